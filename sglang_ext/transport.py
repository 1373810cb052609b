"""Transport of a version's tensors: the bucket plan (how tensors are grouped, never part of the
identity: the same adapter under any bucket cap has the same manifest and digest), the bucket
payloads (safetensors bytes with their sha256) and their checks on receipt."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pydantic import Field

from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.identity import Manifest, TensorEntry, check_tensor_against_manifest
from sglang_ext.wire import NonNegInt, WireModel, invalid

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


def payload_sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def encode_bucket(tensors: Mapping[str, torch.Tensor], spec: BucketSpec) -> bytes:
    """The safetensors payload of exactly ``spec.tensor_names`` taken from ``tensors``."""
    from safetensors.torch import save

    missing = [n for n in spec.tensor_names if n not in tensors]
    if missing:
        raise invalid(f"bucket {spec.index}: tensors not provided: {missing[:5]!r}")
    return save({n: tensors[n].detach().to("cpu").contiguous() for n in spec.tensor_names})


def decode_bucket(payload: bytes, *, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a bucket payload. With ``expected_sha256`` the bytes are checked first
    (CHECKSUM_MISMATCH); a payload that is not valid safetensors is INVALID_REQUEST."""
    from safetensors.torch import load

    if expected_sha256 is not None and payload_sha256(payload) != expected_sha256:
        raise LoraVersionError(ErrorCode.CHECKSUM_MISMATCH, "bucket payload sha256 does not match")
    try:
        return load(bytes(payload))
    except Exception as exc:  # safetensors raises its own error types; all mean "bad payload"
        raise invalid(f"bucket payload is not valid safetensors: {exc}") from None


def check_bucket_tensors(manifest: Manifest, spec: BucketSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """A decoded bucket holds exactly its spec's tensors, each matching the manifest."""
    if set(tensors) != set(spec.tensor_names):
        raise LoraVersionError(
            ErrorCode.MANIFEST_MISMATCH,
            f"bucket {spec.index} holds other tensors than its plan",
            unexpected=sorted(set(tensors) - set(spec.tensor_names))[:20],
            missing=sorted(set(spec.tensor_names) - set(tensors))[:20],
        )
    for name in spec.tensor_names:
        check_tensor_against_manifest(manifest, name, tensors[name])


# Bucket metadata travels in headers; the body is the raw safetensors payload.
LORA_NAME_HEADER = "X-Lora-Name"
ATTEMPT_TOKEN_HEADER = "X-Attempt-Token"
BUCKET_INDEX_HEADER = "X-Bucket-Index"
BUCKET_SHA256_HEADER = "X-Bucket-Sha256"
BUCKET_CONTENT_TYPE = "application/octet-stream"
