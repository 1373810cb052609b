"""The step publisher (relax_glue/step_publisher.py) over the real publisher, the real registry
(capacity 2, checked after every call) and fake engines: a publication refused for capacity is
retried when a reclaim frees a slot (woken by the event, not by polling), a step is skipped
within the lag bound, a required one waits within the forced bound and then fails, and the
records say what happened. Time is a fake clock that each reclaim run advances."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import pytest
from _fake_engine import make_snapshot
from _in_process_world import FAST_RECLAIM, InProcessWorld
from _rg_helpers import EPOCH, new_registry, sk

from relax_glue.backpressure import StalenessPolicy
from relax_glue.step_publisher import FAILED, PUBLISHED, RAISED, SKIPPED, StepPublisher

SNAP = {name: make_snapshot(seed=i) for i, name in enumerate("ABCD")}
CAPACITY_ERROR = "CAPACITY_ERROR"


def name_of(vid: str) -> str:
    return SNAP[vid].lora_name("relax_policy_lora", EPOCH, vid)


class Counted:
    """The registry, with its status reads counted (every other call passes through)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != "status":
            return attr

        def status(*args: Any, **kwargs: Any) -> Any:
            self.calls["status"] += 1
            return attr(*args, **kwargs)

        return status


class Steps(InProcessWorld):
    """A cohort with versions A (step 0) and B (step 1) published and A held by session S0:
    both slots are in use, so the next publication is refused for capacity. ``reg`` counts the
    registry's status reads."""

    def __init__(self, policy: StalenessPolicy, tick: float) -> None:
        super().__init__(registry=Counted(new_registry(capacity=2)), publisher_options=FAST_RECLAIM)
        self.now = 0.0
        pub = self.pub
        self.reclaim_runs = 0
        reclaim_ready = pub.reclaim_ready

        async def counted_reclaim(**kwargs: Any) -> Any:
            # the real reclaim; each run takes ``tick`` on the fake clock
            self.reclaim_runs += 1
            self.now += tick
            return await reclaim_ready(**kwargs)

        pub.reclaim_ready = counted_reclaim  # type: ignore[method-assign]
        self.sp = StepPublisher(pub, policy, clock=lambda: self.now)

    async def fill(self) -> None:
        assert (await self.sp.publish_step(SNAP["A"], 0, "A", required=True)).published
        self.reg.bind_first(sk("S0"))
        assert (await self.sp.publish_step(SNAP["B"], 1, "B")).published
        assert self.reg.status().slots_used == 2


async def waiting_for_slot(steps: Steps, runs_before: int) -> None:
    """Until the publication waits for a slot: it ran its reclaim before publishing and the
    one of the capacity wait."""
    while steps.reclaim_runs < runs_before + 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)


@pytest.mark.parametrize("background", [False, True], ids=["waiter_reclaims", "background_reclaims"])
async def test_a_reclaim_that_frees_a_slot_wakes_the_waiting_publication(background: bool) -> None:
    # a stuck clock: the policy's wait (30 s) never runs out; only the event can end it
    steps = Steps(StalenessPolicy(max_staleness=2, reclaim_wait_s=30.0), tick=0.0)
    await steps.fill()
    if background:
        steps.sp.start()
    task = asyncio.create_task(steps.sp.publish_step(SNAP["C"], 2, "C"))
    await waiting_for_slot(steps, steps.reclaim_runs)
    runs, reads = steps.reclaim_runs, steps.reg.calls["status"]
    await asyncio.sleep(0.3)  # a poll would read the registry and reclaim in here
    assert (steps.reclaim_runs, steps.reg.calls["status"]) == (runs, reads)

    t = time.monotonic()
    steps.reg.close_and_release(sk("S0"))
    steps.sp.episode_closed()
    rec = await asyncio.wait_for(task, 5.0)
    assert time.monotonic() - t < 2.0
    assert rec.outcome == PUBLISHED and rec.lora_name == name_of("C")
    assert (rec.attempts, rec.refusals, rec.capacity_refusals) == (2, (CAPACITY_ERROR,), 1)
    # one reclaim before the publication, one at the capacity wait, one for the close
    assert steps.reclaim_runs == runs + 1
    freed = [r for r in steps.sp.reclaims if r.done]
    assert [(r.step, r.version_id, r.lora_name, r.trigger) for r in freed] == [
        (0, "A", name_of("A"), "episode closed")
    ]
    assert set(freed[0].engines.values()) == {"UNLOADED"}
    assert steps.reg.status().default.version_id == "C"
    await steps.sp.close()
    steps.assert_no_stop_the_world()


async def test_a_step_is_skipped_after_the_reclaim_wait_while_the_engines_are_within_the_lag() -> None:
    steps = Steps(StalenessPolicy(max_staleness=2, reclaim_wait_s=0.005), tick=0.01)
    await steps.fill()
    rec = await steps.sp.publish_step(SNAP["C"], 2, "C")
    assert rec.outcome == SKIPPED and rec.lora_name is None and rec.code == CAPACITY_ERROR
    assert (rec.attempts, rec.refusals, rec.lag_after) == (1, (CAPACITY_ERROR,), 1)
    assert steps.sp.last_published == 1
    assert steps.reg.status().default.version_id == "B"


async def test_a_required_publication_waits_within_the_forced_bound_then_fails() -> None:
    policy = StalenessPolicy(max_staleness=2, reclaim_wait_s=0.005, forced_wait_s=0.03)
    steps = Steps(policy, tick=0.01)
    await steps.fill()
    # within the lag, and still not skipped: required
    rec = await steps.sp.publish_step(SNAP["C"], 2, "C", required=True)
    assert rec.outcome == FAILED and rec.code == CAPACITY_ERROR
    # reclaims at 0.01 (before), 0.02 and 0.03 (two waits); the third refusal is past the bound
    assert (rec.attempts, rec.refusals) == (3, (CAPACITY_ERROR,) * 3)
    runs_for_fill = 2  # one reclaim before each of A and B
    assert steps.reclaim_runs == runs_for_fill + 3 and steps.sp.reclaims == []  # A stays held
    assert steps.reg.status().default.version_id == "B"


async def test_the_records_say_every_publication_in_order() -> None:
    steps = Steps(StalenessPolicy(max_staleness=2, reclaim_wait_s=0.005), tick=0.01)
    await steps.fill()
    await steps.sp.publish_step(SNAP["C"], 2, "C")  # skipped
    steps.reg.close_and_release(sk("S0"))
    rec = await steps.sp.publish_step(SNAP["D"], 3, "D")  # the reclaim before it frees A
    assert rec.outcome == PUBLISHED and (rec.attempts, rec.refusals, rec.lag_after) == (1, (), 0)
    assert [(p.step, p.version_id, p.outcome) for p in steps.sp.publications] == [
        (0, "A", PUBLISHED),
        (1, "B", PUBLISHED),
        (2, "C", SKIPPED),
        (3, "D", PUBLISHED),
    ]
    assert steps.sp.versions == {name_of(v): s for v, s in (("A", 0), ("B", 1), ("D", 3))}
    assert [(r.step, r.trigger, r.done) for r in steps.sp.reclaims] == [(0, "before publish", True)]
    assert all(p.t_start <= p.t_end for p in steps.sp.publications)


async def test_a_publisher_that_raises_is_recorded_and_raised() -> None:
    steps = Steps(StalenessPolicy(), tick=0.0)

    async def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("registry unreachable")

    steps.sp.publisher.publish = unreachable  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await steps.sp.publish_step(SNAP["A"], 0, "A", required=True)
    (rec,) = steps.sp.publications
    assert rec.outcome == RAISED and "registry unreachable" in rec.detail and rec.lora_name is None
