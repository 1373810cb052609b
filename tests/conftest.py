"""Shared fixtures. Engines are real SGLang 0.5.23 processes on CPU, started once per session."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _admin_key import ADMIN_KEY
from _local_source import local_source_dir

from lora_versions_dev.fixtures import Fixtures, ensure_fixtures

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / ".runs" / "tests"


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
    """E0 and E1 with the plugin on, and ``stock`` with it off, started together in parallel."""
    from lora_versions_dev.launcher import EngineSpec, running_engines
    from sglang_ext.engine_state import BODY_IDLE_TIMEOUT_ENV
    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    # E0/E1 run like a guarded deployment: control endpoints need the admin key.
    admin = ["--admin-api-key", ADMIN_KEY]
    # A short body deadline so the stalled-upload test sees it fire (production default: 30 s).
    # One local source directory for both: two engines on one host, as a co-located trainer
    # would hand them buckets (tests/plugin_tests/test_publication_engines.py).
    env = {BODY_IDLE_TIMEOUT_ENV: "5", LOCAL_SOURCE_DIR_ENV: str(local_source_dir(run_dir))}
    specs = [
        EngineSpec(
            name=n, model_path=fixtures.model_dir, log_path=run_dir / f"{n}.log", extra_args=admin, env=env
        )
        for n in ("E0", "E1")
    ] + [
        EngineSpec(name="stock", model_path=fixtures.model_dir, log_path=run_dir / "stock.log", plugin=False),
    ]
    t0 = time.monotonic()
    with running_engines(specs) as engines:
        timing = {e.name: round(e.started_s or 0.0, 1) for e in engines}
        timing["all_parallel_s"] = round(time.monotonic() - t0, 1)
        (run_dir / "engine_start.json").write_text(json.dumps(timing, indent=2))
        print(f"\n[engines] started in parallel: {timing}")
        yield {e.name: e for e in engines}


@pytest.fixture(scope="session")
def engines(engine_farm: dict) -> tuple:
    return engine_farm["E0"], engine_farm["E1"]


@pytest.fixture(scope="session")
def stock_engine(engine_farm: dict):
    return engine_farm["stock"]


@pytest.fixture(scope="module")
def other_base_engine(fixtures: Fixtures, run_dir: Path):
    """A plugin engine whose base model has the cohort's shape, config and tokenizer but other
    weights (tests/trainer_tests/test_base_model_engines.py). Module-scoped, not in the farm: the
    farm lives the whole session, and a fourth resident engine leaves the acceptance suite's own
    four (gpu_tests/) too little memory to start on a 24 GiB host."""
    from lora_versions_dev.fixtures import ensure_other_base
    from lora_versions_dev.launcher import EngineSpec, running_engines

    spec = EngineSpec(
        name="EB",
        model_path=ensure_other_base(fixtures),
        log_path=run_dir / "EB.log",
        extra_args=["--admin-api-key", ADMIN_KEY],
    )
    with running_engines([spec]) as (engine,):
        yield engine


def pytest_report_header(config: pytest.Config) -> str:
    return f"lora-versions: fixtures root {os.environ.get('LORA_VERSIONS_FIXTURES', REPO / '.fixtures')}"
