"""A probe of the step fence inside the real SGLang 0.5.23 scheduler (tests only, both devices).

Each physical unload that reaches the scheduler is logged with what the fence would decide at
that moment: the batches the scheduler launched and has not finished processing, whether any
reads the adapter's slot, and whether their GPU work is known complete
(``sglang_ext.version_table.step_fence_passed``). Without the overlap scheduler the answer is
always yes (the normal loop processes a batch before it ingests the next request); with it, on
a GPU, a "no" is the deferred-free hazard the plugin refuses the overlap scheduler for.

Upstream symbols read (0.5.23): ``Scheduler.unload_lora_adapter`` (bound into the request
dispatcher in ``Scheduler.__init__``, so the class is patched before the scheduler is built),
``Scheduler.enable_overlap``, ``.result_queue`` (deque of ``(ScheduleBatch,
GenerationBatchResult)``), ``.last_batch``, ``ScheduleBatch.reqs``, ``Req.lora_id``,
``GenerationBatchResult.copy_done`` (a device event with ``query()``).

The scheduler runs in a ``spawn``-ed process: :func:`run_scheduler_process_with_probe` is handed
to ``launch_server`` and installs the probe inside it.
"""

from __future__ import annotations

import sys
from typing import Any

from lora_versions_dev.engine_log import log_records
from sglang_ext import lora_registry_patch as upstream
from sglang_ext.step_fence import fence_view
from sglang_ext.version_table import LaunchedBatch, step_fence_passed

LOG_LINE = "step-fence probe"


def launched_batches(scheduler: Any) -> list[LaunchedBatch]:
    """What the scheduler launched and has not finished processing, as the fence sees it (the
    plugin's own reader: this probe checks what the plugin's fence reads)."""
    return fence_view(upstream.launched_steps(scheduler))


def install() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    original = Scheduler.unload_lora_adapter

    def unload_lora_adapter(self: Any, recv_req: Any) -> Any:
        batches = launched_batches(self)
        on_adapter = sum(1 for b in batches if recv_req.lora_id in b.lora_ids)
        passed = step_fence_passed(recv_req.lora_id, batches)
        # One write of the whole line: print's text and newline are two writes, and another
        # thread's line can land between them (tests/engine_wrappers/probe_log.py).
        sys.stderr.write(
            f"{LOG_LINE} lora_id={recv_req.lora_id} overlap={bool(self.enable_overlap)} "
            f"launched={len(batches)} on_adapter={on_adapter} fence_passed={passed}\n"
        )
        sys.stderr.flush()
        return original(self, recv_req)

    Scheduler.unload_lora_adapter = unload_lora_adapter


def run_scheduler_process_with_probe(*args: Any, **kwargs: Any) -> Any:
    install()
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def probe_lines(log_text: str, lora_id: str) -> list[dict[str, str]]:
    """The probe's records for ``lora_id`` in an engine log, as key/value dicts."""
    return log_records(log_text, LOG_LINE, lora_id)
