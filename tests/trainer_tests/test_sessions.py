"""Pure-logic tests of the session layer (RFC 4): first-bind once, exact lora_path, close.

The registry is the REAL ``LoRAVersionRegistry`` (checked by ``_rg_helpers.Checked``) behind a
``GatedRegistry`` test double that only counts calls and can hold one op before or after it runs;
the engines are ``_fake_engine.FakeEngine`` doubles driven through the REAL ``EngineClient``.
No engine runs; these tests prove the session logic, not SGLang.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from _eventually import eventually
from _fake_engine import Cluster, make_cluster, make_snapshot
from _in_process_world import InProcessWorld
from _rg_helpers import EPOCH, new_registry

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import EngineVersionState
from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.actor import AsyncRegistryClient
from relax_glue.engine_client import OutcomeUnknown
from relax_glue.registry import PUBLIC_OPS, LoRAVersionRegistry
from relax_glue.registry_types import SessionState, VersionKey
from relax_glue.router import StickyRoundRobinRouter
from relax_glue.sessions import Session, SessionManager, SessionPhase, TurnOutcomeUnknown

SNAP = {name: make_snapshot(seed=i) for i, name in enumerate("AB")}
BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def name_of(vid: str) -> str:
    return SNAP[vid].lora_name("relax_policy_lora", EPOCH, vid)


class GatedRegistry:
    """Test double around the REAL registry (sync or async client): counts calls per op; an op
    in ``before`` waits for its event before it runs, one in ``after`` runs and then waits."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()
        self.before: dict[str, asyncio.Event] = {}
        self.after: dict[str, asyncio.Event] = {}
        self.arrived: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in PUBLIC_OPS:
            return attr

        async def call(**kwargs: Any) -> Any:
            self.calls[name] += 1
            self.arrived[name].set()
            if name in self.before:
                await self.before[name].wait()
            result = attr(**kwargs)
            if inspect.isawaitable(result):
                result = await result
            if name in self.after:
                await self.after[name].wait()
            return result

        return call


class World(InProcessWorld):
    """``reg`` the real registry, ``gated`` the sessions' view of it; ``engines`` the clients new
    session managers take (a test wraps one there)."""

    def __init__(self, core: Any, cluster: Cluster) -> None:
        super().__init__(registry=core, cluster=cluster)
        self.gated = GatedRegistry(core)
        self.mgr = self.sessions(self.gated, self.engines, drain_timeout_s=2.0, abort_interval_s=0.02)

    async def publish(self, vid: str) -> None:
        assert (await self.pub.publish(SNAP[vid], vid)).ok

    def refs(self, vid: str) -> int:
        return self.reg.version(VersionKey(EPOCH, vid)).session_refs

    def sent(self, session: Session) -> list[dict[str, Any]]:
        rids = {r.rid for r in session.requests}
        return [b for f in self.fakes.values() for b in f.generations if b.get("rid") in rids]


@pytest.fixture()
def world() -> Iterator[World]:
    w = World(new_registry(), make_cluster())
    yield w
    w.assert_no_stop_the_world()


async def expect(code: ErrorCode, aw: Any) -> LoraVersionError:
    with pytest.raises(LoraVersionError) as exc:
        await aw
    assert exc.value.code is code, exc.value
    return exc.value


# ------------------------------------------------------------------------------- binding


@pytest.mark.parametrize("flavour", ["memory", "async_client"])
async def test_first_generation_binds_once_under_concurrency(flavour: str) -> None:
    core = LoRAVersionRegistry(EPOCH, ("E0", "E1"))
    client = AsyncRegistryClient.in_process(core) if flavour == "async_client" else None
    try:
        w = World(client or core, make_cluster())
        await w.publish("A")
        s = await w.mgr.open("agent")
        assert s.phase is SessionPhase.OPEN and s.binding is None  # no version at creation
        assert core.session(s.key).state is SessionState.OPEN
        w.gated.before["bind_first"] = gate = asyncio.Event()
        turns = [asyncio.create_task(s.generate(BODY)) for _ in range(20)]
        await w.gated.arrived["bind_first"].wait()
        await asyncio.sleep(0.01)  # let every waiter pile up on the shared task
        gate.set()
        outs = await asyncio.gather(*turns)
        assert w.gated.calls["bind_first"] == 1 and s.bind_calls == 1
        assert {o["meta_info"]["lora_path"] for o in outs} == {name_of("A")}
        assert [b["lora_path"] for b in w.sent(s)] == [name_of("A")] * 20
        assert core.version(VersionKey(EPOCH, "A")).session_refs == 1
    finally:
        if client is not None:
            client.close()


async def test_cancelling_a_waiter_never_cancels_the_binding(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    world.gated.after["bind_first"] = gate = asyncio.Event()  # bound in the registry, reply delayed
    first = asyncio.create_task(s.generate(BODY))
    await world.gated.arrived["bind_first"].wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    task = s._bind_task
    assert task is not None and not task.done()  # the shared binding lives on
    second = asyncio.create_task(s.generate(BODY))
    await asyncio.sleep(0.01)
    await world.publish("B")  # a newer default must not matter to this session
    gate.set()
    out = await second
    assert out["meta_info"]["lora_path"] == name_of("A")
    assert world.gated.calls["bind_first"] == 1 and world.refs("A") == 1 and world.refs("B") == 0
    assert [b["lora_path"] for b in world.sent(s)] == [name_of("A")]  # the cancelled turn never sent


async def test_a_binding_whose_only_waiter_was_cancelled_still_completes(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    world.gated.before["bind_first"] = gate = asyncio.Event()
    only = asyncio.create_task(s.generate(BODY))
    await world.gated.arrived["bind_first"].wait()
    only.cancel()
    await asyncio.gather(only, return_exceptions=True)
    gate.set()
    await asyncio.sleep(0.01)
    assert s.binding is not None and s.lora_path == name_of("A") and world.refs("A") == 1
    await s.generate(BODY)
    assert world.gated.calls["bind_first"] == 1


async def test_no_published_version_is_a_typed_error_and_a_later_turn_binds(world: World) -> None:
    s = await world.mgr.open()
    await expect(ErrorCode.NO_PUBLISHED_VERSION, s.generate(BODY))
    assert s.binding is None and world.sent(s) == [] and all(not f.generations for f in world.fakes.values())
    await world.publish("A")
    out = await s.generate(BODY)
    assert out["meta_info"]["lora_path"] == name_of("A")
    assert s.bind_calls == 2 and world.refs("A") == 1  # the failed bind held nothing


# ------------------------------------------------------------------------------ requests


async def test_every_request_carries_the_bound_lora_path_through_turns_retries_abort_resume(
    world: World,
) -> None:
    await world.publish("A")
    s_old = await world.mgr.open("old")
    await s_old.generate(BODY)  # turn 1 binds A
    await world.publish("B")
    s_new = await world.mgr.open("new")
    await s_new.generate(BODY)
    await s_old.generate({**BODY, "input_ids": [1, 2, 3, 9, 9]})  # tool turn
    await s_old.generate(BODY, rid="retry-1")  # an explicit retry is a new backend attempt

    engine = world.mgr.router.pick(s_old.key)
    world.fakes[engine].hold_generations()
    turn = asyncio.create_task(s_old.generate(BODY, rid="to-abort"))
    await eventually(lambda: "to-abort" in world.fakes[engine]._running)  # admitted by the engine
    assert s_old.in_flight == ("to-abort",)
    assert await s_old.abort("to-abort")  # temporary abort: the binding stays
    aborted = await turn
    world.fakes[engine].release_generations()
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert {"rid": "to-abort", "abort_all": False} in world.fakes[engine].aborts
    assert not await s_old.abort("to-abort")  # finished: nothing to abort
    await s_old.generate(BODY)  # resume

    assert {b["lora_path"] for b in world.sent(s_old)} == {name_of("A")} and len(world.sent(s_old)) == 5
    assert {b["lora_path"] for b in world.sent(s_new)} == {name_of("B")}
    assert s_old.bind_calls == 1 and s_old.lora_path == name_of("A") and s_new.lora_path == name_of("B")
    # Session-sticky round robin: each session stays on its engine; the two sessions differ.
    assert {r.engine_id for r in s_old.requests} == {engine}
    assert {r.engine_id for r in s_new.requests} == {world.mgr.router.pick(s_new.key)} != {engine}
    assert all(r.outcome == "ok" for r in s_old.requests if r.rid != "to-abort")


async def test_streaming_carries_the_bound_lora_path(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    chunks = [c async for c in s.generate_stream(BODY)]
    assert chunks[-1]["meta_info"]["lora_path"] == name_of("A")
    assert [b["lora_path"] for b in world.sent(s)] == [name_of("A")] and s.requests[-1].outcome == "ok"


async def test_version_errors_surface_typed_without_fallback(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    await s.generate(BODY)
    engine = world.mgr.router.pick(s.key)
    fake = world.fakes[engine]
    fake.versions[name_of("A")].state = EngineVersionState.RECLAIMING  # as if unregistered
    await expect(ErrorCode.VERSION_RECLAIMED, s.generate(BODY))
    fake.restart()  # the engine lost every adapter
    await expect(ErrorCode.UNKNOWN_VERSION, s.generate(BODY))
    # Exactly one backend request per turn, always the bound name: no base, no latest, no retry.
    assert [b["lora_path"] for b in fake.generations] == [name_of("A")]  # refused ones were not admitted
    assert [r.outcome for r in s.requests] == ["ok", "refused:VERSION_RECLAIMED", "refused:UNKNOWN_VERSION"]
    assert [op for op in fake.ops() if op == "generate"] == ["generate"] * 3
    assert s.lora_path == name_of("A") and s.bind_calls == 1


async def test_a_maybe_admitted_turn_is_never_resent_blindly(world: World) -> None:
    """RFC 4.2 (issue 10): the reply of an admitted turn is lost. The session raises the typed
    TurnOutcomeUnknown with the rid, sent once; further turns are refused until the caller
    decides; resend() aborts the old rid and sends the same body once more, same binding.
    (Before: the next generate() silently went out again, a possible duplicated turn.)"""
    await world.publish("A")
    for e in ("E0", "E1"):
        world.engines[e] = FaultInjectingClient(world.cluster.clients[e]).drop_reply("generate", nth=1)
    mgr = SessionManager(world.gated, world.engines)
    s = await mgr.open()
    with pytest.raises(TurnOutcomeUnknown) as e:
        await s.generate(BODY, rid="r1")
    assert e.value.rid == "r1" and e.value.lora_path == name_of("A") and s.unknown_turns == ("r1",)
    engine = mgr.router.pick(s.key)
    fake = world.fakes[engine]
    assert fake.ops("generate") == ["generate"]  # sent once, never re-sent
    assert s.requests[-1].outcome == "unknown" and s.requests[-1].rid == "r1"
    err = await expect(ErrorCode.INVALID_REQUEST, s.generate(BODY))
    assert err.details["unknown_rids"] == ["r1"] and fake.ops("generate") == ["generate"]
    out = await s.resend("r1")  # the caller's explicit decision
    assert out["meta_info"]["lora_path"] == name_of("A") and out["meta_info"]["id"] == "r1.resend1"
    assert {"rid": "r1", "abort_all": False} in fake.aborts  # the old rid aborted first
    assert [g["rid"] for g in fake.generations] == ["r1", "r1.resend1"]
    assert s.unknown_turns == () and (await s.generate(BODY))["meta_info"]["lora_path"] == name_of("A")


async def test_discard_gives_up_the_unknown_turn_and_the_session_goes_on(world: World) -> None:
    await world.publish("A")
    for e in ("E0", "E1"):
        world.engines[e] = FaultInjectingClient(world.cluster.clients[e]).drop_reply("generate", nth=1)
    mgr = SessionManager(world.gated, world.engines)
    s = await mgr.open()
    with pytest.raises(TurnOutcomeUnknown):
        await s.generate(BODY, rid="r1")
    await expect(ErrorCode.INVALID_REQUEST, s.resend("nope"))
    await s.discard("r1")
    assert s.unknown_turns == ()
    await expect(ErrorCode.INVALID_REQUEST, s.discard("r1"))  # settled once
    assert (await s.generate(BODY, rid="r2"))["meta_info"]["id"] == "r2"
    assert [g["rid"] for g in world.fakes[mgr.router.pick(s.key)].generations] == ["r1", "r2"]


async def test_a_request_that_never_left_is_sent_again_automatically(world: World) -> None:
    """Nothing was admitted (the request failed before it was sent): re-sent within the bound."""
    await world.publish("A")
    for e in ("E0", "E1"):
        world.engines[e] = FaultInjectingClient(world.cluster.clients[e]).fail_before_send("generate", nth=1)
    mgr = SessionManager(world.gated, world.engines, resend_interval_s=0.0)
    s = await mgr.open()
    out = await s.generate(BODY, rid="r1")
    assert out["meta_info"]["id"] == "r1" and s.resends == 1 and s.unknown_turns == ()
    assert [g["rid"] for g in world.fakes[mgr.router.pick(s.key)].generations] == ["r1"]  # once


async def test_a_queue_full_503_is_sent_again_but_any_other_503_is_an_unknown_turn(world: World) -> None:
    """SGLang's scheduler turns a request away with 503 "The request queue is full." before
    running it: nothing was admitted, so the session sends it again (bounded). Any other 503
    proves nothing and is a TurnOutcomeUnknown."""
    from relax_glue.engine_client import QUEUE_FULL_MESSAGE

    await world.publish("A")
    mgr = SessionManager(world.gated, world.engines, resend_interval_s=0.0)
    s = await mgr.open()
    await s.generate(BODY)
    fake = world.fakes[mgr.router.pick(s.key)]
    fake.fail("generate", status=503, message=QUEUE_FULL_MESSAGE)
    fake.fail("generate", nth=2, status=503, message=QUEUE_FULL_MESSAGE)
    out = await s.generate(BODY, rid="q1")
    assert out["meta_info"]["id"] == "q1" and s.resends == 2
    fake.fail("generate", status=503, message="The server is overloaded.")
    with pytest.raises(TurnOutcomeUnknown):
        await s.generate(BODY, rid="q2")
    assert s.unknown_turns == ("q2",)


async def test_a_broken_stream_is_an_unknown_turn(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    await s.generate(BODY)
    engine = world.mgr.router.pick(s.key)
    attested = world.fakes[engine]._attested

    async def broken(body: Any) -> Any:
        yield {"text": "x", "output_ids": [1], "meta_info": attested({"id": body["rid"]}, name_of("A"), 1)}
        raise OutcomeUnknown(engine, "generate_stream", "stream ended without [DONE]")

    world.mgr.engines[engine] = type(
        "Broken", (), {"generate_stream": staticmethod(broken), "engine_id": engine}
    )()
    with pytest.raises(TurnOutcomeUnknown) as e:
        async for _ in s.generate_stream(BODY, rid="st1"):
            pass
    assert e.value.rid == "st1" and s.unknown_turns == ("st1",)
    world.mgr.engines[engine] = world.cluster.clients[engine]


async def test_bodies_that_would_escape_the_binding_are_refused_before_anything(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    await expect(ErrorCode.FORBIDDEN_FIELD, s.generate({**BODY, "lora_id": "victim"}))
    await expect(ErrorCode.INVALID_REQUEST, s.generate({"text": ["a", "b"]}))
    await expect(ErrorCode.INVALID_REQUEST, s.generate({**BODY, "sampling_params": {"n": 2}}))  # sample()
    await expect(ErrorCode.INVALID_REQUEST, s.generate({**BODY, "stream": True}))
    assert world.gated.calls["bind_first"] == 0  # nothing bound for a refused request
    await expect(ErrorCode.INVALID_REQUEST, s.generate({**BODY, "lora_path": name_of("B")}))
    out = await s.generate({**BODY, "lora_path": name_of("A")})  # the bound name itself is fine
    assert out["meta_info"]["lora_path"] == name_of("A")
    assert [b["lora_path"] for b in world.sent(s)] == [name_of("A")]


# ------------------------------------------------------------- what served each reply (issue 39)


async def test_the_attested_version_is_checked_and_recorded_on_every_reply(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    await s.generate(BODY)
    [c async for c in s.generate_stream(BODY)]
    await s.sample(BODY, 3)
    assert [r.served for r in s.requests] == [(name_of("A"),)] * 3
    assert s.served_mismatches == 0 and world.mgr.served_mismatches == 0


@pytest.mark.parametrize(
    ("instead", "said"),
    [("B", "relax_policy_lora@"), ("", "by base"), (None, "no 'lora_versions'")],
    ids=["another-version", "base-model", "nothing-attested"],
)
@pytest.mark.parametrize("path", ["generate", "stream", "sample"])
async def test_a_reply_served_by_anything_but_the_binding_is_a_typed_error(
    world: World, path: str, instead: str | None, said: str
) -> None:
    """The engine attests another version, the base model, or nothing: never handed on as the
    binding's, counted, and the session (its binding, its ref) goes on unchanged."""
    await world.publish("A")
    s = await world.mgr.open()
    await s.bind()
    await world.publish("B")
    engine = world.fakes[world.mgr.router.pick(s.key)]
    engine.serve_instead[name_of("A")] = name_of("B") if instead == "B" else instead
    turn = {
        "generate": lambda: s.generate(BODY, rid="r1"),
        "stream": lambda: _drain(s.generate_stream(BODY, rid="r1")),
        "sample": lambda: s.sample(BODY, 2, rid="r1"),
    }[path]
    err = await expect(ErrorCode.SERVED_VERSION_MISMATCH, turn())
    assert said in err.message and err.details["rid"] == "r1" and err.details["bound"] == name_of("A")
    assert s.served_mismatches == 1 and world.mgr.served_mismatches == 1
    assert s.requests[-1].outcome == "refused:SERVED_VERSION_MISMATCH"
    engine.serve_instead.clear()  # the engine is fixed: the same session goes on, on A
    await s.generate(BODY)
    assert s.lora_path == name_of("A") and s.requests[-1].served == (name_of("A"),)
    assert world.refs("A") == 1 and world.refs("B") == 0 and s.in_flight == ()


async def _drain(chunks: Any) -> list[dict[str, Any]]:
    return [c async for c in chunks]


# ------------------------------------------------------------------- groups of completions


async def test_sample_sends_one_request_for_n_completions_all_on_the_bound_version(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    outs = await s.sample(BODY, 4, rid="g1")
    assert len(outs) == 4 and all(o["meta_info"]["lora_path"] == name_of("A") for o in outs)
    assert all(o["meta_info"]["id"].startswith("g1_0-") for o in outs)
    (sent,) = world.sent(s)  # one request, not four
    assert sent["sampling_params"]["n"] == 4 and sent["lora_path"] == name_of("A")
    assert world.gated.calls["bind_first"] == 1
    await world.publish("B")  # the session keeps A for every later group
    again = await s.sample(BODY, 2)
    assert [o["meta_info"]["lora_path"] for o in again] == [name_of("A")] * 2
    assert all(f.native.in_flight_by_name == collections.Counter() for f in world.fakes.values())


@pytest.mark.parametrize("n", [0, -1, True, 2.0, "2"])
async def test_a_bad_n_is_refused_before_anything(world: World, n: Any) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    await expect(ErrorCode.INVALID_REQUEST, s.sample(BODY, n))
    await expect(ErrorCode.INVALID_REQUEST, s.generate({**BODY, "sampling_params": {"n": n}}))
    assert world.gated.calls["bind_first"] == 0 and world.sent(s) == []


async def bound_session_on_a_held_engine(world: World) -> tuple[Session, str]:
    """A session bound to A whose engine holds every generation from now on (until released)."""
    await world.publish("A")
    s = await world.mgr.open()
    await s.generate(BODY)
    engine = world.mgr.router.pick(s.route_key)
    world.fakes[engine].hold_generations()
    return s, engine


async def test_close_aborts_a_group_in_flight_by_its_rid_and_releases(world: World) -> None:
    s, engine = await bound_session_on_a_held_engine(world)
    group = asyncio.create_task(s.sample(BODY, 3, rid="grp"))
    await eventually(lambda: world.fakes[engine].native.in_flight_by_name[name_of("A")] == 3)
    view = await s.close()
    outs = await group
    world.fakes[engine].release_generations()
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
    assert world.fakes[engine].aborts == [{"rid": "grp", "abort_all": False}]
    assert s.requests[-1].outcome == "aborted"
    assert view.released and world.refs("A") == 0
    assert world.fakes[engine].native.in_flight_by_name[name_of("A")] == 0
    # with a request in flight the close fences the registry before it aborts (not idle)
    assert world.gated.calls["begin_close"] == 1 and world.gated.calls["close_and_release"] == 1


async def test_sessions_of_one_group_share_one_engine_and_keep_their_own_binding_and_close(
    world: World,
) -> None:
    """A GRPO group as G sessions: routed together (one engine, one prefix), bound and closed
    each on its own; the group's route is forgotten only with its last session."""
    await world.publish("A")
    members = [await world.mgr.open(f"m{i}", group="prompt-7") for i in range(4)]
    loner = await world.mgr.open("loner")
    for m in members[:2]:
        await m.generate(BODY)
    await world.publish("B")  # members binding later get B: a binding stays per session
    for m in [*members[2:], loner]:
        await m.generate(BODY)
    engines = {r.engine_id for m in members for r in m.requests}
    assert len(engines) == 1 and {m.route_key for m in members} == {members[0].route_key}
    assert [m.lora_path for m in members] == [name_of("A")] * 2 + [name_of("B")] * 2
    await members[0].close()
    later = await members[1].generate(BODY)
    assert {r.engine_id for r in members[1].requests} == engines and later["meta_info"][
        "lora_path"
    ] == name_of("A")
    for m in members[1:]:
        await m.close()
    assert world.refs("A") == 0 and world.refs("B") == 1  # the loner still holds B
    assert members[0].route_key not in world.mgr.router._assigned  # the last member took the route
    await expect(ErrorCode.INVALID_REQUEST, world.mgr.open("x", group=""))


def test_router_is_sticky_round_robin() -> None:
    router = StickyRoundRobinRouter(["E0", "E1"])
    assert [router.pick(k) for k in ("a", "b", "c", "a", "b")] == ["E0", "E1", "E0", "E0", "E1"]
    router.forget("a")
    assert router.pick("a") == "E1"
    with pytest.raises(ValueError):
        StickyRoundRobinRouter(["E0", "E0"])


# --------------------------------------------------------------------------------- close


async def test_close_before_bind_leaves_a_closed_tombstone(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    view = await s.close()
    assert view.state is SessionState.CLOSED and view.binding is None and not view.released
    assert s.phase is SessionPhase.CLOSED and world.mgr.get(s.key) is None
    await expect(ErrorCode.SESSION_CLOSED, s.generate(BODY))
    assert world.gated.calls["bind_first"] == 0 and world.sent(s) == []
    with pytest.raises(LoraVersionError) as exc:  # a late bind is refused by the registry too
        world.reg.bind_first(s.key)
    assert exc.value.code is ErrorCode.SESSION_CLOSED
    assert world.refs("A") == 0


async def test_close_is_exactly_once_under_concurrency(world: World) -> None:
    await world.publish("A")
    s = await world.mgr.open()
    await s.generate(BODY)
    assert world.refs("A") == 1
    views = await asyncio.gather(*(s.close() for _ in range(5)))
    assert len(set(views)) == 1 and views[0].released and views[0].state is SessionState.CLOSED
    # idle (nothing in flight, the bind done): nothing to fence, so one registry call
    assert world.gated.calls["begin_close"] == 0 and world.gated.calls["close_and_release"] == 1
    assert await s.close() == views[0] and world.gated.calls["close_and_release"] == 1
    assert world.refs("A") == 0 and world.mgr.sessions == {}



@pytest.mark.parametrize("where", ["before", "after"])
async def test_close_while_the_binding_is_in_flight(world: World, where: str) -> None:
    """``before``: bind_first reaches the registry after begin_close (refused, no ref taken);
    ``after``: it bound before begin_close and its reply is late (the ref is released once)."""
    await world.publish("A")
    s = await world.mgr.open()
    gate = asyncio.Event()
    (world.gated.before if where == "before" else world.gated.after)["bind_first"] = gate
    turn = asyncio.create_task(s.generate(BODY))
    await world.gated.arrived["bind_first"].wait()
    closing = asyncio.create_task(s.close())
    await world.gated.arrived["begin_close"].wait()
    await asyncio.sleep(0.01)
    assert s.phase is SessionPhase.FINALIZING and not closing.done()  # waits for the binding
    assert world.gated.calls["close_and_release"] == 0
    gate.set()
    view = await closing
    await expect(ErrorCode.SESSION_CLOSED, turn)  # no dispatch once FINALIZING
    assert world.sent(s) == [] and all(not f.generations for f in world.fakes.values())
    assert view.state is SessionState.CLOSED and view.released is (where == "after")
    assert world.refs("A") == 0 and world.gated.calls["close_and_release"] == 1


@pytest.mark.timeout(30)  # a broken close rule hangs here: fail in seconds, not at the suite's 900 s
async def test_close_aborts_requests_already_sent_then_releases(world: World) -> None:
    s, engine = await bound_session_on_a_held_engine(world)
    turn = asyncio.create_task(s.generate(BODY, rid="long"))
    await asyncio.sleep(0.01)
    view = await s.close()
    out = await turn
    world.fakes[engine].release_generations()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert world.fakes[engine].aborts == [{"rid": "long", "abort_all": False}]
    assert view.released and world.refs("A") == 0 and world.gated.calls["close_and_release"] == 1
    ops = [(e.op, e.detail) for e in world.cluster.audit.entries(kind="control") if e.op == "abort_request"]
    assert ops == [("abort_request", "long")]


async def test_close_releases_even_if_an_engine_never_answers_the_abort(world: World) -> None:
    await world.publish("A")
    mgr = SessionManager(world.gated, world.engines, drain_timeout_s=0.1, abort_interval_s=0.02)
    s = await mgr.open()
    await s.generate(BODY)
    engine = mgr.router.pick(s.key)
    world.fakes[engine].hold_generations()
    world.fakes[engine].fail("abort_request", 1, status=503)
    world.fakes[engine].fail("abort_request", 2, status=503)
    # The rid arrives after the aborts run out: the engine's own refcount covers it, and the
    # session ref (future requests) is released after the bounded drain.
    turn = asyncio.create_task(s.generate(BODY, rid="stuck"))
    await asyncio.sleep(0.01)
    world.fakes[engine]._running.clear()  # make the aborts miss the request
    view = await s.close()
    assert view.released and world.refs("A") == 0
    assert len(world.fakes[engine].aborts) >= 1  # retried until the drain bound
    world.fakes[engine].release_generations()
    await turn


async def test_close_all(world: World) -> None:
    await world.publish("A")
    sessions = [await world.mgr.open(f"s{i}") for i in range(4)]
    await asyncio.gather(*(s.generate(BODY) for s in sessions[:2]))
    views = await world.mgr.close_all()
    assert len(views) == 4 and all(v.state is SessionState.CLOSED for v in views)
    assert world.refs("A") == 0 and world.mgr.sessions == {}


def test_turn_outcome_unknown_survives_a_pickle_round_trip_unchanged() -> None:
    """It crosses Ray and process boundaries (a rollout worker's exception): the copy keeps every
    field of its cause. (Before: maybe_sent and admitted were dropped and the message was
    prefixed a second time.)"""
    import pickle

    cause = OutcomeUnknown(
        "E1", "generate", "HTTP 500: boom", status_code=500, maybe_sent=False, admitted=False
    )
    err = TurnOutcomeUnknown(cause, "r9", "lv-x")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is TurnOutcomeUnknown and str(copy) == str(err)
    fields = ("engine_id", "op", "cause", "status_code", "maybe_sent", "admitted", "rid", "lora_path")
    assert {f: getattr(copy, f) for f in fields} == {f: getattr(err, f) for f in fields}


# ------------------------------------------------------------- failure and concurrency paths


async def test_a_close_while_a_refused_turn_waits_to_be_resent_sends_nothing_more(world: World) -> None:
    """The turn was refused before admission (VERSION_NOT_READY, Retry-After 1 s) and waits to be
    sent again; the session closes meanwhile. The turn ends SESSION_CLOSED without its resend
    (no dispatch after close began), the close releases the ref once, nothing reached an engine."""
    await world.publish("A")
    s = await world.mgr.open("s")
    for fake in world.fakes.values():
        fake.fail("generate", 1, code=ErrorCode.VERSION_NOT_READY)
    turn = asyncio.ensure_future(s.generate(BODY, rid="r1"))
    await eventually(lambda: sum(f.calls["generate"] for f in world.fakes.values()) == 1)
    view = await s.close()
    await expect(ErrorCode.SESSION_CLOSED, turn)
    assert view.released and world.refs("A") == 0
    assert sum(f.calls["generate"] for f in world.fakes.values()) == 1  # the refused send only
    assert all(f.generations == [] for f in world.fakes.values()) and s.resends == 0


async def test_a_settle_whose_abort_reply_is_lost_keeps_the_turn_unsettled(world: World) -> None:
    """discard(rid) aborts the turn first; that abort's reply is lost, so the turn may still
    run: it stays unknown (new turns still refused) and a second discard settles it."""
    await world.publish("A")
    for e in ("E0", "E1"):
        wrapped = FaultInjectingClient(world.cluster.clients[e]).drop_reply("generate", nth=1)
        world.engines[e] = wrapped.drop_reply("abort_request", nth=1)
    mgr = SessionManager(world.gated, world.engines)
    s = await mgr.open()
    with pytest.raises(TurnOutcomeUnknown):
        await s.generate(BODY, rid="r1")
    with pytest.raises(OutcomeUnknown):
        await s.discard("r1")
    assert s.unknown_turns == ("r1",)
    await expect(ErrorCode.INVALID_REQUEST, s.generate(BODY))
    await s.discard("r1")  # the abort's reply arrives this time
    assert s.unknown_turns == () and (await s.generate(BODY, rid="r2"))["meta_info"]["id"] == "r2"
    fake = world.fakes[mgr.router.pick(s.key)]
    assert [a["rid"] for a in fake.aborts] == ["r1", "r1"]  # both aborts reached the engine


async def test_an_abort_whose_reply_is_lost_leaves_the_binding_and_the_request_accounted(
    world: World,
) -> None:
    """A temporary abort whose reply is lost raises to the caller; nothing of the session
    changes: the request still ends (here: aborted by the engine, which did get the abort), the
    binding stays, the next turn carries the same lora_path."""
    await world.publish("A")
    for e in ("E0", "E1"):
        world.engines[e] = FaultInjectingClient(world.cluster.clients[e]).drop_reply("abort_request", nth=1)
    mgr = SessionManager(world.gated, world.engines)
    s = await mgr.open()
    for fake in world.fakes.values():
        fake.hold_generations()
    turn = asyncio.ensure_future(s.generate(BODY, rid="r1"))
    await eventually(lambda: s.in_flight == ("r1",) and any(f.generations for f in world.fakes.values()))
    with pytest.raises(OutcomeUnknown):
        await s.abort("r1")
    out = await turn
    assert out["meta_info"]["finish_reason"]["type"] == "abort"  # the engine did abort it
    assert s.in_flight == () and s.lora_path == name_of("A")
    for fake in world.fakes.values():
        fake.release_generations()
    assert (await s.generate(BODY))["meta_info"]["lora_path"] == name_of("A")
    assert world.refs("A") == 1
