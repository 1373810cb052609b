"""Parallel sampling (``n > 1``) of a managed version on a real engine (issue 27).

SGLang 0.5.23 serves ``n > 1`` as a prefix request (``max_new_tokens = 0``, which fills the
prompt's KV cache under the version's lora id) and then n samples, each its own request. The
native LoRA count is acquired once per sample when the request arrives and released once per
sample when it ends; the prefix request borrows the samples' counts. Every test here ends with the
count back at 0 and a reclaim that completes with exactly one physical unload (``Published.finish``),
after one terminal path: finish (streamed and not), an abort of the request by the rid the client
sent, an abort of one sample by its own rid, a client that disconnects (streamed and not), and a
scheduler 500 mid-decode. And: every sample runs on the exact version (greedy samples equal the
independent reference of that adapter), and a rid list with ``n > 1`` (which stock accepts and then
leaks a count for on a failure) is refused before anything is acquired.

They run on the farm's E1: its scheduler carries the marked-rid 500 probe.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import ADMIN, Published, error_code, in_flight, snapshot_of, wait_in_flight

from lora_versions_dev import reference
from lora_versions_dev.farm import PROMPT

pytestmark = pytest.mark.engine

WRAPPERS = Path(__file__).parents[1] / "engine_wrappers"
sys.path.insert(0, str(WRAPPERS))
from scheduler_500_faults import HOLD_PREFIX, MID_DECODE  # noqa: E402

N = 3
# Tokens of a request that is still decoding when the test acts on it. All N samples must fit
# the CPU engine's KV pool (--max-total-tokens 4096) at once, or the scheduler runs only some of
# them and queues the rest (seen with 2000: the third sample started after the first two ended).
LONG = 1000


@pytest.fixture(scope="module")
def engine(engines):
    return engines[1]


@pytest.fixture(scope="module")
def snap(fixtures):
    return snapshot_of(fixtures.adapter_dir("A"))


@pytest.fixture
def version(engine, snap):
    p = Published(engine, snap)
    yield p
    p.finish()  # the count back at 0; the reclaim completes with one physical unload


def body(name: str, rid: str, max_new_tokens: int, *, stream: bool = False, temperature: float = 0.8) -> dict:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "lora_path": name,
        "stream": stream,
        "sampling_params": {
            "n": N,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
        },
    }


def post_in_thread(url: str, payload: dict, out: dict, timeout: float = 300) -> threading.Thread:
    def run() -> None:
        try:
            out["response"] = httpx.post(f"{url}/generate", json=payload, timeout=timeout)
        except httpx.HTTPError as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def abort(url: str, rid: str) -> None:
    r = httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text


def sample_ids(outputs: list[dict]) -> list[str]:
    return [o["meta_info"]["id"] for o in outputs]


def test_every_sample_runs_on_the_exact_version_named_under_the_request_rid(
    engine, version, fixtures
) -> None:
    """Greedy, n = 3: each sample equals the independent HF + PEFT reference of adapter A (not the
    base model's continuation), and each sample's id starts with the rid the client sent."""
    rid = f"par-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{engine.url}/generate", json=body(version.name, rid, 8, temperature=0), timeout=120)
    assert r.status_code == 200, r.text
    outputs = r.json()
    assert len(outputs) == N
    expected = reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir("A"), PROMPT, 8)
    base = reference.greedy_tokens(fixtures.model_dir, None, PROMPT, 8)
    assert expected != base  # the check can tell the version from the base model
    assert [o["output_ids"] for o in outputs] == [expected] * N
    assert all(i.startswith(f"{rid}_0-") for i in sample_ids(outputs)), sample_ids(outputs)
    wait_in_flight(engine.url, version.name, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_native_count_is_one_per_sample_while_decoding_and_zero_after_finish(
    engine, version, stream
) -> None:
    out: dict = {}
    t = post_in_thread(engine.url, body(version.name, f"fin-{uuid.uuid4().hex[:8]}", 400, stream=stream), out)
    wait_in_flight(engine.url, version.name, N)  # the samples' counts; the prefix request took none
    t.join(300)
    assert not t.is_alive() and out["response"].status_code == 200
    wait_in_flight(engine.url, version.name, 0)


def test_an_abort_by_the_request_rid_ends_every_sample(engine, version) -> None:
    """Stock 0.5.23 has no request state under the client's rid for n > 1 and ignores the abort;
    the plugin aborts each sample of it."""
    rid = f"abt-{uuid.uuid4().hex[:8]}"
    out: dict = {}
    t = post_in_thread(engine.url, body(version.name, rid, LONG), out)
    wait_in_flight(engine.url, version.name, N)
    abort(engine.url, rid)
    wait_in_flight(engine.url, version.name, 0, timeout_s=30)
    t.join(60)
    assert not t.is_alive()
    outputs = out["response"].json()
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in outputs]
    assert reasons == ["abort"] * N, reasons
    assert all(len(o["output_ids"]) < LONG for o in outputs)


def test_an_abort_before_the_samples_are_sent_ends_every_sample(engine, version) -> None:
    """SGLang sends the samples only after the prefix request has finished. An abort that arrives
    before (here: while the scheduler holds the prefix request, the counts already taken) found
    no sample to abort, and stock then sent all N, which decoded to the end (seen in CI:
    ``['length', 'length', 'length']``). The plugin aborts each sample as it is sent."""
    rid = f"pre-{uuid.uuid4().hex[:8]}{HOLD_PREFIX}"
    out: dict = {}
    t = post_in_thread(engine.url, body(version.name, rid, LONG), out)
    wait_in_flight(engine.url, version.name, N)  # acquired at arrival; the prefix is held 2 s
    abort(engine.url, rid)
    wait_in_flight(engine.url, version.name, 0, timeout_s=30)
    t.join(60)
    assert not t.is_alive()
    outputs = out["response"].json()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outputs] == ["abort"] * N, outputs
    assert all(len(o["output_ids"]) < LONG for o in outputs)


def test_an_abort_of_one_sample_ends_that_sample_alone(engine, version) -> None:
    """The samples' own rids arrive with the stream; aborting one leaves the others decoding
    (the count drops by one), and aborting the request then ends them."""
    rid = f"one-{uuid.uuid4().hex[:8]}"
    seen: dict[int, str] = {}
    last: dict[int, dict] = {}
    with httpx.stream(
        "POST", f"{engine.url}/generate", json=body(version.name, rid, LONG, stream=True), timeout=120
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            seen[chunk["index"]] = chunk["meta_info"]["id"]
            last[chunk["index"]] = chunk
            if len(seen) == N:
                break
        victim = seen[1]
        abort(engine.url, victim)
        wait_in_flight(engine.url, version.name, N - 1, timeout_s=30)
        abort(engine.url, rid)
        for line in lines:
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                chunk = json.loads(line[len("data:") :])
                last[chunk["index"]] = chunk
    assert all(c["meta_info"]["finish_reason"]["type"] == "abort" for c in last.values())
    wait_in_flight(engine.url, version.name, 0)


def test_a_client_that_disconnects_mid_stream_releases_every_sample(engine, version) -> None:
    rid = f"dis-{uuid.uuid4().hex[:8]}"
    with httpx.stream(
        "POST", f"{engine.url}/generate", json=body(version.name, rid, LONG, stream=True), timeout=120
    ) as r:
        ids: set[str] = set()
        # Held, not iterated in the for statement: a line iterator that is dropped closes the
        # response, i.e. disconnects before the count is read.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                ids.add(json.loads(line[len("data:") :])["meta_info"]["id"])
            if len(ids) == N:
                break
        assert in_flight(engine.url, version.name) == N
        r.close()  # the client disconnects mid-stream
        wait_in_flight(engine.url, version.name, 0, timeout_s=60)


def test_a_client_that_disconnects_before_the_reply_releases_every_sample(engine, version) -> None:
    out: dict = {}
    t = post_in_thread(engine.url, body(version.name, f"dnc-{uuid.uuid4().hex[:8]}", LONG), out, timeout=3.0)
    t.join(60)
    assert isinstance(out.get("error"), httpx.TimeoutException), out  # the client gave up and closed
    wait_in_flight(engine.url, version.name, 0, timeout_s=60)


def test_a_scheduler_500_mid_decode_releases_every_sample(engine, version) -> None:
    rid = f"f500-{uuid.uuid4().hex[:8]}{MID_DECODE}"
    r = httpx.post(f"{engine.url}/generate", json=body(version.name, rid, 64), timeout=120)
    assert r.status_code == 500, r.text
    wait_in_flight(engine.url, version.name, 0)


@pytest.mark.parametrize("too_long", [False, True])
def test_a_rid_list_with_parallel_sampling_is_refused_before_anything_is_acquired(
    engine, version, too_long
) -> None:
    """Stock keeps a rid list of one per prompt while it acquires a count per sample: a failure
    before the samples start (here a prompt over the context length) released one count and left
    the other held forever. Refused now, typed, with nothing acquired."""
    payload = body(version.name, "unused", 4)
    payload["rid"] = [f"lst-{uuid.uuid4().hex[:8]}"]
    if too_long:
        payload["input_ids"] = PROMPT * 600  # 3,000 tokens: over the model's 2,048
    r = httpx.post(f"{engine.url}/generate", json=payload, timeout=120)
    assert r.status_code == 400 and error_code(r) == "INVALID_REQUEST", r.text
    time.sleep(0.5)
    assert in_flight(engine.url, version.name) == 0
