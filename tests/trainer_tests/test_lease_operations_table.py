"""Every lease operation in every lease state: one expected answer per cell, as the session
operations have (test_registry's session table), written from the rules of docs/fault-semantics.md
("Leases") and the registry's lease docstrings, asserted against the REAL pure registry.

The rules the cells come from:

* A lease is live from its grant until it is ENDED, and it ends only by the journaled decision
  (``end_leases``, which ``expire_leases`` makes for the leases due by ``now``). A live lease whose
  deadline passed (DUE) is still live: a keep-alive or a repeated grant renews it, a session may
  still be opened or bound on it, until the reaper's decision.
* A repeated grant of a live lease with its TTL is a keep-alive; an ended lease is never granted,
  renewed nor attached to again (SESSION_EXPIRED); an unknown lease is INVALID_REQUEST.
* Renewals are soft state (no transition); a deadline never moves earlier.
* An end closes every session on the lease exactly once; a second end of an ended lease changes
  nothing.
* A registry restart (state reloaded, ``refresh_leases``) gives every LIVE lease a fresh TTL from
  the restart, and never revives an ENDED one.
* Pruning forgets CLOSED session records past the window and an ENDED lease no kept session
  hangs on; it never forgets a live lease, even one with no session at the moment. A forgotten
  lease is an unknown lease afterwards (the window, as for pruned session keys: a worker never
  re-grants an old lease id, it draws a fresh one).
* A retried open or bind carrying the lease the session already has answers as the first call
  did and changes nothing.

Every cell is also called twice: the repeat changes nothing and answers the same (for the ops
that report what they did, ``end_leases``, ``expire_leases`` and ``prune_sessions``, the repeat
reports that nothing more was done: each session is closed exactly once).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from _rg_helpers import Checked, Publisher, new_registry, refused, sk, snapshot, vk

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.registry_types import SessionState

T0 = 1_000.0
TTL = 10.0
RESTART_AT = 50.0  # offsets from T0

# label -> the registry clock (offset from T0) at which the ops of that row are called
_NOW = {
    "ABSENT": 5.0,  # never granted
    "LIVE": 5.0,  # granted at T0, session s bound on it, deadline T0 + 10
    "IDLE": 5.0,  # live, its only session closed by its owner: no session at the moment
    "CLOSING": 5.0,  # live, its session's owner died mid-close (begin_close, no release)
    "DUE": 12.0,  # live, its deadline passed, not yet ended (the reaper has not run)
    "ENDED": 12.0,  # ended by expiry at T0 + 10; s closed as expired
    "RESTARTED": 55.0,  # LIVE, then the registry restarted at T0 + 50 (its deadline passed while down)
    "ENDED_RESTARTED": 55.0,  # ENDED, then the registry restarted at T0 + 50
    "PRUNED": 12.0,  # ENDED, then its session pruned: the lease is forgotten
}
STATES = tuple(_NOW)


def _restart(reg: Any) -> Any:
    """A registry restart as a durable host does it: the state rebuilt from what is on disk (the
    dump carries no deadline: renewals are soft state), then every live lease refreshed."""
    fresh = Checked(LoRAVersionRegistry.load(reg.inner.dump()))
    fresh.refresh_leases(T0 + RESTART_AT)
    return fresh


def _lease_in(label: str) -> Any:
    """A registry with version A as the default and lease ``w`` (TTL 10) in state ``label``;
    two unleased sessions opened last, so pruning with ``keep_last=1`` reaches every close."""
    reg = new_registry()
    Publisher(reg).publish("A")
    if label != "ABSENT":
        reg.grant_lease("w", TTL, T0)
        reg.bind_first(sk("s"), "w")
    if label == "IDLE":
        reg.close_and_release(sk("s"))
    if label == "CLOSING":
        reg.begin_close(sk("s"))
    if label in ("ENDED", "ENDED_RESTARTED", "PRUNED"):
        assert reg.expire_leases(T0 + TTL) == (sk("s"),)
    reg.open_session(sk("f1"))
    reg.open_session(sk("f2"))
    if label == "PRUNED":
        assert reg.prune_sessions(1) == 1 and reg.lease("w") is None
    if label in ("RESTARTED", "ENDED_RESTARTED"):
        reg = _restart(reg)
    return reg


@dataclasses.dataclass(frozen=True)
class Row:
    """An accepted cell: lease ``w`` afterwards ("live", "ended" or "absent") and its deadline
    (offset from T0; None: no deadline), the transitions made, the change of A's session refs,
    and, for the ops that report it, the answer (sessions closed, records pruned)."""

    lease: str
    expires: float | None
    transitions: int = 0
    refs: int = 0
    answer: Any = None


def _live(expires: float, transitions: int = 0, refs: int = 0, answer: Any = None) -> Row:
    return Row("live", expires, transitions, refs, answer)


_ENDED = Row("ended", None)
_ABSENT = Row("absent", None)
_GONE = ErrorCode.INVALID_REQUEST  # an unknown lease (never granted, or forgotten by pruning)
_EXPIRED = ErrorCode.SESSION_EXPIRED

# op -> label -> Row or the refusal's code
_LEASE_ROWS: dict[str, dict[str, Row | ErrorCode]] = {
    # the worker's first grant, or a retried one (its reply was lost): a keep-alive when live
    "grant_lease": {
        "ABSENT": _live(15.0, transitions=1),
        "LIVE": _live(15.0),
        "IDLE": _live(15.0),
        "CLOSING": _live(15.0),
        "DUE": _live(22.0),  # not ended yet: renewed
        "ENDED": _EXPIRED,  # never granted again
        "RESTARTED": _live(65.0),
        "ENDED_RESTARTED": _EXPIRED,
        "PRUNED": _live(22.0, transitions=1),  # forgotten: a new lease (the window)
    },
    "keep_alive": {
        "ABSENT": _GONE,
        "LIVE": _live(15.0),
        "IDLE": _live(15.0),
        "CLOSING": _live(15.0),
        "DUE": _live(22.0),
        "ENDED": _EXPIRED,
        "RESTARTED": _live(65.0),
        "ENDED_RESTARTED": _EXPIRED,
        "PRUNED": _GONE,
    },
    "end_leases": {
        "ABSENT": _GONE,
        "LIVE": Row("ended", None, 1, -1, ("s",)),
        "IDLE": Row("ended", None, 1, 0, ()),  # a lease with no session ends too
        "CLOSING": Row("ended", None, 1, -1, ("s",)),  # closed through the one close, released once
        "DUE": Row("ended", None, 1, -1, ("s",)),
        "ENDED": Row("ended", None, 0, 0, ()),  # a second end changes nothing
        "RESTARTED": Row("ended", None, 1, -1, ("s",)),
        "ENDED_RESTARTED": Row("ended", None, 0, 0, ()),
        "PRUNED": _GONE,
    },
    "expire_leases": {
        "ABSENT": Row("absent", None, 0, 0, ()),
        "LIVE": _live(10.0, answer=()),
        "IDLE": _live(10.0, answer=()),
        "CLOSING": _live(10.0, answer=()),
        "DUE": Row("ended", None, 1, -1, ("s",)),
        "ENDED": Row("ended", None, 0, 0, ()),
        "RESTARTED": _live(60.0, answer=()),  # a fresh TTL from the restart: never expired early
        "ENDED_RESTARTED": Row("ended", None, 0, 0, ()),
        "PRUNED": Row("absent", None, 0, 0, ()),
    },
    # a restart's refresh (what a restarted host does first), at the row's clock
    "refresh_leases": {
        "ABSENT": _ABSENT,
        "LIVE": _live(15.0),
        "IDLE": _live(15.0),
        "CLOSING": _live(15.0),
        "DUE": _live(22.0),
        "ENDED": _ENDED,  # never revived: no deadline, never due, never renewed
        "RESTARTED": _live(65.0),
        "ENDED_RESTARTED": _ENDED,
        "PRUNED": _ABSENT,
    },
    "prune_sessions": {
        "ABSENT": Row("absent", None, 0, 0, 0),
        "LIVE": _live(10.0, answer=0),
        "IDLE": _live(10.0, transitions=1, answer=1),  # its session goes, the live lease stays
        "CLOSING": _live(10.0, answer=0),  # a CLOSING record is never pruned
        "DUE": _live(10.0, answer=0),
        "ENDED": Row("absent", None, 1, 0, 1),  # the ended lease goes with its last session
        "RESTARTED": _live(60.0, answer=0),
        "ENDED_RESTARTED": Row("absent", None, 1, 0, 1),
        "PRUNED": Row("absent", None, 0, 0, 0),
    },
    # a new session of the worker, on its lease
    "open_session:new": {
        "ABSENT": _GONE,
        "LIVE": _live(10.0, transitions=1),
        "IDLE": _live(10.0, transitions=1),
        "CLOSING": _live(10.0, transitions=1),
        "DUE": _live(10.0, transitions=1),  # still live until the reaper's decision
        "ENDED": _EXPIRED,
        "RESTARTED": _live(60.0, transitions=1),
        "ENDED_RESTARTED": _EXPIRED,
        "PRUNED": _GONE,
    },
    "bind_first:new": {
        "ABSENT": _GONE,
        "LIVE": _live(10.0, transitions=1, refs=1),
        "IDLE": _live(10.0, transitions=1, refs=1),
        "CLOSING": _live(10.0, transitions=1, refs=1),
        "DUE": _live(10.0, transitions=1, refs=1),
        "ENDED": _EXPIRED,
        "RESTARTED": _live(60.0, transitions=1, refs=1),
        "ENDED_RESTARTED": _EXPIRED,
        "PRUNED": _GONE,
    },
    # a retried open or bind of session s carrying the lease it already has
    "open_session:retry": {
        "ABSENT": _GONE,
        "LIVE": _live(10.0),
        "IDLE": ErrorCode.SESSION_CLOSED,
        "CLOSING": ErrorCode.SESSION_CLOSED,
        "DUE": _live(10.0),
        "ENDED": _EXPIRED,
        "RESTARTED": _live(60.0),
        "ENDED_RESTARTED": _EXPIRED,
        "PRUNED": _GONE,
    },
    "bind_first:retry": {
        "ABSENT": _GONE,
        "LIVE": _live(10.0),  # the first binding, never a second ref
        "IDLE": ErrorCode.SESSION_CLOSED,
        "CLOSING": ErrorCode.SESSION_CLOSED,
        "DUE": _live(10.0),
        "ENDED": _EXPIRED,
        "RESTARTED": _live(60.0),
        "ENDED_RESTARTED": _EXPIRED,
        "PRUNED": _GONE,
    },
}

_REPORTING_OPS = {"end_leases": (), "expire_leases": (), "prune_sessions": 0}  # op -> "nothing more"


def _call(reg: Any, op: str, now: float) -> Any:
    name, _, which = op.partition(":")
    if name == "grant_lease":
        return reg.grant_lease("w", TTL, now)
    if name == "keep_alive":
        return reg.keep_alive("w", now)
    if name == "end_leases":
        return reg.end_leases(["w"])
    if name == "expire_leases":
        return reg.expire_leases(now)
    if name == "refresh_leases":
        return reg.refresh_leases(now)
    if name == "prune_sessions":
        return reg.prune_sessions(1)
    key = sk("n" if which == "new" else "s")
    return getattr(reg, name)(key, "w")


def _lease_state(reg: Any) -> tuple[str, float | None]:
    view = reg.lease("w")
    if view is None:
        return "absent", None
    assert view.lease_id == "w" and view.ttl_s == TTL
    expires = None if view.expires_at is None else view.expires_at - T0
    return ("live" if view.live else "ended"), expires


def _answer(op: str, result: Any) -> Any:
    if op in ("end_leases", "expire_leases"):
        return tuple(key.nonce for key in result)
    return result if op == "prune_sessions" else None


@pytest.mark.parametrize("op", list(_LEASE_ROWS))
@pytest.mark.parametrize("label", STATES)
def test_every_lease_op_has_one_answer_for_every_lease_state(op: str, label: str) -> None:
    assert set(_LEASE_ROWS[op]) == set(STATES)
    reg = _lease_in(label)
    now = T0 + _NOW[label]
    refs, seq = reg.version(vk("A")).session_refs, reg.seq
    want = _LEASE_ROWS[op][label]
    if isinstance(want, ErrorCode):
        before = snapshot(reg)
        for _ in range(2):  # refused, and refused the same way again
            refused(want, _call, reg, op, now)
            assert snapshot(reg) == before  # the deadlines (soft state) too: nothing changed
        return

    first = _call(reg, op, now)
    assert _lease_state(reg) == (want.lease, want.expires)
    assert reg.seq == seq + want.transitions
    assert reg.version(vk("A")).session_refs == refs + want.refs
    assert _answer(op, first) == want.answer
    reg.check_invariants(full=True)

    # the repeat: nothing changes, and it answers as the first call did
    after, seq_after = snapshot(reg), reg.seq
    again = _call(reg, op, now)
    assert snapshot(reg) == after and reg.seq == seq_after
    if op in _REPORTING_OPS:
        assert _answer(op, again) == _REPORTING_OPS[op]  # exactly once: nothing more to do
    else:
        assert again == first

    if want.lease == "ended":
        # every session on an ended lease is closed as expired, its ref released exactly once
        for key in (sk("s"), sk("n")):
            view = reg.session(key)
            if view is not None and view.lease_id == "w" and label != "IDLE":
                assert view.state is SessionState.CLOSED and view.expired and view.released
        assert "w" not in reg.leases_due(T0 + 10**6)  # never due again (no deadline)


@pytest.mark.parametrize("label", ["ENDED", "ENDED_RESTARTED"])
def test_an_ended_lease_stays_ended_through_a_refresh_and_its_sessions_never_rebind(label: str) -> None:
    """The whole life after a restart's refresh: the ended lease has no deadline, nothing can
    renew, re-grant or attach to it, and its expired session is refused, never rebound."""
    reg = _lease_in(label)
    reg.refresh_leases(T0 + 70)
    assert reg.lease("w").expires_at is None and reg.leases_due(T0 + 10**6) == ()
    for call in (
        lambda: reg.keep_alive("w", T0 + 71),
        lambda: reg.grant_lease("w", TTL, T0 + 71),
        lambda: reg.open_session(sk("s")),
        lambda: reg.bind_first(sk("s")),
        lambda: reg.open_session(sk("n"), "w"),
    ):
        refused(ErrorCode.SESSION_EXPIRED, call)
    view = reg.session(sk("s"))
    assert view.state is SessionState.CLOSED and view.expired and view.released
    assert reg.version(vk("A")).session_refs == 0


def test_a_live_lease_whose_sessions_were_all_pruned_still_holds_its_next_session() -> None:
    """A worker between sessions: its last session closed long ago and was pruned. Its lease
    is live (the worker is alive), so its next session opens on it and is expired with it."""
    reg = _lease_in("IDLE")
    assert reg.prune_sessions(1) == 1 and reg.session(sk("s")) is None
    assert reg.lease("w").live
    reg.keep_alive("w", T0 + 8)
    reg.bind_first(sk("next"), "w")
    assert reg.expire_leases(T0 + 17.9) == ()
    assert reg.expire_leases(T0 + 18) == (sk("next"),)
    assert reg.version(vk("A")).session_refs == 0


def test_a_refused_lease_op_is_refused_before_anything_changes() -> None:
    """A bad argument with a good lease id: refused, the lease and its deadline untouched."""
    reg = _lease_in("LIVE")
    before = snapshot(reg)
    for call in (
        lambda: reg.keep_alive("w", -1.0),
        lambda: reg.grant_lease("w", TTL + 1, T0 + 5),
        lambda: reg.end_leases(["w", "nobody"]),  # all checked first: w does not end
        lambda: reg.refresh_leases(float("nan")),
    ):
        with pytest.raises(LoraVersionError):
            call()
        assert snapshot(reg) == before
