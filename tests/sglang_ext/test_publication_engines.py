"""Staged publication (begin / ordered buckets / end / cleanup) on real CPU engines E0/E1.

Every test leaves the engines as it found them (its candidates cleaned up), and every refusal is
checked to leave the engine's state unchanged and a following publication to succeed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from _engine_helpers import (
    ADMIN,
    Staged,
    error_code,
    generate,
    post,
    snapshot_of,
    status,
    versions,
    visible_state,
)

from sglang_ext.protocol import Routes

pytestmark = pytest.mark.engine

PROMPT = [302, 356, 417, 494, 439]


@pytest.fixture(scope="module")
def snaps(fixtures) -> dict:
    return {name: snapshot_of(fixtures.adapter_dir(name)) for name in ("A", "B", "C", "rank16")}


def assert_publication_still_works(url: str, snap, cleanup_after: list) -> None:
    s = Staged(url, snap)
    cleanup_after.append(s)
    assert s.publish()["state"] == "READY_LOCAL"


def test_happy_path_equals_stock_load_of_the_same_adapter(
    engines, stock_engine, snaps, fixtures, cleanup_after
):
    ref = httpx.post(
        f"{stock_engine.url}/load_lora_adapter",
        json={"lora_name": "ref-B", "lora_path": str(fixtures.adapter_dir("B"))},
        timeout=120,
    )
    assert ref.status_code == 200, ref.text
    expected = generate(stock_engine.url, PROMPT, "ref-B").json()["output_ids"]
    httpx.post(f"{stock_engine.url}/unload_lora_adapter", json={"lora_name": "ref-B"}, timeout=120)
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
    url = engines[0].url
    s = Staged(url, snaps["A"])
    cleanup_after.append(s)
    first = s.begin().json()
    assert s.begin().json() == first and first["state"] == "PREPARED"
    buckets = s.buckets()
    assert s.send_bucket(buckets[0]).json() == {"index": 0, "accepted": True, "duplicate": False}
    assert s.send_bucket(buckets[0]).json() == {"index": 0, "accepted": True, "duplicate": True}
    for b in buckets[1:]:
        assert s.send_bucket(b).status_code == 200
    ready = s.end().json()
    lora_id = versions(url)[s.name]["lora_id"]
    assert s.end().json() == ready
    assert s.send_bucket(buckets[-1]).json()["duplicate"] is True
    # begin of a READY name with the same digest: the READY receipt, no second load
    assert s.begin().json() == ready
    assert versions(url)[s.name]["lora_id"] == lora_id


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
    from sglang_ext.protocol import bucket_checksum, encode_bucket

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


def test_same_name_other_digest_is_a_conflict(engines, snaps, cleanup_after):
    url = engines[0].url
    a = Staged(url, snaps["A"])
    cleanup_after.append(a)
    assert a.begin().status_code == 200
    # Forge B's content under A's name: the name carries A's digest prefix, the body B's digest.
    body = a.begin_req.model_dump(mode="json")
    body_b = Staged(url, snaps["B"], a.version_id).begin_req.model_dump(mode="json")
    body_b["lora_name"] = body["lora_name"]
    r = post(url, Routes.BEGIN, body_b)
    assert r.status_code in (400, 409) and error_code(r) in ("INVALID_REQUEST", "VERSION_CONFLICT")


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


def test_cleanup_racing_a_late_end_unloads_the_candidate(engines, snaps):
    url = engines[0].url
    s = Staged(url, snaps["C"])
    assert s.begin().status_code == 200
    for b in s.buckets():
        assert s.send_bucket(b).status_code == 200
    results: dict = {}
    t = threading.Thread(target=lambda: results.setdefault("end", s.end()))
    t.start()
    time.sleep(0.05)
    cleaned = s.cleanup()
    t.join()
    assert cleaned.status_code == 200, cleaned.text
    assert results["end"].status_code in (200, 409)  # READY first, or refused as stale
    listed = versions(url)[s.name]
    assert listed["state"] == "CLEANED" and listed["lora_id"] is None
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert s.name not in {m["id"] for m in models}
    r = generate(url, PROMPT, s.name)
    assert r.status_code != 200  # never served after cleanup (no fallback, no implicit reload)


def test_engine_capacity_refuses_a_third_managed_version(engines, snaps, cleanup_after):
    url = engines[1].url
    for name in ("A", "B"):
        s = Staged(url, snaps[name])
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


def test_generation_on_a_keeps_running_while_b_is_published(engines, snaps, cleanup_after, run_dir):
    url = engines[0].url
    a = Staged(url, snaps["A"])
    cleanup_after.append(a)
    a.publish()
    stop = threading.Event()
    gaps: list[float] = []
    failures: list[str] = []
    baseline_gap: list[float] = []

    def stream_a(sink: list[float]) -> None:
        while not stop.is_set():
            body = {
                "input_ids": PROMPT,
                "lora_path": a.name,
                "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True},
            }
            last = None
            try:
                with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        failures.append(f"status {r.status_code}")
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data:") or line.strip() == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            sink.append(now - last)
                        last = now
            except httpx.HTTPError as exc:
                failures.append(repr(exc))

    # the same load without publication, for comparison
    t = threading.Thread(target=stream_a, args=(baseline_gap,))
    t.start()
    time.sleep(3)
    stop.set()
    t.join()

    stop.clear()
    t = threading.Thread(target=stream_a, args=(gaps,))
    t.start()
    time.sleep(1)
    b = Staged(url, snaps["B"])
    cleanup_after.append(b)
    t0 = time.perf_counter()
    b.publish()
    publish_s = time.perf_counter() - t0
    time.sleep(1)
    stop.set()
    t.join()
    assert not failures, failures
    assert gaps, "A produced tokens during the publication"
    report = {
        "publish_s": round(publish_s, 3),
        "max_gap_s_during_publication": round(max(gaps), 3),
        "max_gap_s_without_publication": round(max(baseline_gap), 3),
        "tokens_during": len(gaps),
    }
    (run_dir / "publication_gap.json").write_text(json.dumps(report, indent=2))
    print(f"\n[publication gap] {report}")


def test_a_bucket_handed_over_as_a_local_file_serves_exactly_like_a_body(
    engines, snaps, cleanup_after, run_dir
):
    """E0 takes B's buckets from files a trainer on this host wrote (EngineClient with
    local_source_dir), E1 takes them as bodies: the same tokens, the trainer's files removed,
    the engine's staged copies removed at READY; bad local sources are refused and change nothing."""
    import asyncio
    import os
    from pathlib import Path

    from _local_source import local_source_dir

    from relax_glue.engine_client import EngineClient
    from sglang_ext.protocol import EndRequest, ReceiveBucketMeta

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
            "E0", e0.url, admin_key=ADMIN["Authorization"].split()[1], local_source_dir=src
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
