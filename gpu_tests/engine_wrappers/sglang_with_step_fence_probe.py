"""Run SGLang's HTTP server (plugin on) with :mod:`step_fence_probe` installed in its scheduler
process (see ``lora_versions_dev.scheduler_wrapper``)."""

from step_fence_probe import run_scheduler_process_with_probe

from lora_versions_dev.scheduler_wrapper import launch_http_server_with

if __name__ == "__main__":
    launch_http_server_with(run_scheduler_process_with_probe)
