"""The wiring of the TRL example: two CPU engines with the plugin and the smg gateway (the local
cohort the demo and the showcase start), the training processes (``train.py``: ``GRPOTrainer``
with the integration, one process or several under ``accelerate launch``), then the checks,
the report and the plot."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from examples.trl_grpo import checks as ck
from examples.trl_grpo.train import TrainSpec, launch
from lora_versions_demo.local_cohort import local_cohort, run_reporting
from relax_glue.cli import table

TRAIN_TIMEOUT_S = 900.0
LOGPROB_TOLERANCE = 1e-3  # fp32 on both sides: measured about 1e-6 (the showcase: 6.7e-6 max)


@dataclasses.dataclass(frozen=True)
class ExampleConfig:
    steps: int = 20
    processes: int = 1
    prompts_per_step: int = 4  # per process
    group_size: int = 8
    max_new_tokens: int = 4
    lr: float = 3e-2
    seed: int = 0
    background: bool = False


def run_example(cfg: ExampleConfig, out_dir: Path, *, as_json: bool) -> int:
    def main() -> int:
        t0 = time.monotonic()
        with local_cohort(out_dir, 2, "trl-grpo") as cohort:
            spec = TrainSpec(
                engines={e.name: e.url for e in cohort.engines},
                gateway_url=cohort.gateway_url,
                admin_key=cohort.admin_key,
                model_dir=str(cohort.fixtures.model_dir),
                out_dir=str(out_dir / "train"),
                epoch=f"trlgrpo{time.strftime('%H%M%S')}",
                steps=cfg.steps,
                prompts_per_step=cfg.prompts_per_step,
                group_size=cfg.group_size,
                max_new_tokens=cfg.max_new_tokens,
                lr=cfg.lr,
                seed=cfg.seed,
                background=cfg.background,
            )
            print(
                f"[trl-grpo] GRPOTrainer: {cfg.processes} process(es), {cfg.steps} steps; log {spec.out_dir}"
            )
            t_train = time.monotonic()
            code, reports = launch(spec, cfg.processes, TRAIN_TIMEOUT_S)
            train_s = time.monotonic() - t_train
            logs = {e.name: e.log_path for e in cohort.engines}
            unloads = ck.count_unloads(reports, logs) if reports else {}
            cohort_ids = list(cohort.ids)
            start_s = cohort.engine_start_s
        doc = build_report(cfg, code, reports, unloads, cohort_ids)
        doc["timing"] = {
            "engines_start_s": start_s,
            "train_s": round(train_s, 1),
            "total_s": round(time.monotonic() - t0, 1),
        }
        (out_dir / "report.json").write_text(json.dumps(doc, indent=1, default=str))
        if reports:
            plot(doc, out_dir / "trl_grpo.png")
        print_report(doc, out_dir)
        return 0 if doc["ok"] else 1

    return run_reporting(main, out_dir / "report.json", as_json=as_json)


def build_report(
    cfg: ExampleConfig,
    code: int,
    reports: list[dict[str, Any]],
    unloads: dict[str, dict[str, int]],
    cohort: list[str],
) -> dict[str, Any]:
    checks: list[ck.Check] = [ck.Check("the training processes finished", code == 0 and bool(reports), code)]
    if reports:
        outcomes = ck.main_report(reports)["outcomes"]
        checks += [
            ck.turns_on_one_version(reports),
            ck.rewards_received_versions(reports),
            ck.ranks_agree(reports),
            ck.one_outcome_per_step(outcomes, cfg.steps, {}),
            ck.retired_unloaded_once(reports, unloads, cohort),
            ck.reclaimed_after_last_close(reports),
            ck.no_pause_flush_abort_all(reports),
            ck.only_expected_failed_requests(reports),
            ck.same_weights_logprobs(reports, LOGPROB_TOLERANCE),
        ]
    return {
        "ok": all(c.ok for c in checks),
        "checks": [dataclasses.asdict(c) for c in checks],
        "summary": summarize(reports) if reports else {},
        "config": dataclasses.asdict(cfg),
        "unloads": unloads,
        "ranks": reports,
    }


def summarize(reports: list[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    rewards = ck.rewards_by_step(reports)
    values = list(rewards.values())
    outcomes = ck.main_report(reports)["outcomes"]
    kinds = {k: sum(1 for o in outcomes if o["kind"] == k) for k in ("PUBLISHED", "SKIPPED", "FAILED")}
    pub_s = [o["seconds"] for o in outcomes if o["kind"] == "PUBLISHED"]
    mismatch = ck.same_weights_logprobs(reports, LOGPROB_TOLERANCE).detail
    return {
        "reward_by_step": {s: round(r, 3) for s, r in rewards.items()},
        "reward_first": round(statistics.fmean(values[:window]), 3),
        "reward_last": round(statistics.fmean(values[-window:]), 3),
        "publications": kinds,
        "publish_s_median": round(statistics.median(pub_s), 3) if pub_s else None,
        "staleness_by_step": ck.staleness_by_step(reports),
        "logprob_mismatch": mismatch,
        "completions": len(ck.completions(reports)),
        "reclaims": sum(1 for r in ck.main_report(reports)["reclaims"] if r["done"]),
        "train_s_per_rank": [r["train_s"] for r in reports],
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [int(k) for k in s["reward_by_step"]]
    a.plot(steps, list(s["reward_by_step"].values()), marker="o")
    a.set(
        xlabel="trainer step t (its rollouts: version step{t}, or older)",
        ylabel="mean reward",
        ylim=(0, 1.05),
    )
    a.set_title("reward: share of digit tokens in the assistant turns")
    outcomes = ck.main_report(doc["ranks"])["outcomes"]
    colors = {"PUBLISHED": "tab:green", "SKIPPED": "tab:orange", "FAILED": "tab:red"}
    for o in outcomes:
        b.bar(o["step"], o["seconds"], color=colors[o["kind"]])
    b.set(xlabel="version step{t}", ylabel="seconds (reclaim, publish, commit)")
    b.set_title("each step's publication (green: published)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(doc: dict[str, Any], out_dir: Path) -> None:
    s = doc["summary"]
    if s:
        rows = [[k, v] for k, v in s["reward_by_step"].items()]
        print(table(["step", "mean reward"], rows))
        figures = [
            ["reward, first 3 / last 3 steps", f"{s['reward_first']} -> {s['reward_last']}"],
            ["publications", s["publications"]],
            ["publication, median seconds", s["publish_s_median"]],
            ["completions (sessions)", s["completions"]],
            ["reclaims (one unload per engine each)", s["reclaims"]],
            ["trainer vs engine logprob, same weights", s["logprob_mismatch"]],
        ]
        print(table(["figure", "value"], figures))
    print("\n[trl-grpo] checks:")
    for c in doc["checks"]:
        print(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}  ({c['detail']})")
    verdict = "ALL CHECKS HELD" if doc["ok"] else "SOME CHECKS FAILED"
    print(f"\n[trl-grpo] {verdict}; report {out_dir / 'report.json'}, plot {out_dir / 'trl_grpo.png'}")
