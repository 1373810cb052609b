"""How a bucket's bytes reach one engine: a strategy inside the engine client.

The protocol around a bucket is the same whatever carries it (begin names the transport, each
bucket is acknowledged by one HTTP call, in index order, verified by the engine exactly as a
body); only where the bytes travel differs. :class:`EngineClient
<relax_glue.engine_client.EngineClient>` holds one :class:`BucketTransport` and hands it the
engine's raw calls (:class:`EngineCalls`); the publisher sees only
:meth:`BucketTransport.send_ahead`. Each transport is registered here (:func:`register_sender`)
under the name the contract knows (:func:`lora_contract.transport.register_transport`), its
engine end under the same name (:func:`sglang_ext.bucket_sources.register_receive`); whatever it
must set up first (the collective's group) is its own :meth:`~BucketTransport.begin`. A new
transport is a registration, not a branch in the client or the publisher.

- :class:`BodyTransport` (``"http"``): the bytes are the acknowledging call's body (the default).
- :class:`LocalFileTransport` (``"http"`` too, naming a file): for an engine on this host whose
  ``SGLANG_LORA_VERSIONS_LOCAL_SOURCE_DIR`` is the same directory: each bucket is written there
  as a file and named in the call instead of sent as its body; the engine copies (or takes over)
  and verifies it, and the file is removed once the call returned, whatever its outcome.
- :class:`CollectiveTransport` (``"collective"``): the bytes go over the engine's collective group
  (:class:`~relax_glue.collective_sender.CollectiveSender`), broadcast ahead of their
  acknowledgements; begin joins the group first when this engine incarnation has none.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic import BaseModel

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    COLLECTIVE_TRANSPORT,
    HTTP_TRANSPORT,
    BeginRequest,
    BucketAck,
    CollectiveConnectReply,
    CollectiveConnectRequest,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    Routes,
    registered_transports,
)
from relax_glue.collective_sender import CollectiveSender

BeginReply = PreparedReceipt | ReadyReceipt
R = TypeVar("R", bound=BaseModel)


class EngineCalls(Protocol):
    """One engine's raw HTTP calls, as a transport makes them (the engine client's own: each is
    audited and classified like any control call, and none goes through a transport again)."""

    async def post_begin(self, req: BeginRequest) -> BeginReply: ...

    async def post_bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> BucketAck: ...

    async def post_setup(
        self, op: str, route: str, req: BaseModel, reply: type[R], same: tuple[str, ...], read_timeout: float
    ) -> R:
        """A transport's own JSON setup call (``route``, mounted by its engine end); the reply
        must name what the request named (``same`` fields)."""
        ...


class BucketTransport:
    """A bucket transport: the body transport's behaviour, which each other one refines."""

    # the registered transport the engine is told (BeginRequest.transport)
    begin_transport: ClassVar[str] = HTTP_TRANSPORT
    # whether the publisher should hand every bucket over before the acknowledgements start
    sends_ahead: ClassVar[bool] = False

    async def begin(self, req: BeginRequest, engine: EngineCalls) -> BeginReply:
        """Begin on the engine, after whatever this transport sets up first."""
        return await engine.post_begin(req.model_copy(update={"transport": self.begin_transport}))

    def send_ahead(self, attempt_token: str, index: int, payload: bytes) -> None:
        """Start moving a bucket before it is acknowledged (only where :attr:`sends_ahead`)."""

    async def send(self, meta: ReceiveBucketMeta, payload: bytes, engine: EngineCalls) -> BucketAck:
        return await engine.post_bucket(meta, payload)


class BodyTransport(BucketTransport):
    """The bytes are the body of the call that acknowledges them."""


class LocalFileTransport(BucketTransport):
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    async def send(self, meta: ReceiveBucketMeta, payload: bytes, engine: EngineCalls) -> BucketAck:
        source = self.directory / f"{meta.attempt_token}-{meta.index}-{uuid.uuid4().hex[:12]}.safetensors"
        await asyncio.to_thread(_write_new_file, source, payload)
        try:
            return await engine.post_bucket(meta.model_copy(update={"source": source.name}), b"")
        finally:
            source.unlink(missing_ok=True)


class CollectiveTransport(BucketTransport):
    begin_transport: ClassVar[str] = COLLECTIVE_TRANSPORT
    sends_ahead: ClassVar[bool] = True

    def __init__(self, sender: CollectiveSender | None = None) -> None:
        self.sender = sender or CollectiveSender()

    async def begin(self, req: BeginRequest, engine: EngineCalls) -> BeginReply:
        """The begin names this sender's group (``BeginRequest.channel``): an engine that
        receives over another one refuses it before anything changes, and so does one with no
        usable group (it restarted, a transfer broke it, another sender replaced it); then a new
        group is connected, once, before any byte moves."""
        if not self.sender.connected:
            await self.sender.connect(self._ask_engine(engine))
        try:
            return await engine.post_begin(self._over_group(req))
        except LoraVersionError as err:
            if err.code is not ErrorCode.TRANSPORT_UNAVAILABLE:
                raise
        await self.sender.connect(self._ask_engine(engine))
        return await engine.post_begin(self._over_group(req))

    def _over_group(self, req: BeginRequest) -> BeginRequest:
        return req.model_copy(update={"transport": self.begin_transport, "channel": self.sender.group_id})

    def _ask_engine(self, engine: EngineCalls) -> Callable[[str, str, str], Any]:
        async def connect(group_id: str, init_method: str, backend: str) -> str:
            """Have the engine join the group ``group_id``; its incarnation."""
            req = CollectiveConnectRequest(group_id=group_id, init_method=init_method, backend=backend)
            reply = await engine.post_setup(
                "collective_connect",
                Routes.COLLECTIVE_CONNECT,
                req,
                CollectiveConnectReply,
                ("group_id",),
                # the engine starts its receiver and waits for the rendezvous, both bounded there
                self.sender.timeout_s + 90.0,
            )
            return reply.incarnation

        return connect

    def send_ahead(self, attempt_token: str, index: int, payload: bytes) -> None:
        self.sender.send_soon(attempt_token, index, payload)

    async def send(self, meta: ReceiveBucketMeta, payload: bytes, engine: EngineCalls) -> BucketAck:
        # The bytes go over the group (once per attempt and bucket: a retried acknowledgement
        # after a lost reply does not send them again) while this call asks for the
        # acknowledgement, answered once the engine verified them; the engine's refusal ends a
        # broadcast its receiver will never take (see CollectiveSender.send_acknowledged).
        ack_meta = meta.model_copy(update={"transport": self.begin_transport})
        return await self.sender.send_acknowledged(
            meta.attempt_token, meta.index, payload, lambda: engine.post_bucket(ack_meta, b"")
        )


# --------------------------------------------------------------------------------- registry

# transport name -> how this trainer builds its sending end (options: the transport's own)
SenderFactory = Callable[..., BucketTransport]
_SENDERS: dict[str, SenderFactory] = {}


def register_sender(transport: str, factory: SenderFactory) -> None:
    """Have :func:`bucket_transport` build ``transport``'s sending end with ``factory``. The
    contract must know the name first (a message could not carry it otherwise)."""
    if transport not in registered_transports():
        raise ValueError(f"{transport!r} is not a transport registered at the contract")
    _SENDERS[transport] = factory


def bucket_transport(name: str, **options: Any) -> BucketTransport:
    """The sending end of the transport registered as ``name``, built with ``options``. A name the
    contract does not know is INVALID_REQUEST; one it knows but this trainer cannot send over is
    TRANSPORT_UNAVAILABLE. Nothing is built or changed either way."""
    if name not in registered_transports():
        known = sorted(registered_transports())
        raise LoraVersionError(
            ErrorCode.INVALID_REQUEST, f"unknown transport {name[:50]!r}", registered=known
        )
    factory = _SENDERS.get(name)
    if factory is None:
        raise LoraVersionError(
            ErrorCode.TRANSPORT_UNAVAILABLE, f"this trainer has no sender for the {name} transport"
        )
    return factory(**options)


register_sender(HTTP_TRANSPORT, BodyTransport)
register_sender(COLLECTIVE_TRANSPORT, CollectiveTransport)


def _write_new_file(path: Path, payload: bytes) -> None:
    """Write ``payload`` as a new file (never over an existing one), readable by the engine."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
