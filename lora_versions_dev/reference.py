"""Independent reference outputs: HF transformers + PEFT in fp32, in the calling process.

Engine outputs are compared token for token against these; PEFT applies the adapter with its
own implementation, so agreement is evidence that SGLang served exactly that adapter.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=8)
def _model(model_dir: str, adapter_dir: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def greedy_tokens(
    model_dir: Path, adapter_dir: Path | None, input_ids: list[int], max_new_tokens: int
) -> list[int]:
    """Greedy continuation of ``input_ids`` (EOS ignored, exactly ``max_new_tokens`` tokens)."""
    import torch

    model = _model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    ids = torch.tensor([input_ids])
    out: list[int] = []
    with torch.no_grad():
        past = None
        step_input = ids
        for _ in range(max_new_tokens):
            res = model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            step_input = torch.tensor([[nxt]])
    return out
