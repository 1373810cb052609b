"""The trainer's end of a collective group against the real receiver process (driven by the
engine-side link, in this process): buckets go once and in order, and a receiver that dies in the
middle of a broadcast (its engine SIGKILLed: the receiver dies with it) fails the broadcast at
once with a typed error, the group forgotten."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from lora_contract import protocol as p
from lora_contract.collective_group import PIECE_BYTES, pieces, token_tag
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.collective_sender import CollectiveSender
from sglang_ext.collective_link import CollectiveLink, ExpectedBucket, LinkState

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


async def pair(
    timeout_s: float = 30.0, piece_bytes: int = PIECE_BYTES
) -> tuple[CollectiveSender, CollectiveLink]:
    sender = CollectiveSender("127.0.0.1", timeout_s=timeout_s, piece_bytes=piece_bytes)
    link = CollectiveLink(timeout_s=timeout_s)

    async def ask_engine(group_id: str, init_method: str, backend: str) -> str:
        await link.connect(group_id, init_method, backend)
        return "incarnation-1"

    await sender.connect(ask_engine)
    assert sender.connected and sender.incarnation == "incarnation-1" and sender.connects == 1
    return sender, link


def buckets_of(tensors: dict[str, torch.Tensor], cap: int) -> tuple[p.Manifest, list]:
    manifest = p.manifest_from_tensors(CONFIG, tensors)
    return manifest, [(spec, p.encode_bucket(tensors, spec)) for spec in p.plan_buckets(manifest, cap)]


def staged_files(tmp_path: Path, manifest: p.Manifest, buckets: list) -> list[ExpectedBucket]:
    out = []
    for spec, _payload in buckets:
        header = p.bucket_header(manifest, spec)
        path = tmp_path / f"b{spec.index}"
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + spec.total_bytes)
        out.append(ExpectedBucket(spec.index, spec.total_bytes, path, len(header)))
    return out


async def test_every_bucket_goes_once_in_order_and_lands_as_its_payload(tmp_path: Path) -> None:
    sender, link = await pair()
    tensors = {f"w{i}": torch.randn(64, 32) for i in range(6)}
    manifest, buckets = buckets_of(tensors, 3 * 64 * 32 * 4)
    expected = staged_files(tmp_path, manifest, buckets)
    link.expect("job-1", token_tag("tok"), expected)
    # asked in order, twice: the second ask is the same broadcast, never a second one
    first = [sender.send_soon("tok", spec.index, payload) for spec, payload in buckets]
    again = [sender.send_soon("tok", spec.index, payload) for spec, payload in buckets]
    assert first == again
    for (spec, payload), e in zip(buckets, expected, strict=True):
        await sender.send("tok", spec.index, payload)
        await link.arrival("job-1", spec.index)
        assert e.path.read_bytes() == payload  # the engine's file is the HTTP payload, byte for byte
    await link.close()


async def test_a_bucket_of_several_pieces_lands_as_its_payload(tmp_path: Path) -> None:
    """A bucket goes in pieces (the engine hears of each as it lands): they land in order, each
    where it belongs, the last one short."""
    sender, link = await pair()
    tensors = {"w": torch.randn((2 * PIECE_BYTES + 4096) // 4)}
    manifest, buckets = buckets_of(tensors, 10**9)
    expected = staged_files(tmp_path, manifest, buckets)
    link.expect("job-1", token_tag("tok"), expected)
    (spec, payload), e = buckets[0], expected[0]
    assert len(pieces(spec.total_bytes, PIECE_BYTES)) == 3
    await sender.send("tok", spec.index, payload)
    await link.arrival("job-1", spec.index)
    assert e.path.read_bytes() == payload
    await link.close()


async def test_a_broadcast_cancelled_before_it_ran_forgets_the_group(tmp_path: Path) -> None:
    """A bucket's broadcast cancelled while it waited for the one before (its event loop ended:
    the bench runs one per publication) never reached the receiver, which still waits for it:
    the next broadcast fails typed and the group is forgotten, so the next ``begin`` connects a
    new one instead of every later broadcast failing on this one."""
    sender, link = await pair()
    tensors = {f"w{i}": torch.randn(1 << 20) for i in range(3)}
    manifest, buckets = buckets_of(tensors, 4 << 20)
    link.expect("job-1", token_tag("tok"), staged_files(tmp_path, manifest, buckets))
    first = sender.send_soon("tok", 0, buckets[0][1])
    second = sender.send_soon("tok", 1, buckets[1][1])
    second.cancel()
    await first
    assert sender.connected  # nothing failed yet
    with pytest.raises(LoraVersionError) as err:
        await sender.send("tok", 2, buckets[2][1])
    assert err.value.code is ErrorCode.TRANSFER_FAILED, err.value
    assert not sender.connected
    await link.close()


async def cut_mid_broadcast(
    tmp_path: Path, link: CollectiveLink, send: Callable[[bytes], Awaitable[None]]
) -> asyncio.Future[None]:
    """A 256 MiB bucket on its way to the receiver, the receiver SIGKILLed 50 ms in (what the
    engine's death does to it); the send, still running."""
    big = {"w": torch.zeros(256 * 1024 * 1024 // 4)}  # long enough to be cut
    manifest, buckets = buckets_of(big, 10**9)
    link.expect("job-1", token_tag("tok"), staged_files(tmp_path, manifest, buckets))
    assert link._proc is not None
    receiver = link._proc.pid
    sending = asyncio.ensure_future(send(buckets[0][1]))
    await asyncio.sleep(0.05)
    os.kill(receiver, signal.SIGKILL)
    return sending


async def test_a_receiver_killed_mid_broadcast_fails_it_by_the_groups_deadline(tmp_path: Path) -> None:
    """The sender alone: gloo's send to a peer that died in the middle waits out the group's
    timeout (torch 2.14; the bucket in one broadcast here, so it is surely in flight), then the
    broadcast fails typed and the group is forgotten."""
    sender, link = await pair(timeout_s=5, piece_bytes=0)
    sending = await cut_mid_broadcast(tmp_path, link, lambda payload: sender.send("tok", 0, payload))
    with pytest.raises(LoraVersionError) as err:
        await asyncio.wait_for(sending, 60)
    assert err.value.code is ErrorCode.TRANSFER_FAILED, err.value
    assert not sender.connected  # the next begin connects a new group
    with pytest.raises(LoraVersionError) as err2:
        await link.arrival("job-1", 0)
    assert err2.value.code is ErrorCode.TRANSFER_FAILED
    assert link.state is LinkState.BROKEN
    await link.close()


@pytest.mark.parametrize("piece_bytes", [0, PIECE_BYTES], ids=["one-broadcast", "pieces"])
async def test_the_engines_refusal_ends_a_broadcast_to_a_dead_receiver_at_once(
    tmp_path: Path, piece_bytes: int
) -> None:
    """With the acknowledgement asked meanwhile (what EngineClient.receive_bucket does), the
    engine's side, which sees its receiver's exit at once, ends the call long before the
    group's deadline: typed, the group forgotten. (Sent first and acknowledged after, as before
    this fix, the call waited the whole deadline.) With the bucket in one broadcast, only the
    engine can end it so soon; in pieces, the sender may see the closed pair itself first, at
    its next piece."""
    deadline = 12.0  # the call must end in half of it; the stuck broadcast thread waits all of it
    sender, link = await pair(timeout_s=deadline, piece_bytes=piece_bytes)

    def send(payload: bytes) -> Awaitable[None]:
        return sender.send_acknowledged("tok", 0, payload, lambda: link.arrival("job-1", 0))

    sending = await cut_mid_broadcast(tmp_path, link, send)
    with pytest.raises(LoraVersionError) as err:
        await asyncio.wait_for(sending, deadline / 2)  # a TimeoutError here: the deadline was waited
    assert err.value.code is ErrorCode.TRANSFER_FAILED, err.value
    if not piece_bytes:
        assert "receiver" in str(err.value) or "exited" in str(err.value), err.value  # the engine's verdict
    assert not sender.connected
    await until_broken(link)  # the engine's side saw the exit too (the sender may have seen it first)
    await link.close()


async def until_broken(link: CollectiveLink, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while link.state is not LinkState.BROKEN:
        assert asyncio.get_running_loop().time() < deadline, link.state
        await asyncio.sleep(0.05)
