"""Run ``sglang.launch_server`` with one SGLang internal the plugin depends on taken away.

Used only by the test that proves the plugin refuses to start, naming the missing symbol, when
the installed SGLang no longer has something ``sglang_ext.lora_registry_patch`` reads (what a pin
bump that forgot to update that module looks like).
"""

import runpy
import sys

import sglang.srt.managers.tokenizer_control_mixin as mixin

del mixin._merge_lora_update_results
sys.argv[0] = "sglang.launch_server"
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
