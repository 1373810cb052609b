"""The step fence on a real CPU engine's scheduler (issue 24), not a stand-in: the plugin's reader
(``lora_registry_patch.launched_steps``) and the fence's decision, evaluated inside the live SGLang
0.5.23 scheduler by ``tests/engine_wrappers/fence_reader_probe.py`` while managed versions are
generated on, and the fence's own log line at their real unloads (published and reclaimed
through the HTTP routes).

Without the overlap scheduler (every CPU engine) the fence must pass: a batch is processed before
the scheduler ingests the next request, and a finished request leaves the running batch before
its unload can arrive. What these tests prove is that the reader sees the scheduler's real
batches (a reader that saw nothing would pass as well)."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import ADMIN, Published, generate, in_flight, snapshot_of, wait_in_flight

from lora_versions_dev.engine_log import fence_records, log_records
from lora_versions_dev.farm import PROMPT

pytestmark = pytest.mark.engine

WRAPPERS = Path(__file__).parents[1] / "engine_wrappers"
sys.path.insert(0, str(WRAPPERS))
from fence_reader_probe import LOG_LINE  # noqa: E402


@pytest.fixture(scope="module")
def probed_engine(engines):
    """The farm's E1: it runs with this module's probe in its scheduler process (the farm's
    E1 wrapper, tests/engine_wrappers/sglang_with_scheduler_probes.py)."""
    return engines[1]


def readings(engine, lora_id: str) -> list[tuple[str, str, str, str]]:
    """What the reader in the scheduler saw of ``lora_id``: (overlap, on_adapter, done, fence_passed)."""
    records = log_records(engine.log_path.read_text(errors="replace"), LOG_LINE, lora_id)
    return [(r["overlap"], r["on_adapter"], r["done"], r["fence_passed"]) for r in records]


def wait_reading(engine, lora_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not readings(engine, lora_id):
        assert time.monotonic() < deadline, f"the reader never saw a launched step on {lora_id}"
        time.sleep(0.05)


def test_the_reader_sees_the_live_batch_that_reads_a_version(probed_engine, fixtures):
    a = Published(probed_engine, snapshot_of(fixtures.adapter_dir("A")))
    # The publication's own probe generation already ran on A (publication.py); the scheduler
    # idles after it, so the reading of the request below is logged anew.
    before = len(readings(probed_engine, a.lora_id))
    r = generate(probed_engine.url, PROMPT, a.name, max_new_tokens=16)
    assert r.status_code == 200, r.text
    seen = readings(probed_engine, a.lora_id)
    assert len(seen) > before, "the reader did not see the request's batch"
    # While A's request was in the scheduler's last batch the reader found its row there, as
    # processed (no overlap), and the fence would have passed an unload at that point.
    assert set(seen) == {("False", "1", "True", "True")}, seen
    a.finish()
    fences = fence_records(probed_engine.log_path, a.lora_id)
    got = [(f["overlap"], f["waited"], f["fence_passed"]) for f in fences]
    assert got == [("False", "0", "True")], fences


def test_an_unload_while_another_version_decodes_reads_that_batch(probed_engine, fixtures):
    """A and B decode together; A finishes and is reclaimed while B still decodes. At A's unload
    the fence reads one launched batch, B's, with no row on A's slot left in it."""
    url = probed_engine.url
    a = Published(probed_engine, snapshot_of(fixtures.adapter_dir("A")))
    b = Published(probed_engine, snapshot_of(fixtures.adapter_dir("B")))
    rid = uuid.uuid4().hex
    results: dict[str, httpx.Response] = {}
    long_b = threading.Thread(
        target=lambda: results.setdefault("b", generate(url, PROMPT, b.name, max_new_tokens=1500, rid=rid))
    )
    long_b.start()
    try:
        wait_in_flight(url, b.name, 1)
        wait_reading(probed_engine, b.lora_id)  # B's batch is live in the scheduler
        before = len(readings(probed_engine, a.lora_id))
        r = generate(url, PROMPT, a.name, max_new_tokens=8)
        assert r.status_code == 200, r.text
        assert len(readings(probed_engine, a.lora_id)) > before, "the reader never saw A's row next to B's"
        a.finish()  # reclaim: exactly one physical unload
        assert in_flight(url, b.name) == 1, "B ended before A's unload: the unload read no live batch"
        fences = fence_records(probed_engine.log_path, a.lora_id)
        got = [(f["overlap"], f["launched"], f["on_adapter"], f["waited"], f["fence_passed"]) for f in fences]
        assert got == [("False", "1", "0", "0", "True")], fences
    finally:
        httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=ADMIN, timeout=10)
        long_b.join(timeout=120)
    wait_in_flight(url, b.name, 0)
    assert results["b"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    b.finish()
