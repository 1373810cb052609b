"""Rank 0's publication under capacity backpressure (relax_glue/trl/publication.py), with a fake
publisher: a held capacity is reclaimed, waited for and then a counted skip; a slot freed by a
reclaim is used by the retry; the first version is never skipped: it waits within the forced
bound, then fails typed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from _publish_results import result

from lora_contract.errors import ErrorCode
from relax_glue.backpressure import StalenessPolicy
from relax_glue.publisher import PublishOutcome, PublishResult
from relax_glue.registry_types import VersionState
from relax_glue.trl import VersionsConfig
from relax_glue.trl.outcomes import OutcomeKind
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo


class FakePublisher:
    """``publish`` answers each of ``results`` in turn (the last one forever); every slot stays
    held (the registry's status) unless ``free_after`` reclaims happened."""

    def __init__(self, results: list[PublishResult], free_after: int | None = None) -> None:
        self.results, self.free_after = results, free_after
        self.published = self.reclaims = 0
        self.registry = SimpleNamespace(status=self._status)

    async def _status(self) -> SimpleNamespace:
        free = self.free_after is not None and self.reclaims >= self.free_after
        return SimpleNamespace(slots_used=1 if free else 2, capacity=2)

    async def resolve(self, snapshot: Any = None) -> None:
        return None

    async def reclaim_ready(self) -> tuple:
        self.reclaims += 1
        return ()

    async def publish(self, snapshot: Any, vid: str) -> PublishResult:
        self.published += 1
        return self.results[min(self.published, len(self.results)) - 1]


CAPACITY = result(PublishOutcome.REFUSED, ErrorCode.CAPACITY_ERROR)
PUBLISHED = result(PublishOutcome.PUBLISHED, state=VersionState.PUBLISHED)


def publishing(pub: FakePublisher, last: int, forced_wait_s: float = 60.0) -> StepPublication:
    policy = StalenessPolicy(max_staleness=2, reclaim_wait_s=0.2, forced_wait_s=forced_wait_s)
    v = StepPublication(None, RankInfo(), VersionsConfig(policy=policy), pub)  # type: ignore[arg-type]
    v.last_published = last
    return v


async def test_capacity_held_is_reclaimed_waited_for_then_a_counted_skip() -> None:
    pub = FakePublisher([CAPACITY])
    v = publishing(pub, last=4)
    o = await v.publish_step(None, 5, required=False)
    assert (o.kind, o.code) == (OutcomeKind.SKIPPED, "CAPACITY_ERROR")
    assert o.capacity_refusals == pub.published >= 2 and pub.reclaims >= 2  # reclaimed, retried
    assert v.last_published == 4 and v.publications[-1].outcome == o


async def test_a_slot_freed_by_a_reclaim_is_used_by_the_retry() -> None:
    pub = FakePublisher([CAPACITY, PUBLISHED], free_after=2)
    v = publishing(pub, last=4)
    o = await v.publish_step(None, 5, required=False)
    assert (o.kind, o.capacity_refusals, o.attempts) == (OutcomeKind.PUBLISHED, 1, 2)
    assert v.last_published == 5


async def test_the_first_version_waits_within_the_forced_bound_and_then_fails_typed() -> None:
    pub = FakePublisher([CAPACITY])
    v = publishing(pub, last=-1, forced_wait_s=0.5)
    o = await v.publish_step(None, 0, required=True)
    assert (o.kind, o.code) == (OutcomeKind.FAILED, "CAPACITY_ERROR")
    assert o.attempts >= 2  # it waited and tried again: the first version is never skipped
