"""Issue 10 on real engines and the Ray actor: a rollout worker holding open sessions bound to A
is SIGKILLed; after its lease TTL the actor's reaper closes its sessions (refs released), A is
reclaimed (one unload per engine) and the next publication succeeds. A live session with a slow
tool turn (idle longer than the TTL) is kept by its heartbeat and continues on A.
Without leases (before this change) the dead worker's refs held A, and its slot, forever."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _e2e_helpers import PROMPTS, TOOL_IDS, aclose_all, greedy, make_clients, new_epoch, purge, snapshot_of
from _optional import optional_module

from lora_contract import protocol
from lora_versions_dev.farm import ADMIN_KEY
from relax_glue.actor import AsyncRegistryClient, new_publisher_token, start_registry_actor
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import SessionState, VersionKey, VersionState
from relax_glue.sessions import SessionManager

pytestmark = pytest.mark.engine

TTL_S = 3.0
REAPER_S = 0.5
WORKER = Path(__file__).with_name("_lease_worker.py")


@pytest.fixture(scope="module")
def ray_local():
    ray = optional_module("ray", "ray", "ray")
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        if owned:
            ray.shutdown()


def _start_worker(ray_local, epoch: str, engines, mode: str) -> subprocess.Popen:
    urls = {n: e.url for n, e in zip(("E0", "E1"), engines, strict=True)}
    gcs = ray_local.get_runtime_context().gcs_address
    return subprocess.Popen(
        [sys.executable, str(WORKER), gcs, epoch, json.dumps(urls), str(TTL_S), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


async def test_a_worker_killed_right_after_its_first_bind_is_released_after_the_ttl(
    engines, fixtures, ray_local, tmp_path
) -> None:
    """The worker dies the moment ``bind_first`` returns (its registry client is the real one,
    wrapped to SIGKILL the process then), before any heartbeat. Its session hangs on the worker
    lease it was opened on: the bind must have kept it, so the reaper releases the ref after the
    TTL and the retired version is reclaimed. (Before issue 10's fix the bind dropped the lease:
    the ref, the retired version and its slot stayed forever.)"""
    epoch = new_epoch()
    token = new_publisher_token()
    actor = start_registry_actor(
        epoch, ("E0", "E1"), db_path=tmp_path / "registry.db", lease_reaper_s=REAPER_S, publisher_token=token
    )
    client = AsyncRegistryClient.for_actor(actor, publisher_token=token)
    clients = make_clients(engines, ADMIN_KEY, ("E0", "E1"))
    pub = open_publisher(client, clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
    snaps = {n: snapshot_of(fixtures.adapter_dir(n)) for n in "AB"}
    worker = None
    try:
        assert (await pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        worker = _start_worker(ray_local, epoch, engines, "die-after-bind")
        line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 180)
        assert line.strip() == "BOUND", line
        assert await asyncio.to_thread(worker.wait, 30) == -signal.SIGKILL
        t_dead = time.monotonic()
        (dead,) = [v for v in await client.sessions() if v.binding is not None]
        assert dead.state is SessionState.OPEN and dead.lease_id is not None, dead
        assert (await pub.publish(snaps["B"], "B")).outcome is PublishOutcome.PUBLISHED

        async def refs_of_a() -> int:
            return (await client.version(version_key=VersionKey(epoch, "A"))).session_refs

        assert await refs_of_a() == 1
        while await refs_of_a() != 0:
            assert time.monotonic() - t_dead < TTL_S + 20, "the bind dropped the lease: never reaped"
            await asyncio.sleep(0.1)
        view = await client.session(session_key=dead.session_key)
        assert view.state is SessionState.CLOSED and view.expired and view.released, view
        (res,) = [r for r in await pub.reclaim_ready() if r.version_key.version_id == "A"]
        assert res.done and res.registry_state is VersionState.RECLAIMED, res
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        left = await purge(clients, f"@{epoch}-")
        await aclose_all(clients.values())
        with contextlib.suppress(Exception):
            ray_local.kill(actor)
        assert not any(left.values()), left


async def test_a_sigkilled_worker_releases_its_refs_after_the_ttl_and_capacity_recovers(
    engines, fixtures, ray_local, tmp_path
) -> None:
    epoch = new_epoch()
    token = new_publisher_token()
    actor = start_registry_actor(
        epoch, ("E0", "E1"), db_path=tmp_path / "registry.db", lease_reaper_s=REAPER_S, publisher_token=token
    )
    client = AsyncRegistryClient.for_actor(actor, publisher_token=token)
    clients = make_clients(engines, ADMIN_KEY, ("E0", "E1"))
    pub = open_publisher(client, clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05)
    snaps = {n: snapshot_of(fixtures.adapter_dir(n)) for n in "ABC"}
    mgr = SessionManager(client, clients, lease_ttl_s=TTL_S, heartbeat_s=TTL_S / 3)
    worker = None
    try:
        assert (await pub.publish(snaps["A"], "A")).outcome is PublishOutcome.PUBLISHED
        worker = _start_worker(ray_local, epoch, engines, "idle")
        line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 180)
        assert line.startswith("BOUND "), line
        name_a = line.split()[1]

        live = await mgr.open("live")
        prefix = list(PROMPTS[0])
        out = await live.generate({"input_ids": prefix, "sampling_params": greedy(4)})
        assert live.lora_path == name_a
        assert (await pub.publish(snaps["B"], "B")).outcome is PublishOutcome.PUBLISHED
        assert (await client.version(version_key=VersionKey(epoch, "A"))).session_refs == 3

        os.killpg(worker.pid, signal.SIGKILL)  # the worker dies without closing anything
        worker.wait(30)
        t_kill = time.monotonic()
        slow_tool = asyncio.ensure_future(asyncio.sleep(2.5 * TTL_S))  # the live session idles

        async def refs_of_a() -> int:
            return (await client.version(version_key=VersionKey(epoch, "A"))).session_refs

        while await refs_of_a() != 1:
            assert time.monotonic() - t_kill < TTL_S + 20, "the dead worker's sessions were never reaped"
            await asyncio.sleep(0.1)
        released_s = time.monotonic() - t_kill
        assert released_s >= TTL_S - 1.0 - REAPER_S  # not before the lease could have run out
        st = await client.status()
        assert st.sessions["CLOSED"] >= 2

        await slow_tool
        # The live session outlived 2.5 TTLs of idling: its heartbeat kept it; same exact version.
        turn2 = await live.generate(
            {"input_ids": [*prefix, *out["output_ids"], *TOOL_IDS], "sampling_params": greedy(4)}
        )
        assert live.lora_path == name_a and turn2["meta_info"]["finish_reason"]["type"] == "length"
        await live.close()

        (res,) = [r for r in await pub.reclaim_ready() if r.version_key.version_id == "A"]
        assert res.done and res.registry_state is VersionState.RECLAIMED, res
        reclaimed_s = time.monotonic() - t_kill
        for c in clients.values():
            states = {v.lora_name: v.state for v in (await c.status()).versions}
            assert states[name_a] is protocol.EngineVersionState.UNLOADED
        assert (await pub.publish(snaps["C"], "C")).outcome is PublishOutcome.PUBLISHED
        print(
            f"\n[lease] TTL {TTL_S:.1f}s, reaper every {REAPER_S}s: refs released {released_s:.1f}s "
            f"after the SIGKILL, A reclaimed {reclaimed_s:.1f}s after it "
            f"(after the live session's {2.5 * TTL_S:.1f}s slow tool turn and its close)"
        )
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        await mgr.close_all()
        await mgr.aclose()
        left = await purge(clients, f"@{epoch}-")
        await aclose_all(clients.values())
        with contextlib.suppress(Exception):
            ray_local.kill(actor)
        assert not any(left.values()), left
