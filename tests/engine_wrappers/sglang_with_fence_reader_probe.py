"""Run SGLang's HTTP server (plugin on) with :mod:`fence_reader_probe` installed in its scheduler
process (see ``lora_versions_dev.scheduler_wrapper``)."""

from fence_reader_probe import run_scheduler_process_with_reader_probe

from lora_versions_dev.scheduler_wrapper import launch_http_server_with

if __name__ == "__main__":
    launch_http_server_with(run_scheduler_process_with_reader_probe)
