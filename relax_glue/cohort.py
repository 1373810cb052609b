"""What the publisher, the reclaimer and the reconciler share: one :class:`Cohort` (registry
client, engine clients, incarnation memory, snapshot store and its retention, the two locks), an
all-engines fan-out that sorts each engine's outcome (ok, refused, unknown), and the registry
writes every engine step ends with (receipts, incarnations, unknown marks).

:meth:`Cohort.open` is the composition root: the only place that builds the publisher, the
reclaimer and the reconciler, all three over the one cohort it opens."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.actor import AsyncRegistryClient, RegistryUnavailable
from relax_glue.engine_client import CallOutcome, EngineAPI, OutcomeUnknown
from relax_glue.snapshot_store import live_digests

if TYPE_CHECKING:
    from relax_glue.publisher import Publisher
    from relax_glue.reclaimer import Reclaimer, ReclaimResult
    from relax_glue.reconciler import Reconciler, RestoreResult
    from relax_glue.snapshot_store import SnapshotStore

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """One engine call of a run and how it ended (or the registry's answer to its receipt)."""

    engine_id: str
    op: str
    status: CallOutcome  # OK, REFUSED or UNKNOWN
    source: str = "engine"  # "engine" | "registry": who refused
    code: ErrorCode | None = None
    detail: str = ""


class RegistryRefused(Exception):
    """The registry refused a receipt of an engine call that itself succeeded."""

    def __init__(self, error: LoraVersionError) -> None:
        super().__init__(str(error))
        self.error = error


Fanout = tuple[dict[str, Any], dict[str, LoraVersionError], dict[str, OutcomeUnknown]]


@dataclasses.dataclass
class Cohort:
    """One run's registry client and engines, and what every driver of them must share: the
    incarnations already registered, the snapshot store, and the two locks (one publication or
    resolution at a time; one reclaim run at a time; a restore holds both). Built with
    :meth:`open`, which also builds its three drivers."""

    registry: AsyncRegistryClient
    engines: dict[str, EngineAPI]
    store: SnapshotStore | None = None
    # last incarnation registered per engine
    incarnations: dict[str, str] = dataclasses.field(default_factory=dict)
    publication_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    reclaim_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    # the drivers, set by open()
    publisher: Publisher = dataclasses.field(init=False, repr=False)
    reclaimer: Reclaimer = dataclasses.field(init=False, repr=False)
    reconciler: Reconciler | None = dataclasses.field(init=False, repr=False, default=None)

    @classmethod
    def open(
        cls,
        registry: Any,
        engines: Mapping[str, EngineAPI],
        *,
        store: SnapshotStore | None = None,
        prefix: str = protocol.DEFAULT_LORA_PREFIX,
        verify_snapshot: bool = True,
        reclaim_wait_s: float = 2.0,
        reclaim_poll_s: float = 0.1,
        reclaim_deadline_s: float = 60.0,
        registry_retries: int = 2,
        registry_retry_delay_s: float = 0.05,
    ) -> Cohort:
        """The cohort of ``engines`` (every engine id of the registry's cohort, to its client)
        and its drivers. A registry object is wrapped in an in-process client with these
        retries; a client that is passed in keeps its own. ``store``: snapshots of live
        versions on disk, so a restarted engine (or trainer) can get them back; without it no
        restore is possible (no reconciler)."""
        # The drivers import this module for the cohort they take: imported when one is opened.
        from relax_glue.publisher import Publisher
        from relax_glue.reclaimer import Reclaimer
        from relax_glue.reconciler import Reconciler

        client = AsyncRegistryClient.of(
            registry, retries=registry_retries, retry_delay_s=registry_retry_delay_s
        )
        cohort = cls(client, dict(engines), store)
        cohort.reclaimer = Reclaimer(
            cohort, wait_s=reclaim_wait_s, poll_s=reclaim_poll_s, deadline_s=reclaim_deadline_s
        )
        cohort.reconciler = Reconciler(cohort) if store is not None else None
        cohort.publisher = Publisher(cohort, prefix=prefix, verify_snapshot=verify_snapshot)
        return cohort

    async def reclaim_ready(self, *, deadline_s: float | None = None) -> tuple[ReclaimResult, ...]:
        """See :meth:`relax_glue.reclaimer.Reclaimer.reclaim_ready`; then drops the stored
        snapshots of the versions that became RECLAIMED."""
        results = await self.reclaimer.reclaim_ready(deadline_s=deadline_s)
        await self.retain_live_snapshots()
        return results

    async def reconcile(self, engines: Sequence[str] | None = None) -> tuple[RestoreResult, ...]:
        """Stage every live committed version onto each engine that lost it (a restart), from the
        snapshot store. Runs under the publication and the reclaim lock: a restore never races a
        publication or a reclaim of this cohort. See :mod:`relax_glue.reconciler`."""
        if self.reconciler is None:
            raise ValueError("reconcile needs a cohort opened with a SnapshotStore")
        async with self.publication_lock, self.reclaim_lock:
            return await self.reconciler.reconcile(engines)

    async def retain_live_snapshots(self) -> None:
        """The store keeps exactly the digests of versions that hold a slot. Skipped when the
        registry cannot be asked: an entry is never deleted on a guess."""
        if self.store is None:
            return
        try:
            status = await self.registry.status()
        except RegistryUnavailable:
            return
        self.store.retain(live_digests(status))


class CohortDriver:
    """Base of the publisher, the reclaimer and the reconciler: each takes the one cohort."""

    def __init__(self, cohort: Cohort) -> None:
        self.cohort = cohort
        self.registry = cohort.registry
        self.engines = cohort.engines
        self._epoch: str | None = None
        self._cohort: tuple[str, ...] = ()
        self._incarnations = cohort.incarnations

    async def _setup(self) -> str:
        if self._epoch is None:
            await self.registry.connect()
            self._epoch = self.registry.epoch
        # Read on every run: an engine an operator declared lost has left the cohort since (its
        # client may stay in ``engines``; it is no longer driven).
        cohort = tuple((await self.registry.status()).engines)
        if not set(cohort) <= set(self.engines):
            raise ValueError(f"engine clients {sorted(self.engines)} miss registry cohort {sorted(cohort)}")
        self._cohort = cohort
        return self._epoch

    async def _fanout(
        self,
        steps: list[EngineStep],
        op: str,
        engines: Sequence[str],
        call: Callable[[str], Awaitable[Any]],
        describe: Callable[[Any], str] = lambda _: "",
    ) -> Fanout:
        """Run ``call`` on every engine concurrently and wait for *all* of them."""
        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        ok: dict[str, Any] = {}
        refused: dict[str, LoraVersionError] = {}
        unknown: dict[str, OutcomeUnknown] = {}
        fatal: BaseException | None = None
        for engine, r in zip(engines, results, strict=True):
            if isinstance(r, RegistryRefused):
                refused[engine] = r.error
                steps.append(
                    EngineStep(engine, op, CallOutcome.REFUSED, "registry", r.error.code, r.error.message)
                )
            elif isinstance(r, LoraVersionError):
                refused[engine] = r
                steps.append(EngineStep(engine, op, CallOutcome.REFUSED, "engine", r.code, r.message))
            elif isinstance(r, OutcomeUnknown):
                unknown[engine] = r
                steps.append(EngineStep(engine, op, CallOutcome.UNKNOWN, detail=r.cause))
            elif isinstance(r, BaseException):
                fatal = fatal or r
            else:
                ok[engine] = r
                steps.append(EngineStep(engine, op, CallOutcome.OK, detail=describe(r)))
        if fatal is not None:
            raise fatal
        return ok, refused, unknown

    async def _mark_unknown(self, engine: str, ref: str, op: str, cause: str) -> None:
        await self.registry.mark_engine_unknown(engine_id=engine, ref=ref, op=op, reason=cause[:1000] or op)

    async def _note_incarnation(self, engine: str, incarnation: str) -> None:
        """Tell the registry about an incarnation seen in a receipt (a restart invalidates that
        engine's earlier PREPARED / READY). An earlier incarnation is left to the receipt's own
        check, which refuses it."""
        if self._incarnations.get(engine) == incarnation:
            return
        try:
            await self.registry.register_engine_incarnation(engine_id=engine, incarnation=incarnation)
        except LoraVersionError as err:
            if err.code is not ErrorCode.STALE_INCARNATION:
                raise
            return
        self._incarnations[engine] = incarnation

    async def _record(self, call: Awaitable[T]) -> T:
        """A registry recording inside an engine step: its refusal is the step's refusal."""
        try:
            return await call
        except LoraVersionError as err:
            raise RegistryRefused(err) from None
