"""Sessions (RFC 4) and the worker leases they hang on: open, bind once, close and release exactly
once; a lease's grant, keep-alive and end, which closes every session on it through the same close.

None of these needs the publisher token: they are what rollout workers call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from lora_contract.errors import ErrorCode
from lora_contract.names import NAME_PART_RE
from relax_glue.registry_rules import (
    checked_seconds,
    checked_text,
    fail,
)
from relax_glue.registry_spec import OpKind, operation
from relax_glue.registry_state import RegistryState
from relax_glue.registry_types import (
    Binding,
    LeaseRecord,
    LeaseView,
    SessionKey,
    SessionRecord,
    SessionState,
    SessionView,
    evolve,
)


class SessionOps(RegistryState):
    """Session and lease operations and queries."""

    # ==================================================================== sessions (RFC 4)

    @operation(OpKind.SESSION)
    def open_session(
        self, session_key: SessionKey | Sequence[str], lease_id: str | None = None
    ) -> SessionView:
        """Register an OPEN session without binding (optional: bind_first also creates it).
        ``lease_id``: the live worker lease it hangs on (see :meth:`grant_lease`)."""
        sk = self._session_key(session_key)
        s = self._sessions.get(sk)
        if s is not None:
            if s.state is not SessionState.OPEN:
                self._closed(s)
            if self._attach(s, lease_id) is s:
                return self._session_view(s)
            s = self._attach(s, lease_id)
        else:
            self._live_lease(lease_id)
            s = SessionRecord(sk, SessionState.OPEN, lease_id=lease_id)
        self._sessions[sk] = s
        self._accepted()
        return self._session_view(s)

    @operation(OpKind.SESSION)
    def bind_first(self, session_key: SessionKey | Sequence[str], lease_id: str | None = None) -> Binding:
        """First call binds the current default and takes one session ref; later calls return
        the same binding (never the newer default). ``lease_id`` as for :meth:`open_session`
        (a session created by its bind hangs on it; an open one keeps the lease it has)."""
        sk = self._session_key(session_key)
        s = self._sessions.get(sk)
        if s is not None and s.state is not SessionState.OPEN:
            self._closed(s)
        if s is not None and s.binding is not None:
            return s.binding
        if self._default is None:
            fail(ErrorCode.NO_PUBLISHED_VERSION, "no version has been published yet")
        s = SessionRecord(sk, SessionState.OPEN) if s is None else s
        s = self._attach(s, lease_id)  # checked before any change
        rec = self._versions[self._default]
        binding = Binding(sk, rec.key, rec.lora_name, rec.digest, self._revision)
        self._put(evolve(rec, session_refs=rec.session_refs + 1))
        # The bind sets the binding and nothing else: the lease a session hangs on survives it.
        self._sessions[sk] = evolve(s, binding=binding)
        self._accepted()
        return binding

    @operation(OpKind.SESSION)
    def begin_close(self, session_key: SessionKey | Sequence[str]) -> SessionView:
        """Refuse any later open/bind. A close before any open/bind leaves a CLOSED tombstone."""
        sk = self._session_key(session_key)
        s = self._sessions.get(sk)
        if s is not None and s.state is not SessionState.OPEN:
            return self._session_view(s)
        new = (
            SessionRecord(sk, SessionState.CLOSED, closed_seq=self._seq + 1)
            if s is None
            else evolve(s, state=SessionState.CLOSING)
        )
        self._sessions[sk] = new
        self._accepted()
        return self._session_view(new)

    @operation(OpKind.SESSION)
    def close_and_release(self, session_key: SessionKey | Sequence[str]) -> SessionView:
        """Release the session ref exactly once and keep CLOSED; repeats are no-ops."""
        sk = self._session_key(session_key)
        s = self._sessions.get(sk)
        if s is not None and s.state is SessionState.CLOSED:
            return self._session_view(s)
        if s is None:
            new = SessionRecord(sk, SessionState.CLOSED, closed_seq=self._seq + 1)
            self._sessions[sk] = new
            self._accepted()
            return self._session_view(new)
        new = self._close(s, expired=False)
        self._accepted()
        return self._session_view(new)

    def _close(self, s: SessionRecord, *, expired: bool) -> SessionRecord:
        """The one close transition (owner's close and lease expiry alike): CLOSED, the session
        ref released exactly once, the lease gone."""
        release = s.binding is not None and not s.released
        new = evolve(
            s,
            state=SessionState.CLOSED,
            released=release or s.released,
            expired=expired,
            closed_seq=self._seq + 1,  # every close is part of exactly one accepted transition
        )
        if release:
            assert s.binding is not None
            rec = self._versions[s.binding.version_key]
            self._put(evolve(rec, session_refs=rec.session_refs - 1))
        self._sessions[s.key] = new
        return new

    # ========================================================================= leases
    # Beyond the RFC: a rollout worker that crashes never closes its sessions. Each worker holds
    # one lease (as etcd attaches many keys to one lease) and its sessions hang on it; a
    # keep-alive renews all of them at once, and when the lease runs out every session on it is
    # closed through the one close transition, so a retired version can still be reclaimed.
    #
    # What is journaled: a lease's grant (its TTL) and its end, a session's attachment (at open
    # or bind). What is not: the deadline, which keep-alives move in memory only. A restarted
    # host gives every live lease a fresh TTL from the restart (:meth:`refresh_leases`), so a
    # restart never ends a live worker's sessions early and a dead worker's end one TTL later.

    @operation(OpKind.SESSION, timed=True)
    def grant_lease(self, lease_id: str, ttl_s: float, now: float) -> LeaseView:
        """A new live lease of ``ttl_s`` seconds from ``now`` (registry clock). A repeat of a live
        lease with the same TTL is a keep-alive; another TTL is refused (a lease's TTL is fixed
        at its grant); an ended lease is never granted again (SESSION_EXPIRED)."""
        lid = checked_text("lease_id", lease_id, NAME_PART_RE)
        ttl, t = checked_seconds("ttl_s", ttl_s, positive=True), checked_seconds("now", now)
        lease = self._leases.get(lid)
        if lease is not None:
            if lease.ttl_s != ttl:
                fail(
                    ErrorCode.INVALID_REQUEST,
                    f"lease {lid} was granted with ttl_s={lease.ttl_s}",
                    lease_id=lid,
                )
            return self.keep_alive(lid, t)
        self._leases[lid] = LeaseRecord(lid, ttl)
        self._deadlines[lid] = t + ttl
        self._accepted()
        return self._lease_view(self._leases[lid])

    @operation(OpKind.SOFT, timed=True)
    def keep_alive(self, lease_id: str, now: float) -> LeaseView:
        """Move a live lease's deadline to ``now + ttl`` (never earlier). Soft state only: no
        transition, nothing to journal. An ended lease answers SESSION_EXPIRED (its sessions are
        closed: the worker must not dispatch on them), an unknown one INVALID_REQUEST."""
        lease = self._lease_record(lease_id)
        t = checked_seconds("now", now)
        if not lease.live:
            self._lease_ended(lease)
        self._deadlines[lease.lease_id] = max(self._deadlines.get(lease.lease_id, t), t + lease.ttl_s)
        return self._lease_view(lease)

    @operation(OpKind.QUERY, timed=True)
    def leases_due(self, now: float) -> tuple[str, ...]:
        """The live leases whose deadline is ``<= now`` (a read of the soft state)."""
        t = checked_seconds("now", now)
        return tuple(sorted(lid for lid, d in self._deadlines.items() if d <= t))

    @operation(OpKind.SESSION)
    def end_leases(self, lease_ids: Sequence[str]) -> tuple[SessionKey, ...]:
        """End each live lease of ``lease_ids`` and close, exactly once and through the same
        transition as a normal close, every session on it (OPEN, or CLOSING by an owner that
        died mid-close). Returns the sessions closed; leases already ended change nothing.
        Deterministic in its argument: this is what the journal keeps of an expiry."""
        if isinstance(lease_ids, str) or not isinstance(lease_ids, Sequence):
            fail(ErrorCode.INVALID_REQUEST, "lease_ids must be a list of lease ids")
        ending = {lid: self._lease_record(lid) for lid in lease_ids}  # all checked first
        ending = {lid: lease for lid, lease in ending.items() if lease.live}
        if not ending:
            return ()
        due = [
            s for s in self._sessions.values() if s.lease_id in ending and s.state is not SessionState.CLOSED
        ]
        for lid, lease in ending.items():
            self._leases[lid] = evolve(lease, live=False)
            self._deadlines.pop(lid, None)
        for s in due:
            self._close(s, expired=True)
        self._accepted()
        return tuple(s.key for s in due)

    @operation(OpKind.DERIVED, timed=True)
    def expire_leases(self, now: float) -> tuple[SessionKey, ...]:
        """End every lease that ran out by ``now``: ``end_leases(leases_due(now))``. None due:
        nothing changes. A durable host journals the ``end_leases`` call, not this one."""
        due = self.leases_due(now)
        return self.end_leases(due) if due else ()

    def refresh_leases(self, now: float) -> None:
        """Give every live lease a fresh TTL from ``now`` (soft state): what a host does after a
        restart, when the deadlines of before are gone with the old process."""
        t = checked_seconds("now", now)
        self._deadlines = {lid: t + lease.ttl_s for lid, lease in self._leases.items() if lease.live}

    @operation(OpKind.QUERY)
    def lease(self, lease_id: str) -> LeaseView | None:
        lease = self._leases.get(checked_text("lease_id", lease_id, NAME_PART_RE))
        return self._lease_view(lease) if lease else None

    def _lease_record(self, lease_id: Any) -> LeaseRecord:
        lid = checked_text("lease_id", lease_id, NAME_PART_RE)
        lease = self._leases.get(lid)
        if lease is None:
            fail(ErrorCode.INVALID_REQUEST, f"no lease {lid}: grant it first", lease_id=lid)
        return lease

    def _live_lease(self, lease_id: str | None) -> None:
        if lease_id is not None:
            lease = self._lease_record(lease_id)
            if not lease.live:
                self._lease_ended(lease)

    def _attach(self, s: SessionRecord, lease_id: str | None) -> SessionRecord:
        """``s`` hanging on ``lease_id`` (checked; ``s`` itself when nothing changes)."""
        if lease_id is None or s.lease_id == lease_id:
            return s
        if s.lease_id is not None:
            fail(ErrorCode.INVALID_REQUEST, f"session {s.key} hangs on lease {s.lease_id}, not {lease_id}")
        self._live_lease(lease_id)
        return evolve(s, lease_id=lease_id)

    @staticmethod
    def _lease_ended(lease: LeaseRecord) -> NoReturn:
        fail(
            ErrorCode.SESSION_EXPIRED,
            f"lease {lease.lease_id} ran out: its sessions are closed",
            lease_id=lease.lease_id,
        )

    def _lease_view(self, lease: LeaseRecord) -> LeaseView:
        return LeaseView(lease.lease_id, lease.ttl_s, lease.live, self._deadlines.get(lease.lease_id))

    @operation(OpKind.SESSION)
    def prune_sessions(self, keep_last: int) -> int:
        """Forget CLOSED session records closed more than ``keep_last`` transitions ago (their
        refs were released long since); returns how many. Bounded growth over a long run.

        Answers after pruning stay safe: a late close of a pruned session answers CLOSED and
        releases nothing (its ref was released once, at its real close). The tombstone window
        is ``keep_last`` transitions: a late ``open_session`` / ``bind_first`` of a pruned key
        after that window is indistinguishable from a new session (keys carry a fresh nonce per
        lifecycle; with leases on, such a worker has met SESSION_EXPIRED long before)."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            fail(ErrorCode.INVALID_REQUEST, "keep_last must be an int >= 1")
        horizon = self._seq - keep_last
        gone = [
            k
            for k, s in self._sessions.items()
            if s.state is SessionState.CLOSED and s.closed_seq is not None and s.closed_seq <= horizon
        ]
        for k in gone:
            del self._sessions[k]
        if gone:
            # An ended lease no kept session hangs on goes with them (bounded growth when
            # workers come and go); a late keep-alive of it is then an unknown lease.
            held = {s.lease_id for s in self._sessions.values()}
            self._leases = {lid: lease for lid, lease in self._leases.items() if lease.live or lid in held}
            self._accepted()
        return len(gone)

    # ======================================================================== queries

    @operation(OpKind.QUERY)
    def binding_of(self, session_key: SessionKey | Sequence[str]) -> Binding | None:
        """The session's binding (kept after close, for the record); None if never bound."""
        s = self._sessions.get(self._session_key(session_key))
        return s.binding if s else None

    @operation(OpKind.QUERY)
    def session(self, session_key: SessionKey | Sequence[str]) -> SessionView | None:
        s = self._sessions.get(self._session_key(session_key))
        return self._session_view(s) if s else None

    @operation(OpKind.QUERY)
    def sessions(self, include_closed: bool = False, limit: int | None = None) -> tuple[SessionView, ...]:
        """Sessions in the order they were opened (the newest ``limit`` of them); CLOSED
        tombstones only when ``include_closed``. For operators: the registry's own view."""
        views = [
            self._session_view(s)
            for s in self._sessions.values()
            if include_closed or s.state is not SessionState.CLOSED
        ]
        return tuple(views if limit is None else views[-limit:] if limit > 0 else [])

    def _closed(self, s: SessionRecord) -> NoReturn:
        if s.expired:
            fail(
                ErrorCode.SESSION_EXPIRED, f"session {s.key} expired: its lease ran out", state=s.state.value
            )
        fail(ErrorCode.SESSION_CLOSED, f"session {s.key} is {s.state.value}", state=s.state.value)
