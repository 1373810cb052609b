"""An in-process fake engine for PURE-LOGIC tests of the client, publisher and session layer.

This is a test double, not SGLang. Every version rule (begin, buckets, end, cleanup, reclaim,
receipts, status and the generation gate) is decided by the engine's REAL pure
:class:`~sglang_ext.version_table.VersionTable`, driven the way :mod:`sglang_ext.publication` and
:mod:`sglang_ext.reclaim` drive it (check, do the IO, record the outcome). Only the IO is faked:
the load finishes at once with a fake lora_id, in-flight requests are an in-memory counter per
name, decoded tensors sit in a stash. All of it sits behind ``httpx.MockTransport``, so the REAL
:class:`EngineClient` with its classification, audit and pools is what the tests drive.
Real-engine behaviour is proven by the engine tests; nothing here says anything about SGLang.

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
from sglang_ext.engine_state import DEFAULT_MAX_BUCKET_BYTES, DEFAULT_MAX_VERSION_BYTES
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.protocol import (
    BeginRequest,
    BucketAck,
    CleanupReceipt,
    CleanupRequest,
    DrainingReply,
    EndRequest,
    EngineStatus,
    EngineVersionState,
    PreparedReceipt,
    ReceiveBucketMeta,
    ReclaimRequest,
    Routes,
    UnloadedReceipt,
    VersionStatus,
    check_bucket_tensors,
    check_tensor_set,
    decode_bucket,
    parse_model,
)
from sglang_ext.version_table import (
    BucketDecision,
    CleanupDecision,
    EndDecision,
    ManagedVersion,
    ReclaimDecision,
    StagingLimits,
    VersionTable,
    may_unload_now,
)


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
        self.table = self._new_table()  # the engine's real version rules, one per incarnation
        self._stash: dict[str, dict[str, Any]] = {}  # attempt token -> decoded tensors received
        self._unloaded_ids: set[str] = set()  # lora_ids physically unloaded (exactly once each)
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

    def _new_table(self) -> VersionTable:
        limits = StagingLimits(
            managed_capacity=self.capacity,
            max_lora_rank=64,
            target_modules=None,
            max_version_bytes=DEFAULT_MAX_VERSION_BYTES,
            max_bucket_bytes=DEFAULT_MAX_BUCKET_BYTES,
        )
        return VersionTable(f"{self.engine_id}-{uuid.uuid4().hex[:12]}", limits)

    @property
    def incarnation(self) -> str:
        return self.table.incarnation

    @property
    def versions(self) -> dict[str, ManagedVersion]:
        return self.table.versions

    @property
    def cleaned(self) -> dict[str, CleanupReceipt]:  # attempt token -> receipt (tombstones)
        return self.table.cleaned

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
        self.table = self._new_table()
        self._stash.clear()
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
            return await self._cleanup(parse_model(CleanupRequest, request.content))
        if op == "reclaim":
            return await self._reclaim(parse_model(ReclaimRequest, request.content))
        if op == "status":
            return _model(
                EngineStatus(
                    incarnation=self.incarnation,
                    versions=tuple(self._status(v) for _, v in sorted(self.versions.items())),
                    managed_capacity=self.table.limits.managed_capacity,
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

    # -------------------------------------------------- native IO stand-ins (the only fake part)

    def _native_in_flight(self, v: ManagedVersion) -> int | None:
        """NativeLora.in_flight: None when nothing is loaded under that id (never, or unloaded)."""
        if v.lora_id is None or v.lora_id in self._unloaded_ids:
            return None
        return self.in_flight[v.lora_name]

    def _status(self, v: ManagedVersion) -> VersionStatus:
        return self.table.status_of(v, self._native_in_flight(v))

    async def _remove(self, table: VersionTable, lora_name: str, timeout_s: float) -> int | None:
        """publication.remove_version: (unregister: the table's state already refuses new
        requests) -> bounded drain -> physical unload, exactly once per lora_id, only when
        :func:`may_unload_now` says so. None once unloaded, else the count still draining."""
        v = table.get(lora_name)
        if v is None or v.lora_id is None:
            return None
        deadline = time.monotonic() + timeout_s
        while self._native_in_flight(v) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        left = self._native_in_flight(v)
        if left is not None and not may_unload_now(table.get(lora_name), left):
            return left
        if v.lora_id not in self._unloaded_ids:
            self._unloaded_ids.add(v.lora_id)
            self.unloads[lora_name] += 1
        return None

    # ------------------------------------------------ control: the shell around the real table

    def _begin(self, req: BeginRequest) -> httpx.Response:
        receipt = self.table.begin(req)
        if isinstance(receipt, PreparedReceipt):
            self._stash.setdefault(req.attempt_token, {})
        return _model(receipt)

    def _bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> httpx.Response:
        table = self.table
        if table.check_bucket(meta) is BucketDecision.DUPLICATE:
            return _model(BucketAck(index=meta.index, accepted=True, duplicate=True))
        v = table.get(meta.lora_name)
        assert v is not None
        tensors = decode_bucket(payload, expected_sha256=meta.sha256)
        check_bucket_tensors(v.manifest, table.bucket_spec(meta), tensors)
        self._stash.setdefault(meta.attempt_token, {}).update(tensors)
        table.accept_bucket(meta)
        return _model(BucketAck(index=meta.index, accepted=True))

    def _end(self, req: EndRequest) -> httpx.Response:
        table = self.table
        decision = table.start_end(req.lora_name, req.attempt_token)
        v = table.get(req.lora_name)
        assert v is not None and decision is not EndDecision.JOIN  # the fake load never runs on
        if decision is EndDecision.READY:
            return _model(table.ready_receipt(v))
        try:
            check_tensor_set(v.manifest, self._stash.get(req.attempt_token, {}).keys())
        except BaseException:
            table.fail_load(req.lora_name, req.attempt_token)
            raise
        self._stash.pop(req.attempt_token, None)  # "loaded": the engine holds the weights now
        return _model(table.finish_load(req.lora_name, req.attempt_token, lora_id=uuid.uuid4().hex))

    async def _cleanup(self, req: CleanupRequest) -> httpx.Response:
        table = self.table
        decision = table.plan_cleanup(req.lora_name, req.attempt_token)
        assert decision is not CleanupDecision.WAIT_FOR_LOAD  # the fake load never runs on
        if decision is CleanupDecision.UNLOAD:
            table.mark_cleaning(req.lora_name, req.attempt_token)
            left = await self._remove(table, req.lora_name, timeout_s=30.0)
            if left is not None:  # publication.CleanupPending -> 503, never "clean"
                body = {"state": "DRAINING", "lora_name": req.lora_name, "in_flight": left}
                return _json(body, 503)
        self._stash.pop(req.attempt_token, None)
        return _model(table.finish_cleanup(req.lora_name, req.attempt_token))

    async def _reclaim(self, req: ReclaimRequest) -> httpx.Response:
        table = self.table
        unloaded = UnloadedReceipt(
            lora_name=req.lora_name, reclaim_id=req.reclaim_id, incarnation=table.incarnation
        )
        decision = table.start_reclaim(req.lora_name, req.reclaim_id)
        if decision in (ReclaimDecision.DONE, ReclaimDecision.NOT_LOADED):
            return _model(unloaded)
        left = await self._remove(table, req.lora_name, req.timeout_s)
        v = table.get(req.lora_name)
        assert v is not None
        if v.state is EngineVersionState.UNLOADED:
            return _model(unloaded)
        if left is None:
            table.finish_reclaim(req.lora_name, req.reclaim_id)
            return _model(unloaded)
        draining = DrainingReply(
            lora_name=req.lora_name,
            reclaim_id=req.reclaim_id,
            in_flight=max(left, 0),
            incarnation=table.incarnation,
        )
        return _json(draining.model_dump(mode="json"), 202)  # accepted, not finished

    # ----------------------------------------------------------------------- generation

    async def _generate(self, body: dict[str, Any]) -> httpx.Response:
        if "lora_id" in body:
            raise LoraVersionError(ErrorCode.FORBIDDEN_FIELD, "lora_id is internal")
        lora = body.get("lora_path")
        if lora is not None and (refusal := self.table.request_gate(lora)) is not None:
            raise refusal
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
