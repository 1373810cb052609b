"""The wire protocol shared by the engine plugin and the trainer side.

One source of truth for: the canonical manifest and its digest (a LoRA version's identity), the
immutable ``lora_name`` format, the bucket plan and bucket payloads (transport), and the pydantic
models of every engine control request and reply.

Import discipline: this module is imported by ``relax_glue`` (no engine) and by the plugin inside
every SGLang process, so at import time it touches only stdlib and pydantic. ``torch`` and
``safetensors`` are imported inside the few functions that handle tensors.

Identity, in short::

    manifest  = {schema_version, config: normalised PEFT serving config,
                 tensors: [{name, dtype, shape, nbytes, sha256}, ...] sorted by name}
    digest    = sha256(canonical_manifest_bytes(manifest)).hexdigest()
    lora_name = f"{prefix}@{epoch}-{version_id}-{digest[:12]}"

The bucket plan (how tensors are grouped for transfer) is transport, not identity: the same
adapter under any bucket cap has the same manifest and digest.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sglang_ext.errors import ErrorCode, LoraVersionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ATTEMPT_TOKEN_HEADER",
    "BUCKET_CONTENT_TYPE",
    "BUCKET_INDEX_HEADER",
    "BUCKET_SHA256_HEADER",
    "DEFAULT_LORA_PREFIX",
    "DEFAULT_MAX_BUCKET_BYTES",
    "DIGEST_PREFIX_LEN",
    "DTYPE_ITEMSIZE",
    "LORA_NAME_HEADER",
    "MANIFEST_SCHEMA_VERSION",
    "SERVING_CONFIG_FIELDS",
    "BeginReply",
    "BeginRequest",
    "BucketAck",
    "BucketSpec",
    "CleanupReceipt",
    "CleanupRequest",
    "DrainingReply",
    "EndRequest",
    "EngineStatus",
    "EngineVersionState",
    "Manifest",
    "ParsedLoraName",
    "PreparedReceipt",
    "ReadyReceipt",
    "ReceiveBucketMeta",
    "ReclaimReply",
    "ReclaimRequest",
    "Routes",
    "TensorEntry",
    "UnloadedReceipt",
    "VersionKey",
    "VersionStatus",
    "canonical_manifest_bytes",
    "check_bucket_plan",
    "check_bucket_tensors",
    "check_tensor_against_manifest",
    "check_tensor_set",
    "decode_bucket",
    "encode_bucket",
    "is_managed_name",
    "make_lora_name",
    "manifest_digest",
    "manifest_from_tensors",
    "max_payload_bytes",
    "normalise_serving_config",
    "parse_begin_reply",
    "parse_lora_name",
    "parse_model",
    "parse_reclaim_reply",
    "payload_sha256",
    "plan_buckets",
    "read_peft_dir",
    "tensor_entry",
]

MANIFEST_SCHEMA_VERSION = 1
DEFAULT_LORA_PREFIX = "relax_policy_lora"
# A soft target for the planner (see plan_buckets); the engine enforces its own hard limit.
DEFAULT_MAX_BUCKET_BYTES = 64 * 1024 * 1024

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


# --------------------------------------------------------------------------------------------
# Small shared types
# --------------------------------------------------------------------------------------------

_NAME_PART = r"[A-Za-z0-9_.]{1,64}"
_NAME_PART_RE = re.compile(_NAME_PART)
# The only definition of the managed name shape. '-' and '@' are excluded from every part, so
# '@' splits the prefix off and '-' splits epoch / version_id / digest prefix unambiguously.
# Always used with fullmatch: '$' would also accept a trailing newline.
_LORA_NAME_RE = re.compile(
    rf"(?P<prefix>{_NAME_PART})@(?P<epoch>{_NAME_PART})-(?P<version_id>{_NAME_PART})"
    r"-(?P<digest_prefix>[0-9a-f]{12})"
)
DIGEST_PREFIX_LEN = 12
_SHA256 = r"[0-9a-f]{64}"
_SHA256_RE = re.compile(_SHA256)

Sha256Hex = Annotated[str, StringConstraints(pattern=rf"^{_SHA256}$")]
NamePart = Annotated[str, StringConstraints(pattern=rf"^{_NAME_PART}$")]
# Tokens and ids travel in HTTP headers and logs: a header-safe charset, bounded length.
Token = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]
NonNegInt = Annotated[int, Field(ge=0)]


def _check_managed_name(name: str) -> str:
    if parse_lora_name(name) is None:
        raise ValueError(f"not a managed lora_name: {name!r} (expected prefix@epoch-version_id-digest12)")
    return name


LoraName = Annotated[str, AfterValidator(_check_managed_name)]

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class _Model(BaseModel):
    model_config = _FROZEN


def _mismatch(message: str) -> PydanticCustomError:
    # A validator error tagged with our code, so parse_model() reports MANIFEST_MISMATCH rather
    # than a generic INVALID_REQUEST for an internally inconsistent manifest or plan.
    return PydanticCustomError(ErrorCode.MANIFEST_MISMATCH.value, message)


# --------------------------------------------------------------------------------------------
# Serving config normalisation
# --------------------------------------------------------------------------------------------

# Bytes per element, keyed by torch dtype name without the "torch." prefix. Kept torch-free so
# that manifests can be validated on either side without importing torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Serving-relevant PEFT LoRA fields, with the default that an absent field stands for. Fields not
# listed (lora_dropout, task_type, base_model_name_or_path, inference_mode, revision,
# init_lora_weights, ...) change training or bookkeeping, not the served function, so they are
# dropped: two exports of the same weights must not differ in identity because of them. The base
# model is fixed per deployment epoch, so its path is not part of the adapter's identity.
_REQUIRED_FIELDS = ("r", "lora_alpha", "target_modules")
_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "peft_type": "LORA",
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
    "exclude_modules": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
SERVING_CONFIG_FIELDS: tuple[str, ...] = (*_REQUIRED_FIELDS, *_OPTIONAL_DEFAULTS)


def _invalid(message: str, **details: Any) -> LoraVersionError:
    return LoraVersionError(ErrorCode.INVALID_REQUEST, message, **details)


def _norm_int(field: str, value: Any, *, minimum: int) -> int:
    # bool is an int subclass; a True rank is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _invalid(f"config.{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _norm_number(field: str, value: Any) -> int | float:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, float) or not math.isfinite(value):
        raise _invalid(f"config.{field} must be a finite number, got {value!r}")
    # 16 and 16.0 are the same scale; JSON would spell them differently.
    return int(value) if value.is_integer() else value


def _norm_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(f"config.{field} must be a boolean, got {value!r}")
    return value


def _norm_str(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(f"config.{field} must be a non-empty string, got {value!r}")
    return value


def _norm_module_set(field: str, value: Any, *, allow_none: bool) -> list[str] | str | None:
    """A module selector: a regex string stays as is; a collection becomes a sorted unique list."""
    if value is None:
        if allow_none:
            return None
        raise _invalid(f"config.{field} is required")
    if isinstance(value, str):
        return _norm_str(field, value)
    if not isinstance(value, list | tuple | set | frozenset):
        raise _invalid(f"config.{field} must be a string or a list of strings, got {value!r}")
    items = [_norm_str(field, v) for v in value]
    if not items:
        if allow_none:
            return None  # an empty list selects nothing, exactly like None
        raise _invalid(f"config.{field} must not be empty")
    return sorted(set(items))


def _norm_layers(value: Any) -> list[int] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, list | tuple):
        raise _invalid(f"config.layers_to_transform must be an int or a list of ints, got {value!r}")
    layers = sorted({_norm_int("layers_to_transform", v, minimum=0) for v in values})
    return layers or None


def _norm_layers_pattern(value: Any) -> list[str] | str | None:
    # Order matters to PEFT for a list of patterns (first match wins), so it is kept as given.
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise _invalid(f"config.layers_pattern must be a string or a list of strings, got {value!r}")


def _norm_pattern(field: str, value: Any, *, integer: bool) -> dict[str, int | float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _invalid(f"config.{field} must be a mapping, got {value!r}")
    out: dict[str, int | float] = {}
    for key, v in value.items():
        key = _norm_str(f"{field} key", key)
        out[key] = _norm_int(f"{field}[{key}]", v, minimum=1) if integer else _norm_number(field, v)
    return dict(sorted(out.items()))


def normalise_serving_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical serving config of a PEFT LoRA ``adapter_config.json`` dict.

    Rules (one place, both sides):
    - only ``SERVING_CONFIG_FIELDS`` are kept; every other key is dropped;
    - ``r``, ``lora_alpha`` and ``target_modules`` are required (SGLang reads them directly);
    - an absent optional field equals its PEFT default, and the default is written out, so
      ``{}`` and ``{"use_dora": False}`` normalise identically;
    - ``lora_alpha`` and pattern alphas: an integral float becomes an int (16.0 -> 16);
    - ``target_modules``, ``modules_to_save``, ``exclude_modules``: a list becomes a sorted
      unique list (a regex string is kept verbatim); an empty list of the optional ones is None;
    - ``layers_to_transform``: a sorted unique list of ints or None;
    - ``rank_pattern``/``alpha_pattern``: dicts with sorted keys (None becomes {});
    - ``peft_type`` upper-cased; types are checked strictly (no bool where an int is expected).

    The result is itself a valid PEFT dict, so the engine can load with it as ``config_dict``.
    Raises ``LoraVersionError(INVALID_REQUEST)``. Idempotent.
    """
    if not isinstance(config, Mapping):
        raise _invalid(f"config must be a mapping, got {type(config).__name__}")
    missing = [f for f in _REQUIRED_FIELDS if config.get(f) is None]
    if missing:
        raise _invalid(f"config is missing required fields {missing}", missing=missing)

    def get(field: str) -> Any:
        return config.get(field, _OPTIONAL_DEFAULTS[field])

    return {
        "r": _norm_int("r", config["r"], minimum=1),
        "lora_alpha": _norm_number("lora_alpha", config["lora_alpha"]),
        "target_modules": _norm_module_set("target_modules", config["target_modules"], allow_none=False),
        "peft_type": _norm_str("peft_type", get("peft_type")).upper(),
        "bias": _norm_str("bias", get("bias")),
        "fan_in_fan_out": _norm_bool("fan_in_fan_out", get("fan_in_fan_out")),
        "use_rslora": _norm_bool("use_rslora", get("use_rslora")),
        "use_dora": _norm_bool("use_dora", get("use_dora")),
        "modules_to_save": _norm_module_set("modules_to_save", get("modules_to_save"), allow_none=True),
        "exclude_modules": _norm_module_set("exclude_modules", get("exclude_modules"), allow_none=True),
        "layers_to_transform": _norm_layers(get("layers_to_transform")),
        "layers_pattern": _norm_layers_pattern(get("layers_pattern")),
        "rank_pattern": _norm_pattern("rank_pattern", get("rank_pattern"), integer=True),
        "alpha_pattern": _norm_pattern("alpha_pattern", get("alpha_pattern"), integer=False),
    }


# --------------------------------------------------------------------------------------------
# Manifest and digest
# --------------------------------------------------------------------------------------------


class TensorEntry(_Model):
    """One tensor of the adapter: ``sha256`` is over its raw contiguous (little-endian) bytes,
    i.e. exactly the bytes safetensors stores for it."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    dtype: str
    shape: tuple[NonNegInt, ...]
    nbytes: NonNegInt
    sha256: Sha256Hex

    @model_validator(mode="after")
    def _consistent(self) -> TensorEntry:
        itemsize = DTYPE_ITEMSIZE.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"unsupported dtype {self.dtype!r} for {self.name!r}")
        if self.nbytes != math.prod(self.shape) * itemsize:
            raise _mismatch(f"{self.name}: nbytes {self.nbytes} != prod(shape) * itemsize")
        return self


class Manifest(_Model):
    """The identity of a LoRA version. Build it with ``manifest_from_tensors``; treat it as
    read-only (the config dict is a plain dict for JSON's sake)."""

    schema_version: Literal[1] = MANIFEST_SCHEMA_VERSION
    config: dict[str, Any]
    tensors: tuple[TensorEntry, ...] = Field(min_length=1)

    @field_validator("config")
    @classmethod
    def _config_is_canonical(cls, config: dict[str, Any]) -> dict[str, Any]:
        # Only the canonical form is accepted, so a given adapter has exactly one manifest.
        try:
            canonical = normalise_serving_config(config)
        except LoraVersionError as exc:
            raise ValueError(exc.message) from None
        # Compare as JSON: in Python 16 == 16.0 and True == 1, but their canonical bytes differ.
        same_keys = set(config) == set(canonical)
        if not same_keys or json.dumps(canonical, sort_keys=True) != json.dumps(
            config, sort_keys=True, default=repr
        ):
            raise ValueError("config is not in canonical form; use normalise_serving_config()")
        return config

    @field_validator("tensors")
    @classmethod
    def _sorted_unique(cls, tensors: tuple[TensorEntry, ...]) -> tuple[TensorEntry, ...]:
        names = [t.name for t in tensors]
        if names != sorted(set(names)):
            raise _mismatch("manifest tensors must be unique and sorted by name")
        return tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def entry(self, name: str) -> TensorEntry | None:
        # Manifests hold hundreds of entries at most; a linear scan keeps the model plain.
        return next((t for t in self.tensors if t.name == name), None)


def canonical_manifest_bytes(manifest: Manifest) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, ASCII only, no NaN."""
    return json.dumps(
        manifest.model_dump(mode="json"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    ).encode("ascii")


def manifest_digest(manifest: Manifest) -> str:
    """The version digest: sha256 hex of the canonical manifest bytes."""
    return hashlib.sha256(canonical_manifest_bytes(manifest)).hexdigest()


def _dtype_str(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _dtype_name(tensor: torch.Tensor) -> str:
    name = _dtype_str(tensor)
    if name not in DTYPE_ITEMSIZE:
        raise _invalid(f"unsupported tensor dtype {name!r}", supported=sorted(DTYPE_ITEMSIZE))
    return name


def _tensor_sha256(tensor: torch.Tensor) -> str:
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # A uint8 view reads the raw bytes of any dtype (bfloat16 has no numpy type) without a copy.
    raw = flat.view(torch.uint8).numpy()
    return hashlib.sha256(raw).hexdigest()


def tensor_entry(name: str, tensor: torch.Tensor) -> TensorEntry:
    """The manifest entry a tensor would have. The one place per-tensor identity is computed."""
    return TensorEntry(
        name=name,
        dtype=_dtype_name(tensor),
        shape=tuple(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
        sha256=_tensor_sha256(tensor),
    )


def manifest_from_tensors(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Manifest:
    """The canonical manifest of an adapter. Raises INVALID_REQUEST for a bad config, an empty
    tensor set, a non-string name or an unsupported dtype."""
    if not tensors:
        raise _invalid("an adapter needs at least one tensor")
    bad = [n for n in tensors if not isinstance(n, str) or not n]
    if bad:
        raise _invalid(f"tensor names must be non-empty strings: {bad[:5]!r}")
    config = normalise_serving_config(config)
    try:
        entries = tuple(tensor_entry(name, tensors[name]) for name in sorted(tensors))
        return Manifest(config=config, tensors=entries)
    except ValidationError as exc:  # e.g. an over-long tensor name
        raise _to_version_error(exc, "manifest") from None


def check_tensor_against_manifest(
    manifest: Manifest, name: str, tensor: torch.Tensor, *, verify_content: bool = True
) -> None:
    """Refuse a received tensor that the manifest does not describe exactly.

    Unknown name, dtype or shape: MANIFEST_MISMATCH. Same layout, other bytes: CHECKSUM_MISMATCH.
    ``verify_content=False`` skips hashing (layout only)."""
    expected = manifest.entry(name)
    if expected is None:
        raise LoraVersionError(ErrorCode.MANIFEST_MISMATCH, f"tensor {name!r} is not in the manifest")
    dtype, shape = _dtype_str(tensor), tuple(tensor.shape)
    if dtype != expected.dtype or shape != expected.shape:
        raise LoraVersionError(
            ErrorCode.MANIFEST_MISMATCH,
            f"tensor {name!r}: got {dtype}{list(shape)}, "
            f"manifest says {expected.dtype}{list(expected.shape)}",
            tensor=name,
        )
    if verify_content and _tensor_sha256(tensor) != expected.sha256:
        raise LoraVersionError(
            ErrorCode.CHECKSUM_MISMATCH, f"tensor {name!r}: content differs from the manifest", tensor=name
        )


def check_tensor_set(manifest: Manifest, names: Iterable[str]) -> None:
    """At ``end``: exactly the manifest's tensors were received (none missing, none extra)."""
    got, want = set(names), set(manifest.names)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        raise LoraVersionError(
            ErrorCode.MANIFEST_MISMATCH,
            f"received tensors differ from the manifest: {len(missing)} missing, {len(extra)} extra",
            missing=missing[:20],
            extra=extra[:20],
        )


# --------------------------------------------------------------------------------------------
# Immutable lora_name
# --------------------------------------------------------------------------------------------


class ParsedLoraName(NamedTuple):
    prefix: str
    epoch: str
    version_id: str
    digest_prefix: str

    @property
    def version_key(self) -> VersionKey:
        return VersionKey(epoch=self.epoch, version_id=self.version_id)


def _name_part(field: str, value: str | int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # negative ints carry '-' and are refused below
    if not isinstance(value, str) or not _NAME_PART_RE.fullmatch(value):
        raise _invalid(f"{field} must match [A-Za-z0-9_.]{{1,64}}, got {value!r}")
    return value


def make_lora_name(prefix: str, epoch: str | int, version_id: str | int, digest: str) -> str:
    """``f"{prefix}@{epoch}-{version_id}-{digest[:12]}"``; parts are [A-Za-z0-9_.]{1,64}, so the
    name never holds ':' (OpenAI model="base:adapter"), '/', '-' inside a part, or whitespace."""
    parts = (_name_part("prefix", prefix), _name_part("epoch", epoch), _name_part("version_id", version_id))
    if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        raise _invalid(f"digest must be 64 lowercase hex characters, got {digest!r}")
    return f"{parts[0]}@{parts[1]}-{parts[2]}-{digest[:DIGEST_PREFIX_LEN]}"


def parse_lora_name(name: str) -> ParsedLoraName | None:
    """The parts of a managed name, or None when ``name`` is not one."""
    match = _LORA_NAME_RE.fullmatch(name) if isinstance(name, str) else None
    return ParsedLoraName(**match.groupdict()) if match else None


def is_managed_name(name: str, prefix: str | None = None) -> bool:
    """True for a name of our format (optionally with this exact prefix)."""
    parsed = parse_lora_name(name)
    return parsed is not None and (prefix is None or parsed.prefix == prefix)


# --------------------------------------------------------------------------------------------
# Bucket plan and payloads (transport only)
# --------------------------------------------------------------------------------------------


class BucketSpec(_Model):
    index: NonNegInt
    tensor_names: tuple[str, ...] = Field(min_length=1)
    total_bytes: NonNegInt  # tensor data only; the safetensors header comes on top


def plan_buckets(manifest: Manifest, max_bucket_bytes: int = DEFAULT_MAX_BUCKET_BYTES) -> list[BucketSpec]:
    """Greedy buckets in manifest (name) order, each at most ``max_bucket_bytes`` of tensor data.

    A tensor is never split (a payload carries whole tensors), so a single tensor larger than
    the cap gets a bucket of its own. The cap is the planner's target; whether an engine accepts
    such a bucket is its own decision at ``begin`` (PAYLOAD_TOO_LARGE before any data moves).
    """
    if isinstance(max_bucket_bytes, bool) or not isinstance(max_bucket_bytes, int) or max_bucket_bytes < 1:
        raise _invalid(f"max_bucket_bytes must be a positive integer, got {max_bucket_bytes!r}")
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


def _plan_problem(manifest: Manifest, plan: Iterable[BucketSpec]) -> str | None:
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
    problem = _plan_problem(manifest, plan)
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
        raise _invalid(f"bucket {spec.index}: tensors not provided: {missing[:5]!r}")
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
        raise _invalid(f"bucket payload is not valid safetensors: {exc}") from None


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


# --------------------------------------------------------------------------------------------
# PEFT directory
# --------------------------------------------------------------------------------------------


def read_peft_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` from ``adapter_config.json`` + ``adapter_model.safetensors``.

    The config is returned as written (normalise it through the manifest); tensors are loaded
    into memory on CPU. Pickled ``adapter_model.bin`` is refused: it can run code on load."""
    from safetensors.torch import load

    root = Path(path)
    config_file, weights_file = root / PEFT_CONFIG_FILE, root / PEFT_WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise _invalid(f"{root} must contain {PEFT_CONFIG_FILE} and {PEFT_WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _invalid(f"cannot read {config_file}: {exc}") from None
    if not isinstance(config, dict):
        raise _invalid(f"{config_file} must hold a JSON object")
    # Read the bytes first rather than memory-mapping: a file overwritten later must not be able
    # to change tensors we already handed out.
    try:
        tensors = load(weights_file.read_bytes())
    except Exception as exc:
        raise _invalid(f"cannot read {weights_file}: {exc}") from None
    return config, tensors


# --------------------------------------------------------------------------------------------
# Engine control models
# --------------------------------------------------------------------------------------------


class Routes:
    """Engine control endpoint paths (mounted by the plugin in the engine's main process)."""

    BEGIN = "/lora_versions/begin"
    RECEIVE_BUCKET = "/lora_versions/receive_bucket"
    END = "/lora_versions/end"
    CLEANUP = "/lora_versions/cleanup"
    RECLAIM = "/lora_versions/reclaim"
    STATUS = "/lora_versions"
    VERSION_STATUS = "/lora_versions/{lora_name}"


class VersionKey(_Model):
    # Registries may keep epoch / version_id as ints; 3 and "3" are the same key on the wire.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    epoch: NamePart
    version_id: NamePart


class BeginRequest(_Model):
    """Fixes identity, attempt, manifest and bucket plan. Self-consistent by construction: the
    name matches the key and digest, the digest is the manifest's, the plan covers the manifest."""

    lora_name: LoraName
    version_key: VersionKey
    digest: Sha256Hex
    attempt_token: Token
    manifest: Manifest
    bucket_plan: tuple[BucketSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> BeginRequest:
        parsed = parse_lora_name(self.lora_name)
        assert parsed is not None  # LoraName already validated the shape
        if (parsed.epoch, parsed.version_id) != (self.version_key.epoch, self.version_key.version_id):
            raise ValueError("lora_name does not match version_key")
        if parsed.digest_prefix != self.digest[:DIGEST_PREFIX_LEN]:
            raise ValueError("lora_name does not match digest")
        if manifest_digest(self.manifest) != self.digest:
            raise _mismatch("digest is not the sha256 of the canonical manifest")
        problem = _plan_problem(self.manifest, self.bucket_plan)
        if problem:
            raise _mismatch(problem)
        return self


class PreparedReceipt(_Model):
    state: Literal["PREPARED"] = "PREPARED"
    lora_name: LoraName
    digest: Sha256Hex
    attempt_token: Token
    incarnation: Token


class ReceiveBucketMeta(_Model):
    """The metadata of ``POST receive_bucket``; sent as headers, the body is the payload."""

    lora_name: LoraName
    attempt_token: Token
    index: NonNegInt
    sha256: Sha256Hex

    def to_headers(self) -> dict[str, str]:
        return {
            LORA_NAME_HEADER: self.lora_name,
            ATTEMPT_TOKEN_HEADER: self.attempt_token,
            BUCKET_INDEX_HEADER: str(self.index),
            BUCKET_SHA256_HEADER: self.sha256,
            "Content-Type": BUCKET_CONTENT_TYPE,
        }

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> ReceiveBucketMeta:
        """Parse from request headers (case-insensitive); INVALID_REQUEST when absent or bad."""
        lowered = {k.lower(): v for k, v in headers.items()}
        fields = {
            "lora_name": LORA_NAME_HEADER,
            "attempt_token": ATTEMPT_TOKEN_HEADER,
            "index": BUCKET_INDEX_HEADER,
            "sha256": BUCKET_SHA256_HEADER,
        }
        missing = [h for h in fields.values() if h.lower() not in lowered]
        if missing:
            raise _invalid(f"missing headers {missing}", missing=missing)
        return parse_model(cls, {f: lowered[h.lower()] for f, h in fields.items()})


class BucketAck(_Model):
    index: NonNegInt
    accepted: bool
    duplicate: bool = False  # an already accepted bucket again: acknowledged, not rewritten


class EndRequest(_Model):
    lora_name: LoraName
    attempt_token: Token


class ReadyReceipt(_Model):
    state: Literal["READY_LOCAL"] = "READY_LOCAL"
    lora_name: LoraName
    version_key: VersionKey
    digest: Sha256Hex
    attempt_token: Token
    incarnation: Token


class CleanupRequest(_Model):
    lora_name: LoraName
    attempt_token: Token


class CleanupReceipt(_Model):
    state: Literal["CLEANED"] = "CLEANED"
    lora_name: LoraName
    attempt_token: Token
    incarnation: Token


class ReclaimRequest(_Model):
    lora_name: LoraName
    reclaim_id: Token
    # How long the engine may wait for in-flight requests before answering DRAINING.
    timeout_s: Annotated[float, Field(ge=0.0, le=3600.0)] = 0.0


class UnloadedReceipt(_Model):
    state: Literal["UNLOADED"] = "UNLOADED"
    lora_name: LoraName
    reclaim_id: Token
    incarnation: Token


class DrainingReply(_Model):
    state: Literal["DRAINING"] = "DRAINING"
    lora_name: LoraName
    reclaim_id: Token
    in_flight: NonNegInt
    incarnation: Token


class EngineVersionState(StrEnum):
    """Engine-local lifecycle of one managed version (see design.md, "Engine side")."""

    PREPARED = "PREPARED"  # begin accepted; buckets arriving into the attempt's stash
    LOADING = "LOADING"  # end in progress: native load and exact-version probe
    READY_LOCAL = "READY_LOCAL"  # loaded, pinned, probed
    RECLAIMING = "RECLAIMING"  # unregistered; in-flight requests draining
    UNLOADED = "UNLOADED"  # physically unloaded (tombstone)
    CLEANED = "CLEANED"  # attempt cleaned up (tombstone: late calls are STALE_ATTEMPT)


class VersionStatus(_Model):
    lora_name: LoraName
    state: EngineVersionState
    version_key: VersionKey | None = None
    digest: Sha256Hex | None = None
    attempt_token: Token | None = None
    reclaim_id: Token | None = None
    pinned: bool = False
    lora_id: str | None = None  # engine-local; differs between engines and between loads
    in_flight: NonNegInt | None = None  # SGLang's native request refcount, when loaded
    buckets_received: NonNegInt = 0
    buckets_total: NonNegInt = 0
    incarnation: Token
    created_at: float  # unix seconds
    updated_at: float


class EngineStatus(_Model):
    incarnation: Token
    versions: tuple[VersionStatus, ...] = ()
    managed_capacity: NonNegInt | None = None  # pinned managed versions this engine accepts
    server_time: float | None = None  # unix seconds, for reading the timestamps above


BeginReply = Annotated[PreparedReceipt | ReadyReceipt, Field(discriminator="state")]
ReclaimReply = Annotated[UnloadedReceipt | DrainingReply, Field(discriminator="state")]
_BEGIN_REPLY: TypeAdapter[PreparedReceipt | ReadyReceipt] = TypeAdapter(BeginReply)
_RECLAIM_REPLY: TypeAdapter[UnloadedReceipt | DrainingReply] = TypeAdapter(ReclaimReply)


# --------------------------------------------------------------------------------------------
# Parsing with typed errors
# --------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def _to_version_error(exc: ValidationError, what: str) -> LoraVersionError:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    # A validator tagged with one of our codes (e.g. MANIFEST_MISMATCH) decides the code.
    codes = [ErrorCode(e["type"]) for e in errors if e["type"] in ErrorCode.__members__]
    code = codes[0] if codes else ErrorCode.INVALID_REQUEST
    details = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"]} for e in errors[:20]]
    return LoraVersionError(code, f"invalid {what}: {details[0]['msg'] if details else exc}", errors=details)


def _validate(validate_json: Any, validate_python: Any, data: Any, what: str) -> Any:
    try:
        if isinstance(data, bytes | bytearray | str):
            return validate_json(data)
        return validate_python(data)
    except ValidationError as exc:
        raise _to_version_error(exc, what) from None


def parse_model(model: type[M], data: Any) -> M:
    """Validate JSON text/bytes or a dict into ``model``; failures are LoraVersionError
    (INVALID_REQUEST, or MANIFEST_MISMATCH for an inconsistent manifest or plan)."""
    return _validate(model.model_validate_json, model.model_validate, data, model.__name__)


def parse_begin_reply(data: Any) -> PreparedReceipt | ReadyReceipt:
    """``begin`` answers PREPARED, or READY_LOCAL when this exact version is already loaded."""
    return _validate(_BEGIN_REPLY.validate_json, _BEGIN_REPLY.validate_python, data, "begin reply")


def parse_reclaim_reply(data: Any) -> UnloadedReceipt | DrainingReply:
    return _validate(_RECLAIM_REPLY.validate_json, _RECLAIM_REPLY.validate_python, data, "reclaim reply")
