"""The README's "Use it with your trainer" block, for the tests that run it as written (in this
process and in a worker process of their own)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart_source() -> str:
    text = README.read_text()
    block = re.search(r"<!-- quickstart:begin -->\n```python\n(.*?)```\n<!-- quickstart:end -->", text, re.S)
    assert block is not None, "the README lost its quickstart block"
    return block.group(1)


def run_quickstart() -> dict[str, Any]:
    """Execute exactly the README's code (reading its configuration from the environment); its
    names (``registry``, ``publisher``, ``sessions``, ``rollout`` ...)."""
    ns: dict[str, Any] = {}
    exec(compile(quickstart_source(), "README.md:quickstart", "exec"), ns)
    return ns


def peft_model(model_dir: Path, adapter_dir: Path) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def a_training_step(model: Any) -> None:
    """Stands in for an optimizer step: every LoRA weight moves a little."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.01 * torch.randn_like(p))
