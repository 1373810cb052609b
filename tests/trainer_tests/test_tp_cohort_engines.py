"""The whole lifecycle on a cohort of one TP=2 engine and one TP=1 engine (issue 38), with the
real registry, publisher and session layer: publish A, sessions bind on both engines, publish B
while A's sessions generate, reclaim A; then one rank's scheduler process is SIGKILLed in a
publication and in a reclaim drain.

Every turn is checked against the stock engine's baseline of its bound version with its full
prefix (exact greedy tokens: the TP=2 engine serves the TP=1 engine's tokens), and every turn on
the TP=2 engine also against the HF + PEFT reference.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import psutil
import pytest
from _e2e_helpers import (
    PROMPTS,
    TOOL_IDS,
    Deployment,
    abort_and_resume,
    assert_clean_audit,
    engine_versions,
    lora_paths,
    turn,
)

from lora_contract import protocol
from lora_versions_dev.fault_injection import FaultInjectingClient
from lora_versions_dev.launcher import spawn_engine
from lora_versions_dev.reference import greedy_tokens
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import VersionState

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
        want = ref[: len(t.tokens)] if t.kind == "partial" else ref  # an aborted stream's first tokens
        assert t.tokens == want, (t.session, t.kind, t.tokens, want)
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
        assert [s.requests[-1].engine_id for s in s_a] == list(COHORT)

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
        # the request lifecycle on the TP=2 engine: a stream aborted by its rid, then resumed
        await abort_and_resume(w.tx, s_a[1], [*PROMPTS[1], *out_a[1], *TOOL_IDS], 160, abort_after=3)
        assert all(lora_paths(s) == {w.name_of["A"]} for s in s_a)
        assert all(lora_paths(s) == {w.name_of["B"]} for s in s_b)
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, w.tx.table(w.adapter_of)
        assert await assert_tp2_turns_equal_the_reference(w, fixtures) == 5

        for s in s_a:
            await s.close()
        done = await w.pub.reclaim_ready()
        assert [r.version_key.version_id for r in done if r.done] == ["A"], done
        for client in w.clients.values():
            versions = await engine_versions(client, w.marker)
            assert versions[w.name_of["A"]].state is S.UNLOADED
            assert versions[w.name_of["B"]].in_flight == 0, "the native count of B is back at 0"
        assert_clean_audit(w.clients.values(), allow_failed_rids=w.tx.aborted_rids)


def rank_1_scheduler(engine) -> psutil.Process:
    (proc,) = [
        p
        for p in psutil.Process(engine.proc.pid).children(recursive=True)
        if RANK_1_TITLE in " ".join(p.cmdline())
    ]
    return proc


def assert_sglang_took_the_engine_down(log: str) -> None:
    """SGLang 0.5.23 takes the whole engine down when a rank's scheduler dies, by one of two paths,
    whichever comes first: the other rank's next collective fails (gloo: "Connection reset by
    peer") and its scheduler's exception handler SIGQUITs the main process; or the main process's
    ``SubprocessWatchdog`` (utils/watchdog.py), which polls the scheduler processes every second,
    sees the dead one and SIGQUITs itself. The SIGQUIT handler kills the whole process tree: the
    engine does not go on serving on one rank."""
    assert "SIGQUIT received" in log and "kill_process_tree" in log, log[-2000:]


async def restart_tp2(tp2_engine, tp2, tag: str):
    """Wait for SGLang to take the engine down after a rank died, then start it on its port."""
    await asyncio.to_thread(tp2.proc.wait, 60)
    assert_sglang_took_the_engine_down(tp2.log_path.read_text(errors="replace"))
    tp2 = await asyncio.to_thread(spawn_engine, tp2_engine.spec(tp2.port, tag))
    tp2_engine.engine = tp2  # the fixture stops whichever process runs now
    await asyncio.to_thread(tp2.wait_healthy, 300.0)
    return tp2


async def test_a_rank_killed_in_a_publication_and_in_a_reclaim_drain_frees_nothing_on_a_guess(
    engines, stock_engine, fixtures, snaps, tp2_engine, tmp_path
) -> None:
    """Rank 1's scheduler is SIGKILLed twice (two restarts in one test: each costs a minute).

    1. Right before the TP=2 engine's ``end`` of B: the end meets an engine going down, B is not
       committed (OUTCOME_UNKNOWN: A stays the default, B keeps its slot). Started again on its
       port the engine holds nothing; ``resolve()`` drives B onto it from ``begin`` (from the
       snapshot store) and commits it. The A session on the TP=2 engine is refused before
       admission (never the base model), the reconciler stages A (retired, still held) back onto
       it, the turn is sent again and equals the reference.
    2. During A's reclaim drain: A's sessions are closed but a request on A still runs on the
       TP=2 engine (its native count is 1), so the reclaim drains; the kill takes the engine down
       with the request. Nothing was unloaded while it ran; after the restart the new incarnation
       holds nothing (its UNLOADED is authoritative), A's reclaim completes, the reconciler
       restores B (the default) and B's sessions equal the reference on both engines."""
    from relax_glue.snapshot_store import SnapshotStore

    tp2 = await asyncio.to_thread(tp2_engine.take)
    store = SnapshotStore(tmp_path / "snapshots")
    async with Deployment((engines[0], tp2), stock_engine, fixtures, cohort=COHORT, store=store) as w:
        reconciles = w.restore_on_version_missing()
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        name_a = w.name_of["A"]
        s_a = [await w.sm.open(f"SA{i}") for i in range(2)]
        out_a = [await turn(w.tx, s, PROMPTS[i], 6) for i, s in enumerate(s_a)]
        assert [s.requests[-1].engine_id for s in s_a] == list(COHORT)

        # 1. a rank killed in a publication
        killed = []

        async def kill_rank_1() -> None:
            rank_1 = rank_1_scheduler(tp2)
            killed.append(rank_1.pid)
            rank_1.send_signal(signal.SIGKILL)

        w.wrap("TP2", FaultInjectingClient(w.clients["TP2"]).before_send("end", 1, kill_rank_1))
        res = await asyncio.wait_for(w.publish(snaps, "B"), 120)
        assert killed, "the end of B went out after the kill"
        assert res.outcome is PublishOutcome.OUTCOME_UNKNOWN and res.unknown == ("TP2",), res
        assert (await w.status()).default_lora_name == name_a
        assert (await w.version("B")).state is VersionState.LOADING
        w.unwrap()
        tp2 = await restart_tp2(tp2_engine, tp2, "-killed-in-publication")
        settled = await w.pub.resolve()
        assert settled is not None and settled.outcome is PublishOutcome.PUBLISHED, settled
        assert (await w.status()).default_lora_name == w.name_of["B"]
        on_tp2 = await engine_versions(w.clients["TP2"], w.marker)
        assert {n: v.state for n, v in on_tp2.items()} == {w.name_of["B"]: S.READY_LOCAL}
        for i, s in enumerate(s_a):
            await turn(w.tx, s, [*PROMPTS[i], *out_a[i], *TOOL_IDS], 6, kind="tool")
        assert reconciles == ["TP2"], reconciles
        assert all(lora_paths(s) == {name_a} for s in s_a)

        # 2. a rank killed in a reclaim drain
        for s in s_a:
            await s.close()
        lora_id_a = (await engine_versions(w.clients["TP2"], w.marker))[name_a].lora_id
        body = {"input_ids": list(PROMPTS[0]), "lora_path": name_a, "stream": True}
        body["sampling_params"] = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream("POST", f"{tp2.url}/generate", json=body) as stream,
        ):
            lines = stream.aiter_lines()
            await anext(lines)  # the request runs: it holds A's native count
            done = await w.pub.reclaim_ready(deadline_s=1.0)
            assert not [r for r in done if r.done], done  # draining on TP2
            assert (await engine_versions(w.clients["TP2"], w.marker))[name_a].in_flight == 1
            rank_1_scheduler(tp2).send_signal(signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                async for _ in lines:
                    pass
        unloads = f"LoRA adapter unloading starts: LoRARef(lora_id={lora_id_a}"
        assert unloads not in tp2.log_path.read_text(errors="replace"), "nothing unloaded while it ran"
        tp2 = await restart_tp2(tp2_engine, tp2, "-killed-in-drain")
        done = await w.pub.reclaim_ready()
        assert [r.version_key.version_id for r in done if r.done] == ["A"], done
        assert (await engine_versions(w.clients["E0"], w.marker))[name_a].state is S.UNLOADED
        await w.pub.reconcile(["TP2"])
        on_tp2 = await engine_versions(w.clients["TP2"], w.marker)
        assert {n: v.state for n, v in on_tp2.items()} == {w.name_of["B"]: S.READY_LOCAL}
        s_b = [await w.sm.open(f"SB{i}") for i in range(2)]
        for i, s in enumerate(s_b):
            await turn(w.tx, s, PROMPTS[i], 6)
        assert {s.requests[-1].engine_id for s in s_b} == set(COHORT)
        assert all(lora_paths(s) == {w.name_of["B"]} for s in s_b)
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, w.tx.table(w.adapter_of)
        assert await assert_tp2_turns_equal_the_reference(w, fixtures) == 3
