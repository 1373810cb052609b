"""The README's "Use it with your trainer" block, executed exactly as written against the real
CPU engines E0/E1: a PEFT model is published after each "training step" (the third publication
meets CAPACITY_ERROR and the block's reclaim-then-retry path), agent episodes bind and close."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _admin_key import ADMIN_KEY
from _e2e_helpers import PROMPTS, TOOL_IDS, aclose_all, purge

from relax_glue.publisher import PublishOutcome
from relax_glue.registry_types import VersionKey, VersionState

pytestmark = pytest.mark.engine

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart_source() -> str:
    text = README.read_text()
    block = re.search(r"<!-- quickstart:begin -->\n```python\n(.*?)```\n<!-- quickstart:end -->", text, re.S)
    assert block is not None, "the README lost its quickstart block"
    return block.group(1)


def a_training_step(model: Any) -> None:
    """Stands in for an optimizer step: every LoRA weight moves a little."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01 * torch.randn_like(p))


async def test_the_readme_quickstart_runs_as_written(engines, fixtures, monkeypatch) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("LORA_VERSIONS_ENGINES", f"E0={engines[0].url},E1={engines[1].url}")
    monkeypatch.setenv("LORA_VERSIONS_ADMIN_KEY", ADMIN_KEY)
    ns: dict[str, Any] = {}
    exec(compile(quickstart_source(), "README.md:quickstart", "exec"), ns)  # exactly the README's code
    registry, clients = ns["registry"], ns["clients"]
    base = AutoModelForCausalLM.from_pretrained(fixtures.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, fixtures.adapter_dir("A"), is_trainable=True)
    try:
        first = await ns["after_training_step"](model, 1)
        assert first.outcome is PublishOutcome.PUBLISHED, first
        episodes = await asyncio.gather(*(ns["rollout"](list(p), list(TOOL_IDS)) for p in PROMPTS))
        assert all(0 < len(e) <= 32 for e in episodes), episodes  # two sampled turns each

        a_training_step(model)
        second = await ns["after_training_step"](model, 2)
        assert second.outcome is PublishOutcome.PUBLISHED and second.digest != first.digest
        # step1 is retired and unreferenced but still holds its slot: the third publication is
        # refused with CAPACITY_ERROR, the block reclaims step1 and publishes again
        a_training_step(model)
        third = await ns["after_training_step"](model, 3)
        assert third.outcome is PublishOutcome.PUBLISHED, third
        states = {v.version_key.version_id: v.state for v in registry.status().versions}
        assert states == {
            "step1": VersionState.RECLAIMED,
            "step2": VersionState.RETIRED,
            "step3": VersionState.PUBLISHED,
        }
        assert registry.version(VersionKey("run1", "step1")).session_refs == 0
        await ns["rollout"](list(PROMPTS[0]), list(TOOL_IDS))
        assert registry.status().sessions["CLOSED"] == len(PROMPTS) + 1  # every episode released once
    finally:
        left = await purge(clients, "@run1-")
        await aclose_all(clients.values())
        assert not any(left.values()), left
