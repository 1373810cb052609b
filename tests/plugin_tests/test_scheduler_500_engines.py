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
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import ADMIN, Published, generate, in_flight, snapshot_of, wait_in_flight

from lora_versions_dev.farm import PROMPT
from relax_glue.engine_client import EngineClient, OutcomeUnknown

pytestmark = pytest.mark.engine

WRAPPERS = Path(__file__).parents[1] / "engine_wrappers"
sys.path.insert(0, str(WRAPPERS))
from scheduler_500_faults import AT_ADMISSION, LOG_LINE, MID_DECODE  # noqa: E402


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
    body = {
        "rid": rid,
        "input_ids": PROMPT,
        "lora_path": name,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    chunks: list[dict] = []
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
