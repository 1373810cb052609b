"""LoRAVersionRegistry: the single-writer lifecycle state machine (RFC sections 3-5).

Pure and synchronous: it stores state and makes transitions, nothing else. It never waits on a
network, a collective, a probe or an unload; the publisher does that IO and reports the outcome
back as receipts. Every race is therefore a deterministic sequence of calls.

Rules every operation follows:

* **Check before you mutate.** An op first validates everything that could refuse it and only
  then swaps in new (frozen) records. A raised :class:`LoraVersionError` means nothing changed.
* **Idempotent.** A retried op gets the answer of the first call: ``reserve`` by request id,
  ``commit`` by its stored receipt, receipts and claims by their natural key, session ops by the
  session record. Ids the registry hands out (attempt tokens, reclaim ids) are derived from the
  version identity, so replaying the same history yields the same ids.
* **Deterministic.** No clocks, no randomness, no IO: the durable store (``store.py``) rebuilds
  the exact state by replaying the journal of accepted calls.
* **Never free on a guess.** A slot is released only by a confirmed receipt from every engine
  (cleanup for a failed candidate, UNLOADED for a reclaim). An unknown outcome keeps the slot
  and blocks new publications until a receipt resolves it.
* **Only the publisher publishes.** Every op that changes versions, the default, the cohort or
  capacity (``PUBLISHER_OPS``) must carry the publisher token the registry was opened with; a
  missing or wrong one is NOT_PUBLISHER, checked first (by the op's declaration), so it changes
  nothing and gets no replayed answer either (a replay would hand out attempt tokens and
  reclaim ids). Session and
  lease ops and queries need none: they are what rollout workers call. The token is an input
  (given at construction, or drawn once there), never part of a transition, a dump or an answer.

Decisions where the issue is silent are marked "Decision:" next to the code that makes them.

Where things are (one concern per module, all mixins over one state):

* :mod:`relax_glue.registry_spec`: the declaration of an operation (``@operation(kind)``), from
  which the op tables below, the store's journal, the actor's dispatch and the clients follow;
* :mod:`relax_glue.registry_rules`: the pure rules (slot, reclaim, pending and committed states,
  transitions, input checks);
* :mod:`relax_glue.registry_state`: the state and what every part shares;
* :mod:`relax_glue.registry_attempts`: publication, reserve to commit or cleanup, and the engines;
* :mod:`relax_glue.registry_sessions`: sessions and leases;
* :mod:`relax_glue.registry_reclaim`: reclaim;
* this module: the registry they make together, its status, invariants, dump and load, and the
  op tables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from relax_glue.registry_attempts import AttemptOps
from relax_glue.registry_reclaim import ReclaimOps
from relax_glue.registry_rules import (
    COMMITTED_STATES,
    PENDING_STATES,
    UNKNOWN_PHASES,
    checked_publisher_token,
    holds_slot,
    is_committed,
    may_start_reclaim,
    new_publisher_token,
)
from relax_glue.registry_sessions import SessionOps
from relax_glue.registry_spec import OpKind, op_table, operation
from relax_glue.registry_types import (
    AttemptPhase,
    ReclaimPhase,
    SessionState,
    StatusView,
    VersionKey,
    VersionState,
    VersionView,
    decode,
    encode,
)

__all__ = [
    "DERIVED_OPS",
    "MUTATING_OPS",
    "OPS",
    "PUBLIC_OPS",
    "PUBLISHER_OPS",
    "QUERY_OPS",
    "SESSION_OPS",
    "SOFT_OPS",
    "TIMED_OPS",
    "LoRAVersionRegistry",
    "checked_publisher_token",
    "holds_slot",
    "is_committed",
    "may_start_reclaim",
    "new_publisher_token",
    "stamp_now",
]


class LoRAVersionRegistry(AttemptOps, SessionOps, ReclaimOps):
    """Versions, default, sessions, capacity and op results of one deployment epoch.

    Construct with the deployment epoch, the fixed engine cohort (N >= 1 engine ids) and the
    capacity (managed versions that may hold a slot at once). Every method either returns a
    typed, frozen result or raises :class:`LoraVersionError` having changed nothing.
    """

    # ======================================================================== queries

    @operation(OpKind.QUERY)
    def status(self) -> StatusView:
        counts = dict.fromkeys((s.value for s in SessionState), 0)
        for s in self._sessions.values():
            counts[s.state.value] += 1
        default = self._versions[self._default] if self._default else None
        pending = self._versions[self._pending].attempt_token if self._pending else None
        return StatusView(
            epoch=self.epoch,
            capacity=self.capacity,
            slots_used=len(self._live),
            default=self._default,
            default_lora_name=default.lora_name if default else None,
            default_revision=self._revision,
            pending_attempt=pending,
            engines={e: r.incarnation for e, r in self._engines.items()},
            versions=tuple(self._version_view(r) for r in self._versions.values()),
            unknown_outcomes=tuple(self._unknown[k] for k in sorted(self._unknown)),
            sessions=counts,
            seq=self._seq,
            base_fingerprint=self._base,
        )

    @operation(OpKind.QUERY)
    def version(self, version_key: VersionKey | Sequence[str]) -> VersionView | None:
        rec = self._versions.get(self._key(version_key))
        return self._version_view(rec) if rec else None

    # ================================================================ invariants and dumps

    def check_invariants(self, full: bool = True) -> None:
        """Raise AssertionError when the state is inconsistent.

        ``full=False`` is the cheap form run after every accepted transition (O(capacity)):
        slots, default, pending attempt. ``full=True`` (tests) also walks every version and
        session and recounts the session refs.
        """
        live = self._live
        assert len(live) <= self.capacity, f"{len(live)} slots in use > capacity {self.capacity}"
        for k in live:
            assert holds_slot(self._versions[k].state), f"{k} in live set but {self._versions[k].state}"
        if self._default is not None:
            assert self._versions[self._default].state is VersionState.PUBLISHED, "default is not PUBLISHED"
            assert self._default in live
        if self._pending is not None:
            assert self._versions[self._pending].state in PENDING_STATES
        for (engine, ref), outcome in self._unknown.items():
            rec = self._versions[outcome.version_key]
            phase = (
                rec.reclaim_phases.get(engine) if ref == rec.reclaim_id else rec.attempt_phases.get(engine)
            )
            assert phase in (AttemptPhase.UNKNOWN, ReclaimPhase.UNKNOWN), f"unknown {engine}:{ref} is {phase}"
            assert outcome.version_key in live, "an unknown outcome must keep its slot"
        if not full:
            return

        published = [r.key for r in self._versions.values() if r.state is VersionState.PUBLISHED]
        assert published == ([self._default] if self._default else []), f"published {published}"
        pending = [r.key for r in self._versions.values() if r.state in PENDING_STATES]
        assert pending == ([self._pending] if self._pending else []), f"pending attempts {pending}"
        assert live == {r.key for r in self._versions.values() if holds_slot(r.state)}
        refs = dict.fromkeys(self._versions, 0)
        for s in self._sessions.values():
            assert s.key.epoch == self.epoch
            if s.expired:
                assert s.state is SessionState.CLOSED and s.lease_id is not None, f"{s.key} expired"
            if s.lease_id is not None and s.state is not SessionState.CLOSED:
                assert self._leases[s.lease_id].live, f"{s.key} is {s.state} on an ended lease"
            if s.binding is None:
                assert not s.released
                continue
            assert s.released == (s.state is SessionState.CLOSED), f"{s.key}: released={s.released} {s.state}"
            if not s.released:
                refs[s.binding.version_key] += 1
        commits = 0
        for rec in self._versions.values():
            assert rec.session_refs >= 0, f"{rec.key} negative refs"
            assert rec.session_refs == refs[rec.key], f"{rec.key} refs {rec.session_refs} != {refs[rec.key]}"
            if rec.session_refs > 0:
                assert rec.state in (VersionState.PUBLISHED, VersionState.RETIRED), (
                    f"{rec.key} in use but {rec.state}"
                )
            assert (rec.commit is not None) == (rec.state in COMMITTED_STATES)
            commits += rec.commit is not None
            assert (rec.reclaim_id is not None) == (
                rec.state in (VersionState.RECLAIMING, VersionState.RECLAIMED)
            )
            if rec.state is VersionState.RECLAIMED:
                assert all(p is ReclaimPhase.UNLOADED for p in rec.reclaim_phases.values())
            if rec.state is VersionState.FAILED_CLEAN:
                assert all(p is AttemptPhase.CLEANED for p in rec.attempt_phases.values())
            if rec.state is VersionState.LOADING:
                assert AttemptPhase.CLEANED not in rec.attempt_phases.values()
            assert set(rec.attempt_phases) == set(self.engines)
            assert self._by_token[rec.attempt_token] == rec.key and self._by_name[rec.lora_name] == rec.key
            for engine, phase in [*rec.attempt_phases.items(), *rec.reclaim_phases.items()]:
                ref = rec.attempt_token if isinstance(phase, AttemptPhase) else rec.reclaim_id
                assert ((engine, ref) in self._unknown) == (phase in UNKNOWN_PHASES)
        assert commits == self._revision, f"{commits} commits but revision {self._revision}"
        assert len(self._by_token) == len(self._by_name) == len(self._versions)

    @operation(OpKind.QUERY)
    def dump(self) -> str:
        """The complete state as canonical JSON (equal state <=> equal text); see :meth:`load`."""
        state = {
            "epoch": self.epoch,
            "engines": list(self.engines),
            "capacity": self.capacity,
            "versions": list(self._versions.values()),
            "sessions": list(self._sessions.values()),
            "leases": list(self._leases.values()),
            "engine_records": list(self._engines.values()),
            "lost": self._lost,
            "default": self._default,
            "revision": self._revision,
            "unknown": list(self._unknown.values()),
            "reserve_requests": {r: [list(a), res] for r, (a, res) in self._reserve_requests.items()},
            "results": [[list(k), v] for k, v in self._results.items()],
            "seq": self._seq,
            "base": self._base,
        }
        return json.dumps(encode(state), sort_keys=True, separators=(",", ":"))

    @classmethod
    def load(
        cls, text: str, *, debug_checks: bool = __debug__, publisher_token: str | None = None
    ) -> LoRAVersionRegistry:
        """Rebuild a registry from :meth:`dump` output (used for checkpoints and tests). A dump
        holds no publisher token: the loader gives the one to keep (the store's), or gets a new one."""
        state = decode(json.loads(text))
        reg = cls(
            state["epoch"],
            state["engines"],
            state["capacity"],
            debug_checks=debug_checks,
            publisher_token=publisher_token,
        )
        for rec in state["versions"]:
            reg._put(rec)
            reg._by_token[rec.attempt_token] = rec.key
            reg._by_name[rec.lora_name] = rec.key
            if rec.reclaim_id is not None:
                reg._by_reclaim[rec.reclaim_id] = rec.key
        reg._sessions = {s.key: s for s in state["sessions"]}
        reg._leases = {lease.lease_id: lease for lease in state["leases"]}
        reg._engines = {e.engine_id: e for e in state["engine_records"]}
        reg._lost = dict(state.get("lost", {}))
        reg._default = state["default"]
        reg._revision = state["revision"]
        reg._unknown = {(u.engine_id, u.ref): u for u in state["unknown"]}
        reg._reserve_requests = {r: (tuple(a), res) for r, (a, res) in state["reserve_requests"].items()}
        reg._results = {tuple(k): v for k, v in state["results"]}
        reg._seq = state["seq"]
        reg._base = state.get("base")  # absent in checkpoints written before it was recorded
        reg.check_invariants(full=True)
        return reg


# ----------------------------------------------------------------------------- op tables
# Derived from the declarations (``@operation``) on the registry's methods: each op is declared
# once, where its rule is; these names are what the store, the actor and the clients read.
OPS = op_table(LoRAVersionRegistry)
# The mutating ops only the publisher may call (they take ``publisher_token``): everything that
# changes versions, the default, the cohort or the capacity slots.
PUBLISHER_OPS: tuple[str, ...] = OPS.names(OpKind.PUBLISHER)
# The other mutating ops: session and lease ops (rollout workers) and the store's own pruning.
SESSION_OPS: tuple[str, ...] = OPS.names(OpKind.SESSION)
# The public mutating operations, used by the durable store (journal) and the actor.
MUTATING_OPS: tuple[str, ...] = (*PUBLISHER_OPS, *SESSION_OPS)
QUERY_OPS: tuple[str, ...] = OPS.names(OpKind.QUERY)
SOFT_OPS: tuple[str, ...] = OPS.names(OpKind.SOFT)
DERIVED_OPS: tuple[str, ...] = OPS.names(OpKind.DERIVED)
TIMED_OPS: tuple[str, ...] = OPS.timed
# Everything a client may call (the actor's allow-list, the typed forwarding table).
PUBLIC_OPS: tuple[str, ...] = OPS.public


def stamp_now(op: str, kwargs: dict[str, Any], clock: Any = None) -> dict[str, Any]:
    """``kwargs`` with ``now`` set from the host's clock for a timed op (kept when given)."""
    if op in TIMED_OPS and kwargs.get("now") is None:
        import time  # here, not at the top: the host's clock, which the pure registry never reads

        return {**kwargs, "now": (clock or time.time)()}
    return kwargs
