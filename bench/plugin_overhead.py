"""What the plugin costs generation: throughput with the plugin on against off, with a
confidence interval, and the in-process cost of its request hooks.

Real CPU engines with the same model and the same flags, started together:

* ``on0``, ``on1``, ...:   the plugin on; requests name a managed version of adapter A (published
  staged);
* ``off0``, ``off1``, ...: stock SGLang (plugin off); requests name adapter A loaded by
  ``/load_lora_adapter``;
* ``timed``: the plugin on with ``SGLANG_LORA_VERSIONS_HOOK_TIMING=1`` (every hook wrapped in a
  timer, ``sglang_ext/hook_timing.py``), used only for the hook cost, never for throughput.

Throughput: many short phases of the same closed-loop load (``--clients`` concurrent clients,
each sending ``/generate`` of ``--tokens`` tokens with the next prompt as soon as the last
returned), one engine at a time, in ABBA order (on, off, off, on, then off, on, on, off, ...)
so drift and warm-up hit both alike; successive cycles use the next (on, off) pair of instances,
because two processes of the same build differ by several per cent here (seen: a 3-engine run
gave a mean ratio of 1.07, the next one 0.96). Per cycle, ratio = tokens/s on / tokens/s off;
reported: the mean ratio with a 95% t-interval over the cycles, the median, the spread, and the
mean per pair of instances.

Hook cost: the same load on ``timed``; the hooks' own time (the time in the hook minus the time
in the upstream function it wraps) summed over the phase, per request, against the median
request time. The tiny model makes requests short, so the relative cost is a worst case.

Prints a table and writes ``bench/results/plugin_overhead.json``.

    .venv/bin/python bench/plugin_overhead.py [--cycles 16] [--phase-s 6] [--clients 4] [--tokens 16]
                                              [--instances 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from publish_engine import Driver  # noqa: E402

from lora_contract.protocol import Routes  # noqa: E402
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402
from relax_glue.snapshot import Snapshot  # noqa: E402
from sglang_ext.settings import HOOK_TIMING_ENV  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "plugin_overhead.json"
STOCK_NAME = "bench-A"
PROMPTS = [
    [302, 356, 417, 494, 439],
    [2, 87, 82, 293, 202, 90, 72, 492, 313],
    [461, 275, 29, 446, 27, 224, 38, 15],
    [288, 79, 82, 88, 71, 92, 3, 202],
]


async def phase(url: str, lora: str, clients: int, tokens: int, seconds: float) -> dict[str, Any]:
    """A closed-loop load for ``seconds``; only requests that both start and end inside count."""
    latencies: list[float] = []
    out_tokens = 0
    failed = 0
    prompts = itertools.cycle(PROMPTS)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        t0 = time.perf_counter()
        stop = t0 + seconds

        async def client() -> None:
            nonlocal out_tokens, failed
            while time.perf_counter() < stop:
                body = {
                    "input_ids": next(prompts),
                    "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
                    "lora_path": lora,
                }
                s = time.perf_counter()
                r = await http.post("/generate", json=body)
                e = time.perf_counter()
                if r.status_code != 200:
                    failed += 1
                    continue
                if e <= stop:
                    latencies.append(e - s)
                    out_tokens += len(r.json()["output_ids"])

        await asyncio.gather(*(client() for _ in range(clients)))
    return {
        "requests": len(latencies),
        "tokens": out_tokens,
        "failed": failed,
        "tokens_per_s": out_tokens / seconds,
        "median_latency_ms": statistics.median(latencies) * 1e3 if latencies else None,
    }


def t_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and the two-sided t-interval of the mean."""
    from scipy import stats

    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1 + level) / 2, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half


def hook_timing(url: str) -> dict[str, dict[str, float]]:
    r = httpx.get(f"{url}{Routes.HOOK_TIMING}", timeout=10)
    r.raise_for_status()
    return r.json()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=16, help="ABBA cycles (4 phases each)")
    p.add_argument("--phase-s", type=float, default=6.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument(
        "--instances", type=int, default=2, help="engines per side, taking turns (instance effects)"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    t_start = time.monotonic()
    fx = ensure_fixtures()
    run_dir = ROOT / ".runs" / f"bench-overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    pairs = [(f"on{i}", f"off{i}") for i in range(args.instances)]
    specs = [
        EngineSpec(name=n, model_path=fx.model_dir, log_path=run_dir / f"{n}.log", plugin=n.startswith("on"))
        for pair in pairs
        for n in pair
    ] + [
        EngineSpec(
            name="timed", model_path=fx.model_dir, log_path=run_dir / "timed.log", env={HOOK_TIMING_ENV: "1"}
        ),
    ]
    snap = Snapshot.from_peft_dir(fx.adapter_dir("A"))
    payloads = list(snap.iter_buckets())
    print(f"starting {len(specs)} engines (logs in {run_dir}) ...", flush=True)
    with running_engines(specs) as engines:
        by = {e.name: e for e in engines}
        lora: dict[str, str] = {}
        for name in by:
            if name.startswith("off"):
                r = httpx.post(
                    f"{by[name].url}/load_lora_adapter",
                    json={"lora_name": STOCK_NAME, "lora_path": str(fx.adapter_dir("A"))},
                    timeout=120,
                )
                r.raise_for_status()
                lora[name] = STOCK_NAME
            else:
                d = Driver(by[name].url)
                _, lora[name], _ = d.staged(snap, payloads)  # READY, pinned, probed; kept for the run
                d.close()

        def run(name: str, seconds: float) -> dict[str, Any]:
            return asyncio.run(phase(by[name].url, lora[name], args.clients, args.tokens, seconds))

        for name in by:  # warm-up: first LoRA batches, allocator, caches
            run(name, 2.0)
        cycles: list[dict[str, Any]] = []
        for c in range(args.cycles):
            # engine instances take turns: an instance's own speed (which differs by several per
            # cent between two processes of the same build here) is spread over both sides
            on, off = pairs[c % len(pairs)]
            order = ["on", "off", "off", "on"] if (c // len(pairs)) % 2 == 0 else ["off", "on", "on", "off"]
            got: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            for side in order:
                got[side].append(run(on if side == "on" else off, args.phase_s))
            tput = {k: sum(x["tokens"] for x in v) / (len(v) * args.phase_s) for k, v in got.items()}
            cycle = {
                "engines": [on, off],
                "order": order,
                "tokens_per_s": tput,
                "ratio": tput["on"] / tput["off"],
                "median_latency_ms": {
                    k: statistics.median(x["median_latency_ms"] for x in v) for k, v in got.items()
                },
                "failed": sum(x["failed"] for v in got.values() for x in v),
            }
            cycles.append(cycle)
            print(
                f"  cycle {c + 1}/{args.cycles}: on {tput['on']:.1f} tok/s, off {tput['off']:.1f} tok/s,"
                f" ratio {cycle['ratio']:.4f}",
                flush=True,
            )
        # hook cost on the timed engine under the same load
        before = hook_timing(by["timed"].url)
        timed = run("timed", args.phase_s * 2)
        after = hook_timing(by["timed"].url)

    ratios = [c["ratio"] for c in cycles]
    by_pair = {
        f"{on}/{off}": statistics.fmean(c["ratio"] for c in cycles if c["engines"] == [on, off])
        for on, off in pairs
        if any(c["engines"] == [on, off] for c in cycles)
    }
    mean, lo, hi = t_interval(ratios)
    per_hook = {}
    for name, a in after.items():
        b = before.get(name, {"calls": 0, "own_ns": 0})
        calls, own = a["calls"] - b["calls"], a["own_ns"] - b["own_ns"]
        if calls:
            per_hook[name] = {
                "calls": calls,
                "mean_us": own / calls / 1e3,
                "per_request_us": own / 1e3 / timed["requests"],
            }
    hook_us = sum(h["per_request_us"] for h in per_hook.values())
    median_ms = statistics.median(c["median_latency_ms"]["on"] for c in cycles)
    summary = {
        "ratio_mean": mean,
        "ratio_ci95": [lo, hi],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_stdev": statistics.stdev(ratios) if len(ratios) > 1 else None,
        "ratio_by_engine_pair": by_pair,
        "ci_above_0_99": bool(lo > 0.99),
        "hook_us_per_request": hook_us,
        "median_request_ms_on": median_ms,
        "hook_share_of_request": hook_us / 1e3 / median_ms,
        "failed_requests": sum(c["failed"] for c in cycles) + timed["failed"],
    }

    print(
        f"\nthroughput, plugin on / off ({args.cycles} ABBA cycles of 4 x {args.phase_s:.0f} s, "
        f"{args.clients} clients, {args.tokens} tokens per request)"
    )
    print(f"{'cycle':>5} {'engines':>10} {'on tok/s':>9} {'off tok/s':>9} {'ratio':>7}")
    for i, c in enumerate(cycles):
        print(
            f"{i + 1:5d} {'/'.join(c['engines']):>10} {c['tokens_per_s']['on']:9.1f}"
            f" {c['tokens_per_s']['off']:9.1f} {c['ratio']:7.4f}"
        )
    print(
        f"ratio mean {mean:.4f}, 95% CI [{lo:.4f}, {hi:.4f}], median {summary['ratio_median']:.4f},"
        f" min {min(ratios):.4f}, max {max(ratios):.4f}"
    )
    print("mean ratio by engine pair: " + ", ".join(f"{k} {v:.4f}" for k, v in by_pair.items()))
    print(f"\nhook cost per request (own time, in the engine's main process; {timed['requests']} requests)")
    print(f"{'hook':42} {'calls':>7} {'mean us':>8} {'us/request':>10}")
    for name, h in sorted(per_hook.items(), key=lambda kv: -kv[1]["per_request_us"]):
        print(f"{name:42} {h['calls']:7d} {h['mean_us']:8.2f} {h['per_request_us']:10.2f}")
    print(
        f"total {hook_us:.1f} us per request = {100 * summary['hook_share_of_request']:.3f}% of the median"
        f" request time ({median_ms:.1f} ms, plugin on)"
    )
    import sglang

    out = {
        "meta": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": platform.python_version(),
            "sglang": sglang.__version__,
            "cpus": os.cpu_count(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "run_time_s": round(time.monotonic() - t_start, 1),
            "engine_logs": str(run_dir),
        },
        "summary": summary,
        "cycles": cycles,
        "hooks": per_hook,
        "timed_phase": timed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nrun time {out['meta']['run_time_s']}s; wrote {args.out}")
    return 1 if summary["failed_requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
