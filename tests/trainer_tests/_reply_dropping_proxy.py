"""A pass-through HTTP proxy in front of a REAL engine that loses the reply of marked turns.

Every request goes to the engine and is really served there. For a ``POST /generate`` whose rid
ends with :data:`DROP_REPLY`, the engine's reply is replaced by a 502 on its way back, as a
sidecar or load balancer that timed out would do: the turn was admitted and ran, and the caller
cannot know it. :attr:`ReplyDroppingProxy.served` counts, per rid, the replies the engine gave.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from types import TracebackType

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lora_versions_dev.launcher import free_port

DROP_REPLY = ":drop-reply"
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "content-encoding", "connection"}


class ReplyDroppingProxy:
    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.port = free_port()
        self.served: collections.Counter[str] = collections.Counter()
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="reply-dropping-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with httpx.AsyncClient(base_url=self.engine_url, timeout=120) as client:
            r = await client.request(
                request.method, request.url.path, content=body, params=request.query_params, headers=headers
            )
        if request.url.path == "/generate" and r.status_code == 200:
            rid = str(json.loads(body).get("rid", ""))
            self.served[rid] += 1
            if rid.endswith(DROP_REPLY):
                return Response(b'{"error": "upstream reply lost"}', 502, media_type="application/json")
        out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP_BY_HOP}
        return Response(r.content, r.status_code, headers=out)

    def __enter__(self) -> ReplyDroppingProxy:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


__all__ = ["DROP_REPLY", "ReplyDroppingProxy"]
