"""The chaos campaign on real engines (issue 9): seeded, bounded in time.

Two real CPU engines, the real trainer stack (registry as a durable Ray actor, publisher with an
on-disk snapshot store, reconciler, sessions), live session turns, repeated publications and
reclaims; at random phases it SIGKILLs and restarts an engine (during begin, buckets, end,
between READY and commit, during a reclaim drain), drops one engine reply, or SIGKILLs the
registry's process (Ray reopens the journal) together with the trainer's publisher. See
``lora_versions_demo/chaos.py`` for the rounds and the invariants.

Prints a table and writes ``bench/results/chaos.json`` (and ``.runs/bench/chaos-*/chaos.json``).

    .venv/bin/python bench/chaos.py [--faults 30] [--seed 9] [--max-s 3600] [--no-overlap]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lora_versions_demo.chaos import ChaosConfig, print_report, run_campaign  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "chaos.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--max-s", type=float, default=3600.0)
    parser.add_argument(
        "--no-overlap", action="store_true", help="session turns only between faults, not during them"
    )
    parser.add_argument(
        "--transport", choices=("http", "collective"), default="http", help="how the buckets travel"
    )
    parser.add_argument(
        "--capacity", type=int, default=2, help="the epoch's K: up to K versions live at a fault (<= 4)"
    )
    args = parser.parse_args()
    out = ROOT / ".runs" / "bench" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = ChaosConfig(
        seed=args.seed,
        faults=args.faults,
        max_s=args.max_s,
        out_dir=out,
        overlap=not args.no_overlap,
        transport=args.transport,
        capacity=args.capacity,
    )
    report = run_campaign(cfg)
    report["capacity"] = cfg.capacity
    report["overlap"] = cfg.overlap
    report["transport"] = cfg.transport
    report["machine"] = platform.platform()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nchaos campaign, seed {args.seed} ({out}):")
    print_report(report)
    ok = not report["violations"] and report["faults_injected"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
