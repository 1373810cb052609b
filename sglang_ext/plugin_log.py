"""How the plugin speaks in an engine's log, and how it refuses to start: a leaf module (it imports
nothing of the plugin), so every module can report without importing the entry point.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def log_line(message: str) -> None:
    """One line in the engine log. stderr rather than ``logging``: SGLang configures its logging
    only after load_plugins, and stderr lands in the engine log in every process. One write of
    the whole line, newline included: ``print`` writes the newline apart, and a TP engine's ranks
    (processes sharing that stderr) then glued two ranks' lines into one."""
    sys.stderr.write(f"[lora-versions] {message}\n")
    sys.stderr.flush()


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
