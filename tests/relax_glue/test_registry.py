"""Unit tests of the pure registry: predicates, validation, idempotency, queries, dump/load."""

from __future__ import annotations

import pickle

import pytest
from _rg_helpers import EPOCH, Publisher, digest, lora_name, new_registry, refused, sk, vk

from relax_glue.registry import _TRANSITIONS, LoRAVersionRegistry, holds_slot, may_start_reclaim
from relax_glue.registry_types import (
    AttemptPhase,
    CleanupEvidence,
    PreparedEvidence,
    ReadyEvidence,
    SessionKey,
    UnloadEvidence,
    VersionKey,
    VersionRecord,
    VersionState,
    dumps,
    loads,
)
from sglang_ext.errors import HTTP_STATUS, ErrorCode, LoraVersionError

# ------------------------------------------------------------------------------ predicates


def test_holds_slot_is_false_only_for_the_two_terminal_states() -> None:
    free = {s for s in VersionState if not holds_slot(s)}
    assert free == {VersionState.FAILED_CLEAN, VersionState.RECLAIMED}


def test_terminal_states_have_no_way_out() -> None:
    for state in VersionState:
        assert (not _TRANSITIONS[state]) == (not holds_slot(state))


@pytest.mark.parametrize("state", list(VersionState))
@pytest.mark.parametrize("refs", [0, 1])
def test_may_start_reclaim_only_retired_without_session_refs(state: VersionState, refs: int) -> None:
    rec = VersionRecord(vk("A"), digest("A"), "n", "t", state, {}, session_refs=refs)
    assert may_start_reclaim(rec) == (state is VersionState.RETIRED and refs == 0)


def test_every_error_code_has_an_http_status_and_errors_pickle() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    err = LoraVersionError(ErrorCode.VERSION_IN_USE, "busy", session_refs=2)
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.message, back.details, back.http_status) == (
        err.code,
        "busy",
        {"session_refs": 2},
        409,
    )


# ------------------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("engines", "capacity"),
    [((), 2), (("E0", "E0"), 2), (("E0",), 0), (("E0",), True), ("E0", 2), (("",), 2)],
)
def test_constructor_refuses_bad_cohort_or_capacity(engines: tuple[str, ...], capacity: int) -> None:
    with pytest.raises((ValueError, LoraVersionError)):
        LoRAVersionRegistry(EPOCH, engines, capacity)


def test_int_epoch_is_normalised_to_the_wire_string() -> None:
    reg = LoRAVersionRegistry(7, ["E0"])
    assert reg.epoch == "7"
    assert reg.version((7, "A")) is None  # an int epoch in a key is accepted too


@pytest.mark.parametrize("n_engines", [1, 3])
def test_any_cohort_size_needs_every_engine_ready(n_engines: int) -> None:
    engines = tuple(f"E{i}" for i in range(n_engines))
    reg = new_registry(engines=engines)
    pub = Publisher(reg)
    pub.reserve("A")
    for engine in engines[:-1]:
        pub.ready("A", engine)
    if n_engines > 1:
        refused(ErrorCode.NOT_ALL_READY, pub.commit, "A")
    pub.ready("A", engines[-1])
    pub.commit("A")
    assert reg.status().default == vk("A")


def test_capacity_one_and_three() -> None:
    one = new_registry(capacity=1)
    pub = Publisher(one)
    pub.publish("A")
    refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "B")  # A must go before anything else loads

    three = new_registry(capacity=3)
    pub = Publisher(three)
    for vid in ("A", "B", "C"):
        pub.publish(vid)
    assert [v.state for v in three.status().versions] == [
        VersionState.RETIRED,
        VersionState.RETIRED,
        VersionState.PUBLISHED,
    ]
    refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "D")


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("key", "dig", "name", "request_id"),
    [
        (("8", "A"), digest("A"), lora_name("A", digest("A")), "r"),  # other epoch
        ((EPOCH, "A-1"), digest("A"), "x", "r"),  # '-' is not allowed in a version id
        ((EPOCH, ""), digest("A"), "x", "r"),
        ((EPOCH,), digest("A"), "x", "r"),
        ((EPOCH, "A"), "abc", "x", "r"),  # not a sha256 hex digest
        ((EPOCH, "A"), digest("A").upper(), "x", "r"),
        ((EPOCH, "A"), digest("A"), "base:adapter", "r"),  # ':' splits OpenAI model names
        ((EPOCH, "A"), digest("A"), "with space", "r"),
        ((EPOCH, "A"), digest("A"), "", "r"),
        ((EPOCH, "A"), digest("A"), "x", ""),
        ((EPOCH, "A"), digest("A"), "x", None),
    ],
)
def test_reserve_refuses_malformed_input(key: tuple, dig: str, name: str, request_id: str) -> None:
    reg = new_registry()
    refused(ErrorCode.INVALID_REQUEST, reg.reserve, key, dig, name, request_id)
    assert reg.status().seq == 0


def test_request_id_reused_with_other_arguments_is_refused() -> None:
    reg = new_registry()
    reg.reserve(vk("A"), digest("A"), lora_name("A", digest("A")), "r1")
    refused(ErrorCode.INVALID_REQUEST, reg.reserve, vk("B"), digest("B"), lora_name("B", digest("B")), "r1")


def test_lora_name_is_unique_and_bound_to_its_version() -> None:
    reg = new_registry(capacity=3)
    dig = digest("A")
    reg.reserve(vk("A"), dig, lora_name("A", dig), "r1")
    refused(ErrorCode.VERSION_CONFLICT, reg.reserve, vk("A"), dig, "other-name", "r2")
    # the name check comes before the pending-attempt check: the conflict is the real problem
    refused(ErrorCode.VERSION_CONFLICT, reg.reserve, vk("B"), digest("B"), lora_name("A", dig), "r3")


def test_unknown_engine_and_unregistered_incarnation_are_refused() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    res = pub.reserve("A")
    receipt = ReadyEvidence(vk("A"), res.digest, res.attempt_token, "E9-i1")
    refused(ErrorCode.UNKNOWN_ENGINE, reg.record_ready, "E9", receipt)
    refused(ErrorCode.UNKNOWN_ENGINE, reg.register_engine_incarnation, "E9", "E9-i1")
    refused(ErrorCode.STALE_INCARNATION, reg.record_ready, "E0", receipt)
    refused(ErrorCode.INVALID_REQUEST, reg.record_ready, "E0", {"attempt_token": res.attempt_token})
    refused(ErrorCode.INVALID_REQUEST, reg.register_engine_incarnation, "E0", "bad incarnation!")


def test_receipt_for_another_version_or_unknown_token_is_stale_attempt() -> None:
    reg = new_registry(capacity=3)
    pub = Publisher(reg)
    pub.publish("A")
    res = pub.reserve("B")
    inc = pub.incarnation["E0"]
    refused(
        ErrorCode.STALE_ATTEMPT,
        reg.record_ready,
        "E0",
        ReadyEvidence(vk("A"), res.digest, res.attempt_token, inc),
    )
    refused(ErrorCode.STALE_ATTEMPT, reg.record_prepared, "E0", PreparedEvidence(vk("B"), "att-nope", inc))
    refused(ErrorCode.STALE_ATTEMPT, reg.abort, "att-nope", "x")
    refused(ErrorCode.STALE_ATTEMPT, reg.commit, vk("B"), "att-nope", 1)
    refused(ErrorCode.UNKNOWN_VERSION, reg.commit, vk("Z"), res.attempt_token, 1)
    refused(ErrorCode.STALE_ATTEMPT, reg.mark_engine_unknown, "E0", "att-nope", "end", "x")


def test_cleanup_needs_abort_first_and_matching_token() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    tok = pub.token("A")
    refused(ErrorCode.INVALID_REQUEST, reg.record_cleanup, "E0", tok, CleanupEvidence(tok, "E0-i1"))
    reg.abort(tok, "x")
    refused(ErrorCode.INVALID_REQUEST, reg.record_cleanup, "E0", tok, CleanupEvidence("att-other", "E0-i1"))
    refused(ErrorCode.STALE_INCARNATION, reg.record_cleanup, "E0", tok, CleanupEvidence(tok, "E0-i9"))
    # a cleanup confirmed by an earlier (registered) incarnation still counts
    pub.restart("E0")
    reg.record_cleanup("E0", tok, CleanupEvidence(tok, "E0-i1"))
    assert reg.version(vk("A")).attempt_phases["E0"] is AttemptPhase.CLEANED


def test_commit_with_wrong_revision_is_default_revision_conflict() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    pub.ready("B", "E0")
    pub.ready("B", "E1")
    err = refused(ErrorCode.DEFAULT_REVISION_CONFLICT, pub.commit, "B", 0)
    assert err.details["default_revision"] == 1
    refused(ErrorCode.INVALID_REQUEST, pub.commit, "B", "1")
    assert pub.commit("B", 1).default_revision == 2


def test_claim_reclaim_of_non_retired_versions() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    refused(ErrorCode.UNKNOWN_VERSION, reg.claim_reclaim, vk("A"))
    pub.reserve("A")
    refused(ErrorCode.INVALID_REQUEST, reg.claim_reclaim, vk("A"))  # LOADING
    reg.abort(pub.token("A"), "x")
    refused(ErrorCode.INVALID_REQUEST, reg.claim_reclaim, vk("A"))  # ABORTED


def test_session_key_of_another_epoch_is_refused() -> None:
    reg = new_registry()
    refused(ErrorCode.INVALID_REQUEST, reg.bind_first, SessionKey("8", "s"))
    refused(ErrorCode.INVALID_REQUEST, reg.begin_close, ("7",))
    refused(ErrorCode.INVALID_REQUEST, reg.open_session, ("7", ""))


# ------------------------------------------------------------------------------ idempotency


def test_prepared_then_ready_then_late_prepared() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    first = pub.prepared("A", "E0")
    assert first.phase == "PREPARED" and first.confirmed == ("E0",)
    assert pub.prepared("A", "E0") == first
    pub.ready("A", "E0")
    seq = reg.status().seq
    pub.prepared("A", "E0")  # a late begin reply: READY is kept
    assert reg.status().seq == seq
    assert reg.version(vk("A")).attempt_phases["E0"] is AttemptPhase.READY


def test_unknown_mark_drops_ready_until_a_fresh_ready() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    pub.ready("A", "E0")
    pub.ready("A", "E1")
    ack = reg.mark_engine_unknown("E1", pub.token("A"), "probe", "lost contact")
    assert ack.phase == "UNKNOWN" and not ack.complete
    assert reg.mark_engine_unknown("E1", pub.token("A"), "probe", "again") == ack
    refused(ErrorCode.OUTCOME_UNKNOWN, pub.commit, "A")
    pub.prepared("A", "E1")  # PREPARED does not resolve an unknown outcome
    assert reg.version(vk("A")).attempt_phases["E1"] is AttemptPhase.UNKNOWN
    pub.ready("A", "E1")  # the same READY again resolves it
    assert reg.status().unknown_outcomes == ()
    pub.commit("A")
    refused(ErrorCode.STALE_ATTEMPT, reg.mark_engine_unknown, "E1", pub.token("A"), "x", "y")


def test_incarnation_registration_is_idempotent_and_only_moves_forward() -> None:
    reg = new_registry()
    first = reg.register_engine_incarnation("E0", "a")
    assert first.previous is None and first.invalidated == ()
    assert reg.register_engine_incarnation("E0", "a") == first
    second = reg.register_engine_incarnation("E0", "b")
    assert second.previous == "a"
    refused(ErrorCode.STALE_INCARNATION, reg.register_engine_incarnation, "E0", "a")
    assert reg.status().engines == {"E0": "b", "E1": None}


def test_restart_invalidates_prepared_and_keeps_unknown() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    pub.prepared("A", "E0")
    reg.mark_engine_unknown("E1", pub.token("A"), "begin", "timeout")
    r0 = reg.register_engine_incarnation("E0", "E0-i2")
    r1 = reg.register_engine_incarnation("E1", "E1-i2")
    assert r0.invalidated == (pub.token("A"),) and r1.invalidated == ()
    phases = reg.version(vk("A")).attempt_phases
    assert phases == {"E0": AttemptPhase.NONE, "E1": AttemptPhase.UNKNOWN}


def test_replays_write_no_transition() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk("s"))
    seq = reg.status().seq
    pub.commit("A", 0)
    reg.bind_first(sk("s"))
    pub.ready("A", "E0")
    reg.register_engine_incarnation("E0", pub.incarnation["E0"])
    assert reg.status().seq == seq


def test_a_replayed_close_and_a_duplicate_ready_while_loading_write_no_transition() -> None:
    """Issue 10 (a mutation the suite missed): both replays must leave the journal sequence."""
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk("s"))
    reg.close_and_release(sk("s"))
    seq = reg.status().seq
    again = reg.close_and_release(sk("s"))
    assert reg.status().seq == seq and again.released and reg.version(vk("A")).session_refs == 0
    pub.reserve("B")
    pub.prepared("B", "E0")
    pub.ready("B", "E0")  # B LOADING, READY on E0 only
    seq = reg.status().seq
    ack = pub.ready("B", "E0")
    assert reg.status().seq == seq and ack.confirmed == ("E0",) and not ack.complete
    assert reg.version(vk("B")).state is VersionState.LOADING


# ------------------------------------------------------------------------------ queries, dumps


def test_status_reports_versions_slots_attempts_default_and_sessions() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk("s1"))
    reg.begin_close(sk("s2"))
    res = pub.reserve("B")
    st = reg.status()
    assert st.epoch == EPOCH and st.capacity == 2 and st.slots_used == 2
    assert st.default == vk("A") and st.default_lora_name == lora_name("A", digest("A"))
    assert st.default_revision == 1 and st.pending_attempt == res.attempt_token
    assert st.sessions == {"OPEN": 1, "CLOSING": 0, "CLOSED": 1}
    a, b = st.versions
    assert (a.state, a.session_refs, a.holds_slot, a.commit_revision) == (VersionState.PUBLISHED, 1, True, 1)
    assert (b.state, b.session_refs, b.attempt_token) == (VersionState.LOADING, 0, res.attempt_token)
    assert reg.session(sk("s2")).binding is None and reg.session(sk("zz")) is None
    assert reg.binding_of(sk("zz")) is None


def test_dump_load_round_trip_and_codec() -> None:
    reg = new_registry(capacity=3)
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk("s"))
    pub.publish("B")
    reg.close_and_release(sk("s"))
    claim = reg.claim_reclaim(vk("A"))
    reg.confirm_reclaim(vk("A"), "E0", UnloadEvidence(claim.reclaim_id, pub.incarnation["E0"]))
    pub.reserve("C")
    reg.mark_engine_unknown("E1", pub.token("C"), "begin", "timeout")
    text = reg.dump()
    back = LoRAVersionRegistry.load(text)
    assert back.dump() == text
    assert back.status() == reg.inner.status()
    # identical answers after load
    assert back.claim_reclaim(vk("A")) == claim
    assert back.reserve(vk("C"), digest("C"), lora_name("C", digest("C")), "req-C-C") == pub.results["C"]
    for value in (vk("A"), reg.status(), claim, (1, "x"), {"k": [VersionKey("1", "a")]}):
        assert loads(dumps(value)) == value


def test_ids_are_deterministic_per_version_and_distinct() -> None:
    a, b = new_registry(), new_registry()
    for reg in (a, b):
        Publisher(reg).publish("A")
    ta, tb = a.version(vk("A")).attempt_token, b.version(vk("A")).attempt_token
    assert ta == tb
    Publisher(a).publish("B")
    assert a.claim_reclaim(vk("A")).reclaim_id != ta
