"""Fixtures of tests/. The engine farm (E0, E1, stock) and the generated fixtures are shared with
gpu_tests/ (the repository's conftest.py); engines are real SGLang 0.5.23 processes on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lora_versions_dev import prestart
from lora_versions_dev.farm import ADMIN_KEY
from lora_versions_dev.fixtures import Fixtures

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def engines(engine_farm: dict) -> tuple:
    return engine_farm["E0"], engine_farm["E1"]


@pytest.fixture(scope="session")
def stock_engine(engine_farm: dict):
    return engine_farm["stock"]


@pytest.fixture(scope="session")
def snaps(fixtures: Fixtures) -> dict:
    """Every fixture adapter (A, B, C, rank16) as the engine tests send it (tests/_snapshots.py),
    by name. Snapshots are frozen, so one set serves the whole session."""
    from _snapshots import snapshot_of  # imports torch: paid only by the runs that use snaps

    return {name: snapshot_of(fixtures.adapter_dir(name)) for name in fixtures.adapter_names}


@prestart.prestartable("other_base_engine")
def _spawn_other_base_engine(fixtures: Fixtures, run_dir: Path):
    from lora_versions_dev.fixtures import ensure_other_base
    from lora_versions_dev.launcher import EngineSpec, spawn_engine

    spec = EngineSpec(
        name="EB",
        model_path=ensure_other_base(fixtures),
        log_path=run_dir / "EB.log",
        extra_args=["--admin-api-key", ADMIN_KEY],
    )
    return spawn_engine(spec)


@pytest.fixture(scope="module")
def other_base_engine(fixtures: Fixtures, run_dir: Path, prestarts: prestart.Prestarts | None):
    """A plugin engine whose base model has the cohort's shape, config and tokenizer but other
    weights (tests/trainer_tests/test_base_model_engines.py). Module-scoped, not in the farm: it
    is stopped when its module ends (spawned ahead of its first use, lora_versions_dev.prestart)."""
    with prestart.serving(prestarts, "other_base_engine", fixtures, run_dir) as engine:
        yield engine


def pytest_report_header(config: pytest.Config) -> str:
    return f"lora-versions: fixtures root {os.environ.get('LORA_VERSIONS_FIXTURES', REPO / '.fixtures')}"
