"""One bucket body, received into a staged file and verified while it arrives.

The safetensors header comes first: it is parsed and checked against the bucket plan and the
manifest (layout, before any tensor byte is read, and before the file is even created, so a
wrong bucket costs no allocation). Then every chunk is copied once, into the mapped file. The
tensors are hashed on a worker thread (hashlib releases the GIL), each tensor's sha256 compared
with the manifest, its values checked finite, and the bucket checksum
(:func:`~sglang_ext.transport.bucket_checksum_of`, built from those same digests) compared with
the one the sender declared. Each byte is hashed once.

When the hashing runs: behind the socket, in strides, on a machine with cores to spare (it then
overlaps the receive); after the last byte otherwise. On 2 cores, hashing behind the socket took
the core the receive (and a co-located sender) needed: a 27 MiB body read in 76 ms instead of
42 (``bench/publish_engine.py``), more than the 27 ms of hashing it hid. The switch
``SGLANG_LORA_VERSIONS_HASH_WHILE_RECEIVING`` (1/0) overrides the choice.

A bucket can also come from a file in the engine's local source directory
(:meth:`BucketReceiver.fill_from_file`, for a trainer on the same host): the worker copies it
into the private staged file in strides, hashing each stride right after copying it, so what is
verified is exactly the private copy the scheduler will load, whatever happens to the source.

Nothing is accepted here: the caller commits the part (rename into the attempt's directory)
only after :meth:`BucketReceiver.finish` returned, and discards it otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import traceback
from typing import Any

from sglang_ext.adapter_compat import check_tensor_values
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.identity import Manifest, content_mismatch
from sglang_ext.staging import StagedPart, StagingArea
from sglang_ext.transport import (
    HEADER_PREFIX_BYTES,
    BucketSpec,
    PayloadLayout,
    bucket_checksum_of,
    check_layout_against_plan,
    header_length,
    parse_payload_layout,
)
from sglang_ext.wire import invalid

# Hash in strides of this many received bytes: small enough to track the socket closely,
# large enough that the thread hand-offs cost nothing next to the hashing.
HASH_STRIDE_BYTES = 1024 * 1024
# A local source file is copied and hashed in strides of this size (one pass over cache-hot data).
COPY_STRIDE_BYTES = 4 * 1024 * 1024
HASH_WHILE_RECEIVING_ENV = "SGLANG_LORA_VERSIONS_HASH_WHILE_RECEIVING"


def hash_while_receiving() -> bool:
    """Hash behind the socket only with cores to spare (see the module docstring)."""
    configured = os.environ.get(HASH_WHILE_RECEIVING_ENV)
    if configured is not None:
        return configured.strip() not in ("", "0", "false", "no")
    return len(os.sched_getaffinity(0)) > 2


# One hashing thread for the engine: strides of one bucket run in order, and concurrent buckets
# take turns instead of taking a core each from generation.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-versions-hash")


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
        self._submitted = 0
        self._jobs: list[asyncio.Future[None]] = []
        # worker-thread state: the tensor being hashed, how far, and the digests so far
        self._cursor = 0
        self._hashed = 0
        self._hasher: Any = None
        self._digests: dict[str, str] = {}
        self._error: BaseException | None = None
        self._stride = HASH_STRIDE_BYTES if hash_while_receiving() else None

    @property
    def received(self) -> int:
        return self._filled

    # ------------------------------------------------------------------------- event loop side

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the body (raises, and the read stops, on a defect)."""
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
        self.part.view[self._filled : end] = chunk
        self._filled = end
        if end == self.layout.size or (self._stride is not None and end - self._submitted >= self._stride):
            self._submit(end)

    async def fill_from_file(self, fd: int) -> None:
        """Take the bucket from an open local file (owned from here on: closed once read). The
        header is read and checked first, as for a body; then the worker thread copies the rest
        into the private staged file and hashes it. Refusals as for a body."""
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
            self.feed(os.pread(fd, HEADER_PREFIX_BYTES + n, 0))
            if self.layout is None:
                raise LoraVersionError(
                    ErrorCode.INCOMPLETE_BODY,
                    f"bucket {self.spec.index} source file ends inside its header",
                    received=self._filled,
                )
            size = os.fstat(fd).st_size
            if size > self.layout.size:
                raise invalid(
                    f"bucket {self.spec.index} source file is longer than its safetensors header says "
                    f"({self.layout.size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        loop = asyncio.get_running_loop()
        self._submitted = self.layout.size
        self._jobs.append(loop.run_in_executor(_HASHER, self._copy_and_hash, fd))
        await self._drain_jobs()

    def _copy_and_hash(self, fd: int) -> None:
        """Worker thread: copy the source into the mapped file stride by stride, hashing each
        stride once it is in the private copy. Owns ``fd`` and closes it."""
        assert self.part is not None and self.layout is not None
        try:
            view = self.part.view
            try:
                pos, size = self._filled, self.layout.size
                while pos < size and self._error is None:
                    stop = min(pos + COPY_STRIDE_BYTES, size)
                    got = os.preadv(fd, [view[pos:stop]], pos)
                    if got <= 0:
                        break  # the source shrank under us: INCOMPLETE_BODY in finish()
                    pos += got
                    self._filled = pos
                    self._hash_to(pos)
            finally:
                del view
        except OSError as exc:
            self._error = LoraVersionError(
                ErrorCode.INCOMPLETE_BODY, f"bucket {self.spec.index} source file unreadable: {exc.strerror}"
            )
        finally:
            os.close(fd)

    def _parse_header(self) -> bool:
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
        self.part = self.staging.new_part(layout.size)
        self.layout = layout
        return True

    def _submit(self, upto: int) -> None:
        self._submitted = upto
        loop = asyncio.get_running_loop()
        self._jobs.append(loop.run_in_executor(_HASHER, self._hash_to, upto))

    async def finish(self) -> None:
        """After the last chunk: wait for the hashing, then every content check. Raises
        INCOMPLETE_BODY, INVALID_REQUEST, CHECKSUM_MISMATCH or INCOMPATIBLE_ADAPTER."""
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
        checksum = bucket_checksum_of(self.part.view[: self.layout.header_end], self._digests)
        if checksum != self.declared_checksum:
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH, f"bucket {self.spec.index}: checksum does not match"
            )

    async def abandon(self) -> None:
        """Stop: wait for the hashing thread to let go of the mapping, then delete the file."""
        await self._drain_jobs()
        if self.part is not None:
            StagingArea.discard_part(self.part)
            self.part = None

    async def _drain_jobs(self) -> None:
        jobs, self._jobs = self._jobs, []
        if jobs:
            # shielded: the mapping must outlive the thread's reads even if our caller is cancelled
            await asyncio.shield(asyncio.gather(*jobs, return_exceptions=True))

    # ------------------------------------------------------------------------- hashing thread

    def _hash_to(self, upto: int) -> None:
        """Hash every tensor byte below ``upto`` not hashed yet; finish each tensor it completes.
        Runs on the one hashing thread, strides in order."""
        if self._error is not None:
            return
        assert self.part is not None and self.layout is not None
        spans = self.layout.tensors
        view = self.part.view
        try:
            while self._cursor < len(spans):
                span = spans[self._cursor]
                if self._hasher is None:
                    self._hasher = hashlib.sha256()
                    self._hashed = span.start
                stop = min(span.end, upto)
                if stop > self._hashed:
                    self._hasher.update(view[self._hashed : stop])
                    self._hashed = stop
                if self._hashed < span.end:
                    return  # the rest of this tensor has not arrived yet
                self._finish_tensor(view, span.name, span.dtype, span.shape, span.start, span.end)
                self._hasher = None
                self._cursor += 1
        except LoraVersionError as exc:
            # Dropped frames: a traceback that keeps a tensor over the mapping would keep the
            # mapping exported after the file is gone.
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            self._error = exc.with_traceback(None)
        except Exception as exc:  # a defect of ours: the bucket fails (a 500), never accepted
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__)
            self._error = exc
        finally:
            del view

    def _finish_tensor(
        self, view: memoryview, name: str, dtype: str, shape: tuple[int, ...], start: int, end: int
    ) -> None:
        digest = self._hasher.hexdigest()
        entry = self.manifest.entry(name)
        if entry is None or digest != entry.sha256:
            raise content_mismatch(name)
        self._digests[name] = digest
        if end > start:
            _check_values(view[start:end], name, dtype, shape)


def _check_values(raw: memoryview, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    import torch

    tensor = torch.frombuffer(raw, dtype=getattr(torch, dtype)).reshape(shape)
    try:
        check_tensor_values(name, tensor)
    finally:
        del tensor, raw
