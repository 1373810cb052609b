"""A LoRA version's identity: the normalised serving config, the canonical manifest (every
tensor's name, dtype, shape, size and content hash) and its digest, and the PEFT directory it is
read from. Identity, in short::

    manifest  = {schema_version, config: normalised PEFT serving config,
                 tensors: [{name, dtype, shape, nbytes, sha256}, ...] sorted by name}
    digest    = sha256(canonical_manifest_bytes(manifest)).hexdigest()
    lora_name = f"{prefix}@{epoch}-{version_id}-{digest[:12]}"   (lora_contract.names)

At import time this touches only stdlib and pydantic; ``torch`` and ``safetensors`` are imported
inside the few functions that handle tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, StringConstraints, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.wire_models import NonNegInt, Sha256Hex, WireModel, invalid, mismatch, to_version_error

if TYPE_CHECKING:
    import torch

MANIFEST_SCHEMA_VERSION = 1
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


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

# Serving-relevant PEFT LoRA fields, with the default that an absent field stands for: kept,
# normalised, part of the digest (adapter_compat decides which of their values an engine serves).
# Every other key is classified in the table below: dropped, refused, or refused unless neutral.
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

# The one table of every other key an adapter config may carry: each field of PEFT 0.21.2's
# LoraConfig (peft/tuners/lora/config.py, with the PeftConfig fields of peft/config.py), classified
# from the PEFT source that reads it. tests/contract_tests/test_config_keys.py fails when the installed
# LoraConfig has a field that is not classified here. A key that is in no list (a field of a later
# PEFT, a typo) is refused: it may change what the adapter computes, and nothing here knows how.
PEFT_VERSION_CLASSIFIED = "0.21.2"

# Bookkeeping: proven not to change the function PEFT computes in inference from the saved tensors
# on the unmodified base. Dropped, so two exports of the same weights have one identity.
BOOKKEEPING_CONFIG_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "task_type": "picks the PeftModel wrapper; the LoRA layers are the same, and a head a task "
        "adds is put in modules_to_save (PeftModelForSequenceClassification & co.), which is refused",
        "auto_mapping": "which class loads a custom base model; the base is fixed per deployment epoch",
        "peft_version": "the PEFT version that wrote the file",
        "base_model_name_or_path": "where the trainer loaded the base from; the base is fixed per "
        "deployment epoch",
        "revision": "the base model's hub revision; the base is fixed per deployment epoch",
        "inference_mode": "only sets requires_grad of the adapter's parameters",
        "lora_dropout": "an nn.Dropout before lora_A: the identity in eval mode, it acts only in training",
        "megatron_core": "the module megatron_config's layers import from; read only when "
        "megatron_config is set, which is refused",
        "qalora_group_size": "read only by the QALoRA variant (use_qalora, refused)",
        "loftq_config": "parameters of init_lora_weights='loftq' (refused); PEFT resets it to {} "
        "for every other init",
        "eva_config": "parameters of EVA's data pass, which sets lora_A (saved) and rank_pattern / "
        "alpha_pattern (served fields) and leaves the base alone (tuners/lora/eva.py)",
        "corda_config": "parameters of preprocess_corda and init_lora_weights='corda' (refused); read "
        "by nothing else",
        "lora_ga_config": "parameters of init_lora_weights='lora_ga' (refused); read by nothing else",
        "velora_config": "VeLoRA changes only the backward pass: VeloraFunction.forward is "
        "F.linear(x, lora_A), and in eval the variant calls lora_A(x) (tuners/lora/velora.py); the "
        "lora_velora_embed buffer PEFT saves beside the factors is refused by the tensor rule",
        "monteclora_config": "MonteCLoRA perturbs lora_A only while module.training; in eval its "
        "forward is plain LoRA (MontecloraLinearVariant.forward), like lora_dropout; the sampler "
        "tensors PEFT saves beside the factors are refused by the tensor rule",
        "runtime_config": "runtime only (ephemeral_gpu_offload: the device DoRA's init runs on); "
        "LoraConfig.to_dict never writes it and from_json_file deletes it",
    }
)


@dataclass(frozen=True)
class NeutralOnly:
    """A field PEFT acts on: ``neutral`` are the values with which it does nothing (PEFT's
    default first; compared as JSON, so 0 is not False), ``effect`` what PEFT computes with any
    other value that an engine does not."""

    neutral: tuple[Any, ...]
    effect: str

    def is_neutral(self, value: Any) -> bool:
        return _json(value) in {_json(n) for n in self.neutral}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


# Refused unless neutral: with any other value PEFT computes another function than base + the
# served factors; a neutral value is dropped, so the digests of existing adapters (whose saved
# configs name every field at PEFT's default) do not change.
NEUTRAL_ONLY_CONFIG_FIELDS: Mapping[str, NeutralOnly] = MappingProxyType(
    {
        "init_lora_weights": NeutralOnly(
            (True, False, "gaussian", "orthogonal", "eva", "mica"),
            "pissa, pissa_niter_N, olora, corda, loftq and lora_ga subtract the initial "
            "scale * B @ A from the base weights or quantise them (LoraLayer.pissa_init & co.): "
            "the trainer computes W_res + BA, an engine serves W + BA; the neutral inits only "
            "set lora_A / lora_B",
        ),
        "layer_replication": NeutralOnly(
            (None, []),
            "PEFT rebuilds the layer stack from ranges of base layers (replicate_layers), each "
            "copy with its own adapter; an engine applies layers.N to base layer N",
        ),
        "lora_bias": NeutralOnly((False,), "adds a trained bias to lora_B; SGLang applies no LoRA bias"),
        "use_qalora": NeutralOnly(
            (False,), "pools the input in groups of qalora_group_size before lora_A (QALoRA)"
        ),
        "trainable_token_indices": NeutralOnly(
            (None,), "trains the embedding rows of the listed tokens (TrainableTokensLayer)"
        ),
        "target_parameters": NeutralOnly(
            (None, []), "puts LoRA on nn.Parameters such as fused MoE expert weights (ParamWrapper)"
        ),
        "alora_invocation_tokens": NeutralOnly(
            (None,), "aLoRA: the adapter acts only from its invocation tokens on; SGLang applies it to all"
        ),
        "megatron_config": NeutralOnly(
            (None,), "builds Megatron's tensor-parallel LoRA layers (LoraParallelLinear)"
        ),
        "use_bdlora": NeutralOnly((None,), "block-diagonal lora_A or lora_B (BdLoraLinearVariant)"),
        "arrow_config": NeutralOnly((None,), "routes each token among several adapters (ArrowLinearVariant)"),
        "kasa_config": NeutralOnly(
            (None,),
            "KaSA truncates the base weights' smallest singular components and scales B @ A by a "
            "learned diagonal (KasaLinearVariant)",
        ),
        "ensure_weight_tying": NeutralOnly(
            (False,), "ties the adapters of tied layers (embedding and lm_head), which SGLang does not adapt"
        ),
    }
)


def _incompatible(message: str, **details: Any) -> LoraVersionError:
    return LoraVersionError(ErrorCode.INCOMPATIBLE_ADAPTER, message, **details)


def _check_config_keys(config: Mapping[str, Any]) -> None:
    """Refuse (INCOMPATIBLE_ADAPTER, naming the key) every key that may change what the adapter
    computes and is not served exactly: a neutral-only field away from its neutral values, or a
    key the table does not know."""
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise invalid(f"config keys must be strings, got {bad[:5]!r}")
    for key in sorted(config):
        if key in SERVING_CONFIG_FIELDS or key in BOOKKEEPING_CONFIG_FIELDS:
            continue
        rule = NEUTRAL_ONLY_CONFIG_FIELDS.get(key)
        if rule is None:
            raise _incompatible(
                f"config key {key!r} is not a field of PEFT {PEFT_VERSION_CLASSIFIED}'s LoraConfig: it "
                "may change what the adapter computes, so it is refused (lora_contract/identity.py lists "
                "every key that is served or ignored)",
                key=key,
            )
        if not rule.is_neutral(config[key]):
            value = _json(config[key])
            raise _incompatible(
                f"config key {key!r} = {value[:200]} is not served: {rule.effect} "
                f"(served only as {' or '.join(_json(n) for n in rule.neutral)})",
                key=key,
            )


def _norm_int(field: str, value: Any, *, minimum: int) -> int:
    # bool is an int subclass; a True rank is a bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(f"config.{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _norm_number(field: str, value: Any) -> int | float:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, float) or not math.isfinite(value):
        raise invalid(f"config.{field} must be a finite number, got {value!r}")
    # 16 and 16.0 are the same scale; JSON would spell them differently.
    return int(value) if value.is_integer() else value


def _norm_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"config.{field} must be a boolean, got {value!r}")
    return value


def _norm_str(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"config.{field} must be a non-empty string, got {value!r}")
    return value


def _norm_module_set(field: str, value: Any, *, allow_none: bool) -> list[str] | str | None:
    """A module selector: a regex string stays as is; a collection becomes a sorted unique list."""
    if value is None:
        if allow_none:
            return None
        raise invalid(f"config.{field} is required")
    if isinstance(value, str):
        return _norm_str(field, value)
    if not isinstance(value, list | tuple | set | frozenset):
        raise invalid(f"config.{field} must be a string or a list of strings, got {value!r}")
    items = [_norm_str(field, v) for v in value]
    if not items:
        if allow_none:
            return None  # an empty list selects nothing, exactly like None
        raise invalid(f"config.{field} must not be empty")
    return sorted(set(items))


def _norm_layers(value: Any) -> list[int] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, list | tuple):
        raise invalid(f"config.layers_to_transform must be an int or a list of ints, got {value!r}")
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
    raise invalid(f"config.layers_pattern must be a string or a list of strings, got {value!r}")


def _norm_pattern(field: str, value: Any, *, integer: bool) -> dict[str, int | float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise invalid(f"config.{field} must be a mapping, got {value!r}")
    out: dict[str, int | float] = {}
    for key, v in value.items():
        key = _norm_str(f"{field} key", key)
        out[key] = _norm_int(f"{field}[{key}]", v, minimum=1) if integer else _norm_number(field, v)
    return dict(sorted(out.items()))


def normalise_serving_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical serving config of a PEFT LoRA ``adapter_config.json`` dict.

    Rules (one place, both sides):
    - only ``SERVING_CONFIG_FIELDS`` are kept; ``BOOKKEEPING_CONFIG_FIELDS`` are dropped;
      ``NEUTRAL_ONLY_CONFIG_FIELDS`` are dropped when neutral and refused otherwise; any other
      key is refused (INCOMPATIBLE_ADAPTER, naming the key);
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
    Raises ``LoraVersionError``: INCOMPATIBLE_ADAPTER for a refused key, INVALID_REQUEST for a
    malformed config. Idempotent.
    """
    if not isinstance(config, Mapping):
        raise invalid(f"config must be a mapping, got {type(config).__name__}")
    _check_config_keys(config)
    missing = [f for f in _REQUIRED_FIELDS if config.get(f) is None]
    if missing:
        raise invalid(f"config is missing required fields {missing}", missing=missing)

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


class TensorEntry(WireModel):
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
            raise mismatch(f"{self.name}: nbytes {self.nbytes} != prod(shape) * itemsize")
        return self


class Manifest(WireModel):
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
            # Tagged with the refusal's own code: a begin body whose config carries a key the
            # table refuses is INCOMPATIBLE_ADAPTER at the engine, not a malformed request.
            raise PydanticCustomError(exc.code.value, exc.message) from None
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
            raise mismatch("manifest tensors must be unique and sorted by name")
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
        raise invalid(f"unsupported tensor dtype {name!r}", supported=sorted(DTYPE_ITEMSIZE))
    return name


def _tensor_sha256(tensor: torch.Tensor) -> str:
    import torch  # lazy: lora_contract.protocol imports this module and loads without torch

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
        raise invalid("an adapter needs at least one tensor")
    bad = [n for n in tensors if not isinstance(n, str) or not n]
    if bad:
        raise invalid(f"tensor names must be non-empty strings: {bad[:5]!r}")
    config = normalise_serving_config(config)
    try:
        entries = tuple(tensor_entry(name, tensors[name]) for name in sorted(tensors))
        return Manifest(config=config, tensors=entries)
    except ValidationError as exc:  # e.g. an over-long tensor name
        raise to_version_error(exc, "manifest") from None


def check_entry_layout(manifest: Manifest, name: str, dtype: str, shape: tuple[int, ...]) -> TensorEntry:
    """The manifest's entry for ``name``, refused (MANIFEST_MISMATCH) unless it exists with
    exactly this dtype and shape. The one layout rule, for decoded tensors and parsed headers."""
    expected = manifest.entry(name)
    if expected is None:
        raise LoraVersionError(ErrorCode.MANIFEST_MISMATCH, f"tensor {name!r} is not in the manifest")
    if dtype != expected.dtype or tuple(shape) != expected.shape:
        raise LoraVersionError(
            ErrorCode.MANIFEST_MISMATCH,
            f"tensor {name!r}: got {dtype}{list(shape)}, "
            f"manifest says {expected.dtype}{list(expected.shape)}",
            tensor=name,
        )
    return expected


def content_mismatch(name: str) -> LoraVersionError:
    """A tensor with the manifest's layout but other bytes (CHECKSUM_MISMATCH)."""
    return LoraVersionError(
        ErrorCode.CHECKSUM_MISMATCH, f"tensor {name!r}: content differs from the manifest", tensor=name
    )


def check_tensor_against_manifest(
    manifest: Manifest, name: str, tensor: torch.Tensor, *, verify_content: bool = True
) -> None:
    """Refuse a received tensor that the manifest does not describe exactly.

    Unknown name, dtype or shape: MANIFEST_MISMATCH. Same layout, other bytes: CHECKSUM_MISMATCH.
    ``verify_content=False`` skips hashing (layout only)."""
    expected = check_entry_layout(manifest, name, _dtype_str(tensor), tuple(tensor.shape))
    if verify_content and _tensor_sha256(tensor) != expected.sha256:
        raise content_mismatch(name)


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
# PEFT directory
# --------------------------------------------------------------------------------------------


def read_peft_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` from ``adapter_config.json`` + ``adapter_model.safetensors``.

    The config is returned as written (normalise it through the manifest); tensors are loaded
    into memory on CPU. Pickled ``adapter_model.bin`` is refused: it can run code on load."""
    from safetensors.torch import load  # lazy: the protocol loads without torch (see above)

    root = Path(path)
    config_file, weights_file = root / PEFT_CONFIG_FILE, root / PEFT_WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise invalid(f"{root} must contain {PEFT_CONFIG_FILE} and {PEFT_WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise invalid(f"cannot read {config_file}: {exc}") from None
    if not isinstance(config, dict):
        raise invalid(f"{config_file} must hold a JSON object")
    # Read the bytes first rather than memory-mapping: a file overwritten later must not be able
    # to change tensors we already handed out.
    try:
        tensors = load(weights_file.read_bytes())
    except Exception as exc:
        raise invalid(f"cannot read {weights_file}: {exc}") from None
    return config, tensors
