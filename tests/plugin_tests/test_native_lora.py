"""NativeLora's partial-load path against a stand-in tokenizer manager that answers like SGLang's
scheduler fan-out (real ``LoRAUpdateOutput`` replies merged by SGLang's own merge function)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext.native_lora import NativeLora

NAME = "p@e-v-aaaaaaaaaaaa"


def tm_answering(*replies):
    from sglang.srt.managers.io_struct import LoRAUpdateOutput

    queue = [[LoRAUpdateOutput(**r) for r in rank_replies] for rank_replies in replies]
    sent = []

    async def communicator(req):
        sent.append(type(req).__name__)
        return queue.pop(0)

    tm = SimpleNamespace(
        auto_create_handle_loop=lambda: None,
        update_lora_adapter_communicator=communicator,
        lora_registry=SimpleNamespace(_counters={}),
    )
    return tm, sent


async def test_a_partial_load_whose_undo_fails_names_its_leftover():
    tm, sent = tm_answering(
        [{"success": False, "error_message": "rank 1 failed", "loaded_adapters": {NAME: "__tensor__"}}],
        [{"success": False, "error_message": "unload failed"}],
    )
    with pytest.raises(LoraVersionError) as info:
        await NativeLora(tm).load_pinned(NAME, Path("/nonexistent/adapter"))
    assert info.value.code is ErrorCode.LOAD_FAILED and info.value.details["leftover_lora_id"]
    assert sent == ["LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput"]


async def test_a_partial_load_that_is_taken_back_leaves_nothing():
    tm, sent = tm_answering(
        [{"success": False, "error_message": "rank 1 failed", "loaded_adapters": {NAME: "__tensor__"}}],
        [{"success": True, "error_message": ""}],
    )
    with pytest.raises(LoraVersionError) as info:
        await NativeLora(tm).load_pinned(NAME, Path("/nonexistent/adapter"))
    assert info.value.code is ErrorCode.LOAD_FAILED and "leftover_lora_id" not in info.value.details
    assert sent == ["LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput"]


async def test_finished_unloads_are_not_remembered_per_id():
    """The unload task of an id lives while it runs (racing callers share it), not for the
    engine's life: ids are per load, so finished entries would grow with history. A failed
    unload leaves nothing behind either: the next call tries again."""
    ids = [f"id{i}" for i in range(5)]
    tm, sent = tm_answering(
        *([{"success": True, "error_message": ""}] for _ in ids),
        [{"success": False, "error_message": "scheduler said no"}],
        [{"success": True, "error_message": ""}],
    )
    native = NativeLora(tm)
    for lora_id in ids:
        await native.physical_unload(NAME, lora_id)
    assert native._unloads == {} and len(sent) == 5
    with pytest.raises(LoraVersionError):
        await native.physical_unload(NAME, "id-x")
    assert native._unloads == {}
    await native.physical_unload(NAME, "id-x")
    assert native._unloads == {} and len(sent) == 7
