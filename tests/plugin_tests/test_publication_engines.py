"""Staged publication (begin / ordered buckets / end / cleanup) on real CPU engines E0/E1.

Every test leaves the engines as it found them (its candidates cleaned up), and every refusal is
checked to leave the engine's state unchanged and a following publication to succeed.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid

import httpx
import pytest
from _digest_collision import colliding_snapshots
from _engine_helpers import (
    ADMIN,
    EPOCH,
    PREFIX,
    Staged,
    error_code,
    first_state_other_than,
    generate,
    loaded_lora_ids,
    post,
    status,
    stock_output_ids,
    unload_log_count_after,
    versions,
    visible_state,
)

from lora_contract.protocol import Routes, read_peft_dir
from lora_versions_dev.farm import PROMPT
from lora_versions_dev.launcher import DEV_LORA_SLOTS

pytestmark = pytest.mark.engine


def assert_publication_still_works(url: str, snap, cleanup_after: list) -> None:
    s = Staged(url, snap)
    cleanup_after.append(s)
    assert s.publish()["state"] == "READY_LOCAL"


def test_happy_path_equals_stock_load_of_the_same_adapter(
    engines, stock_engine, snaps, fixtures, cleanup_after
):
    expected = stock_output_ids(stock_engine.url, fixtures.adapter_dir("B"), "ref-B", PROMPT)
    # B must change the output, or serving the base model would "equal" the stock load too
    assert generate(stock_engine.url, PROMPT).json()["output_ids"] != expected
    assert len(snaps["B"].bucket_plan) > 1, "the fixture must travel in several buckets"

    version_id = None
    for e in engines:
        s = Staged(e.url, snaps["B"], version_id)
        version_id = s.version_id  # the same version on both engines
        cleanup_after.append(s)
        receipt = s.publish()
        assert receipt == {
            "state": "READY_LOCAL",
            "lora_name": s.name,
            "version_key": {"epoch": "t1", "version_id": version_id},
            "digest": snaps["B"].digest,
            "attempt_token": s.attempt,
            "incarnation": status(e.url)["incarnation"],
        }
        got = generate(e.url, PROMPT, s.name)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == expected
        listed = versions(e.url)[s.name]
        assert listed["state"] == "READY_LOCAL" and listed["pinned"] is True
        assert listed["lora_id"] and listed["in_flight"] == 0
        assert listed["buckets_received"] == listed["buckets_total"] == len(snaps["B"].bucket_plan)
        models = httpx.get(f"{e.url}/v1/models", timeout=10).json()["data"]
        assert s.name in {m["id"] for m in models}
    # engine-local ids differ between engines; the name is what clients use
    ids = {versions(e.url)[cleanup_after[i].name]["lora_id"] for i, e in enumerate(engines)}
    assert len(ids) == 2


def test_duplicates_replay_without_second_effect(engines, snaps, cleanup_after):
    """A repeated begin, bucket or end answers what the first did and does nothing again: the
    bucket is not counted twice, and SGLang loads the version once (its load lines in the log)."""
    e0 = engines[0]
    url = e0.url
    s = Staged(url, snaps["A"])
    cleanup_after.append(s)
    first = s.begin().json()
    assert s.begin().json() == first and first["state"] == "PREPARED"
    buckets = s.buckets()
    assert s.send_bucket(buckets[0]).json() == {"index": 0, "accepted": True, "duplicate": False}
    assert s.send_bucket(buckets[0]).json() == {"index": 0, "accepted": True, "duplicate": True}
    assert versions(url)[s.name]["buckets_received"] == 1
    for b in buckets[1:]:
        assert s.send_bucket(b).status_code == 200
    ready = s.end().json()
    lora_id = versions(url)[s.name]["lora_id"]
    assert s.end().json() == ready
    assert s.send_bucket(buckets[-1]).json()["duplicate"] is True
    # begin of a READY name with the same digest: the READY receipt, no second load
    assert s.begin().json() == ready
    assert versions(url)[s.name]["lora_id"] == lora_id
    assert versions(url)[s.name]["buckets_received"] == len(buckets)
    assert loaded_lora_ids(e0, s.name) == [lora_id]


def test_out_of_order_and_corrupted_buckets_change_nothing(engines, snaps, cleanup_after):
    url = engines[0].url
    s = Staged(url, snaps["A"])
    cleanup_after.append(s)
    assert s.begin().status_code == 200
    buckets = s.buckets()
    before = visible_state(url)

    r = s.send_bucket(buckets[1])
    assert r.status_code == 409 and error_code(r) == "BUCKET_OUT_OF_ORDER"
    corrupted = bytearray(buckets[0].payload)
    corrupted[-1] ^= 0xFF
    r = s.send_bucket(buckets[0], payload=bytes(corrupted))
    assert r.status_code == 422 and error_code(r) == "CHECKSUM_MISMATCH"
    # a self-consistent payload (its own sha256) whose tensors differ from the manifest
    from lora_contract.protocol import bucket_checksum, encode_bucket

    wrong = {n: t.clone() + 1 for n, t in snaps["A"].tensors.items()}
    payload = encode_bucket(wrong, buckets[0].spec)
    r = s.send_bucket(buckets[0], payload=payload, sha=bucket_checksum(payload))
    assert r.status_code == 422 and error_code(r) == "CHECKSUM_MISMATCH"
    # bucket 1's tensors sent as bucket 0
    r = s.send_bucket(buckets[1], index=0)
    assert r.status_code == 422 and error_code(r) == "MANIFEST_MISMATCH"
    r = s.end()
    assert r.status_code == 422 and error_code(r) == "MANIFEST_MISMATCH"  # end before all buckets
    assert visible_state(url) == before

    for b in buckets:
        assert s.send_bucket(b).status_code == 200
    assert s.end().json()["state"] == "READY_LOCAL"


def test_incompatible_adapter_is_refused_at_begin(engines, snaps, cleanup_after):
    url = engines[0].url
    before = visible_state(url)
    s = Staged(url, snaps["rank16"])
    r = s.begin()
    assert r.status_code == 422 and error_code(r) == "INCOMPATIBLE_ADAPTER", r.text
    assert "max-lora-rank" in r.json()["error"]["message"]
    assert visible_state(url) == before
    assert_publication_still_works(url, snaps["A"], cleanup_after)


def test_same_name_other_digest_is_a_conflict(engines, snaps, fixtures, cleanup_after):
    """A valid begin names an existing version with another digest only when the two digests share
    the 12 hex characters the name carries, so the two snapshots here are a real prefix collision
    (fixture A with 6 low bytes changed; tests/plugin_tests/_digest_collision.py). The second is
    VERSION_CONFLICT while the first is READY, from another attempt and from the one that loaded
    it, and still after the first's cleanup (a name fixes its digest for the engine's lifetime);
    none of these changes anything, and the first keeps serving what it served."""
    url = engines[0].url
    config, tensors = read_peft_dir(fixtures.adapter_dir("A"))
    first, second = colliding_snapshots(config, tensors, max_bucket_bytes=16 * 1024)
    a = Staged(url, first)
    cleanup_after.append(a)
    assert a.publish()["state"] == "READY_LOCAL"
    served = generate(url, PROMPT, a.name).json()["output_ids"]
    before = visible_state(url)

    def begin_second(attempt: str) -> httpx.Response:
        req = second.begin_request(PREFIX, EPOCH, a.version_id, attempt)  # validated: a sound body
        assert req.lora_name == a.name and req.digest != first.digest
        return post(url, Routes.BEGIN, req.model_dump(mode="json"))

    def assert_conflict(r: httpx.Response) -> None:
        assert r.status_code == 409 and error_code(r) == "VERSION_CONFLICT", r.text
        assert r.json()["error"]["digest"] == first.digest  # the digest the name holds here

    for attempt in (uuid.uuid4().hex, a.attempt):
        assert_conflict(begin_second(attempt))
    assert visible_state(url) == before
    assert generate(url, PROMPT, a.name).json()["output_ids"] == served

    assert a.cleanup().json()["state"] == "CLEANED"
    cleaned = visible_state(url)
    assert_conflict(begin_second(uuid.uuid4().hex))
    assert visible_state(url) == cleaned
    assert_publication_still_works(url, snaps["B"], cleanup_after)


def test_cleanup_is_idempotent_and_tombstones_the_attempt(engines, snaps, cleanup_after):
    url = engines[0].url
    s = Staged(url, snaps["A"])
    assert s.begin().status_code == 200
    buckets = s.buckets()
    assert s.send_bucket(buckets[0]).status_code == 200
    first = s.cleanup()
    assert first.status_code == 200 and first.json()["state"] == "CLEANED"
    assert s.cleanup().json() == first.json()
    before = visible_state(url)
    # late bucket, late end, late begin of the cleaned attempt: STALE_ATTEMPT, nothing recreated
    for r in (s.send_bucket(buckets[1]), s.end(), s.begin()):
        assert r.status_code == 409 and error_code(r) == "STALE_ATTEMPT", r.text
    assert visible_state(url) == before
    assert_publication_still_works(url, snaps["A"], cleanup_after)


def test_cleanup_before_begin_prevents_a_late_begin(engines, snaps):
    url = engines[0].url
    s = Staged(url, snaps["A"])
    assert s.cleanup().json()["state"] == "CLEANED"
    r = s.begin()
    assert r.status_code == 409 and error_code(r) == "STALE_ATTEMPT"
    assert s.name not in versions(url)


def cleanup_as_soon_as_the_end_loads(s: Staged) -> tuple[str, httpx.Response, httpx.Response]:
    """Send ``s``'s end, then its cleanup the moment the version leaves PREPARED: the state seen
    then (LOADING when the cleanup raced the load), the end's reply and the cleanup's."""
    results: dict = {}
    t = threading.Thread(target=lambda: results.setdefault("end", s.end()))
    t.start()
    seen = first_state_other_than(s.url, s.name, "PREPARED")
    cleaned = s.cleanup()
    t.join()
    return seen, results["end"], cleaned


# The load and its probe take tens of ms; a poll of the version's state can miss that on a busy
# host, so the race is tried again (each try is checked in full) until the poll saw it LOADING.
RACE_TRIES = 5


def test_cleanup_racing_a_late_end_unloads_the_candidate(engines, snaps, cleanup_after):
    """The cleanup arrives while the end's load is running (the version seen LOADING): it waits
    for the load, which answers the end READY, then unloads what was loaded, exactly once (the
    one lora_id SGLang loaded under the name has exactly one unload line in the engine log), and
    the name is never served again."""
    e0 = engines[0]
    url = e0.url
    seen_states = []
    for _ in range(RACE_TRIES):
        s = Staged(url, snaps["C"])
        cleanup_after.append(s)  # cleaned at teardown too, should a check below fail
        assert s.begin().status_code == 200
        for b in s.buckets():
            assert s.send_bucket(b).status_code == 200
        seen, end, cleaned = cleanup_as_soon_as_the_end_loads(s)
        seen_states.append(seen)
        assert cleaned.status_code == 200 and cleaned.json()["state"] == "CLEANED", cleaned.text
        assert end.status_code == 200 and end.json()["state"] == "READY_LOCAL", end.text
        [lora_id] = loaded_lora_ids(e0, s.name)  # exactly one physical load ...
        assert unload_log_count_after(e0, lora_id) == 1  # ... and exactly one physical unload of it
        listed = versions(url)[s.name]
        assert listed["state"] == "CLEANED" and listed["lora_id"] is None
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert s.name not in {m["id"] for m in models}
        r = generate(url, PROMPT, s.name)
        # never served after cleanup (no fallback, no implicit reload)
        assert r.status_code == 404 and error_code(r) == "UNKNOWN_VERSION", r.text
        if seen == "LOADING":
            break
    assert seen_states[-1] == "LOADING", f"the cleanup never raced the load: states seen {seen_states}"


def test_engine_capacity_refuses_one_managed_version_past_its_slots(engines, snaps, cleanup_after):
    """The engine's own bound (every LoRA slot but one): one more begin is CAPACITY_ERROR with
    nothing changed, whatever the registry's K (the trainer side refuses past K before this)."""
    url = engines[1].url
    capacity = httpx.get(f"{url}/lora_versions", headers=ADMIN, timeout=10).json()["managed_capacity"]
    assert capacity == DEV_LORA_SLOTS - 1
    for i in range(capacity):
        s = Staged(url, snaps[("A", "B")[i % 2]])
        cleanup_after.append(s)
        s.publish()
    before = visible_state(url)
    third = Staged(url, snaps["C"])
    r = third.begin()
    assert r.status_code == 409 and error_code(r) == "CAPACITY_ERROR"
    assert visible_state(url) == before
    # freeing one slot (cleanup) admits the third
    assert cleanup_after.pop().cleanup().status_code == 200
    cleanup_after.append(third)
    assert third.publish()["state"] == "READY_LOCAL"


def test_control_endpoints_need_the_admin_key(engines, snaps):
    url = engines[0].url
    s = Staged(url, snaps["A"])
    for route, body in [
        (Routes.BEGIN, s.begin_req.model_dump(mode="json")),
        (Routes.END, {"lora_name": s.name, "attempt_token": s.attempt}),
        (Routes.CLEANUP, {"lora_name": s.name, "attempt_token": s.attempt}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert post(url, route, body, headers=headers).status_code == 401
    bucket = s.buckets()[0]
    r = httpx.post(f"{url}{Routes.RECEIVE_BUCKET}", content=bucket.payload, timeout=10)
    assert r.status_code == 401
    assert httpx.get(f"{url}{Routes.STATUS}", timeout=10).status_code == 401
    assert s.name not in versions(url)
    assert generate(url, PROMPT).status_code == 200  # generation stays open


def test_managed_names_are_protected_from_the_stock_lora_api(engines, snaps, fixtures, cleanup_after):
    url = engines[0].url
    s = Staged(url, snaps["A"])
    cleanup_after.append(s)
    s.publish()
    before = visible_state(url)
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": s.name}, headers=ADMIN, timeout=60)
    assert r.status_code == 409 and error_code(r) == "MANAGED_ADAPTER", r.text
    other = Staged(url, snaps["B"])
    r = httpx.post(
        f"{url}/load_lora_adapter",
        headers=ADMIN,
        timeout=60,
        json={"lora_name": other.name, "lora_path": str(fixtures.adapter_dir("B"))},
    )
    assert r.status_code == 409 and error_code(r) == "MANAGED_ADAPTER", r.text
    assert visible_state(url) == before
    assert generate(url, PROMPT, s.name).status_code == 200


class TokenStream:
    """Greedy streams on one version, one after another in a thread, recording when each streamed
    chunk arrived (``time.perf_counter``). Entered once the first chunk arrived."""

    def __init__(self, url: str, lora_name: str) -> None:
        self.url = url
        self.lora_name = lora_name
        self.arrivals: list[float] = []
        self.failures: list[str] = []
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> TokenStream:
        self._thread.start()
        assert self._first.wait(60), f"no token on {self.lora_name} within 60 s: {self.failures}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        body = {
            "input_ids": PROMPT,
            "lora_path": self.lora_name,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True},
        }
        while not self._stop.is_set():
            try:
                with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        self.failures.append(f"status {r.status_code}")
                        return
                    for line in r.iter_lines():
                        if line.startswith("data:") and line.strip() != "data: [DONE]":
                            self.arrivals.append(time.perf_counter())
                            self._first.set()
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
                return

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals)]


def largest_gap_within(arrivals: list[float], start: float, end: float) -> float:
    """The longest stretch of [start, end] without an arrival, the window's edges included."""
    marks = [start, *(t for t in arrivals if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(marks))


# A token gap on these CPU engines is tens of milliseconds (about 0.05 s even during a
# publication); a stall of a second means the publication held the event loop or the scheduler.
STALL_S = 1.0


def test_generation_on_a_keeps_running_while_b_is_published(engines, snaps, cleanup_after, run_dir):
    """From the moment B's begin is sent to the moment B's end answers READY, A's stream goes on:
    tokens arrive inside that window and no stretch of it (its edges included) goes without one
    for longer than STALL_S (or 5x the longest gap of the same stream without a publication)."""
    url = engines[0].url
    a = Staged(url, snaps["A"])
    cleanup_after.append(a)
    a.publish()
    with TokenStream(url, a.name) as alone:  # the same load without publication, for comparison
        time.sleep(2)  # a measuring period, not a wait for a condition
    assert not alone.failures, alone.failures
    bound = max(STALL_S, 5 * max(alone.gaps()))

    b = Staged(url, snaps["B"])
    cleanup_after.append(b)
    with TokenStream(url, a.name) as during:
        t_begin = time.perf_counter()
        assert b.publish()["state"] == "READY_LOCAL"
        t_ready = time.perf_counter()
    assert not during.failures, during.failures
    inside = [t for t in during.arrivals if t_begin <= t <= t_ready]
    gap = largest_gap_within(during.arrivals, t_begin, t_ready)
    report = {
        "publish_s": round(t_ready - t_begin, 3),
        "tokens_during_publication": len(inside),
        "max_gap_s_during_publication": round(gap, 3),
        "max_gap_s_without_publication": round(max(alone.gaps()), 3),
        "bound_s": round(bound, 3),
    }
    (run_dir / "publication_gap.json").write_text(json.dumps(report, indent=2))
    print(f"\n[publication gap] {report}")
    assert inside, f"no token of A arrived between B's begin and B's READY: {report}"
    assert gap <= bound, f"A's stream stalled {gap:.3f} s during B's publication: {report}"


def test_a_bucket_handed_over_as_a_local_file_serves_exactly_like_a_body(
    engines, snaps, cleanup_after, run_dir
):
    """E0 takes B's buckets from files a trainer on this host wrote (EngineClient with
    local_source_dir), E1 takes them as bodies: the same tokens, the trainer's files removed,
    the engine's staged copies removed at READY; bad local sources are refused and change nothing."""
    import asyncio
    import os
    from pathlib import Path

    from lora_contract.protocol import EndRequest, ReceiveBucketMeta
    from lora_versions_dev.farm import local_source_dir
    from relax_glue.bucket_transport import LocalFileTransport
    from relax_glue.engine_client import EngineClient

    e0, e1 = engines
    src = local_source_dir(run_dir)
    body = Staged(e1.url, snaps["B"])
    cleanup_after.append(body)
    assert body.publish()["state"] == "READY_LOCAL"
    local = Staged(e0.url, snaps["B"], body.version_id)
    cleanup_after.append(local)
    assert local.begin().status_code == 200

    async def send_local() -> dict:
        async with EngineClient(
            "E0", e0.url, admin_key=ADMIN["Authorization"].split()[1], transport=LocalFileTransport(src)
        ) as client:
            for b in local.buckets():
                meta = ReceiveBucketMeta(
                    lora_name=local.name, attempt_token=local.attempt, index=b.spec.index, sha256=b.sha256
                )
                ack = await client.receive_bucket(meta, b.payload)
                assert ack.accepted and not ack.duplicate
            receipt = await client.end(EndRequest(lora_name=local.name, attempt_token=local.attempt))
            return receipt.model_dump(mode="json")

    assert asyncio.run(send_local())["state"] == "READY_LOCAL"
    assert list(src.iterdir()) == []  # the client removed what it wrote
    staged = [
        p
        for d in Path("/dev/shm").glob(f"sglang-lora-versions-{e0.proc.pid}-*")
        for p in d.rglob("*")
        if p.is_file()
    ]
    assert staged == []  # READY: the engine's private copies are gone too
    assert (
        generate(e0.url, PROMPT, local.name).json()["output_ids"]
        == generate(e1.url, PROMPT, body.name).json()["output_ids"]
    )

    # refusals: each leaves the attempt as it was, and the next publication works
    bad = Staged(e0.url, snaps["C"])
    cleanup_after.append(bad)
    assert bad.begin().status_code == 200
    [first, *_] = bad.buckets()

    def send_named(name: str, payload: bytes = b"") -> httpx.Response:
        return httpx.post(
            f"{e0.url}{Routes.RECEIVE_BUCKET}",
            content=payload,
            headers={**bad.bucket_headers(first), "X-Bucket-Source": name},
            timeout=60,
        )

    (src / "real.safetensors").write_bytes(first.payload)
    os.symlink(src / "real.safetensors", src / "link.safetensors")
    os.mkfifo(src / "fifo.safetensors")
    (src / "other.safetensors").write_bytes(bad.buckets()[-1].payload)
    cases = {
        "link.safetensors": "INVALID_REQUEST",  # never followed
        "fifo.safetensors": "INVALID_REQUEST",  # refused, not waited on
        "missing.safetensors": "INVALID_REQUEST",
        "..": "INVALID_REQUEST",  # not a bare file name
        "other.safetensors": "MANIFEST_MISMATCH",  # another bucket's tensors
    }
    for name, code in cases.items():
        r = send_named(name)
        assert r.status_code in (400, 409, 422) and error_code(r) == code, (name, r.text)
    r = send_named("real.safetensors", payload=b"x")  # a body as well: which one would count?
    assert error_code(r) == "INVALID_REQUEST", r.text
    assert versions(e0.url)[bad.name]["buckets_received"] == 0
    assert send_named("real.safetensors").status_code == 200  # the source still readable and sound
    # on the staging filesystem, with no other link and no writer: taken over, not copied
    assert not (src / "real.safetensors").exists()
    for f in src.iterdir():
        f.unlink()


def test_staged_files_are_held_by_the_scheduler_until_the_unload_and_released_by_it(engines, snaps):
    """At READY the engine's staged files are deleted, but the scheduler still maps them (SGLang's
    loader keeps the safetensors mapping as the weights): the memory is held exactly as long as
    the version is loaded, and the unload releases it; nothing stays mapped after a cleanup."""
    from pathlib import Path

    import psutil

    e0, _ = engines
    main = psutil.Process(e0.proc.pid)

    def staged_mappings() -> list[str]:
        found = []
        for proc in [main, *main.children(recursive=True)]:
            try:
                maps = Path(f"/proc/{proc.pid}/maps").read_text()
            except OSError:
                continue
            found += [ln.split()[-2] for ln in maps.splitlines() if "sglang-lora-versions-" in ln]
        return found

    s = Staged(e0.url, snaps["B"])
    try:
        assert s.publish()["state"] == "READY_LOCAL"
        held = staged_mappings()
        assert held, "the scheduler maps the loaded version's files"
        staged = [
            p for d in Path("/dev/shm").glob(f"sglang-lora-versions-{e0.proc.pid}-*") for p in d.rglob("*")
        ]
        assert [p for p in staged if p.is_file()] == []  # deleted from the directory already
    finally:
        r = s.cleanup()
    assert r.status_code == 200 and r.json()["state"] == "CLEANED", r.text
    deadline = time.monotonic() + 30
    while staged_mappings() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert staged_mappings() == []
