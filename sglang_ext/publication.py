"""Staged publication on one engine: begin -> ordered buckets -> end, and cleanup.

The imperative shell around :class:`~sglang_ext.version_table.VersionTable`: it receives each
bucket into a private staged file and verifies it there (:mod:`bucket_receiver`), drives SGLang's
native load of the attempt's files and the exact-version probe, and serialises the operations of
one name with a per-name lock. Decisions and state live in the table; this module
never decides what is allowed. The removal and the lock set it shares with reclaim live in
:mod:`sglang_ext.removal`.

Where time goes is logged once per publication (``publication phases <name>: ...``), which is
what ``bench/publish_engine.py`` reads to report the engine-side breakdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    BeginRequest,
    BucketAck,
    CleanupReceipt,
    CleanupRequest,
    DrainingReply,
    EndRequest,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    check_tensor_set,
)
from lora_contract.transport import HTTP_TRANSPORT
from sglang_ext.adapter_compat import sglang_load_config
from sglang_ext.bucket_receiver import BucketReceiver
from sglang_ext.bucket_sources import AttemptKey, BucketFiller, OutOfBandReceive, bucket_cap
from sglang_ext.native_lora import NativeEdge
from sglang_ext.removal import NameLocks, remove_version
from sglang_ext.staging import StagingArea
from sglang_ext.version_table import (
    BucketDecision,
    CleanupDecision,
    EndDecision,
    VersionTable,
    failed_refusal,
    in_flight_anomaly,
)


@dataclass
class PhaseTimes:
    """Engine-side time of one attempt, by phase (milliseconds)."""

    buckets: int = 0
    read_ms: float = 0.0  # body bytes in, from the first chunk to the last
    verify_ms: float = 0.0  # what verification adds after the last byte arrived
    load_ms: float = 0.0
    probe_ms: float = 0.0

    def line(self, lora_name: str) -> str:
        return (
            f"publication phases {lora_name}: buckets={self.buckets} read_ms={self.read_ms:.1f} "
            f"verify_ms={self.verify_ms:.1f} load_ms={self.load_ms:.1f} probe_ms={self.probe_ms:.1f}"
        )


class PublicationService:
    def __init__(
        self,
        table: VersionTable,
        native: NativeEdge,
        staging: StagingArea,
        locks: NameLocks,
        log: Callable[[str], None] | None = None,
        out_of_band: Sequence[OutOfBandReceive] = (),
    ) -> None:
        self.table = table
        self.native = native
        self.staging = staging
        # transport name -> the receive of the buckets that transport carries out of band
        # (bucket_sources: the collective group); bodies and local files need none
        self.out_of_band: dict[str, OutOfBandReceive] = {r.transport: r for r in out_of_band}
        # Required, never defaulted: reclaim must serialise on the very same locks (a private set
        # here would let a reclaim and a cleanup of one name run at once, with no error).
        self._locks = locks
        self._log = log
        # (name, attempt token) -> engine-side time so far
        self._phases: dict[AttemptKey, PhaseTimes] = {}
        # (name, attempt token) -> the running load+probe, shared by a racing end and by cleanup;
        # only while it runs (it sets the version's state itself before it ends)
        self._loads: dict[AttemptKey, asyncio.Task[ReadyReceipt]] = {}

    # ----------------------------------------------------------------------------- begin

    async def begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt:
        async with self._locks[req.lora_name]:
            key = (req.lora_name, req.attempt_token)
            current = self.table.get(req.lora_name)
            if current is None or current.attempt_token != req.attempt_token:
                # A new attempt: before the table changes, a version the staging directory cannot
                # hold is refused with nothing reserved. (A retried begin of the current attempt
                # is answered from the table, whatever the room.)
                self.staging.check_room(req.manifest.total_bytes, f"version {req.lora_name}")
            receive = self._out_of_band(req.transport)
            prepare = receive is not None and not receive.receiving(key)
            if prepare:
                receive.check_ready(req.channel)  # before the table changes
            receipt = self.table.begin(req)
            if isinstance(receipt, PreparedReceipt):
                self.staging.attempt_dir(key)
                self._phases.setdefault(key, PhaseTimes())
                if prepare:
                    v = self.table.get(req.lora_name)
                    assert v is not None
                    receive.prepare(key, v)
            return receipt

    def _out_of_band(self, transport: str) -> OutOfBandReceive | None:
        """The receive a begin's transport needs: none for HTTP (bodies, local files)."""
        if transport == HTTP_TRANSPORT:
            return None
        receive = self.out_of_band.get(transport)
        if receive is None:
            raise LoraVersionError(
                ErrorCode.TRANSPORT_UNAVAILABLE, f"this engine has no {transport} transport"
            )
        return receive

    def out_of_band_filler(self, transport: str, meta: ReceiveBucketMeta) -> BucketFiller:
        """The filler of an acknowledgement whose bytes came over ``transport``."""
        receive = self._out_of_band(transport)
        assert receive is not None, "HTTP buckets are filled from their own request"
        return receive.filler(meta)

    # ----------------------------------------------------------------------------- buckets

    async def receive_bucket(self, meta: ReceiveBucketMeta, fill: BucketFiller) -> BucketAck:
        async with self._locks[meta.lora_name]:
            decision = self.table.check_bucket(meta)
            if decision is BucketDecision.DUPLICATE:
                return BucketAck(index=meta.index, accepted=True, duplicate=True)
            v = self.table.get(meta.lora_name)
            assert v is not None
            manifest, spec = v.manifest, self.table.bucket_spec(meta)
            assert manifest is not None, "a PREPARED version keeps its manifest"
        # The body is read and verified without the name lock: a slow or stalled upload must not
        # block cleanup, end or begin of its version (the reader has a deadline of its own), and
        # the hashing runs on worker threads so generation keeps its event loop.
        cap = bucket_cap(manifest, spec, self.table.limits.max_bucket_bytes)
        receiver = BucketReceiver(self.staging, manifest, spec, meta.sha256, cap)
        key = (meta.lora_name, meta.attempt_token)
        try:
            t0 = time.perf_counter()
            await fill(cap, receiver)
            t1 = time.perf_counter()
            await receiver.finish()
            t2 = time.perf_counter()
            async with self._locks[meta.lora_name]:
                # Asked again: the attempt may have been cleaned up, or the bucket accepted by a
                # concurrent upload of the same bytes, while this body was read.
                if self.table.check_bucket(meta) is BucketDecision.DUPLICATE:
                    return BucketAck(index=meta.index, accepted=True, duplicate=True)
                # every check passed: only now does the attempt's state change
                assert receiver.part is not None
                self.staging.commit_part(key, receiver.part, meta.index)
                receiver.part = None
                self.table.accept_bucket(meta)
                phases = self._phases.setdefault(key, PhaseTimes())
                phases.buckets += 1
                phases.read_ms += (t1 - t0) * 1e3
                phases.verify_ms += (t2 - t1) * 1e3
                return BucketAck(index=meta.index, accepted=True)
        finally:
            await receiver.abandon()  # a no-op once committed

    # ----------------------------------------------------------------------------- end

    async def end(self, req: EndRequest) -> ReadyReceipt:
        async with self._locks[req.lora_name]:
            decision = self.table.plan_end(req.lora_name, req.attempt_token)
            if decision is EndDecision.READY:
                v = self.table.get(req.lora_name)
                assert v is not None
                return self.table.ready_receipt(v)
            key = (req.lora_name, req.attempt_token)
            if decision is EndDecision.LOAD:
                v = self.table.get(req.lora_name)
                assert v is not None and v.manifest is not None
                # What will be loaded is what lies in the attempt's directory: exactly one
                # verified file per planned bucket, together every tensor of the manifest. Checked
                # before the version becomes LOADING: a refused end changes nothing.
                self.staging.check_bucket_files(key, v.buckets_total)
                check_tensor_set(v.manifest, (n for spec in v.plan for n in spec.tensor_names))
                self.table.start_load(req.lora_name, req.attempt_token)
                load = asyncio.create_task(self._load_and_probe(req.lora_name, req.attempt_token))
                self._loads[key] = load
                load.add_done_callback(lambda done, key=key: self._forget_load(key, done))
            task = self._loads[key]
        # Shielded: a client that disconnects mid-end must not cancel a native load half way.
        return await asyncio.shield(task)

    async def _load_and_probe(self, lora_name: str, attempt_token: str) -> ReadyReceipt:
        v = self.table.get(lora_name)
        assert v is not None and v.manifest is not None
        key = (lora_name, attempt_token)
        phases = self._phases.setdefault(key, PhaseTimes())
        lora_id: str | None = None
        try:
            config = json.dumps(sglang_load_config(v.manifest.config), sort_keys=True).encode()
            adapter_dir = self.staging.write_config(key, config)
            t0 = time.perf_counter()
            lora_id = await self.native.load_pinned(lora_name, adapter_dir)
            t1 = time.perf_counter()
            await self.native.probe(lora_name, lora_id)
            phases.load_ms, phases.probe_ms = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        except BaseException as exc:
            # What stayed loaded: the id the load returned and registered (the probe failed), or
            # the id of a partial load SGLang refused after some rank loaded it, never registered
            # (LOAD_FAILED's details).
            details = exc.details if isinstance(exc, LoraVersionError) else {}
            leftover = lora_id or details.get("leftover_lora_id")
            if leftover is not None:
                # Take it out again through the one removal path; never forget it on a failure.
                self.table.abandon_load(lora_name, attempt_token, leftover, registered=lora_id is not None)
                try:
                    if await remove_version(self.table, self.native, lora_name, leftover, 30.0) is None:
                        leftover = None  # removed: nothing stays loaded
                except Exception:
                    pass  # still loaded: FAILED below keeps it visible and its slot held
            self.table.fail_load(lora_name, attempt_token, leftover_lora_id=leftover)
            v = self.table.get(lora_name)
            if leftover is not None and isinstance(exc, Exception) and v is not None:
                # FAILED now: the one refusal after which the version is not as it was. It says
                # so (state, leftover id), as every repeat of this end will (docs/serving.md).
                raise failed_refusal(v) from exc
            raise
        receipt = self.table.finish_load(lora_name, attempt_token, lora_id)
        # The schedulers hold the weights now: the files go (a failed load keeps them, so the
        # same attempt's end can be sent again).
        self._forget(key)
        if self._log is not None:
            self._log(phases.line(lora_name))
        return receipt

    def _forget_load(self, key: AttemptKey, done: asyncio.Task[ReadyReceipt]) -> None:
        if self._loads.get(key) is done:
            del self._loads[key]

    def _forget(self, key: AttemptKey) -> None:
        for receive in self.out_of_band.values():
            receive.forget(key)
        self.staging.remove(key)
        self._phases.pop(key, None)

    # ----------------------------------------------------------------------------- cleanup

    async def cleanup(
        self, req: CleanupRequest, drain_timeout_s: float = 30.0
    ) -> CleanupReceipt | DrainingReply:
        while True:
            async with self._locks[req.lora_name]:
                decision = self.table.plan_cleanup(req.lora_name, req.attempt_token)
                key = (req.lora_name, req.attempt_token)
                if decision is CleanupDecision.WAIT_FOR_LOAD:
                    load = self._loads.get(key)
                else:
                    if decision is CleanupDecision.UNLOAD:
                        v = self.table.get(req.lora_name)
                        assert v is not None
                        anomaly = in_flight_anomaly(req.lora_name, self.native.in_flight(v.lora_id))
                        if anomaly is not None:
                            raise anomaly  # checked before anything changes
                        self.table.mark_cleaning(req.lora_name, req.attempt_token)
                        pending = await remove_version(
                            self.table, self.native, req.lora_name, v.lora_id, drain_timeout_s
                        )
                        if pending is not None:
                            # Unregistered, not yet unloaded: never "clean" before the unload.
                            return DrainingReply(
                                lora_name=req.lora_name,
                                attempt_token=req.attempt_token,
                                in_flight=pending.in_flight,
                                unload_error=pending.unload_error,
                                incarnation=self.table.incarnation,
                            )
                    for receive in self.out_of_band.values():
                        await receive.settle(key)  # bytes still landing, not a dead sender
                    self._forget(key)
                    self._loads.pop(key, None)
                    return self.table.finish_cleanup(req.lora_name, req.attempt_token)
            if load is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(load)
            else:
                await asyncio.sleep(0.01)
