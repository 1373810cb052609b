"""How a bucket's bytes reach one engine: a strategy inside the engine client.

The protocol around a bucket is the same whatever carries it (begin names the transport, each
bucket is acknowledged by one HTTP call, in index order, verified by the engine exactly as a
body); only where the bytes travel differs. :class:`EngineClient
<relax_glue.engine_client.EngineClient>` holds one :class:`BucketTransport` and hands it the
two HTTP calls it may need; the publisher sees only :meth:`BucketTransport.send_ahead`. A new
transport is a new subclass here (and its receiving end in the plugin), not a branch in the
client or the publisher.

- :class:`BodyTransport`: the bytes are the acknowledging call's body (the default).
- :class:`LocalFileTransport`: for an engine on this host whose
  ``SGLANG_LORA_VERSIONS_LOCAL_SOURCE_DIR`` is the same directory: each bucket is written there
  as a file and named in the call instead of sent as its body; the engine copies (or takes over)
  and verifies it, and the file is removed once the call returned, whatever its outcome.
- :class:`CollectiveTransport`: the bytes go over the engine's collective group
  (:class:`~relax_glue.collective_sender.CollectiveSender`), broadcast ahead of their
  acknowledgements; begin joins the group first when this engine incarnation has none.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    BeginRequest,
    BucketAck,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
)
from relax_glue.collective_sender import CollectiveSender

BeginReply = PreparedReceipt | ReadyReceipt
PostBegin = Callable[[BeginRequest], Awaitable[BeginReply]]
PostBucket = Callable[[ReceiveBucketMeta, bytes], Awaitable[BucketAck]]
# (group_id, init_method, backend) -> the engine's incarnation, once it joined the group
Connect = Callable[[str, str, str], Awaitable[str]]


class BucketTransport:
    """A bucket transport: the body transport's behaviour, which each other one refines."""

    # the BeginRequest.transport value the engine is told
    begin_transport: ClassVar[str] = "http"
    # whether the publisher should hand every bucket over before the acknowledgements start
    sends_ahead: ClassVar[bool] = False

    async def begin(self, req: BeginRequest, post_begin: PostBegin, connect: Connect) -> BeginReply:
        return await post_begin(req)

    def send_ahead(self, attempt_token: str, index: int, payload: bytes) -> None:
        """Start moving a bucket before it is acknowledged (only where :attr:`sends_ahead`)."""

    async def send(self, meta: ReceiveBucketMeta, payload: bytes, post_bucket: PostBucket) -> BucketAck:
        return await post_bucket(meta, payload)


class BodyTransport(BucketTransport):
    """The bytes are the body of the call that acknowledges them."""


class LocalFileTransport(BucketTransport):
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    async def send(self, meta: ReceiveBucketMeta, payload: bytes, post_bucket: PostBucket) -> BucketAck:
        source = self.directory / f"{meta.attempt_token}-{meta.index}-{uuid.uuid4().hex[:12]}.safetensors"
        await asyncio.to_thread(_write_new_file, source, payload)
        try:
            return await post_bucket(meta.model_copy(update={"source": source.name}), b"")
        finally:
            source.unlink(missing_ok=True)


class CollectiveTransport(BucketTransport):
    begin_transport: ClassVar[str] = "collective"
    sends_ahead: ClassVar[bool] = True

    def __init__(self, sender: CollectiveSender | None = None) -> None:
        self.sender = sender or CollectiveSender()

    async def begin(self, req: BeginRequest, post_begin: PostBegin, connect: Connect) -> BeginReply:
        req = req.model_copy(update={"transport": self.begin_transport})
        if not self.sender.connected:
            await self.sender.connect(connect)
        try:
            return await post_begin(req)
        except LoraVersionError as err:
            if err.code is not ErrorCode.TRANSPORT_UNAVAILABLE:
                raise
        # The engine has no usable group (it restarted, or a transfer broke it): a new one, once.
        await self.sender.connect(connect)
        return await post_begin(req)

    def send_ahead(self, attempt_token: str, index: int, payload: bytes) -> None:
        self.sender.send_soon(attempt_token, index, payload)

    async def send(self, meta: ReceiveBucketMeta, payload: bytes, post_bucket: PostBucket) -> BucketAck:
        # The bytes go over the group (once per attempt and bucket: a retried acknowledgement
        # after a lost reply does not send them again) while this call asks for the
        # acknowledgement, answered once the engine verified them; the engine's refusal ends a
        # broadcast its receiver will never take (see CollectiveSender.send_acknowledged).
        ack_meta = meta.model_copy(update={"collective": True})
        return await self.sender.send_acknowledged(
            meta.attempt_token, meta.index, payload, lambda: post_bucket(ack_meta, b"")
        )


def _write_new_file(path: Path, payload: bytes) -> None:
    """Write ``payload`` as a new file (never over an existing one), readable by the engine."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
