"""Rank 0's publication under capacity backpressure: the TRL adapter (relax_glue/trl/publication.py)
over the step publisher, with a fake publisher and the real time: a held capacity is reclaimed,
waited for and then a counted skip after the reclaim wait and no longer (a settling before the
first attempt counts as waited); a slot freed by a reclaim is used by the retry; a close of one
of rank 0's episodes wakes the wait; the first version is never skipped: it waits the forced
bound, then fails typed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from _publish_results import result

from lora_contract.errors import ErrorCode
from relax_glue.backpressure import StalenessPolicy
from relax_glue.publisher import PublishOutcome, PublishResult
from relax_glue.registry_types import VersionState
from relax_glue.trl import VersionsConfig
from relax_glue.trl.outcomes import OutcomeKind, outcome_of
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo


class FakePublisher:
    """``publish`` answers each of ``results`` in turn (the last one forever); every slot stays
    held (the registry's status) until reclaim number ``free_after`` unloads a version."""

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
        if self.reclaims != self.free_after:
            return ()
        key = SimpleNamespace(version_id="step3")
        return (SimpleNamespace(done=True, lora_name="relax@e-step3-abc", version_key=key, engines={}),)

    async def publish(self, snapshot: Any, vid: str) -> PublishResult:
        self.published += 1
        return self.results[min(self.published, len(self.results)) - 1]


CAPACITY = result(PublishOutcome.REFUSED, ErrorCode.CAPACITY_ERROR)
PUBLISHED = result(PublishOutcome.PUBLISHED, state=VersionState.PUBLISHED)


def publishing(pub: FakePublisher, last: int, reclaim_wait_s: float = 0.2, forced_wait_s: float = 60.0):
    policy = StalenessPolicy(max_staleness=2, reclaim_wait_s=reclaim_wait_s, forced_wait_s=forced_wait_s)
    v = StepPublication(None, RankInfo(), VersionsConfig(policy=policy), pub)  # type: ignore[arg-type]
    assert v.steps is not None
    v.steps.last_published = last
    return v, v.steps


async def test_capacity_held_is_reclaimed_waited_for_then_a_counted_skip_after_the_reclaim_wait() -> None:
    pub = FakePublisher([CAPACITY])
    v, steps = publishing(pub, last=4, reclaim_wait_s=0.3)
    o = await v.publish_step(None, 5, required=False)
    assert (o.kind, o.code) == (OutcomeKind.SKIPPED, "CAPACITY_ERROR")
    assert o.capacity_refusals == pub.published >= 2 and pub.reclaims >= 2  # reclaimed, retried
    # the whole reclaim wait, no longer: a second wait would make it 0.6 s (the upper bound leaves
    # a late wake-up of a loaded machine its room)
    assert 0.25 <= o.seconds < 0.55, o.seconds
    assert steps.last_published == 4 and outcome_of(steps.publications[-1]) == o


async def test_the_settling_before_the_first_attempt_counts_as_waited() -> None:
    """The wait is the step's: a resolve of what an earlier attempt left pending that took 0.3 s
    leaves 0.2 s of the 0.5 s reclaim wait, not another 0.5 s."""
    pub = FakePublisher([CAPACITY])

    async def slow_resolve(snapshot: Any = None) -> None:
        await asyncio.sleep(0.3)

    pub.resolve = slow_resolve  # type: ignore[method-assign]
    v, _ = publishing(pub, last=4, reclaim_wait_s=0.5)
    o = await v.publish_step(None, 5, required=False)
    assert o.kind is OutcomeKind.SKIPPED and 0.45 <= o.seconds < 0.75, o.seconds  # not 0.3 + 0.5


async def test_a_slot_freed_by_a_reclaim_is_used_by_the_retry() -> None:
    pub = FakePublisher([CAPACITY, PUBLISHED], free_after=2)
    v, steps = publishing(pub, last=4)
    o = await v.publish_step(None, 5, required=False)
    assert (o.kind, o.capacity_refusals, o.attempts) == (OutcomeKind.PUBLISHED, 1, 2)
    assert steps.last_published == 5


async def test_a_close_of_one_of_rank_0s_episodes_wakes_the_wait_for_a_slot() -> None:
    # the slot frees at the third reclaim: the one the episode's close triggers, long before the
    # 5 s reclaim wait runs out
    pub = FakePublisher([CAPACITY, PUBLISHED], free_after=3)
    v, steps = publishing(pub, last=4, reclaim_wait_s=5.0)
    asyncio.get_running_loop().call_later(0.2, v.episode_closed)
    o = await v.publish_step(None, 5, required=False)
    assert (o.kind, o.attempts) == (OutcomeKind.PUBLISHED, 2) and o.seconds < 1.5
    assert [r.trigger for r in steps.reclaims] == ["episode closed"]


async def test_the_first_version_waits_the_forced_bound_and_then_fails_typed() -> None:
    pub = FakePublisher([CAPACITY])
    v, steps = publishing(pub, last=-1, forced_wait_s=0.5)
    o = await v.publish_step(None, 0, required=True)
    # never skipped (nothing to roll out on without it): the forced bound, then a typed failure
    assert (o.kind, o.code) == (OutcomeKind.FAILED, "CAPACITY_ERROR")
    assert o.attempts >= 2 and 0.45 <= o.seconds < 0.9, o.seconds  # the bound once, not twice
    assert steps.last_published == -1
