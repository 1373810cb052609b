"""RFC 7.2: a session bound to a managed version computes exactly what a clean engine that
loaded only that adapter computes, on both engines, across tool turns and retries; and the KV
(radix) cache is never shared between versions, in either direction.

Every check goes through one rule (``_acceptance.compare``): the same tokens, and every token's
logprob within the profile's epsilon of the clean baseline's: 0 on CPU fp32 (bit-equal), a
documented bound on GPU bf16. The negative controls show each check can fail.
"""

from __future__ import annotations

import asyncio

import pytest
from _acceptance import Cohort, Turn, body, compare, logprobs_of, prompt

from relax_glue.publisher import PublishOutcome

pytestmark = pytest.mark.engine

TURN_TOKENS = 12


async def test_sessions_bound_to_a_and_b_reproduce_their_clean_baselines(
    deployment, acceptance_fixtures, profile, report
) -> None:
    """Sessions bind A, B is published, new sessions bind B; old ones keep A. Every turn (first
    turn, tool turn, retry, a turn after B's commit, an aborted stream and its resume) is compared
    with the clean engine of the version the session bound, with the turn's full prefix. Turns
    run one at a time, so the managed engine and the baseline compute the same batch shape."""
    async with Cohort(deployment, acceptance_fixtures, profile) as c:
        assert (await c.publish("A")).outcome is PublishOutcome.PUBLISHED
        a_sessions = [await c.sm.open(f"a{i}") for i in range(2)]
        for i, s in enumerate(a_sessions):
            await c.episode(s, prompt(100 + i), TURN_TOKENS)
        assert (await c.publish("B")).outcome is PublishOutcome.PUBLISHED
        b_sessions = [await c.sm.open(f"b{i}") for i in range(2)]
        for i, s in enumerate(b_sessions):
            await c.episode(s, prompt(200 + i), TURN_TOKENS)
        for i, s in enumerate(a_sessions):  # B is the default now; these stay on A
            await c.turn(s, prompt(300 + i), TURN_TOKENS)
        for i, s in enumerate([*a_sessions, *b_sessions]):  # abort mid-stream, resume on the same version
            await c.abort_and_resume(s, prompt(350 + i), TURN_TOKENS)

        checks = [(t, await c.check(t)) for t in c.turns]
        bad = [(t.short(), cmp) for t, cmp in checks if not cmp.ok]
        assert not bad, f"turns that differ from their clean baseline: {bad}"
        for s in a_sessions:
            assert {r.lora_path for r in s.requests} == {c.name_of["A"]}
        for s in b_sessions:
            assert {r.lora_path for r in s.requests} == {c.name_of["B"]}
        retries = [t for t in c.turns if t.kind == "retry"]
        tools = [t for t in c.turns if t.kind == "tool"]
        assert [t.tokens for t in retries] == [t.tokens for t in tools], "a retry changed its answer"
        engines = {t.engine for t in c.turns}
        assert engines == {"E0", "E1"}, f"the sessions did not cover both engines: {engines}"
        assert not c.forbidden()

        # The same turns, all at once: mixed A/B batches on each engine. Tokens must still match;
        # the logprob delta is reported (a different batch shape may change the last bits).
        concurrent = await asyncio.gather(
            *(c.turn(s, prompt(400 + i), TURN_TOKENS) for i, s in enumerate([*a_sessions, *b_sessions]))
        )
        mixed = [await c.check(t) for t in concurrent]
        assert all(m.first_token_mismatch is None for m in mixed), mixed

        report.add(
            "rfc72_numerics",
            {
                "turns_compared": len(checks),
                "engines": sorted(engines),
                "kinds": sorted({t.kind for t in c.turns}),
                "epsilon": profile.logprob_epsilon,
                "max_abs_logprob_delta": max(cmp.max_abs_delta for _, cmp in checks),
                "tokens_equal": True,
                "mixed_batch_turns": len(mixed),
                "mixed_batch_max_abs_logprob_delta": max(m.max_abs_delta for m in mixed),
                "mixed_batch_within_epsilon": all(m.ok for m in mixed),
            },
        )


async def _forced(c: Cohort, engine: str, lora_path: str, prefix: list[int], n: int) -> Turn:
    """A request sent straight to an engine with an explicit lora_path (no session): a forced
    adapter, the negative control of the numeric check."""
    out = await c.clients[engine].generate({**body(prefix, n), "lora_path": lora_path})
    meta = out["meta_info"]
    t = Turn("forced", "forced", engine, lora_path, prefix, out["output_ids"], logprobs_of(out), 0)
    t.cached_tokens = int(meta.get("cached_tokens") or 0)
    return t


async def test_kv_cache_is_never_shared_between_versions_in_either_direction(
    deployment, acceptance_fixtures, profile, report
) -> None:
    """For (first, second) in (A, B) and (B, A): a session of ``first`` prefills a fresh prefix P;
    a session of ``second`` then sends P + a tail on the same engine. ``second`` must reuse
    nothing (cached_tokens 0) and match its clean baseline. Negative controls: a second request
    of ``first`` does hit P (the measurement can see a hit), and the request forced to the wrong
    adapter is flagged by the comparison (the numeric check can fail)."""
    async with Cohort(deployment, acceptance_fixtures, profile) as c:
        assert (await c.publish("A")).outcome is PublishOutcome.PUBLISHED
        on_a = [await c.sm.open(f"kvA{i}") for i in range(2)]
        for i, s in enumerate(on_a):
            await c.turn(s, prompt(500 + i, 6), 2)  # binds A (B not published yet)
        assert (await c.publish("B")).outcome is PublishOutcome.PUBLISHED
        on_b = [await c.sm.open(f"kvB{i}") for i in range(2)]
        for i, s in enumerate(on_b):
            await c.turn(s, prompt(510 + i, 6), 2)  # binds B
        engine_of = {s.name: s.requests[-1].engine_id for s in [*on_a, *on_b]}

        rows = []
        for direction, (first, second) in {"A->B": (on_a, on_b), "B->A": (on_b, on_a)}.items():
            # A pair of sessions of each version that sit on the same engine.
            first_s, first_s2 = first
            second_s = next(s for s in second if engine_of[s.name] == engine_of[first_s.name])
            shared = prompt(600 + len(rows), 48)
            tail = prompt(700 + len(rows), 6)
            t_first = await c.turn(first_s, shared, 4)
            t_second = await c.turn(second_s, [*shared, *tail], 8)
            assert t_second.engine == t_first.engine
            isolated = await c.check(t_second)
            # Negative control 1: the same version does reuse P on that engine.
            same_engine_first = first_s2 if engine_of[first_s2.name] == t_first.engine else first_s
            t_hit = await c.turn(same_engine_first, [*shared, *tail[:3]], 4)
            # Negative control 2: P + tail forced onto the first version; compared with the
            # second version's baseline it must be flagged.
            forced = await _forced(c, t_first.engine, t_first.lora_path, [*shared, *tail], 8)
            ref_second = await c.baselines.generate(c.adapter_of[t_second.lora_path], [*shared, *tail], 8)
            flagged = compare(
                forced.tokens,
                forced.logprobs,
                ref_second["output_ids"],
                logprobs_of(ref_second),
                profile.logprob_epsilon,
            )
            rows.append(
                {
                    "direction": direction,
                    "engine": t_first.engine,
                    "shared_prefix_tokens": len(shared),
                    "second_cached_tokens": t_second.cached_tokens,
                    "second_matches_baseline": isolated.ok,
                    "second_max_abs_logprob_delta": isolated.max_abs_delta,
                    "same_version_cached_tokens": t_hit.cached_tokens,
                    "forced_wrong_adapter_flagged": not flagged.ok,
                }
            )
            assert t_second.cached_tokens == 0, rows[-1]
            assert isolated.ok, (rows[-1], isolated)
            assert t_hit.cached_tokens >= len(shared), rows[-1]
            assert not flagged.ok, rows[-1]
        assert not c.forbidden()
        report.add("rfc72_kv_isolation", {"checks": rows})
