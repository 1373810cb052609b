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

MAIN_PROCESS_TARGETS = (CHECK_SERVER_ARGS, SETUP_HTTP_SERVER)


def refuse_unsupported_setup(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ServerArgs.check_server_args: called by Engine._launch_subprocesses in the main
    process after ``resolve_once()``, so the view below holds the resolved values."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    from sglang_ext.plugin import RefusedToStart
    from sglang_ext.setup_checks import setup_problems

    verify_hooks_applied(MAIN_PROCESS_TARGETS)
    problems = setup_problems(resolving_view(server_args))
    if problems:
        raise RefusedToStart("; ".join(problems))
    return None


def mount_lora_versions_routes(*args: Any, **kwargs: Any) -> None:
    """BEFORE http_server._setup_and_run_http_server: the FastAPI app exists and uvicorn has not
    started yet, so routes added here are served (and covered by SGLang's auth middleware)."""
    from sglang.srt.entrypoints.http_server import app

    from sglang_ext.http_routes import mount

    mount(app)
    return None


def verify_hooks_applied(targets: tuple[str, ...]) -> None:
    """HookRegistry.apply_hooks logs and skips a target it cannot patch; we fail closed instead."""
    from sglang_ext.plugin import RefusedToStart

    missing = [t for t in targets if t not in HookRegistry._patched]
    if missing:
        raise RefusedToStart(f"hooks could not be applied to {missing}; is this sglang==0.5.23?")


def register_all(role: str) -> None:
    if role == "main":
        HookRegistry.register(CHECK_SERVER_ARGS, refuse_unsupported_setup, HookType.BEFORE)
        HookRegistry.register(SETUP_HTTP_SERVER, mount_lora_versions_routes, HookType.BEFORE)
