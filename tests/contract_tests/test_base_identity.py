"""The base model's fingerprint (lora_contract.base_identity), from files on disk: each part sees
what it names and nothing else, and the engine's begin refuses another base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_contract import base_identity as bi
from lora_contract.messages import BaseIdentity

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "_name_or_path": "/here"}


def write_model(d: Path, *, seed: int = 0, config: dict | None = None, tokenizer: str = "tok") -> Path:
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {"w": torch.randn(256, 256, generator=g), "v": torch.randn(64, generator=g)},
        str(d / "model.safetensors"),
    )
    (d / "config.json").write_text(json.dumps(config or CONFIG))
    (d / "tokenizer.json").write_text(tokenizer)
    return d


def identity(d: Path, dtype: str = "torch.float32") -> BaseIdentity:
    return bi.base_identity(
        model_dir=d,
        tokenizer_dir=d,
        config=bi.config_of(d, {}),
        dtype=dtype,
        quantization=None,
        model_name=str(d),
    )


def differing(a: BaseIdentity, b: BaseIdentity) -> list[str]:
    assert (a.fingerprint == b.fingerprint) == (bi.base_differences(a, b) == [])
    return bi.base_differences(a, b)


def test_the_same_files_give_the_same_fingerprint_wherever_they_lie(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(
        json.dumps({**cfg, "_name_or_path": "/elsewhere", "transformers_version": "9"})
    )
    assert differing(identity(a), identity(b)) == []


def test_other_weights_of_the_same_shape_are_another_base(tmp_path: Path) -> None:
    assert differing(
        identity(write_model(tmp_path / "a", seed=1)), identity(write_model(tmp_path / "b", seed=2))
    ) == ["weights"]


def test_one_changed_sample_of_the_weights_is_seen(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    path = b / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header] ^= 0xFF  # the first data byte: inside the first sample
    path.write_bytes(bytes(data))
    assert differing(identity(a), identity(b)) == ["weights"]


def test_the_tokenizer_config_and_dtype_are_parts_of_their_own(tmp_path: Path) -> None:
    a = identity(write_model(tmp_path / "a"))
    assert differing(a, identity(write_model(tmp_path / "t", tokenizer="other"))) == ["tokenizer"]
    assert differing(a, identity(write_model(tmp_path / "c", config={**CONFIG, "hidden_size": 65}))) == [
        "config"
    ]
    assert differing(a, identity(tmp_path / "a", dtype="torch.bfloat16")) == ["serving"]


def test_a_model_without_local_files_is_named_not_guessed(tmp_path: Path) -> None:
    one = bi.weights_identity(None, "org/model@rev1")
    assert one == bi.weights_identity(tmp_path / "missing", "org/model@rev1")
    assert one != bi.weights_identity(None, "org/model@rev2")


@pytest.mark.parametrize("part", ["fingerprint", "config", "tokenizer", "weights", "serving"])
def test_every_part_is_a_sha256(part: str) -> None:
    with pytest.raises(ValueError):
        BaseIdentity(
            **{
                **dict.fromkeys(("fingerprint", "config", "tokenizer", "weights", "serving"), "a" * 64),
                part: "x",
            }
        )
