"""Issue 42 on a real multi-node Ray cluster: four raylets on this host (the trainer's head node,
the registry's node, two rollout nodes: lora_versions_dev.ray_cluster), laid out by
relax_glue.placement, the farm's real engines reached over HTTP. Each fault is injected into
the real component (a node's processes killed, a worker's real registry client cut) and each
test ends with the invariants: no leaked ref, nothing unloaded while held, capacity recovered.

* the layout: the registry actor on its database's node, one rollout worker per rollout node,
  every process given the cluster's address and token (nothing read from a home directory);
* a rollout node lost mid-episode: its worker's lease runs out, the registry closes its
  sessions, the retired version is reclaimed once the other node's episode ends;
* the registry's node lost mid-publication: callers get REGISTRY_UNAVAILABLE, the publication
  does not commit, the worker fences itself past its TTL; the node back with its database, the
  actor starts there from the journal, the worker's session is still valid and the publication
  is resolved from the journal;
* a worker cut off from the registry (its calls hang, its node alive): it fences itself; when
  the link returns its session is closed (the registry ended the lease), never half.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import _cluster_episodes as episodes
import pytest
from _e2e_helpers import (
    PROMPTS,
    TOOL_IDS,
    Gate,
    Interceptor,
    aclose_all,
    engine_state,
    make_clients,
    new_epoch,
    purge,
    reach,
)
from _optional import optional_module

from lora_contract import protocol
from lora_contract.errors import ErrorCode
from lora_versions_dev.farm import ADMIN_KEY
from lora_versions_dev.ray_cluster import LocalRayCluster
from relax_glue.actor import RegistryUnavailable, actor_name, new_publisher_token
from relax_glue.cohort import open_publisher
from relax_glue.placement import (
    REGISTRY_RESOURCE,
    ROLLOUT_RESOURCE,
    current_layout,
    start_registry,
    start_rollout_workers,
)
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import VersionKey, VersionState

# a Ray cluster of three nodes and its workers
pytestmark = [pytest.mark.engine, pytest.mark.room(gib=3.5)]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TTL_S = 3.0
REAPER_S = 0.5
COHORT = ("E0", "E1")


@pytest.fixture(scope="module")
def cluster():
    optional_module("ray", "ray", "ray")
    roles = (REGISTRY_RESOURCE, ROLLOUT_RESOURCE, ROLLOUT_RESOURCE)
    with LocalRayCluster(roles, python_path=(ROOT, HERE)) as c:
        yield c


class Run:
    """One epoch laid out on the cluster: the registry on its node, a worker per rollout node,
    the trainer's publisher here (the head node)."""

    def __init__(self, engines, db_path: Path, **worker_options) -> None:
        self.epoch = new_epoch()
        self.token = new_publisher_token()
        self.db_path = db_path
        self.layout = current_layout()
        self.client = self.start_registry()
        self.clients = make_clients(engines, ADMIN_KEY, COHORT)
        self.pub = open_publisher(self.client, self.clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
        urls = {n: e.url for n, e in zip(COHORT, engines, strict=True)}
        self.workers = start_rollout_workers(
            self.layout, self.epoch, urls, lease_ttl_s=TTL_S, heartbeat_s=TTL_S / 3, **worker_options
        )

    def start_registry(self):
        return start_registry(
            current_layout(), self.epoch, COHORT, db_path=self.db_path, publisher_token=self.token,
            lease_reaper_s=REAPER_S,
        )

    async def refs(self, vid: str) -> int:
        return (await self.client.version(version_key=VersionKey(self.epoch, vid))).session_refs

    async def engine_states(self, lora_name: str) -> dict[str, protocol.EngineVersionState | None]:
        return {n: await engine_state(c, lora_name) for n, c in self.clients.items()}

    async def reclaimed(self, vid: str) -> bool:
        results = [r for r in await self.pub.reclaim_ready() if r.version_key.version_id == vid]
        return bool(results) and results[0].done and results[0].registry_state is VersionState.RECLAIMED

    async def finish(self) -> None:
        """Every worker shut down, the engines left without this epoch's versions, the actor
        stopped; asserts nothing of the epoch is left on an engine."""
        import ray

        for w in self.workers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.shutdown.remote(), 30)
            with contextlib.suppress(Exception):
                ray.kill(w)
        left = await purge(self.clients, f"@{self.epoch}-")
        await aclose_all(self.clients.values())
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(actor_name(self.epoch), namespace="relax_lora_versions"))
        assert not any(left.values()), left


async def within(awaitable, what: str, timeout_s: float = 60.0):
    """``awaitable``'s result; a step that hangs fails the test naming itself."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: no answer within {timeout_s}s") from None


async def eventually(pred, timeout_s: float, what: str) -> float:
    """Seconds until ``pred()`` (awaited) holds; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_a_run_is_laid_out_over_the_nodes_with_the_token_it_was_given(
    cluster, engines, snaps, tmp_path
):
    import ray

    run = Run(engines, tmp_path / "registry.db")
    try:
        layout = run.layout
        assert len({layout.registry_node, *layout.rollout_nodes}) == 3
        assert ray.get_runtime_context().get_node_id() not in {layout.registry_node, *layout.rollout_nodes}
        actor = ray.get_actor(actor_name(run.epoch), namespace="relax_lora_versions")
        assert (await actor.describe.remote())["node_id"] == layout.registry_node
        assert [await w.node_id.remote() for w in run.workers] == list(layout.rollout_nodes)

        assert (await run.pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        bound = [await w.run.remote(episodes.first_turns, ["s"], PROMPTS[0], 4) for w in run.workers]
        names = {b["lora_path"] for (b,) in bound}
        assert len(names) == 1 and "@" in names.pop()
        assert await run.refs("A") == 2

        # every process reached Ray with the token it was handed, not a home directory's file
        env = await run.workers[0].run.remote(episodes.environment)
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == cluster.token
        assert env["HOME"] == str(cluster.home) and not (cluster.home / ".ray").exists()
        wrong = subprocess.run(
            [sys.executable, "-c", f"import ray; ray.init(address={cluster.address!r})"],
            env={
                **os.environ,
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": "0" * 64,
                # one connect attempt (Ray retries for 20 s by default: a GCS may still be starting)
                "RAY_gcs_server_port_wait_time_s": "1",
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert wrong.returncode != 0 and "AuthenticationError" in wrong.stderr, wrong.stderr[-2000:]

        for w, ((b,)) in zip(run.workers, bound, strict=True):
            assert (await w.run.remote(episodes.close, b["nonce"]))["released"]
        assert await run.refs("A") == 0
    finally:
        await run.finish()


async def test_a_rollout_node_lost_mid_episode_releases_its_sessions_after_the_ttl(
    cluster, engines, snaps, tmp_path
):
    run = Run(engines, tmp_path / "registry.db")
    lost, kept = run.workers
    try:
        assert (await run.pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        lost_bound = await lost.run.remote(episodes.first_turns, ["l0", "l1"], PROMPTS[0], 4)
        (kept_bound,) = await kept.run.remote(episodes.first_turns, ["k0"], PROMPTS[1], 4)
        name_a = kept_bound["lora_path"]
        assert {b["lora_path"] for b in lost_bound} == {name_a}
        assert (await run.pub.publish(snaps["B"], "B")).outcome is PublishOutcome.PUBLISHED
        assert await run.refs("A") == 3

        cluster.remove(run.layout.rollout_nodes[0])  # the lost node's worker dies mid-episode
        released_s = await eventually(
            lambda: _equals(run.refs("A"), 1), TTL_S + 30, "the lost sessions reaped"
        )
        assert released_s >= TTL_S - 1.0 - REAPER_S  # not before the lease could have run out

        # the other node's episode still holds A: no reclaim, A loaded on every engine
        assert not await run.reclaimed("A")
        assert set((await run.engine_states(name_a)).values()) == {protocol.EngineVersionState.READY_LOCAL}
        prefix = [*PROMPTS[1], *kept_bound["output_ids"], *TOOL_IDS]
        turn = await kept.run.remote(episodes.next_turn, kept_bound["nonce"], prefix, 4)
        assert turn.get("lora_path") == name_a, turn
        assert (await kept.run.remote(episodes.close, kept_bound["nonce"]))["released"]

        assert await run.refs("A") == 0 and await run.reclaimed("A")
        assert set((await run.engine_states(name_a)).values()) == {protocol.EngineVersionState.UNLOADED}
        assert (await run.pub.publish(snaps["C"], "C")).outcome is PublishOutcome.PUBLISHED  # capacity back
        assert (await run.client.status()).sessions["OPEN"] == 0
        assert (await kept.counters.remote())["served_mismatches"] == 0
    finally:
        cluster.add(ROLLOUT_RESOURCE)  # a rollout node again, for the next test
        await run.finish()


async def _equals(value, expected) -> bool:
    return (await value) == expected


async def test_the_registry_node_lost_mid_publication_then_back_continues_from_the_journal(
    cluster, engines, snaps, tmp_path
):
    run = Run(engines, tmp_path / "registry.db")
    worker = run.workers[0]
    gate = Gate()
    run.clients["E1"] = held = Interceptor(run.clients["E1"])  # gated once A is out
    run.pub = open_publisher(run.client, run.clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
    try:
        assert (await run.pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        (bound,) = await worker.run.remote(episodes.first_turns, ["s"], PROMPTS[0], 4)
        name_a = bound["lora_path"]
        held.on("end", gate)
        publishing = asyncio.ensure_future(run.pub.publish(snaps["B"], "B"))
        await reach(gate, publishing)  # B staged on both engines, E1's end held

        cluster.remove(run.layout.registry_node)
        t_lost = time.monotonic()

        async def unreachable() -> bool:
            try:
                await run.client.status()
            except RegistryUnavailable as err:
                return err.code is ErrorCode.REGISTRY_UNAVAILABLE
            return False

        await eventually(unreachable, 30, "the registry unreachable")
        gate.open()
        with pytest.raises(RegistryUnavailable) as lost:  # E1 READY, but nothing can record or commit B
            await within(publishing, "the publication cut off from its registry")
        assert lost.value.code is ErrorCode.REGISTRY_UNAVAILABLE

        # a new session cannot bind; the bound one runs on A while its lease is fresh, then the
        # worker fences itself (nothing sent) once the lease cannot be renewed within the TTL
        refused = await within(worker.run.remote(episodes.open_and_bind, "new", PROMPTS[2], 2), "bind")
        assert refused["error"] == ErrorCode.REGISTRY_UNAVAILABLE.value, refused
        # (a keep-alive may still have been answered just after the node went: 1.5 s of slack)
        await asyncio.sleep(max(0.0, t_lost + TTL_S + 1.5 - time.monotonic()))
        prefix = [*PROMPTS[0], *bound["output_ids"], *TOOL_IDS]
        fenced = await within(worker.run.remote(episodes.next_turn, bound["nonce"], prefix, 4), "fenced turn")
        assert fenced == {"error": ErrorCode.WORKER_FENCED.value, "phase": "OPEN", "in_flight": 0}, fenced
        assert (await worker.counters.remote())["fenced_turns"] >= 1

        # the node and its database are back: the actor starts there from the journal
        cluster.add(REGISTRY_RESOURCE)
        restarted = run.start_registry()
        status = await within(restarted.status(), "the restarted registry's status")
        assert status.default is not None and status.default.version_id == "A"  # B never committed
        assert status.pending_attempt is not None
        assert await run.refs("A") == 1  # the bound session's ref survived the loss

        # the worker finds the new actor by name: its lease is renewed, the session still valid
        turn = await within(worker.run.remote(episodes.next_turn, bound["nonce"], prefix, 4), "turn after")
        assert turn.get("lora_path") == name_a, turn
        resolved = await within(run.pub.resolve(snaps["B"]), "resolve")
        assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED, resolved
        late = await worker.run.remote(episodes.open_and_bind, "late", PROMPTS[2], 2)
        assert late.get("lora_path") == resolved.lora_name, late

        for nonce in (bound["nonce"], late["nonce"]):
            assert (await worker.run.remote(episodes.close, nonce))["released"]
        assert await run.reclaimed("A")
        assert set((await run.engine_states(name_a)).values()) == {protocol.EngineVersionState.UNLOADED}
        assert (await run.pub.publish(snaps["C"], "C")).outcome is PublishOutcome.PUBLISHED
        assert (await run.client.status()).sessions["OPEN"] == 0
    finally:
        gate.open()
        await run.finish()


async def test_a_worker_cut_off_from_the_registry_fences_itself_and_never_comes_back_half(
    cluster, engines, snaps, tmp_path
):
    flag = tmp_path / "cut"
    run = Run(engines, tmp_path / "registry.db", wrap_registry=episodes.cut_off_while(str(flag)))
    worker = run.workers[0]
    try:
        assert (await run.pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        (bound,) = await worker.run.remote(episodes.first_turns, ["s"], PROMPTS[0], 4)
        name_a = bound["lora_path"]
        assert (await run.pub.publish(snaps["B"], "B")).outcome is PublishOutcome.PUBLISHED

        flag.touch()  # the worker's link to the registry is cut; its node and the engines are fine
        t_cut = time.monotonic()
        await eventually(lambda: _equals(run.refs("A"), 0), TTL_S + 30, "the cut worker's lease ended")
        assert time.monotonic() - t_cut >= TTL_S - 1.0 - REAPER_S
        prefix = [*PROMPTS[0], *bound["output_ids"], *TOOL_IDS]
        fenced = await worker.run.remote(episodes.next_turn, bound["nonce"], prefix, 4)
        assert fenced == {"error": ErrorCode.WORKER_FENCED.value, "phase": "OPEN", "in_flight": 0}, fenced

        # A may go now: the registry released the ref and the worker sends nothing on it
        assert await run.reclaimed("A")
        assert set((await run.engine_states(name_a)).values()) == {protocol.EngineVersionState.UNLOADED}

        flag.unlink()  # the link returns: the session is closed, never half
        expired = await worker.run.remote(episodes.next_turn, bound["nonce"], prefix, 4)
        assert expired["error"] == ErrorCode.SESSION_EXPIRED.value and expired["phase"] == "EXPIRED", expired
        fresh = await worker.run.remote(episodes.open_and_bind, "after", PROMPTS[1], 2)
        assert "error" not in fresh and fresh["lora_path"] != name_a, fresh
        assert (await worker.run.remote(episodes.close, fresh["nonce"]))["released"]
        assert (await run.pub.publish(snaps["C"], "C")).outcome is PublishOutcome.PUBLISHED
        assert (await run.client.status()).sessions["OPEN"] == 0
        counters = await worker.counters.remote()
        assert counters["fenced_turns"] >= 1 and counters["served_mismatches"] == 0, counters
    finally:
        with contextlib.suppress(FileNotFoundError):
            flag.unlink()
        await run.finish()
