"""The terminal paths that need a full scheduler: abort of a *queued* request, the 503 the
scheduler answers when its waiting queue is full (both after the tokenizer side acquired), and
repeated terminal messages for one request.

A dedicated engine with ``--max-running-requests 1 --max-queued-requests 1``: r1 runs, r2 waits in
the queue, r3 finds the queue full.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from _engine_helpers import Published, generate, in_flight, snapshot_of, wait_in_flight

from lora_versions_dev import prestart
from lora_versions_dev.farm import PROMPT
from lora_versions_dev.launcher import EngineSpec, spawn_engine
from relax_glue.engine_client import QUEUE_FULL_MESSAGE

pytestmark = pytest.mark.engine



@prestart.prestartable("queue_engine")
def _spawn_queue_engine(fixtures, run_dir):
    spec = EngineSpec(
        name="queue-limited",
        model_path=fixtures.model_dir,
        log_path=run_dir / "queue-limited.log",
        extra_args=["--max-running-requests", "1", "--max-queued-requests", "1"],
    )
    return spawn_engine(spec)


@pytest.fixture(scope="module")
def queue_engine(fixtures, run_dir, prestarts):
    with prestart.serving(prestarts, "queue_engine", fixtures, run_dir) as engine:
        yield engine


def _start(url: str, name: str, rid: str, results: dict) -> threading.Thread:
    def run() -> None:
        results[rid] = generate(url, PROMPT, name, max_new_tokens=1500, rid=rid)

    t = threading.Thread(target=run)
    t.start()
    return t


def _scheduler_counts(url: str) -> tuple[int, int]:
    """(running, waiting) requests as the scheduler itself counts them (SGLang's ``/v1/loads``):
    in flight is the tokenizer side, which counts a request before the scheduler has seen it."""
    r = httpx.get(f"{url}/v1/loads", params={"include": "core"}, timeout=10)
    assert r.status_code == 200, r.text
    [load] = r.json()["loads"]
    return load["num_running_reqs"], load["num_waiting_reqs"]


def _wait_scheduler(url: str, running: int, waiting: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _scheduler_counts(url) == (running, waiting):
            return
        time.sleep(0.02)
    raise AssertionError(f"scheduler never at {running} running, {waiting} waiting: {_scheduler_counts(url)}")


def _through_the_scheduler(url: str) -> None:
    """One base-model request end to end. Sent after the aborts answered, it reaches the scheduler
    after them and, with one running slot, runs only once the aborted request left it; its reply
    comes back the way the aborts' own outputs came, after them. So every release the aborts could
    cause has happened when this returns."""
    r = generate(url, PROMPT, max_new_tokens=2)
    assert r.status_code == 200, r.text


def test_abort_of_a_queued_request_and_queue_full_503_release_once(queue_engine, fixtures):
    url = queue_engine.url
    a = Published(queue_engine, snapshot_of(fixtures.adapter_dir("A")))
    results: dict = {}
    running, queued = uuid.uuid4().hex, uuid.uuid4().hex
    threads = [_start(url, a.name, running, results)]
    _wait_scheduler(url, running=1, waiting=0)  # r1 admitted and decoding
    assert in_flight(url, a.name) == 1
    threads.append(_start(url, a.name, queued, results))
    _wait_scheduler(url, running=1, waiting=1)  # r2 in the scheduler's queue: it is full now
    assert in_flight(url, a.name) == 2

    full = generate(url, PROMPT, a.name, max_new_tokens=4)
    assert full.status_code == 503, full.text  # the queue is full: rejected after acquire
    # The words the trainer-side client recognises as "not admitted, may be sent again".
    assert QUEUE_FULL_MESSAGE in full.text, full.text
    wait_in_flight(url, a.name, 2)  # ... and released exactly once

    assert httpx.post(f"{url}/abort_request", json={"rid": queued}, timeout=10).status_code == 200
    wait_in_flight(url, a.name, 1)  # the queued one released; the running one still counted
    assert httpx.post(f"{url}/abort_request", json={"rid": running}, timeout=10).status_code == 200
    for t in threads:
        t.join(timeout=120)
    wait_in_flight(url, a.name, 0)
    assert results[queued].json()["meta_info"]["finish_reason"]["type"] == "abort"
    a.finish()  # reclaim completes with exactly one physical unload


def test_repeated_terminal_messages_release_nothing_more(queue_engine, fixtures):
    """Issue 10: aborts of a request that already finished, and two aborts of one running
    request: every terminal message after the first releases nothing (the count ends at 0, not
    -1), and the reclaim still unloads exactly once."""
    url = queue_engine.url
    b = Published(queue_engine, snapshot_of(fixtures.adapter_dir("B")))
    rid = uuid.uuid4().hex
    assert generate(url, PROMPT, b.name, max_new_tokens=4, rid=rid).status_code == 200
    for _ in range(3):  # terminal messages for a request that already finished
        assert httpx.post(f"{url}/abort_request", json={"rid": rid}, timeout=10).status_code == 200
    _through_the_scheduler(url)
    assert in_flight(url, b.name) == 0

    results: dict = {}
    running = uuid.uuid4().hex

    def run() -> None:
        # long enough that both aborts land while it decodes (60 tokens once finished first in CI)
        results["r"] = generate(url, PROMPT, b.name, max_new_tokens=1500, rid=running)

    t = threading.Thread(target=run)
    t.start()
    wait_in_flight(url, b.name, 1)
    aborts = [
        threading.Thread(target=httpx.post, args=(f"{url}/abort_request",), kwargs={"json": {"rid": running}})
        for _ in range(2)
    ]
    for th in aborts:
        th.start()
    for th in [*aborts, t]:
        th.join()
    assert results["r"].json()["meta_info"]["finish_reason"]["type"] == "abort", results["r"].text[:300]
    wait_in_flight(url, b.name, 0)
    _through_the_scheduler(url)
    assert in_flight(url, b.name) == 0  # not -1: the second abort released nothing
    b.finish()
