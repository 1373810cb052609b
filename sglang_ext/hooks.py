"""Every hook the plugin places on SGLang, in one list.

Each hook is small, named after what it guards, and says which upstream symbol (SGLang 0.5.23)
it depends on. Hooks go through SGLang's own ``HookRegistry``; no installed file is edited.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

# Upstream symbols this module patches (all in sglang==0.5.23).
CHECK_SERVER_ARGS = "sglang.srt.server_args.ServerArgs.check_server_args"
SETUP_HTTP_SERVER = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"

LOAD_ADAPTER = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.load_lora_adapter"
LOAD_ADAPTER_FROM_TENSORS = (
    "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.load_lora_adapter_from_tensors"
)
UNLOAD_ADAPTER = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.unload_lora_adapter"

_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
GENERATE_REQUEST = f"{_TM}.generate_request"
INIT_REQ_STATE = f"{_TM}._init_req_state"
RESOLVE_LORA_PATH = f"{_TM}._resolve_lora_path"
RELEASE_LORA_ONCE = f"{_TM}._release_lora_once"
LRU_LORA_NAME = "sglang.srt.lora.lora_registry.LoRARegistry.lru_lora_name"
SERVE_GENERATE = "sglang.srt.entrypoints.http_server.serve_generate_request"
OPENAI_HANDLE_REQUEST = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"

MAIN_PROCESS_TARGETS = (
    CHECK_SERVER_ARGS,
    SETUP_HTTP_SERVER,
    LOAD_ADAPTER,
    LOAD_ADAPTER_FROM_TENSORS,
    UNLOAD_ADAPTER,
    GENERATE_REQUEST,
    INIT_REQ_STATE,
    RESOLVE_LORA_PATH,
    RELEASE_LORA_ONCE,
    LRU_LORA_NAME,
    SERVE_GENERATE,
    OPENAI_HANDLE_REQUEST,
)


def refuse_unsupported_setup(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ServerArgs.check_server_args: called by Engine._launch_subprocesses in the main
    process after ``resolve_once()``, so the view below holds the resolved values."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    from sglang_ext.plugin import refuse_to_start
    from sglang_ext.setup_checks import setup_problems

    verify_hooks_applied(MAIN_PROCESS_TARGETS)
    problems = setup_problems(resolving_view(server_args))
    if problems:
        refuse_to_start("; ".join(problems))
    return None


def mount_lora_versions_routes(server_args: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE http_server._setup_and_run_http_server(server_args, tokenizer_manager, ...): the
    FastAPI app exists and uvicorn has not started, so routes added here are served (and covered
    by SGLang's auth middleware, which it adds later in that same function)."""
    from sglang.srt.entrypoints.http_server import app

    from sglang_ext.http_routes import mount

    mount(app, server_args, tokenizer_manager)
    return None


async def refuse_managed_names_on_stock_lora_api(
    original: Any, self: Any, obj: Any, *args: Any, **kwargs: Any
):
    """AROUND TokenizerControlMixin.load_lora_adapter / load_lora_adapter_from_tensors /
    unload_lora_adapter (the methods behind SGLang's /load_lora_adapter,
    /load_lora_adapter_from_tensors and /unload_lora_adapter). A managed version is created only
    by staged publication and removed only by cleanup or reclaim; an ordinary call naming one is
    MANAGED_ADAPTER and changes nothing. Other names keep stock behaviour."""
    from sglang_ext.errors import ErrorCode, LoraVersionError
    from sglang_ext.protocol import is_managed_name

    # The plugin itself never calls these methods (managed loads and unloads go through the
    # scheduler fan-out in native_lora), so there is no exception to make.
    name = getattr(obj, "lora_name", None)
    if isinstance(name, str) and is_managed_name(name):
        raise LoraVersionError(
            ErrorCode.MANAGED_ADAPTER,
            f"{name!r} is a managed LoRA version: it is published and reclaimed only through /lora_versions",
            lora_name=name,
        )
    return await original(self, obj, *args, **kwargs)


def verify_hooks_applied(targets: tuple[str, ...]) -> None:
    """HookRegistry.apply_hooks logs and skips a target it cannot patch; we fail closed instead."""
    from sglang_ext.plugin import refuse_to_start

    missing = [t for t in targets if t not in HookRegistry._patched]
    if missing:
        refuse_to_start(f"hooks could not be applied to {missing}; is this sglang==0.5.23?")


def register_all(role: str) -> None:
    if role == "main":
        HookRegistry.register(CHECK_SERVER_ARGS, refuse_unsupported_setup, HookType.BEFORE)
        HookRegistry.register(SETUP_HTTP_SERVER, mount_lora_versions_routes, HookType.BEFORE)
        for target in (LOAD_ADAPTER, LOAD_ADAPTER_FROM_TENSORS, UNLOAD_ADAPTER):
            HookRegistry.register(target, refuse_managed_names_on_stock_lora_api, HookType.AROUND)

        from sglang_ext import tokenizer_hooks as th

        HookRegistry.register(GENERATE_REQUEST, th.refuse_forged_internal_fields, HookType.AROUND)
        HookRegistry.register(INIT_REQ_STATE, th.refuse_mismatched_lora_path, HookType.BEFORE)
        HookRegistry.register(RESOLVE_LORA_PATH, th.serve_only_ready_managed_versions, HookType.AROUND)
        HookRegistry.register(RELEASE_LORA_ONCE, th.release_only_what_was_acquired, HookType.AROUND)
        HookRegistry.register(LRU_LORA_NAME, th.lru_never_picks_managed, HookType.REPLACE)
        HookRegistry.register(SERVE_GENERATE, th.precheck_generate, HookType.AROUND)
        HookRegistry.register(OPENAI_HANDLE_REQUEST, th.precheck_openai, HookType.AROUND)
