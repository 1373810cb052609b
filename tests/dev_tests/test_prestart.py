"""The session's background starts (lora_versions_dev.prestart), with stand-in resources: the order
of first use, a take before the start, the memory gate and what is stopped at the session's end,
the run lane (one run at a time, once the engine tests begin) and the room a test waits for.
The engines themselves are the engine tests' (every module-scoped engine is taken this way)."""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from pathlib import Path

import pytest
from _procs import nice_of

from lora_versions_dev import prestart


class Resource:
    def __init__(self, name: str) -> None:
        self.name, self.stopped = name, 0

    def stop(self) -> None:
        self.stopped += 1


@pytest.fixture
def register(monkeypatch):
    """Register stand-in starters under fresh names; the registry is left as it was."""
    monkeypatch.setattr(prestart, "_STARTERS", dict(prestart._STARTERS))
    monkeypatch.setattr(prestart, "_COST_GIB", dict(prestart._COST_GIB))
    monkeypatch.setattr(prestart, "_RUNS", set(prestart._RUNS))
    monkeypatch.setattr(prestart, "available_gib", lambda: 1e6)  # not this machine's: tests set it
    made: dict[str, list[Resource]] = {}

    def add(
        gib: float = 1.0, gate: threading.Event | None = None, fail: bool = False, run: bool = False
    ) -> str:
        name = f"r_{uuid.uuid4().hex[:8]}"
        made[name] = []

        @prestart.prestartable(name, gib=gib, run=run)
        def start(fixtures, run_dir) -> Resource:
            if gate is not None:
                gate.wait(10)
            if fail:
                raise RuntimeError(f"{name} failed to start")
            made[name].append(Resource(name))
            return made[name][-1]

        return name

    add.made = made  # type: ignore[attr-defined]
    return add


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_needed_lists_registered_fixtures_once_in_the_order_of_first_use(register):
    a, b = register(), register()
    assert prestart.needed([["tmp_path", b], [a, "engines"], [b, a]]) == [b, a]
    assert prestart.needed([["tmp_path"]]) == []


def test_a_started_resource_is_handed_to_its_fixture_and_not_stopped_by_the_session(register):
    a = register()
    starts = prestart.Prestarts(None, Path("."), [a])
    wait_for(lambda: register.made[a])
    got = starts.take(a)
    starts.stop_untaken()
    assert got is register.made[a][0] and got.stopped == 0  # its fixture owns it
    assert len(register.made[a]) == 1


def test_a_take_before_the_start_starts_it_then_and_once(register, monkeypatch):
    monkeypatch.setattr(prestart, "available_gib", lambda: 0.0)  # the gate holds every start
    a = register()
    starts = prestart.Prestarts(None, Path("."), [a])
    got = starts.take(a)  # its test is here: it starts despite the gate
    starts.stop_untaken()
    assert register.made[a] == [got] and got.stopped == 0


def test_the_memory_gate_holds_a_start_until_the_memory_is_there(register, monkeypatch):
    free = {"gib": prestart.RESERVE_GIB + 1.0}
    monkeypatch.setattr(prestart, "available_gib", lambda: free["gib"])
    a = register(gib=2.0)
    starts = prestart.Prestarts(None, Path("."), [a])
    time.sleep(1.2)
    assert register.made[a] == []  # 1 GiB over the reserve; it needs 2
    free["gib"] += 1.0
    wait_for(lambda: register.made[a])
    starts.take(a)
    starts.stop_untaken()


def test_a_start_counts_its_memory_until_it_serves(register, monkeypatch):
    monkeypatch.setattr(prestart, "available_gib", lambda: prestart.RESERVE_GIB + 3.0)
    gate = threading.Event()
    a, b = register(gib=2.0, gate=gate), register(gib=2.0)
    starts = prestart.Prestarts(None, Path("."), [a, b])
    time.sleep(1.2)
    assert register.made[b] == []  # a is booting with 2 of the 3 GiB: b waits
    gate.set()
    wait_for(lambda: register.made[b])
    starts.take(a), starts.take(b)
    starts.stop_untaken()


def test_the_session_stops_what_no_test_took_and_starts_nothing_more(register, monkeypatch):
    a, b = register(), register(gib=1000.0)  # b can never pass the gate
    starts = prestart.Prestarts(None, Path("."), [a, b])
    wait_for(lambda: register.made[a])
    starts.stop_untaken()
    assert register.made[a][0].stopped == 1
    assert register.made[b] == []  # no start at the end of the session only to stop it


def test_a_failed_background_start_fails_the_fixture_that_takes_it(register):
    a = register(fail=True)
    starts = prestart.Prestarts(None, Path("."), [a])
    with pytest.raises(RuntimeError, match="failed to start"):
        starts.take(a)
    starts.stop_untaken()


def test_without_prestarts_a_fixture_starts_its_own(register):
    a = register()
    got = prestart.take(None, a, None, Path("."))
    assert register.made[a] == [got]


def test_background_starts_boot_at_a_lower_priority(register, monkeypatch):
    """What a start thread spawns inherits its nice value (per thread on Linux), so the tests
    running meanwhile keep the CPU; the test process itself is untouched."""
    import os
    import subprocess

    name = f"r_{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen] = []

    @prestart.prestartable(name)
    def start(fixtures, run_dir):
        procs.append(subprocess.Popen(["sleep", "30"]))
        return procs[-1]  # stop() is not Popen's: terminated below

    before = os.getpriority(os.PRIO_PROCESS, 0)
    starts = prestart.Prestarts(None, Path("."), [name])
    proc = starts.take(name)
    try:
        assert nice_of(proc.pid) == max(before, prestart.BOOT_NICE)
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
    finally:
        proc.kill()
        proc.wait()
        starts.stop_untaken()


def test_a_start_books_only_the_memory_it_has_not_taken_yet(register, monkeypatch):
    free = {"gib": 20.0}
    monkeypatch.setattr(prestart, "available_gib", lambda: free["gib"])
    gate = threading.Event()
    a = register(gib=6.0, gate=gate)
    starts = prestart.Prestarts(None, Path("."), [a])
    wait_for(lambda: starts._still_to_take_gib(free["gib"]) == 6.0)
    free["gib"] = 16.0  # it has taken 4 of its 6
    assert starts._free_gib() == 14.0
    free["gib"] = 12.0  # more than it booked: nothing left to take, never a negative booking
    assert starts._free_gib() == 12.0
    gate.set()
    starts.take(a)
    starts.stop_untaken()


def test_a_run_starts_once_the_engine_tests_begin_and_runs_alone(register):
    first, second = threading.Event(), threading.Event()
    a, b = register(run=True, gate=first), register(run=True, gate=second)
    starts = prestart.Prestarts(None, Path("."), [a, b])
    time.sleep(0.7)
    assert "started_s" not in starts.timeline.get(a, {})  # the tests without engines keep the CPU
    starts.begin_engine_tests()
    wait_for(lambda: "started_s" in starts.timeline.get(a, {}))
    time.sleep(0.3)
    assert b not in starts.timeline  # one run at a time
    first.set()
    wait_for(lambda: "started_s" in starts.timeline.get(b, {}))
    second.set()
    assert starts.take(a) is register.made[a][0] and starts.take(b) is register.made[b][0]
    starts.stop_untaken()


def test_an_engine_test_waits_for_room_only_while_a_run_holds_it(register, monkeypatch):
    free = {"gib": prestart.ROOM_GIB}  # with the run's booking, under the room a test needs
    monkeypatch.setattr(prestart, "available_gib", lambda: free["gib"])
    ends = threading.Event()
    starts = prestart.Prestarts(None, Path("."), [])
    starts.wait_for_room(poll_s=0.01)  # no run in flight: nothing a wait would free
    run = register(run=True, gate=ends, gib=0.5)
    starts = prestart.Prestarts(None, Path("."), [run])
    starts.begin_engine_tests()
    starts._urgent[run].set()  # past the gate despite the memory, as its test would
    wait_for(lambda: "started_s" in starts.timeline.get(run, {}))
    waited = threading.Thread(target=starts.wait_for_room, kwargs={"poll_s": 0.01})
    waited.start()
    time.sleep(0.3)
    assert waited.is_alive()  # the run holds the memory the test may need
    ends.set()  # the run ends by itself
    waited.join(5)
    assert not waited.is_alive()
    starts.take(run)
    starts.stop_untaken()


def test_a_start_its_test_wants_waits_for_a_run_in_flight_when_memory_is_short(register, monkeypatch):
    free = {"gib": 4.0}
    monkeypatch.setattr(prestart, "available_gib", lambda: free["gib"])
    ends = threading.Event()
    run, engine = register(run=True, gate=ends, gib=0.5), register(gib=3.8)
    starts = prestart.Prestarts(None, Path("."), [run, engine])
    starts.begin_engine_tests()
    starts._urgent[run].set()
    wait_for(lambda: "started_s" in starts.timeline.get(run, {}))
    asked, may_start = [], starts._may_start
    monkeypatch.setattr(starts, "_may_start", lambda name: asked.append(name) or may_start(name))
    took = threading.Thread(target=starts.take, args=(engine,))
    t0 = time.monotonic()
    took.start()
    time.sleep(0.7)
    assert register.made[engine] == []  # 4 less the run's 0.5 < 3.8: it waits for the run
    polls, waited_s = len(asked), time.monotonic() - t0
    assert polls <= waited_s / 0.5 + 3, (polls, waited_s)  # and polls while it waits, it does not spin
    ends.set()
    took.join(5)
    assert register.made[engine] and not took.is_alive()
    starts.take(run)
    starts.stop_untaken()


def test_the_session_end_stops_a_run_no_test_took(register):
    import subprocess

    name = f"r_{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen] = []

    @prestart.prestartable(name, run=True)
    def start(fixtures, run_dir):
        procs.append(subprocess.Popen(["sleep", "60"]))
        prestart.track(procs[-1])
        return procs[-1].wait()

    starts = prestart.Prestarts(None, Path("."), [name])
    starts.begin_engine_tests()
    wait_for(lambda: procs)
    t0 = time.monotonic()
    starts.stop_untaken()
    assert procs[0].poll() is not None and time.monotonic() - t0 < 10  # SIGTERM, not its end


def test_the_tests_of_runs_go_last(register):
    a, b = register(run=True), register()
    assert prestart.is_run(["tmp_path", a]) and not prestart.is_run(["tmp_path", b])


class _Item:
    """What the session's ordering hook reads of a collected test."""

    def __init__(self, name: str, markers: tuple[str, ...] = (), fixturenames: tuple[str, ...] = ()) -> None:
        self.name, self.markers, self.fixturenames = name, markers, list(fixturenames)

    def get_closest_marker(self, marker: str) -> object | None:
        return object() if marker in self.markers else None


def test_the_session_order_is_room_declaring_tests_without_engines_then_the_rest_then_engines_then_runs(
    register,
):
    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[2] / "conftest.py")
    assert spec is not None and spec.loader is not None
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    run = register(run=True)
    items = [
        _Item("engine", ("engine",)),
        _Item("of_a_run", ("engine",), (run,)),
        _Item("plain"),
        _Item("engine_with_room", ("engine", "room")),
        _Item("heavy", ("room",)),
        _Item("plain_2"),
    ]
    root.pytest_collection_modifyitems(items)
    assert [i.name for i in items] == ["heavy", "plain", "plain_2", "engine", "engine_with_room", "of_a_run"]
