"""Issue 36 on real engines and the Ray actor: a rollout worker's registry client (the epoch's
actor by name, no publisher token) tries to record READY, commit, abort, mark an outcome unknown,
reserve, register an incarnation and claim or confirm a reclaim while a real publication is at
its commit point (every engine READY): each is NOT_PUBLISHER and the registry's state is exactly
what it was. The real publisher then commits, the engines serve the new default, and it reclaims
the retired version once the worker's session closed. The worker keeps its own rights: it binds
and closes sessions."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from _e2e_helpers import aclose_all, engine_state, make_clients, new_epoch, purge, snapshot_of
from test_leases_engines import ray_local  # noqa: F401  (the module's local Ray, reused)

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_versions_dev.farm import ADMIN_KEY
from relax_glue.actor import (
    AsyncRegistryClient,
    get_registry_actor,
    new_publisher_token,
    start_registry_actor,
)
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import ReadyEvidence, SessionKey, UnloadEvidence, VersionKey, VersionState

pytestmark = pytest.mark.engine

COHORT = ("E0", "E1")


async def _refusal(call: Any) -> ErrorCode | None:
    try:
        await call
    except LoraVersionError as exc:
        return exc.code
    return None


async def _stray_worker_tries(
    worker: AsyncRegistryClient, epoch: str, commit: dict[str, Any]
) -> dict[str, Any]:
    """Every publication op a worker could call with what it can see (the status and the
    commit's own arguments), each refused; the state before and after, for comparison."""
    before = await worker.dump()
    status = await worker.status()
    (b,) = [v for v in status.versions if v.state is VersionState.LOADING]
    inc = status.engines["E0"]
    a = VersionKey(epoch, "A")
    calls = {
        "record_ready": worker.record_ready(
            engine_id="E0", receipt=ReadyEvidence(b.version_key, b.digest, b.attempt_token, inc)
        ),
        "commit": worker.commit(**commit),
        "commit (wrong token)": worker.commit(**commit, publisher_token=new_publisher_token()),
        "abort": worker.abort(attempt_token=b.attempt_token, reason="stray worker"),
        "mark_engine_unknown": worker.mark_engine_unknown(
            engine_id="E0", ref=b.attempt_token, op="end", reason="stray worker"
        ),
        "reserve": worker.reserve(
            version_key=VersionKey(epoch, "C"), digest="c" * 64, lora_name=f"c@{epoch}", request_id="stray"
        ),
        "register_engine_incarnation": worker.register_engine_incarnation(
            engine_id="E0", incarnation="stray-1"
        ),
        "declare_engine_lost": worker.declare_engine_lost(engine_id="E1", reason="stray worker"),
        "claim_reclaim": worker.claim_reclaim(version_key=a),
    }
    codes = {op: await _refusal(call) for op, call in calls.items()}
    return {"codes": codes, "same": await worker.dump() == before, "b": b}


async def test_a_rollout_worker_cannot_publish_and_the_publisher_commits_normally(
    engines,
    fixtures,
    ray_local,  # noqa: F811
    tmp_path,
) -> None:
    epoch = new_epoch()
    token = new_publisher_token()
    actor = start_registry_actor(epoch, COHORT, db_path=tmp_path / "registry.db", publisher_token=token)
    registry = AsyncRegistryClient.for_actor(actor, publisher_token=token)
    worker = await AsyncRegistryClient.for_actor(get_registry_actor(epoch)).connect()  # by name
    clients = make_clients(engines, ADMIN_KEY, COHORT)
    pub = open_publisher(registry, clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
    snaps = {n: snapshot_of(fixtures.adapter_dir(n)) for n in "AB"}
    tried: list[dict[str, Any]] = []
    real_commit = registry.commit

    async def commit_after_the_worker_tried(**kwargs: Any) -> Any:
        if not tried:  # B is READY on every engine: the moment a stray commit would count
            tried.append(await _stray_worker_tries(worker, epoch, kwargs))
        return await real_commit(**kwargs)

    try:
        assert (await pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        session = SessionKey(epoch, "worker-1")
        assert (await worker.bind_first(session_key=session)).version_key == VersionKey(epoch, "A")

        registry.commit = commit_after_the_worker_tried  # type: ignore[method-assign]
        res_b = await pub.publish(snaps["B"], "B")
        assert res_b.outcome is PublishOutcome.PUBLISHED, res_b
        (seen,) = tried
        assert seen["codes"] == dict.fromkeys(seen["codes"], ErrorCode.NOT_PUBLISHER), seen["codes"]
        assert seen["same"], "a refused worker call changed the registry"
        b = seen["b"]
        for client in clients.values():
            assert await engine_state(client, b.lora_name) is protocol.EngineVersionState.READY_LOCAL
        status = await worker.status()
        assert status.default == b.version_key and status.default_revision == 2
        assert token not in repr(status) and token not in repr(await worker.dump())

        # A is retired: the worker closes its session (its right), cannot reclaim A (not its right)
        assert (await worker.close_and_release(session_key=session)).released
        a = VersionKey(epoch, "A")
        assert await _refusal(worker.claim_reclaim(version_key=a)) is ErrorCode.NOT_PUBLISHER
        fake = UnloadEvidence("rcl-" + "0" * 24, status.engines["E0"])
        assert await _refusal(worker.confirm_reclaim(version_key=a, engine_id="E0", receipt=fake)) is (
            ErrorCode.NOT_PUBLISHER
        )
        assert (await worker.version(version_key=a)).state is VersionState.RETIRED
        (reclaimed,) = [r for r in await pub.reclaim_ready() if r.version_key == a]
        assert reclaimed.done and reclaimed.registry_state is VersionState.RECLAIMED, reclaimed
    finally:
        left = await purge(clients, f"@{epoch}-")
        await aclose_all(clients.values())
        worker.close()
        registry.close()
        with contextlib.suppress(Exception):
            ray_local.kill(actor)
        assert not any(left.values()), left
