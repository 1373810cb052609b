"""The device profile of the acceptance suite (``gpu_tests/``): one set of tests, and the device
chooses only the configuration: model size, dtype, LoRA backend, CUDA graphs, logprob epsilon.

- ``cpu`` (CI, every machine of ours): the tiny fixture Qwen3 in fp32, rank-4 adapters in a
  rank-8 pool, SGLang's CPU development mode (``torch_native`` LoRA and attention), radix cache
  on. Logprob epsilon floor 0: the managed engine and the clean baseline run the same fp32
  kernels on the same batch shape.
- ``cuda`` (a user's GPU host; NOT RUN HERE: no machine of ours has a GPU): a random Qwen3 with
  the real Qwen3-0.6B dimensions in bf16, generated locally (the GPU host has no network),
  adapters of ranks 32 / 16 / 48 (:data:`GPU_ADAPTER_RANKS`) on every linear module in a rank-64
  pool, the ``triton`` LoRA backend (``ACCEPTANCE_LORA_BACKEND`` picks another, e.g. ``csgmv``,
  0.5.23's default), CUDA graphs on, radix cache on. Logprob epsilon floor
  :data:`BF16_EPSILON_FLOOR`.

The logprob epsilon itself is not a constant of either profile: the suite derives it from the
clean baselines' measured spread (``gpu_tests/_acceptance.derive_epsilon``) and the profile only
gives its floor. The profile also fixes the online run's stall bound (``stall_bound_s``).

Nothing in the CUDA path is code the CPU path does not also run, except this configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lora_versions_dev import fixtures as tiny
from lora_versions_dev.launcher import EngineSpec, lora_flags

DEVICE_ENV = "ACCEPTANCE_DEVICE"  # "cpu" | "cuda"; default: cuda when torch sees one
LORA_BACKEND_ENV = "ACCEPTANCE_LORA_BACKEND"

# The floor of the derived logprob epsilon (epsilon = max(floor, factor x the baselines' measured
# spread)). The pre-run only repeats one engine, while a comparison crosses two processes, so its
# spread can understate what a comparison sees; the floor is what two processes are known to
# differ by. fp32 on CPU: 1e-5. Measured in CI here: a pre-run spread of 7.2e-7 (epsilon 1.4e-6)
# beside a managed turn 1.7e-6 from its clean baseline, with no cached token (the KV experiment);
# mixed A/B batches up to 4.1e-6. The A/B separation at the scoring positions is above 1.1, five
# orders more. bf16 on GPU: 1e-3, for the same reason (bf16 kernels do not promise bit-equality
# across processes); far below the A/B separation the scoring positions need. Neither is a GPU
# measurement: the GPU run measures.
CPU_EPSILON_FLOOR = 1e-5
BF16_EPSILON_FLOOR = 1e-3
# The online run fails when an engine makes no progress for longer than this while it has a
# request in flight (RFC 7.3 "maximum no-progress gap", fixed before the run). CPU: 2 cores shared
# by the farm's engines and the load generator; the largest gaps seen in CI runs are 0.3-0.6 s,
# so 5 s is a stall, not noise. GPU: Relax's anchor is 0.05 s on an RTX 6000 Ada; 1 s is a stall
# on any GPU (a pause, a flush, a blocked event loop), not a slow step.
CPU_STALL_BOUND_S = 5.0
GPU_STALL_BOUND_S = 1.0

# Qwen3-0.6B's dimensions (its config.json), random weights: kernels, CUDA graphs and LoRA
# buffers see the real shapes. The tokenizer is still the fixture's 500-token BPE: tests send
# token ids, and ids beyond it detokenize to "".
QWEN3_06B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
}
# Scaled to the width (about 1/sqrt(hidden)) so 28 bf16 layers keep activations of order 1; the
# adapters then move the outputs clearly without saturating them.
GPU_BASE_STD = 0.03
GPU_ADAPTER_STD = 0.03
# The GPU pool's rank (--max-lora-rank) and the adapters' ranks, all below it: a slot freed by one
# of them is cleared over the ranks it wrote, not the whole slot (sglang_ext/slot_zeroing's
# partial path, the one a rank equal to the pool's maximum never runs), and the ranks differ, so
# a slot holds a smaller adapter after a larger one (the overlap test alternates A and B).
GPU_ADAPTER_RANK = 64
GPU_ADAPTER_RANKS = {"A": 32, "B": 16, "C": 48}
GPU_MODEL_SEED = 5678
ACCEPTANCE_ADAPTERS = ("A", "B", "C")

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class DeviceProfile:
    device: str  # "cpu" | "cuda"
    dtype: str
    model: str  # what the model is, for the report
    lora_backend: str
    attention_backend: str
    cuda_graph: bool
    radix_cache: bool
    max_lora_rank: int
    adapter_ranks: Mapping[str, int]
    epsilon_floor: float  # of the derived logprob epsilon (the suite measures the rest)
    stall_bound_s: float  # the online run's largest allowed no-progress gap
    gpus: int = 0
    extra: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return asdict(self)

    @property
    def collective_backend(self) -> str:
        """The collective transport's backend on this device: NCCL moves GPU memory, gloo CPU."""
        return "nccl" if self.device == "cuda" else "gloo"

    def banner(self) -> str:
        graph = "on" if self.cuda_graph else "off"
        radix = "on" if self.radix_cache else "off"
        return (
            f"device={self.device} model={self.model} dtype={self.dtype} lora_backend={self.lora_backend} "
            f"attention={self.attention_backend} cuda_graph={graph} radix_cache={radix} "
            f"max_lora_rank={self.max_lora_rank} adapter_ranks={dict(self.adapter_ranks)} "
            f"epsilon_floor={self.epsilon_floor} stall_bound_s={self.stall_bound_s}"
        )

    def engine_spec(
        self,
        name: str,
        model_dir: Path,
        log_path: Path,
        *,
        index: int = 0,
        of: int = 1,
        plugin: bool = True,
        lora_paths: Mapping[str, Path] | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        command_prefix: Sequence[str] | None = None,
        overlap_schedule: bool = False,
    ) -> EngineSpec:
        """Engine ``index`` of ``of`` engines in this run. A clean baseline is ``plugin=False``
        with ``lora_paths``: the stock load path, nothing of ours in the process."""
        args = list(extra_args)
        if lora_paths:
            args += ["--lora-paths", *(f"{n}={p}" for n, p in lora_paths.items())]
        engine_env = dict(env or {})
        if self.device == "cuda":
            # One engine per GPU when there are enough; otherwise they share by memory fraction.
            gpus = max(1, self.gpus)
            engine_env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
            per_gpu = -(-of // gpus)
            args += ["--mem-fraction-static", f"{0.8 / per_gpu:.2f}"]
            if not self.cuda_graph:
                args.append("--disable-cuda-graph")
        if not self.radix_cache:
            args.append("--disable-radix-cache")
        backend = None if self.device == "cpu" else self.lora_backend  # CPU mode sets its own
        return EngineSpec(
            name=name,
            model_path=model_dir,
            log_path=log_path,
            plugin=plugin,
            cpu_dev=self.device == "cpu",
            lora_flags=lora_flags(self.max_lora_rank, backend),
            extra_args=args,
            env=engine_env,
            dtype=self.dtype,
            startup_timeout_s=240.0 if self.device == "cpu" else 900.0,
            command_prefix=command_prefix,
            overlap_schedule=overlap_schedule,
        )


def cpu_profile() -> DeviceProfile:
    return DeviceProfile(
        device="cpu",
        dtype="float32",
        model="tiny random Qwen3 (fixture, 2 layers, hidden 64)",
        lora_backend="torch_native",
        attention_backend="torch_native",
        cuda_graph=False,
        radix_cache=True,
        max_lora_rank=tiny.MAX_LORA_RANK,
        adapter_ranks={n: tiny.ADAPTER_RANKS[n] for n in ACCEPTANCE_ADAPTERS},
        epsilon_floor=CPU_EPSILON_FLOOR,
        stall_bound_s=CPU_STALL_BOUND_S,
    )


def cuda_profile(gpus: int = 1, lora_backend: str | None = None) -> DeviceProfile:
    return DeviceProfile(
        device="cuda",
        dtype="bfloat16",
        model="random Qwen3 with Qwen3-0.6B dimensions (28 layers, hidden 1024), bf16",
        lora_backend=lora_backend or "triton",
        attention_backend="sglang default for the GPU",
        cuda_graph=True,
        radix_cache=True,
        max_lora_rank=GPU_ADAPTER_RANK,
        adapter_ranks=dict(GPU_ADAPTER_RANKS),
        epsilon_floor=BF16_EPSILON_FLOOR,
        stall_bound_s=GPU_STALL_BOUND_S,
        gpus=gpus,
    )


def detect_profile(env: Mapping[str, str] | None = None) -> DeviceProfile:
    """``ACCEPTANCE_DEVICE`` if set, else ``cuda`` when torch sees a GPU, else ``cpu``."""
    env = os.environ if env is None else env
    wanted = env.get(DEVICE_ENV, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda', not {wanted!r}")
    if wanted == "cpu":
        return cpu_profile()
    import torch

    if wanted == "cuda" or torch.cuda.is_available():
        if not torch.cuda.is_available():
            raise RuntimeError(f"{DEVICE_ENV}=cuda but torch sees no GPU")
        return cuda_profile(torch.cuda.device_count(), env.get(LORA_BACKEND_ENV) or None)
    return cpu_profile()


# ------------------------------------------------------------------------------ fixtures


@dataclass(frozen=True)
class AcceptanceFixtures:
    model_dir: Path
    adapters: Mapping[str, Path]

    def adapter_dir(self, name: str) -> Path:
        return self.adapters[name]


def ensure_acceptance_fixtures(profile: DeviceProfile, root: Path | None = None) -> AcceptanceFixtures:
    """The model and the adapters A, B, C of ``profile``, generated once and cached."""
    small = tiny.ensure_fixtures(root)
    if profile.device == "cpu":
        return AcceptanceFixtures(small.model_dir, {n: small.adapter_dir(n) for n in ACCEPTANCE_ADAPTERS})
    out = ensure_gpu_fixtures(root)
    return AcceptanceFixtures(out / "model", {n: out / "adapters" / n for n in ACCEPTANCE_ADAPTERS})


def _gpu_key(tiny_root: Path) -> str:
    """What the GPU fixtures' bytes depend on: their parameters, the generator (``fixtures.py``,
    whose source the tiny fixtures' key hashes) and the libraries; not the rest of this file, so
    a change of a threshold does not regenerate 1.7 GB."""
    import torch
    import transformers

    params = [QWEN3_06B_SHAPE, GPU_BASE_STD, GPU_ADAPTER_STD, GPU_ADAPTER_RANKS, GPU_MODEL_SEED]
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    h.update(tiny_root.name.encode())
    for v in (torch.__version__, transformers.__version__):
        h.update(v.encode())
    return h.hexdigest()[:16]


def ensure_gpu_fixtures(root: Path | None = None) -> Path:
    """The bf16 Qwen3-0.6B-shaped model and its adapters (about 1.5 GB + 3 x 20-60 MB), built on
    any machine (CPU is enough), cached under ``.fixtures/gpu-<key>/``."""
    small = tiny.ensure_fixtures(root)

    def build(tmp: Path) -> None:
        model_dir = tmp / "model"
        tiny.copy_tokenizer(small.model_dir, model_dir)
        config = tiny.write_random_qwen3(
            model_dir, QWEN3_06B_SHAPE, seed=GPU_MODEL_SEED, std=GPU_BASE_STD, dtype="bfloat16"
        )
        for name in ACCEPTANCE_ADAPTERS:
            tiny.write_adapter(
                tmp / "adapters" / name,
                config,
                seed=tiny.ADAPTER_SEEDS[name],
                rank=GPU_ADAPTER_RANKS[name],
                std=GPU_ADAPTER_STD,
                dtype="bfloat16",
            )
        (tmp / "profile.json").write_text(json.dumps(cuda_profile().describe(), indent=2))

    return tiny.build_atomically(tiny.fixture_root(root) / f"gpu-{_gpu_key(small.root)}", build)
