"""The collective transport's receiving end, beside the collective link: an
:class:`~sglang_ext.bucket_sources.OutOfBandReceive` the publication shell holds for
``transport="collective"`` (registered in :mod:`sglang_ext.bucket_sources`), with the group's
connect as its own setup call (``Routes.COLLECTIVE_CONNECT``).

At begin it stages a part for every bucket not accepted yet, writes its header and posts its
receive on the link (the engine is ready for the broadcast before it answers PREPARED); each
bucket is verified the moment the receiver reports it whole, while the next ones are still on
the wire; an acknowledgement's filler then takes the verified bucket (at most the plugin's
deadline). When the group breaks, the parts still waiting for their bytes go at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from lora_contract.collective_group import token_tag
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    COLLECTIVE_TRANSPORT,
    BucketSpec,
    CollectiveConnectReply,
    CollectiveConnectRequest,
    Manifest,
    ReceiveBucketMeta,
    Routes,
    bucket_header,
)
from sglang_ext.bucket_receiver import BucketReceiver
from sglang_ext.bucket_sources import AttemptKey, BucketFiller, ReceiveSetup, SetupRoute, bucket_cap
from sglang_ext.collective_link import CollectiveLink, ExpectedBucket, transfer_failed
from sglang_ext.staging import StagedPart, StagingArea
from sglang_ext.version_table import ManagedVersion

_BACKGROUND: set[asyncio.Future[None]] = set()


def _in_background(job: Awaitable[None]) -> None:
    """Run ``job`` to its end without a caller (a reference is kept until then)."""
    task = asyncio.ensure_future(job)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


@dataclass
class CollectiveStash:
    """One attempt's buckets on their way over the collective group: a staged part per bucket not
    yet acknowledged, its header written and its receive posted (the receiver writes the tensor
    bytes after the header). A part leaves the stash when an acknowledgement takes it."""

    job: str
    parts: dict[int, StagedPart] = field(default_factory=dict)
    # bucket index -> its verification, started the moment the bucket arrived whole
    verifying: dict[int, asyncio.Task[BucketReceiver]] = field(default_factory=dict)

    def discard(self, keep: Callable[[int], bool] = lambda _index: False) -> None:
        for index in [i for i in self.parts if not keep(i)]:
            StagingArea.discard_part(self.parts.pop(index))

    def release(self) -> None:
        """Everything goes: parts not arrived, verifications running or done and never taken."""
        self.discard()
        for task in self.verifying.values():
            if not task.done():
                task.cancel()  # its receiver abandons its part on the way out
            elif not task.cancelled() and task.exception() is None:
                _in_background(task.result().abandon())
        self.verifying.clear()


class CollectiveReceive:
    transport = COLLECTIVE_TRANSPORT

    def __init__(
        self, link: CollectiveLink, staging: StagingArea, max_bucket_bytes: int, incarnation: str
    ) -> None:
        self.link = link
        self.staging = staging
        self.max_bucket_bytes = max_bucket_bytes
        self.incarnation = incarnation
        # (name, attempt token) -> its buckets on their way over the collective group
        self._stashes: dict[AttemptKey, CollectiveStash] = {}
        self._jobs = itertools.count()
        link.on_break(self._group_broke)

    @classmethod
    def build(cls, setup: ReceiveSetup) -> CollectiveReceive:
        """This engine's receive, over a link of its own (no group until a trainer connects)."""
        return cls(CollectiveLink(log=setup.log), setup.staging, setup.max_bucket_bytes, setup.incarnation)

    def setup_routes(self) -> Sequence[SetupRoute]:
        return [SetupRoute(Routes.COLLECTIVE_CONNECT, CollectiveConnectRequest, self._connect)]

    async def _connect(self, req: CollectiveConnectRequest) -> CollectiveConnectReply:
        """Join the trainer's group (idempotent for the group being set up or up)."""
        await self.link.connect(req.group_id, req.init_method, req.backend)
        return CollectiveConnectReply(
            group_id=req.group_id, incarnation=self.incarnation, timeout_s=self.link.timeout_s
        )

    def receiving(self, key: AttemptKey) -> bool:
        """A stash whose group broke never gets its missing bytes: it goes here, and the retried
        begin posts the receives again on the trainer's current group."""
        stash = self._stashes.get(key)
        if stash is not None and not self.link.receives(stash.job):
            self.forget(key)
            return False
        return stash is not None

    def check_ready(self, channel: str | None) -> None:
        """The trainer's group must be this engine's (a begin that names no group, or another,
        is refused before anything changes: its bytes would go where nobody receives them)."""
        self.link.check_idle()
        if channel != self.link.group_id:
            raise LoraVersionError(
                ErrorCode.TRANSPORT_UNAVAILABLE,
                f"the trainer sends over group {channel}, this engine receives over group "
                f"{self.link.group_id} (another sender connected since, or the begin names no "
                "group); connect again",
                state=self.link.state.value,
                group_id=self.link.group_id,
            )

    def prepare(self, key: AttemptKey, version: ManagedVersion) -> None:
        v = version
        assert v.manifest is not None
        stash = CollectiveStash(job=f"job-{next(self._jobs)}")
        expected: list[ExpectedBucket] = []
        try:
            for spec in v.plan[v.next_bucket :]:
                header = bucket_header(v.manifest, spec)
                # Sparse: the receiver process allocates the pages as the bytes land (a full
                # filesystem ends it, not this process); the header is written with a call
                # that fails with an error, never through the mapping.
                part = self.staging.new_part(len(header) + spec.total_bytes, written_here=False)
                stash.parts[spec.index] = part
                with open(part.path, "r+b") as f:
                    f.write(header)
                expected.append(ExpectedBucket(spec.index, spec.total_bytes, part.path, len(header)))
            self.link.expect(stash.job, token_tag(key[1]), expected)
        except BaseException:
            stash.discard()
            raise
        for spec in v.plan[v.next_bucket :]:
            stash.verifying[spec.index] = asyncio.ensure_future(
                self._verify_on_arrival(stash, v.manifest, spec)
            )
        self._stashes[key] = stash

    async def _verify_on_arrival(
        self, stash: CollectiveStash, manifest: Manifest, spec: BucketSpec
    ) -> BucketReceiver:
        """Verify a bucket the moment the receiver reports it whole, while the next ones are
        still on the wire; the acknowledgement then only compares the checksum. No deadline
        here: the acknowledgement's wait has one, and the receiver's receives have theirs."""
        await self.link.arrived_whole(stash.job, spec.index)
        part = stash.parts.pop(spec.index, None)
        if part is None:
            raise transfer_failed(f"bucket {spec.index} was dropped")
        cap = bucket_cap(manifest, spec, self.max_bucket_bytes)
        receiver = BucketReceiver(self.staging, manifest, spec, "", cap)
        try:
            await receiver.adopt(part)
        except BaseException:
            await receiver.abandon()
            raise
        return receiver

    def filler(self, meta: ReceiveBucketMeta) -> BucketFiller:
        """The filler of an acknowledgement: the bucket's part, once the receiver reported it
        whole (at most the plugin's deadline), verified like any other bucket."""
        key = (meta.lora_name, meta.attempt_token)

        async def fill(_cap: int, receiver: BucketReceiver) -> None:
            stash = self._stashes.get(key)
            if stash is None:
                raise transfer_failed(
                    f"bucket {meta.index}: this attempt is not being received over the collective group"
                )
            verified = stash.verifying.pop(meta.index, None)
            if verified is None:
                raise transfer_failed(f"bucket {meta.index} was taken by an earlier acknowledgement")
            try:
                await self.link.arrival(stash.job, meta.index)  # at most the deadline
                receiver.take_verified(await asyncio.shield(verified))
            except BaseException:
                if not verified.done():
                    verified.cancel()
                raise

        return fill

    async def settle(self, key: AttemptKey) -> None:
        stash = self._stashes.get(key)
        if stash is not None:
            await self.link.settle(stash.job)  # bytes still landing, not a dead sender

    def forget(self, key: AttemptKey) -> None:
        stash = self._stashes.pop(key, None)
        if stash is not None:
            stash.release()
            self.link.drop(stash.job)  # receives still pending go with the receiver

    def _group_broke(self, _reason: str) -> None:
        """Every transfer on the group is over: the parts still waiting for their bytes go now,
        not at cleanup. Buckets that arrived whole stay: they are acknowledged (and verified)
        as usual."""
        for stash in self._stashes.values():
            stash.discard(keep=lambda index, job=stash.job: self.link.arrived(job, index))
