"""Start and stop a local ``smg`` gateway in front of a cohort (demo, tests, CLI).

The flags come from :func:`relax_glue.gateway.gateway_command`; this module only runs the
process and waits until the gateway has registered every worker as healthy (``GET /workers``),
since smg answers ``/health`` before its workers are known and routes nothing until then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from lora_versions_dev.launcher import free_port
from relax_glue.gateway import gateway_command

__all__ = ["GatewayProcess", "GatewayStartError", "running_gateway", "smg_executable", "start_gateway"]


class GatewayStartError(RuntimeError):
    pass


def smg_executable() -> str:
    """The ``smg`` next to this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("smg")
    if beside.exists():
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise GatewayStartError("smg is not installed: pip install 'smg==1.13.0' (the [gateway] extra)")
    return found


class GatewayProcess:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path, workers: Sequence[str]):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.workers = tuple(workers)
        self.command: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def registered(self, client: httpx.Client) -> set[str]:
        """Worker URLs the gateway has registered and reports healthy."""
        r = client.get(f"{self.url}/workers")
        if r.status_code != 200:
            return set()
        return {
            w["url"].rstrip("/") for w in r.json().get("workers", []) if w.get("is_healthy") and "url" in w
        }

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = {w.rstrip("/") for w in self.workers}
        seen: set[str] = set()
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise GatewayStartError(
                        f"smg exited with code {self.proc.returncode}; see {self.log_path}:\n{self._tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    seen = self.registered(client)
                    if want <= seen:
                        return
                time.sleep(0.2)
        raise GatewayStartError(f"smg registered {sorted(seen)} of {sorted(want)} within {timeout_s:.0f}s")

    def _tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace_s)


SHUTDOWN_GRACE_S = 1


def start_gateway(
    worker_urls: Sequence[str],
    log_path: Path,
    *,
    retries: bool = False,
    port: int | None = None,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> GatewayProcess:
    port = port or free_port()
    cmd = gateway_command(
        worker_urls,
        port=port,
        executable=smg_executable(),
        retries=retries,
        metrics_port=free_port(),
        # smg waits out much of its shutdown grace (180 s by default) after SIGTERM even with
        # nothing in flight, so every stop here was GatewayProcess.stop's 5 s and then SIGKILL;
        # with 1 s it exits in 0.7 s (measured, smg 1.13.0). Ours is stopped only once its
        # cohort's sessions are done.
        extra_args=["--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S), *extra_args],
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    gw = GatewayProcess(proc, port, log_path, worker_urls)
    gw.command = cmd
    try:
        gw.wait_ready(timeout_s)
    except BaseException:
        gw.stop()
        raise
    return gw


@contextlib.contextmanager
def running_gateway(worker_urls: Sequence[str], log_path: Path, **kwargs: object) -> Iterator[GatewayProcess]:
    gw = start_gateway(worker_urls, log_path, **kwargs)  # type: ignore[arg-type]
    try:
        yield gw
    finally:
        gw.stop()
