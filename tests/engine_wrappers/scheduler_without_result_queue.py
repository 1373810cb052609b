"""A real SGLang 0.5.23 scheduler whose ``result_queue`` is gone (tests only): what a pin bump
that renamed the attribute looks like to the plugin's step fence.

0.5.23 sets ``Scheduler.result_queue`` in ``init_running_status`` in every mode; only the overlap
loops fill it, so without the overlap scheduler this scheduler still serves normally. A reader
that took the missing attribute for an empty queue would see no launched step and let every
unload through; the plugin must refuse to start instead, naming the attribute.

The scheduler runs in a process started with ``spawn``: :func:`run_scheduler_process_without_result_queue`
is handed to ``launch_server`` (``lora_versions_dev.scheduler_wrapper``) and removes it there.
"""

from __future__ import annotations

from typing import Any

REMOVED = "result_queue"


def install() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    init_running_status = Scheduler.init_running_status

    def init_running_status_without_result_queue(self: Any) -> None:
        init_running_status(self)
        delattr(self, REMOVED)

    Scheduler.init_running_status = init_running_status_without_result_queue


def run_scheduler_process_without_result_queue(*args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.scheduler import run_scheduler_process

    install()
    return run_scheduler_process(*args, **kwargs)
