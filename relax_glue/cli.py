"""``lora-versions``: the command-line entry point."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lora-versions", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the lifecycle demo on two local CPU SGLang engines")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path(".runs") / "demo" / time.strftime("%Y%m%d-%H%M%S"),
        help="where engine logs and demo.json go",
    )

    status = sub.add_parser("status", help="print an engine's managed versions (GET /lora_versions)")
    status.add_argument("url", help="engine base URL, e.g. http://127.0.0.1:30000")
    status.add_argument("--api-key", default=None)

    args = parser.parse_args(argv)
    if args.command == "demo":
        from lora_versions_demo.lifecycle import run_demo

        return run_demo(args.out)
    if args.command == "status":
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        r = httpx.get(f"{args.url.rstrip('/')}/lora_versions", headers=headers, timeout=10)
        print(json.dumps(r.json(), indent=2))
        return 0 if r.status_code == 200 else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
