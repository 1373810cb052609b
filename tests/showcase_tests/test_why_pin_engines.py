"""The why-pin study's short form (``bench/why_pin.py --short``, issue 40) as CI runs it: every
cell (pinned or per-turn rollout x no correction, truncated importance ratio over the engine's
log-probabilities or over the labelled version's, TRL's clipped surrogate), one seed, two
updates, on two CPU engines of its own behind smg. The study's figures come from real runs:
pinned episodes never span versions (the engine's attestation says so), per-turn episodes do,
every run holds the showcase's invariants, the plot is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _example_process import run_to_the_end

pytestmark = pytest.mark.engine

TIMEOUT_S = 600
CELLS = {f"{r}/{c}" for r in ("pinned", "per-turn") for c in ("tis", "trl", "none", "tis-label")}


def test_the_why_pin_short_form_runs_every_cell_and_only_per_turn_episodes_span_versions(
    tmp_path: Path,
) -> None:
    cmd = [
        sys.executable,
        "bench/why_pin.py",
        "--short",
        "--out",
        str(tmp_path),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    p = run_to_the_end(cmd, TIMEOUT_S, merge_stderr=True)
    out = p.stdout
    assert p.returncode == 0, out[-4000:]
    doc = json.loads((tmp_path / "why_pin.json").read_text())
    assert doc["ok"] and set(doc["cells"]) == CELLS, out[-3000:]
    assert (tmp_path / "why_pin.png").stat().st_size > 10_000
    for run in doc["runs"]:
        s = run["summary"]
        assert run["ok"], run["failed_invariants"]
        assert len(s["batch_rewards"]) == 2 and s["episodes_by_fate"].get("used", 0) >= 32
        if run["cell"].startswith("pinned/"):
            # exactly zero: every token of every episode attested as served by its one binding
            assert s["multi_version_share"] == 0.0 and s["switched_tokens"] == 0, s
            assert s["assumed_gap_mean"] < 1e-3, s  # the serving mismatch, nothing more
        else:
            # the study's episodes span a publication about 60% of the time (short runs here)
            assert s["multi_version_share"] > 0.1 and s["switched_tokens"] > 0, s
            assert s["switched_gap_mean"] > 1e-2, s  # another version's log-probabilities
