"""Why decode stalls while versions are published: per-process CPU and a py-spy profile of one
engine during a window of back-to-back publications, against a quiet window (issue 29: where a
goal is not met, the profile says why).

Two CPU engines on the tiny model, ``--streams`` streams per engine bound to version A (as in
``decode_gap.py``). Then, for each mode of ``--modes`` (``quiet``: nothing else; ``publish``: a
version published and cleaned up back to back on both engines, as ``decode_gap.py
--interval-s 0`` does), one window of ``--seconds``: each process's CPU time (cores used over the
window), the streams' inter-chunk gaps, and py-spy sampling E0's ``--process`` (``scheduler`` or
``main``) with every thread, idle samples included, summarised by thread and by innermost frame.

Prints a table and writes ``bench/results/decode_gap_profile.json``.

    .venv/bin/python bench/decode_gap_profile.py [--modes quiet,publish] [--seconds 8]
                                                 [--streams 2] [--process scheduler|main]
                                                 [--layout shared|pinned]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _layout  # noqa: E402
import psutil  # noqa: E402
from _profiling import engine_processes, raw_stacks  # noqa: E402
from decode_gap import MEASURED, Streams, Window, _now, _pct, cohort_on_version, publish_loop  # noqa: E402

from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402
from relax_glue.snapshot import Snapshot  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "decode_gap_profile.json"


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}


def major_faults(procs: dict[str, psutil.Process]) -> dict[str, int]:
    """Page faults that waited for I/O (``majflt`` of /proc/<pid>/stat): time off the CPU."""
    out = {}
    for k, p in procs.items():
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[k] = int(fields[9])  # the 12th field; fields[0] is the 3rd (state)
    return out


def summarise_profile(raw: Path, top: int = 12) -> dict[str, Any]:
    """Samples per thread, and each thread's innermost frames (file:line) by share."""
    threads: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for frames, count in raw_stacks(raw):
        thread = re.sub(r"^thread \(\d+\): ?", "", frames[0]) or "unnamed"
        threads[thread] += count
        leaf = re.sub(r" \(/.*?([^/]+\.py):(\d+)\)", r" (\1:\2)", frames[-1])
        leaves[thread][leaf] += count
    return {
        t: {
            "samples": n,
            "top_frames": [{"frame": f, "share": round(c / n, 3)} for f, c in leaves[t].most_common(top)],
        }
        for t, n in threads.most_common()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="quiet,publish")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--streams", type=int, default=2, help="streams per engine")
    p.add_argument("--process", choices=("scheduler", "main"), default="scheduler")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument(
        "--layout",
        choices=_layout.LAYOUTS,
        default="shared",
        help="bench/_layout.py; pinned: E0's scheduler alone on the last core, and the gaps are E0's streams",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    fx = ensure_fixtures()
    run_dir = args.out.parent / "decode_gap_profile"
    run_dir.mkdir(parents=True, exist_ok=True)
    specs = [
        EngineSpec(
            name=n,
            model_path=fx.model_dir,
            log_path=run_dir / f"{n}-{args.layout}.log",
            env=_layout.engine_env(args.layout, measured=n == MEASURED),
        )
        for n in ("E0", "E1")
    ]
    snap_a, snap_b = Snapshot.from_peft_dir(fx.adapter_dir("A")), Snapshot.from_peft_dir(fx.adapter_dir("B"))
    payloads_a, payloads_b = list(snap_a.iter_buckets()), list(snap_b.iter_buckets())
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "modes": {}}
    print(f"layout {args.layout}")
    with running_engines(specs) as engines:
        by_name = {e.name: e.proc.pid for e in engines}
        others = [pid for name, pid in by_name.items() if name != MEASURED]
        report["pinned"] = _layout.apply(args.layout, by_name[MEASURED], others)
        urls, logs, drivers, lora_a = cohort_on_version(engines, snap_a, payloads_a)
        _layout.pin_the_rest(args.layout, by_name[MEASURED], others)
        procs: dict[str, psutil.Process] = {}
        for e in engines:
            procs.update(engine_processes(e.name, e.proc.pid))
        procs["bench client"] = psutil.Process()
        target = procs[f"E0 {args.process}"].pid
        streams = Streams(urls, lora_a, args.streams, 1500)
        streams.start()
        time.sleep(3.0)  # streams past their prefill
        spy_exe = str(Path(sys.executable).with_name("py-spy"))
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            raw = run_dir / f"{mode}-{args.process}.txt"
            spy = subprocess.Popen(
                [
                    spy_exe,
                    *("record", "--pid", str(target), "--format", "raw", "--output", str(raw)),
                    *("--rate", str(args.rate), "--threads", "--idle", "--nonblocking", "--full-filenames"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
            c0, f0, t0 = cpu_seconds(procs), major_faults(procs), time.monotonic()
            w = Window(mode, _now(), _now() + args.seconds)
            if mode == "publish":
                publish_loop(drivers, snap_b, payloads_b, w, 0.0, None, logs, 0.0)
            else:
                time.sleep(args.seconds)
            c1, f1, dt = cpu_seconds(procs), major_faults(procs), time.monotonic() - t0
            spy.send_signal(2)  # py-spy writes its file on SIGINT
            spy.wait(timeout=120)
            # pinned: the gaps of the engine whose scheduler has a core of its own (bench/_layout.py)
            gaps = streams.gaps(w.lo, w.hi, (MEASURED,) if args.layout == "pinned" else None)
            report["modes"][mode] = {
                "publications": len(w.events),
                "cores_used": {k: round((c1[k] - c0[k]) / dt, 3) for k in c0},
                "major_faults": {k: f1[k] - f0[k] for k in f0},
                "gaps_ms": {
                    "n": len(gaps),
                    "p50": round(1e3 * (_pct(gaps, 0.5) or 0.0), 2),
                    "p99": round(1e3 * (_pct(gaps, 0.99) or 0.0), 2),
                    "max": round(1e3 * max(gaps, default=0.0), 2),
                },
                "profile": summarise_profile(raw) if raw.exists() else {},
            }
        streams.stop()
        _layout.apply("shared", 0)
    args.out.write_text(json.dumps(report, indent=2))
    print_report(report, args.process)
    print(f"wrote {args.out}")


def print_report(report: dict[str, Any], process: str) -> None:
    for mode, r in report["modes"].items():
        g = r["gaps_ms"]
        gaps = f"gaps p50 {g['p50']} / p99 {g['p99']} / max {g['max']} ms"
        print(f"\n{mode}: {r['publications']} publications; {gaps}")
        cores = r["cores_used"]
        used = ", ".join(f"{k} {v:.2f}" for k, v in cores.items())
        print(f"  cores used: {used}; total {sum(cores.values()):.2f}")
        faults = ", ".join(f"{k} {v}" for k, v in r["major_faults"].items() if v)
        print(f"  major page faults (waits for I/O): {faults or 'none'}")
        for thread, t in list(r["profile"].items())[:3]:
            print(f"  E0 {process}, thread {thread} ({t['samples']} samples, idle included):")
            for f in t["top_frames"][:6]:
                print(f"    {100 * f['share']:5.1f}%  {f['frame'][:110]}")


if __name__ == "__main__":
    main()
