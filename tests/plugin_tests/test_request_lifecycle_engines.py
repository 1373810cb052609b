"""Request-lifecycle guards and safe reclaim on real CPU engines (issue: engine side, part 2).

Every scenario ends with the version's native in-flight count back where it was and a reclaim
that completes (UNLOADED) -- a leaked or negative count would leave it DRAINING forever.
"""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest
from _engine_helpers import (
    ADMIN,
    Published,
    Staged,
    error_code,
    generate,
    in_flight,
    reclaim,
    unload_log_count,
    versions,
    wait_in_flight,
)

from lora_versions_dev import reference
from lora_versions_dev.farm import PROMPT

pytestmark = pytest.mark.engine


@pytest.fixture
def publish(engines):
    made: list[Published] = []

    def _publish(snap, engine=None) -> Published:
        p = Published(engine or engines[0], snap)
        made.append(p)
        return p

    yield _publish
    for p in made:
        p.finish()


def long_request(
    url: str, name: str, max_new_tokens: int, results: dict, key: str, **extra
) -> threading.Thread:
    def run() -> None:
        results[key] = generate(url, PROMPT, name, max_new_tokens=max_new_tokens, **extra)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_rfc_prevalidation_drain_then_unload_once(publish, snaps, engines):
    """r_short and r_long on A (0->1->2), r_short ends (2->1), reclaim stays DRAINING while r_long
    runs and new requests are refused, r_long ends (1->0), the unload happens exactly once."""
    url = engines[0].url
    a = publish(snaps["A"])
    results: dict = {}
    t_long = long_request(url, a.name, 1200, results, "long")
    wait_in_flight(url, a.name, 1)
    t_short = long_request(url, a.name, 80, results, "short")
    wait_in_flight(url, a.name, 2)
    t_short.join()
    assert results["short"].status_code == 200
    wait_in_flight(url, a.name, 1)

    reclaim_id = uuid.uuid4().hex
    r = reclaim(url, a.name, reclaim_id, timeout_s=0.5)
    assert r.status_code == 202 and r.json() == {
        "state": "DRAINING",
        "lora_name": a.name,
        "reclaim_id": reclaim_id,
        "attempt_token": None,  # a reclaim's DRAINING names its reclaim id, a cleanup's its attempt
        "in_flight": 1,
        "incarnation": r.json()["incarnation"],
        "unload_error": None,  # set only when the unload itself was refused after unregister
    }
    assert versions(url)[a.name]["state"] == "RECLAIMING"
    late = generate(url, PROMPT, a.name)
    assert late.status_code == 410 and error_code(late) == "VERSION_RECLAIMED"
    assert unload_log_count(engines[0], a.lora_id) == 0, "no unload while r_long runs"
    # another version publishes and serves meanwhile: the drain holds no SGLang lock
    b = publish(snaps["B"])
    assert generate(url, PROMPT, b.name).status_code == 200

    t_long.join()
    assert results["long"].status_code == 200, results["long"].text
    assert len(results["long"].json()["output_ids"]) == 1200
    done = reclaim(url, a.name, reclaim_id, timeout_s=30)
    assert done.status_code == 200 and done.json()["state"] == "UNLOADED"
    assert reclaim(url, a.name, reclaim_id).json() == done.json()  # idempotent by reclaim_id
    other = reclaim(url, a.name, uuid.uuid4().hex)
    assert other.status_code == 409 and error_code(other) == "STALE_ATTEMPT"


def test_late_requests_after_reclaim_are_refused_and_never_reload(publish, snaps, engines):
    url = engines[0].url
    a = publish(snaps["A"])
    a.finish()
    for body_lora in (a.name, [a.name]):
        r = (
            generate(url, PROMPT, body_lora)
            if isinstance(body_lora, str)
            else httpx.post(
                f"{url}/generate",
                json={
                    "input_ids": [PROMPT],
                    "lora_path": body_lora,
                    "sampling_params": {"max_new_tokens": 2},
                },
                timeout=60,
            )
        )
        assert r.status_code == 410 and error_code(r) == "VERSION_RECLAIMED", r.text
    chat = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": f"default:{a.name}", "prompt": "The quick", "max_tokens": 2},
    )
    assert chat.status_code == 410 and error_code(chat) == "VERSION_RECLAIMED", chat.text
    models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert a.name not in models
    listed = versions(url)[a.name]
    assert listed["state"] == "UNLOADED" and listed["lora_id"] == a.lora_id
    assert unload_log_count(engines[0], a.lora_id) == 1


def test_unknown_and_staging_managed_names_are_version_errors(engines, snaps):
    url = engines[0].url
    r = generate(url, PROMPT, "relax_policy_lora@t1-404-abcdefabcdef")
    assert r.status_code == 404 and error_code(r) == "UNKNOWN_VERSION"
    s = Staged(url, snaps["C"])
    assert s.begin().status_code == 200
    try:
        r = generate(url, PROMPT, s.name)
        assert r.status_code == 409 and error_code(r) == "VERSION_NOT_READY"
        stream = httpx.post(
            f"{url}/generate",
            timeout=30,
            json={
                "input_ids": PROMPT,
                "lora_path": s.name,
                "stream": True,
                "sampling_params": {"max_new_tokens": 2},
            },
        )
        assert stream.status_code == 409 and error_code(stream) == "VERSION_NOT_READY"
    finally:
        assert s.cleanup().status_code == 200


@pytest.mark.parametrize("forged", ["victim_id_alone", "unknown_name_with_victim_id", "name_with_other_id"])
def test_forged_lora_id_is_refused_and_counts_do_not_move(publish, snaps, engines, forged):
    url = engines[0].url
    victim = publish(snaps["A"])
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "lora_id": victim.lora_id}
    if forged == "unknown_name_with_victim_id":
        body["lora_path"] = "relax_policy_lora@t1-999-abcdefabcdef"
    if forged == "name_with_other_id":
        body["lora_path"] = victim.name
        body["lora_id"] = uuid.uuid4().hex
    for stream in (False, True):
        r = httpx.post(f"{url}/generate", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400 and error_code(r) == "FORBIDDEN_FIELD", r.text
    assert in_flight(url, victim.name) == 0
    # finish(): a later reclaim of the victim completes at once (its counter is intact)


def test_extra_key_that_mimics_a_lora_namespace_is_refused(publish, snaps, engines):
    url = engines[0].url
    a = publish(snaps["A"])
    r = generate(url, PROMPT, None, extra_key=a.lora_id)
    assert r.status_code == 400 and error_code(r) == "FORBIDDEN_FIELD"
    assert generate(url, PROMPT, None, extra_key="tenant-7").status_code == 200


def test_terminal_paths_release_exactly_once(publish, snaps, engines):
    url = engines[0].url
    a = publish(snaps["A"])
    b = publish(snaps["B"])

    def settle(*names: str) -> None:
        for n in names:
            wait_in_flight(url, n, 0)

    # finish; n>1 parallel sampling; mixed-version batch
    assert generate(url, PROMPT, a.name).status_code == 200
    r = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "input_ids": PROMPT,
            "lora_path": a.name,
            "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 0.8},
        },
    )
    assert r.status_code == 200 and len(r.json()) == 3
    r = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "input_ids": [PROMPT] * 3,
            "lora_path": [a.name, b.name, None],
            "sampling_params": {"max_new_tokens": 4},
        },
    )
    assert r.status_code == 200
    settle(a.name, b.name)

    # 400 after acquire: too long input, bad max_new_tokens; scheduler-side 400: bad regex
    r = generate(url, [5] * 5000, a.name)
    assert r.status_code == 400, r.text
    r = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={"input_ids": PROMPT, "lora_path": a.name, "sampling_params": {"max_new_tokens": -3}},
    )
    assert r.status_code == 400, r.text
    r = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "input_ids": PROMPT,
            "lora_path": a.name,
            "sampling_params": {"max_new_tokens": 4, "regex": "(unclosed"},
        },
    )
    assert r.status_code == 400, r.text
    settle(a.name)

    # a batch whose lora_path list does not match the batch: refused before acquire
    r = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "input_ids": [PROMPT] * 2,
            "lora_path": [a.name, a.name, b.name],
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert r.status_code == 400 and error_code(r) == "INVALID_REQUEST", r.text
    settle(a.name, b.name)

    # /abort_request of a running request
    results: dict = {}
    rid = uuid.uuid4().hex
    t = long_request(url, a.name, 1500, results, "aborted", rid=rid)
    wait_in_flight(url, a.name, 1)
    assert httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=ADMIN, timeout=10).status_code == 200
    t.join()
    settle(a.name)

    # client disconnect, non-stream (client timeout) and stream (closed after two chunks)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{url}/generate",
            timeout=httpx.Timeout(10, read=1.0),
            json={
                "input_ids": PROMPT,
                "lora_path": a.name,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
            },
        )
    body = {
        "input_ids": PROMPT,
        "lora_path": b.name,
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
    }
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
    settle(a.name, b.name)


def test_managed_versions_survive_max_loaded_loras_pressure(publish, snaps, engines, fixtures):
    url = engines[1].url
    a = publish(snaps["A"], engines[1])
    # max_loaded_loras is the engine's managed capacity + 1: one unmanaged load more than that
    # (with the managed version loaded) makes SGLang's LRU evict twice
    slots = httpx.get(f"{url}/lora_versions", headers=ADMIN, timeout=10).json()["managed_capacity"] + 1
    loaded = []
    try:
        for i in range(slots + 1):
            name = ("B", "C", "A")[i % 3]
            lname = f"plain-{i}-{name}"
            r = httpx.post(
                f"{url}/load_lora_adapter",
                headers=ADMIN,
                timeout=60,
                json={"lora_name": lname, "lora_path": str(fixtures.adapter_dir(name))},
            )
            assert r.status_code == 200, r.text
            loaded.append(lname)
        listed = versions(url)[a.name]
        assert listed["state"] == "READY_LOCAL" and listed["pinned"] and listed["lora_id"] == a.lora_id
        models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert a.name in models and "plain-0-B" not in models  # the LRU took an unmanaged one
        assert generate(url, PROMPT, a.name).status_code == 200
    finally:
        for lname in loaded:
            httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": lname}, headers=ADMIN, timeout=60)


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


@pytest.mark.parametrize(("warm", "probe"), [("A", "B"), ("B", "A")])
def test_kv_cache_is_isolated_between_versions(publish, snaps, engines, fixtures, warm, probe):
    """A warm -> first B request hits nothing and equals B's cold reference; repeated B hits its
    own cache (the negative control: the test would see a hit if namespaces were shared)."""
    url = engines[1].url
    versions_ = {n: publish(snaps[n], engines[1]) for n in (warm, probe)}
    # a fresh prompt per direction: each experiment starts from cold caches for it
    prompt = [(7 * i + (11 if warm == "A" else 13)) % 480 + 10 for i in range(64)]
    w, p = versions_[warm].name, versions_[probe].name
    assert _cached(generate(url, prompt, w, max_new_tokens=4)) == 0
    assert _cached(generate(url, prompt, w, max_new_tokens=4)) >= len(prompt) - 1  # same version: hit
    first = generate(url, prompt, p, max_new_tokens=8)
    assert _cached(first) == 0, "the other version must not reuse the warm version's KV"
    expected = reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir(probe), prompt, 8)
    assert first.json()["output_ids"] == expected
    again = generate(url, prompt, p, max_new_tokens=8)
    assert _cached(again) >= len(prompt) - 1 and again.json()["output_ids"] == expected


def test_switch_off_has_no_guards(stock_engine):
    url = stock_engine.url
    r = generate(url, PROMPT, "relax_policy_lora@t1-404-abcdefabcdef")
    assert r.status_code == 400 and error_code(r) is None  # stock error text, not our typed error
    assert "never been loaded" in r.text
    r = generate(url, PROMPT, None, extra_key="0" * 32)
    assert r.status_code == 200
