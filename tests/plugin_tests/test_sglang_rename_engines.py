"""Issue 36 on real engines: an SGLang whose field the guards read was renamed (what a pin bump
that forgot the pin module looks like) is refused at start, naming the field, instead of serving
with a guard switched off. One field of each way the start check reads them: an attribute the
request normalisation sets (read by the parallel-sampling guards; checked at plugin load, before
SGLang spawns anything) and one of the live TokenizerManager (``rid_to_state``, read by the abort
of a parallel request; checked when the HTTP server is set up, after the scheduler is ready).
tests/plugin_tests/test_sglang_renames_refuse_the_start.py takes every field away, one at a time,
without an engine.

Both launches are forked from one process that imported SGLang once (``launcher.refused_launches``):
each child runs the wrapper as ``__main__``, which renames its field and runs the real
``sglang.launch_server``, as the command line would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lora_versions_dev import prestart
from lora_versions_dev.launcher import EngineSpec, refused_launches
from sglang_ext.plugin_log import REFUSED_EXIT_CODE

pytestmark = pytest.mark.engine

WRAPPER = Path(__file__).parents[1] / "engine_wrappers" / "sglang_with_a_renamed_field.py"

RENAMED = {
    "GenerateReqInput.parallel_sample_num": (
        "GenerateReqInput().parallel_sample_num is missing after normalize_batch_and_arguments"
    ),
    "TokenizerManager.rid_to_state": "TokenizerManager.rid_to_state is missing",
}


@pytest.fixture(scope="module")
def renamed_starts(fixtures, run_dir, prestarts) -> dict[str, tuple[int | None, EngineSpec]]:
    """Each renamed field: (the exit code, None if it was still starting at the timeout; the spec),
    launched ahead of their first use, in the background (lora_versions_dev.prestart)."""
    return prestart.take(prestarts, "renamed_starts", fixtures, run_dir)


@prestart.prestartable("renamed_starts")
def _launch_renamed(fixtures, run_dir) -> dict[str, tuple[int | None, EngineSpec]]:
    specs = {
        renamed: EngineSpec(
            name=f"renamed-{renamed.replace('.', '-')}",
            model_path=fixtures.model_dir,
            log_path=run_dir / f"renamed-{renamed.replace('.', '-')}.log",
            env={"LORA_VERSIONS_RENAMED": renamed},
            command_prefix=[sys.executable, str(WRAPPER)],
        )
        for renamed in sorted(RENAMED)
    }
    codes = refused_launches(list(specs.values()))
    return {renamed: (codes[spec.name], spec) for renamed, spec in specs.items()}


@pytest.mark.parametrize("renamed", sorted(RENAMED))
def test_an_engine_whose_sglang_renamed_a_guarded_field_refuses_to_start(renamed_starts, renamed):
    code, spec = renamed_starts[renamed]
    assert code is not None, f"the engine was still starting with {renamed} renamed (never refused)"
    log = spec.log_path.read_text()
    refused = [ln for ln in log.splitlines() if "[lora-versions] REFUSED TO START" in ln]
    assert len(refused) == 1 and RENAMED[renamed] in refused[0], refused
    assert code == REFUSED_EXIT_CODE, f"exited with {code}"
