"""The engine's end of a collective group, against the real receiver process and a real gloo
peer (this test process as the trainer), without an engine: every way the group can fail ends
in a typed error within the link's own deadline, with the receiver gone and nothing waited on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _eventually import eventually
from _procs import thread_nices

from lora_contract.collective_group import (
    PIECE_BYTES,
    Frame,
    broadcast,
    broadcast_pieces,
    host_store,
    open_group,
    token_tag,
)
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue import collective_sender
from relax_glue.collective_sender import CollectiveSender
from sglang_ext.bucket_receiver import BACKGROUND_NICE
from sglang_ext.collective_link import SETTLE_STALL_S, CollectiveLink, ExpectedBucket, LinkState

TAG = token_tag("attempt-1")


class Trainer:
    """Rank 0: hosts the store, joins on a thread while the link's receiver joins."""

    def __init__(self, timeout_s: float = 10.0, *, join_now: bool = True) -> None:
        self.store = host_store("127.0.0.1", 0, timeout_s)
        self.group_id = uuid.uuid4().hex
        self.init_method = f"tcp://127.0.0.1:{self.store.port}"
        self.group: Any = None
        self._joiner = threading.Thread(target=self._join, args=(timeout_s,), daemon=True)
        if join_now:
            self.join_now()

    def join_now(self) -> None:
        self._joiner.start()

    def _join(self, timeout_s: float) -> None:
        self.group = open_group(self.init_method, 0, self.group_id, timeout_s, "gloo", self.store)

    def joined(self) -> None:
        self._joiner.join(30)
        assert self.group is not None

    def send(self, index: int, data: bytes, announce: int | None = None) -> None:
        frame = Frame(
            index=index, nbytes=len(data) if announce is None else announce, tag=TAG, piece_bytes=PIECE_BYTES
        )
        broadcast(self.group, torch.frombuffer(bytearray(frame.encode()), dtype=torch.uint8))
        broadcast_pieces(self.group, torch.frombuffer(bytearray(data), dtype=torch.uint8), PIECE_BYTES)


def part_file(tmp_path: Path, name: str, size: int) -> Path:
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(size)
    return path


async def connected(timeout_s: float = 10.0) -> tuple[CollectiveLink, Trainer]:
    link = CollectiveLink(timeout_s=timeout_s)
    trainer = Trainer(30.0)  # the trainer waits for the receiver process to start
    await link.connect(trainer.group_id, trainer.init_method, "gloo")
    trainer.joined()
    assert link.state is LinkState.CONNECTED
    return link, trainer


def receiver_pid(link: CollectiveLink) -> int:
    assert link._proc is not None
    return link._proc.pid


def gone(pid: int) -> bool:
    """Exited (a zombie not reaped yet counts). The process may be reaped between the two
    looks: its /proc entry is then gone too (seen in CI as ProcessLookupError from the read)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


def mapped(pid: int, library: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()


async def test_the_receiver_joins_at_the_engines_priority_and_receives_behind_its_decode() -> None:
    """The torch import and the join are short and bounded by the trainer's rendezvous deadline:
    at background priority, beside two booting engines, a receiver took 30 and 50 s to join
    (CI) and the trainer gave up. Once joined, every thread of the receiver (gloo's workers run
    the receives) yields to the engine's decode."""
    link = CollectiveLink(timeout_s=30.0)
    trainer = Trainer(30.0, join_now=False)  # the receiver waits in the rendezvous for rank 0
    connecting = asyncio.ensure_future(link.connect(trainer.group_id, trainer.init_method, "gloo"))
    await _until(lambda: link._proc is not None)
    pid = receiver_pid(link)
    await eventually(lambda: mapped(pid, "libtorch_cpu"), timeout=60.0, poll_s=0.05)
    await asyncio.sleep(0.5)  # in open_group now, waiting for the trainer
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert set(thread_nices(pid).values()) == {own}, thread_nices(pid)
    trainer.join_now()
    await connecting
    trainer.joined()
    nices = thread_nices(pid)
    assert len(nices) > 1 and set(nices.values()) == {BACKGROUND_NICE}, nices
    await link.close()


async def test_buckets_land_after_their_header_and_the_group_goes_idle(tmp_path: Path) -> None:
    link, trainer = await connected()
    data = [os.urandom(1000), os.urandom(5000)]
    paths = [part_file(tmp_path, f"p{i}", 16 + len(d)) for i, d in enumerate(data)]
    link.expect("job-1", TAG, [ExpectedBucket(i, len(d), paths[i], 16) for i, d in enumerate(data)])
    with pytest.raises(LoraVersionError) as err:
        link.check_idle()  # one transfer at a time
    assert err.value.code is ErrorCode.TRANSPORT_UNAVAILABLE and "busy" in err.value.message
    for i, d in enumerate(data):
        await asyncio.to_thread(trainer.send, i, d)
        await link.arrival("job-1", i)
        assert paths[i].read_bytes() == b"\0" * 16 + d
    assert link.arrived("job-1", 1)
    link.check_idle()
    link.drop("job-1")
    assert link.state is LinkState.CONNECTED  # nothing was pending: the group stays
    await link.close()


async def test_a_frame_that_disagrees_is_refused_before_the_data_receive(tmp_path: Path) -> None:
    """The receiver's refusal reaches the caller with its own code: the sender's bucket is not
    the plan's (MANIFEST_MISMATCH, as the HTTP transport says of such a bucket), not a transport
    fault to retry."""
    link, trainer = await connected()
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    pid = receiver_pid(link)
    sender = threading.Thread(target=lambda: _quiet(trainer.send, 0, b"x" * 101), daemon=True)
    sender.start()
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-1", 0)
    assert err.value.code is ErrorCode.MANIFEST_MISMATCH, err.value
    assert "announced bucket 0 of 101 bytes" in err.value.message
    assert path.read_bytes() == b"\0" * 116  # no byte landed
    assert link.state is LinkState.BROKEN
    await _until(lambda: gone(pid))
    with pytest.raises(LoraVersionError) as err:
        link.check_usable()
    assert err.value.code is ErrorCode.TRANSPORT_UNAVAILABLE
    await link.close()


async def test_a_frame_of_another_attempt_is_refused_as_stale(tmp_path: Path) -> None:
    """A frame tagged with another attempt's token: STALE_ATTEMPT, the later buckets of the job
    TRANSFER_FAILED (the group broke under them), the group gone."""
    link, trainer = await connected()
    paths = [part_file(tmp_path, f"p{i}", 16 + 100) for i in range(2)]
    link.expect("job-1", token_tag("attempt-2"), [ExpectedBucket(i, 100, paths[i], 16) for i in range(2)])
    sender = threading.Thread(target=lambda: _quiet(trainer.send, 0, b"x" * 100), daemon=True)
    sender.start()
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-1", 0)
    assert err.value.code is ErrorCode.STALE_ATTEMPT and "another attempt" in err.value.message, err.value
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-1", 1)
    assert err.value.code is ErrorCode.TRANSFER_FAILED, err.value
    assert link.state is LinkState.BROKEN
    await link.close()


async def test_more_bytes_than_announced_end_the_receiver_only(tmp_path: Path) -> None:
    link, trainer = await connected()
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    sender = threading.Thread(target=lambda: _quiet(trainer.send, 0, b"x" * 4196, 100), daemon=True)
    sender.start()
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-1", 0)
    assert err.value.code is ErrorCode.TRANSFER_FAILED
    assert link.state is LinkState.BROKEN  # this process (the "engine") is fine
    await link.close()


async def test_a_trainer_that_never_sends_costs_the_deadline_not_the_default(tmp_path: Path) -> None:
    link, _trainer = await connected(timeout_s=2.0)
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    pid = receiver_pid(link)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-1", 0)
    assert err.value.code is ErrorCode.TRANSFER_FAILED
    assert asyncio.get_running_loop().time() - t0 < 10
    assert link.state is LinkState.BROKEN
    await _until(lambda: gone(pid))
    await link.close()


async def test_dropping_a_pending_transfer_kills_the_receiver_at_once(tmp_path: Path) -> None:
    link, _trainer = await connected(timeout_s=60.0)
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    pid = receiver_pid(link)
    broke: list[str] = []
    link.on_break(broke.append)
    t0 = asyncio.get_running_loop().time()
    link.drop("job-1")  # a cleanup during the transfer: no wait for the 60 s receive
    assert link.state is LinkState.BROKEN and broke and "dropped" in broke[0]
    await _until(lambda: gone(pid))
    assert asyncio.get_running_loop().time() - t0 < 5
    await link.close()


async def test_a_wait_on_a_dropped_transfer_ends_at_once_and_its_deadline_breaks_no_later_group(
    tmp_path: Path,
) -> None:
    """Issue 41: an acknowledgement still waiting for a bucket when its attempt was cleaned up
    (its HTTP caller gone) used to wait out the whole deadline, popped from the link and never
    failed, and then broke whichever group was in use by then: a later, healthy publication."""
    link, _first = await connected(timeout_s=3.0)
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    waiting = asyncio.ensure_future(link.arrival("job-1", 0))
    await asyncio.sleep(0)  # the wait has begun
    link.drop("job-1")  # the cleanup during the transfer
    with pytest.raises(LoraVersionError) as err:
        await asyncio.wait_for(waiting, 1.0)  # failed with the drop, not at its 3 s deadline
    assert err.value.code is ErrorCode.TRANSFER_FAILED and "dropped" in err.value.message
    assert not link.receives("job-1")

    # a wait on an earlier group's job whose deadline passes after a new group was connected
    # fails alone: the new group stays usable
    second = Trainer()
    await link.connect(second.group_id, second.init_method, "gloo")
    second.joined()
    link._arrivals["job-0"] = {0: asyncio.get_running_loop().create_future()}  # never answered
    link._job_group["job-0"] = _first.group_id
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-0", 0)
    assert err.value.code is ErrorCode.TRANSFER_FAILED
    assert link.state is LinkState.CONNECTED and not link.receives("job-0")
    link.expect("job-2", TAG, [ExpectedBucket(0, 100, path, 16)])
    assert link.receives("job-2")
    await asyncio.to_thread(second.send, 0, b"y" * 100)
    await link.arrival("job-2", 0)
    assert path.read_bytes() == b"\0" * 16 + b"y" * 100
    link.drop("job-2")
    assert link.state is LinkState.CONNECTED
    await link.close()


async def test_a_cleanup_right_after_the_last_send_lets_the_bytes_land_and_keeps_the_group(
    tmp_path: Path,
) -> None:
    """The trainer's broadcast returns once its bytes are on the wire, before the receiver has
    reported them: settle() waits for them (bounded), so the drop that follows breaks nothing.
    Seen in CI before settle existed: a cleanup right after the last send broke a healthy group."""
    link, trainer = await connected()
    data = os.urandom(64 << 20)
    path = part_file(tmp_path, "p0", 16 + len(data))
    link.expect("job-1", TAG, [ExpectedBucket(0, len(data), path, 16)])
    sending = asyncio.create_task(asyncio.to_thread(trainer.send, 0, data))
    await asyncio.sleep(0.02)  # the bytes are on their way, not yet reported
    await link.settle("job-1")
    link.drop("job-1")
    await sending
    assert link.state is LinkState.CONNECTED and path.read_bytes()[16:] == data
    await link.close()


def payload_of(data: bytes) -> bytes:
    """A bucket payload around ``data`` (the sender strips the header; the engine writes its own)."""
    header = b"{}      "
    return len(header).to_bytes(8, "little") + header + data


async def paired(timeout_s: float = 30.0) -> tuple[CollectiveSender, CollectiveLink]:
    """The real trainer side (relax_glue's sender) and the engine's link, one group."""
    sender = CollectiveSender("127.0.0.1", timeout_s=timeout_s)
    link = CollectiveLink(timeout_s=timeout_s)

    async def ask_engine(group_id: str, init_method: str, backend: str) -> str:
        await link.connect(group_id, init_method, backend)
        return "incarnation-1"

    await sender.connect(ask_engine)
    return sender, link


def a_trainer_slow_between_pieces(monkeypatch: pytest.MonkeyPatch, gap_s: float) -> None:
    """The real sender, each piece after the first one ``gap_s`` late (a trainer busy between
    its pieces): the bytes land steadily, and a bucket of n pieces cannot land in less than
    (n - 1) x ``gap_s``, whatever the machine's load (load only makes it later)."""
    real = collective_sender.broadcast_pieces

    def paced(group: Any, tensor: Any, piece_bytes: int, landed: Any = None) -> None:
        def after_each_piece(so_far: int) -> None:
            if landed is not None:
                landed(so_far)
            if so_far < tensor.numel():
                time.sleep(gap_s)

        real(group, tensor, piece_bytes, after_each_piece)

    monkeypatch.setattr(collective_sender, "broadcast_pieces", paced)


class Frozen:
    """The receiver process stopped (SIGSTOP) for the ``with`` block: nothing of it moves, its
    posted receives stay pending; SIGCONT at the end if it is still there."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def __enter__(self) -> Frozen:
        self._signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        self._signal(signal.SIGCONT)


async def the_next_transfer_works(sender: CollectiveSender, link: CollectiveLink, tmp_path: Path) -> None:
    more = os.urandom(1 << 20)
    path = part_file(tmp_path, "next", 16 + len(more))
    link.expect("job-next", token_tag("attempt-next"), [ExpectedBucket(0, len(more), path, 16)])
    await sender.send("attempt-next", 0, payload_of(more))
    await link.arrival("job-next", 0)
    assert path.read_bytes()[16:] == more and link.state is LinkState.CONNECTED


async def test_a_cleanup_waits_for_the_last_bucket_landing_slowly_but_steadily_and_keeps_the_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cleanup right after the trainer's last broadcast, its bytes still landing, slowly but
    steadily (24 pieces 0.25 s apart), for longer than any fixed bound (here longer than the
    stall bound itself): the settle waits as long as the receiver reports bytes landing, the
    drop breaks nothing, and the same group carries the next transfer. (Seen in the bench: the
    old 1 s settle ran out and the drop killed a healthy group.) The slowness is the sender's:
    a receiver starved by a SIGSTOP/SIGCONT thread ran free whenever that thread lapsed under
    load, and landed its bucket faster than the bound."""
    a_trainer_slow_between_pieces(monkeypatch, gap_s=0.25)
    sender, link = await paired()
    sender.piece_bytes = 1 << 20
    data = os.urandom(24 << 20)
    path = part_file(tmp_path, "p0", 16 + len(data))
    link.expect("job-1", TAG, [ExpectedBucket(0, len(data), path, 16)])
    sending = asyncio.ensure_future(sender.send("attempt-1", 0, payload_of(data)))
    await _until(lambda: first_bytes_landed(path, data))
    assert not link.arrived("job-1", 0)
    t0 = time.monotonic()
    await link.settle("job-1")
    settled_s = time.monotonic() - t0
    link.drop("job-1")
    assert link.state is LinkState.CONNECTED, link.reason
    assert settled_s > SETTLE_STALL_S, f"landed in {settled_s:.2f} s: not slower than the stall bound"
    await asyncio.wait_for(sending, 30)
    assert path.read_bytes()[16:] == data
    await the_next_transfer_works(sender, link, tmp_path)
    await link.close()


async def test_a_cleanup_during_a_slow_steady_sender_waits_for_every_bucket_and_keeps_the_group(
    tmp_path: Path,
) -> None:
    """A trainer that sends its buckets 0.4 s apart (2 s after the cleanup came, twice the old
    1 s settle): each bucket that lands is progress, so the settle waits for the last one and the
    drop breaks nothing; the same group carries the next transfer."""
    sender, link = await paired()
    data = [os.urandom(1 << 20) for _ in range(6)]
    paths = [part_file(tmp_path, f"p{i}", 16 + len(d)) for i, d in enumerate(data)]
    link.expect("job-1", TAG, [ExpectedBucket(i, len(d), paths[i], 16) for i, d in enumerate(data)])

    last_sent: list[float] = []

    async def trainer() -> None:
        for i, d in enumerate(data):
            if i == len(data) - 1:
                last_sent.append(time.monotonic())
            await sender.send("attempt-1", i, payload_of(d))
            await asyncio.sleep(0.4)

    sending = asyncio.ensure_future(trainer())
    await link.arrival("job-1", 0)
    await link.settle("job-1")
    settled_at = time.monotonic()
    # it waited for the last bucket, sent 2 s after the first (an order, not a duration: a
    # late word of the first bucket's arrival must not count against the wait)
    assert all(link.arrived("job-1", i) for i in range(len(data)))
    assert last_sent and settled_at > last_sent[0]
    link.drop("job-1")
    assert link.state is LinkState.CONNECTED, link.reason
    await sending
    assert [path.read_bytes()[16:] for path in paths] == data
    await the_next_transfer_works(sender, link, tmp_path)
    await link.close()


def first_bytes_landed(path: Path, data: bytes, offset: int = 16) -> bool:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(64) == data[:64]


async def test_a_transfer_that_stops_landing_is_given_up_within_the_stall_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that stop landing in the middle of a bucket (the receiver frozen once its first
    bytes landed, a bucket that needs at least 3.75 s: nothing moves any more): the settle gives
    up once it heard nothing of them for the stall bound, long before the receiver's own
    deadline, and the drop that follows breaks the group and says why."""
    a_trainer_slow_between_pieces(monkeypatch, gap_s=0.25)
    sender, link = await paired(timeout_s=8.0)
    sender.piece_bytes = 1 << 20
    data = os.urandom(16 << 20)
    path = part_file(tmp_path, "p0", 16 + len(data))
    link.expect("job-1", TAG, [ExpectedBucket(0, len(data), path, 16)])
    pid = receiver_pid(link)
    broke: list[str] = []
    link.on_break(broke.append)
    sending = asyncio.ensure_future(sender.send("attempt-1", 0, payload_of(data)))
    await _until(lambda: first_bytes_landed(path, data))
    with Frozen(pid):
        t0 = time.monotonic()
        await link.settle("job-1", stall_s=1.0)
        settled_s = time.monotonic() - t0
        assert not link.arrived("job-1", 0)  # it was really still pending
        link.drop("job-1")
    assert 1.0 <= settled_s < 3.0, settled_s  # the stall bound, not the 8 s deadline
    assert link.state is LinkState.BROKEN
    assert broke and "dropped before it ended" in broke[0] and "nothing of it landed for 1 s" in broke[0]
    await _until(lambda: gone(pid))
    with pytest.raises(LoraVersionError) as err:
        await asyncio.wait_for(sending, 30)  # the sender's side ends by its own deadline
    assert err.value.code is ErrorCode.TRANSFER_FAILED
    await link.close()


async def test_settle_gives_up_on_a_bucket_past_the_receivers_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that keep landing, but too slowly for the receiver's per-bucket deadline (the
    plugin's timeout, here 2 s): the settle does not wait past it whatever the progress, and the
    group breaks. The slowness is the sender's (24 pieces, 0.25 s apart: at least 5.75 s), not a
    starved receiver's: a starver that lapses under load gives the receiver more time, and in
    CI it landed the whole bucket within the deadline."""
    a_trainer_slow_between_pieces(monkeypatch, gap_s=0.25)
    sender, link = await paired()
    sender.piece_bytes = 1 << 20
    link.timeout_s = 2.0  # the bucket's deadline, once joined (a loaded machine's rendezvous takes longer)
    data = os.urandom(24 << 20)
    path = part_file(tmp_path, "p0", 16 + len(data))
    link.expect("job-1", TAG, [ExpectedBucket(0, len(data), path, 16)])
    sending = asyncio.ensure_future(sender.send("attempt-1", 0, payload_of(data)))
    await _until(lambda: first_bytes_landed(path, data))
    t0 = time.monotonic()
    await link.settle("job-1", stall_s=30.0)
    settled_s = time.monotonic() - t0
    assert not link.arrived("job-1", 0)
    link.drop("job-1")
    assert settled_s < 4.0, settled_s  # the bucket's 2 s deadline, not the 30 s stall bound
    assert link.state is LinkState.BROKEN and "within 2 s" in str(link.reason), link.reason
    with contextlib.suppress(LoraVersionError):
        await asyncio.wait_for(sending, 30)
    await link.close()


async def test_settle_is_bounded_for_a_sender_that_never_comes(tmp_path: Path) -> None:
    link, _trainer = await connected(timeout_s=60.0)
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    t0 = asyncio.get_running_loop().time()
    await link.settle("job-1", stall_s=0.5)
    assert 0.4 < asyncio.get_running_loop().time() - t0 < 5
    link.drop("job-1")  # then the receiver goes with the pending receive, as before
    assert link.state is LinkState.BROKEN and "nothing of it landed for 0.5 s" in str(link.reason)
    await link.close()


async def test_a_rendezvous_nobody_joins_is_bounded_and_typed() -> None:
    store = host_store("127.0.0.1", 0, 2.0)  # a store, but no rank 0 ever joins the group
    link = CollectiveLink(timeout_s=2.0)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(LoraVersionError) as err:
        await link.connect("g-" + uuid.uuid4().hex, f"tcp://127.0.0.1:{store.port}", "gloo")
    assert err.value.code is ErrorCode.TRANSPORT_UNAVAILABLE and "rendezvous" in err.value.message
    assert asyncio.get_running_loop().time() - t0 < 30  # receiver start-up + the 2 s timeout
    assert link.state is LinkState.BROKEN
    await link.close()


async def test_a_new_group_replaces_the_old_receiver() -> None:
    link, _first = await connected()
    old = receiver_pid(link)
    second = Trainer()
    await link.connect(second.group_id, second.init_method, "gloo")
    second.joined()
    assert link.state is LinkState.CONNECTED and link.group_id == second.group_id
    await _until(lambda: gone(old))
    await link.close()


async def _until(pred: Any) -> None:
    await eventually(pred, timeout=10.0, poll_s=0.05)  # a process exit or a write on another thread


def _quiet(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # the receiver refused: the sender's side fails, as it should
        return
