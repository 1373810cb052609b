"""No device-wide cache flush around a load or an unload (issue 29). SGLang 0.5.23's
LoRAManager.load_lora_adapter / unload_lora_adapter each log two lines whose memory figure comes
from get_available_gpu_memory(), which on CUDA first runs torch.cuda.empty_cache(): two flushes
on the scheduler thread per load and per unload. The plugin's replacements log the same lines
without them. The call sites are device-independent, so the flushes are counted here, on CPU,
through upstream's own get_available_gpu_memory with CUDA's memory queries stubbed."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_ext import lora_registry_patch as upstream


@pytest.fixture
def cuda_stubs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every flush or device-wide synchronise upstream's memory read would run, recorded."""
    from sglang.srt.utils import common

    calls: list[str] = []
    monkeypatch.setattr(common, "empty_device_cache", lambda mod: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(is_integrated=False))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (8 << 30, 16 << 30))
    return calls


class Manager:
    """A LoRAManager's surface these methods touch: its device and the two private workers."""

    device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.done: list[tuple[str, Any]] = []

    def _load_lora_adapter(self, ref: Any) -> str:
        self.done.append(("load", ref))
        return "loaded"

    def _unload_lora_adapter(self, ref: Any) -> str:
        self.done.append(("unload", ref))
        return "unloaded"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sglang.srt.lora.lora_manager"]


def test_upstream_flushes_twice_per_load_and_unload_and_the_plugin_never(cuda_stubs, caplog) -> None:
    from sglang.srt.lora.lora_manager import LoRAManager

    caplog.set_level(logging.INFO, logger="sglang.srt.lora.lora_manager")
    m = Manager()
    assert LoRAManager.load_lora_adapter(m, "ref-A") == "loaded"
    assert LoRAManager.unload_lora_adapter(m, "ref-A") == "unloaded"
    assert cuda_stubs == ["empty_cache"] * 4  # what a GPU pays today, on the scheduler thread
    stock_lines = _lines(caplog)

    cuda_stubs.clear()
    caplog.clear()
    assert upstream.load_without_a_cache_flush(m, "ref-A") == "loaded"
    assert upstream.unload_without_a_cache_flush(m, "ref-A") == "unloaded"
    assert cuda_stubs == []
    assert _lines(caplog) == stock_lines  # the same four lines, word for word (tests read them)
    assert m.done == [("load", "ref-A"), ("unload", "ref-A")] * 2


def test_the_scheduler_process_replaces_both_and_checks_they_are_applied(monkeypatch) -> None:
    from sglang_ext import hooks, prepared_load

    registered: list[tuple[str, Any, str]] = []
    monkeypatch.setattr(upstream, "register_hook", lambda t, h, k: registered.append((t, h, k)))
    hooks.register_all("scheduler")
    # through the prepared load's replacements, which call these two (test_prepared_load.py)
    load = prepared_load.load_installing_what_was_prepared
    assert (upstream.LORA_MANAGER_LOAD, load, "REPLACE") in registered
    unload = prepared_load.unload_releasing_off_the_loop
    assert (upstream.LORA_MANAGER_UNLOAD, unload, "REPLACE") in registered
    # an unapplied one refuses the scheduler's start like the fence's own (step_fence)
    replaced = {upstream.LORA_MANAGER_LOAD, upstream.LORA_MANAGER_UNLOAD}
    assert replaced <= set(upstream.SCHEDULER_PROCESS_TARGETS)
