"""A managed load is read and re-shaped off the scheduler thread, and the scheduler's own request
only installs it (issue 29), on the real engine E1, whose scheduler process carries
``tests/engine_wrappers/prepared_load_probe.py``: a log line naming the thread of each part of a
load and an unload, and a failed preparation for the one load its trigger file marks."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import (
    ADMIN,
    Published,
    Staged,
    error_code,
    generate,
    loaded_lora_ids,
    snapshot_of,
    unload_log_count_after,
    versions,
)

from lora_versions_dev import reference
from lora_versions_dev.farm import PROMPT, local_source_dir
from lora_versions_dev.fixtures import Fixtures

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_wrappers"))
import prepared_load_probe as probe  # noqa: E402

MAX_NEW = 8


def probe_records(log_path: Path, lora_id: str) -> list[dict[str, str]]:
    """The probe's lines about ``lora_id``: {"what": ..., "thread": ..., "main": ..., ...}."""
    out = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if probe.LOG_LINE not in line or f"lora_id={lora_id}" not in line:
            continue
        rest = line.split(probe.LOG_LINE, 1)[1].split()
        record = {"what": rest[0]}
        record.update(kv.split("=", 1) for kv in rest[1:] if "=" in kv)
        out.append(record)
    return out


def wait_for_records(log_path: Path, lora_id: str, what: str, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = probe_records(log_path, lora_id)
        if any(r["what"] == what for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


@pytest.fixture(scope="module")
def e1(engines):
    return engines[1]


def test_a_managed_load_reads_and_reshapes_off_the_scheduler_thread_and_installs_on_it(
    e1, fixtures: Fixtures
):
    expected = reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir("C"), PROMPT, MAX_NEW)
    pub = Published(e1, snapshot_of(fixtures.adapter_dir("C")))
    try:
        r = generate(e1.url, PROMPT, pub.name, max_new_tokens=MAX_NEW)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected, "the installed adapter is exactly C"
    finally:
        pub.finish()
    assert loaded_lora_ids(e1, pub.name) == [pub.lora_id], "loaded exactly once"

    records = wait_for_records(e1.log_path, pub.lora_id, "release")
    where = {(r["what"], r.get("op")): (r["thread"], r["main"]) for r in records}
    worker = "lora-versions-prepare"
    # the reading and re-shaping: once, on the plugin's worker thread of the scheduler process
    assert [r["thread"] for r in records if r["what"] == "initialize_weights"] == [worker]
    assert [r["thread"] for r in records if r["what"] == "normalize_weights"] == [worker]
    # the scheduler thread (the process's main thread) only answered the ops and installed it
    assert [r["main"] for r in records if r["what"] == "install"] == ["True"]
    assert not [r for r in records if r["what"] == "upstream_load"], "never upstream's whole load"
    ops = [r["op"] for r in records if r["what"] == "op"]
    assert ops[0] == "prepare" and ops[-1] == "install", ops  # installed: nothing to discard
    assert set(ops[1:-1]) == {"poll"}, ops
    assert all(r["main"] == "True" for r in records if r["what"] == "op")
    assert [r["held"] for r in records if r["what"] == "op"][-1] == "0", "nothing stays prepared"
    # the unload: the slot on the scheduler thread, the adapter's memory released on the worker
    assert where[("release", None)] == (worker, "False")


def test_a_stock_load_on_a_plugin_engine_stays_upstreams(e1, fixtures: Fixtures):
    name = f"stock-{uuid.uuid4().hex[:6]}"
    r = httpx.post(
        f"{e1.url}/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(fixtures.adapter_dir("A"))},
        headers=ADMIN,
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    try:
        (lora_id,) = loaded_lora_ids(e1, name)
        records = wait_for_records(e1.log_path, lora_id, "upstream_load")
        assert [(r["what"], r["main"]) for r in records if r["what"] != "op"][:2] == [
            ("upstream_load", "True"),
            ("initialize_weights", "True"),
        ], records
        assert [r["op"] for r in records if r["what"] == "op"] == ["stock"]
    finally:
        r = httpx.post(f"{e1.url}/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text


def test_a_failed_preparation_is_load_failed_and_leaves_nothing(e1, fixtures: Fixtures, run_dir):
    trigger = probe.trigger_path(local_source_dir(run_dir))
    snap = snapshot_of(fixtures.adapter_dir("A"))
    s = Staged(e1.url, snap)
    assert s.begin().status_code == 200
    for b in s.buckets():
        assert s.send_bucket(b).status_code == 200
    trigger.write_text("")
    try:
        r = s.end()
    finally:
        left = trigger.exists()
        trigger.unlink(missing_ok=True)
    try:
        assert not left, "the probe's fault was taken by this load's preparation"
        assert r.status_code != 200 and error_code(r) == "LOAD_FAILED", r.text
        assert probe.FAULT_TEXT in r.text
        # as after any failed load that left nothing loaded: the attempt is PREPARED again
        v = versions(e1.url)[s.name]
        assert v["state"] == "PREPARED" and v["lora_id"] is None, v
        assert loaded_lora_ids(e1, s.name) == [], "never installed"
        # its ops: prepared, failed at a poll (forgotten there), discarded; nothing held
        text = Path(e1.log_path).read_text(errors="replace")
        (fault,) = [ln for ln in text.splitlines() if probe.LOG_LINE in ln and "fault injected" in ln]
        failed_id = fault.split("lora_id=")[1].split()[0]
        records = probe_records(e1.log_path, failed_id)
        ops = [(r["op"], r["success"]) for r in records if r["what"] == "op"]
        assert ops[0] == ("prepare", "True") and ops[-1] == ("discard", "True"), ops
        assert ("poll", "False") in ops and ("install", "True") not in ops, ops
        assert records[-1]["held"] == "0"
        assert not [r for r in records if r["what"] in ("install", "upstream_load")]

        # the same attempt's end again: a new load (new id, its own preparation) serves exactly A
        r = s.end()
        assert r.status_code == 200 and r.json()["state"] == "READY_LOCAL", r.text
        (lora_id,) = loaded_lora_ids(e1, s.name)
        assert lora_id != failed_id
        expected = reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir("A"), PROMPT, MAX_NEW)
        got = generate(e1.url, PROMPT, s.name, max_new_tokens=MAX_NEW)
        assert got.status_code == 200 and got.json()["output_ids"] == expected, got.text
    finally:
        r = s.cleanup()
        assert r.status_code == 200 and r.json()["state"] == "CLEANED", r.text
    assert unload_log_count_after(e1, lora_id) == 1
    assert unload_log_count_after(e1, failed_id, expect=0, timeout_s=0.5) == 0, "nothing of it to unload"
