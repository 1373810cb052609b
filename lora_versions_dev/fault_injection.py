"""Fault injection that wraps the REAL engine client (for tests and benches, never for serving;
the vLLM seed's lesson: fail only the Nth call of one operation and pass every other call
through untouched). Besides failing a call, a hook can run right before the Nth call goes out
(e.g. SIGKILL the engine process), so the call meets the real consequence of the fault."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Any

from lora_contract.errors import LoraVersionError
from lora_contract.protocol import (
    BeginRequest,
    BucketAck,
    CleanupReceipt,
    CleanupRequest,
    DrainingReply,
    EndRequest,
    EngineStatus,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    ReclaimRequest,
    UnloadedReceipt,
    VersionStatus,
)
from relax_glue.engine_client import EngineAPI, GenerationReply, OutcomeUnknown, outcome_label


class FaultKind(StrEnum):
    DROP_REPLY = "DROP_REPLY"  # the request is sent and processed; its reply is discarded
    FAIL_BEFORE_SEND = "FAIL_BEFORE_SEND"  # the request never leaves: the engine sees nothing
    HOOK_BEFORE_SEND = "HOOK_BEFORE_SEND"  # a hook runs (e.g. kills the engine), then the call goes out
    # receive_bucket only: the payload goes out with its last byte flipped (its checksum header
    # unchanged), so the engine must refuse it (CHECKSUM_MISMATCH): a clean partial failure.
    CORRUPT_PAYLOAD = "CORRUPT_PAYLOAD"
    # The request is sent and processed; the caller gets an earlier reply instead (a stale
    # read: e.g. a status taken before another actor changed the engine).
    STALE_REPLY = "STALE_REPLY"


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    engine_id: str
    op: str
    nth: int
    kind: FaultKind
    real_outcome: str  # what the engine really answered ("ok", "refused:<CODE>", "unknown", "-")


_WRAPPED_OPS = (
    "begin",
    "receive_bucket",
    "end",
    "cleanup",
    "reclaim",
    "status",
    "version_status",
    "generate",
    "abort_request",
)


class FaultInjectingClient:
    """Wrapper around a REAL :class:`EngineClient` (or any :class:`EngineAPI`).

    Fails exactly the configured (op, Nth call) pairs and passes every other call through
    untouched, so everything the test observes besides the injected fault is the real
    component's behaviour. Call counts are per op, starting at 1, over the wrapper's life.
    """

    def __init__(self, inner: EngineAPI) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id
        self._faults: dict[tuple[str, int], FaultKind] = {}
        self._hooks: dict[tuple[str, int], Callable[[], Awaitable[Any]]] = {}
        self._stale: dict[tuple[str, int], Any] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.injected: list[InjectedFault] = []

    def __getattr__(self, name: str) -> Any:
        # audit, aclose, generate_stream, timeouts, ... come from the real client.
        return getattr(self.inner, name)

    def drop_reply(self, op: str, nth: int = 1) -> FaultInjectingClient:
        return self._add(op, nth, FaultKind.DROP_REPLY)

    def fail_before_send(self, op: str, nth: int = 1) -> FaultInjectingClient:
        return self._add(op, nth, FaultKind.FAIL_BEFORE_SEND)

    def before_send(self, op: str, nth: int, hook: Callable[[], Awaitable[Any]]) -> FaultInjectingClient:
        """Run ``hook()`` right before the Nth call of ``op`` is passed through (its real outcome,
        whatever the hook caused, reaches the caller)."""
        self._hooks[(op, nth)] = hook
        return self._add(op, nth, FaultKind.HOOK_BEFORE_SEND)

    def corrupt_bucket(self, nth: int = 1) -> FaultInjectingClient:
        return self._add("receive_bucket", nth, FaultKind.CORRUPT_PAYLOAD)

    def stale_reply(self, op: str, nth: int, reply: Any) -> FaultInjectingClient:
        """The Nth call of ``op`` reaches the engine as usual, but its caller gets ``reply`` (an
        answer recorded earlier) instead of the real one."""
        self._stale[(op, nth)] = reply
        return self._add(op, nth, FaultKind.STALE_REPLY)

    def disarm(self) -> list[tuple[str, int, FaultKind]]:
        """Drop every fault not injected yet (returned); later calls all pass through."""
        left = self.pending()
        self._faults.clear()
        self._hooks.clear()
        self._stale.clear()
        return left

    def pending(self) -> list[tuple[str, int, FaultKind]]:
        return [(op, n, kind) for (op, n), kind in sorted(self._faults.items())]

    def _add(self, op: str, nth: int, kind: FaultKind) -> FaultInjectingClient:
        if op not in _WRAPPED_OPS:
            raise ValueError(f"unknown op {op!r}; one of {_WRAPPED_OPS}")
        if nth < 1:
            raise ValueError("nth counts from 1")
        self._faults[(op, nth)] = kind
        return self

    async def _run(self, op: str, *args: Any) -> Any:
        self.calls[op] += 1
        nth = self.calls[op]
        kind = self._faults.pop((op, nth), None)
        if kind is FaultKind.FAIL_BEFORE_SEND:
            self.injected.append(InjectedFault(self.engine_id, op, nth, kind, "-"))
            raise OutcomeUnknown(
                self.engine_id, op, f"injected: call {nth} failed before send", maybe_sent=False
            )
        if kind is FaultKind.HOOK_BEFORE_SEND:
            await self._hooks.pop((op, nth))()
            self.injected.append(InjectedFault(self.engine_id, op, nth, kind, "-"))
        if kind is FaultKind.CORRUPT_PAYLOAD:
            meta, payload = args
            self.injected.append(InjectedFault(self.engine_id, op, nth, kind, "-"))
            return await self.inner.receive_bucket(meta, payload[:-1] + bytes([payload[-1] ^ 0xFF]))
        if kind in (None, FaultKind.HOOK_BEFORE_SEND):
            return await getattr(self.inner, op)(*args)
        try:
            await getattr(self.inner, op)(*args)
            real = "ok"
        except (LoraVersionError, OutcomeUnknown) as exc:
            real = outcome_label(exc)
        self.injected.append(InjectedFault(self.engine_id, op, nth, kind, real))
        if kind is FaultKind.STALE_REPLY:
            return self._stale.pop((op, nth))  # the engine's real answer is never heard
        # Whatever the engine answered, the caller never hears it.
        raise OutcomeUnknown(self.engine_id, op, f"injected: reply {nth} dropped")

    async def begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt:
        return await self._run("begin", req)

    async def receive_bucket(self, meta: ReceiveBucketMeta, payload: bytes) -> BucketAck:
        return await self._run("receive_bucket", meta, payload)

    async def end(self, req: EndRequest) -> ReadyReceipt:
        return await self._run("end", req)

    async def cleanup(self, req: CleanupRequest) -> CleanupReceipt | DrainingReply:
        return await self._run("cleanup", req)

    async def reclaim(self, req: ReclaimRequest) -> UnloadedReceipt | DrainingReply:
        return await self._run("reclaim", req)

    async def status(self) -> EngineStatus:
        return await self._run("status")

    async def version_status(self, lora_name: str) -> VersionStatus:
        return await self._run("version_status", lora_name)

    async def generate(self, body: Mapping[str, Any]) -> GenerationReply:
        return await self._run("generate", body)

    def generate_stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.inner.generate_stream(body)

    async def abort_request(self, rid: str) -> None:
        return await self._run("abort_request", rid)
