"""Publisher and reclaimer: the only code that drives engines through a publication (RFC 3, 5).

``publish(snapshot, version_id)``::

    registry.reserve                               (a refusal here: no engine sees anything)
    begin on every engine, in parallel             (receipts -> incarnations, record_prepared)
    bucket 0 to every engine, all acks, bucket 1, ...
    end on every engine, in parallel               (record_ready as each receipt arrives)
    status on every engine                         (a restart since READY is registered first)
    registry.commit(expected_default_revision)

Failures (RFC 3.4), decided per phase after *every* engine's call of that phase has finished
(``gather(return_exceptions=True)``: cancelling a sibling mid-call would only manufacture
another unknown outcome):

* a clean refusal (:class:`LoraVersionError` from an engine, or the registry refusing a receipt)
  -> ``registry.abort`` -> cleanup on every engine -> ``record_cleanup`` per confirmed engine;
  FAILED_CLEAN (slot freed) only once every engine confirmed, otherwise CLEANUP_PENDING;
* an ambiguous outcome (:class:`OutcomeUnknown`) is never success and never clean: it is marked
  in the registry (the slot stays held, new publications are refused), the publisher stops and
  says so; :meth:`Publisher.resolve` asks the engines (``GET /lora_versions/{name}``) and then
  finishes the attempt or cleans it up;
* a lost commit reply is resolved by asking the registry again (commit is idempotent).

``reclaim_ready()``: every RETIRED version with no session refs is claimed, reclaimed on every
engine (polling through DRAINING with a bounded wait per call) and confirmed per engine.

The publisher never calls pause, flush or abort-all: the engine client has no such method.
The registry is reached through :class:`~relax_glue.actor.AsyncRegistryClient` (in process or
through the Ray actor); a registry object given instead is wrapped in an in-process client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, TypeVar

from lora_contract import protocol
from lora_contract.base_identity import base_differences
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.actor import RegistryUnavailable
from relax_glue.cohort_core import CohortCore, CohortDriver, EngineStep
from relax_glue.engine_client import CallOutcome, OutcomeUnknown
from relax_glue.reclaimer import Reclaimer, ReclaimResult
from relax_glue.reconciler import Reconciler, RestoreResult
from relax_glue.recovery_rules import ResolveAction, resolve_action
from relax_glue.registry import holds_slot, is_committed
from relax_glue.registry_types import (
    AttemptPhase,
    CleanupEvidence,
    CommitReceipt,
    PreparedEvidence,
    ReadyEvidence,
    VersionKey,
    VersionState,
    VersionView,
)
from relax_glue.snapshot import Snapshot
from relax_glue.stage import StagePlan, stage

__all__ = [
    "CommitEvidence",
    "EngineStep",
    "PublishOutcome",
    "PublishResult",
    "Publisher",
    "ReclaimResult",
    "RegistryUnavailable",
    "ResolveAction",
    "RestoreResult",
    "commit_evidence",
]

T = TypeVar("T")

# ------------------------------------------------------------------------------ the registry


class CommitEvidence(StrEnum):
    """What one engine's status read, taken right before a commit, says about the attempt."""

    READY = "READY"  # READY_LOCAL for this attempt and digest, in the incarnation it reports now
    NOT_READY = "NOT_READY"  # it answered, and does not hold this attempt READY (e.g. restarted)
    UNREACHABLE = "UNREACHABLE"  # no answer: refused connection, timeout, 5xx, 503 while booting


def commit_evidence(
    status: protocol.EngineStatus | None,
    lora_name: str,
    attempt_token: str,
    digest: str,
    base_fingerprint: str | None = None,
) -> CommitEvidence:
    """The one rule for "does this engine allow the commit now?" (RFC 3.3), for every path that
    commits (publish, resolve, a fresh publisher). Only fresh, positive evidence counts:
    ``status`` is the engine's answer read after its READY (None: it did not answer). A READY
    remembered from before, or an engine that cannot be asked, never does; nor does an engine
    that runs another base model than the epoch's (``base_fingerprint``, when the registry has
    recorded it)."""
    if status is None:
        return CommitEvidence.UNREACHABLE
    if base_fingerprint is not None and (status.base is None or status.base.fingerprint != base_fingerprint):
        return CommitEvidence.NOT_READY
    v = next((v for v in status.versions if v.lora_name == lora_name), None)
    ready = (
        v is not None
        and v.state is protocol.EngineVersionState.READY_LOCAL
        and v.attempt_token == attempt_token
        and v.digest == digest
        and v.incarnation == status.incarnation
    )
    return CommitEvidence.READY if ready else CommitEvidence.NOT_READY


def base_mismatch(statuses: Mapping[str, protocol.EngineStatus]) -> LoraVersionError:
    """The refusal for a cohort whose engines do not run one base model: each engine's
    fingerprint, and which parts differ from the first fingerprinted engine's."""
    first = next((s.base for s in statuses.values() if s.base is not None), None)
    differ: dict[str, list[str]] = {}
    for engine, s in statuses.items():
        if s.base is None:
            differ[engine] = ["no fingerprint"]
        elif first is not None and s.base.fingerprint != first.fingerprint:
            differ[engine] = base_differences(first, s.base)
    return LoraVersionError(
        ErrorCode.BASE_MISMATCH,
        f"the cohort's engines do not run one base model ({differ}): every version of an epoch is "
        "a delta on one base; start every engine with the same model, tokenizer and dtype",
        fingerprints={e: s.base.fingerprint if s.base is not None else None for e, s in statuses.items()},
        differ=differ,
    )


def capacity_mismatch(
    statuses: Mapping[str, protocol.EngineStatus], capacity: int
) -> LoraVersionError | None:
    """The refusal for a cohort with an engine that cannot hold the epoch's ``capacity`` (K)
    managed versions at once, or None. A setup error, told apart from CAPACITY_ERROR's "every
    slot is in use now" so that no backpressure loop waits on it."""
    small = {
        e: s.managed_capacity
        for e, s in sorted(statuses.items())
        if s.managed_capacity is not None and s.managed_capacity < capacity
    }
    if not small:
        return None
    return LoraVersionError(
        ErrorCode.CAPACITY_MISMATCH,
        f"engines {small} hold fewer managed versions than the epoch's capacity {capacity}: start "
        f"them with --max-loras-per-batch and --max-loaded-loras of {capacity + 1} or more (K "
        "pinned versions and one free slot), or open the epoch with a smaller capacity",
        engine_capacity=small,
        capacity=capacity,
    )


class PublishOutcome(StrEnum):
    PUBLISHED = "PUBLISHED"  # committed by this call: the version is the default
    ALREADY_PUBLISHED = "ALREADY_PUBLISHED"  # a replay of a version committed earlier
    REFUSED = "REFUSED"  # refused before any engine saw a begin (capacity, conflict, unknown ...)
    FAILED_CLEAN = "FAILED_CLEAN"  # a clean refusal; cleanup confirmed on every engine; slot freed
    CLEANUP_PENDING = "CLEANUP_PENDING"  # ABORTED; some cleanup unconfirmed; slot held; resolve()
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # an engine outcome is unknown; slot held; resolve()
    NOT_COMMITTED = "NOT_COMMITTED"  # the registry refused the commit; still LOADING; resolve()
    COMMIT_UNKNOWN = "COMMIT_UNKNOWN"  # the registry cannot be reached to learn about the commit


@dataclasses.dataclass(frozen=True)
class PublishResult:
    outcome: PublishOutcome
    version_key: VersionKey
    lora_name: str
    digest: str
    attempt_token: str | None
    registry_state: VersionState | None  # as read right after the run (None: not reserved / unreachable)
    commit: CommitReceipt | None = None
    error: LoraVersionError | None = None  # the refusal that decided the outcome, if any
    unknown: tuple[str, ...] = ()  # engines whose outcome is unknown after this run
    steps: tuple[EngineStep, ...] = ()
    phase_s: Mapping[str, float] = dataclasses.field(default_factory=dict)  # seconds per phase
    duration_s: float = 0.0  # this call, reserve (or resolve) to the end

    @property
    def ok(self) -> bool:
        return self.outcome in (PublishOutcome.PUBLISHED, PublishOutcome.ALREADY_PUBLISHED)

    @property
    def holds_slot(self) -> bool:
        return self.registry_state is not None and holds_slot(self.registry_state)


# ------------------------------------------------------------------------------- internals


@dataclasses.dataclass
class _Attempt:
    key: VersionKey
    lora_name: str
    digest: str
    token: str
    snapshot: Snapshot | None
    expected_revision: int
    base: str | None = None  # the epoch's base fingerprint (None: not known yet)
    t0: float = dataclasses.field(default_factory=time.monotonic)
    steps: list[EngineStep] = dataclasses.field(default_factory=list)
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)


class _PublishCalls:
    """The publisher's part of a staging (relax_glue.stage.StageCalls): every phase runs on all
    its engines concurrently and is settled after all of them answered (a refusal aborts and
    cleans up, an unknown outcome is marked), and every receipt is recorded in the registry."""

    _DESCRIBE: Mapping[str, Callable[[Any], str]] = {
        "begin": str,
        "receive_bucket": lambda ack: f"#{ack.index}{' dup' if ack.duplicate else ''}",
    }

    def __init__(self, publisher: Publisher, att: _Attempt) -> None:
        self.publisher, self.att = publisher, att

    async def run(
        self, op: str, engines: Sequence[str], call: Callable[[str], Awaitable[Any]]
    ) -> tuple[Mapping[str, Any], PublishResult | None]:
        p, att = self.publisher, self.att
        describe = self._DESCRIBE.get(op, lambda _: "")
        ok, refused, unknown = await p._fanout(att.steps, op, engines, call, describe)
        return ok, await p._settle(att, op, refused, unknown)

    async def begun(self, engine: str, reply: protocol.BeginReply) -> bool:
        p, att = self.publisher, self.att
        await p._note_incarnation(engine, reply.incarnation)
        if isinstance(reply, protocol.ReadyReceipt):
            # This engine already holds exactly this attempt, loaded: nothing to send.
            receipt = p._ready_receipt(att, reply.incarnation)
            await p._record(p.registry.record_ready(engine_id=engine, receipt=receipt))
            return False
        prepared = PreparedEvidence(att.key, att.token, reply.incarnation)
        await p._record(p.registry.record_prepared(engine_id=engine, receipt=prepared))
        return True

    async def ready(self, engine: str, receipt: protocol.ReadyReceipt) -> Any:
        p, att = self.publisher, self.att
        await p._note_incarnation(engine, receipt.incarnation)
        # Recorded as soon as this engine answers, not after the slowest one (RFC 3.4).
        ready = p._ready_receipt(att, receipt.incarnation)
        return await p._record(p.registry.record_ready(engine_id=engine, receipt=ready))


class Publisher(CohortDriver):
    """Drives publications over a fixed engine cohort. Built by :meth:`Cohort.open
    <relax_glue.cohort.Cohort.open>` beside the cohort's reclaimer and reconciler, which it is
    given (or in one line by :func:`relax_glue.cohort.open_publisher`); its reclaim and restore
    calls are theirs.

    The cohort's ``engines`` map every engine id of the registry's cohort to its client. One
    publication (or resolution) runs at a time per cohort; reclaims run under their own lock.
    """

    def __init__(
        self,
        cohort: CohortCore,
        reclaimer: Reclaimer,
        reconciler: Reconciler | None,
        *,
        prefix: str = protocol.DEFAULT_LORA_PREFIX,
        verify_snapshot: bool = True,
    ) -> None:
        super().__init__(cohort)
        self.reclaimer = reclaimer
        self.reconciler = reconciler
        self.prefix = prefix
        self.verify_snapshot = verify_snapshot
        self._snapshots: dict[str, Snapshot] = {}  # attempt token -> snapshot, until it ends
        self._lock = cohort.publication_lock
        self.store = cohort.store

    async def reclaim_ready(self, *, deadline_s: float | None = None) -> tuple[ReclaimResult, ...]:
        """The cohort's :meth:`~relax_glue.reclaimer.Reclaimer.reclaim_ready`."""
        return await self.reclaimer.reclaim_ready(deadline_s=deadline_s)

    async def reconcile(self, engines: Sequence[str] | None = None) -> tuple[RestoreResult, ...]:
        """Stage every live committed version onto each engine that lost it (a restart), from the
        snapshot store: the cohort's :meth:`~relax_glue.reconciler.Reconciler.reconcile`."""
        if self.reconciler is None:
            raise ValueError("reconcile needs a cohort opened with a SnapshotStore")
        return await self.reconciler.reconcile(engines)

    async def reconcile_forever(self, interval_s: float = 5.0) -> None:
        """Poll: one :meth:`reconcile` every ``interval_s`` until cancelled (run it as a task).
        A registry that cannot be reached is asked again at the next tick."""
        while True:
            with contextlib.suppress(RegistryUnavailable):
                await self.reconcile()
            await asyncio.sleep(interval_s)

    # ============================================================================ publish

    async def publish(
        self, snapshot: Snapshot, version_id: str | int, *, request_id: str | None = None
    ) -> PublishResult:
        """Publish ``snapshot`` as ``(epoch, version_id)``. Returns a result for every protocol
        outcome; raises only :class:`RegistryUnavailable` (registry unreachable) and bugs."""
        async with self._lock:
            try:
                return await self._publish(snapshot, version_id, request_id)
            finally:
                await self.cohort.retain_live_snapshots()

    async def _publish(
        self, snapshot: Snapshot, version_id: str | int, request_id: str | None
    ) -> PublishResult:
        epoch = await self._setup()
        key = VersionKey(epoch, str(version_id))
        lora_name = snapshot.lora_name(self.prefix, epoch, version_id)
        att = _Attempt(key, lora_name, snapshot.digest, "", snapshot, expected_revision=0)
        if self.verify_snapshot:
            try:
                snapshot.verify()
            except LoraVersionError as err:
                return await self._result(att, PublishOutcome.REFUSED, error=err, query=False)
        # The revision we saw before reserving is the one the commit must still find: the
        # default can only move by a commit, and only the pending attempt can commit.
        status = await self.registry.status()
        att.expected_revision = status.default_revision
        refused = await self._check_cohort(att, status.base_fingerprint)
        if refused is not None:
            return await self._result(att, PublishOutcome.REFUSED, error=refused, query=False)
        if self.store is not None:
            # On disk before reserve: once the version can be committed, a restarted engine
            # (or a restarted trainer) must be able to get exactly these bytes back.
            self.store.put(snapshot)
        t = time.monotonic()
        try:
            res = await self.registry.reserve(
                version_key=key,
                digest=snapshot.digest,
                lora_name=lora_name,
                request_id=request_id or f"pub-{uuid.uuid4().hex}",
            )
        except LoraVersionError as err:
            return await self._result(att, PublishOutcome.REFUSED, error=err, query=False)
        att.phase_s["reserve"] = time.monotonic() - t
        att.token = res.attempt_token
        if not res.created:
            return await self._replay(att)
        self._snapshots[att.token] = snapshot
        return await self._run(att, list(self._cohort))

    async def _check_cohort(self, att: _Attempt, recorded: str | None) -> LoraVersionError | None:
        """Set ``att.base`` to the epoch's base model: the registry's record, or, before the
        epoch's first publication, from one read of the engines' statuses: every answering
        engine can hold the epoch's K versions, and they all report one base fingerprint,
        recorded now. A cohort with a smaller engine, or whose engines disagree (or one that
        reports none), is refused here, before anything is reserved or sent. No engine answering
        leaves both unknown: their begins will say (an engine's own CAPACITY_ERROR past its
        slots, BASE_MISMATCH), and the commit needs every engine's fresh status anyway."""
        if recorded is not None:
            att.base = recorded
            return None
        statuses = {e: s for e, s in (await self._read_statuses(att)).items() if s is not None}
        too_small = capacity_mismatch(statuses, self.registry.capacity)
        if too_small is not None:
            return too_small
        if not statuses:
            return None
        bases = {e: (s.base.fingerprint if s.base is not None else None) for e, s in statuses.items()}
        if None in bases.values() or len(set(bases.values())) > 1:
            return base_mismatch(statuses)
        try:
            att.base = await self.registry.record_base(fingerprint=next(iter(bases.values())))
        except LoraVersionError as err:  # another publisher recorded another base meanwhile
            return err
        return None

    async def _replay(self, att: _Attempt) -> PublishResult:
        """``reserve`` found this exact version already (same key, same digest)."""
        view = await self.registry.version(version_key=att.key)
        if is_committed(view.state):
            receipt = await self.registry.commit(
                version_key=att.key, attempt_token=att.token, expected_default_revision=0
            )  # a replayed commit returns the stored receipt and changes nothing
            return await self._result(att, PublishOutcome.ALREADY_PUBLISHED, commit=receipt)
        if view.state is VersionState.FAILED_CLEAN:
            return await self._result(att, PublishOutcome.FAILED_CLEAN)
        # LOADING or ABORTED: an earlier run of ours stopped part way; finish what it started.
        assert att.snapshot is not None
        self._snapshots[att.token] = att.snapshot
        return await self._resolve_attempt(att, view)

    async def _run(
        self, att: _Attempt, engines: Sequence[str], end_only: Sequence[str] = ()
    ) -> PublishResult:
        """begin -> buckets -> end on ``engines`` (and only end on ``end_only``: engines that
        already hold every bucket), then commit. The staging is :func:`relax_glue.stage.stage`
        (the reconciler's too); what this publisher adds is in :class:`_PublishCalls`."""
        if engines:
            assert att.snapshot is not None, "driving an engine from begin needs the snapshot"
            plan = StagePlan.of(att.snapshot, self.prefix, att.key, att.token, att.base)
        else:  # only ends: no begin body is sent, so none is needed (nor the snapshot)
            plan = StagePlan.ends_only(att.lora_name, att.token)
        staged = await stage(
            plan, self.engines, engines, _PublishCalls(self, att), end_only=end_only, phase_s=att.phase_s
        )
        if staged.stopped is not None:
            return staged.stopped
        return await self._commit(att)

    # --------------------------------------------------------------------------- phases

    async def _settle(
        self,
        att: _Attempt,
        op: str,
        refused: Mapping[str, LoraVersionError],
        unknown: Mapping[str, OutcomeUnknown],
    ) -> PublishResult | None:
        """None when the phase succeeded everywhere; otherwise the run's result."""
        for engine, u in unknown.items():
            await self._mark_unknown(engine, att.token, op, u.cause)
        if refused:
            engine, err = next(iter(refused.items()))
            reason = f"{op} refused on {engine}: {err.code.value}: {err.message}"
            return await self._abort_and_cleanup(att, reason, err)
        if unknown:
            return await self._result(att, PublishOutcome.OUTCOME_UNKNOWN)
        return None

    def _ready_receipt(self, att: _Attempt, incarnation: str) -> ReadyEvidence:
        return ReadyEvidence(att.key, att.digest, att.token, incarnation)

    async def _read_statuses(self, att: _Attempt) -> dict[str, protocol.EngineStatus | None]:
        """Every cohort engine's status now (None: it did not answer); each incarnation seen is
        registered, so a restart drops that engine's earlier PREPARED / READY in the registry."""

        async def read(engine: str) -> protocol.EngineStatus:
            status = await self.engines[engine].status()
            await self._note_incarnation(engine, status.incarnation)
            return status

        results = await asyncio.gather(*(read(e) for e in self._cohort), return_exceptions=True)
        statuses: dict[str, protocol.EngineStatus | None] = {}
        for engine, r in zip(self._cohort, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, LoraVersionError | OutcomeUnknown):
                raise r
            if isinstance(r, protocol.EngineStatus):
                statuses[engine] = r
                att.steps.append(EngineStep(engine, "status", CallOutcome.OK, detail=r.incarnation))
            else:
                statuses[engine] = None
                att.steps.append(EngineStep(engine, "status", CallOutcome.UNKNOWN, detail=str(r)))
        return statuses

    async def _commit_evidence(self, att: _Attempt) -> dict[str, CommitEvidence]:
        """Every cohort engine's status read now, judged with :func:`commit_evidence`."""
        statuses = await self._read_statuses(att)
        if att.base is None:
            # No engine answered before the reserve: the epoch's base is fixed now, from the
            # statuses every engine must give for the commit (a disagreement is never READY).
            await self._epoch_base(att, None)
        return {
            e: commit_evidence(s, att.lora_name, att.token, att.digest, att.base) for e, s in statuses.items()
        }

    async def _commit(self, att: _Attempt) -> PublishResult:
        t = time.monotonic()
        evidence = await self._commit_evidence(att)
        unreachable = sorted(e for e, ev in evidence.items() if ev is CommitEvidence.UNREACHABLE)
        not_ready = sorted(e for e, ev in evidence.items() if ev is CommitEvidence.NOT_READY)
        if unreachable or not_ready:
            # No commit without fresh READY evidence from every engine. The slot stays held and
            # the attempt pending; resolve() finishes it once every engine answers.
            att.phase_s["commit"] = time.monotonic() - t
            for engine in unreachable:
                await self._mark_unknown(engine, att.token, "status", "no answer before commit")
            if unreachable:
                return await self._result(
                    att, PublishOutcome.OUTCOME_UNKNOWN, unknown_engines=tuple(unreachable)
                )
            err = LoraVersionError(
                ErrorCode.NOT_ALL_READY,
                f"no fresh READY for this attempt from {not_ready} before the commit",
                engines=not_ready,
            )
            return await self._result(att, PublishOutcome.NOT_COMMITTED, error=err)
        try:
            receipt = await self.registry.commit(
                version_key=att.key,
                attempt_token=att.token,
                expected_default_revision=att.expected_revision,
            )
        except LoraVersionError as err:
            att.phase_s["commit"] = time.monotonic() - t
            return await self._result(att, PublishOutcome.NOT_COMMITTED, error=err)
        except RegistryUnavailable:
            # The reply is lost (after the client's idempotent retries): ask what happened.
            att.phase_s["commit"] = time.monotonic() - t
            try:
                view = await self.registry.version(version_key=att.key)
            except RegistryUnavailable:
                return await self._result(att, PublishOutcome.COMMIT_UNKNOWN, query=False)
            if view is None or view.commit_revision is None:
                return await self._result(att, PublishOutcome.NOT_COMMITTED)
            try:
                receipt = await self.registry.commit(
                    version_key=att.key, attempt_token=att.token, expected_default_revision=0
                )
            except RegistryUnavailable:
                receipt = None
            self._snapshots.pop(att.token, None)
            return await self._result(att, PublishOutcome.PUBLISHED, commit=receipt)
        att.phase_s["commit"] = time.monotonic() - t
        self._snapshots.pop(att.token, None)
        return await self._result(att, PublishOutcome.PUBLISHED, commit=receipt)

    # ------------------------------------------------------------------------- failure

    async def _abort_and_cleanup(
        self, att: _Attempt, reason: str, error: LoraVersionError | None
    ) -> PublishResult:
        await self.registry.abort(attempt_token=att.token, reason=reason[:1000])
        # Every engine, including those that never answered begin: the cleanup tombstones the
        # attempt token there, so a late begin for it cannot resurrect the candidate.
        return await self._cleanup(att, list(self._cohort), error)

    async def _cleanup(
        self, att: _Attempt, engines: Sequence[str], error: LoraVersionError | None
    ) -> PublishResult:
        req = protocol.CleanupRequest(lora_name=att.lora_name, attempt_token=att.token)

        async def one(engine: str) -> Any:
            receipt = await self.engines[engine].cleanup(req)
            await self._note_incarnation(engine, receipt.incarnation)
            if isinstance(receipt, protocol.DrainingReply):
                # Unregistered there, requests still running on it: not clean yet (resolve asks again).
                why = receipt.unload_error or f"draining {receipt.in_flight} in-flight requests"
                raise OutcomeUnknown(engine, "cleanup", why, maybe_sent=True)
            cleaned = CleanupEvidence(att.token, receipt.incarnation)
            return await self._record(
                self.registry.record_cleanup(engine_id=engine, attempt_token=att.token, receipt=cleaned)
            )

        t = time.monotonic()
        _, refused, unknown = await self._fanout(att.steps, "cleanup", engines, one)
        att.phase_s["cleanup"] = att.phase_s.get("cleanup", 0.0) + time.monotonic() - t
        # A cleanup that was refused is not a confirmed cleanup: like an unknown one it keeps
        # the slot until a later resolve() gets a receipt.
        for engine, u in unknown.items():
            await self._mark_unknown(engine, att.token, "cleanup", u.cause)
        for engine, err in refused.items():
            await self._mark_unknown(
                engine, att.token, "cleanup", f"cleanup refused: {err.code.value}: {err.message}"
            )
        view = await self.registry.version(version_key=att.key)
        if view is not None and view.state is VersionState.FAILED_CLEAN:
            self._snapshots.pop(att.token, None)
            return await self._result(att, PublishOutcome.FAILED_CLEAN, error=error, view=view)
        return await self._result(att, PublishOutcome.CLEANUP_PENDING, error=error, view=view)

    # ========================================================================== resolve

    async def resolve(self, snapshot: Snapshot | None = None) -> PublishResult | None:
        """Settle the pending attempt (LOADING or ABORTED), if there is one.

        ABORTED: cleanup on every engine not yet confirmed. LOADING: ask every engine (also one
        the registry has READY: that record may be stale) for this version
        (``GET /lora_versions/{name}``): READY_LOCAL for this
        attempt counts as its READY receipt; LOADING, or PREPARED with every bucket, gets only
        ``end`` again (it joins the load); PREPARED with buckets missing, or unknown to the
        engine (never got begin, or restarted), is driven again from begin (duplicate buckets
        are acknowledged), which needs the snapshot -- ``snapshot``, this publisher's memory of
        it, or the snapshot store's entry for the digest; without it the attempt is aborted and
        cleaned (presumed abort). A CLEANED tombstone or another attempt under the name also
        aborts. An engine that still cannot answer leaves the outcome unknown. Then commit.
        """
        async with self._lock:
            await self._setup()
            status = await self.registry.status()
            if status.pending_attempt is None:
                return None
            view = next(v for v in status.versions if v.attempt_token == status.pending_attempt)
            snap = snapshot or self._snapshots.get(view.attempt_token) or self._stored(view.digest)
            if snap is not None and snap.digest != view.digest:
                raise ValueError(f"the snapshot's digest is not the pending attempt's ({view.version_key})")
            att = _Attempt(
                view.version_key,
                view.lora_name,
                view.digest,
                view.attempt_token,
                snap,
                expected_revision=status.default_revision,
                base=status.base_fingerprint,
            )
            try:
                return await self._resolve_attempt(att, view)
            finally:
                await self.cohort.retain_live_snapshots()

    def _stored(self, digest: str) -> Snapshot | None:
        """The snapshot of ``digest`` from the store (a fresh publisher finishing another
        process's attempt); None when there is no store or no valid entry."""
        if self.store is None:
            return None
        try:
            return self.store.get(digest)
        except LoraVersionError:
            return None

    async def _resolve_attempt(self, att: _Attempt, view: VersionView) -> PublishResult:
        if view.state is VersionState.ABORTED:
            todo = [e for e in self._cohort if view.attempt_phases.get(e) is not AttemptPhase.CLEANED]
            return await self._cleanup(att, todo, None)
        if view.state is not VersionState.LOADING:
            done = (
                PublishOutcome.ALREADY_PUBLISHED if is_committed(view.state) else PublishOutcome.FAILED_CLEAN
            )
            return await self._result(att, done, view=view)
        await self._read_statuses(att)  # a restart must be known before READY is trusted
        # Every engine is asked, also those the registry has READY: a READY recorded in the
        # engine's current incarnation may be stale all the same (its copy cleaned up since, by
        # an operator or a stale attempt), and only its own answer says so. Trusting the record
        # would leave the attempt NOT_COMMITTED forever, its slot held.
        todo = list(self._cohort)

        async def ask(engine: str) -> ResolveAction:
            try:
                vs = await self.engines[engine].version_status(att.lora_name)
            except LoraVersionError as err:
                if err.code is not ErrorCode.UNKNOWN_VERSION:
                    # A refused *query* says nothing about the attempt: we still do not know.
                    raise OutcomeUnknown(engine, "version_status", f"refused: {err}") from None
                vs = None  # never got begin, or lost it in a restart
            action = resolve_action(vs, att.token, att.digest)
            if action is ResolveAction.READY:
                assert vs is not None
                await self._note_incarnation(engine, vs.incarnation)
                ready = self._ready_receipt(att, vs.incarnation)
                await self._record(self.registry.record_ready(engine_id=engine, receipt=ready))
            return action

        ok, refused, unknown = await self._fanout(att.steps, "version_status", todo, ask, str)
        doomed = [e for e, a in ok.items() if a is ResolveAction.DOOMED] + list(refused)
        if doomed:
            for engine, u in unknown.items():
                await self._mark_unknown(engine, att.token, "version_status", u.cause)
            return await self._abort_and_cleanup(
                att, f"cannot finish on {doomed}", next(iter(refused.values()), None)
            )
        if unknown:
            # Nothing new was learnt about these engines; earlier unknown marks stay as they are.
            return await self._result(att, PublishOutcome.OUTCOME_UNKNOWN, unknown_engines=tuple(unknown))
        redrive = [e for e in todo if ok.get(e) is ResolveAction.REDRIVE]
        end_only = [e for e in todo if ok.get(e) is ResolveAction.END]
        if redrive and att.snapshot is None:
            return await self._abort_and_cleanup(
                att, "the snapshot is not available to finish the attempt", None
            )
        return await self._run(att, redrive, end_only)

    # =========================================================================== results

    async def _result(
        self,
        att: _Attempt,
        outcome: PublishOutcome,
        *,
        error: LoraVersionError | None = None,
        commit: CommitReceipt | None = None,
        view: VersionView | None = None,
        query: bool = True,
        unknown_engines: tuple[str, ...] = (),
    ) -> PublishResult:
        if view is None and query:
            try:
                view = await self.registry.version(version_key=att.key)
            except RegistryUnavailable:
                view = None
        marked = {e for e, p in (view.attempt_phases.items() if view else ()) if p is AttemptPhase.UNKNOWN}
        unknown = tuple(sorted(marked | set(unknown_engines)))
        return PublishResult(
            outcome=outcome,
            version_key=att.key,
            lora_name=att.lora_name,
            digest=att.digest,
            attempt_token=att.token or None,
            registry_state=view.state if view is not None else None,
            commit=commit,
            error=error,
            unknown=unknown,
            steps=tuple(att.steps),
            phase_s=dict(att.phase_s),
            duration_s=time.monotonic() - att.t0,
        )
