"""The collective transport on real CPU engines with gloo, the test process as the trainer.

The same contract as HTTP (begin -> ordered buckets -> end, cleanup, idempotency, typed
errors), the bytes over each engine's group. Every fault ends in a typed refusal, a cleanup,
and an engine that keeps serving: an A session streams through the whole module and must never
fail, and each fault test ends by publishing again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import (
    Staged,
    error_code,
    generate,
    new_version_id,
    status,
    stock_output_ids,
    versions,
    visible_state,
)
from _group_trainer import GroupTrainer, tensor_bytes

from lora_versions_dev.farm import PROMPT

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def trainers(engines) -> dict:
    """One group per engine, connected once (tests that break a group connect a new one)."""
    out = {}
    for e in engines:
        t = GroupTrainer(e.url)
        r = t.connect()
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "CONNECTED" and r.json()["incarnation"] == status(e.url)["incarnation"]
        out[e.name] = t
    return out


@pytest.fixture(scope="module")
def a_sessions(engines, snaps):
    """A sessions on E0 with version A (published over HTTP), streaming for the whole module.
    Every generation must end well; the fixture's teardown asserts it."""
    url = engines[0].url
    a = Staged(url, snaps["A"])
    a.publish()
    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def stream() -> None:
        body = {
            "input_ids": PROMPT,
            "lora_path": a.name,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        }
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        failures.append(f"status {r.status_code}")
                        continue
                    last = None
                    for line in r.iter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            last = json.loads(line[5:])
                    if last is None or len(last["output_ids"]) != 64:
                        failures.append(f"ended short: {last and len(last['output_ids'])}")
                    done[0] += 1
            except Exception as exc:
                failures.append(repr(exc))

    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    yield a
    stop.set()
    worker.join(60)
    assert not failures, failures
    assert done[0] > 0
    assert a.cleanup().status_code == 200


def reconnect(trainers: dict, engine) -> GroupTrainer:
    t = GroupTrainer(engine.url)
    r = t.connect()
    assert r.status_code == 200, r.text
    trainers[engine.name] = t
    return t


def assert_collective_publication_works(trainers, engine, snap, cleanup_after) -> None:
    t = trainers[engine.name]
    s = t.staged(snap)
    cleanup_after.append(s)
    assert t.publish(s)["state"] == "READY_LOCAL"
    assert generate(engine.url, PROMPT, s.name).status_code == 200


def begun(trainers, engine, snap, cleanup_after) -> tuple[GroupTrainer, Staged]:
    """A collective attempt of ``snap`` on ``engine``, PREPARED (its receives posted)."""
    t = trainers[engine.name]
    s = t.staged(snap)
    cleanup_after.append(s)
    assert s.begin().status_code == 200
    return t, s


def in_background(send) -> None:
    """A broadcast the engine refuses: the trainer's side fails or waits; the test goes on."""
    threading.Thread(target=lambda: _suppress(send), daemon=True).start()


def cleaned_and_serving(trainers, engine, s: Staged, snap, cleanup_after, *, new_group: bool) -> None:
    """Every fault ends so: the attempt cleaned up, the engine generating, and a collective
    publication working again (over a new group when the fault broke the old one)."""
    assert s.cleanup().json()["state"] == "CLEANED"
    cleanup_after.remove(s)
    assert generate(engine.url, PROMPT).status_code == 200
    if new_group:
        reconnect(trainers, engine)
    assert_collective_publication_works(trainers, engine, snap, cleanup_after)


def test_collective_publication_on_two_engines_equals_http(
    engines, stock_engine, trainers, snaps, fixtures, a_sessions, cleanup_after
):
    expected = stock_output_ids(stock_engine.url, fixtures.adapter_dir("B"), "ref-B-collective", PROMPT)
    assert len(snaps["B"].bucket_plan) > 1

    version_id = new_version_id()
    for e in engines:
        t = trainers[e.name]
        s = t.staged(snaps["B"], version_id)
        cleanup_after.append(s)
        receipt = t.publish(s)
        assert receipt["state"] == "READY_LOCAL" and receipt["incarnation"] == status(e.url)["incarnation"]
        got = generate(e.url, PROMPT, s.name)
        assert got.status_code == 200 and got.json()["output_ids"] == expected
        listed = versions(e.url)[s.name]
        assert listed["buckets_received"] == listed["buckets_total"] == len(snaps["B"].bucket_plan)
    # the staged files are gone once READY (the scheduler holds the weights)
    assert "collective" not in str(os.listdir("/dev/shm"))


def test_duplicate_and_out_of_order_acknowledgements(engines, trainers, snaps, a_sessions, cleanup_after):
    e = engines[0]
    t = trainers[e.name]
    s = t.staged(snaps["A"])
    cleanup_after.append(s)
    first = s.begin().json()
    assert first["state"] == "PREPARED" and s.begin().json() == first  # one set of receives
    buckets = s.buckets()
    for b in buckets:  # the whole version goes over the group first
        t.send(s, b)
    before = visible_state(e.url)
    r = t.ack(s, buckets[1])
    assert r.status_code == 409 and error_code(r) == "BUCKET_OUT_OF_ORDER"
    assert visible_state(e.url) == before
    assert t.ack(s, buckets[0]).json() == {"index": 0, "accepted": True, "duplicate": False}
    # a duplicate acknowledgement transfers nothing: nothing is sent again, and it is answered
    assert t.ack(s, buckets[0]).json() == {"index": 0, "accepted": True, "duplicate": True}
    for b in buckets[1:]:
        assert t.ack(s, b).status_code == 200
    ready = s.end().json()
    assert ready["state"] == "READY_LOCAL" and s.end().json() == ready  # end again: no second load
    assert t.ack(s, buckets[-1]).json()["duplicate"] is True
    assert generate(e.url, PROMPT, s.name).status_code == 200


def test_a_begin_over_a_replaced_group_is_refused_before_any_byte_moves(
    engines, trainers, snaps, a_sessions, cleanup_after
):
    """Issue 41: a second sender connected its own group to the engine (the first one's receiver
    is gone with it). The first sender's begin names its group, which the engine no longer
    receives over: TRANSPORT_UNAVAILABLE, changing nothing, so that sender connects again before
    any byte moves. Before, the begin answered PREPARED, the first sender broadcast into its
    closed group (``Connection closed by peer``) and the second group's receiver waited for frames
    that never came, until a cleanup broke it too (``bench/publish_engine.py``: 8 of 20 collective
    publications failed so, one sender per adapter on one engine)."""
    e = engines[0]
    first = trainers[e.name]
    reconnect(trainers, e)  # another sender's group replaces the first one's
    s = first.staged(snaps["A"])
    before = visible_state(e.url)
    r = s.begin()
    assert r.status_code == 409 and error_code(r) == "TRANSPORT_UNAVAILABLE", r.text
    assert "connect again" in r.text, r.text
    assert visible_state(e.url) == before and s.name not in versions(e.url)
    # the group in use is untouched: the second sender publishes over it
    assert_collective_publication_works(trainers, e, snaps["A"], cleanup_after)


def test_a_retried_begin_after_its_group_went_posts_the_receives_again_on_the_new_one(
    engines, trainers, snaps, a_sessions, cleanup_after
):
    """A begin whose reply was lost, retried after the group it posted its receives on went
    (another group connected meanwhile, as ``CollectiveTransport`` does on TRANSPORT_UNAVAILABLE):
    the attempt's receives are posted again on the group the retry names, and the buckets sent
    over it are taken. Before, the retry was answered from the table with the receives gone, and
    every acknowledgement failed (TRANSFER_FAILED)."""
    e = engines[0]
    first = trainers[e.name]
    s = first.staged(snaps["B"])
    cleanup_after.append(s)
    assert s.begin().json()["state"] == "PREPARED"  # receives posted on the first group
    second = reconnect(trainers, e)  # that group goes
    # a retry that still names the first group is refused, changing nothing
    before = visible_state(e.url)
    r = s.begin()
    assert r.status_code == 409 and error_code(r) == "TRANSPORT_UNAVAILABLE", r.text
    assert visible_state(e.url) == before
    s.begin_req = s.begin_req.model_copy(update={"channel": second.group_id})
    assert s.begin().json()["state"] == "PREPARED"  # the same attempt, receives posted again
    for b in s.buckets():
        second.send(s, b)
        assert second.ack(s, b).json() == {"index": b.spec.index, "accepted": True, "duplicate": False}
    assert s.end().json()["state"] == "READY_LOCAL"
    assert generate(e.url, PROMPT, s.name).status_code == 200


def test_corrupted_data_is_refused_and_the_group_stays_usable(
    engines, trainers, snaps, a_sessions, cleanup_after
):
    e = engines[0]
    t, s = begun(trainers, e, snaps["B"], cleanup_after)
    buckets = s.buckets()
    before = visible_state(e.url)
    data = bytearray(tensor_bytes(buckets[0].payload))
    data[-1] ^= 0xFF
    t.send(s, buckets[0], data=bytes(data))
    r = t.ack(s, buckets[0])
    assert r.status_code == 422 and error_code(r) == "CHECKSUM_MISMATCH", r.text
    assert visible_state(e.url) == before
    # the bytes are gone with the refusal: no second chance over the group in this attempt
    r = t.ack(s, buckets[0])
    assert r.status_code == 409 and error_code(r) == "TRANSFER_FAILED"
    # the rest of the version is still sent (the publisher would clean up instead); the sizes
    # kept the pair in step, so the group serves the next publication
    for b in buckets[1:]:
        t.send(s, b)
    cleaned_and_serving(trainers, e, s, snaps["B"], cleanup_after, new_group=False)


def test_wrong_size_is_refused_before_any_byte_lands(engines, trainers, snaps, a_sessions, cleanup_after):
    e = engines[1]
    t, s = begun(trainers, e, snaps["B"], cleanup_after)
    b0 = s.buckets()[0]
    before = visible_state(e.url)
    # the frame announces one byte more than the plan: refused on the frame, the data receive
    # is never posted (the sender's data broadcast then fails on its side)
    in_background(lambda: t.send(s, b0, data=tensor_bytes(b0.payload) + b"\0"))
    r = t.ack(s, b0)
    # the receiver's refusal, typed: the sender's bucket is not the plan's (as over HTTP)
    assert r.status_code == 422 and error_code(r) == "MANIFEST_MISMATCH" and "announced" in r.text, r.text
    assert visible_state(e.url) == before
    # the group is out of step and never used again: a collective begin says so, changing nothing
    s2 = t.staged(snaps["A"])
    r = s2.begin()
    assert r.status_code == 409 and error_code(r) == "TRANSPORT_UNAVAILABLE", r.text
    assert s2.name not in versions(e.url)
    cleaned_and_serving(trainers, e, s, snaps["B"], cleanup_after, new_group=True)


def test_more_bytes_than_announced_end_the_receiver_not_the_engine(
    engines, trainers, snaps, a_sessions, cleanup_after
):
    e = engines[1]
    t, s = begun(trainers, e, snaps["B"], cleanup_after)
    b0 = s.buckets()[0]
    body = tensor_bytes(b0.payload)
    # a frame that tells the truth about the plan, then more data than it said: gloo aborts the
    # receiving process, which is the receiver, never the engine
    in_background(lambda: t.send(s, b0, data=body + b"\0" * 4096, announce=len(body)))
    r = t.ack(s, b0)
    assert r.status_code == 409 and error_code(r) == "TRANSFER_FAILED", r.text
    assert generate(e.url, PROMPT).status_code == 200
    cleaned_and_serving(trainers, e, s, snaps["B"], cleanup_after, new_group=True)


def test_cleanup_during_a_transfer(engines, trainers, snaps, a_sessions, cleanup_after):
    e = engines[0]
    t, s = begun(trainers, e, snaps["B"], cleanup_after)
    buckets = s.buckets()
    t.send(s, buckets[0])
    assert t.ack(s, buckets[0]).status_code == 200
    # bucket 1's receive is pending: cleanup takes the receiver with it, at once
    t0 = time.monotonic()
    assert s.cleanup().json()["state"] == "CLEANED"
    assert time.monotonic() - t0 < 10
    cleanup_after.remove(s)
    assert s.name not in {n for n, v in versions(e.url).items() if v["state"] != "CLEANED"}
    with pytest.raises(RuntimeError):  # gloo's DistBackendError
        t.send(s, buckets[1])  # the trainer's side sees the group gone
    assert generate(e.url, PROMPT).status_code == 200
    reconnect(trainers, e)
    assert_collective_publication_works(trainers, e, snaps["B"], cleanup_after)


@pytest.mark.parametrize("sent", ["none", "some", "all"])
def test_trainer_sigkilled_before_during_after_the_broadcast(
    engines, trainers, snaps, fixtures, a_sessions, cleanup_after, sent
):
    e = engines[0]
    snap = snaps["B"]
    n = len(snap.bucket_plan)
    count = {"none": 0, "some": n // 2, "all": n}[sent]
    version_id, attempt = new_version_id(), uuid.uuid4().hex
    args = {
        "url": e.url,
        "adapter_dir": str(fixtures.adapter_dir("B")),
        "version_id": version_id,
        "attempt": attempt,
        "sent": count,
    }
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_group_trainer.py"), json.dumps(args)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "SENT"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    s = Staged(e.url, snap, version_id)
    s.attempt = attempt
    cleanup_after.append(s)
    buckets = s.buckets()
    ack = GroupTrainer(e.url)
    t0 = time.monotonic()
    for b in buckets[:count]:
        r = ack.ack(s, b)
        assert r.status_code == 200, r.text  # what arrived before the kill is whole and verified
    if count < n:
        r = ack.ack(s, buckets[count])
        assert r.status_code == 409 and error_code(r) == "TRANSFER_FAILED", r.text
        assert time.monotonic() - t0 < 20  # the dead peer is seen at once, not after 30 minutes
    else:
        assert s.end().json()["state"] == "READY_LOCAL"  # nothing was missing
    cleaned_and_serving(trainers, e, s, snap, cleanup_after, new_group=True)


def _suppress(fn) -> None:
    with contextlib.suppress(Exception):
        fn()
