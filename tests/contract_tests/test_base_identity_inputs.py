"""The base fingerprint's inputs beyond one float safetensors file (lora_contract.base_identity):
quantized weights and configs, weights that are not safetensors, and a sharded model, whose
fingerprint may not depend on the order in which the filesystem lists its files (two engines of
one cohort list the same directory in different orders: another filesystem, another copy)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_contract import base_identity as bi

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}
SHARDS = 4


def write_sharded(d: Path, seed: int = 0) -> Path:
    """A model saved in ``SHARDS`` shards, as transformers writes one: ``model-0000k-of-0000n``
    files and the index that maps each tensor to its shard."""
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    for k in range(1, SHARDS + 1):
        name = f"model-{k:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {
            f"layers.{k}.w": torch.randn(64, 64, generator=g),
            f"layers.{k}.b": torch.randn(64, generator=g),
        }
        save_file(tensors, str(d / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def weights(d: Path) -> str:
    return bi.weights_identity(d, str(d))


@pytest.mark.parametrize("order", ["reversed", "shuffled", "config first"])
def test_a_sharded_models_fingerprint_does_not_depend_on_the_listing_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    d = write_sharded(tmp_path / "m")
    as_listed = weights(d)
    listed = sorted(d.iterdir())
    listings: list[Path] = []
    real_iterdir = Path.iterdir

    def iterdir(self: Path):
        entries = list(real_iterdir(self))
        if order == "reversed":
            entries = sorted(entries, reverse=True)
        elif order == "shuffled":
            random.Random(7).shuffle(entries)
            if entries == sorted(entries):  # a shuffle that happens to sort proves nothing
                entries.reverse()
        else:
            entries = sorted(entries, key=lambda p: (p.suffix != ".json", p.name), reverse=True)
        listings.append(self)
        return iter(entries)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    assert weights(d) == as_listed
    assert listings == [d]  # the listing was asked for, in the order set here
    assert len(listed) == SHARDS + 2


def test_every_shard_is_part_of_the_fingerprint(tmp_path: Path) -> None:
    a = write_sharded(tmp_path / "a")
    for k in (1, SHARDS):  # the first and the last shard in the listing
        b = tmp_path / f"b{k}"
        shutil.copytree(a, b)
        shard = b / f"model-{k:05d}-of-{SHARDS:05d}.safetensors"
        data = bytearray(shard.read_bytes())
        data[8 + int.from_bytes(data[:8], "little")] ^= 0xFF  # its first data byte
        shard.write_bytes(bytes(data))
        assert weights(b) != weights(a)


def quantized(d: Path, dtype: torch.dtype, data: torch.Tensor) -> Path:
    d.mkdir(parents=True)
    save_file({"w": data.view(dtype), "scale": torch.ones(8)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize(
    ("a", "b"),
    [(torch.int8, torch.uint8), (torch.int8, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e5m2)],
)
def test_quantized_weights_of_the_same_bytes_in_another_dtype_are_another_base(
    tmp_path: Path, a: torch.dtype, b: torch.dtype
) -> None:
    """The same bytes read as another dtype compute something else: the safetensors header
    (each tensor's dtype) is part of the weights' identity, not only the data's samples."""
    raw = torch.randint(0, 120, (256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    da, db = quantized(tmp_path / "a", a, raw), quantized(tmp_path / "b", b, raw)
    assert (da / "model.safetensors").stat().st_size == (db / "model.safetensors").stat().st_size
    assert weights(da) != weights(db)
    assert weights(da) == weights(quantized(tmp_path / "a2", a, raw.clone()))


def test_a_quantization_config_is_part_of_the_config(tmp_path: Path) -> None:
    q4 = {**CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    q8 = {**CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}}
    assert len({bi.config_identity(c) for c in (CONFIG, q4, q8)}) == 3
    # key order inside the nested object is not identity (canonical JSON)
    reordered = {**CONFIG, "quantization_config": {"group_size": 128, "bits": 4, "quant_method": "gptq"}}
    assert bi.config_identity(reordered) == bi.config_identity(q4)


@pytest.mark.parametrize("other", [None, "w8a8_int8", "awq"])
def test_the_engines_quantization_is_part_of_serving(other: str | None) -> None:
    assert bi.serving_identity("torch.bfloat16", "fp8") != bi.serving_identity("torch.bfloat16", other)


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".gguf"])
def test_weights_that_are_not_safetensors_are_fingerprinted_by_their_bytes(
    tmp_path: Path, suffix: str
) -> None:
    """A base in pickled torch (or GGUF) files is identified by its files, as safetensors are
    (minus the header they do not have): never by the model's name alone."""
    name = f"pytorch_model{suffix}" if suffix != ".gguf" else "model.gguf"
    dirs = []
    for seed in (1, 2):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        g = torch.Generator().manual_seed(seed)
        torch.save({"w": torch.randn(256, 256, generator=g)}, d / name)
        dirs.append(d)
    one, two = (bi.weights_identity(d, "org/model") for d in dirs)
    assert one != two  # other weights, the same name
    assert one != bi.weights_identity(None, "org/model")  # not the unresolved name
    # one byte changed inside a sample is seen (the first sample starts at the file's start)
    path = dirs[0] / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle sample starts exactly at span * 8 // 16
    path.write_bytes(bytes(data))
    assert bi.weights_identity(dirs[0], "org/model") != one


def test_index_and_config_files_are_not_weights(tmp_path: Path) -> None:
    """Only weight files are the weights: the index (a map the shard headers already say) and
    other JSON may be rewritten by a tool without making another base."""
    d = write_sharded(tmp_path / "m")
    before = weights(d)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": {}})
    )
    (d / "generation_config.json").write_text("{}")
    assert weights(d) == before
