"""The one module that touches SGLang 0.5.23 internals.

Every upstream symbol the plugin imports, every private or instance attribute it reads, every
upstream message it matches, and every hook target it patches is named here, behind a small
accessor. No other module of the plugin imports ``sglang.*`` (``plugin.py``, which must stay
import-light, excepted; the development tools that start engines live in ``lora_versions_dev``).
:func:`surface_problems` resolves all of it, and the plugin refuses to start naming whatever is
missing, so moving the pin is a diff of this file that fails closed instead of a hunt through the
package that fails open.

Nothing from SGLang is imported at module import time: the plugin loads this module in every
SGLang process, and the trainer side never does.

When the pin moves: upstream's later ``LoRARef.reloadable`` expresses the rule that
:func:`lru_lora_name_never_managed` adds here (a managed version is never an eviction candidate);
delete that override then, and re-read every accessor below against the new source.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lora_contract.messages import QUEUE_FULL_MESSAGE
from lora_contract.served_version import SERVED_TOKENS_KEY

# ------------------------------------------------------------------------------ hook targets
# Patched through SGLang's own HookRegistry (sglang.srt.plugins.hook_registry).

CHECK_SERVER_ARGS = "sglang.srt.server_args.ServerArgs.check_server_args"
SETUP_HTTP_SERVER = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
_MIXIN = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
LOAD_ADAPTER = f"{_MIXIN}.load_lora_adapter"
LOAD_ADAPTER_FROM_TENSORS = f"{_MIXIN}.load_lora_adapter_from_tensors"
UNLOAD_ADAPTER = f"{_MIXIN}.unload_lora_adapter"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
GENERATE_REQUEST = f"{_TM}.generate_request"
INIT_REQ_STATE = f"{_TM}._init_req_state"
VALIDATE_ONE_REQUEST = f"{_TM}._validate_one_request"
RESOLVE_LORA_PATH = f"{_TM}._resolve_lora_path"
RELEASE_LORA_ONCE = f"{_TM}._release_lora_once"
# Parallel sampling (n > 1): _handle_batch_request gives the prefix request and each sample a new
# rid through this method (its only callers in 0.5.23), and /abort_request reaches abort_request.
REGENERATE_RID = "sglang.srt.managers.io_struct.GenerateReqInput.regenerate_rid"
ABORT_REQUEST = f"{_TM}.abort_request"
# Every request reaches the scheduler through this (a sample of a parallel request included).
SEND_ONE_REQUEST = f"{_TM}._send_one_request"
LRU_LORA_NAME = "sglang.srt.lora.lora_registry.LoRARegistry.lru_lora_name"
SERVE_GENERATE = "sglang.srt.entrypoints.http_server.serve_generate_request"
OPENAI_HANDLE_REQUEST = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"
# Called by http_server's lifespan (a module-global lookup, so the patched name is the one called)
# when --enable-metrics; replaced by mount_metrics_route.
METRICS_ROUTE = "sglang.srt.entrypoints.http_server.add_prometheus_middleware"
# What a non-streamed OpenAI chat or completion response carries of its first choice's meta_info
# (its "metadata": weight_version); imported by name into serving_chat and serving_completions
# (the hook registry rebinds it there). The served versions are added to it.
OPENAI_RESPONSE_METADATA = "sglang.srt.utils.weight_versions.build_endpoint_weight_version_metadata"

# Scheduler process. Bound into the request dispatcher in Scheduler.__init__, which runs after
# load_plugins() (run_scheduler_process), so the patched method is the one dispatched.
SCHEDULER_UNLOAD_ADAPTER = "sglang.srt.managers.scheduler.Scheduler.unload_lora_adapter"
# Bound into the same dispatcher (LoadLoRAAdapterReqInput): the plugin's managed load is prepared
# off the scheduler thread and only installed here (sglang_ext.prepared_load).
SCHEDULER_LOAD_ADAPTER = "sglang.srt.managers.scheduler.Scheduler.load_lora_adapter"
# Its end is where the live scheduler's attributes first exist, before run_scheduler_process
# reports it ready (see scheduler_problems).
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
# LoRAManager's public load/unload only wrap _load_lora_adapter / _unload_lora_adapter in two log
# lines, each computing get_available_gpu_memory(), which on CUDA first runs
# torch.cuda.empty_cache() (a device-wide flush on the scheduler thread, twice per call). Replaced
# by the same log lines read without the flush (load_without_a_cache_flush). The load's
# replacement also installs an adapter prepared off the scheduler thread (upstream's
# _load_lora_adapter with its load_lora_weights step done beforehand: install_prepared), the
# unload's releases the unloaded adapter's memory off it (sglang_ext.prepared_load).
LORA_MANAGER_LOAD = "sglang.srt.lora.lora_manager.LoRAManager.load_lora_adapter"
LORA_MANAGER_UNLOAD = "sglang.srt.lora.lora_manager.LoRAManager.unload_lora_adapter"
# LoRAMemoryPool (sglang.srt.lora.mem_pool, 0.5.23): its buffers start as torch.zeros in
# init_buffers; load_lora_weight_to_buffer is the one writer of an adapter into a slot;
# _clear_buffer_slot_for_base zeroes a whole slot (remove_lora at every unload, and the base
# model's placement). Hooked so a clear zeroes only the ranks written (sglang_ext.slot_zeroing).
_POOL = "sglang.srt.lora.mem_pool.LoRAMemoryPool"
POOL_INIT_BUFFERS = f"{_POOL}.init_buffers"
POOL_LOAD_TO_BUFFER = f"{_POOL}.load_lora_weight_to_buffer"
POOL_CLEAR_SLOT = f"{_POOL}._clear_buffer_slot_for_base"
# Issue 39 (every reply names what served it, sglang_ext.served_version). LoRAManager.__init__
# builds its backend from the class this factory returns (imported by name into lora_manager: the
# hook registry rebinds it there); prepare_lora_batch builds each forward step's LoRA batch
# (ForwardBatch.init_new, on the scheduler thread); run_batch runs one step; the streamer class
# is built once, in Scheduler.init_output_streamer, its only caller.
LORA_BACKEND_FACTORY = "sglang.srt.lora.backend.lora_registry.get_backend_from_name"
LORA_MANAGER_PREPARE_BATCH = "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch"
SCHEDULER_RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
SCHEDULER_OUTPUT_STREAMER_CLASS = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"
SCHEDULER_PROCESS_TARGETS = (
    SCHEDULER_INIT,
    SCHEDULER_UNLOAD_ADAPTER,
    SCHEDULER_LOAD_ADAPTER,
    LORA_MANAGER_LOAD,
    LORA_MANAGER_UNLOAD,
    POOL_INIT_BUFFERS,
    POOL_LOAD_TO_BUFFER,
    POOL_CLEAR_SLOT,
    LORA_BACKEND_FACTORY,
    LORA_MANAGER_PREPARE_BATCH,
    SCHEDULER_RUN_BATCH,
    SCHEDULER_OUTPUT_STREAMER_CLASS,
)

MAIN_PROCESS_TARGETS = (
    CHECK_SERVER_ARGS,
    SETUP_HTTP_SERVER,
    LOAD_ADAPTER,
    LOAD_ADAPTER_FROM_TENSORS,
    UNLOAD_ADAPTER,
    GENERATE_REQUEST,
    INIT_REQ_STATE,
    VALIDATE_ONE_REQUEST,
    RESOLVE_LORA_PATH,
    RELEASE_LORA_ONCE,
    REGENERATE_RID,
    ABORT_REQUEST,
    SEND_ONE_REQUEST,
    LRU_LORA_NAME,
    SERVE_GENERATE,
    OPENAI_HANDLE_REQUEST,
    METRICS_ROUTE,
    OPENAI_RESPONSE_METADATA,
)

# ------------------------------------------------------------------------------ symbols

# name -> (module, attribute): everything the plugin imports from SGLang.
SYMBOLS: dict[str, tuple[str, str]] = {
    "HookRegistry": ("sglang.srt.plugins.hook_registry", "HookRegistry"),
    "HookType": ("sglang.srt.plugins.hook_registry", "HookType"),
    "resolving_view": ("sglang.srt.arg_groups.model_override_base", "resolving_view"),
    "http_app": ("sglang.srt.entrypoints.http_server", "app"),
    "auth_level": ("sglang.srt.utils.auth", "auth_level"),
    "AuthLevel": ("sglang.srt.utils.auth", "AuthLevel"),
    "LoRARef": ("sglang.srt.lora.lora_registry", "LoRARef"),
    "LoRARegistry": ("sglang.srt.lora.lora_registry", "LoRARegistry"),
    "GenerateReqInput": ("sglang.srt.managers.io_struct", "GenerateReqInput"),
    # the other request type TokenizerManager.generate_request takes (the guards see it too)
    "EmbeddingReqInput": ("sglang.srt.managers.io_struct", "EmbeddingReqInput"),
    # what _send_one_request sends (abort_samples_sent_after_their_request_was_aborted reads its rid)
    "TokenizedGenerateReqInput": ("sglang.srt.managers.io_struct", "TokenizedGenerateReqInput"),
    "TokenizedEmbeddingReqInput": ("sglang.srt.managers.io_struct", "TokenizedEmbeddingReqInput"),
    "LoadLoRAAdapterFromTensorsReqInput": (
        "sglang.srt.managers.io_struct",
        "LoadLoRAAdapterFromTensorsReqInput",
    ),
    # the server arguments setup_checks and engine_state read (through resolved_server_args)
    "ServerArgs": ("sglang.srt.server_args", "ServerArgs"),
    # the OpenAI requests precheck_openai reads (model, lora_path)
    "CompletionRequest": ("sglang.srt.entrypoints.openai.protocol", "CompletionRequest"),
    "ChatCompletionRequest": ("sglang.srt.entrypoints.openai.protocol", "ChatCompletionRequest"),
    # the owners of the upstream messages the plugin matches (see MESSAGES)
    "Scheduler": ("sglang.srt.managers.scheduler", "Scheduler"),
    "LoRAManager": ("sglang.srt.lora.lora_manager", "LoRAManager"),
    # the class TokenizerManager builds every request's sampling parameters with
    "SamplingParams": ("sglang.srt.sampling.sampling_params", "SamplingParams"),
    "LoadLoRAAdapterReqInput": ("sglang.srt.managers.io_struct", "LoadLoRAAdapterReqInput"),
    "UnloadLoRAAdapterReqInput": ("sglang.srt.managers.io_struct", "UnloadLoRAAdapterReqInput"),
    "merge_lora_update_results": (
        "sglang.srt.managers.tokenizer_control_mixin",
        "_merge_lora_update_results",
    ),
    "get_parallel": ("sglang.srt.runtime_context", "get_parallel"),
    "get_normalized_target_modules": ("sglang.srt.lora.utils", "get_normalized_target_modules"),
    "ReqState": ("sglang.srt.managers.tokenizer_manager", "ReqState"),
    "TokenizerManager": ("sglang.srt.managers.tokenizer_manager", "TokenizerManager"),
    "OpenAIServingBase": ("sglang.srt.entrypoints.openai.serving_base", "OpenAIServingBase"),
    "ConcurrentCounter": ("sglang.srt.utils.common", "ConcurrentCounter"),
    "LoRAUpdateOutput": ("sglang.srt.managers.io_struct", "LoRAUpdateOutput"),
    # the scheduler's launched steps, as the step fence reads them (see launched_steps)
    "ScheduleBatch": ("sglang.srt.managers.schedule_batch", "ScheduleBatch"),
    "Req": ("sglang.srt.managers.schedule_batch", "Req"),
    "GenerationBatchResult": ("sglang.srt.managers.utils", "GenerationBatchResult"),
    # the observability settings http_server reads to mount /metrics (--enable-metrics)
    "get_observability": ("sglang.srt.runtime_context", "get_observability"),
    # what mount_metrics_route mirrors (http_server imports it from here)
    "add_prometheus_middleware": ("sglang.srt.utils.common", "add_prometheus_middleware"),
    # what a managed load prepares off the scheduler thread (adapter_builder, install_prepared)
    "LoRAConfig": ("sglang.srt.lora.lora_config", "LoRAConfig"),
    "LoRAAdapter": ("sglang.srt.lora.lora", "LoRAAdapter"),
    "warn_if_adapter_targets_embeddings": ("sglang.srt.lora.utils", "warn_if_adapter_targets_embeddings"),
    # what served each reply (sglang_ext.served_version): the streamer subclassed, the backend
    # method whose parameters are read, the step's rows
    "SchedulerOutputStreamer": (
        "sglang.srt.managers.scheduler_components.output_streamer",
        "SchedulerOutputStreamer",
    ),
    "BaseLoRABackend": ("sglang.srt.lora.backend.base_backend", "BaseLoRABackend"),
    "ForwardBatch": ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch"),
}

# (symbol, attribute) that must exist on the class itself.
CLASS_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("TokenizerManager", "auto_create_handle_loop"),
    ("TokenizerManager", "generate_request"),
    ("OpenAIServingBase", "_resolve_lora_path"),
    ("LoRARegistry", "register"),
    ("LoRARegistry", "unregister"),
    ("ConcurrentCounter", "value"),
    ("ConcurrentCounter", "wait_for_zero"),
    ("HookRegistry", "register"),
    ("HookRegistry", "_patched"),
    ("LoRAAdapter", "initialize_weights"),
    ("SchedulerOutputStreamer", "stream_output"),
    ("BaseLoRABackend", "prepare_lora_batch"),
)
# Set in LoRARegistry.__init__ (checked on a fresh instance).
LORA_REGISTRY_ATTRIBUTES = ("_registry", "_counters", "_registry_lock")
# ReqState dataclass fields read by the release guard.
REQ_STATE_FIELDS = ("obj", "lora_released")
# Set in TokenizerManager.__init__ / init_communicators (checked on the live instance, see
# tokenizer_manager_problems). rid_to_state: the parallel-sampling abort reads every live request
# state by rid (a rename read as "no state" would leave an aborted request's samples decoding).
TOKENIZER_MANAGER_ATTRIBUTES = (
    "lora_registry",
    "lora_ref_cache",
    "model_config",
    "update_lora_adapter_communicator",
    "tokenizer",
    "rid_to_state",
)
# TokenizerManager.model_config (sglang.srt.configs.model_config.ModelConfig): what base_hf_config,
# base_serving and vocab_size read (the vocabulary bound of refuse_inputs_that_crash_the_scheduler).
MODEL_CONFIG_ATTRIBUTES = ("hf_config", "dtype", "quantization", "vocab_size")

# ------------------------------------------------------------------------------ request fields
# GenerateReqInput fields the tokenizer manager or the engine set themselves (io_struct, 0.5.23):
# a request may not send them (tokenizer_hooks.forbidden_fields).
INTERNAL_FIELDS = (
    "lora_id",
    "http_worker_ipc",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
)
# The same of EmbeddingReqInput, which declares only these two of them.
EMBEDDING_INTERNAL_FIELDS = ("lora_id", "http_worker_ipc")
# The fields a raw /generate body may not set, with GenerateReqInput's default for each (checked
# against the class at start): the internal fields above, and three set legitimately only by the
# OpenAI layer or internally. A body that names a field with exactly its default changes nothing
# and is accepted: a gateway that re-serializes the request (smg 1.13.0 writes "return_bytes":
# false into every /generate body it buffers for retries) is not a forger. Any other value is
# refused.
RAW_FIELD_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys(INTERNAL_FIELDS),
    "received_time": None,
    "positional_embed_overrides": None,
    "return_bytes": False,
}
# GenerateReqInput fields that hold one entry per prompt when they are lists.
PER_PROMPT_LISTS = ("lora_path", "sampling_params")
# The ids SGLang mints: LoRARef.lora_id (uuid4().hex; Req.extra_key = client extra_key + lora_id, a
# plain concatenation) and the rid GenerateReqInput.regenerate_rid gives each sample of a parallel
# request. Checked at start on a fresh LoRARef and a regenerated rid.
UUID_HEX = "[0-9a-f]{32}"
# normalize_batch_and_arguments names prompt i of a request with rid r "r_i" when n > 1 (checked at
# start on a normalised request).
PROMPT_RID = "{rid}_{i}"

# ------------------------------------------------------------------------------ parallel sampling
# What sglang_ext.parallel_sampling reads of SGLang's n > 1 path besides the fields above
# (GenerateReqInput.rid and parallel_sample_num, TokenizedGenerateReqInput.rid,
# TokenizerManager.rid_to_state; all checked at start): the pattern of PROMPT_RID's tail after the
# request's rid, and TokenizerManager.abort_request's parameters after self, in order (the abort
# hook reads both, sent by position or by name; checked at start on the method's signature).
PROMPT_RID_TAIL = PROMPT_RID.removeprefix("{rid}").format(i=r"\d+")
ABORT_REQUEST_PARAMETERS = ("rid", "abort_all")
# What LoRAManager.prepare_lora_batch hands each backend (0.5.23: positionally, then scalings and
# the CUDA-graph flags): per row the slot index, per slot the rank this step.
BACKEND_PREPARE_PARAMETERS = ("forward_batch", "weight_indices", "lora_ranks")


def abort_request_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(rid, abort_all) of a call ``abort_request(*args, **kwargs)``, with upstream's defaults."""
    rid_name, all_name = ABORT_REQUEST_PARAMETERS
    rid = kwargs.get(rid_name, args[0] if args else "")
    return rid, kwargs.get(all_name, args[1] if len(args) > 1 else False)


def abort_one_request(rid: str) -> dict[str, Any]:
    """The keyword arguments of ``abort_request`` that abort the one request ``rid``."""
    rid_name, all_name = ABORT_REQUEST_PARAMETERS
    return {rid_name: rid, all_name: False}


def live_request_rids(tm: Any) -> list[Any]:
    """The rids the tokenizer manager holds a request state for now (a copy: the loop changes it)."""
    return list(tm.rid_to_state)


def has_request_state(tm: Any, rid: Any) -> bool:
    return rid in tm.rid_to_state


def parallel_sample_num(request: Any) -> Any:
    """``n`` as normalisation set it on a generation request (None or an int)."""
    return request.parallel_sample_num


def signature_problems() -> list[str]:
    """The upstream methods whose parameters the hooks read by name or position."""
    try:
        method = symbol("TokenizerManager").abort_request
    except (ImportError, AttributeError):
        return []  # already reported above
    problems = []
    params = tuple(inspect.signature(method).parameters)[1 : 1 + len(ABORT_REQUEST_PARAMETERS)]
    if params != ABORT_REQUEST_PARAMETERS:
        problems.append(f"TokenizerManager.abort_request takes {params!r}, not {ABORT_REQUEST_PARAMETERS!r}")
    try:
        method = symbol("BaseLoRABackend").prepare_lora_batch
    except (ImportError, AttributeError):
        return problems  # already reported above
    params = tuple(inspect.signature(method).parameters)[1 : 1 + len(BACKEND_PREPARE_PARAMETERS)]
    if params != BACKEND_PREPARE_PARAMETERS:
        problems.append(
            f"BaseLoRABackend.prepare_lora_batch takes {params!r}, not {BACKEND_PREPARE_PARAMETERS!r}"
        )
    return problems


# (symbol, field) declared on the class (a dataclass field, a msgspec Struct field or a pydantic
# model field), read by a guard, the step fence or the engine's setup. Checked at start on the
# installed classes: a rename refuses the start, naming it, instead of reading as a default.
DECLARED_FIELDS: tuple[tuple[str, str], ...] = (
    *(("ReqState", f) for f in REQ_STATE_FIELDS),
    *(
        ("GenerateReqInput", f)
        for f in ("rid", "lora_path", "sampling_params", "extra_key", "return_logprob", "top_logprobs_num")
    ),
    *(("GenerateReqInput", f) for f in RAW_FIELD_DEFAULTS),
    *(("EmbeddingReqInput", f) for f in ("rid", "lora_path", "sampling_params", *EMBEDDING_INTERNAL_FIELDS)),
    ("TokenizedGenerateReqInput", "rid"),
    ("TokenizedEmbeddingReqInput", "rid"),
    # native_lora reads each rank's reply: success, error_message, loaded_adapters (a partial load)
    *(("LoRAUpdateOutput", f) for f in ("success", "error_message", "loaded_adapters")),
    *(("LoRARef", f) for f in ("lora_id", "lora_name", "lora_path", "pinned")),
    # the stock LoRA API guard (hooks.refuse_managed_names_on_stock_lora_api) reads lora_name
    *(("LoadLoRAAdapterReqInput", f) for f in ("rid", "lora_name", "lora_path", "lora_id")),
    *(("UnloadLoRAAdapterReqInput", f) for f in ("lora_name", "lora_id")),
    ("LoadLoRAAdapterFromTensorsReqInput", "lora_name"),
    *(("CompletionRequest", f) for f in ("model", "lora_path")),
    *(("ChatCompletionRequest", f) for f in ("model", "lora_path")),
    *(
        ("ServerArgs", f)
        for f in (
            # setup_checks
            "enable_lora",
            "tokenizer_worker_num",
            "dp_size",
            "max_loras_per_batch",
            "max_loaded_loras",
            "nnodes",
            "enable_dp_attention",
            "attn_cp_size",
            "ep_size",
            "pp_size",
            "enable_pdmux",
            "enable_lora_overlap_loading",
            "speculative_algorithm",
            "disaggregation_mode",
            "disable_overlap_schedule",
            "disable_radix_cache",
            "device",
            # engine_state (enable_metrics: through get_observability, see metrics_enabled)
            "enable_metrics",
            "model_path",
            "revision",
            "tokenizer_path",
            "lora_target_modules",
            "max_lora_rank",
        )
    ),
)
# (symbol, attribute) set on the request by normalize_batch_and_arguments, read by the
# parallel-sampling and per-prompt guards (checked at start on normalised requests). A sub-request
# SGLang cuts from a normalised one (``obj[i]``) has none of them: see :func:`normalised`.
NORMALISED_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("GenerateReqInput", "is_single"),
    ("GenerateReqInput", "batch_size"),
    ("GenerateReqInput", "parallel_sample_num"),
    ("EmbeddingReqInput", "is_single"),
    ("EmbeddingReqInput", "batch_size"),
)

# Function names on the stack that tell which SGLang process loads the plugin
# (sglang.srt.managers.scheduler / detokenizer_manager / data_parallel_controller).
PROCESS_ENTRY_FUNCTIONS = {
    "run_scheduler_process": "scheduler",
    "run_detokenizer_process": "detokenizer",
    "run_data_parallel_controller_process": "dp-controller",
}

# Texts of LoRAManager.validate_new_adapter (sglang.srt.lora.lora_manager) that mean "this adapter
# does not fit this engine" rather than "the load failed".
INCOMPATIBLE_MESSAGE_MARKERS = ("incompatible with the current LoRA memory pool", "DoRA", "add tokens")
# (symbol, method, text): every upstream message the plugin (or the trainer side, through
# lora_contract) matches, with the method whose string constants hold it. QUEUE_FULL_MESSAGE is
# Scheduler._abort_on_queued_limit's 503 (relax_glue.engine_client reads it as "not admitted").
MESSAGES: tuple[tuple[str, str, str], ...] = (
    ("Scheduler", "_abort_on_queued_limit", QUEUE_FULL_MESSAGE),
    *(("LoRAManager", "validate_new_adapter", m) for m in INCOMPATIBLE_MESSAGE_MARKERS),
)


def symbol(name: str) -> Any:
    module, attribute = SYMBOLS[name]
    return getattr(importlib.import_module(module), attribute)


def _resolve_dotted(path: str) -> Any:
    """Import the longest importable module prefix of ``path`` and walk the rest as attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(path)


def surface_problems() -> list[str]:
    """Every upstream symbol, attribute and hook target of this module that cannot be resolved
    in the installed SGLang, by name. Empty on the pinned version."""
    problems: list[str] = []
    for name, (module, attribute) in SYMBOLS.items():
        try:
            getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{attribute} ({name}): {exc}")
    for owner, attribute in CLASS_ATTRIBUTES:
        try:
            if not hasattr(symbol(owner), attribute):
                problems.append(f"{SYMBOLS[owner][1]}.{attribute} is missing")
        except (ImportError, AttributeError):
            pass  # already reported above
    for target in MAIN_PROCESS_TARGETS + SCHEDULER_PROCESS_TARGETS:
        try:
            _resolve_dotted(target)
        except (ImportError, AttributeError) as exc:
            problems.append(f"hook target {target}: {exc!r}")
    try:
        registry = symbol("LoRARegistry")()
        problems += [
            f"LoRARegistry().{a} is missing" for a in LORA_REGISTRY_ATTRIBUTES if not hasattr(registry, a)
        ]
    except Exception as exc:  # a constructor that changed shape is a problem too
        problems.append(f"LoRARegistry() cannot be built: {exc!r}")
    problems += declared_field_problems(DECLARED_FIELDS)
    problems += request_problems() + signature_problems()
    return problems + message_problems() + step_reader_problems()


def declared_fields(cls: Any) -> set[str]:
    """The fields ``cls`` declares: a dataclass's, a msgspec Struct's or a pydantic model's."""
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    fields |= set(getattr(cls, "__struct_fields__", ()))
    model_fields = getattr(cls, "model_fields", None)
    return fields | set(model_fields) if isinstance(model_fields, dict) else fields


def declared_field_problems(wanted: tuple[tuple[str, str], ...]) -> list[str]:
    problems: list[str] = []
    for owner, field in wanted:
        try:
            if field not in declared_fields(symbol(owner)):
                problems.append(f"{SYMBOLS[owner][1]}.{field} is missing")
        except (ImportError, AttributeError):
            pass  # already reported above
    return problems


def request_problems() -> list[str]:
    """What the request guards read that exists only on a built request: the attributes
    normalisation sets, the defaults of the raw-body fields, the formats of the ids SGLang mints."""
    try:
        generate_cls, embedding_cls = symbol("GenerateReqInput"), symbol("EmbeddingReqInput")
        ref_cls = symbol("LoRARef")
    except (ImportError, AttributeError):
        return []  # already reported above
    problems: list[str] = []
    defaults = getattr(generate_cls, "__dataclass_fields__", {})
    for field, default in RAW_FIELD_DEFAULTS.items():
        upstream_default = defaults[field].default if field in defaults else default
        if upstream_default is not default:
            problems.append(f"GenerateReqInput.{field} defaults to {upstream_default!r}, not {default!r}")
    try:
        # a single prompt with n=2: normalisation makes it a batch of one prompt, two samples
        generate = generate_cls(text="lora-versions-check", rid="r", sampling_params={"n": 2})
        generate.normalize_batch_and_arguments()
        embedding = embedding_cls(text="lora-versions-check")
        embedding.normalize_batch_and_arguments()
    except Exception as exc:  # a request that changed shape is a problem too
        return [*problems, f"a normalised GenerateReqInput / EmbeddingReqInput cannot be built: {exc!r}"]
    built = {"GenerateReqInput": generate, "EmbeddingReqInput": embedding}
    missing = [(o, a) for o, a in NORMALISED_ATTRIBUTES if not hasattr(built[o], a)]
    problems += [f"{o}().{a} is missing after normalize_batch_and_arguments" for o, a in missing]
    prompt_rids = [PROMPT_RID.format(rid="r", i=i) for i in range(2)]
    if getattr(generate, "rid", None) != prompt_rids:
        problems.append(f"normalisation names a request's prompts {generate.rid!r}, not {prompt_rids!r}")
    try:
        minted = {
            "LoRARef().lora_id": ref_cls(lora_name="lora-versions-check").lora_id,
            "GenerateReqInput.regenerate_rid()": generate.regenerate_rid(),
        }
    except Exception as exc:
        return [*problems, f"LoRARef() / GenerateReqInput.regenerate_rid() failed: {exc!r}"]
    for what, value in minted.items():
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) and re.fullmatch(UUID_HEX, v) for v in values):
            problems.append(f"{what} is {value!r}, not {UUID_HEX}")
    return problems


def _string_constants(code: Any) -> list[str]:
    out: list[str] = []
    for const in code.co_consts:
        if isinstance(const, str):
            out.append(const)
        elif hasattr(const, "co_consts"):
            out += _string_constants(const)
    return out


def message_problems() -> list[str]:
    """Every upstream message of :data:`MESSAGES` still among its method's string constants."""
    problems: list[str] = []
    for owner, method, text in MESSAGES:
        try:
            code = getattr(symbol(owner), method).__code__
        except (ImportError, AttributeError) as exc:
            problems.append(f"{SYMBOLS[owner][1]}.{method} (the source of {text!r}): {exc}")
            continue
        if not any(text in const for const in _string_constants(code)):
            problems.append(f"{SYMBOLS[owner][1]}.{method} no longer says {text!r}")
    return problems


def step_reader_problems() -> list[str]:
    """What the step fence reads that exists before a scheduler does: the step classes' fields,
    a fresh Req's ``lora_id``, the unload request's ``lora_id``."""
    problems = declared_field_problems(STEP_FIELDS)
    try:
        req_cls, params_cls = symbol("Req"), symbol("SamplingParams")
        unload_cls = symbol("UnloadLoRAAdapterReqInput")
    except (ImportError, AttributeError):
        return problems  # already reported above
    try:
        req = req_cls("lora-versions-check", "", array("q"), params_cls(), lora_id="L")
        problems += [f"Req().{a} is missing" for a in REQ_ATTRIBUTES if not hasattr(req, a)]
    except Exception as exc:  # a constructor that changed shape is a problem too
        problems.append(f"Req() cannot be built: {exc!r}")
    try:
        if not hasattr(unload_cls(lora_name="lora-versions-check", lora_id="L"), "lora_id"):
            problems.append("UnloadLoRAAdapterReqInput().lora_id is missing")
    except Exception as exc:
        problems.append(f"UnloadLoRAAdapterReqInput(lora_id=) cannot be built: {exc!r}")
    return problems


def scheduler_problems(scheduler: Any) -> list[str]:
    """The instance attributes of the live Scheduler the step fence and the prepared load read
    (set in its __init__, so checked at its end, in the scheduler process, before the scheduler
    reports ready)."""
    problems = [f"Scheduler.{a} is missing" for a in SCHEDULER_ATTRIBUTES if not hasattr(scheduler, a)]
    try:
        manager = lora_manager_of(scheduler)
    except AttributeError as exc:
        return [*problems, f"Scheduler.tp_worker.model_runner.lora_manager: {exc}"]
    missing = [a for a in LORA_MANAGER_ATTRIBUTES if not hasattr(manager, a)]
    problems += [f"LoRAManager.{a} is missing" for a in missing]
    if "memory_pool" in missing:
        return problems
    pool = manager.memory_pool
    return problems + [f"LoRAMemoryPool.{a} is missing" for a in POOL_ATTRIBUTES if not hasattr(pool, a)]


def tokenizer_manager_problems(tm: Any) -> list[str]:
    """The instance attributes of the live TokenizerManager this module and the guards read, and
    those of its model config."""
    missing = [a for a in TOKENIZER_MANAGER_ATTRIBUTES if not hasattr(tm, a)]
    problems = [f"TokenizerManager.{a} is missing" for a in missing]
    if hasattr(tm, "model_config"):  # else named above
        config = tm.model_config
        problems += [f"ModelConfig.{a} is missing" for a in MODEL_CONFIG_ATTRIBUTES if not hasattr(config, a)]
    return problems


# ------------------------------------------------------------------------------ accessors
# The tokenizer manager's LoRA registry (sglang.srt.lora.lora_registry.LoRARegistry): names ->
# LoRARef in ``_registry``, lora_id -> ConcurrentCounter of in-flight requests in ``_counters``.


def registered_lora_id(tm: Any, lora_name: str) -> str | None:
    ref = tm.lora_registry._registry.get(lora_name)
    return None if ref is None else ref.lora_id


def in_flight_counter(tm: Any, lora_id: str) -> Any | None:
    """The ConcurrentCounter of ``lora_id`` (``value()``, ``wait_for_zero()``), or None once gone."""
    return tm.lora_registry._counters.get(lora_id)


def drop_counter(tm: Any, lora_id: str) -> None:
    tm.lora_registry._counters.pop(lora_id, None)


def forget_cached_ref(tm: Any, lora_name: str) -> None:
    """TokenizerManager.lora_ref_cache feeds the implicit reload of an unregistered name."""
    tm.lora_ref_cache.pop(lora_name, None)


async def register(tm: Any, ref: Any) -> None:
    await tm.lora_registry.register(ref)


async def unregister(tm: Any, lora_name: str) -> None:
    await tm.lora_registry.unregister(lora_name)


def new_pinned_ref(lora_name: str) -> Any:
    """The LoRARef registered for a managed version. Its path is the sentinel ``__tensor__``,
    not the staged directory (gone once READY): a cached ref can never be implicitly reloaded."""
    return symbol("LoRARef")(lora_name=lora_name, lora_path="__tensor__", pinned=True)


# The scheduler's launched steps (sglang.srt.managers.scheduler.Scheduler, 0.5.23), read by the
# step fence. Every attribute is read as it is, never defaulted: a missing one (a rename in a pin
# bump) would otherwise read as "no launched step" and let an unload free a slot a step still
# reads. All of them exist in every mode of 0.5.23: ``enable_overlap`` is set in __init__,
# ``last_batch`` and ``result_queue`` in init_running_status (the queue, a deque of
# (ScheduleBatch, GenerationBatchResult) launched and not processed yet, is filled only by the
# overlap loops; event_loop_normal leaves it empty). ``ScheduleBatch.reqs`` and
# ``GenerationBatchResult.copy_done`` (a device event recorded after the step's forward, None
# when none was recorded) are dataclass fields; ``Req.lora_id`` (None for a base-model row) is set
# in Req.__init__.
SCHEDULER_ATTRIBUTES = ("enable_overlap", "last_batch", "result_queue", "tp_group", "tp_cpu_group")
STEP_FIELDS: tuple[tuple[str, str], ...] = (
    ("ScheduleBatch", "reqs"),
    ("GenerationBatchResult", "copy_done"),
    ("ForwardBatch", "lora_ids"),  # one per row, in ScheduleBatch.reqs order (served_version)
)
# output_ids and customized_info (None until something is collected): what the attestation of each
# output token reads and writes (sglang_ext.served_version).
REQ_ATTRIBUTES = ("lora_id", "output_ids", "customized_info")


class SchedulerUnreadable(Exception):
    """The live scheduler, a step it launched, or the unload request lacks an attribute the step
    fence reads: the fence refuses the unload rather than guess. (Also: a pool write's target
    cannot be read, and the slot zeroing falls back to upstream's whole-slot clear.)"""

    def __init__(self, attribute: str) -> None:
        super().__init__(f"{attribute} is missing")
        self.attribute = attribute


def _read(obj: Any, owner: str, attribute: str) -> Any:
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise SchedulerUnreadable(f"{owner}.{attribute}") from None


@dataclass(frozen=True)
class LaunchedStep:
    """A batch the scheduler launched: the engine-local LoRA ids its rows read, and its
    completion: True (its results were processed), a device event (``query()``,
    ``synchronize()``), or None (unknown)."""

    lora_ids: frozenset[str]
    completion: Any


def _lora_ids(batch: Any) -> frozenset[str]:
    """The adapters a batch's rows read (a base-model row has lora_id None)."""
    ids = (_read(req, "Req", "lora_id") for req in _read(batch, "ScheduleBatch", "reqs"))
    return frozenset(i for i in ids if i is not None)


def overlap_scheduler_on(scheduler: Any) -> bool:
    return bool(_read(scheduler, "Scheduler", "enable_overlap"))


def launched_steps(scheduler: Any) -> list[LaunchedStep]:
    """What the scheduler launched and has not finished processing: every queued step, with its
    result's device event, whatever the mode (only the overlap loops queue any); and
    ``last_batch``, as processed, except under the overlap scheduler while steps are queued (it is
    then the newest of them, not processed yet). Without the overlap scheduler that is at most
    ``last_batch``, processed before the next request is ingested. Raises
    :class:`SchedulerUnreadable` naming what is missing."""
    queue = list(_read(scheduler, "Scheduler", "result_queue"))
    out = [
        LaunchedStep(_lora_ids(batch), _read(result, "GenerationBatchResult", "copy_done"))
        for batch, result in queue
    ]
    last = _read(scheduler, "Scheduler", "last_batch")
    if last is not None and (not overlap_scheduler_on(scheduler) or not queue):
        out.append(LaunchedStep(_lora_ids(last), True))
    return out


def unload_lora_id(recv_req: Any) -> str | None:
    """The engine-local id an unload names (UnloadLoRAAdapterReqInput.lora_id)."""
    return _read(recv_req, "UnloadLoRAAdapterReqInput", "lora_id")


def unload_refused(message: str) -> Any:
    """A scheduler's reply to an unload it did not do (merged by the tokenizer like any rank's)."""
    return symbol("LoRAUpdateOutput")(success=False, error_message=message)


def load_from_dir_request(ref: Any, adapter_dir: str, rid: str | None = None) -> Any:
    """SGLang's stock path load (``Scheduler.load_lora_adapter`` -> ``LoRAManager.load_lora_adapter``,
    weights through ``DefaultModelLoader``) of ``adapter_dir`` under ``ref``'s name and id, pinned.
    ``rid`` (``BaseReq.rid``, unused by a LoRA update upstream) carries the plugin's op
    (``prepared_load``)."""
    return symbol("LoadLoRAAdapterReqInput")(
        lora_name=ref.lora_name, lora_path=adapter_dir, pinned=True, lora_id=ref.lora_id, rid=rid
    )


def load_request_fields(recv_req: Any) -> tuple[Any, Any, Any, Any]:
    """(rid, lora_name, lora_path, lora_id) of a LoadLoRAAdapterReqInput, as the scheduler got it."""
    return recv_req.rid, recv_req.lora_name, recv_req.lora_path, recv_req.lora_id


def ref_fields(lora_ref: Any) -> tuple[Any, Any, Any]:
    """(lora_id, lora_name, lora_path) of a LoRARef (``LoadLoRAAdapterReqInput.to_ref()``)."""
    return lora_ref.lora_id, lora_ref.lora_name, lora_ref.lora_path


def rank_loaded(rank_result: Any, lora_name: str) -> bool:
    """Whether a scheduler rank's reply to a load (LoRAUpdateOutput) says it holds ``lora_name``:
    it succeeded, or its ``loaded_adapters`` (name -> path; None when it sent none) names it."""
    return bool(rank_result.success) or lora_name in (rank_result.loaded_adapters or {})


def lora_update_output(
    success: bool, message: str | None = None, loaded_adapters: dict[str, str] | None = None
) -> Any:
    """A scheduler's reply to a LoRA update (merged by the tokenizer like any rank's)."""
    return symbol("LoRAUpdateOutput")(success=success, error_message=message, loaded_adapters=loaded_adapters)


def take_back_a_load(scheduler: Any, lora_name: str, lora_id: str) -> Any:
    """SGLang's own unload of one load on this rank only (0.5.23: ``TpModelWorker.unload_lora_adapter``
    -> ``LoRAManager.unload_lora_adapter``), not ``Scheduler.unload_lora_adapter``, whose step fence
    waits for every rank. For a load no request could have used (never registered)."""
    return scheduler.tp_worker.unload_lora_adapter(unload_request(lora_name, lora_id))


# The scheduler's tensor-parallel group (0.5.23, set in Scheduler.__init__): ``tp_group`` (a
# GroupCoordinator; ``world_size``) and ``tp_cpu_group`` (its gloo group, which SGLang itself
# broadcasts the requests over). Read by the rank agreement (sglang_ext.rank_agreement).
def tp_peers(scheduler: Any) -> tuple[int, Any] | None:
    """(TP world size, the TP group's CPU group) when the scheduler has more than one TP rank."""
    size = int(scheduler.tp_group.world_size)
    return None if size <= 1 else (size, scheduler.tp_cpu_group)


def tp_rank(scheduler: Any) -> int:
    """This scheduler's rank in its TP group (``GroupCoordinator.rank_in_group``)."""
    return int(scheduler.tp_group.rank_in_group)


def all_reduce_min(value: int, cpu_group: Any) -> int:
    import torch
    import torch.distributed

    tensor = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
    return int(tensor.item())


def all_gather_object(out: list[Any], obj: Any, cpu_group: Any) -> None:
    import torch.distributed

    torch.distributed.all_gather_object(out, obj, group=cpu_group)


def unload_request(lora_name: str, lora_id: str) -> Any:
    # lora_id must be set: the scheduler builds a LoRARef from it and a None id raises there.
    return symbol("UnloadLoRAAdapterReqInput")(lora_name=lora_name, lora_id=lora_id)


async def fan_out(tm: Any, request: Any) -> tuple[Any, list[Any]]:
    """Send a load/unload to every scheduler rank: (merged result, per-rank results)."""
    tm.auto_create_handle_loop()
    ranks = await tm.update_lora_adapter_communicator(request)
    return symbol("merge_lora_update_results")(ranks), ranks


def generation_request(lora_name: str, input_ids: list[int], max_new_tokens: int) -> Any:
    return symbol("GenerateReqInput")(
        input_ids=list(input_ids),
        sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0},
        lora_path=lora_name,
    )


def generate(tm: Any, request: Any) -> AsyncIterator[dict]:
    return tm.generate_request(request, None)


def resolved_lora_id(request: Any) -> str | None:
    """The lora_id SGLang resolved a generation to (set at its acquire point)."""
    lora_id = request.lora_id
    return lora_id if isinstance(lora_id, str) else None


def is_generation(request: Any) -> bool:
    """True for a GenerateReqInput, False for an EmbeddingReqInput: the two request types
    TokenizerManager.generate_request takes, whose fields differ (an embedding request has no
    parallel samples, logprobs or extra_key). Any other type is a TypeError, not a guess."""
    if isinstance(request, symbol("GenerateReqInput")):
        return True
    if isinstance(request, symbol("EmbeddingReqInput")):
        return False
    raise TypeError(f"not an SGLang generation or embedding request: {type(request).__name__}")


def internal_fields(request: Any) -> tuple[str, ...]:
    """The fields of :data:`INTERNAL_FIELDS` that ``request``'s type declares."""
    return INTERNAL_FIELDS if is_generation(request) else EMBEDDING_INTERNAL_FIELDS


def normalised(request: Any) -> bool:
    """Whether ``request`` went through normalize_batch_and_arguments, by SGLang's own test
    (``TokenizerManager._init_req_state``: a sub-request ``obj[i]`` has no ``is_single``). The
    start check proves normalisation sets it (:data:`NORMALISED_ATTRIBUTES`), so a rename refuses
    the start rather than reading every request as a sub-request."""
    return hasattr(request, "is_single")


def base_hf_config(tm: Any) -> Any:
    return tm.model_config.hf_config


def base_serving(tm: Any) -> tuple[str, str | None]:
    """(dtype, quantization) the base model runs with: ``ModelConfig.dtype`` (the resolved torch
    dtype) and ``ModelConfig.quantization`` (sglang.srt.configs.model_config, 0.5.23)."""
    return str(tm.model_config.dtype), tm.model_config.quantization


def vocab_size(tm: Any) -> int:
    return int(tm.model_config.vocab_size)


def normalize_stop_regex(tm: Any, stop_regex: Any) -> None:
    """SGLang's own normalisation of a request's ``stop_regex`` (SamplingParams.normalize: its caps
    on count and length, a ValueError, then the parse that measures each pattern, an re.error),
    as TokenizerManager._create_tokenized_object runs it later for every request."""
    symbol("SamplingParams")(stop_regex=stop_regex).normalize(tm.tokenizer)


def normalized_target_modules(targets: Any) -> set[str]:
    return symbol("get_normalized_target_modules")(targets)


def is_incompatible_message(message: str) -> bool:
    return any(marker in message for marker in INCOMPATIBLE_MESSAGE_MARKERS)


def lora_released(state: Any) -> bool:
    return bool(state.lora_released)


def mark_lora_released(state: Any) -> None:
    state.lora_released = True


def acquired_lora_id(state: Any) -> Any:
    return state.obj.lora_id


def openai_lora_path(serving: Any, request: Any) -> Any:
    """The lora_path an OpenAI request resolves to (``model="base:adapter"`` or ``lora_path``)."""
    return serving._resolve_lora_path(request.model, request.lora_path)


def resolved_server_args(server_args: Any) -> Any:
    return symbol("resolving_view")(server_args)


def http_app() -> Any:
    return symbol("http_app")


def metrics_enabled() -> bool:
    """True when SGLang serves /metrics (``--enable-metrics``): the same switch
    ``http_server._setup_and_run_http_server`` reads before ``add_prometheus_middleware``."""
    return bool(symbol("get_observability")().enable_metrics)


# Upstream copy: sglang.srt.utils.common:add_prometheus_middleware (sglang 0.5.23).
# Changed: the collectors passed in are registered on the CollectorRegistry it builds (one loop,
# before the Mount); the rest is upstream's, line for line.
# Why: that registry is local to the function and is the one /metrics collects, so the plugin's
# per-version series (which must be able to end) can only be served by a collector on it.
def mount_metrics_route(app: Any, collectors: tuple[Any, ...]) -> None:
    """``sglang.srt.utils.common.add_prometheus_middleware`` (0.5.23) line for line, with
    ``collectors`` on the registry it builds. That registry, not prometheus_client's default, is
    what SGLang's /metrics collects (a ``MultiProcessCollector`` reading the multiprocess
    directory), and it is local to that function: a series that must be able to end (the
    plugin's per-version series) can only be served by a collector on it."""
    # Imported here, as upstream does: prometheus_client only after SGLang has set
    # PROMETHEUS_MULTIPROC_DIR, and neither is imported on the trainer side.
    from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess
    from starlette.routing import Mount

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    for collector in collectors:
        registry.register(collector)
    metrics_route = Mount("/metrics", make_asgi_app(registry=registry))
    # upstream's workaround for a 307 redirect of /metrics
    metrics_route.path_regex = re.compile("^/metrics(?P<path>.*)$")
    app.routes.append(metrics_route)


def admin_optional(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Guard a route like SGLang's own LoRA control endpoints (ADMIN_OPTIONAL)."""
    return symbol("auth_level")(symbol("AuthLevel").ADMIN_OPTIONAL)(endpoint)


def register_hook(target: str, hook: Callable[..., Any], kind: str) -> None:
    """``kind``: BEFORE, AFTER, AROUND or REPLACE (sglang.srt.plugins.hook_registry.HookType)."""
    symbol("HookRegistry").register(target, hook, getattr(symbol("HookType"), kind))


def unapplied_hooks(targets: tuple[str, ...]) -> list[str]:
    """HookRegistry.apply_hooks logs and skips a target it cannot patch; we fail closed instead."""
    patched = symbol("HookRegistry")._patched
    return [t for t in targets if t not in patched]


# Upstream copy: sglang.srt.lora.lora_registry:LoRARegistry.lru_lora_name (sglang 0.5.23).
# Changed: a name ``may_evict`` refuses is skipped (one more ``continue``), and the
# ``exclude_pinned=False`` case walks the registry as the pinned case does instead of taking its
# first name (the same name whenever nothing is refused).
# Why: a managed version is never an eviction candidate; its removal is reclaim's or cleanup's
# (upstream's later ``LoRARef.reloadable`` expresses the same rule: see the module docstring).
async def lru_lora_name_never_managed(
    registry: Any, exclude_pinned: bool, may_evict: Callable[[str], bool]
) -> str | None:
    """LoRARegistry.lru_lora_name (0.5.23) with one more rule: a name ``may_evict`` refuses is
    skipped. Same body as upstream otherwise (reader lock, LRU order)."""
    async with registry._registry_lock.reader_lock:
        for name, ref in registry._registry.items():
            if exclude_pinned and ref.pinned:
                continue
            if not may_evict(name):
                continue
            return name
    return None


# ----------------------------------------------------------------- no device-wide cache flush


# upstream's own logger for these lines (same name, so the same level and handlers)
_lora_manager_log = logging.getLogger("sglang.srt.lora.lora_manager")


def _available_memory_gb(manager: Any) -> float:
    """What LoRAManager's log lines report (0.5.23: get_available_gpu_memory(device.type,
    device.index)), read without its default torch.cuda.empty_cache()."""
    # on use, as every SGLang read of this module: nothing from SGLang at import (module docstring)
    from sglang.srt.utils import get_available_gpu_memory

    return float(get_available_gpu_memory(manager.device.type, manager.device.index, empty_cache=False))


def _log_lora_update(what: str, manager: Any, lora_ref: Any) -> None:
    # the text of upstream's lines, which the step fence's log line and the tests read
    _lora_manager_log.info(
        f"LoRA adapter {what}: {lora_ref}. avail mem={_available_memory_gb(manager):.2f} GB"
    )


# Upstream copy: sglang.srt.lora.lora_manager:LoRAManager.load_lora_adapter (sglang 0.5.23).
# Changed: the two log lines read the free memory with ``empty_cache=False``
# (:func:`_available_memory_gb`); an adapter prepared off the scheduler thread is installed
# (:func:`install_prepared`) instead of built by ``_load_lora_adapter`` (``prepared=None``: upstream's).
# Why: no device-wide cache flush on the scheduler thread around a load (issue 29), and the disk
# reads and re-shaping off that thread (:mod:`sglang_ext.prepared_load`).
def load_without_a_cache_flush(manager: Any, lora_ref: Any, prepared: Any = None) -> Any:
    """LoRAManager.load_lora_adapter (0.5.23) with the same two log lines, their memory read
    without a cache flush; the load itself is upstream's _load_lora_adapter, or, for an adapter
    prepared off the scheduler thread, its install (:func:`install_prepared`)."""
    _log_lora_update("loading starts", manager, lora_ref)
    if prepared is None:
        result = manager._load_lora_adapter(lora_ref)
    else:
        result = install_prepared(manager, lora_ref, prepared)
    _log_lora_update("loading completes", manager, lora_ref)
    return result


# Upstream copy: sglang.srt.lora.lora_manager:LoRAManager.unload_lora_adapter (sglang 0.5.23).
# Changed: the two log lines read the free memory with ``empty_cache=False``; the unload itself is
# upstream's ``_unload_lora_adapter``.
# Why: no device-wide cache flush on the scheduler thread around an unload (issue 29).
def unload_without_a_cache_flush(manager: Any, lora_ref: Any) -> Any:
    """LoRAManager.unload_lora_adapter (0.5.23), the same way."""
    _log_lora_update("unloading starts", manager, lora_ref)
    result = manager._unload_lora_adapter(lora_ref)
    _log_lora_update("unloading completes", manager, lora_ref)
    return result


# ------------------------------------------------------------- a load prepared off the loop
# LoRAManager (sglang.srt.lora.lora_manager, 0.5.23): the attributes the prepared load reads.
# Set in __init__ and read-only afterwards: base_hf_config, load_config, lora_backend, base_model
# (what LoRAManager.load_lora_weights hands to LoRAAdapter), speculative_algorithm. Its state:
# loras / configs / lora_refs (lora_id -> LoRAAdapter / LoRAConfig / LoRARef), num_pinned_loras;
# and validate_new_adapter, create_lora_update_result.
LORA_MANAGER_ATTRIBUTES = (
    "base_hf_config",
    "load_config",
    "lora_backend",
    "base_model",
    "speculative_algorithm",
    "loras",
    "configs",
    "lora_refs",
    "num_pinned_loras",
    "validate_new_adapter",
    "create_lora_update_result",
    "memory_pool",
)


def lora_manager_of(scheduler: Any) -> Any:
    """The scheduler's LoRAManager (Scheduler.tp_worker -> TpModelWorker.model_runner ->
    ModelRunner.lora_manager)."""
    return scheduler.tp_worker.model_runner.lora_manager


@dataclass(frozen=True)
class PreparedAdapter:
    """What upstream's _load_lora_adapter builds before it touches the manager's state."""

    config: Any  # LoRAConfig
    adapter: Any  # LoRAAdapter, weights read and normalised


# Upstream copy: the two builds of sglang.srt.lora.lora_manager:LoRAManager._load_lora_adapter
# (``LoRAConfig(...)``) and LoRAManager.load_lora_weights (``LoRAAdapter(...)``,
# ``initialize_weights()``), sglang 0.5.23.
# Changed: both run in a closure over the manager's fixed configuration, on another thread, and
# before ``validate_new_adapter`` (upstream validates the config before it reads the weights: an
# incompatible adapter's weights are read here and then refused, with no state changed).
# Why: the safetensors reads and re-shaping are the slow part of a load and touch no state a step
# uses; the scheduler thread only installs (:func:`install_prepared`).
def adapter_builder(manager: Any, lora_id: str, lora_path: str) -> Callable[[], PreparedAdapter]:
    """Upstream's build of an adapter from disk (0.5.23: ``LoRAConfig(path, base_vocab_size=)`` in
    _load_lora_adapter, then load_lora_weights' ``LoRAAdapter(...)`` and ``initialize_weights()``:
    the safetensors reads and the q/k/v and gate/up re-shaping), as a function of nothing but what
    is read here, on the scheduler thread: the manager's fixed configuration. It reads no state a
    step uses, so it may run on another thread."""
    config_cls, adapter_cls = symbol("LoRAConfig"), symbol("LoRAAdapter")
    base_hf_config, load_config = manager.base_hf_config, manager.load_config
    lora_backend, base_model = manager.lora_backend, manager.base_model

    def build() -> PreparedAdapter:
        config = config_cls(lora_path, base_vocab_size=base_hf_config.vocab_size)
        adapter = adapter_cls(
            lora_id, config, base_hf_config, load_config, lora_backend, base_model=base_model
        )
        adapter.initialize_weights()
        return PreparedAdapter(config, adapter)

    return build


# Upstream copy: sglang.srt.lora.lora_manager:LoRAManager._load_lora_adapter with the state half
# of LoRAManager.load_lora_weights (sglang 0.5.23).
# Changed: the config and the adapter come built (:func:`adapter_builder`); the failure path also
# pops what it had set (``configs``, ``loras``, ``lora_refs`` of the id); the second assert's
# message is shortened. Same validation, same state, same order, same result type.
# Why: the scheduler thread only installs what was prepared off it, and a failed install leaves
# nothing of the adapter behind (upstream keeps ``configs[lora_id]``).
def install_prepared(manager: Any, lora_ref: Any, prepared: PreparedAdapter) -> Any:
    """LoRAManager._load_lora_adapter (0.5.23) with its two builds (config, weights) already done:
    the same validation against the live pool, then the same state, in the same order. On a
    failure nothing of it stays (upstream would keep ``configs[lora_id]``)."""
    lora_id = lora_ref.lora_id
    assert lora_ref.lora_name is not None and lora_ref.lora_path is not None
    assert lora_id not in manager.loras, f"LoRA adapter with ID {lora_id} is already loaded"
    try:
        manager.validate_new_adapter(prepared.config, lora_ref)
        manager.configs[lora_id] = prepared.config
        symbol("warn_if_adapter_targets_embeddings")(
            lora_name=lora_ref.lora_name,
            embedding_layer_names=prepared.adapter.embedding_layers.keys(),
            speculative_algorithm=manager.speculative_algorithm,
        )
        manager.loras[lora_id] = prepared.adapter
        manager.lora_refs[lora_id] = lora_ref
        manager.num_pinned_loras += int(lora_ref.pinned)
    except Exception as e:
        manager.configs.pop(lora_id, None)
        manager.loras.pop(lora_id, None)
        manager.lora_refs.pop(lora_id, None)
        return manager.create_lora_update_result(success=False, error_message=str(e))
    return manager.create_lora_update_result(success=True)


# LoRAMemoryPool's buffers (0.5.23, set in __init__ / init_buffers), as the slot zeroing groups
# them by where a slot's ranks lie: rank-major ("A": [slots, max_rank * c, in]) or rank-minor ("B":
# [slots, out, max_rank]); A_buffer / B_buffer hold one tensor per layer per module, the embedding
# and lm_head ones one per module (empty unless those are targeted). new_embeddings_buffer holds
# added-token rows, written by count of added tokens, not by rank.
POOL_RANK_MAJOR = ("embedding_A_buffer", "lm_head_A_buffer")
POOL_RANK_MINOR = ("embedding_B_buffer", "lm_head_B_buffer")
# What the slot zeroing reads of the live pool (LoRAManager.memory_pool), checked with the scheduler
# (scheduler_problems): a missing one would only send every clear back to upstream's whole slot,
# but the log line of each clear reads max_lora_rank as it is.
POOL_ATTRIBUTES = (
    "max_loras_per_batch",
    "max_lora_rank",
    "tp_rank",  # named in the slot zeroing's log line (each TP rank clears its own pool)
    "buffer_id_to_uid",  # what each slot holds (served_version names a row's slot by it)
    "new_embeddings_buffer",
    "A_buffer",
    "B_buffer",
    *POOL_RANK_MAJOR,
    *POOL_RANK_MINOR,
)


def pool_slot_count(pool: Any) -> int | None:
    slots = getattr(pool, "max_loras_per_batch", None)
    return slots if isinstance(slots, int) and slots > 0 else None


def pool_rank_buffers(pool: Any) -> tuple[list[Any], list[Any], int] | None:
    """A pool's rank-major and rank-minor buffers and its max rank, when those are all it has
    (None with added-token buffers, or when an attribute is missing)."""
    try:
        if pool.new_embeddings_buffer:
            return None
        major = [t for tensors in pool.A_buffer.values() for t in tensors]
        minor = [t for tensors in pool.B_buffer.values() for t in tensors]
        major += [t for name in POOL_RANK_MAJOR for t in getattr(pool, name).values()]
        minor += [t for name in POOL_RANK_MINOR for t in getattr(pool, name).values()]
        return major, minor, pool.max_lora_rank
    except AttributeError:
        return None


def load_to_buffer_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(uid, buffer_id, the adapter's rank) of a LoRAMemoryPool.load_lora_weight_to_buffer call
    (0.5.23: ``(self, uid, buffer_id, lora_adapter, lora_modules, ...)``; the rank it writes is
    ``lora_adapter.config.r``; uid None is the base model, with no adapter)."""
    names = ("uid", "buffer_id", "lora_adapter")
    values = list(args[:3]) + [kwargs[n] for n in names[len(args[:3]) :] if n in kwargs]
    if len(values) != 3:
        raise SchedulerUnreadable("load_lora_weight_to_buffer(uid, buffer_id, lora_adapter)")
    uid, slot, adapter = values
    if uid is None:
        return None, slot, 0
    try:
        return uid, slot, adapter.config.r
    except AttributeError as exc:
        raise SchedulerUnreadable("lora_adapter.config.r") from exc


def loaded_adapter(manager: Any, lora_ref: Any) -> Any | None:
    """The LoRAAdapter the manager holds for ``lora_ref``'s id (None: not loaded)."""
    return manager.loras.get(lora_ref.lora_id)


# ------------------------------------------------------------------ what served each reply
# sglang_ext.served_version (issue 39). Read on the scheduler thread, once per forward step.


def backend_batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(weight_indices, lora_ranks) of a backend's prepare_lora_batch call (``args`` without
    self); raises :class:`SchedulerUnreadable` when the call does not carry them."""
    values = dict(zip(BACKEND_PREPARE_PARAMETERS, args, strict=False))
    values.update({k: kwargs[k] for k in BACKEND_PREPARE_PARAMETERS if k in kwargs})
    try:
        return values["weight_indices"], values["lora_ranks"]
    except KeyError as missing:
        raise SchedulerUnreadable(f"prepare_lora_batch({missing.args[0]})") from None


def forward_lora_ids(forward_batch: Any) -> list[Any]:
    return list(_read(forward_batch, "ForwardBatch", "lora_ids"))


def batch_reqs(batch: Any) -> list[Any]:
    return list(_read(batch, "ScheduleBatch", "reqs"))


def slot_lora_names(manager: Any) -> list[str | None]:
    """Per slot of the LoRA pool, the name of the adapter it holds now; None for the base model's
    slot, an empty slot, or an adapter the manager has no ref for."""
    holders = _read(_read(manager, "LoRAManager", "memory_pool"), "LoRAMemoryPool", "buffer_id_to_uid")
    refs = _read(manager, "LoRAManager", "lora_refs")
    names: list[str | None] = []
    for uid in holders:
        ref = refs.get(uid) if isinstance(uid, str) else None
        name = getattr(ref, "lora_name", None)
        names.append(name if isinstance(name, str) else None)
    return names


def served_token_entries(req: Any) -> list[Any]:
    """The request's per-token entries of what served it, in its ``customized_info`` (created on
    first use: upstream leaves it None until something is collected)."""
    info = _read(req, "Req", "customized_info")
    if info is None:
        info = req.customized_info = {}
    return info.setdefault(SERVED_TOKENS_KEY, [])


def output_token_count(req: Any) -> int:
    return len(_read(req, "Req", "output_ids"))
