"""Run SGLang's HTTP server with another scheduler process function (tests only): the same steps
as ``python -m sglang.launch_server`` in the default HTTP mode, except that ``launch_server``
gets ``run_scheduler_process_func``. The scheduler runs in a ``spawn``-ed process, so a patch
made in the launching process would not reach it; a wrapper's function installs its hooks
there. Upstream (0.5.23): ``http_server.launch_server(server_args, run_scheduler_process_func=)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def launch_http_server_with(run_scheduler_process_func: Callable[..., Any]) -> None:
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    server_args.resolve_once()  # as sglang.launch_server.run_server does before dispatching
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process_func)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
