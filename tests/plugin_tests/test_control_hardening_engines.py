"""Control-plane hardening on real CPU engines (issue 15): each reproduction of the black-box fuzz
is a test here. A version serves exactly its manifest, no control input kills the engine or
leaks a slot, bodies have deadlines, and generation inputs that crash the stock scheduler are
refused. Every test ends with the engine healthy and its candidates cleaned up."""

from __future__ import annotations

import json
import shutil
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from _engine_helpers import (
    ADMIN,
    Published,
    Staged,
    error_code,
    generate,
    in_flight,
    post,
    snapshot_of,
    versions,
    visible_state,
)

from lora_contract.protocol import Routes
from lora_versions_dev import reference
from lora_versions_dev.farm import PROMPT
from relax_glue.snapshot import Snapshot

pytestmark = pytest.mark.engine

MAX_NEW = 8


@pytest.fixture(scope="module")
def ref_tokens(fixtures):
    def tokens(adapter_dir: Path) -> list[int]:
        return reference.greedy_tokens(fixtures.model_dir, adapter_dir, PROMPT, MAX_NEW)

    return tokens


def healthy(url: str) -> bool:
    r = generate(url, PROMPT, max_new_tokens=2)
    return r.status_code == 200


def served_tokens(url: str, name: str) -> list[int]:
    r = generate(url, PROMPT, name, max_new_tokens=MAX_NEW)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def peft_variant(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of the PEFT adapter at ``src`` with ``config_changes`` in its adapter_config.json."""
    dst.mkdir(parents=True)
    shutil.copy(src / "adapter_model.safetensors", dst / "adapter_model.safetensors")
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


class LogWatch:
    """The part of an engine log written after this point."""

    def __init__(self, engine) -> None:
        self.path = engine.log_path
        self.start = self.path.stat().st_size

    def new_text(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")


def raw_request(url: str, path: str, headers: dict[str, str], body: bytes, declared: int) -> socket.socket:
    """Send headers announcing ``declared`` body bytes and only ``body``; the socket stays open."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    head = [f"POST {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", f"Content-Length: {declared}"]
    head += [f"{k}: {v}" for k, v in {**ADMIN, **headers}.items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock


def read_reply(sock: socket.socket, timeout_s: float = 60.0) -> str:
    """The whole HTTP reply on ``sock`` (headers and its Content-Length of body)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def no_reply_yet(sock: socket.socket) -> bool:
    """True while the engine has sent nothing back (no bytes, no close)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


# ------------------------------------------------------------------------------ reproductions


def test_one_attempt_token_cannot_feed_two_versions(engines, snaps, fixtures, ref_tokens, cleanup_after):
    """(1) Begin X (A's manifest) and Y (B's manifest) with the same token; X's buckets, Y's
    buckets, end X. Before: both begins accepted, one stash, X served B's tokens."""
    url = engines[0].url
    x = Staged(url, snaps["A"])
    y = Staged(url, snaps["B"])
    y.attempt = x.attempt
    y.begin_req = y.begin_req.model_copy(update={"attempt_token": x.attempt})
    cleanup_after.append(x)
    assert x.begin().status_code == 200
    before = visible_state(url)
    r = y.begin()
    assert r.status_code == 409 and error_code(r) == "ATTEMPT_MISMATCH", r.text
    assert visible_state(url) == before
    for b in x.buckets():
        assert x.send_bucket(b).status_code == 200
    for b in y.buckets():
        r = y.send_bucket(b)
        assert r.status_code == 409 and error_code(r) == "ATTEMPT_MISMATCH", r.text
    r = y.end()
    assert r.status_code == 409 and error_code(r) == "ATTEMPT_MISMATCH", r.text
    assert x.end().json()["state"] == "READY_LOCAL"
    assert y.name not in versions(url)
    got = served_tokens(url, x.name)
    assert got == ref_tokens(fixtures.adapter_dir("A"))
    assert got != ref_tokens(fixtures.adapter_dir("B"))


def test_a_config_whose_rank_disagrees_with_its_tensors_is_refused_and_the_engine_lives(
    engines, fixtures, tmp_path, cleanup_after
):
    """(2) A's rank-4 tensors with r=2 and a recomputed digest. Before: begin and buckets passed,
    end never answered, the scheduler asserted on the buffer shape and the engine died."""
    url = engines[0].url
    lying = Snapshot.from_peft_dir(peft_variant(fixtures.adapter_dir("A"), tmp_path / "r2", r=2))
    before = visible_state(url)
    s = Staged(url, lying)
    r = s.begin()
    assert r.status_code == 422 and error_code(r) == "INCOMPATIBLE_ADAPTER", r.text
    assert "r=2" in r.json()["error"]["message"]
    assert visible_state(url) == before
    assert healthy(url)
    ok = Staged(url, snapshot_of(fixtures.adapter_dir("A")))
    cleanup_after.append(ok)
    assert ok.publish()["state"] == "READY_LOCAL"


def test_a_cleanup_naming_another_version_changes_nothing(engines, snaps):
    """(3) Begin V with T; cleanup {W, T}. Before: 200, then cleanup {V, T} answered a CLEANED
    receipt naming W while V stayed PREPARED, holding its pinned slot until a restart."""
    url = engines[0].url
    v = Staged(url, snaps["A"])
    assert v.begin().status_code == 200
    w_name = Staged(url, snaps["B"]).name
    before = visible_state(url)
    r = post(url, Routes.CLEANUP, {"lora_name": w_name, "attempt_token": v.attempt})
    assert r.status_code == 409 and error_code(r) == "ATTEMPT_MISMATCH", r.text
    assert visible_state(url) == before
    r = v.cleanup()
    assert r.status_code == 200 and r.json()["lora_name"] == v.name, r.text
    assert versions(url)[v.name]["state"] == "CLEANED"
    again = Staged(url, snaps["A"], v.version_id)  # the slot is free and the name usable again
    assert again.begin().json()["state"] == "PREPARED"
    assert again.cleanup().status_code == 200


def test_rslora_is_served_with_pefts_scale_and_alpha_pattern_is_refused(
    engines, fixtures, tmp_path, ref_tokens, cleanup_after
):
    """(4) use_rslora / alpha_pattern reached READY and served plain A: SGLang always scales by
    lora_alpha / r. rsLoRA is now loaded with the alpha giving PEFT's scale exactly; an
    alpha_pattern SGLang cannot apply is refused."""
    url = engines[0].url
    rs_dir = peft_variant(fixtures.adapter_dir("A"), tmp_path / "rslora", use_rslora=True)
    rs = Staged(url, Snapshot.from_peft_dir(rs_dir))
    cleanup_after.append(rs)
    assert rs.publish()["state"] == "READY_LOCAL"
    got = served_tokens(url, rs.name)
    assert got == ref_tokens(rs_dir)
    assert got != ref_tokens(fixtures.adapter_dir("A")), "the negative control: plain A differs"

    pattern_dir = peft_variant(fixtures.adapter_dir("A"), tmp_path / "alpha", alpha_pattern={"q_proj": 2})
    before = visible_state(url)
    r = Staged(url, Snapshot.from_peft_dir(pattern_dir)).begin()
    assert r.status_code == 422 and error_code(r) == "INCOMPATIBLE_ADAPTER", r.text
    assert "alpha_pattern" in r.json()["error"]["message"]
    assert visible_state(url) == before


def test_a_stalled_bucket_upload_does_not_block_its_version(engines, snaps):
    """(5) Headers with Content-Length N, N/2 bytes sent, socket kept open. Before: cleanup, end
    and begin of that name waited for the socket (the body was read under the name lock, with no
    deadline). Now they answer at once; the stalled read is abandoned at its deadline."""
    engine = engines[0]
    url = engine.url
    s = Staged(url, snaps["A"])
    assert s.begin().status_code == 200
    bucket = s.buckets()[0]
    watch = LogWatch(engine)
    half = len(bucket.payload) // 2
    headers = s.bucket_headers(bucket)
    sock = raw_request(url, Routes.RECEIVE_BUCKET, headers, bucket.payload[:half], len(bucket.payload))
    try:
        time.sleep(0.5)  # the engine is now inside the body read
        assert s.begin().json()["state"] == "PREPARED"  # a replay of begin answers
        r = s.end()
        assert r.status_code == 422 and error_code(r) == "MANIFEST_MISMATCH"  # not all buckets yet
        assert no_reply_yet(sock), "the stalled upload is still being read"
        r = s.cleanup()
        assert r.status_code == 200 and r.json()["state"] == "CLEANED", r.text
        assert no_reply_yet(sock), "cleanup did not wait for the stalled upload"
        # the deadline (SGLANG_LORA_VERSIONS_BODY_IDLE_TIMEOUT_S on the test engines) abandons it
        reply = read_reply(sock)
    finally:
        sock.close()
    assert reply.startswith("HTTP/1.1 400") and "INCOMPLETE_BODY" in reply, reply
    log = watch.new_text()
    assert "request body stalled" in log and "Traceback" not in log
    assert versions(url)[s.name]["state"] == "CLEANED"
    assert healthy(url)


def test_bodies_cut_short_log_one_line_not_a_traceback(engines, snaps):
    """(6) A begin or bucket body cut short by the client logged `Exception in ASGI application`
    with a ClientDisconnect traceback. State was and stays unchanged."""
    engine = engines[0]
    url = engine.url
    s = Staged(url, snaps["A"])
    body = json.dumps(s.begin_req.model_dump(mode="json")).encode()
    watch = LogWatch(engine)
    before = visible_state(url)
    raw_request(url, Routes.BEGIN, {"Content-Type": "application/json"}, body[:100], len(body)).close()
    assert s.begin().status_code == 200
    bucket = s.buckets()[0]
    headers = s.bucket_headers(bucket)
    raw_request(url, Routes.RECEIVE_BUCKET, headers, bucket.payload[:50], len(bucket.payload)).close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and watch.new_text().count("client disconnected") < 2:
        time.sleep(0.1)
    log = watch.new_text()
    assert log.count("client disconnected") == 2, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert versions(url)[s.name]["buckets_received"] == 0
    assert s.cleanup().status_code == 200
    assert {k: v for k, v in visible_state(url).items() if k != s.name} == before


# Inputs that kill the stock 0.5.23 scheduler (each seen on a plugin-off engine: the process
# exits and the HTTP connection drops without a response).
SCHEDULER_KILLERS = {
    "empty_text": ("/generate", {"text": ""}),
    "empty_text_in_batch": ("/generate", {"text": ["hi", ""]}),
    "empty_ids_in_batch": ("/generate", {"input_ids": [[]]}),
    "negative_token_id": ("/generate", {"input_ids": [1, -5]}),
    "negative_token_id_in_batch": ("/generate", {"input_ids": [[1], [-1]]}),
    "top_logprobs_num_past_vocab": (
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6},
    ),
    "openai_negative_token_id": ("/v1/completions", {"model": "default", "prompt": [-1], "max_tokens": 2}),
    "openai_logprobs_past_vocab": (
        "/v1/completions",
        {"model": "default", "prompt": "hi", "max_tokens": 2, "logprobs": 100000},
    ),
    "chat_top_logprobs_past_vocab": (
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 100000,
        },
    ),
}
# Refused too, though the CPU engine survives them (an id past the vocabulary is a device-side
# assert on a GPU and silently embeds garbage on CPU).
INVALID_INPUTS = {
    "token_id_past_vocab": ("/generate", {"input_ids": [1, 10**6]}),
}


@pytest.mark.parametrize("case", sorted({**SCHEDULER_KILLERS, **INVALID_INPUTS}))
def test_inputs_that_crash_the_stock_scheduler_get_a_typed_400(engines, case):
    """(7) `POST /generate {"text": ""}` killed the engine, plugin on or off."""
    path, body = {**SCHEDULER_KILLERS, **INVALID_INPUTS}[case]
    url = engines[1].url
    if path == "/generate":
        body = {**body, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert error_code(r) == "INVALID_REQUEST", r.text
    assert healthy(url)


# Inputs a plugin-on engine answered with an UNTYPED 500 (issue 24): SGLang's normalisation lets
# them through and a later step raises something that is not a ValueError (a bad stop_regex: re.error
# in SamplingParams.normalize, after the LoRA acquire; a rid list for one prompt: an unhashable
# request key in _init_req_state; a sampling_params list that does not match the batch: IndexError
# there, or AttributeError in _validate_one_request for a single prompt). Each names the managed
# version served by ``served_on_e1`` (lora_path on /generate, ``model`` on the OpenAI routes) and the
# field its refusal must name.
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SP = {"max_new_tokens": 2, "temperature": 0}
UNTYPED_500S: dict[str, tuple[str, dict, str]] = {
    "stop_regex_unclosed": (
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {**SP, "stop_regex": "(unclosed"}},
        "stop_regex",
    ),
    "stop_regex_bad_range_in_a_batch": (
        "/generate",
        {"input_ids": [PROMPT, PROMPT], "sampling_params": {**SP, "stop_regex": ["ok", "[z-a]"]}},
        "stop_regex",
    ),
    "openai_stop_regex": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "stop_regex": "(unclosed"},
        "stop_regex",
    ),
    "openai_stop_regex_stream": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "stop_regex": "(unclosed", "stream": True},
        "stop_regex",
    ),
    "chat_stop_regex": ("/v1/chat/completions", {**CHAT, "stop_regex": "*"}, "stop_regex"),
    "rid_list_for_one_prompt": ("/generate", {"input_ids": PROMPT, "sampling_params": SP}, "rid"),
    "openai_rid_list_for_one_prompt": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "rid"),
    "chat_rid_list_for_one_prompt": ("/v1/chat/completions", CHAT, "rid"),
    "sampling_params_list_shorter_than_the_batch": (
        "/generate",
        {"input_ids": [PROMPT, PROMPT], "sampling_params": [SP]},
        "sampling_params",
    ),
    "sampling_params_list_shorter_than_the_batch_with_n": (
        "/generate",
        {"input_ids": [PROMPT, PROMPT], "sampling_params": [{**SP, "n": 2, "temperature": 0.5}]},
        "sampling_params",
    ),
    "sampling_params_list_for_one_prompt": (
        "/generate",
        {"input_ids": PROMPT, "sampling_params": [SP]},
        "sampling_params",
    ),
    # IndexError in normalize_batch_and_arguments itself (it reads the list's first entry for ``n``)
    "sampling_params_empty_list": (
        "/generate",
        {"input_ids": PROMPT, "sampling_params": []},
        "sampling_params",
    ),
}


@pytest.fixture(scope="module")
def served_on_e1(engines, snaps):
    """One managed version READY on E1, reclaimed (counts back to 0) when the module ends."""
    version = Published(engines[1], snaps["A"])
    yield version
    version.finish()


def naming_version(path: str, body: dict, name: str) -> dict:
    """``body`` routed to the managed version ``name`` (``model="base:adapter"`` on OpenAI routes)."""
    return {**body, "lora_path": name} if path == "/generate" else {**body, "model": f"default:{name}"}


@pytest.mark.parametrize("case", sorted(UNTYPED_500S))
def test_inputs_that_got_an_untyped_500_get_a_typed_400_and_acquire_nothing(engines, served_on_e1, case):
    path, body, field = UNTYPED_500S[case]
    engine = engines[1]
    url, name = engine.url, served_on_e1.name
    body = naming_version(path, body, name)
    if field == "rid":
        body["rid"] = [uuid.uuid4().hex, uuid.uuid4().hex]
    watch = LogWatch(engine)
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert error_code(r) == "INVALID_REQUEST", r.text
    assert field in r.json()["error"]["message"], r.text
    assert in_flight(url, name) == 0, "a refused request holds no LoRA ref"
    assert "Traceback" not in watch.new_text()
    assert generate(url, PROMPT, name, max_new_tokens=2).status_code == 200
    assert in_flight(url, name) == 0


@pytest.mark.parametrize("case", ["rid_list_for_one_prompt", "stop_regex_unclosed"])
def test_a_streamed_generate_gets_its_refusal_as_an_error_event(engines, served_on_e1, case):
    """/generate with stream=true answers 200 before SGLang runs the request (stock: every refusal
    of a streamed /generate is an error event). Before, the stream broke off mid-body (the
    client saw an incomplete chunked read); now it carries the typed refusal, then [DONE]."""
    engine = engines[1]
    url, name = engine.url, served_on_e1.name
    _, body, field = UNTYPED_500S[case]
    body = {**naming_version("/generate", body, name), "stream": True}
    if field == "rid":
        body["rid"] = [uuid.uuid4().hex, uuid.uuid4().hex]
    watch = LogWatch(engine)
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2, events
    error = json.loads(events[0])["error"]
    assert error["code"] == 400 and "INVALID_REQUEST" in error["message"] and field in error["message"], error
    assert in_flight(url, name) == 0
    assert "Traceback" not in watch.new_text()


def test_a_sampling_params_list_longer_than_the_batch_is_refused(engines, served_on_e1):
    """Stock serves the first entries and drops the rest without a word: the same rule as SGLang's
    own per-prompt lists (rid, watermark) and lora_path, one entry per prompt."""
    url, name = engines[1].url, served_on_e1.name
    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": [SP, SP, SP], "lora_path": name}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 400 and error_code(r) == "INVALID_REQUEST", r.text
    assert "sampling_params has 3 entries for 2 prompts" in r.json()["error"]["message"], r.text
    assert in_flight(url, name) == 0
    ok = httpx.post(f"{url}/generate", json={**body, "sampling_params": [SP, SP]}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()) == 2, ok.text


# ------------------------------------------------------------------------------ body limits


def test_bucket_bodies_must_be_octet_stream(engines, snaps):
    url = engines[0].url
    s = Staged(url, snaps["A"])
    assert s.begin().status_code == 200
    bucket = s.buckets()[0]
    for content_type in ("application/json", "text/plain", ""):
        headers = {**s.bucket_headers(bucket), "Content-Type": content_type}
        r = httpx.post(f"{url}{Routes.RECEIVE_BUCKET}", content=bucket.payload, headers=headers, timeout=30)
        assert r.status_code == 400 and error_code(r) == "INVALID_REQUEST", r.text
    assert versions(url)[s.name]["buckets_received"] == 0
    headers = {**s.bucket_headers(bucket), "Content-Type": "application/octet-stream; charset=binary"}
    r = httpx.post(f"{url}{Routes.RECEIVE_BUCKET}", content=bucket.payload, headers=headers, timeout=30)
    assert r.status_code == 200, r.text  # parameters after the media type are fine
    assert s.cleanup().status_code == 200


def test_json_control_bodies_are_capped(engines):
    url = engines[0].url
    before = visible_state(url)
    big = b'{"x": "' + b"a" * (9 * 1024**2) + b'"}'
    r = httpx.post(
        f"{url}{Routes.BEGIN}", content=big, headers={**ADMIN, "Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == 413 and error_code(r) == "PAYLOAD_TOO_LARGE", r.text

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(9):
            yield b"a" * 1024**2

    r = httpx.post(f"{url}{Routes.CLEANUP}", content=chunks(), headers=ADMIN, timeout=60)
    assert r.status_code == 413 and error_code(r) == "PAYLOAD_TOO_LARGE", r.text
    assert visible_state(url) == before
    assert healthy(url)


def test_a_nan_adapter_is_refused_at_its_bucket(engines, fixtures, tmp_path):
    """A diverged trainer can export NaN factors; serving them turns every logit to NaN."""
    from safetensors.torch import load_file, save_file

    src = fixtures.adapter_dir("A")
    dst = peft_variant(src, tmp_path / "nan")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    url = engines[0].url
    s = Staged(url, Snapshot.from_peft_dir(dst, max_bucket_bytes=16 * 1024))
    assert s.begin().status_code == 200
    r = s.send_bucket(s.buckets()[0])
    assert r.status_code == 422 and error_code(r) == "INCOMPATIBLE_ADAPTER" and "NaN" in r.text, r.text
    assert versions(url)[s.name]["buckets_received"] == 0
    assert s.cleanup().status_code == 200
