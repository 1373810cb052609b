"""Setups the managed-version lifecycle cannot make safe, refused at engine start.

Pure function of the resolved server arguments, so each rule is unit-testable without an engine.
Every argument is read as it is, never through a default: each one is a ServerArgs field named in
the pin module (``lora_registry_patch.DECLARED_FIELDS``) and checked at start, so a rename in a pin
bump refuses the start instead of reading as "off" and letting an unsupported setup through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_contract.names import MANAGED_CAPACITY
from sglang_ext.settings import OVERLAP_PROOF_ENV, switch


def overlap_proof_active(cfg: Any, env: Mapping[str, str] | None = None) -> bool:
    return (
        switch(OVERLAP_PROOF_ENV, env=env)
        and str(cfg.device or "").startswith("cuda")
        and not cfg.disable_overlap_schedule
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
    mlpb = int(cfg.max_loras_per_batch or 0)
    mll = cfg.max_loaded_loras
    return max(0, min(mlpb, int(mll) if mll is not None else mlpb) - 1)


def setup_problems(cfg: Any, env: Mapping[str, str] | None = None) -> list[str]:
    """Every reason this configuration is refused; empty when it is supported."""
    problems: list[str] = []
    if not cfg.enable_lora:
        problems.append("--enable-lora is off: managed LoRA versions need LoRA serving enabled")
    if (cfg.tokenizer_worker_num or 1) > 1:
        problems.append(
            f"tokenizer_worker_num={cfg.tokenizer_worker_num} > 1: each tokenizer worker keeps its own "
            "LoRA registry and does not run plugins, so versions could not be tracked exactly"
        )
    if (cfg.dp_size or 1) > 1:
        problems.append(
            f"dp_size={cfg.dp_size} > 1: run one engine per data-parallel replica instead "
            "(the publisher treats each engine as one cohort member)"
        )
    mlpb = cfg.max_loras_per_batch or 0
    if mlpb < MIN_LORAS_PER_BATCH:
        problems.append(
            f"max_loras_per_batch={mlpb} < {MIN_LORAS_PER_BATCH}: {MANAGED_CAPACITY} pinned managed versions "
            "need one more free slot (set --max-loras-per-batch 3 or more)"
        )
    mll = cfg.max_loaded_loras
    if mll is not None and mll < MIN_LORAS_PER_BATCH:
        problems.append(
            f"max_loaded_loras={mll} < {MIN_LORAS_PER_BATCH}: {MANAGED_CAPACITY} pinned managed versions "
            "plus one free slot must fit in host memory (set --max-loaded-loras 3 or more, or leave it unset)"
        )
    # tp_size > 1 is supported: every rank answers each managed step (sglang_ext.rank_agreement).
    # What is still refused around it is named on its own:
    if (cfg.nnodes or 1) > 1:
        # The bytes of a version are received, verified and staged once, on this node's disk;
        # every rank reads the staged directory by path, which a rank on another node lacks.
        problems.append(
            f"nnodes={cfg.nnodes} > 1: a version is staged on the first node's disk and every rank reads "
            "it there (run each engine on one node; tensor parallelism within it is fine)"
        )
    if cfg.enable_dp_attention:
        problems.append(
            "--enable-dp-attention is on: data-parallel attention is not proven with managed versions"
        )
    if (cfg.attn_cp_size or 1) > 1:
        problems.append(
            f"attn_cp_size={cfg.attn_cp_size} > 1: context parallelism is not proven with managed versions"
        )
    if (cfg.ep_size or 1) > 1:
        problems.append(f"ep_size={cfg.ep_size} > 1: expert parallelism is not proven with managed versions")
    if (cfg.pp_size or 1) > 1:
        # The step fence reads the one-batch loops' last_batch and result_queue; the pipeline loop
        # (event_loop_pp) keeps a micro-batch in flight per stage, which the fence cannot see.
        problems.append(
            f"pp_size={cfg.pp_size} > 1: pipeline parallelism keeps several launched micro-batches the "
            "step fence cannot see (run pp 1 engines)"
        )
    if cfg.enable_pdmux:
        problems.append(
            "--enable-pdmux is on: PD multiplexing runs prefill and decode batches on two streams at once, "
            "outside the one-batch loops the step fence reads"
        )
    if cfg.enable_lora_overlap_loading:
        # LoRAOverlapLoader (sglang/srt/lora/lora_overlap_loader.py) starts a slot's fill on a side
        # stream at admission and evicts a non-pinned adapter for it there, while launched steps run:
        # a slot change neither the native count nor the step fence at unload orders.
        problems.append(
            "--enable-lora-overlap-loading is on: it fills (and evicts) LoRA slots on a side stream while "
            "launched steps run, outside the step fence; managed versions are proven only with slots "
            "changed between steps"
        )
    spec = cfg.speculative_algorithm
    if spec not in (None, "", "NONE", "none"):
        problems.append(f"speculative decoding ({spec}) is enabled: not supported with managed versions")
    disagg = cfg.disaggregation_mode
    if disagg not in (None, "", "null"):
        problems.append(f"PD disaggregation (disaggregation_mode={disagg}) is enabled: not supported")
    if cfg.disable_radix_cache:
        # The KV-isolation claims (RFC: a version's prefix cache is its own, never another's or the
        # base model's) are proven with SGLang's radix cache on, which keys every cached prefix by
        # the request's lora_id. Off, nothing is cached, so nothing could leak, but neither is the
        # behaviour the claims and their tests describe. SGLang 0.5.23 also turns it off by itself
        # for some setups (--enable-deterministic-inference on an attention backend without radix
        # support, --enable-mis, embedding, encoder-only and some hybrid-attention models, Whisper):
        # the resolved value is read here, so those are refused the same way.
        problems.append(
            "the radix cache is off (--disable-radix-cache, or SGLang turned it off for this model or "
            "setup): the KV isolation of managed versions is proven only with it on (drop the flag, or "
            "use a setup that keeps it on)"
        )
    if not cfg.disable_overlap_schedule and not overlap_proof_active(cfg, env):
        # Under overlap a finished request's release reaches the tokenizer while the next batch,
        # still holding its row, may run on the GPU: a zero count no longer implies the step
        # fence (version_table.step_fence_passed; gpu_tests/README.md, "The overlap scheduler").
        problems.append(
            "the overlap scheduler is enabled: pass --disable-overlap-schedule (release ordering of "
            "LoRA references is only proven without it)"
        )
    return problems
