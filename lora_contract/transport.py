"""Transport of a version's tensors: the bucket plan (how tensors are grouped, never part of the
identity: the same adapter under any bucket cap has the same manifest and digest), the bucket
payloads (safetensors bytes with their sha256) and their checks on receipt."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, Field

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.identity import (
    DTYPE_ITEMSIZE,
    Manifest,
    TensorEntry,
    check_entry_layout,
    check_tensor_against_manifest,
)
from lora_contract.wire_models import NonNegInt, WireModel, invalid

if TYPE_CHECKING:
    import torch

# A soft target for the planner (see plan_buckets); the engine enforces its own hard limit.
BUCKET_TARGET_BYTES = 64 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# Bucket plan and payloads (transport only)
# --------------------------------------------------------------------------------------------


class BucketSpec(WireModel):
    index: NonNegInt
    tensor_names: tuple[str, ...] = Field(min_length=1)
    total_bytes: NonNegInt  # tensor data only; the safetensors header comes on top


def plan_buckets(manifest: Manifest, max_bucket_bytes: int = BUCKET_TARGET_BYTES) -> list[BucketSpec]:
    """Greedy buckets in manifest (name) order, each at most ``max_bucket_bytes`` of tensor data.

    A tensor is never split (a payload carries whole tensors), so a single tensor larger than
    the cap gets a bucket of its own. The cap is the planner's target; whether an engine accepts
    such a bucket is its own decision at ``begin`` (PAYLOAD_TOO_LARGE before any data moves).
    """
    if isinstance(max_bucket_bytes, bool) or not isinstance(max_bucket_bytes, int) or max_bucket_bytes < 1:
        raise invalid(f"max_bucket_bytes must be a positive integer, got {max_bucket_bytes!r}")
    groups: list[list[TensorEntry]] = []
    for entry in manifest.tensors:
        current = groups[-1] if groups else None
        if current and sum(e.nbytes for e in current) + entry.nbytes <= max_bucket_bytes:
            current.append(entry)
        else:
            groups.append([entry])
    return [
        BucketSpec(index=i, tensor_names=tuple(e.name for e in g), total_bytes=sum(e.nbytes for e in g))
        for i, g in enumerate(groups)
    ]


def plan_problem(manifest: Manifest, plan: Iterable[BucketSpec]) -> str | None:
    plan = list(plan)
    if not plan:
        return "bucket plan is empty"
    if [b.index for b in plan] != list(range(len(plan))):
        return "bucket indices must be 0..n-1 in order"
    sizes = {t.name: t.nbytes for t in manifest.tensors}
    seen: list[str] = [name for b in plan for name in b.tensor_names]
    if len(seen) != len(set(seen)) or set(seen) != set(sizes):
        return "bucket plan must cover every manifest tensor exactly once"
    for b in plan:
        if b.total_bytes != sum(sizes[n] for n in b.tensor_names):
            return f"bucket {b.index}: total_bytes does not match the manifest"
    return None


def check_bucket_plan(manifest: Manifest, plan: Iterable[BucketSpec]) -> None:
    """Refuse a plan that does not cover the manifest exactly once (MANIFEST_MISMATCH)."""
    problem = plan_problem(manifest, plan)
    if problem:
        raise LoraVersionError(ErrorCode.MANIFEST_MISMATCH, problem)


def max_payload_bytes(manifest: Manifest, spec: BucketSpec) -> int:
    """A safe upper bound on ``len(encode_bucket(..., spec))``: tensor data plus a generous bound
    on the safetensors JSON header, so an engine can refuse an oversized body before reading it."""
    header = 64  # braces, the 8-byte length prefix, alignment padding
    for name in spec.tensor_names:
        entry = manifest.entry(name)
        ndim = len(entry.shape) if entry else 8
        # quoted name (JSON escapes at most 6x), keys and dtype tag, 20 digits per number
        header += 6 * len(name.encode()) + 96 + 21 * (ndim + 2)
    return spec.total_bytes + header


# --------------------------------------------------------------------------------------------
# Payload layout and checksum
# --------------------------------------------------------------------------------------------

# safetensors dtype tag -> manifest dtype name (identity.DTYPE_ITEMSIZE's keys)
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# the header length prefix of a safetensors payload
HEADER_PREFIX_BYTES = 8
# safetensors' own bound on the JSON header
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's raw bytes lie in a payload (absolute offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class PayloadLayout:
    """A parsed safetensors payload: header end and the tensors in data order."""

    header_end: int  # the 8-byte prefix plus the JSON header
    size: int  # the whole payload
    tensors: tuple[TensorSpan, ...]


def header_length(prefix: bytes | memoryview) -> int | None:
    """The JSON header's length from the first 8 bytes (None: fewer than 8 bytes yet)."""
    if len(prefix) < HEADER_PREFIX_BYTES:
        return None
    n = int.from_bytes(prefix[:HEADER_PREFIX_BYTES], "little")
    if n < 2 or n > MAX_HEADER_BYTES:
        raise invalid(f"bucket payload is not valid safetensors: header length {n}")
    return n


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key in safetensors header")
    return dict(pairs)


def _nonneg_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse_payload_layout(header: bytes | memoryview) -> PayloadLayout:
    """Parse the 8-byte prefix plus JSON header of a safetensors payload, strictly: every
    entry well formed, a known dtype, offsets that tile the data region exactly (no gap, no
    overlap, nothing after). Any defect is INVALID_REQUEST. Torch-free, reads no tensor byte."""
    n = header_length(header)
    if n is None or len(header) < HEADER_PREFIX_BYTES + n:
        raise invalid("bucket payload is not valid safetensors: truncated header")
    try:
        doc = json.loads(
            bytes(header[HEADER_PREFIX_BYTES : HEADER_PREFIX_BYTES + n]).decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid(f"bucket payload is not valid safetensors: header: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid("bucket payload is not valid safetensors: header is not an object")
    meta = doc.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise invalid("bucket payload is not valid safetensors: bad __metadata__")
    header_end = HEADER_PREFIX_BYTES + n
    spans: list[TensorSpan] = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise invalid(f"bucket payload is not valid safetensors: bad entry {name[:200]!r}")
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        shape, offsets = entry["shape"], entry["data_offsets"]
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(_nonneg_int(d) for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_nonneg_int(o) for o in offsets)
            or offsets[1] - offsets[0] != math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        ):
            raise invalid(f"bucket payload is not valid safetensors: bad entry {name[:200]!r}")
        spans.append(TensorSpan(name, dtype, tuple(shape), header_end + offsets[0], header_end + offsets[1]))
    spans.sort(key=lambda t: (t.start, t.end))
    cursor = header_end
    for span in spans:
        if span.start != cursor:
            raise invalid("bucket payload is not valid safetensors: tensor data not contiguous")
        cursor = span.end
    return PayloadLayout(header_end=header_end, size=cursor, tensors=tuple(spans))


def _check_names_against_plan(spec: BucketSpec, names: Iterable[str]) -> None:
    got, planned = set(names), set(spec.tensor_names)
    if got != planned:
        raise LoraVersionError(
            ErrorCode.MANIFEST_MISMATCH,
            f"bucket {spec.index} holds other tensors than its plan",
            unexpected=sorted(got - planned)[:20],
            missing=sorted(planned - got)[:20],
        )


def check_layout_against_plan(manifest: Manifest, spec: BucketSpec, layout: PayloadLayout) -> None:
    """The payload holds exactly the spec's tensors, each with the manifest's dtype and shape
    (MANIFEST_MISMATCH), checked from the header alone, before any tensor byte is read."""
    _check_names_against_plan(spec, [t.name for t in layout.tensors])
    for t in layout.tensors:
        check_entry_layout(manifest, t.name, t.dtype, t.shape)


def _whole_payload_layout(view: memoryview) -> PayloadLayout:
    """The layout of a complete payload in memory (INVALID_REQUEST unless valid and whole)."""
    n = header_length(view)
    if n is None:
        raise invalid("bucket payload is not valid safetensors: truncated header")
    layout = parse_payload_layout(view[: HEADER_PREFIX_BYTES + n])
    if layout.size != len(view):
        raise invalid("bucket payload is not valid safetensors: size does not match its header")
    return layout


def bucket_checksum_of(header: bytes | memoryview, tensor_sha256: Mapping[str, str]) -> str:
    """The bucket checksum: sha256 over the payload's header bytes and then its tensors' sha256
    digests in name order. Every payload byte is covered (the header literally, each tensor
    through its digest), and each byte is hashed once: the per-tensor digests are the ones the
    manifest pins, so checking a bucket against its checksum and against the manifest costs one
    pass over the data, not two."""
    h = hashlib.sha256(header)
    for name in sorted(tensor_sha256):
        h.update(bytes.fromhex(tensor_sha256[name]))
    return h.hexdigest()


def bucket_checksum(payload: bytes | memoryview) -> str:
    """:func:`bucket_checksum_of` computed from the payload itself (INVALID_REQUEST when it is
    not valid safetensors)."""
    view = memoryview(payload)
    layout = _whole_payload_layout(view)
    digests = {t.name: hashlib.sha256(view[t.start : t.end]).hexdigest() for t in layout.tensors}
    return bucket_checksum_of(view[: layout.header_end], digests)


def manifest_bucket_checksum(manifest: Manifest, payload: bytes | memoryview) -> str:
    """The checksum of a payload encoded from tensors that match ``manifest``, taking their
    digests from it instead of hashing the bytes again (the sender's fast path; the engine
    hashes what it receives)."""
    view = memoryview(payload)
    layout = _whole_payload_layout(view)
    digests: dict[str, str] = {}
    for t in layout.tensors:
        entry = manifest.entry(t.name)
        if entry is None:
            raise LoraVersionError(ErrorCode.MANIFEST_MISMATCH, f"tensor {t.name!r} is not in the manifest")
        digests[t.name] = entry.sha256
    return bucket_checksum_of(view[: layout.header_end], digests)


_SAFETENSORS_TAG = {name: tag for tag, name in SAFETENSORS_DTYPES.items()}


def _canonical_header(items: Iterable[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[str]]:
    """The canonical safetensors header of (name, dtype, shape, nbytes) tensors, and their
    names in data order: by item size descending then name (safetensors' own rule, so every
    tensor starts aligned to its item size), offsets contiguous, no metadata, the header padded
    with spaces to a multiple of 8 bytes."""
    order = sorted(items, key=lambda t: (-DTYPE_ITEMSIZE[t[1]], t[0]))
    doc: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, nbytes in order:
        doc[name] = {
            "dtype": _SAFETENSORS_TAG[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(HEADER_PREFIX_BYTES + len(body)) % 8)
    return len(body).to_bytes(HEADER_PREFIX_BYTES, "little") + body, [t[0] for t in order]


def bucket_header(manifest: Manifest, spec: BucketSpec) -> bytes:
    """The header of the bucket :func:`encode_bucket` makes of tensors that match ``manifest``:
    an engine that knows the manifest and the plan knows every payload's header, so a transport
    that carries only tensor bytes (the collective one) needs nothing else to rebuild the file."""
    items = []
    for name in spec.tensor_names:
        entry = manifest.entry(name)
        if entry is None:
            raise LoraVersionError(ErrorCode.MANIFEST_MISMATCH, f"tensor {name!r} is not in the manifest")
        items.append((name, entry.dtype, tuple(entry.shape), entry.nbytes))
    return _canonical_header(items)[0]


def encode_bucket(tensors: Mapping[str, torch.Tensor], spec: BucketSpec) -> bytes:
    """The safetensors payload of exactly ``spec.tensor_names`` taken from ``tensors``, in the
    canonical layout (:func:`bucket_header`): the same bytes whichever transport carries them."""
    import torch  # lazy: the contract loads without torch (test_protocol_import_is_light)

    missing = [n for n in spec.tensor_names if n not in tensors]
    if missing:
        raise invalid(f"bucket {spec.index}: tensors not provided: {missing[:5]!r}")
    flat = {n: tensors[n].detach().to("cpu").contiguous() for n in spec.tensor_names}
    header, order = _canonical_header(
        (n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
        for n, t in flat.items()
    )
    # one copy: join takes each tensor's bytes through the buffer protocol
    return b"".join([header, *(flat[n].reshape(-1).view(torch.uint8).numpy() for n in order)])


def decode_bucket(payload: bytes, *, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a bucket payload. With ``expected_sha256`` the bucket checksum is checked
    first (CHECKSUM_MISMATCH); a payload that is not valid safetensors is INVALID_REQUEST."""
    from safetensors.torch import load  # lazy: the contract loads without torch (see encode_bucket)

    if expected_sha256 is not None and bucket_checksum(payload) != expected_sha256:
        raise LoraVersionError(ErrorCode.CHECKSUM_MISMATCH, "bucket checksum does not match")
    try:
        return load(bytes(payload))
    except Exception as exc:  # safetensors raises its own error types; all mean "bad payload"
        raise invalid(f"bucket payload is not valid safetensors: {exc}") from None


def check_bucket_tensors(manifest: Manifest, spec: BucketSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """A decoded bucket holds exactly its spec's tensors, each matching the manifest."""
    _check_names_against_plan(spec, tensors)
    for name in spec.tensor_names:
        check_tensor_against_manifest(manifest, name, tensors[name])


# Bucket metadata travels in headers; the body is the raw safetensors payload.
LORA_NAME_HEADER = "X-Lora-Name"
ATTEMPT_TOKEN_HEADER = "X-Attempt-Token"
BUCKET_INDEX_HEADER = "X-Bucket-Index"
BUCKET_SHA256_HEADER = "X-Bucket-Sha256"
# Optional: the bucket is the named file of the engine's local source directory (empty body).
BUCKET_SOURCE_HEADER = "X-Bucket-Source"
# Optional: the registered transport the bucket travelled over, when that is not the call itself
# (the body is then empty), e.g. "collective": its engine group.
BUCKET_TRANSPORT_HEADER = "X-Bucket-Transport"
BUCKET_CONTENT_TYPE = "application/octet-stream"


# --------------------------------------------------------------------------------------------
# Transports: registered names
# --------------------------------------------------------------------------------------------

# The bytes travel in the call that acknowledges them (its body, or a file of the engine's local
# source directory named in it): the one transport every engine and client has.
HTTP_TRANSPORT = "http"
# The bytes travel over the engine's collective group (lora_contract.collective_group).
COLLECTIVE_TRANSPORT = "collective"
TRANSPORT_NAME = r"[a-z][a-z0-9_-]{0,31}"
_TRANSPORT_NAME = re.compile(TRANSPORT_NAME)

# Every transport a message may name. Any other transport's bytes come *out of band*: the
# acknowledging call has an empty body and names the transport (BUCKET_TRANSPORT_HEADER). Each
# side plugs its own end in under the same name (the engine's receive:
# sglang_ext.bucket_sources.register_receive; the trainer's sender:
# relax_glue.bucket_transport.register_sender), so a new transport edits no message, no route
# and no shell.
_TRANSPORTS: set[str] = {HTTP_TRANSPORT}


def register_transport(name: str) -> str:
    """Make ``name`` a transport the messages may carry (idempotent); returns it."""
    if not _TRANSPORT_NAME.fullmatch(name):  # fullmatch: "$" would let a trailing newline in
        raise ValueError(f"a transport name matches {TRANSPORT_NAME}, got {name!r}")
    _TRANSPORTS.add(name)
    return name


def registered_transports() -> frozenset[str]:
    return frozenset(_TRANSPORTS)


def check_transport_name(name: str) -> str:
    """``name`` if it is a registered transport; ValueError (an INVALID_REQUEST once parsed) if not."""
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown transport {name[:50]!r} (registered: {sorted(_TRANSPORTS)})")
    return name


# A message field naming a transport: validated against the registry when the message is built.
TransportName = Annotated[str, AfterValidator(check_transport_name)]

register_transport(COLLECTIVE_TRANSPORT)
