"""The operator CLI (``lora-versions``, run as a process) against REAL engines E0/E1 and a durable
registry: publish a PEFT directory with progress, status of the registry and every engine,
sessions, the capacity refusal with its hint, the writer lock while a trainer holds the registry,
reclaim with progress, and resolve with nothing pending."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _e2e_helpers import PROMPTS, aclose_all, greedy, make_clients, new_epoch, purge

from lora_versions_dev.farm import ADMIN_KEY
from relax_glue.sessions import SessionManager
from relax_glue.store import DurableRegistry

# a CPU engine of its own (the engine command)
pytestmark = [pytest.mark.engine, pytest.mark.room(gib=4.0)]


def cli(*args: str, cohort: list[str] | None = None) -> tuple[int, Any, str]:
    """Run ``lora-versions ARGS --json`` as its own process; (exit code, JSON out, stderr)."""
    argv = [sys.executable, "-m", "relax_glue.cli", *args, "--json"]
    for spec in cohort or []:
        argv += ["--engine", spec]
    p = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env={"LORA_VERSIONS_ADMIN_KEY": ADMIN_KEY, **_env()},
    )
    try:
        out = json.loads(p.stdout) if p.stdout.strip() else None
    except json.JSONDecodeError:
        raise AssertionError(f"not JSON: {p.stdout!r}\nstderr: {p.stderr}") from None
    return p.returncode, out, p.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "LORA_VERSIONS_ADMIN_KEY"}


async def test_the_cli_runs_a_publication_lifecycle_on_real_engines(
    engines, fixtures, tmp_path: Path
) -> None:
    epoch = new_epoch()
    db = tmp_path / "registry.db"
    registry = f"sqlite:{db}"
    cohort = [f"E0={engines[0].url}", f"E1={engines[1].url}"]
    clients = make_clients(engines, ADMIN_KEY)
    marker = f"@{epoch}-"

    def publish(adapter: str) -> tuple[int, Any, str]:
        return cli(
            "publish", str(fixtures.adapter_dir(adapter)), "--version-id", adapter, "--registry", registry,
            cohort=cohort,
        )  # fmt: skip

    try:
        # --- publish A from its PEFT directory: a new registry (epoch + cohort), progress on stderr
        code, a, err = cli(
            "publish", str(fixtures.adapter_dir("A")), "--version-id", "A", "--registry", registry,
            "--epoch", epoch, "--bucket-mib", "0.015625", cohort=cohort,
        )  # fmt: skip
        assert code == 0 and a["outcome"] == "PUBLISHED", (a, err)
        # --json keeps progress off stdout; a human run prints it (checked with the text run below)

        # --- a trainer holds the registry and binds a session on A
        store = DurableRegistry.open(db, epoch, ("E0", "E1"))
        sm = SessionManager(store, clients, drain_timeout_s=10.0)
        s = await sm.open("S1")
        await s.generate({"input_ids": list(PROMPTS[0]), "sampling_params": greedy(4)})
        assert s.lora_path == a["lora_name"]

        code, rows, _ = cli("sessions", "--registry", registry)  # reads without the writer lock
        assert code == 0 and [(r["state"], r["bound"]) for r in rows] == [("OPEN", a["lora_name"])]
        code, st, _ = cli("status", "--registry", registry, cohort=cohort)
        assert code == 0
        assert st["registry"]["default"] == a["lora_name"] and st["registry"]["slots"] == "1/2"
        for eid in ("E0", "E1"):
            e = st["engines"][eid]
            assert e["consistent"] is True, e
            assert {v["lora_name"]: v["state"] for v in e["versions"]}[a["lora_name"]] == "READY_LOCAL"

        code, locked, _ = publish("B")
        assert code == 1 and locked["error"]["code"] == "REGISTRY_LOCKED" and locked["error"]["hint"], locked
        await sm.aclose()
        store.close()  # the trainer steps aside; the session stays OPEN on A in the registry

        # --- B is published (A retired, still referenced); C is refused with its hint
        code, b, _ = publish("B")
        assert code == 0 and b["outcome"] == "PUBLISHED", b
        code, c, _ = publish("C")
        assert code == 1 and c["outcome"] == "REFUSED" and c["error"]["code"] == "CAPACITY_ERROR", c
        code, nothing, _ = cli("reclaim", "--registry", registry, cohort=cohort)
        assert code == 0 and nothing == [], "A still has a session ref: nothing may be reclaimed"

        # --- the trainer closes the session (the session layer's two registry calls, RFC 4.3;
        # nothing is in flight), then the operator reclaims A, with progress
        with DurableRegistry.open(db, epoch, ("E0", "E1")) as store:
            store.begin_close(session_key=s.key)
            assert store.close_and_release(session_key=s.key).released
        text = subprocess.run(
            [sys.executable, "-m", "relax_glue.cli", "reclaim", "--registry", registry,
             "--engine", cohort[0], "--engine", cohort[1], "--admin-key", ADMIN_KEY],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert text.returncode == 0, text.stderr
        assert "unloaded" in text.stderr and a["lora_name"] in text.stdout, (text.stdout, text.stderr)
        code, st, _ = cli("status", "--registry", registry, cohort=cohort)
        states = {v["lora_name"]: v["state"] for v in st["registry"]["versions"]}
        assert states[a["lora_name"]] == "RECLAIMED" and states[b["lora_name"]] == "PUBLISHED (default)"
        assert all(
            {v["lora_name"]: v["state"] for v in st["engines"][e]["versions"]}[a["lora_name"]] == "UNLOADED"
            for e in ("E0", "E1")
        )
        code, none, _ = cli("resolve", "--registry", registry, cohort=cohort)
        assert code == 0 and none is None
    finally:
        left = await purge(clients, marker)
        await aclose_all(clients.values())
        assert not any(left.values()), left


def test_usage_errors_are_typed_and_exit_2(tmp_path: Path) -> None:
    code, out, _ = cli("status", cohort=["E0-no-url"])
    assert code == 2 and out["error"]["code"] == "USAGE"
    code, out, _ = cli("sessions", "--registry", f"sqlite:{tmp_path / 'missing.db'}")
    assert code == 1 and out["error"]["code"] == "REGISTRY_ERROR"
    code, out, _ = cli(
        "publish", str(tmp_path), "--version-id", "x", "--registry", f"sqlite:{tmp_path / 'n.db'}"
    )
    assert code == 2 and "epoch" in out["error"]["message"]


def test_the_engine_command_starts_a_cpu_engine_with_the_plugin_and_stops_it_on_interrupt(
    tmp_path: Path,
) -> None:
    import signal

    import httpx

    from lora_versions_dev.launcher import free_port

    port = free_port()
    log = tmp_path / "engine.log"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lora_versions_dev.cli",
            "engine",
            "--port",
            str(port),
            "--log",
            str(log),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        text, record = "", None
        assert p.stdout is not None
        for line in p.stdout:  # the record is printed once the engine is healthy
            text += line
            try:
                record = json.loads(text)
                break
            except json.JSONDecodeError:
                continue
        assert record is not None and record["url"] == f"http://127.0.0.1:{port}", (text, p.stderr)
        status = httpx.get(f"{record['url']}/lora_versions", timeout=10)
        assert status.status_code == 200 and status.json()["versions"] == []  # the plugin is on
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{record['url']}/health", timeout=5)
    finally:
        if p.poll() is None:
            p.kill()
