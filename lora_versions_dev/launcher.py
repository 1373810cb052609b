"""Start and stop real ``sglang.launch_server`` processes (tests, demo, benchmarks).

Each engine runs in its own process group on a free loopback port, with its log in a file. Stop
kills exactly that process group (never a broad ``pkill``). A start that fails raises
:class:`EngineStartError` with the tail of the engine log and leaves no process behind.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lora_versions_dev import cpu
from sglang_ext.settings import PLUGIN_SWITCH_ENV
from sglang_ext.setup_checks import MIN_LORAS_PER_BATCH

# LoRA slots of a development engine: K = 4 managed versions plus the free slot SGLang keeps,
# so one engine serves an epoch of any capacity up to 4 (the RFC's K = 2 and issue 27's K = 4);
# the minimum an engine accepts is setup_checks.MIN_LORAS_PER_BATCH.
DEV_LORA_SLOTS = 5


def lora_flags(
    max_lora_rank: int = 8, backend: str | None = None, slots: int = DEV_LORA_SLOTS
) -> tuple[str, ...]:
    """LoRA on, room for ``slots - 1`` pinned managed versions plus one free slot, every
    linear module."""
    flags = (
        "--enable-lora",
        "--max-loras-per-batch",
        str(slots),
        "--max-loaded-loras",
        str(slots),
        "--max-lora-rank",
        str(max_lora_rank),
        "--lora-target-modules",
        "all",
    )
    return flags + (("--lora-backend", backend) if backend else ())


LORA_FLAGS: tuple[str, ...] = lora_flags()
COMMON_FLAGS: tuple[str, ...] = (
    "--skip-server-warmup",
    "--log-level",
    "info",
    # An idle scheduler otherwise busy-polls (~35% of a core each); on 2 cores that starves the rest.
    "--sleep-on-idle",
)

LOG_TAIL_LINES = 40


class EngineStartError(RuntimeError):
    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # the engine's own, when it exited during start-up


@dataclass
class EngineSpec:
    name: str
    model_path: Path
    log_path: Path
    plugin: bool = True
    cpu_dev: bool = True
    lora_flags: Sequence[str] = LORA_FLAGS
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None
    startup_timeout_s: float = 240.0
    # The overlap scheduler needs a GPU and the plugin refuses it; True only to test that refusal.
    overlap_schedule: bool = False
    # Replaces ``python -m sglang.launch_server`` (e.g. a wrapper script used by a test).
    command_prefix: Sequence[str] | None = None
    # fp32 on CPU (the fixtures are fp32 and the tests compare logprobs with epsilon 0);
    # bfloat16 for the GPU acceptance profile (lora_versions_dev.device_profile).
    dtype: str = "float32"
    # Tensor-parallel ranks (``--tp-size``); on CPU each rank gets its share of the cores
    # (lora_versions_dev.cpu.tp_env: SGLang refuses more ranks than NUMA nodes without it).
    tp: int = 1


# Ports that a child process binds only later (an engine binds its HTTP port about a minute after
# its launch) are drawn below the kernel's ephemeral range: bind(0) and every outgoing connection
# draw from that range, so a port picked there can be handed to some client socket meanwhile
# (seen in CI: "[Errno 98] address already in use" at an engine's start). And above SGLang's own
# pick for its internal ports (sglang.srt.utils.network.get_free_port_below_ephemeral, 22000-29999).
LATE_BIND_PORTS = (30000, 32767)
_handed_out: set[int] = set()  # never the same port twice from one process
_pick = random.SystemRandom()  # not the (often seeded) global generator: two processes would agree


def ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(attempts: int = 64) -> int:
    """A port free now, for a process that binds it later (see LATE_BIND_PORTS)."""
    low, high = LATE_BIND_PORTS[0], min(LATE_BIND_PORTS[1], ephemeral_port_range()[0] - 1)
    candidates = [p for p in range(low, high + 1) if p not in _handed_out]
    for port in _pick.sample(candidates, min(attempts, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a host with a narrow range
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


class Engine:
    """One running engine. Use :func:`start_engine` or :func:`start_engines`."""

    def __init__(self, spec: EngineSpec, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self.port = port
        self.proc = proc
        self.started_s: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return tail(self.spec.log_path, lines)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise EngineStartError(
                        f"engine {self.name} exited with code {self.proc.returncode} during start-up; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}",
                        exit_code=self.proc.returncode,
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.5)
        raise EngineStartError(
            f"engine {self.name} not healthy after {timeout_s:.0f}s; last lines of {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop this engine's own process group; returns the exit code of the launcher process."""
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            _kill_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
            deadline = time.monotonic() + grace_s
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(self.proc.pid):
                _kill_group(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        return self.proc.returncode

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build_command(spec: EngineSpec, port: int) -> list[str]:
    prefix = list(spec.command_prefix or (sys.executable, "-m", "sglang.launch_server"))
    cmd = [*prefix, "--model-path", str(spec.model_path)]
    if spec.cpu_dev:
        cmd += cpu.ENGINE_FLAGS
    cmd += ["--dtype", spec.dtype, *COMMON_FLAGS]
    if not spec.overlap_schedule:
        cmd.append("--disable-overlap-schedule")
    cmd += spec.lora_flags
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if spec.tp > 1:
        cmd += ["--tp-size", str(spec.tp)]
    cmd += spec.extra_args
    return cmd


def gpu_launch_command(
    model: str | Path,
    *,
    port: int = 30000,
    host: str = "0.0.0.0",
    max_lora_rank: int = 64,
    tp_size: int = 1,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The launch line for a CUDA host, run with ``SGLANG_LORA_VERSIONS=1`` in the environment
    (never ``SGLANG_EXT_CPU_DEV``). Not run here: no machine of ours has a GPU.

    What the plugin requires and why: LoRA on, room for two pinned managed versions plus one
    free slot (``--max-loras-per-batch`` and ``--max-loaded-loras`` 3 or more), the overlap
    scheduler off (the deferred-free hazard is not proven closed on GPU), one node (``tp_size``
    GPUs of it), one tokenizer worker; it refuses to start otherwise. ``--enable-metrics`` adds
    the plugin's series to ``/metrics``; add ``--admin-api-key`` to guard the control routes."""
    return [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        *lora_flags(max_lora_rank, slots=MIN_LORAS_PER_BATCH),  # the RFC's K = 2; K + 1 for more
        "--disable-overlap-schedule",
        "--enable-metrics",
        "--host",
        host,
        "--port",
        str(port),
        *(["--tp-size", str(tp_size)] if tp_size > 1 else []),
        *extra_args,
    ]


def build_env(spec: EngineSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(PLUGIN_SWITCH_ENV, None)
    if spec.cpu_dev:
        env = cpu.engine_env(env)
    if spec.plugin:
        env[PLUGIN_SWITCH_ENV] = "1"
    if spec.cpu_dev:
        env.update(cpu.tp_env(spec.tp))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(spec.env)
    return env


def spawn_engine(spec: EngineSpec) -> Engine:
    """Start the process and return at once (not yet healthy)."""
    port = spec.port or free_port()
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "wb") as log:
        proc = subprocess.Popen(
            build_command(spec, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=build_env(spec),
            start_new_session=True,  # own process group: stop() kills exactly this engine
        )
    engine = Engine(spec, port, proc)
    _LIVE.add(engine)
    return engine


def start_engine(spec: EngineSpec) -> Engine:
    t0 = time.monotonic()
    engine = spawn_engine(spec)
    try:
        engine.wait_healthy(spec.startup_timeout_s)
    except BaseException:
        engine.stop()
        _LIVE.discard(engine)
        raise
    engine.started_s = time.monotonic() - t0
    return engine


def shared_gpus(specs: Sequence[EngineSpec]) -> list[list[int]]:
    """The specs (by index) that share a GPU, in groups, each in its given order: engines on CUDA
    whose ``CUDA_VISIBLE_DEVICES`` overlap. Every other spec is a group of its own. SGLang sizes an
    engine's KV pool from the device's free memory at its baseline and after its weights load,
    and refuses to start when the second is under baseline x (1 - mem_fraction_static): a
    neighbour on the same GPU loading its weights and pool in between counts as this engine's
    own. On CPU the fraction is set wide enough instead (cpu.CPU_MEM_FRACTION_STATIC): the pool is
    capped by --max-total-tokens there, so the engines may boot together."""
    groups: list[list[int]] = []
    devices: list[set[str]] = []
    for i, spec in enumerate(specs):
        mine = _gpus_of(spec)
        overlapping = [g for g, ds in enumerate(devices) if mine and ds and ("*" in ds | mine or ds & mine)]
        merged = [i]
        for g in reversed(overlapping):
            merged = groups.pop(g) + merged
            mine |= devices.pop(g)
        groups.append(sorted(merged))
        devices.append(mine)
    return groups


def _gpus_of(spec: EngineSpec) -> set[str]:
    """The GPUs an engine may use: none on CPU; ``{"*"}`` (every one) when nothing narrows them."""
    if spec.cpu_dev:
        return set()
    visible = spec.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    return {d.strip() for d in visible.split(",") if d.strip()} if visible else {"*"}


def _start_one_after_another(specs: Sequence[EngineSpec]) -> list[Engine]:
    started: list[Engine] = []
    try:
        for spec in specs:
            started.append(start_engine(spec))
    except BaseException:
        stop_engines(started)
        raise
    return started


def start_engines(specs: Sequence[EngineSpec]) -> list[Engine]:
    """Start several engines in parallel, but those that share a GPU one after another
    (:func:`shared_gpus`); all or nothing. Returned in the order of ``specs``."""
    groups = shared_gpus(specs)
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as pool:
        futures = [pool.submit(_start_one_after_another, [specs[i] for i in g]) for g in groups]
        started: dict[int, Engine] = {}
        errors = []
        for group, f in zip(groups, futures, strict=True):
            try:
                started.update(zip(group, f.result(), strict=True))
            except Exception as e:
                errors.append(e)
    if errors:
        stop_engines(list(started.values()))
        raise errors[0]
    return [started[i] for i in range(len(specs))]


def stop_engine(engine: Engine) -> int | None:
    code = engine.stop()
    _LIVE.discard(engine)
    return code


@contextlib.contextmanager
def running_engines(specs: Sequence[EngineSpec]) -> Iterator[list[Engine]]:
    engines = start_engines(specs)
    try:
        yield engines
    finally:
        stop_engines(engines)


def stop_engines(engines: Sequence[Engine]) -> None:
    """Stop several engines in parallel (each SGLang engine takes seconds to wind down)."""
    if engines:
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            list(pool.map(stop_engine, engines))


class _LiveEngines:
    """Engines started by this process, stopped at interpreter exit if the caller forgot."""

    def __init__(self) -> None:
        self._engines: set[Engine] = set()
        self._lock = threading.Lock()

    def add(self, e: Engine) -> None:
        with self._lock:
            self._engines.add(e)

    def discard(self, e: Engine) -> None:
        with self._lock:
            self._engines.discard(e)

    def stop_all(self) -> None:
        with self._lock:
            engines = list(self._engines)
        for e in engines:
            e.stop(grace_s=5.0)


_LIVE = _LiveEngines()

atexit.register(_LIVE.stop_all)


def refused_launches(specs: Sequence[EngineSpec], timeout_s: float = 120.0) -> dict[str, int | None]:
    """Launch each spec, expecting the plugin to refuse it at start, in one process that imports
    SGLang once and forks a launch per spec (``lora_versions_dev.forked_launches``). Specs may
    differ in their flags, in a wrapper script (``command_prefix``: the Python running it, then
    the script) and in their own ``env`` (set in the child: variables a wrapper reads when it runs,
    not at import); everything else of the environment is shared. Returns each spec's exit code
    by name (None: it was still starting at ``timeout_s``, and was killed)."""
    import json
    import tempfile

    assert specs, "nothing to launch"
    shared = [build_env(dataclasses.replace(s, env={})) for s in specs]
    assert all(e == shared[0] for e in shared), "forked launches share one environment"
    launches = []
    for s in specs:
        prefix = s.command_prefix or (sys.executable, "-m", "sglang.launch_server")
        assert s.command_prefix is None or (len(prefix) == 2 and prefix[0] == sys.executable), (
            f"{s.name}: a forked launch's wrapper is a Python script run by this interpreter"
        )
        argv = build_command(s, s.port or free_port())[len(prefix) :]
        s.log_path.parent.mkdir(parents=True, exist_ok=True)
        launch: dict = {"argv": argv, "log": str(s.log_path), "timeout_s": timeout_s, "env": dict(s.env)}
        if s.command_prefix is not None:
            launch["wrapper"] = str(prefix[1])
        launches.append(launch)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "lora_versions_dev.forked_launches", f.name],
            env=shared[0],
            capture_output=True,
            text=True,
            timeout=60 + len(specs) * (timeout_s + 10),
            start_new_session=True,
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise EngineStartError(f"the forked launcher failed ({out.returncode}):\n{out.stderr[-3000:]}")
    codes = {r["log"]: r["exit_code"] for r in map(json.loads, out.stdout.splitlines())}
    return {s.name: codes[str(s.log_path)] for s in specs}
