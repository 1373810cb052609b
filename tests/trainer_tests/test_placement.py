"""relax_glue.placement's pure parts and the client that follows the registry actor by name
(issue 42). The layout and the node faults on a real multi-node cluster:
test_ray_cluster_engines.py."""

from __future__ import annotations

import os

import pytest
from _optional import optional_module

from lora_contract.errors import HTTP_STATUS, ErrorCode
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


class _CallMany:
    """A stand-in for an actor handle's ``call_many`` method object."""

    def __init__(self, handle: _Handle) -> None:
        self.handle = handle

    def remote(self, calls: list) -> _Ref:
        h = self.handle
        h.calls += 1
        return _Ref(h.failure if h.failure is not None else [("ok", {"answered_by": h.name})] * len(calls))


class _Handle:
    def __init__(self, name: str, failure: BaseException | None = None) -> None:
        self.name, self.failure, self.calls = name, failure, 0
        self.call_many = _CallMany(self)


async def test_the_named_client_looks_the_actor_up_again_once_it_is_gone(monkeypatch):
    ray = optional_module("ray", "ray", "ray")
    from ray.exceptions import ActorUnschedulableError

    lost = _Handle("old", ActorUnschedulableError("the node is gone"))
    back = _Handle("new")
    lookups: list[str] = []
    actors = iter([lost, None, back])

    def get_actor(name, namespace=None):
        lookups.append(name)
        found = next(actors)
        if found is None:
            raise ValueError(f"Failed to look up actor with name {name!r}")
        return found

    monkeypatch.setattr(ray, "get_actor", get_actor)
    client = AsyncRegistryClient.for_named_actor("e1", retries=0)
    send = client._acall
    for expected in (ActorUnschedulableError, ConnectionError):  # the node lost, then nothing runs
        with pytest.raises(expected):
            await send("status", {})
    assert await send("status", {}) == ("ok", {"answered_by": "new"})
    assert await send("status", {}) == ("ok", {"answered_by": "new"})  # kept while it answers
    assert lookups == ["lora_version_registry@e1"] * 3 and (lost.calls, back.calls) == (1, 2)
    with pytest.raises(RegistryUnavailable) as err:  # through the typed surface, after retries
        monkeypatch.setattr(back, "failure", ConnectionError("cut"))
        await client.status()
    assert err.value.code is ErrorCode.REGISTRY_UNAVAILABLE
