"""Staged publication (begin -> ordered buckets -> end) versus stock ``/load_lora_adapter``.

Real CPU engines, started in parallel, each measured in the same run:

* ``tiny``:  the tiny fixture model with the fixture adapter ``A`` (rank 4, ~36 KB);
* ``large``: a random Qwen3 base (hidden 1024, 6 layers, ~290 MB) with a generated rank-64 adapter
  over q,k,v,o,gate,up,down (~27 MiB fp32), see ``bench/_bench_fixtures.py``;
* ``sized``: the same base with adapters of about ``--sizes`` MiB (rank scaled), one bucket cap of
  64 MiB: time against size.

Per repetition and per engine (the paths interleaved, so load drift hits all of them alike):

* ``staged``: ``begin`` -> every bucket body in plan order over HTTP -> ``end`` (which loads the
  verified staged files pinned through SGLang's own path load and runs a 1-token exact-version
  probe), under a fresh version_id, for each bucket cap; then ``/lora_versions/cleanup`` (timed
  apart, not in the total). The bucket payloads are encoded before the clock starts.
* ``local``: the same, with each bucket handed over as a file in the engines' local source
  directory (on the staging filesystem, so it is taken over, not copied), written before the
  clock as the stock path's adapter file was (``client_write_ms``).
* ``collective``: the same contract with the tensor bytes broadcast over the engine's gloo group
  (the bench process is the trainer, through ``relax_glue.collective_sender``; the group is
  connected once per engine, before the clock), each bucket acknowledged over HTTP. ``begin``
  and the buckets go through ``EngineClient`` as the publisher's do, so a group the engine
  broke (its ``begin`` answers TRANSPORT_UNAVAILABLE) is reconnected inside that repetition's
  ``begin`` (counted: ``collective_reconnects``), not a failure of every later repetition.
* ``stock``: ``/load_lora_adapter`` of the same adapter directory from disk, then (apart) a 1-token
  generation with it, which is what the staged ``end`` includes as its probe, then
  ``/unload_lora_adapter``.

Engine side, per publication: the plugin's phase line (read, verify, load, probe) and the main
process's peak resident memory above idle (``VmHWM`` after a ``clear_refs`` reset) and its RSS
after the cleanup.

The ratio is ``staged begin..end / stock load`` (medians); ``ratio_vs_load_gen`` compares with
stock load + a 1-token generation. One unmeasured warm-up of each path first, which also checks
that the staged and the stock copy give the same greedy tokens. Capacity never fills: every
candidate is cleaned up and every stock load unloaded before the next.

Layouts (``--layouts``, both by default, each on engines started for it, in one run;
``bench/_layout.py``): ``shared``, every process on every core; ``pinned``, the large engine's
scheduler alone on the last core and every other process (the other engines whole, this bench)
on the others.

Prints a table per layout and writes ``bench/results/publish_engine.json``.

    .venv/bin/python bench/publish_engine.py [--reps 5] [--large-caps 1,4,64] [--sizes 1,8,32,128]
                                             [--no-large] [--layouts shared,pinned]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _layout  # noqa: E402
import httpx  # noqa: E402
from _bench_fixtures import LARGE_CONFIG, ensure_bench_fixtures, ensure_sized_adapters, rank_for_mib  # noqa: E402

from lora_contract.protocol import BeginRequest, PreparedReceipt, ReceiveBucketMeta, Routes  # noqa: E402
from lora_versions_dev.farm import PROMPT  # noqa: E402
from lora_versions_dev.fixtures import ensure_fixtures  # noqa: E402
from lora_versions_dev.launcher import EngineSpec, running_engines  # noqa: E402
from relax_glue.bucket_transport import CollectiveTransport  # noqa: E402
from relax_glue.collective_sender import CollectiveSender  # noqa: E402
from relax_glue.engine_client import ClientTimeouts, EngineClient  # noqa: E402
from relax_glue.snapshot import EncodedBucket, Snapshot  # noqa: E402
from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV, default_staging_base  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "publish_engine.json"
PREFIX = "bench_lora"
EPOCH = "b1"
MiB = 1024 * 1024
HTTP_TIMEOUT = 300.0
CLIENT_TIMEOUTS = ClientTimeouts(
    begin=HTTP_TIMEOUT, bucket=HTTP_TIMEOUT, end=HTTP_TIMEOUT, cleanup=HTTP_TIMEOUT
)


# ------------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One adapter on one engine, published under several bucket caps."""

    engine: str
    adapter: str
    adapter_dir: Path
    rank: int
    caps: list[int]
    snaps: dict[int, Snapshot] = field(default_factory=dict)
    payloads: dict[int, list[EncodedBucket]] = field(default_factory=dict)
    prep_ms: dict[int, float] = field(default_factory=dict)  # from_peft_dir (read, copy, hash, plan)
    encode_ms: dict[int, float] = field(default_factory=dict)  # every bucket payload + its sha256

    def prepare(self) -> None:
        for cap in self.caps:
            t0 = time.perf_counter()
            snap = Snapshot.from_peft_dir(self.adapter_dir, max_bucket_bytes=cap)
            t1 = time.perf_counter()
            payloads = list(snap.iter_buckets())
            t2 = time.perf_counter()
            self.snaps[cap], self.payloads[cap] = snap, payloads
            self.prep_ms[cap], self.encode_ms[cap] = (t1 - t0) * 1e3, (t2 - t1) * 1e3

    @property
    def total_bytes(self) -> int:
        return next(iter(self.snaps.values())).total_bytes

    @property
    def n_tensors(self) -> int:
        return len(next(iter(self.snaps.values())).manifest.tensors)


class BenchError(RuntimeError):
    pass


def _check(r: httpx.Response, what: str) -> httpx.Response:
    if r.status_code != 200:
        raise BenchError(f"{what}: HTTP {r.status_code}: {r.text[:2000]}")
    return r


# ------------------------------------------------------------------------------------------ drivers


class Driver:
    """HTTP calls against one engine (no admin key configured), one keep-alive client."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=HTTP_TIMEOUT)
        self._n = 0
        self._loop = asyncio.Runner()  # one event loop for the run: the clients' and the sender's
        self._clients: dict[str, EngineClient] = {}
        self.sender: CollectiveSender | None = None
        self.connect_ms: float | None = None

    def close(self) -> None:
        self.http.close()
        for client in self._clients.values():
            self._loop.run(client.__aexit__(None, None, None))
        self._clients.clear()
        self._loop.close()

    def _client(self, sender: CollectiveSender | None) -> EngineClient:
        """The run's client for HTTP bodies, or for the collective: each opened once, in this
        driver's one event loop, as a publisher keeps its clients (a client's pools cost ~50 ms
        of CPU to build, SSL contexts; its connections are kept alive between publications)."""
        kind = "http" if sender is None else "collective"
        if kind not in self._clients:
            transport = CollectiveTransport(sender) if sender is not None else None
            client = EngineClient("bench", self.url, timeouts=CLIENT_TIMEOUTS, transport=transport)
            self._clients[kind] = self._loop.run(client.__aenter__())
        return self._clients[kind]

    def collective(self) -> CollectiveSender:
        """The group to this engine, connected on first use (timed apart, never in a total)."""
        if self.sender is None:
            sender = CollectiveSender("127.0.0.1", timeout_s=60.0)

            async def ask_engine(group_id: str, init_method: str, backend: str) -> str:
                body = {"group_id": group_id, "init_method": init_method, "backend": backend}
                r = await asyncio.to_thread(self.http.post, Routes.COLLECTIVE_CONNECT, json=body)
                return _check(r, "collective connect").json()["incarnation"]

            t0 = time.perf_counter()
            self._loop.run(sender.connect(ask_engine))
            self.connect_ms = (time.perf_counter() - t0) * 1e3
            self.sender = sender
        return self.sender

    def staged(
        self,
        snap: Snapshot,
        payloads: list[EncodedBucket],
        source_dir: Path | None = None,
        collective: bool = False,
    ) -> tuple[dict[str, float], str, str]:
        """One publication begin..end; returns the timings (ms), the lora_name and the attempt token.

        With ``source_dir`` (the engine's local source directory) the payloads are written there
        as files before the clock starts, as a co-located trainer would (and as the stock path's
        adapter file was written before its clock), and each bucket call names its file."""
        self._n += 1
        version_id = f"r{self._n}x{uuid.uuid4().hex[:6]}"
        attempt = uuid.uuid4().hex
        begin = snap.begin_request(PREFIX, EPOCH, version_id, attempt)
        if collective:
            begin = begin.model_copy(update={"transport": "collective"})
        sender = self.collective() if collective else None
        body = begin.model_dump(mode="json")
        name = begin.lora_name
        sources: list[str | None] = [None] * len(payloads)
        tw = time.perf_counter()
        if source_dir is not None:
            for i, b in enumerate(payloads):
                sources[i] = f"{attempt}-{i}.safetensors"
                (source_dir / sources[i]).write_bytes(b.payload)
        write_ms = (time.perf_counter() - tw) * 1e3
        t0 = time.perf_counter()
        try:
            if source_dir is None:  # begin and the bucket phase in one event loop, as the publisher
                client = self._client(sender)
                t0, t1 = self._loop.run(self._client_begin_and_buckets(client, sender, begin, payloads))
            else:
                r = _check(self.http.post(Routes.BEGIN, json=body), "begin")
                if r.json().get("state") != "PREPARED":
                    raise BenchError(f"begin: expected PREPARED, got {r.text[:500]}")
                t1 = time.perf_counter()
            for b, source in zip(payloads, sources, strict=True) if source_dir is not None else ():
                meta = ReceiveBucketMeta(
                    lora_name=name, attempt_token=attempt, index=b.spec.index, sha256=b.sha256, source=source
                )
                _check(
                    self.http.post(
                        Routes.RECEIVE_BUCKET,
                        content=b.payload if source is None else b"",
                        headers=meta.to_headers(),
                    ),
                    f"receive_bucket {b.spec.index}/{len(payloads)} ({len(b.payload)} bytes)",
                )
            t2 = time.perf_counter()
            r = _check(self.http.post(Routes.END, json={"lora_name": name, "attempt_token": attempt}), "end")
            if r.json().get("state") != "READY_LOCAL":
                raise BenchError(f"end: expected READY_LOCAL, got {r.text[:500]}")
            t3 = time.perf_counter()
        except BaseException:
            with contextlib.suppress(Exception):
                self.cleanup(name, attempt)
            raise
        finally:
            for source in sources:
                if source is not None and source_dir is not None:
                    (source_dir / source).unlink(missing_ok=True)
        times = {
            "client_write_ms": write_ms,
            "total_ms": (t3 - t0) * 1e3,
            "begin_ms": (t1 - t0) * 1e3,
            "buckets_ms": (t2 - t1) * 1e3,
            "end_ms": (t3 - t2) * 1e3,
        }
        return times, name, attempt

    async def _client_begin_and_buckets(
        self,
        client: EngineClient,
        sender: CollectiveSender | None,
        begin: BeginRequest,
        payloads: list[EncodedBucket],
    ) -> tuple[float, float]:
        """As the publisher does it, through ``EngineClient`` (its async HTTP client: the
        blocking client's write re-slices the unsent rest of a body after every partial send, a
        copy per send that cost the sender 0.7 s of CPU per 350 MiB here, against 0.1 s for the
        kernel's own copy). HTTP: ``begin``, then each bucket as a body. Collective (``sender``):
        ``begin`` (which connects a new group when the engine's is unusable, e.g. broken by an
        earlier cleanup), then every bucket broadcast at once (the engine is PREPARED), then the
        acknowledgements in order, each asked while its broadcast is on the wire. Returns the
        clock when ``begin`` started and when it ended."""
        t0 = time.perf_counter()
        receipt = await client.begin(begin)
        if not isinstance(receipt, PreparedReceipt):
            raise BenchError(f"begin: expected PREPARED, got {receipt!r:.500}")
        t1 = time.perf_counter()
        for b in payloads if sender is not None else ():
            sender.send_soon(begin.attempt_token, b.spec.index, b.payload)
        for b in payloads:
            meta = ReceiveBucketMeta(
                lora_name=begin.lora_name,
                attempt_token=begin.attempt_token,
                index=b.spec.index,
                sha256=b.sha256,
            )
            await client.receive_bucket(meta, b.payload)
        return t0, t1

    @property
    def reconnects(self) -> int:
        """Groups connected after the first one (each inside a repetition's ``begin``)."""
        return 0 if self.sender is None else self.sender.connects - 1

    def cleanup(self, name: str, attempt: str) -> float:
        t0 = time.perf_counter()
        r = _check(
            self.http.post(Routes.CLEANUP, json={"lora_name": name, "attempt_token": attempt}), "cleanup"
        )
        if r.json().get("state") != "CLEANED":
            raise BenchError(f"cleanup: expected CLEANED, got {r.text[:500]}")
        return (time.perf_counter() - t0) * 1e3

    def stock_load(self, adapter_dir: Path) -> tuple[float, str]:
        self._n += 1
        name = f"stock-{self._n}-{uuid.uuid4().hex[:6]}"
        t0 = time.perf_counter()
        r = self.http.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dir)})
        dt = (time.perf_counter() - t0) * 1e3
        _check(r, "/load_lora_adapter")
        if r.json().get("success") is False:
            raise BenchError(f"/load_lora_adapter: {r.text[:500]}")
        return dt, name

    def unload(self, name: str) -> float:
        t0 = time.perf_counter()
        _check(self.http.post("/unload_lora_adapter", json={"lora_name": name}), "/unload_lora_adapter")
        return (time.perf_counter() - t0) * 1e3

    def generate(
        self, lora: str, max_new_tokens: int = 1, prompt: list[int] | None = None
    ) -> tuple[float, list]:
        body = {
            "input_ids": prompt or [1],
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "lora_path": lora,
        }
        t0 = time.perf_counter()
        r = _check(self.http.post("/generate", json=body), f"/generate lora_path={lora}")
        return (time.perf_counter() - t0) * 1e3, r.json()["output_ids"]

    def managed_versions(self) -> list[str]:
        r = _check(self.http.get(Routes.STATUS), "GET /lora_versions")
        return [v["lora_name"] for v in r.json()["versions"] if v["state"] != "CLEANED"]


# ------------------------------------------------------------------------------------------ running


def _stats(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    return {
        "median": round(statistics.median(samples), 2),
        "min": round(min(samples), 2),
        "max": round(max(samples), 2),
        "n": len(samples),
        "samples": [round(s, 2) for s in samples],
    }


ENGINE_PHASES = ("read_ms", "verify_ms", "load_ms", "probe_ms")
# http: bucket bodies over HTTP; local: files in the engine's local source directory;
# collective: tensor bytes over the engine's gloo group, acknowledged over HTTP
TRANSPORTS = ("http", "local", "collective")
MEMORY_KEYS = ("idle_rss_mib", "peak_above_idle_mib", "after_cleanup_above_idle_mib")


class Runner:
    def __init__(
        self,
        case: Case,
        driver: Driver,
        log_tail: Callable[[], str],
        pid: int,
        log_path: Path,
        source_dir: Path,
    ) -> None:
        self.case = case
        self.source_dir = source_dir
        self.d = driver
        self.log_tail = log_tail
        self.pid = pid
        self.log_path = log_path
        self.staged: dict[tuple[str, int], dict[str, list[float]]] = {
            (transport, cap): {
                k: []
                for k in (
                    *("total_ms", "begin_ms", "buckets_ms", "end_ms", "cleanup_ms", "client_write_ms"),
                    *(f"engine_{k}" for k in ENGINE_PHASES),
                    *MEMORY_KEYS,
                )
            }
            for cap in case.caps
            for transport in TRANSPORTS
        }
        self.stock: dict[str, list[float]] = {"load_ms": [], "gen1_ms": [], "unload_ms": []}
        self.warmup: dict[str, Any] = {}
        self.errors: list[dict[str, str]] = []

    def _err(self, where: str, exc: BaseException) -> None:
        self.errors.append({"where": where, "error": str(exc), "engine_log_tail": self.log_tail()})
        print(f"  !! {self.case.engine}/{where}: {exc}", flush=True)

    def one_staged(self, transport: str, cap: int, record: bool) -> dict[str, float] | None:
        try:
            idle = _reset_peak(self.pid)
            source_dir = self.source_dir if transport == "local" else None
            times, name, attempt = self.d.staged(
                self.case.snaps[cap],
                self.case.payloads[cap],
                source_dir,
                collective=transport == "collective",
            )
            peak = _status_mib(self.pid, "VmHWM")
            times.update(_engine_phases(self.log_path, name))
            if not record:
                self.warmup[f"{transport}_cap{cap}"] = times
                if cap == self.case.caps[0] and transport == "http":
                    self.warmup["staged_tokens"] = self.d.generate(name, 6, PROMPT)[1]
            times["cleanup_ms"] = self.d.cleanup(name, attempt)
            after = _status_mib(self.pid, "VmRSS")
            if idle is not None and peak is not None and after is not None:
                times["idle_rss_mib"] = idle
                times["peak_above_idle_mib"] = round(peak - idle, 1)
                times["after_cleanup_above_idle_mib"] = round(after - idle, 1)
        except Exception as exc:
            self._err(f"staged cap={cap}", exc)
            return None
        if record:
            for k, v in times.items():
                self.staged[(transport, cap)][k].append(v)
        return times

    def one_stock(self, record: bool) -> None:
        name = None
        try:
            load_ms, name = self.d.stock_load(self.case.adapter_dir)
            gen_ms, _ = self.d.generate(name)
            if not record:
                self.warmup["stock"] = {"load_ms": load_ms, "gen1_ms": gen_ms}
                self.warmup["stock_tokens"] = self.d.generate(name, 6, PROMPT)[1]
            unload_ms = self.d.unload(name)
        except Exception as exc:
            self._err("stock", exc)
            if name is not None:
                with contextlib.suppress(Exception):
                    self.d.unload(name)
            return
        if record:
            self.stock["load_ms"].append(load_ms)
            self.stock["gen1_ms"].append(gen_ms)
            self.stock["unload_ms"].append(unload_ms)

    def run_rep(self, rep: int | None) -> None:
        record = rep is not None
        # Alternate the order (stock first on even reps, last on odd ones) so drift is shared.
        steps: list[Callable[[], Any]] = [
            lambda c=c, t=t: self.one_staged(t, c, record) for c in self.case.caps for t in TRANSPORTS
        ]
        steps.insert(0 if (rep or 0) % 2 == 0 else len(steps), lambda: self.one_stock(record))
        for step in steps:
            step()

    def result(self) -> dict[str, Any]:
        c = self.case
        stock_load = _stats(self.stock["load_ms"])
        stock_load_gen = _stats(
            [a + b for a, b in zip(self.stock["load_ms"], self.stock["gen1_ms"], strict=True)]
        )
        rows = []
        for transport, cap in self.staged:
            s = self.staged[(transport, cap)]
            total = _stats(s["total_ms"])
            payloads = c.payloads[cap]
            row = {
                "path": "staged",
                "transport": transport,
                "client_write_ms": _stats(s["client_write_ms"]) if transport == "local" else None,
                "bucket_cap_bytes": cap,
                "buckets": len(payloads),
                "payload_bytes": sum(len(b.payload) for b in payloads),
                "max_bucket_payload_bytes": max(len(b.payload) for b in payloads),
                "client_snapshot_ms": round(c.prep_ms[cap], 2),
                "client_encode_ms": round(c.encode_ms[cap], 2),
                "total_ms": total,
                **{k: _stats(s[k]) for k in ("begin_ms", "buckets_ms", "end_ms", "cleanup_ms")},
                "engine_phases_ms": {k: _stats(s[f"engine_{k}"]) for k in ENGINE_PHASES},
                "engine_main_memory_mib": {k: _stats(s[k]) for k in MEMORY_KEYS},
            }
            if total["n"] and stock_load["n"]:
                row["ratio_vs_stock_load"] = round(total["median"] / stock_load["median"], 2)
                row["ratio_vs_stock_load_gen"] = round(total["median"] / stock_load_gen["median"], 2)
                if len(payloads) > 0:
                    row["buckets_ms_per_bucket"] = round(row["buckets_ms"]["median"] / len(payloads), 2)
            rows.append(row)
        return {
            "engine": c.engine,
            "adapter": c.adapter,
            "adapter_dir": str(c.adapter_dir),
            "adapter_bytes": c.total_bytes,
            "adapter_file_bytes": (c.adapter_dir / "adapter_model.safetensors").stat().st_size,
            "tensors": c.n_tensors,
            "rank": c.rank,
            "staged": rows,
            "stock": {
                "load_ms": stock_load,
                "gen1_ms": _stats(self.stock["gen1_ms"]),
                "load_plus_gen1_ms": stock_load_gen,
                "unload_ms": _stats(self.stock["unload_ms"]),
            },
            "warmup": self.warmup,
            "staged_equals_stock_tokens": (
                self.warmup.get("staged_tokens") == self.warmup.get("stock_tokens")
                if "staged_tokens" in self.warmup and "stock_tokens" in self.warmup
                else None
            ),
            "errors": self.errors,
            "collective_connect_ms": None if self.d.connect_ms is None else round(self.d.connect_ms, 1),
            # of the engine's one sender, shared by its adapters: the whole run's
            "collective_connects": 0 if self.d.sender is None else self.d.sender.connects,
            "collective_reconnects": self.d.reconnects,
        }


# ------------------------------------------------------------------------------------------- output


def _fmt_bytes(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def _fmt_cap(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else _fmt_bytes(n)


def _path(row: dict[str, Any]) -> str:
    return {"http": "staged", "local": "local", "collective": "collect"}[row["transport"]]


def transport_speedups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per adapter and cap: HTTP begin..end over collective begin..end (medians), and the engine
    main process's peak memory above idle on each path."""
    out = []
    for res in results:
        rows = {(r["transport"], r["bucket_cap_bytes"]): r for r in res["staged"]}
        for (transport, cap), row in rows.items():
            http = rows.get(("http", cap))
            if (
                transport != "collective"
                or http is None
                or not row["total_ms"]["n"]
                or not http["total_ms"]["n"]
            ):
                continue
            mem = {
                t: rows[(t, cap)]["engine_main_memory_mib"]["peak_above_idle_mib"].get("median")
                for t in TRANSPORTS
                if (t, cap) in rows
            }
            out.append(
                {
                    "engine": res["engine"],
                    "adapter_bytes": res["adapter_bytes"],
                    "bucket_cap_bytes": cap,
                    "http_ms": http["total_ms"]["median"],
                    "collective_ms": row["total_ms"]["median"],
                    "speedup": round(http["total_ms"]["median"] / row["total_ms"]["median"], 2),
                    "peak_main_mib_above_idle": mem,
                    "collective_connect_ms": res.get("collective_connect_ms"),
                }
            )
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'engine':6} {'adapter':14} {'path':7} {'cap':>9} {'bkts':>4} {'median':>8} {'min':>8} {'max':>8}"
        f" {'begin':>7} {'buckets':>8} {'end':>8} {'ratio':>6} {'r(+gen)':>7}"
    )
    print("\nall times in ms (median over reps; begin/buckets/end are medians of their own)")
    print(head)
    print("-" * len(head))
    for res in results:
        adapter = f"{res['adapter']} {_fmt_bytes(res['adapter_bytes'])}"
        st = res["stock"]
        for label, s in (("stock", st["load_ms"]), ("stock+g", st["load_plus_gen1_ms"])):
            if s["n"]:
                print(
                    f"{res['engine']:6} {adapter:14} {label:7} {'disk':>9} {'-':>4} {s['median']:8.1f}"
                    f" {s['min']:8.1f} {s['max']:8.1f}"
                )
        for row in res["staged"]:
            t = row["total_ms"]
            if not t["n"]:
                print(
                    f"{res['engine']:6} {adapter:14} {_path(row):7}"
                    f" {_fmt_cap(row['bucket_cap_bytes']):>9}  FAILED"
                )
                continue
            print(
                f"{res['engine']:6} {adapter:14} {_path(row):7} {_fmt_cap(row['bucket_cap_bytes']):>9}"
                f" {row['buckets']:4d} {t['median']:8.1f} {t['min']:8.1f} {t['max']:8.1f}"
                f" {row['begin_ms']['median']:7.1f} {row['buckets_ms']['median']:8.1f}"
                f" {row['end_ms']['median']:8.1f} {row.get('ratio_vs_stock_load', float('nan')):6.2f}"
                f" {row.get('ratio_vs_stock_load_gen', float('nan')):7.2f}"
            )
    print(
        "ratio = staged begin..end / stock /load_lora_adapter; r(+gen) = vs stock load + a 1-token"
        " generation (the staged end includes such a probe)."
    )
    speedups = transport_speedups(results)
    if speedups:
        print("\ncollective vs HTTP (begin..end medians; engine main-process peak above idle, MiB)")
        for s in speedups:
            size, cap = _fmt_bytes(s["adapter_bytes"]), _fmt_cap(s["bucket_cap_bytes"])
            print(
                f"  {s['engine']:6} {size:>10} cap {cap:>9}: http {s['http_ms']:8.1f}"
                f"  collective {s['collective_ms']:8.1f}  speedup {s['speedup']:5.2f}x"
                f"  peak {s['peak_main_mib_above_idle']}  (connect {s['collective_connect_ms']} ms, once)"
            )
        connects = {res["engine"]: res.get("collective_connects", 0) for res in results}
        print(f"  collective groups connected per engine over the whole run: {connects} (1: connected once)")
        for engine in connects:
            reconnected = next(r["collective_reconnects"] for r in results if r["engine"] == engine)
            if reconnected:
                print(f"  {engine}: {reconnected} group(s) reconnected inside a begin (timed in that rep)")
    print("\nengine side (medians, ms; memory of the engine's main process, MiB above idle)")
    head = (
        f"{'engine':6} {'adapter':14} {'cap':>9} {'read':>7} {'verify':>7} {'load':>7} {'probe':>7}"
        f" {'MiB/s in':>8} {'peak+':>6} {'after':>6}"
    )
    print(head)
    print("-" * len(head))
    for res in results:
        adapter = f"{res['adapter']} {_fmt_bytes(res['adapter_bytes'])}"
        for row in res["staged"]:
            ph, mem = row["engine_phases_ms"], row["engine_main_memory_mib"]
            if not ph["read_ms"]["n"]:
                continue
            med = {k: v["median"] for k, v in ph.items()}
            rate = row["payload_bytes"] / MiB / (row["buckets_ms"]["median"] / 1e3)
            peak = mem["peak_above_idle_mib"].get("median", float("nan"))
            after = mem["after_cleanup_above_idle_mib"].get("median", float("nan"))
            print(
                f"{res['engine']:6} {adapter:14} {_fmt_cap(row['bucket_cap_bytes']):>9}"
                f" {med['read_ms']:7.1f} {med['verify_ms']:7.1f} {med['load_ms']:7.1f} {med['probe_ms']:7.1f}"
                f" {rate:8.0f} {peak:6.1f} {after:6.1f}"
            )


# ------------------------------------------------------------------------------------------ layouts


def measured_engine(specs: list[EngineSpec]) -> str:
    """The engine whose scheduler has a core of its own in the pinned layout: the large one
    (the 27 MiB rank-64 adapter the goals are stated for), else the only one."""
    names = [s.name for s in specs]
    return "large" if "large" in names else names[0]


def measure_layout(
    layout: str, args: argparse.Namespace, cases: list[Case], specs: list[EngineSpec], source_dir: Path
) -> dict[str, Any]:
    """Every case on engines started for ``layout`` (bench/_layout.py), the reps interleaved."""
    measured = measured_engine(specs)
    specs = [
        dataclasses.replace(
            s,
            log_path=s.log_path.with_name(f"{s.name}-{layout}.log"),
            env={**s.env, **_layout.engine_env(layout, measured=s.name == measured)},
        )
        for s in specs
    ]
    t0 = time.monotonic()
    print(f"[{layout}] starting {len(specs)} engines in parallel (logs in {specs[0].log_path.parent}) ...")
    with running_engines(specs) as engines:
        startup_wall = time.monotonic() - t0
        startup = {e.name: round(e.started_s or 0.0, 1) for e in engines}
        print(f"[{layout}] engines healthy after {startup_wall:.1f}s: {startup}", flush=True)
        by_name = {e.name: e for e in engines}
        others = [e.proc.pid for e in engines if e.name != measured]
        pinned = _layout.apply(layout, by_name[measured].proc.pid, others)
        # One driver per engine, shared by its cases: one trainer per engine, so one collective
        # group per engine for the whole run (a driver per case had each case's sender replace
        # the others' group on the engine)
        drivers = {e.name: Driver(e.url) for e in engines}
        runners = [
            Runner(c, drivers[c.engine], by_name[c.engine].log_tail, by_name[c.engine].proc.pid,
                   by_name[c.engine].log_path, source_dir)
            for c in cases
        ]  # fmt: skip
        rss_before = {e.name: _rss_mib(e.proc.pid) for e in engines}
        rss_per_rep: list[dict[str, float | None]] = []
        try:
            for r in runners:  # warm-up: first adapter generation, first native load
                t1 = time.monotonic()
                r.run_rep(None)
                print(f"  warm-up {r.case.engine}: {time.monotonic() - t1:.1f}s", flush=True)
            # the collective receivers started in the warm-up: on the other cores too
            pinned["other"] = _layout.pin_the_rest(layout, by_name[measured].proc.pid, others)
            load_before = os.getloadavg()
            for rep in range(args.reps):
                t1 = time.monotonic()
                for r in runners:
                    r.run_rep(rep)
                rss_per_rep.append({e.name: _rss_mib(e.proc.pid) for e in engines})
                dt = time.monotonic() - t1
                print(f"  rep {rep + 1}/{args.reps}: {dt:.1f}s, main RSS MiB {rss_per_rep[-1]}", flush=True)
            leftovers = {r.case.engine: r.d.managed_versions() for r in runners}
        finally:
            for d in drivers.values():
                d.close()
            _layout.apply("shared", 0)
        return {
            "layout": layout,
            "pinned_pids": pinned,
            "results": [r.result() for r in runners],
            "measured_engine": measured,
            "leftover_versions": leftovers,
            "loadavg_before_measure": load_before,
            "loadavg_after_measure": os.getloadavg(),
            "engine_startup_s": startup,
            "engine_startup_wall_s": round(startup_wall, 1),
            "engine_main_rss_mib_before": rss_before,
            "engine_main_rss_mib_after": {e.name: _rss_mib(e.proc.pid) for e in engines},
            "engine_main_rss_mib_per_rep": rss_per_rep,
        }


def _layout_line(layout: str, out: dict[str, Any]) -> str:
    where = {
        "shared": "every process on every core",
        "pinned": f"the {out['measured_engine']} engine's scheduler alone on core {_layout.scheduler_core()},"
        " everything else on the other cores",
    }[layout]
    return (
        f"{where}; load average {tuple(round(x, 2) for x in out['loadavg_before_measure'])} ->"
        f" {tuple(round(x, 2) for x in out['loadavg_after_measure'])}; engine main-process RSS (MiB)"
        f" {out['engine_main_rss_mib_before']} -> {out['engine_main_rss_mib_after']}"
    )


def report(results: list[dict[str, Any]], leftovers: dict[str, list[str]]) -> None:
    print_table(results)
    for res in results:
        if res["staged_equals_stock_tokens"] is False:
            print(f"WARNING {res['engine']}: staged and stock greedy tokens differ: {res['warmup']}")
        for err in res["errors"]:
            print(f"ERROR {res['engine']} {err['where']}: {err['error']}")
    if any(leftovers.values()):
        print(f"WARNING managed versions left after the run: {leftovers}")


# --------------------------------------------------------------------------------------------- main


def _status_mib(pid: int, field: str) -> float | None:
    """A memory field of /proc/<pid>/status (VmRSS, VmHWM) of the engine's main process (HTTP
    server, tokenizer manager, bucket bodies in flight), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _rss_mib(pid: int) -> float | None:
    return _status_mib(pid, "VmRSS")


def _reset_peak(pid: int) -> float | None:
    """Reset the process's peak resident set (VmHWM) to its current RSS; returns that RSS."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_mib(pid, "VmRSS")


def _engine_phases(log_path: Path, lora_name: str) -> dict[str, float]:
    """The engine-side breakdown the plugin logs once per publication (publication.PhaseTimes)."""
    marker = f"publication phases {lora_name}:"
    for _ in range(50):  # the line is written before the reply; allow the log a moment to flush
        try:
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if marker in ln]
        except OSError:
            lines = []
        if lines:
            # key=number pairs only: another process's log line may be interleaved into it
            fields = dict(re.findall(r"(\w+)=(\d+(?:\.\d+)?)", lines[-1].split(marker, 1)[1]))
            return {f"engine_{k}": float(fields[k]) for k in ENGINE_PHASES if k in fields}
        time.sleep(0.02)
    return {}


def _lora_flags(max_rank: int) -> tuple[str, ...]:
    return (
        "--enable-lora",
        "--max-loras-per-batch", "3",
        "--max-loaded-loras", "3",
        "--max-lora-rank", str(max_rank),
        "--lora-target-modules", "all",
    )  # fmt: skip


def _parse_caps(text: str, unit: int) -> list[int]:
    return [int(float(x) * unit) for x in text.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny-caps", default="16,65536", help="KiB, comma separated (default 16 KiB, 64 MiB)")
    p.add_argument("--large-caps", default="1,4,64", help="MiB, comma separated")
    p.add_argument("--no-large", action="store_true", help="only the tiny engine")
    p.add_argument(
        "--sizes",
        default="1,8,32,128",
        help="MiB, comma separated: adapters of these sizes over the large base, published on a third"
        " engine (its --max-lora-rank fits the largest) to show time against size; '' for none",
    )
    p.add_argument(
        "--large-mem-fraction",
        default="0.5",
        help="--mem-fraction-static of the large engine: SGLang checks the ~290 MB of weights against the"
        " RAM free at start-up, and the default 0.1 fails when other engines share the machine (the KV cache"
        " stays capped by --max-total-tokens 4096 either way)",
    )
    _layout.add_layouts_option(p, measured="the large engine")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--run-dir", type=Path, default=None, help="engine logs (default .runs/bench-publish-*)")
    args = p.parse_args()
    t_start = time.monotonic()
    load_start = os.getloadavg()

    tiny = ensure_fixtures()
    cases = [
        Case("tiny", "A", tiny.adapter_dir("A"), 4, _parse_caps(args.tiny_caps, 1024)),
    ]
    fixtures_meta: dict[str, Any] = {"tiny": str(tiny.root)}
    specs_extra: list[EngineSpec] = []
    run_dir = args.run_dir or ROOT / ".runs" / f"bench-publish-{time.strftime('%Y%m%d-%H%M%S')}"
    # one local source directory for every engine, as for engines sharing a host with the trainer
    # on the engines' staging filesystem, so a handed-over file is taken over, not copied
    source_dir = default_staging_base() / f"lora-versions-bench-source-{run_dir.name}"
    source_dir.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, source_dir, True)
    env = {LOCAL_SOURCE_DIR_ENV: str(source_dir)}
    specs = [EngineSpec(name="tiny", model_path=tiny.model_dir, log_path=run_dir / "tiny.log", env=env)]
    if not args.no_large:
        t0 = time.monotonic()
        big = ensure_bench_fixtures()
        fixtures_meta["large"] = {"root": str(big.root), "base_config": LARGE_CONFIG, "rank": big.rank}
        print(f"bench fixtures ready in {time.monotonic() - t0:.1f}s: {big.root}", flush=True)
        cases.append(
            Case("large", f"r{big.rank}", big.adapter_dir, big.rank, _parse_caps(args.large_caps, MiB))
        )
        specs_extra.append(
            EngineSpec(
                name="large",
                model_path=big.model_dir,
                log_path=run_dir / "large.log",
                lora_flags=_lora_flags(big.rank),
                extra_args=("--mem-fraction-static", args.large_mem_fraction),
                env=env,
            )
        )
        sizes = [float(x) for x in args.sizes.split(",") if x.strip()]
        if sizes:
            sized = ensure_sized_adapters(big, sizes)
            for mib, adapter_dir in sized.items():
                rank = rank_for_mib(mib)
                cases.append(Case("sized", f"r{rank}", adapter_dir, rank, [64 * MiB]))
            specs_extra.append(
                EngineSpec(
                    name="sized",
                    model_path=big.model_dir,
                    log_path=run_dir / "sized.log",
                    lora_flags=_lora_flags(max(rank_for_mib(m) for m in sizes)),
                    extra_args=("--mem-fraction-static", args.large_mem_fraction),
                    env=env,
                )
            )
    specs += specs_extra

    t0 = time.monotonic()
    for c in cases:
        c.prepare()
    print(f"snapshots and payloads prepared in {time.monotonic() - t0:.1f}s", flush=True)

    layouts: dict[str, Any] = {}
    for layout in args.layouts:
        layouts[layout] = measure_layout(layout, args, cases, specs, source_dir)
        print(f"\n[{layout}] {_layout_line(layout, layouts[layout])}")
        report(layouts[layout]["results"], layouts[layout]["leftover_versions"])

    import sglang
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "reps": args.reps,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "run_time_s": round(time.monotonic() - t_start, 1),
        "engine_logs": str(run_dir),
        "fixtures": fixtures_meta,
        "layouts": args.layouts,
        "measured_engine": measured_engine(specs),
        "notes": [
            "CPU engines (torch_native LoRA backend), fp32; another agent may share the 2 cores.",
            "staged total = begin + buckets + end; payloads encoded before the clock (client_encode_ms).",
            "end = pinned load of the staged files + 1-token exact-version probe; stock load has no probe,",
            "so ratio_vs_stock_load_gen compares with stock load + a 1-token generation.",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "meta": meta,
                "layouts": {
                    layout: {**out, "collective_vs_http": transport_speedups(out["results"])}
                    for layout, out in layouts.items()
                },
            },
            indent=2,
        )
        + "\n"
    )
    print(
        f"\nrun time {meta['run_time_s']}s; load average {load_start} -> {meta['loadavg_end']};"
        f" wrote {args.out}"
    )
    return 1 if any(res["errors"] for out in layouts.values() for res in out["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
