"""A bucket body received into a staged file and verified while it arrives: every defect is
refused with its code, and a refused body leaves no file behind."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.transport import TensorSpan, parse_payload_layout
from sglang_ext import bucket_receiver, staging
from sglang_ext.bucket_receiver import (
    HASH_WHILE_RECEIVING_ENV,
    WRITE_BACKLOG_BYTES,
    BucketReceiver,
    same_dtype_runs,
    split_groups,
)
from sglang_ext.staging import StagingArea, open_local_source

CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
KEY = ("lv:p:e:v:0123456789abcdef", "a" * 32)


def adapter(seed: int = 0, hidden: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for m in ("q_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            out[f"{stem}.lora_A.weight"] = torch.randn(4, hidden, generator=g).to(torch.bfloat16)
            out[f"{stem}.lora_B.weight"] = torch.randn(hidden, 4, generator=g)
    return out


@pytest.fixture(autouse=True, params=["after-receipt", "while-receiving"])
def hashing_mode(request, monkeypatch) -> str:
    """Every test in both verification modes: tensor groups in parallel after the last byte, and
    the ordered lane hashing behind the socket."""
    monkeypatch.setenv(HASH_WHILE_RECEIVING_ENV, "1" if request.param == "while-receiving" else "0")
    return request.param


def test_groups_are_consecutive_balanced_and_cover_every_tensor() -> None:
    spans = [TensorSpan(f"t{i}", "float32", (n,), 0, 0) for i, n in enumerate([5, 1, 1, 1, 5, 0, 3])]
    pos = 8
    laid = []
    for s in spans:
        n = s.shape[0] * 4
        laid.append(TensorSpan(s.name, s.dtype, s.shape, pos, pos + n))
        pos += n
    for n in (1, 2, 3, 4, 10):
        groups = split_groups(laid, n)
        assert [t for g in groups for t in g] == laid and 1 <= len(groups) <= n and all(groups)
    assert [len(g) for g in split_groups(laid, 2)] == [4, 3]


@pytest.fixture
def area(tmp_path: Path):
    a = StagingArea()  # the default base (/dev/shm here), as on an engine
    yield a
    a.close()


def setup(tensors: dict[str, torch.Tensor]) -> tuple[p.Manifest, p.BucketSpec, bytes]:
    manifest = p.manifest_from_tensors(CONFIG, tensors)
    spec = p.plan_buckets(manifest, 10**9)[0]
    return manifest, spec, p.encode_bucket(tensors, spec)


async def receive(
    area: StagingArea, manifest, spec, payload: bytes, checksum: str | None = None, chunk: int = 4096
) -> BucketReceiver:
    cap = p.max_payload_bytes(manifest, spec) + 64 * 1024
    r = BucketReceiver(area, manifest, spec, checksum or p.bucket_checksum(payload), cap)
    try:
        for i in range(0, len(payload), chunk):
            await r.pace()  # as read_body does between chunks
            r.feed(payload[i : i + chunk])
        await r.finish()
    except BaseException:
        await r.abandon()
        raise
    return r


def no_parts(area: StagingArea) -> bool:
    return not list(area.root.glob("*.part"))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1024 * 1024 + 3, WRITE_BACKLOG_BYTES + 3, 1 << 30])
async def test_a_good_body_in_any_chunking_is_verified_and_committed_byte_for_byte(area, chunk) -> None:
    manifest, spec, payload = setup(adapter(hidden=2048 if chunk > 4096 else 16))
    r = await receive(area, manifest, spec, payload, chunk=chunk)
    area.commit_part(KEY, r.part, 0)
    [f] = area.bucket_files(KEY)
    assert f.read_bytes() == payload and no_parts(area)
    got = load(f.read_bytes())
    assert all(torch.equal(got[n], t) for n, t in adapter(hidden=2048 if chunk > 4096 else 16).items())


async def test_a_wrong_checksum_is_refused_and_leaves_no_file(area) -> None:
    manifest, spec, payload = setup(adapter())
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload, checksum="0" * 64)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH and no_parts(area)


async def test_a_self_consistent_body_with_other_content_names_the_tensor(area) -> None:
    tensors = adapter()
    manifest, spec, _ = setup(tensors)
    name = spec.tensor_names[2]
    other = dict(tensors, **{name: tensors[name] + 1})
    payload = p.encode_bucket(other, spec)
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload)  # its own correct checksum
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH and info.value.details["tensor"] == name
    assert no_parts(area)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", [0, 1, 5, 7])
@pytest.mark.parametrize("one_dtype", [False, True], ids=["runs-of-one", "one-run"])
async def test_non_finite_values_are_refused_even_when_the_manifest_pins_them(
    area, which, value, one_dtype
) -> None:
    """Values are checked per run of adjacent same-dtype tensors; the refusal still names the
    tensor that holds them, wherever it lies in its run."""
    tensors = adapter()
    if one_dtype:  # every tensor in one run
        tensors = {k: v.float() for k, v in tensors.items()}
    name = sorted(tensors)[which]
    tensors[name][-1, -1] = value
    manifest, spec, payload = setup(tensors)
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload)
    assert info.value.code is ErrorCode.INCOMPATIBLE_ADAPTER and no_parts(area)
    assert info.value.details.get("tensor") == name, info.value


def test_values_are_checked_in_runs_of_adjacent_tensors_of_one_dtype() -> None:
    def span(name: str, start: int, end: int, dtype: str) -> TensorSpan:
        return TensorSpan(name=name, dtype=dtype, shape=(max(0, end - start) // 4,), start=start, end=end)

    a, b = span("a", 0, 8, "float32"), span("b", 8, 16, "float32")
    c, empty = span("c", 16, 20, "bfloat16"), span("e", 20, 20, "float32")
    d, gap = span("d", 20, 28, "float32"), span("g", 32, 40, "float32")
    runs = same_dtype_runs([a, b, c, empty, d, gap])
    assert [[x.name for x in run] for run in runs] == [["a", "b"], ["c"], ["d"], ["g"]]


async def test_a_foreign_tensor_is_refused_from_the_header_before_any_file_exists(area) -> None:
    manifest, spec, _ = setup(adapter())
    foreign = save({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 16)})
    r = BucketReceiver(area, manifest, spec, "0" * 64, 10**6)
    with pytest.raises(LoraVersionError) as info:
        r.feed(foreign)
    assert info.value.code is ErrorCode.MANIFEST_MISMATCH and r.part is None
    assert list(area.root.iterdir()) == []


async def test_a_body_longer_or_shorter_than_its_header_is_refused(area) -> None:
    manifest, spec, payload = setup(adapter())
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload + b"\0")
    assert info.value.code is ErrorCode.INVALID_REQUEST and no_parts(area)
    full = p.bucket_checksum(payload)
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload[:-1], checksum=full)
    assert info.value.code is ErrorCode.INCOMPLETE_BODY and no_parts(area)
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload[:5], checksum=full)
    assert info.value.code is ErrorCode.INCOMPLETE_BODY


async def test_a_header_beyond_the_cap_is_refused_before_it_is_read(area) -> None:
    manifest, spec, _ = setup(adapter())
    r = BucketReceiver(area, manifest, spec, "0" * 64, cap=1000)
    with pytest.raises(LoraVersionError) as info:
        r.feed(struct.pack("<Q", 5000))
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE


def raw_payload(header: Any, data: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "payload",
    [
        raw_payload(b"[1, 2]"),
        raw_payload(b"not json"),
        raw_payload(
            b'{"a": ' + json.dumps(F32).encode() + b', "a": ' + json.dumps(F32).encode() + b"}", bytes(8)
        ),
        raw_payload({"a": {**F32, "dtype": "F31"}}, bytes(8)),
        raw_payload({"a": {**F32, "shape": [3]}}, bytes(8)),
        raw_payload({"a": {**F32, "shape": [True, 2]}}, bytes(8)),
        raw_payload({"a": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
        raw_payload({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12)),
        raw_payload({"a": {**F32, "extra": 1}}, bytes(8)),
        raw_payload({"__metadata__": {"k": 1}, "a": F32}, bytes(8)),
        struct.pack("<Q", 2**40) + b"{}",
    ],
    ids=[
        "array",
        "not-json",
        "duplicate-key",
        "dtype",
        "size",
        "bool-dim",
        "gap",
        "overlap",
        "extra-key",
        "metadata",
        "huge-header",
    ],
)
def test_malformed_safetensors_headers_are_invalid(payload: bytes) -> None:
    with pytest.raises(LoraVersionError) as info:
        p.bucket_checksum(payload)
    assert info.value.code is ErrorCode.INVALID_REQUEST


dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.text("abcxyz._", min_size=1, max_size=12), st.tuples(dtypes, shapes), max_size=6))
def test_the_layout_parse_agrees_with_safetensors(spec: dict[str, tuple[torch.dtype, list[int]]]) -> None:
    tensors = {
        n: torch.zeros(s, dtype=d) if d in (torch.int64, torch.uint8) else torch.rand(s).to(d)
        for n, (d, s) in spec.items()
    }
    payload = save(tensors)
    n = int.from_bytes(payload[:8], "little")
    layout = parse_payload_layout(payload[: 8 + n])
    assert layout.size == len(payload)
    for t in layout.tensors:
        assert (
            payload[t.start : t.end]
            == tensors[t.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
        assert t.shape == tuple(tensors[t.name].shape)
    if tensors:
        manifest = p.manifest_from_tensors(CONFIG, tensors)
        assert p.manifest_bucket_checksum(manifest, payload) == p.bucket_checksum(payload)


# ------------------------------------------------------------------------------ local source files


async def fill_from(area: StagingArea, manifest, spec, path: Path, checksum: str) -> BucketReceiver:
    r = BucketReceiver(area, manifest, spec, checksum, p.max_payload_bytes(manifest, spec) + 64 * 1024)
    try:
        await r.fill_from_file(open_local_source(path.parent, path.name))
        await r.finish()
    except BaseException:
        await r.abandon()
        raise
    return r


async def test_a_local_source_file_is_copied_verified_and_committed(area, tmp_path) -> None:
    tensors = adapter(hidden=2048)  # several copy strides
    manifest, spec, payload = setup(tensors)
    src = tmp_path / "src"
    src.mkdir()
    (src / "b0.safetensors").write_bytes(payload)
    r = await fill_from(area, manifest, spec, src / "b0.safetensors", p.bucket_checksum(payload))
    area.commit_part(KEY, r.part, 0)
    [f] = area.bucket_files(KEY)
    assert f.read_bytes() == payload and (src / "b0.safetensors").exists()  # the source is the sender's


async def test_a_bad_local_source_file_is_refused_like_a_body(area, tmp_path) -> None:
    tensors = adapter()
    manifest, spec, payload = setup(tensors)
    good = p.bucket_checksum(payload)
    src = tmp_path / "src"
    src.mkdir()
    cases = {
        "short.safetensors": (payload[:-3], good, ErrorCode.INCOMPLETE_BODY),
        "long.safetensors": (payload + b"xx", good, ErrorCode.INVALID_REQUEST),
        "tiny.safetensors": (payload[:4], good, ErrorCode.INCOMPLETE_BODY),
        "wrong.safetensors": (payload, "0" * 64, ErrorCode.CHECKSUM_MISMATCH),
    }
    for name, (data, checksum, code) in cases.items():
        (src / name).write_bytes(data)
        with pytest.raises(LoraVersionError) as info:
            await fill_from(area, manifest, spec, src / name, checksum)
        assert info.value.code is code, name
        assert no_parts(area)


def test_local_sources_open_only_regular_files_by_bare_name(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    os.symlink(tmp_path / "f", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    os.close(open_local_source(tmp_path, "f"))
    for name in ("link", "fifo", "dir", "missing"):
        with pytest.raises(LoraVersionError) as info:
            open_local_source(tmp_path, name)
        assert info.value.code is ErrorCode.INVALID_REQUEST, name
    with pytest.raises(LoraVersionError) as info:
        open_local_source(None, "f")  # not enabled on this engine
    assert info.value.code is ErrorCode.INVALID_REQUEST
    base = {"lora_name": "lv@e-v-0123456789ab", "attempt_token": "a" * 32, "index": 0, "sha256": "0" * 64}
    for name in ("../f", "/etc/passwd", ".hidden", "a/b", ""):
        with pytest.raises(LoraVersionError):
            p.parse_model(p.ReceiveBucketMeta, {**base, "source": name})


# ------------------------------------------------------------------- local sources taken over


@pytest.fixture
def source_dir(area: StagingArea) -> Path:
    """A local source directory on the staging filesystem (a rename can take files over)."""
    d = area.base / f"source-{os.getpid()}-{id(area)}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def take_and_verify(area: StagingArea, manifest, spec, source_dir: Path, name: str, checksum: str):
    r = BucketReceiver(area, manifest, spec, checksum, p.max_payload_bytes(manifest, spec) + 64 * 1024)
    src = area.take_local_source(source_dir, name)
    try:
        if src.part is not None:
            await r.adopt(src.part)
        else:
            await r.fill_from_file(src.fd)
        await r.finish()
    except BaseException:
        await r.abandon()
        raise
    finally:
        src.discard_moved()
    return r, src


async def test_a_private_local_source_is_taken_over_without_a_copy(area, source_dir) -> None:
    manifest, spec, payload = setup(adapter(hidden=2048))
    (source_dir / "b.safetensors").write_bytes(payload)
    r, src = await take_and_verify(
        area, manifest, spec, source_dir, "b.safetensors", p.bucket_checksum(payload)
    )
    assert src.part is not None and src.fd is None and src.moved is None  # taken over
    assert not (source_dir / "b.safetensors").exists()  # no path of the sender's leads to it
    assert stat.S_IMODE(r.part.path.stat().st_mode) == 0o400 and r.part.path.parent == area.root
    area.commit_part(KEY, r.part, 0)
    [f] = area.bucket_files(KEY)
    assert f.read_bytes() == payload and no_parts(area)


async def test_a_local_source_someone_may_still_write_is_copied_not_taken(area, source_dir) -> None:
    manifest, spec, payload = setup(adapter())
    checksum = p.bucket_checksum(payload)
    (source_dir / "open.safetensors").write_bytes(payload)
    writer = os.open(source_dir / "open.safetensors", os.O_WRONLY)  # a writer still holds it
    (source_dir / "linked.safetensors").write_bytes(payload)
    os.link(source_dir / "linked.safetensors", source_dir / "other-link")  # another path to it
    try:
        for name in ("open.safetensors", "linked.safetensors"):
            r, src = await take_and_verify(area, manifest, spec, source_dir, name, checksum)
            assert src.part is None and src.fd is not None and src.moved is not None  # the copy path
            assert not src.moved.exists()  # the moved original is gone once copied
            assert r.part.writable and stat.S_IMODE(r.part.path.stat().st_mode) == 0o600
            await r.abandon()
    finally:
        os.close(writer)
    assert no_parts(area)


async def test_a_local_source_on_another_filesystem_is_copied(area, tmp_path) -> None:
    if os.stat(tmp_path).st_dev == os.stat(area.root).st_dev:
        pytest.skip("needs the source on another filesystem than the staging directory")
    manifest, spec, payload = setup(adapter())
    (tmp_path / "b.safetensors").write_bytes(payload)
    r, src = await take_and_verify(
        area, manifest, spec, tmp_path, "b.safetensors", p.bucket_checksum(payload)
    )
    assert src.part is None and src.moved is None and (tmp_path / "b.safetensors").exists()
    await r.abandon()


async def test_a_refused_taken_over_source_is_deleted(area, source_dir) -> None:
    manifest, spec, payload = setup(adapter())
    (source_dir / "b.safetensors").write_bytes(payload)
    with pytest.raises(LoraVersionError) as info:
        await take_and_verify(area, manifest, spec, source_dir, "b.safetensors", "0" * 64)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH and list(area.root.iterdir()) == []
    os.symlink("/etc/hostname", source_dir / "link.safetensors")
    os.mkfifo(source_dir / "fifo.safetensors")
    for name in ("link.safetensors", "fifo.safetensors", "missing.safetensors"):
        with pytest.raises(LoraVersionError) as info:
            await take_and_verify(area, manifest, spec, source_dir, name, "0" * 64)
        assert info.value.code is ErrorCode.INVALID_REQUEST, name
    assert list(area.root.iterdir()) == []  # a moved symlink or FIFO is removed, never followed
    (source_dir / "short.safetensors").write_bytes(payload[:-2])
    with pytest.raises(LoraVersionError) as info:
        await take_and_verify(
            area, manifest, spec, source_dir, "short.safetensors", p.bucket_checksum(payload)
        )
    assert info.value.code is ErrorCode.INCOMPLETE_BODY and list(area.root.iterdir()) == []


# ------------------------------------------------------------------- integrity, from the rules
#
# The bucket checksum covers every payload byte (the header literally, each tensor through its
# digest); nothing may follow the last tensor; a bucket is at most the engine's cap. Each rule
# holds for every way a bucket arrives: a request body, a local source copied, one taken over.

SOURCES = ["body", "copied", "taken-over"]


async def receive_via(
    source: str, area: StagingArea, source_dir: Path, manifest, spec, data: bytes, checksum: str, cap: int
) -> BucketReceiver:
    """Receive ``data`` as bucket ``spec`` the way ``source`` says, with this ``cap``."""
    r = BucketReceiver(area, manifest, spec, checksum, cap)
    name = f"b-{source}.safetensors"
    try:
        if source == "body":
            for i in range(0, len(data), 4096):
                r.feed(data[i : i + 4096])
        else:
            (source_dir / name).write_bytes(data)
            if source == "copied":
                writer = os.open(source_dir / name, os.O_WRONLY)  # a writer: never taken over
                try:
                    src = area.take_local_source(source_dir, name)
                finally:
                    os.close(writer)
                assert src.part is None and src.fd is not None
                try:
                    await r.fill_from_file(src.fd)
                finally:
                    src.discard_moved()
            else:
                src = area.take_local_source(source_dir, name)
                assert src.part is not None
                await r.adopt(src.part)
        await r.finish()
    except BaseException:
        await r.abandon()
        raise
    return r


def split_payload(payload: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def with_header(doc: dict[str, Any], data: bytes, pad: int = 0) -> bytes:
    body = json.dumps(doc).encode()
    body += b" " * ((-(8 + len(body)) % 8) + pad)
    return struct.pack("<Q", len(body)) + body + data


HEADER_EDITS = {
    "metadata-added": lambda doc, data: with_header({"__metadata__": {"format": "pt"}, **doc}, data),
    "keys-reordered": lambda doc, data: with_header(dict(reversed(list(doc.items()))), data),
    "padded": lambda doc, data: with_header(doc, data, pad=8),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
@pytest.mark.parametrize("source", SOURCES)
async def test_the_checksum_covers_the_header_a_changed_header_over_the_same_tensor_bytes_is_refused(
    area, source_dir, source, edit
) -> None:
    manifest, spec, payload = setup(adapter())
    doc, data = split_payload(payload)
    other = HEADER_EDITS[edit](doc, data)
    assert split_payload(other)[1] == data and other != payload  # only the header differs
    cap = p.max_payload_bytes(manifest, spec) + 64 * 1024
    with pytest.raises(LoraVersionError) as info:
        await receive_via(source, area, source_dir, manifest, spec, other, p.bucket_checksum(payload), cap)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH and no_parts(area)
    # the changed header is itself valid: declared with its own checksum, the same bytes pass
    r = await receive_via(source, area, source_dir, manifest, spec, other, p.bucket_checksum(other), cap)
    await r.abandon()


@pytest.mark.parametrize("tail", [b"\0", b" " * 8, bytes(4096)], ids=["1-byte", "8-spaces", "4-KiB"])
@pytest.mark.parametrize("source", SOURCES)
async def test_bytes_after_the_last_tensor_are_refused(area, source_dir, source, tail) -> None:
    manifest, spec, payload = setup(adapter())
    cap = p.max_payload_bytes(manifest, spec) + 64 * 1024
    with pytest.raises(LoraVersionError) as info:
        await receive_via(
            source, area, source_dir, manifest, spec, payload + tail, p.bucket_checksum(payload), cap
        )
    assert info.value.code is ErrorCode.INVALID_REQUEST and no_parts(area)


@pytest.mark.parametrize("source", SOURCES)
async def test_a_bucket_exactly_at_the_cap_is_accepted_and_one_byte_over_is_refused(
    area, source_dir, source
) -> None:
    manifest, spec, payload = setup(adapter())
    checksum = p.bucket_checksum(payload)
    r = await receive_via(source, area, source_dir, manifest, spec, payload, checksum, cap=len(payload))
    await r.abandon()
    with pytest.raises(LoraVersionError) as info:
        await receive_via(source, area, source_dir, manifest, spec, payload, checksum, cap=len(payload) - 1)
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE and no_parts(area)


def body_request(body: bytes, chunk: int, content_length: bool) -> Any:
    """A starlette request whose body arrives in ``chunk``-byte messages."""
    from starlette.requests import Request

    messages = [
        {"type": "http.request", "body": body[i : i + chunk], "more_body": i + chunk < len(body)}
        for i in range(0, len(body), chunk)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    headers = [(b"content-length", str(len(body)).encode())] if content_length else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


@pytest.mark.parametrize("content_length", [True, False])
async def test_a_bucket_body_exactly_at_the_cap_is_read_and_one_byte_over_is_refused(
    area, content_length
) -> None:
    """The engine's body reader (sglang_ext.http_routes.read_body) with a receiver as its sink:
    the cap counts bytes as they arrive, whether or not Content-Length announced them."""
    from sglang_ext.engine_state import BodyLimits
    from sglang_ext.http_routes import read_body

    manifest, spec, payload = setup(adapter())
    checksum = p.bucket_checksum(payload)
    r = BucketReceiver(area, manifest, spec, checksum, len(payload))
    await read_body(body_request(payload, 100, content_length), len(payload), BodyLimits(), "bucket", r.feed)
    await r.finish()
    await r.abandon()
    over = BucketReceiver(area, manifest, spec, checksum, len(payload))
    with pytest.raises(LoraVersionError) as info:
        await read_body(
            body_request(payload + b"\0", 100, content_length),
            len(payload),
            BodyLimits(),
            "bucket",
            over.feed,
        )
    await over.abandon()
    # the receiver alone would say INVALID_REQUEST (longer than its header); the reader's cap is first
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE and no_parts(area)


def open_fds(*dirs: Path) -> set[tuple[str, str]]:
    """This process's fds on files under ``dirs`` (the staging area, a test's source): only
    those, since threads of the test session (its background engine starts) open and close fds of
    their own meanwhile."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if any(target.startswith(str(d)) for d in dirs):
            fds.add((fd, target))
    return fds


def failing_nth(real: Any, n: int, errno_: int) -> Any:
    """The real call, except its ``n``-th one fails with ``errno_`` (a full filesystem)."""
    calls = {"n": 0}

    def call(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno_, os.strerror(errno_))
        return real(*args)

    return call


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EDQUOT])
async def test_a_full_filesystem_mid_body_is_a_typed_refusal_that_leaves_no_file_and_no_fd(
    area, monkeypatch, errno_
) -> None:
    """The part is sparse and written through its fd: a full filesystem fails the write (a typed
    refusal), where a store into a mapped page of a sparse file would SIGBUS the engine."""
    manifest, spec, payload = setup(adapter(hidden=256))
    before = open_fds(area.root)
    monkeypatch.setattr(staging.os, "pwrite", failing_nth(os.pwrite, 3, errno_))
    with pytest.raises(LoraVersionError) as info:
        await receive(area, manifest, spec, payload, chunk=4096)
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE and "no room" in info.value.message
    assert no_parts(area) and open_fds(area.root) == before


async def test_a_committed_or_refused_part_keeps_no_fd(area) -> None:
    manifest, spec, payload = setup(adapter())
    before = open_fds(area.root)
    r = await receive(area, manifest, spec, payload)
    area.commit_part(KEY, r.part, 0)
    with pytest.raises(LoraVersionError):
        await receive(area, manifest, spec, payload, checksum="0" * 64)
    assert open_fds(area.root) == before and no_parts(area)


@pytest.mark.parametrize("errno_", [errno.EXDEV, errno.ENOSYS])
async def test_a_local_source_is_copied_by_read_and_write_where_the_kernel_cannot_copy_it(
    area, tmp_path, monkeypatch, errno_
) -> None:
    tensors = adapter(hidden=2048)  # several copy strides
    manifest, spec, payload = setup(tensors)
    src = tmp_path / "src"
    src.mkdir()
    (src / "b0.safetensors").write_bytes(payload)
    refused = []

    def no_copy_file_range(*args: Any) -> int:
        refused.append(args)
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(staging.os, "copy_file_range", no_copy_file_range)
    r = await fill_from(area, manifest, spec, src / "b0.safetensors", p.bucket_checksum(payload))
    area.commit_part(KEY, r.part, 0)
    [f] = area.bucket_files(KEY)
    assert refused and f.read_bytes() == payload


async def test_a_local_source_that_fills_the_filesystem_is_a_typed_refusal(
    area, tmp_path, monkeypatch
) -> None:
    manifest, spec, payload = setup(adapter(hidden=2048))
    src = tmp_path / "src"
    src.mkdir()
    (src / "b0.safetensors").write_bytes(payload)
    monkeypatch.setattr(staging.os, "copy_file_range", failing_nth(os.copy_file_range, 2, errno.ENOSPC))
    with pytest.raises(LoraVersionError) as info:
        await fill_from(area, manifest, spec, src / "b0.safetensors", p.bucket_checksum(payload))
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE and no_parts(area)


async def test_a_kernel_copy_failure_that_does_not_say_whose_is_retried_as_a_read_and_a_write(
    area, tmp_path, monkeypatch
) -> None:
    """copy_file_range's EIO may be the source's or the part's: the stride is copied again by a
    read and a write (here both succeed), and the bucket is accepted byte for byte."""
    manifest, spec, payload = setup(adapter(hidden=2048))  # several copy strides
    src = tmp_path / "src"
    src.mkdir()
    (src / "b0.safetensors").write_bytes(payload)
    monkeypatch.setattr(staging.os, "copy_file_range", failing_nth(os.copy_file_range, 2, errno.EIO))
    r = await fill_from(area, manifest, spec, src / "b0.safetensors", p.bucket_checksum(payload))
    area.commit_part(KEY, r.part, 0)
    [f] = area.bucket_files(KEY)
    assert f.read_bytes() == payload


@pytest.mark.parametrize("side", ["source", "part"])
async def test_a_failed_copy_names_the_side_that_failed(area, tmp_path, monkeypatch, side: str) -> None:
    """The source's read failing is the sender's INCOMPLETE_BODY; the part's own write failing is
    the engine's, as a bucket body's write fails (the bucket fails, never a sender's fault)."""
    manifest, spec, payload = setup(adapter(hidden=2048))
    src = tmp_path / "src"
    src.mkdir()
    (src / "b0.safetensors").write_bytes(payload)
    before = open_fds(area.root, tmp_path)
    eio = OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(staging.os, "copy_file_range", lambda *a: (_ for _ in ()).throw(eio))
    # the receiver's own two reads of the header are the first preads; the copy's come after
    call, nth = ("pread", 4) if side == "source" else ("pwrite", 2)
    monkeypatch.setattr(staging.os, call, failing_nth(getattr(os, call), nth, errno.EIO))
    with pytest.raises(Exception) as info:
        await fill_from(area, manifest, spec, src / "b0.safetensors", p.bucket_checksum(payload))
    if side == "source":
        assert isinstance(info.value, LoraVersionError)
        assert info.value.code is ErrorCode.INCOMPLETE_BODY and "source file unreadable" in info.value.message
    else:
        assert not isinstance(info.value, LoraVersionError), "not the sender's fault"
        assert isinstance(info.value, OSError) and info.value.errno == errno.EIO
    assert no_parts(area) and open_fds(area.root, tmp_path) == before


async def test_the_read_waits_while_the_write_lane_is_a_backlog_behind_and_goes_on_when_it_catches_up(
    area, monkeypatch
) -> None:
    """The body's chunks are written on a lane: a lane that cannot keep up (starved by decode)
    holds the body's read at WRITE_BACKLOG_BYTES, never a whole bucket in memory."""
    tensors = adapter(hidden=131072)  # ~12 MiB: more than the backlog
    manifest, spec, payload = setup(tensors)
    assert len(payload) > WRITE_BACKLOG_BYTES + (1 << 20)
    release = threading.Event()
    real_pwrite = os.pwrite

    def held_pwrite(fd: int, data: Any, offset: int) -> int:
        release.wait(30)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(staging.os, "pwrite", held_pwrite)
    cap = p.max_payload_bytes(manifest, spec) + 64 * 1024
    r = BucketReceiver(area, manifest, spec, p.bucket_checksum(payload), cap)
    chunk, pos = 1 << 20, 0
    try:
        while pos <= WRITE_BACKLOG_BYTES:  # the lane holds every chunk so far
            await r.pace()
            r.feed(payload[pos : pos + chunk])
            pos += chunk
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.pace(), 0.3)  # more than the backlog is unwritten: wait
        release.set()
        await asyncio.wait_for(r.pace(), 30)
        while pos < len(payload):
            await r.pace()
            r.feed(payload[pos : pos + chunk])
            pos += chunk
        await r.finish()
    finally:
        release.set()
    area.commit_part(KEY, r.part, 0)
    [f] = area.bucket_files(KEY)
    assert f.read_bytes() == payload


async def test_a_write_lane_failure_stops_the_read_at_the_next_chunk(area, monkeypatch) -> None:
    manifest, spec, payload = setup(adapter(hidden=2048))
    monkeypatch.setattr(staging.os, "pwrite", failing_nth(os.pwrite, 1, errno.ENOSPC))
    r = BucketReceiver(area, manifest, spec, p.bucket_checksum(payload), len(payload) + 1024)
    r.feed(payload[:4096])
    # the lane runs in order: once a later no-op ran, the first chunk's write has failed
    await asyncio.wrap_future(bucket_receiver._WRITE_LANE.submit(lambda: None))
    with pytest.raises(LoraVersionError) as info:
        await r.pace()
    with pytest.raises(LoraVersionError):
        r.feed(payload[4096:8192])  # nothing more is taken
    await r.abandon()
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE and no_parts(area)
