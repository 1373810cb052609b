"""Pure-logic tests of sessions through a gateway (``relax_glue.gateway``).

The engines are ``_fake_engine.FakeEngine`` doubles behind the REAL engine clients; the gateway
is a routing double (one engine per routing key, named back in ``x-smg-routed-worker-id``, as
smg 1.13.0 does). The real gateway in front of real engines is in test_gateway_engines.py.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterator

import httpx
import pytest
from _eventually import eventually
from _fake_engine import Cluster, make_cluster, make_snapshot
from _in_process_world import InProcessWorld
from _rg_helpers import EPOCH, new_registry

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.engine_client import EngineClient, OutcomeUnknown
from relax_glue.gateway import (
    GATEWAY_ID,
    ROUTED_WORKER_HEADER,
    ROUTING_KEY_HEADER,
    GatewayClient,
    gateway_command,
)
from relax_glue.router import StickyRoundRobinRouter
from relax_glue.sessions import SessionManager

BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def test_the_launch_line_disables_retries_and_hashes_the_routing_key() -> None:
    cmd = gateway_command(["http://a:1", "http://b:2"], port=9000, metrics_port=9001)
    assert cmd[:2] == ["smg", "launch"]
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == [
        "http://a:1",
        "http://b:2",
    ]
    assert cmd[cmd.index("--policy") + 1] == "consistent_hashing"
    assert "--disable-retries" in cmd
    assert cmd[cmd.index("--prometheus-port") + 1] == "9001"
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert "--disable-retries" not in gateway_command(["http://a:1"], port=1, retries=True)
    with pytest.raises(ValueError):
        gateway_command([], port=1)


class FakeGateway:
    """Routes /generate by the routing key (a stable hash, like consistent hashing) to one of
    the fake engines and names it back; it has no /abort_request, like smg."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.ids = sorted(cluster.fakes)
        self.keys: list[str | None] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return httpx.Response(404, json={"error": {"code": "unknown_url"}})
        key = request.headers.get(ROUTING_KEY_HEADER)
        self.keys.append(key)
        engine = self.ids[zlib.crc32((key or "").encode()) % len(self.ids)]
        reply = await self.cluster.fakes[engine].handle(request)
        headers = {**reply.headers, ROUTED_WORKER_HEADER: self.cluster.clients[engine].base_url}
        return httpx.Response(reply.status_code, headers=headers, content=reply.content)


class GatewayWorld(InProcessWorld):
    """The in-process world with its sessions generating through a fake gateway."""

    def __init__(self) -> None:
        super().__init__()
        self.fake_gw = FakeGateway(self.cluster)
        self.gw = GatewayClient("http://gateway.fake", self.cluster.clients)
        self.gw.client = EngineClient(
            GATEWAY_ID,
            "http://gateway.fake",
            audit=self.gw.client.audit,
            generation_transport=httpx.MockTransport(self.fake_gw.handle),
            control_transport=httpx.MockTransport(self.fake_gw.handle),
        )
        self.mgr = self.sessions(gateway=self.gw, drain_timeout_s=2.0)

    async def publish(self, vid: str) -> str:
        snap = make_snapshot(seed=7)
        assert (await self.pub.publish(snap, vid)).ok
        return snap.lora_name("relax_policy_lora", EPOCH, vid)


@pytest.fixture()
def gw_world() -> Iterator[GatewayWorld]:
    w = GatewayWorld()
    yield w
    w.assert_no_stop_the_world()


async def test_a_session_generates_through_the_gateway_with_its_key_and_exact_version(gw_world) -> None:
    w = gw_world
    name = await w.publish("A")
    # Keys carry a random nonce: 24 sessions all hashed to one of two engines is a 2**-23 chance
    # (8 sessions made it a 1-in-128 flake).
    sessions = [await w.mgr.open(f"s{i}") for i in range(24)]
    for _ in range(3):
        for s in sessions:
            await s.generate(BODY)
    for s in sessions:
        engines = {r.engine_id for r in s.requests}
        assert len(engines) == 1 and engines <= set(w.cluster.fakes), engines  # named, not "gateway"
        assert {r.lora_path for r in s.requests} == {name}
        assert w.mgr.router.pick(s.key) in engines
    # every request carried its session's key; no generation went to an engine client directly
    assert set(w.fake_gw.keys) == {str(s.key) for s in sessions}
    assert len(w.gw.client.audit.entries(kind="generation")) == 3 * len(sessions)
    assert not [e for e in w.cluster.audit.entries() if e.kind == "generation"]
    assert len({r.engine_id for s in sessions for r in s.requests}) == 2  # the hash spread them


async def test_an_abort_goes_to_the_engine_the_gateway_named(gw_world) -> None:
    w = gw_world
    await w.publish("A")
    s = await w.mgr.open("s")
    await s.generate(BODY, rid="done")
    engine = s.requests[-1].engine_id
    other = next(e for e in w.cluster.fakes if e != engine)
    await w.gw.route(s.key).abort_request("done")  # a late abort: a no-op there, but only there
    assert [a["rid"] for a in w.cluster.fakes[engine].aborts] == ["done"]
    assert w.cluster.fakes[other].aborts == []


async def test_a_turn_not_yet_named_is_aborted_on_every_engine_on_close(gw_world) -> None:
    """The gateway names the engine with the reply's headers; a turn held before them (or whose
    reply never came) is aborted by rid everywhere, so close never leaves it running."""
    w = gw_world
    await w.publish("A")
    s = await w.mgr.open("s")
    for f in w.cluster.fakes.values():
        f.hold_generations()
    held = asyncio.ensure_future(s.generate(BODY, rid="held"))
    await eventually(
        lambda: any(b.get("rid") == "held" for f in w.cluster.fakes.values() for b in f.generations)
    )
    await s.close()
    assert (await held)["meta_info"]["finish_reason"]["type"] == "abort"
    assert all("held" in [a["rid"] for a in f.aborts] for f in w.cluster.fakes.values())


async def test_an_abort_of_a_turn_the_gateway_never_named_goes_to_every_engine(gw_world) -> None:
    w = gw_world
    await w.gw.abort_request("never-seen")
    assert all([a["rid"] for a in f.aborts] == ["never-seen"] for f in w.cluster.fakes.values())


async def test_a_refusal_names_the_engine_that_refused_not_the_gateway(gw_world) -> None:
    w = gw_world
    await w.publish("A")
    s = await w.mgr.open("s")
    await s.generate(BODY)
    engine = s.requests[-1].engine_id
    with pytest.raises(LoraVersionError) as err:
        await w.gw.route(s.key).generate({**BODY, "rid": "forged", "lora_id": "0" * 32})
    assert err.value.code is ErrorCode.FORBIDDEN_FIELD
    assert err.value.details["engine_id"] == engine


async def test_an_unreachable_gateway_is_an_unknown_outcome_not_a_refusal() -> None:
    cluster = make_cluster()
    gw = GatewayClient("http://127.0.0.1:9", cluster.clients)  # nothing listens on port 9
    try:
        with pytest.raises(OutcomeUnknown) as err:
            await gw.route("k").generate({**BODY, "rid": "r1"})
        assert err.value.engine_id == GATEWAY_ID and not err.value.maybe_sent
    finally:
        await gw.aclose()
        await cluster.aclose()


def test_a_gateway_and_a_router_together_are_refused() -> None:
    cluster = make_cluster()
    gw = GatewayClient("http://gateway.fake", cluster.clients)
    with pytest.raises(ValueError, match="not both"):
        SessionManager(new_registry(), cluster.clients, gateway=gw, router=StickyRoundRobinRouter(["E0"]))


def test_the_served_by_memory_is_bounded() -> None:
    cluster = make_cluster()
    gw = GatewayClient("http://gateway.fake", cluster.clients, remember=3)
    url = cluster.clients["E1"].base_url
    for i in range(5):
        gw._note_reply("k", f"r{i}", httpx.Response(200, headers={ROUTED_WORKER_HEADER: url + "/"}))
    assert [gw.served_by(f"r{i}") for i in range(5)] == [None, None, "E1", "E1", "E1"]
    gw._note_reply("k2", "r9", httpx.Response(200, headers={ROUTED_WORKER_HEADER: "http://elsewhere:1"}))
    assert gw.served_by("r9") is None and gw.pick("k2") == GATEWAY_ID  # not a cohort engine
    assert gw.pick("k") == "E1"
    gw.forget("k")
    assert gw.pick("k") == GATEWAY_ID
