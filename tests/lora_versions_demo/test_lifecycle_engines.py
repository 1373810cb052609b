"""The main job, run as the README runs it (``lora-versions demo``, here with ``--json``): two
CPU engines of its own behind the real smg gateway, the whole lifecycle, every check held."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_the_demo_runs_the_whole_lifecycle_through_the_gateway(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "relax_glue.cli", "demo", "--json", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.stdout.strip(), p.stderr[-3000:]
    report = json.loads(p.stdout)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert p.returncode == 0 and report["ok"] and not failed, failed or p.stderr[-3000:]
    assert report["gateway"].startswith("http://127.0.0.1:")
    assert "gateway smg 1.13.0" in p.stderr and "--disable-retries" in p.stderr
    gateway = next(s["gateway"] for s in report["steps"] if "gateway" in s)
    assert gateway["cache_hit_rate_later_turns"] >= 0.5
    assert (tmp_path / "demo.json").exists() and (tmp_path / "gateway.log").exists()
