"""The device profile, and the GPU path dry-run as far as it goes without a GPU: the engine
lines each profile starts, and the bf16 Qwen3-0.6B-shaped model with its adapters (ranks below
the pool's 64) generated, admitted by the plugin's adapter check and run through HF + PEFT on the
CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_versions_dev.device_profile import (
    GPU_ADAPTER_RANK,
    GPU_ADAPTER_RANKS,
    QWEN3_06B_SHAPE,
    cpu_profile,
    cuda_profile,
    detect_profile,
    ensure_gpu_fixtures,
)
from lora_versions_dev.launcher import build_command, build_env
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry, serving_problem
from sglang_ext.settings import PLUGIN_SWITCH_ENV


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_profile_starts_managed_and_clean_baseline_engines() -> None:
    p = cpu_profile()
    managed = p.engine_spec("E0", Path("/m"), Path("/l"), extra_args=["--admin-api-key", "k"])
    base = p.engine_spec("base_A", Path("/m"), Path("/l"), plugin=False, lora_paths={"A": Path("/a")})
    cmd, env = build_command(managed, 1), build_env(managed)
    assert flag(cmd, "--device") == "cpu" and flag(cmd, "--lora-backend") == "torch_native"
    assert flag(cmd, "--dtype") == "float32" and "--disable-radix-cache" not in cmd
    assert env[PLUGIN_SWITCH_ENV] == "1"
    base_cmd = build_command(base, 2)
    assert flag(base_cmd, "--lora-paths") == "A=/a" and PLUGIN_SWITCH_ENV not in build_env(base)
    # above every cross-process delta measured on CPU (4.1e-6), far below the A/B separation (1.1)
    assert 4.1e-6 < p.epsilon_floor < 1e-3 and p.collective_backend == "gloo"
    assert all(r < p.max_lora_rank for r in p.adapter_ranks.values()), p.adapter_ranks


def test_cuda_profile_starts_engines_with_the_real_gpu_backends() -> None:
    p = cuda_profile(gpus=2)
    spec = p.engine_spec(
        "base_B", Path("/m"), Path("/l"), index=3, of=4, plugin=False, lora_paths={"B": Path("/b")}
    )
    cmd, env = build_command(spec, 1), build_env(spec)
    assert flag(cmd, "--lora-backend") == "triton" and flag(cmd, "--dtype") == "bfloat16"
    assert flag(cmd, "--max-lora-rank") == str(GPU_ADAPTER_RANK) == "64"
    assert "--device" not in cmd and "--attention-backend" not in cmd  # SGLang's GPU defaults
    assert "--disable-cuda-graph" not in cmd and "--disable-radix-cache" not in cmd
    assert "--disable-overlap-schedule" in cmd  # refused by the plugin until proven (gpu_tests/README.md)
    assert flag(cmd, "--mem-fraction-static") == "0.40"  # two engines per GPU
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "SGLANG_EXT_CPU_DEV" not in env
    assert cuda_profile(lora_backend="csgmv").lora_backend == "csgmv"
    assert 0 < p.epsilon_floor < 0.01 and p.collective_backend == "nccl"
    assert p.stall_bound_s <= 1.0 < cpu_profile().stall_bound_s


def test_gpu_adapters_are_below_the_pools_rank_so_slot_zeroing_takes_its_partial_path() -> None:
    """A slot freed by an adapter of the pool's maximum rank is cleared whole either way; only a
    smaller rank exercises the partial clear (sglang_ext/slot_zeroing), and different ranks put a
    smaller adapter into a slot a larger one left."""
    p = cuda_profile()
    assert dict(p.adapter_ranks) == GPU_ADAPTER_RANKS
    assert all(r < p.max_lora_rank == GPU_ADAPTER_RANK for r in GPU_ADAPTER_RANKS.values())
    assert len(set(GPU_ADAPTER_RANKS.values())) == len(GPU_ADAPTER_RANKS)


def test_detect_profile_follows_the_device_and_refuses_what_it_cannot_run() -> None:
    import torch

    assert detect_profile({"ACCEPTANCE_DEVICE": "cpu"}).device == "cpu"
    assert detect_profile({}).device == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        detect_profile({"ACCEPTANCE_DEVICE": "tpu"})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no GPU"):
            detect_profile({"ACCEPTANCE_DEVICE": "cuda"})


@pytest.mark.room(gib=5.0)  # generating the fixtures peaks at 4.8 GiB (peak RSS, a fresh clone)
def test_gpu_fixtures_are_generated_bf16_admitted_and_computable_without_a_gpu() -> None:
    """The GPU profile's model and adapters, generated here exactly as on a GPU host; the
    plugin's begin-time check admits the adapters for that geometry, and HF + PEFT runs them
    (bf16, CPU): finite logits, and each adapter moves the greedy tokens off the base model's."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import Qwen3ForCausalLM

    from relax_glue.snapshot import Snapshot

    root = ensure_gpu_fixtures()
    config = json.loads((root / "model" / "config.json").read_text())
    assert {k: config[k] for k in QWEN3_06B_SHAPE} == QWEN3_06B_SHAPE
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    geometry = ModelGeometry.read(SimpleNamespace(**config), "Qwen3ForCausalLM")
    shape = EngineLoraShape(geometry, max_lora_rank=GPU_ADAPTER_RANK, served_modules=None)
    for name in ("A", "B", "C"):
        adapter = root / "adapters" / name
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == GPU_ADAPTER_RANKS[name]
        with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (not a dict)
        assert dtypes == {"BF16"}
        assert serving_problem(Snapshot.from_peft_dir(adapter).manifest, shape) is None

    model = Qwen3ForCausalLM.from_pretrained(str(root / "model"), torch_dtype=torch.bfloat16)
    assert 0.7e9 < sum(p.numel() for p in model.parameters()) < 0.8e9  # untied lm_head: 0.75B
    ids = torch.tensor([[302, 356, 417, 494, 439, 2, 87, 82]])
    with torch.no_grad():
        base_logits = model(ids).logits
        assert torch.isfinite(base_logits).all()
        base_next = base_logits[0].argmax(-1)
        peft = PeftModel.from_pretrained(model, str(root / "adapters" / "A"), adapter_name="A")
        peft.load_adapter(str(root / "adapters" / "B"), adapter_name="B")
        nexts = {}
        for name in ("A", "B"):
            peft.set_adapter(name)
            logits = peft(ids).logits
            assert torch.isfinite(logits).all()
            nexts[name] = logits[0].argmax(-1)
    assert not torch.equal(nexts["A"], base_next) and not torch.equal(nexts["A"], nexts["B"])
