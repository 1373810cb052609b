"""CPU layouts for the benches that measure what a publication costs the engines' decode.

``shared``: every process may run on every core (what a plain start on this machine does). On a
2-core host the engines' main processes (HTTP, hashing, verification), the publisher and the
clients then compete with decode for the same two cores, so a decode gap measures the machine as
much as the plugin.

``pinned``: as on a GPU host, where the scheduler drives the device from a core of its own: the
measured engine's scheduler process (every thread of it, its OpenMP threads included: that engine
starts with ``SGLANG_CPU_OMP_THREADS_BIND`` set to the core) runs alone on the last core;
everything else (that engine's main and detokenizer processes and collective receiver, the other
engines whole, this bench, its publisher and its clients) on the others. With two cores only one
scheduler can have a core of its own (two schedulers on one core starve each other: their loops
never sleep), so the gaps of the pinned layout are read on the measured engine's streams; the
other engines are still in the cohort every publication goes to. What a publication then costs
the measured engine's decode is what it costs its scheduler: the load and the unload it runs,
and nothing else.
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


def engine_env(layout: str, measured: bool) -> dict[str, str]:
    """The environment an engine of ``layout`` starts with (its scheduler's OpenMP binding)."""
    if layout != "pinned":
        return {}
    cores = {scheduler_core()} if measured else other_cores()
    return {"SGLANG_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cores)))}


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


def apply(layout: str, measured_pid: int, other_pids: Iterable[int] = ()) -> dict[str, list[int]]:
    """Pin the engines' processes (the measured engine's main process, the others') and this
    process's thread for ``layout``; returns the pids pinned by role (empty for ``shared``).
    Processes this one starts later inherit its cores."""
    if layout == "shared":
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        return {}
    roles: dict[str, list[int]] = {"scheduler": [], "other": []}
    for pid in _tree(measured_pid):
        if _is_scheduler(pid):
            _pin_process(pid, {scheduler_core()})
            roles["scheduler"].append(pid)
    if len(roles["scheduler"]) != 1:
        raise SystemExit(f"expected one {SCHEDULER_TITLE.decode()} under {measured_pid}: {roles}")
    pin_the_rest(layout, measured_pid, other_pids)
    roles["other"] = [p for root in (measured_pid, *other_pids) for p in _tree(root)]
    roles["other"] = [p for p in roles["other"] if p not in roles["scheduler"]]
    os.sched_setaffinity(0, other_cores())
    return roles


def pin_the_rest(layout: str, measured_pid: int, other_pids: Iterable[int] = ()) -> None:
    """Every process of the engines but the measured scheduler on the other cores (again after
    an engine started one, e.g. a collective receiver)."""
    if layout != "pinned":
        return
    for root in (measured_pid, *other_pids):
        for pid in _tree(root):
            if root != measured_pid or not _is_scheduler(pid):
                _pin_process(pid, other_cores())
