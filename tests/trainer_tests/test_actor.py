"""The registry as a named single-writer Ray actor, against a real local Ray (num_cpus=1).

Skipped only when Ray is not installed (the optional ``ray`` extra; CI installs it); installed but
broken is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _optional import optional_module

ray = optional_module("ray", "ray", "ray")

from _local_ray import local_ray  # noqa: E402
from _rg_helpers import ENGINES, EPOCH, Publisher, async_scenario, refused, sk, vk  # noqa: E402

from lora_contract.errors import ErrorCode, LoraVersionError  # noqa: E402
from relax_glue.actor import (  # noqa: E402
    AsyncRegistryClient,
    RegistryClient,
    actor_name,
    get_registry_actor,
    new_publisher_token,
    publisher_fingerprint,
    start_registry_actor,
)
from relax_glue.registry import LoRAVersionRegistry  # noqa: E402
from relax_glue.registry_types import VersionState  # noqa: E402
from relax_glue.store import DurableRegistry, StoreError, StoreLockedError  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with local_ray(ray):
        yield


def _kill(handle: Any) -> None:
    ray.kill(handle, no_restart=True)


def test_named_in_memory_actor_serves_the_registry_api_sync_and_async(ray_cluster: None) -> None:
    """One actor (worker processes are slow to start on a loaded box): typed errors, one named
    actor per epoch, config mismatch refused, the async client, the sync client."""
    token = new_publisher_token()
    handle = start_registry_actor(EPOCH, ENGINES, publisher_token=token)
    local = AsyncRegistryClient.in_process(LoRAVersionRegistry(EPOCH, ENGINES))
    try:
        client = RegistryClient.for_actor(handle, publisher_token=token)
        assert (client.epoch, client.engines, client.capacity) == (EPOCH, ENGINES, 2)
        err = refused(ErrorCode.NO_PUBLISHED_VERSION, client.bind_first, sk("early"))
        assert isinstance(err, LoraVersionError) and err.http_status == 409
        refused(ErrorCode.INVALID_REQUEST, client._call, "check_invariants")  # not remotely callable

        # one actor per epoch: asking again (any process) gets the same one; another config is refused
        assert start_registry_actor(EPOCH, ENGINES)._actor_id == handle._actor_id
        assert get_registry_actor(EPOCH)._actor_id == handle._actor_id
        assert actor_name(EPOCH) == f"lora_version_registry@{EPOCH}"
        with pytest.raises(StoreError, match="already serves"):
            start_registry_actor(EPOCH, ENGINES, capacity=3)
        # the running actor keeps its publisher: another trainer's token is refused at start
        assert start_registry_actor(EPOCH, ENGINES, publisher_token=token)._actor_id == handle._actor_id
        with pytest.raises(StoreError, match="another publisher"):
            start_registry_actor(EPOCH, ENGINES, publisher_token=new_publisher_token())
        desc = ray.get(handle.describe.remote())
        assert desc["publisher"] == publisher_fingerprint(token) and token not in repr(desc)

        # the async client through the actor answers exactly like the in-process one
        remote_dump = asyncio.run(
            async_scenario(AsyncRegistryClient.for_actor(handle, publisher_token=token))
        )
        local_dump = asyncio.run(async_scenario(local))
        assert remote_dump == local_dump
        assert client.version(vk("A")).state is VersionState.RECLAIMED

        # and the sync client goes on with the same state: B is the default, C fills capacity
        pub = Publisher.__new__(Publisher)
        pub.reg, pub.incarnation, pub.results = client, {e: f"{e}-i1" for e in ENGINES}, {}
        pub.auth = {"publisher_token": None}  # the client carries the token
        binding = client.bind_first(sk("s2"))
        assert binding.version_key == vk("B") and client.binding_of(sk("s2")) == binding
        pub.publish("C")
        err = refused(ErrorCode.VERSION_IN_USE, client.claim_reclaim, vk("B"))
        assert err.details == {"state": "RETIRED", "session_refs": 1}
        refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "D")
        assert client.status().default == vk("C")
    finally:
        local.close()
        _kill(handle)


def test_durable_actor_restarts_after_its_process_dies_with_every_transition(
    ray_cluster: None, tmp_path: Path
) -> None:
    db = tmp_path / "registry.db"
    token = new_publisher_token()
    handle = start_registry_actor(EPOCH, ENGINES, db_path=db, name="durable-test", publisher_token=token)
    try:
        client = RegistryClient.for_actor(handle, publisher_token=token)
        pub = Publisher(client)
        receipt = pub.publish("A")
        binding = client.bind_first(sk("s"))
        before, pid = client.dump(), ray.get(handle.describe.remote())["pid"]

        ray.kill(handle, no_restart=False)  # the process dies; Ray restarts the actor
        _restarted(handle, pid, timeout_s=60)  # ray.kill is asynchronous: an answer from a new process
        assert client.dump() == before
        # retries of calls whose replies were lost in the crash get the original answers
        assert pub.commit("A", 0) == receipt
        assert client.bind_first(sk("s")) == binding
        # the restarted actor kept its publisher: a worker's client (by name) gets no replay
        worker = RegistryClient.for_actor(get_registry_actor(EPOCH, name="durable-test"))
        refused(ErrorCode.NOT_PUBLISHER, worker.commit, vk("A"), receipt.attempt_token, 0)

        # a second writer on the same database (here: this driver process) is refused
        with pytest.raises(StoreLockedError, match="another registry writer"):
            DurableRegistry.open(db, EPOCH, ENGINES, 2)
    finally:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.close.remote(), timeout=10)
        _kill(handle)


def _restarted(handle: Any, pid: int, timeout_s: float = 90.0) -> dict:
    """The description of the actor's next process (Ray restarts it after a SIGKILL)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the actor did not come back"
        try:
            desc = ray.get(handle.describe.remote(), timeout=5)
            if desc["pid"] != pid:
                return desc
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.ActorUnavailableError,
            ray.exceptions.GetTimeoutError,
        ):
            pass
        time.sleep(0.2)


def test_a_sigkilled_durable_actor_comes_back_on_its_node_with_its_state(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Placement that cannot fork (issue 26): the durable actor is pinned to the node holding its
    database (here the driver's), and after a SIGKILL of its process Ray restarts it there, with
    every transition."""
    db = tmp_path / "registry.db"
    token = new_publisher_token()
    handle = start_registry_actor(EPOCH, ENGINES, db_path=db, name="pinned-test", publisher_token=token)
    try:
        client = RegistryClient.for_actor(handle, publisher_token=token)
        Publisher(client).publish("A")
        before = client.dump()
        first = ray.get(handle.describe.remote())
        assert first["node_id"] == ray.get_runtime_context().get_node_id()
        os.kill(first["pid"], signal.SIGKILL)
        again = _restarted(handle, first["pid"])
        assert again["node_id"] == first["node_id"] and again["db_path"] == str(db)
        assert client.dump() == before
    finally:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.close.remote(), timeout=10)
        _kill(handle)


def test_a_restarted_actor_that_finds_no_database_refuses_and_never_starts_empty(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The same restart with the database gone (a wrong path, another node's disk): the actor
    refuses every call with REGISTRY_STATE_LOST naming the path, and creates nothing there."""
    db = tmp_path / "registry.db"
    token = new_publisher_token()
    handle = start_registry_actor(EPOCH, ENGINES, db_path=db, name="lost-db-test", publisher_token=token)
    try:
        client = RegistryClient.for_actor(handle, publisher_token=token)
        Publisher(client).publish("A")
        pid = ray.get(handle.describe.remote())["pid"]
        for f in tmp_path.glob("registry.db*"):
            f.unlink()
        os.kill(pid, signal.SIGKILL)
        desc = _restarted(handle, pid)
        assert "refused" in desc and "epoch" not in desc
        err = refused(ErrorCode.REGISTRY_STATE_LOST, client.status)
        assert str(db) in err.message and err.details["db_path"] == str(db)
        refused(ErrorCode.REGISTRY_STATE_LOST, client.bind_first, sk("late"))
        with pytest.raises(LoraVersionError) as raised:  # a client connecting now is told too
            _ = RegistryClient.for_actor(handle).epoch
        assert raised.value.code is ErrorCode.REGISTRY_STATE_LOST
        assert not db.exists()  # nothing was created in its place
    finally:
        _kill(handle)


def test_concurrent_calls_through_the_durable_actor_share_round_trips_and_commits(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Issue 26: 64 sessions' calls from one batching client travel in few actor calls and are
    committed in groups (far fewer transactions than journaled calls); each op keeps its own
    answer, a refusal in the middle of a batch refuses only that op, and a keep-alive commits
    nothing. The state is then exactly what the same calls make one by one."""
    token = new_publisher_token()
    db = tmp_path / "registry.db"
    handle = start_registry_actor(EPOCH, ENGINES, db_path=db, name="group-test", publisher_token=token)
    try:
        Publisher(RegistryClient.for_actor(handle, publisher_token=token)).publish("A")
        commits0 = ray.get(handle.describe.remote())["commits"]

        async def run() -> tuple[list[Any], int]:
            client = await AsyncRegistryClient.for_actor(handle, retries=0).connect()
            await client.grant_lease(lease_id="w", ttl_s=30.0)
            keys = [sk(f"s{i}") for i in range(64)]
            await asyncio.gather(*(client.open_session(session_key=k, lease_id="w") for k in keys))
            outs = await asyncio.gather(
                *(client.bind_first(session_key=k) for k in keys),
                client.keep_alive(lease_id="nobody"),  # refused, alone
                client.keep_alive(lease_id="w"),
                return_exceptions=True,
            )
            await asyncio.gather(*(client.close_and_release(session_key=k) for k in keys[:32]))
            return outs, client._acall.__self__.sends

        outs, sends = asyncio.run(run())
        assert [o.version_key for o in outs[:64]] == [vk("A")] * 64
        assert isinstance(outs[64], LoraVersionError) and outs[64].code is ErrorCode.INVALID_REQUEST
        assert outs[65].live
        commits = ray.get(handle.describe.remote())["commits"] - commits0
        journaled = 1 + 64 + 64 + 32  # grant, opens, binds, closes (the keep-alives write nothing)
        assert sends < 20 and commits < journaled / 4, (sends, commits)
        client = RegistryClient.for_actor(handle)
        assert client.version(vk("A")).session_refs == 32
        client_view = LoRAVersionRegistry.load(client.dump())
        client_view.check_invariants(full=True)
    finally:
        _kill(handle)
