"""One staging of a version onto engines (RFC 3.2): begin -> every bucket in order -> end.

The one driver of that sequence on the trainer side. The publisher runs it on the whole cohort
in lockstep (each bucket acknowledged by every engine before the next is sent, its receipts
recorded in the registry as they arrive); the reconciler runs it on one engine that lost a
committed version. What differs between the two is only what they do with each engine's answer
and when they stop, so that is all a caller supplies (:class:`StageCalls`); the order of the
calls, the bodies (the one begin body, :meth:`Snapshot.begin_request`) and the send-ahead of a
collective transport are here, once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from lora_contract import protocol
from relax_glue.engine_client import EngineAPI
from relax_glue.registry_types import VersionKey
from relax_glue.snapshot import EncodedBucket, Snapshot

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """What one attempt sends, whoever sends it: the begin body, the buckets, the end body.
    A plan for ends only (engines that already hold every bucket) carries no snapshot."""

    lora_name: str
    attempt_token: str
    snapshot: Snapshot | None = None
    begin: protocol.BeginRequest | None = None

    @classmethod
    def of(
        cls, snapshot: Snapshot, prefix: str, key: VersionKey, attempt_token: str, base: str | None
    ) -> StagePlan:
        begin = snapshot.begin_request(
            prefix, key.epoch, key.version_id, attempt_token, base_fingerprint=base
        )
        return cls(begin.lora_name, attempt_token, snapshot, begin)

    @classmethod
    def ends_only(cls, lora_name: str, attempt_token: str) -> StagePlan:
        return cls(lora_name, attempt_token)

    def end(self) -> protocol.EndRequest:
        return protocol.EndRequest(lora_name=self.lora_name, attempt_token=self.attempt_token)

    def bucket_meta(self, bucket: EncodedBucket) -> protocol.ReceiveBucketMeta:
        return protocol.ReceiveBucketMeta(
            lora_name=self.lora_name,
            attempt_token=self.attempt_token,
            index=bucket.spec.index,
            sha256=bucket.sha256,
        )

    def buckets(self) -> Iterator[EncodedBucket]:
        assert self.snapshot is not None, "sending buckets needs the snapshot"
        return self.snapshot.iter_buckets()


# A phase call: one engine's call of that phase (its answer, or an exception).
EngineCall = Callable[[str], Awaitable[Any]]


class StageCalls(Protocol[R_co]):
    """What a driver does around the calls :func:`stage` makes."""

    def run(
        self, op: str, engines: Sequence[str], call: EngineCall
    ) -> Awaitable[tuple[Mapping[str, Any], Any]]:
        """Run ``call`` on ``engines``; returns (answers by engine, a stop value or None). A
        stop value ends the staging there and is what :func:`stage` returns."""
        ...

    def begun(self, engine: str, reply: protocol.BeginReply) -> Awaitable[bool]:
        """An engine answered begin; True when it still needs the buckets (PREPARED), False when
        it already holds exactly this attempt, loaded (a replayed begin)."""
        ...

    def ready(self, engine: str, receipt: protocol.ReadyReceipt) -> Awaitable[Any]:
        """An engine answered end with its READY receipt (called as each one arrives)."""
        ...


@dataclasses.dataclass
class Staged(Generic[R]):
    """How a staging ended: ``stopped`` is the caller's stop value (None: every engine READY)."""

    stopped: R | None
    ready: tuple[str, ...] = ()


async def stage(
    plan: StagePlan,
    clients: Mapping[str, EngineAPI],
    engines: Sequence[str],
    calls: StageCalls[R],
    *,
    end_only: Sequence[str] = (),
    phase_s: MutableMapping[str, float] | None = None,
) -> Staged[R]:
    """begin on ``engines`` -> the buckets to those that answered PREPARED -> end on them and on
    ``end_only`` (engines that already hold every bucket of this attempt)."""
    timings: MutableMapping[str, float] = phase_s if phase_s is not None else {}
    prepared: list[str] = []
    if engines:
        body = plan.begin
        assert body is not None, "driving an engine from begin needs the begin body"

        async def begin(engine: str) -> bool:
            return await calls.begun(engine, await clients[engine].begin(body))

        with _timed(timings, "begin"):
            needs_buckets, stop = await calls.run("begin", engines, begin)
        if stop is not None:
            return Staged(stop)
        prepared = [e for e in engines if needs_buckets[e]]
    if prepared:
        with _timed(timings, "buckets"):
            stop = await _send_buckets(plan, clients, prepared, calls)
        if stop is not None:
            return Staged(stop)
    to_end = [*prepared, *end_only]
    if to_end:
        end = plan.end()

        async def end_one(engine: str) -> Any:
            receipt = await clients[engine].end(end)
            return await calls.ready(engine, receipt)

        with _timed(timings, "end"):
            _, stop = await calls.run("end", to_end, end_one)
        if stop is not None:
            return Staged(stop)
    return Staged(None, tuple(to_end))


async def _send_buckets(
    plan: StagePlan, clients: Mapping[str, EngineAPI], engines: Sequence[str], calls: StageCalls[R]
) -> Any:
    buckets: Iterable[EncodedBucket] = plan.buckets()
    # Engines whose transport sends ahead (a collective group) get every bucket handed over at
    # once, now that all of them are PREPARED (their receives are posted): the transfer of
    # bucket i+1 overlaps the verification of bucket i. The acknowledgements below stay in
    # order, one bucket at a time, and take each broadcast as it is (none is sent twice). This
    # holds the whole encoded version in memory while it is on the protocol.
    ahead = [tr for e in engines if (tr := clients[e].transport).sends_ahead]
    if ahead:
        buckets = list(buckets)
        for transport in ahead:
            for bucket in buckets:
                transport.send_ahead(plan.attempt_token, bucket.spec.index, bucket.payload)
    # Otherwise one payload in memory at a time; each bucket is acknowledged by every engine
    # before the next one is sent (RFC 3.2), so a failure stops the transfer everywhere.
    for bucket in buckets:
        meta = plan.bucket_meta(bucket)
        payload = bucket.payload

        async def one(engine: str, meta: protocol.ReceiveBucketMeta = meta, payload: bytes = payload) -> Any:
            return await clients[engine].receive_bucket(meta, payload)

        _, stop = await calls.run("receive_bucket", engines, one)
        if stop is not None:
            return stop
    return None


class _timed:
    """Adds the time spent inside to ``timings[name]`` (a phase can run more than once)."""

    def __init__(self, timings: MutableMapping[str, float], name: str) -> None:
        self.timings, self.name = timings, name

    def __enter__(self) -> None:
        self.t0 = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.timings[self.name] = self.timings.get(self.name, 0.0) + time.monotonic() - self.t0
