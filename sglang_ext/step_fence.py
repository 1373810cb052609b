"""The step fence, in the scheduler: an adapter's slot is freed only once every launched step
that reads it has completed (the vLLM seed's lesson: free after the step that used the resource,
never while it may still run).

Why the registry's refs and SGLang's in-flight count are not enough under the overlap scheduler
(GPU only; gpu_tests/README.md has the 0.5.23 evidence): the scheduler launches step N+1 before
it processes step N, so a request that finished in N (its count already released, its unload
already sent) may still have a row in N+1, which reads the adapter's slot on the device while
the unload would zero it. So the unload first waits for those steps' device events, then
unloads; a launched step whose completion is unknown refuses the unload (typed by the caller,
retried later): nothing is freed on a guess. Without the overlap scheduler (every CPU engine)
the last batch is processed before the unload is ingested, and the fence passes at once.

The fence fails closed: every scheduler attribute it reads is named in ``lora_registry_patch``
and read as it is. The class-level ones are checked at plugin load in the main process
(``surface_problems``), the live scheduler's at the end of ``Scheduler.__init__``
(:func:`refuse_a_scheduler_the_fence_cannot_read`): a missing one refuses to start, never reads
as "nothing launched".

The plugin still refuses the overlap scheduler outside the GPU proof test
(``setup_checks.OVERLAP_PROOF_ENV``); this hook is what that test proves.
"""

from __future__ import annotations

from typing import Any

from sglang_ext import lora_registry_patch as upstream
from sglang_ext import rank_agreement as ranks
from sglang_ext.plugin_log import log_line, refuse_to_start
from sglang_ext.version_table import LaunchedBatch, step_fence_passed

LOG_MARKER = "step fence"  # one scheduler log line per unload (lora_versions_dev.engine_log reads it)


def fence_view(steps: list[upstream.LaunchedStep]) -> list[LaunchedBatch]:
    """The steps as the pure predicate sees them (an event is asked, never waited for)."""
    out = []
    for step in steps:
        c = step.completion
        done = True if c is True else (bool(c.query()) if hasattr(c, "query") else None)
        out.append(LaunchedBatch(step.lora_ids, done))
    return out


def complete_the_step_before_unload(
    original: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND Scheduler.unload_lora_adapter (0.5.23; the scheduler thread, between steps): wait
    for the launched steps that read ``recv_req.lora_id`` to complete, then unload; refuse
    (changing nothing) when a step's completion cannot be known, or when what the fence reads is
    missing (never read as "no launched step"). One log line per unload."""

    try:
        lora_id = upstream.unload_lora_id(recv_req)
        steps = upstream.launched_steps(self)
        overlap = upstream.overlap_scheduler_on(self)
    except upstream.SchedulerUnreadable as exc:
        return ranks.agree(self, refuse_unreadable(exc, recv_req))  # every rank agrees once
    waited = 0
    if lora_id is not None and not step_fence_passed(lora_id, fence_view(steps)):
        for step in steps:
            if lora_id in step.lora_ids and hasattr(step.completion, "synchronize"):
                step.completion.synchronize()  # one step's device work: the scheduler waits it out
                waited += 1
    passed = lora_id is None or step_fence_passed(lora_id, fence_view(steps))
    log_line(
        f"{LOG_MARKER} lora_id={lora_id} tp_rank={upstream.tp_rank(self)} overlap={overlap} "
        f"launched={len(steps)} on_adapter={sum(1 for s in steps if lora_id in s.lora_ids)} "
        f"waited={waited} fence_passed={passed}"
    )
    fence = (
        upstream.lora_update_output(True)
        if passed
        else upstream.unload_refused(
            f"step fence: a launched step on adapter {lora_id} has no known completion; nothing unloaded"
        )
    )
    # every rank unloads or none does: the fence must have passed on each (check before mutate)
    fence = ranks.agree(self, fence)
    if not fence.success:
        return fence
    return ranks.agree(self, original(self, recv_req, *args, **kwargs))


def refuse_unreadable(exc: upstream.SchedulerUnreadable, recv_req: Any) -> Any:
    """After the start check (refuse_a_scheduler_the_fence_cannot_read) this is a step object or
    request that changed shape at run time: refused like an unknown completion."""

    shown_id = getattr(recv_req, "lora_id", "?")  # for the log line only (already refused)
    log_line(f"{LOG_MARKER} lora_id={shown_id} unreadable={exc.attribute} fence_passed=False")
    return upstream.unload_refused(f"step fence: {exc}, the launched steps cannot be read; nothing unloaded")


def scheduler_start_problems(scheduler: Any) -> list[str]:
    """Why the fence could not run on this scheduler: its hooks not in place (HookRegistry logs and
    skips a target it cannot patch), or a live attribute it reads missing."""
    unapplied = upstream.unapplied_hooks(upstream.SCHEDULER_PROCESS_TARGETS)
    return [f"hook not applied to {t}" for t in unapplied] + upstream.scheduler_problems(scheduler)


def refuse_a_scheduler_the_fence_cannot_read(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__ (the scheduler process; run_scheduler_process reports the scheduler
    ready only after it returns): the attributes the fence reads on the live scheduler exist only
    from here on, so here is the first place to check them. A problem refuses to start: this
    process exits with the plugin's code and the engine never becomes healthy."""

    problems = scheduler_start_problems(self)
    if problems:
        refuse_to_start(f"the installed SGLang's scheduler lacks what the step fence reads: {problems}")
    return None
