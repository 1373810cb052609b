"""Every hook the plugin places on SGLang, in :func:`register_all`: the main process's list,
and the scheduler's (the step fence at the physical unload, :mod:`sglang_ext.step_fence`; the
managed load prepared off the scheduler thread, :mod:`sglang_ext.prepared_load`; what each output
token was served by, :mod:`sglang_ext.served_version`).

Each hook is small and named after what it guards; the upstream targets (SGLang 0.5.23) are
named in :mod:`sglang_ext.lora_registry_patch`. Hooks go through SGLang's own ``HookRegistry``;
no installed file is edited.
"""

from __future__ import annotations

import logging
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import is_managed_name
from sglang_ext import hook_timing, prepared_load, served_version, slot_zeroing
from sglang_ext import lora_registry_patch as upstream
from sglang_ext import parallel_sampling as ps
from sglang_ext import tokenizer_hooks as th
from sglang_ext.engine_state import engine_state
from sglang_ext.http_routes import mount
from sglang_ext.plugin_log import refuse_to_start
from sglang_ext.setup_checks import overlap_proof_active, setup_problems
from sglang_ext.step_fence import complete_the_step_before_unload as fence
from sglang_ext.step_fence import refuse_a_scheduler_the_fence_cannot_read as check

logger = logging.getLogger(__name__)


def refuse_unsupported_setup(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ServerArgs.check_server_args: called by Engine._launch_subprocesses in the main
    process after ``resolve_once()``, so the view below holds the resolved values."""
    verify_hooks_applied(upstream.MAIN_PROCESS_TARGETS)
    resolved = upstream.resolved_server_args(server_args)
    problems = setup_problems(resolved)
    if problems:
        refuse_to_start("; ".join(problems))
    if overlap_proof_active(resolved):
        logger.warning(
            "lora-versions: the overlap scheduler is ON for the GPU proof test only; reclaim is NOT "
            "proven safe with it (gpu_tests/README.md). Never serve this way."
        )
    return None


def mount_lora_versions_routes(server_args: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE http_server._setup_and_run_http_server(server_args, tokenizer_manager, ...): the
    FastAPI app exists and uvicorn has not started, so routes added here are served (and covered
    by SGLang's auth middleware, which it adds later in that same function)."""
    problems = upstream.tokenizer_manager_problems(tokenizer_manager)
    if problems:
        refuse_to_start(f"the installed SGLang lacks what the plugin reads: {problems}")
    mount(upstream.http_app(), server_args, tokenizer_manager)
    return None


def serve_version_series_on_metrics(app: Any, *args: Any, **kwargs: Any) -> None:
    """REPLACE http_server.add_prometheus_middleware(app), called in SGLang's lifespan when
    ``--enable-metrics`` (after the BEFORE hook above attached the engine state): the same
    /metrics route, whose registry also holds the per-version collector (:mod:`sglang_ext.metrics`)."""
    upstream.mount_metrics_route(app, engine_state().metrics.collectors())


async def refuse_managed_names_on_stock_lora_api(
    original: Any, self: Any, obj: Any, *args: Any, **kwargs: Any
):
    """AROUND TokenizerControlMixin.load_lora_adapter / load_lora_adapter_from_tensors /
    unload_lora_adapter (the methods behind SGLang's /load_lora_adapter,
    /load_lora_adapter_from_tensors and /unload_lora_adapter). A managed version is created only
    by staged publication and removed only by cleanup or reclaim; an ordinary call naming one is
    MANAGED_ADAPTER and changes nothing. Other names keep stock behaviour."""
    # The plugin itself never calls these methods (managed loads and unloads go through the
    # scheduler fan-out in native_lora), so there is no exception to make.
    name = obj.lora_name  # on each of the three request types (checked at start: DECLARED_FIELDS)
    if isinstance(name, str) and is_managed_name(name):
        raise LoraVersionError(
            ErrorCode.MANAGED_ADAPTER,
            f"{name!r} is a managed LoRA version: it is published and reclaimed only through /lora_versions",
            lora_name=name,
        )
    return await original(self, obj, *args, **kwargs)


def verify_hooks_applied(targets: tuple[str, ...]) -> None:
    missing = upstream.unapplied_hooks(targets)
    if missing:
        refuse_to_start(f"hooks could not be applied to {missing}; is this sglang==0.5.23?")


def register_all(role: str) -> None:
    if role == "scheduler":
        # Their targets resolve (the main process checked SCHEDULER_PROCESS_TARGETS before spawning
        # us); the first checks, before the scheduler reports ready, that the second was applied and
        # that the live scheduler has what it reads. The fence's log line at every unload is
        # asserted on every engine by the online run.
        scheduler_hooks: list[tuple[str, Any, str]] = [
            (upstream.SCHEDULER_INIT, check, "AFTER"),
            (upstream.SCHEDULER_UNLOAD_ADAPTER, fence, "AROUND"),
            # Issue 29: a managed load is read and re-shaped off the scheduler thread, which only
            # installs it; an unloaded adapter's memory is released off it; and no device-wide
            # cache flush on the scheduler thread around a load or an unload.
            (upstream.SCHEDULER_LOAD_ADAPTER, prepared_load.prepare_then_install, "AROUND"),
            (upstream.LORA_MANAGER_LOAD, prepared_load.load_installing_what_was_prepared, "REPLACE"),
            (upstream.LORA_MANAGER_UNLOAD, prepared_load.unload_releasing_off_the_loop, "REPLACE"),
            # A freed slot's clear zeroes the ranks written into it, not the pool's max rank.
            (upstream.POOL_INIT_BUFFERS, slot_zeroing.track_slots_from_a_zeroed_pool, "AFTER"),
            (upstream.POOL_LOAD_TO_BUFFER, slot_zeroing.record_the_rank_about_to_be_written, "BEFORE"),
            (upstream.POOL_CLEAR_SLOT, slot_zeroing.zero_only_what_was_written, "AROUND"),
            # Issue 39: every output token is attested with what its step ran, read from the batch.
            (upstream.LORA_BACKEND_FACTORY, served_version.backend_that_reports_its_rows, "AFTER"),
            (upstream.LORA_MANAGER_PREPARE_BATCH, served_version.read_the_rows_each_batch_runs, "AROUND"),
            (upstream.SCHEDULER_RUN_BATCH, served_version.mark_each_request_with_what_ran, "AROUND"),
            (
                upstream.SCHEDULER_OUTPUT_STREAMER_CLASS,
                served_version.streamer_class_that_attests_tokens,
                "REPLACE",
            ),
        ]
        assert [t for t, _, _ in scheduler_hooks] == list(upstream.SCHEDULER_PROCESS_TARGETS), "one list"
        for target, hook, kind in scheduler_hooks:
            upstream.register_hook(target, hook, kind)
        return
    if role != "main":
        return
    hooks: list[tuple[str, Any, str]] = [
        (upstream.CHECK_SERVER_ARGS, refuse_unsupported_setup, "BEFORE"),
        (upstream.SETUP_HTTP_SERVER, mount_lora_versions_routes, "BEFORE"),
        (upstream.LOAD_ADAPTER, refuse_managed_names_on_stock_lora_api, "AROUND"),
        (upstream.LOAD_ADAPTER_FROM_TENSORS, refuse_managed_names_on_stock_lora_api, "AROUND"),
        (upstream.UNLOAD_ADAPTER, refuse_managed_names_on_stock_lora_api, "AROUND"),
        (upstream.GENERATE_REQUEST, th.refuse_forged_internal_fields, "AROUND"),
        (upstream.INIT_REQ_STATE, th.refuse_what_normalisation_lets_through, "BEFORE"),
        (upstream.VALIDATE_ONE_REQUEST, th.refuse_inputs_that_crash_the_scheduler, "BEFORE"),
        (upstream.RESOLVE_LORA_PATH, th.serve_only_ready_managed_versions, "AROUND"),
        (upstream.RELEASE_LORA_ONCE, th.release_only_what_was_acquired, "AROUND"),
        (upstream.REGENERATE_RID, ps.sample_rids_under_the_request_rid, "AROUND"),
        (upstream.ABORT_REQUEST, ps.abort_every_sample_of_a_parallel_request, "AROUND"),
        (upstream.SEND_ONE_REQUEST, ps.abort_samples_sent_after_their_request_was_aborted, "AROUND"),
        (upstream.LRU_LORA_NAME, th.lru_never_picks_managed, "REPLACE"),
        (upstream.SERVE_GENERATE, th.precheck_generate, "AROUND"),
        (upstream.OPENAI_HANDLE_REQUEST, th.precheck_openai, "AROUND"),
        (upstream.METRICS_ROUTE, serve_version_series_on_metrics, "REPLACE"),
        (
            upstream.OPENAI_RESPONSE_METADATA,
            served_version.name_the_served_versions_in_openai_metadata,
            "AFTER",
        ),
    ]
    assert [t for t, _, _ in hooks] == list(upstream.MAIN_PROCESS_TARGETS), "one list of targets"
    timed = hook_timing.enabled()  # a bench switch: off, the hooks are registered as they are
    for target, hook, kind in hooks:
        upstream.register_hook(target, hook_timing.timed(hook, kind, hook.__name__) if timed else hook, kind)
