"""Deterministic test fixtures: a tiny Qwen3 model, its BPE tokenizer, and PEFT adapters.

No model hub is reachable from these machines, so everything the engines serve in tests and in the
demo is generated here from fixed seeds. The output is cached under ``.fixtures/<key>/`` where the
key hashes this file's source and the library versions that shape the bytes; a change to the
generator therefore regenerates, and an interrupted generation is never used (we build in a
temporary directory and rename it into place, which is atomic on one filesystem).

Adapters:
- ``A``, ``B``, ``C``: rank 4, distinct seeds, clearly different greedy outputs.
- ``rank16``: rank 16, above the engines' ``--max-lora-rank 8``; an engine must refuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FIXTURE_ROOT_ENV = "LORA_VERSIONS_FIXTURES"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO_ROOT / ".fixtures"

MODEL_SEED = 1234
ADAPTER_SEEDS = {"A": 101, "B": 202, "C": 303, "rank16": 404}
ADAPTER_RANKS = {"A": 4, "B": 4, "C": 4, "rank16": 16}
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LORA_RANK = 8  # engines are started with --max-lora-rank 8; rank16 must exceed it

# Enough varied text for a ~500-token byte-level BPE; sentences read like agent traffic.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A session binds to the default version at its first generation.",
    "Every later request of that session carries the same exact adapter path.",
    "The trainer publishes a new adapter while agents keep generating tokens.",
    "Tool call: search the web for the weather in Paris and return the result.",
    "The assistant answers the user's question step by step with care.",
    "Reclaim may start when no session can still ask for the old version.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 appear in logs.",
    "def main(): return sum(x * x for x in range(10)) # python code",
    '{"role": "user", "content": "hello"} {"role": "assistant"}',
    "Engines E0 and E1 serve the base model with pinned adapters A and B.",
    "Capacity is two managed versions; a third one is refused before any data moves.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "In the beginning the model knew nothing, then it learned from rewards.",
]
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Fixtures:
    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    def adapter_dir(self, name: str) -> Path:
        return self.root / "adapters" / name

    @property
    def adapter_names(self) -> list[str]:
        return sorted(ADAPTER_SEEDS)


def _generator_key() -> str:
    import tokenizers
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for v in (torch.__version__, transformers.__version__, tokenizers.__version__):
        h.update(v.encode())
    return h.hexdigest()[:16]


def fixture_root(root: Path | None = None) -> Path:
    return Path(os.environ.get(FIXTURE_ROOT_ENV, root or DEFAULT_ROOT))


def build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Return ``final``, first building it with ``build(tmp_dir)`` if no complete copy exists.

    Built in a temporary sibling and renamed into place (atomic on one filesystem), so an
    interrupted build is never used: the next call simply builds again."""
    if (final / "COMPLETE").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=final.parent))
    try:
        build(tmp)
        (tmp / "COMPLETE").write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race and renamed a complete copy first: use theirs.
            if not (final / "COMPLETE").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_fixtures(root: Path | None = None) -> Fixtures:
    """Return the cached fixtures, generating them first if they are missing."""
    return Fixtures(build_atomically(fixture_root(root) / _generator_key(), _generate))


def _generate(out: Path) -> None:
    _write_tokenizer(out / "model")
    config = _write_model(out / "model")
    for name, seed in ADAPTER_SEEDS.items():
        write_adapter(out / "adapters" / name, config, seed=seed, rank=ADAPTER_RANKS[name])


def _write_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    model_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(model_dir))


# Everything of the fixture tokenizer a larger generated model needs beside its weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def copy_tokenizer(src_model_dir: Path, dst_model_dir: Path) -> None:
    """Put the fixture tokenizer beside another generated model (the bench's, the GPU profile's)."""
    dst_model_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src_model_dir / name).is_file():
            shutil.copy2(src_model_dir / name, dst_model_dir / name)


TINY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}


def _write_model(model_dir: Path) -> dict:
    return write_random_qwen3(model_dir, TINY_SHAPE, seed=MODEL_SEED, std=0.2)


def write_random_qwen3(
    model_dir: Path, shape: dict, *, seed: int, std: float, dtype: str = "float32"
) -> dict:
    """A Qwen3 of ``shape`` with every matrix drawn from N(0, std), saved in ``dtype`` beside the
    tokenizer already in ``model_dir``; returns its config. (The default init gives near-flat
    logits, and the greedy outputs of base and adapters would be too similar to tell apart.)"""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    config = Qwen3Config(
        **shape,
        tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.to(getattr(torch, dtype))
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return json.loads((model_dir / "config.json").read_text())


OTHER_BASE_SEED = MODEL_SEED + 1


def ensure_other_base(fixtures: Fixtures) -> Path:
    """A second tiny base model of exactly the same shape, config and tokenizer as
    ``fixtures.model_dir`` but other weights: an engine on it must be told apart from the
    cohort's (lora_contract.base_identity) although every adapter fits it."""

    def build(out: Path) -> None:
        copy_tokenizer(fixtures.model_dir, out)
        write_random_qwen3(out, TINY_SHAPE, seed=OTHER_BASE_SEED, std=0.2)

    # beside the fixture set, not in it: the set's tree is what its generator key promises
    return build_atomically(fixtures.root.with_name(f"{fixtures.root.name}-other-base"), build)


def _module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA target in one decoder layer, by its path."""
    from types import SimpleNamespace

    from sglang_ext.adapter_compat import MODULE_PATHS, ModelGeometry

    geometry = ModelGeometry.read(SimpleNamespace(**config), "Qwen3ForCausalLM")
    return {path: geometry.in_out(module) for module, path in MODULE_PATHS.items()}


def make_adapter_tensors(config: dict, *, seed: int, rank: int, std: float = 0.5) -> dict:
    """PEFT-named lora_A/lora_B tensors for every target module of every layer."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in _module_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn((rank, fan_in), generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((fan_out, rank), generator=gen) * std
    return tensors


def adapter_config(rank: int) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }


def write_adapter(
    out: Path, model_config: dict, *, seed: int, rank: int, std: float = 0.5, dtype: str = "float32"
) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(rank), indent=2, sort_keys=True))
    tensors = make_adapter_tensors(model_config, seed=seed, rank=rank, std=std)
    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))


if __name__ == "__main__":
    print(ensure_fixtures().root)
