"""Does pinning an episode to one version matter for learning? (issue 40; docs/why-pin.md)

The online RL showcase (``examples/online_rl``: a LoRA on the fixture tiny Qwen3, a group-baseline
policy gradient, a new immutable version published after every update while multi-turn agent
episodes go on through the session layer and smg) is run in every cell of

* **rollout**: ``pinned`` (this project: an episode binds the default at its first generation and
  every turn carries it) or ``per-turn`` (TRL AsyncGRPO: every turn asks for the default of its
  moment, ``async_rollout_worker.py`` ``_request_model``, so an episode may span versions);
* **correction**: ``none``; ``tis`` (per-token truncated importance ratio against the engine's
  log-probability of each token, from the version the engine attested for it); ``trl`` (TRL
  1.16.0 AsyncGRPO's clipped surrogate against the rollout's log-probabilities,
  ``async_grpo_trainer.py`` ``compute_loss``, epsilon 0.2, and its staleness dating of a group
  by the version current at its start); ``tis-label`` (the truncated ratio over the probabilities
  of the version the trainer takes the episode for, recomputed from its weights: what a trainer
  that trusts its version label computes, exact only if every token came from that version);

over ``--seeds`` seeds (the LoRA init and the tool latencies; engine sampling is not seeded). One
pair of CPU engines and one smg serve every run (their start is the costliest part of a run
here); the runs share one registry epoch, each naming its versions and sessions with its own
tag, and each is checked with the showcase's invariants (per-turn: each turn on its own
session's binding, attested by the engine). The episodes are longer than the showcase's (4
assistant turns, 0.2-0.6 s tool calls, no stragglers) and there are as many workers as a batch
has episodes, so publications land inside episodes often; the summary says how often.

Per cell (mean and spread over the seeds): the reward curve, updates to reach the target reward,
the share of episodes whose tokens came from more than one version (attested) and of episodes a
publication landed in, how many updates old the served version of a used token was, the
variance of the ratio pi_trainer / pi_served and the share the correction cut, the log-probability
gap between the version the trainer takes an episode for and what served its tokens, and wall
time per update. Writes ``why_pin.json`` and ``why_pin.png``.

    .venv/bin/python bench/why_pin.py                       # 8 cells x 12 seeds (about 50 min here)
    .venv/bin/python bench/why_pin.py --cells per-turn/trl  # one cell
    .venv/bin/python bench/why_pin.py --short               # the CI form: every cell, 1 seed, 2 updates
    .venv/bin/python bench/why_pin.py --from-runs DIR...    # summarize runs already made
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.online_rl import report as rp  # noqa: E402
from examples.online_rl.config import CORRECTIONS, ROLLOUTS, RunConfig  # noqa: E402
from examples.online_rl.run import OnlineRL, Stack  # noqa: E402
from lora_versions_demo.local_cohort import local_cohort  # noqa: E402
from relax_glue.cli import table  # noqa: E402

CELLS = tuple(f"{r}/{c}" for r in ROLLOUTS for c in CORRECTIONS)
TARGET = 0.5  # updates to reach this mean batch reward (over the showcase's 3-update window)

# The study's episodes: long enough, and enough of them at once, that publications land inside
# them (every worker's episode spans about one update cycle).
STUDY = RunConfig(
    assistant_turns=4,
    group_size=4,  # batch = 4 x 4 prompts = 16 episodes
    workers=16,
    tool_latency_s=(0.2, 0.6),
    # No stragglers: a pinned straggler holds its version's slot for its whole episode, and at
    # K = 3 that alone made half of the pinned runs' publications skip (a first try with 5% of
    # tool calls at 3-8 s), which would measure the capacity cost of pinning, not what mixing
    # versions inside an episode does to learning. docs/why-pin.md reports that try apart.
    slow_tool_p=0.0,
    until_reward=None,
)


@dataclasses.dataclass(frozen=True)
class RunResult:
    cell: str
    seed: int
    ok: bool
    failed_invariants: list[str]
    summary: dict[str, Any]


def cell_config(cell: str, seed: int, steps: int) -> RunConfig:
    rollout, correction = cell.split("/")
    return dataclasses.replace(STUDY, rollout=rollout, correction=correction, seed=seed, steps=steps)


def tag_of(cell: str, seed: int) -> str:
    rollout, correction = cell.split("/")
    # version ids and session keys: [A-Za-z0-9_.]
    return f"{rollout[:3]}{correction.replace('-', '_')}{seed}."


async def run_cells(cells: list[str], seeds: list[int], steps: int, lc: Any, out: Path) -> list[RunResult]:
    stack = Stack.open(lc.engines, lc.gateway_url, lc.admin_key, STUDY.capacity, epoch="whypin")
    results: list[RunResult] = []
    try:
        # seed-major: a slower stretch of the shared machine touches every cell alike
        for seed in seeds:
            for cell in cells:
                t0 = time.monotonic()
                cfg = cell_config(cell, seed, steps)
                print(f"[why-pin] {cell} seed {seed}: {steps} updates", flush=True)
                record = await OnlineRL(cfg, stack, lc.fixtures.model_dir, tag_of(cell, seed)).run()
                doc = rp.to_json(record, rp.check_invariants(record))
                result = result_of(cell, seed, doc)
                results.append(result)
                (out / "runs").mkdir(parents=True, exist_ok=True)
                (out / "runs" / f"{tag_of(cell, seed)}json").write_text(json.dumps(doc, default=str))
                s = result.summary
                print(
                    f"[why-pin] {cell} seed {seed}: rewards {s['batch_rewards']}, multi-version "
                    f"{s['multi_version_share']}, invariants {result.failed_invariants or 'held'} "
                    f"({time.monotonic() - t0:.0f}s)",
                    flush=True,
                )
    finally:
        await stack.aclose()
    return results


def token_staleness_mean(doc: dict[str, Any]) -> float | None:
    """Over the tokens the updates used: how many updates behind the trainer the version that
    served each token was (a turn's tokens all ran on its session's binding, attested)."""
    versions = doc.get("versions") or {}
    turns = [
        (e["trainer_step"] - versions[path], len(out))
        for e in doc.get("episodes", [])
        if e.get("fate") == "used"
        for path, out in zip(e["turn_lora_paths"], e["output_ids"], strict=True)
    ]
    tokens = sum(n for _, n in turns)
    return sum(age * n for age, n in turns) / tokens if tokens else None


def result_of(cell: str, seed: int, doc: dict[str, Any]) -> RunResult:
    """One run's result from its report (as run, or read back from its file)."""
    bad = [i["name"] for i in doc["invariants"] if not i["ok"]]
    summary = doc["summary"] | {"token_staleness_mean": token_staleness_mean(doc)}
    return RunResult(cell, seed, not bad, bad, summary)


def load_runs(run_dirs: list[Path], cells: list[str]) -> list[RunResult]:
    """The results of runs already made, from each run's report (``<run dir>/runs/*.json``)."""
    results = []
    for d in run_dirs:
        for path in sorted((d / "runs").glob("*.json")):
            doc = json.loads(path.read_text())
            cfg = doc["config"]
            cell = f"{cfg['rollout']}/{cfg['correction']}"
            if cell in cells:
                results.append(result_of(cell, int(cfg["seed"]), doc))
    order = {c: i for i, c in enumerate(CELLS)}
    return sorted(results, key=lambda r: (order[r.cell], r.seed))


def _stats(xs: list[float | None]) -> dict[str, float | None]:
    vals = [x for x in xs if x is not None]
    if not vals:
        return {"mean": None, "sd": None, "n": 0}
    return {
        "mean": statistics.fmean(vals),
        "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


FIGURES = (
    "reward_last",
    "updates_to_target",
    "multi_version_share",
    "spanning_publication_share",
    "ratio_var",
    "cut_share",
    "assumed_gap_mean",
    "switched_gap_mean",
    "update_s",
    "token_staleness_mean",
    "policy_lag_stale_mean",
    "skipped",
)


def aggregate(results: list[RunResult], steps: int) -> dict[str, Any]:
    """Per cell: each figure's mean and spread over the seeds, and the reward curve's."""
    out: dict[str, Any] = {}
    for cell in dict.fromkeys(r.cell for r in results):
        runs = [r for r in results if r.cell == cell]
        curves = [r.summary["batch_rewards"] for r in runs]
        curve = [_stats([c[i] if i < len(c) else None for c in curves]) for i in range(steps)]
        out[cell] = {
            "seeds": [r.seed for r in runs],
            "invariants_held": sum(r.ok for r in runs),
            "reached_target": sum(r.summary["updates_to_target"] is not None for r in runs),
            "reward_curve": curve,
            "reward_auc": _stats([reward_auc(r) for r in runs]),
            **{f: _stats([r.summary.get(f) for r in runs]) for f in FIGURES},
        }
    return out


def reward_auc(r: RunResult) -> float | None:
    """The mean batch reward over every update of the run: how early and how far it learned."""
    rewards = r.summary["batch_rewards"]
    return statistics.fmean(rewards) if rewards else None


def contrasts(results: list[RunResult], resamples: int = 4000) -> dict[str, dict[str, Any]]:
    """Per correction, per-turn minus pinned: the difference of the seeds' means of the reward
    over the last 3 updates and over every update, with a 95% bootstrap interval (each cell's
    seeds resampled apart; a fixed RNG, so the same runs give the same interval)."""
    rng = random.Random(0)
    figures = {"reward_last": lambda r: r.summary.get("reward_last"), "reward_auc": reward_auc}
    out: dict[str, dict[str, Any]] = {}
    for correction in CORRECTIONS:
        cell = {rollout: [r for r in results if r.cell == f"{rollout}/{correction}"] for rollout in ROLLOUTS}
        if not all(cell.values()):
            continue
        out[correction] = {}
        for name, figure in figures.items():
            pinned = [x for r in cell["pinned"] if (x := figure(r)) is not None]
            per_turn = [x for r in cell["per-turn"] if (x := figure(r)) is not None]
            if not pinned or not per_turn:
                continue
            diffs = sorted(
                statistics.fmean(rng.choices(per_turn, k=len(per_turn)))
                - statistics.fmean(rng.choices(pinned, k=len(pinned)))
                for _ in range(resamples)
            )
            out[correction][name] = {
                "diff": statistics.fmean(per_turn) - statistics.fmean(pinned),
                "ci95": (diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]),
                "seeds": (len(pinned), len(per_turn)),
            }
    return out


def _fmt(s: dict[str, float | None], digits: int = 3, sci: bool = False) -> str:
    if s["mean"] is None:
        return "-"
    m, sd = s["mean"], s["sd"] or 0.0
    return f"{m:.1e} ± {sd:.0e}" if sci else f"{m:.{digits}f} ± {sd:.{digits}f}"


def summary_rows(agg: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for cell, a in agg.items():
        rows.append(
            [
                cell,
                f"{a['invariants_held']}/{len(a['seeds'])}",
                _fmt(a["reward_last"], 2),
                _fmt(a["reward_auc"], 2),
                _fmt(a["updates_to_target"], 1) + f" ({a['reached_target']}/{len(a['seeds'])})",
                _fmt(a["multi_version_share"], 2),
                _fmt(a["spanning_publication_share"], 2),
                _fmt(a["token_staleness_mean"], 2),
                _fmt(a["ratio_var"], 3),
                _fmt(a["cut_share"], 3),
                _fmt(a["assumed_gap_mean"], sci=True),
                _fmt(a["switched_gap_mean"], 3),
                _fmt(a["update_s"], 1),
            ]
        )
    return rows


def contrast_rows(con: dict[str, dict[str, Any]]) -> list[list[Any]]:
    def cell(c: dict[str, Any] | None) -> str:
        if c is None:
            return "-"
        lo, hi = c["ci95"]
        return f"{c['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"

    return [[corr, cell(c.get("reward_last")), cell(c.get("reward_auc"))] for corr, c in con.items()]


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "".join("| " + " | ".join(str(c) for c in line) + " |\n" for line in lines)


CONTRAST_HEADERS = [
    "correction",
    "per-turn - pinned: reward, last 3 updates [95% CI]",
    "per-turn - pinned: reward over every update [95% CI]",
]

HEADERS = [
    "cell (rollout/correction)",
    "invariants",
    "reward, last 3",
    "reward, every update",
    f"updates to {TARGET} (reached)",
    "multi-version episodes",
    "episodes a publication landed in",
    "served version's age (updates)",
    "ratio variance",
    "cut share",
    "gap assumed vs served",
    "gap, switched tokens",
    "s per update",
]


def plot(agg: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrections = list(dict.fromkeys(c.split("/")[1] for c in agg))
    cols = 2 if len(corrections) > 3 else len(corrections)
    rows = -(-len(corrections) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, corr in zip(axes.flat, corrections, strict=False):
        for rollout, color in (("pinned", "tab:blue"), ("per-turn", "tab:red")):
            a = agg.get(f"{rollout}/{corr}")
            if a is None:
                continue
            pts = [
                (i + 1, s["mean"], s["sd"] or 0.0)
                for i, s in enumerate(a["reward_curve"])
                if s["mean"] is not None
            ]
            x = [p[0] for p in pts]
            m = [p[1] for p in pts]
            ax.plot(x, m, "o-", color=color, label=f"{rollout} ({len(a['seeds'])} seeds)")
            lo = [max(p[1] - p[2], 0.0) for p in pts]
            ax.fill_between(x, lo, [min(p[1] + p[2], 1.0) for p in pts], color=color, alpha=0.18)
        ax.axhline(TARGET, color="grey", lw=0.8, ls=":")
        ax.set_title(f"correction: {corr}")
        ax.set_xlabel("update")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    for row in axes:
        row[0].set_ylabel("batch reward (mean ± sd over seeds)")
    fig.suptitle("Pinned episodes vs per-turn switching: reward per update")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=12, help="seeds per cell (default 12)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds F..F+N-1 (default 0)")
    ap.add_argument("--steps", type=int, default=16, help="updates per run (default 16)")
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma separated, of {', '.join(CELLS)}")
    ap.add_argument("--short", action="store_true", help="the CI form: 1 seed, 2 updates")
    ap.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results", help="why_pin.json and why_pin.png go here"
    )
    ap.add_argument(
        "--run-dir",
        type=Path,
        default=ROOT / ".runs" / "why_pin" / time.strftime("%Y%m%d-%H%M%S"),
        help="engine and gateway logs, and every run's full report",
    )
    ap.add_argument(
        "--from-runs",
        type=Path,
        nargs="+",
        help="no engines: summarize the runs' reports already in these run dirs (re-plot, merge)",
    )
    args = ap.parse_args(argv)
    cells = [c for c in args.cells.split(",") if c]
    if unknown := set(cells) - set(CELLS):
        ap.error(f"unknown cells {sorted(unknown)}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    seeds, steps = ([0], 2) if args.short else (seeds, args.steps)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.from_runs:
        results = load_runs(args.from_runs, cells)
        seeds = sorted({r.seed for r in results})
        steps = max(len(r.summary["batch_rewards"]) for r in results)
    else:
        # SIGTERM (a test's timeout, a CI cancel) unwinds like Ctrl-C: the engines and the
        # gateway this study started are stopped on the way out
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            with local_cohort(args.run_dir, STUDY.engines, "why-pin") as lc:
                results = asyncio.run(run_cells(cells, seeds, steps, lc, args.run_dir))
        except KeyboardInterrupt:
            print("[why-pin] interrupted; the engines and the gateway were stopped", file=sys.stderr)
            return 130
    agg = aggregate(results, steps)
    doc = {
        "ok": all(r.ok for r in results),
        "config": {
            **dataclasses.asdict(STUDY),
            "steps": steps,
            "seeds": seeds,
            "cells": cells,
            "target_reward": TARGET,
        },
        "cells": agg,
        "contrasts": contrasts(results),
        "runs": [dataclasses.asdict(r) for r in results],
        "wall_s": round(time.monotonic() - t0, 1),
        "run_dir": [str(d) for d in args.from_runs] if args.from_runs else str(args.run_dir),
    }
    (out / "why_pin.json").write_text(json.dumps(doc, indent=2, default=str))
    plot(agg, out / "why_pin.png")
    print(table(HEADERS, summary_rows(agg)))
    print(table(CONTRAST_HEADERS, contrast_rows(doc["contrasts"])))
    # the same two tables in Markdown, as docs/why-pin.md shows them
    (out / "why_pin.md").write_text(
        markdown(HEADERS, summary_rows(agg))
        + "\n"
        + markdown(CONTRAST_HEADERS, contrast_rows(doc["contrasts"]))
    )
    print(
        f"[why-pin] {'every run held its invariants' if doc['ok'] else 'SOME RUNS FAILED INVARIANTS'}; "
        f"{out / 'why_pin.json'}, {out / 'why_pin.png'} ({doc['wall_s']}s)"
    )
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
