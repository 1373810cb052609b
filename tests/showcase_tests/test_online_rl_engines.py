"""The online RL example, short form, run as the README runs it (``python -m examples.online_rl``
with ``--json``): two CPU engines of its own behind the real smg gateway, a few updates. The
reward must rise above the base model's by a margin, and every invariant must hold. It runs in
the background while the engine tests run (lora_versions_dev.prestart's run lane); the test,
among the last, asserts on what it left."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _example_process import background_run

pytestmark = pytest.mark.engine

TIMEOUT_S = 780  # inside pytest's own 900 s, so the example gets to stop its engines itself
STEPS = 20
# The reward is the share of digit tokens: about 0.04 for the base model. Measured at 10 updates
# over seeds 0..6 (examples/online_rl/README.md): the last three updates' mean batch reward was
# above the base model's by 0.66 to 0.95; the assertion asks for less than half the smallest.
# Engine sampling is not seeded, and the take-off comes at update 5 to 8, or later: a CI run once
# stayed at the base model's reward through 10 updates (its engines served the trainer's policy
# exactly). So the run may go to 20 updates and stops as soon as the last three updates' mean
# batch reward reaches UNTIL_REWARD (at update 8 to 10 in the runs here: no longer than before).
MARGIN = 0.3
UNTIL_REWARD = 0.5


def _command(out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "examples.online_rl", "--steps", str(STEPS)]
    return [*cmd, "--until-reward", str(UNTIL_REWARD), "--json", "--out", str(out)]


online_rl_run = background_run("online_rl_run", _command, TIMEOUT_S)


def test_online_rl_short_form_learns_and_holds_its_invariants(online_rl_run) -> None:
    out, p = online_rl_run
    assert p.stdout.strip(), p.stderr[-3000:]
    report = json.loads(p.stdout)
    failed = [i for i in report["invariants"] if not i["ok"]]
    assert p.returncode == 0 and report["ok"] and not failed, failed or p.stderr[-3000:]
    s = report["summary"]
    assert 3 <= s["updates"] <= STEPS and s["published"] + s["skipped"] == s["updates"]
    # learning: the policy that the last updates sampled scores clearly above the base model
    assert s["reward_last"] >= s["reward_base"] + MARGIN, s
    # the serving mismatch: same weights on both sides, fp32 -> the log-probs agree to ~1e-6
    assert s["mismatch_fresh_max"] is not None and s["mismatch_fresh_max"] < 1e-3, s
    assert s["reclaims"] >= s["updates"] - s["skipped"] - 1  # every replaced version was reclaimed
    assert (out / "report.json").exists() and (out / "online_rl.png").stat().st_size > 10_000
