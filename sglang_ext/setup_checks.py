"""Setups the managed-version lifecycle cannot make safe, refused at engine start.

Pure function of the resolved server arguments, so each rule is unit-testable without an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_contract.names import MANAGED_CAPACITY
from sglang_ext.settings import OVERLAP_PROOF_ENV, switch


def overlap_proof_active(cfg: Any, env: Mapping[str, str] | None = None) -> bool:
    return (
        switch(OVERLAP_PROOF_ENV, env=env)
        and str(getattr(cfg, "device", "") or "").startswith("cuda")
        and not getattr(cfg, "disable_overlap_schedule", False)
    )


# MANAGED_CAPACITY versions stay pinned, and SGLang refuses a pin that would leave no free slot
# (``LoRAManager.validate_new_adapter``: num_pinned >= max_loras_per_batch - 1), so one more.
MIN_LORAS_PER_BATCH = MANAGED_CAPACITY + 1


def managed_slots(cfg: Any) -> int:
    """How many managed versions this engine can hold pinned at once: every LoRA slot but one,
    of the smaller of the GPU pool (``--max-loras-per-batch``) and the host's loaded adapters
    (``--max-loaded-loras``, unset: no bound of its own). The one left is what SGLang's pin rule
    keeps free, for the probe's batch or a stock adapter. An epoch's capacity K needs at least K
    here on every engine of its cohort (checked by the trainer side at setup)."""
    mlpb = int(getattr(cfg, "max_loras_per_batch", 0) or 0)
    mll = getattr(cfg, "max_loaded_loras", None)
    return max(0, min(mlpb, int(mll) if mll is not None else mlpb) - 1)


def setup_problems(cfg: Any, env: Mapping[str, str] | None = None) -> list[str]:
    """Every reason this configuration is refused; empty when it is supported."""
    problems: list[str] = []
    if not getattr(cfg, "enable_lora", False):
        problems.append("--enable-lora is off: managed LoRA versions need LoRA serving enabled")
    if (getattr(cfg, "tokenizer_worker_num", 1) or 1) > 1:
        problems.append(
            f"tokenizer_worker_num={cfg.tokenizer_worker_num} > 1: each tokenizer worker keeps its own "
            "LoRA registry and does not run plugins, so versions could not be tracked exactly"
        )
    if (getattr(cfg, "dp_size", 1) or 1) > 1:
        problems.append(
            f"dp_size={cfg.dp_size} > 1: run one engine per data-parallel replica instead "
            "(the publisher treats each engine as one cohort member)"
        )
    mlpb = getattr(cfg, "max_loras_per_batch", 0) or 0
    if mlpb < MIN_LORAS_PER_BATCH:
        problems.append(
            f"max_loras_per_batch={mlpb} < {MIN_LORAS_PER_BATCH}: {MANAGED_CAPACITY} pinned managed versions "
            "need one more free slot (set --max-loras-per-batch 3 or more)"
        )
    mll = getattr(cfg, "max_loaded_loras", None)
    if mll is not None and mll < MIN_LORAS_PER_BATCH:
        problems.append(
            f"max_loaded_loras={mll} < {MIN_LORAS_PER_BATCH}: {MANAGED_CAPACITY} pinned managed versions "
            "plus one free slot must fit in host memory (set --max-loaded-loras 3 or more, or leave it unset)"
        )
    if (getattr(cfg, "tp_size", 1) or 1) > 1:
        # Decision: not proven on real engines here (the CPU engines run tp 1), so refused rather
        # than assumed: the load, probe, unload and refcount paths would have to hold on every rank.
        problems.append(
            f"tp_size={cfg.tp_size} > 1: tensor parallelism is not proven with managed versions "
            "(run tp 1 engines, one cohort member each)"
        )
    if (getattr(cfg, "pp_size", 1) or 1) > 1:
        # The step fence reads the one-batch loops' last_batch and result_queue; the pipeline loop
        # (event_loop_pp) keeps a micro-batch in flight per stage, which the fence cannot see.
        problems.append(
            f"pp_size={cfg.pp_size} > 1: pipeline parallelism keeps several launched micro-batches the "
            "step fence cannot see (run pp 1 engines)"
        )
    if getattr(cfg, "enable_pdmux", False):
        problems.append(
            "--enable-pdmux is on: PD multiplexing runs prefill and decode batches on two streams at once, "
            "outside the one-batch loops the step fence reads"
        )
    if getattr(cfg, "enable_lora_overlap_loading", False):
        # LoRAOverlapLoader (sglang/srt/lora/lora_overlap_loader.py) starts a slot's fill on a side
        # stream at admission and evicts a non-pinned adapter for it there, while launched steps run:
        # a slot change neither the native count nor the step fence at unload orders.
        problems.append(
            "--enable-lora-overlap-loading is on: it fills (and evicts) LoRA slots on a side stream while "
            "launched steps run, outside the step fence; managed versions are proven only with slots "
            "changed between steps"
        )
    spec = getattr(cfg, "speculative_algorithm", None)
    if spec not in (None, "", "NONE", "none"):
        problems.append(f"speculative decoding ({spec}) is enabled: not supported with managed versions")
    disagg = getattr(cfg, "disaggregation_mode", "null")
    if disagg not in (None, "", "null"):
        problems.append(f"PD disaggregation (disaggregation_mode={disagg}) is enabled: not supported")
    if not getattr(cfg, "disable_overlap_schedule", False) and not overlap_proof_active(cfg, env):
        # Under overlap a finished request's release reaches the tokenizer while the next batch,
        # still holding its row, may run on the GPU: a zero count no longer implies the step
        # fence (version_table.step_fence_passed; gpu_tests/README.md, "The overlap scheduler").
        problems.append(
            "the overlap scheduler is enabled: pass --disable-overlap-schedule (release ordering of "
            "LoRA references is only proven without it)"
        )
    return problems
