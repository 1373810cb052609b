"""The collective transport's group and its wire frames, shared by the trainer (rank 0, the
sender) and the engine's receiver process (rank 1).

One group per engine incarnation: the trainer and that engine's receiver, nothing else, so a
failure of one engine never breaks another engine's group. The group is a torch ``ProcessGroup``
built directly on a ``TCPStore`` (never torch's global default group: the trainer may have its
own, and talks to many engines). ``gloo`` on CPU; ``nccl`` is the same code with device buffers,
and has not run here (no GPU).

What travels, per bucket, in plan order (each a broadcast from rank 0):

1. a frame of exactly :data:`FRAME_BYTES`: magic, the bucket index, its tensor byte count, and a
   tag of the attempt token;
2. exactly that many bytes: the bucket's tensors in the canonical layout
   (:func:`sglang_ext.transport.bucket_header` describes them; the receiver writes them after
   that header, so the file is the very payload the HTTP transport would have carried).

The receiver checks the frame against its plan before it posts the data receive, so a sender
with another idea of the sizes is refused before any byte lands in a wrong-sized buffer.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from sglang_ext.wire import invalid

FRAME_MAGIC = b"LVCB"
FRAME_VERSION = 1
FRAME_BYTES = 64
_FRAME = struct.Struct("<4sIQQ16s")  # magic, version, index, nbytes, token tag (48 bytes)
BACKENDS = ("gloo", "nccl")
SENDER_RANK = 0
RECEIVER_RANK = 1
WORLD_SIZE = 2


def token_tag(attempt_token: str) -> bytes:
    return hashlib.sha256(attempt_token.encode()).digest()[:16]


@dataclass(frozen=True)
class Frame:
    index: int
    nbytes: int
    tag: bytes

    def encode(self) -> bytes:
        raw = _FRAME.pack(FRAME_MAGIC, FRAME_VERSION, self.index, self.nbytes, self.tag)
        return raw + b"\0" * (FRAME_BYTES - len(raw))

    @classmethod
    def decode(cls, raw: bytes) -> Frame | None:
        """None unless ``raw`` is a frame of this version."""
        if len(raw) != FRAME_BYTES:
            return None
        magic, version, index, nbytes, tag = _FRAME.unpack_from(raw)
        if magic != FRAME_MAGIC or version != FRAME_VERSION:
            return None
        return cls(index=index, nbytes=nbytes, tag=tag)


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
    import torch.distributed as dist

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
    import torch.distributed as dist

    return dist.TCPStore(
        host, port, WORLD_SIZE, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def device_of(backend: str) -> str:
    """Where a backend's buffers live: NCCL moves device memory only (not run here: no GPU)."""
    return "cuda" if backend == "nccl" else "cpu"


def broadcast(group: Any, tensor: Any) -> None:
    """One broadcast from the sender, waited for (raises on a broken peer or a timeout)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = SENDER_RANK
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()
