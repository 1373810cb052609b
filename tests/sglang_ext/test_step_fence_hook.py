"""The step fence in the scheduler (``step_fence.complete_the_step_before_unload``), against a
scheduler double that has the 0.5.23 shape the reader uses (``enable_overlap``,
``result_queue`` of (batch, result), ``last_batch``, ``reqs[].lora_id``, ``copy_done``). The
real scheduler runs the hook on every unload of the engine tests (its log line is asserted in
gpu_tests/test_rfc73_online_run.py); only a GPU with the overlap scheduler makes it wait."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from sglang_ext.step_fence import complete_the_step_before_unload


class Event:
    """A device event: ``query()`` says whether the step's work completed."""

    def __init__(self, calls: list[str], done: bool) -> None:
        self.calls, self.done = calls, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        self.done = True


def batch(*lora_ids: str) -> Any:
    return SimpleNamespace(reqs=[SimpleNamespace(lora_id=i) for i in lora_ids])


def scheduler(*, overlap: bool, queue: list[tuple[Any, Any]] = (), last: Any = None) -> Any:
    return SimpleNamespace(enable_overlap=overlap, result_queue=deque(queue), last_batch=last)


def unload(calls: list[str]):
    def original(self: Any, recv_req: Any) -> Any:
        calls.append("unload")
        return SimpleNamespace(success=True)

    return original


REQ = SimpleNamespace(lora_name="lv-x", lora_id="L1")


def test_without_the_overlap_scheduler_the_unload_goes_through_at_once() -> None:
    calls: list[str] = []
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=False, last=batch("L1")), REQ)
    assert out.success and calls == ["unload"]


def test_a_launched_step_on_the_adapter_completes_before_the_unload() -> None:
    calls: list[str] = []
    running = (batch("L1", "L2"), SimpleNamespace(copy_done=Event(calls, done=False)))
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=True, queue=[running]), REQ)
    assert out.success and calls == ["synchronize", "unload"]


def test_a_launched_step_on_other_adapters_is_not_waited_for() -> None:
    calls: list[str] = []
    running = (batch("L2"), SimpleNamespace(copy_done=Event(calls, done=False)))
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=True, queue=[running]), REQ)
    assert out.success and calls == ["unload"]


def test_an_unknown_completion_refuses_and_unloads_nothing() -> None:
    calls: list[str] = []
    unknown = (batch("L1"), SimpleNamespace())  # no device event: its completion cannot be known
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=True, queue=[unknown]), REQ)
    assert not out.success and "step fence" in out.error_message
    assert calls == []
