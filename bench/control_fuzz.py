"""The long run of the control-endpoint fuzzer against a real CPU engine of its own.

The same fuzzer as the test suite's short seeded run (``lora_versions_dev/control_fuzz.py``):
valid publications of the fixture adapters and of crafted-but-valid ones (rsLoRA, q/v only, one
layer only) interleaved with malformed, out-of-order, cross-version, oversized, cut-short,
concurrent and crafted-invalid requests (each rejected for one reason SGLang 0.5.23 would
mis-serve or crash on). After every request: a typed answer, no change on a refusal, the engine
alive, no slot held by anything not validly begun; at the end every READY version serves its
HF + PEFT reference tokens and the engine log holds no traceback.

Prints a table and writes ``bench/results/control_fuzz.json``.

    .venv/bin/python bench/control_fuzz.py [--requests 10000] [--seed 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lora_versions_dev.control_fuzz import (  # noqa: E402
    ControlFuzzer,
    attach_reference_tokens,
    crafted_adapters,
    fuzz_engine_spec,
)
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import running_engines  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "control_fuzz.json"
ADMIN_KEY = "lora-versions-bench-admin-key"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args()

    fixtures = ensure_fixtures()
    run_dir = ROOT / ".runs" / "bench" / f"control_fuzz-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    adapters = crafted_adapters({n: fixtures.adapter_dir(n) for n in ("A", "B", "C")})
    with tempfile.TemporaryDirectory() as refs:
        attach_reference_tokens(adapters, fixtures.model_dir, Path(refs))
    spec = fuzz_engine_spec(fixtures.model_dir, run_dir / "fuzz.log", ADMIN_KEY)
    with running_engines([spec]) as (engine,):
        t0 = time.monotonic()
        fuzzer = ControlFuzzer(
            engine.url,
            adapters,
            seed=args.seed,
            admin_key=ADMIN_KEY,
            log_path=engine.log_path,
            alive=engine.alive,
        )
        report = fuzzer.run(args.requests)
        elapsed = time.monotonic() - t0
    summary = {
        **report.summary(),
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(report.requests / elapsed, 1),
        "engine_log": str(spec.log_path),
        "machine": platform.platform(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2, default=str))

    print(f"\ncontrol fuzz, seed {args.seed}: {report.requests} requests in {elapsed:.0f} s")
    print(f"{'operation':<16}{'count':>8}")
    for op, n in summary["by_op"].items():
        print(f"{op:<16}{n:>8}")
    print(f"{'status':<16}{'count':>8}")
    for status, n in summary["by_status"].items():
        print(f"{status!s:<16}{n:>8}")
    print(f"publications READY: {report.publications_ready}")
    print(f"violations: {len(report.violations)}")
    for v in report.violations[:20]:
        print(f"  {v}")
    print(f"wrote {RESULTS}")
    return 0 if not report.violations else 1


if __name__ == "__main__":
    sys.exit(main())
