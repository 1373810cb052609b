"""An in-process fake engine for PURE-LOGIC tests of the client, publisher and session layer.

It runs the engine's REAL control plane: the plugin's routes (:func:`sglang_ext.http_routes.
install`) on a FastAPI app, over the real :class:`~sglang_ext.publication.PublicationService`,
:class:`~sglang_ext.reclaim.ReclaimService` and :class:`~sglang_ext.version_table.VersionTable`.
The only fake part is the native edge below them (:class:`tests._fake_native.FakeNative`: loads
finish at once under a fresh id, in-flight requests are an in-memory counter) and a small
``/generate`` / ``/abort_request`` stand-in that asks the table's real request gate. The app
sits behind ``httpx.MockTransport``, so the REAL :class:`EngineClient` with its classification,
audit and pools is what the tests drive. Real-engine behaviour is proven by the engine tests.

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
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httpx
from _fake_native import FakeNative, fake_base, fake_staging
from fastapi import FastAPI, Request

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import EngineVersionState, Routes
from lora_contract.served_version import BASE_MODEL, SERVED_TOKENS_KEY, attach_served_versions
from relax_glue.engine_client import AuditLog, ClientTimeouts, EngineClient
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.engine_state import (
    ENGINE_BUCKET_CAP_BYTES,
    ENGINE_VERSION_CAP_BYTES,
    EngineState,
    assemble_engine,
)
from sglang_ext.http_routes import install
from sglang_ext.version_table import ManagedVersion, StagingLimits, VersionTable


@dataclasses.dataclass
class _Fault:
    op: str
    nth: int
    code: ErrorCode | None
    status: int | None
    timeout: bool
    after: bool
    message: str | None = None  # the body's message with ``status`` (e.g. SGLang's own words)


@dataclasses.dataclass
class Gate:
    """Pauses one op at arrival until released; ``arrived`` is set when a call is waiting."""

    arrived: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    opened: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.opened.set()


class FakeEngine:
    """One fake engine. ``client()`` builds a real EngineClient wired to it."""

    def __init__(
        self,
        engine_id: str,
        *,
        capacity: int = 2,
        shared_log: list[tuple[str, str, str]] | None = None,
        base: str = "base",
    ):
        self.engine_id = engine_id
        self.capacity = capacity
        self.base = fake_base(base)  # the base model it "runs" (another label: another base)
        self.unloads: collections.Counter[str] = collections.Counter()  # physical unloads per name
        self.seen: list[tuple[str, str]] = []  # (op, detail) of every call that arrived
        self.shared_log = shared_log if shared_log is not None else []  # (engine, op, detail)
        self.calls: collections.Counter[str] = collections.Counter()
        self.generations: list[dict[str, Any]] = []  # bodies of admitted generations
        self.aborts: list[dict[str, Any]] = []
        self.restarts = 0
        self._faults: list[_Fault] = []
        self._gates: dict[str, Gate] = {}
        self._before: dict[str, Callable[[int], None]] = {}
        self._hold_generations: asyncio.Event | None = None
        self._running: dict[str, asyncio.Event] = {}  # rid -> abort signal
        # What the "scheduler" runs for a request naming a version: itself, unless a test plants
        # another (lora_path -> what its tokens are attested as served by; "" is the base model,
        # None an engine that attests nothing, as one without the plugin)
        self.serve_instead: dict[str, str | None] = {}
        self._boot()

    def _boot(self) -> None:
        """A process start: a new incarnation with the real engine shell over a fresh native edge."""
        limits = StagingLimits(
            managed_capacity=self.capacity,
            lora=EngineLoraShape(FAKE_GEOMETRY, max_lora_rank=64, served_modules=None),
            max_version_bytes=ENGINE_VERSION_CAP_BYTES,
            max_bucket_bytes=ENGINE_BUCKET_CAP_BYTES,
        )
        state = EngineState(incarnation=f"{self.engine_id}-{uuid.uuid4().hex[:12]}", base=self.base)
        self.native = FakeNative(self.unloads)
        self.table = VersionTable(state.incarnation, limits, base_fingerprint=self.base.fingerprint)
        assemble_engine(state, self.table, self.native, fake_staging())
        app = FastAPI()
        install(app, state)
        app.add_api_route("/generate", self._generate_route, methods=["POST"])
        app.add_api_route("/abort_request", self._abort_route, methods=["POST"])
        self._app = httpx.ASGITransport(app=app)

    # ------------------------------------------------------------------ test controls

    @property
    def incarnation(self) -> str:
        return self.table.incarnation

    @property
    def versions(self) -> dict[str, ManagedVersion]:
        return self.table.versions

    @property
    def cleaned(self) -> dict[str, Any]:  # attempt token -> receipt (tombstones)
        return self.table.cleaned

    @property
    def in_flight(self) -> collections.Counter[str]:
        """Admitted generations still running, per lora_path (SGLang's counters, by name)."""
        return self.native.in_flight_by_name

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
        self._boot()
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
        message: str | None = None,
    ) -> None:
        """Make the Nth call of ``op`` (counted from now on, per op, from 1) fail.

        ``code``: a clean refusal with our body (4xx). ``status``: that HTTP status with a
        non-protocol body. ``timeout``: the reply never comes (httpx.ReadTimeout). ``after``: the
        call is processed first (the engine changed), then the failure replaces the reply.
        """
        assert code or status or timeout
        self._faults.append(_Fault(op, self.calls[op] + nth, code, status, timeout, after, message))

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
        response = await self._app.handle_async_request(request)
        await response.aread()
        if fault is not None:
            return self._fault_reply(fault, request)
        return httpx.Response(response.status_code, headers=response.headers, content=response.content)

    def _fault_reply(self, fault: _Fault, request: httpx.Request) -> httpx.Response:
        if fault.timeout:
            raise httpx.ReadTimeout("injected by FakeEngine", request=request)
        if fault.code is not None:
            err = LoraVersionError(fault.code, f"injected {fault.code.value} on {fault.op}")
            return httpx.Response(err.http_status, json=err.to_body())
        assert fault.status is not None
        message = fault.message or f"injected HTTP {fault.status}"
        return httpx.Response(fault.status, json={"error": {"message": message}})

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

    # --------------------------------------------- generation: a stand-in for SGLang's /generate

    async def _abort_route(self, request: Request) -> Any:
        body = await request.json()
        self.aborts.append(body)
        signal = self._running.get(body.get("rid", ""))
        if signal is not None:
            signal.set()
        return {}

    def _attested(self, meta: dict[str, Any], lora: str | None, tokens: int) -> dict[str, Any]:
        """``meta`` with what served its tokens, as the plugin's main process writes it (from
        per-token entries, through the same function)."""
        ran = self.serve_instead.get(lora or "", lora or BASE_MODEL)
        if ran is None:
            return meta

        def digest_of(name: str) -> str | None:
            v = self.table.get(name)
            return v.digest if v is not None else None

        out = {**meta, SERVED_TOKENS_KEY: [ran] * tokens}
        attach_served_versions(out, digest_of)
        return out

    async def _generate_route(self, request: Request) -> Any:
        from fastapi.responses import JSONResponse, PlainTextResponse

        body = await request.json()
        if "lora_id" in body:
            raise LoraVersionError(ErrorCode.FORBIDDEN_FIELD, "lora_id is internal")
        lora = body.get("lora_path")
        native = self.native  # the incarnation this request was admitted by
        if lora is not None:
            refusal = self.table.request_gate(lora, native.lora_id_of(lora))
            if refusal is not None:
                raise refusal
        rid = str(body.get("rid") or uuid.uuid4().hex)
        self.generations.append(body)
        finish = "length"
        # n > 1 as SGLang serves it: one count per sample, samples named {rid}_0-{hex}
        samples = int((body.get("sampling_params") or {}).get("n", 1))
        lora_ids = [native.acquire(lora) if lora is not None else None for _ in range(samples)]
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
            for lora_id in lora_ids:
                native.release(lora_id)
            self._running.pop(rid, None)
        outs = [
            {
                "text": f"out:{lora}",
                "output_ids": [1, 2, 3],
                "meta_info": self._attested(
                    {
                        "id": rid if samples == 1 else f"{rid}_0-{uuid.uuid4().hex}",
                        "finish_reason": {"type": finish},
                        "lora_path": lora,
                        "engine_id": self.engine_id,
                    },
                    lora,
                    3,
                ),
            }
            for _ in range(samples)
        ]
        out = outs[0]
        if samples > 1 and not body.get("stream"):
            return JSONResponse(outs)
        if body.get("stream"):
            chunks = [{**out, "text": "out:"}, out]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return PlainTextResponse(text, media_type="text/event-stream")
        return JSONResponse(out)


# ------------------------------------------------------------------------------ test helpers

LORA_CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
# The base model the fake engine pretends to serve (make_snapshot's shapes fit it).
FAKE_GEOMETRY = ModelGeometry(
    "Qwen3ForCausalLM", num_layers=8, hidden_size=16, intermediate_size=32, q_size=16, kv_size=16
)


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
    engines: tuple[str, ...] = ("E0", "E1"),
    *,
    timeouts: ClientTimeouts | None = None,
    bases: dict[str, str] | None = None,
    capacity: int | dict[str, int] = 2,
) -> Cluster:
    """``bases``: engine -> base label for engines that run another base model than the rest;
    ``capacity``: the managed slots of every engine, or per engine."""
    log: list[tuple[str, str, str]] = []
    audit = AuditLog()
    slots = capacity if isinstance(capacity, dict) else dict.fromkeys(engines, capacity)
    fakes = {
        e: FakeEngine(e, shared_log=log, base=(bases or {}).get(e, "base"), capacity=slots[e])
        for e in engines
    }
    clients = {e: f.client(audit=audit, timeouts=timeouts) for e, f in fakes.items()}
    return Cluster(fakes, clients, audit, log)
