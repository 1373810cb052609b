"""Scheduler-side 500s, injected into the real SGLang 0.5.23 scheduler process (tests only).

SGLang's scheduler ends a request with a 500 on paths a tiny CPU text model cannot reach: a
multimodal input it cannot process (finished at admission, ``Scheduler.handle_generate_request``
sets the abort and queues the request anyway), or a grammar that rejects a sampled token
(finished mid-decode, ``SchedulerBatchResultProcessor`` sets ``req.to_finish``). These hooks take
exactly those two upstream paths for requests whose rid carries a marker, and pass every other
request through untouched (fail only the marked call). What follows is SGLang's own: the abort
travels through the output streamer and the tokenizer manager, which release the native LoRA
count and answer HTTP 500. One more marker is not a fault but a delay of the marked call alone:
the prefix request of a parallel request (n > 1) is held in the scheduler (``HOLD_PREFIX``).

Two more markers let a test say *when*: a request marked ``FAIL_ON_SIGNAL`` decodes normally
until its signal file (:func:`signal_path`) exists, then takes the same mid-decode 500; one marked
``FINISH_ON_SIGNAL`` then finishes normally, by length (its ``max_new_tokens`` is cut to what it
has decoded, so upstream's own finish check ends it). So a test can hold two requests on one
version and read the native count between the two ends (RFC 7.1: 2 -> 1 -> 0).

The scheduler runs in a process started with ``spawn``, so a patch made in the launching process
would not reach it: :func:`run_scheduler_process_with_500s` is handed to ``launch_server`` as
its ``run_scheduler_process_func`` and installs the hooks inside the scheduler process.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

from probe_log import log_line

# Marker suffixes. A resend by the session layer uses another rid ("<rid>.resend1"), so it passes.
AT_ADMISSION = ":500@admit"
MID_DECODE = ":500@decode"
DECODE_TOKENS_BEFORE_FAULT = 4
# Not a 500: the prefix request of a marked parallel request (n > 1; max_new_tokens = 0) is held
# this long in the scheduler before its result is processed, so an abort sent meanwhile reaches
# the tokenizer manager while the request's samples are not yet sent.
HOLD_PREFIX = ":hold@prefix"
HOLD_PREFIX_S = 2.0
LOG_LINE = "scheduler-500 fault injected"
FAIL_ON_SIGNAL = ":500@signal"
FINISH_ON_SIGNAL = ":finish@signal"
SIGNAL_LOG_LINE = "scheduler-500 signal taken"


def signal_path(local_source_dir: str | os.PathLike[str], rid: str) -> Path:
    """The file whose existence ends the request ``rid`` (marked ``FAIL_ON_SIGNAL`` or
    ``FINISH_ON_SIGNAL``): beside the farm's local source directory, whose path is in E1's
    environment, named by a hash of the rid (any rid is a valid file name then)."""
    source = Path(local_source_dir)
    return source.with_name(f"{source.name}.signal-{hashlib.sha256(rid.encode()).hexdigest()[:16]}")


def _marked(rid: str, marker: str) -> bool:
    """``rid`` ends with ``marker``, or is a parallel sample of such a request (n > 1: the
    plugin names each sample ``{rid}_{i}-{uuid}``)."""
    return rid.endswith(marker) or re.search(re.escape(marker) + r"_\d+-[0-9a-f]{32}$", rid) is not None


def _note(rid: str, where: str) -> None:
    log_line(f"{LOG_LINE} {where}: rid={rid}")


def install() -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    # Upstream: Scheduler._add_request_to_queue(req, is_retracted=False). The multimodal error
    # path calls req.set_finish_with_abort(..., INTERNAL_SERVER_ERROR) and then this method.
    add_to_queue = Scheduler._add_request_to_queue

    def _add_request_to_queue(self: Any, req: Any, is_retracted: bool = False) -> Any:
        if not is_retracted and _marked(req.rid, AT_ADMISSION) and req.to_finish is None:
            req.set_finish_with_abort(
                "injected scheduler fault (tests): 500 at admission",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
                err_type="InternalServerError",
            )
            _note(req.rid, "at admission")
        return add_to_queue(self, req, is_retracted)

    # Upstream: SchedulerBatchResultProcessor.process_batch_result_decode(batch, result); the
    # grammar path sets req.to_finish = FINISH_ABORT(..., INTERNAL_SERVER_ERROR) in that loop.
    decode = SchedulerBatchResultProcessor.process_batch_result_decode
    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    source = os.environ.get(LOCAL_SOURCE_DIR_ENV)

    def signalled(req: Any, marker: str) -> bool:
        return (
            source is not None
            and req.rid.endswith(marker)
            and not req.finished()
            and req.to_finish is None
            and signal_path(source, req.rid).exists()
        )

    def process_batch_result_decode(self: Any, batch: Any, result: Any) -> Any:
        for req in batch.reqs:
            if signalled(req, FAIL_ON_SIGNAL):
                req.to_finish = FINISH_ABORT(
                    "injected scheduler fault (tests): 500 mid-decode on signal",
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                )
                _note(req.rid, "mid-decode on signal")
            elif signalled(req, FINISH_ON_SIGNAL):
                # upstream's own length check (Req.check_finished) ends it after this step's token
                req.sampling_params.max_new_tokens = len(req.output_ids) + 1
                log_line(f"{SIGNAL_LOG_LINE}: finish rid={req.rid}")
            if (
                _marked(req.rid, MID_DECODE)
                and not req.finished()
                and req.to_finish is None
                and len(req.output_ids) >= DECODE_TOKENS_BEFORE_FAULT
            ):
                req.to_finish = FINISH_ABORT(
                    "injected scheduler fault (tests): 500 mid-decode",
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                )
                _note(req.rid, "mid-decode")
        return decode(self, batch, result)

    # Upstream: SchedulerBatchResultProcessor.process_batch_result_prefill(batch, result), where
    # a prefix request (max_new_tokens = 0) finishes.
    prefill = SchedulerBatchResultProcessor.process_batch_result_prefill

    def process_batch_result_prefill(self: Any, batch: Any, result: Any) -> Any:
        held = [
            r.rid
            for r in batch.reqs
            if _marked(r.rid, HOLD_PREFIX) and r.sampling_params.max_new_tokens == 0
        ]
        if held:
            _note(held[0], f"prefix held {HOLD_PREFIX_S} s")
            time.sleep(HOLD_PREFIX_S)
        return prefill(self, batch, result)

    Scheduler._add_request_to_queue = _add_request_to_queue
    SchedulerBatchResultProcessor.process_batch_result_prefill = process_batch_result_prefill
    SchedulerBatchResultProcessor.process_batch_result_decode = process_batch_result_decode


def run_scheduler_process_with_500s(*args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.scheduler import run_scheduler_process

    install()
    return run_scheduler_process(*args, **kwargs)
