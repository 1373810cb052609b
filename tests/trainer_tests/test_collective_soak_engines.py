"""Issue 41 on the farm's two engines, through the real publisher: the collective transport never
fails a publication a healthy engine can take.

- Back to back: publications of adapters of several sizes, each committed and its predecessor
  reclaimed, with no failure and one group per engine for the whole run (the connect is paid
  once, not per publication).
- A starved receiver: the engine's receiver process SIGSTOPped while its receives are posted,
  for longer than the cleanup's stall bound (``SETTLE_STALL_S``), then SIGCONTed: the
  publication waits and commits; the group is kept.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
import pytest
from _e2e_helpers import Deployment, Interceptor

from lora_versions_dev.fixtures import MAX_LORA_RANK, write_adapter
from relax_glue.publisher import PublishOutcome
from relax_glue.snapshot import Snapshot
from sglang_ext.collective_link import SETTLE_STALL_S

pytestmark = pytest.mark.engine

ROUNDS = 20
# (rank, bucket cap): adapters of several sizes (rank 1 to the engines' --max-lora-rank 8), in
# one bucket or in many
SHAPES = ((1, 1 << 20), (8, 16 << 10), (2, 8 << 10), (8, 1 << 20), (4, 4 << 10))
STARVED_S = 2 * SETTLE_STALL_S + 1.0  # well past the old bound, well inside the 30 s deadline


def receiver_pids(engine_pid: int) -> list[int]:
    """The engine's collective receiver processes (children of its main process)."""
    return [
        child.pid
        for child in psutil.Process(engine_pid).children()
        if "sglang_ext.collective_receiver" in " ".join(child.cmdline())
    ]


@pytest.fixture(scope="module")
def sized_snaps(fixtures, tmp_path_factory) -> dict[str, Snapshot]:
    """Snapshots by name: one per shape of :data:`SHAPES`."""
    config = json.loads((fixtures.model_dir / "config.json").read_text())
    out: dict[str, Snapshot] = {}
    for i, (rank, cap) in enumerate(SHAPES):
        assert rank <= MAX_LORA_RANK
        path = tmp_path_factory.mktemp(f"r{rank}")
        write_adapter(path, config, seed=100 + i, rank=rank)
        out[f"r{rank}c{cap}"] = Snapshot.from_peft_dir(path, max_bucket_bytes=cap)
    assert len({len(s.bucket_plan) for s in out.values()}) > 2  # one bucket to many
    return out


def senders(w: Deployment) -> dict:
    return {e: c.transport.sender for e, c in w.clients.items()}


async def publish_and_reclaim(w: Deployment, snaps: dict, adapter: str, vid: str) -> None:
    res = await w.publish(snaps, adapter, vid)
    assert res.outcome is PublishOutcome.PUBLISHED, (vid, res)
    previous = res.commit.previous_default if res.commit is not None else None
    if previous is not None:  # no session holds it: reclaimed now, so capacity never fills
        done = await w.pub.reclaim_ready()
        assert [r.version_key for r in done if r.done] == [previous], done


async def test_back_to_back_collective_publications_never_fail_and_connect_once(
    engines, stock_engine, fixtures, sized_snaps
) -> None:
    names = sorted(sized_snaps)
    async with Deployment(engines, stock_engine, fixtures, transport="collective") as w:
        for i in range(ROUNDS):
            await publish_and_reclaim(w, sized_snaps, names[i % len(names)], f"b2b{i}")
        assert {e: s.connects for e, s in senders(w).items()} == {"E0": 1, "E1": 1}


async def test_a_receiver_starved_of_cpu_delays_the_publication_and_never_fails_it(
    engines, stock_engine, fixtures, snaps, sized_snaps
) -> None:
    e0 = engines[0]
    async with Deployment(engines, stock_engine, fixtures, transport="collective") as w:
        await publish_and_reclaim(w, snaps, "A", "warm")  # the groups are connected
        [receiver] = receiver_pids(e0.proc.pid)
        stopped: list[float] = []

        async def starve_after_begin(_n: int, call, *args):
            reply = await call(*args)  # PREPARED: E0's receives are posted
            os.kill(receiver, signal.SIGSTOP)
            stopped.append(asyncio.get_running_loop().time())
            asyncio.get_running_loop().call_later(STARVED_S, os.kill, receiver, signal.SIGCONT)
            return reply

        w.wrap("E0", Interceptor(w.clients["E0"]).on("begin", starve_after_begin))
        t0 = asyncio.get_running_loop().time()
        try:
            await publish_and_reclaim(w, sized_snaps, f"r8c{16 << 10}", "starved")
        finally:
            os.kill(receiver, signal.SIGCONT)  # whatever happened, the process runs again
        assert stopped and asyncio.get_running_loop().time() - t0 >= STARVED_S  # it did wait
        # the same receiver, the same group: nothing was declared broken
        assert receiver_pids(e0.proc.pid) == [receiver]
        w.unwrap()
        await publish_and_reclaim(w, snaps, "B", "after")
        assert {e: s.connects for e, s in senders(w).items()} == {"E0": 1, "E1": 1}
