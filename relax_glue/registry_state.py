"""The one state the registry's parts work on, and what they share: the constructor (every field),
the publisher check, record storage that keeps the slot set and the pending attempt in step with
:func:`~relax_glue.registry_rules.holds_slot`, argument lookups that refuse with a typed error, and
the views handed out.

Pure: no clocks, no randomness, no IO. The parts (:mod:`~relax_glue.registry_attempts`,
:mod:`~relax_glue.registry_sessions`, :mod:`~relax_glue.registry_reclaim`) are mixins over this
class; :class:`relax_glue.registry.LoRAVersionRegistry` joins them.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from lora_contract.errors import ErrorCode
from lora_contract.names import MANAGED_CAPACITY, NAME_PART_RE, TOKEN_RE
from relax_glue.registry_rules import (
    PENDING_STATES,
    TRANSITIONS,
    checked_epoch,
    checked_publisher_token,
    checked_text,
    fail,
    holds_slot,
    new_publisher_token,
)
from relax_glue.registry_types import (
    AttemptPhase,
    EngineAck,
    EngineRecord,
    LeaseRecord,
    ReclaimClaim,
    ReclaimPhase,
    ReserveResult,
    SessionKey,
    SessionRecord,
    SessionView,
    UnknownOutcome,
    VersionKey,
    VersionRecord,
    VersionState,
    VersionView,
    evolve,
)


class RegistryState:
    """Versions, default, sessions, leases, engines and op results of one deployment epoch, with
    the helpers every part's operations use. Not an operation surface on its own."""

    def __init__(
        self,
        epoch: str | int,
        engines: Sequence[str],
        capacity: int = MANAGED_CAPACITY,
        *,
        debug_checks: bool = __debug__,
        publisher_token: str | None = None,
    ) -> None:
        self.epoch = checked_epoch(epoch)
        if isinstance(engines, str) or not engines:
            raise ValueError("engines must be a non-empty sequence of engine ids")
        cohort = tuple(checked_text("engine_id", e) for e in engines)
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
        """The one publisher check, made by the declaration of every publisher op before its body
        runs (before any lookup, so a non-publisher gets no replayed answer either; see
        :func:`relax_glue.registry_spec.operation`). Constant time; the token is never named."""
        given = publisher_token.encode() if isinstance(publisher_token, str) else b""
        if not given or not hmac.compare_digest(given, self._publisher_token.encode()):
            fail(
                ErrorCode.NOT_PUBLISHER,
                f"{op} is a publication op: only the publisher that opened the registry may call it "
                f"({'no' if publisher_token is None else 'another'} publisher token given)",
                op=op,
            )

    @property
    def seq(self) -> int:
        """Number of accepted transitions (replays and refusals do not count)."""
        return self._seq

    # ============================================================================ helpers

    def _put(self, rec: VersionRecord) -> None:
        """Store a version record; the slot set and the pending attempt follow from its state
        through :func:`holds_slot` alone, so they can not drift from the predicate."""
        self._versions[rec.key] = rec
        if holds_slot(rec.state):
            self._live.add(rec.key)
        else:
            self._live.discard(rec.key)
        if rec.state in PENDING_STATES:
            self._pending = rec.key
        elif self._pending == rec.key:
            self._pending = None

    def _accepted(self) -> None:
        self._seq += 1
        if self.debug_checks:
            self.check_invariants(full=False)

    def _key(self, value: Any) -> VersionKey:
        if not isinstance(value, tuple | list) or len(value) != 2:
            fail(ErrorCode.INVALID_REQUEST, "version_key must be (epoch, version_id)")
        epoch = checked_epoch(value[0])
        version_id = checked_text("version_id", value[1], NAME_PART_RE)
        if epoch != self.epoch:
            fail(ErrorCode.INVALID_REQUEST, f"version_key is of epoch {epoch}, registry is {self.epoch}")
        return VersionKey(epoch, version_id)

    def _session_key(self, value: Any) -> SessionKey:
        if not isinstance(value, tuple | list) or len(value) != 2:
            fail(ErrorCode.INVALID_REQUEST, "session_key must be (epoch, nonce)")
        epoch = checked_epoch(value[0])
        nonce = checked_text("session nonce", value[1])
        if epoch != self.epoch:
            fail(ErrorCode.INVALID_REQUEST, f"session_key is of epoch {epoch}, registry is {self.epoch}")
        return SessionKey(epoch, nonce)

    def _receipt(self, receipt: Any, cls: type) -> Any:
        if not isinstance(receipt, cls):
            fail(ErrorCode.INVALID_REQUEST, f"expected a {cls.__name__}, got {type(receipt).__name__}")
        if hasattr(receipt, "version_key"):
            receipt = evolve(receipt, version_key=self._key(receipt.version_key))
        return receipt

    def _engine(self, engine_id: Any) -> EngineRecord:
        eng = self._engines.get(engine_id) if isinstance(engine_id, str) else None
        if eng is None:
            lost = self._lost.get(engine_id) if isinstance(engine_id, str) else None
            why = f" (declared lost: {lost})" if lost is not None else ""
            fail(ErrorCode.UNKNOWN_ENGINE, f"{engine_id!r} is not in the cohort {list(self.engines)}{why}")
        return eng

    def _version(self, key: VersionKey) -> VersionRecord:
        rec = self._versions.get(key)
        if rec is None:
            fail(ErrorCode.UNKNOWN_VERSION, f"no version {key} in this epoch", version_key=list(key))
        return rec

    def _attempt(self, token: Any, version_key: VersionKey | None = None) -> VersionRecord:
        checked_text("attempt_token", token, TOKEN_RE)
        key = self._by_token.get(token)
        if key is None or (version_key is not None and key != version_key):
            fail(ErrorCode.STALE_ATTEMPT, f"{token} is not an attempt of this registry for that version")
        return self._versions[key]

    def _current_incarnation(self, eng: EngineRecord, incarnation: Any) -> None:
        checked_text("incarnation", incarnation, TOKEN_RE)
        if eng.incarnation != incarnation:
            known = incarnation in eng.history
            fail(
                ErrorCode.STALE_INCARNATION,
                f"{incarnation} is {'an earlier' if known else 'not a registered'} incarnation of "
                f"{eng.engine_id} (current {eng.incarnation})",
                current=eng.incarnation,
            )

    def _known_incarnation(self, eng: EngineRecord, incarnation: Any) -> None:
        checked_text("incarnation", incarnation, TOKEN_RE)
        if incarnation not in eng.history:
            fail(
                ErrorCode.STALE_INCARNATION,
                f"{incarnation} is not a registered incarnation of {eng.engine_id}",
                current=eng.incarnation,
            )

    def _not_live(self, rec: VersionRecord) -> NoReturn:
        fail(
            ErrorCode.STALE_ATTEMPT,
            f"attempt of {rec.key} is no longer live ({rec.state.value})",
            state=rec.state.value,
        )

    @staticmethod
    def _transition(rec: VersionRecord, state: VersionState, **changes: Any) -> VersionRecord:
        if state not in TRANSITIONS[rec.state]:
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
