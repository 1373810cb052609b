"""Fixtures both suites share (``tests/`` and ``gpu_tests/``): the generated fixtures, the run
directory and the engine farm (``lora_versions_dev.farm``), started once per session."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    return ensure_fixtures()


@pytest.fixture(scope="session")
def run_dir() -> Path:
    path = RUNS / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def engine_farm(fixtures: Fixtures, run_dir: Path) -> Iterator[dict]:
    """E0, E1 and ``stock`` (lora_versions_dev.farm), started together in parallel."""
    from lora_versions_dev.farm import farm_specs
    from lora_versions_dev.launcher import running_engines

    specs = farm_specs(fixtures, run_dir, e1_command_prefix=[sys.executable, str(E1_PROBE_LAUNCHER)])
    t0 = time.monotonic()
    with running_engines(specs) as engines:
        timing = {e.name: round(e.started_s or 0.0, 1) for e in engines}
        timing["all_parallel_s"] = round(time.monotonic() - t0, 1)
        (run_dir / "engine_start.json").write_text(json.dumps(timing, indent=2))
        print(f"\n[engines] started in parallel: {timing}")
        yield {e.name: e for e in engines}


@pytest.fixture(scope="session")
def spare_engine(fixtures: Fixtures, run_dir: Path) -> Iterator[SpareEngine]:
    """One plugin engine that the restart tests of several modules stop, kill and start again
    (lora_versions_dev.farm.SpareEngine): spawned at its first use, shared by the session."""
    spare = SpareEngine(fixtures, run_dir)
    try:
        yield spare
    finally:
        spare.stop()


@pytest.fixture(scope="session")
def tp2_engine(fixtures: Fixtures, run_dir: Path) -> Iterator[SpareEngine]:
    """A TP=2 plugin engine (issue 38) with E1's scheduler probes, which the TP tests of several
    modules share and may kill and start again (lora_versions_dev.farm.SpareEngine): spawned at
    its first use. Its local source directory is its own (the probes' trigger files lie beside)."""
    source = run_dir / "tp2-source"
    source.mkdir(exist_ok=True)
    launcher = [sys.executable, str(E1_PROBE_LAUNCHER)]
    spare = SpareEngine(fixtures, run_dir, "TP2", tp=2, command_prefix=launcher, source_dir=source)
    try:
        yield spare
    finally:
        spare.stop()
