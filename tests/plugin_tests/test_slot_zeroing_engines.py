"""A freed slot's clear zeroes the ranks written into it, on the real engine E1 (issue 29;
sglang_ext.slot_zeroing; the bit-for-bit proof against upstream's clear is test_slot_zeroing.py).
The engines' pool holds rank 8 (--max-lora-rank 8) and the fixtures' adapters are rank 4."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _engine_helpers import Published, generate, snapshot_of

from lora_versions_dev import reference
from lora_versions_dev.farm import PROMPT
from lora_versions_dev.fixtures import ADAPTER_RANKS, MAX_LORA_RANK, Fixtures
from sglang_ext.slot_zeroing import LOG_MARKER

pytestmark = pytest.mark.engine

MAX_NEW = 8
UNLOAD_LINE = "LoRA adapter unloading starts"


def clear_after_unload(log_path: Path, lora_id: str, timeout_s: float = 10.0) -> dict[str, str]:
    """The slot zeroing's record inside the physical unload of ``lora_id`` (SGLang logs the
    unload's start, then remove_lora clears the slot)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = Path(log_path).read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if UNLOAD_LINE in line and lora_id in line]
        after = [line for line in lines[starts[-1] :] if LOG_MARKER in line] if starts else []
        if after or time.monotonic() > deadline:
            assert after, f"no {LOG_MARKER!r} line after the unload of {lora_id}"
            return dict(kv.split("=", 1) for kv in after[0].split(LOG_MARKER, 1)[1].split() if "=" in kv)
        time.sleep(0.1)


def test_an_unload_zeroes_the_adapters_ranks_and_the_slot_serves_the_next_version_exactly(
    engines, fixtures: Fixtures
):
    e1 = engines[1]
    for name in ("C", "A"):  # A is placed in a slot C's unload cleared
        expected = reference.greedy_tokens(fixtures.model_dir, fixtures.adapter_dir(name), PROMPT, MAX_NEW)
        pub = Published(e1, snapshot_of(fixtures.adapter_dir(name)))
        try:
            r = generate(e1.url, PROMPT, pub.name, max_new_tokens=MAX_NEW)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == expected, f"the installed adapter is exactly {name}"
        finally:
            pub.finish()
        record = clear_after_unload(e1.log_path, pub.lora_id)
        assert record == {
            "slot": record["slot"],
            "zeroed_ranks": str(ADAPTER_RANKS[name]),
            "max_rank": str(MAX_LORA_RANK),
            "tp_rank": "0",
        }
    base = reference.greedy_tokens(fixtures.model_dir, None, PROMPT, MAX_NEW)
    r = generate(e1.url, PROMPT, None, max_new_tokens=MAX_NEW)
    assert r.status_code == 200 and r.json()["output_ids"] == base, "the base model is untouched"
