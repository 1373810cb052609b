"""The engine's end of a collective group, against the real receiver process and a real gloo
peer (this test process as the trainer), without an engine: every way the group can fail ends
in a typed error within the link's own deadline, with the receiver gone and nothing waited on."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_ext.collective_group import Frame, broadcast, host_store, open_group, token_tag
from sglang_ext.collective_link import CollectiveLink, ExpectedBucket, LinkState
from sglang_ext.errors import ErrorCode, LoraVersionError

TAG = token_tag("attempt-1")


class Trainer:
    """Rank 0: hosts the store, joins on a thread while the link's receiver joins."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.store = host_store("127.0.0.1", 0, timeout_s)
        self.group_id = uuid.uuid4().hex
        self.init_method = f"tcp://127.0.0.1:{self.store.port}"
        self.group: Any = None
        self._joiner = threading.Thread(target=self._join, args=(timeout_s,), daemon=True)
        self._joiner.start()

    def _join(self, timeout_s: float) -> None:
        self.group = open_group(self.init_method, 0, self.group_id, timeout_s, "gloo", self.store)

    def joined(self) -> None:
        self._joiner.join(30)
        assert self.group is not None

    def send(self, index: int, data: bytes, announce: int | None = None) -> None:
        frame = Frame(index=index, nbytes=len(data) if announce is None else announce, tag=TAG)
        broadcast(self.group, torch.frombuffer(bytearray(frame.encode()), dtype=torch.uint8))
        broadcast(self.group, torch.frombuffer(bytearray(data), dtype=torch.uint8))


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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


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
    link, trainer = await connected()
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    pid = receiver_pid(link)
    sender = threading.Thread(target=lambda: _quiet(trainer.send, 0, b"x" * 101), daemon=True)
    sender.start()
    with pytest.raises(LoraVersionError) as err:
        await link.arrival("job-1", 0)
    assert (
        err.value.code is ErrorCode.TRANSFER_FAILED and "announced bucket 0 of 101 bytes" in err.value.message
    )
    assert path.read_bytes() == b"\0" * 116  # no byte landed
    assert link.state is LinkState.BROKEN
    await _until(lambda: gone(pid))
    with pytest.raises(LoraVersionError) as err:
        link.check_usable()
    assert err.value.code is ErrorCode.TRANSPORT_UNAVAILABLE
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


async def test_settle_is_bounded_for_a_sender_that_never_comes(tmp_path: Path) -> None:
    link, _trainer = await connected(timeout_s=60.0)
    path = part_file(tmp_path, "p0", 16 + 100)
    link.expect("job-1", TAG, [ExpectedBucket(0, 100, path, 16)])
    t0 = asyncio.get_running_loop().time()
    await link.settle("job-1", timeout_s=0.5)
    assert 0.4 < asyncio.get_running_loop().time() - t0 < 5
    link.drop("job-1")  # then the receiver goes with the pending receive, as before
    assert link.state is LinkState.BROKEN
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


async def _until(pred: Any, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


def _quiet(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # the receiver refused: the sender's side fails, as it should
        return
