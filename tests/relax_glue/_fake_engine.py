"""An in-process fake engine for PURE-LOGIC tests of the client, publisher and session layer.

This is a test double, not SGLang: it implements the control protocol's *semantics* (begin is
idempotent per attempt, buckets in order with duplicates acknowledged, end verifies every bucket,
cleanup tombstones the attempt, reclaim unregisters then drains then unloads exactly once, version
errors on generation) behind ``httpx.MockTransport``, so the REAL :class:`EngineClient` with its
classification, audit and pools is what the tests drive. Real-engine behaviour is proven by the
engine tests; nothing here says anything about SGLang itself.

Scripted faults (:meth:`FakeEngine.fail`) make the Nth call of an op answer a refusal, a 5xx or
a timeout, either *before* processing (the engine changed nothing) or *after* (it did, and the
reply is lost or garbled). Gates (:meth:`FakeEngine.hold`) pause an op at arrival so a test can
look at the world in between.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httpx

from relax_glue.engine_client import AuditLog, ClientTimeouts, EngineClient
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.protocol import (
    BeginRequest,
    BucketAck,
    BucketSpec,
    CleanupReceipt,
    CleanupRequest,
    DrainingReply,
    EndRequest,
    EngineStatus,
    EngineVersionState,
    Manifest,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    ReclaimRequest,
    Routes,
    UnloadedReceipt,
    VersionKey,
    VersionStatus,
    check_bucket_tensors,
    decode_bucket,
    parse_model,
)

_LIVE = (
    EngineVersionState.PREPARED,
    EngineVersionState.LOADING,
    EngineVersionState.READY_LOCAL,
    EngineVersionState.RECLAIMING,
)


@dataclasses.dataclass
class _Version:
    lora_name: str
    version_key: VersionKey
    digest: str
    attempt_token: str
    manifest: Manifest
    plan: tuple[BucketSpec, ...]
    state: EngineVersionState = EngineVersionState.PREPARED
    received: dict[int, str] = dataclasses.field(default_factory=dict)
    reclaim_id: str | None = None
    lora_id: str | None = None
    created_at: float = dataclasses.field(default_factory=time.time)
    updated_at: float = dataclasses.field(default_factory=time.time)


@dataclasses.dataclass
class _Fault:
    op: str
    nth: int
    code: ErrorCode | None
    status: int | None
    timeout: bool
    after: bool


@dataclasses.dataclass
class Gate:
    """Pauses one op at arrival until released; ``arrived`` is set when a call is waiting."""

    arrived: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    opened: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.opened.set()


def _json(data: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=data)


def _model(model: Any) -> httpx.Response:
    return _json(model.model_dump(mode="json"))


class FakeEngine:
    """One fake engine. ``client()`` builds a real EngineClient wired to it."""

    def __init__(
        self, engine_id: str, *, capacity: int = 2, shared_log: list[tuple[str, str, str]] | None = None
    ):
        self.engine_id = engine_id
        self.capacity = capacity
        self.incarnation = self._new_incarnation()
        self.versions: dict[str, _Version] = {}
        self.cleaned: set[str] = set()  # attempt tokens: late calls for them are STALE_ATTEMPT
        self.seen: list[tuple[str, str]] = []  # (op, detail) of every call that arrived
        self.shared_log = shared_log if shared_log is not None else []  # (engine, op, detail)
        self.calls: collections.Counter[str] = collections.Counter()
        self.unloads: collections.Counter[str] = collections.Counter()  # physical unloads per name
        self.generations: list[dict[str, Any]] = []  # bodies of admitted generations
        self.aborts: list[dict[str, Any]] = []
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.restarts = 0
        self._faults: list[_Fault] = []
        self._gates: dict[str, Gate] = {}
        self._before: dict[str, Callable[[int], None]] = {}
        self._hold_generations: asyncio.Event | None = None
        self._running: dict[str, asyncio.Event] = {}  # rid -> abort signal

    # ------------------------------------------------------------------ test controls

    def _new_incarnation(self) -> str:
        return f"{self.engine_id}-{uuid.uuid4().hex[:12]}"

    def client(
        self, *, audit: AuditLog | None = None, timeouts: ClientTimeouts | None = None
    ) -> EngineClient:
        return EngineClient(
            self.engine_id,
            f"http://{self.engine_id.lower()}.fake",
            audit=audit,
            timeouts=timeouts,
            control_transport=httpx.MockTransport(self.handle),
            generation_transport=httpx.MockTransport(self.handle),
        )

    def restart(self) -> str:
        """A process restart: a new incarnation; loaded adapters, stash and tombstones are gone."""
        self.incarnation = self._new_incarnation()
        self.versions.clear()
        self.cleaned.clear()
        self.restarts += 1
        return self.incarnation

    def fail(
        self,
        op: str,
        nth: int = 1,
        *,
        code: ErrorCode | None = None,
        status: int | None = None,
        timeout: bool = False,
        after: bool = False,
    ) -> None:
        """Make the Nth call of ``op`` (counted from now on, per op, from 1) fail.

        ``code``: a clean refusal with our body (4xx). ``status``: that HTTP status with a
        non-protocol body. ``timeout``: the reply never comes (httpx.ReadTimeout). ``after``: the
        call is processed first (the engine changed), then the failure replaces the reply.
        """
        assert code or status or timeout
        self._faults.append(_Fault(op, self.calls[op] + nth, code, status, timeout, after))

    def hold(self, op: str) -> Gate:
        gate = Gate()
        self._gates[op] = gate
        return gate

    def before(self, op: str, hook: Callable[[int], None]) -> None:
        """Run ``hook(nth)`` when a call of ``op`` arrives (e.g. restart the engine)."""
        self._before[op] = hook

    def hold_generations(self) -> None:
        self._hold_generations = asyncio.Event()

    def release_generations(self) -> None:
        if self._hold_generations is not None:
            self._hold_generations.set()
            self._hold_generations = None

    def ops(self, op: str | None = None) -> list[str]:
        return [o for o, _ in self.seen if op is None or o == op]

    def state_of(self, lora_name: str) -> EngineVersionState | None:
        v = self.versions.get(lora_name)
        return v.state if v else None

    # ------------------------------------------------------------------------ dispatch

    @staticmethod
    def _route(request: httpx.Request) -> str:
        method, path = request.method, request.url.path
        table = {
            ("POST", Routes.BEGIN): "begin",
            ("POST", Routes.RECEIVE_BUCKET): "receive_bucket",
            ("POST", Routes.END): "end",
            ("POST", Routes.CLEANUP): "cleanup",
            ("POST", Routes.RECLAIM): "reclaim",
            ("GET", Routes.STATUS): "status",
            ("POST", "/generate"): "generate",
            ("POST", "/abort_request"): "abort_request",
        }
        if (method, path) in table:
            return table[(method, path)]
        if method == "GET" and path.startswith(Routes.STATUS + "/"):
            return "version_status"
        return "other"

    async def handle(self, request: httpx.Request) -> httpx.Response:
        op = self._route(request)
        self.calls[op] += 1
        nth = self.calls[op]
        detail = self._detail(op, request)
        self.seen.append((op, detail))
        self.shared_log.append((self.engine_id, op, detail))
        if op in self._before:
            self._before[op](nth)
        fault = next((f for f in self._faults if f.op == op and f.nth == nth), None)
        if fault is not None and not fault.after:
            return self._fault_reply(fault, request)
        gate = self._gates.get(op)
        if gate is not None:
            gate.arrived.set()
            await gate.opened.wait()
        try:
            response = await self._process(op, request)
        except LoraVersionError as err:
            response = _json(err.to_body(), err.http_status)
        if fault is not None:
            return self._fault_reply(fault, request)
        return response

    def _fault_reply(self, fault: _Fault, request: httpx.Request) -> httpx.Response:
        if fault.timeout:
            raise httpx.ReadTimeout("injected by FakeEngine", request=request)
        if fault.code is not None:
            err = LoraVersionError(fault.code, f"injected {fault.code.value} on {fault.op}")
            return _json(err.to_body(), err.http_status)
        assert fault.status is not None
        return _json({"error": {"message": f"injected HTTP {fault.status}"}}, fault.status)

    @staticmethod
    def _detail(op: str, request: httpx.Request) -> str:
        if op == "receive_bucket":
            return request.headers.get("X-Bucket-Index", "?")
        if op in ("begin", "end", "cleanup", "reclaim", "generate", "abort_request"):
            try:
                body = json.loads(request.content)
            except ValueError:
                return ""
            return str(body.get("lora_name") or body.get("lora_path") or body.get("rid") or "")
        if op == "version_status":
            return unquote(request.url.path.rsplit("/", 1)[1])
        return ""

    async def _process(self, op: str, request: httpx.Request) -> httpx.Response:
        if op == "begin":
            return self._begin(parse_model(BeginRequest, request.content))
        if op == "receive_bucket":
            return self._bucket(ReceiveBucketMeta.from_headers(request.headers), request.content)
        if op == "end":
            return self._end(parse_model(EndRequest, request.content))
        if op == "cleanup":
            return self._cleanup(parse_model(CleanupRequest, request.content))
        if op == "reclaim":
            return await self._reclaim(parse_model(ReclaimRequest, request.content))
        if op == "status":
            return _model(
                EngineStatus(
                    incarnation=self.incarnation,
                    versions=tuple(self._status(v) for _, v in sorted(self.versions.items())),
                    managed_capacity=self.capacity,
                    server_time=time.time(),
                )
            )
        if op == "version_status":
            name = unquote(request.url.path.rsplit("/", 1)[1])
            v = self.versions.get(name)
            if v is None:
                raise LoraVersionError(
                    ErrorCode.UNKNOWN_VERSION, f"no managed version {name!r}", lora_name=name
                )
            return _model(self._status(v))
        if op == "generate":
            return await self._generate(json.loads(request.content))
        if op == "abort_request":
            body = json.loads(request.content)
            self.aborts.append(body)
            signal = self._running.get(body.get("rid", ""))
            if signal is not None:
                signal.set()
            return httpx.Response(200)
        return _json({"detail": "Not Found"}, 404)

    def _status(self, v: _Version) -> VersionStatus:
        return VersionStatus(
            lora_name=v.lora_name,
            state=v.state,
            version_key=v.version_key,
            digest=v.digest,
            attempt_token=v.attempt_token,
            reclaim_id=v.reclaim_id,
            pinned=v.state in (EngineVersionState.READY_LOCAL, EngineVersionState.RECLAIMING),
            lora_id=v.lora_id,
            in_flight=self.in_flight[v.lora_name],
            buckets_received=len(v.received),
            buckets_total=len(v.plan),
            incarnation=self.incarnation,
            created_at=v.created_at,
            updated_at=v.updated_at,
        )

    # ------------------------------------------------------------------------ control

    def _attempt_version(self, lora_name: str, attempt_token: str) -> _Version:
        if attempt_token in self.cleaned:
            raise LoraVersionError(ErrorCode.STALE_ATTEMPT, f"attempt {attempt_token} was cleaned up")
        v = self.versions.get(lora_name)
        if v is None:
            raise LoraVersionError(
                ErrorCode.STALE_ATTEMPT, f"no attempt is staging {lora_name!r} (begin first)"
            )
        if v.attempt_token != attempt_token:
            raise LoraVersionError(
                ErrorCode.STALE_ATTEMPT, f"{attempt_token} is not the attempt of {lora_name}"
            )
        return v

    def _ready(self, v: _Version) -> ReadyReceipt:
        return ReadyReceipt(
            lora_name=v.lora_name,
            version_key=v.version_key,
            digest=v.digest,
            attempt_token=v.attempt_token,
            incarnation=self.incarnation,
        )

    def _begin(self, req: BeginRequest) -> httpx.Response:
        # Mirrors the engine's version table: idempotent per attempt, a loaded version is
        # adopted (no second load), reclaimed names never return, one staging attempt per name.
        if req.attempt_token in self.cleaned:
            raise LoraVersionError(ErrorCode.STALE_ATTEMPT, f"attempt {req.attempt_token} was cleaned up")
        v = self.versions.get(req.lora_name)
        if v is not None and v.digest != req.digest:
            raise LoraVersionError(ErrorCode.VERSION_CONFLICT, f"{req.lora_name} exists with another digest")
        if v is not None and v.state in (EngineVersionState.RECLAIMING, EngineVersionState.UNLOADED):
            raise LoraVersionError(ErrorCode.VERSION_RECLAIMED, f"{req.lora_name} was reclaimed")
        if v is not None and v.state is EngineVersionState.READY_LOCAL:
            v.attempt_token = req.attempt_token
            return _model(self._ready(v))
        if v is not None and v.state in (EngineVersionState.PREPARED, EngineVersionState.LOADING):
            if v.attempt_token == req.attempt_token:
                return _model(self._prepared(v))
            raise LoraVersionError(ErrorCode.PUBLICATION_IN_PROGRESS, f"{v.attempt_token} is staging it")
        live = [x for x in self.versions.values() if x.state in _LIVE]
        if len(live) >= self.capacity:
            raise LoraVersionError(ErrorCode.CAPACITY_ERROR, f"{len(live)} managed versions already")
        v = _Version(
            lora_name=req.lora_name,
            version_key=req.version_key,
            digest=req.digest,
            attempt_token=req.attempt_token,
            manifest=req.manifest,
            plan=req.bucket_plan,
        )
        self.versions[req.lora_name] = v
        return _model(self._prepared(v))

    def _prepared(self, v: _Version) -> PreparedReceipt:
        return PreparedReceipt(
            lora_name=v.lora_name,
            digest=v.digest,
            attempt_token=v.attempt_token,
            incarnation=self.incarnation,
        )

    def _bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> httpx.Response:
        v = self._attempt_version(meta.lora_name, meta.attempt_token)
        if meta.index >= len(v.plan):
            raise LoraVersionError(ErrorCode.BUCKET_OUT_OF_ORDER, f"no bucket {meta.index} in the plan")
        if meta.index in v.received:
            if v.received[meta.index] != meta.sha256:
                raise LoraVersionError(ErrorCode.CHECKSUM_MISMATCH, f"bucket {meta.index} had another sha256")
            return _model(BucketAck(index=meta.index, accepted=True, duplicate=True))
        if v.state is not EngineVersionState.PREPARED:
            raise LoraVersionError(ErrorCode.STALE_ATTEMPT, f"{v.lora_name} is {v.state.value}")
        if meta.index != len(v.received):
            raise LoraVersionError(
                ErrorCode.BUCKET_OUT_OF_ORDER, f"expected bucket {len(v.received)}, got {meta.index}"
            )
        tensors = decode_bucket(payload, expected_sha256=meta.sha256)
        check_bucket_tensors(v.manifest, v.plan[meta.index], tensors)
        v.received[meta.index] = meta.sha256
        v.updated_at = time.time()
        return _model(BucketAck(index=meta.index, accepted=True))

    def _end(self, req: EndRequest) -> httpx.Response:
        v = self._attempt_version(req.lora_name, req.attempt_token)
        if v.state is EngineVersionState.READY_LOCAL:
            return _model(self._ready(v))
        if v.state is not EngineVersionState.PREPARED:
            raise LoraVersionError(ErrorCode.STALE_ATTEMPT, f"{v.lora_name} is {v.state.value}")
        missing = [b.index for b in v.plan if b.index not in v.received]
        if missing:
            raise LoraVersionError(ErrorCode.MANIFEST_MISMATCH, f"buckets missing: {missing}")
        v.state = EngineVersionState.READY_LOCAL
        v.lora_id = uuid.uuid4().hex
        v.updated_at = time.time()
        return _model(self._ready(v))

    def _cleanup(self, req: CleanupRequest) -> httpx.Response:
        v = self.versions.get(req.lora_name)
        if v is not None and v.attempt_token != req.attempt_token:
            v = None  # another attempt's name: nothing of *this* attempt to clean, just tombstone it
        if v is not None and v.state in (EngineVersionState.RECLAIMING, EngineVersionState.UNLOADED):
            raise LoraVersionError(
                ErrorCode.VERSION_RECLAIMED, "a committed version is reclaimed, not cleaned"
            )
        if v is not None and v.state is not EngineVersionState.CLEANED:
            if v.state is EngineVersionState.READY_LOCAL:
                self.unloads[v.lora_name] += 1  # a loaded, never-served candidate is unloaded
            v.state = EngineVersionState.CLEANED
            v.updated_at = time.time()
        self.cleaned.add(req.attempt_token)
        return _model(
            CleanupReceipt(
                lora_name=req.lora_name, attempt_token=req.attempt_token, incarnation=self.incarnation
            )
        )

    async def _reclaim(self, req: ReclaimRequest) -> httpx.Response:
        v = self.versions.get(req.lora_name)
        if v is None or v.state is EngineVersionState.CLEANED:
            raise LoraVersionError(ErrorCode.UNKNOWN_VERSION, f"no managed version {req.lora_name!r}")
        if v.reclaim_id is not None and v.reclaim_id != req.reclaim_id:
            raise LoraVersionError(ErrorCode.STALE_ATTEMPT, "another reclaim id owns this version")
        if v.state is EngineVersionState.UNLOADED:
            return _model(self._unloaded(v))
        if v.state not in (EngineVersionState.READY_LOCAL, EngineVersionState.RECLAIMING):
            raise LoraVersionError(ErrorCode.VERSION_NOT_READY, f"{v.lora_name} is {v.state.value}")
        v.state, v.reclaim_id = EngineVersionState.RECLAIMING, req.reclaim_id  # unregistered
        deadline = time.monotonic() + req.timeout_s
        while self.in_flight[v.lora_name] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        if self.in_flight[v.lora_name] > 0:
            draining = DrainingReply(
                lora_name=v.lora_name,
                reclaim_id=req.reclaim_id,
                in_flight=self.in_flight[v.lora_name],
                incarnation=self.incarnation,
            )
            return _json(draining.model_dump(mode="json"), 202)  # accepted, not finished
        v.state = EngineVersionState.UNLOADED
        v.updated_at = time.time()
        self.unloads[v.lora_name] += 1
        return _model(self._unloaded(v))

    def _unloaded(self, v: _Version) -> UnloadedReceipt:
        assert v.reclaim_id is not None
        return UnloadedReceipt(lora_name=v.lora_name, reclaim_id=v.reclaim_id, incarnation=self.incarnation)

    # ----------------------------------------------------------------------- generation

    async def _generate(self, body: dict[str, Any]) -> httpx.Response:
        if "lora_id" in body:
            raise LoraVersionError(ErrorCode.FORBIDDEN_FIELD, "lora_id is internal")
        lora = body.get("lora_path")
        if lora is not None:
            v = self.versions.get(lora)
            if v is None:
                raise LoraVersionError(ErrorCode.UNKNOWN_VERSION, f"no managed version {lora!r}")
            if v.state in (EngineVersionState.RECLAIMING, EngineVersionState.UNLOADED):
                raise LoraVersionError(ErrorCode.VERSION_RECLAIMED, f"{lora} is {v.state.value}")
            if v.state is not EngineVersionState.READY_LOCAL:
                raise LoraVersionError(ErrorCode.VERSION_NOT_READY, f"{lora} is {v.state.value}")
        rid = str(body.get("rid") or uuid.uuid4().hex)
        self.generations.append(body)
        finish = "length"
        self.in_flight[lora or ""] += 1
        signal = self._running[rid] = asyncio.Event()
        try:
            hold = self._hold_generations
            if hold is not None:
                waiters = [asyncio.ensure_future(hold.wait()), asyncio.ensure_future(signal.wait())]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
            if signal.is_set():
                finish = "abort"
        finally:
            self.in_flight[lora or ""] -= 1
            self._running.pop(rid, None)
        out = {
            "text": f"out:{lora}",
            "output_ids": [1, 2, 3],
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": finish},
                "lora_path": lora,
                "engine_id": self.engine_id,
            },
        }
        if body.get("stream"):
            chunks = [{**out, "text": "out:"}, out]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return _json(out)


# ------------------------------------------------------------------------------ test helpers

LORA_CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def make_snapshot(seed: int = 0, *, layers: int = 2, hidden: int = 16, max_bucket_bytes: int = 600) -> Any:
    """A small frozen adapter: 4 tensors per layer of 256 bytes; 600-byte buckets give two
    tensors per bucket (4 buckets for 2 layers), enough to exercise bucket ordering."""
    import torch

    from relax_glue.snapshot import Snapshot

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for mod in ("q_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(4, hidden, generator=gen)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(hidden, 4, generator=gen)
    return Snapshot.from_tensors(LORA_CONFIG, tensors, max_bucket_bytes=max_bucket_bytes)


@dataclasses.dataclass
class Cluster:
    """Fake engines, the real clients wired to them, one shared audit log and one shared
    arrival log (engine, op, detail) across engines for ordering checks."""

    fakes: dict[str, FakeEngine]
    clients: dict[str, EngineClient]
    audit: AuditLog
    log: list[tuple[str, str, str]]

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.aclose()


def make_cluster(
    engines: tuple[str, ...] = ("E0", "E1"), *, timeouts: ClientTimeouts | None = None
) -> Cluster:
    log: list[tuple[str, str, str]] = []
    audit = AuditLog()
    fakes = {e: FakeEngine(e, shared_log=log) for e in engines}
    clients = {e: f.client(audit=audit, timeouts=timeouts) for e, f in fakes.items()}
    return Cluster(fakes, clients, audit, log)
