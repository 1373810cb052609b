"""``python -m examples.online_rl [--steps N] [--until-reward R] [--workers N] [--seed S] [--out DIR]
[--json]`` (every option: ``--help``)"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from pathlib import Path

from examples.online_rl.config import CORRECTIONS, ROLLOUTS, RunConfig


def main(argv: list[str] | None = None) -> int:
    d = RunConfig()
    ap = argparse.ArgumentParser(
        prog="python -m examples.online_rl",
        description="Online RL on two CPU SGLang engines: a LoRA trained by a group-baseline policy "
        "gradient publishes a new immutable version every step while multi-turn agent rollouts go on.",
    )
    ap.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    ap.add_argument(
        "--until-reward",
        type=float,
        default=d.until_reward,
        help="stop early once the last 3 updates' mean batch reward reaches this (default: run every step)",
    )
    ap.add_argument("--workers", type=int, default=d.workers, help=f"rollout workers (default {d.workers})")
    ap.add_argument("--seed", type=int, default=d.seed, help="LoRA init and tool latencies (default 0)")
    ap.add_argument(
        "--engines", type=int, default=d.engines, help=f"engines in the cohort (default {d.engines})"
    )
    ap.add_argument("--max-staleness", type=int, default=d.max_staleness, help=f"(default {d.max_staleness})")
    ap.add_argument("--capacity", type=int, default=d.capacity, help=f"the epoch's K (default {d.capacity})")
    ap.add_argument(
        "--correction",
        choices=CORRECTIONS,
        default=d.correction,
        help="off-policy correction: truncated importance ratio (default), TRL's clipped surrogate, none",
    )
    ap.add_argument(
        "--rollout",
        choices=ROLLOUTS,
        default=d.rollout,
        help="pinned: an episode keeps the version of its first turn (default); per-turn: every turn "
        "asks for the current default, as TRL AsyncGRPO does (only to compare: docs/why-pin.md)",
    )
    ap.add_argument(
        "--assistant-turns",
        type=int,
        default=d.assistant_turns,
        help=f"per episode (default {d.assistant_turns})",
    )
    ap.add_argument(
        "--no-group-routing", action="store_true", help="route each episode by its own key, not its prompt's"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(".runs") / "online_rl" / time.strftime("%Y%m%d-%H%M%S"),
        help="where report.json, online_rl.png and the engine logs go",
    )
    ap.add_argument("--json", action="store_true", help="print the report (JSON) instead of the tables")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(
        d,
        steps=args.steps,
        until_reward=args.until_reward,
        workers=args.workers,
        seed=args.seed,
        engines=args.engines,
        max_staleness=args.max_staleness,
        capacity=args.capacity,
        correction=args.correction,
        rollout=args.rollout,
        assistant_turns=args.assistant_turns,
        group_routing=not args.no_group_routing,
    )
    from examples.online_rl.run import run_online_rl

    # SIGTERM (a test's timeout, a CI cancel) unwinds like Ctrl-C: the sessions close, and the
    # gateway and the engines this run started are stopped on the way out, never left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return run_online_rl(cfg, args.out, as_json=args.json)
    except KeyboardInterrupt:
        print("[online-rl] interrupted; the engines and the gateway were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
