"""The per-version metrics on a REAL engine's own ``/metrics`` (``--enable-metrics``): scraped
before and after a staged publication, traffic, a refusal and a reclaim, next to SGLang's own
series (same endpoint, same registry), and over many versions, whose series end with them.

SGLang mounts /metrics only with ``--enable-metrics``; the session's shared E0/E1 run with it
(lora_versions_dev.farm), so this module uses E0 and starts no engine of its own."""

from __future__ import annotations

import threading

import httpx
import pytest
from _engine_helpers import Published, error_code, generate, snapshot_of, versions, wait_in_flight
from prometheus_client.parser import text_string_to_metric_families

from lora_contract.protocol import EngineVersionState
from lora_versions_dev.farm import PROMPT

pytestmark = pytest.mark.engine

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def metrics_engine(engines):
    return engines[0]


def scrape(url: str) -> Samples:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def op_count(samples: Samples, op: str, outcome: str = "ok") -> float:
    return sample(samples, "sglang:lora_version_op_duration_seconds_count", op=op, outcome=outcome)


def test_metrics_follow_a_publication_its_traffic_a_refusal_and_the_reclaim(metrics_engine, fixtures):
    url = metrics_engine.url
    before = scrape(url)
    assert any(name.startswith("sglang:") and "lora_version" not in name for name, _ in before), (
        "SGLang's own series are on the same /metrics"
    )

    a = Published(metrics_engine, snapshot_of(fixtures.adapter_dir("A")))
    published = scrape(url)
    assert sample(published, "sglang:lora_version_state", lora_name=a.name, state="READY_LOCAL") == 1
    assert sample(published, "sglang:lora_version_slots_in_use") == 1
    assert op_count(published, "begin") == op_count(before, "begin") + 1
    assert op_count(published, "end") == op_count(before, "end") + 1
    assert op_count(published, "bucket") >= op_count(before, "bucket") + 2  # several ordered buckets

    for _ in range(3):
        assert generate(url, PROMPT, a.name).status_code == 200

    # one long streamed request: the in-flight gauge shows it while it runs
    body = {
        "input_ids": PROMPT,
        "lora_path": a.name,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
    }

    def stream() -> None:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    t = threading.Thread(target=stream)
    t.start()
    wait_in_flight(url, a.name, 1)
    running = scrape(url)
    t.join()
    assert sample(running, "sglang:lora_version_in_flight", lora_name=a.name) == 1
    wait_in_flight(url, a.name, 0)
    served = scrape(url)
    assert sample(served, "sglang:lora_version_in_flight", lora_name=a.name) == 0
    requests = "sglang:lora_version_requests_total"
    # (the publication's own exact-version probe at `end` is one admitted request too)
    assert sample(published, requests, lora_name=a.name) >= 1
    assert sample(served, requests, lora_name=a.name) == sample(published, requests, lora_name=a.name) + 4

    forged = generate(url, PROMPT, a.name, lora_id="0" * 32)
    assert error_code(forged) == "FORBIDDEN_FIELD"
    refused = scrape(url)
    assert sample(refused, "sglang:lora_version_refusals_total", code="FORBIDDEN_FIELD") == (
        sample(served, "sglang:lora_version_refusals_total", code="FORBIDDEN_FIELD") + 1
    )
    assert sample(refused, requests, lora_name=a.name) == sample(served, requests, lora_name=a.name)

    a.finish()  # reclaim: drains (nothing in flight) and unloads once
    late = generate(url, PROMPT, a.name)
    assert error_code(late) == "VERSION_RECLAIMED"
    after = scrape(url)
    # the version's series ended with it (test below: over many versions)
    assert a.name not in series_by_version(after)
    assert sample(after, "sglang:lora_version_slots_in_use") == 0
    assert op_count(after, "reclaim") == op_count(refused, "reclaim") + 1
    assert sample(after, "sglang:lora_version_drain_seconds_count") == (
        sample(refused, "sglang:lora_version_drain_seconds_count") + 1
    )
    assert sample(after, "sglang:lora_version_refusals_total", code="VERSION_RECLAIMED") == (
        sample(refused, "sglang:lora_version_refusals_total", code="VERSION_RECLAIMED") + 1
    )


def series_by_version(samples: Samples) -> dict[str, set[tuple[str, frozenset[tuple[str, str]]]]]:
    """Every series that carries a ``lora_name`` label, grouped by the version it names."""
    out: dict[str, set[tuple[str, frozenset[tuple[str, str]]]]] = {}
    for key in samples:
        name = dict(key[1]).get("lora_name")
        if name is not None:
            out.setdefault(name, set()).add(key)
    return out


def sglang_own_series(samples: Samples) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    return {key for key in samples if not key[0].startswith("sglang:lora_version_")}


def live_versions(url: str) -> set[str]:
    return {
        name
        for name, v in versions(url).items()
        if EngineVersionState(EngineVersionState(v["state"])).holds_slot
    }


def test_version_series_end_with_their_version_over_many_publications(metrics_engine, fixtures):
    """A version per cycle, published, served and reclaimed while the next one is already live
    (an RL run's rhythm): after every reclaim, /metrics names only the versions that still hold
    a slot, each with the same number of series, and SGLang's own series are untouched."""
    url = metrics_engine.url
    snap = snapshot_of(fixtures.adapter_dir("A"))
    assert generate(url, PROMPT).status_code == 200  # SGLang's own request series exist from here on
    own_before = sglang_own_series(scrape(url))
    assert own_before, "SGLang's own series are on the same /metrics"
    per_version: int | None = None
    previous: Published | None = None
    for _ in range(10):
        current = Published(metrics_engine, snap)
        assert generate(url, PROMPT, current.name).status_code == 200
        if previous is not None:
            previous.finish()
        live = live_versions(url)
        assert current.name in live and (previous is None or previous.name not in live)
        by_version = series_by_version(scrape(url))
        assert set(by_version) <= live, f"series of dead versions: {sorted(set(by_version) - live)}"
        assert current.name in by_version, "a live version has its series"
        per_version = per_version or len(by_version[current.name])
        assert sum(map(len, by_version.values())) == per_version * len(by_version)
        previous = current
    assert previous is not None
    previous.finish()
    assert series_by_version(scrape(url)) == {}
    assert sglang_own_series(scrape(url)) == own_before
