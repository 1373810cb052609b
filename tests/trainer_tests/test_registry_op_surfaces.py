"""Every surface of the registry's operations has exactly the declared operations, with the
declared signatures, and nothing else.

An operation is declared once, by ``@operation(kind, timed=...)`` on the registry's method
(:mod:`relax_glue.registry_spec`). The op tables, the store's journal and the actor's dispatch are
derived from the declarations; the typed surfaces static checkers read are written out
(:class:`~relax_glue.registry_ops.RegistryOps`, ``AsyncRegistryAPI``) or generated
(``AsyncRegistryOps``). Each test below fails, naming the operation, when its surface misses a
declared operation, has one more, or spells one with another signature.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from _rg_helpers import new_registry

from relax_glue import actor
from relax_glue.actor import AsyncRegistryClient, RegistryClient
from relax_glue.registry import (
    MUTATING_OPS,
    OPS,
    PUBLIC_OPS,
    PUBLISHER_OPS,
    TIMED_OPS,
    LoRAVersionRegistry,
    stamp_now,
)
from relax_glue.registry_ops import AsyncRegistryAPI, AsyncRegistryOps, RegistryOps
from relax_glue.registry_spec import OpKind
from relax_glue.store import DurableRegistry

# Public methods of the registry that are the host's, not operations: a client never calls them.
HOST_ONLY = {"load", "check_invariants", "refresh_leases"}


def _public_methods(cls: type, *, coroutines: bool | None = None) -> set[str]:
    names = set()
    for klass in cls.__mro__[:-1]:  # not object's
        for name, value in vars(klass).items():
            fn = value.__func__ if isinstance(value, classmethod | staticmethod) else value
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            if coroutines is None or inspect.iscoroutinefunction(fn) == coroutines:
                names.add(name)
    return names


def _client_signature(op: str) -> inspect.Signature:
    """The signature a client surface gives ``op``: the registry method's, where a timed op's
    ``now`` may be left out (the host stamps its clock)."""
    sig = inspect.signature(getattr(LoRAVersionRegistry, op))
    if not OPS[op].timed:
        return sig
    now = sig.parameters["now"]
    params = [
        p.replace(annotation=f"{now.annotation} | None", default=None) if p is now else p
        for p in sig.parameters.values()
    ]
    return sig.replace(parameters=params)


def _differences(surface: Any, ops: set[str]) -> list[str]:
    return [
        f"{op}: {inspect.signature(getattr(surface, op))} != {_client_signature(op)}"
        for op in sorted(ops)
        if inspect.signature(getattr(surface, op)) != _client_signature(op)
    ]


def test_every_public_method_of_the_registry_is_a_declared_operation() -> None:
    assert _public_methods(LoRAVersionRegistry) - HOST_ONLY == set(PUBLIC_OPS)
    assert len(PUBLIC_OPS) == len(set(PUBLIC_OPS)) == 29
    assert _public_methods(LoRAVersionRegistry) >= HOST_ONLY


def test_a_publisher_operation_and_only_it_takes_the_publisher_token() -> None:
    for op in PUBLIC_OPS:
        param = inspect.signature(getattr(LoRAVersionRegistry, op)).parameters.get("publisher_token")
        if OPS[op].kind is OpKind.PUBLISHER:
            assert param is not None and param.kind is param.KEYWORD_ONLY and param.default is None, op
        else:
            assert param is None, op
    for op in TIMED_OPS:
        assert "now" in inspect.signature(getattr(LoRAVersionRegistry, op)).parameters, op


def test_the_sync_surface_has_every_operation_with_its_signature() -> None:
    assert _public_methods(RegistryOps) == set(PUBLIC_OPS)
    assert not _differences(RegistryOps, set(PUBLIC_OPS))


def test_the_typed_async_surface_has_every_operation_as_a_coroutine_with_its_signature() -> None:
    assert _public_methods(AsyncRegistryAPI, coroutines=True) == set(PUBLIC_OPS)
    assert _public_methods(AsyncRegistryAPI, coroutines=False) == set()
    assert not _differences(AsyncRegistryAPI, set(PUBLIC_OPS))


def test_the_generated_async_surface_has_every_operation_as_a_coroutine_with_its_signature() -> None:
    generated = {n for n in PUBLIC_OPS if n in vars(AsyncRegistryOps)}
    assert generated == set(PUBLIC_OPS)  # generated on the class itself, not the stubs inherited
    for op in PUBLIC_OPS:
        fn = vars(AsyncRegistryOps)[op]
        assert inspect.iscoroutinefunction(fn) and fn is not vars(AsyncRegistryAPI)[op], op
    assert _public_methods(AsyncRegistryOps, coroutines=True) == set(PUBLIC_OPS)
    assert not _differences(AsyncRegistryOps, set(PUBLIC_OPS))


class _Recorder(RegistryOps):
    def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        return op, kwargs


class _AsyncRecorder(AsyncRegistryOps):
    async def _dispatch(self, op: str, /, **kwargs: Any) -> Any:
        return op, kwargs


def _sentinels(op: str) -> dict[str, object]:
    """A distinct value for every argument of ``op`` (the forwarding must carry each one)."""
    params = list(inspect.signature(getattr(LoRAVersionRegistry, op)).parameters)[1:]
    return {name: object() for name in params}


@pytest.mark.parametrize("op", PUBLIC_OPS)
def test_each_typed_method_forwards_its_own_operation_with_every_argument(op: str) -> None:
    """The written-out bodies of RegistryOps (and the coroutines generated from them) send their
    own op name and every argument, by name, to ``_dispatch``: nothing dropped, nothing renamed."""
    args = _sentinels(op)
    assert getattr(_Recorder(), op)(**args) == (op, args)
    assert asyncio.run(getattr(_AsyncRecorder(), op)(**args)) == (op, args)


@pytest.mark.parametrize("client", [RegistryClient, DurableRegistry, AsyncRegistryClient])
def test_no_client_overrides_an_operation_with_another_signature(client: type) -> None:
    assert set(PUBLIC_OPS) <= _public_methods(client)
    assert not _differences(client, set(PUBLIC_OPS))
    if client is AsyncRegistryClient:
        assert all(inspect.iscoroutinefunction(getattr(client, op)) for op in PUBLIC_OPS)


def test_the_actors_dispatch_follows_the_declarations() -> None:
    """What the actor (and every client, which dispatches through the same functions) lets
    through, signs as the publisher and stamps with the host's clock is the declared table."""
    assert set(PUBLIC_OPS) == actor._ALLOWED
    assert actor._PUBLISHER_OPS == set(PUBLISHER_OPS) == {s.name for s in OPS.specs if s.kind == "publisher"}
    token = "t" * 32
    for op in PUBLIC_OPS:
        spec = OPS[op]
        assert ("publisher_token" in actor._as_publisher(op, {}, token)) == (spec.kind is OpKind.PUBLISHER), (
            op
        )
        assert ("now" in stamp_now(op, {})) == spec.timed, op
    refusal = actor._call_envelope(LoRAVersionRegistry("7", ["E0"]), "load", {"text": "{}"})
    assert refusal[:2] == ("err", "INVALID_REQUEST")  # a host-only method is no operation


def test_the_journal_keeps_exactly_the_mutating_operations() -> None:
    assert set(MUTATING_OPS) == {s.name for s in OPS.specs if s.mutating}
    assert {s.kind for s in OPS.specs} == set(OpKind)


async def test_the_async_client_runs_the_generated_operation_not_the_stub() -> None:
    client = AsyncRegistryClient.in_process(new_registry())
    await client.connect()
    status = await client.status()
    assert status.default_lora_name is None and status.engines
