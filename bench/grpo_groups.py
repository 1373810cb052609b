"""G completions of one prompt, three ways, through the real smg gateway (issue 27).

A GRPO step samples G completions per prompt. On two CPU engines with the plugin on and one
managed version, each prompt's group of G = 8 is sent as:

* ``separate``: G sessions, each routed by its own key (what a session per completion did
  before): the group spreads over the engines and each engine prefills the prompt again;
* ``group``: G sessions opened with one ``group`` (``sessions.open(name, group=...)``): routed by
  the group's key, all on one engine, where the prompt is prefilled once;
* ``n``: one session, one request with ``n = G`` (``Session.sample``): SGLang prefills the prompt
  once and runs G samples.

Per way: prompt tokens the engines computed (prompt tokens minus those served from the KV cache,
as each reply's ``meta_info`` says), the cache-hit share, completions per second, and the p50 /
p95 latency of a whole group. Every completion's ``lora_path`` is the version bound. Each way uses
prompts no other way used (fresh in every cache), and the groups of one way run ``--concurrency``
at a time.

Each way runs on a cohort per engine schedule policy (``--policies``, default SGLang's ``fcfs``;
``fcfs,lpm`` also measures ``lpm``, whose in-batch prefix caching holds back a waiting request
that shares a prefix with another one; measured here it saved nothing more for a group).

Prints a table and writes ``bench/results/grpo_groups.json``.

    .venv/bin/python bench/grpo_groups.py [--groups 12] [--g 8] [--prompt-tokens 256]
                                          [--tokens 16] [--concurrency 4] [--policies fcfs,lpm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lora_versions_demo.local_cohort import local_cohort  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "grpo_groups.json"
WAYS = ("separate", "group", "n")


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(length)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def _one_group(sm: Any, way: str, gid: int, prompt: list[int], g: int, tokens: int) -> dict[str, Any]:
    params = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": params}
    t0 = time.monotonic()
    if way == "n":
        s = await sm.open(f"n{gid}")
        replies = await s.sample(body, g)
        sessions = [s]
    else:
        group = f"g{gid}" if way == "group" else None
        sessions = [await sm.open(f"{way}{gid}-{i}", group=group) for i in range(g)]
        # the members start together, as a rollout would: the first one's prefill is shared
        # only where the others land on its engine and arrive after its prompt is cached
        replies = await asyncio.gather(*(s.generate(body) for s in sessions))
    latency = time.monotonic() - t0
    engines = {r.engine_id for s in sessions for r in s.requests}
    lora = {r.lora_path for s in sessions for r in s.requests}
    for s in sessions:
        await s.close()
    # What each reply says it computed (prompt_tokens - cached_tokens). With n > 1, SGLang's
    # prefix request (which the client never sees) prefilled the whole prompt first, fresh in
    # every cache by construction, and the samples then report it cached: add it.
    prompt_tokens = sum(int(r["meta_info"]["prompt_tokens"]) for r in replies)
    cached = sum(int(r["meta_info"].get("cached_tokens") or 0) for r in replies)
    computed = prompt_tokens - cached + (len(prompt) if way == "n" else 0)
    return {
        "latency_s": latency,
        "engines": sorted(engines),
        "lora_paths": sorted(lora),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "computed_prompt_tokens": computed,
        "completions": len(replies),
    }


async def _run_way(
    sm: Any, way: str, groups: int, g: int, prompt_tokens: int, tokens: int, conc: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(f"{seed}-{way}")
    prompts = [_prompt(rng, prompt_tokens) for _ in range(groups)]
    sem = asyncio.Semaphore(conc)

    async def run(i: int) -> dict[str, Any]:
        async with sem:
            return await _one_group(sm, way, i, prompts[i], g, tokens)

    t0 = time.monotonic()
    rows = await asyncio.gather(*(run(i) for i in range(groups)))
    wall = time.monotonic() - t0
    lat = [r["latency_s"] for r in rows]
    return {
        "way": way,
        "groups": groups,
        "completions": sum(r["completions"] for r in rows),
        "completions_per_s": round(sum(r["completions"] for r in rows) / wall, 2),
        "group_latency_p50_s": round(statistics.median(lat), 3),
        "group_latency_p95_s": round(_pct(lat, 0.95), 3),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "computed_prompt_tokens": sum(r["computed_prompt_tokens"] for r in rows),
        "cache_hit_share": round(
            sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows), 3
        ),
        "prompt_computations_per_group": round(
            sum(r["computed_prompt_tokens"] for r in rows) / (groups * prompt_tokens), 2
        ),
        "engines_per_group": statistics.fmean(len(r["engines"]) for r in rows),
        "lora_paths": sorted({p for r in rows for p in r["lora_paths"]}),
        "wall_s": round(wall, 2),
    }


async def _bench(cohort: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from relax_glue.cohort import open_publisher
    from relax_glue.engine_client import EngineClient
    from relax_glue.gateway import GatewayClient
    from relax_glue.registry import LoRAVersionRegistry
    from relax_glue.sessions import SessionManager
    from relax_glue.snapshot import Snapshot

    reg = LoRAVersionRegistry("groups", cohort.ids)
    clients = {e.name: EngineClient(e.name, e.url, admin_key=cohort.admin_key) for e in cohort.engines}
    gw = GatewayClient(cohort.gateway_url, clients)
    sm = SessionManager(reg, clients, gateway=gw, lease_ttl_s=None)
    try:
        snap = Snapshot.from_peft_dir(cohort.fixtures.adapter_dir("A"))
        assert (await open_publisher(reg, clients).publish(snap, "A")).ok
        for way in WAYS:  # warm-up, untimed: the engines' first batches of each shape are slow
            await _run_way(
                sm, way, 2, args.g, args.prompt_tokens, args.tokens, args.concurrency, -1 - args.seed
            )
        out = []
        for way in WAYS:
            row = await _run_way(
                sm, way, args.groups, args.g, args.prompt_tokens, args.tokens, args.concurrency, args.seed
            )
            assert len(row["lora_paths"]) == 1, row  # every completion on the one bound version
            out.append(row)
            print(f"[groups] {way}: {row}", flush=True)
        return out
    finally:
        await sm.close_all()
        await gw.aclose()
        for c in clients.values():
            await c.aclose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policies",
        default="fcfs",
        help="SGLang --schedule-policy of the engines, one cohort each (comma-separated)",
    )
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for policy in args.policies.split(","):
        with (
            tempfile.TemporaryDirectory(prefix="grpo-groups-") as tmp,
            local_cohort(Path(tmp), 2, "groups", engine_args=["--schedule-policy", policy]) as cohort,
        ):
            rows += [{"schedule_policy": policy, **r} for r in asyncio.run(_bench(cohort, args))]
    header = (
        "schedule policy",
        "way",
        "computed prompt tokens",
        "prompt computations / group",
        "cache hits",
        "completions/s",
        "group p50 / p95 s",
        "engines / group",
    )
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print(
            f"| {r['schedule_policy']} | {r['way']} | {r['computed_prompt_tokens']:,} | "
            f"{r['prompt_computations_per_group']} | "
            f"{r['cache_hit_share']:.0%} | {r['completions_per_s']} | {r['group_latency_p50_s']} / "
            f"{r['group_latency_p95_s']} | {r['engines_per_group']:.2f} |"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps({"args": vars(args), "rows": rows, "machine": platform.platform()}, indent=2)
    )
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
