"""Run ``sglang.launch_server`` with the plugin on but its forged-field guard taken away.

Used only by the test that drives SGLang's native in-flight count below zero through the stock
0.5.23 path the guard normally closes (a request naming an unknown adapter and a victim's
``lora_id``: its failure releases the victim's counter, which was never acquired), to show that
the plugin then reports the raw negative count and refuses to reclaim on a guess.
"""

import runpy
import sys

import sglang_ext.tokenizer_hooks as hooks

hooks.forbidden_fields = lambda obj: []  # the AROUND hook on generate_request lets lora_id through
hooks.raw_forbidden_fields = lambda body: []  # the HTTP pre-check lets it through too
sys.argv[0] = "sglang.launch_server"
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
