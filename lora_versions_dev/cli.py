"""``lora-versions-dev``: the development commands, kept out of the operator CLI.

    lora-versions-dev demo     [--engines N] [--out DIR]   the lifecycle demo on local CPU engines
    lora-versions-dev engine   [--gpu]                     start a CPU dev engine, or print the GPU line

Every command takes ``--json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from relax_glue.cli import ADMIN_KEY_ENV, Output


def cmd_engine(args: argparse.Namespace, out: Output) -> int:
    from lora_versions_dev.fixtures import ensure_fixtures
    from lora_versions_dev.launcher import (
        EngineSpec,
        free_port,
        gpu_launch_command,
        start_engine,
    )
    from sglang_ext.settings import PLUGIN_SWITCH_ENV

    if args.gpu:
        model = args.model or "<model dir or hub id>"
        argv = gpu_launch_command(
            model, port=args.port or 30000, max_lora_rank=args.max_lora_rank, tp_size=args.tp
        )
        record = {"env": {PLUGIN_SWITCH_ENV: "1"}, "argv": argv}
        out.result(record, lambda r: f"{PLUGIN_SWITCH_ENV}=1 " + " ".join(r["argv"]))
        return 0
    model = Path(args.model) if args.model else ensure_fixtures().model_dir
    log = Path(args.log or f".runs/engine/{time.strftime('%Y%m%d-%H%M%S')}.log")
    extra = ["--admin-api-key", args.admin_key] if args.admin_key else []
    if args.enable_metrics:
        extra.append("--enable-metrics")
    spec = EngineSpec(
        name="engine",
        model_path=model,
        log_path=log,
        extra_args=extra,
        port=args.port or free_port(),
        tp=args.tp,
    )
    out.progress(
        f"starting a CPU development engine (plugin on, tp {args.tp}) on port {spec.port}; log {log}"
    )
    engine = start_engine(spec)
    out.result(
        {"url": engine.url, "pid": engine.proc.pid, "log": str(log)}, lambda r: f"engine ready at {r['url']}"
    )
    try:
        while engine.alive():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    parser = argparse.ArgumentParser(prog="lora-versions-dev", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", parents=[common], help="the lifecycle demo on local CPU engines")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path(".runs") / "demo" / time.strftime("%Y%m%d-%H%M%S"),
        help="where engine logs and demo.json go",
    )
    demo.add_argument("--engines", type=int, default=2, help="engines in the cohort (default 2)")
    demo.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the cohort's last engine")

    engine = sub.add_parser("engine", parents=[common], help="start a CPU dev engine, or print the GPU line")
    engine.add_argument("--gpu", action="store_true", help="print the GPU launch command instead")
    engine.add_argument("--model", default=None, help="model dir (CPU default: the built-in tiny Qwen3)")
    engine.add_argument("--port", type=int, default=None)
    engine.add_argument("--max-lora-rank", type=int, default=64)
    engine.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (CPU: at most one per core)")
    engine.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV))
    engine.add_argument("--enable-metrics", action="store_true", help="serve /metrics (with the plugin's)")
    engine.add_argument("--log", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from lora_versions_demo.lifecycle import run_demo

        return run_demo(args.out, args.engines, as_json=args.json, last_engine_tp=args.tp)
    return cmd_engine(args, Output(args.json))


if __name__ == "__main__":
    sys.exit(main())
