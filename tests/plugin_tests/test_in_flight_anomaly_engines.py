"""Issue 10 on a real engine: SGLang's native in-flight count driven below zero through the stock
0.5.23 path (the plugin's forged-field guard removed by a wrapper, as if it had a hole): the status
shows the raw negative count, reclaim refuses with IN_FLIGHT_ANOMALY and changes nothing, no
physical unload runs, and the LoRA control plane is not wedged (another version still loads).
Before: the status clamped the count to 0 and reclaim answered DRAINING with 0 in flight forever."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
from _engine_helpers import Published, error_code, generate, reclaim, snapshot_of, unload_log_count, versions

from lora_versions_dev import prestart
from lora_versions_dev.launcher import EngineSpec, spawn_engine

pytestmark = pytest.mark.engine

WRAPPER = Path(__file__).parents[1] / "engine_wrappers" / "sglang_without_forged_field_guard.py"


@prestart.prestartable("unguarded_engine")
def _spawn_unguarded(fixtures, run_dir):
    spec = EngineSpec(
        name="unguarded",
        model_path=fixtures.model_dir,
        log_path=run_dir / "unguarded.log",
        command_prefix=[sys.executable, str(WRAPPER)],
    )
    return spawn_engine(spec)


@pytest.fixture(scope="module")
def unguarded_engine(fixtures, run_dir, prestarts):
    with prestart.serving(prestarts, "unguarded_engine", fixtures, run_dir) as engine:
        yield engine


def test_a_negative_native_count_is_visible_and_never_unloaded_on_a_guess(unguarded_engine, fixtures):
    url = unguarded_engine.url
    a = Published(unguarded_engine, snapshot_of(fixtures.adapter_dir("A")))
    assert versions(url)[a.name]["in_flight"] == 0
    # The stock hole: an unknown adapter plus the victim's lora_id. Resolution fails, and the
    # failure path releases the victim's counter that this request never acquired.
    r = generate(url, [302, 356, 417], "no-such-adapter", max_new_tokens=1, lora_id=a.lora_id)
    assert r.status_code == 400, r.text
    assert versions(url)[a.name]["in_flight"] == -1  # raw, never clamped

    r = reclaim(url, a.name, uuid.uuid4().hex, timeout_s=1.0)
    assert r.status_code == 409 and error_code(r) == "IN_FLIGHT_ANOMALY", r.text
    after = versions(url)[a.name]
    assert after["state"] == "READY_LOCAL" and after["in_flight"] == -1  # nothing changed
    assert unload_log_count(unguarded_engine, a.lora_id) == 0  # nothing unloaded on a guess
    ok = generate(url, [302, 356, 417], a.name, max_new_tokens=2)
    assert ok.status_code == 200, ok.text  # still served exactly (the count is only a count)
    # The LoRA control plane is not wedged: no unload waits forever under lora_update_lock.
    b = Published(unguarded_engine, snapshot_of(fixtures.adapter_dir("B")))
    assert versions(url)[b.name]["state"] == "READY_LOCAL"
    b.finish()
