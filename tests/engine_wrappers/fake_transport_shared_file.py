"""A third bucket transport, for tests only: "shared-file", plugged in through the registries
alone (no edit to the contract, the route, the shell, the client or the publisher).

The trainer writes each bucket as a file of a directory both processes see (this host's temp
directory, one subdirectory per engine incarnation, learnt from the begin receipt) and
acknowledges it with an empty body that names the transport; the engine reads the file in the
acknowledgement, verifies it like any bucket and the trainer removes it once the call returned.
Each side registers its own end under the contract's name:

- :func:`register_engine_side` in the engine's main process (E1's launch wrapper,
  ``sglang_with_scheduler_probes.py``, imports this module and calls it before the server starts);
- :func:`register_trainer_side` in the test process.

:attr:`SharedFileSender.drop` is the test's fault: the buckets whose index it names are
acknowledged without their file ever being written (a delivery that lost them).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import BeginRequest, BucketAck, ReceiveBucketMeta, register_transport

SHARED_FILE = "shared-file"
# one directory per user on this host: the engine and the trainer compute the same path
SHARED_DIR = Path(tempfile.gettempdir()) / f"lora-versions-shared-file-{os.getuid()}"


def bucket_path(directory: Path, attempt_token: str, index: int) -> Path:
    return directory / f"{attempt_token}-{index}.safetensors"


# ------------------------------------------------------------------------------ engine side


class SharedFileReceive:
    """The engine's end (an ``sglang_ext.bucket_sources.OutOfBandReceive``)."""

    transport = SHARED_FILE

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._attempts: set[tuple[str, str]] = set()

    def setup_routes(self) -> Sequence[Any]:
        return ()

    def receiving(self, key: tuple[str, str]) -> bool:
        return key in self._attempts

    def check_ready(self, _channel: str | None) -> None:
        if not self.directory.is_dir():
            raise LoraVersionError(ErrorCode.TRANSPORT_UNAVAILABLE, f"no shared directory {self.directory}")

    def prepare(self, key: tuple[str, str], _version: Any) -> None:
        self._attempts.add(key)

    def filler(self, meta: ReceiveBucketMeta) -> Any:
        key = (meta.lora_name, meta.attempt_token)

        async def fill(_cap: int, receiver: Any) -> None:
            if key not in self._attempts:
                raise LoraVersionError(ErrorCode.TRANSFER_FAILED, "this attempt is not received here")
            path = bucket_path(self.directory, meta.attempt_token, meta.index)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                raise LoraVersionError(
                    ErrorCode.TRANSFER_FAILED, f"bucket {meta.index} never reached the shared directory"
                ) from None
            await receiver.fill_from_file(fd)  # verified like a body; the fd is the receiver's now

        return fill

    async def settle(self, _key: tuple[str, str]) -> None:
        return None

    def forget(self, key: tuple[str, str]) -> None:
        self._attempts.discard(key)


def register_engine_side(directory: Path = SHARED_DIR) -> None:
    from sglang_ext.bucket_sources import register_receive

    register_transport(SHARED_FILE)
    register_receive(SHARED_FILE, lambda setup: SharedFileReceive(directory / setup.incarnation))


# ----------------------------------------------------------------------------- trainer side


def register_trainer_side(directory: Path = SHARED_DIR) -> None:
    from relax_glue.bucket_transport import BucketTransport, EngineCalls, register_sender

    class SharedFileSender(BucketTransport):
        """The trainer's end: ``drop`` names bucket indexes whose file is never written."""

        begin_transport = SHARED_FILE

        def __init__(self, directory: Path = directory, drop: frozenset[int] = frozenset()) -> None:
            self.directory = directory
            self.drop = drop
            self.sent: list[int] = []  # indexes acknowledged through this transport
            self.incarnation: dict[str, str] = {}  # attempt token -> the engine's, from its begin

        async def begin(self, req: BeginRequest, engine: EngineCalls) -> Any:
            receipt = await super().begin(req, engine)
            self.incarnation[req.attempt_token] = receipt.incarnation
            return receipt

        async def send(self, meta: ReceiveBucketMeta, payload: bytes, engine: EngineCalls) -> BucketAck:
            where = self.directory / self.incarnation[meta.attempt_token]
            path = bucket_path(where, meta.attempt_token, meta.index)
            if meta.index not in self.drop:
                await asyncio.to_thread(_write_whole, path, payload)
            try:
                self.sent.append(meta.index)
                return await engine.post_bucket(meta.model_copy(update={"transport": SHARED_FILE}), b"")
            finally:
                path.unlink(missing_ok=True)

    register_transport(SHARED_FILE)
    register_sender(SHARED_FILE, SharedFileSender)


def _write_whole(path: Path, payload: bytes) -> None:
    """The file appears whole or not at all (written aside, then renamed into place)."""
    aside = path.with_suffix(".part")
    aside.write_bytes(payload)
    os.replace(aside, path)
