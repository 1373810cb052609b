"""Run SGLang's HTTP server (plugin on) with :mod:`scheduler_500_faults` installed in its scheduler
process (see ``lora_versions_dev.scheduler_wrapper``)."""

from scheduler_500_faults import run_scheduler_process_with_500s

from lora_versions_dev.scheduler_wrapper import launch_http_server_with

if __name__ == "__main__":
    launch_http_server_with(run_scheduler_process_with_500s)
