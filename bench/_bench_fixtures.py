"""Generated fixtures for ``bench/publish_engine.py``: a larger random Qwen3 base and a PEFT adapter
of a few tens of MB that matches it.

Same discipline as ``lora_versions_dev.fixtures``: fixed seeds, cached under
``.fixtures/bench-<key>/`` where the key hashes this file, the tiny fixtures' key (the tokenizer is
copied from there) and the library versions; built in a temporary directory and renamed into place,
so an interrupted generation is never used. Weights are never committed (``.fixtures/`` is ignored).

Shapes (defaults): hidden 1024, intermediate 2816, 6 layers, 16 heads of 64 (8 KV heads), vocab 512
(the fixture tokenizer); about 300 MB of fp32 base weights. Adapter: rank 64 over q,k,v,o,gate,up,
down of every layer, fp32: 6 x 4.78 MB = about 28.7 MB in 84 tensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lora_versions_dev import fixtures as tiny

MODEL_SEED = 4321
ADAPTER_SEED = 8765
BASE_STD = 0.02
ADAPTER_STD = 0.02

LARGE_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
LARGE_RANK = 64


@dataclass(frozen=True)
class BenchFixtures:
    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def adapter_dir(self) -> Path:
        return self.root / "adapter"

    @property
    def rank(self) -> int:
        return json.loads((self.adapter_dir / "adapter_config.json").read_text())["r"]


def _key(tiny_root: Path) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(tiny_root.name.encode())
    for v in (torch.__version__, transformers.__version__):
        h.update(v.encode())
    return h.hexdigest()[:16]


def ensure_bench_fixtures(root: Path | None = None) -> BenchFixtures:
    """Return the cached large base + adapter, generating them first if they are missing."""
    small = tiny.ensure_fixtures()

    def build(tmp: Path) -> None:
        model_dir = tmp / "model"
        tiny.copy_tokenizer(small.model_dir, model_dir)
        config = tiny.write_random_qwen3(model_dir, LARGE_CONFIG, seed=MODEL_SEED, std=BASE_STD)
        _write_adapter(tmp / "adapter", config)

    return BenchFixtures(tiny.build_atomically(tiny.fixture_root(root) / f"bench-{_key(small.root)}", build))


def _write_adapter(out: Path, model_config: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(
        json.dumps(tiny.adapter_config(LARGE_RANK), indent=2, sort_keys=True)
    )
    tensors = tiny.make_adapter_tensors(model_config, seed=ADAPTER_SEED, rank=LARGE_RANK, std=ADAPTER_STD)
    save_file(tensors, str(out / "adapter_model.safetensors"))


def rank_for_mib(mib: float) -> int:
    """The rank whose adapter over the large base weighs about ``mib`` MiB (fp32, all 7 modules)."""
    per_rank = sum(fan_in + fan_out for fan_in, fan_out in tiny._module_shapes(LARGE_CONFIG).values())
    per_rank_bytes = per_rank * 4 * LARGE_CONFIG["num_hidden_layers"]
    return max(1, round(mib * 1024 * 1024 / per_rank_bytes))


def ensure_sized_adapters(fixtures: BenchFixtures, sizes_mib: list[float]) -> dict[float, Path]:
    """Adapters of about each size over the large base (rank scaled to fit), cached beside it."""
    out: dict[float, Path] = {}
    model_config = json.loads((fixtures.model_dir / "config.json").read_text())
    for mib in sizes_mib:
        rank = rank_for_mib(mib)

        def build(tmp: Path, rank: int = rank) -> None:
            _write_sized_adapter(tmp, model_config, rank)

        out[mib] = tiny.build_atomically(fixtures.root / f"adapter-r{rank}", build)
    return out


def _write_sized_adapter(out: Path, model_config: dict, rank: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(tiny.adapter_config(rank), indent=2, sort_keys=True))
    tensors = tiny.make_adapter_tensors(model_config, seed=ADAPTER_SEED + rank, rank=rank, std=ADAPTER_STD)
    save_file(tensors, str(out / "adapter_model.safetensors"))


if __name__ == "__main__":
    print(ensure_bench_fixtures().root)
