"""The acceptance suite's deployment: one device profile, two managed engines and the clean
baselines, started once per test session; the report written when the session ends.

The same file runs on CPU (CI, the tiny fixtures) and on a CUDA host (the bf16 Qwen3-0.6B-shaped
model, triton LoRA, CUDA graphs); see ``lora_versions_dev.device_profile``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _acceptance import (
    ACCEPTANCE_ADMIN_KEY,
    EPSILON_FACTOR,
    STABILITY_PREFIX_LENGTHS,
    STABILITY_REPEATS,
    TURN_TOKENS,
    Baselines,
    Report,
    baseline_stability,
    derive_epsilon,
    greedy,
    prompt,
    provenance,
)

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
def report(
    profile: DeviceProfile, acceptance_fixtures: AcceptanceFixtures, report_dir: Path
) -> Iterator[Report]:
    """The report, on disk from the start with its provenance (code revision, SGLang version,
    device, fixture digests); every threshold is written into it before the run it governs."""
    rep = Report(profile, report_dir, provenance(profile, acceptance_fixtures))
    rep.write()
    yield rep
    rep.write()
    print(f"\n{rep.table()}\n[acceptance] report: {report_dir / 'report.json'}")


@pytest.fixture(scope="session")
def epsilon(deployment: dict, profile: DeviceProfile, report: Report) -> float:
    """RFC 7.2's tolerance, measured before any comparison: each clean baseline answers fixed
    fresh prefixes ``STABILITY_REPEATS`` times; a baseline whose tokens change between repeats
    fails the suite (it cannot be a baseline); epsilon = max(the profile's floor,
    ``EPSILON_FACTOR`` x the largest logprob spread), written to the report before it is used."""
    prefixes = [prompt(800 + i, n) for i, n in enumerate(STABILITY_PREFIX_LENGTHS)]
    report.fix("rfc72.sampling_params", greedy(TURN_TOKENS), "greedy: both sides generate the same tokens")
    report.fix("rfc72.stability_prefix_token_ids", prefixes, "fresh prompts of the compared lengths")
    report.fix("rfc72.stability_repeats", STABILITY_REPEATS)
    report.fix("rfc72.epsilon_rule", f"max({profile.epsilon_floor}, {EPSILON_FACTOR} x max spread)")

    async def measure():
        baselines = Baselines({a: deployment[f"base_{a}"].url for a in ("A", "B")})
        try:
            return await baseline_stability(baselines, prefixes, TURN_TOKENS, STABILITY_REPEATS)
        finally:
            await baselines.aclose()

    stability = asyncio.run(measure())
    report.add("rfc72_baseline_stability", dataclasses.asdict(stability))
    assert all(stability.tokens_stable.values()), f"a clean baseline is not stable: {stability}"
    eps = derive_epsilon(list(stability.spread.values()), EPSILON_FACTOR, profile.epsilon_floor)
    return report.fix("rfc72.logprob_epsilon", eps, f"derived from the measured spread {stability.spread}")


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
