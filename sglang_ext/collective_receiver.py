"""The collective transport's receiver: a child process of the engine's main process
(``python -m sglang_ext.collective_receiver``), one per engine incarnation's group.

Why a process of its own, and not receives posted in the scheduler or the main process: the
hazards of a torch collective receive cannot be contained inside the process that runs it
(SGLang 0.5.23, torch gloo):

- a sender that sends more bytes than the receive expects aborts the receiving process (gloo
  enforces the size in its own thread; nothing in Python can catch it);
- a pending receive cannot be cancelled, and destroying its group blocks until it times out;
- a receive waits for the group's timeout when the peer hangs.

Here each of those ends this process only. The engine's main process owns it
(:mod:`sglang_ext.collective_link`): it kills it to cancel (a cleanup during a transfer), it
enforces every deadline itself, and it sees an abort as the child's exit, a typed error, with
the engine serving throughout. The scheduler never runs a collective at all: the bytes land in
the engine's staged files, verified by the main process like any other bucket, and loaded by
SGLang's stock path load on every rank.

Protocol: one JSON command per line on stdin, one JSON event per line on the original stdout
(library prints go to stderr). Commands: ``connect`` (once, first), then ``expect`` jobs, run in
order. Events: ``connected``, ``bucket`` (one per bucket that arrived whole), ``failed`` (then the
process exits: after a failed receive the pair is out of step, and the group is not reused).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import signal
import sys
from typing import Any

from sglang_ext.bucket_receiver import BACKGROUND_NICE
from sglang_ext.collective_group import FRAME_BYTES, RECEIVER_RANK, Frame, broadcast, device_of, open_group

EXIT_FAILED = 2
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL when the engine's main process dies, whatever way it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(EXIT_FAILED)


class Receiver:
    def __init__(self, events_fd: int) -> None:
        self.events_fd = events_fd
        self.group: Any = None
        self.device = "cpu"

    def emit(self, **event: Any) -> None:
        os.write(self.events_fd, (json.dumps(event) + "\n").encode())

    def fail(self, reason: str, **where: Any) -> None:
        self.emit(ev="failed", reason=reason[:2000], **where)
        os._exit(EXIT_FAILED)  # no interpreter shutdown: a pending gloo op must not be waited for

    def connect(self, cmd: dict[str, Any]) -> None:
        self.device = device_of(cmd["backend"])
        try:
            self.group = open_group(
                cmd["init_method"], RECEIVER_RANK, cmd["group_id"], float(cmd["timeout_s"]), cmd["backend"]
            )
        except Exception as exc:
            self.fail(f"rendezvous failed: {type(exc).__name__}: {exc}")
        self.emit(ev="connected")

    def expect(self, cmd: dict[str, Any]) -> None:
        import torch

        job, tag = cmd["job"], bytes.fromhex(cmd["tag"])
        frame_buf = torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=self.device)
        for bucket in cmd["buckets"]:
            index, nbytes = int(bucket["index"]), int(bucket["nbytes"])
            try:
                broadcast(self.group, frame_buf)
            except Exception as exc:
                self.fail(f"bucket {index}: frame not received: {exc}", job=job, index=index)
            frame = Frame.decode(frame_buf.cpu().numpy().tobytes())
            if frame is None or (frame.index, frame.nbytes, frame.tag) != (index, nbytes, tag):
                got = "no frame" if frame is None else f"bucket {frame.index} of {frame.nbytes} bytes"
                self.fail(
                    f"expected bucket {index} of {nbytes} bytes of this attempt, the sender announced {got}",
                    job=job,
                    index=index,
                    code="MANIFEST_MISMATCH",
                )
            try:
                self._receive_into(bucket["path"], int(bucket["offset"]), nbytes)
            except Exception as exc:
                self.fail(f"bucket {index}: data not received: {exc}", job=job, index=index)
            self.emit(ev="bucket", job=job, index=index)

    def _receive_into(self, path: str, offset: int, nbytes: int) -> None:
        """Receive straight into the staged file's pages, after its header."""
        import torch

        if nbytes == 0:
            return
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, offset + nbytes)
        finally:
            os.close(fd)
        try:
            target = torch.frombuffer(mapping, dtype=torch.uint8, offset=offset, count=nbytes)
            if self.device == "cpu":
                broadcast(self.group, target)  # straight into the file's pages
            else:  # NCCL receives into device memory only (not run here: no GPU)
                staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                broadcast(self.group, staging)
                target.copy_(staging)
                del staging
            del target
        finally:
            with contextlib.suppress(BufferError):
                mapping.close()


def main() -> None:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(BACKGROUND_NICE)  # the engine's decode goes first (sglang_ext.bucket_receiver)
    events_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed by a library goes to the log, never into the event stream
    sys.stdout = sys.stderr
    receiver = Receiver(events_fd)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "connect":
            receiver.connect(cmd)
        elif cmd["op"] == "expect":
            receiver.expect(cmd)
    os._exit(0)  # stdin closed: the engine let go of this group


if __name__ == "__main__":
    main()
