"""The main job, run as the README runs it (``lora-versions-dev demo``, here with ``--json``): two
CPU engines of its own behind the real smg gateway, the whole lifecycle, every check held.

The demo's own ``ok`` is not enough: a check (or a step) the demo silently dropped would leave it
true. So the test pins the exact set of checks, by stable name and step, that README's "What the
main job shows" promises, and re-derives the key figures from what the run left behind: the
engines' own logs (one physical unload of A per engine, no pause / flush endpoint ever served)
and an independent HF transformers + PEFT reference of every turn.

The demo runs in the background while the engine tests run (lora_versions_dev.prestart's run
lane); the test, among the last, asserts on what it left.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _example_process import background_run

pytestmark = pytest.mark.engine

# check name -> the step that must run it (README, "What the main job shows")
EXPECTED_CHECKS: dict[str, int] = {
    # 1: A bootstrapped through the staged protocol; a session generating before the commit
    "refused_before_commit": 1,
    "a_committed": 1,
    "a_staged_in_order": 1,
    # 2: sessions bind A at their first generation, on both engines
    "a_bound_at_first_generation": 2,
    "a_sessions_bound_to_a": 2,
    "a_sessions_on_every_engine": 2,
    # 3: B published while the A sessions keep streaming
    "b_committed": 3,
    "no_a_request_failed_during_b": 3,
    "decoded_during_b": 3,
    "a_sessions_stayed_on_a": 3,
    # 4: new sessions bind B, the old ones stay on A
    "new_sessions_bound_to_b": 4,
    "old_sessions_still_on_a": 4,
    # 5: C refused with CAPACITY_ERROR before any engine sees it
    "c_refused_capacity": 5,
    "c_unseen_by_engines": 5,
    # 6: the A sessions close
    "a_sessions_released_once": 6,
    "a_refs_zero": 6,
    # 7: A reclaimed, one physical unload per engine, a late A request refused
    "a_reclaimed": 7,
    "a_unloaded_once_per_engine": 7,
    "late_a_refused": 7,
    # 8: C published
    "c_committed_default": 8,
    "c_session_bound_b_kept": 8,
    # 9: over the whole run
    "turns_equal_reference": 9,
    "gateway_sticky": 9,
    "gateway_kv_cache_hits": 9,
    "no_pause_flush_abort_all": 9,
    "no_generation_failed": 9,
}
COHORT = ("E0", "E1")


def _command(out: Path) -> list[str]:
    return [sys.executable, "-m", "lora_versions_dev.cli", "demo", "--json", "--out", str(out)]


demo_run = background_run("demo_run", _command, 840)


def test_the_demo_runs_the_whole_lifecycle_through_the_gateway(demo_run) -> None:
    out, p = demo_run
    assert p.stdout.strip(), p.stderr[-3000:]
    report = json.loads(p.stdout)
    names = [c["name"] for c in report["checks"]]
    assert len(names) == len(set(names)), names
    assert {c["name"]: c["step"] for c in report["checks"]} == EXPECTED_CHECKS
    failed = [c for c in report["checks"] if not c["ok"]]
    assert p.returncode == 0 and report["ok"] and not failed, failed or p.stderr[-3000:]
    assert len(report["steps"]) == max(EXPECTED_CHECKS.values())
    checks = {c["name"]: c for c in report["checks"]}

    assert report["gateway"].startswith("http://127.0.0.1:")
    assert "gateway smg 1.13.0" in p.stderr and "--disable-retries" in p.stderr
    gateway = next(s["gateway"] for s in report["steps"] if "gateway" in s)
    assert gateway["cache_hit_rate_later_turns"] >= 0.5
    assert (out / "demo.json").exists() and (out / "gateway.log").exists()

    logs = {e: Path(report["engines"][e]["log"]).read_text(errors="replace") for e in COHORT}
    assert_staged_and_bound(checks)
    assert_published_while_streaming(report["steps"][2])
    assert_c_refused_unseen(checks, report["steps"][4])
    assert_a_unloaded_once_per_engine(report["steps"][6], logs)
    assert checks["late_a_refused"]["detail"]["code"] == "VERSION_RECLAIMED"
    assert_turns_equal_reference(report, checks)
    assert_no_forbidden_endpoint_served(checks, logs)


def assert_staged_and_bound(checks: dict[str, Any]) -> None:
    staged = checks["a_staged_in_order"]["detail"]
    assert set(staged) == set(COHORT), staged
    # begin + at least two buckets + end, in order, and the version loaded on each engine
    assert all(s["in_order"] and s["calls"] >= 4 and s["state"] == "READY_LOCAL" for s in staged.values())
    bound = checks["a_bound_at_first_generation"]["detail"]
    assert bound["unbound_at_open"] == 4 and bound["a_refs_at_open"] == 0 and bound["a_refs_after"] >= 4


def assert_published_while_streaming(step3: dict[str, Any]) -> None:
    decode = step3["decode"]
    assert set(decode["tokens_during_publication"]) == set(COHORT)
    assert all(n > 0 for n in decode["tokens_during_publication"].values()), decode
    assert decode["publication_ms"] > 0 and decode["max_gap_during_publication_ms"] > 0, decode
    assert [r["outcome"] for r in step3["publish"]] == ["PUBLISHED"]


def assert_c_refused_unseen(checks: dict[str, Any], step5: dict[str, Any]) -> None:
    assert [(r["version"], r["error"]) for r in step5["publish"]] == [("C", "CAPACITY_ERROR")]
    unseen = checks["c_unseen_by_engines"]["detail"]
    assert unseen["control_calls_before"] == unseen["control_calls_after"] > 0, unseen
    assert unseen["calls_naming_c"] == 0 and unseen["engines_holding_c"] == [], unseen
    assert all("C" not in row for row in step5["engines"]), step5["engines"]


def assert_a_unloaded_once_per_engine(step7: dict[str, Any], logs: dict[str, str]) -> None:
    """Counted here from each engine's own log (SGLang's scheduler line per physical unload of
    one engine-local lora_id), not taken from the demo's count."""
    from lora_versions_dev.engine_log import UNLOAD_LOG_LINE

    rows = {r["engine"]: r for r in step7["reclaim"]}
    assert set(rows) == set(COHORT), rows
    for engine, row in rows.items():
        lora_id = str(row["engine-local lora_id"])
        assert lora_id, row
        lines = [ln for ln in logs[engine].splitlines() if UNLOAD_LOG_LINE in ln and lora_id in ln]
        assert len(lines) == 1, (engine, lora_id, lines)


def assert_turns_equal_reference(report: dict[str, Any], checks: dict[str, Any]) -> None:
    """Every turn, recomputed here with HF transformers + PEFT (fp32) from its full prefix under
    the adapter its lora_path names."""
    from lora_versions_dev.fixtures import ensure_fixtures
    from lora_versions_dev.reference import greedy_tokens

    fx = ensure_fixtures()
    adapter_of = {name: adapter for adapter, name in report["lora_names"].items()}
    turns = report["turns"]
    assert {adapter_of[t["lora_path"]] for t in turns} == {"A", "B", "C"}
    wrong = []
    for t in turns:
        adapter = adapter_of[t["lora_path"]]
        assert t["adapter"] == adapter, t
        ref = greedy_tokens(fx.model_dir, fx.adapter_dir(adapter), t["prefix"], len(t["tokens"]))
        if ref != t["tokens"] or not t["tokens"]:
            wrong.append((t["session"], adapter, t["tokens"], ref))
    assert not wrong, wrong[:3]
    assert checks["turns_equal_reference"]["detail"]["turns"] == len(turns)


def assert_no_forbidden_endpoint_served(checks: dict[str, Any], logs: dict[str, str]) -> None:
    """The engines' HTTP access logs see every caller (the gateway included): none of them ever
    hit pause / flush / memory release. The logs must show the requests that were served, or
    this would see nothing."""
    from relax_glue.engine_client import FORBIDDEN_PATHS

    for engine, text in logs.items():
        assert '"POST /generate HTTP' in text, f"{engine}: no access lines in its log"
        served = [path for path in FORBIDDEN_PATHS if f" {path} HTTP" in text or f" {path}?" in text]
        assert not served, (engine, served)
    detail = checks["no_pause_flush_abort_all"]["detail"]
    assert detail["audited"] == [] and detail["engine_logs"] == {e: {} for e in COHORT}, detail
