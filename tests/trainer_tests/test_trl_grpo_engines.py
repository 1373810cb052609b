"""TRL's ``GRPOTrainer`` (trl 1.16.0) against the farm's two real engines through the smg gateway
(issue 28), with the integration of ``relax_glue/trl/`` as ``examples/trl_grpo`` runs it:
3 optimizer steps, one prompt of 4 completions per process and step, 2 assistant turns of 4
tokens around a tool turn.

* One training process, synchronous publication: every completion's turns carried its one
  bound version and the reward functions got it; each step published one new version; every
  retired version was unloaded exactly once per engine, after its last session closed; no pause,
  flush or abort-all; the trainer's log-probabilities equal the engine's on the same weights.
* The README's "Use it from TRL" block, run as written (1 step) with the example's task pieces
  defined around it: it publishes and trains, and closes cleanly.
* Two processes under ``accelerate launch`` (gloo), publication in the background, the
  publication of ``step2`` made to fail on E1 (its bucket corrupted in the real engine client's
  fault wrapper, so E1 refuses it): both ranks record the same typed failure and go on, nothing
  is left half-published, the next step publishes again (capacity recovered), and every other
  check above holds over both ranks' episodes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # examples/ is run from the repository root, not installed
    sys.path.insert(0, str(REPO))

from _e2e_helpers import versions_on  # noqa: E402

from examples.trl_grpo import checks as ck  # noqa: E402
from examples.trl_grpo.train import TrainSpec, launch  # noqa: E402
from lora_versions_dev.farm import ADMIN_KEY  # noqa: E402
from lora_versions_dev.gateway_process import running_gateway  # noqa: E402

# two training processes with torch and the model, a gateway
pytestmark = [pytest.mark.engine, pytest.mark.room(gib=4.0)]

STEPS = 3
TIMEOUT_S = 420.0  # inside pytest's 900 s: the launcher then stops every rank itself
# fp32 on both sides; the example measured a max of 3.3e-6 (the showcase 6.7e-6): well above noise,
# far below a token sampled by other weights (the showcase's policy lag: 0.2-1 nat per token).
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def gateway(engines, run_dir):
    with running_gateway([e.url for e in engines], run_dir / "gateway-trl.log") as gw:
        yield gw


def run_trl(engines: tuple, gateway: Any, fixtures: Any, out: Path, processes: int, **spec: Any) -> dict:
    """Run the training processes; return their reports, the unload counts and what the engines
    still hold of the run's epoch; then remove the epoch from the shared engines."""
    assert not any(asyncio.run(versions_on(engines, "")).values()), "the farm engines must start clean"
    epoch = f"trl{uuid.uuid4().hex[:6]}"
    train = TrainSpec(
        engines={e.name: e.url for e in engines},
        gateway_url=gateway.url,
        admin_key=ADMIN_KEY,
        model_dir=str(fixtures.model_dir),
        out_dir=str(out),
        epoch=epoch,
        steps=STEPS,
        **spec,
    )
    try:
        code, reports = launch(train, processes, TIMEOUT_S)
        assert code == 0 and len(reports) == processes, (code, (out / "train.log").read_text()[-4000:])
        unloads = ck.count_unloads(reports, {e.name: e.log_path for e in engines})
        live = asyncio.run(versions_on(engines, f"@{epoch}-"))
    finally:
        left = asyncio.run(versions_on(engines, f"@{epoch}-", remove=True))
    assert not any(left.values()), left
    return {"reports": reports, "unloads": unloads, "live": live}


def assert_checks(checks: list[ck.Check]) -> None:
    failed = [c for c in checks if not c.ok]
    assert not failed, failed


def test_grpo_trainer_publishes_every_step_and_runs_episodes_on_exact_versions(
    engines, gateway, fixtures, tmp_path
) -> None:
    run = run_trl(engines, gateway, fixtures, tmp_path, processes=1)
    reports, cohort = run["reports"], [e.name for e in engines]
    (main,) = reports
    outcomes = main["outcomes"]
    assert_checks(
        [
            ck.turns_on_one_version(reports),
            ck.rewards_received_versions(reports),
            ck.one_outcome_per_step(outcomes, STEPS, failures={}),
            ck.retired_unloaded_once(reports, run["unloads"], cohort),
            ck.reclaimed_after_last_close(reports),
            ck.no_pause_flush_abort_all(reports),
            ck.only_expected_failed_requests(reports),
            ck.same_weights_logprobs(reports, LOGPROB_TOLERANCE),
        ]
    )
    # synchronous publication: every completion was sampled by the trainer's own weights
    for call in main["rollout_calls"]:
        assert call["version_id"] == [f"step{call['step']}"] * 4, call["version_id"]
        assert all(d is not None for d in call["same_weights_diff"])
    assert [o["kind"] for o in outcomes] == ["PUBLISHED"] * (STEPS + 1)
    last = outcomes[-1]["lora_name"]
    assert run["live"] == {e: [last] for e in cohort}, run["live"]  # only the default is left
    # the completions of one prompt were one session group: one engine served all of them
    for step in range(STEPS):
        served = {t["engine_id"] for c in main["completions"] if c["step"] == step for t in c["turns"]}
        assert len(served) == 1 and served <= set(cohort), (step, served)


def test_two_training_processes_agree_on_every_outcome_and_a_failed_publication_leaks_nothing(
    engines, gateway, fixtures, tmp_path
) -> None:
    run = run_trl(
        engines,
        gateway,
        fixtures,
        tmp_path,
        processes=2,
        background=True,
        max_failures=1,
        fail_version="step2",
        fail_engine="E1",
    )
    reports, cohort = run["reports"], [e.name for e in engines]
    assert sorted(r["rank"] for r in reports) == [0, 1] and all(r["world_size"] == 2 for r in reports)
    outcomes = ck.main_report(reports)["outcomes"]
    assert_checks(
        [
            ck.ranks_agree(reports),
            ck.one_outcome_per_step(outcomes, STEPS, failures={2: "CHECKSUM_MISMATCH"}),
            ck.turns_on_one_version(reports),
            ck.rewards_received_versions(reports),
            ck.retired_unloaded_once(reports, run["unloads"], cohort),
            ck.reclaimed_after_last_close(reports),
            ck.no_pause_flush_abort_all(reports),
            ck.only_expected_failed_requests(reports, ["E1:receive_bucket:refused:CHECKSUM_MISMATCH"]),
            ck.same_weights_logprobs(reports, LOGPROB_TOLERANCE),
        ]
    )
    # both ranks hold the same typed failure of step2, counted once each, and went on
    for r in reports:
        failed = [o for o in r["outcomes"] if o["kind"] == "FAILED"]
        assert [(o["step"], o["code"]) for o in failed] == [(2, "CHECKSUM_MISMATCH")] and r["failures"] == 1
        assert r["error"] is None
    # nothing half-published: the failed version was cleaned up on both engines (its slot
    # freed), and the next step published again
    states = ck.main_report(reports)["registry_states"]
    half = {n: s for n, s in states.items() if s in ("LOADING", "ABORTED", "RECLAIMING")}
    assert not half, half
    assert [s for n, s in states.items() if "-step2-" in n] == ["FAILED_CLEAN"], states
    assert outcomes[3]["kind"] == "PUBLISHED"
    assert run["live"] == {e: [outcomes[3]["lora_name"]] for e in cohort}, run["live"]
    # each process ran its own slice of the rollouts through its own sessions
    by_rank = {r["rank"]: {c["session"] for c in r["completions"]} for r in reports}
    assert all(len(s) == STEPS * 4 for s in by_rank.values()) and not by_rank[0] & by_rank[1]


# What a user's script has before the README's lines: the engines, the gateway, the model, and the
# TRL pieces of the example's task (a 1-step GRPOConfig for CPU).
README_PRELUDE = """
import json, os, sys
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
import torch
torch.set_num_threads(1)
from transformers import AutoTokenizer
from trl import GRPOTrainer
from examples.trl_grpo.task import ToolTurn, digit_reward, grpo_config, lora_config, train_dataset
ENGINES, GATEWAY_URL, ADMIN_KEY, MODEL, OUT = json.loads(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(MODEL)
reward, tool_turn = digit_reward(tokenizer), ToolTurn(tokenizer)
dataset, lora = train_dataset(2), lora_config()
args = grpo_config(OUT, per_device_train_batch_size=4, num_generations=4, max_steps=1, learning_rate=3e-2)
"""
README_EPILOGUE = """
print(json.dumps({"epoch": versions.epoch, "outcomes": [o.kind.value for o in versions.outcomes]}))
"""


def readme_block() -> str:
    """The README's block between its trl markers, as a user copies it."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- trl:begin -->\n```python\n(.*?)```\n<!-- trl:end -->", text, re.S)
    assert m, "no <!-- trl:begin --> python block in README.md"
    return m.group(1)


def test_the_readme_section_runs_as_written(engines, gateway, fixtures, tmp_path) -> None:
    assert not any(asyncio.run(versions_on(engines, "")).values()), "the farm engines must start clean"
    where = [{e.name: e.url for e in engines}, gateway.url, ADMIN_KEY, str(fixtures.model_dir), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = README_PRELUDE + readme_block() + README_EPILOGUE
    try:
        p = subprocess.run(
            [sys.executable, "-c", code, json.dumps(where)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert p.returncode == 0, p.stderr[-4000:]
        done = json.loads(p.stdout.strip().splitlines()[-1])
        assert done["outcomes"] == ["PUBLISHED", "PUBLISHED"], done  # step0, then step1
        live = asyncio.run(versions_on(engines, f"@{done['epoch']}-"))
        assert all(len(names) == 1 and "-step1-" in names[0] for names in live.values()), live
    finally:
        asyncio.run(versions_on(engines, "@trl", remove=True))  # the block's epoch: trl<hex> (the default)
