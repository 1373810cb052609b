"""Run SGLang's HTTP server (plugin on) with :mod:`step_fence_probe` installed in its scheduler
process: the same steps as ``python -m sglang.launch_server`` in the default HTTP mode, except
that ``launch_server`` gets the probing scheduler process function."""

import os
import sys

from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils import kill_process_tree
from step_fence_probe import run_scheduler_process_with_probe

if __name__ == "__main__":
    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    server_args.resolve_once()  # as sglang.launch_server.run_server does before dispatching
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process_with_probe)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
