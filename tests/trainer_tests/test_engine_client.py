"""Pure-logic tests of the engine client: outcome classification, pools, no retries, audit,
timeouts, admin key, streaming, and the fault-injecting wrapper.

Replies come from ``httpx.MockTransport`` handlers and from ``_fake_engine.FakeEngine`` (a test
double of the protocol semantics, not SGLang); the pool and no-retry tests use a tiny raw HTTP
server on localhost so the real ``AsyncHTTPTransport`` pools are what is measured. No engine runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from _fake_engine import FakeEngine, make_snapshot

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_versions_dev.fault_injection import FaultInjectingClient, FaultKind
from relax_glue.engine_client import (
    BODY_SLICE_BYTES,
    ENGINE_KEEP_ALIVE_S,
    FORBIDDEN_PATHS,
    AuditLog,
    ClientTimeouts,
    EngineClient,
    OutcomeUnknown,
    PoolLimits,
    classify_outcome,
    forbidden_calls,
)

SNAP = make_snapshot(seed=1)
LORA = SNAP.lora_name("relax_policy_lora", "7", "A")
TOKEN = "att-test-1"
BEGIN = SNAP.begin_request("relax_policy_lora", "7", "A", TOKEN)
INC = "E0-inc1"


def prepared(**over: Any) -> dict[str, Any]:
    body = {
        "state": "PREPARED",
        "lora_name": LORA,
        "digest": SNAP.digest,
        "attempt_token": TOKEN,
        "incarnation": INC,
    }
    return {**body, **over}


def mock_client(
    handler: Callable[[httpx.Request], Any], *, audit: AuditLog | None = None, **kwargs: Any
) -> EngineClient:
    return EngineClient(
        "E0",
        "http://e0.mock",
        audit=audit,
        control_transport=httpx.MockTransport(handler),
        generation_transport=httpx.MockTransport(handler),
        **kwargs,
    )


def reply(
    status: int, body: Any = None, text: str | None = None
) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        if text is not None:
            return httpx.Response(status, text=text)
        return httpx.Response(status, json=body)

    return handler


# ------------------------------------------------------------------------- classification


async def test_2xx_with_a_matching_receipt_is_success() -> None:
    client = mock_client(reply(200, prepared()))
    receipt = await client.begin(BEGIN)
    assert isinstance(receipt, p.PreparedReceipt) and receipt.incarnation == INC
    assert [(e.op, e.outcome, e.status_code) for e in client.audit.entries()] == [("begin", "ok", 200)]


@pytest.mark.parametrize(
    "code", [ErrorCode.CAPACITY_ERROR, ErrorCode.CHECKSUM_MISMATCH, ErrorCode.UNKNOWN_VERSION]
)
async def test_4xx_with_our_error_body_is_a_typed_clean_refusal(code: ErrorCode) -> None:
    err = LoraVersionError(code, "refused for the test", in_use=2)
    client = mock_client(reply(err.http_status, err.to_body()))
    with pytest.raises(LoraVersionError) as exc:
        await client.begin(BEGIN)
    assert (
        exc.value.code is code and exc.value.details["in_use"] == 2 and exc.value.details["engine_id"] == "E0"
    )
    assert not isinstance(exc.value, OutcomeUnknown)
    assert client.audit.entries()[0].outcome == f"refused:{code.value}"


@pytest.mark.parametrize(
    ("status", "body", "text"),
    [
        (500, None, "Internal Server Error"),
        (503, LoraVersionError(ErrorCode.CAPACITY_ERROR, "x").to_body(), None),  # 5xx is never clean
        (502, None, ""),
        (400, {"error": {"message": "SGLang's own 400", "code": 400}}, None),  # a 4xx that is not ours
        (401, {"error": "Unauthorized"}, None),
        (404, {"detail": "Not Found"}, None),
        (409, None, "not json at all"),
        (200, None, "garbage"),  # 2xx we cannot read
        (200, {"state": "PREPARED"}, None),  # 2xx missing fields
        (200, prepared(attempt_token="att-other"), None),  # 2xx for another attempt
        (200, prepared(digest="0" * 64), None),  # 2xx for other content
        (302, None, ""),
    ],
)
async def test_everything_else_is_outcome_unknown(status: int, body: Any, text: str | None) -> None:
    client = mock_client(reply(status, body, text))
    with pytest.raises(OutcomeUnknown) as exc:
        await client.begin(BEGIN)
    assert not isinstance(exc.value, LoraVersionError)
    assert exc.value.engine_id == "E0" and exc.value.op == "begin" and exc.value.status_code == status
    assert exc.value.maybe_sent
    assert client.audit.entries()[0].outcome == "unknown"


@pytest.mark.parametrize(
    ("error", "maybe_sent"),
    [
        (httpx.ReadTimeout("read"), True),
        (httpx.WriteTimeout("write"), True),
        (httpx.RemoteProtocolError("server went away"), True),
        (httpx.ReadError("reset"), True),
        (httpx.ConnectError("refused"), False),
        (httpx.ConnectTimeout("connect"), False),
        (httpx.PoolTimeout("pool"), False),
    ],
)
async def test_transport_errors_are_outcome_unknown(error: Exception, maybe_sent: bool) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    client = mock_client(handler)
    with pytest.raises(OutcomeUnknown) as exc:
        await client.end(p.EndRequest(lora_name=LORA, attempt_token=TOKEN))
    assert exc.value.maybe_sent is maybe_sent and type(error).__name__ in exc.value.cause


def test_classify_outcome_is_one_function_for_replies_and_errors() -> None:
    ok = httpx.Response(200, json={"a": 1})
    assert classify_outcome("E", "op", response=ok, parse=json.loads) == {"a": 1}
    with pytest.raises(OutcomeUnknown):
        classify_outcome("E", "op", error=httpx.ReadTimeout("t"))
    with pytest.raises(LoraVersionError):
        classify_outcome(
            "E", "op", response=httpx.Response(410, json={"error": {"code": "VERSION_RECLAIMED"}})
        )
    with pytest.raises(OutcomeUnknown):
        classify_outcome("E", "op", response=httpx.Response(410, json={"error": {"code": "NOT_OURS"}}))


async def test_bucket_ack_must_be_for_the_bucket_sent_and_accepted() -> None:
    meta = p.ReceiveBucketMeta(lora_name=LORA, attempt_token=TOKEN, index=2, sha256="a" * 64)
    for body in ({"index": 3, "accepted": True}, {"index": 2, "accepted": False}):
        with pytest.raises(OutcomeUnknown):
            await mock_client(reply(200, body)).receive_bucket(meta, b"x")
    ack = await mock_client(reply(200, {"index": 2, "accepted": True, "duplicate": True})).receive_bucket(
        meta, b"x"
    )
    assert ack.duplicate


# ------------------------------------------------------------------------- wire details


async def test_receive_bucket_sends_the_raw_payload_with_meta_headers() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"index": 0, "accepted": True})

    bucket = next(SNAP.iter_buckets())
    meta = p.ReceiveBucketMeta(lora_name=LORA, attempt_token=TOKEN, index=0, sha256=bucket.sha256)
    await mock_client(handler).receive_bucket(meta, bucket.payload)
    (req,) = seen
    assert req.url.path == p.Routes.RECEIVE_BUCKET and req.content == bucket.payload
    assert p.ReceiveBucketMeta.from_headers(req.headers) == meta
    assert req.headers["content-type"] == p.BUCKET_CONTENT_TYPE
    # one body framed by its length (the engine checks it against the cap before reading)
    assert req.headers["content-length"] == str(len(bucket.payload))
    assert "transfer-encoding" not in req.headers


async def test_a_body_of_several_slices_reaches_a_real_server_whole_and_framed_by_its_length() -> None:
    """A real socket and a reader slower than the sender: the body goes in slices, each one
    after the last drained (asyncio's buffer never holds the rest of a large body)."""
    payload = bytes(range(256)) * (3 * BODY_SLICE_BYTES // 256 + 17)
    got: dict[str, Any] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        got["head"] = head.decode().lower()
        length = int(got["head"].split("content-length: ")[1].split("\r\n")[0])
        body = bytearray()
        while len(body) < length:
            body += await reader.read(64 * 1024)
            await asyncio.sleep(0.001)  # a slow reader: the sender's buffer fills
        got["body"] = bytes(body)
        reply = b'{"index": 0, "accepted": true}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(reply), reply)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    meta = p.ReceiveBucketMeta(lora_name=LORA, attempt_token=TOKEN, index=0, sha256="0" * 64)
    async with server, EngineClient("e0", f"http://127.0.0.1:{port}") as client:
        ack = await client.post_bucket(meta, payload)
    assert ack.accepted and got["body"] == payload
    assert f"content-length: {len(payload)}" in got["head"] and "transfer-encoding" not in got["head"]


async def test_each_call_type_has_its_own_read_timeout() -> None:
    seen: dict[str, dict[str, float]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = request.extensions["timeout"]
        if request.url.path == p.Routes.RECLAIM:
            return httpx.Response(
                200,
                json={
                    "state": "DRAINING",
                    "lora_name": LORA,
                    "reclaim_id": "r1",
                    "in_flight": 1,
                    "incarnation": INC,
                },
            )
        if request.url.path == p.Routes.END:
            return httpx.Response(409, json=LoraVersionError(ErrorCode.STALE_ATTEMPT, "x").to_body())
        return httpx.Response(200, json={"text": "ok"})

    t = ClientTimeouts(connect=1.5, pool=2.5, end=77.0, reclaim_margin=3.0, generate=42.0)
    client = mock_client(handler, timeouts=t)
    await client.reclaim(p.ReclaimRequest(lora_name=LORA, reclaim_id="r1", timeout_s=5.0))
    with pytest.raises(LoraVersionError):
        await client.end(p.EndRequest(lora_name=LORA, attempt_token=TOKEN))
    await client.generate({"rid": "g"})
    assert seen[p.Routes.RECLAIM]["read"] == 8.0  # engine-side wait + margin
    assert seen[p.Routes.END]["read"] == 77.0
    assert seen["/generate"]["read"] == 42.0
    assert all(v["connect"] == 1.5 and v["pool"] == 2.5 for v in seen.values())


async def test_admin_key_on_control_api_key_on_generation() -> None:
    auth: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        auth[request.url.path] = request.headers.get("authorization")
        if request.url.path == "/abort_request":
            return httpx.Response(200)
        return httpx.Response(200, json={"text": "ok"})

    await mock_client(handler, admin_key="adm", api_key="api").abort_request("r1")
    await mock_client(handler, admin_key="adm", api_key="api").generate({"rid": "g"})
    assert auth == {"/abort_request": "Bearer adm", "/generate": "Bearer api"}
    await mock_client(handler).generate({"rid": "g"})
    assert auth["/generate"] is None


async def test_audit_records_every_call_and_abort_is_never_abort_all() -> None:
    fake = FakeEngine("E0")
    audit = AuditLog()
    client = fake.client(audit=audit)
    await client.status()
    with pytest.raises(LoraVersionError):
        await client.version_status(LORA)
    await client.generate({"rid": "g1"})
    await client.abort_request("g1")
    with pytest.raises(ValueError):
        await client.abort_request("")  # an empty rid is refused before sending
    entries = audit.entries()
    assert [(e.kind, e.op, e.method, e.path, e.outcome) for e in entries] == [
        ("control", "status", "GET", "/lora_versions", "ok"),
        ("control", "version_status", "GET", f"/lora_versions/{LORA}", "refused:UNKNOWN_VERSION"),
        ("generation", "generate", "POST", "/generate", "ok"),
        ("control", "abort_request", "POST", "/abort_request", "ok"),
    ]
    assert all(e.engine_id == "E0" and e.started_at > 0 and e.duration_s >= 0 for e in entries)
    assert fake.aborts == [{"rid": "g1", "abort_all": False}]
    assert audit.forbidden() == [] and forbidden_calls([audit, audit]) == []
    assert {"/pause_generation", "/flush_cache", "/continue_generation"} <= FORBIDDEN_PATHS
    assert not any(hasattr(client, name) for name in ("pause_generation", "flush_cache", "abort_all"))


def test_audit_flags_forbidden_paths_and_abort_all() -> None:
    audit = AuditLog()
    common = dict(engine_id="E0", kind="control", method="POST", started_at=0.0, duration_s=0.0)
    audit.record(op="x", path="/flush_cache", outcome="ok", status_code=200, detail="", **common)
    audit.record(
        op="abort_request",
        path="/abort_request",
        outcome="ok",
        status_code=200,
        detail="",
        abort_all=True,
        **common,
    )
    audit.record(op="status", path="/lora_versions", outcome="ok", status_code=200, detail="", **common)
    assert [e.path for e in audit.forbidden()] == ["/flush_cache", "/abort_request"]


# ---------------------------------------------------------------------------- generation


async def test_generation_is_sent_once_and_never_retried_on_timeout() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("slow", request=request)

    client = mock_client(handler)
    with pytest.raises(OutcomeUnknown) as exc:
        await client.generate({"rid": "g1", "lora_path": LORA})
    assert calls == 1 and exc.value.maybe_sent
    assert client.audit.by_outcome[("generation", "unknown")] == 1


async def test_generation_version_error_is_typed() -> None:
    fake = FakeEngine("E0")
    with pytest.raises(LoraVersionError) as exc:
        await fake.client().generate({"rid": "g1", "lora_path": LORA})
    assert exc.value.code is ErrorCode.UNKNOWN_VERSION


async def test_streaming_yields_chunks_and_classifies_errors() -> None:
    def sse(*chunks: str) -> Callable[[httpx.Request], httpx.Response]:
        def handler(request: httpx.Request) -> httpx.Response:
            assert json.loads(request.content)["stream"] is True
            return httpx.Response(200, text="".join(f"data: {c}\n\n" for c in chunks))

        return handler

    async def collect(it: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c async for c in it]

    ok = await collect(
        mock_client(sse('{"text": "a"}', '{"text": "ab"}', "[DONE]")).generate_stream({"rid": "s"})
    )
    assert [c["text"] for c in ok] == ["a", "ab"]
    ours = json.dumps(LoraVersionError(ErrorCode.VERSION_RECLAIMED, "gone").to_body())
    with pytest.raises(LoraVersionError):
        await collect(mock_client(sse('{"text": "a"}', ours)).generate_stream({"rid": "s"}))
    for bad in (('{"text": "a"}',), ('{"error": {"message": "boom"}}', "[DONE]"), ("not json", "[DONE]")):
        with pytest.raises(OutcomeUnknown):
            await collect(mock_client(sse(*bad)).generate_stream({"rid": "s"}))
    refusal = LoraVersionError(ErrorCode.UNKNOWN_VERSION, "no")
    with pytest.raises(LoraVersionError):
        await collect(mock_client(reply(404, refusal.to_body())).generate_stream({"rid": "s"}))
    client = mock_client(reply(500, text="boom"))
    with pytest.raises(OutcomeUnknown):
        await collect(client.generate_stream({"rid": "s"}))
    assert [e.outcome for e in client.audit.entries()] == ["unknown"]


# ----------------------------------------------------------- real pools on a local server


class TinyServer:
    """A raw HTTP/1.1 server on localhost: ``/generate`` waits for ``release`` (or closes the
    connection without a reply when ``drop`` is set); ``/lora_versions`` answers at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.generate_seen = asyncio.Event()
        self.generations = 0
        self.drop = False
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aenter__(self) -> TinyServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if x)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                if path == "/generate":
                    self.generations += 1
                    self.generate_seen.set()
                    if self.drop:
                        return  # close without a reply
                    await self.release.wait()
                    body = json.dumps({"text": "done"}).encode()
                else:
                    body = json.dumps({"incarnation": "tiny-1", "versions": []}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_generation_and_control_use_separate_pools() -> None:
    async with TinyServer() as server:
        client = EngineClient(
            "E0",
            server.url,
            limits=PoolLimits(control_connections=1, generation_connections=1),
            timeouts=ClientTimeouts(pool=0.3, generate=10.0, status=2.0),
        )
        assert client.control_http is not client.generation_http
        assert client.control_http._transport is not client.generation_http._transport
        for http in (client.control_http, client.generation_http):
            assert http._transport._pool._retries == 0  # no transport-level retries
        try:
            first = asyncio.create_task(client.generate({"rid": "g1"}))
            await asyncio.wait_for(server.generate_seen.wait(), 5)
            # The only generation connection is busy: a second generation waits for the pool
            # and gives up without ever being sent ...
            with pytest.raises(OutcomeUnknown) as exc:
                await client.generate({"rid": "g2"})
            assert exc.value.maybe_sent is False and server.generations == 1
            # ... while control calls still get through on their own pool.
            status = await asyncio.wait_for(client.status(), 2)
            assert status.incarnation == "tiny-1"
            server.release.set()
            assert (await first)["text"] == "done"
        finally:
            await client.aclose()


def test_a_pooled_connection_is_let_go_before_the_engine_closes_it_for_idling() -> None:
    """A request sent on a pooled connection just as SGLang's server closes it for idling fails
    with no reply, an unknown outcome on a healthy engine: the pool must drop a connection first
    (seen in CI: a bucket sent 5.0 s after its begin, on begin's connection)."""
    from sglang.srt.environ import envs  # the pinned engine's own default, not our copy of it

    assert envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() == ENGINE_KEEP_ALIVE_S
    assert PoolLimits().keepalive_expiry <= ENGINE_KEEP_ALIVE_S - 1.0  # a second for timer slack


async def test_a_generation_whose_connection_drops_is_not_resent() -> None:
    async with TinyServer() as server:
        server.drop = True
        client = EngineClient("E0", server.url)
        try:
            with pytest.raises(OutcomeUnknown) as exc:
                await client.generate({"rid": "g1"})
            assert exc.value.maybe_sent and server.generations == 1
        finally:
            await client.aclose()


async def test_a_generation_that_times_out_is_not_resent() -> None:
    async with TinyServer() as server:
        client = EngineClient("E0", server.url, timeouts=ClientTimeouts(generate=0.2))
        try:
            with pytest.raises(OutcomeUnknown) as exc:
                await client.generate({"rid": "g1"})
            assert "ReadTimeout" in exc.value.cause
            await asyncio.sleep(0.1)
            assert server.generations == 1
        finally:
            await client.aclose()


# ------------------------------------------------------------------------ fault injection


async def test_drop_reply_fails_only_the_nth_call_after_the_engine_processed_it() -> None:
    fake = FakeEngine("E0")
    client = FaultInjectingClient(fake.client()).drop_reply("begin", nth=2)
    first = await client.begin(BEGIN)
    with pytest.raises(OutcomeUnknown) as exc:
        await client.begin(BEGIN)  # sent, processed, reply discarded
    assert "dropped" in exc.value.cause and exc.value.maybe_sent
    third = await client.begin(BEGIN)
    assert first == third and fake.ops("begin") == ["begin"] * 3
    assert [(f.op, f.nth, f.kind, f.real_outcome) for f in client.injected] == [
        ("begin", 2, FaultKind.DROP_REPLY, "ok")
    ]
    assert [e.outcome for e in client.audit.entries()] == ["ok", "ok", "ok"]  # the real client saw a reply


async def test_fail_before_send_never_reaches_the_engine_and_other_ops_pass_through() -> None:
    fake = FakeEngine("E0")
    client = FaultInjectingClient(fake.client()).fail_before_send("begin", nth=1)
    with pytest.raises(OutcomeUnknown) as exc:
        await client.begin(BEGIN)
    assert exc.value.maybe_sent is False and fake.ops("begin") == []
    assert (await client.status()).incarnation == fake.incarnation  # other ops untouched
    receipt = await client.begin(BEGIN)
    assert receipt.state == "PREPARED" and fake.ops() == ["status", "begin"]
    assert client.calls == {"begin": 2, "status": 1} and client.pending() == []


async def test_drop_reply_of_a_refusal_is_still_unknown() -> None:
    fake = FakeEngine("E0")
    fake.fail("end", code=ErrorCode.LOAD_FAILED)
    client = FaultInjectingClient(fake.client()).drop_reply("end")
    with pytest.raises(OutcomeUnknown):
        await client.end(p.EndRequest(lora_name=LORA, attempt_token=TOKEN))
    assert client.injected[0].real_outcome == "refused:LOAD_FAILED"


def test_wrapper_refuses_unknown_ops() -> None:
    with pytest.raises(ValueError):
        FaultInjectingClient(FakeEngine("E0").client()).drop_reply("pause_generation")


async def test_corrupt_bucket_flips_one_byte_of_only_the_nth_payload() -> None:
    seen: list[bytes] = []

    class Recorder:
        engine_id = "E0"

        async def receive_bucket(self, meta: object, payload: bytes) -> str:
            seen.append(payload)
            return "ack"

    client = FaultInjectingClient(Recorder()).corrupt_bucket(nth=2)  # type: ignore[arg-type]
    payloads = [b"abc", b"def", b"ghi"]
    assert [await client.receive_bucket(None, x) for x in payloads] == ["ack"] * 3  # type: ignore[arg-type]
    assert seen == [b"abc", b"de" + bytes([ord("f") ^ 0xFF]), b"ghi"]
    assert [(f.op, f.nth, f.kind) for f in client.injected] == [
        ("receive_bucket", 2, FaultKind.CORRUPT_PAYLOAD)
    ]
