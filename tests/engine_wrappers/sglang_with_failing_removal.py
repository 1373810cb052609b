"""Run ``sglang.launch_server`` with the plugin on and two faults in its real native edge, each
for the one call a trigger file marks (tests only; every other call passes through untouched):

- the exact-version probe runs for real, then reports a failure (as a probe served by another id);
- the physical unload answers as SGLang does when it did not unload (LOAD_FAILED) and sends nothing.

The trigger files live in the directory named by ``FAULT_DIR_ENV``; the call that takes a fault
removes its file. Used by tests/plugin_tests/test_end_removal_failure_engines.py: an ``end`` whose
probe fails and whose removal then fails too leaves a FAILED version behind its refusal.
"""

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext import native_lora

FAULT_DIR_ENV = "LORA_VERSIONS_TEST_FAULT_DIR"
FAIL_NEXT_PROBE = "fail-next-probe"
FAIL_NEXT_UNLOAD = "fail-next-unload"


def _take(trigger: str) -> bool:
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        return False
    try:
        (Path(directory) / trigger).unlink()  # only one call takes the fault
    except FileNotFoundError:
        return False
    return True


_real_probe = native_lora.NativeLora.probe
_real_unload = native_lora.NativeLora.physical_unload


async def probe(self: Any, lora_name: str, expected_lora_id: str) -> None:
    await _real_probe(self, lora_name, expected_lora_id)
    if _take(FAIL_NEXT_PROBE):
        raise LoraVersionError(ErrorCode.LOAD_FAILED, "injected probe failure (tests)", lora_name=lora_name)


async def physical_unload(self: Any, lora_name: str, lora_id: str) -> None:
    if _take(FAIL_NEXT_UNLOAD):
        raise LoraVersionError(
            ErrorCode.LOAD_FAILED, "injected: SGLang did not unload (tests)", lora_name=lora_name
        )
    await _real_unload(self, lora_name, lora_id)


if __name__ == "__main__":
    native_lora.NativeLora.probe = probe
    native_lora.NativeLora.physical_unload = physical_unload
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
