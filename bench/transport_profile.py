"""Where a large publication's time goes, per transport: each process's CPU over each publication,
and (``--py-spy``) a sampled profile of the sender, the engine's main process and the collective
receiver (issue 41: where a goal is not met, the profile says why).

One CPU engine on the bench's random Qwen3 base with an adapter of about ``--mib`` MiB (rank
scaled, bucket cap 64 MiB, ``bench/_bench_fixtures.py``). This process is the trainer: it
publishes through ``EngineClient`` as the publisher does (HTTP bodies, or the collective with one
group for the whole run), alternating the transports, ``--reps`` publications each after one
unmeasured warm-up of each, every one cleaned up before the next.

Per publication: wall time, the plugin's phase line (read, verify, load, probe) and the CPU
seconds of this process (the sender), the engine's main process (HTTP, verification), its
scheduler (load, probe) and its collective receiver. With ``--py-spy``, each of the three
profiles is summarised by innermost frames (idle samples left out).

Prints a table and writes ``bench/results/transport_profile.json``.

    .venv/bin/python bench/transport_profile.py [--mib 350] [--reps 3] [--py-spy]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psutil  # noqa: E402
import publish_engine as pe  # noqa: E402
from _bench_fixtures import ensure_bench_fixtures, ensure_sized_adapters, rank_for_mib  # noqa: E402
from _profiling import engine_processes, raw_stacks  # noqa: E402

from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "transport_profile.json"
TRANSPORTS = ("http", "collective")
CAP = 64 * pe.MiB
# innermost frames of a thread that waits (py-spy's --idle is off, but a thread blocked in C
# may still be sampled)
_WAITING = ("_worker", "wait", "select", "_run_once", "sleep", "poll")


def cpu_seconds(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def top_frames(raw: Path, top: int = 8) -> list[dict[str, Any]]:
    leaves: collections.Counter[str] = collections.Counter()
    for frames, count in raw_stacks(raw):
        leaf = frames[-1].split(" (")[0]
        if leaf.rsplit(".", 1)[-1] in _WAITING:
            continue
        leaves[";".join(f.split(" (")[0] for f in frames[-2:])] += count
    total = sum(leaves.values()) or 1
    return [{"frames": f, "share": round(n / total, 3)} for f, n in leaves.most_common(top)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=350.0, help="adapter size")
    p.add_argument("--reps", type=int, default=3, help="publications per transport")
    p.add_argument("--py-spy", action="store_true", help="profile the three processes (100 Hz)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    big = ensure_bench_fixtures()
    adapter_dir = ensure_sized_adapters(big, [args.mib])[args.mib]
    rank = rank_for_mib(args.mib)
    run_dir = ROOT / ".runs" / f"bench-transport-profile-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = EngineSpec(
        name="sized",
        model_path=big.model_dir,
        log_path=run_dir / "sized.log",
        lora_flags=pe._lora_flags(rank),
        extra_args=("--mem-fraction-static", "0.5"),
    )
    case = pe.Case("sized", f"r{rank}", adapter_dir, rank, [CAP])
    case.prepare()
    snap, payloads = case.snaps[CAP], case.payloads[CAP]
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
    profiles: dict[str, Any] = {}
    with running_engines([spec]) as (engine,):
        driver = pe.Driver(engine.url)
        try:
            for transport in TRANSPORTS:  # warm-up: the first load, the group's connect
                _, name, attempt = driver.staged(snap, payloads, collective=transport == "collective")
                driver.cleanup(name, attempt)
            procs = {"sender": psutil.Process()}
            for role, proc in engine_processes("engine", engine.proc.pid).items():
                procs[role.removeprefix("engine ")] = proc
            spies = {}
            if args.py_spy:
                spy = str(Path(sys.executable).with_name("py-spy"))
                for role in ("sender", "main", "collective_receiver"):
                    if role not in procs:
                        continue
                    raw = run_dir / f"py-spy-{role}.txt"
                    spies[role] = (
                        raw,
                        subprocess.Popen(
                            [
                                *(spy, "record", "--pid", str(procs[role].pid), "--rate", "100"),
                                *("--threads", "--nonblocking", "--format", "raw", "--output", str(raw)),
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                time.sleep(2.0)
            for _ in range(args.reps):
                for transport in TRANSPORTS:
                    before = {k: cpu_seconds(proc) for k, proc in procs.items()}
                    t0 = time.perf_counter()
                    times, name, attempt = driver.staged(snap, payloads, collective=transport == "collective")
                    wall = time.perf_counter() - t0
                    after = {k: cpu_seconds(proc) for k, proc in procs.items()}
                    phases = pe._engine_phases(spec.log_path, name)
                    driver.cleanup(name, attempt)
                    rows[transport].append(
                        {
                            "wall_s": wall,
                            **times,
                            **phases,
                            **{f"cpu_{k}_s": after[k] - before[k] for k in procs},
                        }
                    )
            for role, (raw, proc) in spies.items():
                proc.send_signal(2)  # py-spy writes its file on SIGINT
                proc.wait(timeout=120)
                profiles[role] = top_frames(raw) if raw.exists() else []
        finally:
            driver.close()
    summary = {t: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for t, rs in rows.items()}
    print(f"\n{snap.total_bytes / pe.MiB:.1f} MiB in {len(payloads)} buckets, medians of {args.reps}:")
    keys = [k for k in summary["http"] if k.startswith("cpu_") or k == "wall_s"]
    names = {k: k.removeprefix("cpu_").removesuffix("_s") for k in keys}
    widths = {k: max(12, len(names[k]) + 2) for k in keys}
    print(f"{'transport':11}" + "".join(f"{names[k]:>{widths[k]}}" for k in keys))
    for transport, s in summary.items():
        print(f"{transport:11}" + "".join(f"{s.get(k, float('nan')):{widths[k]}.3f}" for k in keys))
    print("(seconds: wall, then each process's CPU over the publication)")
    for transport, s in summary.items():
        engine_side = ", ".join(
            f"{k.removeprefix('engine_')} {s[k]:.0f}" for k in s if k.startswith("engine_")
        )
        phases = f"begin {s['begin_ms']:.0f}, buckets {s['buckets_ms']:.0f}, end {s['end_ms']:.0f} ms"
        print(f"{transport}: {phases}; engine side (ms): {engine_side}")
    for role, frames in profiles.items():
        print(f"\npy-spy, {role} (both transports, idle left out):")
        for f in frames:
            print(f"  {100 * f['share']:5.1f}%  {f['frames'][:120]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"adapter_bytes": snap.total_bytes, "rows": rows, "median": summary, "py_spy": profiles}, indent=2
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
