"""The composition root: :meth:`Cohort.open` is the only place that builds the publisher, the
reclaimer and the reconciler, all three over the one cohort it opens. What they share is
:mod:`relax_glue.cohort_core`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lora_contract import protocol
from relax_glue.actor import AsyncRegistryClient
from relax_glue.cohort_core import CohortCore
from relax_glue.engine_client import EngineAPI
from relax_glue.publisher import Publisher
from relax_glue.reclaimer import Reclaimer, ReclaimResult
from relax_glue.reconciler import Reconciler, RestoreResult

if TYPE_CHECKING:
    from relax_glue.snapshot_store import SnapshotStore


@dataclasses.dataclass
class Cohort(CohortCore):
    """A :class:`~relax_glue.cohort_core.CohortCore` with its three drivers. Built with
    :meth:`open`."""

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
        client = AsyncRegistryClient.of(
            registry, retries=registry_retries, retry_delay_s=registry_retry_delay_s
        )
        cohort = cls(client, dict(engines), store)
        cohort.reclaimer = Reclaimer(
            cohort, wait_s=reclaim_wait_s, poll_s=reclaim_poll_s, deadline_s=reclaim_deadline_s
        )
        cohort.reconciler = Reconciler(cohort) if store is not None else None
        cohort.publisher = Publisher(
            cohort, cohort.reclaimer, cohort.reconciler, prefix=prefix, verify_snapshot=verify_snapshot
        )
        return cohort

    async def reclaim_ready(self, *, deadline_s: float | None = None) -> tuple[ReclaimResult, ...]:
        """See :meth:`relax_glue.reclaimer.Reclaimer.reclaim_ready` (which also drops the stored
        snapshots of the versions that became RECLAIMED)."""
        return await self.reclaimer.reclaim_ready(deadline_s=deadline_s)

    async def reconcile(self, engines: Sequence[str] | None = None) -> tuple[RestoreResult, ...]:
        """See :meth:`relax_glue.publisher.Publisher.reconcile`."""
        return await self.publisher.reconcile(engines)


def open_publisher(registry: Any, engines: Mapping[str, EngineAPI], **options: Any) -> Publisher:
    """The publisher of a cohort opened with :meth:`Cohort.open` (same arguments): one line for
    tools and tests."""
    return Cohort.open(registry, engines, **options).publisher
