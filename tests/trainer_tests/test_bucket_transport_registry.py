"""The trainer's end of the transports registered at the contract (issue 37, item 4): a client
is built with a transport by its name, an unknown name is a typed refusal that builds nothing,
and the collective's group connect is that transport's own setup call, not a client method."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
import pytest
from _fake_engine import make_snapshot

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.bucket_transport import (
    BodyTransport,
    CollectiveTransport,
    bucket_transport,
    register_sender,
)
from relax_glue.engine_client import AuditLog, EngineClient

SNAP = make_snapshot(seed=1)
TOKEN = "att-test-1"
BEGIN = SNAP.begin_request("relax_policy_lora", "7", "A", TOKEN)


def client(handler: Callable[[httpx.Request], httpx.Response], **kwargs: object) -> EngineClient:
    return EngineClient(
        "E0",
        "http://e0.mock",
        control_transport=httpx.MockTransport(handler),
        generation_transport=httpx.MockTransport(handler),
        **kwargs,  # type: ignore[arg-type]
    )


def nothing(_request: httpx.Request) -> httpx.Response:
    raise AssertionError("no call expected")


async def test_a_client_gets_the_sender_registered_under_the_name_it_is_given() -> None:
    assert type(client(nothing).transport) is BodyTransport  # the default: HTTP
    assert type(client(nothing, transport="http").transport) is BodyTransport
    collective = client(nothing, transport="collective").transport
    assert isinstance(collective, CollectiveTransport) and collective.begin_transport == "collective"


def test_an_unknown_name_is_invalid_and_a_known_one_without_a_sender_is_unavailable() -> None:
    with pytest.raises(LoraVersionError) as err:
        bucket_transport("pigeon")
    assert err.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(LoraVersionError) as err:
        client(nothing, transport="pigeon")
    assert err.value.code is ErrorCode.INVALID_REQUEST
    p.register_transport("engine-only")  # the contract knows it; this trainer has no sender
    with pytest.raises(LoraVersionError) as err:
        bucket_transport("engine-only")
    assert err.value.code is ErrorCode.TRANSPORT_UNAVAILABLE
    with pytest.raises(ValueError):
        register_sender("never-registered", BodyTransport)  # the contract must know it first


class StubSender:
    """The collective sender's connect as the transport drives it, without a group."""

    timeout_s = 5.0

    def __init__(self) -> None:
        self.connected = False
        self.group_id: str | None = None
        self.incarnations: list[str] = []

    async def connect(self, ask_engine: Callable[[str, str, str], Awaitable[str]]) -> None:
        self.incarnations.append(await ask_engine("g1", "tcp://127.0.0.1:1234", "gloo"))
        self.connected, self.group_id = True, "g1"


async def test_the_collective_connects_through_its_own_setup_call_before_the_begin() -> None:
    seen: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == p.Routes.COLLECTIVE_CONNECT:
            return httpx.Response(
                200, json={"group_id": body["group_id"], "incarnation": "inc1", "timeout_s": 30.0}
            )
        receipt = {"lora_name": BEGIN.lora_name, "digest": BEGIN.digest, "attempt_token": TOKEN}
        return httpx.Response(200, json={"state": "PREPARED", "incarnation": "inc1", **receipt})

    sender = StubSender()
    audit = AuditLog()
    c = client(handler, transport=CollectiveTransport(sender), audit=audit)  # type: ignore[arg-type]
    assert not hasattr(c, "collective_connect")  # no transport's setup is a method of the client
    receipt = await c.begin(BEGIN)
    assert receipt.state == "PREPARED" and sender.incarnations == ["inc1"]
    assert [path for path, _ in seen] == [p.Routes.COLLECTIVE_CONNECT, p.Routes.BEGIN]
    assert seen[0][1] == {"group_id": "g1", "init_method": "tcp://127.0.0.1:1234", "backend": "gloo"}
    assert seen[1][1]["transport"] == "collective"
    assert seen[1][1]["channel"] == "g1"  # the begin names the group it will be sent over
    assert audit.ops() == ["collective_connect", "begin"]  # audited like every control call


def test_a_begin_names_a_channel_only_with_an_out_of_band_transport() -> None:
    """``BeginRequest.channel`` (the collective: the sender's group) travels as JSON; with HTTP,
    which has no channel, it is an INVALID_REQUEST, not a field silently ignored."""
    body = BEGIN.model_dump(mode="json")
    assert body["channel"] is None
    over_group = p.parse_model(p.BeginRequest, {**body, "transport": "collective", "channel": "g1"})
    assert over_group.channel == "g1"
    with pytest.raises(LoraVersionError) as err:
        p.parse_model(p.BeginRequest, {**body, "channel": "g1"})
    assert err.value.code is ErrorCode.INVALID_REQUEST and "channel" in err.value.message
