"""The imperative edge to SGLang's own LoRA machinery, from the engine's main process.

SGLang's native lifecycle stays the source of truth: its ``LoRARegistry`` resolves names to
engine-local ids and counts in-flight requests per id, and its schedulers hold the weights. For
managed versions we drive the same primitives SGLang's control methods use, but not those
methods themselves, because of what they do around them (sglang 0.5.23):

- the stock tensor load takes ``lora_update_lock``, runs the ``max_loaded_loras`` LRU loop (which
  can report failure after the adapter was registered) and caches the ref for implicit reload;
- the stock unload drains the in-flight count while holding ``lora_update_lock``.

Instead: load = scheduler fan-out, then ``register`` (READY only after); removal = ``unregister``
-> bounded drain without any lock -> scheduler fan-out with the explicit ``lora_id`` (exactly once
per id). The communicator serialises fan-outs itself, so none of this needs ``lora_update_lock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import pickle
from collections.abc import Mapping
from typing import Any

from sglang_ext.errors import ErrorCode, LoraVersionError

# Set while the plugin's own exact-version probe generates with a managed name that is still
# LOADING: the request guard (tokenizer_hooks.check_servable) lets exactly that call pass.
managed_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lora_versions_managed_call", default=False
)

PROBE_INPUT_IDS = [1]

# Messages of LoRAManager.validate_new_adapter that mean "this adapter does not fit this engine".
_INCOMPATIBLE_MARKERS = ("incompatible with the current LoRA memory pool", "DoRA", "add tokens")


class NativeLora:
    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager
        # lora_id -> the one physical unload of that id (exactly once, shared by racing callers)
        self._unloads: dict[str, asyncio.Task[None]] = {}

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
        """Load ``tensors`` under ``lora_name``, pinned, and register it; returns the new lora_id.

        Upstream: LoRARef, LoadLoRAAdapterFromTensorsReqInput, TokenizerManager.
        update_lora_adapter_communicator, tokenizer_control_mixin._merge_lora_update_results,
        LoRARegistry.register. The payload is a by-value pickle of CPU tensors (SGLang's
        SafeUnpickler admits torch storages): no shared memory, no fd that leaks if unconsumed.
        Tensors were verified against the manifest on receipt; ``expected_checksums`` is not used
        because a mismatch raises outside any try in the scheduler and takes the server down."""
        from sglang.srt.lora.lora_registry import LoRARef
        from sglang.srt.managers.io_struct import (
            LoadLoRAAdapterFromTensorsReqInput,
            UnloadLoRAAdapterReqInput,
        )
        from sglang.srt.managers.tokenizer_control_mixin import _merge_lora_update_results
        from sglang.srt.runtime_context import get_parallel

        tm = self.tm
        tm.auto_create_handle_loop()
        ref = LoRARef(lora_name=lora_name, lora_path="__tensor__", pinned=True)
        payload = pickle.dumps(
            {k: v.contiguous() for k, v in tensors.items()}, protocol=pickle.HIGHEST_PROTOCOL
        )
        req = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=lora_name,
            config_dict=dict(config),
            serialized_named_tensors=[payload] * get_parallel().tp_size,
            pinned=True,
            lora_id=ref.lora_id,
        )
        ranks = await tm.update_lora_adapter_communicator(req)
        result = _merge_lora_update_results(ranks)
        if not result.success:
            if any(r.success or lora_name in (r.loaded_adapters or {}) for r in ranks):
                # some rank loaded it: take it back out so nothing half-loaded stays behind
                await tm.update_lora_adapter_communicator(
                    UnloadLoRAAdapterReqInput(lora_name=lora_name, lora_id=ref.lora_id)
                )
            message = result.error_message or "unknown error"
            code = (
                ErrorCode.INCOMPATIBLE_ADAPTER
                if any(m in message for m in _INCOMPATIBLE_MARKERS)
                else ErrorCode.LOAD_FAILED
            )
            raise LoraVersionError(code, f"SGLang refused the load: {message}", lora_name=lora_name)
        await tm.lora_registry.register(ref)
        return ref.lora_id

    async def probe(self, lora_name: str, expected_lora_id: str) -> None:
        """Exact-version probe: a 1-token greedy generation naming ``lora_name`` succeeds and was
        resolved by SGLang to exactly the adapter instance we loaded."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(PROBE_INPUT_IDS),
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            lora_path=lora_name,
        )
        token = managed_call.set(True)
        try:
            outputs = [out async for out in self.tm.generate_request(obj, None)]
        finally:
            managed_call.reset(token)
        if not outputs or not outputs[-1].get("output_ids"):
            raise LoraVersionError(ErrorCode.LOAD_FAILED, "probe generated no token", lora_name=lora_name)
        got = obj.lora_id if isinstance(obj.lora_id, str) else None
        if got != expected_lora_id:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED,
                f"probe was served by lora_id {got}, expected {expected_lora_id}",
                lora_name=lora_name,
            )

    async def unregister(self, lora_name: str, lora_id: str) -> None:
        """Removal step 1: new requests can no longer acquire ``lora_name`` (idempotent). The
        counter stays, so in-flight requests keep being counted. Upstream: LoRARegistry.unregister;
        TokenizerManager.lora_ref_cache (forgotten, so a managed name is never implicitly reloaded)."""
        tm = self.tm
        tm.lora_ref_cache.pop(lora_name, None)
        ref = tm.lora_registry._registry.get(lora_name)
        if ref is not None and ref.lora_id == lora_id:
            await tm.lora_registry.unregister(lora_name)

    async def drain(self, lora_id: str, timeout_s: float) -> int | None:
        """Removal step 2: wait (bounded, holding NO lock) for the native in-flight count to reach
        zero. Returns the count left, or None when the counter is gone (already unloaded)."""
        counter = self.tm.lora_registry._counters.get(lora_id)
        if counter is None:
            return None
        if counter.value() != 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(counter.wait_for_zero(), timeout=timeout_s)
        return counter.value()

    async def physical_unload(self, lora_name: str, lora_id: str) -> None:
        """Removal step 3, exactly once per lora_id (racing callers share the one fan-out). Only
        after the caller's ``may_unload_now`` said yes. Idempotent on the scheduler side too."""
        task = self._unloads.get(lora_id)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.ensure_future(self._unload(lora_name, lora_id))
            self._unloads[lora_id] = task
        await asyncio.shield(task)

    async def _unload(self, lora_name: str, lora_id: str) -> None:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput
        from sglang.srt.managers.tokenizer_control_mixin import _merge_lora_update_results

        tm = self.tm
        # lora_id must be set: the scheduler builds a LoRARef from it and a None id raises there.
        result = _merge_lora_update_results(
            await tm.update_lora_adapter_communicator(
                UnloadLoRAAdapterReqInput(lora_name=lora_name, lora_id=lora_id)
            )
        )
        if not result.success:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, f"SGLang failed to unload: {result.error_message}", lora_name=lora_name
            )
        tm.lora_registry._counters.pop(lora_id, None)
