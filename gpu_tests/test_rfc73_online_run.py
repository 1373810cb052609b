"""RFC 7.3: the online run. Two engines serve live A-bound agent sessions (streaming, with tool
turns) while new sessions keep joining; B is published mid-run (its first attempt meets an
injected partial failure on E1 and is cleaned up); C is refused for capacity before any engine
sees it; the A sessions end, A is reclaimed (one physical unload per engine, a late A request
refused), and C is published.

Before the run, the report fixes its load, the bucket cap, each phase's deadline and the largest
no-progress gap allowed (the device profile's ``stall_bound_s``). It asserts behaviour (bindings,
exact outputs, capacity, no pause/flush/abort-all, unload once, no failed request, at most two
versions held) and progress: the run FAILS when either engine went longer than the bound without
a chunk while it had a request in flight (``_acceptance.max_no_progress_gap``). It reports
request latency p50/p95/p99 (overall and before / during / after publication), each
publication's per-phase times, the version occupancy samples, and the throughput of a managed
version against a plain-LoRA engine under the same load, next to Relax's anchor (0.98 of plain
throughput, 0.05 s largest gap, RTX 6000 Ada).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import pytest
from _acceptance import (
    RELAX_ANCHOR,
    TOOL_IDS,
    Cohort,
    LoadFigures,
    Report,
    Stream,
    Turn,
    body,
    greedy,
    latency_summary,
    max_no_progress_gap,
    measure_load,
    prompt,
)
from engine_wrappers.step_fence_probe import probe_lines

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.transport import BUCKET_TARGET_BYTES
from lora_versions_dev.engine_log import fence_records, unload_lines
from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.publisher import PublishOutcome
from relax_glue.sessions import Session

pytestmark = pytest.mark.engine

AGENTS = 4  # A-bound sessions streaming for the whole first half of the run
TOKENS = 16  # per streamed turn
WINDOW_S = 3.0  # traffic before the publication and after the last step
# The throughput comparison's load per device: concurrent clients, requests each, tokens each.
LOAD = {"cpu": {"streams": 4, "rounds": 2, "n": 32}, "cuda": {"streams": 32, "rounds": 2, "n": 128}}
CYCLES = 2
JOIN_EVERY_S = 0.7  # a new session joins this often
PUBLISH_DEADLINE_S = 120.0  # each publication call (begin to commit or clean failure)
RECLAIM_DEADLINE_S = 120.0  # A's reclaim, from its sessions' close to both unloads
DRAIN_DEADLINE_S = 30.0  # a closing session's in-flight requests
MAX_VERSIONS = 2


def fix_thresholds(report: Report, profile: Any, load: dict[str, int]) -> float:
    """RFC 7.3: load, bucket cap, phase deadlines and the largest no-progress gap, fixed (and
    written to the report) before the run. Returns the no-progress bound."""
    report.fix("rfc73.agents", AGENTS)
    report.fix("rfc73.tokens_per_turn", TOKENS)
    report.fix("rfc73.join_every_s", JOIN_EVERY_S)
    report.fix("rfc73.traffic_window_s", WINDOW_S)
    report.fix("rfc73.throughput_load", {**load, "abba_cycles": CYCLES})
    report.fix("rfc73.bucket_cap_bytes", BUCKET_TARGET_BYTES)
    report.fix("rfc73.deadline_publish_s", PUBLISH_DEADLINE_S)
    report.fix("rfc73.deadline_reclaim_s", RECLAIM_DEADLINE_S)
    report.fix("rfc73.deadline_session_drain_s", DRAIN_DEADLINE_S)
    report.fix("rfc73.max_versions_held", MAX_VERSIONS)
    return report.fix(
        "rfc73.max_no_progress_gap_s",
        profile.stall_bound_s,
        f"device profile {profile.device}: a stall, not a slow step (lora_versions_dev/device_profile.py)",
    )


def combine(runs: list[LoadFigures]) -> LoadFigures:
    """Several measurements of one engine as one: throughput over the summed wall time."""
    tokens, wall = sum(r.tokens for r in runs), sum(r.wall_s for r in runs)
    return LoadFigures(
        requests=sum(r.requests for r in runs),
        tokens=tokens,
        wall_s=round(wall, 3),
        tokens_per_s=round(tokens / wall, 2),
        p95_latency_s=max(r.p95_latency_s for r in runs),
        max_gap_s=max(r.max_gap_s for r in runs),
    )


@dataclasses.dataclass
class Live:
    """What the run recorded."""

    streams: list[Stream] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    # (when its first generation was asked for, the lora_path it bound)
    joined: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    slots: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, max held per engine)
    events: dict[str, float] = dataclasses.field(default_factory=dict)


async def stream_turn(c: Cohort, live: Live, s: Session, prefix: list[int], label: str) -> list[int]:
    """One streamed turn of a session; its chunks are timed and the turn is kept for the check."""
    st = Stream(label, "", c.sm.router.pick(s.key), time.monotonic())
    live.streams.append(st)
    async for chunk in s.generate_stream(body(prefix, TOKENS) | {"return_logprob": False}):
        st.t.append(time.monotonic())
        st.tokens = list(chunk.get("output_ids") or st.tokens)
    assert s.lora_path is not None and len(st.tokens) == TOKENS, (s, st.tokens)
    st.lora_path = s.lora_path
    live.turns.append(Turn(s.name, label, st.engine, s.lora_path, list(prefix), st.tokens, [], 0))
    return st.tokens


async def agent(c: Cohort, live: Live, s: Session, seed: int, stop: asyncio.Event) -> None:
    """Assistant turn, scripted tool reply, assistant turn, ... until told to stop; then close."""
    prefix = prompt(seed)
    while not stop.is_set():
        out = await stream_turn(c, live, s, prefix, "agent")
        prefix = [*prefix, *out, *TOOL_IDS][-96:]
    await s.close()


async def joiners(c: Cohort, live: Live, stop: asyncio.Event) -> None:
    """New sessions keep arriving; each binds the default at its first generation, runs a short
    episode (turn, tool turn) and closes."""
    k = 0
    tasks = []

    async def one(k: int) -> None:
        s = await c.sm.open(f"join{k}")
        asked = time.monotonic()  # it binds when this first generation is dispatched
        first = await stream_turn(c, live, s, prompt(900 + k), "join")
        live.joined.append((asked, s.lora_path or ""))
        await stream_turn(c, live, s, [*prompt(900 + k), *first, *TOOL_IDS], "join")
        await s.close()

    while not stop.is_set():
        tasks.append(asyncio.create_task(one(k)))
        k += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), JOIN_EVERY_S)
    await asyncio.gather(*tasks)


async def sample_slots(c: Cohort, live: Live, stop: asyncio.Event) -> None:
    while not stop.is_set():
        held = await c.live()
        live.slots.append((time.monotonic(), max(len(v) for v in held.values())))
        await asyncio.sleep(0.2)


def phase_figures(live: Live, lo: float, hi: float) -> dict[str, Any]:
    started = [s for s in live.streams if lo <= s.started <= hi and s.t]
    gaps = [g for s in live.streams for g in s.gaps(lo, hi)]
    tokens = sum(1 for s in live.streams for t in s.t if lo <= t <= hi)
    return {
        "window_s": round(hi - lo, 2),
        "requests_started": len(started),
        "chunks": tokens,
        "latency": latency_summary([s.latency_s for s in started]),
        "max_gap_s": round(max(gaps, default=0.0), 3),
        "max_no_progress_s": {
            e: round(max_no_progress_gap(live.streams, e, lo, hi), 3) for e in ("E0", "E1")
        },
    }


def publication_figures(result: Any) -> dict[str, Any]:
    """One publication call: its outcome, its time and its time per phase."""
    return {
        "outcome": result.outcome.value,
        "duration_s": round(result.duration_s, 3),
        "phase_s": {k: round(v, 3) for k, v in result.phase_s.items()},
    }


async def test_online_publication_under_live_agent_traffic(
    deployment, acceptance_fixtures, profile, report
) -> None:
    load = LOAD[profile.device]
    stall_bound_s = fix_thresholds(report, profile, load)
    async with Cohort(deployment, acceptance_fixtures, profile) as c:
        c.sm.drain_timeout_s = DRAIN_DEADLINE_S
        published_a = await c.publish("A")
        assert published_a.outcome is PublishOutcome.PUBLISHED
        name_a = c.name_of["A"]

        async def publish(adapter: str, version_id: str | None = None) -> Any:
            return await asyncio.wait_for(c.publish(adapter, version_id), PUBLISH_DEADLINE_S)

        # -- throughput: the same load on one managed engine (version A) and on the plain-LoRA
        # engine (stock SGLang, only A loaded), one after the other.
        # One warm-up round each, then ABBA cycles so neither engine gains from going first.
        engines = {"managed": (deployment["E0"].url, name_a), "plain": (deployment["base_A"].url, "A")}
        for url, lora in engines.values():
            await measure_load(url, lora, seed=999, **{**load, "rounds": 1})
        runs: dict[str, list[LoadFigures]] = {"managed": [], "plain": []}
        for cycle in range(CYCLES):
            for which in ("managed", "plain", "plain", "managed"):
                url, lora = engines[which]
                runs[which].append(await measure_load(url, lora, seed=1000 + cycle, **load))
        managed, plain = combine(runs["managed"]), combine(runs["plain"])

        # -- the online run
        live = Live()
        stop_agents, stop_joiners, stop_sampler = asyncio.Event(), asyncio.Event(), asyncio.Event()
        agents = [await c.sm.open(f"agent{i}") for i in range(AGENTS)]
        tasks = [asyncio.create_task(agent(c, live, s, 1100 + i, stop_agents)) for i, s in enumerate(agents)]
        join_task = asyncio.create_task(joiners(c, live, stop_joiners))
        sampler = asyncio.create_task(sample_slots(c, live, stop_sampler))
        late_refusal: LoraVersionError | None = None
        try:
            while len(live.streams) < AGENTS:
                await asyncio.sleep(0.05)
            live.events["traffic"] = time.monotonic()
            await asyncio.sleep(WINDOW_S)

            live.events["publish_B"] = time.monotonic()
            # The injected partial failure: B's first bucket to E1 arrives corrupted.
            faulty = FaultInjectingClient(c.clients["E1"]).corrupt_bucket(1)
            c.wrap("E1", faulty)
            first_try = await publish("B")
            c.unwrap()
            assert first_try.outcome is PublishOutcome.FAILED_CLEAN, first_try
            assert first_try.error is not None and first_try.error.code is ErrorCode.CHECKSUM_MISMATCH
            assert faulty.injected and (await c.live()) == {"E0": [name_a], "E1": [name_a]}
            replay = await publish("B")  # idempotent: the same outcome, nothing sent again
            assert replay.outcome is PublishOutcome.FAILED_CLEAN and not replay.steps, replay
            second_try = await publish("B", "B.retry")
            assert second_try.outcome is PublishOutcome.PUBLISHED, second_try
            live.events["committed_B"] = time.monotonic()

            refused = await publish("C")
            live.events["refused_C"] = time.monotonic()
            assert refused.outcome is PublishOutcome.REFUSED and refused.error is not None
            assert refused.error.code is ErrorCode.CAPACITY_ERROR, refused
            begins_c = [
                e for cl in c.clients.values() for e in cl.audit.entries(kind="control")
                if e.op == "begin" and e.detail == refused.lora_name
            ]  # fmt: skip
            assert not begins_c, "the refused version reached an engine"

            await asyncio.sleep(1.0)  # joiners now bind B
            stop_agents.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert not [r for r in results if isinstance(r, BaseException)], results
            live.events["agents_closed"] = time.monotonic()

            a_ids = {e: next(v.lora_id for v in (await cl.status()).versions if v.lora_name == name_a)
                     for e, cl in c.clients.items()}  # fmt: skip
            deadline = time.monotonic() + RECLAIM_DEADLINE_S
            while name_a in {n for names in (await c.live()).values() for n in names}:
                assert time.monotonic() < deadline, "A was never reclaimed"
                await c.publisher.reclaim_ready()
                await asyncio.sleep(0.2)
            live.events["reclaimed_A"] = time.monotonic()
            with pytest.raises(LoraVersionError) as late:
                await c.clients["E0"].generate(
                    {"input_ids": prompt(5), "sampling_params": greedy(2), "lora_path": name_a}
                )
            late_refusal = late.value

            published_c = await publish("C")
            assert published_c.outcome is PublishOutcome.PUBLISHED
            live.events["committed_C"] = time.monotonic()
            await asyncio.sleep(WINDOW_S)
            live.events["end"] = time.monotonic()
        finally:
            stop_agents.set()
            stop_joiners.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            join_error = await asyncio.gather(join_task, return_exceptions=True)
            stop_sampler.set()
            await asyncio.gather(sampler, return_exceptions=True)
        assert not [e for e in join_error if isinstance(e, BaseException)], join_error

        # -- behaviour
        ev = live.events
        name_b, name_c = c.name_of["B"], c.name_of["C"]
        for s in agents:
            assert {r.lora_path for r in s.requests} == {name_a}, "an A session left its version"
        bound_before = {p for t, p in live.joined if t < ev["publish_B"]}
        bound_after_c = {p for t, p in live.joined if t > ev["committed_C"]}
        assert bound_before <= {name_a} and bound_after_c == {name_c}, (bound_before, bound_after_c)
        a_turns = [t for t in live.turns if t.lora_path == name_a]
        wrong = []
        for t in a_turns:  # A's outputs, compared token for token with the clean A engine
            ref = await c.baselines.generate("A", t.prefix, TOKENS)
            if ref["output_ids"] != t.tokens:
                wrong.append(t.short())
        assert not wrong, f"A-bound turns differ from the clean A engine: {wrong[:3]}"
        assert late_refusal.code in (ErrorCode.VERSION_RECLAIMED, ErrorCode.UNKNOWN_VERSION), late_refusal
        unloads = {e: unload_lines(deployment[e].log_path, a_ids[e]) for e in c.clients}
        assert unloads == {"E0": 1, "E1": 1}, unloads
        # Each scheduler's step fence ran at that unload and had nothing to wait for (overlap is
        # refused on this deployment; under overlap on a GPU: test_overlap_scheduler), and E1's
        # probe, which runs inside the fence right before the real unload, agrees.
        fences = {e: fence_records(deployment[e].log_path, a_ids[e]) for e in c.clients}
        decided = {e: [(r["overlap"], r["waited"], r["fence_passed"]) for r in f] for e, f in fences.items()}
        assert decided == {e: [("False", "0", "True")] for e in c.clients}, fences
        probes = probe_lines(deployment["E1"].log_path.read_text(errors="replace"), a_ids["E1"])
        assert [(p["overlap"], p["fence_passed"]) for p in probes] == [("False", "True")], probes
        assert max(n for _, n in live.slots) <= MAX_VERSIONS, "more than two managed versions held capacity"
        assert not c.forbidden(), c.forbidden()
        failed = [
            e for cl in c.clients.values() for e in cl.audit.entries(kind="generation")
            if e.outcome != "ok" and not e.outcome.startswith("refused:")
        ]  # fmt: skip
        assert not failed, failed
        assert {n for names in (await c.live()).values() for n in names} == {name_b, name_c}

        # -- figures, and progress: no engine may stall longer than the bound fixed before the run
        no_progress = {
            e: round(max_no_progress_gap(live.streams, e, ev["traffic"], ev["end"]), 3) for e in c.clients
        }
        phases = {
            "before": phase_figures(live, ev["traffic"], ev["publish_B"]),
            "during": phase_figures(live, ev["publish_B"], ev["committed_C"]),
            "after": phase_figures(live, ev["committed_C"], ev["end"]),
        }
        report.add(
            "rfc73_online_run",
            {
                "throughput_managed_tok_s": managed.tokens_per_s,
                "throughput_plain_tok_s": plain.tokens_per_s,
                "throughput_ratio": round(managed.tokens_per_s / plain.tokens_per_s, 3),
                "p95_latency_managed_s": managed.p95_latency_s,
                "p95_latency_plain_s": plain.p95_latency_s,
                "max_gap_managed_s": managed.max_gap_s,
                "max_gap_plain_s": plain.max_gap_s,
                "load": {**load, "abba_cycles": CYCLES},
                "phases": phases,
                "max_gap_before_s": phases["before"]["max_gap_s"],
                "max_gap_during_s": phases["during"]["max_gap_s"],
                "max_gap_after_s": phases["after"]["max_gap_s"],
                "request_latency": latency_summary([s.latency_s for s in live.streams if s.t]),
                "max_no_progress_s": no_progress,
                "max_no_progress_bound_s": stall_bound_s,
                "publication_B_s": round(ev["committed_B"] - ev["publish_B"], 3),
                "publications": {
                    "A": publication_figures(published_a),
                    "B_injected_failure": publication_figures(first_try),
                    "B_retry": publication_figures(second_try),
                    "C_refused": publication_figures(refused),
                    "C": publication_figures(published_c),
                },
                "partial_failure": "B's first bucket to E1 corrupted: FAILED_CLEAN, cleaned on both",
                "refused_C": "CAPACITY_ERROR, no engine saw a begin",
                "reclaim_A_s": round(ev["reclaimed_A"] - ev["agents_closed"], 3),
                "late_A_request": late_refusal.code.value,
                "unloads_of_A": unloads,
                "step_fence_at_unload": {e: records[0] for e, records in fences.items()},
                "step_fence_probe_at_unload_E1": probes[0],
                "max_versions_held": max(n for _, n in live.slots),
                "occupancy_samples": [(round(t - ev["traffic"], 2), n) for t, n in live.slots],
                "a_turns_checked": len(a_turns),
                "sessions_joined": len(live.joined),
                "anchor": RELAX_ANCHOR,
            },
        )
        stalled = {e: gap for e, gap in no_progress.items() if gap > stall_bound_s}
        assert not stalled, f"an engine made no progress for longer than {stall_bound_s} s: {stalled}"
