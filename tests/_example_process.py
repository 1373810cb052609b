"""Run an example or a bench the way a user does (a process from the repository root), and on a
timeout stop it as a CI cancel would: SIGTERM, which both unwind like Ctrl-C, stopping the
engines and the gateway they started. Run in the background (lora_versions_dev.prestart's run
lane, :func:`background_run`), the process is tracked so that a session that ends first stops it
the same way."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from lora_versions_dev import prestart

REPO = Path(__file__).resolve().parents[1]


def run_to_the_end(
    cmd: list[str], timeout_s: float, *, merge_stderr: bool = False
) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
    )
    prestart.track(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"{' '.join(cmd[1:3])} ran over {timeout_s}s:\n{(err or out)[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err or "")


def background_run(
    name: str, command: Callable[[Path], list[str]], timeout_s: float, *, merge_stderr: bool = False
) -> Callable[..., tuple[Path, subprocess.CompletedProcess]]:
    """The module fixture ``name``: ``command(out)`` run to its end in prestart's run lane, beside
    the engine tests (``out`` is ``<run dir>/<name>``), as (out, the finished process); its tests
    run last. Assign it to a module attribute of the same name."""

    @prestart.prestartable(name, gib=prestart.RUN_GIB, run=True)
    def start(fixtures, run_dir: Path) -> tuple[Path, subprocess.CompletedProcess]:
        out = run_dir / name
        return out, run_to_the_end(command(out), timeout_s, merge_stderr=merge_stderr)

    @pytest.fixture(scope="module", name=name)
    def taken(fixtures, run_dir: Path, prestarts) -> tuple[Path, subprocess.CompletedProcess]:
        return prestart.take(prestarts, name, fixtures, run_dir)

    return taken
