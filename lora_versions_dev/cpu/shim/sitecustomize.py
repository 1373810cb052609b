# CPU development mode bootstrap for SGLang engine processes (see lora_versions_dev/cpu).
# This directory is put on PYTHONPATH only by the project's engine launcher, and the hook below
# does nothing unless SGLANG_EXT_CPU_DEV=1. It runs in every (spawned) engine process.
import os

if os.environ.get("SGLANG_EXT_CPU_DEV") == "1":
    from lora_versions_dev.cpu import activate

    activate()
