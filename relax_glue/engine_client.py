"""Async HTTP client for one engine: control calls (begin .. reclaim, status) and generation.

Three rules, each learnt the hard way by earlier systems:

* **Separate connection pools.** Generation and control run on two ``httpx.AsyncClient``
  instances with their own limits, so a pool full of long generations can never starve a cancel,
  a cleanup or a reclaim.
* **No automatic retries.** The transports are built with ``retries=0`` and nothing here
  re-sends anything. Whether to retry a generation is the session layer's decision; whether to
  retry a control call is the publisher's (every control call is idempotent on the engine).
* **One outcome classification** (:func:`classify_outcome`): a 2xx with a parseable reply that
  matches the request is success; a 4xx carrying our error body is a clean refusal (the typed
  :class:`LoraVersionError`, meaning "nothing changed"); everything else -- 5xx, timeouts,
  connection errors, unparseable or mismatched replies, a 4xx without our body -- is
  :class:`OutcomeUnknown`, never a LoraVersionError, so nobody can mistake it for "clean".

Every call is recorded in an in-memory :class:`AuditLog` (tests assert that no pause, flush or
abort-all endpoint was ever called). :class:`FaultInjectingClient` wraps a real client for tests.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from lora_contract.errors import LoraVersionError
from lora_contract.protocol import (
    HTTP_TRANSPORT,
    QUEUE_FULL_MESSAGE,
    BeginRequest,
    BucketAck,
    CleanupReceipt,
    CleanupRequest,
    DrainingReply,
    EndRequest,
    EngineStatus,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    ReclaimRequest,
    Routes,
    UnloadedReceipt,
    VersionStatus,
    parse_begin_reply,
    parse_cleanup_reply,
    parse_model,
    parse_reclaim_reply,
)
from relax_glue.bucket_transport import BucketTransport, bucket_transport

__all__ = [
    "FORBIDDEN_PATHS",
    "AuditEntry",
    "AuditLog",
    "CallOutcome",
    "ClientTimeouts",
    "EngineAPI",
    "EngineClient",
    "GenerationReply",
    "OutcomeUnknown",
    "PoolLimits",
    "classify_outcome",
    "forbidden_calls",
    "generation_aborted",
]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# What ``/generate`` answers: one object, or with ``n > 1`` (parallel sampling) one per sample.
GenerationReply = dict[str, Any] | list[dict[str, Any]]

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"

# Endpoints the publication path must never touch: they stop or disturb every running request.
# The client has no method for any of them; the audit check exists so a test proves it end to end.
FORBIDDEN_PATHS: frozenset[str] = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)

# httpx errors raised before a single request byte left this process: the engine cannot have
# seen the request. Still an unknown outcome for the publisher (conservative), but the session
# layer may use ``maybe_sent=False`` to decide that a generation retry cannot double-submit.
_GENERATION_OPS = frozenset({"generate", "generate_stream"})
_NOT_SENT_ERRORS: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class CallOutcome(StrEnum):
    """How a call to an engine ended, as audited (a refusal's label also names its code)."""

    OK = "ok"
    ABORTED = "aborted"  # a generation the engine ended with finish_reason "abort": reply, no result
    REFUSED = "refused"  # labelled "refused:<CODE>"
    UNKNOWN = "unknown"  # the engine may or may not have acted on it
    CANCELLED = "cancelled"  # our caller was cancelled mid-call


def outcome_label(exc: LoraVersionError | OutcomeUnknown) -> str:
    """The audit label of a call that raised: the one mapping from outcome to label."""
    if isinstance(exc, LoraVersionError):
        return f"{CallOutcome.REFUSED.value}:{exc.code.value}"
    return CallOutcome.UNKNOWN


def generation_outcome(reply: GenerationReply) -> CallOutcome:
    """ABORTED when the generation (or, with ``n > 1``, any of its samples) was aborted."""
    replies = reply if isinstance(reply, list) else [reply]
    return CallOutcome.ABORTED if any(generation_aborted(r) for r in replies) else CallOutcome.OK


class OutcomeUnknown(Exception):
    """The caller cannot know whether ``op`` took effect on ``engine_id``.

    Deliberately not a :class:`LoraVersionError`: code that catches "clean refusals" must never
    catch this. The only ways out are a later receipt or a status query.
    """

    def __init__(
        self,
        engine_id: str,
        op: str,
        cause: str,
        *,
        status_code: int | None = None,
        maybe_sent: bool = True,
        admitted: bool | None = None,
    ) -> None:
        super().__init__(f"{engine_id} {op}: outcome unknown ({cause})")
        self.engine_id = engine_id
        self.op = op
        self.cause = cause
        self.status_code = status_code
        self.maybe_sent = maybe_sent
        # False only when the reply proves the engine did not run it (the scheduler's queue-full
        # 503): a generation that may be sent again; None: nobody knows.
        self.admitted = admitted

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.engine_id, self.op, self.cause, self.status_code, self.maybe_sent, self.admitted)
        return (_rebuild_unknown, args)


def _rebuild_unknown(
    engine_id: str,
    op: str,
    cause: str,
    status_code: int | None,
    maybe_sent: bool,
    admitted: bool | None = None,
) -> OutcomeUnknown:
    return OutcomeUnknown(
        engine_id, op, cause, status_code=status_code, maybe_sent=maybe_sent, admitted=admitted
    )


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def classify_outcome(
    engine_id: str,
    op: str,
    *,
    response: httpx.Response | None = None,
    error: BaseException | None = None,
    parse: Callable[[bytes], T] | None = None,
) -> T:
    """The one place that turns a reply (or a transport error) into success, refusal or unknown.

    Returns ``parse(body)`` on success; raises :class:`LoraVersionError` for a clean refusal and
    :class:`OutcomeUnknown` for everything else. ``parse`` may raise LoraVersionError / ValueError
    for a body it cannot accept: a 2xx we cannot understand is unknown, not success.
    """
    if error is not None:
        cause = f"{type(error).__name__}: {_short(str(error) or repr(error))}"
        raise OutcomeUnknown(engine_id, op, cause, maybe_sent=not isinstance(error, _NOT_SENT_ERRORS))
    if response is None:
        raise ValueError("classify_outcome needs a response or an error")
    status = response.status_code
    if 200 <= status < 300:
        try:
            return parse(response.content) if parse is not None else None  # type: ignore[return-value]
        except (LoraVersionError, ValueError) as exc:
            # The engine did *something* and told us in a way we cannot read: unknown.
            raise OutcomeUnknown(
                engine_id, op, f"unparseable {status} reply: {_short(str(exc))}", status_code=status
            ) from None
    if 400 <= status < 500:
        try:
            body = json.loads(response.content)
        except ValueError:
            body = None
        err = LoraVersionError.from_body(body)
        if err is not None:
            err.details.setdefault("engine_id", engine_id)
            retry_after = response.headers.get("retry-after", "")
            if retry_after.isdigit():
                err.details.setdefault("retry_after_s", int(retry_after))
            raise err
        # A 4xx that is not ours (SGLang's own 400, an auth middleware, a proxy) carries no
        # promise that nothing changed: only our handlers make that promise.
        raise OutcomeUnknown(
            engine_id,
            op,
            f"HTTP {status} without a protocol error body: {_short(response.text)}",
            status_code=status,
        )
    if status == 503 and op in _GENERATION_OPS and QUEUE_FULL_MESSAGE in response.text:
        # SGLang 0.5.23's scheduler rejected it before running it (waiting queue full; the
        # tokenizer side released its LoRA ref): not admitted, so it may be sent again.
        raise OutcomeUnknown(
            engine_id, op, "the engine's request queue is full", status_code=503, admitted=False
        )
    raise OutcomeUnknown(engine_id, op, f"HTTP {status}: {_short(response.text)}", status_code=status)


# ------------------------------------------------------------------------------ configuration


@dataclasses.dataclass(frozen=True)
class ClientTimeouts:
    """Seconds per call type (read timeout; ``connect`` and ``pool`` apply to every call).

    ``end`` covers the engine's native load plus the exact-version probe, so it is the longest
    control call. A reclaim call waits ``ReclaimRequest.timeout_s`` on the engine, so its HTTP
    timeout is that plus ``reclaim_margin``. ``generate`` is per read (a streamed chunk or the
    whole non-streamed reply); None means no read timeout for generation.
    """

    connect: float = 5.0
    pool: float = 10.0
    begin: float = 30.0
    bucket: float = 120.0
    end: float = 300.0
    cleanup: float = 60.0
    reclaim_margin: float = 10.0
    status: float = 10.0
    abort: float = 10.0
    generate: float | None = 600.0


# SGLang's HTTP server closes a connection idle for this long (uvicorn's ``timeout_keep_alive``,
# ``SGLANG_TIMEOUT_KEEP_ALIVE`` in sglang/srt/environ.py, 0.5.23).
ENGINE_KEEP_ALIVE_S = 5.0


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    """``keepalive_expiry`` stays under the engine's :data:`ENGINE_KEEP_ALIVE_S`: a request sent
    on a pooled connection in the instant the engine closes it for idling fails with "Server
    disconnected without sending a response", an unknown outcome for an engine that is healthy
    (a CI run: a bucket sent 5.0 s after its ``begin``, on the connection ``begin`` used). An
    engine started with a shorter ``SGLANG_TIMEOUT_KEEP_ALIVE`` needs a shorter expiry here."""

    control_connections: int = 8
    generation_connections: int = 256
    keepalive_expiry: float = ENGINE_KEEP_ALIVE_S - 1.0


# ------------------------------------------------------------------------------------- audit


@dataclasses.dataclass(frozen=True)
class AuditEntry:
    seq: int
    engine_id: str
    kind: str  # "control" | "generation"
    op: str
    method: str
    path: str
    started_at: float  # unix seconds
    duration_s: float
    # a CallOutcome value, or "refused:<CODE>"
    outcome: str
    status_code: int | None
    detail: str  # lora_name / bucket index / rid: enough to read a log, never a payload
    abort_all: bool = False


class AuditLog:
    """Every call the client made, in order. Bounded so a long run cannot grow it forever;
    ``total`` and the counters keep counting past the bound."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._entries: collections.deque[AuditEntry] = collections.deque(maxlen=maxlen)
        self._seq = itertools.count(1)
        self.total = 0
        self.by_outcome: collections.Counter[tuple[str, str]] = collections.Counter()  # (kind, outcome)

    def record(self, **fields: Any) -> AuditEntry:
        entry = AuditEntry(seq=next(self._seq), **fields)
        self._entries.append(entry)
        self.total += 1
        self.by_outcome[(entry.kind, entry.outcome.split(":", 1)[0])] += 1
        return entry

    def entries(self, *, kind: str | None = None, engine_id: str | None = None) -> list[AuditEntry]:
        return [
            e
            for e in self._entries
            if (kind is None or e.kind == kind) and (engine_id is None or e.engine_id == engine_id)
        ]

    def ops(self, engine_id: str | None = None) -> list[str]:
        return [e.op for e in self.entries(engine_id=engine_id)]

    def forbidden(self) -> list[AuditEntry]:
        """Calls to pause / flush / memory-release endpoints, and any abort-all."""
        return [e for e in self._entries if e.path in FORBIDDEN_PATHS or e.abort_all]

    def __len__(self) -> int:
        return len(self._entries)


# ---------------------------------------------------------------------------------- interface


@runtime_checkable
class EngineAPI(Protocol):
    """What the publisher and the session layer need from an engine (the real client, the
    fault-injecting wrapper, or a test double)."""

    engine_id: str
    # how bucket bytes reach this engine (relax_glue.bucket_transport); the publisher asks it
    # whether buckets go ahead of their acknowledgements
    transport: BucketTransport

    async def begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt: ...
    async def receive_bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> BucketAck: ...
    async def end(self, req: EndRequest) -> ReadyReceipt: ...
    async def cleanup(self, req: CleanupRequest) -> CleanupReceipt | DrainingReply: ...
    async def reclaim(self, req: ReclaimRequest) -> UnloadedReceipt | DrainingReply: ...
    async def status(self) -> EngineStatus: ...
    async def version_status(self, lora_name: str) -> VersionStatus: ...
    async def generate(self, body: Mapping[str, Any]) -> GenerationReply: ...
    def generate_stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]: ...
    async def abort_request(self, rid: str) -> None: ...


# A bucket body goes out in slices of this size. Handed over whole, the part of a body the kernel
# did not take at once is copied into asyncio's transport buffer, which is then trimmed from the
# front after every send the reader allows: 1.2 s of the sender's CPU per 350 MiB against 0.1 s
# for the kernel's own copy (bench/publish_engine.py, 2 cores). Each slice waits for the buffer to
# drain, so the buffer never holds more than one.
BODY_SLICE_BYTES = 1024 * 1024


async def body_slices(payload: bytes) -> AsyncIterator[memoryview]:
    view = memoryview(payload)
    for start in range(0, len(view), BODY_SLICE_BYTES):
        yield view[start : start + BODY_SLICE_BYTES]


def _mismatch(what: str) -> ValueError:
    return ValueError(f"reply does not match the request: {what}")


def _check_same(reply: Any, **expected: Any) -> None:
    for name, value in expected.items():
        if getattr(reply, name) != value:
            raise _mismatch(f"{name}={getattr(reply, name)!r}, sent {value!r}")


def generation_aborted(reply: Mapping[str, Any]) -> bool:
    """True when SGLang ended the generation with ``finish_reason.type == "abort"`` (an abort by
    rid, an abort-all, a pause in abort mode, a client disconnect): a 200 reply, not a result."""
    meta = reply.get("meta_info") if isinstance(reply, Mapping) else None
    finish = meta.get("finish_reason") if isinstance(meta, Mapping) else None
    return isinstance(finish, Mapping) and finish.get("type") == "abort"


def _json_object(body: bytes) -> dict[str, Any]:
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data


def _generation_reply(body: bytes) -> GenerationReply:
    """``/generate``'s reply: one object, or with ``n > 1`` a list of one object per sample."""
    data = json.loads(body)
    if isinstance(data, list) and data and all(isinstance(d, dict) for d in data):
        return data
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object or a list of them")
    return data


# ------------------------------------------------------------------------------------ client


class EngineClient:
    """One engine. Build it, use it from one event loop, ``await aclose()`` at the end.

    ``control_transport`` / ``generation_transport`` replace the real transports (tests pass an
    ``httpx.MockTransport``); by default each pool gets an ``AsyncHTTPTransport(retries=0)``.
    ``admin_key`` is sent as ``Authorization: Bearer`` on control calls (SGLang's
    ``ADMIN_OPTIONAL`` endpoints), ``api_key`` on generation (and on control calls when there is
    no admin key).

    ``transport``: how bucket bytes reach the engine (:mod:`relax_glue.bucket_transport`: the
    call's body by default, a file in a directory the engine on this host reads, or the engine's
    collective group), or the name of a registered transport, built with its defaults; the
    protocol around each bucket is the same whatever carries it.
    """

    def __init__(
        self,
        engine_id: str,
        base_url: str,
        *,
        admin_key: str | None = None,
        api_key: str | None = None,
        timeouts: ClientTimeouts | None = None,
        limits: PoolLimits | None = None,
        audit: AuditLog | None = None,
        control_transport: httpx.AsyncBaseTransport | None = None,
        generation_transport: httpx.AsyncBaseTransport | None = None,
        transport: BucketTransport | str | None = None,
    ) -> None:
        self.engine_id = engine_id
        if transport is None or isinstance(transport, str):
            transport = bucket_transport(transport or HTTP_TRANSPORT)
        self.transport: BucketTransport = transport
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or ClientTimeouts()
        self.limits = limits or PoolLimits()
        self.audit = audit if audit is not None else AuditLog()
        t = self.timeouts
        control_key = admin_key or api_key
        # Limits live on the transport's pool; give each client its own transport so the two
        # pools are really separate (a shared transport would be one pool).
        self.control_http = self._pool(
            control_transport,
            self.limits.control_connections,
            control_key,
            httpx.Timeout(t.status, connect=t.connect, pool=t.pool),
        )
        self.generation_http = self._pool(
            generation_transport,
            self.limits.generation_connections,
            api_key,
            httpx.Timeout(t.generate, connect=t.connect, pool=t.pool),
        )

    def _pool(
        self,
        transport: httpx.AsyncBaseTransport | None,
        connections: int,
        key: str | None,
        timeout: httpx.Timeout,
    ) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport
            or httpx.AsyncHTTPTransport(
                retries=0,
                limits=httpx.Limits(
                    max_connections=connections,
                    max_keepalive_connections=connections,
                    keepalive_expiry=self.limits.keepalive_expiry,
                ),
            ),
            headers={"Authorization": f"Bearer {key}"} if key else None,
            timeout=timeout,
            follow_redirects=False,  # a redirect would be a second request we never decided on
        )

    def __repr__(self) -> str:
        return f"EngineClient({self.engine_id!r}, {self.base_url!r})"

    async def aclose(self) -> None:
        await self.control_http.aclose()
        await self.generation_http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _timeout(self, read: float | None) -> httpx.Timeout:
        return httpx.Timeout(read, connect=self.timeouts.connect, pool=self.timeouts.pool)

    def _record(
        self,
        kind: str,
        op: str,
        method: str,
        path: str,
        started: float,
        t0: float,
        outcome: str,
        status_code: int | None,
        detail: str,
        abort_all: bool = False,
    ) -> None:
        self.audit.record(
            engine_id=self.engine_id,
            kind=kind,
            op=op,
            method=method,
            path=path,
            started_at=started,
            duration_s=time.monotonic() - t0,
            outcome=outcome,
            status_code=status_code,
            detail=detail,
            abort_all=abort_all,
        )

    async def _call(
        self,
        kind: str,
        op: str,
        method: str,
        path: str,
        parse: Callable[[bytes], T] | None,
        *,
        read_timeout: float | None,
        detail: str = "",
        json_body: Any = None,
        content: bytes | AsyncIterable[memoryview] | None = None,
        headers: Mapping[str, str] | None = None,
        outcome_of: Callable[[T], str] | None = None,
        on_reply: Callable[[httpx.Response], None] | None = None,
    ) -> T:
        if path in FORBIDDEN_PATHS:  # defence in depth: no code path should get here
            raise ValueError(f"{path} is never called by this client")
        http = self.control_http if kind == "control" else self.generation_http
        started, t0 = time.time(), time.monotonic()
        status_code: int | None = None
        outcome: str = CallOutcome.CANCELLED  # what the audit says if we are cancelled mid-call
        abort_all = bool(isinstance(json_body, dict) and json_body.get("abort_all"))
        try:
            try:
                response = await http.request(
                    method,
                    path,
                    json=json_body,
                    content=content,
                    headers=headers,
                    timeout=self._timeout(read_timeout),
                )
            except (httpx.HTTPError, OSError) as exc:
                outcome = CallOutcome.UNKNOWN
                classify_outcome(self.engine_id, op, error=exc)  # always raises OutcomeUnknown
                raise
            status_code = response.status_code
            if on_reply is not None:
                on_reply(response)
            try:
                result = classify_outcome(self.engine_id, op, response=response, parse=parse)
            except (LoraVersionError, OutcomeUnknown) as exc:
                outcome = outcome_label(exc)
                raise
            outcome = outcome_of(result) if outcome_of is not None else CallOutcome.OK
            return result
        finally:
            self._record(kind, op, method, path, started, t0, outcome, status_code, detail, abort_all)

    # -------------------------------------------------------------------------- control

    async def _post_json(
        self,
        op: str,
        route: str,
        req: BaseModel,
        parser: Callable[[bytes], T],
        same: tuple[str, ...],
        read_timeout: float,
    ) -> T:
        """A JSON control call whose reply must name what the request named (``same`` fields)."""

        def parse(body: bytes) -> T:
            reply = parser(body)
            _check_same(reply, **{f: getattr(req, f) for f in same})
            return reply

        return await self._call(
            "control",
            op,
            "POST",
            route,
            parse,
            read_timeout=read_timeout,
            detail=getattr(req, "lora_name", ""),
            json_body=req.model_dump(mode="json"),
        )

    async def begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt:
        return await self.transport.begin(req, self)

    async def receive_bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> BucketAck:
        return await self.transport.send(meta, payload, self)

    # The raw calls a transport makes (relax_glue.bucket_transport.EngineCalls): begin and the
    # bucket above go through the transport; these do not.

    async def post_begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt:
        same = ("lora_name", "attempt_token", "digest")
        return await self._post_json("begin", Routes.BEGIN, req, parse_begin_reply, same, self.timeouts.begin)

    async def post_setup(
        self, op: str, route: str, req: BaseModel, reply: type[M], same: tuple[str, ...], read_timeout: float
    ) -> M:
        parser = functools.partial(parse_model, reply)
        return await self._post_json(op, route, req, parser, same, read_timeout)

    async def post_bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> BucketAck:
        def parse(body: bytes) -> BucketAck:
            ack = parse_model(BucketAck, body)
            _check_same(ack, index=meta.index)
            if not ack.accepted:
                # A 2xx that says "not accepted" has no code and no promise: not a receipt.
                raise ValueError(f"bucket {meta.index} acknowledged as not accepted")
            return ack

        return await self._call(
            "control",
            "receive_bucket",
            "POST",
            Routes.RECEIVE_BUCKET,
            parse,
            read_timeout=self.timeouts.bucket,
            detail=f"{meta.lora_name}#{meta.index}",
            content=body_slices(payload),
            # framed by its length, as one body (not chunked): the engine refuses a body longer
            # than its cap before reading it
            headers={**meta.to_headers(), "Content-Length": str(len(payload))},
        )

    async def end(self, req: EndRequest) -> ReadyReceipt:
        same = ("lora_name", "attempt_token")
        parser = functools.partial(parse_model, ReadyReceipt)
        return await self._post_json("end", Routes.END, req, parser, same, self.timeouts.end)

    async def cleanup(self, req: CleanupRequest) -> CleanupReceipt | DrainingReply:
        same = ("lora_name", "attempt_token")
        return await self._post_json(
            "cleanup", Routes.CLEANUP, req, parse_cleanup_reply, same, self.timeouts.cleanup
        )

    async def reclaim(self, req: ReclaimRequest) -> UnloadedReceipt | DrainingReply:
        same = ("lora_name", "reclaim_id")
        read_timeout = req.timeout_s + self.timeouts.reclaim_margin
        return await self._post_json("reclaim", Routes.RECLAIM, req, parse_reclaim_reply, same, read_timeout)

    async def status(self) -> EngineStatus:
        return await self._call(
            "control",
            "status",
            "GET",
            Routes.STATUS,
            lambda body: parse_model(EngineStatus, body),
            read_timeout=self.timeouts.status,
        )

    async def version_status(self, lora_name: str) -> VersionStatus:
        """``GET /lora_versions/{name}``; an engine that does not know the name answers
        UNKNOWN_VERSION (a clean LoraVersionError)."""

        def parse(body: bytes) -> VersionStatus:
            reply = parse_model(VersionStatus, body)
            _check_same(reply, lora_name=lora_name)
            return reply

        return await self._call(
            "control",
            "version_status",
            "GET",
            Routes.VERSION_STATUS.format(lora_name=quote(lora_name, safe="@")),
            parse,
            read_timeout=self.timeouts.status,
            detail=lora_name,
        )

    async def abort_request(self, rid: str) -> None:
        """Abort one request by id. Never abort-all: that would end every session's requests."""
        if not isinstance(rid, str) or not rid:
            # SGLang treats an empty rid as "" and aborts nothing; refuse before sending.
            raise ValueError("abort_request needs a non-empty rid")
        # On the control pool: a cancel must get through even when generation is saturated.
        await self._call(
            "control",
            "abort_request",
            "POST",
            ABORT_PATH,
            None,
            read_timeout=self.timeouts.abort,
            detail=rid,
            json_body={"rid": rid, "abort_all": False},
        )

    # ------------------------------------------------------------------------ generation

    async def generate(
        self,
        body: Mapping[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        on_reply: Callable[[httpx.Response], None] | None = None,
    ) -> GenerationReply:
        """One ``POST /generate``, sent exactly once. The body is sent as given (the session
        layer puts ``lora_path`` and ``rid`` in it). ``headers`` and ``on_reply`` (called with
        the response before it is read as an outcome) serve a gateway in front of the engines:
        the routing key out, the engine that served it back. With ``n > 1`` the reply is a list
        (one object per sample)."""
        return await self._call(
            "generation",
            "generate",
            "POST",
            GENERATE_PATH,
            _generation_reply,
            read_timeout=self.timeouts.generate,
            detail=str(body.get("rid", "")),
            json_body=dict(body),
            headers=headers,
            outcome_of=generation_outcome,
            on_reply=on_reply,
        )

    async def generate_stream(
        self,
        body: Mapping[str, Any],
        *,
        headers: Mapping[str, str] | None = None,
        on_reply: Callable[[httpx.Response], None] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Streaming ``POST /generate`` (``stream: true``): yields each SSE chunk as a dict.

        A refusal before the stream starts is classified like any reply; an error chunk with our
        body raises the typed LoraVersionError; a broken or truncated stream is OutcomeUnknown
        (the request was admitted and may still be running: abort it by rid before a retry).
        """
        op, rid = "generate_stream", str(body.get("rid", ""))
        payload = {**body, "stream": True}
        started, t0 = time.time(), time.monotonic()
        outcome, status_code = CallOutcome.CANCELLED, None
        try:
            try:
                async with self.generation_http.stream(
                    "POST",
                    GENERATE_PATH,
                    json=payload,
                    headers=headers,
                    timeout=self._timeout(self.timeouts.generate),
                ) as response:
                    status_code = response.status_code
                    if on_reply is not None:
                        on_reply(response)
                    if not 200 <= status_code < 300:
                        await response.aread()
                        classify_outcome(self.engine_id, op, response=response)
                    done = aborted = False
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[len("data:") :].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        try:
                            chunk = _json_object(data.encode())
                        except ValueError:
                            raise OutcomeUnknown(
                                self.engine_id, op, f"unparseable stream chunk: {_short(data)}"
                            ) from None
                        if "error" in chunk:
                            err = LoraVersionError.from_body(chunk)
                            if err is not None:
                                err.details.setdefault("engine_id", self.engine_id)
                                raise err
                            raise OutcomeUnknown(self.engine_id, op, f"error chunk: {_short(data)}")
                        # with n > 1 each sample ends in its own chunk: one aborted sample makes
                        # the group's outcome aborted, whichever sample's chunk comes last
                        aborted = aborted or generation_aborted(chunk)
                        yield chunk
                    if not done:
                        raise OutcomeUnknown(self.engine_id, op, "stream ended without [DONE]")
            except (httpx.HTTPError, OSError) as exc:
                classify_outcome(self.engine_id, op, error=exc)
            outcome = CallOutcome.ABORTED if aborted else CallOutcome.OK
        except (LoraVersionError, OutcomeUnknown) as exc:
            outcome = outcome_label(exc)
            raise
        finally:
            self._record("generation", op, "POST", GENERATE_PATH, started, t0, outcome, status_code, rid)


def forbidden_calls(logs: Iterable[AuditLog]) -> list[AuditEntry]:
    """Forbidden calls across several clients' audit logs (one per engine, or shared)."""
    seen: set[int] = set()
    out: list[AuditEntry] = []
    for log in logs:
        if id(log) in seen:
            continue
        seen.add(id(log))
        out.extend(log.forbidden())
    return out
