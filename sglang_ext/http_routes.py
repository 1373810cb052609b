"""HTTP routes of the plugin, mounted on SGLang's FastAPI app in the engine's main process.

On an engine (:func:`mount`) every control route is ``ADMIN_OPTIONAL``, exactly like SGLang's own
LoRA control endpoints: with ``--admin-api-key`` set only that key opens them; with only
``--api-key`` that key does. Every refusal is a :class:`LoraVersionError`, turned into
``{"error": {...}}`` with its one status by the exception handler registered here (also for errors
raised by our hooks inside SGLang routes). :func:`install` mounts the same routes on any app (the
trainer-side tests run the real routes and services in process, over a fake native edge)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    BUCKET_CONTENT_TYPE,
    HTTP_TRANSPORT,
    BeginRequest,
    CleanupRequest,
    DrainingReply,
    EndRequest,
    ReceiveBucketMeta,
    ReclaimRequest,
    Routes,
    parse_model,
)
from lora_contract.wire_models import invalid
from sglang_ext import hook_timing
from sglang_ext.bucket_receiver import BucketReceiver
from sglang_ext.bucket_sources import SetupRoute
from sglang_ext.engine_state import BodyLimits, EngineState, engine_state
from sglang_ext.lora_registry_patch import admin_optional
from sglang_ext.plugin_log import log_line


def error_response(err: LoraVersionError) -> JSONResponse:
    """The one way a typed refusal leaves the engine (control and generation routes alike)."""
    engine_state().metrics.refused(err.code.value)
    retry = err.retry_after_s
    headers = {"Retry-After": str(retry)} if retry is not None else None
    return JSONResponse(err.to_body(), status_code=err.http_status, headers=headers)


async def _lora_version_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LoraVersionError)
    return error_response(exc)


def _ok(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def _removal_reply(reply: Any, op: dict[str, str]) -> JSONResponse:
    """A reclaim or cleanup: 200 once done, 202 while DRAINING (not an error: it goes on)."""
    draining = isinstance(reply, DrainingReply)
    if draining:
        op["outcome"] = "draining"
    status = 202 if draining else 200
    return JSONResponse(reply.model_dump(mode="json"), status_code=status)


async def read_body(
    request: Request,
    cap: int,
    limits: BodyLimits,
    what: str,
    sink: Callable[[bytes], None] | None = None,
    pace: Callable[[], Awaitable[None]] | None = None,
) -> bytes:
    """The request body, at most ``cap`` bytes, read under ``limits``' deadlines. With ``sink``
    each chunk goes to it as it arrives (and nothing is kept here; the sink raises to stop);
    ``pace`` is awaited before each next chunk (the sink's backpressure: that wait is the
    receiver's, so it counts against the total deadline, not the client's idle one).

    Refused before reading when Content-Length says it is too large (PAYLOAD_TOO_LARGE). A body
    that stalls past its deadline or is cut short by the client is INCOMPLETE_BODY and one log
    line (not an ASGI traceback); either way the caller changed nothing yet."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise LoraVersionError(
            ErrorCode.PAYLOAD_TOO_LARGE, f"{what} body of {length} bytes exceeds {cap}", limit=cap
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.total_timeout_s
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    try:
        async with asyncio.timeout(None) as scope:
            while True:
                if pace is not None:
                    scope.reschedule(deadline)
                    await pace()
                scope.reschedule(min(deadline, loop.time() + limits.idle_timeout_s))
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                size += len(chunk)
                if size > cap:
                    raise LoraVersionError(
                        ErrorCode.PAYLOAD_TOO_LARGE, f"{what} body exceeds {cap} bytes", limit=cap
                    )
                if sink is None:
                    chunks.append(chunk)
                else:
                    sink(chunk)
    except TimeoutError:
        log_line(f"{what}: request body stalled after {size} bytes; read abandoned")
        raise LoraVersionError(
            ErrorCode.INCOMPLETE_BODY, f"{what} body stalled after {size} bytes", received=size
        ) from None
    except ClientDisconnect:
        log_line(f"{what}: client disconnected after {size} bytes of the request body")
        raise LoraVersionError(
            ErrorCode.INCOMPLETE_BODY, f"{what} body cut short after {size} bytes", received=size
        ) from None
    finally:
        await stream.aclose()
    return b"".join(chunks)


def _check_bucket_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != BUCKET_CONTENT_TYPE:
        raise LoraVersionError(
            ErrorCode.INVALID_REQUEST,
            f"a bucket body must be {BUCKET_CONTENT_TYPE} (safetensors bytes), "
            f"got {content_type or 'none'!r}",
        )


S = TypeVar("S")
M = TypeVar("M", bound=BaseModel)


def _serving(service: S | None) -> S:
    """A service exists once the HTTP server is set up (EngineState.attach)."""
    if service is None:
        raise LoraVersionError(ErrorCode.INVALID_REQUEST, "the engine is not serving yet")
    return service


def _setup_endpoint(setup: SetupRoute, json_body: Callable[[Request, Any], Any]) -> Callable[[Request], Any]:
    async def transport_setup(request: Request) -> Any:
        return _ok(await setup.handle(await json_body(request, setup.request)))

    transport_setup.__name__ = f"lora_versions_setup{setup.path.replace('/', '_')}"
    return transport_setup


class _Routes:
    """Collects (path, endpoint, methods). Mounted with ``app.add_api_route`` one by one: FastAPI's
    ``include_router`` (in the version SGLang 0.5.23 pulls in) adds a lazy included-router object,
    and SGLang's auth middleware then cannot see the endpoints' ``_auth_level`` and treats them as
    NORMAL, i.e. open when only an admin key is set. A test asserts the 401s."""

    def __init__(self) -> None:
        self.routes: list[tuple[str, Any, list[str]]] = []

    def get(self, path: str):
        return self._add(path, "GET")

    def post(self, path: str):
        return self._add(path, "POST")

    def _add(self, path: str, method: str):
        def decorator(endpoint: Any) -> Any:
            self.routes.append((path, endpoint, [method]))
            return endpoint

        return decorator


def build_routes(state: EngineState) -> list[tuple[str, Any, list[str]]]:
    router = _Routes()

    @router.get(Routes.STATUS)
    async def lora_versions_status() -> Any:
        return _ok(state.status())

    async def json_body(request: Request, model: type[M]) -> M:
        limits = state.body_limits
        return parse_model(model, await read_body(request, limits.max_json_bytes, limits, model.__name__))

    @router.post(Routes.BEGIN)
    async def lora_versions_begin(request: Request) -> Any:
        with state.metrics.timed_op("begin"):
            req = await json_body(request, BeginRequest)
            return _ok(await _serving(state.publication).begin(req))

    @router.post(Routes.RECEIVE_BUCKET)
    async def lora_versions_receive_bucket(request: Request) -> Any:
        meta = ReceiveBucketMeta.from_headers(request.headers)
        _check_bucket_content_type(request)
        service = _serving(state.publication)

        what = f"bucket {meta.index} of {meta.lora_name}"

        async def read_bucket(cap: int, receiver: BucketReceiver) -> None:
            await read_body(request, cap, state.body_limits, what, receiver.feed, receiver.pace)

        async def read_local_source(cap: int, receiver: BucketReceiver) -> None:
            # a bucket comes from one place only: the body must be empty
            length = request.headers.get("content-length")
            if length not in (None, "0"):
                raise invalid(f"{what}: a bucket named by its local source has an empty body")
            await read_body(request, 0, state.body_limits, what)
            assert meta.source is not None
            source = receiver.staging.take_local_source(state.local_source_dir, meta.source)
            try:
                if source.part is not None:
                    await receiver.adopt(source.part)
                else:
                    assert source.fd is not None
                    await receiver.fill_from_file(source.fd)
            finally:
                source.discard_moved()  # copied (or refused): the moved original goes

        async def acknowledge_out_of_band(cap: int, receiver: BucketReceiver) -> None:
            await read_body(request, 0, state.body_limits, what)  # the bytes came another way
            await service.out_of_band_filler(meta.transport, meta)(cap, receiver)

        if meta.transport != HTTP_TRANSPORT:
            fill = acknowledge_out_of_band
        else:
            fill = read_bucket if meta.source is None else read_local_source
        with state.metrics.timed_op("bucket"):
            return _ok(await service.receive_bucket(meta, fill))

    # the setup calls of this engine's other transports (bucket_sources: the collective's connect)
    receives = state.publication.out_of_band.values() if state.publication is not None else ()
    for setup in [route for receive in receives for route in receive.setup_routes()]:
        router.post(setup.path)(_setup_endpoint(setup, json_body))

    @router.post(Routes.END)
    async def lora_versions_end(request: Request) -> Any:
        with state.metrics.timed_op("end"):
            req = await json_body(request, EndRequest)
            return _ok(await _serving(state.publication).end(req))

    @router.post(Routes.CLEANUP)
    async def lora_versions_cleanup(request: Request) -> Any:
        with state.metrics.timed_op("cleanup") as op:
            req = await json_body(request, CleanupRequest)
            return _removal_reply(await _serving(state.publication).cleanup(req), op)

    @router.post(Routes.RECLAIM)
    async def lora_versions_reclaim(request: Request) -> Any:
        with state.metrics.timed_op("reclaim") as op:
            req = await json_body(request, ReclaimRequest)
            return _removal_reply(await _serving(state.reclaim).reclaim(req), op)

    if hook_timing.enabled():

        @router.get(Routes.HOOK_TIMING)
        async def lora_versions_hook_timing() -> Any:
            return JSONResponse(hook_timing.snapshot())

    # Declared last: "/lora_versions/{lora_name}" must not shadow the routes above.
    @router.get(Routes.VERSION_STATUS)
    async def lora_version_status(lora_name: str) -> Any:
        for version in state.status().versions:
            if version.lora_name == lora_name:
                return _ok(version)
        raise LoraVersionError(
            ErrorCode.UNKNOWN_VERSION, f"no managed version {lora_name!r}", lora_name=lora_name
        )

    return router.routes


def install(app: Any, state: EngineState, guard: Callable[[Any], Any] = lambda endpoint: endpoint) -> None:
    """Mount the control routes of ``state`` and the typed-error handlers on ``app``; ``guard``
    marks every route's auth level (identity for an app without SGLang's auth middleware)."""
    app.add_exception_handler(LoraVersionError, _lora_version_error_handler)
    for path, endpoint, methods in build_routes(state):
        app.add_api_route(path, guard(endpoint), methods=methods)


def mount(app: Any, server_args: Any, tokenizer_manager: Any) -> None:
    """The engine's own mount: every control route ADMIN_OPTIONAL, like SGLang's LoRA endpoints."""
    if getattr(app.state, "lora_versions_mounted", False):
        return
    state = engine_state()
    state.attach(server_args, tokenizer_manager)
    install(app, state, guard=admin_optional)
    app.state.lora_versions_mounted = True
