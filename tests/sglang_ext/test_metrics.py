"""Pure tests of the per-version metrics (``sglang_ext.metrics``) on a registry of their own;
the real engine's ``/metrics`` is scraped in test_metrics_engines.py."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.metrics import NO_METRICS, VersionMetrics
from sglang_ext.protocol import EngineStatus, EngineVersionState, VersionStatus

NAME = "relax_policy_lora@e-v1-0123456789ab"


def status(state: EngineVersionState, in_flight: int | None = 0) -> EngineStatus:
    v = VersionStatus(
        lora_name=NAME, state=state, in_flight=in_flight, incarnation="i" * 16, created_at=0.0, updated_at=0.0
    )
    return EngineStatus(incarnation="i" * 16, versions=(v,))


@pytest.fixture()
def m() -> tuple[VersionMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return VersionMetrics(registry), registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_the_state_gauge_is_one_hot_and_follows_the_version(m) -> None:
    metrics, reg = m
    metrics.refresh(status(EngineVersionState.READY_LOCAL, in_flight=3))
    assert value(reg, "sglang:lora_version_state", lora_name=NAME, state="READY_LOCAL") == 1
    assert value(reg, "sglang:lora_version_in_flight", lora_name=NAME) == 3
    assert value(reg, "sglang:lora_version_slots_in_use") == 1
    metrics.refresh(status(EngineVersionState.UNLOADED, in_flight=None))
    assert value(reg, "sglang:lora_version_state", lora_name=NAME, state="READY_LOCAL") == 0
    assert value(reg, "sglang:lora_version_state", lora_name=NAME, state="UNLOADED") == 1
    assert value(reg, "sglang:lora_version_in_flight", lora_name=NAME) == 0
    assert value(reg, "sglang:lora_version_slots_in_use") == 0


def test_a_timed_op_records_its_outcome_or_its_error_code(m) -> None:
    metrics, reg = m
    with metrics.timed_op("begin"):
        pass
    with pytest.raises(LoraVersionError), metrics.timed_op("begin"):
        raise LoraVersionError(ErrorCode.CAPACITY_ERROR, "full")
    with metrics.timed_op("reclaim") as op:
        op["outcome"] = "draining"
    with pytest.raises(RuntimeError), metrics.timed_op("end"):
        raise RuntimeError("boom")
    count = "sglang:lora_version_op_duration_seconds_count"
    assert value(reg, count, op="begin", outcome="ok") == 1
    assert value(reg, count, op="begin", outcome="CAPACITY_ERROR") == 1
    assert value(reg, count, op="reclaim", outcome="draining") == 1
    assert value(reg, count, op="end", outcome="error") == 1


def test_counters_count(m) -> None:
    metrics, reg = m
    for _ in range(3):
        metrics.served(NAME)
    metrics.refused("VERSION_RECLAIMED")
    metrics.anomaly("negative_in_flight")
    metrics.drained(0.25)
    assert value(reg, "sglang:lora_version_requests_total", lora_name=NAME) == 3
    assert value(reg, "sglang:lora_version_refusals_total", code="VERSION_RECLAIMED") == 1
    assert value(reg, "sglang:lora_version_anomalies_total", kind="negative_in_flight") == 1
    assert value(reg, "sglang:lora_version_drain_seconds_count") == 1


def test_without_metrics_every_call_is_a_no_op() -> None:
    NO_METRICS.refresh(status(EngineVersionState.READY_LOCAL))
    NO_METRICS.served(NAME)
    with NO_METRICS.timed_op("begin") as op:
        op["outcome"] = "x"
