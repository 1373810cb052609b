"""HTTP routes of the plugin, mounted on SGLang's FastAPI app in the engine's main process."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

# Upstream symbol: sglang.srt.utils.auth.auth_level / AuthLevel. ADMIN_OPTIONAL is what SGLang's
# own LoRA control endpoints use: the admin key (or the API key) is required when one is set.
from sglang.srt.utils.auth import AuthLevel, auth_level

from sglang_ext.engine_state import engine_state
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.protocol import Routes


def error_response(err: LoraVersionError) -> JSONResponse:
    return JSONResponse(err.to_body(), status_code=err.http_status)


def build_router() -> APIRouter:
    router = APIRouter()

    @router.get(Routes.STATUS)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_versions_status() -> Any:
        return JSONResponse(engine_state().status().model_dump(mode="json"))

    @router.get(Routes.VERSION_STATUS)
    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def lora_version_status(lora_name: str) -> Any:
        version = engine_state().versions.get(lora_name)
        if version is None:
            return error_response(
                LoraVersionError(
                    ErrorCode.UNKNOWN_VERSION, f"no managed version {lora_name!r}", lora_name=lora_name
                )
            )
        return JSONResponse(version.model_dump(mode="json"))

    return router


def mount(app: Any) -> None:
    if getattr(app.state, "lora_versions_mounted", False):
        return
    app.include_router(build_router())
    app.state.lora_versions_mounted = True
