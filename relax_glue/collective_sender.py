"""The trainer's end of one engine's collective group (rank 0 of 2; the engine's receiver is
rank 1). See :mod:`sglang_ext.collective_group` for the group and the frames.

Used by :class:`~relax_glue.engine_client.EngineClient` when it is given one: ``begin`` then asks
the engine to post its receives (connecting the group first if this engine incarnation has none),
``receive_bucket`` broadcasts the bucket's tensor bytes and then sends the acknowledgement, and a
bucket already broadcast in this attempt is never broadcast again (a retried acknowledgement
after a lost reply only asks). The publisher is unchanged: it calls ``begin`` on every engine and
starts the buckets only once all are PREPARED, so a refusal never strands a broadcast.
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

from sglang_ext.collective_group import (
    FRAME_BYTES,
    SENDER_RANK,
    Frame,
    broadcast,
    host_store,
    open_group,
    token_tag,
)
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.transport import HEADER_PREFIX_BYTES, header_length


class CollectiveSender:
    """``host``: an address of this trainer the engine can reach (it joins the store there).
    ``timeout_s`` bounds the rendezvous and every broadcast on this side."""

    def __init__(self, host: str = "127.0.0.1", *, timeout_s: float = 30.0, backend: str = "gloo") -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.backend = backend
        self.group_id: str | None = None
        self.incarnation: str | None = None
        self._store: Any = None
        self._group: Any = None
        # (attempt token, bucket index) broadcast on the current group
        self._sent: set[tuple[str, int]] = set()
        self._lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._group is not None

    async def connect(self, ask_engine: Callable[[str, str, str], Awaitable[str]]) -> None:
        """A new group: host the rendezvous store, have the engine join it (``ask_engine(group_id,
        init_method, backend)`` returns the engine's incarnation), join it here meanwhile."""
        async with self._lock:
            self.close()
            store = await asyncio.to_thread(host_store, self.host, 0, self.timeout_s)
            group_id = uuid.uuid4().hex
            init_method = f"tcp://{self.host}:{store.port}"
            joined = asyncio.create_task(
                asyncio.to_thread(
                    open_group, init_method, SENDER_RANK, group_id, self.timeout_s, self.backend, store
                )
            )
            try:
                incarnation = await ask_engine(group_id, init_method, self.backend)
                group = await joined
            except BaseException:
                # our side's join ends by its own timeout; it is not waited for here
                joined.add_done_callback(lambda t: t.cancelled() or t.exception())
                raise
            self._store, self._group, self.group_id, self.incarnation = store, group, group_id, incarnation

    def forget(self) -> None:
        """The group is unusable (the engine restarted, or a broadcast failed)."""
        self.close()

    def close(self) -> None:
        self._group = None
        self._store = None
        self.group_id = None
        self.incarnation = None
        self._sent.clear()

    def was_sent(self, attempt_token: str, index: int) -> bool:
        return (attempt_token, index) in self._sent

    async def send(self, attempt_token: str, index: int, payload: bytes) -> None:
        """Broadcast bucket ``index``: its frame, then exactly its tensor bytes (the payload after
        its header, which the engine builds itself). TRANSFER_FAILED when the group fails; the
        group is then forgotten (the engine's end is gone or out of step)."""
        n = header_length(payload[:HEADER_PREFIX_BYTES])
        if n is None:
            raise ValueError("not a bucket payload")
        data = memoryview(payload)[HEADER_PREFIX_BYTES + n :]
        group = self._group
        if group is None:
            raise LoraVersionError(ErrorCode.TRANSPORT_UNAVAILABLE, "no collective group to this engine")
        frame = Frame(index=index, nbytes=len(data), tag=token_tag(attempt_token)).encode()
        try:
            await asyncio.to_thread(_broadcast_bucket, group, frame, data)
        except Exception as exc:
            if self._group is group:
                self.forget()
            raise LoraVersionError(
                ErrorCode.TRANSFER_FAILED, f"broadcast of bucket {index} failed: {exc}", index=index
            ) from None
        self._sent.add((attempt_token, index))


def _broadcast_bucket(group: Any, frame: bytes, data: memoryview) -> None:
    import torch

    assert len(frame) == FRAME_BYTES
    broadcast(group, torch.frombuffer(bytearray(frame), dtype=torch.uint8))
    if len(data):
        with warnings.catch_warnings():
            # the payload is read-only bytes; a broadcast from the root only reads it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(data, dtype=torch.uint8)
        broadcast(group, tensor)
