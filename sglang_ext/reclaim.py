"""Engine-side reclaim of a committed version: ``POST /lora_versions/reclaim``.

Reclaim starts only when the registry says no session can still ask for the version (session
refs == 0); from that moment new requests naming it get ``VERSION_RECLAIMED``. SGLang's native
per-request refcount then decides when the physical unload may happen. Each call waits at most
its own ``timeout_s``; a drain that does not finish answers ``DRAINING`` with the count and goes
on, and a later call with the same ``reclaim_id`` resumes it. The wait never holds SGLang's
``lora_update_lock``, so loads, unloads and publications of other versions continue meanwhile.
"""

from __future__ import annotations

import time

from lora_contract.protocol import DrainingReply, EngineVersionState, ReclaimRequest, UnloadedReceipt
from sglang_ext.metrics import NO_METRICS, Metrics
from sglang_ext.native_lora import NativeEdge
from sglang_ext.removal import NameLocks, remove_version
from sglang_ext.version_table import ReclaimDecision, VersionTable, in_flight_anomaly


class ReclaimService:
    def __init__(
        self, table: VersionTable, native: NativeEdge, locks: NameLocks, metrics: Metrics = NO_METRICS
    ) -> None:
        self.table = table
        self.native = native
        self._locks = locks
        self._metrics = metrics
        self._drain_started: dict[str, float] = {}  # lora_name -> when its reclaim started

    def _unloaded(self, req: ReclaimRequest) -> UnloadedReceipt:
        return UnloadedReceipt(
            lora_name=req.lora_name, reclaim_id=req.reclaim_id, incarnation=self.table.incarnation
        )

    async def reclaim(self, req: ReclaimRequest) -> UnloadedReceipt | DrainingReply:
        async with self._locks[req.lora_name]:
            v = self.table.get(req.lora_name)
            if v is not None:  # checked before anything changes: a negative count never drains
                anomaly = in_flight_anomaly(req.lora_name, self.native.in_flight(v.lora_id))
                if anomaly is not None:
                    self._metrics.anomaly("negative_in_flight")
                    raise anomaly
            decision = self.table.start_reclaim(req.lora_name, req.reclaim_id)
            if decision is ReclaimDecision.START:
                self._drain_started[req.lora_name] = time.monotonic()
            if decision in (ReclaimDecision.DONE, ReclaimDecision.NOT_LOADED):
                return self._unloaded(req)
        # Not under the name lock: a repeat call (same reclaim id) joins the drain instead of queueing.
        v = self.table.get(req.lora_name)
        assert v is not None
        pending = await remove_version(self.table, self.native, req.lora_name, v.lora_id, req.timeout_s)
        async with self._locks[req.lora_name]:
            v = self.table.get(req.lora_name)
            assert v is not None
            if v.state is EngineVersionState.UNLOADED:
                return self._unloaded(req)
            if pending is None:
                self.table.finish_reclaim(req.lora_name, req.reclaim_id)
                started = self._drain_started.pop(req.lora_name, None)
                if started is not None:
                    self._metrics.drained(time.monotonic() - started)
                return self._unloaded(req)
            return DrainingReply(
                lora_name=req.lora_name,
                reclaim_id=req.reclaim_id,
                in_flight=pending.in_flight,
                unload_error=pending.unload_error,
                incarnation=self.table.incarnation,
            )
