"""The capacity backpressure every per-step publisher follows (relax_glue/backpressure.py): which
refusal it answers, the rule with a required first version, and the one loop that applies it
(driven here by scripted publication results and a fake clock; the TRL and showcase engine tests
run it against real engines)."""

from __future__ import annotations

import pytest
from _publish_results import result

from lora_contract.errors import ErrorCode
from relax_glue.backpressure import (
    Decision,
    PublishDecision,
    StalenessPolicy,
    is_capacity_refusal,
    publish_with_backpressure,
)
from relax_glue.publisher import PublishOutcome, PublishResult
from relax_glue.registry_types import VersionState

FULL = result(PublishOutcome.REFUSED, ErrorCode.CAPACITY_ERROR)
PUBLISHED = result(PublishOutcome.PUBLISHED, state=VersionState.PUBLISHED)
BROKEN = result(PublishOutcome.FAILED_CLEAN, ErrorCode.CHECKSUM_MISMATCH, VersionState.FAILED_CLEAN)


def test_only_a_capacity_refusal_is_backpressure() -> None:
    assert is_capacity_refusal(FULL)
    assert not is_capacity_refusal(result(PublishOutcome.REFUSED, ErrorCode.CAPACITY_MISMATCH))
    assert not is_capacity_refusal(PUBLISHED)
    assert not is_capacity_refusal(BROKEN)


@pytest.mark.parametrize(
    ("waited", "last", "required", "want"),
    [
        (0.2, 4, False, PublishDecision.RETRY),  # within the reclaim wait: reclaim, try again
        (1.5, 4, False, PublishDecision.SKIP),  # engines one step behind: skip is allowed
        (1.5, 3, False, PublishDecision.RETRY),  # two behind: past the lag, a forced wait
        (61.0, 3, False, PublishDecision.FAIL),  # the forced wait ran out
        (1.5, -1, True, PublishDecision.RETRY),  # the first version is never skipped
        (61.0, -1, True, PublishDecision.FAIL),
    ],
)
def test_the_capacity_rule_never_skips_a_required_version(
    waited: float, last: int, required: bool, want: PublishDecision
) -> None:
    policy = StalenessPolicy(max_staleness=2, reclaim_wait_s=1.0, forced_wait_s=60.0)
    step = last + 1 if required else 5
    d = policy.on_capacity_error(step=step, last_published=last, waited_s=waited, required=required)
    assert d.action is want
    assert (d.wait_s > 0) == (want is PublishDecision.RETRY)


class Script:
    """Publication results in order; a clock that only the waits move."""

    def __init__(self, *results: PublishResult) -> None:
        self.results = list(results)
        self.now = 0.0
        self.waits: list[float] = []

    async def attempt(self) -> PublishResult:
        return self.results.pop(0)

    async def wait_for_slot(self, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        self.now += timeout_s

    def clock(self) -> float:
        return self.now


def decide_for(step: int, last: int, required: bool = False):
    policy = StalenessPolicy(max_staleness=2, reclaim_wait_s=1.0, forced_wait_s=60.0)

    def decide(waited_s: float) -> Decision:
        return policy.on_capacity_error(step=step, last_published=last, waited_s=waited_s, required=required)

    return decide


async def test_a_full_registry_is_waited_out_then_published() -> None:
    s = Script(FULL, FULL, PUBLISHED)
    run = await publish_with_backpressure(s.attempt, decide_for(5, 3), s.wait_for_slot, s.clock)
    assert run.result is PUBLISHED and run.gave_up is None
    assert (run.attempts, run.capacity_refusals) == (3, 2)
    # the reclaim wait, then (the engines 2 steps behind: no skip) the rest of the forced bound
    assert s.waits == [1.0, 59.0] and run.last_attempt_s == 60.0


async def test_a_step_is_skipped_after_the_reclaim_wait_while_the_engines_are_close() -> None:
    s = Script(FULL, FULL)
    run = await publish_with_backpressure(s.attempt, decide_for(5, 4), s.wait_for_slot, s.clock)
    assert run.gave_up is PublishDecision.SKIP and run.result is FULL
    assert (run.attempts, run.capacity_refusals, s.waits) == (2, 2, [1.0])


async def test_a_required_version_waits_within_the_forced_bound_then_fails() -> None:
    s = Script(FULL, FULL, FULL)
    run = await publish_with_backpressure(s.attempt, decide_for(0, -1, True), s.wait_for_slot, s.clock)
    assert run.gave_up is PublishDecision.FAIL and s.waits == [1.0, 59.0] and run.attempts == 3


async def test_any_other_failure_is_returned_at_once_never_retried() -> None:
    s = Script(BROKEN, PUBLISHED)
    run = await publish_with_backpressure(s.attempt, decide_for(5, 4), s.wait_for_slot, s.clock)
    assert run.result is BROKEN and run.gave_up is None
    assert (run.attempts, run.capacity_refusals, s.waits) == (1, 0, [])


async def test_the_wait_counts_from_the_steps_start_when_given() -> None:
    """A caller that settled and reclaimed before its first attempt (the TRL integration) counts
    that time as waited: 1.5 s already gone, the reclaim wait is over and the step is skipped."""
    s = Script(FULL)
    s.now = 1.5
    run = await publish_with_backpressure(s.attempt, decide_for(5, 4), s.wait_for_slot, s.clock, started=0.0)
    assert run.gave_up is PublishDecision.SKIP and s.waits == [] and run.last_attempt_s == 1.5
