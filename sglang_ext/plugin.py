"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] lora_versions``).

SGLang calls :func:`register` in its main, scheduler and detokenizer processes (``load_plugins``).
The plugin is **off unless** ``SGLANG_LORA_VERSIONS=1`` is set in the engine's environment: off, it
registers nothing and SGLang behaves exactly as stock. On, it

- refuses an SGLang version other than the pinned one (the hooks depend on 0.5.23 internals);
- refuses setups the lifecycle cannot make safe (see :mod:`sglang_ext.setup_checks`);
- logs one line per process, and mounts the ``/lora_versions`` routes in the main process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from importlib.metadata import version as dist_version
from typing import NoReturn

from sglang_ext import PINNED_SGLANG_VERSION

SWITCH_ENV = "SGLANG_LORA_VERSIONS"

logger = logging.getLogger("sglang_ext")


def is_enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def log_line(message: str) -> None:
    """One line in the engine log. stderr rather than ``logging``: SGLang configures its logging
    only after load_plugins, and stderr lands in the engine log in every process."""
    print(f"[lora-versions] {message}", file=sys.stderr, flush=True)


def process_role() -> str:
    """Which SGLang process is loading us: main, scheduler, detokenizer (or another child)."""
    from sglang_ext.lora_registry_patch import PROCESS_ENTRY_FUNCTIONS

    if multiprocessing.parent_process() is None:
        return "main"
    frame = sys._getframe(1)
    while frame is not None:
        role = PROCESS_ENTRY_FUNCTIONS.get(frame.f_code.co_name)
        if role is not None:
            return role
        frame = frame.f_back
    return "subprocess"


REFUSED_EXIT_CODE = 3


def refuse_to_start(message: str) -> NoReturn:
    """Stop the engine at start with a clear message and a non-zero exit code.

    Called only before SGLang has spawned any child process (plugin load, argument checks), so
    there is nothing to clean up, or in the scheduler process before it reports ready (the step
    fence's start check): SGLang's main process then sees the scheduler die during initialization
    (it reports this exit code) and ends the engine itself.

    ``os._exit`` rather than ``SystemExit``: SGLang's plugin loader would log and swallow an
    ordinary exception, and a SystemExit was seen to linger for minutes in interpreter shutdown
    (atexit work of modules imported by then) before the process ended.
    """
    log_line(f"REFUSED TO START: {message}")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(REFUSED_EXIT_CODE)


def check_sglang_version() -> None:
    installed = dist_version("sglang")
    if installed != PINNED_SGLANG_VERSION:
        refuse_to_start(
            f"sglang=={installed} is installed but the lora-versions plugin is pinned to "
            f"sglang=={PINNED_SGLANG_VERSION} (its hooks depend on that version's internals). "
            f"Install sglang=={PINNED_SGLANG_VERSION} or unset {SWITCH_ENV}."
        )


def register() -> None:
    if not is_enabled():
        return
    check_sglang_version()
    role = process_role()
    from sglang_ext.engine_state import engine_state

    incarnation = engine_state().incarnation if role == "main" else "-"
    log_line(f"plugin active in {role} process (pid {os.getpid()}, incarnation {incarnation})")

    from sglang_ext import hooks, lora_registry_patch

    if role == "main":
        problems = lora_registry_patch.surface_problems()
        if problems:
            refuse_to_start(
                f"the installed SGLang lacks {len(problems)} internal(s) the plugin depends on: "
                + "; ".join(problems)
            )
    hooks.register_all(role)
