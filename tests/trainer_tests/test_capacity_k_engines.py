"""Capacity K per epoch on real engines (issue 27): K = 4 on one cohort of engines with 5 LoRA
slots (E0 and the session's spare engine E2, the one SIGKILLed here).

K versions live at once, each held by a session on each engine; the K+1th is
CAPACITY_ERROR before any engine sees a begin; an engine that is SIGKILLed and started again gets
all K live versions back (the reconciler stages them from the snapshot store when the first turn
meets the loss) and every session's turn there equals its turn before the restart, token for
token; retired versions are reclaimed exactly when their last session closed, each unloaded once
per engine; the freed slot takes the K+1th version. Same-prompt turns of the K versions differ
pairwise, so "equal to its earlier turn" can only hold on the session's own exact version.

Also: a registry of K = 4 over an engine with fewer slots is refused at the first publication
(CAPACITY_MISMATCH), before anything moves.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from _e2e_helpers import PROMPTS, Deployment, begins_for, engine_versions, greedy, new_epoch, snapshot_of

from lora_contract.errors import ErrorCode
from lora_contract.protocol import EngineVersionState as S
from lora_versions_dev.engine_log import await_unload_lines
from lora_versions_dev.fixtures import write_adapter
from lora_versions_dev.launcher import spawn_engine
from relax_glue.publisher import PublishOutcome
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.snapshot_store import SnapshotStore

pytestmark = pytest.mark.engine

COHORT = ("E0", "E2")
TOKENS = 6


@pytest.fixture(scope="module")
def snaps(snaps, fixtures, tmp_path_factory) -> dict:
    """Five distinct adapters: the fixtures' A, B, C (the shared ``snaps``) and two more from
    other seeds."""
    out = {name: snaps[name] for name in ("A", "B", "C")}
    config = json.loads((fixtures.model_dir / "config.json").read_text())
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("D", 505), ("F", 606)):
        write_adapter(root / name, config, seed=seed, rank=4)
        out[name] = snapshot_of(root / name)
    return out


ORDER = ("A", "B", "C", "D", "F")


async def _turn(s, prompt) -> list[int]:
    out = await s.generate({"input_ids": list(prompt), "sampling_params": greedy(TOKENS)})
    return list(out["output_ids"])


# K = 2 runs the same path in test_publication_lifecycle_engines (the restart after commit restores both live
# versions) and in every publication test; K = 4 is what this module adds.
@pytest.mark.parametrize("k", [4])
async def test_k_live_versions_refuse_the_next_survive_a_restart_and_reclaim_once(
    k, engines, stock_engine, fixtures, snaps, spare_engine, tmp_path
) -> None:
    e2 = await asyncio.to_thread(spare_engine.take)
    store = SnapshotStore(tmp_path / "snapshots")
    epoch = new_epoch()
    registry = LoRAVersionRegistry(epoch, COHORT, capacity=k)
    async with Deployment(
        (engines[0], e2), stock_engine, fixtures, registry=registry, epoch=epoch, cohort=COHORT, store=store
    ) as w:
        restores = w.restore_on_version_missing()
        prompt = PROMPTS[0]
        first: dict[str, list[int]] = {}  # session name -> its first turn
        sessions = []
        for i in range(k):
            vid = ORDER[i]
            assert (await w.publish(snaps, vid)).outcome is PublishOutcome.PUBLISHED
            for engine in COHORT:  # the sticky router alternates: one session per engine
                s = await w.sm.open(f"{vid}_{engine}")
                first[s.name] = await _turn(s, prompt)
                sessions.append(s)
        route = {s.name: w.sm.router.pick(s.route_key) for s in sessions}
        assert route == {f"{v}_{e}": e for v in ORDER[:k] for e in COHORT}, route
        by_version = {s.lora_path: first[s.name] for s in sessions}
        assert len(by_version) == k and len({tuple(t) for t in by_version.values()}) == k, by_version
        assert all(first[s.name] == by_version[s.lora_path] for s in sessions)  # both engines agree

        # --- K live: the next is refused before any engine sees it
        over = await w.publish(snaps, ORDER[k])
        assert over.outcome is PublishOutcome.REFUSED and over.error.code is ErrorCode.CAPACITY_ERROR
        assert not begins_for(w.clients.values(), w.name_of[ORDER[k]])

        # --- E2 is SIGKILLed and started again: holds nothing; the first turn there restores all K
        os.killpg(e2.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(e2.proc.wait, 60)
        e2 = await asyncio.to_thread(spawn_engine, spare_engine.spec(e2.port, f"-k{k}"))
        spare_engine.engine = e2
        await asyncio.to_thread(e2.wait_healthy, 300.0)
        assert not await engine_versions(w.clients["E2"], w.marker)
        for s in sessions:
            assert await _turn(s, prompt) == first[s.name], s.name
        assert restores == ["E2"], restores  # one recovery, by the first turn that met the loss
        on_e2 = await engine_versions(w.clients["E2"], w.marker)
        assert {n: v.state for n, v in on_e2.items()} == {w.name_of[v]: S.READY_LOCAL for v in ORDER[:k]}

        # --- retired versions go exactly when their last session closed, once per engine
        lora_ids = {
            (eid, n): v.lora_id
            for eid in COHORT
            for n, v in (await engine_versions(w.clients[eid], w.marker)).items()
        }
        retired = list(ORDER[: k - 1])  # every version but the default
        for vid in reversed(retired):  # close newest first: reclaim follows the refs, not age
            for s in sessions:
                if s.name.startswith(f"{vid}_"):
                    await s.close()
            done = await w.pub.reclaim_ready()
            assert [r.version_key.version_id for r in done if r.done] == [vid], done
        for vid in retired:
            name = w.name_of[vid]
            for eid, engine in zip(COHORT, (engines[0], e2), strict=True):
                assert (await engine_versions(w.clients[eid], w.marker))[name].state is S.UNLOADED
                assert await await_unload_lines(engine.log_path, lora_ids[(eid, name)], 1) == 1, (eid, vid)

        # --- the freed slots take new versions up to K again
        assert (await w.publish(snaps, ORDER[k])).outcome is PublishOutcome.PUBLISHED


async def test_a_registry_of_k_4_refuses_a_cohort_engine_with_fewer_slots(
    engines, stock_engine, fixtures, snaps
) -> None:
    """E0 and E1 hold 4 managed versions (5 slots): a K of 5 is refused at the first publication,
    naming both engines, with nothing reserved and no begin sent."""
    epoch = new_epoch()
    registry = LoRAVersionRegistry(epoch, ("E0", "E1"), capacity=5)
    async with Deployment(engines, stock_engine, fixtures, registry=registry, epoch=epoch) as w:
        r = await w.publish(snaps, "A")
        assert r.outcome is PublishOutcome.REFUSED and r.error.code is ErrorCode.CAPACITY_MISMATCH
        assert r.error.details["engine_capacity"] == {"E0": 4, "E1": 4}
        assert w.reg.version(w.key("A")) is None and not begins_for(w.clients.values(), w.name_of["A"])
