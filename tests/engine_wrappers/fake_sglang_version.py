"""Run ``sglang.launch_server`` while the installed sglang reports another version.

Used only by the test that proves the plugin refuses an SGLang version other than the pinned one
(we cannot install a second SGLang next to the pinned one just for that).
"""

import importlib.metadata as metadata
import runpy
import sys

FAKE = "0.5.22"
_real_version = metadata.version


def _version(dist: str) -> str:
    return FAKE if dist == "sglang" else _real_version(dist)


metadata.version = _version
sys.argv[0] = "sglang.launch_server"
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
