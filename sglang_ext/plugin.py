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

from sglang_ext import PINNED_SGLANG_VERSION
from sglang_ext.plugin_log import log_line, refuse_to_start
from sglang_ext.settings import PLUGIN_SWITCH_ENV, SWITCHES, number_problems, switch, switch_problems

SWITCH_ENV = PLUGIN_SWITCH_ENV

logger = logging.getLogger("sglang_ext")


def is_enabled() -> bool:
    return switch(SWITCH_ENV)


def process_role() -> str:
    """Which SGLang process is loading us: main, scheduler, detokenizer (or another child)."""
    # Here and below, imported only once the switch is on: SGLang loads this entry point in every
    # process of every engine, and an engine without the switch loads nothing more of the plugin.
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


def check_sglang_version() -> None:
    installed = dist_version("sglang")
    if installed != PINNED_SGLANG_VERSION:
        refuse_to_start(
            f"sglang=={installed} is installed but the lora-versions plugin is pinned to "
            f"sglang=={PINNED_SGLANG_VERSION} (its hooks depend on that version's internals). "
            f"Install sglang=={PINNED_SGLANG_VERSION} or unset {SWITCH_ENV}."
        )


def register() -> None:
    # Checked before the switch is read: a malformed switch (SGLANG_LORA_VERSIONS=of) refuses
    # the start rather than leaving the plugin off, or another switch silently at its default.
    problems = switch_problems(names=SWITCHES if is_enabled() else (SWITCH_ENV,))
    if problems:
        refuse_to_start("malformed switch: " + "; ".join(problems))
    if not is_enabled():
        return
    # Read at start, so a malformed limit or deadline refuses the engine rather than failing
    # the first request that reads it.
    problems = number_problems()
    if problems:
        refuse_to_start("malformed setting: " + "; ".join(problems))
    check_sglang_version()
    role = process_role()
    from sglang_ext.engine_state import engine_state  # only with the switch on (process_role)

    incarnation = engine_state().incarnation if role == "main" else "-"
    log_line(f"plugin active in {role} process (pid {os.getpid()}, incarnation {incarnation})")

    from sglang_ext import hooks, lora_registry_patch  # only with the switch on (process_role)

    if role == "main":
        problems = lora_registry_patch.surface_problems()
        if problems:
            refuse_to_start(
                f"the installed SGLang lacks {len(problems)} internal(s) the plugin depends on: "
                + "; ".join(problems)
            )
    hooks.register_all(role)
