"""Would this engine serve an adapter exactly as PEFT computes it? Pure: no IO, no SGLang import.

SGLang 0.5.23's LoRA loader (``sglang/srt/lora/lora.py``, ``mem_pool.py``, ``lora_manager.py``)
reads much less of a PEFT adapter than PEFT does, and what it does not read it either ignores in
silence or trips over inside the scheduler's forward step, which kills the engine:

- the scale is always ``lora_alpha / r`` (``LoRAAdapter.__init__``): ``use_rslora`` and
  ``alpha_pattern`` are ignored;
- one rank ``r`` for every module: the pool buffers are sliced ``[:r]`` and a tensor of another
  rank fails ``assert buffer_view.shape == weight.shape`` in ``load_lora_weight_to_buffer``, i.e.
  on the first request that uses the adapter, in the scheduler (``rank_pattern`` is ignored);
- tensors are placed by substring (``layers.N.``, ``q_proj``, ``lora_A``): a name it cannot place
  is skipped with a warning (served without it) or raises in the forward step;
- per layer, ``q_proj`` needs ``v_proj`` (``k_proj`` is zero-filled); ``k``/``v`` without ``q``
  and ``up`` without ``gate`` stay unstacked and raise in the forward step;
- ``bias``, ``fan_in_fan_out``, ``modules_to_save`` and DoRA are not applied.

So ``begin`` admits only adapters for which SGLang and PEFT provably compute the same function,
and refuses everything else with INCOMPATIBLE_ADAPTER and the reason, before any data moves. The
config keys themselves were decided before this check, by the one table of
``lora_contract.identity`` (a key that changes the function unless neutral, or that PEFT 0.21.2 does
not have, is refused when the manifest is validated): only serving fields reach it. One
difference is bridged instead of refused: rsLoRA (scale ``alpha / sqrt(r)``) is loaded with an
equivalent ``lora_alpha`` when that reproduces PEFT's scale to the last bit
(:func:`sglang_load_config`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import Manifest

# Base architectures whose LoRA geometry is checked here: dense decoders with
# self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj of uniform size in every layer, for which
# SGLang uses the config-driven ``get_default_hidden_dim`` (none of them overrides it).
VERIFIED_ARCHITECTURES = frozenset(
    {"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}
)

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Each module's path inside a decoder layer (model.layers.N.<path>).
MODULE_PATHS = {m: f"self_attn.{m}" for m in ATTENTION_MODULES} | {m: f"mlp.{m}" for m in MLP_MODULES}
# Dtypes an engine copies into its LoRA buffers as values (an int tensor would be cast silently).
SERVED_DTYPES = frozenset({"float32", "float16", "bfloat16"})

# PEFT's saved key of one LoRA factor of one linear module (adapter name stripped, as PEFT saves).
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?(?P<module_key>model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\."
    r"(?P<block>self_attn|mlp)\.(?P<module>[a-z_]+))\.lora_(?P<factor>[AB])\.weight"
)


@dataclass(frozen=True)
class ModelGeometry:
    """The LoRA-relevant shape of the base model, read from its HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_attention_heads * head_dim
    kv_size: int  # num_key_value_heads * head_dim

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelGeometry | None:
        """None when the architecture is not one whose geometry this module knows."""
        archs = list(getattr(cfg, "architectures", None) or [])
        if len(archs) != 1 or archs[0] not in VERIFIED_ARCHITECTURES:
            return None
        return cls.read(cfg, archs[0])

    @classmethod
    def read(cls, cfg: Any, architecture: str) -> ModelGeometry:
        """The dims of any config with HF's attribute names (as SGLang's get_default_hidden_dim
        reads them)."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            architecture=architecture,
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            q_size=int(cfg.num_attention_heads) * int(head_dim),
            kv_size=int(cfg.num_key_value_heads) * int(head_dim),
        )

    def in_out(self, module: str) -> tuple[int, int]:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]


@dataclass(frozen=True)
class EngineLoraShape:
    """What this engine serves: the base geometry (None: unverified architecture), the largest
    rank its pool holds, and the SGLang modules it serves (None: every module of the model)."""

    geometry: ModelGeometry | None
    max_lora_rank: int
    served_modules: frozenset[str] | None


def _incompatible(reason: str, **details: Any) -> LoraVersionError:
    return LoraVersionError(ErrorCode.INCOMPATIBLE_ADAPTER, reason, **details)


# --------------------------------------------------------------------------------------------
# PEFT's module selection (peft.tuners.tuners_utils.check_target_module_exists), for the module
# keys this module admits at all ("model.layers.N.self_attn.q_proj" ...).
# --------------------------------------------------------------------------------------------


def _listed(key: str, modules: Iterable[str]) -> bool:
    return any(key == m or key.endswith(f".{m}") for m in modules)


def _peft_selects(config: Mapping[str, Any], module_key: str, layer: int) -> bool:
    targets = config["target_modules"]
    # a string other than "all-linear" was refused before
    selected = targets == "all-linear" if isinstance(targets, str) else _listed(module_key, targets)
    excluded = config.get("exclude_modules")
    if excluded is not None and _listed(module_key, excluded):
        selected = False
    layers = config.get("layers_to_transform")
    return selected and (layers is None or layer in layers)


# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------


def _config_problem(
    config: Mapping[str, Any], shape: EngineLoraShape, normalize: Callable[[list[str]], set[str]]
) -> LoraVersionError | None:
    r = config["r"]
    if config["peft_type"] != "LORA":
        return _incompatible(f"peft_type {config['peft_type']!r} is not served (only LORA)")
    if config["use_dora"]:
        return _incompatible("DoRA adapters are not served: SGLang does not apply the magnitude vector")
    if config["bias"] != "none":
        return _incompatible(f"bias={config['bias']!r} is not served: SGLang applies no LoRA bias")
    if config["fan_in_fan_out"]:
        return _incompatible("fan_in_fan_out=true is not served: SGLang reads lora_A as [r, in]")
    if config["modules_to_save"] is not None:
        return _incompatible("modules_to_save is not served: SGLang loads only LoRA factors")
    if r > shape.max_lora_rank:
        return _incompatible(
            f"adapter rank {r} exceeds this engine's --max-lora-rank {shape.max_lora_rank}",
            rank=r,
            max_lora_rank=shape.max_lora_rank,
        )
    other_ranks = sorted({v for v in config["rank_pattern"].values() if v != r})
    if other_ranks:
        return _incompatible(
            f"rank_pattern gives ranks {other_ranks} other than r={r}: SGLang serves every module at r",
            rank_pattern=config["rank_pattern"],
        )
    other_alphas = sorted({v for v in config["alpha_pattern"].values() if v != config["lora_alpha"]})
    if other_alphas:
        return _incompatible(
            f"alpha_pattern gives alphas {other_alphas} other than lora_alpha: SGLang scales every "
            "module by lora_alpha / r",
            alpha_pattern=config["alpha_pattern"],
        )
    if config["use_rslora"] and _rslora_alpha(config["lora_alpha"], r) is None:
        return _incompatible(
            f"use_rslora with r={r}: no lora_alpha makes SGLang's lora_alpha / r equal PEFT's "
            "lora_alpha / sqrt(r) exactly"
        )
    targets = config["target_modules"]
    if isinstance(targets, str) and targets != "all-linear":
        return _incompatible(f"target_modules as a regex ({targets!r}) is not served; list the modules")
    if shape.served_modules is not None and isinstance(targets, list):
        # LoRAMemoryPool.can_support would refuse the load at end; refuse it before any data moves.
        extra = sorted(normalize(targets) - shape.served_modules)
        if extra:
            return _incompatible(
                f"target modules {extra} are not served by this engine (--lora-target-modules)",
                modules=extra,
            )
    if isinstance(config.get("exclude_modules"), str):
        return _incompatible("exclude_modules as a regex is not served; list the modules")
    if config["layers_pattern"] not in (None, "layers", ["layers"]):
        return _incompatible(f"layers_pattern {config['layers_pattern']!r} is not served")
    return None


def _tensor_problem(
    manifest: Manifest, shape: EngineLoraShape, normalize: Callable[[list[str]], set[str]]
) -> LoraVersionError | None:
    geometry = shape.geometry
    assert geometry is not None
    config = manifest.config
    r = config["r"]
    # (layer, module) -> factors present
    present: dict[tuple[int, str], set[str]] = {}
    for entry in manifest.tensors:
        m = _TENSOR_NAME.fullmatch(entry.name)
        module = m["module"] if m else ""
        if m is None or f"{m['block']}.{module}" != MODULE_PATHS.get(module):
            return _incompatible(
                f"tensor {entry.name!r} is not a LoRA factor of a module this engine serves "
                "(model.layers.N.self_attn.{q,k,v,o}_proj / mlp.{gate,up,down}_proj .lora_A|B.weight)",
                tensor=entry.name,
            )
        layer, factor = int(m["layer"]), m["factor"]
        if layer >= geometry.num_layers:
            return _incompatible(
                f"tensor {entry.name!r}: layer {layer} does not exist ({geometry.num_layers} layers)",
                tensor=entry.name,
            )
        if entry.dtype not in SERVED_DTYPES:
            return _incompatible(
                f"tensor {entry.name!r} has dtype {entry.dtype}; served: {sorted(SERVED_DTYPES)}",
                tensor=entry.name,
            )
        fan_in, fan_out = geometry.in_out(module)
        want = (r, fan_in) if factor == "A" else (fan_out, r)
        if entry.shape != want:
            return _incompatible(
                f"tensor {entry.name!r} has shape {list(entry.shape)}; with r={r} on this base model "
                f"lora_{factor} of {module} must be {list(want)}",
                tensor=entry.name,
                expected_shape=list(want),
            )
        if not _peft_selects(config, m["module_key"], layer):
            return _incompatible(
                f"tensor {entry.name!r} belongs to a module the config does not target "
                "(PEFT would not apply it, SGLang would)",
                tensor=entry.name,
            )
        present.setdefault((layer, module), set()).add(factor)
    for (layer, module), factors in sorted(present.items()):
        if factors != {"A", "B"}:
            return _incompatible(f"layer {layer} {module}: lora_A and lora_B must come together")
    for layer in sorted({layer for layer, _ in present}):
        here = {module for (lyr, module) in present if lyr == layer}
        if here & {"q_proj", "k_proj", "v_proj"} and not {"q_proj", "v_proj"} <= here:
            return _incompatible(
                f"layer {layer}: SGLang stacks q/k/v and needs q_proj and v_proj whenever one of "
                f"them is adapted (found {sorted(here & {'q_proj', 'k_proj', 'v_proj'})})"
            )
        if "up_proj" in here and "gate_proj" not in here:
            return _incompatible(f"layer {layer}: SGLang stacks gate/up and needs gate_proj with up_proj")
    if shape.served_modules is not None:
        used = sorted(normalize(sorted({module for _, module in present})) - shape.served_modules)
        if used:
            return _incompatible(
                f"target modules {used} are not served by this engine (--lora-target-modules)", modules=used
            )
    return None


def serving_problem(
    manifest: Manifest, shape: EngineLoraShape, normalize: Callable[[list[str]], set[str]] = set
) -> LoraVersionError | None:
    """Why this engine would not serve ``manifest`` exactly as PEFT computes it (None: it would).

    ``normalize`` maps PEFT module names to SGLang's served names (the shell passes SGLang's own
    ``get_normalized_target_modules``); it is compared with ``served_modules`` only."""
    if shape.geometry is None:
        return _incompatible(
            "the base model's architecture is not one whose LoRA geometry this plugin verifies "
            f"({sorted(VERIFIED_ARCHITECTURES)})"
        )
    return _config_problem(manifest.config, shape, normalize) or _tensor_problem(manifest, shape, normalize)


# --------------------------------------------------------------------------------------------
# The config SGLang loads with
# --------------------------------------------------------------------------------------------


def _rslora_alpha(lora_alpha: float, r: int) -> float | None:
    """An alpha with ``alpha / r == lora_alpha / math.sqrt(r)`` bit for bit (PEFT's rsLoRA scale,
    peft.tuners.lora.layer.LoraLayer.update_layer), or None when no float near it does."""
    target = lora_alpha / math.sqrt(r)
    guess = target * r
    for candidate in (guess, math.nextafter(guess, math.inf), math.nextafter(guess, -math.inf)):
        if candidate / r == target:
            return candidate
    return None


def sglang_load_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config dict SGLang loads a version with: the manifest's own, except that rsLoRA is
    expressed as the plain-LoRA alpha that yields PEFT's scale exactly (SGLang has no rsLoRA).
    Only for configs that :func:`serving_problem` admitted."""
    out = dict(config)
    if out["use_rslora"]:
        alpha = _rslora_alpha(out["lora_alpha"], out["r"])
        assert alpha is not None, "serving_problem refuses rsLoRA without an exact alpha"
        out["lora_alpha"] = alpha
        out["use_rslora"] = False
    return out


def check_tensor_values(name: str, tensor: Any) -> None:
    """A received factor must hold finite values: a NaN or Inf adapter turns every logit of the
    requests that use it into NaN (and sampling from NaN probabilities raises in the scheduler)."""
    import torch  # heavy, and only a received bucket needs it: the table and its shape rules do not

    if tensor.numel() == 0 or not tensor.is_floating_point():
        return
    try:
        # min and max propagate NaN and reach +-Inf: two finite extremes mean every value is
        # finite, without the full boolean tensor isfinite(...).all() would allocate (45x faster)
        lo, hi = torch.aminmax(tensor)
        finite = bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8 on CPU)
        finite = bool(torch.isfinite(tensor.float()).all())
    if not finite:
        raise _incompatible(f"tensor {name!r} holds NaN or Inf values", tensor=name)
