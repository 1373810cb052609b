"""RFC 7.2: a session bound to a managed version computes what a clean engine that loaded only
that adapter computes, for S_old, S_mid and S_new of RFC 3.4 on both engines, across tool turns,
retries and resumes; and the KV (radix) cache is never shared between versions, in either
direction, each direction in its own engine process from a cold cache.

Before any comparison (the ``epsilon`` fixture, ``gpu_tests/conftest.py``): the clean baselines
answer fixed prefixes several times, the logprob epsilon is derived from their measured spread
and written to the report. Every check goes through one rule (``_acceptance.compare``): the same
tokens, and every token's logprob within epsilon of the clean baseline's; and each compared turn
must have scoring positions, where the A and B baselines differ by more than 2 epsilon
(``_acceptance.scoring_positions``), so that the match says which version computed it. The
negative controls show each check can fail.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from _acceptance import TURN_TOKENS, Cohort, Comparison, Turn, body, compare, logprobs_of, prompt

from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import AttemptPhase
from relax_glue.sessions import Session

pytestmark = pytest.mark.engine

GROUP_SIZE = 2  # sessions per RFC 3.4 group; the router alternates engines, so one per engine


async def open_group(c: Cohort, group: str) -> list[Session]:
    return [await c.sm.open(f"{group}{i}") for i in range(GROUP_SIZE)]


async def test_s_old_s_mid_s_new_reproduce_their_clean_baselines_on_both_engines(
    deployment, acceptance_fixtures, profile, epsilon, report
) -> None:
    """RFC 3.4's scenario: S_old binds A; B is published and held with only E0 READY (E1's end
    waits), so S_mid binds A and the default is still A; B commits and S_new binds B. Every turn
    of every session (first turn, tool turn with its full prefix, retry, a turn after B's commit,
    an aborted stream and its resume with its full prefix) is compared with the clean engine of
    the version the session bound. Turns run one at a time (the baselines' batch shape)."""
    report.fix("rfc72.turn_tokens", TURN_TOKENS)
    async with Cohort(deployment, acceptance_fixtures, profile, epsilon=epsilon) as c:
        assert (await c.publish("A")).outcome is PublishOutcome.PUBLISHED
        s_old = await open_group(c, "S_old")
        for i, s in enumerate(s_old):
            await c.episode(s, prompt(100 + i), TURN_TOKENS)

        # B with only E0 READY: E1's end is held until the S_mid sessions have run.
        release, held = asyncio.Event(), asyncio.Event()

        async def hold_end() -> None:
            held.set()
            await release.wait()

        c.wrap("E1", FaultInjectingClient(c.clients["E1"]).before_send("end", 1, hold_end))
        publishing = asyncio.create_task(c.publish("B"))
        try:
            await asyncio.wait_for(held.wait(), 300)
            deadline = time.monotonic() + 60
            while c.registry.version((c.epoch, "B")).attempt_phases["E0"] is not AttemptPhase.READY:
                assert time.monotonic() < deadline, "E0 never became READY for B"
                await asyncio.sleep(0.02)
            phases = dict(c.registry.version((c.epoch, "B")).attempt_phases)
            default_mid = c.registry.status().default
            assert default_mid == c.registry.version((c.epoch, "A")).version_key, default_mid
            s_mid = await open_group(c, "S_mid")
            for i, s in enumerate(s_mid):
                await c.episode(s, prompt(150 + i), TURN_TOKENS)
        finally:
            release.set()
            published_b = await publishing
            c.unwrap()
        assert published_b.outcome is PublishOutcome.PUBLISHED, published_b
        assert phases["E1"] is not AttemptPhase.READY, phases

        s_new = await open_group(c, "S_new")
        for i, s in enumerate(s_new):
            await c.episode(s, prompt(200 + i), TURN_TOKENS)
        for i, s in enumerate([*s_old, *s_mid]):  # B is the default now; these stay on A
            await c.turn(s, prompt(300 + i), TURN_TOKENS)
        for i, s in enumerate([*s_old, *s_mid, *s_new]):  # abort mid-stream, resume on the same version
            await c.abort_and_resume(s, prompt(350 + i), TURN_TOKENS)

        checks: list[tuple[Turn, Comparison]] = [(t, await c.check(t)) for t in c.turns]
        bad = [(t.short(), cmp) for t, cmp in checks if not cmp.ok]
        groups = {"S_old": (s_old, "A"), "S_mid": (s_mid, "A"), "S_new": (s_new, "B")}
        per_group = {}
        for group, (sessions, adapter) in groups.items():
            names = {s.name for s in sessions}
            mine = [(t, cmp) for t, cmp in checks if t.session in names]
            scored = [cmp for t, cmp in mine if cmp.scoring_positions is not None]
            per_group[group] = {
                "bound": adapter,
                "lora_paths": sorted({r.lora_path for s in sessions for r in s.requests}),
                "engines": sorted({t.engine for t, _ in mine}),
                "kinds": sorted({t.kind for t, _ in mine}),
                "turns_compared": len(mine),
                "max_abs_logprob_delta": max((cmp.max_abs_delta for _, cmp in mine), default=0.0),
                "min_scoring_positions_per_turn": min((s.scoring_positions or 0 for s in scored), default=0),
                "min_a_b_separation": min((s.separation for s in scored), default=0.0),
            }
        retries = [t for t in c.turns if t.kind == "retry"]
        tools = [t for t in c.turns if t.kind == "tool"]

        # The same turns, all at once: mixed A/B batches on each engine. Tokens must still match;
        # the logprob delta is reported (a different batch shape may change the last bits).
        everyone = [*s_old, *s_mid, *s_new]
        concurrent = await asyncio.gather(
            *(c.turn(s, prompt(400 + i), TURN_TOKENS) for i, s in enumerate(everyone))
        )
        mixed = [await c.check(t) for t in concurrent]
        report.add(
            "rfc72_numerics",
            {
                "epsilon": epsilon,
                "b_held_with_only_E0_ready": {k: v.value for k, v in phases.items()},
                "default_while_b_held": str(default_mid),
                "groups": per_group,
                "turns_compared": len(checks),
                "turns_differing": len(bad),
                "max_abs_logprob_delta": max(cmp.max_abs_delta for _, cmp in checks),
                "mixed_batch_turns": len(mixed),
                "mixed_batch_tokens_equal": all(m.first_token_mismatch is None for m in mixed),
                "mixed_batch_max_abs_logprob_delta": max(m.max_abs_delta for m in mixed),
                "mixed_batch_within_epsilon": all(m.ok for m in mixed),
            },
        )
        assert not bad, f"turns that differ from their clean baseline: {bad}"
        for group, (_, adapter) in groups.items():
            assert per_group[group]["lora_paths"] == [c.name_of[adapter]], (group, per_group[group])
            assert per_group[group]["engines"] == ["E0", "E1"], f"{group} did not cover both engines"
            assert {"turn", "tool", "retry", "resume"} <= set(per_group[group]["kinds"]), per_group[group]
        assert [t.tokens for t in retries] == [t.tokens for t in tools], "a retry changed its answer"
        assert not c.forbidden()
        assert all(m.first_token_mismatch is None for m in mixed), mixed


async def _forced(c: Cohort, engine: str, lora_path: str, prefix: list[int], n: int) -> Turn:
    """A request sent straight to an engine with an explicit lora_path (no session): a forced
    adapter, the negative control of the numeric check."""
    out = await c.clients[engine].generate({**body(prefix, n), "lora_path": lora_path})
    meta = out["meta_info"]
    return Turn("forced", "forced", engine, lora_path, prefix, out["output_ids"], logprobs_of(out),
                int(meta.get("cached_tokens") or 0))  # fmt: skip


async def test_kv_cache_is_never_shared_between_versions_in_either_direction(
    deployment, acceptance_fixtures, profile, epsilon, report
) -> None:
    """RFC 7.2's two experiments, each in its own engine process from a cold cache for its
    prefix: experiment 1 on E0 (A warms a fresh prefix P; B then sends P + a tail and must reuse
    nothing and match B's cold clean baseline; B repeated must hit its own cache and still match),
    experiment 2 on E1 with the versions swapped and another fresh prefix. E0 and E1 are separate
    SGLang processes with separate radix caches, and each prefix is new to the deployment (the
    warming request itself shows ``cached_tokens`` 0), so neither experiment starts from the
    other's cache state. Negative control: P + tail forced onto the warming version is flagged by
    the same comparison against the second version's baseline (the check can fail)."""
    shared_len, tail_len, n = 48, 6, 8
    report.fix("rfc72.kv_shared_prefix_tokens", shared_len)
    async with Cohort(deployment, acceptance_fixtures, profile, epsilon=epsilon) as c:
        assert (await c.publish("A")).outcome is PublishOutcome.PUBLISHED
        on_a = [await c.sm.open(f"kvA{i}") for i in range(2)]
        for i, s in enumerate(on_a):
            await c.turn(s, prompt(500 + i, 6), 2)  # binds A (B not published yet)
        assert (await c.publish("B")).outcome is PublishOutcome.PUBLISHED
        on_b = [await c.sm.open(f"kvB{i}") for i in range(2)]
        for i, s in enumerate(on_b):
            await c.turn(s, prompt(510 + i, 6), 2)  # binds B
        by_engine = {
            (c.adapter_of[s.lora_path], s.requests[-1].engine_id): s for s in [*on_a, *on_b] if s.lora_path
        }
        experiments = {"1: A warm -> B": ("E0", "A", "B"), "2: B warm -> A": ("E1", "B", "A")}
        rows = []
        for k, (label, (engine, warm, second)) in enumerate(experiments.items()):
            warm_s, second_s = by_engine[(warm, engine)], by_engine[(second, engine)]
            shared = prompt(600 + k, shared_len)
            full = [*shared, *prompt(700 + k, tail_len)]
            cold = await c.baselines.generate(second, full, n)  # the second version's cold baseline
            t_warm = await c.turn(warm_s, shared, 4)
            t_second = await c.turn(second_s, full, n)
            t_repeat = await c.turn(second_s, full, n)
            first_cmp, repeat_cmp = await c.check(t_second), await c.check(t_repeat)
            forced = await _forced(c, engine, t_warm.lora_path, full, n)
            flagged = compare(forced.tokens, forced.logprobs, cold["output_ids"], logprobs_of(cold), epsilon)
            rows.append(
                {
                    "experiment": label,
                    "engine": engine,
                    "engines_seen": sorted({t_warm.engine, t_second.engine, t_repeat.engine}),
                    "shared_prefix_tokens": len(shared),
                    "baseline_cached_tokens": int(cold["meta_info"].get("cached_tokens") or 0),
                    "warm_cached_tokens": t_warm.cached_tokens,
                    "second_cached_tokens": t_second.cached_tokens,
                    "second_matches_cold_baseline": first_cmp.ok,
                    "second_max_abs_logprob_delta": first_cmp.max_abs_delta,
                    "repeat_cached_tokens": t_repeat.cached_tokens,
                    "repeat_matches_cold_baseline": repeat_cmp.ok,
                    "repeat_max_abs_logprob_delta": repeat_cmp.max_abs_delta,
                    "forced_wrong_adapter_flagged": not flagged.ok,
                }
            )
        report.add("rfc72_kv_isolation", {"epsilon": epsilon, "experiments": rows})
        for row in rows:
            assert row["engines_seen"] == [row["engine"]], row
            assert row["baseline_cached_tokens"] == 0 and row["warm_cached_tokens"] == 0, ("not cold", row)
            assert row["second_cached_tokens"] == 0, ("the other version's KV was reused", row)
            assert row["second_matches_cold_baseline"], row
            assert row["repeat_cached_tokens"] >= shared_len, ("no same-version cache hit", row)
            assert row["repeat_matches_cold_baseline"], row
            assert row["forced_wrong_adapter_flagged"], row
        assert {row["engine"] for row in rows} == {"E0", "E1"}
        assert not c.forbidden()
