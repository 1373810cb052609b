"""The collective transport's frames, addresses and the canonical bucket layout it relies on."""

from __future__ import annotations

import struct

import pytest
import torch

from lora_contract import protocol as p
from lora_contract.collective_group import (
    _FRAME,
    FRAME_BYTES,
    FRAME_MAGIC,
    PIECE_BYTES,
    Frame,
    parse_init_method,
    pieces,
    token_tag,
)
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.transport import HEADER_PREFIX_BYTES, parse_payload_layout


def test_frame_round_trip_and_refusals() -> None:
    frame = Frame(index=3, nbytes=12345, tag=token_tag("attempt-1"))
    raw = frame.encode()
    assert len(raw) == FRAME_BYTES
    assert Frame.decode(raw) == frame
    assert Frame.decode(raw[:-1]) is None  # not a frame's size
    assert Frame.decode(b"XXXX" + raw[4:]) is None  # another magic
    bumped = bytearray(raw)
    bumped[4] += 1  # another version
    assert Frame.decode(bytes(bumped)) is None
    assert token_tag("attempt-1") == frame.tag and token_tag("attempt-2") != frame.tag
    assert len(frame.tag) == 16
    cut = Frame(index=3, nbytes=12345, tag=frame.tag, piece_bytes=PIECE_BYTES)
    assert Frame.decode(cut.encode()) == cut and cut.encode() != raw  # the piece size travels


def test_a_frame_of_the_first_version_is_refused() -> None:
    """Version 1 frames had no piece size (one broadcast per bucket): such a sender's frame is
    refused, never read as a version 2 frame with pieces it does not send."""
    v1 = struct.pack("<4sIQQ16s", FRAME_MAGIC, 1, 0, 100, token_tag("a"))
    assert Frame.decode(v1 + b"\0" * (FRAME_BYTES - len(v1))) is None
    assert _FRAME.size <= FRAME_BYTES


@pytest.mark.parametrize(
    ("nbytes", "piece_bytes"),
    [(0, 0), (0, 4), (1, 0), (10, 0), (10, 3), (12, 3), (12, 12), (12, 100), (7, 1)],
)
def test_pieces_cover_the_bucket_once_in_order(nbytes: int, piece_bytes: int) -> None:
    spans = pieces(nbytes, piece_bytes)
    covered = [i for start, end in spans for i in range(start, end)]
    assert covered == list(range(nbytes))
    assert all(end > start for start, end in spans)
    if piece_bytes:
        assert all(end - start <= piece_bytes for start, end in spans)
        assert len(spans) == -(-nbytes // piece_bytes)
    else:
        assert len(spans) == (1 if nbytes else 0)  # 0: one broadcast


def test_a_frame_is_refused_with_the_code_of_its_disagreement() -> None:
    tag = token_tag("attempt-1")
    frame = Frame(index=2, nbytes=100, tag=tag)
    assert frame.refusal(2, 100, tag) is None
    code, message = frame.refusal(2, 101, tag) or (None, "")
    assert code is ErrorCode.MANIFEST_MISMATCH and "bucket 2 of 100 bytes" in message
    code, message = frame.refusal(3, 100, tag) or (None, "")
    assert code is ErrorCode.MANIFEST_MISMATCH and "expected bucket 3" in message
    # another attempt's frame: its sizes say nothing about this plan, even when they agree
    for index, nbytes in ((2, 100), (3, 7)):
        code, message = frame.refusal(index, nbytes, token_tag("attempt-2")) or (None, "")
        assert code is ErrorCode.STALE_ATTEMPT and "another attempt" in message


@pytest.mark.parametrize(
    "bad",
    ["http://h:1", "tcp://h", "tcp://:80", "tcp://h:99999", "tcp://h:1/x", "file:///etc/passwd", "tcp://h:x"],
)
def test_init_method_must_be_tcp_host_port(bad: str) -> None:
    with pytest.raises(LoraVersionError) as err:
        parse_init_method(bad)
    assert err.value.code is ErrorCode.INVALID_REQUEST


def test_init_method_parsed() -> None:
    assert parse_init_method("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_init_method("tcp://trainer-0.svc:1234") == ("trainer-0.svc", 1234)


CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def test_the_engine_knows_every_header_from_the_manifest() -> None:
    """bucket_header(manifest, spec) is the header encode_bucket writes: an engine rebuilds the
    exact payload from the tensor bytes alone. Mixed item sizes stay aligned."""
    tensors = {
        "a.lora_A.weight": torch.randn(4, 8),
        "b.bias": torch.randn(3).to(torch.bfloat16),
        "c.flag": torch.tensor([True, False, True]),
        "d.lora_B.weight": torch.randn(8, 4).double(),
        "e.empty": torch.zeros(0, 2),
    }
    manifest = p.manifest_from_tensors(CONFIG, tensors)
    for cap in (1, 64, 10**9):
        for spec in p.plan_buckets(manifest, cap):
            payload = p.encode_bucket(tensors, spec)
            header = p.bucket_header(manifest, spec)
            assert payload[: len(header)] == header
            assert (len(header)) % 8 == 0
            layout = parse_payload_layout(payload[: len(header)])
            assert layout.size == len(payload) == len(header) + spec.total_bytes
            for span in layout.tensors:  # every tensor starts aligned to its item size
                itemsize = p.DTYPE_ITEMSIZE[span.dtype]
                assert (span.start - len(header)) % itemsize == 0
            decoded = p.decode_bucket(payload, expected_sha256=p.manifest_bucket_checksum(manifest, payload))
            p.check_bucket_tensors(manifest, spec, decoded)
    n = int.from_bytes(payload[:HEADER_PREFIX_BYTES], "little")
    assert payload[HEADER_PREFIX_BYTES + n - 1 : HEADER_PREFIX_BYTES + n] in (b"}", b" ")


def test_bucket_header_refuses_a_plan_outside_the_manifest() -> None:
    manifest = p.manifest_from_tensors(CONFIG, {"a": torch.zeros(2)})
    spec = p.BucketSpec(index=0, tensor_names=("zz",), total_bytes=8)
    with pytest.raises(LoraVersionError) as err:
        p.bucket_header(manifest, spec)
    assert err.value.code is ErrorCode.MANIFEST_MISMATCH


def test_collective_bucket_meta_travels_in_headers() -> None:
    meta = p.ReceiveBucketMeta(
        lora_name=_name(),
        attempt_token="tok1",
        index=2,
        sha256="0" * 64,
        transport="collective",
    )
    headers = meta.to_headers()
    assert headers[p.BUCKET_TRANSPORT_HEADER] == "collective"
    assert p.ReceiveBucketMeta.from_headers(headers) == meta
    with pytest.raises(LoraVersionError) as err:
        p.ReceiveBucketMeta.from_headers({**headers, p.BUCKET_TRANSPORT_HEADER: "pigeon"})
    assert err.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(LoraVersionError) as err:
        p.ReceiveBucketMeta.from_headers({**headers, p.BUCKET_SOURCE_HEADER: "file.safetensors"})
    assert err.value.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    "init_method", ["tcp://h:1; rm -rf /", "http://h:1", "tcp://" + "h" * 300 + ":1", ""]
)
def test_connect_request_refuses_odd_addresses(init_method: str) -> None:
    with pytest.raises(LoraVersionError) as err:
        p.parse_model(p.CollectiveConnectRequest, {"group_id": "g1", "init_method": init_method})
    assert err.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(LoraVersionError):
        p.parse_model(
            p.CollectiveConnectRequest, {"group_id": "g1", "init_method": "tcp://h:1", "backend": "mpi"}
        )


def _name() -> str:
    return p.make_lora_name(p.DEFAULT_LORA_PREFIX, "e1", "v1", "a" * 64)
