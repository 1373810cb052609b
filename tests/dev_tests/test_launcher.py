"""The launcher fails loudly and leaves no process behind."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

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


def _gpu_spec(name: str, gpus: str | None, *, cpu_dev: bool = False) -> EngineSpec:
    env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}
    return EngineSpec(name=name, model_path=Path("m"), log_path=Path(f"{name}.log"), cpu_dev=cpu_dev, env=env)


def test_engines_that_share_a_gpu_are_grouped_to_start_one_after_another(monkeypatch) -> None:
    """SGLang sizes an engine's KV pool from its device's free memory before and after its load:
    a neighbour on the same GPU booting in between counts as its own (it refuses to start, or
    sizes its pool wrong). CPU engines are never grouped (their pool is capped by
    --max-total-tokens and their fraction leaves room), nor engines on separate GPUs."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    g = launcher.shared_gpus
    # the acceptance profile's four engines on one GPU, and on two
    assert g([_gpu_spec(n, "0") for n in "abcd"]) == [[0, 1, 2, 3]]
    assert g([_gpu_spec(n, str(i % 2)) for i, n in enumerate("abcd")]) == [[0, 2], [1, 3]]
    # TP = 2 on GPUs 0,1 shares with an engine on 1, and joins the two groups it overlaps
    assert g([_gpu_spec("a", "0"), _gpu_spec("b", "1"), _gpu_spec("c", "2"), _gpu_spec("d", "0,1")]) == [
        [2],
        [0, 1, 3],
    ]
    assert g([_gpu_spec(n, None) for n in "ab"]) == [[0, 1]]  # nothing narrows them: every GPU
    assert g([_gpu_spec("a", None), _gpu_spec("b", "3")]) == [[0, 1]]
    assert g([_gpu_spec(n, "0", cpu_dev=True) for n in "ab"]) == [[0], [1]]


def test_start_engines_starts_gpu_sharers_one_at_a_time_and_the_rest_together(monkeypatch) -> None:
    """The real start_engines over a recording start_engine: engines on one GPU never boot at the
    same time (each one healthy before the next is spawned), engines on separate GPUs do (a
    barrier both must reach at once), and the result keeps the order asked."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs = [_gpu_spec("a", "0"), _gpu_spec("b", "1"), _gpu_spec("c", "0"), _gpu_spec("d", "1")]
    both_gpus_at_once = threading.Barrier(2, timeout=10)
    lock, booting, overlaps = threading.Lock(), set(), []

    def recording_start(spec):
        with lock:
            mine = {specs[i].env["CUDA_VISIBLE_DEVICES"] for i, s in enumerate(specs) if s.name in booting}
            if spec.env["CUDA_VISIBLE_DEVICES"] in mine:
                overlaps.append(spec.name)
            booting.add(spec.name)
        if spec.name in ("a", "b"):
            both_gpus_at_once.wait()  # raises if the two GPUs' first engines were serialised
        time.sleep(0.05)
        with lock:
            booting.discard(spec.name)
        return spec.name

    monkeypatch.setattr(launcher, "start_engine", recording_start)
    assert launcher.start_engines(specs) == ["a", "b", "c", "d"]
    assert overlaps == []
