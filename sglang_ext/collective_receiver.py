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

Protocol (:mod:`sglang_ext.collective_messages`): one command per line on stdin, one event per
line on the original stdout (library prints go to stderr). While a bucket lands it reports how
far it got (:class:`~sglang_ext.collective_messages.Progress` as its pieces land, at most every
:data:`PROGRESS_EVERY_S`): the engine decides from that whether a transfer is still going, not
from a guess of how long one takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import sys
import time
from typing import Any, NoReturn

from lora_contract.collective_group import (
    FRAME_BYTES,
    RECEIVER_RANK,
    Frame,
    broadcast,
    broadcast_pieces,
    device_of,
    open_group,
)
from lora_contract.errors import ErrorCode
from sglang_ext.bucket_receiver import BACKGROUND_NICE
from sglang_ext.collective_messages import (
    Arrived,
    Connect,
    Connected,
    Expect,
    ExpectedBucket,
    Failed,
    Message,
    Progress,
    decode,
    encode,
)

EXIT_FAILED = 2
_PR_SET_PDEATHSIG = 1
# Progress is reported after a piece lands, at most this often (a sender of tiny pieces must not
# flood the engine's event loop), so the engine hears of a landing transfer several times a
# second however small or large its pieces.
PROGRESS_EVERY_S = 0.05


def _die_with_parent() -> None:
    """SIGKILL when the engine's main process dies, whatever way it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(EXIT_FAILED)


def _yield_to_decode() -> None:
    """Every thread of this process at :data:`BACKGROUND_NICE` (Linux nice is per thread: gloo's
    worker threads, started by the join, run the receives)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(tid), BACKGROUND_NICE)


class Receiver:
    def __init__(self, events_fd: int) -> None:
        self.events_fd = events_fd
        self.group: Any = None
        self.device = "cpu"
        self.timeout_s = 0.0

    def emit(self, event: Message) -> None:
        os.write(self.events_fd, encode(event))

    def fail(
        self,
        reason: str,
        code: ErrorCode = ErrorCode.TRANSFER_FAILED,
        job: str | None = None,
        index: int | None = None,
    ) -> NoReturn:
        self.emit(Failed(reason=reason[:2000], code=code, job=job, index=index))
        os._exit(EXIT_FAILED)  # no interpreter shutdown: a pending gloo op must not be waited for

    def connect(self, cmd: Connect) -> None:
        self.device = device_of(cmd.backend)
        self.timeout_s = cmd.timeout_s
        try:
            self.group = open_group(cmd.init_method, RECEIVER_RANK, cmd.group_id, cmd.timeout_s, cmd.backend)
        except Exception as exc:
            self.fail(f"rendezvous failed: {type(exc).__name__}: {exc}")
        # Only now does the receiver yield to the engine's decode (sglang_ext.bucket_receiver):
        # the torch import and the join are short, once per group, and bounded by the trainer's
        # rendezvous deadline, which a receiver at background priority on a busy machine missed
        # (a CI run: 30 and 50 s to join beside two booting engines); the receives are long.
        _yield_to_decode()
        self.emit(Connected())

    def expect(self, cmd: Expect) -> None:
        import torch  # lazy heavy import: only a collective transfer needs it

        frame_buf = torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=self.device)
        for bucket in cmd.buckets:
            index = bucket.index
            try:
                broadcast(self.group, frame_buf)
            except Exception as exc:
                self.fail(f"bucket {index}: frame not received: {exc}", job=cmd.job, index=index)
            frame = Frame.decode(frame_buf.cpu().numpy().tobytes())
            if frame is None:
                self.fail(
                    f"expected bucket {index} of this attempt, the sender sent no frame of this version",
                    job=cmd.job,
                    index=index,
                )
            refusal = frame.refusal(index, bucket.nbytes, cmd.tag)
            if refusal is not None:
                self.fail(refusal[1], refusal[0], job=cmd.job, index=index)
            self.emit(Progress(job=cmd.job, index=index, landed=0))
            try:
                self._receive_into(cmd.job, bucket, frame.piece_bytes)
            except Exception as exc:
                self.fail(f"bucket {index}: data not received: {exc}", job=cmd.job, index=index)
            self.emit(Arrived(job=cmd.job, index=index))

    def _receive_into(self, job: str, bucket: ExpectedBucket, piece_bytes: int) -> None:
        """Receive straight into the staged file's pages, after its header, piece by piece,
        reporting how far it got; within this receiver's per-bucket deadline (the group's
        timeout, counted from the frame), which the engine applies too."""
        import torch  # lazy heavy import: only a collective transfer needs it

        nbytes = bucket.nbytes
        if nbytes == 0:
            return
        started = last_report = time.monotonic()

        def landed(so_far: int) -> None:
            nonlocal last_report
            now = time.monotonic()
            if so_far < nbytes and now - started > self.timeout_s:
                self.fail(
                    f"bucket {bucket.index}: {so_far} of {nbytes} bytes landed within {self.timeout_s:.0f} s",
                    job=job,
                    index=bucket.index,
                )
            if so_far < nbytes and now - last_report >= PROGRESS_EVERY_S:
                self.emit(Progress(job=job, index=bucket.index, landed=so_far))
                last_report = now

        fd = os.open(bucket.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, bucket.offset + nbytes)
        finally:
            os.close(fd)
        try:
            target = torch.frombuffer(mapping, dtype=torch.uint8, offset=bucket.offset, count=nbytes)
            if self.device == "cpu":
                broadcast_pieces(self.group, target, piece_bytes, landed)  # straight into the file's pages
            else:  # NCCL receives into device memory only (not run here: no GPU)
                staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                broadcast_pieces(self.group, staging, piece_bytes, landed)
                target.copy_(staging)
                del staging
            del target
        finally:
            with contextlib.suppress(BufferError):
                mapping.close()


def main() -> None:
    _die_with_parent()
    events_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed by a library goes to the log, never into the event stream
    sys.stdout = sys.stderr
    receiver = Receiver(events_fd)
    for line in sys.stdin:
        try:
            cmd = decode(line)
        except ValueError as exc:
            receiver.fail(f"unreadable command: {exc}")
        if isinstance(cmd, Connect):
            receiver.connect(cmd)
        elif isinstance(cmd, Expect):
            receiver.expect(cmd)
        else:
            receiver.fail(f"not a command: {cmd}")
    os._exit(0)  # stdin closed: the engine let go of this group


if __name__ == "__main__":
    main()
