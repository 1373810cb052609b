"""The registry's operations are declared once (relax_glue.registry_ops): the sync table, the
async client's generated coroutines, and the typed async signatures static checkers read."""

from __future__ import annotations

import inspect

from relax_glue.actor import AsyncRegistryClient
from relax_glue.registry import PUBLIC_OPS, LoRAVersionRegistry
from relax_glue.registry_ops import AsyncRegistryAPI, AsyncRegistryOps, RegistryOps

OPS = PUBLIC_OPS


def test_every_registry_operation_has_one_typed_sync_and_one_typed_async_form() -> None:
    for op in OPS:
        sync = inspect.signature(getattr(RegistryOps, op))
        typed = getattr(AsyncRegistryAPI, op)
        assert inspect.iscoroutinefunction(typed), op
        # the typed stub is the coroutine form of the sync declaration: same parameters, same
        # annotations, same result type (annotations compared as written)
        assert inspect.signature(typed) == sync, op
        generated = getattr(AsyncRegistryOps, op)
        assert inspect.iscoroutinefunction(generated) and generated is not typed, op
        assert inspect.signature(generated) == sync, op
    public = {n for n, v in vars(AsyncRegistryAPI).items() if inspect.iscoroutinefunction(v)}
    assert public == set(OPS)  # no stub without an operation, no operation without a stub


def test_the_declared_operations_are_the_registrys_own() -> None:
    for op in OPS:
        declared = list(inspect.signature(getattr(RegistryOps, op)).parameters)
        real = list(inspect.signature(getattr(LoRAVersionRegistry, op)).parameters)
        assert declared == real, op


async def test_the_async_client_runs_the_generated_operation_not_the_stub() -> None:
    from _rg_helpers import new_registry

    client = AsyncRegistryClient.in_process(new_registry())
    await client.connect()
    status = await client.status()
    assert status.default_lora_name is None and status.engines
