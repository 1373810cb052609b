"""The plugin's step-fence reader, evaluated on the live SGLang 0.5.23 scheduler (tests only).

The scheduler serves a control request such as an unload inside ``Scheduler.ingest_requests``,
at the start of a loop iteration. Before every such call this probe runs what the fence runs at
an unload (``lora_registry_patch.launched_steps``, ``step_fence.fence_view``,
``version_table.step_fence_passed``) for every adapter the launched steps read, and logs one
line each time that reading changes: what the fence would have seen had an unload of that
adapter arrived there. So a test can check the reader on the scheduler's own ``last_batch`` /
``result_queue`` / ``ScheduleBatch`` / ``Req`` objects while a version is being generated on, and
not only at the (mostly idle) moment of its unload.

Upstream symbols (0.5.23): ``Scheduler.ingest_requests`` (called first in every event loop).
The scheduler runs in a ``spawn``-ed process: :func:`run_scheduler_process_with_reader_probe`
is handed to ``launch_server`` and installs the probe inside it.
"""

from __future__ import annotations

from typing import Any

from probe_log import log_line

LOG_LINE = "fence-reader probe"


def readings(scheduler: Any) -> list[str]:
    """One ``key=value`` record per adapter the launched steps read, as the fence decides it."""
    from sglang_ext import lora_registry_patch as upstream
    from sglang_ext.step_fence import fence_view
    from sglang_ext.version_table import step_fence_passed

    steps = upstream.launched_steps(scheduler)
    view = fence_view(steps)
    out = []
    for lora_id in sorted(frozenset().union(*(s.lora_ids for s in steps))):
        done = ",".join(str(b.done) for b in view if lora_id in b.lora_ids)
        out.append(
            f"lora_id={lora_id} overlap={upstream.overlap_scheduler_on(scheduler)} launched={len(steps)} "
            f"on_adapter={sum(1 for b in view if lora_id in b.lora_ids)} done={done} "
            f"fence_passed={step_fence_passed(lora_id, view)}"
        )
    return out


def install() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    ingest = Scheduler.ingest_requests
    last: list[str] = []

    def ingest_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        now = readings(self)
        for record in now:
            if record not in last:
                log_line(f"{LOG_LINE} {record}")
        last[:] = now
        return ingest(self, *args, **kwargs)

    Scheduler.ingest_requests = ingest_requests


def run_scheduler_process_with_reader_probe(*args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.scheduler import run_scheduler_process

    install()
    return run_scheduler_process(*args, **kwargs)
