"""What the publisher, the reclaimer and the reconciler share: the :class:`CohortCore` (registry
client, engine clients, incarnation memory, snapshot store and its retention, the two locks), an
all-engines fan-out that sorts each engine's outcome (ok, refused, unknown), and the registry
writes every engine step ends with (receipts, incarnations, unknown marks).

The drivers import this module, never :mod:`relax_glue.cohort`, which builds them: so the
composition root imports its drivers at module level and no import circle exists."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.actor import AsyncRegistryClient, RegistryUnavailable
from relax_glue.engine_client import CallOutcome, EngineAPI, OutcomeUnknown
from relax_glue.snapshot_store import live_digests

if TYPE_CHECKING:
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
class CohortCore:
    """One run's registry client and engines, and what every driver of them must share: the
    incarnations already registered, the snapshot store, and the two locks (one publication or
    resolution at a time; one reclaim run at a time; a restore holds both). The drivers take
    it; :class:`relax_glue.cohort.Cohort` (a core with its three drivers) is how one is built."""

    registry: AsyncRegistryClient
    engines: dict[str, EngineAPI]
    store: SnapshotStore | None = None
    # last incarnation registered per engine
    incarnations: dict[str, str] = dataclasses.field(default_factory=dict)
    publication_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    reclaim_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

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

    def __init__(self, cohort: CohortCore) -> None:
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
