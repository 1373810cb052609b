"""The one staging driver (relax_glue.stage) that the publisher and the reconciler both run:
its call order, its stop, a replayed begin, and the send-ahead of a transport that asks for it.

Engines are ``_fake_engine.FakeEngine`` doubles running the plugin's real routes and version
table behind the REAL ``EngineClient`` (pure logic; the real-engine proofs are the publication
and reconciler engine tests)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
from _fake_engine import make_cluster, make_snapshot
from _rg_helpers import EPOCH

from lora_contract import protocol
from relax_glue.bucket_transport import BodyTransport
from relax_glue.engine_client import EngineClient
from relax_glue.registry_types import VersionKey
from relax_glue.stage import StagePlan, stage

PREFIX = "relax_policy_lora"
SNAP = make_snapshot(seed=3)
N_BUCKETS = len(list(SNAP.iter_buckets()))


def plan(token: str = "tok-1") -> StagePlan:
    return StagePlan.of(SNAP, PREFIX, VersionKey(EPOCH, "v1"), token, None)


class Recording:
    """A StageCalls that runs each phase on every engine in turn and can stop at one call."""

    def __init__(self, stop_at: tuple[str, int] | None = None) -> None:
        self.stop_at = stop_at
        self.runs: list[tuple[str, tuple[str, ...]]] = []
        self.ready_on: list[str] = []

    async def run(
        self, op: str, engines: Sequence[str], call: Callable[[str], Awaitable[Any]]
    ) -> tuple[Mapping[str, Any], str | None]:
        self.runs.append((op, tuple(engines)))
        answers = {e: await call(e) for e in engines}
        nth = sum(1 for o, _ in self.runs if o == op)
        return answers, ("stopped" if self.stop_at == (op, nth) else None)

    async def begun(self, engine: str, reply: protocol.BeginReply) -> bool:
        return not isinstance(reply, protocol.ReadyReceipt)

    async def ready(self, engine: str, receipt: protocol.ReadyReceipt) -> None:
        self.ready_on.append(engine)


async def test_begin_then_every_bucket_acknowledged_everywhere_in_order_then_end() -> None:
    cluster = make_cluster()
    calls = Recording()
    phase_s: dict[str, float] = {}
    staged = await stage(plan(), cluster.clients, ["E0", "E1"], calls, phase_s=phase_s)
    assert staged.stopped is None and staged.ready == ("E0", "E1")
    assert calls.runs == [
        ("begin", ("E0", "E1")),
        *[("receive_bucket", ("E0", "E1"))] * N_BUCKETS,
        ("end", ("E0", "E1")),
    ]
    # bucket i reached every engine before bucket i+1 reached any (RFC 3.2)
    buckets = [(e, d) for e, op, d in cluster.log if op == "receive_bucket"]
    assert [d for _, d in buckets] == [str(i) for i in range(N_BUCKETS) for _ in "01"]
    for fake in cluster.fakes.values():
        assert fake.state_of(plan().lora_name) is protocol.EngineVersionState.READY_LOCAL
    assert set(phase_s) == {"begin", "buckets", "end"}
    await cluster.aclose()


async def test_a_stop_value_ends_the_staging_where_it_was_returned() -> None:
    cluster = make_cluster()
    calls = Recording(stop_at=("receive_bucket", 2))
    staged = await stage(plan(), cluster.clients, ["E0", "E1"], calls)
    assert staged.stopped == "stopped"
    assert [op for op, _ in calls.runs] == ["begin", "receive_bucket", "receive_bucket"]
    assert not [1 for _, op, _ in cluster.log if op == "end"]  # nothing after the stop
    await cluster.aclose()


async def test_a_replayed_begin_of_a_loaded_attempt_sends_nothing_more_there() -> None:
    cluster = make_cluster()
    await stage(plan(), cluster.clients, ["E0"], Recording())
    sent = len(cluster.log)
    calls = Recording()
    staged = await stage(plan(), cluster.clients, ["E0", "E1"], calls)
    assert staged.ready == ("E1",)  # E0 answered begin with its READY receipt
    assert {e for e, op, _ in cluster.log[sent:] if op in ("receive_bucket", "end")} == {"E1"}
    await cluster.aclose()


class _AheadBody(BodyTransport):
    """A new transport is a new class: the body transport, told to send ahead (recorded)."""

    sends_ahead = True

    def __init__(self) -> None:
        self.ahead: list[tuple[str, int]] = []

    def send_ahead(self, attempt_token: str, index: int, payload: bytes) -> None:
        self.ahead.append((attempt_token, index))


async def test_a_transport_that_sends_ahead_gets_every_bucket_before_the_first_acknowledgement() -> None:
    cluster = make_cluster()
    ahead = _AheadBody()
    fake = cluster.fakes["E1"]
    clients = dict(cluster.clients)
    clients["E1"] = EngineClient(
        "E1",
        "http://e1.fake",
        transport=ahead,
        control_transport=httpx.MockTransport(fake.handle),
        generation_transport=httpx.MockTransport(fake.handle),
    )

    class Watch(Recording):
        async def run(self, op: str, engines: Sequence[str], call: Any) -> Any:
            if op == "receive_bucket" and not self.runs[1:]:
                assert len(ahead.ahead) == N_BUCKETS  # all handed over before the first ack
            return await super().run(op, engines, call)

    staged = await stage(plan("tok-ahead"), clients, ["E0", "E1"], Watch())
    assert staged.ready == ("E0", "E1")
    assert ahead.ahead == [("tok-ahead", i) for i in range(N_BUCKETS)]
    await clients["E1"].aclose()
    await cluster.aclose()
