"""One bucket, received into a private staged file and verified there.

The safetensors header comes first: it is parsed and checked against the bucket plan and the
manifest (layout, before any tensor byte is read, and before the file is even created, so a
wrong bucket costs no allocation). Then the bytes are copied once, into the mapped file, and
verified on worker threads (hashlib and torch release the GIL): each tensor's sha256 compared
with the manifest, its values checked finite, and the bucket checksum
(:func:`~lora_contract.transport.bucket_checksum_of`, built from those same digests) compared with
the one the sender declared. Each byte is hashed once, and what is verified is exactly the
private copy the scheduler will load: read back from it, or the very bytes the lane handed to
its ``pwrite`` (a private file this process alone writes holds what it was given).

Where the bytes come from:

- a request body, chunk by chunk (:meth:`BucketReceiver.feed`). Each chunk is written to the
  part on one ordered lane, so the event loop goes back to the socket while the kernel
  allocates the file's pages (a fresh tmpfs page costs more than the receive's own copy: a 27
  MiB bucket written in 14-19 ms, rewritten in 6-7); the reader waits (:meth:`BucketReceiver.pace`)
  when the lane is :data:`WRITE_BACKLOG_BYTES` behind. With cores to spare the lane also hashes
  each chunk from memory right after writing it (the bytes just written, hot in its cache);
  otherwise the tensors split into groups verified in parallel after the last byte.
  ``SGLANG_LORA_VERSIONS_HASH_WHILE_RECEIVING`` (1/0) overrides the choice.
- a file in the engine's local source directory, for a trainer on the same host: taken over
  when it can be made private (``StagingArea.take_local_source``: moved into this process's
  directory, no other link, no writer, read-only) and verified where it lies
  (:meth:`BucketReceiver.adopt`); otherwise copied, each group's worker copying its byte range
  into the private file and then verifying it there (:meth:`BucketReceiver.fill_from_file`).

Nothing is accepted here: the caller commits the part (rename into the attempt's directory)
only after :meth:`BucketReceiver.finish` returned, and discards it otherwise.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import os
import threading
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.identity import Manifest, content_mismatch
from lora_contract.transport import (
    HEADER_PREFIX_BYTES,
    BucketSpec,
    PayloadLayout,
    TensorSpan,
    bucket_checksum_of,
    check_layout_against_plan,
    header_length,
    parse_payload_layout,
)
from lora_contract.wire_models import invalid
from sglang_ext.adapter_compat import check_tensor_values
from sglang_ext.settings import HASH_WHILE_RECEIVING_ENV, switch
from sglang_ext.staging import StagedPart, StagingArea

# How far the write lane may fall behind the socket: past this many received bytes not yet
# written, the body's read waits (the socket's flow control then holds the sender), so a lane
# starved by decode never holds a whole bucket in memory.
WRITE_BACKLOG_BYTES = 8 * 1024 * 1024
_CORES = len(os.sched_getaffinity(0))
# Parallel verification: one group of tensors per worker, at most 4 (a bucket is verified in
# the time of its share, and generation keeps the rest of a large machine).
VERIFY_WORKERS = max(1, min(4, _CORES))


def hash_while_receiving() -> bool:
    """Hash behind the socket only with cores to spare (see the module docstring)."""
    return switch(HASH_WHILE_RECEIVING_ENV, default=_CORES > 2)


# Publication work is background work: its threads (and the collective receiver process) run
# at this niceness, so on a machine without spare cores the decode of running sessions goes
# first and a publication takes longer instead (measured: bench/transport_gap.py).
BACKGROUND_NICE = 10


def yield_to_generation() -> None:
    """Lower the calling thread's CPU priority (Linux nice applies per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


# The write lane (a body's chunks, in order: written to the part, and hashed while receiving)
# and the parallel pool (disjoint groups of tensors).
_WRITE_LANE = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="lora-versions-write", initializer=yield_to_generation
)
_VERIFIERS = concurrent.futures.ThreadPoolExecutor(
    max_workers=VERIFY_WORKERS, thread_name_prefix="lora-versions-verify", initializer=yield_to_generation
)


def split_groups(spans: Sequence[TensorSpan], n: int) -> list[list[TensorSpan]]:
    """At most ``n`` runs of consecutive tensors with about equal bytes each (none empty)."""
    total = sum(s.end - s.start for s in spans)
    groups: list[list[TensorSpan]] = [[]]
    acc = 0
    for span in spans:
        if groups[-1] and len(groups) < n and acc >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(span)
        acc += span.end - span.start
    return [g for g in groups if g]


class BucketReceiver:
    def __init__(
        self,
        staging: StagingArea,
        manifest: Manifest,
        spec: BucketSpec,
        declared_checksum: str,
        cap: int,
    ) -> None:
        self.staging = staging
        self.manifest = manifest
        self.spec = spec
        self.declared_checksum = declared_checksum
        self.cap = cap
        self.part: StagedPart | None = None
        self.layout: PayloadLayout | None = None
        self._head = bytearray()  # the header, until the layout is known
        self._filled = 0
        self._jobs: list[asyncio.Future[None]] = []
        # a body's chunks on the write lane, oldest first: (end offset, job)
        self._writes: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._written = 0
        # write-lane hashing: the tensor being hashed, how far, and its running hash (None: the
        # tensors are hashed in parallel groups after the last byte)
        self._cursor = 0
        self._hashed = 0
        self._hasher: Any = None
        self._hash_on_lane = hash_while_receiving()
        self._verify_after = False  # a body's groups, verified once the lane wrote every byte
        self._digests: dict[str, str] = {}
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------- event loop side

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the body (raises, and the read stops, on a defect)."""
        if self._error is not None:
            raise self._error
        if self.layout is None:
            self._head += chunk
            self._filled += len(chunk)
            if not self._parse_header():
                return
            chunk = bytes(self._head)
            self._head = bytearray()
            self._filled = 0
        assert self.part is not None and self.layout is not None
        end = self._filled + len(chunk)
        if end > self.layout.size:
            raise invalid(
                f"bucket {self.spec.index} body is longer than its safetensors header says "
                f"({self.layout.size} bytes)"
            )
        # Written (and hashed) on the lane, not here: the event loop goes back to the socket
        # while the kernel allocates the part's pages, which cost as much as the receive itself.
        self._writes.append((end, self._run(_WRITE_LANE, self._write_chunk, self._filled, chunk)))
        self._filled = end
        if end == self.layout.size:
            self._verify_after = True

    async def pace(self) -> None:
        """Wait while the write lane is more than :data:`WRITE_BACKLOG_BYTES` behind the body
        (a body's reader calls this between chunks); raise what stopped the lane."""
        while self._writes:
            end, job = self._writes[0]
            if not job.done() and self._filled - self._written <= WRITE_BACKLOG_BYTES:
                break
            await asyncio.shield(job)  # never raises: the lane's failure is the bucket's error
            self._writes.popleft()
            self._written = end
        if self._error is not None:
            raise self._error

    async def fill_from_file(self, fd: int) -> None:
        """Take the bucket from an open local file (owned from here on: closed once read). The
        header is read and checked first, as for a body; then the workers copy the rest into the
        private staged file and verify it. Refusals as for a body."""
        try:
            head = os.pread(fd, 8, 0)
            n = header_length(head)
            if n is None:
                raise LoraVersionError(
                    ErrorCode.INCOMPLETE_BODY,
                    f"bucket {self.spec.index} source file is shorter than a safetensors header",
                    received=len(head),
                )
            if HEADER_PREFIX_BYTES + n > self.cap:
                self.feed(head)  # refused there, with the same error as a body
            self._hash_on_lane = False  # copied and verified in parallel groups
            self.feed(os.pread(fd, HEADER_PREFIX_BYTES + n, 0))
            await self._drain_jobs()  # the header, written on the lane
            self._verify_after = False
            if self.layout is None:
                raise LoraVersionError(
                    ErrorCode.INCOMPLETE_BODY,
                    f"bucket {self.spec.index} source file ends inside its header",
                    received=self._filled,
                )
            if os.fstat(fd).st_size > self.layout.size:
                raise invalid(
                    f"bucket {self.spec.index} source file is longer than its safetensors header says "
                    f"({self.layout.size} bytes)"
                )
            jobs = [
                self._run(_VERIFIERS, self._copy_and_verify_group, fd, group)
                for group in split_groups(self.layout.tensors, VERIFY_WORKERS)
            ]
        except BaseException:
            os.close(fd)
            raise
        if not jobs:
            os.close(fd)
            return
        # The fd is closed when the last copy ended, even if this caller is cancelled first.
        asyncio.gather(*jobs, return_exceptions=True).add_done_callback(lambda _: os.close(fd))
        await self._drain_jobs()
        if self._error is None:
            self._filled = self.layout.size  # every group copied its whole range

    async def adopt(self, part: StagedPart) -> None:
        """Take a part that already holds the whole bucket (a local source taken over, read-only):
        its header is checked as a body's would be, then its tensors verified in parallel groups.
        The part is this receiver's from here on (discarded by :meth:`abandon` if refused)."""
        self.part = part
        view = part.view
        try:
            n = header_length(view[:HEADER_PREFIX_BYTES])
            if n is None or HEADER_PREFIX_BYTES + n > part.size:
                raise LoraVersionError(
                    ErrorCode.INCOMPLETE_BODY,
                    f"bucket {self.spec.index} source file ends inside its header",
                    received=part.size,
                )
            self._head = bytearray(view[: HEADER_PREFIX_BYTES + n])
        finally:
            del view
        if not self._parse_header(allocate=False):
            raise AssertionError("a complete header was given")
        assert self.layout is not None
        if part.size != self.layout.size:
            raise LoraVersionError(
                ErrorCode.INCOMPLETE_BODY if part.size < self.layout.size else ErrorCode.INVALID_REQUEST,
                f"bucket {self.spec.index} source file has {part.size} bytes, its header describes "
                f"{self.layout.size}",
                received=part.size,
            )
        self._head = bytearray()
        self._filled = part.size
        for group in split_groups(self.layout.tensors, VERIFY_WORKERS):
            self._run(_VERIFIERS, self._verify_group, group)
        await self._drain_jobs()

    def take_verified(self, other: BucketReceiver) -> None:
        """Take the part ``other`` already received and verified, with its results (the
        collective transport verifies each bucket on arrival, before its acknowledgement)."""
        self.part, other.part = other.part, None
        self.layout, self._filled = other.layout, other._filled
        self._digests, self._error = other._digests, other._error

    def _parse_header(self, allocate: bool = True) -> bool:
        n = header_length(self._head)
        if n is None:
            return False
        if HEADER_PREFIX_BYTES + n > self.cap:
            raise LoraVersionError(
                ErrorCode.PAYLOAD_TOO_LARGE, f"bucket {self.spec.index} header exceeds {self.cap} bytes"
            )
        if len(self._head) < HEADER_PREFIX_BYTES + n:
            return False
        layout = parse_payload_layout(memoryview(self._head)[: HEADER_PREFIX_BYTES + n])
        check_layout_against_plan(self.manifest, self.spec, layout)
        if layout.size > self.cap:
            raise LoraVersionError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"bucket {self.spec.index} of {layout.size} bytes exceeds {self.cap}",
                limit=self.cap,
            )
        if allocate:
            self.part = self.staging.new_part(layout.size)
        self.layout = layout
        return True

    def _run(self, pool: concurrent.futures.Executor, fn: Any, *args: Any) -> asyncio.Future[None]:
        job = asyncio.get_running_loop().run_in_executor(pool, self._guarded, fn, *args)
        self._jobs.append(job)
        return job

    async def finish(self) -> None:
        """After the last chunk: wait for the verification, then every content check. Raises
        INCOMPLETE_BODY, INVALID_REQUEST, CHECKSUM_MISMATCH or INCOMPATIBLE_ADAPTER."""
        await self._drain_jobs()
        if self._verify_after and self._error is None:
            assert self.layout is not None
            check = self._check_group_values if self._hash_on_lane else self._verify_group
            for group in split_groups(self.layout.tensors, VERIFY_WORKERS):
                self._run(_VERIFIERS, check, group)
            await self._drain_jobs()
        if self._error is not None:
            raise self._error
        if self.layout is None or self._filled != self.layout.size:
            expected = self.layout.size if self.layout is not None else "a safetensors header"
            raise LoraVersionError(
                ErrorCode.INCOMPLETE_BODY,
                f"bucket {self.spec.index} body ended after {self._filled} bytes, expected {expected}",
                received=self._filled,
            )
        assert self.part is not None
        if len(self._digests) != len(self.layout.tensors):  # a defect of ours, never an accept
            raise RuntimeError(f"bucket {self.spec.index}: not every tensor was verified")
        checksum = bucket_checksum_of(self.part.view[: self.layout.header_end], self._digests)
        if checksum != self.declared_checksum:
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH, f"bucket {self.spec.index}: checksum does not match"
            )

    async def abandon(self) -> None:
        """Stop: wait for the workers to let go of the mapping, then delete the file."""
        await self._drain_jobs()
        if self.part is not None:
            StagingArea.discard_part(self.part)
            self.part = None

    async def _drain_jobs(self) -> None:
        jobs, self._jobs = self._jobs, []
        if jobs:
            # shielded: the mapping must outlive the workers' reads even if our caller is cancelled
            await asyncio.shield(asyncio.gather(*jobs, return_exceptions=True))

    # ------------------------------------------------------------------------- worker threads

    def _guarded(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` on a worker; its failure becomes the bucket's (the first one wins)."""
        if self._error is not None:
            return
        try:
            fn(*args)
        except LoraVersionError as exc:
            # Dropped frames: a traceback that keeps a tensor over the mapping would keep the
            # mapping exported after the file is gone.
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            if self._error is None:
                self._error = exc.with_traceback(None)
        except Exception as exc:  # a defect of ours: the bucket fails (a 500), never accepted
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            if self._error is None:
                self._error = exc

    def _write_chunk(self, offset: int, chunk: bytes) -> None:
        """Write lane: the chunk into the part at ``offset``; with hashing on the lane, every
        tensor byte of it into its tensor's running hash, finishing each tensor it completes.
        The bytes hashed are the bytes just written to the private file, from memory the lane
        has hot in its cache (no page of the mapping is touched)."""
        assert self.part is not None and self.layout is not None
        self.part.write(offset, chunk)
        if not self._hash_on_lane:
            return
        view, end = memoryview(chunk), offset + len(chunk)
        spans = self.layout.tensors
        while self._cursor < len(spans):
            span = spans[self._cursor]
            if self._hasher is None:
                self._hasher = hashlib.sha256()
                self._hashed = span.start
            stop = min(span.end, end)
            if stop > self._hashed:
                self._hasher.update(view[self._hashed - offset : stop - offset])
                self._hashed = stop
            if self._hashed < span.end:
                return  # the rest of this tensor has not arrived yet
            digest = self._hasher.hexdigest()
            self._check_digest(span, digest)
            self._digests[span.name] = digest
            self._hasher = None
            self._cursor += 1

    def _verify_group(self, group: Sequence[TensorSpan]) -> None:
        """Each tensor's digest, then the values of the whole group in as few calls as its
        layout allows: one check per run of adjacent tensors of one dtype. Per tensor, the
        checks' own overhead (and the thread team each torch call wakes, spinning beside the
        other group's hashing) cost a 27 MiB bucket of 84 tensors 12 to 15 ms of wall time on
        2 cores; the bytes checked are the same."""
        assert self.part is not None
        view = self.part.view
        try:
            digests = {}
            for span in group:
                digest = hashlib.sha256(view[span.start : span.end]).hexdigest()
                self._check_digest(span, digest)
                digests[span.name] = digest
            _check_runs(view, group)
            self._digests.update(digests)
        finally:
            del view

    def _check_group_values(self, group: Sequence[TensorSpan]) -> None:
        """The values of a group whose digests the write lane already checked."""
        assert self.part is not None
        view = self.part.view
        try:
            _check_runs(view, group)
        finally:
            del view

    def _copy_and_verify_group(self, fd: int, group: Sequence[TensorSpan]) -> None:
        """Copy the group's byte range from the source into the private file, then verify it
        there (never the source: it may change after being read)."""
        assert self.part is not None
        self.part.copy_from(fd, group[0].start, group[-1].end, f"bucket {self.spec.index} source file")
        self._verify_group(group)

    def _check_digest(self, span: TensorSpan, digest: str) -> None:
        entry = self.manifest.entry(span.name)
        if entry is None or digest != entry.sha256:
            raise content_mismatch(span.name)


def same_dtype_runs(spans: Sequence[TensorSpan]) -> list[list[TensorSpan]]:
    """The non-empty spans in runs of adjacent bytes and one dtype (each run one values check)."""
    runs: list[list[TensorSpan]] = []
    for span in spans:
        if span.end == span.start:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last.dtype == span.dtype and last.end == span.start:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def _check_runs(view: memoryview, group: Sequence[TensorSpan]) -> None:
    """The values of ``group``: one check per run of adjacent tensors of one dtype (per tensor,
    the checks' own overhead cost a 27 MiB bucket of 84 tensors 12 to 15 ms on 2 cores)."""
    for run in same_dtype_runs(group):
        try:
            _check_values(view[run[0].start : run[-1].end], run[0].name, run[0].dtype, (-1,))
        except LoraVersionError:
            for span in run:  # name the tensor that holds them
                _check_values(view[span.start : span.end], span.name, span.dtype, span.shape)
            raise


def _check_values(raw: memoryview, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    import torch  # lazy heavy import: only the value check of a received bucket needs it

    with warnings.catch_warnings():
        # a taken-over part is mapped read-only, and this tensor is only read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(raw, dtype=getattr(torch, dtype)).reshape(shape)
    try:
        check_tensor_values(name, tensor)
    finally:
        del tensor, raw
