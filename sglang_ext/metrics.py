"""Per-version metrics on SGLang's own ``/metrics`` (an engine started with ``--enable-metrics``).

SGLang serves ``/metrics`` from its main process with prometheus_client in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set before any process starts): its route collects a registry of
its own, built in ``add_prometheus_middleware``, holding one ``MultiProcessCollector`` that reads
back what every process wrote to that directory. A series written there lives as long as the
engine: multiprocess mode has no way to remove one. So the plugin's metrics come in two kinds:

Series labelled by version come from :class:`VersionSeries`, a collector on that same scrape
registry (``lora_registry_patch.mount_metrics_route``) that yields them from the engine's own
status at each scrape, for the versions that hold an engine slot (``EngineVersionState.holds_slot``) and for
no other. A version's series end with it, so a run that publishes a version per step serves
the series of at most ``managed_capacity`` versions, never of its history:

* ``sglang:lora_version_state{lora_name, state}``: 1 for a live version's current state, 0 for
  the other states a live version can be in;
* ``sglang:lora_version_in_flight{lora_name}``: SGLang's native in-flight count for it;
* ``sglang:lora_version_requests_total{lora_name}``: generation requests admitted for it (the
  count is kept here, for live versions only: a counter that ends with its version);
* ``sglang:lora_version_slots_in_use``: managed versions holding engine capacity.

Series not labelled by version (a bounded set of labels) go through the multiprocess directory,
like SGLang's own. Names follow SGLang's (``sglang:<name>``):

* ``sglang:lora_version_op_duration_seconds{op, outcome}``: begin, bucket, end, cleanup and
  reclaim calls (outcome ``ok``, ``draining`` or the error code);
* ``sglang:lora_version_drain_seconds``: from a reclaim's start to the last in-flight request;
* ``sglang:lora_version_refusals_total{code}``: typed refusals, control and generation;
* ``sglang:lora_version_anomalies_total{kind}``: e.g. a negative native count seen at reclaim.

With metrics off, :data:`NO_METRICS` takes every call and does nothing. prometheus_client is
imported only when metrics are on, after SGLang set the multiprocess directory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from lora_contract.protocol import EngineStatus, EngineVersionState, VersionStatus
from sglang_ext.plugin_log import log_line

__all__ = ["NO_METRICS", "EngineView", "Metrics", "VersionMetrics", "VersionSeries"]

PREFIX = "sglang:lora_version_"
# Control calls take milliseconds (begin) to minutes (a large end, a long drain).
OP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The states of the one-hot state gauge: those a version holding a slot can be in.
LIVE_STATES = tuple(s for s in EngineVersionState if EngineVersionState(s).holds_slot)


class EngineView(Protocol):
    """What the per-version series read of the engine (``engine_state.EngineState``)."""

    def status(self) -> EngineStatus: ...
    def holds_slot(self, lora_name: str) -> bool: ...


class Metrics(Protocol):
    def collectors(self) -> tuple[Any, ...]: ...
    def served(self, lora_name: str) -> None: ...
    def refused(self, code: str) -> None: ...
    def drained(self, seconds: float) -> None: ...
    def anomaly(self, kind: str) -> None: ...
    def observe_op(self, op: str, outcome: str, seconds: float) -> None: ...
    def timed_op(self, op: str) -> Any: ...


class _NoMetrics:
    def collectors(self) -> tuple[Any, ...]:
        return ()

    def served(self, lora_name: str) -> None:
        pass

    def refused(self, code: str) -> None:
        pass

    def drained(self, seconds: float) -> None:
        pass

    def anomaly(self, kind: str) -> None:
        pass

    def observe_op(self, op: str, outcome: str, seconds: float) -> None:
        pass

    @contextmanager
    def timed_op(self, op: str) -> Iterator[dict[str, str]]:
        yield {}


NO_METRICS: Metrics = _NoMetrics()


def live_versions(status: EngineStatus) -> list[VersionStatus]:
    """The versions whose series are served: those holding an engine slot, the one rule of
    ``EngineVersionState.holds_slot`` (UNLOADED and CLEANED versions are history)."""
    return [v for v in status.versions if v.state.holds_slot]


class VersionSeries:
    """A prometheus_client collector of the series labelled by version, read from the engine's
    own status at each scrape: nothing is stored per version but the admitted request counts of
    live versions."""

    def __init__(self, engine: EngineView) -> None:
        self._engine = engine
        self._admitted: dict[str, int] = {}

    def served(self, lora_name: str) -> None:
        if lora_name not in self._admitted:
            # once per version: drop the counts of ended versions, so they stay bounded by the
            # live versions even on an engine nobody scrapes (a lookup per counted version)
            self._admitted = {n: c for n, c in self._admitted.items() if self._engine.holds_slot(n)}
        self._admitted[lora_name] = self._admitted.get(lora_name, 0) + 1

    def _keep_only(self, live: list[VersionStatus]) -> None:
        names = {v.lora_name for v in live}
        self._admitted = {n: c for n, c in self._admitted.items() if n in names}

    def describe(self) -> Iterator[Any]:
        """The families without samples: lets a registry check names without reading the status."""
        return iter(self._families())

    def collect(self) -> Iterator[Any]:
        try:
            live = live_versions(self._engine.status())
        except Exception as exc:  # a scrape must never fail on the plugin's series: SGLang's are on it
            log_line(f"per-version metrics not collected: {type(exc).__name__}: {exc}")
            return iter(())
        self._keep_only(live)
        state, in_flight, requests, slots = self._families()
        for v in live:
            for s in LIVE_STATES:
                state.add_metric([v.lora_name, s.value], 1.0 if v.state is s else 0.0)
            in_flight.add_metric([v.lora_name], float(v.in_flight or 0))
            requests.add_metric([v.lora_name], float(self._admitted.get(v.lora_name, 0)))
        slots.add_metric([], float(len(live)))
        return iter((state, in_flight, requests, slots))

    @staticmethod
    def _families() -> tuple[Any, Any, Any, Any]:
        # on use, as SGLang does: prometheus_client reads PROMETHEUS_MULTIPROC_DIR at import
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        return (
            GaugeMetricFamily(
                f"{PREFIX}state",
                "1 for a live managed version's current engine state, 0 for its other live states",
                labels=["lora_name", "state"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}in_flight",
                "SGLang's native in-flight request count of a live managed version",
                labels=["lora_name"],
            ),
            CounterMetricFamily(
                f"{PREFIX}requests",
                "generation requests admitted for a live managed version",
                labels=["lora_name"],
            ),
            GaugeMetricFamily(f"{PREFIX}slots_in_use", "managed versions holding engine capacity", labels=[]),
        )


class VersionMetrics:
    """The live metrics of one engine's main process."""

    def __init__(self, engine: EngineView, registry: Any = None) -> None:
        """``engine``: read at each scrape and at a version's first request. ``registry``: where the series
        not labelled by version go, prometheus_client's default (written to the multiprocess
        directory SGLang's scrape reads back) unless a test passes its own. The per-version
        series are :attr:`series`, registered on SGLang's scrape registry by whoever builds it."""
        # on use, as SGLang does: prometheus_client reads PROMETHEUS_MULTIPROC_DIR at import
        from prometheus_client import REGISTRY, Counter, Histogram

        kw = {"registry": registry if registry is not None else REGISTRY}
        self.series = VersionSeries(engine)
        self._ops = Histogram(
            f"{PREFIX}op_duration_seconds",
            "control calls by operation and outcome",
            ["op", "outcome"],
            buckets=OP_BUCKETS,
            **kw,
        )
        self._drain = Histogram(
            f"{PREFIX}drain_seconds",
            "from a reclaim's start to its last in-flight request",
            buckets=OP_BUCKETS,
            **kw,
        )
        self._refusals = Counter(f"{PREFIX}refusals", "typed refusals by error code", ["code"], **kw)
        self._anomalies = Counter(f"{PREFIX}anomalies", "anomalies seen by the plugin", ["kind"], **kw)

    def collectors(self) -> tuple[Any, ...]:
        return (self.series,)

    def served(self, lora_name: str) -> None:
        self.series.served(lora_name)

    def refused(self, code: str) -> None:
        self._refusals.labels(code).inc()

    def drained(self, seconds: float) -> None:
        self._drain.observe(seconds)

    def anomaly(self, kind: str) -> None:
        self._anomalies.labels(kind).inc()

    def observe_op(self, op: str, outcome: str, seconds: float) -> None:
        self._ops.labels(op, outcome).observe(seconds)

    @contextmanager
    def timed_op(self, op: str) -> Iterator[dict[str, str]]:
        """Time one control call; the caller may set ``outcome`` in the yielded dict, an
        exception names its error code (or ``error``)."""
        t0 = time.monotonic()
        result = {"outcome": "ok"}
        try:
            yield result
        except BaseException as exc:
            code = getattr(exc, "code", None)
            result["outcome"] = str(getattr(code, "value", code) or "error")
            raise
        finally:
            self.observe_op(op, result["outcome"], time.monotonic() - t0)
