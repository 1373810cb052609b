"""``python -m examples.trl_grpo [--steps N] [--processes P] [--background] [--out DIR] [--json]``"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from pathlib import Path

from examples.trl_grpo.run import ExampleConfig


def main(argv: list[str] | None = None) -> int:
    d = ExampleConfig()
    ap = argparse.ArgumentParser(
        prog="python -m examples.trl_grpo",
        description="TRL's GRPOTrainer on two CPU SGLang engines behind smg: each step's LoRA is "
        "published as an immutable version, every completion is a multi-turn episode on one session.",
    )
    ap.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    ap.add_argument("--processes", type=int, default=d.processes, help="training processes (accelerate)")
    ap.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step and process")
    ap.add_argument("--group-size", type=int, default=d.group_size, help="completions per prompt")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--background", action="store_true", help="publish while the next step's rollouts run")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(".runs") / "trl_grpo" / time.strftime("%Y%m%d-%H%M%S"),
        help="where report.json, trl_grpo.png and the logs go",
    )
    ap.add_argument("--json", action="store_true", help="print the report (JSON) instead of the tables")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(
        d,
        steps=args.steps,
        processes=args.processes,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        lr=args.lr,
        seed=args.seed,
        background=args.background,
    )
    from examples.trl_grpo.run import run_example

    # SIGTERM unwinds like Ctrl-C: the training processes, the gateway and the engines stop.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return run_example(cfg, args.out, as_json=args.json)
    except KeyboardInterrupt:
        print("[trl-grpo] interrupted; the engines and the gateway were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
