"""The engines every test suite shares (``tests/`` and, on CPU, ``gpu_tests/``): started once per
session, in parallel, and reused by every test that needs no fresh or special engine. A test
that does (a restart, a wrapper, another model) starts its own.

- ``E0``, ``E1``: plugin on, guarded like a deployment (control routes need :data:`ADMIN_KEY`),
  ``/metrics`` served, a short body deadline and one local source directory. ``E1`` can run
  through a wrapper (the acceptance suite's step-fence probe), which only adds log lines.
- ``stock``: plugin off, adapters ``A`` and ``B`` loaded at start through SGLang's own
  ``--lora-paths``: the clean baselines (SGLang keys its prefix cache by ``lora_id``, so one stock
  engine serves both baselines apart).
"""

from __future__ import annotations

import atexit
import shutil
from collections.abc import Sequence
from pathlib import Path

from lora_versions_dev.fixtures import Fixtures
from lora_versions_dev.launcher import Engine, EngineSpec

# The admin API key every shared engine is started with (one definition for every suite).
ADMIN_KEY = "lora-versions-test-admin-key"
# A short body deadline so the stalled-upload test sees it fire (production default: 30 s).
BODY_IDLE_SECONDS = "5"
BASELINE_ADAPTERS = ("A", "B")
# The prompt the engine tests and benches send: "The quick brown" in the fixture tokenizer.
PROMPT = [302, 356, 417, 494, 439]


def local_source_dir(run_dir: Path) -> Path:
    """The local source directory E0/E1 read handed-over buckets from: on the engines' staging
    filesystem (``/dev/shm`` here), so a file can be taken over, not copied."""
    from sglang_ext.staging import default_staging_base

    path = default_staging_base() / f"lora-versions-test-source-{run_dir.name}"
    if not path.exists():
        path.mkdir()
        atexit.register(shutil.rmtree, path, True)
    return path


def farm_specs(
    fixtures: Fixtures, run_dir: Path, *, e1_command_prefix: Sequence[str] | None = None
) -> list[EngineSpec]:
    from sglang_ext.settings import BODY_IDLE_TIMEOUT_S
    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    # One local source directory for both: two engines on one host, as a co-located trainer
    # would hand them buckets (tests/plugin_tests/test_publication_engines.py).
    env = {BODY_IDLE_TIMEOUT_S.env: BODY_IDLE_SECONDS, LOCAL_SOURCE_DIR_ENV: str(local_source_dir(run_dir))}
    managed = [
        EngineSpec(
            name=n,
            model_path=fixtures.model_dir,
            log_path=run_dir / f"{n}.log",
            extra_args=["--admin-api-key", ADMIN_KEY, "--enable-metrics"],
            env=env,
            command_prefix=e1_command_prefix if n == "E1" else None,
        )
        for n in ("E0", "E1")
    ]
    baselines = [f"{n}={fixtures.adapter_dir(n)}" for n in BASELINE_ADAPTERS]
    stock = EngineSpec(
        name="stock",
        model_path=fixtures.model_dir,
        log_path=run_dir / "stock.log",
        plugin=False,
        extra_args=["--lora-paths", *baselines],
    )
    return [*managed, stock]


class SpareEngine:
    """A plugin engine beside the farm that tests may stop, SIGKILL and start again on its port
    (the restart tests of several modules): one per session, spawned ahead of its first use (the
    test session's lora_versions_dev.prestart), so that it boots while other tests run. Whoever
    restarts it puts the new process in
    :attr:`engine`; :meth:`take` hands it to the next test with nothing an earlier one left."""

    def __init__(
        self,
        fixtures: Fixtures,
        run_dir: Path,
        name: str = "spare",
        *,
        tp: int = 1,
        command_prefix: Sequence[str] | None = None,
        source_dir: Path | None = None,
    ) -> None:
        from lora_versions_dev.launcher import spawn_engine

        self.fixtures, self.run_dir, self.name = fixtures, run_dir, name
        # tp > 1: a tensor-parallel engine, each rank bound to its cores (issue 38);
        # command_prefix: a wrapper launch (e.g. E1's scheduler probes); source_dir: its local
        # source directory (the probes' trigger files live beside it)
        self.tp, self.command_prefix, self.source_dir = tp, command_prefix, source_dir
        self.starts = 0
        self.engine = spawn_engine(self.spec())

    def spec(self, port: int | None = None, tag: str = "") -> EngineSpec:
        """The spare's spec; ``port`` for a restart on the same port, ``tag`` names its log."""
        from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

        self.starts += 1
        return EngineSpec(
            name=self.name,
            model_path=self.fixtures.model_dir,
            log_path=self.run_dir / f"{self.name}.{self.starts}{tag}.log",
            extra_args=["--admin-api-key", ADMIN_KEY],
            env={LOCAL_SOURCE_DIR_ENV: str(self.source_dir)} if self.source_dir is not None else {},
            port=port,
            command_prefix=self.command_prefix,
            tp=self.tp,
        )

    def take(self, timeout_s: float = 300.0) -> Engine:
        """The running spare once it serves, every managed version of an earlier user removed
        through its own protocol (lora_versions_dev.teardown.purge)."""
        import asyncio

        from lora_versions_dev.teardown import purge
        from relax_glue.engine_client import EngineClient

        engine = self.engine
        engine.wait_healthy(timeout_s)

        async def clean() -> dict[str, list[str]]:
            client = EngineClient(self.name, engine.url, admin_key=ADMIN_KEY)
            try:
                return await purge({self.name: client}, marker="")
            finally:
                await client.aclose()

        left = asyncio.run(clean())
        assert not left, f"the spare engine still holds {left} after the purge"
        return engine

    def stop(self) -> None:
        from lora_versions_dev.launcher import stop_engine

        stop_engine(self.engine)
