"""Staged publication on one engine: begin -> ordered buckets -> end, and cleanup.

The imperative shell around :class:`~sglang_ext.version_table.VersionTable`: it holds the
per-attempt stashes, reads bucket bodies under a byte cap, drives SGLang's native load and the
exact-version probe, and serialises the operations of one name with a per-name lock. Decisions
and state live in the table; this module never decides what is allowed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.native_lora import NativeLora
from sglang_ext.protocol import (
    BeginRequest,
    BucketAck,
    CleanupReceipt,
    CleanupRequest,
    EndRequest,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    check_bucket_tensors,
    check_tensor_set,
    decode_bucket,
    max_payload_bytes,
)
from sglang_ext.version_table import (
    BucketDecision,
    CleanupDecision,
    EndDecision,
    VersionTable,
    may_unload_now,
)


class NameLocks:
    """One asyncio lock per managed name: operations on one name are serialised, others run on."""

    def __init__(self) -> None:
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def __getitem__(self, lora_name: str) -> asyncio.Lock:
        return self._locks[lora_name]


async def remove_version(
    table: VersionTable, native: NativeLora, lora_name: str, lora_id: str | None, timeout_s: float
) -> int | None:
    """Unregister -> drain (bounded, without any SGLang lock) -> physical unload, the last step
    only when :func:`may_unload_now` says so. Shared by reclaim, cleanup and a failed probe.

    Returns None once unloaded, else the in-flight count still draining (call again later)."""
    if lora_id is None:
        return None  # nothing was ever loaded under that name
    await native.unregister(lora_name, lora_id)
    left = await native.drain(lora_id, timeout_s)
    if left is not None and not may_unload_now(table.get(lora_name), left):
        return left
    await native.physical_unload(lora_name, lora_id)
    return None


class CleanupPending(Exception):
    """The candidate is unregistered but requests still run on it; call cleanup again."""

    def __init__(self, lora_name: str, in_flight: int | None) -> None:
        super().__init__(f"cleanup of {lora_name!r} is still draining {in_flight} in-flight requests")
        self.lora_name = lora_name
        self.in_flight = in_flight


# safetensors header slack on top of the tensor bytes a bucket may carry
_HEADER_SLACK = 64 * 1024


class PublicationService:
    def __init__(self, table: VersionTable, native: NativeLora, locks: NameLocks | None = None) -> None:
        self.table = table
        self.native = native
        self._locks = locks if locks is not None else NameLocks()
        # attempt token -> tensors received so far (one bucket decoded at a time on top of it)
        self._stash: dict[str, dict[str, Any]] = {}
        # attempt token -> the running load+probe, shared by a racing end and by cleanup
        self._loads: dict[str, asyncio.Task[ReadyReceipt]] = {}

    # ----------------------------------------------------------------------------- begin

    async def begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt:
        async with self._locks[req.lora_name]:
            receipt = self.table.begin(req)
            if isinstance(receipt, PreparedReceipt):
                self._stash.setdefault(req.attempt_token, {})
            return receipt

    # ----------------------------------------------------------------------------- buckets

    async def receive_bucket(
        self, meta: ReceiveBucketMeta, content_length: int | None, body: AsyncIterator[bytes]
    ) -> BucketAck:
        async with self._locks[meta.lora_name]:
            decision = self.table.check_bucket(meta)
            if decision is BucketDecision.DUPLICATE:
                return BucketAck(index=meta.index, accepted=True, duplicate=True)
            v = self.table.get(meta.lora_name)
            assert v is not None
            spec = self.table.bucket_spec(meta)
            cap = min(max_payload_bytes(v.manifest, spec), self.table.limits.max_bucket_bytes) + _HEADER_SLACK
            if content_length is not None and content_length > cap:
                raise LoraVersionError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"bucket body of {content_length} bytes exceeds {cap}",
                    limit=cap,
                )
            payload = await _read_capped(body, cap)
            tensors = decode_bucket(payload, expected_sha256=meta.sha256)
            del payload
            check_bucket_tensors(v.manifest, spec, tensors)
            # every check passed: only now does the attempt's state change
            self._stash.setdefault(meta.attempt_token, {}).update(tensors)
            self.table.accept_bucket(meta)
            return BucketAck(index=meta.index, accepted=True)

    # ----------------------------------------------------------------------------- end

    async def end(self, req: EndRequest) -> ReadyReceipt:
        async with self._locks[req.lora_name]:
            decision = self.table.start_end(req.lora_name, req.attempt_token)
            if decision is EndDecision.READY:
                v = self.table.get(req.lora_name)
                assert v is not None
                return self.table.ready_receipt(v)
            if decision is EndDecision.LOAD:
                stash = self._stash.get(req.attempt_token, {})
                try:
                    v = self.table.get(req.lora_name)
                    assert v is not None
                    check_tensor_set(v.manifest, stash.keys())
                except BaseException:
                    self.table.fail_load(req.lora_name, req.attempt_token)
                    raise
                self._loads[req.attempt_token] = asyncio.create_task(
                    self._load_and_probe(req.lora_name, req.attempt_token)
                )
            task = self._loads[req.attempt_token]
        # Shielded: a client that disconnects mid-end must not cancel a native load half way.
        return await asyncio.shield(task)

    async def _load_and_probe(self, lora_name: str, attempt_token: str) -> ReadyReceipt:
        v = self.table.get(lora_name)
        assert v is not None
        lora_id: str | None = None
        try:
            lora_id = await self.native.load_pinned(lora_name, v.manifest.config, self._stash[attempt_token])
            await self.native.probe(lora_name, lora_id)
        except BaseException:
            if lora_id is not None:
                # Loaded but the probe failed: take it out again, never leave it half-published.
                v.cleaning = True
                with contextlib.suppress(Exception):
                    await remove_version(self.table, self.native, lora_name, lora_id, timeout_s=30.0)
                v.cleaning = False
            self.table.fail_load(lora_name, attempt_token)
            raise
        receipt = self.table.finish_load(lora_name, attempt_token, lora_id)
        self._stash.pop(attempt_token, None)  # the engine holds the weights now
        return receipt

    # ----------------------------------------------------------------------------- cleanup

    async def cleanup(self, req: CleanupRequest, drain_timeout_s: float = 30.0) -> CleanupReceipt:
        while True:
            async with self._locks[req.lora_name]:
                decision = self.table.plan_cleanup(req.lora_name, req.attempt_token)
                if decision is CleanupDecision.WAIT_FOR_LOAD:
                    load = self._loads.get(req.attempt_token)
                else:
                    if decision is CleanupDecision.UNLOAD:
                        self.table.mark_cleaning(req.lora_name, req.attempt_token)
                        v = self.table.get(req.lora_name)
                        assert v is not None
                        left = await remove_version(
                            self.table, self.native, req.lora_name, v.lora_id, drain_timeout_s
                        )
                        if left is not None:
                            # Unknown to the caller whether it will finish: a 5xx, never "clean".
                            raise CleanupPending(req.lora_name, left)
                    self._stash.pop(req.attempt_token, None)
                    self._loads.pop(req.attempt_token, None)
                    return self.table.finish_cleanup(req.lora_name, req.attempt_token)
            if load is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(load)
            else:
                await asyncio.sleep(0.01)

    # ----------------------------------------------------------------------------- status


async def _read_capped(body: AsyncIterator[bytes], cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in body:
        size += len(chunk)
        if size > cap:
            raise LoraVersionError(ErrorCode.PAYLOAD_TOO_LARGE, f"bucket body exceeds {cap} bytes", limit=cap)
        chunks.append(chunk)
    return b"".join(chunks)
