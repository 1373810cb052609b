"""Sessions through the real SGLang gateway (``smg``, the Rust successor of ``sglang-router``).

Production traffic reaches SGLang engines through a gateway, so the session layer can send every
generation to one gateway URL instead of picking an engine itself. What this module guarantees
on that path, and why:

* **Stickiness by routing key.** Every request of a session carries ``X-SMG-Routing-Key`` = the
  session key; the gateway, launched with ``--policy consistent_hashing``, sends every request
  with one key to one engine, where the session's prefix already sits in the KV cache.
* **Pass-through.** The body (``lora_path`` and ``rid`` included) and the engine's reply (typed
  errors with their status and body) cross the gateway unchanged; the reply is classified by
  the same code as a direct engine reply (:func:`relax_glue.engine_client.classify_outcome`).
* **No hidden resend (RFC 4.2).** The gateway resends on 408/429/5xx by default, which would run
  an admitted turn twice. :func:`gateway_command` always passes ``--disable-retries``; every
  resend stays a visible decision of the session layer.
* **Aborts by rid reach the engine itself.** The gateway has no ``/abort_request`` route. It
  names the engine that served each request (``x-smg-routed-worker-id``, its URL); an abort goes
  there, and when that engine is not known (the reply never came back), to every engine of the
  cohort: a rid is unique, so an abort on an engine that never saw it is a no-op.

Control calls (publication, reclaim, status) never cross the gateway: the publisher and the
reclaimer talk to each engine directly, since they must address every engine, not one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from typing import Any

import httpx

from lora_contract.errors import LoraVersionError
from relax_glue.engine_client import (
    AuditLog,
    ClientTimeouts,
    EngineAPI,
    EngineClient,
    GenerationReply,
    OutcomeUnknown,
)

__all__ = [
    "GATEWAY_ID",
    "ROUTED_WORKER_HEADER",
    "ROUTING_KEY_HEADER",
    "GatewayClient",
    "GatewayRoute",
    "gateway_command",
]

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# smg 1.13.0 answers every proxied request with the URL of the worker that served it.
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
GATEWAY_ID = "gateway"  # the id a request carries until the gateway says which engine served it
SMG_VERSION = "1.13.0"


def gateway_command(
    worker_urls: Sequence[str],
    *,
    port: int,
    host: str = "127.0.0.1",
    executable: str = "smg",
    retries: bool = False,
    metrics_port: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The one place that knows how the gateway is launched in front of a cohort.

    ``retries=True`` exists only for the test that shows what the gateway's default does to a
    turn that fails after admission (it is sent twice); never use it for sessions.
    """
    if not worker_urls:
        raise ValueError("the gateway needs at least one worker URL")
    cmd = [
        executable,
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        # One engine per routing key: a session's turns meet its prefix in that engine's KV cache.
        "--policy",
        "consistent_hashing",  # hashes X-SMG-Routing-Key
        "--log-level",
        "warn",
    ]
    if metrics_port is not None:
        # smg serves its own Prometheus metrics on 0.0.0.0:29000 unless told otherwise, so a
        # second gateway on one host fails to start; give each its port, on the same host.
        cmd += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    if not retries:
        cmd.append("--disable-retries")  # RFC 4.2: the gateway never resends a turn on its own
    return [*cmd, *extra_args]


def _url_key(url: str) -> str:
    return url.rstrip("/").lower()


class GatewayClient:
    """Generation through a gateway for the sessions of one cohort.

    ``engines``: the cohort's engine clients by id (their ``base_url`` is how the gateway names
    them); aborts go to them directly. Generation shares one pool to the gateway and one audit
    log (each entry's ``engine_id`` is ``"gateway"``; :meth:`served_by` names the engine).
    """

    def __init__(
        self,
        url: str,
        engines: Mapping[str, EngineAPI],
        *,
        api_key: str | None = None,
        timeouts: ClientTimeouts | None = None,
        audit: AuditLog | None = None,
        remember: int = 100_000,
    ) -> None:
        self.url = url.rstrip("/")
        self.engines: dict[str, EngineAPI] = dict(engines)
        self.client = EngineClient(GATEWAY_ID, self.url, api_key=api_key, timeouts=timeouts, audit=audit)
        self._engine_of_url = {
            _url_key(str(getattr(e, "base_url", ""))): eid for eid, e in self.engines.items()
        }
        # rid -> engine id, as the gateway reported it; bounded, oldest forgotten first.
        self._served: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._remember = remember
        # session key -> the engine its latest request went to (what pick() answers).
        self._engine_of_key: dict[Hashable, str] = {}

    def __repr__(self) -> str:
        return f"GatewayClient({self.url!r}, engines={sorted(self.engines)})"

    async def aclose(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------------- the Router protocol

    def pick(self, session_key: Hashable) -> str:
        """The engine this session's requests went to, once the gateway said so; before that,
        ``"gateway"`` (the gateway decides at the first request)."""
        return self._engine_of_key.get(session_key, GATEWAY_ID)

    def forget(self, session_key: Hashable) -> None:
        self._engine_of_key.pop(session_key, None)

    # -------------------------------------------------------------------------- requests

    def route(self, session_key: Hashable) -> GatewayRoute:
        return GatewayRoute(self, session_key)

    def served_by(self, rid: str) -> str | None:
        """The engine that served ``rid``, as the gateway reported it (None: not known)."""
        return self._served.get(rid)

    def _note_reply(self, session_key: Hashable, rid: str, response: httpx.Response) -> None:
        worker = response.headers.get(ROUTED_WORKER_HEADER)
        engine_id = self._engine_of_url.get(_url_key(worker)) if worker else None
        if engine_id is None:
            return
        self._served[rid] = engine_id
        self._served.move_to_end(rid)
        while len(self._served) > self._remember:
            self._served.popitem(last=False)
        self._engine_of_key[session_key] = engine_id

    async def abort_request(self, rid: str) -> None:
        """Abort ``rid`` on the engine that served it, or on every engine when that is unknown.

        Raises the first OutcomeUnknown that may have reached an engine (the abort may not have
        landed: the caller asks again); a refused connection means no engine listens there.
        """
        engine_id = self.served_by(rid)
        targets = [engine_id] if engine_id is not None else sorted(self.engines)
        results = await asyncio.gather(
            *(self.engines[t].abort_request(rid) for t in targets), return_exceptions=True
        )
        for r in results:
            if isinstance(r, OutcomeUnknown) and not r.maybe_sent:
                continue
            if isinstance(r, BaseException):
                raise r


class GatewayRoute:
    """One session's way through the gateway: the generation half of
    :class:`~relax_glue.engine_client.EngineAPI`, with the session key as the routing key."""

    engine_id = GATEWAY_ID

    def __init__(self, gateway: GatewayClient, session_key: Hashable) -> None:
        self.gateway = gateway
        self.session_key = session_key
        self._headers = {ROUTING_KEY_HEADER: str(session_key)}

    def _on_reply(self, rid: str) -> Any:
        return lambda response: self.gateway._note_reply(self.session_key, rid, response)

    def _named(self, err: LoraVersionError, rid: str) -> LoraVersionError:
        """A refusal names the engine that refused, not the gateway it came through."""
        engine_id = self.gateway.served_by(rid)
        if engine_id is not None:
            err.details["engine_id"] = engine_id
        return err

    async def generate(self, body: Mapping[str, Any]) -> GenerationReply:
        rid = str(body.get("rid", ""))
        try:
            return await self.gateway.client.generate(
                body, headers=self._headers, on_reply=self._on_reply(rid)
            )
        except LoraVersionError as err:
            raise self._named(err, rid) from None

    async def generate_stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        rid = str(body.get("rid", ""))
        try:
            async for chunk in self.gateway.client.generate_stream(
                body, headers=self._headers, on_reply=self._on_reply(rid)
            ):
                yield chunk
        except LoraVersionError as err:
            raise self._named(err, rid) from None

    async def abort_request(self, rid: str) -> None:
        await self.gateway.abort_request(rid)
