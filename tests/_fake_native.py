"""An in-memory stand-in for SGLang's LoRA machinery: the one fake part under the REAL engine
shell (publication, reclaim, routes, version table) in pure-logic tests.

It implements :class:`sglang_ext.native_lora.NativeEdge` the way SGLang 0.5.23 behaves as the
plugin uses it: a load registers a fresh id only when it succeeds; a name resolves to the id it
is registered under; each id has an in-flight counter that outlives ``unregister`` and dies with
the physical unload; an unload happens once per id. Scripted failures (:meth:`fail_next`) make
the next call of one operation raise, so the shell's failure branches run in unit tests.
Real-engine behaviour is proven by the engine tests; nothing here says anything about SGLang.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import hashlib
import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import BaseIdentity
from sglang_ext.staging import StagingArea


class FakeNative:
    def __init__(self, unloads: collections.Counter[str] | None = None) -> None:
        self.registry: dict[str, str] = {}  # name -> lora_id (SGLang's LoRARegistry._registry)
        self.counters: dict[str, int] = {}  # lora_id -> in flight (LoRARegistry._counters)
        self.names: dict[str, str] = {}  # lora_id -> the name it was loaded under
        self.loaded: dict[str, dict[str, Any]] = {}  # lora_id -> tensors (the schedulers' copy)
        self.configs: dict[str, dict[str, Any]] = {}  # name -> the adapter_config.json it loaded
        # physical unloads per name (kept by the caller across restarts when it passes one in)
        self.unloads = unloads if unloads is not None else collections.Counter()
        self._failures: dict[str, list[BaseException]] = collections.defaultdict(list)
        self._unloaded: set[str] = set()

    # ------------------------------------------------------------------ test controls

    def fail_next(self, op: str, error: BaseException | None = None) -> None:
        """The next call of ``op`` (load_pinned, probe, unregister, drain, physical_unload) raises."""
        self._failures[op].append(
            error or LoraVersionError(ErrorCode.LOAD_FAILED, f"injected failure of {op}")
        )

    def _maybe_fail(self, op: str) -> None:
        if self._failures[op]:
            raise self._failures[op].pop(0)

    def acquire(self, lora_name: str) -> str | None:
        """A generation request's acquire point: the id it counts against (None: not registered)."""
        lora_id = self.registry.get(lora_name)
        if lora_id is not None:
            self.counters[lora_id] += 1
        return lora_id

    def release(self, lora_id: str | None) -> None:
        if lora_id is not None:
            self.counters[lora_id] -= 1

    @property
    def in_flight_by_name(self) -> collections.Counter[str]:
        return collections.Counter({self.names[i]: n for i, n in self.counters.items()})

    # ------------------------------------------------------------------ NativeEdge

    def lora_id_of(self, lora_name: str) -> str | None:
        return self.registry.get(lora_name)

    def in_flight(self, lora_id: str | None) -> int | None:
        return None if lora_id is None else self.counters.get(lora_id)

    async def load_pinned(self, lora_name: str, adapter_dir: Path) -> str:
        """Reads the staged directory as SGLang's disk load would: the config and every
        ``*.safetensors`` file in it."""
        self._maybe_fail("load_pinned")
        from safetensors.torch import load_file

        self.configs[lora_name] = json.loads((adapter_dir / "adapter_config.json").read_text())
        tensors: dict[str, Any] = {}
        for f in sorted(adapter_dir.glob("*.safetensors")):
            tensors.update(load_file(f))
        lora_id = uuid.uuid4().hex
        self.loaded[lora_id] = tensors
        self.counters[lora_id] = 0
        self.names[lora_id] = lora_name
        self.registry[lora_name] = lora_id
        return lora_id

    async def probe(self, lora_name: str, expected_lora_id: str) -> None:
        self._maybe_fail("probe")
        got = self.registry.get(lora_name)
        if got != expected_lora_id:
            raise LoraVersionError(
                ErrorCode.LOAD_FAILED, f"probe was served by {got}, expected {expected_lora_id}"
            )

    async def unregister(self, lora_name: str, lora_id: str) -> None:
        self._maybe_fail("unregister")
        if self.registry.get(lora_name) == lora_id:
            del self.registry[lora_name]

    async def drain(self, lora_id: str, timeout_s: float) -> int | None:
        self._maybe_fail("drain")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.counters.get(lora_id, 0) > 0 and loop.time() < deadline:
            await asyncio.sleep(0.002)
        return self.counters.get(lora_id)

    async def physical_unload(self, lora_name: str, lora_id: str) -> None:
        self._maybe_fail("physical_unload")
        if lora_id in self._unloaded:
            return
        self._unloaded.add(lora_id)
        self.unloads[lora_name] += 1
        self.loaded.pop(lora_id, None)
        self.counters.pop(lora_id, None)


_STAGING_BASE: Path | None = None


def fake_staging() -> StagingArea:
    """A real :class:`StagingArea` under one temporary base for the whole test process."""
    global _STAGING_BASE
    if _STAGING_BASE is None:
        _STAGING_BASE = Path(tempfile.mkdtemp(prefix="lora-versions-test-staging-"))
        atexit.register(shutil.rmtree, _STAGING_BASE, True)
    return StagingArea(_STAGING_BASE)


def fake_base(label: str) -> BaseIdentity:
    """The base model identity a fake engine reports: engines with one label run the same base."""

    def part(name: str) -> str:
        return hashlib.sha256(f"{label}/{name}".encode()).hexdigest()

    return BaseIdentity(
        fingerprint=part("fingerprint"),
        config=part("config"),
        tokenizer=part("tokenizer"),
        weights=part("weights"),
        serving=part("serving"),
    )
