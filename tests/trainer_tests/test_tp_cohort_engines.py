"""The whole lifecycle on a cohort of one TP=2 engine and one TP=1 engine (issue 38), with the
real registry, publisher and session layer: publish A, sessions bind on both engines, publish B
while A's sessions generate, reclaim A; then one rank's scheduler process is SIGKILLed.

Every turn is checked against the stock engine's baseline of its bound version with its full
prefix (exact greedy tokens: the TP=2 engine serves the TP=1 engine's tokens), and every turn on
the TP=2 engine also against the HF + PEFT reference.
"""

from __future__ import annotations

import asyncio
import signal
import time

import psutil
import pytest
from _e2e_helpers import (
    PROMPTS,
    TOOL_IDS,
    Deployment,
    assert_clean_audit,
    engine_versions,
    lora_paths,
    turn,
)

from lora_contract import protocol
from lora_versions_dev.launcher import spawn_engine
from lora_versions_dev.reference import greedy_tokens
from relax_glue.publisher import PublishOutcome

pytestmark = pytest.mark.engine

S = protocol.EngineVersionState
COHORT = ("E0", "TP2")
RANK_1_TITLE = "sglang::scheduler_TP1"  # SGLang 0.5.23's process title of TP rank 1's scheduler


@pytest.fixture(scope="module", autouse=True)
def _tp2_boots_early(request):
    """The session's TP=2 engine (conftest.py), spawned as this module starts so it boots while
    the farm does (when a test here is selected)."""
    request.getfixturevalue("tp2_engine")


async def assert_tp2_turns_equal_the_reference(w: Deployment, fixtures) -> int:
    checked = 0
    for t in w.tx.turns:
        if t.engine != "TP2":
            continue
        adapter = fixtures.adapter_dir(w.adapter_of[t.lora_path])
        ref = await asyncio.to_thread(greedy_tokens, fixtures.model_dir, adapter, t.prefix, t.n)
        assert t.tokens == ref, (t.session, t.kind, t.tokens, ref)
        checked += 1
    return checked


async def test_a_tp2_and_a_tp1_engine_publish_serve_and_reclaim_together(
    engines, stock_engine, fixtures, snaps, tp2_engine
) -> None:
    tp2 = await asyncio.to_thread(tp2_engine.take)
    async with Deployment((engines[0], tp2), stock_engine, fixtures, cohort=COHORT) as w:
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        s_a = [await w.sm.open(f"SA{i}") for i in range(2)]  # round robin: one per engine
        out_a = [await turn(w.tx, s, PROMPTS[i], 6) for i, s in enumerate(s_a)]
        assert {s.requests[-1].engine_id for s in s_a} == set(COHORT)

        # B is published while every A session generates a tool turn on its engine
        tool_turns = [
            asyncio.create_task(turn(w.tx, s, [*PROMPTS[i], *out_a[i], *TOOL_IDS], 24, kind="tool"))
            for i, s in enumerate(s_a)
        ]
        assert (await w.publish(snaps, "B")).outcome is PublishOutcome.PUBLISHED
        await asyncio.gather(*tool_turns)
        s_b = [await w.sm.open(f"SB{i}") for i in range(2)]
        for i, s in enumerate(s_b):
            await turn(w.tx, s, PROMPTS[i], 6)
        assert {s.requests[-1].engine_id for s in s_b} == set(COHORT)
        assert all(lora_paths(s) == {w.name_of["A"]} for s in s_a)
        assert all(lora_paths(s) == {w.name_of["B"]} for s in s_b)
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, w.tx.table(w.adapter_of)
        assert await assert_tp2_turns_equal_the_reference(w, fixtures) == 3

        for s in s_a:
            await s.close()
        done = await w.pub.reclaim_ready()
        assert [r.version_key.version_id for r in done if r.done] == ["A"], done
        for client in w.clients.values():
            versions = await engine_versions(client, w.marker)
            assert versions[w.name_of["A"]].state is S.UNLOADED
            assert versions[w.name_of["B"]].in_flight == 0, "the native count of B is back at 0"
        assert_clean_audit(w.clients.values())


def rank_1_scheduler(engine) -> psutil.Process:
    (proc,) = [
        p
        for p in psutil.Process(engine.proc.pid).children(recursive=True)
        if RANK_1_TITLE in " ".join(p.cmdline())
    ]
    return proc


async def test_a_killed_rank_takes_the_tp_engine_down_and_the_reconciler_restores_its_versions(
    engines, stock_engine, fixtures, snaps, tp2_engine, tmp_path
) -> None:
    """SGLang 0.5.23's answer to a dead rank: its ``SubprocessWatchdog`` (utils/watchdog.py) polls
    the scheduler processes every second and SIGQUITs the main process, whose handler kills the
    whole process tree: the engine goes down, it does not serve on one rank. Started again on the
    same port, it holds nothing; the first turn of its session is refused before admission
    (never the base model), the reconciler stages the session's version back onto it, and the
    turn is sent again: it equals the reference."""
    from relax_glue.snapshot_store import SnapshotStore

    tp2 = await asyncio.to_thread(tp2_engine.take)
    store = SnapshotStore(tmp_path / "snapshots")
    async with Deployment((engines[0], tp2), stock_engine, fixtures, cohort=COHORT, store=store) as w:
        reconciles: list[str] = []

        async def restore(engine_id: str, lora_path: str) -> None:
            reconciles.append(engine_id)
            await w.pub.reconcile([engine_id])

        w.sm.on_version_missing = restore
        w.sm.resend_interval_s = 0.2
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        s_a = [await w.sm.open(f"SA{i}") for i in range(2)]
        out_a = [await turn(w.tx, s, PROMPTS[i], 6) for i, s in enumerate(s_a)]
        assert [s.requests[-1].engine_id for s in s_a] == list(COHORT)
        old_inc = (await w.clients["TP2"].status()).incarnation

        rank_1_scheduler(tp2).send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        await asyncio.to_thread(tp2.proc.wait, 60)  # SGLang takes the whole engine down
        down_s = time.monotonic() - t0
        log = tp2.log_path.read_text(errors="replace")
        assert "crashed with exit code -9" in log and "kill_process_tree" in log, log[-2000:]
        tp2 = await asyncio.to_thread(spawn_engine, tp2_engine.spec(tp2.port, "-after-rank-kill"))
        tp2_engine.engine = tp2  # the fixture stops whichever process runs now
        await asyncio.to_thread(tp2.wait_healthy, 300.0)
        new_inc = (await w.clients["TP2"].status()).incarnation
        assert new_inc != old_inc and not await engine_versions(w.clients["TP2"], w.marker)

        for i, s in enumerate(s_a):
            await turn(w.tx, s, [*PROMPTS[i], *out_a[i], *TOOL_IDS], 6, kind="tool")
        assert reconciles == ["TP2"], reconciles
        on_tp2 = await engine_versions(w.clients["TP2"], w.marker)
        assert {n: v.state for n, v in on_tp2.items()} == {w.name_of["A"]: S.READY_LOCAL}
        assert all(lora_paths(s) == {w.name_of["A"]} for s in s_a)
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, w.tx.table(w.adapter_of)
        assert await assert_tp2_turns_equal_the_reference(w, fixtures) == 2

        await w.sm.close_all()
        assert (await w.publish(snaps, "B")).outcome is PublishOutcome.PUBLISHED
        done = await w.pub.reclaim_ready()
        assert [r.version_key.version_id for r in done if r.done] == ["A"], done
        for client in w.clients.values():
            assert (await engine_versions(client, w.marker))[w.name_of["A"]].state is S.UNLOADED
        print(
            f"\n[tp2] rank 1 killed: engine down in {down_s:.1f}s; {old_inc[:8]} -> {new_inc[:8]}, A restored"
        )
