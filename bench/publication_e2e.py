"""Publishing a new LoRA version under live traffic: versioned publication vs pause + flush + overwrite.

Two real CPU engines E0/E1 (plugin on), started in parallel. The same closed-loop agent load runs
in four phases of equal length, one after the other in this one run:

* ``versioned, no publication``: K workers, each running sessions of T streamed turns (every
  turn's prompt is the session's history plus a tool result); sessions bind the default version
  through the real session layer and carry its exact ``lora_path``.
* ``versioned publication``: the same load while the publisher publishes a new immutable version
  every few seconds (reserve -> begin -> ordered buckets -> end -> commit on both engines) and the
  reclaimer unloads retired versions once their sessions have ended. No pause, no flush.
* ``fixed name, no update``: the same load on one unmanaged adapter name (``policy``), loaded
  with stock ``/load_lora_adapter`` -- how RL frameworks serve a LoRA today.
* ``pause + flush + overwrite``: the same load while, every few seconds, both engines get
  ``/pause_generation`` (SGLang's default mode: abort what runs), ``/flush_cache``,
  ``/unload_lora_adapter`` + ``/load_lora_adapter`` of the new weights under the SAME name, and
  ``/continue_generation``.

Reported per phase: update latency (reserve->commit, or pause->continue), request latency
p50/p95/p99, failed requests (and those overlapping an update), the largest gap between two
tokens of one stream (overall and overlapping an update), and the largest interval in which an
engine produced no token at all. Prints a table, writes ``bench/results/publication_e2e.json``.

    .venv/bin/python bench/publication_e2e.py [--duration 30] [--workers 8] [--turns 2] [--interval 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from lora_contract import protocol as wire  # noqa: E402
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402
from relax_glue.cohort import open_publisher  # noqa: E402
from relax_glue.engine_client import EngineClient, forbidden_calls  # noqa: E402
from relax_glue.publisher import Publisher, PublishOutcome  # noqa: E402
from relax_glue.registry import LoRAVersionRegistry  # noqa: E402
from relax_glue.sessions import SessionManager  # noqa: E402
from relax_glue.snapshot import Snapshot  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "publication_e2e.json"
EPOCH = "bench"
COHORT = ("E0", "E1")
FIXED_NAME = "policy"
PROMPTS: tuple[tuple[int, ...], ...] = (
    (302, 356, 417, 494, 439),
    (2, 87, 82, 293, 202, 90, 72, 492, 313),
    (461, 275, 29, 446, 27, 224, 38, 15),
    (288, 79, 82, 88, 71, 92, 3, 202),
)
TOOL_IDS: tuple[int, ...] = (2, 87, 82, 293, 202, 90, 72, 492, 313, 461, 275, 29, 446, 27, 3, 202)
MAX_PREFIX = 96


def _now() -> float:
    return time.monotonic()


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


# ------------------------------------------------------------------------------------ load


@dataclasses.dataclass
class Req:
    worker: int
    engine: str
    start: float
    chunks: list[float] = dataclasses.field(default_factory=list)
    end: float = 0.0
    ok: bool = False
    failure: str = ""


class Sess:
    """What a worker needs from a session: stream one turn, know its engine, close."""

    engine: str

    def stream(self, body: dict[str, Any]) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class ManagedSess(Sess):
    def __init__(self, sm: SessionManager, session: Any) -> None:
        self.sm, self.s = sm, session
        self.engine = "?"

    def stream(self, body: dict[str, Any]) -> Any:
        return self.s.generate_stream(body)

    def after_first_chunk(self) -> None:
        self.engine = self.sm.router.pick(self.s.key)

    async def close(self) -> None:
        await self.s.close()


class WorkerRouter:
    """Worker i always runs on engine i % 2, in every phase: the same load on each engine."""

    def pick(self, session_key: Any) -> str:
        worker = int(str(session_key[1]).split(".", 1)[0].lstrip("w"))
        return COHORT[worker % len(COHORT)]

    def forget(self, session_key: Any) -> None:
        return None


class FixedSess(Sess):
    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.engine = client.engine_id

    def stream(self, body: dict[str, Any]) -> Any:
        return self.client.generate_stream({**body, "lora_path": FIXED_NAME})


async def run_load(
    open_session: Callable[[int], Awaitable[Sess]], workers: int, turns: int, tokens: int, t_end: float
) -> list[Req]:
    reqs: list[Req] = []

    async def worker(i: int) -> None:
        while _now() < t_end:
            sess = await open_session(i)
            prefix = list(PROMPTS[i % len(PROMPTS)])
            try:
                for _ in range(turns):
                    if _now() >= t_end:
                        break
                    req = Req(i, sess.engine, _now())
                    reqs.append(req)
                    out: list[int] = []
                    finish = None
                    try:
                        async for chunk in sess.stream(
                            {
                                "input_ids": prefix,
                                "sampling_params": {
                                    "temperature": 0,
                                    "max_new_tokens": tokens,
                                    "ignore_eos": True,
                                },
                            }
                        ):
                            req.chunks.append(_now())
                            if len(req.chunks) == 1:
                                if isinstance(sess, ManagedSess):
                                    sess.after_first_chunk()
                                req.engine = sess.engine
                            out = list(chunk.get("output_ids") or out)
                            finish = (chunk.get("meta_info") or {}).get("finish_reason")
                        if finish and finish.get("type") == "abort":
                            req.failure = "aborted"
                        else:
                            req.ok = len(out) == tokens
                            req.failure = "" if req.ok else f"short:{len(out)}"
                    except Exception as exc:  # a failed request is data here, not a crash
                        req.failure = f"{type(exc).__name__}:{getattr(exc, 'code', '') or exc}"[:160]
                    req.end = _now()
                    prefix = [*prefix, *out, *TOOL_IDS][-MAX_PREFIX:]
            finally:
                with contextlib.suppress(Exception):
                    await sess.close()

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return reqs


# --------------------------------------------------------------------------------- updates


@dataclasses.dataclass
class Update:
    kind: str
    lo: float
    hi: float
    ok: bool
    info: dict[str, Any]


async def versioned_updates(
    pub: Publisher,
    reg: LoRAVersionRegistry,
    snaps: list[Snapshot],
    t_start: float,
    t_end: float,
    interval: float,
) -> tuple[list[Update], list[Update], int]:
    pubs: list[Update] = []
    reclaims: list[Update] = []
    max_slots = reg.status().slots_used
    k = 0
    await asyncio.sleep(max(0.0, t_start - _now()))
    while _now() + 1.0 < t_end:
        # capacity: the version retired by the previous publication is reclaimed once its
        # sessions have ended (sessions are short: a few turns each)
        while reg.status().slots_used >= reg.capacity and _now() + 1.0 < t_end:
            lo = _now()
            done = await pub.reclaim_ready(deadline_s=1.0)
            if done:
                reclaims.append(
                    Update(
                        "reclaim",
                        lo,
                        _now(),
                        all(r.done for r in done),
                        {"versions": [r.lora_name for r in done]},
                    )
                )
            if reg.status().slots_used >= reg.capacity:
                await asyncio.sleep(0.2)
        if _now() + 1.0 >= t_end:
            break
        k += 1
        lo = _now()
        res = await pub.publish(snaps[k % len(snaps)], f"v{k}")
        hi = _now()
        max_slots = max(max_slots, reg.status().slots_used)
        pubs.append(
            Update(
                "publish",
                lo,
                hi,
                res.outcome is PublishOutcome.PUBLISHED,
                {
                    "version": f"v{k}",
                    "outcome": res.outcome.value,
                    "reserve_to_commit_ms": round(1000 * sum(res.phase_s.values()), 1),
                    "phase_ms": {p: round(1000 * s, 1) for p, s in res.phase_s.items()},
                },
            )
        )
        await asyncio.sleep(interval)
    return pubs, reclaims, max_slots


async def overwrite_updates(
    http: httpx.AsyncClient,
    urls: dict[str, str],
    dirs: list[Path],
    t_start: float,
    t_end: float,
    interval: float,
) -> list[Update]:
    out: list[Update] = []
    k = 0
    await asyncio.sleep(max(0.0, t_start - _now()))

    async def one(url: str, adapter_dir: Path) -> dict[str, Any]:
        steps: dict[str, Any] = {}
        for step, method, path, body in (
            ("pause", "POST", "/pause_generation", {}),
            ("flush", "POST", "/flush_cache", None),
            ("unload", "POST", "/unload_lora_adapter", {"lora_name": FIXED_NAME}),
            ("load", "POST", "/load_lora_adapter", {"lora_name": FIXED_NAME, "lora_path": str(adapter_dir)}),
            ("continue", "POST", "/continue_generation", {}),
        ):
            t = _now()
            r = await http.request(method, url + path, json=body)
            steps[step] = {"status": r.status_code, "ms": round(1000 * (_now() - t), 1)}
        return steps

    while _now() + 1.0 < t_end:
        k += 1
        lo = _now()
        adapter_dir = dirs[k % len(dirs)]
        steps = await asyncio.gather(*(one(u, adapter_dir) for u in urls.values()))
        hi = _now()
        ok = all(s["status"] == 200 for st in steps for name, s in st.items() if name != "flush")
        out.append(
            Update(
                "overwrite",
                lo,
                hi,
                ok,
                {
                    "adapter": adapter_dir.name,
                    "pause_to_continue_ms": round(1000 * (hi - lo), 1),
                    "engines": dict(zip(urls, steps, strict=True)),
                },
            )
        )
        await asyncio.sleep(interval)
    return out


# ---------------------------------------------------------------------------------- summary


def _overlaps(a: float, b: float, windows: Sequence[Update]) -> bool:
    return any(b >= w.lo and a <= w.hi for w in windows)


def summarize(
    name: str, reqs: list[Req], updates: list[Update], lo: float, hi: float, reclaims: Sequence[Update] = ()
) -> dict[str, Any]:
    # token metrics: every stream's tokens inside the window (also of requests started before it);
    # request metrics: requests started inside the window
    streams = reqs
    reqs = [r for r in reqs if lo <= r.start <= hi and r.end > 0]
    lat = [r.end - r.start for r in reqs if r.ok]
    ttft = [r.chunks[0] - r.start for r in reqs if r.ok and r.chunks]
    gaps, gaps_upd, gaps_rec = [], [], []
    for r in streams:
        for a, b in itertools.pairwise(r.chunks):
            if b < lo or a > hi:
                continue
            gaps.append(b - a)
            if _overlaps(a, b, updates):
                gaps_upd.append(b - a)
            if _overlaps(a, b, reclaims):
                gaps_rec.append(b - a)
    no_progress: dict[str, float] = {}
    for engine in COHORT:
        ts = sorted(t for r in streams if r.engine == engine for t in r.chunks if lo <= t <= hi)
        pts = [lo, *ts, hi]
        no_progress[engine] = max((b - a for a, b in itertools.pairwise(pts)), default=0.0)
    failed = [r for r in reqs if not r.ok]
    upd_lat = [u.info.get("reserve_to_commit_ms") or u.info.get("pause_to_continue_ms") for u in updates]
    return {
        "phase": name,
        "window_s": round(hi - lo, 1),
        "updates": len(updates),
        "updates_ok": sum(u.ok for u in updates),
        "update_ms_p50": statistics.median(upd_lat) if upd_lat else None,
        "update_ms_max": max(upd_lat) if upd_lat else None,
        "requests": len(reqs),
        "tokens_in_window": sum(1 for r in streams for t in r.chunks if lo <= t <= hi),
        "tokens_per_s": round(sum(1 for r in streams for t in r.chunks if lo <= t <= hi) / (hi - lo), 1),
        "failed": len(failed),
        "failed_during_update": sum(1 for r in failed if _overlaps(r.start, r.end, updates)),
        "failure_kinds": sorted({r.failure for r in failed}),
        "latency_ms_p50": _ms(_pct(lat, 50)),
        "latency_ms_p95": _ms(_pct(lat, 95)),
        "latency_ms_p99": _ms(_pct(lat, 99)),
        "ttft_ms_p50": _ms(_pct(ttft, 50)),
        "max_decode_gap_ms": _ms(max(gaps, default=None)),
        "p99_decode_gap_ms": _ms(_pct(gaps, 99)),
        "max_gap_during_update_ms": _ms(max(gaps_upd, default=None)),
        "max_gap_during_reclaim_ms": _ms(max(gaps_rec, default=None)),
        "max_engine_no_progress_ms": {e: _ms(v) for e, v in no_progress.items()},
        "update_details": [
            {
                "kind": u.kind,
                "at_s": round(u.lo - lo, 2),
                "ms": round(1000 * (u.hi - u.lo), 1),
                "ok": u.ok,
                **u.info,
            }
            for u in updates
        ],
        "reclaims": len(reclaims),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("phase", "phase", 27),
        ("updates", "upd", 4),
        ("update_ms_p50", "upd p50", 8),
        ("update_ms_max", "upd max", 8),
        ("requests", "reqs", 5),
        ("tokens_per_s", "tok/s", 6),
        ("failed", "fail", 5),
        ("failed_during_update", "fail@upd", 9),
        ("latency_ms_p50", "lat p50", 8),
        ("latency_ms_p95", "lat p95", 8),
        ("latency_ms_p99", "lat p99", 8),
        ("max_decode_gap_ms", "max gap", 8),
        ("max_gap_during_update_ms", "gap@upd", 8),
        ("max_engine_no_progress_ms", "no-progress E0/E1", 18),
    ]
    print("\n" + " ".join(h.rjust(w) if i else h.ljust(w) for i, (_, h, w) in enumerate(cols)))
    print("-" * (sum(w for *_, w in cols) + len(cols) - 1))
    for r in rows:
        cells = []
        for i, (key, _, w) in enumerate(cols):
            v = r.get(key)
            if isinstance(v, dict):
                v = "/".join("-" if x is None else f"{x:.0f}" for x in v.values())
            elif isinstance(v, float):
                v = f"{v:.0f}"
            v = "-" if v is None else str(v)
            cells.append(v.ljust(w) if i == 0 else v.rjust(w))
        print(" ".join(cells))
    print("(ms; upd = publication reserve->commit, or pause->continue;")
    print(" gap = largest gap between two tokens of one stream;")
    print(" no-progress = longest time an engine emitted no token)")


# ------------------------------------------------------------------------------------- main


async def bench(
    engines: Sequence[Any], fx: Any, args: argparse.Namespace, admin_key: str | None = None
) -> dict[str, Any]:
    clients = {e.name: EngineClient(e.name, e.url, admin_key=admin_key) for e in engines}
    reg = LoRAVersionRegistry(EPOCH, COHORT)
    pub = open_publisher(reg, clients, reclaim_wait_s=1.0, reclaim_poll_s=0.05, reclaim_deadline_s=30.0)
    sm = SessionManager(reg, clients, router=WorkerRouter(), drain_timeout_s=10.0)
    snaps = [Snapshot.from_peft_dir(fx.adapter_dir(n), max_bucket_bytes=args.bucket_bytes) for n in "ABC"]
    phases: list[dict[str, Any]] = []
    http = httpx.AsyncClient(
        timeout=120, headers={"Authorization": f"Bearer {admin_key}"} if admin_key else None
    )
    try:
        res = await pub.publish(snaps[0], "v0")
        assert res.outcome is PublishOutcome.PUBLISHED, res

        async def managed(i: int) -> Sess:
            return ManagedSess(sm, await sm.open(f"w{i}"))

        async def fixed(i: int) -> Sess:
            return FixedSess(clients[COHORT[i % len(COHORT)]])

        async def phase(name: str, opener: Any, updater: Any = None) -> dict[str, Any]:
            t0 = _now()
            lo, hi = t0 + args.warmup, t0 + args.warmup + args.duration
            load = asyncio.create_task(run_load(opener, args.workers, args.turns, args.tokens, hi))
            upd: Any = await updater(lo, hi) if updater else []
            reqs = await load
            reclaims: list[Update] = []
            extra: dict[str, Any] = {}
            if isinstance(upd, tuple):
                upd, reclaims, extra["max_managed_versions"] = upd
            row = summarize(name, reqs, upd, lo, hi, reclaims) | extra
            phases.append(row)
            print(
                f"[bench] {name}: {row['requests']} requests, {row['failed']} failed, "
                f"{row['updates']} updates, max gap {row['max_decode_gap_ms']} ms"
            )
            return row

        audit_before = sum(len(c.audit) for c in clients.values())
        await phase("versioned, no publication", managed)
        await phase(
            "versioned publication",
            managed,
            lambda lo, hi: versioned_updates(pub, reg, snaps, lo, hi, args.interval),
        )
        forbidden = forbidden_calls([c.audit for c in clients.values()])
        audit_calls = sum(len(c.audit) for c in clients.values()) - audit_before

        # leave no managed version behind before the fixed-name phases
        await sm.close_all()
        await pub.reclaim_ready()
        for c in clients.values():
            for v in (await c.status()).versions:
                if v.state is wire.EngineVersionState.READY_LOCAL:
                    await c.reclaim(
                        wire.ReclaimRequest(lora_name=v.lora_name, reclaim_id=f"bench-{uuid.uuid4().hex[:8]}")
                    )
        urls = {e.name: e.url for e in engines}
        for url in urls.values():
            r = await http.post(
                url + "/load_lora_adapter",
                json={"lora_name": FIXED_NAME, "lora_path": str(fx.adapter_dir("A"))},
            )
            assert r.status_code == 200, r.text
        await phase("fixed name, no update", fixed)
        dirs = [fx.adapter_dir(n) for n in "ABC"]
        await phase(
            "pause+flush+overwrite",
            fixed,
            lambda lo, hi: overwrite_updates(http, urls, dirs, lo, hi, args.interval),
        )
        for url in urls.values():
            await http.post(url + "/unload_lora_adapter", json={"lora_name": FIXED_NAME})
        return {
            "phases": phases,
            "versioned_forbidden_calls": len(forbidden),
            "versioned_control_and_generation_calls": audit_calls,
        }
    finally:
        await http.aclose()
        for c in clients.values():
            await c.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds at the start of a phase")
    p.add_argument("--workers", type=int, default=8, help="concurrent sessions (closed loop)")
    p.add_argument("--turns", type=int, default=2, help="turns per session (then a new session)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per turn")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between two updates")
    p.add_argument("--bucket-bytes", type=int, default=16 * 1024)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    t_run = time.monotonic()
    fx = ensure_fixtures()
    run = ROOT / ".runs" / f"bench-publication-e2e-{time.strftime('%Y%m%d-%H%M%S')}"
    specs = [EngineSpec(name=n, model_path=fx.model_dir, log_path=run / f"{n}.log") for n in COHORT]
    load_start = os.getloadavg()
    t0 = time.monotonic()
    with running_engines(specs) as engines:
        started = time.monotonic() - t0
        print(f"[bench] E0/E1 healthy after {started:.1f}s (parallel start); logs in {run}")
        result = asyncio.run(bench(engines, fx, args))
    import sglang
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "engine_startup_s": round(started, 1),
        "run_time_s": round(time.monotonic() - t_run, 1),
        "engine_logs": str(run),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "notes": [
            "CPU engines (torch_native LoRA backend), fp32, tiny fixture Qwen3; other jobs may share cores.",
            "versioned: the real registry/publisher/session layer; 16 KB buckets; new version per interval,",
            "retired versions reclaimed once their (short) sessions ended; no pause/flush/abort-all.",
            "pause+flush+overwrite: SGLang's default pause mode ('abort') ends every running request;",
            "requests arriving while paused wait; the adapter is unloaded and reloaded under one fixed name.",
            "failed = aborted / errored / short requests; gap@upd = largest token gap overlapping an update.",
        ],
    }
    out = {"meta": meta, **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, default=str))
    print_table(result["phases"])
    print(f"[bench] versioned phases: {result['versioned_forbidden_calls']} pause/flush/abort-all calls")
    print(f"[bench] wrote {args.out} ({meta['run_time_s']}s incl. engine start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
