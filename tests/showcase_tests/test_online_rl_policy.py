"""The online RL example's functional core, without engines: the reward, the group baseline,
the staleness / backpressure policy and the invariants over a recorded run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # examples/ is run from the repository root, not installed
    sys.path.insert(0, str(REPO))

from examples.online_rl import report as rp  # noqa: E402
from examples.online_rl.config import RunConfig  # noqa: E402
from examples.online_rl.policy import Decision, PublishDecision, StalenessPolicy  # noqa: E402
from examples.online_rl.reward import digit_token_ids, episode_reward, is_digit_text  # noqa: E402
from examples.online_rl.rollout import Episode, Turn  # noqa: E402
from examples.online_rl.task import prompt_of, tool_latency  # noqa: E402
from examples.online_rl.trainer import StepStats, group_advantages  # noqa: E402
from relax_glue.step_publisher import PUBLISHED, PublicationRecord, ReclaimRecord  # noqa: E402

# ------------------------------------------------------------------------------ reward


def test_digit_tokens_are_digits_and_spaces_only() -> None:
    assert is_digit_text("7") and is_digit_text(" 42") and is_digit_text("04")
    assert (
        not is_digit_text("")
        and not is_digit_text(" ")
        and not is_digit_text("a1")
        and not is_digit_text("1.")
    )
    texts = {0: "1", 1: " 2", 2: "x", 3: "", 4: "<|im_end|>", 5: "10"}
    assert digit_token_ids(lambda i: texts.get(i, ""), 8) == frozenset({0, 1, 5})


def test_the_reward_is_the_share_of_digit_tokens_over_every_assistant_turn() -> None:
    targets = frozenset({1, 2})
    assert episode_reward([[1, 9, 9, 9], [2, 2, 9, 9]], targets) == 3 / 8
    assert episode_reward([[1, 2], [1, 2]], targets) == 1.0
    assert episode_reward([], targets) == 0.0


def test_prompts_rotate_and_tool_latencies_are_seeded_per_episode() -> None:
    assert [prompt_of(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    cfg = RunConfig(seed=3)
    draws = [tool_latency(cfg, i) for i in range(400)]
    assert draws == [tool_latency(cfg, i) for i in range(400)]  # the same schedule, run after run
    assert draws != [tool_latency(dataclasses.replace(cfg, seed=4), i) for i in range(400)]
    slow = [d for d in draws if d >= cfg.slow_tool_latency_s[0]]
    assert 0.04 < len(slow) / len(draws) < 0.2  # about slow_tool_p of the calls straggle
    assert all(cfg.tool_latency_s[0] <= d <= cfg.slow_tool_latency_s[1] for d in draws)


# ---------------------------------------------------------------------- group baseline


def test_group_advantages_center_and_scale_within_each_prompt() -> None:
    adv = group_advantages([1.0, 0.0, 0.5, 0.5, 0.2], ["a", "a", "b", "b", "c"])
    assert adv[0] == pytest.approx(0.7071, abs=1e-3) and adv[1] == pytest.approx(-0.7071, abs=1e-3)
    assert adv[2:] == [0.0, 0.0, 0.0]  # a flat group and a singleton teach nothing


# ------------------------------------------------------------------------------ policy


def test_admission_drops_episodes_staler_than_the_bound() -> None:
    p = StalenessPolicy(max_staleness=2)
    assert [p.admits(5, v) for v in (5, 4, 3, 2)] == [True, True, True, False]
    assert not p.admits(5, 6)  # a version newer than the trainer cannot exist


def test_capacity_error_retries_then_skips_while_the_lag_allows_then_waits() -> None:
    p = StalenessPolicy(max_staleness=2, reclaim_wait_s=1.0, forced_wait_s=30.0)
    # within the reclaim wait: wait for a reclaim (what is left of the wait), then try again
    assert p.on_capacity_error(step=7, last_published=6, waited_s=0.25) == Decision(
        PublishDecision.RETRY, 0.75
    )
    # the wait ran out and the engines would be one step behind: skip this publication
    assert p.on_capacity_error(step=7, last_published=6, waited_s=1.0) == Decision(PublishDecision.SKIP)
    # one skip already: skipping again would put the engines two steps behind: wait instead
    assert p.on_capacity_error(step=8, last_published=6, waited_s=5.0) == Decision(
        PublishDecision.RETRY, 25.0
    )
    assert p.on_capacity_error(step=8, last_published=6, waited_s=30.0) == Decision(PublishDecision.FAIL)
    # a looser bound allows a longer run of skips
    loose = StalenessPolicy(max_staleness=3, reclaim_wait_s=1.0)
    assert loose.on_capacity_error(step=8, last_published=6, waited_s=1.0).action is PublishDecision.SKIP


# -------------------------------------------------------------------------- invariants


def _episode(
    index: int, lora: str, version: int, *, staleness: int = 0, paths: tuple[str, str] | None = None
) -> Episode:
    ep = Episode(index, 0, 0, f"s{index}", 0.05, 0.0, [1, 2], [3])
    for i, path in enumerate(paths or (lora, lora)):
        turn = Turn(f"r{index}.{i}", path, "E0", "ok", 2, [5, 6], [-1.0, -1.0], 0, 0.0, 0.1, [lora, lora])
        ep.turns.append(dataclasses.replace(turn, bound_lora=lora))
    ep.bound_lora, ep.bind_calls, ep.released, ep.version = lora, 1, True, version
    ep.sessions = 1
    ep.fate, ep.trainer_step, ep.staleness = "used", version + staleness, staleness
    return ep


def _stats(step: int) -> StepStats:
    return StepStats(step, 0.0, 0.5, 2, 8, 1.0, 8, 1e-6, 2e-6, 0, None, None, 0.1)


def _record(**changes: object) -> rp.RunRecord:
    v0, v1 = "lora@e-step0-aa", "lora@e-step1-bb"
    unloaded = {"E0": "UNLOADED", "E1": "UNLOADED"}
    rec = rp.RunRecord(
        config={"workers": 1, "seed": 0},
        capacity=2,
        cohort=["E0", "E1"],
        episodes=[_episode(0, v0, 0), _episode(1, v0, 0, staleness=1), _episode(2, v1, 1)],
        steps=[rp.StepRecord(_stats(1), 0.0, 1.0, 2, 0, [0, 1], {0: 2}, 1)],
        publications=[
            PublicationRecord(0, "step0", v0, PUBLISHED, 1, (), 0.0, 0, 0.0, 0.1, 0.1),
            PublicationRecord(1, "step1", v1, PUBLISHED, 3, ("CAPACITY_ERROR",) * 2, 0.4, 0, 0.9, 1.4, 0.1),
        ],
        reclaims=[ReclaimRecord(0, "step0", v0, "episode closed", True, unloaded, 2.0, 2.1)],
        slots=[rp.SlotSample(0.0, 1, {"E0": 1, "E1": 1}), rp.SlotSample(1.0, 2, {"E0": 2, "E1": 2})],
        versions={v0: 0, v1: 1},
        final_states={v0: "RECLAIMED", v1: "PUBLISHED"},
        unloads={v0: {"E0": 1, "E1": 1}, v1: {"E0": 0, "E1": 0}},
        failed_requests=[],
        forbidden_calls=[],
        sessions_left=0,
        max_staleness=2,
    )
    return dataclasses.replace(rec, **changes)  # type: ignore[arg-type]


def _failed(rec: rp.RunRecord) -> list[str]:
    return [i.name for i in rp.check_invariants(rec) if not i.ok]


def test_a_clean_run_holds_every_invariant() -> None:
    assert _failed(_record()) == []
    summary = rp.summarize(_record())
    assert summary["capacity_refusals"] == 2 and summary["published_after_waiting"] == 1
    assert summary["reclaims"] == 1 and summary["staleness_max_used"] == 1


@pytest.mark.parametrize(
    ("change", "broken"),
    [
        # a later turn on another version than the one bound
        (
            lambda r: r.episodes.append(
                _episode(3, "lora@e-step1-bb", 1, paths=("lora@e-step1-bb", "lora@e-step0-aa"))
            ),
            "every turn of every episode",
        ),
        (
            lambda r: r.failed_requests.append({"op": "generate", "outcome": "refused:VERSION_RECLAIMED"}),
            "no request failed",
        ),
        (
            lambda r: r.publications.__setitem__(
                1, dataclasses.replace(r.publications[1], refusals=(*r.publications[1].refusals, "CONFLICT"))
            ),
            "no request failed",
        ),
        (lambda r: r.forbidden_calls.append({"path": "/pause_generation"}), "no pause"),
        (lambda r: r.unloads["lora@e-step0-aa"].update(E1=2), "unloaded exactly once"),
        (lambda r: r.unloads["lora@e-step1-bb"].update(E0=1), "unloaded exactly once"),
        (lambda r: r.slots.append(rp.SlotSample(2.0, 2, {"E0": 3, "E1": 2})), "versions held slots"),
        (lambda r: setattr(r.episodes[1], "staleness", 3), "staleness bounded"),
        # a retired version left loaded (never reclaimed, so never unloaded)
        (
            lambda r: (
                r.final_states.update({"lora@e-step0-aa": "RETIRED"}),
                r.unloads["lora@e-step0-aa"].update(E0=0, E1=0),
            ),
            "reclaim kept up",
        ),
        (lambda r: setattr(r.episodes[0], "released", False), "closed and released"),
    ],
)
def test_each_invariant_catches_its_violation(change, broken: str) -> None:
    rec = _record()
    change(rec)
    failed = _failed(rec)
    assert failed and all(broken in name for name in failed), failed


def test_the_report_renders_from_a_record(tmp_path: Path) -> None:
    import json

    rec = _record()
    doc = rp.to_json(rec, rp.check_invariants(rec))
    assert doc["ok"] and json.loads(json.dumps(doc, default=str))["summary"]["published"] == 1
    assert rp.step_header().split()[0] == "step"
    line = rp.step_line(rp.step_row(rec.steps[0], rec.publications[1]))
    assert "step1 PUBLISHED after 2x CAPACITY_ERROR" in line
    rp.plot(rec, tmp_path / "online_rl.png")
    assert (tmp_path / "online_rl.png").stat().st_size > 10_000


def test_the_truncated_importance_ratio_is_the_probability_ratio_capped_and_detached() -> None:
    import torch

    from examples.online_rl.trainer import truncated_ratio

    logp = torch.tensor([-1.0, -1.0, -0.5, -3.0], requires_grad=True)
    behaviour = torch.tensor([-1.0, -1.5, -3.0, -2.0])  # same, likelier now, far likelier, less likely
    w = truncated_ratio(logp.detach(), behaviour, 2.0)
    expected = [1.0, float(torch.exp(torch.tensor(0.5))), 2.0, float(torch.exp(torch.tensor(-1.0)))]
    assert w.tolist() == pytest.approx(expected)
    assert not w.requires_grad


def test_the_run_config_keeps_capacity_and_correction_in_range() -> None:
    assert (RunConfig().capacity, RunConfig().max_staleness, RunConfig().correction) == (3, 2, "tis")
    for bad in ({"capacity": 1}, {"capacity": 5}, {"correction": "ppo"}, {"tis_cap": 0.5}):
        with pytest.raises(ValueError):
            RunConfig(**bad)


def test_the_target_reward_stop_reads_the_same_window_as_reward_last() -> None:
    assert not rp.target_reached([0.9, 0.9], 0.5)  # fewer updates than the window
    assert not rp.target_reached([0.04, 0.05, 0.9, 0.3, 0.2], 0.5)  # last three: 0.47
    assert rp.target_reached([0.04, 0.9, 0.3, 0.3], 0.5)  # last three: 0.5
    assert not rp.target_reached([1.0] * 5, None)  # no target: every step runs
    with pytest.raises(ValueError):
        RunConfig(until_reward=1.5)
