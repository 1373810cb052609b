"""What the engine tests would wait for, started before they run (tests only).

An engine takes half a minute to boot here, almost all of it importing SGLang and torch in three
processes; a test module that starts its own engine used to wait that long in its setup while the
rest of the machine idled. The test session now queues, at its first test, every engine (and
every batch of refused launches) that its selected tests will use, in the order they will use
them; each starts when one of two start slots is free and enough memory stays available for the
tests' own processes (:data:`RESERVE_GIB`), and boots at a lower priority (:data:`BOOT_NICE`)
until it serves. So the boots overlap the tests without engines, which run first, and the engine
tests' waits, instead of adding to them.

A run that needs nothing but the machine (an example or a bench run the way the README runs it,
with engines, a gateway and a trainer of its own) is queued the same way but in a lane of its
own (``prestartable(..., run=True)``): one run at a time, from the first engine test on, so it
takes the CPU the engine tests leave idle (about 40% of two cores over the engine tests, sampled
here) instead of a slot in the sequence of tests; its test, run last, asserts on what it left.

A fixture that owns such a resource declares how to start it (:func:`prestartable`, under the
fixture's own name) and gets it with :meth:`Prestarts.take`: the started one if the session
started it, a new one otherwise (a run of a single test starts what it needs, as before). The
fixture keeps ownership: it waits for its engine to serve and stops it when its scope ends;
whatever no test took is stopped when the session ends. A start that failed in the background
fails the fixture that takes it, with the engine's own error.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_versions_dev.fixtures import Fixtures

if TYPE_CHECKING:
    from lora_versions_dev.launcher import Engine

# (fixtures, run_dir) -> the started resource: an Engine, a list of them, a SpareEngine, or the
# value of a blocking batch (refused launches: their exit codes).
Starter = Callable[[Fixtures, Path], Any]

_STARTERS: dict[str, Starter] = {}
_COST_GIB: dict[str, float] = {}
_RUNS: set[str] = set()  # the registered fixtures whose resource is a whole run (the run lane)

# Resources starting at once: an engine's boot is two to three cores' worth of imports for half a
# minute, and a storm of them would starve the tests running meanwhile (2 cores here).
BOOTING_AT_ONCE = 2
# The nice value a background start runs at until it serves: the tests running meanwhile keep the
# CPU (several of them bound a stall in seconds), the boots take what is left. Measured: booted at
# the tests' own priority, the tests without engines took 503 s instead of 190 and a 2 s stall
# bound of test_collective_link tripped.
BOOT_NICE = 10
# Memory, in what MemAvailable loses (the cost a start books until what it started shows there):
# an engine of the fixture model holds about 2 to 2.9 GiB (2.9 is the PSS of its four processes),
# a TP=2 engine about 4, a whole example run (two engines, smg, the trainer and its reference
# model) about 4.9 at its peak (sampled every second here: the demo and the online RL example
# each took MemAvailable from 23.0 to 18.1-18.2). A start waits until, after it, RESERVE_GIB stays
# available for what the tests start themselves (an engine of their own, a Ray cluster of three
# nodes, trainer processes); an engine test, while a run is in flight, waits for ROOM_GIB or what
# it declares (:meth:`Prestarts.wait_for_room`).
ENGINE_GIB = 2.5
TP2_ENGINE_GIB = 4.0  # two scheduler processes, one model each
RUN_GIB = 6.0
RESERVE_GIB = 4.0
# What an engine test starts of its own, unless it says more (``@pytest.mark.room(gib=...)``): a
# restart replaces an engine (nothing more), a worker or a Ray actor process about 1 GiB. Waiting
# for 4 GiB instead held two restart tests 57 and 62 s behind a run in flight (3.3 GiB available).
ROOM_GIB = 2.5


def prestartable(
    fixture_name: str, *, gib: float = ENGINE_GIB, run: bool = False
) -> Callable[[Starter], Starter]:
    """Register how to start what the fixture ``fixture_name`` uses (a test module's decorator,
    run when the module is collected, before the session's first test) and the memory it holds;
    ``run``: a whole run that ends by itself (the run lane, see the module docstring)."""

    def register(starter: Starter) -> Starter:
        _STARTERS[fixture_name] = starter
        _COST_GIB[fixture_name] = gib
        if run:
            _RUNS.add(fixture_name)
        return starter

    return register


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")  # not Linux: no gate


def needed(fixturenames_in_order: Iterable[Iterable[str]]) -> list[str]:
    """The registered fixtures the tests use (each test's fixture closure, in run order), each
    once, in the order of its first use."""
    seen: dict[str, None] = {}
    for names in fixturenames_in_order:
        for name in names:
            if name in _STARTERS:
                seen.setdefault(name)
    return list(seen)


def is_run(fixturenames: Iterable[str]) -> bool:
    """Whether a test asserts on a background run (such tests go last: their runs had the time)."""
    return any(name in _RUNS for name in fixturenames)


def _boot_in_the_background() -> None:
    """The start threads' initializer: what they start (every process of it) inherits this
    thread's nice value on Linux, where it is per thread."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, 0, BOOT_NICE)


def _serve_at_normal_priority(engine: Any) -> None:
    """An engine that serves gets the tests' priority back: its process group (the engine and
    every process it started) to nice 0. Lowering a nice value needs privileges (CAP_SYS_NICE);
    without them the engine keeps serving at BOOT_NICE, only slower under contention."""
    proc = getattr(engine, "proc", None)
    if proc is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, proc.pid, 0)  # launcher: each engine leads its own group


def _settle(handle: Any) -> None:
    """Wait until a started resource is up, so the next start does not compete with its boot; its
    failure is left to the fixture that takes it (it waits again and raises the engine's error)."""
    if isinstance(handle, list):
        engines = handle
    elif isinstance(getattr(handle, "engines", None), dict):  # a pool of them (chaos)
        engines = list(handle.engines.values())
    else:
        engines = [getattr(handle, "engine", handle)]  # a SpareEngine's current one, or an Engine
    for engine in engines:
        wait = getattr(engine, "wait_healthy", None)
        if wait is not None:
            with contextlib.suppress(Exception):
                wait(engine.spec.startup_timeout_s)
        _serve_at_normal_priority(engine)


def _stop(handle: Any) -> None:
    for item in handle if isinstance(handle, list) else [handle]:
        stop = getattr(item, "stop", None)
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()


_running = threading.local()  # in a start thread: the name of what it starts
_RUN_PROCS: dict[str, subprocess.Popen] = {}


def track(proc: subprocess.Popen) -> None:
    """A run's process, as its starter spawns it: stopped if the session ends before its test took
    the run (an interrupted session). Outside a start thread (a run started by its test) a no-op."""
    name = getattr(_running, "name", None)
    if name is not None:
        _RUN_PROCS[name] = proc


class Prestarts:
    """The session's background starts (see the module docstring)."""

    def __init__(self, fixtures: Fixtures, run_dir: Path, names: Iterable[str]) -> None:
        self.fixtures, self.run_dir = fixtures, run_dir
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=BOOTING_AT_ONCE, thread_name_prefix="prestart", initializer=_boot_in_the_background
        )
        self._run_lane = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prestart-run", initializer=_boot_in_the_background
        )
        self._jobs: dict[str, Future[None]] = {}
        self._handles: dict[str, Future[Any]] = {}
        self._taken: set[str] = set()
        self._urgent: dict[str, threading.Event] = {}
        self._closing = threading.Event()
        self._engine_tests = threading.Event()
        self._t0 = time.monotonic()
        # per resource: when its start began and when it served, from the session's first test
        # (the test session writes it to its run directory)
        self.timeline: dict[str, dict[str, float]] = {}
        # started and not yet serving (a run: not yet ended): its cost and MemAvailable when it
        # started, so the memory it will still take counts before MemAvailable shows it
        self._growing: dict[str, tuple[float, float]] = {}
        for name in names:
            self._handles[name] = Future()
            self._urgent[name] = threading.Event()
            lane = self._run_lane if name in _RUNS else self._pool
            self._jobs[name] = lane.submit(self._start_and_settle, name)

    def begin_engine_tests(self) -> None:
        """The tests without engines are done: the run lane may start (they keep the CPU till then)."""
        self._engine_tests.set()

    def _still_to_take_gib(self, available: float) -> float:
        with self._lock:
            growing = list(self._growing.values())
        return sum(max(0.0, cost - max(0.0, at_start - available)) for cost, at_start in growing)

    def _free_gib(self) -> float:
        """Available memory, less what the starts in flight will still take."""
        available = available_gib()
        return available - self._still_to_take_gib(available)

    def _run_in_flight(self) -> bool:
        with self._lock:
            return any(name in _RUNS for name in self._growing)

    def _may_start(self, name: str) -> bool:
        free, cost = self._free_gib(), _COST_GIB[name]
        if free >= cost + RESERVE_GIB:
            return True
        # its test is here: it starts unless memory is short and a run in flight will free it
        return self._urgent[name].is_set() and not (free < cost and self._run_in_flight())

    def wait_for_room(self, gib: float = ROOM_GIB, poll_s: float = 0.5) -> None:
        """Before a test that may start processes of its own: while a run in flight leaves less
        than ``gib``, wait for it to end (a run ends by itself; nothing resident is waited for)."""
        while self._run_in_flight() and self._free_gib() < gib:
            time.sleep(poll_s)

    def _start_and_settle(self, name: str) -> None:
        handle_future, cost, urgent = self._handles[name], _COST_GIB[name], self._urgent[name]
        if name in _RUNS:
            while not self._engine_tests.wait(0.5) and not urgent.is_set() and not self._closing.is_set():
                pass  # the tests without engines keep the CPU
        while not self._closing.is_set() and not self._may_start(name):
            # until the memory is there, or its test wants it now (then until a run in flight
            # that holds the memory it needs has ended)
            (self._closing if urgent.is_set() else urgent).wait(0.5)
        if self._closing.is_set():
            handle_future.cancel()  # the session ended before any test took it
            return
        with self._lock:
            self._growing[name] = (cost, available_gib())
        self.timeline.setdefault(name, {})["started_s"] = round(time.monotonic() - self._t0, 1)
        _running.name = name
        try:
            try:
                handle = _STARTERS[name](self.fixtures, self.run_dir)
            except BaseException as exc:  # the fixture that takes it raises it
                handle_future.set_exception(exc)
                return
            handle_future.set_result(handle)
            _settle(handle)
            self.timeline[name]["up_s"] = round(time.monotonic() - self._t0, 1)
        finally:
            _running.name = None
            with self._lock:
                self._growing.pop(name, None)

    def take(self, name: str) -> Any:
        """What the fixture ``name`` uses: started in the background, or started now if it was not
        (not selected at the session's start, or still waiting for a free start)."""
        with self._lock:
            job = self._jobs.pop(name, None)  # a second take (a module set up again) starts anew
            self._taken.add(name)
        if job is None or job.cancel():
            return _STARTERS[name](self.fixtures, self.run_dir)
        self._urgent[name].set()  # waiting for memory no longer: its test is here
        self.timeline.setdefault(name, {})["taken_s"] = round(time.monotonic() - self._t0, 1)
        return self._handles[name].result()

    def stop_untaken(self) -> None:
        """At the session's end: nothing started for a test that never ran is left running (a run
        in flight is stopped as a CI cancel would: SIGTERM, and it stops what it started)."""
        with self._lock:
            jobs, self._jobs = self._jobs, {}
        self._closing.set()
        for name, job in jobs.items():
            job.cancel()
            self._urgent[name].set()  # a job still waiting for memory ends without a start
            proc = _RUN_PROCS.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        self._pool.shutdown(wait=True)
        self._run_lane.shutdown(wait=True)
        for name, future in self._handles.items():
            if name in self._taken or not future.done() or future.cancelled():
                continue
            if future.exception() is None:
                _stop(future.result())


def take(prestarts: Prestarts | None, name: str, fixtures: Fixtures, run_dir: Path) -> Any:
    """:meth:`Prestarts.take` when the session has prestarts, else start it now."""
    if prestarts is None:
        return _STARTERS[name](fixtures, run_dir)
    return prestarts.take(name)


@contextlib.contextmanager
def serving(
    prestarts: Prestarts | None, name: str, fixtures: Fixtures, run_dir: Path
) -> Iterator[Engine | list[Engine]]:
    """What the fixture ``name`` owns, one :class:`~lora_versions_dev.launcher.Engine` or a list
    of them (the farm): taken, waited for until every one serves, all stopped when the block ends
    (or when one of them fails to start)."""
    from lora_versions_dev.launcher import stop_engines

    handle = take(prestarts, name, fixtures, run_dir)
    engines = handle if isinstance(handle, list) else [handle]
    try:
        for engine in engines:
            engine.wait_healthy(engine.spec.startup_timeout_s)
        yield handle
    finally:
        stop_engines(engines)
