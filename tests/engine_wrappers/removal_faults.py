"""Two faults in the plugin's real native edge, each for the one call a trigger file marks (tests
only; every other call passes through untouched). Installed in E1's main process, where the
tokenizer manager and the plugin's ``NativeLora`` run (``sglang_with_scheduler_probes.py``):

- the exact-version probe runs for real, then reports a failure (as a probe served by another id);
- the physical unload answers as SGLang does when it did not unload (LOAD_FAILED) and sends nothing.

A trigger file lives beside the farm's local source directory (:func:`trigger_path`; its path is
in E1's environment); the call that takes a fault removes its file. Used by
tests/plugin_tests/test_end_removal_failure_engines.py: an ``end`` whose probe fails and whose
removal then fails too leaves a FAILED version behind its refusal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FAIL_NEXT_PROBE = "fail-next-probe"
FAIL_NEXT_UNLOAD = "fail-next-unload"


def trigger_path(local_source_dir: str | os.PathLike[str], fault: str) -> Path:
    """Beside the farm's local source directory, as prepared_load_probe's trigger: E0 shares that
    directory but carries no faults, so only E1 takes them."""
    source = Path(local_source_dir)
    return source.with_name(f"{source.name}.{fault}")


def install() -> None:
    from lora_contract.errors import ErrorCode, LoraVersionError
    from sglang_ext import native_lora
    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    source = os.environ.get(LOCAL_SOURCE_DIR_ENV)

    def take(fault: str) -> bool:
        if not source:
            return False
        try:
            trigger_path(source, fault).unlink()  # only one call takes the fault
        except FileNotFoundError:
            return False
        return True

    real_probe = native_lora.NativeLora.probe
    real_unload = native_lora.NativeLora.physical_unload

    async def probe(self: Any, lora_name: str, expected_lora_id: str) -> None:
        await real_probe(self, lora_name, expected_lora_id)
        if take(FAIL_NEXT_PROBE):
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, "injected probe failure (tests)", lora_name=lora_name
            )

    async def physical_unload(self: Any, lora_name: str, lora_id: str) -> None:
        if take(FAIL_NEXT_UNLOAD):
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, "injected: SGLang did not unload (tests)", lora_name=lora_name
            )
        await real_unload(self, lora_name, lora_id)

    native_lora.NativeLora.probe = probe
    native_lora.NativeLora.physical_unload = physical_unload
