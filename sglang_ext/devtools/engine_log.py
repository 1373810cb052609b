"""What an engine's log says about physical unloads: the one reader the tests, the demo, the
acceptance suite and the examples count "unloaded exactly once" with.

SGLang 0.5.23 logs ``LoRA adapter unloading starts: LoRARef(lora_id='<id>', ...)`` in the
scheduler (``LoRAManager.unload_lora_adapter``) once per physical unload; the engine-local
``lora_id`` is unique per load, so the lines for one id count its unloads.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

UNLOAD_LOG_LINE = "LoRA adapter unloading starts"


def unload_lines(log_path: Path, lora_id: str) -> int:
    """Scheduler log lines of SGLang's physical unload of exactly this engine-local lora_id."""
    text = Path(log_path).read_text(errors="replace")
    return sum(1 for line in text.splitlines() if UNLOAD_LOG_LINE in line and str(lora_id) in line)


async def await_unload_lines(log_path: Path, lora_id: str, expect: int = 1, timeout_s: float = 10.0) -> int:
    """:func:`unload_lines`, waiting up to ``timeout_s`` for the log to show ``expect`` of them
    (the log line is written by the scheduler process and may trail the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = unload_lines(log_path, lora_id)
        if n >= expect or time.monotonic() > deadline:
            return n
        await asyncio.sleep(0.1)
