"""The engine's end of its collective group, in the engine's main process: it owns the receiver
process (:mod:`sglang_ext.collective_receiver`), knows the group's state, and turns everything
that can go wrong with it into a typed error on the event loop, which never waits on a
collective itself.

States: ``NONE`` (never connected in this incarnation) -> ``CONNECTING`` -> ``CONNECTED``; any
failure (a rendezvous that timed out, a receive that failed, a deadline passed, a cleanup during
a transfer, the receiver's exit) -> ``BROKEN`` with its reason. A BROKEN or replaced group is
never used again: the receiver is killed (its pending receives end with it, at once) and the
trainer connects a new group. Every deadline is enforced here, by the clock of this process:
the receiver's own timeouts are a second line, not the one we rely on.

The receiver says how far each bucket got while it lands (:mod:`sglang_ext.collective_messages`),
so a cleanup during a transfer (:meth:`CollectiveLink.settle`, then :meth:`CollectiveLink.drop`)
waits for bytes that keep landing however slow the machine is, and breaks the group only for a
transfer that stopped or passed its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext import settings
from sglang_ext.collective_messages import (
    Arrived,
    Connect,
    Connected,
    Expect,
    ExpectedBucket,
    Failed,
    Message,
    MessageError,
    Progress,
    decode,
    encode,
)

# what starting the receiver (a Python process importing torch) may take on top of the rendezvous
RECEIVER_START_ALLOWANCE_S = 60.0
# A cleanup during a transfer waits as long as the receiver reports bytes landing (a trainer's
# broadcast returns once its bytes are on the wire, so a cleanup right after the last send finds
# them still landing, for as long as the machine's load makes it take). It gives up on a transfer
# the receiver has said nothing of for this long: its pieces land many times a second even on a
# starved CPU, so this silence means a trainer that stopped (or never sent); it is also what a
# cleanup of such an attempt costs before the group is broken.
SETTLE_STALL_S = 2.0


def collective_timeout_s() -> float:
    return float(settings.number(settings.COLLECTIVE_TIMEOUT_S))


class LinkState(StrEnum):
    NONE = "NONE"
    CONNECTING = "CONNECTING"
    CONNECTED = "CONNECTED"
    BROKEN = "BROKEN"


@dataclass
class Landing:
    """What the receiver last said of one job's transfer, by this process's clock."""

    heard: float  # its last word on the job (or when the receives were posted)
    bucket: int | None = None  # the bucket landing now (its frame accepted), None between buckets
    since: float = 0.0  # when that bucket's frame was accepted: its deadline runs from there


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failure nobody waits for is not an "exception never retrieved"


def transfer_failed(reason: str, **details: Any) -> LoraVersionError:
    return LoraVersionError(ErrorCode.TRANSFER_FAILED, reason, **details)


class CollectiveLink:
    def __init__(
        self,
        timeout_s: float | None = None,
        log: Callable[[str], None] | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
        self._log = log or (lambda _m: None)
        self._command = list(command or (sys.executable, "-m", "sglang_ext.collective_receiver"))
        self.state = LinkState.NONE
        self.group_id: str | None = None
        self.reason: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connected: asyncio.Future[None] | None = None
        # job -> bucket index -> arrival; a job is one attempt's transfer
        self._arrivals: dict[str, dict[int, asyncio.Future[None]]] = {}
        # job -> the group its receives were posted on (a job outlives its group only as a record)
        self._job_group: dict[str, str | None] = {}
        self._landing: dict[str, Landing] = {}
        # job -> why settle() gave up on it (said by the drop that breaks the group)
        self._unsettled: dict[str, str] = {}
        self._on_break: list[Callable[[str], None]] = []

    def on_break(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` whenever the group breaks (the publication drops its stashes)."""
        self._on_break.append(callback)

    # ------------------------------------------------------------------------- connect

    async def connect(self, group_id: str, init_method: str, backend: str) -> None:
        """Join the trainer's group ``group_id`` (idempotent for the group being set up or up).
        Another group id replaces the current one. Raises TRANSPORT_UNAVAILABLE when the
        rendezvous fails or does not end within the plugin's timeout; generation goes on
        meanwhile (the receiver joins; this loop only waits for its word)."""
        if self.group_id != group_id or self.state is LinkState.BROKEN:
            if self._proc is not None:
                self._break(f"replaced by group {group_id}")
            await self._start(group_id, init_method, backend)
        assert self._connected is not None
        try:
            await asyncio.wait_for(
                asyncio.shield(self._connected), self.timeout_s + RECEIVER_START_ALLOWANCE_S
            )
        except TimeoutError:
            self._break(f"rendezvous of group {group_id} did not end within {self.timeout_s:.0f} s")
        except LoraVersionError:
            pass
        if self.state is not LinkState.CONNECTED:
            raise self.unavailable()

    async def _start(self, group_id: str, init_method: str, backend: str) -> None:
        self.group_id, self.reason = group_id, None
        self.state = LinkState.CONNECTING
        loop = asyncio.get_running_loop()
        self._connected = loop.create_future()
        self._connected.add_done_callback(_retrieved)
        self._proc = await asyncio.create_subprocess_exec(
            *self._command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._reader = asyncio.create_task(self._read_events(self._proc))
        self._send(
            Connect(init_method=init_method, group_id=group_id, timeout_s=self.timeout_s, backend=backend)
        )
        self._log(f"collective group {group_id}: receiver pid {self._proc.pid} joining {init_method}")

    def unavailable(self) -> LoraVersionError:
        return LoraVersionError(
            ErrorCode.TRANSPORT_UNAVAILABLE,
            f"no usable collective group on this engine ({self.state.value}"
            + (f": {self.reason}" if self.reason else "")
            + "); connect one first",
            state=self.state.value,
            group_id=self.group_id,
        )

    def check_usable(self) -> None:
        if self.state is not LinkState.CONNECTED:
            raise self.unavailable()

    def check_idle(self) -> None:
        """One transfer at a time per group: the receiver runs jobs in order, so a new attempt's
        frames would meet an older attempt's pending receive. A trainer that moved on from an
        unfinished transfer without cleaning it up connects a new group (which takes the old
        receives with the old receiver)."""
        self.check_usable()
        pending = sorted(
            job for job, arrivals in self._arrivals.items() if any(not f.done() for f in arrivals.values())
        )
        if pending:
            raise LoraVersionError(
                ErrorCode.TRANSPORT_UNAVAILABLE,
                "the collective group is busy with another attempt's transfer; clean that attempt up "
                "or connect a new group",
                state=self.state.value,
                group_id=self.group_id,
            )

    # ------------------------------------------------------------------------- transfers

    def expect(self, job: str, tag: bytes, buckets: Sequence[ExpectedBucket]) -> None:
        """Post the receives of one attempt's buckets, in order (the receiver runs them after any
        earlier job). Returns at once."""
        self.check_usable()
        loop = asyncio.get_running_loop()
        arrivals: dict[int, asyncio.Future[None]] = {}
        for b in buckets:
            fut = loop.create_future()
            fut.add_done_callback(_retrieved)
            arrivals[b.index] = fut
        self._arrivals[job] = arrivals
        self._job_group[job] = self.group_id
        self._landing[job] = Landing(heard=loop.time())
        self._send(Expect(job=job, tag=tag, buckets=tuple(buckets)))

    def _arrival_of(self, job: str, index: int) -> asyncio.Future[None]:
        fut = self._arrivals.get(job, {}).get(index)
        if fut is None:
            raise transfer_failed(f"bucket {index} is not expected over the collective group")
        return fut

    def receives(self, job: str) -> bool:
        """Whether ``job``'s receives are posted on the group in use now (not dropped, and not
        on a group that broke or was replaced since)."""
        return (
            job in self._arrivals
            and self.state is LinkState.CONNECTED
            and self._job_group.get(job) == self.group_id
        )

    async def arrival(self, job: str, index: int) -> None:
        """Wait (at most the plugin's timeout) until bucket ``index`` of ``job`` arrived whole.
        TRANSFER_FAILED when it cannot: the group broke, or the deadline passed (which breaks
        the group the job's receives are on, never a later one: the sender is out of step or
        gone)."""
        fut = self._arrival_of(job, index)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            if self.receives(job):
                self._break(f"bucket {index} did not arrive within {self.timeout_s:.0f} s")
            raise transfer_failed(f"bucket {index} did not arrive within {self.timeout_s:.0f} s") from None

    async def arrived_whole(self, job: str, index: int) -> None:
        """Wait, without a deadline of its own, for bucket ``index`` of ``job`` (TRANSFER_FAILED
        if the group breaks first)."""
        await asyncio.shield(self._arrival_of(job, index))

    def arrived(self, job: str, index: int) -> bool:
        fut = self._arrivals.get(job, {}).get(index)
        return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None

    async def settle(self, job: str, stall_s: float = SETTLE_STALL_S) -> None:
        """Wait while ``job``'s pending receives keep landing (they may be the last bytes of a
        transfer the trainer already finished), so that :meth:`drop` only kills the receiver for
        a transfer that is really not going to end. Returns once they all landed; or once the
        receiver has said nothing of them for ``stall_s`` (counted from this call at the
        earliest); or once the bucket landing now is past the receiver's per-bucket deadline
        (``timeout_s`` from its frame). It breaks nothing itself."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while pending := [f for f in self._arrivals.get(job, {}).values() if not f.done()]:
            landing = self._landing.get(job) or Landing(heard=start)
            give_up = max(start, landing.heard) + stall_s
            verdict = f"nothing of it landed for {stall_s:g} s"
            if landing.bucket is not None and landing.since + self.timeout_s < give_up:
                give_up = landing.since + self.timeout_s
                verdict = f"bucket {landing.bucket} did not land within {self.timeout_s:g} s"
            now = loop.time()
            if now >= give_up:
                self._unsettled[job] = verdict
                return
            await asyncio.wait(pending, timeout=give_up - now)

    def drop(self, job: str) -> None:
        """The attempt is over (READY, or cleaned up). If some of its receives are still pending,
        the receiver is killed with them (a cleanup during a transfer): a pending receive is
        never destroyed in place."""
        verdict = self._unsettled.pop(job, None)
        if any(not f.done() for f in self._arrivals.get(job, {}).values()):
            # broken while the job is still listed, so its waits end now (TRANSFER_FAILED), not
            # at their deadline, when they would break whatever group is in use then
            self._break(
                f"a transfer was dropped before it ended (job {job}{': ' + verdict if verdict else ''})"
            )
        self._arrivals.pop(job, None)
        self._job_group.pop(job, None)
        self._landing.pop(job, None)

    # ------------------------------------------------------------------------- the receiver

    def _send(self, cmd: Message) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(encode(cmd))
        except (BrokenPipeError, ConnectionResetError):
            self._break("the receiver process is gone")
            raise self.unavailable() from None

    async def _read_events(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            if proc is not self._proc:
                break  # a replaced receiver: its words no longer count
            try:
                event = decode(line)
            except MessageError as exc:
                # not one of our messages: what else it said (or missed) cannot be trusted
                self._break(f"the receiver is out of protocol: {exc}")
                break
            self._heard(event)
        code = await proc.wait()
        if proc is self._proc:
            self._break(f"the receiver process exited with code {code}")

    def _heard(self, event: Message) -> None:
        now = asyncio.get_running_loop().time()
        match event:
            case Connected() if self._connected is not None and not self._connected.done():
                self.state = LinkState.CONNECTED
                self._connected.set_result(None)
                self._log(f"collective group {self.group_id}: connected")
            case Progress(job=job, index=index, landed=landed) if job in self._landing:
                landing = self._landing[job]
                landing.heard = now
                if landed == 0 or landing.bucket != index:  # its frame was accepted: a bucket starts
                    landing.bucket, landing.since = index, now
            case Arrived(job=job, index=index):
                fut = self._arrivals.get(job, {}).get(index)
                if fut is not None and not fut.done():
                    fut.set_result(None)
                if job in self._landing:
                    self._landing[job].heard, self._landing[job].bucket = now, None
            case Failed():
                self._break(event.reason, event)
            case Connect() | Expect():
                self._break(f"the receiver sent a command: {event}")

    def _break(self, reason: str, refusal: Failed | None = None) -> None:
        """The group is unusable from here on: the receiver goes (with any pending receive), and
        every wait on it ends with TRANSFER_FAILED, but the wait for the bucket the receiver
        refused (``refusal``), which ends with the refusal's own code (e.g. MANIFEST_MISMATCH:
        the sender's bucket is not the plan's, no transport fault)."""
        if self.state is not LinkState.BROKEN:
            self._log(f"collective group {self.group_id} unusable: {reason}")
        self.state, self.reason = LinkState.BROKEN, reason
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            if proc.stdin is not None:
                proc.stdin.close()
        if self._connected is not None and not self._connected.done():
            self._connected.set_exception(self.unavailable())
        error = transfer_failed(f"the collective transfer failed: {reason}")
        refused: tuple[str | None, int | None, LoraVersionError] | None = None
        if refusal is not None and refusal.code is not ErrorCode.TRANSFER_FAILED:
            refused = refusal.job, refusal.index, LoraVersionError(refusal.code, reason, index=refusal.index)
        for job, arrivals in self._arrivals.items():
            for index, fut in arrivals.items():
                if not fut.done():
                    fut.set_exception(refused[2] if refused and refused[:2] == (job, index) else error)
        for callback in self._on_break:
            callback(reason)

    async def close(self) -> None:
        reader = self._reader
        if self._proc is not None:
            self._break("the engine is shutting down")
        if reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader, 10)
