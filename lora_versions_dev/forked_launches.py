"""Many ``python -m sglang.launch_server`` starts that are expected to be refused, for the price
of one import (tests only).

A refused setup is refused by the plugin in the engine's main process, before SGLang spawns
anything (``ServerArgs.check_server_args``, hooked): what costs a refused start is importing
SGLang, torch and the plugin (about 15 s of CPU each here). This process imports them once and
forks one child per launch; the child sets ``sys.argv`` and runs ``sglang.launch_server`` as
``__main__``, exactly what the command line runs (``load_plugins()``, ``prepare_server_args``,
``run_server``), its output in the launch's own log. A launch that is not refused is killed
after ``timeout_s`` (it was starting an engine) and reported as such.

A launch may name a ``wrapper``: a Python script that changes something in SGLang and then runs
``sglang.launch_server`` itself (tests/engine_wrappers/). The child then runs that script as
``__main__``, as ``python WRAPPER ARGV`` would (its folder first on ``sys.path``), after setting
the launch's own ``env``: variables the wrapper reads when it runs (never at import: what every
launch imports is imported before the fork).

Run with the engine's environment (``launcher.build_env``):
``python -m lora_versions_dev.forked_launches SPEC.json`` where SPEC.json is a list of
``{"argv": [...], "log": path}`` (optional: ``"timeout_s"``, ``"wrapper"``, ``"env"``); prints one
JSON line per launch: ``{"log", "exit_code"}`` (``null``: still running at its timeout).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time

TIMEOUT_S = 120.0


def _child(argv: list[str], log: str, wrapper: str | None, env: dict[str, str]) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.setsid()  # its own group: a start that was not refused is killed whole
    os.environ.update(env)
    code = 0
    try:
        if wrapper is None:
            sys.argv = ["sglang.launch_server", *argv]
            runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        else:
            sys.argv = [wrapper, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(wrapper)))
            runpy.run_path(wrapper, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a crash is an exit code to the caller
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(pid: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def main(spec_path: str) -> None:
    # What every launch imports, imported once here (the children inherit it).
    import sglang.launch_server
    import sglang.srt.entrypoints.http_server

    import sglang_ext.hooks
    import sglang_ext.plugin

    del sglang, sglang_ext  # only imported, for the children
    with open(spec_path) as f:
        launches = json.load(f)
    for launch in launches:
        pid = os.fork()
        if pid == 0:
            _child(launch["argv"], launch["log"], launch.get("wrapper"), launch.get("env", {}))
        code = _wait(pid, float(launch.get("timeout_s", TIMEOUT_S)))
        if code is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2.0)
            os.waitpid(pid, 0)
        print(json.dumps({"log": launch["log"], "exit_code": code}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
