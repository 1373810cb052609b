"""Run SGLang's HTTP server (plugin on) with every scheduler probe the shared farm's E1 carries
(``conftest.py``), each installed inside the scheduler process (see
``lora_versions_dev.scheduler_wrapper``):

- ``step_fence_probe`` (the acceptance suite's): a log line at every physical unload;
- ``fence_reader_probe``: a log line whenever the fence's reading of the live batches changes;
- ``scheduler_500_faults``: SGLang's own 500 paths, taken only for rids with a marker suffix;
- ``prepared_load_probe``: a log line naming the thread of each part of a load and an unload, and
  a failed preparation for the one load a trigger file marks;
- ``served_slot_swap``: while a trigger file names two versions, rows of the first are built with
  the second's lora id (the attestation tests' planted defect, issue 39);

and, in this (main) process where the plugin's native edge runs, ``removal_faults``: a failed
exact-version probe and a failed physical unload, each for the one call a trigger file marks.

Each only adds log lines or fails only the calls marked for it, so every other test can share
the engine; the tests that read them run on E1 instead of on an engine of their own. E1 also
receives the test-only "shared-file" bucket transport (``fake_transport_shared_file``, registered
in this process before the server starts), which only a client that names it ever uses.
"""

import sys
from pathlib import Path
from typing import Any

# The acceptance suite's probe lives beside its own wrapper; spawn passes sys.path to the
# scheduler process, which unpickles the function below by module name.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu_tests" / "engine_wrappers"))

import fake_transport_shared_file
import fence_reader_probe
import prepared_load_probe
import removal_faults
import scheduler_500_faults
import served_slot_swap
import step_fence_probe

from lora_versions_dev.scheduler_wrapper import launch_http_server_with


def run_scheduler_process_with_probes(*args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.scheduler import run_scheduler_process

    step_fence_probe.install()
    fence_reader_probe.install()
    scheduler_500_faults.install()
    prepared_load_probe.install()
    served_slot_swap.install()
    return run_scheduler_process(*args, **kwargs)


if __name__ == "__main__":
    fake_transport_shared_file.register_engine_side()
    removal_faults.install()
    launch_http_server_with(run_scheduler_process_with_probes)
