"""RFC section 7.1, every registry-level row as a named test.

Each test drives the pure registry through the ``Checked`` proxy: after every accepted call the
full invariant walk runs, and every refused call is asserted to leave the state untouched.
Engine-side rows (native refcount, pinning, exact-version guards) are tested in sglang_ext.
"""

from __future__ import annotations

from _rg_helpers import Publisher, digest, lora_name, new_registry, refused, sk, vk

from lora_contract.errors import ErrorCode
from relax_glue.registry_types import (
    CleanupEvidence,
    PreparedEvidence,
    ReadyEvidence,
    SessionState,
    UnloadEvidence,
    VersionState,
)


def _state(reg, vid: str) -> VersionState:
    return reg.version(vk(vid)).state


# ------------------------------------------------------------------ row 1: E0 READY only, then both


def test_b_ready_only_on_e0_keeps_default_then_commit_switches_new_sessions_only() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    s_old = reg.bind_first(sk("S_old"))
    assert s_old.version_key == vk("A")

    pub.reserve("B")
    pub.prepared("B", "E0")
    pub.prepared("B", "E1")
    ack = pub.ready("B", "E0")
    assert ack.confirmed == ("E0",) and not ack.complete

    s_mid = reg.bind_first(sk("S_mid"))
    assert s_mid.version_key == vk("A"), "E1 not ready: new sessions still get A"
    err = refused(ErrorCode.NOT_ALL_READY, pub.commit, "B")
    assert err.details["missing"] == ["E1"]
    assert reg.status().default == vk("A")

    assert pub.ready("B", "E1").complete
    receipt = pub.commit("B")
    assert receipt.previous_default == vk("A") and receipt.default_revision == 2
    assert _state(reg, "A") is VersionState.RETIRED and _state(reg, "B") is VersionState.PUBLISHED

    s_new = reg.bind_first(sk("S_new"))
    assert s_new.version_key == vk("B")
    # tool turns, retries and resumes of the old sessions call bind_first again: still A
    for _ in range(3):
        assert reg.bind_first(sk("S_old")) == s_old
        assert reg.bind_first(sk("S_mid")) == s_mid
    assert reg.version(vk("A")).session_refs == 2
    assert reg.version(vk("B")).session_refs == 1


# ------------------------------------------------------------------ row 2: duplicate publication


def test_duplicate_publication_takes_no_second_slot_attempt_or_default_switch() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    first = pub.reserve("B", request_id="r1")
    assert first.created and first.state is VersionState.LOADING
    slots = reg.status().slots_used

    assert pub.reserve("B", request_id="r1") == first  # same request: the identical answer
    again = pub.reserve("B", request_id="r2")  # same key + digest, other request
    assert not again.created and again.attempt_token == first.attempt_token
    assert reg.status().slots_used == slots

    for engine in ("E0", "E1"):
        pub.ready("B", engine)
        pub.ready("B", engine)  # duplicate READY: no second load, identical ack
    receipt = pub.commit("B")
    assert pub.commit("B", revision=receipt.default_revision - 1) == receipt
    assert reg.status().default_revision == 2, "a replayed commit never switches the default twice"

    late = pub.reserve("B", request_id="r3")
    assert late.state is VersionState.PUBLISHED and not late.created
    assert pub.reserve("B", request_id="r1") == first  # still the first answer, also now
    assert reg.status().slots_used == slots


# ------------------------------------------------------------- row 2b: same version, other content


def test_same_version_different_content_is_version_conflict_for_the_whole_epoch() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    other = digest("A-other-content")

    def conflicting_reserve() -> object:
        return reg.reserve(vk("A"), other, lora_name("A", other), "req-other")

    refused(ErrorCode.VERSION_CONFLICT, conflicting_reserve)  # while PUBLISHED
    pub.publish("B")
    reg.bind_first(sk("s"))  # binds B; A has no refs
    pub.reclaim("A")
    assert _state(reg, "A") is VersionState.RECLAIMED
    refused(ErrorCode.VERSION_CONFLICT, conflicting_reserve)  # still, after reclaim

    # a READY that carries another digest for the live candidate is refused too
    res = pub.reserve("C")
    bad = ReadyEvidence(vk("C"), digest("C-other"), res.attempt_token, pub.incarnation["E0"])
    refused(ErrorCode.VERSION_CONFLICT, reg.record_ready, "E0", bad)
    assert reg.version(vk("C")).attempt_phases["E0"].value == "NONE"


# ---------------------------------------------------------------------- row 3: lost commit reply


def test_lost_commit_reply_is_answered_by_retry_and_blocks_cleanup_and_next_publication() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    for engine in ("E0", "E1"):
        pub.ready("B", engine)

    # the commit request is lost before it reaches the registry: B stays the pending attempt,
    # so no next publication can start
    refused(ErrorCode.PUBLICATION_IN_PROGRESS, pub.reserve, "C")

    receipt = pub.commit("B")  # accepted, but the reply is lost
    # the publisher must not clean B up on a guess: the registry refuses the abort
    err = refused(ErrorCode.STALE_ATTEMPT, reg.abort, pub.token("B"), "reply timed out")
    assert err.details["state"] == "PUBLISHED"
    tok = pub.token("B")
    refused(
        ErrorCode.STALE_ATTEMPT, reg.record_cleanup, "E0", tok, CleanupEvidence(tok, pub.incarnation["E0"])
    )
    # the retry returns the identical receipt and changes nothing
    seq = reg.status().seq
    assert pub.commit("B", revision=1) == receipt
    assert reg.status().seq == seq and reg.status().default_revision == 2

    # a very late retry after B was retired and reclaimed never makes B default again
    pub.reclaim("A")
    pub.publish("C")
    pub.reclaim("B")
    assert pub.commit("B", revision=1) == receipt
    assert reg.status().default == vk("C") and _state(reg, "B") is VersionState.RECLAIMED


# -------------------------------------------------------- row 3b: partial failure and cleanup


def test_partial_failure_keeps_default_and_frees_slot_only_after_cleanup_on_both_engines() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    pub.ready("B", "E0")  # E1 fails its end (manifest mismatch, load error, ...)
    reg.abort(pub.token("B"), "E1: MANIFEST_MISMATCH")
    assert reg.status().default == vk("A")
    assert _state(reg, "B") is VersionState.ABORTED
    refused(ErrorCode.STALE_ATTEMPT, pub.commit, "B")

    pub.cleanup("B", "E0")
    assert _state(reg, "B") is VersionState.ABORTED and reg.status().slots_used == 2
    refused(ErrorCode.PUBLICATION_IN_PROGRESS, pub.reserve, "C")

    ack = pub.cleanup("B", "E1")
    assert ack.complete and ack.state is VersionState.FAILED_CLEAN
    assert reg.status().slots_used == 1 and reg.status().default == vk("A")
    assert pub.reserve("C").created
    assert reg.bind_first(sk("s")).version_key == vk("A")


def test_unknown_cleanup_outcome_keeps_slot_and_blocks_new_publication_until_confirmed() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    pub.ready("B", "E0")
    reg.mark_engine_unknown("E1", pub.token("B"), "end", "timeout")  # E1's end: no answer
    refused(ErrorCode.OUTCOME_UNKNOWN, pub.commit, "B")
    reg.abort(pub.token("B"), "E1 end timed out")
    pub.cleanup("B", "E0")
    reg.mark_engine_unknown("E1", pub.token("B"), "cleanup", "timeout")

    status = reg.status()
    assert [(u.engine_id, u.op) for u in status.unknown_outcomes] == [("E1", "end")]
    assert _state(reg, "B") is VersionState.ABORTED and status.slots_used == 2

    # an unknown outcome is reported first: the operator sees why nothing moves
    err = refused(ErrorCode.OUTCOME_UNKNOWN, pub.reserve, "C")
    assert err.details["unknown"] == [f"E1:{pub.token('B')}"]

    ack = pub.cleanup("B", "E1")  # the engine answered after all
    assert ack.state is VersionState.FAILED_CLEAN
    assert reg.status().unknown_outcomes == () and reg.status().slots_used == 1
    assert pub.reserve("C").created


def test_unknown_reclaim_outcome_keeps_slot_and_refuses_new_publication() -> None:
    reg = new_registry(capacity=3)
    pub = Publisher(reg)
    pub.publish("A")
    pub.publish("B")
    claim = reg.claim_reclaim(vk("A"))
    pub.unloaded("A", "E0", claim)
    reg.mark_engine_unknown("E1", claim.reclaim_id, "reclaim", "connection reset")
    assert _state(reg, "A") is VersionState.RECLAIMING and reg.status().slots_used == 2
    refused(ErrorCode.OUTCOME_UNKNOWN, pub.reserve, "C")
    pub.unloaded("A", "E1", claim)
    assert _state(reg, "A") is VersionState.RECLAIMED
    assert pub.reserve("C").created


# ------------------------------------------------ row 4: late control messages after cleanup


def test_late_control_messages_after_cleanup_recreate_nothing() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    pub.prepared("B", "E0")
    abort = reg.abort(pub.token("B"), "E1 begin refused")
    pub.cleanup("B", "E0")
    cleanup_e1 = pub.cleanup("B", "E1")
    assert _state(reg, "B") is VersionState.FAILED_CLEAN
    frozen = reg.dump()

    tok, res = pub.token("B"), pub.results["B"]
    inc0 = pub.incarnation["E0"]
    # late PREPARED / READY / commit of the cleaned attempt: refused, nothing recreated
    refused(ErrorCode.STALE_ATTEMPT, reg.record_prepared, "E0", PreparedEvidence(vk("B"), tok, inc0))
    refused(ErrorCode.STALE_ATTEMPT, reg.record_ready, "E0", ReadyEvidence(vk("B"), res.digest, tok, inc0))
    refused(ErrorCode.STALE_ATTEMPT, pub.commit, "B")
    # duplicates of what was accepted answer identically and change nothing
    assert reg.abort(tok, "another reason") == abort
    assert pub.cleanup("B", "E1") == cleanup_e1
    reg.mark_engine_unknown("E1", tok, "cleanup", "late timeout")  # confirmed clean wins
    assert reg.status().unknown_outcomes == ()
    # a replayed reserve reports the failure; the candidate never comes back
    assert pub.reserve("B", request_id="retry").state is VersionState.FAILED_CLEAN
    assert reg.dump() != frozen  # only the new request id was remembered...
    assert _state(reg, "B") is VersionState.FAILED_CLEAN and reg.status().slots_used == 1


# ------------------------------------------------------------ row 5: bind / close races


def test_close_before_bind_leaves_tombstone_that_late_open_and_bind_cannot_reopen() -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    view = reg.begin_close(sk("s"))
    assert view.state is SessionState.CLOSED and view.binding is None
    refused(ErrorCode.SESSION_CLOSED, reg.bind_first, sk("s"))
    refused(ErrorCode.SESSION_CLOSED, reg.open_session, sk("s"))
    assert reg.close_and_release(sk("s")).state is SessionState.CLOSED
    assert reg.version(vk("A")).session_refs == 0
    # close_and_release without begin_close, before any bind: a tombstone as well
    reg.close_and_release(sk("t"))
    refused(ErrorCode.SESSION_CLOSED, reg.bind_first, sk("t"))


def test_one_binding_and_one_ref_per_session_and_release_exactly_once() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.open_session(sk("s"))
    first = reg.bind_first(sk("s"))
    # concurrent waiters / a lost bind reply: every retry gets the first binding, one ref
    assert all(reg.bind_first(sk("s")) == first for _ in range(5))
    pub.publish("B")
    assert reg.bind_first(sk("s")) == first, "a later default never rebinds an existing session"
    assert reg.version(vk("A")).session_refs == 1

    reg.begin_close(sk("s"))
    refused(ErrorCode.SESSION_CLOSED, reg.bind_first, sk("s"))  # late bind after begin_close
    refused(ErrorCode.SESSION_CLOSED, reg.open_session, sk("s"))
    assert reg.version(vk("A")).session_refs == 1, "begin_close keeps the ref until release"
    released = reg.close_and_release(sk("s"))
    assert released.released and released.binding == first
    for _ in range(3):
        assert reg.close_and_release(sk("s")) == released
        reg.begin_close(sk("s"))
    assert reg.version(vk("A")).session_refs == 0
    assert reg.binding_of(sk("s")) == first  # kept for the record


def test_bind_before_first_publication_is_no_published_version_and_binds_nothing() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    refused(ErrorCode.NO_PUBLISHED_VERSION, reg.bind_first, sk("s"))
    pub.reserve("A")
    pub.ready("A", "E0")
    pub.ready("A", "E1")
    refused(ErrorCode.NO_PUBLISHED_VERSION, reg.bind_first, sk("s"))  # LOADING is not bindable
    pub.commit("A")
    assert reg.bind_first(sk("s")).version_key == vk("A")


# ------------------------------------------------- row 8: capacity 2, C refused before begin


def test_capacity_two_refuses_c_before_any_begin_until_a_is_reclaimed_on_both_engines() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk("a1"))
    reg.bind_first(sk("a2"))
    pub.publish("B")
    assert reg.bind_first(sk("b1")).version_key == vk("B")

    err = refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "C")
    assert len(err.details["in_use"]) == 2
    assert reg.version(vk("C")) is None, "no attempt token handed out: no begin can start"

    refused(ErrorCode.VERSION_IN_USE, reg.claim_reclaim, vk("A"))
    reg.close_and_release(sk("a1"))
    refused(ErrorCode.VERSION_IN_USE, reg.claim_reclaim, vk("A"))
    reg.begin_close(sk("a2"))
    refused(ErrorCode.VERSION_IN_USE, reg.claim_reclaim, vk("A"))  # CLOSING still holds the ref
    reg.close_and_release(sk("a2"))

    claim = reg.claim_reclaim(vk("A"))
    refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "C")  # RECLAIMING still holds the slot
    pub.unloaded("A", "E0", claim)
    refused(ErrorCode.CAPACITY_ERROR, pub.reserve, "C")  # only one engine confirmed
    pub.unloaded("A", "E1", claim)
    assert pub.reserve("C").created
    assert reg.status().default == vk("B")


# --------------------------------------------- row 8b: duplicate reclaim, late unload receipts


def test_duplicate_reclaim_returns_same_id_and_late_or_duplicate_unload_receipts_change_nothing() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    refused(ErrorCode.VERSION_IN_USE, reg.claim_reclaim, vk("A"))  # the default is never reclaimed
    pub.publish("B")
    refused(ErrorCode.STALE_ATTEMPT, reg.confirm_reclaim, vk("A"), "E0", UnloadEvidence("rcl-x", "E0-i1"))

    claim = reg.claim_reclaim(vk("A"))
    assert reg.claim_reclaim(vk("A")) == claim
    first = pub.unloaded("A", "E0", claim)
    assert pub.unloaded("A", "E0", claim) == first
    assert _state(reg, "A") is VersionState.RECLAIMING
    refused(ErrorCode.STALE_ATTEMPT, reg.confirm_reclaim, vk("A"), "E1", UnloadEvidence("rcl-other", "E1-i1"))
    done = pub.unloaded("A", "E1", claim)
    assert done.complete and _state(reg, "A") is VersionState.RECLAIMED

    frozen = reg.dump()
    assert pub.unloaded("A", "E0", claim) == first  # late receipts: identical answers
    assert pub.unloaded("A", "E1", claim) == done
    assert reg.claim_reclaim(vk("A")) == claim
    assert reg.dump() == frozen


# -------------------------------------------------- row 10: engine restart between READY and commit


def test_engine_restart_between_ready_and_commit_invalidates_its_ready() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    pub.ready("B", "E0")
    old_e1 = pub.incarnation["E1"]
    pub.ready("B", "E1")

    restarted = pub.restart("E1")
    assert reg.version(vk("B")).attempt_phases["E1"].value == "NONE"
    err = refused(ErrorCode.NOT_ALL_READY, pub.commit, "B")
    assert err.details["missing"] == ["E1"]
    refused(ErrorCode.STALE_INCARNATION, pub.ready, "B", "E1", old_e1)  # a late READY from before
    refused(ErrorCode.STALE_INCARNATION, reg.register_engine_incarnation, "E1", old_e1)
    refused(ErrorCode.STALE_INCARNATION, pub.ready, "B", "E1", "E1-never-registered")

    pub.ready("B", "E1", restarted)  # the new incarnation re-ran begin..end
    assert pub.commit("B").version_key == vk("B")
