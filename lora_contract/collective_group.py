"""The collective transport's group and its wire frames, shared by the trainer (rank 0, the
sender) and the engine's receiver process (rank 1).

One group per engine incarnation: the trainer and that engine's receiver, nothing else, so a
failure of one engine never breaks another engine's group. The group is a torch ``ProcessGroup``
built directly on a ``TCPStore`` (never torch's global default group: the trainer may have its
own, and talks to many engines). ``gloo`` on CPU; ``nccl`` is the same code with device buffers,
and has not run here (no GPU).

What travels, per bucket, in plan order (each a broadcast from rank 0):

1. a frame of exactly :data:`FRAME_BYTES`: magic, the bucket index, its tensor byte count, a
   tag of the attempt token, and the piece size the sender cuts the bytes into;
2. exactly that many bytes: the bucket's tensors in the canonical layout
   (:func:`lora_contract.transport.bucket_header` describes them; the receiver writes them after
   that header, so the file is the very payload the HTTP transport would have carried), one
   broadcast per piece (:func:`pieces`). Pieces are what lets the receiver say how far a bucket
   got while it lands (a single broadcast says nothing until its last byte): the engine waits
   for bytes that keep landing and gives up only on a transfer that stopped.

The receiver checks the frame against its plan before it posts the data receive, so a sender
with another idea of the sizes is refused before any byte lands in a wrong-sized buffer.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from lora_contract.errors import ErrorCode
from lora_contract.wire_models import invalid

FRAME_MAGIC = b"LVCB"
FRAME_VERSION = 2  # 2: the piece size travels in the frame
FRAME_BYTES = 64
_FRAME = struct.Struct("<4sIQQ16sQ")  # magic, version, index, nbytes, token tag, piece bytes (56 bytes)
# The sender's piece size: small enough that a bucket reports progress many times a second on a
# starved CPU, large enough that the per-broadcast cost stays out of the throughput (measured on
# gloo over loopback: 256 MiB in 1, 4 or 16 MiB pieces within the noise of one broadcast).
PIECE_BYTES = 4 << 20
BACKENDS = ("gloo", "nccl")
SENDER_RANK = 0
RECEIVER_RANK = 1
WORLD_SIZE = 2


def token_tag(attempt_token: str) -> bytes:
    return hashlib.sha256(attempt_token.encode()).digest()[:16]


@dataclass(frozen=True)
class Frame:
    """``piece_bytes``: the bytes follow in broadcasts of that size (the last one shorter); 0,
    in one broadcast."""

    index: int
    nbytes: int
    tag: bytes
    piece_bytes: int = 0

    def encode(self) -> bytes:
        raw = _FRAME.pack(FRAME_MAGIC, FRAME_VERSION, self.index, self.nbytes, self.tag, self.piece_bytes)
        return raw + b"\0" * (FRAME_BYTES - len(raw))

    @classmethod
    def decode(cls, raw: bytes) -> Frame | None:
        """None unless ``raw`` is a frame of this version."""
        if len(raw) != FRAME_BYTES:
            return None
        magic, version, index, nbytes, tag, piece_bytes = _FRAME.unpack_from(raw)
        if magic != FRAME_MAGIC or version != FRAME_VERSION:
            return None
        return cls(index=index, nbytes=nbytes, tag=tag, piece_bytes=piece_bytes)

    def refusal(self, index: int, nbytes: int, tag: bytes) -> tuple[ErrorCode, str] | None:
        """Why the receiver that expects bucket ``index`` of ``nbytes`` bytes of the attempt
        tagged ``tag`` must not post the data receive for this frame (None: it may). Another
        attempt's frame says nothing about this plan, so the tag is asked first."""
        if self.tag != tag:
            return ErrorCode.STALE_ATTEMPT, (
                f"expected bucket {index} of this attempt, the sender announced a bucket of another attempt"
            )
        if (self.index, self.nbytes) != (index, nbytes):
            return ErrorCode.MANIFEST_MISMATCH, (
                f"expected bucket {index} of {nbytes} bytes of this attempt, the sender announced "
                f"bucket {self.index} of {self.nbytes} bytes"
            )
        return None


def pieces(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` byte spans of a bucket's broadcasts, in order (both sides cut the
    same way from the frame)."""
    step = piece_bytes if 0 < piece_bytes < nbytes else nbytes
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)] if nbytes else []


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); INVALID_REQUEST otherwise."""
    try:
        parts = urlsplit(init_method)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if (
        parts is None
        or parts.scheme != "tcp"
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
    ):
        raise invalid(f"init_method must be tcp://host:port, got {init_method[:200]!r}")
    return parts.hostname, port


def open_group(
    init_method: str,
    rank: int,
    group_id: str,
    timeout_s: float,
    backend: str = "gloo",
    store: Any = None,
) -> Any:
    """This side's process group of the pair. Blocks until both sides joined or ``timeout_s``
    passed (raising); every later operation on it times out after ``timeout_s`` too.

    ``store``: rank 0 passes the ``TCPStore`` it hosts (created by :func:`host_store`)."""
    import torch.distributed as dist  # lazy heavy import: only a collective transport needs it

    if backend not in BACKENDS:
        raise invalid(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        host, port = parse_init_method(init_method)
        store = dist.TCPStore(host, port, WORLD_SIZE, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"lora-versions/{group_id}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, WORLD_SIZE, timeout)
    options = dist.ProcessGroupNCCL.Options()  # pragma: no cover - needs a GPU
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, WORLD_SIZE, options)


def host_store(host: str, port: int, timeout_s: float) -> Any:
    """The trainer's rendezvous store (rank 0 hosts it; port 0 picks a free one)."""
    import torch.distributed as dist  # lazy heavy import: only a collective transport needs it

    return dist.TCPStore(
        host, port, WORLD_SIZE, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def device_of(backend: str) -> str:
    """Where a backend's buffers live: NCCL moves device memory only (not run here: no GPU)."""
    return "cuda" if backend == "nccl" else "cpu"


def broadcast(group: Any, tensor: Any) -> None:
    """One broadcast from the sender, waited for (raises on a broken peer or a timeout)."""
    import torch.distributed as dist  # lazy heavy import: only a collective transport needs it

    opts = dist.BroadcastOptions()
    opts.rootRank = SENDER_RANK
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def broadcast_pieces(
    group: Any, tensor: Any, piece_bytes: int, landed: Callable[[int], None] | None = None
) -> None:
    """A bucket's bytes (a flat uint8 ``tensor``) as the frame announced them: one broadcast
    per piece, in order; ``landed(bytes so far)`` after each one."""
    for start, end in pieces(tensor.numel(), piece_bytes):
        broadcast(group, tensor[start:end])
        if landed is not None:
            landed(end)
