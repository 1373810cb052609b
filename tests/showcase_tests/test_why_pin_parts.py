"""The parts of the why-pin study (issue 40) that need no engine: the per-turn rollout's
invariants, TRL's clipped surrogate, the summary's figures, the study's aggregation, and the
trainer's measure of what an episode's assumed version gives its tokens (on the fixture model)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # examples/ and bench/ are run from the repository root
    sys.path.insert(0, str(REPO))

from examples.online_rl import report as rp  # noqa: E402
from examples.online_rl.config import RunConfig  # noqa: E402
from examples.online_rl.rollout import Episode, Turn  # noqa: E402
from examples.online_rl.trainer import Sample, trl_clipped_loss  # noqa: E402
from relax_glue.step_publisher import PUBLISHED, SKIPPED, PublicationRecord  # noqa: E402

V0, V1 = "lora@e-step0-aa", "lora@e-step1-bb"


def _episode(bindings: list[str], *, sessions: int, served: list[str] | None = None) -> Episode:
    ep = Episode(0, 0, 0, "k", 0.1, 1.0, [1, 2], [3])
    for i, (bound, ran) in enumerate(zip(bindings, served or bindings, strict=True)):
        turn = Turn(f"r{i}", bound, "E0", "ok", 2, [5, 6], [-1.0, -1.0], 0, 0.0, 0.1, [ran, ran], bound)
        ep.turns.append(turn)
    ep.bound_lora, ep.sessions, ep.bind_calls, ep.released = bindings[0], sessions, sessions, True
    ep.t_end = 5.0
    return ep


def test_a_per_turn_episode_may_span_versions_a_pinned_one_may_not() -> None:
    spanning = _episode([V0, V1], sessions=2)
    assert spanning.versions == [V0, V1]
    assert rp._episode_problems(spanning, "per-turn", 2) == []
    assert rp._episode_problems(spanning, "pinned", 2)  # one session per episode, one binding
    assert rp._episode_problems(_episode([V0, V0], sessions=1), "pinned", 2) == []
    # per-turn still needs a session (and one bind) per turn
    assert rp._episode_problems(_episode([V0, V1], sessions=1), "per-turn", 2)


def test_a_per_turn_turn_attested_as_another_version_than_its_session_bound_is_caught() -> None:
    ep = _episode([V0, V1], sessions=2, served=[V0, V0])
    assert any("attested" in p for p in rp._episode_problems(ep, "per-turn", 2))


def test_trl_clipped_surrogate_matches_the_formula_and_cuts_the_gradient_where_clipped() -> None:
    torch = pytest.importorskip("torch")
    behaviour = torch.log(torch.tensor([1.0, 1.0, 1.0]))
    ratios = torch.tensor([1.5, 0.5, 1.1])
    for adv, want_loss, want_clipped in (
        (1.0, [-1.2, -0.5, -1.1], [True, False, False]),
        (-1.0, [1.5, 0.8, 1.1], [False, True, False]),
    ):
        logp = torch.log(ratios.clone()).requires_grad_(True)
        loss, clipped = trl_clipped_loss(logp, behaviour, adv, 0.2)
        assert loss.tolist() == pytest.approx(want_loss)
        assert clipped.tolist() == want_clipped
        loss.sum().backward()
        # d/dlogp of -r A where not clipped (= -r A), 0 where the clip binds
        want_grad = [0.0 if c else -r * adv for c, r in zip(want_clipped, ratios.tolist(), strict=True)]
        assert logp.grad.tolist() == pytest.approx(want_grad)


def test_updates_to_target_and_publications_inside_an_episode() -> None:
    assert rp.updates_to_target([0.1, 0.2, 0.6, 0.7, 0.8], 0.5) == 4
    assert rp.updates_to_target([0.1, 0.9], 0.5) is None  # fewer updates than the window
    assert rp.updates_to_target([0.1, 0.2, 0.3, 0.2], 0.5) is None

    def pub(t_end: float, outcome: str = PUBLISHED) -> PublicationRecord:
        return PublicationRecord(1, "step1", V1, outcome, 1, (), 0.0, 0, t_end - 0.1, t_end)

    ep = _episode([V0, V0], sessions=1)  # runs from 1.0 to 5.0
    assert rp.spans_a_publication(ep, [pub(3.0)])
    assert not rp.spans_a_publication(ep, [pub(6.0), pub(0.5)])
    assert not rp.spans_a_publication(ep, [pub(3.0, SKIPPED)])  # nothing committed


def _why_pin():
    spec = importlib.util.spec_from_file_location("why_pin", REPO / "bench" / "why_pin.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["why_pin"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_study_aggregates_each_cell_over_its_seeds() -> None:
    wp = _why_pin()
    assert wp.cell_config("per-turn/trl", 3, 7).rollout == "per-turn"
    assert wp.cell_config("per-turn/trl", 3, 7).correction == "trl"
    assert wp.tag_of("per-turn/trl", 3) == "pertrl3."  # a valid version id and session prefix

    def run(cell: str, seed: int, rewards: list[float], multi: float) -> object:
        summary = {f: None for f in wp.FIGURES} | {
            "batch_rewards": rewards,
            "multi_version_share": multi,
            "updates_to_target": rp.updates_to_target(rewards, wp.TARGET),
        }
        return wp.RunResult(cell, seed, True, [], summary)

    agg = wp.aggregate(
        [
            run("pinned/tis", 0, [0.1, 0.3], 0.0),
            run("pinned/tis", 1, [0.3, 0.5], 0.0),
            run("per-turn/tis", 0, [0.2], 0.6),
        ],
        steps=2,
    )
    pinned = agg["pinned/tis"]
    assert pinned["reward_curve"][0]["mean"] == pytest.approx(0.2)
    assert pinned["reward_curve"][1]["sd"] == pytest.approx(math.sqrt(0.02))
    assert pinned["multi_version_share"] == {"mean": 0.0, "sd": 0.0, "n": 2}
    assert agg["per-turn/tis"]["reward_curve"][1] == {"mean": None, "sd": None, "n": 0}  # stopped early
    assert len(wp.summary_rows(agg)) == 2


def test_the_contrast_is_per_turn_minus_pinned_with_an_interval_that_holds_the_difference() -> None:
    wp = _why_pin()

    def run(cell: str, seed: int, last: float) -> object:
        return wp.RunResult(cell, seed, True, [], {"reward_last": last, "batch_rewards": [last, last]})

    runs = [run("pinned/tis", s, x) for s, x in enumerate((0.2, 0.4, 0.3))]
    runs += [run("per-turn/tis", s, x) for s, x in enumerate((0.6, 0.8, 0.7))]
    runs += [run("pinned/trl", 0, 0.5)]  # no per-turn/trl: no contrast for trl
    con = wp.contrasts(runs, resamples=500)
    assert set(con) == {"tis"}
    last = con["tis"]["reward_last"]
    assert last["diff"] == pytest.approx(0.4) and last["seeds"] == (3, 3)
    lo, hi = last["ci95"]
    assert 0.2 <= lo <= 0.4 <= hi <= 0.6
    assert con == wp.contrasts(runs, resamples=500)  # a fixed RNG: the same runs, the same interval
    assert wp.markdown(["a", "b"], [[1, 2]]) == "| a | b |\n| --- | --- |\n| 1 | 2 |\n"


def test_the_study_summarizes_runs_already_made_from_their_reports(tmp_path: Path) -> None:
    import json

    wp = _why_pin()
    runs = tmp_path / "run" / "runs"
    runs.mkdir(parents=True)
    for name, rollout, seed, ok in (
        ("a", "per-turn", 1, True),
        ("b", "pinned", 0, False),
        ("c", "pinned", 1, True),
    ):
        doc = {
            "config": {"rollout": rollout, "correction": "tis", "seed": seed},
            "invariants": [{"name": "the run finished", "ok": ok}],
            "summary": {"batch_rewards": [0.1, 0.2]},
        }
        (runs / f"{name}.json").write_text(json.dumps(doc))
    got = wp.load_runs([tmp_path / "run"], ["pinned/tis", "per-turn/tis"])
    assert [(r.cell, r.seed, r.ok) for r in got] == [
        ("pinned/tis", 0, False),
        ("pinned/tis", 1, True),
        ("per-turn/tis", 1, True),
    ]
    assert got[0].failed_invariants == ["the run finished"]
    assert wp.load_runs([tmp_path / "run"], ["per-turn/trl"]) == []


def test_the_trainer_measures_the_gap_between_the_assumed_version_and_what_served(fixtures) -> None:
    """After one update, tokens whose engine log-probabilities are W_0's: taken for W_0 they are
    off by nothing (the weights are swapped in and back), taken for W_1 by the update's change."""
    pytest.importorskip("peft")
    from examples.online_rl.trainer import Trainer

    trainer = Trainer(fixtures.model_dir, rank=4, lr=5e-2, seed=0)
    tokens = tuple(range(10, 30))
    spans = ((4, 12), (14, 20))
    import torch

    ids = torch.tensor([tokens])
    w0 = trainer._logprobs_at(0, ids, torch.ones_like(ids))
    positions = torch.tensor([j for b, e in spans for j in range(b, e)])
    lp0 = tuple(w0[0, positions - 1].gather(-1, ids[0, positions].unsqueeze(-1)).squeeze(-1).tolist())

    def sample(reward: float, group: int, assumed: int | None) -> Sample:
        return Sample(tokens, spans, lp0, reward, group, 0, assumed_step=assumed)

    trainer.train_step([sample(1.0, 0, 0), sample(0.0, 0, 0)], "none")
    assert trainer.step == 1 and set(trainer.weights_at) == {0, 1}
    at_w0 = trainer.train_step([sample(1.0, 0, 0), sample(0.0, 0, 0)], "tis")
    assert at_w0.assumed_gap_mean is not None and at_w0.assumed_gap_mean < 1e-5
    # the update itself ran on the current weights: W_1's log-probabilities differ from W_0's
    assert at_w0.fresh_abs_diff_mean is not None and at_w0.fresh_abs_diff_mean > 1e-3
    at_w2 = trainer.train_step([sample(1.0, 0, 2), sample(0.0, 0, 2)], "trl")
    assert at_w2.assumed_gap_mean is not None and at_w2.assumed_gap_mean > 1e-3
    assert at_w2.cut_share is not None and at_w2.ratio_var is not None
    # tis-label: the ratio over the labelled version's probabilities, which the trainer recomputes
    labelled = trainer.train_step([sample(1.0, 0, 3), sample(0.0, 0, 3)], "tis-label")
    assert labelled.cut_share is not None and labelled.assumed_gap_mean is not None
    with pytest.raises(ValueError, match="assumed_step"):
        trainer.train_step([sample(1.0, 0, None), sample(0.0, 0, None)], "tis-label")


def test_the_run_config_knows_the_study_modes() -> None:
    assert dataclasses.replace(RunConfig(), rollout="per-turn", correction="trl").rollout == "per-turn"
    for bad in ({"rollout": "latest"}, {"correction": "ppo"}, {"assistant_turns": 0}, {"trl_epsilon": 1.0}):
        with pytest.raises(ValueError):
            RunConfig(**bad)  # type: ignore[arg-type]
