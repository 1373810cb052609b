"""What an engine's log says about physical unloads: the one reader the tests, the demo, the
acceptance suite and the examples count "unloaded exactly once" with, and read the step fence's
decision at each unload from.

SGLang 0.5.23 logs ``LoRA adapter unloading starts: LoRARef(lora_id='<id>', ...)`` in the
scheduler (``LoRAManager.unload_lora_adapter``) once per physical unload; the engine-local
``lora_id`` is unique per load, so the lines for one id count its unloads.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sglang_ext.step_fence import LOG_MARKER as FENCE_LOG_MARKER

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


def log_records(log_text: str, marker: str, lora_id: str) -> list[dict[str, str]]:
    """The ``key=value`` records of the log lines that carry ``marker`` and ``lora_id=<lora_id>``."""
    out = []
    for line in log_text.splitlines():
        if marker in line and f"lora_id={lora_id} " in line:
            out.append(dict(part.split("=", 1) for part in line.split(marker, 1)[1].split() if "=" in part))
    return out


def fence_records(log_path: Path, lora_id: str) -> list[dict[str, str]]:
    """What the step fence (:mod:`sglang_ext.step_fence`) decided at each unload of ``lora_id``:
    ``overlap``, ``launched``, ``on_adapter``, ``waited``, ``fence_passed``."""
    return log_records(Path(log_path).read_text(errors="replace"), FENCE_LOG_MARKER, lora_id)
