"""Per-version metrics on SGLang's own ``/metrics`` (an engine started with ``--enable-metrics``).

SGLang serves ``/metrics`` from its main process with prometheus_client in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, set before any process starts), collecting what every process
wrote to that directory. The plugin's metrics live in the main process, where the version table,
the control routes and SGLang's native per-request LoRA counts are, and go through the same
client and directory. Names follow SGLang's (``sglang:<name>``):

* ``sglang:lora_version_state{lora_name, state}``: 1 for a version's current state, 0 for the
  states it left (a gauge, refreshed from the engine's own status on every scrape);
* ``sglang:lora_version_in_flight{lora_name}``: SGLang's native in-flight count for it;
* ``sglang:lora_version_slots_in_use``: managed versions holding engine capacity;
* ``sglang:lora_version_requests_total{lora_name}``: generation requests admitted for it;
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

from sglang_ext.protocol import EngineStatus

__all__ = ["NO_METRICS", "Metrics", "VersionMetrics"]

PREFIX = "sglang:lora_version_"
# Control calls take milliseconds (begin) to minutes (a large end, a long drain).
OP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics(Protocol):
    def refresh(self, status: EngineStatus) -> None: ...
    def served(self, lora_name: str) -> None: ...
    def refused(self, code: str) -> None: ...
    def drained(self, seconds: float) -> None: ...
    def anomaly(self, kind: str) -> None: ...
    def observe_op(self, op: str, outcome: str, seconds: float) -> None: ...
    def timed_op(self, op: str) -> Any: ...


class _NoMetrics:
    def refresh(self, status: EngineStatus) -> None:
        pass

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


class VersionMetrics:
    """The live metrics of one engine's main process."""

    def __init__(self, registry: Any = None) -> None:
        """``registry``: prometheus_client's default (what SGLang's multiprocess collector reads
        back from the files) unless a test passes its own."""
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        kw = {"registry": registry if registry is not None else REGISTRY}

        # "livemostrecent": the value this (live) process set last; the plugin's gauges have one
        # writer, the main process.
        self._state = Gauge(
            f"{PREFIX}state",
            "1 for a managed version's current engine state, 0 for the states it left",
            ["lora_name", "state"],
            multiprocess_mode="livemostrecent",
            **kw,
        )
        self._in_flight = Gauge(
            f"{PREFIX}in_flight",
            "SGLang's native in-flight request count of a managed version",
            ["lora_name"],
            multiprocess_mode="livemostrecent",
            **kw,
        )
        self._slots = Gauge(
            f"{PREFIX}slots_in_use",
            "managed versions holding engine capacity",
            multiprocess_mode="livemostrecent",
            **kw,
        )
        self._requests = Counter(
            f"{PREFIX}requests", "generation requests admitted for a managed version", ["lora_name"], **kw
        )
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
        self._last_state: dict[str, str] = {}

    def refresh(self, status: EngineStatus) -> None:
        from sglang_ext.version_table import holds_engine_slot

        slots = 0
        for v in status.versions:
            state = v.state.value
            before = self._last_state.get(v.lora_name)
            if before is not None and before != state:
                self._state.labels(v.lora_name, before).set(0)
            self._state.labels(v.lora_name, state).set(1)
            self._last_state[v.lora_name] = state
            self._in_flight.labels(v.lora_name).set(v.in_flight or 0)
            slots += holds_engine_slot(v.state)
        self._slots.set(slots)

    def served(self, lora_name: str) -> None:
        self._requests.labels(lora_name).inc()

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
