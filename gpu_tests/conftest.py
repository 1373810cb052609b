"""The acceptance suite's deployment: one device profile, two managed engines and the clean
baselines, started once per test session; the report written when the session ends.

The same file runs on CPU (CI, the tiny fixtures) and on a CUDA host (the bf16 Qwen3-0.6B-shaped
model, triton LoRA, CUDA graphs); see ``lora_versions_dev.device_profile``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _acceptance import ACCEPTANCE_ADMIN_KEY, Report

from lora_versions_dev.device_profile import (
    AcceptanceFixtures,
    DeviceProfile,
    detect_profile,
    ensure_acceptance_fixtures,
)

REPO = Path(__file__).resolve().parents[1]
# E1 runs through this wrapper: the step-fence probe logs, at each physical unload, what the
# fence would decide (gpu_tests/engine_wrappers/step_fence_probe.py).
PROBED_ENGINE = "E1"
PROBE_LAUNCHER = Path(__file__).resolve().parent / "engine_wrappers" / "sglang_with_step_fence_probe.py"
REPORT_ENV = "ACCEPTANCE_REPORT_DIR"


@pytest.fixture(scope="session")
def profile() -> DeviceProfile:
    return detect_profile()


@pytest.fixture(scope="session")
def acceptance_fixtures(profile: DeviceProfile) -> AcceptanceFixtures:
    return ensure_acceptance_fixtures(profile)


@pytest.fixture(scope="session")
def report_dir() -> Path:
    path = Path(os.environ.get(REPORT_ENV) or REPO / ".runs" / "acceptance" / time.strftime("%Y%m%d-%H%M%S"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def report(profile: DeviceProfile, report_dir: Path) -> Iterator[Report]:
    rep = Report(profile)
    yield rep
    if rep.sections:
        (report_dir / "report.json").write_text(json.dumps(rep.as_json(), indent=2, default=str))
        table = rep.table()
        (report_dir / "report.txt").write_text(table + "\n")
        print(f"\n{table}\n[acceptance] report: {report_dir / 'report.json'}")


@pytest.fixture(scope="session")
def deployment(
    request: pytest.FixtureRequest,
    profile: DeviceProfile,
    acceptance_fixtures: AcceptanceFixtures,
    report_dir: Path,
) -> Iterator[dict]:
    """E0/E1: managed (plugin on, admin key; E1 through the step-fence probe). base_A / base_B:
    clean baselines, plugin off, their adapter loaded at start through the stock ``--lora-paths``;
    base_A is also the plain-LoRA engine the online run's throughput is compared with.

    On CPU these are the session's shared farm (the repository's conftest.py: the same tiny
    fixtures, one stock engine holding both baselines), so the suite starts no engine of its
    own; whatever earlier tests left on E0/E1 is removed first, through the engines' protocol.
    On a CUDA host the profile's four engines are started here."""
    if profile.device == "cpu":
        farm = request.getfixturevalue("engine_farm")
        managed = {n: farm[n] for n in ("E0", "E1")}
        left = asyncio.run(_purge_everything(managed))
        assert left == {}, f"earlier tests left versions the farm could not remove: {left}"
        yield {**managed, "base_A": farm["stock"], "base_B": farm["stock"]}
        return

    from lora_versions_dev.launcher import running_engines

    fx = acceptance_fixtures
    names = ["E0", "E1", "base_A", "base_B"]
    specs = [
        profile.engine_spec(
            n,
            fx.model_dir,
            report_dir / f"{n}.log",
            index=i,
            of=len(names),
            plugin=n.startswith("E"),
            lora_paths=None if n.startswith("E") else {n[-1]: fx.adapter_dir(n[-1])},
            extra_args=["--admin-api-key", ACCEPTANCE_ADMIN_KEY] if n.startswith("E") else (),
            command_prefix=[sys.executable, str(PROBE_LAUNCHER)] if n == PROBED_ENGINE else None,
        )
        for i, n in enumerate(names)
    ]
    with running_engines(specs) as engines:
        yield {e.name: e for e in engines}


async def _purge_everything(engines: dict) -> dict[str, list[str]]:
    from lora_versions_dev.teardown import purge
    from relax_glue.engine_client import EngineClient

    clients = {n: EngineClient(n, e.url, admin_key=ACCEPTANCE_ADMIN_KEY) for n, e in engines.items()}
    try:
        return await purge(clients, marker="")
    finally:
        for c in clients.values():
            await c.aclose()


@pytest.fixture(autouse=True)
def _device_of_each_test(request: pytest.FixtureRequest, profile: DeviceProfile) -> None:
    """Every test says which device and backends it ran with (junit XML, ``-rA``)."""
    request.node.user_properties.append(("acceptance_profile", profile.banner()))


def pytest_report_header(config: pytest.Config) -> str:
    try:
        return "acceptance: " + detect_profile().banner()
    except Exception as e:  # the header must never hide the suite; the fixture raises properly
        return f"acceptance: no device profile ({e})"
