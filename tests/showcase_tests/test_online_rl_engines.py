"""The online RL example, short form, run as the README runs it (``python -m examples.online_rl``
with ``--json``): two CPU engines of its own behind the real smg gateway, a few updates. The
reward must rise above the base model's by a margin, and every invariant must hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 780  # inside pytest's own 900 s, so the example gets to stop its engines itself
STEPS = 10
# The reward is the share of digit tokens: about 0.04 for the base model. Measured at 10 updates
# over seeds 0..6 (examples/online_rl/README.md): the last three updates' mean batch reward was
# above the base model's by 0.66 to 0.95; the assertion asks for less than half the smallest.
MARGIN = 0.3


def test_online_rl_short_form_learns_and_holds_its_invariants(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.online_rl", "--steps", str(STEPS), "--json", "--out", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the example stops its engines and gateway on the way out
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"the short form ran over {TIMEOUT_S}s:\n{err[-3000:]}")
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert p.stdout.strip(), p.stderr[-3000:]
    report = json.loads(p.stdout)
    failed = [i for i in report["invariants"] if not i["ok"]]
    assert p.returncode == 0 and report["ok"] and not failed, failed or p.stderr[-3000:]
    s = report["summary"]
    assert s["updates"] == STEPS and s["published"] + s["skipped"] == STEPS
    # learning: the policy that the last updates sampled scores clearly above the base model
    assert s["reward_last"] >= s["reward_base"] + MARGIN, s
    # the serving mismatch: same weights on both sides, fp32 -> the log-probs agree to ~1e-6
    assert s["mismatch_fresh_max"] is not None and s["mismatch_fresh_max"] < 1e-3, s
    assert s["reclaims"] >= STEPS - s["skipped"] - 1  # every replaced version was reclaimed
    assert (tmp_path / "report.json").exists() and (tmp_path / "online_rl.png").stat().st_size > 10_000
