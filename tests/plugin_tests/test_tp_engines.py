"""Managed versions on a real TP=2 CPU engine (issue 38): every rank prepares, installs, serves
and unloads each version, and a failure on one rank leaves nothing on any.

The engine (the session's ``tp2_engine``, conftest.py) runs with the plugin and E1's scheduler
probes (``sglang_with_scheduler_probes.py``): the prepared-load probe names the TP rank of each
line and fails the next preparation of one rank when its trigger file marks that rank. Outputs
are checked against the HF + PEFT reference of the adapter (``lora_versions_dev.reference``):
greedy tokens exactly (the TP=2 engine serves the TP=1 engine's tokens,
tests/dev_tests/test_cpu_tp_engines.py) and log-probabilities within :data:`LOGPROB_EPSILON` of
the TP=1 stock engine's (the ranks all-reduce in another order).
"""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from _engine_helpers import (
    ADMIN,
    Staged,
    error_code,
    generate,
    in_flight,
    reclaim,
    snapshot_of,
    versions,
    visible_state,
)

from lora_versions_dev import reference
from lora_versions_dev.farm import PROMPT
from lora_versions_dev.fixtures import ADAPTER_RANKS, Fixtures
from sglang_ext.slot_zeroing import LOG_MARKER as SLOT_ZEROING

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_wrappers"))
import prepared_load_probe as probe  # noqa: E402

MAX_NEW = 8
LOGPROB_EPSILON = 1e-5  # measured 1.4e-6 between the TP=2 and TP=1 engines (test_cpu_tp_engines.py)


@pytest.fixture(scope="module")
def tp2(tp2_engine):
    return tp2_engine.take()


@pytest.fixture(scope="module")
def source_dir(tp2_engine) -> Path:
    return tp2_engine.source_dir


def log_text(engine) -> str:
    return Path(engine.log_path).read_text(errors="replace")


def per_rank(engine, pattern: str) -> dict[int, int]:
    """How many log lines match ``pattern``, by the TP rank SGLang's log prefix names (``TP<n>``)."""
    counts: dict[int, int] = {}
    for line in log_text(engine).splitlines():
        if re.search(pattern, line):
            m = re.search(r"\bTP(\d+)\b", line)
            if m:
                counts[int(m[1])] = counts.get(int(m[1]), 0) + 1
    return counts


def probe_ops(engine, lora_id: str) -> list[tuple[str, str, str]]:
    """(tp_rank, op, success) of the prepared-load probe's op lines for ``lora_id``."""
    out = []
    for line in log_text(engine).splitlines():
        if (
            probe.LOG_LINE in line
            and " op " in f" {line.split(probe.LOG_LINE, 1)[1]} "
            and f"lora_id={lora_id}" in line
        ):
            fields = dict(kv.split("=", 1) for kv in line.split(probe.LOG_LINE, 1)[1].split() if "=" in kv)
            out.append((fields["tp_rank"], fields["op"], fields["success"]))
    return out


def greedy(url: str, lora: str | None) -> tuple[list[int], list[float]]:
    r = generate(url, PROMPT, lora, max_new_tokens=MAX_NEW, return_logprob=True)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], [lp for lp, *_ in body["meta_info"]["output_token_logprobs"]]


def expected_tokens(fixtures: Fixtures, adapter: str) -> list[int]:
    return reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir(adapter), PROMPT, MAX_NEW)


def lora_id_of(url: str, name: str) -> str:
    return versions(url)[name]["lora_id"]


def end_with_a_fault(s: Staged, trigger: Path) -> tuple[httpx.Response, bool]:
    """Stage ``s`` (begin, every bucket), then its ``end`` with the probe's ``trigger`` armed:
    (the end's reply, whether the trigger was left untaken)."""
    assert s.begin().status_code == 200
    for b in s.buckets():
        assert s.send_bucket(b).status_code == 200
    trigger.write_text("")
    try:
        return s.end(), trigger.exists()
    finally:
        trigger.unlink(missing_ok=True)


def test_a_version_is_installed_served_and_unloaded_on_every_rank(tp2, stock_engine, fixtures: Fixtures):
    a = Staged(tp2.url, snapshot_of(fixtures.adapter_dir("A")))
    assert a.publish()["state"] == "READY_LOCAL"
    lora_id = lora_id_of(tp2.url, a.name)
    ops = probe_ops(tp2, lora_id)
    for rank in ("0", "1"):
        mine = [(op, ok) for r, op, ok in ops if r == rank]
        assert mine[0] == ("prepare", "True") and ("install", "True") in mine, (rank, ops)
    assert per_rank(tp2, rf"LoRA adapter loading starts: LoRARef\(lora_id={lora_id}") == {0: 1, 1: 1}

    tokens, logprobs = greedy(tp2.url, a.name)
    assert tokens == expected_tokens(fixtures, "A")
    ref_tokens, ref_logprobs = greedy(stock_engine.url, "A")  # the TP=1 stock engine, A loaded at start
    assert tokens == ref_tokens
    assert max(abs(x - y) for x, y in zip(logprobs, ref_logprobs, strict=True)) <= LOGPROB_EPSILON

    # n > 1 on both ranks; the native count is back at 0
    r = generate(tp2.url, PROMPT, a.name, max_new_tokens=4, sampling_params={"n": 3, "temperature": 0.7})
    assert r.status_code == 200 and len(r.json()) == 3, r.text
    assert in_flight(tp2.url, a.name) == 0

    r = reclaim(tp2.url, a.name, uuid.uuid4().hex)
    assert r.status_code == 200 and r.json()["state"] == "UNLOADED", r.text
    fences = [ln for ln in log_text(tp2).splitlines() if f"step fence lora_id={lora_id} " in ln]
    assert sorted(re.search(r"tp_rank=(\d)", ln)[1] for ln in fences) == ["0", "1"], fences
    assert all("fence_passed=True" in ln for ln in fences), fences
    assert per_rank(tp2, rf"LoRA adapter unloading starts: LoRARef\(lora_id={lora_id}") == {0: 1, 1: 1}
    # each rank zeroed its own slot, only the adapter's ranks (sglang_ext.slot_zeroing)
    lines = log_text(tp2).splitlines()
    first_unload = min(
        i for i, ln in enumerate(lines) if f"unloading starts: LoRARef(lora_id={lora_id}" in ln
    )
    clears = [ln for ln in lines[first_unload:] if SLOT_ZEROING in ln]
    by_rank = {re.search(r"tp_rank=(\d)", ln)[1]: re.search(r"zeroed_ranks=(\w+)", ln)[1] for ln in clears}
    assert by_rank == {"0": str(ADAPTER_RANKS["A"]), "1": str(ADAPTER_RANKS["A"])}, clears
    late = generate(tp2.url, PROMPT, a.name)
    assert late.status_code != 200 and error_code(late) is not None, late.text


def test_a_preparation_failed_on_rank_1_only_leaves_nothing_on_any_rank(tp2, fixtures: Fixtures, source_dir):
    s = Staged(tp2.url, snapshot_of(fixtures.adapter_dir("B")))
    r, left = end_with_a_fault(s, probe.trigger_path(source_dir, tp_rank=1))
    try:
        assert not left, "rank 1's preparation took the fault"
        assert r.status_code != 200 and error_code(r) == "LOAD_FAILED", r.text
        assert "TP rank 1" in r.text and probe.FAULT_TEXT in r.text, r.text
        v = versions(tp2.url)[s.name]
        assert v["state"] == "PREPARED" and v["lora_id"] is None, v
        text = log_text(tp2)
        (fault,) = [ln for ln in text.splitlines() if probe.LOG_LINE in ln and "fault injected" in ln]
        assert "tp_rank=1" in fault
        failed_id = fault.split("lora_id=")[1].split()[0]
        ops = probe_ops(tp2, failed_id)
        for rank in ("0", "1"):
            mine = [(op, ok) for rk, op, ok in ops if rk == rank]
            # rank 0 prepared it too; nobody installed it, and both dropped what they held
            assert mine[0] == ("prepare", "True") and mine[-1] == ("discard", "True"), (rank, ops)
            assert not [op for op, _ in mine if op == "install"], (rank, ops)
        assert per_rank(tp2, rf"LoRA adapter loading starts: LoRARef\(lora_id={failed_id}") == {}

        r = s.end()  # the same attempt again: a new load, on both ranks, serves exactly B
        assert r.status_code == 200 and r.json()["state"] == "READY_LOCAL", r.text
        lora_id = lora_id_of(tp2.url, s.name)
        assert lora_id != failed_id
        assert per_rank(tp2, rf"LoRA adapter loading starts: LoRARef\(lora_id={lora_id}") == {0: 1, 1: 1}
        assert greedy(tp2.url, s.name)[0] == expected_tokens(fixtures, "B")
    finally:
        r = s.cleanup()
        assert r.status_code == 200 and r.json()["state"] == "CLEANED", r.text


def test_an_install_failed_on_rank_1_only_is_taken_back_out_of_rank_0(tp2, fixtures: Fixtures, source_dir):
    """Both ranks prepared A and agreed to install it; rank 1's install then fails: rank 0 takes
    its install back out (SGLang's own unload, on rank 0 alone) before it replies, so the load is
    LOAD_FAILED with nothing left on either rank, and a retried end serves A."""
    s = Staged(tp2.url, snapshot_of(fixtures.adapter_dir("A")))
    r, left = end_with_a_fault(s, probe.install_trigger_path(source_dir, tp_rank=1))
    try:
        assert not left, "rank 1's install took the fault"
        assert r.status_code != 200 and error_code(r) == "LOAD_FAILED", r.text
        assert "TP rank 1" in r.text and probe.INSTALL_FAULT_TEXT in r.text, r.text
        v = versions(tp2.url)[s.name]
        assert v["state"] == "PREPARED" and v["lora_id"] is None, v
        (fault,) = [ln for ln in log_text(tp2).splitlines() if "install fault injected" in ln]
        assert "tp_rank=1" in fault
        failed_id = fault.split("lora_id=")[1].split()[0]
        installs = [(rank, ok) for rank, op, ok in probe_ops(tp2, failed_id) if op == "install"]
        assert sorted(installs) == [("0", "False"), ("1", "False")], installs  # the agreed answer
        loads = rf"LoRA adapter loading starts: LoRARef\(lora_id={failed_id}"
        unloads = rf"LoRA adapter unloading starts: LoRARef\(lora_id={failed_id}"
        assert per_rank(tp2, loads) == {0: 1, 1: 1}, "both ranks began the install"
        assert per_rank(tp2, unloads) == {0: 1}, "rank 0 took its install back; rank 1 never held it"

        r = s.end()  # the same attempt again: a new load on both ranks serves exactly A
        assert r.status_code == 200 and r.json()["state"] == "READY_LOCAL", r.text
        lora_id = lora_id_of(tp2.url, s.name)
        assert per_rank(tp2, rf"LoRA adapter loading starts: LoRARef\(lora_id={lora_id}") == {0: 1, 1: 1}
        assert greedy(tp2.url, s.name)[0] == expected_tokens(fixtures, "A")
    finally:
        r = s.cleanup()
        assert r.status_code == 200 and r.json()["state"] == "CLEANED", r.text


def test_capacity_holds_on_the_tp_engine(tp2, snaps, cleanup_after, fixtures: Fixtures):
    """Every slot but one holds a managed version on both ranks; one more begin is CAPACITY_ERROR
    with nothing changed; a cleanup frees a slot on both ranks and admits it."""
    capacity = httpx.get(f"{tp2.url}/lora_versions", headers=ADMIN, timeout=10).json()["managed_capacity"]
    adapters = [("A", "B")[i % 2] for i in range(capacity)]
    for adapter in adapters:
        s = Staged(tp2.url, snaps[adapter])
        cleanup_after.append(s)
        s.publish()
    before = visible_state(tp2.url)
    third = Staged(tp2.url, snaps["C"])
    r = third.begin()
    assert r.status_code == 409 and error_code(r) == "CAPACITY_ERROR", r.text
    assert visible_state(tp2.url) == before
    for s, adapter in zip(cleanup_after, adapters, strict=True):
        assert greedy(tp2.url, s.name)[0] == expected_tokens(fixtures, adapter)
    assert cleanup_after.pop().cleanup().status_code == 200
    cleanup_after.append(third)
    assert third.publish()["state"] == "READY_LOCAL"
    assert greedy(tp2.url, third.name)[0] == expected_tokens(fixtures, "C")
