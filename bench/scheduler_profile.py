"""Where the scheduler process spends a managed publication and a reclaim (issue 29: profile first).

One real CPU engine on the bench's large base (``bench/_bench_fixtures.py``), plugin on, no other
traffic. For each adapter size (``--sizes`` MiB), ``--rounds`` publications through the real
publisher (begin -> buckets -> end: load pinned + exact-version probe) each followed by the
reclaim of the version it retired (the physical unload), while py-spy samples the engine's
scheduler process. With no other traffic every forward the scheduler runs is a probe, so each
sample falls in one window by its stack: ``load`` (``Scheduler.load_lora_adapter``), ``unload``
(``Scheduler.unload_lora_adapter``), ``probe`` (a forward), or ``idle``. Inside the load and
unload windows the top frames say which part is the work itself (reading and copying weights into
the slot), which is SGLang's overhead, and which is the plugin's.

The scheduler thread's time per load and per unload (``held_ms``: its samples in that window /
rate / SGLang's loads or unloads, counted from the engine log) is what decoding waits for; the
plugin's worker thread (issue 29) is counted apart, as ``prepare (worker thread)`` and ``release
(worker thread)``.

Prints a table per size and writes ``bench/results/scheduler_profile.json`` (the raw py-spy files
beside it). Not run in CI (minutes, and a 350 MiB adapter).

    python bench/scheduler_profile.py [--sizes 1,27,350] [--rounds 3] [--rate 250] [--tp 1,2]

With ``--tp 1,2`` the same publications run on a TP=1 engine and then on a TP=2 engine (issue
38), each rank's scheduler process sampled by its own py-spy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _bench_fixtures import ensure_bench_fixtures, ensure_sized_adapters, rank_for_mib  # noqa: E402
from _profiling import engine_processes, raw_stacks  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "scheduler_profile.json"
ADMIN_KEY = "scheduler-profile"

# A sample's window, by the first of these whose needle its stack holds (innermost frames decide
# the leaf summary; the window is the scheduler entry point the sample runs under). py-spy samples
# every thread of the process: the two worker windows are the plugin's worker thread (issue 29:
# the reading and re-shaping of a load, the release of an unloaded adapter), checked first; every
# other window is the scheduler thread itself. The plugin's hook frames are named too: an AROUND
# wrapper's frame is not named after the method it wraps.
WINDOWS = (
    ("prepare (worker thread)", ("prepare_off_the_loop",)),
    ("release (worker thread)", ("release_off_the_loop",)),
    ("unload", ("unload_lora_adapter", "complete_the_step_before_unload", "unload_releasing_off_the_loop")),
    ("load", ("load_lora_adapter", "prepare_then_install", "load_installing_what_was_prepared")),
    ("probe", ("run_batch",)),
)
# The scheduler thread's windows, whose time the scheduler is held (decoding waits).
HELD = ("load", "unload")
# SGLang's own log lines, one per load and per unload (counted to turn samples into ms per op).
LOAD_LINE, UNLOAD_LINE = "LoRA adapter loading starts", "LoRA adapter unloading starts"
# Whose Python frame a load/unload sample's innermost frame is (py-spy samples Python stacks: a
# torch op shows as the frame that called it, so "sglang" includes the tensor work its LoRA code
# does, such as fusing q/k/v and gate/up, copying into and zeroing the slot).
OWNERS = (
    ("plugin (sglang_ext)", "sglang_ext/"),
    ("torch (Python frames)", "torch/"),
    ("safetensors (reading the files)", "safetensors"),
    ("sglang (its LoRA code and the torch ops it calls)", "sglang/"),
)


def scheduler_pids(engine_pid: int, tp: int) -> dict[int, int]:
    """The engine's scheduler process of each TP rank (SGLang titles it ``sglang::scheduler``,
    ``sglang::scheduler_TP<rank>`` with several ranks)."""
    processes = engine_processes("engine", engine_pid)
    roles = {0: "engine scheduler"} if tp == 1 else {r: f"engine scheduler_TP{r}" for r in range(tp)}
    missing = [role for role in roles.values() if role not in processes]
    if missing:
        raise RuntimeError(f"no {missing} under pid {engine_pid}")
    return {rank: processes[role].pid for rank, role in roles.items()}


def count_lines(log: Path, needle: str, rank: int | None) -> int:
    """Lines with ``needle``; of one TP rank's scheduler when ``rank`` is set (SGLang's prefix ``TP<r>]``)."""
    tag = None if rank is None else f" TP{rank}]"
    lines = log.read_text(errors="replace").splitlines()
    return sum(1 for line in lines if needle in line and (tag is None or tag in line))


def operations(log: Path, rank: int | None = None) -> dict[str, int]:
    """SGLang's loads and unloads so far ("adapter loading" is not a part of "adapter unloading")."""
    return {"load": count_lines(log, LOAD_LINE, rank), "unload": count_lines(log, UNLOAD_LINE, rank)}


def held_ms(report: dict[str, Any], rate: int) -> dict[str, float]:
    """Milliseconds per load and per unload that the scheduler thread spent in that window
    (samples / rate / operations), and the worker's preparation per load."""
    w, ops = report["windows"], report["operations"]
    out = {k: 1e3 * w.get(k, 0) / rate / max(1, ops[k]) for k in HELD}
    out["prepare_off_loop"] = 1e3 * w.get("prepare (worker thread)", 0) / rate / max(1, ops["load"])
    return {k: round(v, 1) for k, v in out.items()}


def summarise(raw: Path) -> dict[str, Any]:
    windows: dict[str, int] = defaultdict(int)
    leaves: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    owners: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    total = 0
    for frames, n in raw_stacks(raw):
        total += n
        window = next((w for w, needles in WINDOWS if any(n in f for n in needles for f in frames)), "idle")
        windows[window] += n
        if window in ("load", "unload"):
            leaves[window][frames[-1]] += n
            owner = next(
                (o for f in reversed(frames) for o, needle in OWNERS if needle in f), "other (python, os)"
            )
            owners[window][owner] += n
    out: dict[str, Any] = {"samples": total, "windows": {k: v for k, v in sorted(windows.items())}}
    for w in ("load", "unload"):
        n_w = windows.get(w, 0) or 1
        out[w] = {
            "by_owner": {k: round(v / n_w, 3) for k, v in sorted(owners[w].items(), key=lambda kv: -kv[1])},
            "top_frames": [
                {"frame": f, "share": round(c / n_w, 3)}
                for f, c in sorted(leaves[w].items(), key=lambda kv: -kv[1])[:8]
            ],
        }
    return out


async def publish_and_reclaim(url: str, adapter: Path, rounds: int) -> list[dict[str, float]]:
    """``rounds`` publications of ``adapter``, each followed by the reclaim of the one it retired;
    its own epoch, and everything it published removed at the end (capacity stays free)."""
    from lora_versions_dev.teardown import purge
    from relax_glue.cohort import open_publisher
    from relax_glue.engine_client import EngineClient
    from relax_glue.publisher import PublishOutcome
    from relax_glue.registry import LoRAVersionRegistry
    from relax_glue.snapshot import Snapshot

    snap = Snapshot.from_peft_dir(adapter)
    epoch = f"prof{time.monotonic_ns()}"
    client = EngineClient("E0", url, admin_key=ADMIN_KEY)
    pub = open_publisher(LoRAVersionRegistry(epoch, ("E0",), 2), {"E0": client})
    timings = []
    try:
        for i in range(rounds + 1):  # the first retires nothing
            t0 = time.monotonic()
            res = await pub.publish(snap, f"v{i}")
            assert res.outcome is PublishOutcome.PUBLISHED, res
            t1 = time.monotonic()
            done = await pub.reclaim_ready()
            assert all(r.done for r in done), done
            if i:
                timings.append({"publish_s": t1 - t0, "reclaim_s": time.monotonic() - t1})
        left = await purge({"E0": client}, marker=f"@{epoch}-")
        assert not left, left
    finally:
        await client.aclose()
    return timings


def start_spy(pid: int, raw: Path, rate: int) -> subprocess.Popen[str]:
    spy_exe = str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen(
        [
            spy_exe,
            *("record", "--pid", str(pid), "--format", "raw", "--output", str(raw)),
            *("--rate", str(rate), "--idle", "--nonblocking", "--full-filenames"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_spy(spy: subprocess.Popen[str], raw: Path) -> None:
    spy.send_signal(2)  # py-spy writes its file on SIGINT
    _, err = spy.communicate(timeout=120)
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err[-800:]}")


def profile_engine(spec: Any, tp: int, sizes: list[float], adapters: dict, args: Any, run_dir: Path) -> dict:
    """One engine: per adapter size, the publications' timings and each rank's scheduler profile."""
    from lora_versions_dev.launcher import running_engines

    out: dict[str, Any] = {}
    with running_engines([spec]) as (engine,):
        pids = scheduler_pids(engine.proc.pid, tp)
        asyncio.run(publish_and_reclaim(engine.url, adapters[sizes[0]], 1))  # warm-up, not sampled
        for mib in sizes:
            raws = {rank: run_dir / f"scheduler-tp{tp}-rank{rank}-{mib:g}MiB.txt" for rank in pids}
            spies = {rank: start_spy(pid, raws[rank], args.rate) for rank, pid in pids.items()}
            time.sleep(1.0)
            rank_of = (lambda r: None) if tp == 1 else (lambda r: r)
            before = {rank: operations(spec.log_path, rank_of(rank)) for rank in pids}
            timings = asyncio.run(publish_and_reclaim(engine.url, adapters[mib], args.rounds))
            time.sleep(0.5)
            after = {rank: operations(spec.log_path, rank_of(rank)) for rank in pids}
            ranks: dict[str, Any] = {}
            for rank, spy in spies.items():
                stop_spy(spy, raws[rank])
                ops = {k: after[rank][k] - before[rank][k] for k in after[rank]}
                r = {"operations": ops, **summarise(raws[rank])}
                r["held_ms"] = held_ms(r, args.rate)
                ranks[str(rank)] = r
            out[f"{mib:g}"] = {"timings": timings, "ranks": ranks}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,27", help="adapter sizes in MiB (350 takes minutes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes, comma separated (e.g. 1,2)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from lora_versions_dev.launcher import EngineSpec, lora_flags

    sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
    tps = [int(x) for x in args.tp.split(",") if x.strip()]
    big = ensure_bench_fixtures()
    adapters = ensure_sized_adapters(big, sizes)
    run_dir = args.out.parent / "scheduler_profile"
    run_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"base": str(big.model_dir), "rounds": args.rounds, "rate": args.rate, "tp": {}}
    for tp in tps:
        spec = EngineSpec(
            name=f"profiled-tp{tp}",
            model_path=big.model_dir,
            log_path=run_dir / f"engine-tp{tp}.log",
            lora_flags=lora_flags(max(rank_for_mib(m) for m in sizes)),
            extra_args=["--admin-api-key", ADMIN_KEY, "--mem-fraction-static", "0.5"],
            tp=tp,
        )
        report["tp"][str(tp)] = profile_engine(spec, tp, sizes, adapters, args, run_dir)
    args.out.write_text(json.dumps(report, indent=2))
    print_report(report)


def median_ms(timings: list[dict[str, float]], key: str) -> float:
    values = sorted(t[key] for t in timings)
    return round(1e3 * values[len(values) // 2], 1) if values else float("nan")


def print_report(report: dict[str, Any]) -> None:
    from relax_glue.cli import table

    rows = []
    for tp, sizes in report["tp"].items():
        for size, r in sizes.items():
            for rank, rr in r["ranks"].items():
                held, ops = rr["held_ms"], rr["operations"]
                rows.append(
                    [
                        tp,
                        size,
                        median_ms(r["timings"], "publish_s"),
                        median_ms(r["timings"], "reclaim_s"),
                        rank,
                        f"{held['load']} ({ops['load']})",
                        f"{held['unload']} ({ops['unload']})",
                        held["prepare_off_loop"],
                    ]
                )
    header = [
        "tp",
        "MiB",
        "publish ms",
        "reclaim ms",
        "rank",
        "held/load ms (n)",
        "held/unload ms (n)",
        "prep ms",
    ]
    print(f"\n{report['rounds']} publications + reclaims per row (medians); scheduler thread per rank:")
    print(table(header, rows))
    for tp, sizes in report["tp"].items():
        for size, r in sizes.items():
            for rank, rr in r["ranks"].items():
                print(f"\ntp {tp}, {size} MiB, rank {rank}:")
                for window in ("load", "unload"):
                    owners = ", ".join(f"{k} {v:.0%}" for k, v in rr[window]["by_owner"].items())
                    print(f"  {window}: {owners}")
                    for f in rr[window]["top_frames"][:3]:
                        print(f"    {f['share']:>5.0%}  {f['frame'][:100]}")


if __name__ == "__main__":
    main()
