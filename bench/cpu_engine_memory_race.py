"""Does a CPU engine start while a neighbour takes memory during its load? (The CI failure of
2026-12-05: the online RL showcase's engine refused to start, "Loaded weights leave no GPU memory
for the KV cache under --mem-fraction-static=0.1", beside other engines booting.)

SGLang measures a CPU engine's memory on the whole machine: at its baseline (``pre``), and after
its weights load, when it refuses unless more than ``pre x (1 - mem_fraction_static)`` is still
available. This bench leaves ``--leave-gib`` of memory available (a process holds the rest), starts
one stock CPU engine with each fraction of ``--fractions`` and, the moment the engine logs its
baseline, lets a neighbour process take ``--take-gib`` (as a neighbour engine's boot does), held
until the engine started or refused. ``--reps`` runs per fraction.

Prints a table and writes ``bench/results/cpu_engine_memory_race.json``. Needs about
``--leave-gib`` + 1 GiB free to run; it takes the rest of the machine's memory while it runs, so
run it alone.

    .venv/bin/python bench/cpu_engine_memory_race.py [--fractions 0.1,0.5] [--reps 3] [--take-gib 1.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from lora_versions_dev import cpu  # noqa: E402
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, spawn_engine  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cpu_engine_memory_race.json"
GiB = 1 << 30
REFUSAL = "no GPU memory for the KV cache"
# A process that takes the bytes it reads on stdin (touched, so they are really used), says so,
# and holds them until killed.
HOLDER = (
    "import sys, time\n"
    "n = int(sys.stdin.readline()); held = []\n"
    "while n > 0:\n"
    "    held.append(b'\\x01' * min(n, 64 << 20)); n -= 64 << 20\n"
    "print('held', flush=True); time.sleep(3600)\n"
)


def holder() -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def take(proc: subprocess.Popen[str], nbytes: int) -> None:
    assert proc.stdin is not None
    proc.stdin.write(f"{max(0, nbytes)}\n")
    proc.stdin.flush()


def one_start(
    fraction: float, leave_gib: float, take_gib: float, model_dir: Path, log: Path
) -> dict[str, Any]:
    rest, neighbour = holder(), holder()
    try:
        take(rest, int(psutil.virtual_memory().available - leave_gib * GiB))
        assert rest.stdout is not None and rest.stdout.readline().strip() == "held"
        available = psutil.virtual_memory().available / GiB
        spec = EngineSpec(
            name="race",
            model_path=model_dir,
            log_path=log,
            plugin=False,
            extra_args=["--mem-fraction-static", str(fraction)],
        )
        engine = spawn_engine(spec)
        try:
            taken_at: float | None = None
            t0 = time.monotonic()
            outcome = "timeout"
            while time.monotonic() - t0 < spec.startup_timeout_s:
                text = log.read_text(errors="replace") if log.exists() else ""
                if taken_at is None and "Memory baseline taken" in text:
                    take(neighbour, int(take_gib * GiB))
                    taken_at = time.monotonic() - t0
                if REFUSAL in text:
                    outcome = "refused"
                    break
                if "The server is fired up" in text:
                    outcome = "started"
                    break
                if engine.proc.poll() is not None:
                    outcome = "exited"
                    break
                time.sleep(0.01)
        finally:
            engine.stop()
        return {
            "fraction": fraction,
            "available_gib_at_launch": round(available, 2),
            "neighbour_takes_gib": take_gib,
            "neighbour_took_at_s": None if taken_at is None else round(taken_at, 2),
            "outcome": outcome,
            "sglang_says": next((ln.strip()[-160:] for ln in text.splitlines() if REFUSAL in ln), ""),
        }
    finally:
        rest.kill()
        neighbour.kill()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fractions", default=f"0.1,{cpu.CPU_MEM_FRACTION_STATIC}")
    parser.add_argument("--leave-gib", type=float, default=4.5, help="memory left available (CI's low: 4.5)")
    parser.add_argument("--take-gib", type=float, default=1.5, help="what the neighbour takes")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if psutil.virtual_memory().available / GiB < args.leave_gib + 1:
        print(f"needs {args.leave_gib + 1:g} GiB available", file=sys.stderr)
        return 2
    model_dir = ensure_fixtures().model_dir
    rows = []
    with tempfile.TemporaryDirectory(prefix="memrace-") as tmp:
        for fraction in (float(f) for f in args.fractions.split(",")):
            for rep in range(args.reps):
                log = Path(tmp) / f"e-{fraction}-{rep}.log"
                row = one_start(fraction, args.leave_gib, args.take_gib, model_dir, log)
                rows.append(row)
                print(
                    f"fraction {row['fraction']:<5} available {row['available_gib_at_launch']:>5} GiB, "
                    f"neighbour takes {row['neighbour_takes_gib']} GiB at {row['neighbour_took_at_s']} s: "
                    f"{row['outcome']}"
                )
    print(f"\n{'fraction':>8} {'runs':>5} {'started':>8} {'refused':>8}")
    for fraction in dict.fromkeys(r["fraction"] for r in rows):
        mine = [r for r in rows if r["fraction"] == fraction]
        started = sum(r["outcome"] == "started" for r in mine)
        refused = sum(r["outcome"] == "refused" for r in mine)
        print(f"{fraction:>8} {len(mine):>5} {started:>8} {refused:>8}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
