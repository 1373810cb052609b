"""Does publishing a version stall the decode of sessions bound to another one?

Two real CPU engines E0/E1 (plugin on; by default the tiny fixture model and its adapters,
``--model large`` for the ~290 MB random Qwen3 base of ``bench/_bench_fixtures.py`` with its
rank-64 ~27 MiB adapter). Long-running streams bound to the
managed version A run on both engines for the whole measurement (``--streams`` per engine,
restarted when one ends), and every streamed chunk's arrival time is recorded.

Time is cut into windows of ``--window-s`` seconds, in pairs (ABBA order: publish/quiet,
quiet/publish, ...):

* ``publish``: a new version is published on both engines at once (begin -> ordered buckets ->
  end: verified, loaded pinned, probed), then cleaned up (unregister, drain, unload), again and
  again until the window ends;
* ``quiet``: nothing but the streams.

For each window: the p99 and the largest gap between two consecutive chunks of one stream
(gaps are assigned to the window their later chunk falls in; publication stops a margin before
its window ends so a stall it causes is counted in its own window). Per pair: ratio publish /
quiet. Reported: the median ratio with its spread (min, quartiles, max) over the pairs.

Named apart: the stalls the plugin causes in the scheduler. The load (``end``) and the unload
(``cleanup``) are scheduler requests that block its loop while they run; the largest gap that
overlaps a load or an unload is reported beside the gaps during the transfer alone, with the
engine-side load time from the plugin's log.

Contrast, in the same run: the pause + flush + overwrite path of a fixed adapter name (streams on
``policy``, loaded with stock ``/load_lora_adapter``; in ``overwrite`` windows both engines get
``/pause_generation`` (``abort`` mode: the running requests end and their clients send them again,
as RL frameworks do; SGLang 0.5.23's ``retract`` mode deadlocks here, because the stock unload
waits for the retracted requests that hold the adapter, and they wait for ``continue``),
``/flush_cache``, ``/unload_lora_adapter``, ``/load_lora_adapter`` of the next weights under the
same name, and ``/continue_generation``), paired with quiet windows the same way. A stream is one
client thread (like a session): the stall of an abort and resend is one of its gaps.

Layouts (``--layouts``, both by default, each on two engines started for it, in one run; see
``bench/_layout.py``): ``shared``, every process on every core; ``pinned``, E0's scheduler alone on
a core of its own and everything else on the other, as on a GPU host, where the scheduler thread
has a core to itself: the gaps of E0's streams then measure what a publication costs E0's
scheduler (its load and unload), not the two shared cores. Every layout reports the gaps of all
streams and of E0's alone.

Prints a table and writes ``bench/results/decode_gap.json``.

    .venv/bin/python bench/decode_gap.py [--pairs 6] [--window-s 6] [--streams 2] [--model tiny|large]
                                         [--transport http|local] [--interval-s 0] [--layouts shared,pinned]
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _layout  # noqa: E402
import httpx  # noqa: E402
from _bench_fixtures import ensure_bench_fixtures, ensure_sized_adapters  # noqa: E402
from publish_engine import Driver, _engine_phases, _lora_flags  # noqa: E402

from lora_versions_dev.farm import PROMPT  # noqa: E402
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402
from relax_glue.snapshot import Snapshot  # noqa: E402
from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV, default_staging_base  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "decode_gap.json"
# the engine whose scheduler has a core of its own in the pinned layout (bench/_layout.py)
MEASURED = "E0"
FIXED_NAME = "policy"


def _now() -> float:
    return time.monotonic()


# ------------------------------------------------------------------------------------- streams


@dataclass
class Streams:
    """Streams bound to one adapter name on every engine; chunk arrival times per request."""

    urls: dict[str, str]
    lora: dict[str, str]  # engine -> the lora_path its streams name
    per_engine: int
    max_tokens: int
    # (engine, chunk times) per stream: a stream is one client thread, like a session, and its
    # next request (after one ended or was aborted) continues its list, so the stall of an abort
    # and resend is a gap like any other
    arrivals: list[tuple[str, list[float]]] = field(default_factory=list)
    requests: int = 0
    aborted: int = 0
    errors: list[str] = field(default_factory=list)
    # Run the client threads in a process of their own (the arrivals come back at stop), as the
    # sessions of a real deployment are other programs: in this process a chunk's arrival time is
    # taken only when its thread gets the GIL, which the publisher's threads hold meanwhile (its
    # HTTP requests, the engine-log reads after each publication).
    own_process: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _process: Any = None
    _conn: Any = None

    def start(self) -> None:
        if self.own_process:
            ctx = multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            args = (self.urls, self.lora, self.per_engine, self.max_tokens, child)
            self._process = ctx.Process(target=_streams_process, args=args, daemon=True)
            self._process.start()
            assert self._conn.recv() == "started"
            return
        for engine in self.urls:
            for _ in range(self.per_engine):
                t = threading.Thread(target=self._run, args=(engine,), daemon=True)
                t.start()
                self._threads.append(t)

    def stop(self) -> None:
        if self._process is not None:
            self._conn.send("stop")
            self.arrivals, self.requests, self.aborted, self.errors = self._conn.recv()
            self._process.join(timeout=60)
            self._process = None
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self, engine: str) -> None:
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": self.max_tokens, "ignore_eos": True},
            "lora_path": self.lora[engine],
            "stream": True,
        }
        times: list[float] = []
        self.arrivals.append((engine, times))
        with httpx.Client(base_url=self.urls[engine], timeout=300) as http:
            while not self._stop.is_set():
                self.requests += 1
                try:
                    with http.stream("POST", "/generate", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append(f"{engine}: HTTP {r.status_code}")
                            time.sleep(0.2)
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data:") and line.strip() != "data: [DONE]":
                                times.append(_now())
                                if '"abort"' in line:
                                    self.aborted += 1
                            if self._stop.is_set():
                                break
                except httpx.HTTPError as exc:
                    self.errors.append(f"{engine}: {exc!r}")

    def gaps(self, lo: float, hi: float, engines: tuple[str, ...] | None = None) -> list[float]:
        """Gaps (s) between consecutive chunks of one request whose later chunk is in [lo, hi),
        on ``engines`` (None: every engine)."""
        out = []
        for engine, times in list(self.arrivals):
            if engines is not None and engine not in engines:
                continue
            ts = list(times)
            out.extend(b - a for a, b in itertools.pairwise(ts) if lo <= b < hi)
        return out

    def gaps_overlapping(self, windows: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
        out = []
        for _, times in list(self.arrivals):
            ts = list(times)
            for a, b in itertools.pairwise(ts):
                if lo <= b < hi and any(a < w_hi and b > w_lo for w_lo, w_hi in windows):
                    out.append(b - a)
        return out


def _streams_process(
    urls: dict[str, str], lora: dict[str, str], per_engine: int, max_tokens: int, conn: Any
) -> None:
    """A Streams' client threads in a process of their own (Streams.own_process)."""
    streams = Streams(urls, lora, per_engine, max_tokens)
    streams.start()
    conn.send("started")
    conn.recv()
    streams.stop()
    conn.send(
        ([(e, list(ts)) for e, ts in streams.arrivals], streams.requests, streams.aborted, streams.errors)
    )


# ------------------------------------------------------------------------------------ windows


@dataclass
class Window:
    kind: str  # publish | quiet | overwrite
    lo: float
    hi: float
    events: list[dict[str, Any]] = field(default_factory=list)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _on_every_engine(fn: Any, engines: Any) -> None:
    """``fn(engine)`` for every engine at once, in threads; returns when all have."""
    threads = [threading.Thread(target=fn, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def cohort_on_version(engines: Any, snap: Snapshot, payloads: list) -> tuple[dict, dict, dict, dict]:
    """Each engine's url, log and driver, and version A (``snap``) staged READY on every engine:
    the version the streams are bound to for the whole run (its lora_path per engine)."""
    urls = {e.name: e.url for e in engines}
    logs = {e.name: e.log_path for e in engines}
    drivers = {e.name: Driver(e.url) for e in engines}
    lora_a = {}
    for e in engines:
        _, lora_a[e.name], _ = drivers[e.name].staged(snap, payloads)
    return urls, logs, drivers, lora_a


def publish_loop(
    drivers: dict[str, Driver],
    snap: Snapshot,
    payloads: list,
    w: Window,
    margin_s: float,
    source_dir: Path | None,
    logs: dict[str, Path],
    interval_s: float = 0.0,
) -> None:
    """Publish + clean up on every engine at once, again and again (``interval_s`` apart), until
    the window's margin."""
    while _now() < w.hi - margin_s:
        results: dict[str, Any] = {}

        def one(engine: str, results: dict[str, Any] = results) -> None:
            d = drivers[engine]
            t0 = _now()
            times, name, attempt = d.staged(snap, payloads, source_dir)
            t_end = _now()
            load_lo = t_end - times["end_ms"] / 1e3
            c0 = _now()
            d.cleanup(name, attempt)
            results[engine] = {
                "lo": t0,
                "load": (load_lo, t_end),
                "unload": (c0, _now()),
                "total_ms": times["total_ms"],
                **_engine_phases(logs[engine], name),
            }

        _on_every_engine(one, drivers)
        w.events.append(results)
        time.sleep(max(0.0, min(interval_s, w.hi - margin_s - _now())))


def overwrite_once(http: httpx.Client, urls: dict[str, str], adapter_dir: Path, w: Window) -> None:
    steps: dict[str, Any] = {}

    def one(engine: str) -> None:
        url = urls[engine]
        st = {}
        t0 = _now()
        for step, path, body in (
            ("pause", "/pause_generation", {"mode": "abort"}),
            ("flush", "/flush_cache", None),
            ("unload", "/unload_lora_adapter", {"lora_name": FIXED_NAME}),
            ("load", "/load_lora_adapter", {"lora_name": FIXED_NAME, "lora_path": str(adapter_dir)}),
            ("continue", "/continue_generation", {}),
        ):
            t = _now()
            r = http.post(url + path, json=body)
            st[step] = {"status": r.status_code, "ms": round(1000 * (_now() - t), 1)}
        st["pause_to_continue"] = (t0, _now())
        steps[engine] = st

    _on_every_engine(one, urls)
    w.events.append(steps)


def summarize_pairs(
    streams: Streams, windows: list[Window], active: str, engines: tuple[str, ...] | None = None
) -> dict[str, Any]:
    rows = []
    by_kind: dict[str, list[Window]] = {}
    for w in windows:
        by_kind.setdefault(w.kind, []).append(w)
    pairs = list(zip(by_kind.get(active, []), by_kind.get("quiet", []), strict=False))
    for a, q in pairs:
        ga, gq = streams.gaps(a.lo, a.hi, engines), streams.gaps(q.lo, q.hi, engines)
        rows.append(
            {
                "active_p99_ms": 1e3 * (_pct(ga, 0.99) or 0),
                "quiet_p99_ms": 1e3 * (_pct(gq, 0.99) or 0),
                "active_max_ms": 1e3 * max(ga, default=0),
                "quiet_max_ms": 1e3 * max(gq, default=0),
                "active_median_ms": 1e3 * (statistics.median(ga) if ga else 0),
                "quiet_median_ms": 1e3 * (statistics.median(gq) if gq else 0),
                "gaps": [len(ga), len(gq)],
                "events": len(a.events),
            }
        )
        r = rows[-1]
        r["p99_ratio"] = r["active_p99_ms"] / r["quiet_p99_ms"] if r["quiet_p99_ms"] else None
        r["max_ratio"] = r["active_max_ms"] / r["quiet_max_ms"] if r["quiet_max_ms"] else None

    def spread(key: str) -> dict[str, float | None]:
        xs = sorted(r[key] for r in rows if r[key] is not None)
        if not xs:
            return {"median": None}
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return {"median": statistics.median(xs), "min": xs[0], "q1": q[0], "q3": q[2], "max": xs[-1]}

    return {"pairs": rows, "p99_ratio": spread("p99_ratio"), "max_ratio": spread("max_ratio")}


def plugin_stalls(streams: Streams, windows: list[Window]) -> dict[str, Any]:
    """Gaps overlapping a load (end) or an unload (cleanup) against the other publish-window gaps."""
    loads, unloads, eng_load_ms = [], [], []
    gaps_load, gaps_unload, gaps_other = [], [], []
    for w in windows:
        if w.kind != "publish":
            continue
        for ev in w.events:
            for res in ev.values():
                loads.append(res["load"])
                unloads.append(res["unload"])
                if "engine_load_ms" in res:
                    eng_load_ms.append(res["engine_load_ms"])
        gl = streams.gaps_overlapping(loads, w.lo, w.hi)
        gu = streams.gaps_overlapping(unloads, w.lo, w.hi)
        gaps_load += gl
        gaps_unload += gu
        busy = loads + unloads
        for _, times in list(streams.arrivals):
            ts = list(times)
            for a, b in itertools.pairwise(ts):
                if w.lo <= b < w.hi and not any(a < hi and b > lo for lo, hi in busy):
                    gaps_other.append(b - a)
    return {
        "max_gap_overlapping_load_ms": 1e3 * max(gaps_load, default=0),
        "p99_gap_overlapping_load_ms": 1e3 * (_pct(gaps_load, 0.99) or 0),
        "max_gap_overlapping_unload_ms": 1e3 * max(gaps_unload, default=0),
        "max_gap_transfer_only_ms": 1e3 * max(gaps_other, default=0),
        "p99_gap_transfer_only_ms": 1e3 * (_pct(gaps_other, 0.99) or 0),
        "engine_load_ms_median": statistics.median(eng_load_ms) if eng_load_ms else None,
        "loads": len(loads),
    }


def run_windows(kinds: list[str], window_s: float, act: Any) -> list[Window]:
    windows = []
    for kind in kinds:
        w = Window(kind, _now(), _now() + window_s)
        if kind != "quiet":
            act(w)
        time.sleep(max(0.0, w.hi - _now()))
        windows.append(w)
    return windows


def abba(active: str, pairs: int) -> list[str]:
    out: list[str] = []
    for i in range(pairs):
        out += [active, "quiet"] if i % 2 == 0 else ["quiet", active]
    return out


def run_layout(
    layout: str,
    args: argparse.Namespace,
    run_dir: Path,
    env: dict[str, str],
    model_dir: Path,
    extra: dict[str, Any],
    snap_a: Snapshot,
    snap_b: Snapshot,
    payloads_a: list,
    payloads_b: list,
    adapter_a: Path,
    adapter_b: Path,
    source_dir: Path,
    max_tokens: int,
) -> dict[str, Any]:
    """Both measurements (versioned publication, fixed-name overwrite) on two engines started
    for ``layout`` (bench/_layout.py)."""
    out: dict[str, Any] = {}
    specs = [
        EngineSpec(
            name=n,
            model_path=model_dir,
            log_path=run_dir / f"{n}-{layout}.log",
            env={**env, **_layout.engine_env(layout, measured=n == MEASURED)},
            **extra,
        )
        for n in ("E0", "E1")
    ]
    print(f"[{layout}] starting 2 engines ({args.model}; logs in {run_dir}) ...", flush=True)
    with running_engines(specs) as engines:
        by_name = {e.name: e.proc.pid for e in engines}
        others = [pid for name, pid in by_name.items() if name != MEASURED]
        out["pinned"] = _layout.apply(layout, by_name[MEASURED], others)
        urls, logs, drivers, lora_a = cohort_on_version(engines, snap_a, payloads_a)
        _layout.pin_the_rest(layout, by_name[MEASURED], others)
        src = source_dir if args.transport == "local" else None
        publish_loop(drivers, snap_b, payloads_b, Window("warmup", _now(), _now() + 0.1), 0.0, src, logs)
        streams = Streams(urls, lora_a, args.streams, max_tokens, own_process=not args.clients_in_process)
        streams.start()
        time.sleep(3.0)  # streams past their prefill
        print(f"[{layout}] versioned: {args.pairs} pairs of {args.window_s:.0f} s windows ...", flush=True)
        windows = run_windows(
            abba("publish", args.pairs),
            args.window_s,
            lambda w: publish_loop(drivers, snap_b, payloads_b, w, args.margin_s, src, logs, args.interval_s),
        )
        streams.stop()
        versioned = summarize_pairs(streams, windows, "publish")
        # the streams of the engine whose scheduler has a core of its own in the pinned layout
        versioned["measured_engine"] = {
            "engine": MEASURED,
            **summarize_pairs(streams, windows, "publish", (MEASURED,)),
        }
        stalls = plugin_stalls(streams, windows)
        out["versioned"] = {
            **versioned,
            "plugin_stalls": stalls,
            "stream_errors": streams.errors[:20],
            "requests": streams.requests,
            "aborted": streams.aborted,
        }
        out["versioned"]["publications"] = sum(len(w.events) for w in windows if w.kind == "publish")

        # contrast: a fixed name, paused + flushed + overwritten
        http = httpx.Client(timeout=300)
        for e in engines:
            r = http.post(
                f"{e.url}/load_lora_adapter", json={"lora_name": FIXED_NAME, "lora_path": str(adapter_a)}
            )
            r.raise_for_status()
        fixed = Streams(
            urls,
            {e: FIXED_NAME for e in urls},
            args.streams,
            max_tokens,
            own_process=not args.clients_in_process,
        )
        fixed.start()
        time.sleep(3.0)
        print(f"[{layout}] pause + flush + overwrite: {args.pairs} pairs ...", flush=True)
        flip = [adapter_b, adapter_a]

        def overwrite(w: Window) -> None:
            while _now() < w.hi - args.margin_s:
                overwrite_once(http, urls, flip[len(w.events) % 2], w)
                time.sleep(0.5)

        o_windows = run_windows(abba("overwrite", args.pairs), args.window_s, overwrite)
        fixed.stop()
        out["overwrite"] = {
            **summarize_pairs(fixed, o_windows, "overwrite"),
            "stream_errors": fixed.errors[:20],
            "requests": fixed.requests,
            "aborted": fixed.aborted,
        }
        out["overwrite"]["overwrites"] = sum(len(w.events) for w in o_windows if w.kind == "overwrite")
        pause_ms = [
            1e3 * (st["pause_to_continue"][1] - st["pause_to_continue"][0])
            for w in o_windows
            for ev in w.events
            for st in ev.values()
        ]
        out["overwrite"]["pause_to_continue_ms_median"] = statistics.median(pause_ms) if pause_ms else None
        http.close()
        for d in drivers.values():
            d.close()
    _layout.apply("shared", ())
    return out


def print_layout(layout: str, out: dict[str, Any], args: argparse.Namespace) -> None:
    v, o, s = out["versioned"], out["overwrite"], out["versioned"]["plugin_stalls"]

    def fmt(sp: dict[str, Any]) -> str:
        if sp.get("median") is None:
            return "n/a"
        return (
            f"{sp['median']:.2f} (min {sp['min']:.2f}, q1 {sp['q1']:.2f}, q3 {sp['q3']:.2f},"
            f" max {sp['max']:.2f})"
        )

    print(
        f"\n[{layout}] inter-chunk gaps of streams bound to another version, {args.pairs} pairs of"
        f" {args.window_s:.0f} s windows"
    )
    print(
        f"{'pair':>4} {'path':10} {'p99 act':>8} {'p99 qt':>8} {'max act':>8} {'max qt':>8}"
        f" {'p99 x':>6} {'max x':>6} {'events':>6}"
    )
    for label, res in (("versioned", v), ("overwrite", o)):
        for i, r in enumerate(res["pairs"]):
            print(
                f"{i + 1:4d} {label:10} {r['active_p99_ms']:8.1f} {r['quiet_p99_ms']:8.1f}"
                f" {r['active_max_ms']:8.1f} {r['quiet_max_ms']:8.1f} {r['p99_ratio'] or 0:6.2f}"
                f" {r['max_ratio'] or 0:6.2f} {r['events']:6d}"
            )
    print(
        f"versioned publication: p99 ratio {fmt(v['p99_ratio'])}; max ratio {fmt(v['max_ratio'])};"
        f" {v['publications']} publications, {v['aborted']} of {v['requests']} requests aborted"
    )
    m = v["measured_engine"]
    print(
        f"versioned publication, {m['engine']}'s streams only: p99 ratio {fmt(m['p99_ratio'])};"
        f" max ratio {fmt(m['max_ratio'])}"
    )
    print(
        f"pause+flush+overwrite: p99 ratio {fmt(o['p99_ratio'])}; max ratio {fmt(o['max_ratio'])};"
        f" {o['overwrites']} overwrites, {o['aborted']} of {o['requests']} requests aborted"
    )
    print(
        f"plugin stalls: largest gap overlapping a load {s['max_gap_overlapping_load_ms']:.1f} ms"
        f" (engine-side load median {s['engine_load_ms_median']} ms, {s['loads']} loads),"
        f" overlapping an unload {s['max_gap_overlapping_unload_ms']:.1f} ms,"
        f" transfer only {s['max_gap_transfer_only_ms']:.1f} ms"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--window-s", type=float, default=6.0)
    p.add_argument("--streams", type=int, default=2, help="streams per engine")
    p.add_argument(
        "--model",
        choices=("large", "tiny"),
        default="tiny",
        help="tiny: the fixture model (decode fast enough for many gaps per window); large: the ~290 MB"
        " base with the rank-64 adapter (on 2 cores, decode itself is too slow to resolve much)",
    )
    p.add_argument("--transport", choices=("http", "local"), default="http")
    p.add_argument(
        "--interval-s",
        type=float,
        default=0.0,
        help="pause between publications in a publish window (0: back to back, the worst case)",
    )
    p.add_argument(
        "--margin-s", type=float, default=1.0, help="publication stops this long before its window ends"
    )
    p.add_argument(
        "--clients-in-process",
        action="store_true",
        help="run the streams' client threads in this process, beside the publisher (before 2026-12-03)",
    )
    _layout.add_layouts_option(p, measured="E0")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    t_start = time.monotonic()
    run_dir = ROOT / ".runs" / f"bench-gap-{time.strftime('%Y%m%d-%H%M%S')}"
    # on the engines' staging filesystem, so a handed-over file is taken over, not copied
    source_dir = default_staging_base() / f"lora-versions-bench-source-{run_dir.name}"
    source_dir.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, source_dir, True)
    env = {LOCAL_SOURCE_DIR_ENV: str(source_dir)}
    if args.model == "large":
        big = ensure_bench_fixtures()
        model_dir, adapter_a = big.model_dir, big.adapter_dir
        adapter_b = ensure_sized_adapters(big, [27.4])[27.4]
        extra = {"lora_flags": _lora_flags(big.rank), "extra_args": ("--mem-fraction-static", "0.5")}
        max_tokens = 1500
    else:
        fx = ensure_fixtures()
        model_dir, adapter_a, adapter_b = fx.model_dir, fx.adapter_dir("A"), fx.adapter_dir("B")
        extra = {}
        max_tokens = 1500
    snap_a = Snapshot.from_peft_dir(adapter_a)
    snap_b = Snapshot.from_peft_dir(adapter_b)
    payloads_a, payloads_b = list(snap_a.iter_buckets()), list(snap_b.iter_buckets())
    out: dict[str, Any] = {"layouts": {}}
    for layout in args.layouts:
        out["layouts"][layout] = run_layout(
            layout,
            args,
            run_dir,
            env,
            model_dir,
            extra,
            snap_a,
            snap_b,
            payloads_a,
            payloads_b,
            adapter_a,
            adapter_b,
            source_dir,
            max_tokens,
        )
    for layout, res in out["layouts"].items():
        print_layout(layout, res, args)
    import sglang

    out["meta"] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "sglang": sglang.__version__,
        "cpus": os.cpu_count(),
        "args": {k: str(val) for k, val in vars(args).items()},
        "run_time_s": round(time.monotonic() - t_start, 1),
        "engine_logs": str(run_dir),
        "adapter_bytes": snap_b.total_bytes,
        "id": uuid.uuid4().hex[:8],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nrun time {out['meta']['run_time_s']}s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
