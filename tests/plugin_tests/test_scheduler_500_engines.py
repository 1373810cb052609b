"""Issue 10 on a real engine: a request that SGLang's scheduler ends with a 500 (at admission,
and mid-decode after it acquired the version's native count and decoded a few tokens) releases
that count exactly once. The count returns to 0 (never -1, never stuck at 1), the version keeps
serving, the reclaim then completes with exactly one physical unload, and the trainer-side client
reports the 500 as an unknown outcome (the session layer never resends it on its own).

The 500s are SGLang's own upstream abort paths, taken for marked rids by
``tests/engine_wrappers/scheduler_500_faults.py`` inside the real scheduler process."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import (
    ADMIN,
    Published,
    error_code,
    generate,
    in_flight,
    reclaim,
    snapshot_of,
    unload_log_count,
    versions,
    wait_in_flight,
)

from lora_versions_dev.farm import PROMPT, local_source_dir
from relax_glue.engine_client import EngineClient, OutcomeUnknown

pytestmark = pytest.mark.engine

WRAPPERS = Path(__file__).parents[1] / "engine_wrappers"
sys.path.insert(0, str(WRAPPERS))
from scheduler_500_faults import (  # noqa: E402
    AT_ADMISSION,
    FAIL_ON_SIGNAL,
    FINISH_ON_SIGNAL,
    LOG_LINE,
    MID_DECODE,
    signal_path,
)


@pytest.fixture(scope="module")
def faulty_engine(engines):
    """The farm's E1: it runs with this module's probe in its scheduler process (the farm's
    E1 wrapper, tests/engine_wrappers/sglang_with_scheduler_probes.py)."""
    return engines[1]


def injected(engine, rid: str) -> bool:
    return f"rid={rid}" in "".join(
        line for line in engine.log_path.read_text().splitlines(keepends=True) if LOG_LINE in line
    )


def stream(url: str, name: str, rid: str, max_new_tokens: int) -> tuple[int, list[dict]]:
    return stream_into(url, name, rid, max_new_tokens, [])


def stream_into(url: str, name: str, rid: str, max_new_tokens: int, chunks: list[dict]) -> tuple[int, list]:
    """A streamed generation; each chunk is appended to ``chunks`` as it arrives."""
    body = {
        "rid": rid,
        "input_ids": PROMPT,
        "lora_path": name,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunks.append(json.loads(line[len("data:") :]))
        return r.status_code, chunks


def test_scheduler_500s_release_the_native_count_exactly_once(faulty_engine, fixtures):
    url = faulty_engine.url
    a = Published(faulty_engine, snapshot_of(fixtures.adapter_dir("A")))

    admit = f"{uuid.uuid4().hex}{AT_ADMISSION}"
    r = generate(url, PROMPT, a.name, max_new_tokens=8, rid=admit)
    assert r.status_code == 500, r.text
    assert injected(faulty_engine, admit)  # the fault fired, and through the scheduler
    wait_in_flight(url, a.name, 0)

    decode = f"{uuid.uuid4().hex}{MID_DECODE}"
    r = generate(url, PROMPT, a.name, max_new_tokens=200, rid=decode)
    assert r.status_code == 500, r.text
    assert injected(faulty_engine, decode)
    wait_in_flight(url, a.name, 0)

    streamed = f"{uuid.uuid4().hex}{MID_DECODE}"
    status, chunks = stream(url, a.name, streamed, 200)
    assert injected(faulty_engine, streamed)
    assert status == 200 and chunks, chunks  # the stream had started: the error comes in-band
    last = chunks[-1]
    reason = last.get("meta_info", {}).get("finish_reason") or last.get("error", {})
    assert "500" in json.dumps(reason) or "InternalServerError" in json.dumps(reason), last
    wait_in_flight(url, a.name, 0)

    # Later messages for those rids (an abort after the 500) release nothing more.
    for rid in (admit, decode, streamed):
        r = httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
    ok = generate(url, PROMPT, a.name, max_new_tokens=8)
    assert ok.status_code == 200, ok.text  # the version keeps serving exactly
    assert in_flight(url, a.name) == 0  # not -1
    a.finish()  # the reclaim completes with exactly one physical unload


def test_the_client_reports_a_scheduler_500_as_an_unknown_outcome(faulty_engine, fixtures):
    """A 500 is not a refusal that proves nothing was admitted: the trainer-side client raises
    OutcomeUnknown (status 500, admitted unknown), which the session layer never resends."""
    url = faulty_engine.url
    a = Published(faulty_engine, snapshot_of(fixtures.adapter_dir("A")))

    async def call() -> OutcomeUnknown:
        client = EngineClient("E0", url)
        body = {
            "rid": f"{uuid.uuid4().hex}{MID_DECODE}",
            "input_ids": PROMPT,
            "lora_path": a.name,
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        }
        try:
            with pytest.raises(OutcomeUnknown) as err:
                await client.generate(body)
        finally:
            await client.aclose()
        return err.value

    err = asyncio.run(call())
    assert err.status_code == 500 and err.maybe_sent and err.admitted is None, err
    wait_in_flight(url, a.name, 0)
    a.finish()


class Streaming(threading.Thread):
    """One streamed generation on a thread: its chunks as they arrive, and its status once done."""

    def __init__(self, url: str, name: str, rid: str, max_new_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.name, self.rid, self.max_new_tokens = url, name, rid, max_new_tokens
        self.chunks: list[dict] = []
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        self.status, _ = stream_into(self.url, self.name, self.rid, self.max_new_tokens, self.chunks)

    def wait_for_tokens(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.chunks and time.monotonic() < deadline:
            assert self.is_alive(), f"{self.rid} ended before its first token (status {self.status})"
            time.sleep(0.02)
        assert self.chunks, f"{self.rid} streamed nothing in {timeout_s} s"

    def generating(self) -> bool:
        """Still decoding: the stream is open and its last chunk is not a finish."""
        last = self.chunks[-1] if self.chunks else {}
        return self.is_alive() and not last.get("meta_info", {}).get("finish_reason")


def test_a_scheduler_500_while_another_request_holds_the_version_goes_2_1_0(faulty_engine, fixtures, run_dir):
    """RFC 7.1: r1 and r2 use version A at once; r2 ends with a scheduler 500 while r1 still
    decodes. SGLang's native count goes 2 -> 1 (read while r1 generates, and it stays 1), a
    reclaim started then waits (the drain: DRAINING with 1 in flight, nothing unloaded), r1
    finishes normally, the count goes 1 -> 0, and the reclaim then unloads exactly once.

    Both ends are the test's to time: r2's 500 (SGLang's own mid-decode abort path) and r1's
    normal finish (by length) are taken at the first decode step after each one's signal file
    exists (tests/engine_wrappers/scheduler_500_faults.py, FAIL_ON_SIGNAL / FINISH_ON_SIGNAL)."""
    url = faulty_engine.url
    source = local_source_dir(run_dir)
    a = Published(faulty_engine, snapshot_of(fixtures.adapter_dir("A")))
    long_run = 2000  # each would decode ~9 s on its own: both end by their signal, far earlier

    r1 = Streaming(url, a.name, f"{uuid.uuid4().hex}{FINISH_ON_SIGNAL}", long_run)
    r1.wait_for_tokens()
    r2 = Streaming(url, a.name, f"{uuid.uuid4().hex}{FAIL_ON_SIGNAL}", long_run)
    r2.wait_for_tokens()
    assert in_flight(url, a.name) == 2 and r1.generating() and r2.generating()

    signal_path(source, r2.rid).touch()
    r2.join(60)
    assert not r2.is_alive() and injected(faulty_engine, r2.rid)
    assert r2.status == 200, r2.status  # the stream had started: the 500 comes in-band
    reason = r2.chunks[-1].get("meta_info", {}).get("finish_reason") or r2.chunks[-1].get("error", {})
    assert "500" in json.dumps(reason) or "InternalServerError" in json.dumps(reason), r2.chunks[-1]
    wait_in_flight(url, a.name, 1)
    for _ in range(10):  # exactly once: r2's release took one count, and r1's is still held
        assert r1.generating(), "r1 must still decode while the count is read"
        assert in_flight(url, a.name) == 1
        time.sleep(0.05)

    reclaim_id = uuid.uuid4().hex
    t0 = time.monotonic()
    drain = reclaim(url, a.name, reclaim_id, timeout_s=1.0)
    assert drain.status_code == 202, drain.text
    assert drain.json()["state"] == "DRAINING" and drain.json()["in_flight"] == 1, drain.text
    assert time.monotonic() - t0 >= 1.0  # it waited its whole timeout for r1
    assert r1.generating(), "r1 must still decode while the reclaim drains"
    assert versions(url)[a.name]["state"] == "RECLAIMING"
    assert unload_log_count(faulty_engine, a.lora_id) == 0  # nothing unloaded under r1
    late = generate(url, PROMPT, a.name, max_new_tokens=2)
    assert late.status_code == 410 and error_code(late) == "VERSION_RECLAIMED", late.text

    signal_path(source, r1.rid).touch()
    r1.join(60)
    assert not r1.is_alive() and r1.status == 200
    finish = r1.chunks[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "length", finish  # a normal finish, no error
    wait_in_flight(url, a.name, 0)  # 1 -> 0: the reclaim's drain ends here, not earlier

    done = reclaim(url, a.name, reclaim_id, timeout_s=30.0)
    assert done.status_code == 200 and done.json()["state"] == "UNLOADED", done.text
    a.finish()  # UNLOADED, with exactly one physical unload of its lora_id
