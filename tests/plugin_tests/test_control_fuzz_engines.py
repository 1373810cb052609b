"""The control-endpoint fuzzer (lora_versions_dev/control_fuzz.py), short and seeded, against a
real engine of its own: malformed, out-of-order, cross-version, concurrent and adversarial-but-
valid requests interleaved with valid publications, with 0 violations. The long run (10,000+
requests) is ``bench/control_fuzz.py``."""

from __future__ import annotations

import json

import pytest

from lora_versions_dev import prestart
from lora_versions_dev.control_fuzz import (
    ControlFuzzer,
    attach_reference_tokens,
    crafted_adapters,
    fuzz_engine_spec,
)

pytestmark = pytest.mark.engine

ADMIN_KEY = "lora-versions-fuzz-admin-key"
SEEDS = (15, 1507)
REQUESTS_PER_SEED = 300


@prestart.prestartable("booting_fuzz_engine")
def _spawn_fuzz_engine(fixtures, run_dir):
    from lora_versions_dev.launcher import spawn_engine

    return spawn_engine(fuzz_engine_spec(fixtures.model_dir, run_dir / "fuzz.log", ADMIN_KEY))


@pytest.fixture(scope="module")
def booting_fuzz_engine(fixtures, run_dir, prestarts):
    """The fuzzer's engine, spawned ahead of its use and maybe not yet healthy: it boots
    while :func:`adapters` computes the reference tokens in this process."""
    from lora_versions_dev.launcher import stop_engine

    engine = prestart.take(prestarts, "booting_fuzz_engine", fixtures, run_dir)
    try:
        yield engine
    finally:
        stop_engine(engine)


@pytest.fixture(scope="module")
def adapters(booting_fuzz_engine, fixtures, tmp_path_factory):
    out = crafted_adapters({name: fixtures.adapter_dir(name) for name in ("A", "B", "C")})
    attach_reference_tokens(out, fixtures.model_dir, tmp_path_factory.mktemp("fuzz_refs"))
    return out


@pytest.fixture(scope="module")
def fuzz_engine(booting_fuzz_engine, adapters):
    booting_fuzz_engine.wait_healthy(booting_fuzz_engine.spec.startup_timeout_s)
    return booting_fuzz_engine


@pytest.mark.parametrize("seed", SEEDS)
def test_control_fuzz_finds_no_violation(fuzz_engine, adapters, seed, run_dir):
    fuzzer = ControlFuzzer(
        fuzz_engine.url,
        adapters,
        seed=seed,
        admin_key=ADMIN_KEY,
        log_path=fuzz_engine.log_path,
        alive=fuzz_engine.alive,
    )
    report = fuzzer.run(REQUESTS_PER_SEED)
    summary = report.summary()
    (run_dir / f"control_fuzz_{seed}.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n[control fuzz] {summary}")
    assert report.violations == []
    assert report.requests >= REQUESTS_PER_SEED
    # the run did what it is for: valid publications reached READY among the refusals
    assert report.publications_ready >= 3
    assert summary["by_status"].get("200", 0) > 0 and summary["by_status"].get("409", 0) > 0


def test_the_fuzzer_detects_a_violation(fuzz_engine, adapters):
    """Negative control: a fuzzer whose model of a valid adapter's tokens is wrong must report it."""
    wrong = [a for a in adapters if a.label == "A"]
    wrong = [type(a)(a.label, a.config, a.tensors, tokens=[0] * len(a.tokens)) for a in wrong]
    fuzzer = ControlFuzzer(
        fuzz_engine.url,
        wrong + [a for a in adapters if a.refused_at is not None],
        seed=3,
        admin_key=ADMIN_KEY,
        log_path=fuzz_engine.log_path,
        alive=fuzz_engine.alive,
    )
    report = fuzzer.run(200)  # enough that A is published and generated on at least once
    assert any("served" in v or "generate on READY" in v for v in report.violations), report.violations
