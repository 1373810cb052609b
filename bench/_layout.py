"""CPU layouts for the benches that measure what a publication costs the engines' decode.

``shared``: every process may run on every core (what a plain start on this machine does). On a
2-core host the engines' main processes (HTTP, hashing, verification), the publisher and the
clients then compete with decode for the same two cores, so a decode gap measures the machine as
much as the plugin.

``pinned``: as on a GPU host, where the scheduler drives the device from a core of its own: each
engine's scheduler process (every thread of it, its OpenMP threads included: the engines start
with ``SGLANG_CPU_OMP_THREADS_BIND`` set to that core) runs on the last core, everything else (the
engines' main and detokenizer processes, the collective receivers, this bench, its publisher and
its clients) on the others. What a publication then costs decode is what it costs the scheduler:
the load and the unload it runs, and nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

LAYOUTS = ("shared", "pinned")
SCHEDULER_TITLE = b"sglang::scheduler"  # SGLang 0.5.23's process title (scheduler.py, setproctitle)


def scheduler_core() -> int:
    return max(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))


def other_cores() -> set[int]:
    cores = set(range(os.cpu_count() or 1)) - {scheduler_core()}
    if not cores:
        raise SystemExit("the pinned layout needs at least two cores")
    return cores


def engine_env(layout: str) -> dict[str, str]:
    """The environment an engine of ``layout`` starts with (its scheduler's OpenMP binding)."""
    return {"SGLANG_CPU_OMP_THREADS_BIND": str(scheduler_core())} if layout == "pinned" else {}


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(entry.name))
    return out


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _is_scheduler(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes()).startswith(SCHEDULER_TITLE)
    except OSError:
        return False


def _pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` (affinity is per thread; threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            continue


def apply(layout: str, engine_pids: Iterable[int]) -> dict[str, list[int]]:
    """Pin the engines' processes and this process's thread for ``layout``; returns the pids
    pinned by role (empty for ``shared``). Processes this one starts later inherit its cores."""
    if layout == "shared":
        every = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, every)
        return {}
    roles: dict[str, list[int]] = {"scheduler": [], "other": []}
    for root in engine_pids:
        for pid in _tree(root):
            if _is_scheduler(pid):
                _pin_process(pid, {scheduler_core()})
                roles["scheduler"].append(pid)
            else:
                _pin_process(pid, other_cores())
                roles["other"].append(pid)
    if not roles["scheduler"]:
        raise SystemExit(f"no {SCHEDULER_TITLE.decode()} process found under {list(engine_pids)}")
    os.sched_setaffinity(0, other_cores())
    return roles


def pin_new_children(engine_pids: Iterable[int], layout: str) -> None:
    """Processes an engine started since :func:`apply` (a collective receiver) go with the rest."""
    if layout != "pinned":
        return
    for root in engine_pids:
        for pid in _tree(root):
            if not _is_scheduler(pid):
                _pin_process(pid, other_cores())
