"""The test and demo gateway (lora_versions_dev.gateway_process): a real smg in front of a stand-in
worker (any GET answers 200, which is all smg's registration asks of a worker here)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lora_versions_dev.gateway_process import start_gateway


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"model_path": "stand-in", "is_generation": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def worker_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(5)


def test_a_stopped_gateway_exits_on_its_sigterm_not_on_the_sigkill_after_the_grace(
    worker_url: str, tmp_path: Path
) -> None:
    """smg's default shutdown grace (180 s) outlasts GatewayProcess.stop's 5 s even with nothing
    in flight: every stop was a SIGKILL 5 s later (every test, example and demo cohort paid it)."""
    gw = start_gateway([worker_url], tmp_path / "gateway.log")
    gw.stop()
    assert gw.proc.returncode is not None and gw.proc.returncode != -signal.SIGKILL, gw.proc.returncode
