"""Publication to many engines, by simulation (issue 42): trainer egress, time and the commit rule.

N engine shells in this one process, each the engine's REAL control plane (the plugin's routes,
``sglang_ext.http_routes.install``, on a FastAPI app over the real PublicationService,
ReclaimService and VersionTable, wired by ``sglang_ext.engine_state.assemble_engine``) with only
the native edge faked (``tests/_fake_native.py``: a load reads the staged files and registers a
fresh id; no SGLang, no GPU copy, no probe generation). The trainer side is the real one: the
publisher of ``relax_glue.cohort.Cohort.open`` over an in-memory registry, one real
``EngineClient`` per shell. The shells run on an event loop of their own, on a thread of their
own, so the process's CPU time splits into the trainer's and the engines' (their loop thread,
the plugin's write and verify pools, and for the collective the receiver processes).

What is measured, per N and transport:

* **trainer egress per publication.** HTTP: every request the engine clients send, as HTTP/1.1
  bytes (request line, headers and body framing serialised by h11, the library httpcore writes
  HTTP/1.1 with; no TLS). The requests go to the shells' ASGI apps in memory (no socket), so
  these bytes are computed from the requests the client built, not read off a socket. Collective:
  the same HTTP count for its control calls (begin, the bucket acknowledgements without bodies,
  end, status) plus what the trainer's gloo groups sent, read from the kernel (``TCP_INFO``
  ``tcpi_bytes_acked`` of every TCP socket of this process: the trainer's end of each engine's
  group and its rendezvous stores; the shells talk to their receivers over pipes).
* **seconds per publication** (p50 over ``--reps``, each after ``reclaim_ready``), its phases
  (begin, buckets, end, commit: the publisher's own ``phase_s``), and the CPU seconds of the
  trainer and of all N engines together. Wall time here is the trainer's and every engine's
  main-process work on this host's cores: on real hosts the engines' part runs in parallel.
* **the commit rule**: one more publication, in which one engine (seeded) is lost at a seeded
  point (a bucket's acknowledgement or ``end``): from that call on its shell refuses every
  connection (a dead process), and over the collective its receiver process is killed too.
  Reported: the outcome (never PUBLISHED), the time to it, the registry's state, then the
  cleanup (abort, ``resolve()`` cleans every engine that answers, the operator declares the
  engine lost) and what is left on the surviving shells (managed version, loaded adapter,
  staged files): nothing.
* **a gloo broadcast in one group of N + 1 ranks** (with the collective; ``--no-tree-probe``
  skips it): how many copies of the buffer the root sends (measured from the root process's
  sockets), the alternative to the transport's one two-rank group per engine.

Prints a table, writes ``bench/results/scale_publication.json``.

    .venv/bin/python bench/scale_publication.py            # N = 4, 16, 64 (collective at 4 and 16)
    .venv/bin/python bench/scale_publication.py --short    # the CI form: N = 2, 4, HTTP, 2.4 MiB, seeded
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import random
import resource
import secrets
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # tests/ holds the fake native edge (tests/_fake_native.py)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import h11  # noqa: E402
import httpx  # noqa: E402
from _fake_native import FakeNative, fake_base  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from lora_contract.protocol import COLLECTIVE_TRANSPORT, Routes  # noqa: E402
from relax_glue.bucket_transport import CollectiveTransport  # noqa: E402
from relax_glue.cohort import Cohort  # noqa: E402
from relax_glue.collective_sender import CollectiveSender  # noqa: E402
from relax_glue.engine_client import EngineClient  # noqa: E402
from relax_glue.publisher import PublishOutcome, PublishResult  # noqa: E402
from relax_glue.registry import LoRAVersionRegistry  # noqa: E402
from relax_glue.snapshot import Snapshot  # noqa: E402
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry  # noqa: E402
from sglang_ext.bucket_sources import OutOfBandReceive, ReceiveSetup, build_receives  # noqa: E402
from sglang_ext.engine_state import (  # noqa: E402
    ENGINE_BUCKET_CAP_BYTES,
    ENGINE_VERSION_CAP_BYTES,
    EngineState,
    assemble_engine,
)
from sglang_ext.http_routes import install  # noqa: E402
from sglang_ext.staging import StagingArea  # noqa: E402
from sglang_ext.version_table import StagingLimits, VersionTable  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "scale_publication.json"
EPOCH = "scale"
T = TypeVar("T")

# The base the shells "serve": Qwen3-0.6B's LoRA geometry (28 layers, hidden 1024, 16 query and
# 8 key/value heads of 128, MLP 3072), so the adapter is one a real engine would admit.
GEOMETRY = ModelGeometry(
    "Qwen3ForCausalLM", num_layers=28, hidden_size=1024, intermediate_size=3072, q_size=2048, kv_size=1024
)
MAX_LORA_RANK = 64
# (module, PEFT path, in features, out features) of every linear module a LoRA targets here
MODULES = (
    ("q_proj", "self_attn", GEOMETRY.hidden_size, GEOMETRY.q_size),
    ("k_proj", "self_attn", GEOMETRY.hidden_size, GEOMETRY.kv_size),
    ("v_proj", "self_attn", GEOMETRY.hidden_size, GEOMETRY.kv_size),
    ("o_proj", "self_attn", GEOMETRY.q_size, GEOMETRY.hidden_size),
    ("gate_proj", "mlp", GEOMETRY.hidden_size, GEOMETRY.intermediate_size),
    ("up_proj", "mlp", GEOMETRY.hidden_size, GEOMETRY.intermediate_size),
    ("down_proj", "mlp", GEOMETRY.intermediate_size, GEOMETRY.hidden_size),
)
# fp32 bytes of one rank of that adapter (A: r x in, B: out x r, every module of every layer)
BYTES_PER_RANK = 4 * GEOMETRY.num_layers * sum(i + o for _, _, i, o in MODULES)
MIB = 1024 * 1024
CAPACITY = 2  # the RFC's K: a publication needs the previous retired version reclaimed first
PHASES = ("reserve", "begin", "buckets", "end", "commit")  # the publisher's phase_s keys


# ------------------------------------------------------------------------------- the adapter


def rank_for(adapter_mib: float) -> int:
    """The rank whose all-linear fp32 adapter on the base above is closest to ``adapter_mib``."""
    return max(1, min(MAX_LORA_RANK, round(adapter_mib * MIB / BYTES_PER_RANK)))


class Adapters:
    """Distinct snapshots of one shape: the tensors are drawn once (seeded); each version
    changes one value, so every publication carries a new digest at the price of one copy."""

    def __init__(self, rank: int, bucket_bytes: int, seed: int) -> None:
        import torch  # lazy heavy import: the table printer and the tests' parts need none

        gen = torch.Generator().manual_seed(seed)
        self.rank, self.bucket_bytes = rank, bucket_bytes
        self.config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": [m for m, *_ in MODULES]}
        self.tensors: dict[str, Any] = {}
        for layer in range(GEOMETRY.num_layers):
            for module, block, fan_in, fan_out in MODULES:
                stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
                self.tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
                self.tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        self._first = next(iter(self.tensors))

    def snapshot(self, version: int) -> Snapshot:
        tensors = dict(self.tensors)
        first = tensors[self._first].clone()
        first[0, 0] = float(version)
        tensors[self._first] = first
        return Snapshot.from_tensors(self.config, tensors, max_bucket_bytes=self.bucket_bytes)


# ---------------------------------------------------------------------------- the wire counts


@dataclasses.dataclass
class Wire:
    """Bytes one engine's client put on the wire (requests) and took off it (replies), as
    HTTP/1.1 would carry them, and its calls by op."""

    egress: int = 0
    ingress: int = 0
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    egress_by_op: dict[str, int] = dataclasses.field(default_factory=dict)

    def add_call(self, op: str, egress: int, ingress: int) -> None:
        self.egress += egress
        self.ingress += ingress
        self.calls[op] = self.calls.get(op, 0) + 1
        self.egress_by_op[op] = self.egress_by_op.get(op, 0) + egress

    def copy(self) -> Wire:
        return Wire(self.egress, self.ingress, dict(self.calls), dict(self.egress_by_op))

    def minus(self, earlier: Wire) -> Wire:
        """What went over the wire since ``earlier`` (a copy of this one)."""
        return Wire(
            self.egress - earlier.egress,
            self.ingress - earlier.ingress,
            {
                op: k - earlier.calls.get(op, 0)
                for op, k in self.calls.items()
                if k != earlier.calls.get(op, 0)
            },
            {
                op: b - earlier.egress_by_op.get(op, 0)
                for op, b in self.egress_by_op.items()
                if b != earlier.egress_by_op.get(op, 0)
            },
        )

    @staticmethod
    def total(wires: Iterable[Wire]) -> Wire:
        out = Wire()
        for w in wires:
            out.egress += w.egress
            out.ingress += w.ingress
            for op, k in w.calls.items():
                out.calls[op] = out.calls.get(op, 0) + k
            for op, b in w.egress_by_op.items():
                out.egress_by_op[op] = out.egress_by_op.get(op, 0) + b
        return out


def request_head(request: httpx.Request) -> tuple[h11.Connection, int]:
    """The request line and headers as httpcore's HTTP/1.1 connection writes them (h11), and the
    h11 connection that frames the body that follows (Content-Length or chunked)."""
    conn = h11.Connection(h11.CLIENT)
    head = conn.send(
        h11.Request(method=request.method, target=request.url.raw_path, headers=request.headers.raw)
    )
    return conn, len(head or b"")


def body_framing(conn: h11.Connection, chunk: bytes | memoryview) -> int:
    """Bytes h11 writes for one body chunk (the chunk itself and, chunked, its size line)."""
    pieces = conn.send_with_data_passthrough(h11.Data(data=chunk)) or []
    return sum(len(p) for p in pieces)


def response_bytes(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> int:
    """A reply as an HTTP/1.1 server writes it: status line, headers, body (replies here carry
    a Content-Length)."""
    reason = h11._util.bytesify(httpx.codes.get_reason_phrase(status))  # type: ignore[attr-defined]
    head = len(b"HTTP/1.1 %d %s\r\n" % (status, reason)) + 2
    head += sum(len(k) + 2 + len(v) + 2 for k, v in headers)
    return head + len(body)


def tcp_bytes_sent() -> int:
    """Data bytes this process's TCP sockets sent and had acknowledged, summed (the kernel's
    ``tcpi_bytes_acked`` of each socket; a socket closed since is not counted)."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                sock.getpeername()
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            except OSError:
                continue  # a listening socket, or one that closed meanwhile
            # struct tcp_info (linux/tcp.h): __u64 tcpi_bytes_acked at byte offset 120
            total += struct.unpack_from("Q", info, 120)[0]
    return total


# ------------------------------------------------------------------------ the engines' thread


class EngineLoop:
    """The shells' event loop, on a thread of its own: what the engines do is then CPU time of
    that thread (and of the plugin's pools), apart from the trainer's on the main thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="engine-io")
        self.loop.set_default_executor(self.executor)
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self.thread.start()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.executor.shutdown(wait=False)


class CpuClock:
    """CPU seconds of this process split into the engines' (their loop thread and the plugin's
    pools, plus the collective receiver processes) and the trainer's (everything else of this
    process: its event loop, its broadcast threads, gloo's own threads)."""

    ENGINE_THREADS = ("engine-loop", "engine-io", "lora-versions-")

    def __init__(self, receivers: Callable[[], list[int]] = list) -> None:
        self.receivers = receivers

    def read(self) -> tuple[float, float]:
        """(trainer, engines) CPU seconds so far."""
        usage = resource.getrusage(resource.RUSAGE_SELF)  # this process only, its children apart
        process = usage.ru_utime + usage.ru_stime
        engine_threads = 0.0
        for t in threading.enumerate():
            if t.ident is not None and t.name.startswith(self.ENGINE_THREADS):
                with contextlib.suppress(OSError, ProcessLookupError):  # it ended meanwhile
                    engine_threads += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        receivers = sum(_process_cpu(pid) for pid in self.receivers())
        return process - engine_threads, engine_threads + receivers

    def delta(self, before: tuple[float, float]) -> tuple[float, float]:
        now = self.read()
        return now[0] - before[0], now[1] - before[1]


def _process_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ engine shells


class LeanNative(FakeNative):
    """The fake native edge, keeping no tensors after a load: N shells of K versions each would
    otherwise hold N x K adapters in this one process. The load still reads the staged files."""

    async def load_pinned(self, lora_name: str, adapter_dir: Path) -> str:
        lora_id = await super().load_pinned(lora_name, adapter_dir)
        self.loaded[lora_id] = {}
        return lora_id


class Shell:
    """One engine: the real control plane over the fake native edge, served in memory (ASGI).
    Built and driven on the engine loop only."""

    def __init__(self, engine_id: str, staging_base: Path, collective: bool) -> None:
        self.engine_id = engine_id
        limits = StagingLimits(
            managed_capacity=CAPACITY,
            lora=EngineLoraShape(GEOMETRY, max_lora_rank=MAX_LORA_RANK, served_modules=None),
            max_version_bytes=ENGINE_VERSION_CAP_BYTES,
            max_bucket_bytes=ENGINE_BUCKET_CAP_BYTES,
        )
        state = EngineState(incarnation=f"{engine_id}-{uuid.uuid4().hex[:12]}", base=fake_base("base"))
        self.native = LeanNative()
        self.table = VersionTable(state.incarnation, limits, base_fingerprint=state.base.fingerprint)
        self.staging = StagingArea(staging_base)
        # the collective's receive, built as the engine builds every registered transport's
        receives: list[OutOfBandReceive] = []
        if collective:
            setup = ReceiveSetup(self.staging, limits.max_bucket_bytes, state.incarnation, lambda _m: None)
            receives = build_receives(setup)
        self.links = [r.link for r in receives if r.transport == COLLECTIVE_TRANSPORT]  # type: ignore[attr-defined]
        assemble_engine(state, self.table, self.native, self.staging, out_of_band=receives)
        app = FastAPI()
        install(app, state)
        self.app = httpx.ASGITransport(app=app)

    async def serve(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], chunks: list[bytes | memoryview]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One request as the engine's server hands it to the app (the body's chunks as bytes,
        the copy a server makes off its socket), and the whole reply."""
        request = httpx.Request(method, url, headers=headers, stream=_Chunks(chunks))
        response = await self.app.handle_async_request(request)
        body = await response.aread()
        return response.status_code, list(response.headers.raw), body

    def receiver_pids(self) -> list[int]:
        procs = [link._proc for link in self.links]  # the link owns its receiver process
        return [p.pid for p in procs if p is not None and p.returncode is None]

    async def lose(self) -> None:
        """The engine process is gone: its receiver goes with it (the link kills it)."""
        for link in self.links:
            await link.close()

    def leftovers(self, lora_name: str) -> list[str]:
        """What this shell still holds of ``lora_name``: a managed version, a loaded adapter,
        staged files (none of any version should be on disk here between publications)."""
        out = []
        version = self.table.get(lora_name)
        if version is not None and version.state.holds_slot:  # a CLEANED tombstone holds nothing
            out.append(f"version {version.state.value}")
        if self.native.lora_id_of(lora_name) is not None:
            out.append("adapter loaded")
        files = [p for p in self.staging.root.rglob("*") if p.is_file()]
        if files:
            out.append(f"{len(files)} staged files")
        return out

    async def close(self) -> None:
        for link in self.links:
            await link.close()
        self.staging.close()


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes | memoryview]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield bytes(chunk)


@dataclasses.dataclass
class LossPoint:
    """Where the lost engine stops answering: the acknowledgement of bucket ``index``, or end."""

    op: str  # "receive_bucket" | "end"
    index: int = -1

    def __str__(self) -> str:
        return f"bucket {self.index}" if self.op == "receive_bucket" else "end"


class ShellTransport(httpx.AsyncBaseTransport):
    """The trainer's side of one engine's HTTP: counts what the engine client sends and gets,
    as HTTP/1.1 bytes, and hands the request to the shell on the engine loop. ``arm`` loses the
    engine at a point: from that call on, every connection is refused."""

    def __init__(self, shell: Shell, engines: EngineLoop) -> None:
        self.shell, self.engines = shell, engines
        self.wire = Wire()
        self.loss: LossPoint | None = None
        self.lost = False

    def arm(self, loss: LossPoint) -> None:
        self.loss = loss

    def _hits(self, op: str, request: httpx.Request) -> bool:
        if self.loss is None or op != self.loss.op:
            return False
        return op == "end" or request.headers.get("X-Bucket-Index") == str(self.loss.index)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        op = _op_of(request)
        if not self.lost and self._hits(op, request):
            self.lost = True
            await self.engines.call(self.shell.lose())
        if self.lost:
            raise httpx.ConnectError("engine lost: connection refused", request=request)
        conn, head = request_head(request)
        chunks = [chunk async for chunk in request.stream]
        body = sum(body_framing(conn, c) for c in chunks if len(c))
        body += len(conn.send(h11.EndOfMessage()) or b"")
        status, headers, content = await self.engines.call(
            self.shell.serve(request.method, str(request.url), list(request.headers.raw), chunks)
        )
        self.wire.add_call(op, head + body, response_bytes(status, headers, content))
        return httpx.Response(status, headers=headers, content=content, request=request)


def _op_of(request: httpx.Request) -> str:
    path = request.url.path
    ops = {
        Routes.BEGIN: "begin",
        Routes.RECEIVE_BUCKET: "receive_bucket",
        Routes.END: "end",
        Routes.CLEANUP: "cleanup",
        Routes.RECLAIM: "reclaim",
        Routes.STATUS: "status",
        Routes.COLLECTIVE_CONNECT: "collective_connect",
    }
    if path in ops:
        return ops[path]
    return "version_status" if path.startswith(Routes.STATUS + "/") else "other"


async def connect_groups(clients: dict[str, EngineClient], at_once: int) -> float:
    """Connect every engine's collective group before the first publication, ``at_once`` at a
    time; the seconds it took. Why not inside the first publication's begins, as a trainer does:
    each connect starts a receiver process that imports torch (about 10 s and 650 MB at its peak
    on this host), so N of them at once do not fit here, and one at a time the first engines'
    posted receives would wait longer than the group's 30 s timeout for the buckets, which go
    only once every engine is PREPARED (a hazard of its own at scale: docs/scale.md)."""
    gate = asyncio.Semaphore(at_once)

    async def connect(client: EngineClient) -> None:
        transport = client.transport
        assert isinstance(transport, CollectiveTransport)
        async with gate:
            await transport.sender.connect(transport._ask_engine(client))

    t = time.monotonic()
    await asyncio.gather(*(connect(c) for c in clients.values()))
    return time.monotonic() - t


# ----------------------------------------------------------------------------------- records


@dataclasses.dataclass
class Publication:
    """One publication as measured."""

    outcome: str
    wall_s: float
    trainer_cpu_s: float
    engines_cpu_s: float
    http_egress: int  # bytes of every request to every engine
    group_egress: int  # bytes the trainer's collective groups sent (0 over HTTP)
    ingress: int
    phase_s: dict[str, float]
    calls: dict[str, int]  # HTTP calls by op, all engines
    egress_by_op: dict[str, int]  # HTTP request bytes by op, all engines

    @property
    def egress(self) -> int:
        return self.http_egress + self.group_egress


@dataclasses.dataclass
class LostRun:
    """The commit rule with one engine lost mid-publication."""

    engine: str
    point: str
    outcome: str
    registry_state: str | None
    default_moved: bool
    time_to_outcome_s: float
    unknown_engines: list[str]
    cleanup_outcome: str | None
    cleanup_s: float
    final_state: str | None
    leftovers: dict[str, list[str]]

    @property
    def committed(self) -> bool:
        return self.outcome in (PublishOutcome.PUBLISHED.value, PublishOutcome.ALREADY_PUBLISHED.value)


@dataclasses.dataclass
class Cell:
    """One transport at one N."""

    transport: str
    engines: int
    adapter_bytes: int
    buckets: int
    first: Publication  # the first publication (the epoch's base is recorded: a status read more)
    reps: list[Publication]
    lost: LostRun | None
    setup_s: float  # shells, clients and (collective) groups
    connect_s: float = 0.0  # the collective's groups, ``connect_at_once`` at a time

    def p50(self, field: str) -> float:
        return statistics.median(getattr(p, field) for p in self.reps)

    def phase_p50(self, phase: str) -> float:
        return statistics.median(p.phase_s.get(phase, 0.0) for p in self.reps)

    def summary(self) -> dict[str, Any]:
        mib = self.adapter_bytes / MIB
        egress = self.p50("egress")
        return {
            "egress_bytes": egress,
            "egress_bytes_per_engine": egress / self.engines,
            "egress_per_engine_over_adapter": egress / self.engines / self.adapter_bytes,
            "wall_s_p50": self.p50("wall_s"),
            "trainer_cpu_s_p50": self.p50("trainer_cpu_s"),
            "engines_cpu_s_p50": self.p50("engines_cpu_s"),
            "trainer_cpu_ms_per_engine_mib": 1e3 * self.p50("trainer_cpu_s") / self.engines / mib,
            "engines_cpu_ms_per_engine_mib": 1e3 * self.p50("engines_cpu_s") / self.engines / mib,
            "wall_ms_per_engine_mib": 1e3 * self.p50("wall_s") / self.engines / mib,
            "phase_s_p50": {ph: self.phase_p50(ph) for ph in PHASES},
        }


@dataclasses.dataclass
class Config:
    """One run: the N and transports to measure, the adapter, and what else to run."""

    engines: list[int]
    transports: list[str]
    collective_engines: list[int]
    adapter_mib: float
    bucket_mib: float
    reps: int
    seed: int
    lost: bool = True
    tree_probe: bool = True
    connect_at_once: int = 2
    collective_timeout_s: float = 120.0


# --------------------------------------------------------------------------------- one cell


async def run_cell(
    transport: str, n: int, adapters: Adapters, cfg: Config, engines: EngineLoop, staging_base: Path
) -> Cell:
    """Publish to ``n`` shells over ``transport``: one first publication, ``cfg.reps`` measured
    ones, then (``cfg.lost``) one with an engine lost mid-way, and its cleanup."""
    t_setup = time.monotonic()
    collective = transport == "collective"
    ids = [f"E{i:03d}" for i in range(n)]

    async def build() -> list[Shell]:
        return [Shell(e, staging_base, collective) for e in ids]

    shells = dict(zip(ids, await engines.call(build()), strict=True))
    wires = {e: ShellTransport(shells[e], engines) for e in ids}
    admin_key = secrets.token_urlsafe(32)  # as a deployment sends it: its header is egress too

    def bucket_transport() -> Any:
        return (
            CollectiveTransport(CollectiveSender(timeout_s=cfg.collective_timeout_s)) if collective else None
        )

    clients = {
        e: EngineClient(
            e,
            f"http://{e.lower()}.engines.local:30000",
            admin_key=admin_key,
            control_transport=wires[e],
            generation_transport=wires[e],
            transport=bucket_transport(),
        )
        for e in ids
    }
    registry = LoRAVersionRegistry(EPOCH, tuple(ids), CAPACITY)
    cohort = Cohort.open(registry, clients, reclaim_wait_s=0.05, reclaim_poll_s=0.01)
    publisher = cohort.publisher

    def receivers() -> list[int]:
        return [pid for s in shells.values() for pid in s.receiver_pids()]

    clock = CpuClock(receivers)
    version = 0

    async def publish(snapshot: Snapshot) -> tuple[PublishResult, Publication]:
        nonlocal version
        await cohort.reclaim_ready()  # frees the slot of the version retired by the last commit
        wires0 = {e: w.wire.copy() for e, w in wires.items()}
        tcp0, cpu0, t0 = tcp_bytes_sent(), clock.read(), time.perf_counter()
        res = await publisher.publish(snapshot, f"v{version}")
        wall = time.perf_counter() - t0
        trainer_cpu, engines_cpu = clock.delta(cpu0)
        group = tcp_bytes_sent() - tcp0 if collective else 0
        version += 1
        sent = Wire.total(w.wire.minus(wires0[e]) for e, w in wires.items())
        return res, Publication(
            outcome=res.outcome.value,
            wall_s=wall,
            trainer_cpu_s=trainer_cpu,
            engines_cpu_s=engines_cpu,
            http_egress=sent.egress,
            group_egress=group,
            ingress=sent.ingress,
            phase_s=dict(res.phase_s),
            calls=sent.calls,
            egress_by_op=sent.egress_by_op,
        )

    # N engines' objects live in this one process: a full collection would walk every shell's
    # at each publication (an engine process walks only its own), so what exists now is frozen
    gc.collect()
    gc.freeze()
    try:
        connect_s = await connect_groups(clients, cfg.connect_at_once) if collective else 0.0
        setup_s = time.monotonic() - t_setup
        snapshot = adapters.snapshot(0)
        res, first = await publish(snapshot)
        if res.outcome is not PublishOutcome.PUBLISHED:
            raise RuntimeError(f"{transport} N={n}: the first publication ended {res.outcome}: {res.error}")
        reps: list[Publication] = []
        for _ in range(cfg.reps):
            res, pub = await publish(adapters.snapshot(version))
            if res.outcome is not PublishOutcome.PUBLISHED:
                raise RuntimeError(f"{transport} N={n}: a publication ended {res.outcome}: {res.error}")
            reps.append(pub)
        lost = await lost_run(cohort, shells, wires, adapters, version, cfg.seed + n) if cfg.lost else None
        buckets = len(snapshot.bucket_plan)
        return Cell(transport, n, snapshot.total_bytes, buckets, first, reps, lost, setup_s, connect_s)
    finally:
        for c in clients.values():
            await c.aclose()

        async def close_all() -> None:
            for s in shells.values():
                await s.close()

        await engines.call(close_all())
        gc.unfreeze()


async def lost_run(
    cohort: Cohort,
    shells: dict[str, Shell],
    wires: dict[str, ShellTransport],
    adapters: Adapters,
    version: int,
    seed: int,
) -> LostRun:
    """One publication with a random engine lost at a random point (seeded), then the cleanup a
    trainer does when it gives that engine up: abort, resolve (cleanup on every engine that
    answers), the operator's declaration that the engine is lost."""
    rng = random.Random(seed)
    snapshot = adapters.snapshot(version)
    points = [LossPoint("receive_bucket", i) for i in range(len(snapshot.bucket_plan))] + [LossPoint("end")]
    lost, point = rng.choice(sorted(shells)), rng.choice(points)
    await cohort.reclaim_ready()
    before = (await cohort.registry.status()).default
    wires[lost].arm(point)
    res = await cohort.publisher.publish(snapshot, f"v{version}")
    view = await cohort.registry.version(version_key=res.version_key)
    status = await cohort.registry.status()
    t = time.monotonic()
    cleanup = None
    if view is not None and view.state.value == "LOADING":
        await cohort.registry.abort(attempt_token=res.attempt_token, reason="bench: an engine was lost")
    if view is not None and view.state.value in ("LOADING", "ABORTED"):
        resolved = await cohort.publisher.resolve()
        cleanup = resolved.outcome.value if resolved is not None else None
    await cohort.registry.declare_engine_lost(engine_id=lost, reason=f"bench: {lost} lost at {point}")
    final = await cohort.registry.version(version_key=res.version_key)
    cleanup_s = time.monotonic() - t
    survivors = [e for e in sorted(shells) if e != lost]

    async def leftovers() -> dict[str, list[str]]:
        return {e: shells[e].leftovers(res.lora_name) for e in survivors}

    engines = next(iter(wires.values())).engines
    return LostRun(
        engine=lost,
        point=str(point),
        outcome=res.outcome.value,
        registry_state=view.state.value if view is not None else None,
        default_moved=status.default != before,
        time_to_outcome_s=res.duration_s,
        unknown_engines=list(res.unknown),
        cleanup_outcome=cleanup,
        cleanup_s=cleanup_s,
        final_state=final.state.value if final is not None else None,
        leftovers={e: left for e, left in (await engines.call(leftovers())).items() if left},
    )


# ------------------------------------------------------------------- one group of N + 1 ranks


@dataclasses.dataclass
class TreeProbe:
    """One gloo broadcast of ``nbytes`` from rank 0 to N other ranks in one group."""

    receivers: int
    nbytes: int
    root_sent: int
    copies: float  # root_sent / nbytes
    binomial_copies: int  # ceil(log2(N + 1)): gloo's binomial tree, from its source


def _probe_ranks(port: int, size: int, nbytes: int) -> None:
    """Ranks 1..size-1 of the probe's group, as threads of one process (a spawn target)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=300))
        group = dist.ProcessGroupGloo(dist.PrefixStore("probe", store), r, size, timedelta(seconds=300))
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        group.barrier().wait()  # as the root: every pair connected before the broadcast
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        group.broadcast([buf], opts).wait()
        if int(buf[-1]) != (nbytes - 1) % 256:
            raise SystemExit(f"rank {r} got another buffer")
        group.barrier().wait()
        group.barrier().wait()  # the root has read its sockets: they may close now

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _probe_root(receivers: int, nbytes: int, out: Any) -> None:
    """Rank 0 of the probe's group, alone in its process: every byte its sockets sent is its
    (the rendezvous store's sockets excluded). A spawn target; puts the bytes on ``out``."""
    import multiprocessing as mp
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    size = receivers + 1
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    ranks = mp.get_context("spawn").Process(target=_probe_ranks, args=(store.port, size, nbytes))
    ranks.start()
    group = dist.ProcessGroupGloo(dist.PrefixStore("probe", store), 0, size, timedelta(seconds=300))
    buf = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    group.barrier().wait()  # every pair is connected: only the broadcast moves bytes below
    before = tcp_bytes_sent()
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([buf], opts).wait()
    group.barrier().wait()  # every rank has its copy: every byte sent is acknowledged by now
    sent = tcp_bytes_sent() - before  # (a barrier's own bytes: a few hundred)
    group.barrier().wait()
    ranks.join(300)
    out.put(sent)


def tree_probe(receivers: int, nbytes: int) -> TreeProbe:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    root = ctx.Process(target=_probe_root, args=(receivers, nbytes, out))
    root.start()
    sent = out.get(timeout=600)
    root.join(60)
    return TreeProbe(receivers, nbytes, sent, sent / nbytes, math.ceil(math.log2(receivers + 1)))


# ------------------------------------------------------------------------------------ report


def _cells_for(cfg: Config) -> list[tuple[str, int]]:
    return [(t, n) for n in cfg.engines for t in cfg.transports if t == "http" or n in cfg.collective_engines]


async def measure(cfg: Config, log: Callable[[str], None] = print) -> list[Cell]:
    rank = rank_for(cfg.adapter_mib)
    adapters = Adapters(rank, int(cfg.bucket_mib * MIB), cfg.seed)
    engines = EngineLoop()
    staging_base = Path(tempfile.mkdtemp(prefix="scale-publication-", dir=_staging_root()))
    cells: list[Cell] = []
    try:
        for transport, n in _cells_for(cfg):
            log(f"  {transport} x {n} engines ...")
            cell = await run_cell(transport, n, adapters, cfg, engines, staging_base)
            log(f"    p50 {cell.p50('wall_s'):.3f} s, egress {cell.p50('egress') / MIB:.1f} MiB")
            cells.append(cell)
    finally:
        engines.close()
        shutil.rmtree(staging_base, ignore_errors=True)
    return cells


def _staging_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def table_rows(cells: list[Cell]) -> list[list[str]]:
    rows = []
    for c in cells:
        s = c.summary()
        ph = s["phase_s_p50"]
        lost = c.lost
        rows.append(
            [
                str(c.engines),
                c.transport,
                _mib(s["egress_bytes"]),
                _mib(s["egress_bytes_per_engine"]),
                f"{s['egress_per_engine_over_adapter']:.4f}",
                f"{s['wall_s_p50']:.3f}",
                f"{s['trainer_cpu_s_p50']:.3f}",
                f"{s['engines_cpu_s_p50']:.3f}",
                "/".join(f"{1e3 * ph[p]:.0f}" for p in ("begin", "buckets", "end", "commit")),
                f"{lost.engine} at {lost.point}" if lost else "-",
                lost.outcome if lost else "-",
                f"{1e3 * lost.time_to_outcome_s:.0f}" if lost else "-",
                f"{lost.cleanup_outcome} -> {lost.final_state}" if lost else "-",
                str(sum(len(v) for v in lost.leftovers.values())) if lost else "-",
            ]
        )
    return rows


HEADER = [
    "N",
    "transport",
    "egress MiB/pub",
    "MiB/engine",
    "x adapter",
    "wall s p50",
    "trainer CPU s",
    "engines CPU s",
    "begin/buckets/end/commit ms",
    "lost engine",
    "outcome",
    "to outcome ms",
    "cleanup -> state",
    "leftovers",
]


def print_table(cells: list[Cell], probes: list[TreeProbe]) -> None:
    rows = [HEADER, *table_rows(cells)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for k, row in enumerate(rows):
        cols = enumerate(zip(row, widths, strict=True))
        print("  ".join(v.rjust(w) if k and i != 1 else v.ljust(w) for i, (v, w) in cols))
    if cells:
        c = cells[0]
        print(
            f"adapter {_mib(c.adapter_bytes)} MiB in {c.buckets} buckets; wall and CPU: p50 of "
            f"{len(c.reps)} publications; egress = HTTP/1.1 request bytes (+ the gloo groups' TCP bytes)"
        )
    for c in cells:
        if c.transport == "collective":
            print(f"collective x {c.engines}: {c.engines} groups connected in {c.connect_s:.1f} s")
    for p in probes:
        print(
            f"gloo broadcast, one group of {p.receivers} + 1 ranks: the root sent {p.copies:.3f} x the "
            f"buffer (binomial tree: ceil(log2({p.receivers + 1})) = {p.binomial_copies})"
        )


def report(cfg: Config, cells: list[Cell], probes: list[TreeProbe], wall_s: float) -> dict[str, Any]:
    return {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "argv": sys.argv[1:],
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
            "wall_s": round(wall_s, 1),
            "config": dataclasses.asdict(cfg),
            "rank": rank_for(cfg.adapter_mib),
            "base": dataclasses.asdict(GEOMETRY),
        },
        "cells": [
            {
                "transport": c.transport,
                "engines": c.engines,
                "adapter_bytes": c.adapter_bytes,
                "buckets": c.buckets,
                "setup_s": c.setup_s,
                "connect_s": c.connect_s,
                **c.summary(),
                "first": dataclasses.asdict(c.first),
                "reps": [dataclasses.asdict(p) for p in c.reps],
                "lost": dataclasses.asdict(c.lost) if c.lost else None,
            }
            for c in cells
        ],
        "tree_probe": [dataclasses.asdict(p) for p in probes],
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=_ints, default=[4, 16, 64], help="N, comma separated")
    parser.add_argument("--transports", default="http,collective", help="http, collective")
    parser.add_argument(
        "--collective-engines",
        type=_ints,
        default=[4, 16],
        help="the N the collective runs at: each engine's receiver is a process importing torch "
        "(about 290 MiB of private memory here), so 64 of them do not fit this host",
    )
    parser.add_argument(
        "--adapter-mib",
        type=float,
        default=10.0,
        help=f"adapter size: all-linear, fp32, on a Qwen3-0.6B-shaped base ({BYTES_PER_RANK / MIB:.2f} "
        "MiB per rank; the rank closest to this size)",
    )
    parser.add_argument("--bucket-mib", type=float, default=2.0, help="bucket size")
    parser.add_argument("--reps", type=int, default=5, help="measured publications per cell")
    parser.add_argument("--seed", type=int, default=0, help="which engine is lost, and where")
    parser.add_argument("--no-tree-probe", action="store_true", help="skip the one-group broadcast probe")
    parser.add_argument("--short", action="store_true", help="N = 2, 4, HTTP only, rank 1 (2.4 MiB), 2 reps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cfg = Config(
        engines=args.engines,
        transports=[t for t in args.transports.split(",") if t],
        collective_engines=args.collective_engines,
        adapter_mib=args.adapter_mib,
        bucket_mib=args.bucket_mib,
        reps=args.reps,
        seed=args.seed,
        tree_probe=not args.no_tree_probe,
    )
    if args.short:
        cfg = short_config(args.seed)
    if unknown := set(cfg.transports) - {"http", "collective"}:
        raise SystemExit(f"unknown transports {sorted(unknown)}")
    t0 = time.monotonic()
    print(f"publishing to {cfg.engines} engine shells, transports {cfg.transports}")
    cells = asyncio.run(measure(cfg))
    probes: list[TreeProbe] = []
    if cfg.tree_probe and "collective" in cfg.transports:
        nbytes = cells[0].adapter_bytes if cells else int(cfg.adapter_mib * MIB)
        for n in cfg.engines:
            print(f"  gloo broadcast probe, {n} + 1 ranks ...")
            probes.append(tree_probe(n, nbytes))
    print()
    print_table(cells, probes)
    failed = [c for c in cells if c.lost is not None and (c.lost.committed or c.lost.leftovers)]
    out = report(cfg, cells, probes, time.monotonic() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    if failed:
        raise SystemExit(f"the commit rule did not hold in {[(c.transport, c.engines) for c in failed]}")


def short_config(seed: int = 0) -> Config:
    """The CI form: small, HTTP only (the collective starts a torch process per engine)."""
    return Config(
        engines=[2, 4],
        transports=["http"],
        collective_engines=[],
        adapter_mib=1.0,
        bucket_mib=0.25,
        reps=2,
        seed=seed,
        tree_probe=False,
    )


if __name__ == "__main__":
    main()
