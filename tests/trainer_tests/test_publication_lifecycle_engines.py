"""The whole lifecycle on REAL engines (issue 6): registry, publisher, sessions, two CPU SGLang
engines E0/E1 with the plugin on, and the stock engine (plugin off) for single-version baselines.

No doubles here: the registry is the real ``LoRAVersionRegistry`` (in process, and through the
Ray actor in the RFC 5.2 test), the publisher / session layer / engine client are the real ones,
and faults are injected by wrappers around the REAL client that hold, corrupt, lose or drop
exactly one call. Every test uses an epoch of its own (names never clash) and leaves E0/E1
without any managed version it created.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
import uuid

import pytest
from _e2e_helpers import (
    COHORT,
    PROMPTS,
    TOOL_IDS,
    Deployment,
    Gate,
    Interceptor,
    abort_and_resume,
    assert_clean_audit,
    begins_for,
    corrupt_bucket,
    engine_versions,
    greedy,
    lora_paths,
    lose_bucket,
    new_epoch,
    reach,
    turn,
    vstate,
    wait_until,
    write_json,
)
from _local_ray import local_ray
from _optional import optional_module

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_versions_dev.engine_log import await_unload_lines, unload_lines
from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import AttemptPhase, VersionState
from relax_glue.sessions import Session

pytestmark = pytest.mark.engine

S = protocol.EngineVersionState


# =============================================================================== RFC 3.4


@pytest.mark.parametrize("transport", ["http", "collective"])
async def test_rfc34_happy_path_step_by_step(
    engines, stock_engine, fixtures, snaps, run_dir, transport
) -> None:
    """Bootstrap A through the protocol (binds before A commits: NO_PUBLISHED_VERSION); S_old
    binds A; B READY on E0 only: S_mid binds A, default unchanged; E1 READY, commit: S_new binds
    B; S_old / S_mid go on with tool turns, a retry and an abort/resume, all on A; every token
    stream equals the stock single-version baseline for its full prefix. The same with the
    buckets over each engine's collective group (gloo)."""
    async with Deployment(engines, stock_engine, fixtures, transport=transport) as w:
        e1 = w.wrap("E1", Interceptor(w.clients["E1"]))
        tx, N = w.tx, 8

        # --- bootstrap: A goes through the same protocol; E1's end is held -> READY on E0 only
        gate = Gate()
        e1.on("end", gate)
        s_early = await w.sm.open("S_early")
        pub_a = asyncio.create_task(w.publish(snaps, "A"))
        await reach(gate, pub_a)
        await wait_until(
            lambda: w.reg.version(w.key("A")).attempt_phases["E0"] is AttemptPhase.READY, what="A READY on E0"
        )
        with pytest.raises(LoraVersionError) as err:
            await turn(tx, s_early, PROMPTS[0], N)
        assert err.value.code is ErrorCode.NO_PUBLISHED_VERSION
        assert s_early.lora_path is None and not s_early.requests, "nothing may be sent unbound"
        gate.open()
        res_a = await asyncio.wait_for(pub_a, 120)
        assert res_a.outcome is PublishOutcome.PUBLISHED, res_a
        name_a = w.name_of["A"]

        # --- S_old binds A (and S_early, retried after the commit, binds A too)
        s_old = await w.sm.open("S_old")
        old = {"S_old": await turn(tx, s_old, PROMPTS[0], N)}
        assert s_old.lora_path == name_a

        # --- B prepared; READY on E0 only (E1 holds every bucket, its end is held)
        gate = Gate()
        e1.on("end", gate)
        pub_b = asyncio.create_task(w.publish(snaps, "B"))
        await reach(gate, pub_b)
        await wait_until(
            lambda: w.reg.version(w.key("B")).attempt_phases["E0"] is AttemptPhase.READY, what="B READY on E0"
        )
        name_b = w.name_of["B"]
        on_e0 = await engine_versions(w.clients["E0"], w.marker)
        on_e1 = await engine_versions(w.clients["E1"], w.marker)
        assert on_e0[name_b].state is S.READY_LOCAL and on_e1[name_b].state is S.PREPARED
        assert on_e1[name_b].buckets_received == on_e1[name_b].buckets_total > 1
        st = w.reg.status()
        assert st.default_lora_name == name_a and w.reg.version(w.key("B")).state is VersionState.LOADING
        # S_mid's first generation happens now: it binds A (the default), not the half-ready B
        s_mid = await w.sm.open("S_mid")
        old["S_mid"] = await turn(tx, s_mid, PROMPTS[1], N)
        assert s_mid.lora_path == name_a
        # the old session keeps generating while B is half-published
        prefix_old = [*PROMPTS[0], *old["S_old"], *TOOL_IDS]
        old["S_old"] = await turn(tx, s_old, prefix_old, N, kind="tool")
        assert w.reg.status().default_lora_name == name_a

        # --- E1 READY, commit
        gate.open()
        res_b = await asyncio.wait_for(pub_b, 120)
        assert res_b.outcome is PublishOutcome.PUBLISHED, res_b
        assert res_b.commit is not None and res_b.commit.previous_default == w.key("A")
        assert vstate(w.reg.version(w.key("A"))) is VersionState.RETIRED
        assert w.reg.status().default_lora_name == name_b

        # --- new sessions bind B (one per engine)
        new: dict[str, Session] = {}
        for label in ("S_new", "S_new2"):
            new[label] = await w.sm.open(label)
            await turn(tx, new[label], PROMPTS[2], N)
            assert new[label].lora_path == name_b

        # --- S_early retries its first generation after the commit: binds B, once
        await turn(tx, s_early, PROMPTS[3], N)
        assert s_early.lora_path == name_b and s_early.bind_calls == 2

        # --- old sessions: tool turn, a retry, an abort/resume -- all on A
        prefixes = {"S_old": prefix_old, "S_mid": list(PROMPTS[1])}
        for s in (s_old, s_mid):
            p = [*prefixes[s.name], *old[s.name], *TOOL_IDS]
            out = await turn(tx, s, p, N, kind="tool")
            again = await turn(tx, s, p, N, kind="retry")
            assert again == out, "a retry of the same turn is the same greedy continuation"
            # 160 tokens: the abort must land mid-stream even on a loaded CPU (with 40, the whole
            # turn was once decoded before the abort reached the scheduler)
            await abort_and_resume(tx, s, [*p, *out, *TOOL_IDS], 160, abort_after=3)
        # the new session goes on on B meanwhile
        await turn(tx, new["S_new"], [*PROMPTS[2], *TOOL_IDS], N, kind="tool")

        assert lora_paths(s_old) == lora_paths(s_mid) == {name_a}
        assert lora_paths(new["S_new"]) == lora_paths(new["S_new2"]) == {name_b}
        engines_used = {t.engine for t in tx.turns if w.adapter_of[t.lora_path] == "A"}
        assert engines_used == {"E0", "E1"}, f"A must be served on both engines: {engines_used}"
        bad = await tx.mismatches(w.refs, w.adapter_of)
        print("\n" + tx.table(w.adapter_of))
        write_json(
            run_dir / f"e2e_happy_path_{transport}.json",
            {"turns": [t.__dict__ for t in tx.turns], "mismatches": bad},
        )
        assert not bad, f"token streams differ from the single-version baselines: {bad}"
        # the two temporary aborts are the only generations not "ok" in the audit: "aborted"
        aborted = [
            e for c in w.clients.values() for e in c.audit.entries(kind="generation") if e.outcome != "ok"
        ]
        assert sorted(e.detail for e in aborted) == sorted(tx.aborted_rids) and len(aborted) == 2
        assert {e.outcome for e in aborted} == {"aborted"}
        counts = assert_clean_audit(w.clients.values(), allow_failed_rids=tx.aborted_rids)
        assert counts.get("control:abort_request", 0) >= 2

        # --- wind down: every session closes, A is reclaimed (B is removed by the teardown)
        await w.sm.close_all()
        done = await w.pub.reclaim_ready()
        assert [r.version_key for r in done if r.done] == [w.key("A")]


# =============================================================================== RFC 5.2


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(optional_module("ray", "ray", "ray")) as ray:
        yield ray


async def test_rfc52_capacity_refusal_then_safe_reclaim_through_the_ray_actor(
    engines, stock_engine, fixtures, snaps, ray_cluster
) -> None:
    """A RETIRED + B PUBLISHED: reserve(C) is CAPACITY_ERROR and no engine saw a begin; A is not
    reclaimed while a session holds it; all A sessions close; reclaim unloads A exactly once per
    engine; C is then accepted and the default stays B until C commits. The registry is the
    single-writer Ray actor, reached through the async actor client."""
    from relax_glue.actor import AsyncRegistryClient, new_publisher_token, start_registry_actor

    epoch = new_epoch()
    token = new_publisher_token()  # the publisher's; the sessions' calls need none
    handle = start_registry_actor(epoch, COHORT, publisher_token=token)
    try:
        registry = AsyncRegistryClient.for_actor(handle, publisher_token=token)
        async with Deployment(engines, stock_engine, fixtures, registry=registry, epoch=epoch) as w:
            tx, N = w.tx, 6
            assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
            name_a = w.name_of["A"]
            a_sessions = [await w.sm.open(f"SA{i}") for i in range(4)]
            for i, s in enumerate(a_sessions):
                await turn(tx, s, PROMPTS[i], N)
            assert {s.lora_path for s in a_sessions} == {name_a}
            res_b = await w.publish(snaps, "B")
            assert res_b.outcome is PublishOutcome.PUBLISHED, res_b
            name_b = w.name_of["B"]
            st = await w.status()
            states = {v.version_key.version_id: v.state for v in st.versions}
            assert states == {"A": VersionState.RETIRED, "B": VersionState.PUBLISHED}
            assert st.slots_used == 2 and st.default_lora_name == name_b

            a_ids = {}
            for (eid, c), engine in zip(w.clients.items(), engines, strict=True):
                a_ids[eid] = (await engine_versions(c, w.marker))[name_a].lora_id
                assert a_ids[eid] and unload_lines(engine.log_path, a_ids[eid]) == 0

            # --- C: refused by the registry before any data moves
            res_c = await w.publish(snaps, "C")
            name_c = w.name_of["C"]
            assert res_c.outcome is PublishOutcome.REFUSED and res_c.error is not None
            assert res_c.error.code is ErrorCode.CAPACITY_ERROR, res_c.error
            assert res_c.attempt_token is None and not res_c.steps
            assert not begins_for(w.clients.values(), name_c), "an engine saw a begin for C"
            for c in w.clients.values():
                assert name_c not in await engine_versions(c), "an engine knows C"
            assert (await w.version("C")) is None

            # --- A stays while sessions hold it; they keep working on A, a new one gets B
            assert await w.pub.reclaim_ready() == ()
            for i, s in enumerate(a_sessions):
                await turn(tx, s, [*PROMPTS[i], *TOOL_IDS], N, kind="tool")
            s_b = await w.sm.open("SB")
            await turn(tx, s_b, PROMPTS[0], N)
            assert s_b.lora_path == name_b
            assert (await w.version("A")).session_refs == 4
            for c in w.clients.values():
                assert (await engine_versions(c, w.marker))[name_a].state is S.READY_LOCAL

            # --- every A session closes (RFC 4.3): session refs reach 0, A stays loaded
            for s in a_sessions:
                view = await s.close()
                assert view.released
            assert (await w.version("A")).session_refs == 0

            # --- a request admitted on E0 is still decoding on A when the reclaim starts (session
            # refs are 0, the engine's native refs are not): the reclaim drains it, never cuts it.
            # It starts after the closes, right before the reclaim, so the window it must outlast
            # is one reclaim call's wait (1 s), not however long the closes take on a loaded host:
            # 400 tokens started before the closes once finished before the reclaim began.
            chunks: list[dict] = []
            admitted_tokens = 1200

            async def admitted_a() -> None:
                body = {
                    "input_ids": list(PROMPTS[0]),
                    "sampling_params": greedy(admitted_tokens),
                    "lora_path": name_a,
                }
                async for chunk in w.clients["E0"].generate_stream({**body, "rid": f"inflight-{epoch}"}):
                    chunks.append(chunk)

            in_flight = asyncio.create_task(admitted_a())
            await wait_until(
                lambda: len(chunks) >= 2 or in_flight.done(), what="the admitted A request decoding"
            )
            assert not in_flight.done(), "the admitted request ended too early to show the drain"
            done = await w.pub.reclaim_ready()
            await asyncio.wait_for(in_flight, 120)
            assert len(chunks[-1]["output_ids"]) == admitted_tokens, "the admitted request was cut"
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
            assert len(done) == 1 and done[0].done, done
            assert {e: str(o) for e, o in done[0].engines.items()} == {"E0": "UNLOADED", "E1": "UNLOADED"}
            e0_calls = [st.detail for st in done[0].steps if st.engine_id == "E0" and st.op == "reclaim"]
            assert e0_calls and not e0_calls[0].startswith("UNLOADED after 1 "), e0_calls  # DRAINING first
            assert (await w.status()).slots_used == 1
            for (eid, c), engine in zip(w.clients.items(), engines, strict=True):
                assert (await engine_versions(c, w.marker))[name_a].state is S.UNLOADED
                assert await await_unload_lines(engine.log_path, a_ids[eid], 1) == 1, (
                    f"{eid}: A must be unloaded once"
                )
            assert await w.pub.reclaim_ready() == ()  # nothing left to reclaim; no second unload
            # a late request naming A is refused by the engine (no fallback, no implicit reload)
            late_rid = f"late-{uuid.uuid4().hex[:8]}"
            with pytest.raises(LoraVersionError) as err:
                await w.clients["E0"].generate(
                    {
                        "rid": late_rid,
                        "input_ids": list(PROMPTS[0]),
                        "sampling_params": greedy(2),
                        "lora_path": name_a,
                    }
                )
            assert err.value.code is ErrorCode.VERSION_RECLAIMED
            for (eid, _c), engine in zip(w.clients.items(), engines, strict=True):
                assert unload_lines(engine.log_path, a_ids[eid]) == 1

            # --- C is accepted now; the default stays B until C commits (E1's end held)
            e1 = w.wrap("E1", Interceptor(w.clients["E1"]))
            gate = Gate()
            e1.on("end", gate)
            pub_c = asyncio.create_task(w.publish(snaps, "C"))
            await reach(gate, pub_c)
            assert (await w.version("C")).state is VersionState.LOADING
            assert (await w.status()).default_lora_name == name_b
            s_mid = await w.sm.open("SB_mid")
            await turn(tx, s_mid, PROMPTS[1], N)
            assert s_mid.lora_path == name_b
            gate.open()
            res_c = await asyncio.wait_for(pub_c, 120)
            assert res_c.outcome is PublishOutcome.PUBLISHED, res_c
            assert (await w.status()).default_lora_name == name_c
            s_c = await w.sm.open("SC")
            await turn(tx, s_c, PROMPTS[2], N)
            assert s_c.lora_path == name_c

            bad = await tx.mismatches(w.refs, w.adapter_of)
            assert not bad, bad
            assert_clean_audit(w.clients.values(), allow_failed_rids=[late_rid])
            await w.sm.close_all()
            done = await w.pub.reclaim_ready()
            assert [r.version_key.version_id for r in done if r.done] == ["B"]
    finally:
        ray_cluster.kill(handle, no_restart=True)


# ======================================================================= partial failure


async def a_traffic(w: Deployment, sessions: list[Session], until: asyncio.Task, n: int = 6) -> int:
    """Tool turns on every A session until ``until`` is done, then one more each."""
    turns = 0
    prefixes = {s.name: list(PROMPTS[i % len(PROMPTS)]) for i, s in enumerate(sessions)}
    while True:
        finished = until.done()
        outs = await asyncio.gather(*(turn(w.tx, s, prefixes[s.name], n) for s in sessions))
        for s, out in zip(sessions, outs, strict=True):
            prefixes[s.name] = [*prefixes[s.name], *out, *TOOL_IDS][-200:]
        turns += len(sessions)
        if finished:
            return turns


async def test_partial_failure_on_e1_cleans_both_engines_and_leaves_a_alone(
    engines, stock_engine, fixtures, snaps
) -> None:
    """A failure on E1 during buckets (a corrupted bucket: CHECKSUM_MISMATCH) and, separately,
    at end (a bucket lost in transport: end refuses with MANIFEST_MISMATCH, and the first
    cleanup on E1 is not confirmed): the default never moves, the candidate is cleaned on both
    engines, its slot is freed only once both confirmed, and A's sessions are unaffected."""
    async with Deployment(engines, stock_engine, fixtures) as w:
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        name_a = w.name_of["A"]
        sessions = [await w.sm.open(f"SA{i}") for i in range(2)]  # one per engine

        # --- (1) during buckets
        e1 = w.wrap("E1", Interceptor(w.clients["E1"]))
        e1.on("receive_bucket", corrupt_bucket(2))
        pub = asyncio.create_task(w.publish(snaps, "B", "B1"))
        await a_traffic(w, sessions, pub)
        res = await pub
        assert res.outcome is PublishOutcome.FAILED_CLEAN, res
        assert res.error is not None and res.error.code is ErrorCode.CHECKSUM_MISMATCH
        name_b1 = w.name_of["B1"]
        st = await w.status()
        assert st.default_lora_name == name_a and st.slots_used == 1 and st.pending_attempt is None
        assert (await w.version("B1")).state is VersionState.FAILED_CLEAN
        for c in w.clients.values():
            assert (await engine_versions(c, w.marker))[name_b1].state is S.CLEANED
            assert [e.outcome for e in c.audit.entries() if e.op == "cleanup"] == ["ok"]

        # --- (2) at end, with the first cleanup on E1 unconfirmed
        e1.on("receive_bucket", lose_bucket(2))
        fic = w.wrap("E1", FaultInjectingClient(e1).fail_before_send("cleanup", 1))
        pub = asyncio.create_task(w.publish(snaps, "B", "B2"))
        await a_traffic(w, sessions, pub)
        res = await pub
        name_b2 = w.name_of["B2"]
        assert res.outcome is PublishOutcome.CLEANUP_PENDING, res
        assert res.error is not None and res.error.code is ErrorCode.MANIFEST_MISMATCH
        view = await w.version("B2")
        assert view.state is VersionState.ABORTED and view.holds_slot
        assert view.attempt_phases == {"E0": AttemptPhase.CLEANED, "E1": AttemptPhase.UNKNOWN}
        st = await w.status()
        assert st.slots_used == 2 and st.default_lora_name == name_a
        on_e0 = await engine_versions(w.clients["E0"], w.marker)
        on_e1 = await engine_versions(w.clients["E1"], w.marker)
        assert on_e0[name_b2].state is S.CLEANED  # it was READY_LOCAL there: unloaded by cleanup
        assert on_e1[name_b2].state is S.PREPARED  # nothing freed on a guess
        # no new publication while the cleanup is unconfirmed; no engine sees its begin
        blocked = await w.publish(snaps, "C", "C1")
        assert blocked.outcome is PublishOutcome.REFUSED and blocked.error is not None
        assert blocked.error.code in (ErrorCode.OUTCOME_UNKNOWN, ErrorCode.PUBLICATION_IN_PROGRESS)
        assert not begins_for(w.clients.values(), w.name_of["C1"])
        # resolve: the cleanup reaches E1; only now is the slot freed
        settled = await w.pub.resolve()
        assert settled is not None and settled.outcome is PublishOutcome.FAILED_CLEAN, settled
        assert (await engine_versions(w.clients["E1"], w.marker))[name_b2].state is S.CLEANED
        st = await w.status()
        assert st.slots_used == 1 and st.default_lora_name == name_a and not st.unknown_outcomes
        assert [f.op for f in fic.injected] == ["cleanup"]

        # A's sessions were on A throughout, token for token
        await a_traffic(w, sessions, pub)
        assert all(lora_paths(s) == {name_a} for s in sessions)
        assert {r.engine_id for s in sessions for r in s.requests} == {"E0", "E1"}
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, bad
        assert_clean_audit(w.clients.values())


# ===================================================================== ambiguous outcome


@pytest.mark.parametrize("transport", ["http", "collective"])
async def test_ambiguous_outcome_holds_the_slot_until_resolved(
    engines, stock_engine, fixtures, snaps, transport
) -> None:
    """E1's reply is lost (the REAL client's call goes through; only the Nth reply is dropped):
    first a bucket reply during A's bootstrap, then B's end reply. The slot stays held, nothing is
    cleaned or freed on a guess, no new publication starts; resolve() asks E1 and the protocol
    goes on to commit. Over the collective transport the resolution sends no bucket twice."""
    async with Deployment(engines, stock_engine, fixtures, transport=transport) as w:
        # --- bootstrap A; E1's first bucket reply is lost
        fic = w.wrap("E1", FaultInjectingClient(w.clients["E1"]).drop_reply("receive_bucket", 1))
        res = await w.publish(snaps, "A")
        name_a = w.name_of["A"]
        assert res.outcome is PublishOutcome.OUTCOME_UNKNOWN and res.unknown == ("E1",), res
        assert [(f.op, f.real_outcome) for f in fic.injected] == [("receive_bucket", "ok")]
        st = await w.status()
        assert (
            st.default is None and st.slots_used == 1 and [u.engine_id for u in st.unknown_outcomes] == ["E1"]
        )
        on_e1 = await engine_versions(w.clients["E1"], w.marker)
        assert on_e1[name_a].state is S.PREPARED and on_e1[name_a].buckets_received == 1
        s0 = await w.sm.open("S0")
        with pytest.raises(LoraVersionError) as err:
            await s0.generate({"input_ids": list(PROMPTS[0]), "sampling_params": greedy(4)})
        assert err.value.code is ErrorCode.NO_PUBLISHED_VERSION
        blocked = await w.publish(snaps, "B", "Bx")
        assert blocked.outcome is PublishOutcome.REFUSED and blocked.error.code is ErrorCode.OUTCOME_UNKNOWN
        assert not begins_for(w.clients.values(), w.name_of["Bx"])
        settled = await w.pub.resolve()
        assert settled is not None and settled.outcome is PublishOutcome.PUBLISHED, settled
        assert (await w.status()).default_lora_name == name_a

        # --- A serves; B's end reply from E1 is lost while A sessions generate
        sessions = [s0, await w.sm.open("S1")]
        fic = w.wrap("E1", FaultInjectingClient(w.clients["E1"]).drop_reply("end", 1))
        pub = asyncio.create_task(w.publish(snaps, "B"))
        await a_traffic(w, sessions, pub)
        res = await pub
        name_b = w.name_of["B"]
        assert res.outcome is PublishOutcome.OUTCOME_UNKNOWN and res.unknown == ("E1",), res
        assert [(f.op, f.real_outcome) for f in fic.injected] == [("end", "ok")]
        view = await w.version("B")
        assert view.state is VersionState.LOADING and view.attempt_phases["E1"] is AttemptPhase.UNKNOWN
        st = await w.status()
        assert st.slots_used == 2 and st.default_lora_name == name_a
        for c in w.clients.values():  # really loaded on both; nothing cleaned on a guess
            assert (await engine_versions(c, w.marker))[name_b].state is S.READY_LOCAL
            assert not [e for e in c.audit.entries() if e.op == "cleanup"]
        with pytest.raises(LoraVersionError) as err:
            await w.reg_call(
                "commit", version_key=w.key("B"), attempt_token=res.attempt_token, expected_default_revision=1
            )
        assert err.value.code is ErrorCode.OUTCOME_UNKNOWN
        blocked = await w.publish(snaps, "C")
        assert blocked.outcome is PublishOutcome.REFUSED and blocked.error.code is ErrorCode.OUTCOME_UNKNOWN
        assert not begins_for(w.clients.values(), w.name_of["C"])
        s_new = await w.sm.open("S_before")
        await turn(w.tx, s_new, PROMPTS[2], 6)
        assert s_new.lora_path == name_a

        settled = await w.pub.resolve()
        assert settled is not None and settled.outcome is PublishOutcome.PUBLISHED, settled
        e1_ops = [(s.op, s.detail) for s in settled.steps if s.engine_id == "E1"]
        assert ("version_status", "READY") in e1_ops and not any(op == "end" for op, _ in e1_ops), e1_ops
        st = await w.status()
        assert st.default_lora_name == name_b and not st.unknown_outcomes
        s_after = await w.sm.open("S_after")
        await turn(w.tx, s_after, PROMPTS[3], 6)
        assert s_after.lora_path == name_b
        await a_traffic(w, sessions, pub)
        assert all(lora_paths(s) == {name_a} for s in sessions)
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, bad
        assert_clean_audit(w.clients.values())
        await w.sm.close_all()
        assert [r.version_key.version_id for r in await w.pub.reclaim_ready() if r.done] == ["A"]


# ========================================================================== live traffic


def _gaps(streams: list[dict], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens of one stream that overlap [lo, hi]."""
    out = []
    for st in streams:
        ts = st["t"]
        out.extend(b - a for a, b in itertools.pairwise(ts) if b >= lo and a <= hi)
    return out


async def test_live_traffic_keeps_decoding_on_both_engines_during_publication(
    engines, stock_engine, fixtures, snaps, run_dir
) -> None:
    """8 A-bound sessions stream on E0/E1 while B is published: tokens keep arriving on both
    engines during the publication, no request fails, no pause/flush/abort-all; the largest gap
    between tokens during the publication is reported next to the same run's gap without."""
    async with Deployment(engines, stock_engine, fixtures) as w:
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        name_a = w.name_of["A"]
        sessions = [await w.sm.open(f"L{i}") for i in range(8)]
        streams: list[dict] = []
        stop = asyncio.Event()

        async def loop(i: int, s: Session) -> None:
            prefix = list(PROMPTS[i % len(PROMPTS)])
            while not stop.is_set():
                rec = {"session": s.name, "t": [], "n": 0}
                streams.append(rec)
                async for chunk in s.generate_stream({"input_ids": prefix, "sampling_params": greedy(16)}):
                    rec["t"].append(time.monotonic())
                    rec["n"] = len(chunk["output_ids"])
                    rec["engine"] = w.sm.router.pick(s.key)  # sticky: the engine serving it
                    last = chunk["output_ids"]
                assert rec["n"] == 16
                prefix = [*prefix, *last, *TOOL_IDS][-96:]

        tasks = [asyncio.create_task(loop(i, s)) for i, s in enumerate(sessions)]
        try:
            await wait_until(lambda: len(streams) >= 16, 120, "every session streaming")
            base_lo = time.monotonic()
            await asyncio.sleep(4.0)
            base_hi = time.monotonic()
            await asyncio.sleep(1.0)  # apart, so one long gap is not counted in both windows
            pub_lo = time.monotonic()
            res = await w.publish(snaps, "B")
            pub_hi = time.monotonic()
            assert res.outcome is PublishOutcome.PUBLISHED, res
            s_new = await w.sm.open("L_new")
            await turn(w.tx, s_new, PROMPTS[0], 8)
            assert s_new.lora_path == w.name_of["B"]
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors

        base_gaps = _gaps(streams, base_lo, base_hi)
        pub_gaps = _gaps(streams, pub_lo, pub_hi)
        per_engine = {
            e: sum(1 for st in streams if st.get("engine") == e for t in st["t"] if pub_lo <= t <= pub_hi)
            for e in COHORT
        }
        report = {
            "sessions": len(sessions),
            "requests": len(streams),
            "publication_s": round(pub_hi - pub_lo, 3),
            "publish_phase_s": {k: round(v, 3) for k, v in res.phase_s.items()},
            "max_gap_without_publication_ms": round(1000 * max(base_gaps), 1),
            "max_gap_during_publication_ms": round(1000 * max(pub_gaps), 1),
            "median_gap_without_publication_ms": round(1000 * statistics.median(base_gaps), 1),
            "median_gap_during_publication_ms": round(1000 * statistics.median(pub_gaps), 1),
            "tokens_during_publication_per_engine": per_engine,
            "baseline_window_s": round(base_hi - base_lo, 3),
        }
        write_json(run_dir / "e2e_live_traffic.json", report)
        print("\n[live traffic] " + json.dumps(report))
        assert all(n > 0 for n in per_engine.values()), f"an engine stopped decoding: {per_engine}"
        limit_ms = max(5 * report["max_gap_without_publication_ms"], 2000)
        assert report["max_gap_during_publication_ms"] < limit_ms, report
        assert all(lora_paths(s) == {name_a} for s in sessions)
        assert_clean_audit(w.clients.values())


# ======================================================================= engine restart


RESTART_TESTS = {
    "test_a_cohort_of_three_engines_publishes_serves_and_reclaims",
    "test_engine_restart_between_ready_and_commit_is_not_committed_until_ready_again",
    "test_engine_killed_between_ready_and_commit_blocks_the_commit_until_it_answers",
    "test_engine_killed_after_commit_serves_its_sessions_exact_versions_again",
}


@pytest.fixture(scope="module", autouse=True)
def _spare_boots_early(request):
    """The session's spare engine (conftest.py), spawned as soon as this module starts so that
    it boots while the other tests run (only when a restart test is selected)."""
    if any(item.name in RESTART_TESTS for item in request.session.items):
        request.getfixturevalue("spare_engine")


async def test_a_cohort_of_three_engines_publishes_serves_and_reclaims(
    engines, stock_engine, fixtures, snaps, spare_engine
) -> None:
    """N engines, N = 3: A and B are staged on E0, E1 and E2 and committed only when all three
    are READY; C is refused at capacity; the A sessions spread over the three engines stay on A
    and equal the baselines; once they close, A is reclaimed with one unload per engine."""
    e2 = await asyncio.to_thread(spare_engine.take)
    cohort = ("E0", "E1", "E2")
    async with Deployment((*engines, e2), stock_engine, fixtures, cohort=cohort) as w:
        res_a = await w.publish(snaps, "A")
        assert res_a.outcome is PublishOutcome.PUBLISHED
        assert w.reg.version(w.key("A")).attempt_phases == dict.fromkeys(cohort, AttemptPhase.READY)
        s_a = [await w.sm.open(f"S{i}") for i in range(3)]  # round robin: one per engine
        for i, s in enumerate(s_a):
            await turn(w.tx, s, PROMPTS[i], 8)
        assert {s.requests[-1].engine_id for s in s_a} == set(cohort)
        assert (await w.publish(snaps, "B")).outcome is PublishOutcome.PUBLISHED
        refused = await w.publish(snaps, "C")
        assert refused.error is not None and refused.error.code is ErrorCode.CAPACITY_ERROR
        for i, s in enumerate(s_a):
            await turn(w.tx, s, [*PROMPTS[i], *TOOL_IDS], 8, kind="tool")
        assert all(lora_paths(s) == {w.name_of["A"]} for s in s_a)
        assert not await w.tx.mismatches(w.refs, w.adapter_of)
        for s in s_a:
            await s.close()
        done = await w.pub.reclaim_ready()
        assert [r.version_key for r in done if r.done] == [w.key("A")]
        assert set(done[0].engines) == set(cohort)
        assert {o.state.value for o in done[0].engines.values()} == {"UNLOADED"}
        views = {eid: await engine_versions(c, w.marker) for eid, c in w.clients.items()}
        assert all(v[w.name_of["A"]].state is S.UNLOADED for v in views.values())


async def test_engine_restart_between_ready_and_commit_is_not_committed_until_ready_again(
    engines, stock_engine, fixtures, snaps, run_dir, spare_engine
) -> None:
    """Cohort E0 + E2 (a third engine started here). B is READY on both; E2 restarts before the
    commit (same port, new incarnation): the commit is refused (NOT_ALL_READY; the old READY is
    STALE_INCARNATION) until E2 is READY again in its new incarnation, then it commits."""
    from lora_versions_dev.launcher import start_engine, stop_engine

    e2 = await asyncio.to_thread(spare_engine.take)
    async with Deployment((engines[0], e2), stock_engine, fixtures, cohort=("E0", "E2")) as w:
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        name_a = w.name_of["A"]
        s_a = {label: await w.sm.open(label) for label in ("SA_E0", "SA_E2")}
        for i, s in enumerate(s_a.values()):
            await turn(w.tx, s, PROMPTS[i], 6)
        assert {w.sm.router.pick(s.key) for s in s_a.values()} == {"E0", "E2"}
        old_inc = (await w.clients["E2"].status()).incarnation

        # B READY on both; the publisher is held just before its pre-commit incarnation check
        e2w = w.wrap("E2", Interceptor(w.clients["E2"]))
        gate = Gate()
        e2w.on("status", gate)
        pub = asyncio.create_task(w.publish(snaps, "B"))
        await reach(gate, pub)
        name_b = w.name_of["B"]
        view = await w.version("B")
        assert dict(view.attempt_phases) == {"E0": AttemptPhase.READY, "E2": AttemptPhase.READY}

        # E2 restarts on the same port: a new incarnation that holds nothing
        await asyncio.to_thread(stop_engine, e2)
        t0 = time.monotonic()
        e2 = await asyncio.to_thread(start_engine, spare_engine.spec(e2.port, "-restarted"))
        spare_engine.engine = e2  # the fixture stops whichever process runs now
        restart_s = time.monotonic() - t0
        new_inc = (await w.clients["E2"].status()).incarnation
        assert new_inc != old_inc and not await engine_versions(w.clients["E2"], w.marker)
        gate.open()
        res = await asyncio.wait_for(pub, 120)
        assert res.outcome is PublishOutcome.NOT_COMMITTED, res
        assert res.error is not None and res.error.code is ErrorCode.NOT_ALL_READY, res.error
        st = await w.status()
        assert st.engines["E2"] == new_inc and st.default_lora_name == name_a
        assert (await w.version("B")).attempt_phases["E2"] is AttemptPhase.NONE
        # asking again does not help, and the READY of the old incarnation never counts
        with pytest.raises(LoraVersionError) as err:
            await w.reg_call(
                "commit", version_key=w.key("B"), attempt_token=res.attempt_token, expected_default_revision=1
            )
        assert err.value.code is ErrorCode.NOT_ALL_READY
        from relax_glue.registry_types import ReadyEvidence

        with pytest.raises(LoraVersionError) as err:
            await w.reg_call(
                "record_ready",
                engine_id="E2",
                receipt=ReadyEvidence(w.key("B"), res.digest, res.attempt_token, old_inc),
            )
        assert err.value.code is ErrorCode.STALE_INCARNATION
        # the A session routed to E2 gets a version error, never the base model
        with pytest.raises(LoraVersionError) as err:
            await s_a["SA_E2"].generate({"input_ids": list(PROMPTS[1]), "sampling_params": greedy(4)})
        assert err.value.code is ErrorCode.UNKNOWN_VERSION
        lost_rid = s_a["SA_E2"].requests[-1].rid

        # resolve (the same publisher still holds B's snapshot): E2 knows nothing of B, so it is
        # driven again from begin in its new incarnation; then the commit
        e2w.on("status", None)
        settled = await w.pub.resolve()
        assert settled is not None and settled.outcome is PublishOutcome.PUBLISHED, settled
        on_e2 = await engine_versions(w.clients["E2"], w.marker)
        assert on_e2[name_b].state is S.READY_LOCAL and on_e2[name_b].incarnation == new_inc
        assert (await w.status()).default_lora_name == name_b
        s_b = {label: await w.sm.open(label) for label in ("SB_E0", "SB_E2")}
        for i, s in enumerate(s_b.values()):
            await turn(w.tx, s, PROMPTS[i], 6)
            assert s.lora_path == name_b
        await turn(w.tx, s_a["SA_E0"], [*PROMPTS[0], *TOOL_IDS], 6, kind="tool")
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, bad
        assert_clean_audit(w.clients.values(), allow_failed_rids=[lost_rid])
        # A retires: E0 unloads it, the restarted E2 never had it (its UNLOADED is authoritative)
        await w.sm.close_all()
        done = await w.pub.reclaim_ready()
        assert [r.version_key.version_id for r in done if r.done] == ["A"], done
        print(f"\n[restart] E2 restarted in {restart_s:.1f}s; incarnation {old_inc[:8]} -> {new_inc[:8]}")


async def test_engine_killed_between_ready_and_commit_blocks_the_commit_until_it_answers(
    engines, stock_engine, fixtures, snaps, run_dir, spare_engine
) -> None:
    """Issue 9 (1) on real engines. B is READY on E0 and E2; E2 is SIGKILLed before the commit and
    cannot answer the pre-commit read: no commit (OUTCOME_UNKNOWN), A stays the default and B
    keeps its slot. While E2 boots again on the same port, resolve() still cannot commit; once it
    serves (a new incarnation that holds nothing), resolve() drives B onto it and commits.
    Before the fix the unanswered read was "no news" and B was committed with E2 holding nothing."""
    import os
    import signal

    from lora_versions_dev.launcher import spawn_engine

    e2 = await asyncio.to_thread(spare_engine.take)
    async with Deployment((engines[0], e2), stock_engine, fixtures, cohort=("E0", "E2")) as w:
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        name_a = w.name_of["A"]
        e2w = w.wrap("E2", Interceptor(w.clients["E2"]))
        gate = Gate()
        e2w.on("status", gate)  # the pre-commit read
        pub = asyncio.create_task(w.publish(snaps, "B"))
        await reach(gate, pub)
        assert dict((await w.version("B")).attempt_phases) == {
            "E0": AttemptPhase.READY,
            "E2": AttemptPhase.READY,
        }

        os.killpg(e2.proc.pid, signal.SIGKILL)  # the whole engine, no goodbye
        await asyncio.to_thread(e2.proc.wait, 60)
        gate.open()
        res = await asyncio.wait_for(pub, 120)
        assert res.outcome is PublishOutcome.OUTCOME_UNKNOWN and res.unknown == ("E2",), res
        st = await w.status()
        assert st.default_lora_name == name_a and (await w.version("B")).state is VersionState.LOADING
        assert (await w.version("B")).attempt_phases["E2"] is AttemptPhase.UNKNOWN

        e2w.on("status", None)
        e2 = await asyncio.to_thread(spawn_engine, spare_engine.spec(e2.port, "-killed"))
        spare_engine.engine = e2  # the fixture stops whichever process runs now
        booting = await w.pub.resolve()  # E2 is still booting: still nothing to commit on
        assert booting is not None and booting.outcome is PublishOutcome.OUTCOME_UNKNOWN, booting
        assert (await w.status()).default_lora_name == name_a

        await asyncio.to_thread(e2.wait_healthy, 300.0)
        settled = await w.pub.resolve()
        assert settled is not None and settled.outcome is PublishOutcome.PUBLISHED, settled
        on_e2 = await engine_versions(w.clients["E2"], w.marker)
        assert on_e2[w.name_of["B"]].state is S.READY_LOCAL
        assert (await w.status()).default_lora_name == w.name_of["B"]
        assert_clean_audit(w.clients.values())


async def test_engine_killed_after_commit_serves_its_sessions_exact_versions_again(
    engines, stock_engine, fixtures, snaps, run_dir, spare_engine, tmp_path
) -> None:
    """Issue 9 (2) on real engines. Cohort E0 + E2; A committed, sessions on A on both engines;
    B committed, sessions on B on both engines. E2 is SIGKILLed and started again (a new
    incarnation that holds nothing). The next turn of each E2 session is refused before
    admission (UNKNOWN_VERSION: never the base model), its recovery hook runs the reconciler,
    which stages B (the default) and then A (retired, still held by sessions) onto E2 from the
    on-disk snapshot store, and the same request is sent again: every turn, before and after
    the restart, equals the baseline of its bound version with the full prefix, and the
    restored turns also equal the HF transformers + PEFT reference. Then A is reclaimed: one
    unload per engine, and the store keeps only B.
    Without the reconciler (before this change) the E2 sessions got UNKNOWN_VERSION for the
    rest of their lives."""
    import os
    import signal

    from lora_versions_dev.launcher import spawn_engine
    from lora_versions_dev.reference import greedy_tokens
    from relax_glue.snapshot_store import SnapshotStore

    e2 = await asyncio.to_thread(spare_engine.take)
    store = SnapshotStore(tmp_path / "snapshots")
    async with Deployment((engines[0], e2), stock_engine, fixtures, cohort=("E0", "E2"), store=store) as w:
        reconciles = w.restore_on_version_missing()
        assert (await w.publish(snaps, "A")).outcome is PublishOutcome.PUBLISHED
        s_a = {label: await w.sm.open(label) for label in ("SA_E0", "SA_E2")}
        out_a = {}
        for i, s in enumerate(s_a.values()):
            out_a[s.name] = await turn(w.tx, s, PROMPTS[i], 6)
        assert (await w.publish(snaps, "B")).outcome is PublishOutcome.PUBLISHED
        s_b = {label: await w.sm.open(label) for label in ("SB_E0", "SB_E2")}
        out_b = {}
        for i, s in enumerate(s_b.values()):
            out_b[s.name] = await turn(w.tx, s, PROMPTS[i], 6)
        route = {s.name: w.sm.router.pick(s.key) for s in (*s_a.values(), *s_b.values())}
        assert route == {"SA_E0": "E0", "SA_E2": "E2", "SB_E0": "E0", "SB_E2": "E2"}, route
        assert store.digests() == {snaps["A"].digest, snaps["B"].digest}
        old_inc = (await w.clients["E2"].status()).incarnation

        os.killpg(e2.proc.pid, signal.SIGKILL)  # the whole engine, no goodbye
        await asyncio.to_thread(e2.proc.wait, 60)
        e2 = await asyncio.to_thread(spawn_engine, spare_engine.spec(e2.port, "-after-commit"))
        spare_engine.engine = e2  # the fixture stops whichever process runs now
        await asyncio.to_thread(e2.wait_healthy, 300.0)
        new_inc = (await w.clients["E2"].status()).incarnation
        assert new_inc != old_inc and not await engine_versions(w.clients["E2"], w.marker)

        # The next turn of every session: tool output appended to the full prefix.
        restored_turns = []
        for i, s in enumerate([*s_a.values(), *s_b.values()]):
            prior = out_a.get(s.name) or out_b[s.name]
            prefix = [*PROMPTS[i % 2], *prior, *TOOL_IDS]
            tokens = await turn(w.tx, s, prefix, 6, kind="tool")
            restored_turns.append((s, prefix, tokens))
        assert reconciles == ["E2"], reconciles  # one recovery, by the first E2 turn
        assert s_a["SA_E2"].resends == 1 and s_a["SA_E0"].resends == 0
        on_e2 = await engine_versions(w.clients["E2"], w.marker)
        assert {n: (v.state, v.incarnation) for n, v in on_e2.items()} == {
            w.name_of["A"]: (S.READY_LOCAL, new_inc),
            w.name_of["B"]: (S.READY_LOCAL, new_inc),
        }
        begins = [e.detail for e in begins_for([w.clients["E2"]], w.name_of["B"])]
        assert begins, "B was staged onto the restarted E2"
        for s in (*s_a.values(), *s_b.values()):
            assert lora_paths(s) == {s.lora_path}, (s.name, lora_paths(s))  # one exact version each
        bad = await w.tx.mismatches(w.refs, w.adapter_of)
        assert not bad, w.tx.table(w.adapter_of)
        for s, prefix, tokens in restored_turns:
            adapter = fixtures.adapter_dir(w.adapter_of[s.lora_path])
            ref = await asyncio.to_thread(greedy_tokens, fixtures.model_dir, adapter, prefix, 6)
            assert tokens == ref, (s.name, tokens, ref)
        refused_rid = [r.rid for r in s_a["SA_E2"].requests][-1]
        assert_clean_audit(w.clients.values(), allow_failed_rids=[refused_rid])

        # A is reclaimed: both engines unload it once (E2 holds the restored copy).
        await w.sm.close_all()
        done = await w.pub.reclaim_ready()
        assert [r.version_key.version_id for r in done if r.done] == ["A"], done
        for client in w.clients.values():  # unloaded on both (E2: the copy the reconciler restored)
            assert (await engine_versions(client, w.marker))[w.name_of["A"]].state is S.UNLOADED
        assert store.digests() == {snaps["B"].digest}
        print(
            f"\n[restore] E2 {old_inc[:8]} -> {new_inc[:8]}; restored {sorted(on_e2)}; "
            f"{len(restored_turns)} turns equal their references"
        )
