"""relax_glue.placement's pure parts and the client that follows the registry actor by name
(issue 42). The layout and the node faults on a real multi-node cluster:
test_ray_cluster_engines.py."""

from __future__ import annotations

import os

import pytest
from _optional import optional_module

from lora_contract.errors import HTTP_STATUS, ErrorCode, LoraVersionError
from relax_glue import placement
from relax_glue.actor import AsyncRegistryClient, RegistryUnavailable
from relax_glue.placement import REGISTRY_RESOURCE, ROLLOUT_RESOURCE, RunLayout, layout_of

REG, ROLL = {REGISTRY_RESOURCE: 1}, {ROLLOUT_RESOURCE: 1}


def node(node_id: str, *, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}}


def test_the_layout_is_read_from_the_nodes_resources():
    nodes = [
        node("head"),
        node("r2", **ROLL),
        node("reg", **REG),
        node("r1", **ROLL),
        node("gone", alive=False, **ROLL),
        node("gone-reg", alive=False, **REG),
    ]
    assert layout_of(nodes) == RunLayout("reg", ("r1", "r2"))


@pytest.mark.parametrize(
    "nodes, says",
    [
        ([node("r", **ROLL)], "found 0"),
        ([node("a", **REG), node("b", **REG), node("r", **ROLL)], "found 2"),
        ([node("reg", **REG), node("head")], "no alive node offers"),
        ([node("reg", **REG), node("r", alive=False, **ROLL)], "no alive node offers"),
    ],
)
def test_a_layout_without_exactly_one_registry_node_or_any_rollout_node_is_refused(nodes, says):
    with pytest.raises(ValueError, match=says):
        layout_of(nodes)


def test_an_unreachable_registry_is_typed_but_no_refusal():
    err = RegistryUnavailable("status", ConnectionError("gone"))
    assert err.code is ErrorCode.REGISTRY_UNAVAILABLE and HTTP_STATUS[err.code] == 503
    assert not isinstance(err, ValueError) and "status" in str(err)


def test_the_token_is_the_one_given_never_a_file(monkeypatch):
    reloads = []
    monkeypatch.setattr(placement, "reload_ray_auth", lambda: reloads.append(dict(os.environ)))
    # what use_ray_auth sets is this process's for every later test: put back at teardown (in CI
    # a RAY_AUTH_MODE=disabled left here broke the later tests' local Ray: actors never started)
    # (setenv, not delenv: monkeypatch restores only what it recorded, and it records no absent name)
    monkeypatch.setenv("RAY_AUTH_MODE", "restored-at-teardown")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "restored-at-teardown")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/home/someone/.ray/auth_token")
    placement.use_ray_auth("t" * 64)
    assert (os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"]) == ("token", "t" * 64)
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ and len(reloads) == 1
    placement.use_ray_auth(None)
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ
    assert len(reloads) == 2


class _Ref:
    """What ``handle.call_many.remote(...)`` gives: awaitable, raising or answering."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def __await__(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        yield from ()
        return self.outcome


# what a durable registry actor's describe() says of itself (the fields of its identity)
DURABLE = {"db_path": "/data/r.db", "epoch": "e1", "engines": ["E0", "E1"], "capacity": 2, "publisher": "fp"}


class _Method:
    """A stand-in for an actor handle's method object: ``.remote(...)`` gives a ``_Ref``."""

    def __init__(self, handle: _Handle, answer) -> None:
        self.handle, self.answer = handle, answer

    def remote(self, *args) -> _Ref:
        h = self.handle
        h.calls += 1
        return _Ref(h.failure if h.failure is not None else self.answer(*args))


class _Handle:
    def __init__(self, name: str, **desc) -> None:
        self.name, self.failure, self.calls = name, None, 0
        self.call_many = _Method(self, lambda calls: [("ok", {"answered_by": name})] * len(calls))
        self.describe = _Method(self, lambda: {**DURABLE, **desc, "node_id": name})


def _actors(monkeypatch, *found):
    """``ray.get_actor`` answering each lookup with the next of ``found`` (None: no such actor)."""
    ray = optional_module("ray", "ray", "ray")
    lookups: list[str] = []
    actors = iter(found)

    def get_actor(name, namespace=None):
        lookups.append(name)
        actor = next(actors)
        if actor is None:
            raise ValueError(f"Failed to look up actor with name {name!r}")
        return actor

    monkeypatch.setattr(ray, "get_actor", get_actor)
    return lookups


async def test_the_named_client_looks_the_actor_up_again_once_it_is_gone(monkeypatch):
    from ray.exceptions import ActorUnschedulableError

    old, back = _Handle("old"), _Handle("new")
    lookups = _actors(monkeypatch, old, None, back)
    client = AsyncRegistryClient.for_named_actor("e1", retries=0)
    send = client._acall
    assert await send("status", {}) == ("ok", {"answered_by": "old"})
    old.failure = ActorUnschedulableError("the node is gone")
    for expected in (ActorUnschedulableError, ConnectionError):  # the node lost, then nothing runs
        with pytest.raises(expected):
            await send("status", {})
    assert await send("status", {}) == ("ok", {"answered_by": "new"})  # its database's registry
    assert await send("status", {}) == ("ok", {"answered_by": "new"})  # kept while it answers
    assert lookups == ["lora_version_registry@e1"] * 3
    with pytest.raises(RegistryUnavailable) as err:  # through the typed surface, after retries
        back.failure = ConnectionError("cut")
        await client.status()
    assert err.value.code is ErrorCode.REGISTRY_UNAVAILABLE


@pytest.mark.parametrize(
    "other",
    [{"db_path": "/elsewhere/registry.db"}, {"db_path": None}, {"publisher": "another"}, {"capacity": 3}],
)
async def test_another_actor_under_the_name_is_never_served_as_the_registry(monkeypatch, other):
    from ray.exceptions import ActorDiedError

    old, impostor = _Handle("old"), _Handle("impostor", **other)
    _actors(monkeypatch, old, impostor)
    client = AsyncRegistryClient.for_named_actor("e1", retries=0)
    assert await client._acall("status", {}) == ("ok", {"answered_by": "old"})
    old.failure = ActorDiedError()
    with pytest.raises(ActorDiedError):
        await client._acall("status", {})
    with pytest.raises(LoraVersionError) as err:
        await client.status()
    assert err.value.code is ErrorCode.REGISTRY_STATE_LOST and impostor.calls == 1  # its describe only
