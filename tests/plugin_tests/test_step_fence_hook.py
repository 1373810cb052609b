"""The step fence in the scheduler (``step_fence.complete_the_step_before_unload``), against a
scheduler double that has the 0.5.23 shape the reader uses (``enable_overlap``,
``result_queue`` of (batch, result), ``last_batch``, ``reqs[].lora_id``, ``copy_done``), and
doubles that lack one of them (the reader fails closed). The real scheduler runs the hook on
every unload of the engine tests (tests/plugin_tests/test_step_fence_engines.py reads a live one;
its log line is asserted in gpu_tests/test_rfc73_online_run.py); only a GPU with the overlap
scheduler makes it wait."""

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
    from sglang_ext import lora_registry_patch as upstream

    # the LoRAManager the prepared load reads (sglang_ext.prepared_load) and its memory pool (the
    # slot zeroing's), checked at start too
    pool = SimpleNamespace(**dict.fromkeys(upstream.POOL_ATTRIBUTES))
    manager = SimpleNamespace(**{**dict.fromkeys(upstream.LORA_MANAGER_ATTRIBUTES), "memory_pool": pool})
    return SimpleNamespace(
        enable_overlap=overlap,
        result_queue=deque(queue),
        last_batch=last,
        tp_group=SimpleNamespace(world_size=1, rank_in_group=0),  # one TP rank: nothing is gathered
        tp_cpu_group=None,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)),
    )


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


# The reader fails closed: a stand-in that lacks what it reads refuses the unload, naming it
# (an attribute SGLang renamed must never read as "no launched step").


def test_a_scheduler_without_its_result_queue_refuses_the_unload() -> None:
    calls: list[str] = []
    one_rank = SimpleNamespace(world_size=1)
    renamed = SimpleNamespace(enable_overlap=False, last_batch=None, tp_group=one_rank)  # no result_queue
    out = complete_the_step_before_unload(unload(calls), renamed, REQ)
    assert not out.success and "Scheduler.result_queue is missing" in out.error_message
    assert calls == []


def test_a_launched_batch_without_reqs_refuses_the_unload() -> None:
    calls: list[str] = []
    no_reqs = scheduler(overlap=False, last=SimpleNamespace())
    out = complete_the_step_before_unload(unload(calls), no_reqs, REQ)
    assert not out.success and "ScheduleBatch.reqs is missing" in out.error_message
    assert calls == []


def test_a_request_without_lora_id_refuses_the_unload() -> None:
    calls: list[str] = []
    last = SimpleNamespace(reqs=[SimpleNamespace(rid="r1")])
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=False, last=last), REQ)
    assert not out.success and "Req.lora_id is missing" in out.error_message
    assert calls == []


def test_a_queued_result_without_copy_done_is_named() -> None:
    calls: list[str] = []
    queued = (batch("L1"), SimpleNamespace())
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=True, queue=[queued]), REQ)
    assert not out.success and "GenerationBatchResult.copy_done is missing" in out.error_message
    assert calls == []


def test_a_queued_step_counts_whatever_the_overlap_flag_says() -> None:
    """Only the overlap loops fill result_queue in 0.5.23; a queued step is still a launched step
    if another loop ever fills it (the flag decides nothing about what the queue holds)."""
    calls: list[str] = []
    running = (batch("L1"), SimpleNamespace(copy_done=Event(calls, done=False)))
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=False, queue=[running]), REQ)
    assert out.success and calls == ["synchronize", "unload"]


def test_a_request_without_an_adapter_reads_no_slot() -> None:
    calls: list[str] = []
    base_only = SimpleNamespace(reqs=[SimpleNamespace(lora_id=None)])
    running = (base_only, SimpleNamespace(copy_done=Event(calls, done=False)))
    out = complete_the_step_before_unload(unload(calls), scheduler(overlap=True, queue=[running]), REQ)
    assert out.success and calls == ["unload"]


# The start check: at the end of Scheduler.__init__, before the scheduler reports ready.


def refusals(monkeypatch, *, unapplied: list[str] = ()) -> list[str]:
    from sglang_ext import lora_registry_patch as upstream
    from sglang_ext import step_fence

    refused: list[str] = []
    monkeypatch.setattr(step_fence, "refuse_to_start", refused.append)  # the real one ends the process
    monkeypatch.setattr(upstream, "unapplied_hooks", lambda targets: [t for t in targets if t in unapplied])
    return refused


def test_a_live_scheduler_missing_what_the_fence_reads_refuses_to_start(monkeypatch) -> None:
    from sglang_ext.step_fence import refuse_a_scheduler_the_fence_cannot_read

    refused = refusals(monkeypatch)
    live = scheduler(overlap=False)
    del live.result_queue
    refuse_a_scheduler_the_fence_cannot_read(None, live)
    assert len(refused) == 1 and "Scheduler.result_queue is missing" in refused[0], refused
    refused.clear()
    live = scheduler(overlap=False)
    del live.tp_worker.model_runner.lora_manager.loras
    refuse_a_scheduler_the_fence_cannot_read(None, live)
    assert len(refused) == 1 and "LoRAManager.loras is missing" in refused[0], refused
    refused.clear()
    refuse_a_scheduler_the_fence_cannot_read(None, scheduler(overlap=False))
    assert refused == []


def test_a_fence_hook_that_was_not_applied_refuses_to_start(monkeypatch) -> None:
    from sglang_ext import lora_registry_patch as upstream
    from sglang_ext.step_fence import refuse_a_scheduler_the_fence_cannot_read

    refused = refusals(monkeypatch, unapplied=[upstream.SCHEDULER_UNLOAD_ADAPTER])
    refuse_a_scheduler_the_fence_cannot_read(None, scheduler(overlap=False))
    assert len(refused) == 1 and f"hook not applied to {upstream.SCHEDULER_UNLOAD_ADAPTER}" in refused[0]


def test_the_scheduler_process_registers_the_start_check_and_the_fence(monkeypatch) -> None:
    from sglang_ext import hooks, prepared_load, served_version, slot_zeroing, step_fence
    from sglang_ext import lora_registry_patch as upstream

    registered: list[tuple[str, Any, str]] = []
    monkeypatch.setattr(upstream, "register_hook", lambda t, h, k: registered.append((t, h, k)))
    hooks.register_all("scheduler")
    assert registered == [
        (upstream.SCHEDULER_INIT, step_fence.refuse_a_scheduler_the_fence_cannot_read, "AFTER"),
        (upstream.SCHEDULER_UNLOAD_ADAPTER, step_fence.complete_the_step_before_unload, "AROUND"),
        (upstream.SCHEDULER_LOAD_ADAPTER, prepared_load.prepare_then_install, "AROUND"),
        (upstream.LORA_MANAGER_LOAD, prepared_load.load_installing_what_was_prepared, "REPLACE"),
        (upstream.LORA_MANAGER_UNLOAD, prepared_load.unload_releasing_off_the_loop, "REPLACE"),
        (upstream.POOL_INIT_BUFFERS, slot_zeroing.track_slots_from_a_zeroed_pool, "AFTER"),
        (upstream.POOL_LOAD_TO_BUFFER, slot_zeroing.record_the_rank_about_to_be_written, "BEFORE"),
        (upstream.POOL_CLEAR_SLOT, slot_zeroing.zero_only_what_was_written, "AROUND"),
        (upstream.LORA_BACKEND_FACTORY, served_version.backend_that_reports_its_rows, "AFTER"),
        (upstream.LORA_MANAGER_PREPARE_BATCH, served_version.read_the_rows_each_batch_runs, "AROUND"),
        (upstream.SCHEDULER_RUN_BATCH, served_version.mark_each_request_with_what_ran, "AROUND"),
        (
            upstream.SCHEDULER_OUTPUT_STREAMER_CLASS,
            served_version.streamer_class_that_attests_tokens,
            "REPLACE",
        ),
    ]
    assert tuple(t for t, _, _ in registered) == upstream.SCHEDULER_PROCESS_TARGETS
