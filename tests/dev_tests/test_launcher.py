"""The launcher fails loudly and leaves no process behind."""

from __future__ import annotations

import socket

import pytest

from lora_versions_dev import launcher
from lora_versions_dev.launcher import EngineSpec, EngineStartError


def test_engine_that_cannot_start_raises_with_log_tail_and_leaves_nothing(tmp_path):
    spec = EngineSpec(
        name="broken",
        model_path=tmp_path / "no-such-model",
        log_path=tmp_path / "broken.log",
        startup_timeout_s=180,
    )
    started: list[launcher.Engine] = []
    real_spawn = launcher.spawn_engine

    def spawn(s: EngineSpec) -> launcher.Engine:
        started.append(real_spawn(s))
        return started[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launcher, "spawn_engine", spawn)
        with pytest.raises(EngineStartError) as info:
            launcher.start_engine(spec)
    message = str(info.value)
    assert "exited with code" in message
    assert "no-such-model" in message  # the log tail names the cause
    assert len(message.splitlines()) <= launcher.LOG_TAIL_LINES + 2
    assert not launcher._group_alive(started[0].proc.pid)


def test_start_timeout_stops_the_whole_process_group(fixtures, tmp_path):
    spec = EngineSpec(
        name="slow", model_path=fixtures.model_dir, log_path=tmp_path / "slow.log", startup_timeout_s=4
    )
    engine = launcher.spawn_engine(spec)
    with pytest.raises(EngineStartError, match="not healthy after 4s"):
        try:
            engine.wait_healthy(spec.startup_timeout_s)
        finally:
            launcher.stop_engine(engine)
    assert not launcher._group_alive(engine.proc.pid)


def test_a_port_for_a_later_bind_is_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """An engine binds its port about a minute after it was picked; a port from the kernel's
    ephemeral range may meanwhile become some outgoing connection's source port (CI: "address
    already in use" at an engine's start). SGLang's own internal ports stay apart too."""
    low, _high = launcher.ephemeral_port_range()
    ports = [launcher.free_port() for _ in range(50)]
    assert all(launcher.LATE_BIND_PORTS[0] <= p < low for p in ports), ports
    assert all(p > 29999 for p in ports)  # SGLang's get_free_port_below_ephemeral: 22000-29999
    assert len(set(ports)) == len(ports)
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))  # free when handed out
