"""Pure tests of the per-version metrics (``sglang_ext.metrics``) on a registry of their own, and
of the /metrics route that serves them (``lora_registry_patch.mount_metrics_route``) against
SGLang's own; the real engine's ``/metrics`` is scraped in test_metrics_engines.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.testclient import TestClient

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import EngineStatus, EngineVersionState, VersionStatus
from sglang_ext import hooks
from sglang_ext import lora_registry_patch as upstream
from sglang_ext.engine_state import engine_state
from sglang_ext.metrics import LIVE_STATES, NO_METRICS, VersionMetrics

S = EngineVersionState
NAME = "relax_policy_lora@e-v1-0123456789ab"


def version(name: str, state: EngineVersionState, in_flight: int | None = 0) -> VersionStatus:
    return VersionStatus(
        lora_name=name, state=state, in_flight=in_flight, incarnation="i" * 16, created_at=0.0, updated_at=0.0
    )


class FakeEngine:
    """The engine's status as the metrics read it: versions by name, in publication order."""

    def __init__(self) -> None:
        self.versions: dict[str, VersionStatus] = {}

    def set(self, name: str, state: EngineVersionState, in_flight: int | None = 0) -> None:
        self.versions[name] = version(name, state, in_flight)

    def status(self) -> EngineStatus:
        return EngineStatus(incarnation="i" * 16, versions=tuple(self.versions.values()))

    def holds_slot(self, lora_name: str) -> bool:
        v = self.versions.get(lora_name)
        return v is not None and v.state.holds_slot


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def m(engine: FakeEngine) -> tuple[VersionMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = VersionMetrics(engine, registry)
    for collector in metrics.collectors():
        registry.register(collector)  # as mount_metrics_route does on SGLang's scrape registry
    return metrics, registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def versions_named(registry: CollectorRegistry) -> dict[str, int]:
    """Series per version: every sample carrying a ``lora_name`` label."""
    out: dict[str, int] = {}
    for family in registry.collect():
        for s in family.samples:
            if "lora_name" in s.labels:
                out[s.labels["lora_name"]] = out.get(s.labels["lora_name"], 0) + 1
    return out


def test_the_live_states_are_exactly_the_slot_holding_ones() -> None:
    assert set(LIVE_STATES) == {s for s in EngineVersionState if EngineVersionState(s).holds_slot}
    assert S.UNLOADED not in LIVE_STATES and S.CLEANED not in LIVE_STATES


def test_the_state_gauge_is_one_hot_and_follows_the_version(m, engine) -> None:
    _, reg = m
    engine.set(NAME, S.READY_LOCAL, in_flight=3)
    for s in LIVE_STATES:
        assert value(reg, "sglang:lora_version_state", lora_name=NAME, state=s.value) == (s is S.READY_LOCAL)
    assert value(reg, "sglang:lora_version_in_flight", lora_name=NAME) == 3
    assert value(reg, "sglang:lora_version_slots_in_use") == 1
    engine.set(NAME, S.RECLAIMING, in_flight=1)
    assert value(reg, "sglang:lora_version_state", lora_name=NAME, state="READY_LOCAL") == 0
    assert value(reg, "sglang:lora_version_state", lora_name=NAME, state="RECLAIMING") == 1
    assert value(reg, "sglang:lora_version_in_flight", lora_name=NAME) == 1
    assert value(reg, "sglang:lora_version_slots_in_use") == 1


@pytest.mark.parametrize("end", [S.UNLOADED, S.CLEANED])
def test_a_versions_series_end_with_it(m, engine, end) -> None:
    metrics, reg = m
    engine.set(NAME, S.READY_LOCAL, in_flight=0)
    metrics.served(NAME)
    assert versions_named(reg) == {NAME: len(LIVE_STATES) + 2}  # states, in-flight, requests
    engine.set(NAME, end, in_flight=None)
    assert versions_named(reg) == {}
    assert value(reg, "sglang:lora_version_slots_in_use") == 0


def test_series_are_bounded_by_the_live_versions_not_by_history(m, engine) -> None:
    """A version per step, the previous one reclaimed once the next is READY: the series served
    name the (at most two) live versions, however many were published before."""
    metrics, reg = m
    per_version = len(LIVE_STATES) + 2
    previous = None
    for step in range(200):
        name = f"relax_policy_lora@e-v{step}-0123456789ab"
        engine.set(name, S.PREPARED)
        engine.set(name, S.READY_LOCAL)
        metrics.served(name)
        if previous is not None:
            engine.set(previous, S.UNLOADED, in_flight=None)
        assert versions_named(reg) == {name: per_version}
        assert value(reg, "sglang:lora_version_requests_total", lora_name=name) == 1
        previous = name
    assert len(engine.versions) == 200  # the table keeps its tombstones; the series do not


def test_request_counts_are_kept_for_live_versions_only_even_without_scrapes(m, engine) -> None:
    metrics, reg = m
    for step in range(50):
        name = f"relax_policy_lora@e-v{step}-0123456789ab"
        engine.set(name, S.READY_LOCAL)
        metrics.served(name)
        metrics.served(name)
        engine.set(name, S.UNLOADED, in_flight=None)
    # nothing scraped meanwhile: the counts of ended versions were dropped as new ones came
    assert len(metrics.series._admitted) <= 1
    assert versions_named(reg) == {}


def test_a_live_version_that_served_nothing_counts_zero(m, engine) -> None:
    metrics, reg = m
    engine.set(NAME, S.PREPARED)
    assert value(reg, "sglang:lora_version_requests_total", lora_name=NAME) == 0
    engine.set(NAME, S.READY_LOCAL)
    for _ in range(3):
        metrics.served(NAME)
    assert value(reg, "sglang:lora_version_requests_total", lora_name=NAME) == 3


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


def test_counters_count(m, engine) -> None:
    metrics, reg = m
    engine.set(NAME, S.READY_LOCAL)
    for _ in range(3):
        metrics.served(NAME)
    metrics.refused("VERSION_RECLAIMED")
    metrics.anomaly("negative_in_flight")
    metrics.drained(0.25)
    assert value(reg, "sglang:lora_version_requests_total", lora_name=NAME) == 3
    assert value(reg, "sglang:lora_version_refusals_total", code="VERSION_RECLAIMED") == 1
    assert value(reg, "sglang:lora_version_anomalies_total", kind="negative_in_flight") == 1
    assert value(reg, "sglang:lora_version_drain_seconds_count") == 1


def plugin_samples_in_default_registry() -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name.startswith("sglang:lora_version_")
    ]


def test_without_metrics_every_call_is_a_no_op() -> None:
    before = plugin_samples_in_default_registry()
    assert NO_METRICS.collectors() == ()  # nothing added to SGLang's /metrics
    NO_METRICS.served(NAME)
    NO_METRICS.refused("VERSION_RECLAIMED")
    NO_METRICS.anomaly("negative_in_flight")
    NO_METRICS.drained(1.0)
    NO_METRICS.observe_op("begin", "ok", 1.0)
    with NO_METRICS.timed_op("begin") as op:
        op["outcome"] = "x"
    with pytest.raises(RuntimeError, match="kept"), NO_METRICS.timed_op("end"):
        raise RuntimeError("kept")  # an error in the timed call is not swallowed
    assert plugin_samples_in_default_registry() == before == []


# ------------------------------------------------------------------------ the /metrics route


def write_sglang_series(multiproc_dir: Path) -> None:
    """One series as an SGLang process writes it to the multiprocess directory."""
    from prometheus_client.values import MultiProcessValue

    value_class = MultiProcessValue(process_identifier=lambda: 4242)
    v = value_class("counter", "sglang:fake", "sglang:fake_total", ("model",), ("m",), "SGLang's own")
    v.inc(7)


def scraped(app: Starlette) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = TestClient(app).get("/metrics")
    assert r.status_code == 200, r.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


@pytest.fixture()
def multiproc_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    write_sglang_series(tmp_path)
    return tmp_path


def test_a_failing_status_costs_the_version_series_never_the_scrape(multiproc_dir, monkeypatch) -> None:
    class BrokenEngine(FakeEngine):
        def status(self) -> EngineStatus:
            raise RuntimeError("table gone")

    app = Starlette()
    monkeypatch.setattr(engine_state(), "metrics", VersionMetrics(BrokenEngine(), CollectorRegistry()))
    hooks.serve_version_series_on_metrics(app)
    samples = scraped(app)
    assert samples[("sglang:fake_total", frozenset({("model", "m")}))] == 7  # SGLang's own still served
    assert not [k for k in samples if k[0].startswith("sglang:lora_version_")]


def test_the_metrics_route_is_sglangs_plus_the_version_series(multiproc_dir, engine, monkeypatch) -> None:
    """The REPLACE hook on http_server.add_prometheus_middleware mounts the route SGLang's own
    function mounts (same path, same redirect workaround, same multiprocess series), with the
    engine's per-version collector on its registry."""
    stock, ours = Starlette(), Starlette()
    upstream.symbol("add_prometheus_middleware")(stock)
    metrics = VersionMetrics(engine, CollectorRegistry())
    monkeypatch.setattr(engine_state(), "metrics", metrics)
    hooks.serve_version_series_on_metrics(ours)

    (stock_route,), (our_route,) = stock.routes, ours.routes
    assert (type(our_route), our_route.path, our_route.path_regex.pattern) == (
        type(stock_route),
        stock_route.path,
        stock_route.path_regex.pattern,
    )
    engine.set(NAME, S.READY_LOCAL, in_flight=2)
    stock_samples, our_samples = scraped(stock), scraped(ours)
    assert stock_samples[("sglang:fake_total", frozenset({("model", "m")}))] == 7
    assert {k: v for k, v in our_samples.items() if not k[0].startswith("sglang:lora_version_")} == (
        stock_samples
    )
    assert our_samples[("sglang:lora_version_in_flight", frozenset({("lora_name", NAME)}))] == 2
    engine.set(NAME, S.UNLOADED, in_flight=None)
    assert not [k for k in scraped(ours) if "lora_name" in dict(k[1])]


def test_with_metrics_off_the_route_is_sglangs_own(multiproc_dir, monkeypatch) -> None:
    stock, ours = Starlette(), Starlette()
    upstream.symbol("add_prometheus_middleware")(stock)
    monkeypatch.setattr(engine_state(), "metrics", NO_METRICS)
    hooks.serve_version_series_on_metrics(ours)
    assert scraped(ours) == scraped(stock)


def test_the_route_hook_is_registered_on_sglangs_metrics_target() -> None:
    assert upstream.METRICS_ROUTE in upstream.MAIN_PROCESS_TARGETS
    assert upstream.METRICS_ROUTE.endswith(".http_server.add_prometheus_middleware")
    from sglang.srt.entrypoints import http_server

    # http_server calls the name it imported from utils.common: the one the REPLACE mirrors
    assert http_server.add_prometheus_middleware is upstream.symbol("add_prometheus_middleware")
