"""Every reply names what the engine ran for it (issue 39), on a real engine (the farm's E1).

Each reply path of ``/generate`` carries ``meta_info.lora_versions`` (spans in the shape of
SGLang's ``weight_versions``): non-streamed, every streamed chunk, every sample of ``n > 1``; on a
managed version, on the base model and on an unmanaged adapter; two versions decoding in one
batch each get their own. The planted defect (E1's ``served_slot_swap`` probe: rows of version A
built with B's lora id in the scheduler's LoRA batch) is reported as B while the request, its
``lora_path`` and everything it carries say A: the attestation is read from the batch.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import httpx
import pytest
from _engine_helpers import ADMIN, Published, generate, snapshot_of, wait_in_flight

from lora_contract.served_version import LAST_KEY, SPANS_KEY, read_served_spans, served_version_problem
from lora_versions_dev.farm import PROMPT, local_source_dir

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_wrappers"))
import served_slot_swap  # noqa: E402

TOKENS = 10


@pytest.fixture(scope="module")
def engine(engines):
    return engines[1]


@pytest.fixture
def published(engine, fixtures):
    made: list[Published] = []

    def publish(adapter: str) -> Published:
        p = Published(engine, snapshot_of(fixtures.adapter_dir(adapter)))
        made.append(p)
        return p

    yield publish
    for p in made:
        p.finish()


def digest_of(p: Published) -> str:
    return p.staged.begin_req.digest


def served_by(meta: dict, p: Published, tokens: int | None) -> bool:
    """Every token the reply covers served by exactly ``p`` (no problem found)."""
    return served_version_problem(meta, p.name, digest_of(p), output_tokens=tokens) is None


def reply(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def only_span(meta: dict) -> dict:
    spans = meta[SPANS_KEY]
    assert len(spans) == 1, spans
    return spans[0]


def test_a_managed_reply_names_its_version_key_and_digest(engine, published):
    a = published("A")
    out = reply(generate(engine.url, PROMPT, a.name, max_new_tokens=TOKENS))
    meta = out["meta_info"]
    key = a.staged.begin_req.version_key
    assert only_span(meta) == {
        "version": a.name,
        "start": 0,
        "end": TOKENS,
        "adapter": "managed",
        "epoch": key.epoch,
        "version_id": key.version_id,
        "digest": digest_of(a),
    }
    assert meta[LAST_KEY] == a.name and "lora_versions_served_by" not in meta
    assert served_by(meta, a, len(out["output_ids"]))


def test_base_model_and_unmanaged_adapter_say_so(engine, fixtures):
    base = reply(generate(engine.url, PROMPT, None, max_new_tokens=TOKENS))["meta_info"]
    assert only_span(base) == {**only_span(base), "version": None, "adapter": "base", "end": TOKENS}
    assert base[LAST_KEY] is None
    name = "plain-attested-C"
    r = httpx.post(
        f"{engine.url}/load_lora_adapter",
        headers=ADMIN,
        timeout=60,
        json={"lora_name": name, "lora_path": str(fixtures.adapter_dir("C"))},
    )
    assert r.status_code == 200, r.text
    try:
        meta = reply(generate(engine.url, PROMPT, name, max_new_tokens=TOKENS))["meta_info"]
        span = only_span(meta)
        assert (span["version"], span["adapter"], span["digest"], span["end"]) == (
            name,
            "unmanaged",
            None,
            TOKENS,
        )
        assert served_version_problem(meta, name, "0" * 64) is not None  # never a managed match
    finally:
        httpx.post(f"{engine.url}/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN, timeout=60)


def stream(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


def test_every_streamed_chunk_and_every_sample_is_attested(engine, published):
    a = published("A")
    body = {
        "input_ids": PROMPT,
        "lora_path": a.name,
        "sampling_params": {"temperature": 0, "max_new_tokens": TOKENS, "ignore_eos": True},
    }
    chunks = stream(engine.url, body)
    assert len(chunks) > 1
    for chunk in chunks:
        meta = chunk["meta_info"]
        # a cumulative stream (SGLang's default): each chunk covers every token so far
        assert served_by(meta, a, meta["completion_tokens"])
    assert chunks[-1]["meta_info"]["completion_tokens"] == TOKENS

    params = {**body["sampling_params"], "n": 3, "temperature": 0.8}
    samples = reply(
        httpx.post(f"{engine.url}/generate", json={**body, "sampling_params": params}, timeout=120)
    )
    assert len(samples) == 3
    for s in samples:
        assert served_by(s["meta_info"], a, len(s["output_ids"]))
    per_sample: dict[int, list[dict]] = {}
    for chunk in stream(engine.url, {**body, "sampling_params": params}):
        per_sample.setdefault(chunk.get("index", 0), []).append(chunk["meta_info"])
    assert sorted(per_sample) == [0, 1, 2]
    for metas in per_sample.values():
        for meta in metas:
            assert served_by(meta, a, meta["completion_tokens"])
    wait_in_flight(engine.url, a.name, 0)


def post_in_thread(url: str, body: dict, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(httpx.post(f"{url}/generate", json=body, timeout=300)))
    t.start()
    return t


def test_two_versions_in_one_batch_each_get_their_own(engine, published):
    """A and B decode together (one batch, two slots): each reply names its own version, every
    token of it."""
    a, b = published("A"), published("B")
    outs: dict[str, list] = {a.name: [], b.name: []}
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
    }
    threads = [post_in_thread(engine.url, {**body, "lora_path": p.name}, outs[p.name]) for p in (a, b)]
    for t in threads:
        t.join()
    for p in (a, b):
        out = reply(outs[p.name][0])
        assert served_by(out["meta_info"], p, 200)


def test_a_planted_slot_swap_is_reported_from_the_batch_not_the_request(engine, published, run_dir):
    """The planted defect runs A's rows on B's slot: the reply's request, lora_path and count all
    say A, and the attestation says B, for every token decoded while the defect is on."""
    a, b = published("A"), published("B")
    honest = reply(generate(engine.url, PROMPT, a.name, max_new_tokens=TOKENS))
    # A prompt no cached prefix of A's namespace covers (else A's cached KV of the prompt would
    # mix into the swapped run): the swapped request then computes everything with B's slot.
    other_prompt = PROMPT[::-1]
    b_tokens = reply(generate(engine.url, other_prompt, b.name, max_new_tokens=TOKENS))["output_ids"]
    trigger = served_slot_swap.trigger_path(local_source_dir(run_dir))
    trigger.write_text(f"{a.name} {b.name}")
    try:
        swapped = reply(generate(engine.url, other_prompt, a.name, max_new_tokens=TOKENS))
    finally:
        trigger.unlink()
    assert served_slot_swap.LOG_LINE in Path(engine.log_path).read_text(errors="replace")
    # the defect is real: A's request produced B's tokens (greedy)
    assert swapped["output_ids"] == b_tokens
    spans = read_served_spans(swapped["meta_info"])
    assert spans is not None
    assert [(s.version, s.digest, s.end) for s in spans] == [(b.name, digest_of(b), TOKENS)]
    problem = served_version_problem(swapped["meta_info"], a.name, digest_of(a))
    assert problem is not None and b.name in problem
    # the trigger is gone: A is served from its own slot again (on the prompt the swap did not
    # leave B-computed KV under A's namespace for)
    again = reply(generate(engine.url, PROMPT, a.name, max_new_tokens=TOKENS))
    assert again["output_ids"] == honest["output_ids"]
    assert served_by(again["meta_info"], a, TOKENS)


def test_a_non_streamed_openai_response_names_them_in_its_metadata(engine, published):
    """SGLang's OpenAI responses carry no meta_info; their ``metadata`` (the weight version, of the
    first choice) also carries the served versions."""
    a = published("A")
    body = {"model": f"default:{a.name}", "prompt": "The quick", "max_tokens": TOKENS, "temperature": 0}
    r = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120)
    out = reply(r)
    assert served_by(out["metadata"], a, out["usage"]["completion_tokens"]), out["metadata"]
    assert out["metadata"][LAST_KEY] == a.name and "weight_version" in out["metadata"]
