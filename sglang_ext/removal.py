"""The one removal of a managed version, and the per-name locks its callers serialise on.

Shared by :mod:`sglang_ext.publication` (cleanup, a failed probe, a partial load taken back) and
:mod:`sglang_ext.reclaim` (reclaim of a committed version): both import it from here, neither
from the other. Unregister -> drain -> physical unload, the last step only when
:func:`~sglang_ext.version_table.may_unload_now` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext.native_lora import NativeEdge
from sglang_ext.version_table import VersionTable, in_flight_anomaly, may_unload_now


@dataclass
class _NameLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters


class NameLocks:
    """One asyncio lock per managed name: operations on one name are serialised, others run on.
    ``async with locks[name]:``. A name's lock exists only while someone holds or waits for it:
    a long RL run publishes a version per step, and a lock per name ever seen would grow with
    history (publication and reclaim share one instance: the engine wires it once)."""

    def __init__(self) -> None:
        self._locks: dict[str, _NameLock] = {}

    @contextlib.asynccontextmanager
    async def _held(self, lora_name: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(lora_name, _NameLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[lora_name]

    def __getitem__(self, lora_name: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._held(lora_name)


@dataclass(frozen=True)
class RemovalPending:
    """A removal that started (the name is unregistered) and has not unloaded yet: requests
    still in flight, or SGLang refused the physical unload itself. Either way the next call with
    the same reclaim id / attempt token goes on; it is never a refusal that changed nothing."""

    in_flight: int
    unload_error: str | None = None


async def remove_version(
    table: VersionTable, native: NativeEdge, lora_name: str, lora_id: str | None, timeout_s: float
) -> RemovalPending | None:
    """Unregister -> drain (bounded, without any SGLang lock) -> physical unload, the last step
    only when :func:`may_unload_now` says so, asked with SGLang's reading of the id right before
    it. The one removal of a managed version: reclaim, cleanup, a failed probe and a partial load
    taken back all come here, and nothing else unloads one.

    Returns None once unloaded, else what is still pending (call again later)."""
    if lora_id is None:
        return None  # nothing was ever loaded under that name
    v = table.get(lora_name)
    if v is not None and v.unloaded and v.lora_id == lora_id:
        return None  # an earlier call unloaded it and was cut off before the state said so
    await native.unregister(lora_name, lora_id)
    left = await native.drain(lora_id, timeout_s)
    anomaly = in_flight_anomaly(lora_name, left)
    if anomaly is not None:
        raise anomaly  # the drain can never end: refuse, keep everything as it is
    resolvable = native.lora_id_of(lora_name) == lora_id
    if not may_unload_now(table.get(lora_name), left, resolvable=resolvable):
        if left is None:
            # A registered id whose counter is gone: whether a request still holds it is unknown.
            return RemovalPending(0, f"SGLang has no in-flight count for {lora_id}: not unloaded on a guess")
        return RemovalPending(left)
    try:
        await native.physical_unload(lora_name, lora_id)
    except LoraVersionError as err:
        if err.code is not ErrorCode.LOAD_FAILED:
            raise
        # SGLang answered "not unloaded" after the name was unregistered: a 4xx would tell the
        # caller nothing changed, which is false. Pending, and retried by the next call.
        return RemovalPending(left or 0, err.message)
    table.mark_unloaded(lora_name, lora_id)
    return None
