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
The registry may be the in-process registry (or durable store), the sync ``RegistryClient`` or
the ``AsyncRegistryClient`` (in process or through the Ray actor): see :class:`AsyncRegistryAdapter`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from relax_glue.engine_client import EngineAPI, OutcomeUnknown
from relax_glue.registry_types import (
    AttemptPhase,
    CleanupReceipt,
    CommitReceipt,
    PreparedReceipt,
    ReadyReceipt,
    ReclaimPhase,
    UnloadedReceipt,
    VersionKey,
    VersionState,
    VersionView,
)
from relax_glue.snapshot import Snapshot
from sglang_ext import protocol as wire
from sglang_ext.errors import ErrorCode, LoraVersionError

__all__ = [
    "AsyncRegistryAdapter",
    "EngineStep",
    "PublishOutcome",
    "PublishResult",
    "Publisher",
    "ReclaimResult",
    "RegistryUnavailable",
]

_COMMITTED = frozenset(
    {VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING, VersionState.RECLAIMED}
)


# ------------------------------------------------------------------------------ the registry


class RegistryUnavailable(Exception):
    """The registry could not be reached for ``op`` (after the adapter's retries). Its outcome
    is unknown to the caller; every registry op is idempotent, so asking again is safe."""

    def __init__(self, op: str, cause: BaseException) -> None:
        super().__init__(f"registry {op}: {type(cause).__name__}: {cause}")
        self.op = op
        self.cause = cause


class AsyncRegistryAdapter:
    """One async face for every registry flavour: sync objects are called directly (the pure
    registry never blocks), coroutine methods are awaited.

    Transient failures (connection / timeout / OS errors, Ray errors) are retried ``retries``
    times: every registry operation is idempotent by request id or natural key, so a retry of a
    call whose reply was lost gets the first answer. A :class:`LoraVersionError` is a decision
    of the registry and is never retried.
    """

    def __init__(
        self,
        registry: Any,
        *,
        retries: int = 2,
        retry_delay_s: float = 0.05,
        transient: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError),
    ) -> None:
        self.registry = registry
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.transient = transient

    def _is_transient(self, exc: BaseException) -> bool:
        # Ray's errors (actor died, task failed) are transient for an idempotent op; we do not
        # import ray to recognise them.
        return isinstance(exc, self.transient) or type(exc).__module__.startswith("ray.")

    async def call(self, op: str, /, **kwargs: Any) -> Any:
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_delay_s * attempt)
            try:
                result = getattr(self.registry, op)(**kwargs)
                if inspect.isawaitable(result):
                    result = await result
                return result
            except LoraVersionError:
                raise
            except Exception as exc:
                if not self._is_transient(exc):
                    raise
                last = exc
        assert last is not None
        raise RegistryUnavailable(op, last)

    async def describe(self) -> tuple[str, tuple[str, ...]]:
        """``(epoch, engines)``; connects an AsyncRegistryClient first if needed."""
        reg = self.registry
        try:
            return str(reg.epoch), tuple(reg.engines)
        except RuntimeError:
            connect = getattr(reg, "connect", None)
            if connect is None:
                raise
            result = connect()
            if inspect.isawaitable(result):
                await result
            return str(reg.epoch), tuple(reg.engines)


# ---------------------------------------------------------------------------------- results


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
class EngineStep:
    """One engine call of a run and how it ended (or the registry's answer to its receipt)."""

    engine_id: str
    op: str
    status: str  # "ok" | "refused" | "unknown"
    source: str = "engine"  # "engine" | "registry": who refused
    code: ErrorCode | None = None
    detail: str = ""


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
        return self.registry_state is not None and self.registry_state not in (
            VersionState.FAILED_CLEAN,
            VersionState.RECLAIMED,
        )


@dataclasses.dataclass(frozen=True)
class ReclaimResult:
    version_key: VersionKey
    lora_name: str
    reclaim_id: str | None
    registry_state: VersionState | None
    engines: Mapping[str, str]  # engine -> "UNLOADED" | "DRAINING:<in_flight>" | "UNKNOWN" | "REFUSED:<CODE>"
    error: LoraVersionError | None = None  # the registry refused the claim
    steps: tuple[EngineStep, ...] = ()
    duration_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.registry_state is VersionState.RECLAIMED


# ------------------------------------------------------------------------------- internals


class _RegistryRefused(Exception):
    """The registry refused a receipt of an engine call that itself succeeded."""

    def __init__(self, error: LoraVersionError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass
class _Attempt:
    key: VersionKey
    lora_name: str
    digest: str
    token: str
    snapshot: Snapshot | None
    expected_revision: int
    t0: float = dataclasses.field(default_factory=time.monotonic)
    steps: list[EngineStep] = dataclasses.field(default_factory=list)
    phase_s: dict[str, float] = dataclasses.field(default_factory=dict)


_Fanout = tuple[dict[str, Any], dict[str, LoraVersionError], dict[str, OutcomeUnknown]]


def _reg_key(key: Any) -> VersionKey:
    return VersionKey(str(key.epoch), str(key.version_id))


class Publisher:
    """Drives publications and reclaims over a fixed engine cohort.

    ``engines`` maps every engine id of the registry's cohort to its client. One publication
    (or resolution) runs at a time per publisher; reclaims run under their own lock.
    """

    def __init__(
        self,
        registry: Any,
        engines: Mapping[str, EngineAPI],
        *,
        prefix: str = wire.DEFAULT_LORA_PREFIX,
        reclaim_wait_s: float = 2.0,
        reclaim_poll_s: float = 0.1,
        reclaim_deadline_s: float = 60.0,
        verify_snapshot: bool = True,
        verify_before_commit: bool = True,
        registry_retries: int = 2,
        registry_retry_delay_s: float = 0.05,
        transient_registry_errors: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError),
    ) -> None:
        self.registry = (
            registry
            if isinstance(registry, AsyncRegistryAdapter)
            else AsyncRegistryAdapter(
                registry,
                retries=registry_retries,
                retry_delay_s=registry_retry_delay_s,
                transient=transient_registry_errors,
            )
        )
        self.engines: dict[str, EngineAPI] = dict(engines)
        self.prefix = prefix
        self.reclaim_wait_s = reclaim_wait_s
        self.reclaim_poll_s = reclaim_poll_s
        self.reclaim_deadline_s = reclaim_deadline_s
        self.verify_snapshot = verify_snapshot
        self.verify_before_commit = verify_before_commit
        self._epoch: str | None = None
        self._cohort: tuple[str, ...] = ()
        self._incarnations: dict[str, str] = {}  # last incarnation we registered per engine
        self._snapshots: dict[str, Snapshot] = {}  # attempt token -> snapshot, until it ends
        self._lock = asyncio.Lock()
        self._reclaim_lock = asyncio.Lock()

    async def _reg(self, op: str, /, **kwargs: Any) -> Any:
        return await self.registry.call(op, **kwargs)

    async def _setup(self) -> str:
        if self._epoch is None:
            epoch, cohort = await self.registry.describe()
            if set(cohort) != set(self.engines):
                raise ValueError(f"engine clients {sorted(self.engines)} != registry cohort {sorted(cohort)}")
            self._epoch, self._cohort = epoch, cohort
        return self._epoch

    # ============================================================================ publish

    async def publish(
        self, snapshot: Snapshot, version_id: str | int, *, request_id: str | None = None
    ) -> PublishResult:
        """Publish ``snapshot`` as ``(epoch, version_id)``. Returns a result for every protocol
        outcome; raises only :class:`RegistryUnavailable` (registry unreachable) and bugs."""
        async with self._lock:
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
            status = await self._reg("status")
            att.expected_revision = status.default_revision
            t = time.monotonic()
            try:
                res = await self._reg(
                    "reserve",
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

    async def _replay(self, att: _Attempt) -> PublishResult:
        """``reserve`` found this exact version already (same key, same digest)."""
        view = await self._reg("version", version_key=att.key)
        if view.state in _COMMITTED:
            receipt = await self._reg(
                "commit", version_key=att.key, attempt_token=att.token, expected_default_revision=0
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
        already hold every bucket), then commit."""
        prepared: list[str] = []
        if engines:
            begun = await self._begin_phase(att, engines)
            if isinstance(begun, PublishResult):
                return begun
            prepared = begun
        if prepared:
            failed = await self._bucket_phase(att, prepared)
            if failed is not None:
                return failed
        to_end = [*prepared, *end_only]
        if to_end:
            failed = await self._end_phase(att, to_end)
            if failed is not None:
                return failed
        return await self._commit(att)

    # --------------------------------------------------------------------------- phases

    async def _fanout(
        self,
        att: _Attempt,
        op: str,
        engines: Sequence[str],
        call: Callable[[str], Awaitable[Any]],
        describe: Callable[[Any], str] = lambda _: "",
    ) -> _Fanout:
        """Run ``call`` on every engine concurrently and wait for *all* of them."""
        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        ok: dict[str, Any] = {}
        refused: dict[str, LoraVersionError] = {}
        unknown: dict[str, OutcomeUnknown] = {}
        fatal: BaseException | None = None
        for engine, r in zip(engines, results, strict=True):
            if isinstance(r, _RegistryRefused):
                refused[engine] = r.error
                att.steps.append(EngineStep(engine, op, "refused", "registry", r.error.code, r.error.message))
            elif isinstance(r, LoraVersionError):
                refused[engine] = r
                att.steps.append(EngineStep(engine, op, "refused", "engine", r.code, r.message))
            elif isinstance(r, OutcomeUnknown):
                unknown[engine] = r
                att.steps.append(EngineStep(engine, op, "unknown", detail=r.cause))
            elif isinstance(r, BaseException):
                fatal = fatal or r
            else:
                ok[engine] = r
                att.steps.append(EngineStep(engine, op, "ok", detail=describe(r)))
        if fatal is not None:
            raise fatal
        return ok, refused, unknown

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

    async def _mark_unknown(self, engine: str, ref: str, op: str, cause: str) -> None:
        await self._reg("mark_engine_unknown", engine_id=engine, ref=ref, op=op, reason=cause[:1000] or op)

    async def _note_incarnation(self, engine: str, incarnation: str) -> None:
        """Tell the registry about an incarnation seen in a receipt (a restart invalidates that
        engine's earlier PREPARED / READY). An earlier incarnation is left to the receipt's own
        check, which refuses it."""
        if self._incarnations.get(engine) == incarnation:
            return
        try:
            await self._reg("register_engine_incarnation", engine_id=engine, incarnation=incarnation)
        except LoraVersionError as err:
            if err.code is not ErrorCode.STALE_INCARNATION:
                raise
            return
        self._incarnations[engine] = incarnation

    async def _record(self, op: str, /, **kwargs: Any) -> Any:
        try:
            return await self._reg(op, **kwargs)
        except LoraVersionError as err:
            raise _RegistryRefused(err) from None

    def _ready_receipt(self, att: _Attempt, incarnation: str) -> ReadyReceipt:
        return ReadyReceipt(att.key, att.digest, att.token, incarnation)

    async def _begin_phase(self, att: _Attempt, engines: Sequence[str]) -> list[str] | PublishResult:
        assert att.snapshot is not None, "driving an engine from begin needs the snapshot"
        req = att.snapshot.begin_request(self.prefix, att.key.epoch, att.key.version_id, att.token)

        async def one(engine: str) -> str:
            reply = await self.engines[engine].begin(req)
            await self._note_incarnation(engine, reply.incarnation)
            if isinstance(reply, wire.ReadyReceipt):
                # This engine already holds exactly this attempt, loaded: nothing to send.
                await self._record(
                    "record_ready", engine_id=engine, receipt=self._ready_receipt(att, reply.incarnation)
                )
                return "READY"
            await self._record(
                "record_prepared",
                engine_id=engine,
                receipt=PreparedReceipt(att.key, att.token, reply.incarnation),
            )
            return "PREPARED"

        t = time.monotonic()
        ok, refused, unknown = await self._fanout(att, "begin", engines, one, str)
        att.phase_s["begin"] = att.phase_s.get("begin", 0.0) + time.monotonic() - t
        failed = await self._settle(att, "begin", refused, unknown)
        if failed is not None:
            return failed
        return [e for e in engines if ok[e] == "PREPARED"]

    async def _bucket_phase(self, att: _Attempt, engines: Sequence[str]) -> PublishResult | None:
        assert att.snapshot is not None
        t = time.monotonic()
        # One payload in memory at a time; each bucket is acknowledged by every engine before
        # the next one is sent (RFC 3.2), so a failure stops the transfer everywhere at once.
        for bucket in att.snapshot.iter_buckets():
            meta = wire.ReceiveBucketMeta(
                lora_name=att.lora_name,
                attempt_token=att.token,
                index=bucket.spec.index,
                sha256=bucket.sha256,
            )
            payload = bucket.payload

            async def one(engine: str, meta: wire.ReceiveBucketMeta = meta, payload: bytes = payload) -> Any:
                return await self.engines[engine].receive_bucket(meta, payload)

            _, refused, unknown = await self._fanout(
                att,
                "receive_bucket",
                engines,
                one,
                lambda ack: f"#{ack.index}{' dup' if ack.duplicate else ''}",
            )
            failed = await self._settle(att, "receive_bucket", refused, unknown)
            if failed is not None:
                att.phase_s["buckets"] = att.phase_s.get("buckets", 0.0) + time.monotonic() - t
                return failed
        att.phase_s["buckets"] = att.phase_s.get("buckets", 0.0) + time.monotonic() - t
        return None

    async def _end_phase(self, att: _Attempt, engines: Sequence[str]) -> PublishResult | None:
        req = wire.EndRequest(lora_name=att.lora_name, attempt_token=att.token)

        async def one(engine: str) -> Any:
            receipt = await self.engines[engine].end(req)
            await self._note_incarnation(engine, receipt.incarnation)
            # Recorded as soon as this engine answers, not after the slowest one (RFC 3.4).
            return await self._record(
                "record_ready", engine_id=engine, receipt=self._ready_receipt(att, receipt.incarnation)
            )

        t = time.monotonic()
        _, refused, unknown = await self._fanout(att, "end", engines, one)
        att.phase_s["end"] = att.phase_s.get("end", 0.0) + time.monotonic() - t
        return await self._settle(att, "end", refused, unknown)

    async def _refresh_incarnations(self, att: _Attempt | None) -> None:
        """Register each engine's current incarnation (a read; failures change nothing)."""

        async def one(engine: str) -> str:
            status = await self.engines[engine].status()
            await self._note_incarnation(engine, status.incarnation)
            return status.incarnation

        results = await asyncio.gather(*(one(e) for e in self._cohort), return_exceptions=True)
        for engine, r in zip(self._cohort, results, strict=True):
            if isinstance(r, LoraVersionError | OutcomeUnknown):
                if att is not None:
                    att.steps.append(EngineStep(engine, "status", "unknown", detail=str(r)))
            elif isinstance(r, BaseException):
                raise r
            elif att is not None:
                att.steps.append(EngineStep(engine, "status", "ok", detail=r))

    async def _commit(self, att: _Attempt) -> PublishResult:
        t = time.monotonic()
        if self.verify_before_commit:
            # An engine restarted after its READY must not count: registering its new
            # incarnation drops that READY, and the commit below is refused (NOT_ALL_READY).
            await self._refresh_incarnations(att)
        try:
            receipt = await self._reg(
                "commit",
                version_key=att.key,
                attempt_token=att.token,
                expected_default_revision=att.expected_revision,
            )
        except LoraVersionError as err:
            att.phase_s["commit"] = time.monotonic() - t
            return await self._result(att, PublishOutcome.NOT_COMMITTED, error=err)
        except RegistryUnavailable:
            # The reply is lost (after the adapter's idempotent retries): ask what happened.
            att.phase_s["commit"] = time.monotonic() - t
            try:
                view = await self._reg("version", version_key=att.key)
            except RegistryUnavailable:
                return await self._result(att, PublishOutcome.COMMIT_UNKNOWN, query=False)
            if view is None or view.commit_revision is None:
                return await self._result(att, PublishOutcome.NOT_COMMITTED)
            try:
                receipt = await self._reg(
                    "commit", version_key=att.key, attempt_token=att.token, expected_default_revision=0
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
        await self._reg("abort", attempt_token=att.token, reason=reason[:1000])
        # Every engine, including those that never answered begin: the cleanup tombstones the
        # attempt token there, so a late begin for it cannot resurrect the candidate.
        return await self._cleanup(att, list(self._cohort), error)

    async def _cleanup(
        self, att: _Attempt, engines: Sequence[str], error: LoraVersionError | None
    ) -> PublishResult:
        req = wire.CleanupRequest(lora_name=att.lora_name, attempt_token=att.token)

        async def one(engine: str) -> Any:
            receipt = await self.engines[engine].cleanup(req)
            await self._note_incarnation(engine, receipt.incarnation)
            return await self._record(
                "record_cleanup",
                engine_id=engine,
                attempt_token=att.token,
                receipt=CleanupReceipt(att.token, receipt.incarnation),
            )

        t = time.monotonic()
        _, refused, unknown = await self._fanout(att, "cleanup", engines, one)
        att.phase_s["cleanup"] = att.phase_s.get("cleanup", 0.0) + time.monotonic() - t
        # A cleanup that was refused is not a confirmed cleanup: like an unknown one it keeps
        # the slot until a later resolve() gets a receipt.
        for engine, u in unknown.items():
            await self._mark_unknown(engine, att.token, "cleanup", u.cause)
        for engine, err in refused.items():
            await self._mark_unknown(
                engine, att.token, "cleanup", f"cleanup refused: {err.code.value}: {err.message}"
            )
        view = await self._reg("version", version_key=att.key)
        if view is not None and view.state is VersionState.FAILED_CLEAN:
            self._snapshots.pop(att.token, None)
            return await self._result(att, PublishOutcome.FAILED_CLEAN, error=error, view=view)
        return await self._result(att, PublishOutcome.CLEANUP_PENDING, error=error, view=view)

    # ========================================================================== resolve

    async def resolve(self, snapshot: Snapshot | None = None) -> PublishResult | None:
        """Settle the pending attempt (LOADING or ABORTED), if there is one.

        ABORTED: cleanup on every engine not yet confirmed. LOADING: ask each engine that is
        not READY for this version (``GET /lora_versions/{name}``): READY_LOCAL for this
        attempt counts as its READY receipt; LOADING, or PREPARED with every bucket, gets only
        ``end`` again (it joins the load); PREPARED with buckets missing, or unknown to the
        engine (never got begin, or restarted), is driven again from begin (duplicate buckets
        are acknowledged), which needs the snapshot -- this publisher's memory of it, or
        ``snapshot``; without it the attempt is aborted and cleaned (presumed abort). A CLEANED
        tombstone or another attempt under the name also aborts. An engine that still cannot
        answer leaves the outcome unknown. Then commit.
        """
        async with self._lock:
            await self._setup()
            status = await self._reg("status")
            if status.pending_attempt is None:
                return None
            view = next(v for v in status.versions if v.attempt_token == status.pending_attempt)
            snap = snapshot or self._snapshots.get(view.attempt_token)
            if snap is not None and snap.digest != view.digest:
                raise ValueError(f"the snapshot's digest is not the pending attempt's ({view.version_key})")
            att = _Attempt(
                view.version_key,
                view.lora_name,
                view.digest,
                view.attempt_token,
                snap,
                expected_revision=status.default_revision,
            )
            return await self._resolve_attempt(att, view)

    async def _resolve_attempt(self, att: _Attempt, view: VersionView) -> PublishResult:
        if view.state is VersionState.ABORTED:
            todo = [e for e in self._cohort if view.attempt_phases.get(e) is not AttemptPhase.CLEANED]
            return await self._cleanup(att, todo, None)
        if view.state is not VersionState.LOADING:
            done = (
                PublishOutcome.ALREADY_PUBLISHED if view.state in _COMMITTED else PublishOutcome.FAILED_CLEAN
            )
            return await self._result(att, done, view=view)
        await self._refresh_incarnations(att)  # a restart must be known before READY is trusted
        view = await self._reg("version", version_key=att.key)
        todo = [e for e in self._cohort if view.attempt_phases.get(e) is not AttemptPhase.READY]

        async def ask(engine: str) -> str:
            try:
                vs = await self.engines[engine].version_status(att.lora_name)
            except LoraVersionError as err:
                if err.code is ErrorCode.UNKNOWN_VERSION:
                    return "REDRIVE"  # never got begin, or lost it in a restart
                # A refused *query* says nothing about the attempt: we still do not know.
                raise OutcomeUnknown(engine, "version_status", f"refused: {err}") from None
            if vs.attempt_token != att.token or vs.digest != att.digest:
                return "DOOMED"
            if vs.state is wire.EngineVersionState.READY_LOCAL:
                await self._note_incarnation(engine, vs.incarnation)
                await self._record(
                    "record_ready", engine_id=engine, receipt=self._ready_receipt(att, vs.incarnation)
                )
                return "READY"
            if vs.state is wire.EngineVersionState.LOADING:
                return "END"  # a repeated end joins the running load (the engine shields it)
            if vs.state is wire.EngineVersionState.PREPARED:
                # Every bucket already there: end alone finishes it, no snapshot needed.
                complete = vs.buckets_total > 0 and vs.buckets_received == vs.buckets_total
                return "END" if complete else "REDRIVE"
            return "DOOMED"  # CLEANED tombstone, or reclaimed: this attempt cannot finish here

        ok, refused, unknown = await self._fanout(att, "version_status", todo, ask, str)
        doomed = [e for e, s in ok.items() if s == "DOOMED"] + list(refused)
        if doomed:
            for engine, u in unknown.items():
                await self._mark_unknown(engine, att.token, "version_status", u.cause)
            return await self._abort_and_cleanup(
                att, f"cannot finish on {doomed}", next(iter(refused.values()), None)
            )
        if unknown:
            # Nothing new was learnt about these engines; earlier unknown marks stay as they are.
            return await self._result(att, PublishOutcome.OUTCOME_UNKNOWN, unknown_engines=tuple(unknown))
        redrive = [e for e in todo if ok.get(e) == "REDRIVE"]
        end_only = [e for e in todo if ok.get(e) == "END"]
        if redrive and att.snapshot is None:
            return await self._abort_and_cleanup(
                att, "the snapshot is not available to finish the attempt", None
            )
        return await self._run(att, redrive, end_only)

    # ========================================================================== reclaim

    async def reclaim_ready(self, *, deadline_s: float | None = None) -> tuple[ReclaimResult, ...]:
        """Reclaim every RETIRED version without session refs, and continue every version
        already RECLAIMING (an earlier run that hit its deadline or an unknown outcome)."""
        async with self._reclaim_lock:
            await self._setup()
            status = await self._reg("status")
            todo = [
                v
                for v in status.versions
                if v.state is VersionState.RECLAIMING
                or (v.state is VersionState.RETIRED and v.session_refs == 0)
            ]
            deadline = time.monotonic() + (self.reclaim_deadline_s if deadline_s is None else deadline_s)
            return tuple([await self._reclaim_version(v, deadline) for v in todo])

    async def _reclaim_version(self, view: VersionView, deadline: float) -> ReclaimResult:
        t0 = time.monotonic()
        try:
            claim = await self._reg("claim_reclaim", version_key=view.version_key)
        except LoraVersionError as err:  # e.g. a session still holds it
            return ReclaimResult(view.version_key, view.lora_name, None, view.state, {}, error=err)
        phases = dict(view.reclaim_phases)
        todo = [e for e in self._cohort if phases.get(e) is not ReclaimPhase.UNLOADED]
        att = _Attempt(view.version_key, view.lora_name, view.digest, claim.reclaim_id, None, 0)

        async def one(engine: str) -> str:
            polls = 0
            while True:
                wait = max(0.0, min(self.reclaim_wait_s, deadline - time.monotonic()))
                reply = await self.engines[engine].reclaim(
                    wire.ReclaimRequest(
                        lora_name=claim.lora_name, reclaim_id=claim.reclaim_id, timeout_s=wait
                    )
                )
                polls += 1
                if isinstance(reply, wire.UnloadedReceipt):
                    await self._note_incarnation(engine, reply.incarnation)
                    await self._record(
                        "confirm_reclaim",
                        version_key=view.version_key,
                        engine_id=engine,
                        receipt=UnloadedReceipt(claim.reclaim_id, reply.incarnation),
                    )
                    return f"UNLOADED after {polls} call(s)"
                # DRAINING: the name is unregistered, in-flight requests are finishing. Known
                # state, not an unknown one: keep polling until the deadline, then report it.
                if time.monotonic() + self.reclaim_poll_s >= deadline:
                    return f"DRAINING:{reply.in_flight}"
                await asyncio.sleep(self.reclaim_poll_s)

        _, refused, unknown = await self._fanout(att, "reclaim", todo, one, str)
        for engine, u in unknown.items():
            await self._mark_unknown(engine, claim.reclaim_id, "reclaim", u.cause)
        after = await self._reg("version", version_key=view.version_key)
        engines: dict[str, str] = {}
        for e in self._cohort:
            if after is not None and after.reclaim_phases.get(e) is ReclaimPhase.UNLOADED:
                engines[e] = "UNLOADED"
            elif e in unknown:
                engines[e] = "UNKNOWN"
            elif e in refused:
                engines[e] = f"REFUSED:{refused[e].code.value}"
            else:
                last = next((s for s in reversed(att.steps) if s.engine_id == e), None)
                engines[e] = last.detail if last is not None else "PENDING"
        return ReclaimResult(
            view.version_key,
            claim.lora_name,
            claim.reclaim_id,
            after.state if after is not None else None,
            engines,
            steps=tuple(att.steps),
            duration_s=time.monotonic() - t0,
        )

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
                view = await self._reg("version", version_key=att.key)
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
