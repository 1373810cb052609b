"""A planted defect for the attestation tests (issue 39), in the real scheduler path: the engine
runs another adapter's slot than the request named (tests only, never product code).

Installed inside E1's scheduler process (``sglang_with_scheduler_probes.py``), before the plugin
loads there, on ``LoRAManager.prepare_lora_batch``: the plugin's hook then wraps it, as it wraps
upstream's. While the trigger file (:func:`trigger_path`) holds ``"<victim> <other>"`` (two
lora names), every row whose request names ``victim`` is built with ``other``'s lora id, for
this step's LoRA batch only (the request itself, its count and its cache namespace are
untouched). So the tokens come from ``other``'s slot while everything the request carries still
says ``victim``: an attestation that echoed the request would report ``victim``; one read from
the batch reports ``other``. One log line per swapped step. Removing the file ends the defect.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from probe_log import log_line

LOG_LINE = "served-slot swap"


def trigger_path(local_source_dir: str | os.PathLike[str]) -> Path:
    source = Path(local_source_dir)
    return source.with_name(f"{source.name}.serve-other-slot")


def _swap(trigger: Path | None) -> tuple[str, str] | None:
    if trigger is None:
        return None
    try:
        victim, other = trigger.read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    return victim, other


def install() -> None:
    from sglang.srt.lora.lora_manager import LoRAManager

    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    source = os.environ.get(LOCAL_SOURCE_DIR_ENV)
    trigger = trigger_path(source) if source else None
    prepare = LoRAManager.prepare_lora_batch

    def prepare_lora_batch(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        swap = _swap(trigger)
        if swap is None:
            return prepare(self, forward_batch, *args, **kwargs)
        ids = {ref.lora_name: uid for uid, ref in self.lora_refs.items()}
        victim, other = ids.get(swap[0]), ids.get(swap[1])
        original_ids = forward_batch.lora_ids
        if victim is None or other is None or victim not in original_ids:
            return prepare(self, forward_batch, *args, **kwargs)
        forward_batch.lora_ids = [other if uid == victim else uid for uid in original_ids]
        log_line(f"{LOG_LINE} rows of {swap[0]} built with {swap[1]}'s lora id")
        try:
            return prepare(self, forward_batch, *args, **kwargs)
        finally:
            forward_batch.lora_ids = original_ids

    LoRAManager.prepare_lora_batch = prepare_lora_batch
