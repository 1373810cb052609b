"""Unit tests of the pure registry: predicates, validation, idempotency, queries, dump/load."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from _rg_helpers import EPOCH, Checked, Publisher, digest, lora_name, new_registry, refused, sk, vk

from lora_contract.errors import HTTP_STATUS, ErrorCode, LoraVersionError
from lora_contract.names import make_lora_name
from relax_glue.registry import LoRAVersionRegistry, holds_slot, may_start_reclaim
from relax_glue.registry_rules import TRANSITIONS
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

# ------------------------------------------------------------------------------ predicates


def test_holds_slot_is_false_only_for_the_two_terminal_states() -> None:
    free = {s for s in VersionState if not holds_slot(s)}
    assert free == {VersionState.FAILED_CLEAN, VersionState.RECLAIMED}


def test_terminal_states_have_no_way_out() -> None:
    for state in VersionState:
        assert (not TRANSITIONS[state]) == (not holds_slot(state))


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
    # the same version under another prefix is still its managed name: registered under another one
    other = make_lora_name("other_prefix", EPOCH, "A", dig)
    refused(ErrorCode.VERSION_CONFLICT, reg.reserve, vk("A"), dig, other, "r2")
    # another version can not take A's name: a managed name carries its version (names rule),
    # checked before the pending-attempt check, so the name is the problem named
    refused(ErrorCode.INVALID_REQUEST, reg.reserve, vk("B"), digest("B"), lora_name("A", dig), "r3")


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
    back = Checked(LoRAVersionRegistry.load(text))  # the loader holds the new object: it publishes
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


# ------------------------------------------------------------------ pruning, row by row


def _closed_then(reg, distance: int) -> int:
    """Close session ``s`` (bound to A), then ``distance`` more accepted transitions; returns the
    session's closed_seq. An OPEN and a CLOSING session older than it ride along."""
    Publisher(reg).publish("A")
    reg.bind_first(sk("open"))
    reg.bind_first(sk("closing"))
    reg.begin_close(sk("closing"))
    reg.bind_first(sk("s"))
    reg.close_and_release(sk("s"))
    closed_seq = reg.seq
    for i in range(distance):
        reg.open_session(sk(f"later-{i}"))
    assert reg.seq == closed_seq + distance
    return closed_seq


@pytest.mark.parametrize("distance", [0, 1, 2, 3])
@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_prune_forgets_a_closed_session_exactly_keep_last_transitions_after_its_close(
    distance: int, keep_last: int
) -> None:
    """The window is inclusive: a session closed ``distance`` transitions ago is forgotten iff
    ``distance >= keep_last``; OPEN and CLOSING sessions are never forgotten, whatever their age;
    a prune that forgets nothing is no transition."""
    reg = new_registry()
    _closed_then(reg, distance)
    seq = reg.seq
    gone = reg.prune_sessions(keep_last)
    assert gone == (1 if distance >= keep_last else 0)
    assert (reg.session(sk("s")) is None) == (gone == 1)
    assert reg.session(sk("open")).state.value == "OPEN"
    assert reg.session(sk("closing")).state.value == "CLOSING"
    assert reg.seq == seq + gone  # one accepted transition when something went, else none


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.0, "1", None])
def test_prune_needs_a_window_of_at_least_one_transition(keep_last: object) -> None:
    reg = new_registry()
    _closed_then(reg, 3)
    refused(ErrorCode.INVALID_REQUEST, reg.prune_sessions, keep_last)
    assert reg.session(sk("s")) is not None


# ------------------------------------------------------------- unknown outcomes, row by row


def _attempt_in(reg, phase: AttemptPhase) -> Publisher:
    """Candidate A with E1's attempt phase set to ``phase`` through the registry's own calls."""
    pub = Publisher(reg)
    pub.reserve("A")
    if phase is AttemptPhase.PREPARED:
        pub.prepared("A", "E1")
    elif phase is AttemptPhase.READY:
        pub.ready("A", "E1")
    elif phase is AttemptPhase.UNKNOWN:
        reg.mark_engine_unknown("E1", pub.token("A"), "end", "first")
    elif phase is AttemptPhase.CLEANED:
        reg.abort(pub.token("A"), "x")
        pub.cleanup("A", "E1")
    assert reg.version(vk("A")).attempt_phases["E1"] is phase
    return pub


@pytest.mark.parametrize("phase", list(AttemptPhase))
def test_marking_an_attempt_unknown_has_one_answer_for_every_phase(phase: AttemptPhase) -> None:
    """NONE, PREPARED and READY become UNKNOWN (the earlier evidence no longer counts) and block
    new publications; an UNKNOWN marked again and a confirmed CLEANED (clean wins) change
    nothing: same phase, no transition, no new unknown outcome."""
    reg = new_registry()
    pub = _attempt_in(reg, phase)
    before = (reg.seq, reg.status().unknown_outcomes)
    ack = reg.mark_engine_unknown("E1", pub.token("A"), "end", "again")
    after = reg.version(vk("A")).attempt_phases["E1"]
    if phase in (AttemptPhase.UNKNOWN, AttemptPhase.CLEANED):
        assert after is phase and ack.phase == phase.value
        assert (reg.seq, reg.status().unknown_outcomes) == before
    else:
        assert after is AttemptPhase.UNKNOWN and ack.phase == "UNKNOWN" and reg.seq == before[0] + 1
        assert [(u.engine_id, u.ref) for u in reg.status().unknown_outcomes] == [("E1", pub.token("A"))]
        b = digest("B")
        refused(ErrorCode.OUTCOME_UNKNOWN, reg.reserve, vk("B"), b, lora_name("B", b), "rb")


@pytest.mark.parametrize("phase", ["PENDING", "UNKNOWN", "UNLOADED"])
def test_marking_a_reclaim_unknown_has_one_answer_for_every_phase(phase: str) -> None:
    """PENDING becomes UNKNOWN (the slot stays held, new publications wait); an UNKNOWN marked
    again and a confirmed UNLOADED change nothing: same phase, no transition, no new outcome."""
    from relax_glue.registry_types import ReclaimPhase

    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.publish("B")
    claim = reg.claim_reclaim(vk("A"))
    if phase == "UNKNOWN":
        reg.mark_engine_unknown("E1", claim.reclaim_id, "reclaim", "first")
    elif phase == "UNLOADED":
        pub.unloaded("A", "E1", claim)
    assert reg.version(vk("A")).reclaim_phases["E1"] is ReclaimPhase(phase)
    before = (reg.seq, reg.status().unknown_outcomes)
    ack = reg.mark_engine_unknown("E1", claim.reclaim_id, "reclaim", "again")
    after = reg.version(vk("A")).reclaim_phases["E1"]
    if phase == "PENDING":
        assert after is ReclaimPhase.UNKNOWN and ack.phase == "UNKNOWN" and reg.seq == before[0] + 1
        assert [(u.engine_id, u.ref) for u in reg.status().unknown_outcomes] == [("E1", claim.reclaim_id)]
    else:
        assert after is ReclaimPhase(phase) and ack.phase == phase
        assert (reg.seq, reg.status().unknown_outcomes) == before
    assert reg.version(vk("A")).state is VersionState.RECLAIMING and reg.status().slots_used == 2


# ------------------------------------------------------------ engine restarts, row by row


_RESTART_ROWS = [
    (pending, phase)
    for pending in ("LOADING", "ABORTED")
    for phase in AttemptPhase
    if not (pending == "LOADING" and phase is AttemptPhase.CLEANED)  # CLEANED comes only after abort
]


@pytest.mark.parametrize(("pending", "phase"), _RESTART_ROWS)
def test_a_restart_drops_only_the_live_attempts_prepared_or_ready(pending: str, phase: AttemptPhase) -> None:
    """E1 restarts while candidate A is ``pending`` with E1 at ``phase``. Only the PREPARED or
    READY of a LOADING attempt is dropped (to NONE, reported as invalidated): it came from the
    dead incarnation and must not count toward a commit. An UNKNOWN stays UNKNOWN (only a
    receipt resolves it); an ABORTED attempt only waits for cleanups, its phases stay as they
    are; a committed version's phases never change."""
    reg = new_registry(capacity=3)
    Publisher(reg).publish("P")
    pub = _attempt_in(reg, phase)
    if pending == "ABORTED" and phase is not AttemptPhase.CLEANED:
        reg.abort(pub.token("A"), "x")
    assert reg.version(vk("A")).state.value == pending
    result = reg.register_engine_incarnation("E1", "E1-i9")
    dropped = pending == "LOADING" and phase in (AttemptPhase.PREPARED, AttemptPhase.READY)
    assert result.invalidated == ((pub.token("A"),) if dropped else ())
    assert reg.version(vk("A")).attempt_phases["E1"] is (AttemptPhase.NONE if dropped else phase)
    assert reg.version(vk("A")).attempt_phases["E0"] is AttemptPhase.NONE
    assert reg.version(vk("P")).attempt_phases == {"E0": AttemptPhase.READY, "E1": AttemptPhase.READY}


# ------------------------------------------------------------ sessions, row by row

T0 = 1_000.0
_SESSION_STATES = ("ABSENT", "OPEN", "BOUND", "CLOSING", "CLOSED", "TOMBSTONE", "EXPIRED")


def _session_in(reg, label: str) -> None:
    """Session ``s`` in ``label`` (A is the default): OPEN unbound, BOUND (OPEN, bound to A,
    on worker lease ``w`` until T0 + 10), CLOSING (bound), CLOSED (bound and released), TOMBSTONE (closed
    before any open or bind), EXPIRED (bound, its lease ran out)."""
    if label == "OPEN":
        reg.open_session(sk("s"))
    elif label in ("BOUND", "CLOSING", "CLOSED", "EXPIRED"):
        reg.grant_lease("w", 10.0, T0)
        reg.bind_first(sk("s"), "w")
    if label == "CLOSING":
        reg.begin_close(sk("s"))
    elif label == "CLOSED":
        reg.close_and_release(sk("s"))
    elif label == "TOMBSTONE":
        reg.begin_close(sk("s"))
    elif label == "EXPIRED":
        assert reg.expire_leases(T0 + 10) == (sk("s"),)


# op -> label -> (state after, transitions, change of A's session refs) or the refusal's code
_SESSION_ROWS: dict[str, dict[str, Any]] = {
    "open_session": {
        "ABSENT": ("OPEN", 1, 0),
        "OPEN": ("OPEN", 0, 0),
        "BOUND": ("OPEN", 0, 0),
        "CLOSING": ErrorCode.SESSION_CLOSED,
        "CLOSED": ErrorCode.SESSION_CLOSED,
        "TOMBSTONE": ErrorCode.SESSION_CLOSED,
        "EXPIRED": ErrorCode.SESSION_EXPIRED,
    },
    "bind_first": {
        "ABSENT": ("OPEN", 1, 1),
        "OPEN": ("OPEN", 1, 1),
        "BOUND": ("OPEN", 0, 0),  # the first binding, never a second ref
        "CLOSING": ErrorCode.SESSION_CLOSED,
        "CLOSED": ErrorCode.SESSION_CLOSED,
        "TOMBSTONE": ErrorCode.SESSION_CLOSED,
        "EXPIRED": ErrorCode.SESSION_EXPIRED,
    },
    "begin_close": {
        "ABSENT": ("CLOSED", 1, 0),  # a tombstone: a late open or bind can never reopen it
        "OPEN": ("CLOSING", 1, 0),
        "BOUND": ("CLOSING", 1, 0),  # the ref is kept until the release
        "CLOSING": ("CLOSING", 0, 0),
        "CLOSED": ("CLOSED", 0, 0),
        "TOMBSTONE": ("CLOSED", 0, 0),
        "EXPIRED": ("CLOSED", 0, 0),
    },
    "close_and_release": {
        "ABSENT": ("CLOSED", 1, 0),
        "OPEN": ("CLOSED", 1, 0),
        "BOUND": ("CLOSED", 1, -1),
        "CLOSING": ("CLOSED", 1, -1),
        "CLOSED": ("CLOSED", 0, 0),  # released exactly once
        "TOMBSTONE": ("CLOSED", 0, 0),
        "EXPIRED": ("CLOSED", 0, 0),
    },
}


@pytest.mark.parametrize("op", list(_SESSION_ROWS))
@pytest.mark.parametrize("label", _SESSION_STATES)
def test_every_session_op_has_one_answer_for_every_session_state(op: str, label: str) -> None:
    assert set(_SESSION_ROWS[op]) == set(_SESSION_STATES)
    reg = new_registry()
    Publisher(reg).publish("A")
    _session_in(reg, label)
    before = reg.session(sk("s"))
    refs, seq = reg.version(vk("A")).session_refs, reg.seq
    args = (sk("s"),)
    want = _SESSION_ROWS[op][label]
    if isinstance(want, ErrorCode):
        refused(want, getattr(reg, op), *args)
        return
    state, transitions, ref_change = want
    getattr(reg, op)(*args)
    after = reg.session(sk("s"))
    assert after.state.value == state
    assert reg.seq == seq + transitions
    assert reg.version(vk("A")).session_refs == refs + ref_change
    if transitions == 0 and before is not None:
        assert after == before  # a replay: the record exactly as it was
    if label == "EXPIRED":
        assert after.expired  # an owner's late close never rewrites how it ended


# ------------------------------------------------------------ receipts, row by row

_LIVE_PHASES = [AttemptPhase.NONE, AttemptPhase.PREPARED, AttemptPhase.READY, AttemptPhase.UNKNOWN]


@pytest.mark.parametrize("phase", _LIVE_PHASES)
def test_a_prepared_receipt_moves_only_nothing_to_prepared(phase: AttemptPhase) -> None:
    """PREPARED counts only over NONE. Over PREPARED it is a replay (the first answer), over
    READY a late reply, over UNKNOWN no resolution (only READY or a cleanup resolves it): none
    of them a transition."""
    reg = new_registry()
    pub = _attempt_in(reg, phase)
    first = pub.prepared("A", "E1") if phase is AttemptPhase.PREPARED else None
    seq = reg.seq
    ack = pub.prepared("A", "E1")
    after = reg.version(vk("A")).attempt_phases["E1"]
    if phase is AttemptPhase.NONE:
        assert after is AttemptPhase.PREPARED and reg.seq == seq + 1 and ack.phase == "PREPARED"
    else:
        assert after is phase and reg.seq == seq and ack.phase == phase.value
    if first is not None:
        assert ack == first


@pytest.mark.parametrize("phase", _LIVE_PHASES)
def test_a_ready_receipt_of_the_current_incarnation_makes_any_live_phase_ready(phase: AttemptPhase) -> None:
    reg = new_registry()
    pub = _attempt_in(reg, phase)
    seq = reg.seq
    ack = pub.ready("A", "E1")
    assert reg.version(vk("A")).attempt_phases["E1"] is AttemptPhase.READY and ack.phase == "READY"
    assert reg.seq == seq + (phase is not AttemptPhase.READY)  # a duplicate READY is no transition
    assert reg.status().unknown_outcomes == ()  # READY resolves an unknown outcome


@pytest.mark.parametrize("op", ["prepared", "ready"])
def test_no_receipt_of_the_attempt_counts_once_it_is_aborted(op: str) -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    reg.abort(pub.token("A"), "x")
    refused(ErrorCode.STALE_ATTEMPT, getattr(pub, op), "A", "E1")


# receipt -> incarnation it carries -> accepted? A receipt for a live attempt (PREPARED, READY)
# must come from the engine's current incarnation; one that confirms something is gone
# (cleanup, unload) stays true from any registered incarnation, and none counts from an
# incarnation the registry never saw.
_INCARNATION_ROWS = {
    "prepared": {"current": True, "earlier": False, "unregistered": False},
    "ready": {"current": True, "earlier": False, "unregistered": False},
    "cleanup": {"current": True, "earlier": True, "unregistered": False},
    "unloaded": {"current": True, "earlier": True, "unregistered": False},
}


@pytest.mark.parametrize("op", list(_INCARNATION_ROWS))
@pytest.mark.parametrize("which", ["current", "earlier", "unregistered"])
def test_which_incarnations_a_receipt_may_come_from(op: str, which: str) -> None:
    reg = new_registry()
    pub = Publisher(reg)
    rid = "none"
    if op == "unloaded":
        pub.publish("A")
        pub.publish("B")
        rid = reg.claim_reclaim(vk("A")).reclaim_id
    else:
        pub.reserve("A")
        if op == "cleanup":
            reg.abort(pub.token("A"), "x")
    earlier = pub.incarnation["E1"]
    current = pub.restart("E1")
    inc = {"current": current, "earlier": earlier, "unregistered": "E1-i77"}[which]
    res = pub.results["A"]
    calls = {
        "prepared": (reg.record_prepared, "E1", PreparedEvidence(vk("A"), res.attempt_token, inc)),
        "ready": (reg.record_ready, "E1", ReadyEvidence(vk("A"), res.digest, res.attempt_token, inc)),
        "cleanup": (reg.record_cleanup, "E1", res.attempt_token, CleanupEvidence(res.attempt_token, inc)),
        "unloaded": (reg.confirm_reclaim, vk("A"), "E1", UnloadEvidence(rid, inc)),
    }
    fn, *args = calls[op]
    if _INCARNATION_ROWS[op][which]:
        seq = reg.seq
        fn(*args)
        assert reg.seq == seq + 1
    else:
        refused(ErrorCode.STALE_INCARNATION, fn, *args)


_COMMIT_PHASES = [AttemptPhase.NONE, AttemptPhase.PREPARED, AttemptPhase.READY, AttemptPhase.UNKNOWN]


@pytest.mark.parametrize("e0", _COMMIT_PHASES)
@pytest.mark.parametrize("e1", _COMMIT_PHASES)
@pytest.mark.parametrize("revision_ok", [True, False])
def test_commit_answers_every_combination_of_engine_phases_and_revision(
    e0: AttemptPhase, e1: AttemptPhase, revision_ok: bool
) -> None:
    """Precedence: an UNKNOWN outcome first (nothing is known), then any engine not READY
    (named), then a stale expected revision; only every engine READY at the current revision
    commits."""
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    for engine, phase in (("E0", e0), ("E1", e1)):
        if phase is AttemptPhase.PREPARED:
            pub.prepared("A", engine)
        elif phase is AttemptPhase.READY:
            pub.ready("A", engine)
        elif phase is AttemptPhase.UNKNOWN:
            reg.mark_engine_unknown(engine, pub.token("A"), "end", "lost")
    revision = 0 if revision_ok else 1
    phases = {"E0": e0, "E1": e1}
    unknown = sorted(e for e, p in phases.items() if p is AttemptPhase.UNKNOWN)
    missing = sorted(e for e, p in phases.items() if p is not AttemptPhase.READY)
    if unknown:
        err = refused(ErrorCode.OUTCOME_UNKNOWN, pub.commit, "A", revision)
        assert err.details["engines"] == unknown
    elif missing:
        err = refused(ErrorCode.NOT_ALL_READY, pub.commit, "A", revision)
        assert err.details["missing"] == missing
    elif not revision_ok:
        refused(ErrorCode.DEFAULT_REVISION_CONFLICT, pub.commit, "A", revision)
    else:
        assert pub.commit("A", revision).default_revision == 1
        assert reg.status().default == vk("A")


# claim_reclaim in every version state, with and without a session ref
_CLAIM_ROWS = {
    "LOADING": ErrorCode.INVALID_REQUEST,
    "ABORTED": ErrorCode.INVALID_REQUEST,
    "FAILED_CLEAN": ErrorCode.INVALID_REQUEST,
    "PUBLISHED": ErrorCode.VERSION_IN_USE,  # the default is always in use
    "RETIRED": "claim",  # only without session refs, see below
    "RECLAIMING": "same claim",
    "RECLAIMED": "same claim",
}


@pytest.mark.parametrize("state", list(_CLAIM_ROWS))
@pytest.mark.parametrize("refs", [0, 1])
def test_claim_reclaim_has_one_answer_for_every_version_state(state: str, refs: int) -> None:
    assert set(_CLAIM_ROWS) == {s.value for s in VersionState}
    reg = new_registry(capacity=3)
    pub = Publisher(reg)
    first = None
    if state in ("LOADING", "ABORTED", "FAILED_CLEAN"):
        pub.reserve("A")
        if state != "LOADING":
            reg.abort(pub.token("A"), "x")
        if state == "FAILED_CLEAN":
            pub.cleanup("A", "E0")
            pub.cleanup("A", "E1")
    else:
        pub.publish("A")
        if refs:
            reg.bind_first(sk("s"))
        if state != "PUBLISHED":
            pub.publish("B")
        if state in ("RECLAIMING", "RECLAIMED") and not refs:
            first = pub.reclaim("A") if state == "RECLAIMED" else reg.claim_reclaim(vk("A"))
    want = _CLAIM_ROWS[state]
    if state in ("RETIRED", "RECLAIMING", "RECLAIMED") and refs:
        assert reg.version(vk("A")).state is VersionState.RETIRED  # a held version never got further
        err = refused(ErrorCode.VERSION_IN_USE, reg.claim_reclaim, vk("A"))
        assert err.details["session_refs"] == 1
        return
    assert reg.version(vk("A")).state.value == state
    if isinstance(want, ErrorCode):
        refused(want, reg.claim_reclaim, vk("A"))
        return
    seq = reg.seq
    claim = reg.claim_reclaim(vk("A"))
    if want == "claim":
        assert reg.seq == seq + 1 and reg.version(vk("A")).state is VersionState.RECLAIMING
        assert dict(reg.version(vk("A")).reclaim_phases) == {"E0": "PENDING", "E1": "PENDING"}
    else:
        assert claim == first and reg.seq == seq and reg.version(vk("A")).state.value == state


@pytest.mark.parametrize("how", ["released", "begin_close_tombstone", "close_tombstone", "expired"])
def test_every_kind_of_closed_session_is_pruned_once_its_window_passed(how: str) -> None:
    """A session closed by its owner after a bind, a tombstone left by a close before any open
    (either close call), and a session closed by its lease: each remembers when it closed and is
    forgotten exactly ``keep_last`` transitions later, never earlier."""
    reg = new_registry()
    Publisher(reg).publish("A")
    if how == "released":
        reg.bind_first(sk("s"))
        reg.close_and_release(sk("s"))
    elif how == "begin_close_tombstone":
        reg.begin_close(sk("s"))
    elif how == "close_tombstone":
        reg.close_and_release(sk("s"))
    else:
        reg.grant_lease("w", 5.0, T0)
        reg.bind_first(sk("s"), "w")
        reg.expire_leases(T0 + 5)
    assert reg.session(sk("s")).state.value == "CLOSED"
    reg.open_session(sk("later"))
    assert reg.prune_sessions(2) == 0 and reg.session(sk("s")) is not None
    reg.open_session(sk("later-2"))
    assert reg.prune_sessions(2) == 1 and reg.session(sk("s")) is None


# ------------------------------------------------------------ input bounds, row by row
# Every free-text argument has a length bound: exactly the bound is accepted, one more
# character is INVALID_REQUEST (and changes nothing), as is an empty one.


def _text_call(reg, field: str, value: str):
    pub = Publisher(reg)
    if field == "request_id":
        return lambda: reg.reserve(vk("A"), digest("A"), lora_name("A", digest("A")), value)
    if field == "abort reason":
        pub.reserve("A")
        return lambda: reg.abort(pub.token("A"), value)
    if field == "unknown op":
        pub.reserve("A")
        return lambda: reg.mark_engine_unknown("E0", pub.token("A"), value, "r")
    if field == "unknown reason":
        pub.reserve("A")
        return lambda: reg.mark_engine_unknown("E0", pub.token("A"), "end", value)
    if field == "lost reason":
        return lambda: reg.declare_engine_lost("E1", value)
    assert field == "session nonce"
    return lambda: reg.open_session(SessionKey(EPOCH, value))


# lora_name has no bound of its own: it must be the managed name of its version (the names
# module's parts are bounded), see test_registry_uses_one_rule_each.
_TEXT_BOUNDS = {
    "request_id": 256,
    "abort reason": 1024,
    "unknown op": 64,
    "unknown reason": 1024,
    "lost reason": 1024,
    "session nonce": 256,
}


@pytest.mark.parametrize("field", list(_TEXT_BOUNDS))
@pytest.mark.parametrize("length", ["empty", "bound", "over"])
def test_every_text_argument_is_bounded_inclusively(field: str, length: str) -> None:
    bound = _TEXT_BOUNDS[field]
    value = {"empty": "", "bound": "x" * bound, "over": "x" * (bound + 1)}[length]
    reg = new_registry()
    call = _text_call(reg, field, value)
    if length == "bound":
        seq = reg.seq
        call()
        assert reg.seq == seq + 1
    else:
        refused(ErrorCode.INVALID_REQUEST, call)


@pytest.mark.parametrize("now", [-1.0, -0.5, -1e-9, 0.0, 0.5, T0])
def test_a_registry_time_is_any_finite_number_of_seconds_from_zero(now: float) -> None:
    """``now`` (and a ttl, which must be > 0 besides) below zero is refused, however little."""
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.bind_first(sk("s"))
    if now < 0:
        refused(ErrorCode.INVALID_REQUEST, reg.grant_lease, "w", 1.0, now)
        refused(ErrorCode.INVALID_REQUEST, reg.expire_leases, now)
        refused(ErrorCode.INVALID_REQUEST, reg.grant_lease, "w", now, T0)
    else:
        assert reg.grant_lease("w", 1.0, now).expires_at == now + 1.0
        assert reg.keep_alive("w", now).expires_at == now + 1.0
        assert reg.expire_leases(now) == ()


@pytest.mark.parametrize("revision", [True, False, 1.0, "1", None])
def test_an_expected_revision_that_is_not_an_int_is_refused(revision: object) -> None:
    """A bool is an int in Python; as a revision it is a caller's mistake, never revision 1."""
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    pub.ready("B", "E0")
    pub.ready("B", "E1")
    refused(ErrorCode.INVALID_REQUEST, reg.commit, vk("B"), pub.token("B"), revision)


@pytest.mark.parametrize(
    "e0", [AttemptPhase.NONE, AttemptPhase.PREPARED, AttemptPhase.READY, AttemptPhase.UNKNOWN]
)
@pytest.mark.parametrize("receipt", ["prepared", "ready"])
def test_an_acknowledgement_names_every_engine_its_phase_counts_and_says_when_all_do(
    e0: AttemptPhase, receipt: str
) -> None:
    """E1's receipt is acknowledged with the engines confirmed so far at that phase: for
    PREPARED every engine PREPARED or READY (a READY engine has prepared too), for READY only
    the READY ones; ``complete`` once that is the whole cohort."""
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    if e0 is AttemptPhase.PREPARED:
        pub.prepared("A", "E0")
    elif e0 is AttemptPhase.READY:
        pub.ready("A", "E0")
    elif e0 is AttemptPhase.UNKNOWN:
        reg.mark_engine_unknown("E0", pub.token("A"), "end", "lost")
    ack = getattr(pub, receipt)("A", "E1")
    counted = (AttemptPhase.PREPARED, AttemptPhase.READY) if receipt == "prepared" else (AttemptPhase.READY,)
    confirmed = ("E0", "E1") if e0 in counted else ("E1",)
    assert ack.confirmed == confirmed and ack.complete == (confirmed == ("E0", "E1"))
    assert ack.phase == receipt.upper() and ack.engine_id == "E1"


def test_a_cleanup_acknowledgement_is_complete_only_when_every_engine_cleaned() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    reg.abort(pub.token("A"), "x")
    first = pub.cleanup("A", "E1")
    assert first.confirmed == ("E1",) and not first.complete
    second = pub.cleanup("A", "E0")
    assert second.confirmed == ("E0", "E1") and second.complete
    assert second.state is VersionState.FAILED_CLEAN


@pytest.mark.parametrize("before_abort", ["nothing", "prepared", "ready"])
def test_no_receipt_counts_once_the_attempt_is_aborted_not_even_a_repeat_of_one_that_did(
    before_abort: str,
) -> None:
    """A READY or PREPARED that arrives after the abort is STALE_ATTEMPT, also the very same
    receipt that was accepted before the abort (only a committed attempt answers a late
    duplicate READY from its stored acknowledgement)."""
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    if before_abort != "nothing":
        getattr(pub, before_abort)("A", "E1")
    reg.abort(pub.token("A"), "x")
    refused(ErrorCode.STALE_ATTEMPT, pub.ready, "A", "E1")
    refused(ErrorCode.STALE_ATTEMPT, pub.prepared, "A", "E1")
