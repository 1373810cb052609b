"""The per-version metrics on a REAL engine's own ``/metrics`` (``--enable-metrics``): scraped
before and after a staged publication, traffic, a refusal and a reclaim, next to SGLang's own
series (same endpoint, same multiprocess collector)."""

from __future__ import annotations

import threading

import httpx
import pytest
from _engine_helpers import Published, error_code, generate, snapshot_of, wait_in_flight
from prometheus_client.parser import text_string_to_metric_families

from sglang_ext.devtools.launcher import EngineSpec, running_engines

pytestmark = pytest.mark.engine

PROMPT = [302, 356, 417, 494, 439]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def metrics_engine(fixtures, run_dir):
    spec = EngineSpec(
        name="metrics",
        model_path=fixtures.model_dir,
        log_path=run_dir / "metrics.log",
        extra_args=["--enable-metrics"],
    )
    with running_engines([spec]) as (engine,):
        yield engine


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

    a.finish()  # reclaim: drains (nothing in flight) and unloads once
    late = generate(url, PROMPT, a.name)
    assert error_code(late) == "VERSION_RECLAIMED"
    after = scrape(url)
    assert sample(after, "sglang:lora_version_state", lora_name=a.name, state="READY_LOCAL") == 0
    assert sample(after, "sglang:lora_version_state", lora_name=a.name, state="UNLOADED") == 1
    assert sample(after, "sglang:lora_version_slots_in_use") == 0
    assert op_count(after, "reclaim") == op_count(refused, "reclaim") + 1
    assert sample(after, "sglang:lora_version_drain_seconds_count") == (
        sample(refused, "sglang:lora_version_drain_seconds_count") + 1
    )
    assert sample(after, "sglang:lora_version_refusals_total", code="VERSION_RECLAIMED") == (
        sample(refused, "sglang:lora_version_refusals_total", code="VERSION_RECLAIMED") + 1
    )
    assert sample(after, requests, lora_name=a.name) == sample(
        served, requests, lora_name=a.name
    )  # not the late one
