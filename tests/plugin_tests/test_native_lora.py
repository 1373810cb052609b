"""NativeLora's load (prepared off the scheduler thread, then installed) and its partial-load
path, against a stand-in tokenizer manager that answers like SGLang's scheduler fan-out (real
``LoRAUpdateOutput`` replies merged by SGLang's own merge function)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext.native_lora import NativeLora
from sglang_ext.prepared_load import PENDING_MESSAGE, op_of

NAME = "p@e-v-aaaaaaaaaaaa"


def tm_answering(*replies):
    from sglang.srt.managers.io_struct import LoRAUpdateOutput

    queue = [[LoRAUpdateOutput(**r) for r in rank_replies] for rank_replies in replies]
    sent = []

    async def communicator(req):
        op = op_of(getattr(req, "rid", None), req.lora_name)
        sent.append(op.value if op else type(req).__name__)
        return queue.pop(0)

    tm = SimpleNamespace(
        auto_create_handle_loop=lambda: None,
        update_lora_adapter_communicator=communicator,
        lora_registry=SimpleNamespace(_counters={}),
    )
    return tm, sent


OK = {"success": True, "error_message": ""}
PENDING = {"success": False, "error_message": PENDING_MESSAGE}
PREPARED = ([OK], [OK])  # the prepare and the first poll


async def test_a_partial_load_names_its_leftover_and_unloads_nothing_itself():
    """Some rank loaded it, the load failed: the id (never registered) is named for the caller,
    whose removal (removal.remove_version) asks may_unload_now first. No unload here: it
    was a second door to an unload, past the rule."""
    tm, sent = tm_answering(
        *PREPARED,
        [{"success": False, "error_message": "rank 1 failed", "loaded_adapters": {NAME: "__tensor__"}}],
        [OK],
    )
    with pytest.raises(LoraVersionError) as info:
        await NativeLora(tm).load_pinned(NAME, Path("/nonexistent/adapter"))
    assert info.value.code is ErrorCode.LOAD_FAILED and info.value.details["leftover_lora_id"]
    assert sent == ["prepare", "poll", "install", "discard"]
    assert tm.lora_registry._counters == {}, "never registered: no request could hold it"


async def test_a_load_no_rank_took_names_no_leftover():
    tm, sent = tm_answering(*PREPARED, [{"success": False, "error_message": "rank 0 failed"}], [OK])
    with pytest.raises(LoraVersionError) as info:
        await NativeLora(tm).load_pinned(NAME, Path("/nonexistent/adapter"))
    assert info.value.code is ErrorCode.LOAD_FAILED and "leftover_lora_id" not in info.value.details
    assert sent == ["prepare", "poll", "install", "discard"]


async def test_a_load_is_prepared_polled_until_every_rank_has_it_then_installed():
    tm, sent = tm_answering(
        [OK, OK],
        [PENDING, PENDING],
        [OK, PENDING],
        [OK, OK],
        [OK, OK],  # the install: every rank took its preparation, nothing is left to drop
    )
    tm.lora_registry = SimpleNamespace(_counters={}, registered=[])

    async def register(ref):
        tm.lora_registry.registered.append(ref)

    tm.lora_registry.register = register
    lora_id = await NativeLora(tm).load_pinned(NAME, Path("/staged/attempt-0"))
    assert sent == ["prepare", "poll", "poll", "poll", "install"]
    (ref,) = tm.lora_registry.registered
    assert ref.lora_id == lora_id and ref.pinned and ref.lora_name == NAME


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("[Errno 2] No such file or directory: 'bucket-00000.safetensors'", ErrorCode.LOAD_FAILED),
        ("... DoRA adapters", ErrorCode.INCOMPATIBLE_ADAPTER),
    ],
)
async def test_a_rank_that_fails_its_preparation_fails_the_load_and_every_rank_discards(message, code):
    tm, sent = tm_answering(
        [OK, OK],
        [PENDING, {"success": False, "error_message": message}],
        [OK, OK],  # the discard
    )
    with pytest.raises(LoraVersionError) as info:
        await NativeLora(tm).load_pinned(NAME, Path("/staged/attempt-0"))
    assert info.value.code is code and message in str(info.value)
    assert sent == ["prepare", "poll", "discard"], "never installed; what was prepared is dropped"


async def test_a_refused_prepare_is_discarded_too():
    refused = {"success": False, "error_message": "lora_id x is already being prepared"}
    tm, sent = tm_answering([refused], [OK])
    with pytest.raises(LoraVersionError) as info:
        await NativeLora(tm).load_pinned(NAME, Path("/staged/attempt-0"))
    assert info.value.code is ErrorCode.LOAD_FAILED
    assert sent == ["prepare", "discard"]


async def test_a_load_cancelled_during_its_install_discards_every_preparation():
    """The discard is skipped only after an install every rank answered: a load cancelled while
    its install is in flight (the rank may not have taken it yet) still drops what it prepared."""
    import asyncio

    tm, sent = tm_answering(*PREPARED, [OK])
    answer = tm.update_lora_adapter_communicator
    installing = asyncio.Event()

    async def communicator(req):
        if op_of(getattr(req, "rid", None), req.lora_name) is not None and req.rid.endswith("install"):
            sent.append("install")
            installing.set()
            await asyncio.Event().wait()  # never answered
        return await answer(req)

    tm.update_lora_adapter_communicator = communicator
    load = asyncio.create_task(NativeLora(tm).load_pinned(NAME, Path("/staged/attempt-0")))
    await installing.wait()
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    assert sent == ["prepare", "poll", "install", "discard"]


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
