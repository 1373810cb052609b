"""The trainer's end of one engine's collective group (rank 0 of 2; the engine's receiver is
rank 1). See :mod:`lora_contract.collective_group` for the group and the frames.

Used by :class:`~relax_glue.engine_client.EngineClient` when it is given one: ``begin`` then asks
the engine to post its receives (connecting the group first if this engine incarnation has none),
``receive_bucket`` broadcasts the bucket's tensor bytes while it asks the engine to acknowledge them
(:meth:`CollectiveSender.send_acknowledged`), and a bucket already broadcast in this attempt is
never broadcast again (a retried acknowledgement after a lost reply only asks). The publisher is
unchanged: it calls ``begin`` on every engine and starts the buckets only once all are PREPARED,
so a refusal never strands a broadcast.
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from lora_contract.collective_group import (
    FRAME_BYTES,
    PIECE_BYTES,
    SENDER_RANK,
    Frame,
    broadcast,
    broadcast_pieces,
    device_of,
    host_store,
    open_group,
    token_tag,
)
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.transport import HEADER_PREFIX_BYTES, header_length

T = TypeVar("T")


class CollectiveSender:
    """``host``: an address of this trainer the engine can reach (it joins the store there).
    ``timeout_s`` bounds the rendezvous and every broadcast on this side. ``piece_bytes``: the
    size of the broadcasts a bucket's bytes go in (0: one per bucket, and the engine hears of a
    bucket only once it is whole)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        timeout_s: float = 30.0,
        backend: str = "gloo",
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.backend = backend
        self.piece_bytes = piece_bytes
        self.group_id: str | None = None
        self.incarnation: str | None = None
        self._store: Any = None
        self._group: Any = None
        # (attempt token, bucket index) -> its broadcast on the current group, run in call order
        self._sends: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._last: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.connects = 0  # groups connected so far (one per engine incarnation used)

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
            self.connects += 1

    def forget(self) -> None:
        """The group is unusable (the engine restarted, or a broadcast failed)."""
        self.close()

    def close(self) -> None:
        self._group = None
        self._store = None
        self.group_id = None
        self.incarnation = None
        self._sends.clear()
        self._last = None

    def send_soon(self, attempt_token: str, index: int, payload: bytes) -> asyncio.Task[None]:
        """Bucket ``index``'s broadcast, started after every broadcast asked for before it (the
        receiver takes them in plan order). Asked again, the same broadcast: a bucket goes over
        the group once per attempt, whoever asks (the publisher's send-ahead, then the
        acknowledgement, or a retried acknowledgement after a lost reply)."""
        key = (attempt_token, index)
        task = self._sends.get(key)
        if task is None:
            for other in [k for k in self._sends if k[0] != attempt_token]:
                del self._sends[other]  # an earlier attempt's record is of no use any more
            job = self._send_after(self._last, self._group, attempt_token, index, payload)
            task = asyncio.ensure_future(job)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._sends[key] = task
            self._last = task
        return task

    async def send(self, attempt_token: str, index: int, payload: bytes) -> None:
        await asyncio.shield(self.send_soon(attempt_token, index, payload))

    async def send_acknowledged(
        self, attempt_token: str, index: int, payload: bytes, acknowledge: Callable[[], Awaitable[T]]
    ) -> T:
        """Bucket ``index``'s broadcast and the engine's acknowledgement of it, at the same time;
        the acknowledgement's reply once both ended well.

        Why not one after the other: gloo does not fail a send in flight when its peer dies
        (torch 2.14 gloo: the pair sees the close, the pending send still waits out the group's
        timeout), while the engine sees its receiver die at once (the child's exit) and refuses
        the acknowledgement. So the engine's refusal ends the wait: the broadcast is abandoned and
        the group forgotten (the next ``begin`` connects a new one). A reply that never came is
        no refusal: the broadcast is left to end on its own (it may well have landed), nothing
        is forgotten on a guess. A broadcast that fails on this side fails the call at once."""
        sending = self.send_soon(attempt_token, index, payload)
        asking = asyncio.ensure_future(acknowledge())
        try:
            await asyncio.wait([sending, asking], return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            asking.cancel()  # the broadcast goes on: it is shared with whoever asks it again
            raise
        if sending.done() and (sending.cancelled() or sending.exception() is not None):
            asking.cancel()
            await asyncio.wait([asking])
            await sending  # raises its failure
        refused_in_flight = not sending.done() and isinstance(asking.exception(), LoraVersionError)
        if refused_in_flight and self._sends.get((attempt_token, index)) is sending:
            # the engine's receiver is gone or out of step (and this is not a later group's send)
            self.forget()
        # both ended well, or the acknowledgement failed: its reply, or its failure (an unknown
        # outcome leaves the broadcast to end on its own)
        return asking.result()

    async def _send_after(
        self, previous: asyncio.Task[None] | None, group: Any, attempt_token: str, index: int, payload: bytes
    ) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
        if previous is not None and (previous.cancelled() or previous.exception() is not None):
            if self._group is group:
                # the receiver still waits for that bucket (a broadcast cancelled before it ran,
                # e.g. by the end of its event loop): this group is out of step for good
                self.forget()
            raise LoraVersionError(
                ErrorCode.TRANSFER_FAILED,
                f"bucket {index} not broadcast: an earlier broadcast on this group failed",
                index=index,
            )
        await self._broadcast(group, attempt_token, index, payload)

    async def _broadcast(self, group: Any, attempt_token: str, index: int, payload: bytes) -> None:
        """Bucket ``index``: its frame, then exactly its tensor bytes (the payload after its
        header, which the engine builds itself), in pieces of ``piece_bytes``: the engine hears
        of each piece as it lands, so a cleanup right after this send waits for the bytes
        instead of breaking the group (``CollectiveLink.settle``). TRANSFER_FAILED when the
        group fails; the group is then forgotten (the engine's end is gone or out of step)."""
        n = header_length(payload[:HEADER_PREFIX_BYTES])
        if n is None:
            raise ValueError("not a bucket payload")
        data = memoryview(payload)[HEADER_PREFIX_BYTES + n :]
        if group is None:
            raise LoraVersionError(ErrorCode.TRANSPORT_UNAVAILABLE, "no collective group to this engine")
        frame = Frame(
            index=index, nbytes=len(data), tag=token_tag(attempt_token), piece_bytes=self.piece_bytes
        )
        try:
            await asyncio.to_thread(_broadcast_bucket, group, frame, data, device_of(self.backend))
        except Exception as exc:
            if self._group is group:
                self.forget()
            raise LoraVersionError(
                ErrorCode.TRANSFER_FAILED, f"broadcast of bucket {index} failed: {exc}", index=index
            ) from None


def _broadcast_bucket(group: Any, frame: Frame, data: memoryview, device: str) -> None:
    import torch  # lazy heavy import: only a collective transfer needs it

    raw = frame.encode()
    assert len(raw) == FRAME_BYTES
    broadcast(group, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))
    if len(data):
        with warnings.catch_warnings():
            # the payload is read-only bytes; a broadcast from the root only reads it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(data, dtype=torch.uint8)
        # NCCL: a device copy (not run here: no GPU)
        broadcast_pieces(group, tensor.to(device), frame.piece_bytes)
