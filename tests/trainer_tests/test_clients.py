"""In-process clients (no Ray needed): same API, same answers, same typed errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from _rg_helpers import ENGINES, EPOCH, Publisher, async_scenario, refused, sk, vk

from lora_contract.errors import ErrorCode
from relax_glue.actor import AsyncRegistryClient, RegistryClient
from relax_glue.registry import PUBLIC_OPS, LoRAVersionRegistry
from relax_glue.store import DurableRegistry


def test_clients_expose_every_registry_operation() -> None:
    for name in PUBLIC_OPS:
        assert callable(getattr(RegistryClient, name)), name
        assert asyncio.iscoroutinefunction(getattr(AsyncRegistryClient, name)), name


def test_sync_in_process_client_over_memory_and_durable(tmp_path: Path) -> None:
    with DurableRegistry.open(tmp_path / "r.db", EPOCH, ENGINES) as durable:
        dumps = []
        for reg in (LoRAVersionRegistry(EPOCH, ENGINES), durable):
            client = RegistryClient.in_process(reg)
            assert (client.epoch, client.engines, client.capacity) == (EPOCH, ENGINES, 2)
            pub = Publisher(client)
            refused(ErrorCode.NO_PUBLISHED_VERSION, client.bind_first, sk("s"))
            pub.publish("A")
            assert client.bind_first(sk("s")).version_key == vk("A")
            refused(ErrorCode.STALE_ATTEMPT, client.mark_engine_unknown, "E0", "att-nope", "end", "x")
            dumps.append(client.dump())
        assert dumps[0] == dumps[1], "the same calls give the same state in memory and on disk"


def test_async_in_process_client_serialises_concurrent_calls(tmp_path: Path) -> None:
    with DurableRegistry.open(tmp_path / "r.db", EPOCH, ENGINES) as durable:
        dumps = []
        for reg in (LoRAVersionRegistry(EPOCH, ENGINES), durable):
            client = AsyncRegistryClient.in_process(reg)
            try:
                dumps.append(asyncio.run(async_scenario(client)))
            finally:
                client.close()
        assert dumps[0] == dumps[1]


def test_async_client_needs_connect_before_describe() -> None:
    client = AsyncRegistryClient.in_process(LoRAVersionRegistry(EPOCH, ENGINES))
    try:
        with pytest.raises(RuntimeError, match="connect"):
            _ = client.engines
    finally:
        client.close()
