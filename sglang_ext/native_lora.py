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
from pathlib import Path
from typing import Any, Protocol

from lora_contract.errors import ErrorCode, LoraVersionError
from sglang_ext import lora_registry_patch as upstream
from sglang_ext.prepared_load import PENDING_MESSAGE, Op, rid_for

# Set while the plugin's own exact-version probe generates with a managed name that is still
# LOADING: the request guard (tokenizer_hooks.check_servable) lets exactly that call pass.
managed_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lora_versions_managed_call", default=False
)

PROBE_INPUT_IDS = [1]

# How often a load polls its preparation: doubling from the first to the longest interval. A
# poll costs the scheduler thread a dict look-up between two steps, and under load it waits for
# the step anyway; on an idle engine a long interval is pure latency added to the publication.
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.005


def refused_load(lora_name: str, message: str) -> LoraVersionError:
    """SGLang refused or could not do a load: INCOMPATIBLE_ADAPTER when its text says the adapter
    does not fit this engine, LOAD_FAILED otherwise."""
    incompatible = upstream.is_incompatible_message(message)
    code = ErrorCode.INCOMPATIBLE_ADAPTER if incompatible else ErrorCode.LOAD_FAILED
    return LoraVersionError(code, message, lora_name=lora_name)


class NativeEdge(Protocol):
    """What the publication and reclaim services need from SGLang's LoRA machinery. The engine
    implements it with :class:`NativeLora`; the trainer-side tests with an in-memory fake, so they
    run the real services (tests/trainer_tests/_fake_engine.py)."""

    def lora_id_of(self, lora_name: str) -> str | None:
        """The id SGLang's registry resolves ``lora_name`` to now (None: not registered)."""
        ...

    def in_flight(self, lora_id: str | None) -> int | None:
        """Requests holding ``lora_id`` (None: nothing is loaded under it)."""
        ...

    async def load_pinned(self, lora_name: str, adapter_dir: Path) -> str:
        """Load the verified adapter directory and register it, pinned; the new lora_id.
        Raises LoraVersionError; if some rank loaded it anyway, its ``leftover_lora_id`` detail
        names that id (never registered), for the caller's removal to take back out."""
        ...

    async def probe(self, lora_name: str, expected_lora_id: str) -> None:
        """Generate one token naming ``lora_name``; raise unless served by ``expected_lora_id``."""
        ...

    async def unregister(self, lora_name: str, lora_id: str) -> None:
        """New requests can no longer acquire the name (idempotent); in-flight ones stay counted."""
        ...

    async def drain(self, lora_id: str, timeout_s: float) -> int | None:
        """Wait at most ``timeout_s`` for zero in flight; the count left (None: already gone)."""
        ...

    async def physical_unload(self, lora_name: str, lora_id: str) -> None:
        """Unload ``lora_id`` from every rank, exactly once per id."""
        ...


class NativeLora:
    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager
        # lora_id -> the physical unload of that id while it runs, shared by racing callers. Only
        # while it runs: the version table never asks again for an id it saw unloaded (reclaim
        # answers DONE, cleanup NOTHING), and ids are per load, so a finished entry would only
        # grow with history.
        self._unloads: dict[str, asyncio.Task[None]] = {}

    def lora_id_of(self, lora_name: str) -> str | None:
        return upstream.registered_lora_id(self.tm, lora_name)

    def in_flight(self, lora_id: str | None) -> int | None:
        if lora_id is None:
            return None
        counter = upstream.in_flight_counter(self.tm, lora_id)
        return None if counter is None else counter.value()

    async def load_pinned(self, lora_name: str, adapter_dir: Path) -> str:
        """Load ``adapter_dir`` (this process's staged, verified files) under ``lora_name``,
        pinned, and register it; returns the new lora_id.

        Every scheduler rank reads the files through SGLang's own disk path, as a stock
        ``/load_lora_adapter`` would: no tensor travels through ZMQ, and no fd is handed over
        that could leak if a rank never consumed it. The reading and re-shaping run off each
        scheduler's thread (``prepared_load``): prepare, poll until every rank has it, then the
        load request, which only installs it. Whatever was prepared and not installed is
        discarded before this returns or raises (after an install on every rank, nothing is)."""
        ref = upstream.new_pinned_ref(lora_name)
        path = str(adapter_dir)

        def request(op: Op) -> Any:
            return upstream.load_from_dir_request(ref, path, rid_for(op))

        installed = False
        try:
            await self._prepare_on_every_rank(lora_name, request)
            result, ranks = await upstream.fan_out(self.tm, request(Op.INSTALL))
            # every rank took its preparation: nothing is left to drop, and the load saves a
            # round trip through the scheduler
            installed = result.success and all(r.success for r in ranks)
        finally:
            if not installed:
                # a failure or a cancellation anywhere: every rank's preparation goes, a running
                # one included (its result is dropped when it ends)
                await self._discard(lora_name, request(Op.DISCARD))
        if not result.success:
            message = result.error_message or "unknown error"
            if any(upstream.rank_loaded(r, lora_name) for r in ranks):
                # Some rank loaded it: name what stays loaded (never registered, so no request
                # can hold it). The caller takes it back out through the one removal of a
                # managed version (removal.remove_version, which asks may_unload_now), or
                # keeps it visible (FAILED) if that fails; nothing here unloads on its own.
                err = refused_load(lora_name, f"SGLang refused the load: {message}")
                err.details["leftover_lora_id"] = ref.lora_id
                raise err
            raise refused_load(lora_name, f"SGLang refused the load: {message}")
        await upstream.register(self.tm, ref)
        return ref.lora_id

    async def _prepare_on_every_rank(self, lora_name: str, request: Any) -> None:
        """Prepare, then poll (each poll a short request between the scheduler's steps) until
        every rank has the adapter prepared. A rank that failed fails the load."""
        result, _ = await upstream.fan_out(self.tm, request(Op.PREPARE))
        if not result.success:
            raise refused_load(lora_name, f"SGLang could not prepare the load: {result.error_message}")
        delay = POLL_FIRST_S
        while True:
            _, ranks = await upstream.fan_out(self.tm, request(Op.POLL))
            failed = [
                str(r.error_message) for r in ranks if not r.success and r.error_message != PENDING_MESSAGE
            ]
            if failed:
                raise refused_load(lora_name, f"SGLang could not read the adapter: {'; '.join(failed)}")
            if all(r.success for r in ranks):
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    async def _discard(self, lora_name: str, discard: Any) -> None:
        result, _ = await upstream.fan_out(self.tm, discard)
        if not result.success:  # the scheduler answers a discard with success, kept or not
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED,
                f"SGLang did not discard a preparation: {result.error_message}",
                lora_name=lora_name,
            )

    async def probe(self, lora_name: str, expected_lora_id: str) -> None:
        """Exact-version probe: a 1-token greedy generation naming ``lora_name`` succeeds and was
        resolved by SGLang to exactly the adapter instance we loaded."""
        request = upstream.generation_request(lora_name, PROBE_INPUT_IDS, max_new_tokens=1)
        token = managed_call.set(True)
        try:
            outputs = [out async for out in upstream.generate(self.tm, request)]
        finally:
            managed_call.reset(token)
        if not outputs or not outputs[-1].get("output_ids"):
            raise LoraVersionError(ErrorCode.LOAD_FAILED, "probe generated no token", lora_name=lora_name)
        got = upstream.resolved_lora_id(request)
        if got != expected_lora_id:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED,
                f"probe was served by lora_id {got}, expected {expected_lora_id}",
                lora_name=lora_name,
            )

    async def unregister(self, lora_name: str, lora_id: str) -> None:
        """Removal step 1: new requests can no longer acquire ``lora_name`` (idempotent). The
        counter stays, so in-flight requests keep being counted; the cached ref is forgotten so a
        managed name is never implicitly reloaded."""
        upstream.forget_cached_ref(self.tm, lora_name)
        if upstream.registered_lora_id(self.tm, lora_name) == lora_id:
            await upstream.unregister(self.tm, lora_name)

    async def drain(self, lora_id: str, timeout_s: float) -> int | None:
        """Removal step 2: wait (bounded, holding NO lock) for the native in-flight count to reach
        zero. Returns the count left, or None when the counter is gone (already unloaded)."""
        counter = upstream.in_flight_counter(self.tm, lora_id)
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
        if task is None:
            task = asyncio.ensure_future(self._unload(lora_name, lora_id))
            self._unloads[lora_id] = task
            task.add_done_callback(lambda _done: self._unloads.pop(lora_id, None))
        await asyncio.shield(task)

    async def _unload(self, lora_name: str, lora_id: str) -> None:
        result, _ = await upstream.fan_out(self.tm, upstream.unload_request(lora_name, lora_id))
        if not result.success:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, f"SGLang failed to unload: {result.error_message}", lora_name=lora_name
            )
        upstream.drop_counter(self.tm, lora_id)
