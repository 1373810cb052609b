"""Fixtures both suites share (``tests/`` and ``gpu_tests/``): the generated fixtures, the run
directory and the engine farm (``lora_versions_dev.farm``), started once per session."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_versions_dev import prestart
from lora_versions_dev.farm import SpareEngine
from lora_versions_dev.fixtures import Fixtures, ensure_fixtures

REPO = Path(__file__).resolve().parent
RUNS = REPO / ".runs" / "tests"
# E1 runs with every scheduler probe (tests/engine_wrappers/sglang_with_scheduler_probes.py):
# the acceptance suite's step-fence probe (read by the RFC 7.3 test when that suite runs on the
# farm, on CPU), the fence-reader probe and the marked-rid scheduler 500s. Each adds only log
# lines or fails only the rids marked for it, so the tests that need them share E1 rather than
# starting an engine each.
E1_PROBE_LAUNCHER = REPO / "tests" / "engine_wrappers" / "sglang_with_scheduler_probes.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests without engines run first (in their order), the engine tests after them (in
    theirs), and last the tests of the runs that the background ran meanwhile (:func:`prestarts`):
    meanwhile the engines the engine tests need boot in the background. A test without engines
    that declares the room it needs (``@pytest.mark.room``) runs before all others, while the
    background starts have not yet taken the memory down to their reserve (a fresh clone's
    generation of the GPU fixtures peaks at 4.8 GiB: run last among the tests without engines,
    it took a CI's MemAvailable down to 1.75 GiB)."""

    def phase(item: pytest.Item) -> int:
        if not item.get_closest_marker("engine"):
            return -1 if item.get_closest_marker("room") else 0
        return 2 if prestart.is_run(getattr(item, "fixturenames", ())) else 1

    items.sort(key=phase)  # stable: each phase keeps its order


@pytest.fixture(scope="session", autouse=True)
def prestarts(request: pytest.FixtureRequest) -> Iterator[prestart.Prestarts | None]:
    """Every engine and refused-launch batch the selected tests will use, started at the session's
    first test, a few at a time, in the order of first use (lora_versions_dev.prestart)."""
    names = prestart.needed(item.fixturenames for item in request.session.items)
    if not names:
        yield None
        return
    fixtures, run_dir = request.getfixturevalue("fixtures"), request.getfixturevalue("run_dir")
    starts = prestart.Prestarts(fixtures, run_dir, names)
    try:
        yield starts
    finally:
        starts.stop_untaken()
        (run_dir / "prestart.json").write_text(json.dumps(starts.timeline, indent=2))


@pytest.fixture(autouse=True)
def _room_for_engine_tests(request: pytest.FixtureRequest, prestarts: prestart.Prestarts | None) -> None:
    """The first engine test opens the background's run lane; an engine test that may start
    processes of its own first gets the memory they need, if a run in flight holds it."""
    if prestarts is None or not request.node.get_closest_marker("engine"):
        return
    prestarts.begin_engine_tests()
    if not prestart.is_run(request.fixturenames):
        room = request.node.get_closest_marker("room")
        prestarts.wait_for_room(room.kwargs["gib"] if room else prestart.ROOM_GIB)


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    return ensure_fixtures()


@pytest.fixture(scope="session")
def run_dir() -> Path:
    path = RUNS / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


@prestart.prestartable("engine_farm", gib=3 * prestart.ENGINE_GIB)
def _spawn_farm(fixtures: Fixtures, run_dir: Path) -> list:
    from lora_versions_dev.farm import farm_specs
    from lora_versions_dev.launcher import spawn_engine

    specs = farm_specs(fixtures, run_dir, e1_command_prefix=[sys.executable, str(E1_PROBE_LAUNCHER)])
    return [spawn_engine(s) for s in specs]


@pytest.fixture(scope="session")
def engine_farm(fixtures: Fixtures, run_dir: Path, prestarts: prestart.Prestarts | None) -> Iterator[dict]:
    """E0, E1 and ``stock`` (lora_versions_dev.farm), spawned together ahead of their first use
    (lora_versions_dev.prestart)."""
    t0 = time.monotonic()
    with prestart.serving(prestarts, "engine_farm", fixtures, run_dir) as engines:
        timing = {"waited_s": round(time.monotonic() - t0, 1)}
        (run_dir / "engine_start.json").write_text(json.dumps(timing, indent=2))
        print(f"\n[engines] the farm serves: {timing}")
        yield {e.name: e for e in engines}


@prestart.prestartable("spare_engine")
def _spawn_spare(fixtures: Fixtures, run_dir: Path) -> SpareEngine:
    return SpareEngine(fixtures, run_dir)


@pytest.fixture(scope="session")
def spare_engine(
    fixtures: Fixtures, run_dir: Path, prestarts: prestart.Prestarts | None
) -> Iterator[SpareEngine]:
    """One plugin engine that the restart tests of several modules stop, kill and start again
    (lora_versions_dev.farm.SpareEngine): spawned ahead of its first use (lora_versions_dev.prestart),
    shared by the session."""
    spare = prestart.take(prestarts, "spare_engine", fixtures, run_dir)
    try:
        yield spare
    finally:
        spare.stop()


@prestart.prestartable("tp2_engine", gib=prestart.TP2_ENGINE_GIB)
def _spawn_tp2(fixtures: Fixtures, run_dir: Path) -> SpareEngine:
    source = run_dir / "tp2-source"
    source.mkdir(exist_ok=True)
    launcher = [sys.executable, str(E1_PROBE_LAUNCHER)]
    return SpareEngine(fixtures, run_dir, "TP2", tp=2, command_prefix=launcher, source_dir=source)


@pytest.fixture(scope="session")
def tp2_engine(
    fixtures: Fixtures, run_dir: Path, prestarts: prestart.Prestarts | None
) -> Iterator[SpareEngine]:
    """A TP=2 plugin engine (issue 38) with E1's scheduler probes, which the TP tests of several
    modules share and may kill and start again (lora_versions_dev.farm.SpareEngine): spawned ahead
    of its first use (lora_versions_dev.prestart). Its local source directory is its own (the
    probes' trigger files lie beside)."""
    spare = prestart.take(prestarts, "tp2_engine", fixtures, run_dir)
    try:
        yield spare
    finally:
        spare.stop()
