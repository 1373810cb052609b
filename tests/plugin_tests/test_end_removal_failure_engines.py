"""Issue 36 on a real engine: an ``end`` whose exact-version probe fails and whose removal of what
it loaded fails too. The refusal is the one 4xx after which the version is not as it was
(docs/serving.md): it says so (LOAD_FAILED with state FAILED and the leftover id), SGLang still
holds the adapter (no unload ran) and never serves it, every repeat of the end answers the same
and changes nothing, and only the attempt's cleanup removes it, with exactly one unload.

Both faults are injected into the plugin's real native edge inside the shared engine E1, each for
the one call a trigger file marks (tests/engine_wrappers/removal_faults.py, installed by E1's
wrapper and off until a test marks a call): no engine of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _engine_helpers import (
    Staged,
    error_code,
    generate,
    loaded_lora_ids,
    snapshot_of,
    unload_log_count,
    unload_log_count_after,
    versions,
    visible_state,
)

from lora_versions_dev.farm import PROMPT, local_source_dir

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).parents[1] / "engine_wrappers"))
from removal_faults import FAIL_NEXT_PROBE, FAIL_NEXT_UNLOAD, trigger_path  # noqa: E402


def test_an_end_whose_removal_fails_says_failed_and_only_its_cleanup_frees_it(engines, fixtures, run_dir):
    engine = engines[1]
    url = engine.url
    triggers = [trigger_path(local_source_dir(run_dir), f) for f in (FAIL_NEXT_PROBE, FAIL_NEXT_UNLOAD)]
    s = Staged(url, snapshot_of(fixtures.adapter_dir("A")))
    assert s.begin().status_code == 200
    for b in s.buckets():
        assert s.send_bucket(b).status_code == 200
    for t in triggers:
        t.touch()

    try:
        r = s.end()
    finally:
        taken = [t for t in triggers if not t.exists()]
        for t in triggers:
            t.unlink(missing_ok=True)  # a fault left untaken must not hit a later test on E1
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "LOAD_FAILED" and error["state"] == "FAILED", error
    assert taken == triggers, "both faults were taken, by the real calls"
    leftover = error["leftover_lora_id"]
    v = versions(url)[s.name]
    assert v["state"] == "FAILED" and v["lora_id"] == leftover and v["pinned"], v
    assert loaded_lora_ids(engine, s.name) == [leftover]  # SGLang loaded it once ...
    assert unload_log_count(engine, leftover) == 0  # ... and still holds it
    served = generate(url, PROMPT, s.name, max_new_tokens=2)
    assert served.status_code == 404 and error_code(served) == "UNKNOWN_VERSION", served.text

    before = visible_state(url)
    again = s.end()
    assert again.status_code == 422 and again.json()["error"] == error, again.text
    assert visible_state(url) == before and unload_log_count(engine, leftover) == 0

    cleaned = s.cleanup()
    assert cleaned.status_code == 200 and cleaned.json()["state"] == "CLEANED", cleaned.text
    assert unload_log_count_after(engine, leftover) == 1
    assert versions(url)[s.name]["state"] == "CLEANED"
