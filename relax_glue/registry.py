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
  missing or wrong one is NOT_PUBLISHER, checked first, so it changes nothing and gets no
  replayed answer either (a replay would hand out attempt tokens and reclaim ids). Session and
  lease ops and queries need none: they are what rollout workers call. The token is an input
  (given at construction, or drawn once there), never part of a transition, a dump or an answer.

Decisions where the issue is silent are marked "Decision:" next to the code that makes them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import MANAGED_CAPACITY, NAME_PART_RE, SHA256_RE, TOKEN_RE
from relax_glue.registry_types import (
    AbortResult,
    AttemptPhase,
    Binding,
    CleanupEvidence,
    CommitReceipt,
    EngineAck,
    EngineLostResult,
    EngineRecord,
    IncarnationResult,
    LeaseRecord,
    LeaseView,
    PreparedEvidence,
    ReadyEvidence,
    ReclaimClaim,
    ReclaimPhase,
    ReserveResult,
    SessionKey,
    SessionRecord,
    SessionState,
    SessionView,
    StatusView,
    UnknownOutcome,
    UnloadEvidence,
    VersionKey,
    VersionRecord,
    VersionState,
    VersionView,
    decode,
    encode,
    evolve,
)

__all__ = [
    "MUTATING_OPS",
    "PUBLISHER_OPS",
    "QUERY_OPS",
    "TIMED_OPS",
    "LoRAVersionRegistry",
    "holds_slot",
    "may_start_reclaim",
    "new_publisher_token",
    "stamp_now",
]

# ------------------------------------------------------------------------ the two predicates

_SLOT_STATES = frozenset(
    {
        VersionState.LOADING,
        VersionState.PUBLISHED,
        VersionState.RETIRED,
        VersionState.RECLAIMING,
        VersionState.ABORTED,  # until cleanup is confirmed on every engine
    }
)


def holds_slot(state: VersionState) -> bool:
    """The one answer to "does a version in this state occupy a capacity slot?".

    Only FAILED_CLEAN and RECLAIMED free a slot: both are reached by confirmed receipts from
    every engine, never by a timeout or a guess.
    """
    return state in _SLOT_STATES


def may_start_reclaim(record: VersionRecord | VersionView) -> bool:
    """The one answer to "may this version enter RECLAIMING now?": retired and no session can
    still ask for it. In-flight requests are the engine's business (native refcount)."""
    return record.state is VersionState.RETIRED and record.session_refs == 0


def is_committed(state: VersionState) -> bool:
    """The one answer to "was this version ever committed?" (it then never returns to a
    candidate state: PUBLISHED, RETIRED, RECLAIMING or RECLAIMED)."""
    return state in _COMMITTED_STATES


# A RECLAIMED or FAILED_CLEAN version never returns: both have no way out.
_TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    VersionState.LOADING: frozenset({VersionState.PUBLISHED, VersionState.ABORTED}),
    VersionState.PUBLISHED: frozenset({VersionState.RETIRED}),
    VersionState.RETIRED: frozenset({VersionState.RECLAIMING}),
    VersionState.RECLAIMING: frozenset({VersionState.RECLAIMED}),
    VersionState.ABORTED: frozenset({VersionState.FAILED_CLEAN}),
    VersionState.RECLAIMED: frozenset(),
    VersionState.FAILED_CLEAN: frozenset(),
}

_PENDING_STATES = frozenset({VersionState.LOADING, VersionState.ABORTED})  # the one attempt in flight
_COMMITTED_STATES = frozenset(
    {VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING, VersionState.RECLAIMED}
)

# an engine phase whose outcome is unknown, of an attempt or of a reclaim (the invariant check)
_UNKNOWN_PHASES = frozenset({AttemptPhase.UNKNOWN, ReclaimPhase.UNKNOWN})
_SPACE_RE = re.compile(r"\s")

# The mutating ops only the publisher may call (they take ``publisher_token``): everything that
# changes versions, the default, the cohort or the capacity slots.
PUBLISHER_OPS: tuple[str, ...] = (
    "record_base",
    "reserve",
    "record_prepared",
    "record_ready",
    "commit",
    "abort",
    "record_cleanup",
    "register_engine_incarnation",
    "mark_engine_unknown",
    "declare_engine_lost",
    "claim_reclaim",
    "confirm_reclaim",
)
# The other mutating ops: session and lease ops (rollout workers) and the store's own pruning.
SESSION_OPS: tuple[str, ...] = (
    "open_session",
    "bind_first",
    "begin_close",
    "close_and_release",
    "grant_lease",
    "end_leases",
    "prune_sessions",
)
# The public mutating operations, used by the durable store (journal) and the actor (dispatch
# allow-list): each name is written once, in one of the two lists above.
MUTATING_OPS: tuple[str, ...] = (*PUBLISHER_OPS, *SESSION_OPS)
QUERY_OPS: tuple[str, ...] = (
    "status",
    "binding_of",
    "session",
    "sessions",
    "version",
    "lease",
    "leases_due",
    "dump",
)
# Ops that change soft state only (a lease's deadline in memory), never journaled: a restart
# re-creates that state (every live lease gets a fresh TTL), so a keep-alive costs no disk write.
SOFT_OPS: tuple[str, ...] = ("keep_alive",)
# Derived ops: decided on the soft state, carried out by a journaled op with the decision as its
# argument (expire_leases = end_leases(leases_due(now))), so a replay never depends on a deadline
# that was never journaled.
DERIVED_OPS: tuple[str, ...] = ("expire_leases",)
# Ops that take the registry's clock as an argument (``now``, unix seconds). The registry stays
# pure: whoever hosts it (the actor, an in-process client) stamps ``now`` once, before the call.
TIMED_OPS: tuple[str, ...] = ("grant_lease", "keep_alive", "leases_due", "expire_leases")
# Everything a client may call (the actor's allow-list, the typed forwarding table).
PUBLIC_OPS: tuple[str, ...] = (*MUTATING_OPS, *SOFT_OPS, *DERIVED_OPS, *QUERY_OPS)


def stamp_now(op: str, kwargs: dict[str, Any], clock: Any = None) -> dict[str, Any]:
    """``kwargs`` with ``now`` set from the host's clock for a timed op (kept when given)."""
    if op in TIMED_OPS and kwargs.get("now") is None:
        import time

        return {**kwargs, "now": (clock or time.time)()}
    return kwargs


def new_publisher_token() -> str:
    """A fresh publisher token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def checked_publisher_token(token: Any) -> str:
    """``token`` if it can be a publisher token; ValueError otherwise (never naming the value)."""
    if not isinstance(token, str) or not 16 <= len(token) <= 256 or not token.isascii():
        raise ValueError("a publisher token is an ASCII string of 16 to 256 characters")
    return token


def _fail(code: ErrorCode, message: str, **details: Any) -> NoReturn:
    raise LoraVersionError(code, message, **details)


def _derive_id(prefix: str, *parts: str) -> str:
    # Deterministic: a replayed history hands out the same ids. Unique per version because a
    # version has exactly one attempt and at most one reclaim in its life.
    digest = hashlib.sha256("\x1f".join((prefix, *parts)).encode()).hexdigest()[:24]
    return f"{prefix}-{digest}"


def _text(field: str, value: Any, pattern: re.Pattern[str] | None = None, max_len: int = 256) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        _fail(ErrorCode.INVALID_REQUEST, f"{field} must be a non-empty string (<= {max_len} chars)")
    if pattern is not None and not pattern.fullmatch(value):
        _fail(ErrorCode.INVALID_REQUEST, f"{field} has invalid characters: {value!r}", field=field)
    return value


def _seconds(field: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(ErrorCode.INVALID_REQUEST, f"{field} must be a finite number of seconds")
    if value < 0 or (positive and value == 0):
        _fail(ErrorCode.INVALID_REQUEST, f"{field} must be {'> 0' if positive else '>= 0'}")
    return float(value)


def _epoch_text(value: Any) -> str:
    # The wire protocol carries the epoch as a name part (a string); accept ints for convenience.
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return _text("epoch", value, NAME_PART_RE)


class LoRAVersionRegistry:
    """Versions, default, sessions, capacity and op results of one deployment epoch.

    Construct with the deployment epoch, the fixed engine cohort (N >= 1 engine ids) and the
    capacity (managed versions that may hold a slot at once). Every method either returns a
    typed, frozen result or raises :class:`LoraVersionError` having changed nothing.
    """

    def __init__(
        self,
        epoch: str | int,
        engines: Sequence[str],
        capacity: int = MANAGED_CAPACITY,
        *,
        debug_checks: bool = __debug__,
        publisher_token: str | None = None,
    ) -> None:
        self.epoch = _epoch_text(epoch)
        if isinstance(engines, str) or not engines:
            raise ValueError("engines must be a non-empty sequence of engine ids")
        cohort = tuple(_text("engine_id", e) for e in engines)
        if len(set(cohort)) != len(cohort):
            raise ValueError(f"duplicate engine ids in {cohort}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError("capacity must be an int >= 1")
        self.engines: tuple[str, ...] = cohort
        self.capacity = capacity
        self.debug_checks = debug_checks
        # Whoever constructs (or opens) the registry holds publisher authority: a token given
        # (the durable store's, kept in its database) or one drawn now. Not state: never dumped.
        self._publisher_token = (
            new_publisher_token() if publisher_token is None else checked_publisher_token(publisher_token)
        )

        self._versions: dict[VersionKey, VersionRecord] = {}  # every version of the epoch, forever
        self._by_token: dict[str, VersionKey] = {}
        self._by_reclaim: dict[str, VersionKey] = {}
        self._by_name: dict[str, VersionKey] = {}
        self._live: set[VersionKey] = set()  # versions holding a slot (kept in step with holds_slot)
        self._pending: VersionKey | None = None  # the LOADING or ABORTED candidate, if any
        self._default: VersionKey | None = None
        self._revision = 0
        self._sessions: dict[SessionKey, SessionRecord] = {}
        self._leases: dict[str, LeaseRecord] = {}
        # Soft state: lease deadlines on the host's clock, moved by keep-alives, never journaled
        # nor dumped (a restarted host calls refresh_leases).
        self._deadlines: dict[str, float] = {}
        self._engines: dict[str, EngineRecord] = {e: EngineRecord(e) for e in cohort}
        self._unknown: dict[tuple[str, str], UnknownOutcome] = {}  # (engine, token|reclaim id)
        self._lost: dict[str, str] = {}  # engines declared lost -> the operator's reason
        self._reserve_requests: dict[str, tuple[tuple[VersionKey, str, str], ReserveResult]] = {}
        self._results: dict[tuple[str, ...], Any] = {}  # first answers to receipts, by natural key
        self._seq = 0  # accepted transitions; the store journals a call iff this moved
        # The base model every version of the epoch is a delta on (an engine's fingerprint,
        # lora_contract.base_identity), fixed by the first publication for the whole epoch.
        self._base: str | None = None

    # ================================================================ publisher authority

    @property
    def publisher_token(self) -> str:
        """The token publication ops must carry. For the holder of this object only: no op
        returns it (a worker reaches the registry through ops, never through this object)."""
        return self._publisher_token

    def _authorize(self, op: str, publisher_token: str | None) -> None:
        """The one publisher check, first in every op of PUBLISHER_OPS (before any lookup, so a
        non-publisher gets no replayed answer either). Constant time; the token is never named."""
        given = publisher_token.encode() if isinstance(publisher_token, str) else b""
        if not given or not hmac.compare_digest(given, self._publisher_token.encode()):
            _fail(
                ErrorCode.NOT_PUBLISHER,
                f"{op} is a publication op: only the publisher that opened the registry may call it "
                f"({'no' if publisher_token is None else 'another'} publisher token given)",
                op=op,
            )

    # ================================================================ publication (RFC 3)

    def record_base(self, fingerprint: str, *, publisher_token: str | None = None) -> str:
        """Fix the epoch's base model (the cohort's fingerprint, read by the publisher before its
        first publication); the same fingerprint again changes nothing, another one is
        BASE_MISMATCH forever (versions of one epoch are deltas on one base)."""
        self._authorize("record_base", publisher_token)
        _text("fingerprint", fingerprint, SHA256_RE)
        if self._base is not None and self._base != fingerprint:
            _fail(
                ErrorCode.BASE_MISMATCH,
                f"the epoch's base model is {self._base}, not {fingerprint}",
                expected_base=self._base,
                engine_base=fingerprint,
            )
        if self._base is None:
            self._base = fingerprint
            self._accepted()
        return self._base

    def reserve(
        self,
        version_key: VersionKey | Sequence[str],
        digest: str,
        lora_name: str,
        request_id: str,
        *,
        publisher_token: str | None = None,
    ) -> ReserveResult:
        """Accept a new candidate in LOADING (one slot) and hand out its attempt token.

        Same key + same digest replays the existing version (no second slot, no second attempt);
        same key + other digest is VERSION_CONFLICT for the whole epoch.
        """
        self._authorize("reserve", publisher_token)
        key = self._key(version_key)
        _text("digest", digest, SHA256_RE)
        _text("lora_name", lora_name)
        if ":" in lora_name or _SPACE_RE.search(lora_name):
            # OpenAI model="base:adapter" splits on ':'; whitespace never survives a header.
            _fail(
                ErrorCode.INVALID_REQUEST, "lora_name must not contain ':' or whitespace", lora_name=lora_name
            )
        _text("request_id", request_id)
        args = (key, digest, lora_name)

        stored = self._reserve_requests.get(request_id)
        if stored is not None:
            if stored[0] != args:
                _fail(
                    ErrorCode.INVALID_REQUEST,
                    "request_id reused with different arguments",
                    request_id=request_id,
                )
            return stored[1]

        rec = self._versions.get(key)
        if rec is not None:
            if rec.digest != digest:
                _fail(
                    ErrorCode.VERSION_CONFLICT,
                    f"version {key} already has another digest in this epoch",
                    version_key=list(key),
                    digest=rec.digest,
                )
            if rec.lora_name != lora_name:
                _fail(
                    ErrorCode.VERSION_CONFLICT,
                    f"version {key} is registered under another lora_name",
                    lora_name=rec.lora_name,
                )
            # Decision: a natural-key replay reports the version's current state (the caller
            # learns it is published / failed); one attempt per version ever, so a failed
            # version is retried under a new version_id (its engine tombstones never collide).
            result = ReserveResult(key, digest, lora_name, rec.attempt_token, rec.state, created=False)
            self._reserve_requests[request_id] = (args, result)
            self._accepted()
            return result

        if lora_name in self._by_name:
            _fail(ErrorCode.VERSION_CONFLICT, "lora_name belongs to another version", lora_name=lora_name)
        if self._unknown:
            _fail(
                ErrorCode.OUTCOME_UNKNOWN,
                "an engine outcome is unknown: no new publication until it is resolved",
                unknown=[f"{e}:{r}" for e, r in sorted(self._unknown)],
            )
        if self._pending is not None:
            pending = self._versions[self._pending]
            # Decision: an ABORTED candidate whose cleanup is unconfirmed is still the pending
            # attempt (single publisher, at most one attempt in flight, cleanup included).
            _fail(
                ErrorCode.PUBLICATION_IN_PROGRESS,
                f"attempt for {pending.key} is still {pending.state.value}",
                pending=list(pending.key),
                state=pending.state.value,
            )
        if len(self._live) >= self.capacity:
            _fail(
                ErrorCode.CAPACITY_ERROR,
                f"all {self.capacity} version slots are in use",
                in_use=[f"{k} {self._versions[k].state.value}" for k in sorted(self._live)],
            )

        token = _derive_id("att", self.epoch, key.version_id, digest)
        rec = VersionRecord(
            key=key,
            digest=digest,
            lora_name=lora_name,
            attempt_token=token,
            state=VersionState.LOADING,
            attempt_phases=dict.fromkeys(self.engines, AttemptPhase.NONE),
        )
        result = ReserveResult(key, digest, lora_name, token, VersionState.LOADING, created=True)
        self._put(rec)
        self._by_token[token] = key
        self._by_name[lora_name] = key
        self._reserve_requests[request_id] = (args, result)
        self._accepted()
        return result

    def record_prepared(
        self, engine_id: str, receipt: PreparedEvidence, *, publisher_token: str | None = None
    ) -> EngineAck:
        """An engine accepted ``begin`` for the live attempt (observability; commit needs READY)."""
        self._authorize("record_prepared", publisher_token)
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, PreparedEvidence)
        rec = self._attempt(receipt.attempt_token, receipt.version_key)
        self._current_incarnation(eng, receipt.incarnation)
        if rec.state is not VersionState.LOADING:
            self._not_live(rec)
        phase = rec.attempt_phases[engine_id]
        nk = ("prepared", engine_id, rec.attempt_token, receipt.incarnation)
        if phase in (AttemptPhase.PREPARED, AttemptPhase.READY) and nk in self._results:
            return self._results[nk]
        if phase is not AttemptPhase.NONE:
            # PREPARED after READY (late reply) or while UNKNOWN: only READY or a cleanup
            # resolves an unknown outcome, so this changes nothing.
            return self._attempt_ack(rec, engine_id, phase)
        new = self._with_phase(rec, engine_id, AttemptPhase.PREPARED)
        ack = self._attempt_ack(new, engine_id, AttemptPhase.PREPARED)
        self._put(new)
        self._results[nk] = ack
        self._accepted()
        return ack

    def record_ready(
        self, engine_id: str, receipt: ReadyEvidence, *, publisher_token: str | None = None
    ) -> EngineAck:
        """READY_LOCAL from an engine's current incarnation for the live attempt."""
        self._authorize("record_ready", publisher_token)
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, ReadyEvidence)
        rec = self._attempt(receipt.attempt_token, receipt.version_key)
        if receipt.digest != rec.digest:
            _fail(
                ErrorCode.VERSION_CONFLICT,
                f"READY for {rec.key} carries another digest",
                expected=rec.digest,
                got=receipt.digest,
            )
        self._current_incarnation(eng, receipt.incarnation)
        nk = ("ready", engine_id, rec.attempt_token, receipt.incarnation)
        if rec.state is not VersionState.LOADING:
            if rec.commit is not None and nk in self._results:
                return self._results[nk]  # a late duplicate of a READY that counted
            self._not_live(rec)
        if rec.attempt_phases[engine_id] is AttemptPhase.READY and nk in self._results:
            return self._results[nk]
        new = self._with_phase(rec, engine_id, AttemptPhase.READY)
        ack = self._attempt_ack(new, engine_id, AttemptPhase.READY)
        self._put(new)
        self._unknown.pop((engine_id, rec.attempt_token), None)
        self._results[nk] = ack
        self._accepted()
        return ack

    def commit(
        self,
        version_key: VersionKey | Sequence[str],
        attempt_token: str,
        expected_default_revision: int,
        *,
        publisher_token: str | None = None,
    ) -> CommitReceipt:
        """Make the candidate the default once every engine is READY from its current incarnation.

        Replaying a commit (same version and attempt) returns the stored receipt and changes
        nothing, even if the version has since been retired or reclaimed.
        """
        self._authorize("commit", publisher_token)
        key = self._key(version_key)
        _text("attempt_token", attempt_token, TOKEN_RE)
        if not isinstance(expected_default_revision, int) or isinstance(expected_default_revision, bool):
            _fail(ErrorCode.INVALID_REQUEST, "expected_default_revision must be an int")
        rec = self._version(key)
        if attempt_token != rec.attempt_token:
            _fail(
                ErrorCode.STALE_ATTEMPT, f"{attempt_token} is not the attempt of {key}", version_key=list(key)
            )
        if rec.commit is not None:
            # Decision: the natural key of a commit is (version, attempt); a replay returns the
            # stored receipt whatever revision the retry expected (the receipt tells the truth).
            return rec.commit
        if rec.state is not VersionState.LOADING:
            self._not_live(rec)
        unknown = sorted(e for e, p in rec.attempt_phases.items() if p is AttemptPhase.UNKNOWN)
        if unknown:
            _fail(ErrorCode.OUTCOME_UNKNOWN, "an engine outcome for this attempt is unknown", engines=unknown)
        missing = sorted(e for e, p in rec.attempt_phases.items() if p is not AttemptPhase.READY)
        if missing:
            _fail(ErrorCode.NOT_ALL_READY, f"no current READY from {missing}", missing=missing)
        if expected_default_revision != self._revision:
            _fail(
                ErrorCode.DEFAULT_REVISION_CONFLICT,
                f"default revision is {self._revision}, not {expected_default_revision}",
                default_revision=self._revision,
            )

        previous = self._default
        receipt = CommitReceipt(
            version_key=key,
            attempt_token=rec.attempt_token,
            digest=rec.digest,
            lora_name=rec.lora_name,
            default_revision=self._revision + 1,
            previous_default=previous,
        )
        new = self._transition(rec, VersionState.PUBLISHED, commit=receipt)
        retired = self._transition(self._versions[previous], VersionState.RETIRED) if previous else None
        if retired is not None:
            self._put(retired)
        self._put(new)
        self._default = key
        self._revision += 1
        self._accepted()
        return receipt

    def abort(self, attempt_token: str, reason: str, *, publisher_token: str | None = None) -> AbortResult:
        """LOADING -> ABORTED. The slot stays held until every engine confirmed cleanup."""
        self._authorize("abort", publisher_token)
        rec = self._attempt(attempt_token)
        _text("reason", reason, max_len=1024)
        if rec.commit is not None:
            _fail(
                ErrorCode.STALE_ATTEMPT,
                f"attempt of {rec.key} is committed; it can only be retired and reclaimed",
                state=rec.state.value,
            )
        nk = ("abort", rec.attempt_token)
        if rec.state is not VersionState.LOADING:
            return self._results[nk]  # ABORTED / FAILED_CLEAN: the first answer
        result = AbortResult(rec.key, rec.attempt_token, reason)
        self._put(self._transition(rec, VersionState.ABORTED, abort_reason=reason))
        self._results[nk] = result
        self._accepted()
        return result

    def record_cleanup(
        self,
        engine_id: str,
        attempt_token: str,
        receipt: CleanupEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck:
        """Cleanup confirmed on one engine; FAILED_CLEAN (slot freed) once every engine confirmed."""
        self._authorize("record_cleanup", publisher_token)
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, CleanupEvidence)
        if receipt.attempt_token != attempt_token:
            _fail(ErrorCode.INVALID_REQUEST, "cleanup receipt is for another attempt")
        rec = self._attempt(attempt_token)
        # Decision: a cleanup by an earlier incarnation stays true (its state died with it), so
        # any registered incarnation counts; an unregistered one must be registered first.
        self._known_incarnation(eng, receipt.incarnation)
        if rec.commit is not None:
            _fail(ErrorCode.STALE_ATTEMPT, f"attempt of {rec.key} is committed; reclaim it instead")
        if rec.state is VersionState.LOADING:
            _fail(ErrorCode.INVALID_REQUEST, f"attempt of {rec.key} is live: abort it before cleanup")
        nk = ("cleanup", engine_id, attempt_token)
        if rec.attempt_phases[engine_id] is AttemptPhase.CLEANED:
            return self._results[nk]
        new = self._with_phase(rec, engine_id, AttemptPhase.CLEANED)
        if all(p is AttemptPhase.CLEANED for p in new.attempt_phases.values()):
            new = self._transition(new, VersionState.FAILED_CLEAN)
        ack = self._attempt_ack(new, engine_id, AttemptPhase.CLEANED)
        self._put(new)
        self._unknown.pop((engine_id, attempt_token), None)
        self._results[nk] = ack
        self._accepted()
        return ack

    def register_engine_incarnation(
        self, engine_id: str, incarnation: str, *, publisher_token: str | None = None
    ) -> IncarnationResult:
        """A (re)started engine. A new incarnation drops that engine's PREPARED / READY for the
        pending attempt: a READY from an earlier incarnation never counts toward a commit."""
        self._authorize("register_engine_incarnation", publisher_token)
        eng = self._engine(engine_id)
        _text("incarnation", incarnation, TOKEN_RE)
        nk = ("incarnation", engine_id, incarnation)
        if eng.incarnation == incarnation:
            return self._results[nk]
        if incarnation in eng.history:
            _fail(
                ErrorCode.STALE_INCARNATION,
                f"{incarnation} is an earlier incarnation of {engine_id}",
                current=eng.incarnation,
            )
        invalidated: list[str] = []
        new_rec: VersionRecord | None = None
        if self._pending is not None:
            rec = self._versions[self._pending]
            if rec.state is VersionState.LOADING and rec.attempt_phases[engine_id] in (
                AttemptPhase.PREPARED,
                AttemptPhase.READY,
            ):
                # An UNKNOWN stays UNKNOWN: only a receipt from the new incarnation resolves it.
                new_rec = self._with_phase(rec, engine_id, AttemptPhase.NONE)
                invalidated.append(rec.attempt_token)
        result = IncarnationResult(engine_id, incarnation, eng.incarnation, tuple(invalidated))
        self._engines[engine_id] = EngineRecord(engine_id, incarnation, (*eng.history, incarnation))
        if new_rec is not None:
            self._put(new_rec)
        self._results[nk] = result
        self._accepted()
        return result

    def mark_engine_unknown(
        self, engine_id: str, ref: str, op: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineAck:
        """The publisher could not learn the outcome of ``op`` on ``engine_id`` for ``ref`` (an
        attempt token or a reclaim id). Nothing is freed; the engine's earlier PREPARED/READY for
        that attempt no longer counts; new publications are refused (OUTCOME_UNKNOWN) until a
        READY, cleanup or UNLOADED receipt from that engine resolves it."""
        self._authorize("mark_engine_unknown", publisher_token)
        self._engine(engine_id)
        _text("ref", ref, TOKEN_RE)
        _text("op", op, max_len=64)
        _text("reason", reason, max_len=1024)
        if ref in self._by_reclaim:
            rec = self._versions[self._by_reclaim[ref]]
            rphase = rec.reclaim_phases[engine_id]
            if rphase is not ReclaimPhase.PENDING:  # UNLOADED is final; UNKNOWN already marked
                return self._reclaim_ack(rec, engine_id, rphase)
            new = evolve(rec, reclaim_phases={**rec.reclaim_phases, engine_id: ReclaimPhase.UNKNOWN})
            ack = self._reclaim_ack(new, engine_id, ReclaimPhase.UNKNOWN)
        else:
            rec = self._attempt(ref)
            if rec.commit is not None:
                _fail(ErrorCode.STALE_ATTEMPT, f"attempt of {rec.key} is committed", state=rec.state.value)
            phase = rec.attempt_phases[engine_id]
            if phase in (AttemptPhase.CLEANED, AttemptPhase.UNKNOWN):  # confirmed clean wins
                return self._attempt_ack(rec, engine_id, phase)
            new = self._with_phase(rec, engine_id, AttemptPhase.UNKNOWN)
            ack = self._attempt_ack(new, engine_id, AttemptPhase.UNKNOWN)
        self._put(new)
        self._unknown[(engine_id, ref)] = UnknownOutcome(engine_id, ref, rec.key, op, reason)
        self._accepted()
        return ack

    def declare_engine_lost(
        self, engine_id: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineLostResult:
        """An operator's declaration that ``engine_id`` is gone for good (its host died, its
        disk was wiped): it leaves the cohort for the rest of the epoch.

        Until this call, an engine that cannot answer blocks commit, cleanup and reclaim, and
        nothing it may hold is freed: a silent engine is not a confirmed one. After it, that
        engine's receipts are no longer needed nor accepted (UNKNOWN_ENGINE): its phases are
        dropped from every version, its unknown outcomes are settled, and a version whose only
        missing receipt was this engine's finishes (ABORTED -> FAILED_CLEAN, RECLAIMING ->
        RECLAIMED). A pending LOADING attempt is not committed here: the publisher commits it
        on fresh evidence from the remaining engines. The declaration is journaled like every
        call (the audit trail); a repeat returns the first answer.
        Decision: the last engine of a cohort cannot be declared lost (INVALID_REQUEST): a
        cohort without engines could commit nothing and free everything."""
        self._authorize("declare_engine_lost", publisher_token)
        nk = ("lost", str(engine_id))
        if nk in self._results:
            return self._results[nk]
        self._engine(engine_id)
        _text("reason", reason, max_len=1024)
        if len(self.engines) == 1:
            _fail(ErrorCode.INVALID_REQUEST, f"{engine_id} is the last engine of the cohort")
        cohort = tuple(e for e in self.engines if e != engine_id)
        updated: list[VersionRecord] = []
        finished: list[VersionKey] = []
        for rec in self._versions.values():
            phases = {e: p for e, p in rec.attempt_phases.items() if e != engine_id}
            rphases = {e: p for e, p in rec.reclaim_phases.items() if e != engine_id}
            new = evolve(rec, attempt_phases=phases, reclaim_phases=rphases)
            if rec.state is VersionState.ABORTED and all(p is AttemptPhase.CLEANED for p in phases.values()):
                new = self._transition(new, VersionState.FAILED_CLEAN)
                finished.append(rec.key)
            elif rec.state is VersionState.RECLAIMING and all(
                p is ReclaimPhase.UNLOADED for p in rphases.values()
            ):
                new = self._transition(new, VersionState.RECLAIMED)
                finished.append(rec.key)
            updated.append(new)
        result = EngineLostResult(engine_id, reason, cohort, tuple(finished))
        self.engines = cohort
        del self._engines[engine_id]
        for rec in updated:
            self._put(rec)
        self._unknown = {k: u for k, u in self._unknown.items() if k[0] != engine_id}
        self._lost[engine_id] = reason
        self._results[nk] = result
        self._accepted()
        return result

    # ==================================================================== sessions (RFC 4)

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
            _fail(ErrorCode.NO_PUBLISHED_VERSION, "no version has been published yet")
        s = SessionRecord(sk, SessionState.OPEN) if s is None else s
        s = self._attach(s, lease_id)  # checked before any change
        rec = self._versions[self._default]
        binding = Binding(sk, rec.key, rec.lora_name, rec.digest, self._revision)
        self._put(evolve(rec, session_refs=rec.session_refs + 1))
        # The bind sets the binding and nothing else: the lease a session hangs on survives it.
        self._sessions[sk] = evolve(s, binding=binding)
        self._accepted()
        return binding

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

    def grant_lease(self, lease_id: str, ttl_s: float, now: float) -> LeaseView:
        """A new live lease of ``ttl_s`` seconds from ``now`` (registry clock). A repeat of a live
        lease with the same TTL is a keep-alive; another TTL is refused (a lease's TTL is fixed
        at its grant); an ended lease is never granted again (SESSION_EXPIRED)."""
        lid = _text("lease_id", lease_id, NAME_PART_RE)
        ttl, t = _seconds("ttl_s", ttl_s, positive=True), _seconds("now", now)
        lease = self._leases.get(lid)
        if lease is not None:
            if lease.ttl_s != ttl:
                _fail(
                    ErrorCode.INVALID_REQUEST,
                    f"lease {lid} was granted with ttl_s={lease.ttl_s}",
                    lease_id=lid,
                )
            return self.keep_alive(lid, t)
        self._leases[lid] = LeaseRecord(lid, ttl)
        self._deadlines[lid] = t + ttl
        self._accepted()
        return self._lease_view(self._leases[lid])

    def keep_alive(self, lease_id: str, now: float) -> LeaseView:
        """Move a live lease's deadline to ``now + ttl`` (never earlier). Soft state only: no
        transition, nothing to journal. An ended lease answers SESSION_EXPIRED (its sessions are
        closed: the worker must not dispatch on them), an unknown one INVALID_REQUEST."""
        lease = self._lease_record(lease_id)
        t = _seconds("now", now)
        if not lease.live:
            self._lease_ended(lease)
        self._deadlines[lease.lease_id] = max(self._deadlines.get(lease.lease_id, t), t + lease.ttl_s)
        return self._lease_view(lease)

    def leases_due(self, now: float) -> tuple[str, ...]:
        """The live leases whose deadline is ``<= now`` (a read of the soft state)."""
        t = _seconds("now", now)
        return tuple(sorted(lid for lid, d in self._deadlines.items() if d <= t))

    def end_leases(self, lease_ids: Sequence[str]) -> tuple[SessionKey, ...]:
        """End each live lease of ``lease_ids`` and close, exactly once and through the same
        transition as a normal close, every session on it (OPEN, or CLOSING by an owner that
        died mid-close). Returns the sessions closed; leases already ended change nothing.
        Deterministic in its argument: this is what the journal keeps of an expiry."""
        if isinstance(lease_ids, str) or not isinstance(lease_ids, Sequence):
            _fail(ErrorCode.INVALID_REQUEST, "lease_ids must be a list of lease ids")
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

    def expire_leases(self, now: float) -> tuple[SessionKey, ...]:
        """End every lease that ran out by ``now``: ``end_leases(leases_due(now))``. None due:
        nothing changes. A durable host journals the ``end_leases`` call, not this one."""
        due = self.leases_due(now)
        return self.end_leases(due) if due else ()

    def refresh_leases(self, now: float) -> None:
        """Give every live lease a fresh TTL from ``now`` (soft state): what a host does after a
        restart, when the deadlines of before are gone with the old process."""
        t = _seconds("now", now)
        self._deadlines = {lid: t + lease.ttl_s for lid, lease in self._leases.items() if lease.live}

    def lease(self, lease_id: str) -> LeaseView | None:
        lease = self._leases.get(_text("lease_id", lease_id, NAME_PART_RE))
        return self._lease_view(lease) if lease else None

    def _lease_record(self, lease_id: Any) -> LeaseRecord:
        lid = _text("lease_id", lease_id, NAME_PART_RE)
        lease = self._leases.get(lid)
        if lease is None:
            _fail(ErrorCode.INVALID_REQUEST, f"no lease {lid}: grant it first", lease_id=lid)
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
            _fail(ErrorCode.INVALID_REQUEST, f"session {s.key} hangs on lease {s.lease_id}, not {lease_id}")
        self._live_lease(lease_id)
        return evolve(s, lease_id=lease_id)

    @staticmethod
    def _lease_ended(lease: LeaseRecord) -> NoReturn:
        _fail(
            ErrorCode.SESSION_EXPIRED,
            f"lease {lease.lease_id} ran out: its sessions are closed",
            lease_id=lease.lease_id,
        )

    def _lease_view(self, lease: LeaseRecord) -> LeaseView:
        return LeaseView(lease.lease_id, lease.ttl_s, lease.live, self._deadlines.get(lease.lease_id))

    def prune_sessions(self, keep_last: int) -> int:
        """Forget CLOSED session records closed more than ``keep_last`` transitions ago (their
        refs were released long since); returns how many. Bounded growth over a long run.

        Answers after pruning stay safe: a late close of a pruned session answers CLOSED and
        releases nothing (its ref was released once, at its real close). The tombstone window
        is ``keep_last`` transitions: a late ``open_session`` / ``bind_first`` of a pruned key
        after that window is indistinguishable from a new session (keys carry a fresh nonce per
        lifecycle; with leases on, such a worker has met SESSION_EXPIRED long before)."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            _fail(ErrorCode.INVALID_REQUEST, "keep_last must be an int >= 1")
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

    # ===================================================================== reclaim (RFC 5)

    def claim_reclaim(
        self, version_key: VersionKey | Sequence[str], *, publisher_token: str | None = None
    ) -> ReclaimClaim:
        """RETIRED with session_refs == 0 -> RECLAIMING with a stable reclaim id (a repeat
        returns the same claim)."""
        self._authorize("claim_reclaim", publisher_token)
        key = self._key(version_key)
        rec = self._version(key)
        if rec.reclaim_id is not None:
            return self._claim(rec)
        if not may_start_reclaim(rec):
            if rec.state in (VersionState.PUBLISHED, VersionState.RETIRED):
                _fail(
                    ErrorCode.VERSION_IN_USE,
                    f"{key} is {rec.state.value} with {rec.session_refs} session refs",
                    state=rec.state.value,
                    session_refs=rec.session_refs,
                )
            _fail(
                ErrorCode.INVALID_REQUEST,
                f"{key} is {rec.state.value}, not a retired version",
                state=rec.state.value,
            )
        rid = _derive_id("rcl", self.epoch, key.version_id, rec.digest)
        new = self._transition(
            rec,
            VersionState.RECLAIMING,
            reclaim_id=rid,
            reclaim_phases=dict.fromkeys(self.engines, ReclaimPhase.PENDING),
        )
        self._put(new)
        self._by_reclaim[rid] = key
        self._accepted()
        return self._claim(new)

    def confirm_reclaim(
        self,
        version_key: VersionKey | Sequence[str],
        engine_id: str,
        receipt: UnloadEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck:
        """UNLOADED on one engine; RECLAIMED (slot freed) once every engine confirmed. A late or
        duplicate receipt changes nothing."""
        self._authorize("confirm_reclaim", publisher_token)
        key = self._key(version_key)
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, UnloadEvidence)
        rec = self._version(key)
        if rec.reclaim_id is None or receipt.reclaim_id != rec.reclaim_id:
            _fail(
                ErrorCode.STALE_ATTEMPT,
                f"{receipt.reclaim_id} is not the reclaim of {key}",
                state=rec.state.value,
            )
        self._known_incarnation(eng, receipt.incarnation)
        nk = ("unloaded", engine_id, rec.reclaim_id)
        if rec.reclaim_phases[engine_id] is ReclaimPhase.UNLOADED:
            return self._results[nk]
        new = evolve(rec, reclaim_phases={**rec.reclaim_phases, engine_id: ReclaimPhase.UNLOADED})
        if all(p is ReclaimPhase.UNLOADED for p in new.reclaim_phases.values()):
            new = self._transition(new, VersionState.RECLAIMED)
        ack = self._reclaim_ack(new, engine_id, ReclaimPhase.UNLOADED)
        self._put(new)
        self._unknown.pop((engine_id, rec.reclaim_id), None)
        self._results[nk] = ack
        self._accepted()
        return ack

    # ============================================================================ queries

    @property
    def seq(self) -> int:
        """Number of accepted transitions (replays and refusals do not count)."""
        return self._seq

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

    def version(self, version_key: VersionKey | Sequence[str]) -> VersionView | None:
        rec = self._versions.get(self._key(version_key))
        return self._version_view(rec) if rec else None

    def binding_of(self, session_key: SessionKey | Sequence[str]) -> Binding | None:
        """The session's binding (kept after close, for the record); None if never bound."""
        s = self._sessions.get(self._session_key(session_key))
        return s.binding if s else None

    def session(self, session_key: SessionKey | Sequence[str]) -> SessionView | None:
        s = self._sessions.get(self._session_key(session_key))
        return self._session_view(s) if s else None

    def sessions(self, include_closed: bool = False, limit: int | None = None) -> tuple[SessionView, ...]:
        """Sessions in the order they were opened (the newest ``limit`` of them); CLOSED
        tombstones only when ``include_closed``. For operators: the registry's own view."""
        views = [
            self._session_view(s)
            for s in self._sessions.values()
            if include_closed or s.state is not SessionState.CLOSED
        ]
        return tuple(views if limit is None else views[-limit:] if limit > 0 else [])

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
            assert self._versions[self._pending].state in (VersionState.LOADING, VersionState.ABORTED)
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
        pending = [
            r.key for r in self._versions.values() if r.state in (VersionState.LOADING, VersionState.ABORTED)
        ]
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
            assert (rec.commit is not None) == (rec.state in _COMMITTED_STATES)
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
                assert ((engine, ref) in self._unknown) == (phase in _UNKNOWN_PHASES)
        assert commits == self._revision, f"{commits} commits but revision {self._revision}"
        assert len(self._by_token) == len(self._by_name) == len(self._versions)

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

    # ============================================================================ helpers

    def _put(self, rec: VersionRecord) -> None:
        """Store a version record; the slot set and the pending attempt follow from its state
        through :func:`holds_slot` alone, so they can not drift from the predicate."""
        self._versions[rec.key] = rec
        if holds_slot(rec.state):
            self._live.add(rec.key)
        else:
            self._live.discard(rec.key)
        if rec.state in _PENDING_STATES:
            self._pending = rec.key
        elif self._pending == rec.key:
            self._pending = None

    def _accepted(self) -> None:
        self._seq += 1
        if self.debug_checks:
            self.check_invariants(full=False)

    def _key(self, value: Any) -> VersionKey:
        if not isinstance(value, tuple | list) or len(value) != 2:
            _fail(ErrorCode.INVALID_REQUEST, "version_key must be (epoch, version_id)")
        epoch = _epoch_text(value[0])
        version_id = _text("version_id", value[1], NAME_PART_RE)
        if epoch != self.epoch:
            _fail(ErrorCode.INVALID_REQUEST, f"version_key is of epoch {epoch}, registry is {self.epoch}")
        return VersionKey(epoch, version_id)

    def _session_key(self, value: Any) -> SessionKey:
        if not isinstance(value, tuple | list) or len(value) != 2:
            _fail(ErrorCode.INVALID_REQUEST, "session_key must be (epoch, nonce)")
        epoch = _epoch_text(value[0])
        nonce = _text("session nonce", value[1])
        if epoch != self.epoch:
            _fail(ErrorCode.INVALID_REQUEST, f"session_key is of epoch {epoch}, registry is {self.epoch}")
        return SessionKey(epoch, nonce)

    def _receipt(self, receipt: Any, cls: type) -> Any:
        if not isinstance(receipt, cls):
            _fail(ErrorCode.INVALID_REQUEST, f"expected a {cls.__name__}, got {type(receipt).__name__}")
        if hasattr(receipt, "version_key"):
            receipt = evolve(receipt, version_key=self._key(receipt.version_key))
        return receipt

    def _engine(self, engine_id: Any) -> EngineRecord:
        eng = self._engines.get(engine_id) if isinstance(engine_id, str) else None
        if eng is None:
            lost = self._lost.get(engine_id) if isinstance(engine_id, str) else None
            why = f" (declared lost: {lost})" if lost is not None else ""
            _fail(ErrorCode.UNKNOWN_ENGINE, f"{engine_id!r} is not in the cohort {list(self.engines)}{why}")
        return eng

    def _version(self, key: VersionKey) -> VersionRecord:
        rec = self._versions.get(key)
        if rec is None:
            _fail(ErrorCode.UNKNOWN_VERSION, f"no version {key} in this epoch", version_key=list(key))
        return rec

    def _attempt(self, token: Any, version_key: VersionKey | None = None) -> VersionRecord:
        _text("attempt_token", token, TOKEN_RE)
        key = self._by_token.get(token)
        if key is None or (version_key is not None and key != version_key):
            _fail(ErrorCode.STALE_ATTEMPT, f"{token} is not an attempt of this registry for that version")
        return self._versions[key]

    def _current_incarnation(self, eng: EngineRecord, incarnation: Any) -> None:
        _text("incarnation", incarnation, TOKEN_RE)
        if eng.incarnation != incarnation:
            known = incarnation in eng.history
            _fail(
                ErrorCode.STALE_INCARNATION,
                f"{incarnation} is {'an earlier' if known else 'not a registered'} incarnation of "
                f"{eng.engine_id} (current {eng.incarnation})",
                current=eng.incarnation,
            )

    def _known_incarnation(self, eng: EngineRecord, incarnation: Any) -> None:
        _text("incarnation", incarnation, TOKEN_RE)
        if incarnation not in eng.history:
            _fail(
                ErrorCode.STALE_INCARNATION,
                f"{incarnation} is not a registered incarnation of {eng.engine_id}",
                current=eng.incarnation,
            )

    def _not_live(self, rec: VersionRecord) -> NoReturn:
        _fail(
            ErrorCode.STALE_ATTEMPT,
            f"attempt of {rec.key} is no longer live ({rec.state.value})",
            state=rec.state.value,
        )

    def _closed(self, s: SessionRecord) -> NoReturn:
        if s.expired:
            _fail(
                ErrorCode.SESSION_EXPIRED, f"session {s.key} expired: its lease ran out", state=s.state.value
            )
        _fail(ErrorCode.SESSION_CLOSED, f"session {s.key} is {s.state.value}", state=s.state.value)

    @staticmethod
    def _transition(rec: VersionRecord, state: VersionState, **changes: Any) -> VersionRecord:
        if state not in _TRANSITIONS[rec.state]:
            raise AssertionError(f"illegal transition {rec.state.value} -> {state.value} for {rec.key}")
        return evolve(rec, state=state, **changes)

    @staticmethod
    def _with_phase(rec: VersionRecord, engine_id: str, phase: AttemptPhase) -> VersionRecord:
        return evolve(rec, attempt_phases={**rec.attempt_phases, engine_id: phase})

    @staticmethod
    def _confirmed(phases: Iterable[tuple[str, Any]], accepted: Iterable[Any]) -> tuple[str, ...]:
        ok = set(accepted)
        return tuple(sorted(e for e, p in phases if p in ok))

    def _attempt_ack(self, rec: VersionRecord, engine_id: str, phase: AttemptPhase) -> EngineAck:
        counted = {
            AttemptPhase.PREPARED: (AttemptPhase.PREPARED, AttemptPhase.READY),
            AttemptPhase.READY: (AttemptPhase.READY,),
        }.get(phase, (phase,))
        confirmed = self._confirmed(rec.attempt_phases.items(), counted)
        return EngineAck(
            rec.key,
            engine_id,
            rec.attempt_token,
            phase.value,
            rec.state,
            confirmed,
            len(confirmed) == len(self.engines),
        )

    def _reclaim_ack(self, rec: VersionRecord, engine_id: str, phase: ReclaimPhase) -> EngineAck:
        assert rec.reclaim_id is not None
        confirmed = self._confirmed(rec.reclaim_phases.items(), (phase,))
        return EngineAck(
            rec.key,
            engine_id,
            rec.reclaim_id,
            phase.value,
            rec.state,
            confirmed,
            len(confirmed) == len(self.engines),
        )

    @staticmethod
    def _claim(rec: VersionRecord) -> ReclaimClaim:
        assert rec.reclaim_id is not None
        return ReclaimClaim(rec.key, rec.reclaim_id, rec.lora_name, rec.digest)

    @staticmethod
    def _session_view(s: SessionRecord) -> SessionView:
        return SessionView(s.key, s.state, s.binding, s.released, s.lease_id, s.expired)

    def _version_view(self, rec: VersionRecord) -> VersionView:
        return VersionView(
            version_key=rec.key,
            digest=rec.digest,
            lora_name=rec.lora_name,
            state=rec.state,
            session_refs=rec.session_refs,
            holds_slot=holds_slot(rec.state),
            attempt_token=rec.attempt_token,
            attempt_phases=dict(rec.attempt_phases),
            reclaim_id=rec.reclaim_id,
            reclaim_phases=dict(rec.reclaim_phases),
            abort_reason=rec.abort_reason,
            commit_revision=rec.commit.default_revision if rec.commit else None,
        )
