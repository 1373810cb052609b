"""HTTP routes of the plugin, mounted on SGLang's FastAPI app in the engine's main process.

Every control route is ``ADMIN_OPTIONAL``, exactly like SGLang's own LoRA control endpoints: with
``--admin-api-key`` set only that key opens them; with only ``--api-key`` that key does. Every
refusal is a :class:`LoraVersionError`, turned into ``{"error": {...}}`` with its one status by
the exception handler registered here (also for errors raised by our hooks inside SGLang routes).
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

# Upstream symbol: sglang.srt.utils.auth.auth_level / AuthLevel (0.5.23).
from sglang.srt.utils.auth import AuthLevel, auth_level

from sglang_ext.engine_state import EngineState, engine_state
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.protocol import (
    BeginRequest,
    CleanupRequest,
    EndRequest,
    ReceiveBucketMeta,
    ReclaimRequest,
    Routes,
    parse_model,
)
from sglang_ext.publication import CleanupPending


def error_response(err: LoraVersionError) -> JSONResponse:
    return JSONResponse(err.to_body(), status_code=err.http_status)


async def _lora_version_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, LoraVersionError)
    return error_response(exc)


async def _cleanup_pending_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CleanupPending)
    # 503 on purpose: the outcome is not final, so the publisher must treat it as unknown and ask again.
    return JSONResponse(
        {"state": "DRAINING", "lora_name": exc.lora_name, "in_flight": exc.in_flight, "detail": str(exc)},
        status_code=503,
    )


def _ok(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


async def _json(request: Request) -> bytes:
    return await request.body()


S = TypeVar("S")


def _serving(service: S | None) -> S:
    """A service exists once the HTTP server is set up (EngineState.attach)."""
    if service is None:
        raise LoraVersionError(ErrorCode.INVALID_REQUEST, "the engine is not serving yet")
    return service


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
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_status() -> Any:
        return _ok(state.status())

    @router.post(Routes.BEGIN)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_begin(request: Request) -> Any:
        req = parse_model(BeginRequest, await _json(request))
        return _ok(await _serving(state.publication).begin(req))

    @router.post(Routes.RECEIVE_BUCKET)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_receive_bucket(request: Request) -> Any:
        meta = ReceiveBucketMeta.from_headers(request.headers)
        length = request.headers.get("content-length")
        content_length = int(length) if length and length.isdigit() else None
        return _ok(await _serving(state.publication).receive_bucket(meta, content_length, request.stream()))

    @router.post(Routes.END)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_end(request: Request) -> Any:
        req = parse_model(EndRequest, await _json(request))
        return _ok(await _serving(state.publication).end(req))

    @router.post(Routes.CLEANUP)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_cleanup(request: Request) -> Any:
        req = parse_model(CleanupRequest, await _json(request))
        return _ok(await _serving(state.publication).cleanup(req))

    @router.post(Routes.RECLAIM)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_reclaim(request: Request) -> Any:
        req = parse_model(ReclaimRequest, await _json(request))
        reply = await _serving(state.reclaim).reclaim(req)
        # DRAINING is not an error: the reclaim goes on. 202 says "accepted, not finished".
        return JSONResponse(
            reply.model_dump(mode="json"), status_code=200 if reply.state == "UNLOADED" else 202
        )

    # Declared last: "/lora_versions/{lora_name}" must not shadow the POST routes above.
    @router.get(Routes.VERSION_STATUS)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_version_status(lora_name: str) -> Any:
        for version in state.status().versions:
            if version.lora_name == lora_name:
                return _ok(version)
        raise LoraVersionError(
            ErrorCode.UNKNOWN_VERSION, f"no managed version {lora_name!r}", lora_name=lora_name
        )

    return router.routes


def mount(app: Any, server_args: Any, tokenizer_manager: Any) -> None:
    if getattr(app.state, "lora_versions_mounted", False):
        return
    state = engine_state()
    state.attach(server_args, tokenizer_manager)
    app.add_exception_handler(LoraVersionError, _lora_version_error_handler)
    app.add_exception_handler(CleanupPending, _cleanup_pending_handler)
    for path, endpoint, methods in build_routes(state):
        app.add_api_route(path, endpoint, methods=methods)
    app.state.lora_versions_mounted = True
