"""The imperative edge to SGLang's own LoRA machinery, from the engine's main process.

Everything here goes through ``TokenizerManager`` (sglang 0.5.23) so that SGLang's native
lifecycle stays the source of truth: its ``LoRARegistry`` resolves names to engine-local ids,
counts in-flight requests per id, and its schedulers hold the weights.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

from sglang_ext.errors import ErrorCode, LoraVersionError

# Set while the plugin itself drives a native load/unload of a managed name, so the guard that
# refuses managed names on SGLang's ordinary LoRA API (see hooks) lets exactly these calls pass.
managed_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lora_versions_managed_call", default=False
)

PROBE_INPUT_IDS = [1]


class NativeLora:
    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    # Upstream symbols: LoRARegistry._registry (name -> LoRARef) and ._counters (id -> counter).
    def lora_id_of(self, lora_name: str) -> str | None:
        ref = self.tm.lora_registry._registry.get(lora_name)
        return None if ref is None else ref.lora_id

    def in_flight(self, lora_id: str | None) -> int | None:
        if lora_id is None:
            return None
        counter = self.tm.lora_registry._counters.get(lora_id)
        return None if counter is None else counter.value()

    async def load_pinned(self, lora_name: str, config: Mapping[str, Any], tensors: Mapping[str, Any]) -> str:
        """Load through SGLang's native tensor path with ``pinned=True``; returns the new lora_id.

        Upstream: TokenizerManager.load_lora_adapter_from_tensors (tokenizer_control_mixin) with
        LoadLoRAAdapterFromTensorsReqInput; tensors cross to the scheduler as shared-memory handles
        produced here, in the main process, which outlives the load."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        req = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=lora_name,
            config_dict=dict(config),
            serialized_named_tensors=[MultiprocessingSerializer.serialize(dict(tensors))],
            pinned=True,
        )
        token = managed_call.set(True)
        try:
            result = await self.tm.load_lora_adapter_from_tensors(req, None)
        finally:
            managed_call.reset(token)
        if not result.success:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, f"SGLang refused the load: {result.error_message}", lora_name=lora_name
            )
        lora_id = self.lora_id_of(lora_name)
        if lora_id is None:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, "SGLang reported success but has no such name", lora_name=lora_name
            )
        return lora_id

    async def unload_managed(self, lora_name: str, timeout_s: float) -> Drained:
        return await unload_managed(self, lora_name, timeout_s)

    async def probe(self, lora_name: str, expected_lora_id: str) -> None:
        """Exact-version probe: a 1-token greedy generation naming ``lora_name`` succeeds and was
        resolved by SGLang to exactly the adapter instance we loaded."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(PROBE_INPUT_IDS),
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            lora_path=lora_name,
        )
        outputs = [out async for out in self.tm.generate_request(obj, None)]
        if not outputs or not outputs[-1].get("output_ids"):
            raise LoraVersionError(ErrorCode.LOAD_FAILED, "probe generated no token", lora_name=lora_name)
        got = obj.lora_id if isinstance(obj.lora_id, str) else None
        if got != expected_lora_id:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED,
                f"probe was served by lora_id {got}, expected {expected_lora_id}",
                lora_name=lora_name,
            )


class Drained:
    """Result of :meth:`NativeLora.unload_managed`."""

    def __init__(self, unloaded: bool, in_flight: int | None) -> None:
        self.unloaded = unloaded
        self.in_flight = in_flight


async def _wait_for_zero(counter: Any, timeout_s: float) -> bool:
    import asyncio

    if counter.value() == 0:
        return True
    try:
        await asyncio.wait_for(counter.wait_for_zero(), timeout=timeout_s)
    except TimeoutError:
        return counter.value() == 0
    return True


async def unload_managed(native: NativeLora, lora_name: str, timeout_s: float) -> Drained:
    """Unregister ``lora_name``, drain its native in-flight count, then unload it exactly once.

    Unlike SGLang's ``unload_lora_adapter`` the drain does NOT hold ``lora_update_lock``: loads and
    unloads of other adapters go on meanwhile, and a counter that never reaches zero leaves the
    adapter visibly draining instead of wedging the control plane. The wait is bounded per call;
    a later call resumes where this one stopped (SGLang's ``pending_lora_unloads`` remembers the
    unregistered id, and its own locked unload then finds the counter already at zero).

    Upstream symbols (0.5.23): LoRARegistry.unregister/_counters, TokenizerManager.
    pending_lora_unloads / lora_ref_cache / lora_update_lock / _unload_lora_adapter_locked.
    """
    from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

    tm = native.tm
    # Never implicitly reload a managed name: forget its cached ref before anything else.
    tm.lora_ref_cache.pop(lora_name, None)
    lora_id = tm.pending_lora_unloads.get(lora_name)
    if lora_id is None:
        if lora_name not in tm.lora_registry._registry:
            return Drained(unloaded=True, in_flight=0)  # nothing loaded under that name
        lora_id = await tm.lora_registry.unregister(lora_name)
        tm.pending_lora_unloads[lora_name] = lora_id
    counter = tm.lora_registry._counters.get(lora_id)
    if counter is not None and not await _wait_for_zero(counter, timeout_s):
        return Drained(unloaded=False, in_flight=counter.value())
    token = managed_call.set(True)
    try:
        async with tm.lora_update_lock:
            if lora_name not in tm.pending_lora_unloads:
                return Drained(unloaded=True, in_flight=0)  # a concurrent call finished it
            result = await tm._unload_lora_adapter_locked(UnloadLoRAAdapterReqInput(lora_name=lora_name))
    finally:
        managed_call.reset(token)
    if not result.success:
        raise LoraVersionError(
            ErrorCode.LOAD_FAILED, f"SGLang failed to unload: {result.error_message}", lora_name=lora_name
        )
    tm.lora_ref_cache.pop(lora_name, None)
    return Drained(unloaded=True, in_flight=0)
