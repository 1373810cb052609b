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

import argparse
import os
from collections.abc import Iterable

import psutil
from _profiling import engine_processes

LAYOUTS = ("shared", "pinned")


def add_layouts_option(parser: argparse.ArgumentParser, measured: str) -> None:
    """``--layouts``: comma separated, both by default, each measured on engines of its own."""

    def layouts(text: str) -> list[str]:
        chosen = [x for x in text.split(",") if x]
        if unknown := set(chosen) - set(LAYOUTS):
            raise argparse.ArgumentTypeError(f"unknown layouts {sorted(unknown)}")
        return chosen

    parser.add_argument(
        "--layouts",
        type=layouts,
        default=list(LAYOUTS),
        help="comma separated, each measured on engines of its own in this run (bench/_layout.py):"
        f" shared, every process on every core; pinned, {measured}'s scheduler alone on the last core"
        " (as on a GPU host) and everything else on the others",
    )


def scheduler_core() -> int:
    return (os.cpu_count() or 1) - 1


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


def _pin(proc: psutil.Process, cores: set[int]) -> None:
    """Every thread of ``proc`` (affinity is per thread; threads started later inherit it)."""
    try:
        threads = proc.threads()
    except psutil.Error:  # gone meanwhile
        return
    for thread in threads:
        try:
            os.sched_setaffinity(thread.id, cores)
        except (ProcessLookupError, PermissionError):
            continue


def _measured_scheduler(measured_pid: int) -> psutil.Process:
    scheduler = engine_processes("measured", measured_pid).get("measured scheduler")
    if scheduler is None:
        raise SystemExit(f"no scheduler process under {measured_pid}")
    return scheduler


def apply(layout: str, measured_pid: int, other_pids: Iterable[int] = ()) -> dict[str, list[int]]:
    """Pin the engines' processes (the measured engine's main process, the others') and this
    process's thread for ``layout``; returns the pids pinned by role (empty for ``shared``).
    Processes this one starts later inherit its cores."""
    if layout == "shared":
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        return {}
    scheduler = _measured_scheduler(measured_pid)
    _pin(scheduler, {scheduler_core()})
    others = pin_the_rest(layout, measured_pid, other_pids)
    os.sched_setaffinity(0, other_cores())
    return {"scheduler": [scheduler.pid], "other": others}


def pin_the_rest(layout: str, measured_pid: int, other_pids: Iterable[int] = ()) -> list[int]:
    """Every process of the engines but the measured scheduler on the other cores (again after
    an engine started one, e.g. a collective receiver); returns their pids."""
    if layout != "pinned":
        return []
    scheduler = _measured_scheduler(measured_pid).pid
    pinned = []
    for root in (measured_pid, *other_pids):
        main = psutil.Process(root)
        for proc in (main, *main.children(recursive=True)):
            if proc.pid != scheduler:
                _pin(proc, other_cores())
                pinned.append(proc.pid)
    return pinned
