"""The step fence (pure): an adapter's slot may be freed only once every launched batch that
reads it is known complete; what it would add to ``may_unload_now`` under the overlap scheduler."""

from __future__ import annotations

from sglang_ext.version_table import LaunchedBatch, step_fence_passed


def batch(*ids: str, done: bool | None) -> LaunchedBatch:
    return LaunchedBatch(frozenset(ids), done)


def test_no_launched_batch_passes() -> None:
    assert step_fence_passed("L1", [])


def test_a_running_batch_with_a_row_on_the_adapter_holds_the_fence() -> None:
    assert not step_fence_passed("L1", [batch("L1", "L2", done=False)])


def test_a_completed_batch_or_one_without_the_adapter_passes() -> None:
    assert step_fence_passed("L1", [batch("L1", done=True), batch("L2", done=False)])


def test_an_unknown_completion_never_passes() -> None:
    assert not step_fence_passed("L1", [batch("L1", done=None)])
    assert step_fence_passed("L1", [batch("L2", done=None)])  # it reads another slot


def test_every_launched_batch_counts_not_just_the_last() -> None:
    assert not step_fence_passed("L1", [batch("L1", done=True), batch("L1", done=False)])
