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
from lora_versions_dev.launcher import EngineSpec

# The admin API key every shared engine is started with (one definition for every suite).
ADMIN_KEY = "lora-versions-test-admin-key"
# A short body deadline so the stalled-upload test sees it fire (production default: 30 s).
BODY_IDLE_TIMEOUT_S = "5"
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
    from sglang_ext.engine_state import BODY_IDLE_TIMEOUT_ENV
    from sglang_ext.staging import LOCAL_SOURCE_DIR_ENV

    # One local source directory for both: two engines on one host, as a co-located trainer
    # would hand them buckets (tests/plugin_tests/test_publication_engines.py).
    env = {BODY_IDLE_TIMEOUT_ENV: BODY_IDLE_TIMEOUT_S, LOCAL_SOURCE_DIR_ENV: str(local_source_dir(run_dir))}
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
