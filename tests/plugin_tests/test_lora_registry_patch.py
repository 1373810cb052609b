"""The one module that reads SGLang internals resolves all of them on the pinned version, and
names exactly what is missing when one is taken away (what a pin bump would hit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from sglang_ext import lora_registry_patch as upstream

PKG = Path(upstream.__file__).parent


def test_every_internal_resolves_on_the_pinned_sglang():
    assert upstream.surface_problems() == []


def test_a_missing_module_symbol_is_named(monkeypatch):
    import sglang.srt.managers.io_struct as io_struct

    monkeypatch.delattr(io_struct, "UnloadLoRAAdapterReqInput")
    problems = upstream.surface_problems()
    assert len(problems) == 1 and "sglang.srt.managers.io_struct.UnloadLoRAAdapterReqInput" in problems[0]


def test_a_missing_private_attribute_is_named(monkeypatch):
    from sglang.srt.lora.lora_registry import LoRARegistry

    real_init = LoRARegistry.__init__

    def init_without_counters(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        del self._counters

    monkeypatch.setattr(LoRARegistry, "__init__", init_without_counters)
    assert upstream.surface_problems() == ["LoRARegistry()._counters is missing"]


def test_a_missing_hook_target_and_method_are_named(monkeypatch):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    monkeypatch.delattr(TokenizerManager, "_release_lora_once")
    monkeypatch.delattr(TokenizerManager, "auto_create_handle_loop")
    problems = upstream.surface_problems()
    assert any(upstream.RELEASE_LORA_ONCE in p for p in problems), problems
    assert "TokenizerManager.auto_create_handle_loop is missing" in problems


def test_the_live_tokenizer_manager_is_checked_too():
    tm = SimpleNamespace(lora_registry=object())
    assert upstream.tokenizer_manager_problems(tm) == [
        "TokenizerManager.lora_ref_cache is missing",
        "TokenizerManager.model_config is missing",
        "TokenizerManager.update_lora_adapter_communicator is missing",
        "TokenizerManager.tokenizer is missing",
        "TokenizerManager.rid_to_state is missing",
    ]


def test_no_other_plugin_module_reads_sglang_internals():
    """The issue's rule, as a test: outside this module and plugin.py, no `sglang.` (the dev tools,
    which do read SGLang, live outside the plugin in lora_versions_dev)."""
    out = subprocess.run(
        ["grep", "-rn", "--include=*.py", r"sglang\.", str(PKG)], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    allowed = {"lora_registry_patch.py", "plugin.py"}
    offenders = [line for line in out if Path(line.split(":", 1)[0]).name not in allowed]
    assert offenders == []


def test_importing_the_module_imports_no_sglang():
    code = (
        "import sys, sglang_ext.lora_registry_patch; print(any(m.startswith('sglang.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_live_scheduler_is_checked_before_it_serves():
    """Scheduler instance attributes exist only on the live scheduler (set in __init__): each one
    the step fence reads is named when missing, none defaulted."""
    pool = SimpleNamespace(**dict.fromkeys(upstream.POOL_ATTRIBUTES))
    manager = SimpleNamespace(**{**dict.fromkeys(upstream.LORA_MANAGER_ATTRIBUTES), "memory_pool": pool})
    lora_side = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager))
    tp = dict(tp_group=SimpleNamespace(world_size=1), tp_cpu_group=None)
    renamed = SimpleNamespace(enable_overlap=False, last_batch=None, tp_worker=lora_side, **tp)
    assert upstream.scheduler_problems(renamed) == ["Scheduler.result_queue is missing"]
    assert upstream.scheduler_problems(SimpleNamespace(tp_worker=lora_side)) == [
        f"Scheduler.{a} is missing" for a in upstream.SCHEDULER_ATTRIBUTES
    ]
    # and the LoRAManager the prepared load reads (sglang_ext.prepared_load)
    problems = upstream.scheduler_problems(SimpleNamespace(**vars(renamed), result_queue=[]))
    assert problems == []
    del manager.num_pinned_loras
    assert upstream.scheduler_problems(renamed)[-1] == "LoRAManager.num_pinned_loras is missing"
    no_lora = SimpleNamespace(enable_overlap=False, last_batch=None, result_queue=[], tp_worker=None, **tp)
    assert upstream.scheduler_problems(no_lora)[0].startswith("Scheduler.tp_worker.model_runner.lora_manager")


def test_the_scheduler_init_is_a_scheduler_process_target():
    assert upstream.SCHEDULER_INIT in upstream.SCHEDULER_PROCESS_TARGETS


def test_a_missing_step_field_is_named(monkeypatch):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult

    monkeypatch.delitem(ScheduleBatch.__dataclass_fields__, "reqs")
    monkeypatch.delitem(GenerationBatchResult.__dataclass_fields__, "copy_done")
    assert upstream.surface_problems() == [
        "ScheduleBatch.reqs is missing",
        "GenerationBatchResult.copy_done is missing",
    ]


def test_a_request_without_lora_id_is_named(monkeypatch):
    from sglang.srt.managers.schedule_batch import Req

    real_init = Req.__init__

    def init_without_lora_id(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        del self.lora_id

    monkeypatch.setattr(Req, "__init__", init_without_lora_id)
    assert upstream.surface_problems() == ["Req().lora_id is missing"]


def test_the_reader_reads_real_step_objects():
    """launched_steps on the 0.5.23 step classes themselves (only the scheduler is a stand-in here;
    tests/plugin_tests/test_step_fence_engines.py reads a live one)."""
    from array import array
    from collections import deque

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.sampling.sampling_params import SamplingParams

    def req(rid: str, lora_id: str | None):
        return Req(rid, "", array("q"), SamplingParams(), lora_id=lora_id)

    queued = ScheduleBatch(reqs=[req("r1", "L1"), req("r2", None)])
    last = ScheduleBatch(reqs=[req("r3", "L2")])
    sched = SimpleNamespace(
        enable_overlap=True, last_batch=last, result_queue=deque([(queued, GenerationBatchResult())])
    )
    steps = upstream.launched_steps(sched)
    assert [(s.lora_ids, s.completion) for s in steps] == [(frozenset({"L1"}), None)]
    sched.enable_overlap, sched.result_queue = False, deque()
    assert [(s.lora_ids, s.completion) for s in upstream.launched_steps(sched)] == [(frozenset({"L2"}), True)]


def _upstream_copy_markers() -> list[tuple[int, list[str], str]]:
    """(line, the comment block, the def it stands over) for each "# Upstream copy:" block."""
    lines = (PKG / "lora_registry_patch.py").read_text().splitlines()
    markers = []
    for i, line in enumerate(lines):
        if line.startswith("# Upstream copy:"):
            end = next(j for j in range(i, len(lines)) if not lines[j].startswith("#"))
            markers.append((i + 1, lines[i:end], lines[end]))
    return markers


def test_every_upstream_body_copied_into_the_pin_module_names_its_source_and_what_it_changes():
    """Each copied body carries one block: the upstream function (module:qualname of the pinned
    version, resolvable in the installed SGLang), what the copy changes and why, right over its
    def. A pin bump then knows which bodies to diff against the new upstream."""
    import importlib
    import re

    markers = _upstream_copy_markers()
    copies = {"mount_metrics_route", "lru_lora_name_never_managed", "load_without_a_cache_flush"}
    copies |= {"unload_without_a_cache_flush", "adapter_builder", "install_prepared"}
    marked = {re.match(r"(?:async )?def (\w+)", d).group(1) for _, _, d in markers if "def " in d}
    assert marked == copies
    for line, block, _ in markers:
        text = " ".join(c.lstrip("# ") for c in block)
        assert "sglang 0.5.23" in text, line
        assert any(c.startswith("# Changed:") for c in block), line
        assert any(c.startswith("# Why:") for c in block), line
        for module, qualname in re.findall(r"(sglang(?:\.\w+)+):([\w.]+\w)", text):
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)  # a marker naming a function that is gone fails here
