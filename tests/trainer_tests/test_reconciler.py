"""Restoring live versions onto a restarted engine (pure logic; the real-engine proof is in
test_publication_lifecycle_engines.py).

Engines are ``_fake_engine.FakeEngine`` doubles running the plugin's real routes and version
table behind the REAL ``EngineClient``; the registry is the REAL one (``Checked``: invariants
after every accepted call). ``FakeEngine.restart()`` is a process restart: a new incarnation
that holds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fake_engine import make_snapshot
from _in_process_world import FAST_RECLAIM, InProcessWorld
from _rg_helpers import EPOCH, new_registry, sk

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome
from relax_glue.reconciler import RestoreOutcome, wanted_versions
from relax_glue.recovery_rules import RestoreAction, restore_plan
from relax_glue.registry_types import VersionKey, VersionState
from relax_glue.sessions import SessionManager
from relax_glue.snapshot_store import SnapshotStore

S = protocol.EngineVersionState
SNAP = {name: make_snapshot(seed=i) for i, name in enumerate("ABC")}
PREFIX = "relax_policy_lora"


def name_of(vid: str) -> str:
    return SNAP[vid].lora_name(PREFIX, EPOCH, vid)


class World(InProcessWorld):
    def __init__(self, tmp: Path) -> None:
        super().__init__(store=SnapshotStore(tmp / "snapshots"), publisher_options=FAST_RECLAIM)

    async def publish(self, vid: str) -> Any:
        res = await self.pub.publish(SNAP[vid], vid)
        assert res.outcome is PublishOutcome.PUBLISHED, res
        return res

    def held(self, engine: str) -> dict[str, S]:
        return {n: v.state for n, v in self.fakes[engine].versions.items()}


@pytest.fixture()
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.assert_no_stop_the_world()


async def _two_live_versions(w: World) -> Any:
    """A committed, then B committed while a session still holds A."""
    await w.publish("A")
    w.reg.bind_first(sk("s-old"))
    await w.publish("B")
    return w.reg.status()


# ---------------------------------------------------------------------------------- pure rule


def _status(*versions: tuple[str, S, str | None]) -> protocol.EngineStatus:
    vs = [
        protocol.VersionStatus(
            lora_name=name_of(vid),
            state=state,
            digest=digest or SNAP[vid].digest,
            attempt_token="tok-x",
            incarnation="E1-i2",
            created_at=0.0,
            updated_at=0.0,
        )
        for vid, state, digest in versions
    ]
    return protocol.EngineStatus(incarnation="E1-i2", versions=tuple(vs))


async def test_restore_plan_answers_every_engine_state(world: World) -> None:
    status = await _two_live_versions(world)
    wanted = wanted_versions(status)
    assert [v.version_key.version_id for v in wanted] == ["B", "A"]  # default first

    def plan(*held: tuple[str, S, str | None]) -> list[RestoreAction]:
        return [a for _, a, _ in restore_plan(wanted, _status(*held))]

    R, H = RestoreAction.RESTORE, RestoreAction.HELD
    assert plan() == [R, R]  # a restarted engine holds nothing
    assert plan(("B", S.READY_LOCAL, None), ("A", S.READY_LOCAL, None)) == [H, H]
    assert plan(("B", S.CLEANED, None), ("A", S.LOADING, None)) == [R, RestoreAction.WAIT]
    assert plan(("B", S.PREPARED, None), ("A", S.FAILED, None)) == [RestoreAction.CLEAN_THEN_RESTORE] * 2
    other = "f" * 64
    assert plan(("B", S.READY_LOCAL, other), ("A", S.RECLAIMING, None)) == [RestoreAction.CONFLICT] * 2


# Every engine state of a wanted version, with the registry's digest and with another one:
# the whole table of restore_plan (a state missing here is a test failure, not a default).
_PLAN_SAME_DIGEST = {
    S.PREPARED: RestoreAction.CLEAN_THEN_RESTORE,
    S.LOADING: RestoreAction.WAIT,
    S.READY_LOCAL: RestoreAction.HELD,
    S.FAILED: RestoreAction.CLEAN_THEN_RESTORE,
    S.RECLAIMING: RestoreAction.CONFLICT,  # being reclaimed there: never restored over
    S.UNLOADED: RestoreAction.CONFLICT,  # reclaimed there: a version never returns
    S.CLEANED: RestoreAction.RESTORE,  # only a tombstone: nothing is held
}


async def test_restore_plan_has_one_row_for_every_engine_state_and_digest(world: World) -> None:
    status = await _two_live_versions(world)
    (want_b, _) = wanted_versions(status)
    assert set(_PLAN_SAME_DIGEST) == set(S)
    for state, action in _PLAN_SAME_DIGEST.items():
        ((_, got, _),) = restore_plan([want_b], _status(("B", state, None)))
        assert got is action, state
        # another digest under the same name: never touched, whatever its state (the engine
        # fixes a name's digest for its lifetime, a CLEANED tombstone's too)
        ((_, got, _),) = restore_plan([want_b], _status(("B", state, "f" * 64)))
        assert got is RestoreAction.CONFLICT, state
    ((_, got, vs),) = restore_plan([want_b], _status())
    assert got is RestoreAction.RESTORE and vs is None
    # another version held there changes nothing about this one
    ((_, got, _),) = restore_plan([want_b], _status(("A", S.READY_LOCAL, None)))
    assert got is RestoreAction.RESTORE


async def test_retired_versions_without_session_refs_are_not_wanted(world: World) -> None:
    await world.publish("A")
    await world.publish("B")  # A retired, nobody holds it
    assert [v.version_key.version_id for v in wanted_versions(world.reg.status())] == ["B"]


_COMMIT_ORDER = "CADBE"  # version ids that do not sort like their commits; E is the default


@pytest.mark.parametrize(
    ("held", "wanted"),
    [
        ((), ["E"]),
        (("A",), ["E", "A"]),
        (("C", "D"), ["E", "D", "C"]),
        (("C", "A", "D", "B"), ["E", "B", "D", "A", "C"]),
        (("A", "B"), ["E", "B", "A"]),
    ],
)
def test_wanted_versions_is_the_default_then_every_held_retired_version_newest_first(
    held: tuple[str, ...], wanted: list[str]
) -> None:
    """Commits in the order C, A, D, B, E; a session bound to each version in ``held`` while it
    was the default. Wanted: the default, then each retired version a session still holds, by
    commit revision from the newest. A retired version nobody holds is not wanted, RETIRED or
    RECLAIMING."""
    from _rg_helpers import Publisher as RegistryPublisher

    reg = new_registry(capacity=len(_COMMIT_ORDER))
    pub = RegistryPublisher(reg)
    for vid in _COMMIT_ORDER:
        pub.publish(vid)
        if vid in held:
            reg.bind_first(sk(f"s-{vid}"))
    unheld = [v for v in _COMMIT_ORDER[:-1] if v not in held]
    if unheld:
        reg.claim_reclaim(VersionKey(EPOCH, unheld[0]))  # one RECLAIMING, the others RETIRED
    assert [v.version_key.version_id for v in wanted_versions(reg.status())] == wanted


# ----------------------------------------------------------------------------------- restore


async def test_a_restarted_engine_gets_every_live_version_back_default_first(world: World) -> None:
    await _two_live_versions(world)
    seq = world.reg.seq
    world.fakes["E1"].restart()
    seen_before = len(world.fakes["E1"].seen)
    assert world.held("E1") == {}

    results = await world.pub.reconcile()
    by = {(r.engine_id, r.version_key.version_id): r.outcome for r in results if r.version_key}
    assert by == {
        ("E0", "B"): RestoreOutcome.HELD,
        ("E0", "A"): RestoreOutcome.HELD,
        ("E1", "B"): RestoreOutcome.RESTORED,
        ("E1", "A"): RestoreOutcome.RESTORED,
    }
    assert world.held("E1") == {name_of("B"): S.READY_LOCAL, name_of("A"): S.READY_LOCAL}
    begins = [d for o, d in world.fakes["E1"].seen[seen_before:] if o == "begin"]
    assert begins == [name_of("B"), name_of("A")]  # the default first
    for vid in "AB":
        v = world.fakes["E1"].versions[name_of(vid)]
        assert v.digest == SNAP[vid].digest and v.attempt_token.startswith("rst-")
    # The registry only learnt the new incarnation: nothing was created, committed or freed.
    assert world.reg.seq == seq + 1
    assert world.reg.status().engines["E1"] == world.fakes["E1"].incarnation
    # A second pass finds everything held: status reads only.
    calls = sum(world.fakes["E1"].calls.values())
    again = await world.pub.reconcile()
    assert {r.outcome for r in again} == {RestoreOutcome.HELD}
    assert sum(world.fakes["E1"].calls.values()) == calls + 1


async def test_a_stale_status_and_a_lost_begin_reply_never_unload_a_committed_version(world: World) -> None:
    """The double fault: the reconciler reads a stale status of E1 (taken before A was
    published there, so A looks missing) and the reply to its restore ``begin`` is lost. It then
    cleans up under its own token. The engine holds A under the attempt that committed it: the
    begin is refused (NOT_ATTEMPT_OWNER) and so is the cleanup; A stays READY there, not a single
    unload, and the session bound to A keeps being served by it."""
    fake = world.fakes["E1"]
    stale = await world.cluster.clients["E1"].status()  # E1 holds nothing yet
    await world.publish("A")
    mgr = SessionManager(world.reg, {"E1": world.cluster.clients["E1"]})
    session = await mgr.open("old")
    await session.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    held = fake.versions[name_of("A")]
    owner, lora_id = held.attempt_token, held.lora_id

    faulty = FaultInjectingClient(world.cluster.clients["E1"])
    faulty.stale_reply("status", 1, stale).drop_reply("begin", 1)
    pub = open_publisher(world.reg, {**world.cluster.clients, "E1": faulty}, store=world.store)
    results = await pub.reconcile(["E1"])
    assert [f.kind.value for f in faulty.injected] == ["STALE_REPLY", "DROP_REPLY"]

    v = fake.versions[name_of("A")]
    assert fake.unloads[name_of("A")] == 0
    assert (v.state, v.attempt_token, v.lora_id) == (S.READY_LOCAL, owner, lora_id)
    out = await session.generate({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}})
    assert session.lora_path == name_of("A") and out["output_ids"]

    (begun,) = [f for f in faulty.injected if f.op == "begin"]
    assert begun.real_outcome == "refused:NOT_ATTEMPT_OWNER"  # the engine never let it take A over
    ((_, _, outcome),) = [(r.engine_id, r.lora_name, r.outcome) for r in results]
    assert outcome is RestoreOutcome.FAILED  # it could not know; it cleaned only its own token
    cleanups = [step for step in pub.reconciler.steps if step.op == "restore_cleanup"]
    assert cleanups and "nothing of" in cleanups[-1].detail
    (again,) = await pub.reconcile(["E1"])
    assert again.outcome is RestoreOutcome.HELD
    await session.close()
    await mgr.aclose()


async def test_a_failed_restore_is_cleaned_there_and_retried_next_round(world: World) -> None:
    await _two_live_versions(world)
    fake = world.fakes["E1"]
    fake.restart()
    fake.fail("receive_bucket", nth=2, status=500, after=True)  # bucket landed, reply lost
    results = await world.pub.reconcile(["E1"])
    outcomes = {r.version_key.version_id: r.outcome for r in results}
    assert outcomes == {"B": RestoreOutcome.FAILED, "A": RestoreOutcome.RESTORED}
    # Nothing of the failed attempt is left holding a slot there; its token is tombstoned.
    assert world.held("E1") == {name_of("B"): S.CLEANED, name_of("A"): S.READY_LOCAL}
    assert fake.table.slots_in_use() == 1
    results = await world.pub.reconcile(["E1"])
    assert {r.version_key.version_id: r.outcome for r in results} == {
        "B": RestoreOutcome.RESTORED,
        "A": RestoreOutcome.HELD,
    }


async def test_an_interrupted_restore_left_on_the_engine_is_cleaned_then_redone(world: World) -> None:
    await world.publish("A")
    fake = world.fakes["E1"]
    fake.restart()
    # A restore by a trainer that died after begin: PREPARED under a token nobody remembers.
    req = SNAP["A"].begin_request(PREFIX, EPOCH, "A", "rst-died")
    await world.cluster.clients["E1"].begin(req)
    assert world.held("E1") == {name_of("A"): S.PREPARED}
    (result,) = await world.pub.reconcile(["E1"])
    assert result.outcome is RestoreOutcome.RESTORED
    assert "rst-died" in fake.cleaned
    assert fake.versions[name_of("A")].state is S.READY_LOCAL


async def test_no_valid_snapshot_means_no_restore_and_nothing_sent(world: World) -> None:
    await world.publish("A")
    fake = world.fakes["E1"]
    fake.restart()
    begun = len(fake.ops("begin"))
    entry = world.store.root / SNAP["A"].digest / "tensors.safetensors"
    data = entry.read_bytes()
    entry.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a damaged entry is never sent
    (result,) = await world.pub.reconcile(["E1"])
    assert result.outcome is RestoreOutcome.NO_SNAPSHOT and "CHECKSUM_MISMATCH" in result.detail
    assert len(fake.ops("begin")) == begun and world.held("E1") == {}
    world.store.delete(SNAP["A"].digest)
    (result,) = await world.pub.reconcile(["E1"])
    assert result.outcome is RestoreOutcome.NO_SNAPSHOT and "UNKNOWN_VERSION" in result.detail


async def test_an_engine_that_cannot_answer_is_reported_and_left_alone(world: World) -> None:
    await world.publish("A")
    world.fakes["E1"].fail("status", status=503)
    results = await world.pub.reconcile()
    assert {r.engine_id: r.outcome for r in results} == {
        "E0": RestoreOutcome.HELD,
        "E1": RestoreOutcome.UNREACHABLE,
    }


async def test_reclaim_after_a_restart_confirms_the_engine_that_holds_nothing(world: World) -> None:
    await world.publish("A")
    await world.publish("B")  # A retired without refs: not restored, reclaimed
    world.fakes["E1"].restart()
    await world.pub.reconcile()
    assert name_of("A") not in world.fakes["E1"].versions
    (res,) = await world.pub.reclaim_ready()
    assert res.done
    assert world.fakes["E0"].unloads[name_of("A")] == 1 and world.fakes["E1"].unloads[name_of("A")] == 0


# ------------------------------------------------------------------------------ the store


async def test_the_store_holds_exactly_the_live_versions(world: World) -> None:
    await world.publish("A")
    assert world.store.digests() == {SNAP["A"].digest}
    await world.publish("B")
    assert world.store.digests() == {SNAP["A"].digest, SNAP["B"].digest}  # A retired: still live
    (res,) = await world.pub.reclaim_ready()
    assert res.done and world.store.digests() == {SNAP["B"].digest}
    refused = await world.pub.publish(SNAP["C"], "B")  # same key, another digest: refused
    assert refused.outcome is PublishOutcome.REFUSED
    assert world.store.digests() == {SNAP["B"].digest}
    world.fakes["E1"].fail("end", code=ErrorCode.LOAD_FAILED)
    failed = await world.pub.publish(SNAP["C"], "C")
    assert failed.outcome is PublishOutcome.FAILED_CLEAN
    assert world.store.digests() == {SNAP["B"].digest}


async def test_a_fresh_publisher_finishes_a_pending_attempt_from_the_store(world: World) -> None:
    await world.publish("A")
    fake = world.fakes["E1"]
    statuses = len(fake.ops("status"))
    # E1 restarts after its READY, as the pre-commit status read arrives: no commit (its READY
    # is of an earlier incarnation), the attempt stays pending and E1 must be driven again.
    fake.before("status", lambda nth: fake.restart() if nth == statuses + 1 else None)
    res = await world.pub.publish(SNAP["B"], "B")
    assert res.outcome is PublishOutcome.NOT_COMMITTED, res
    assert world.reg.status().pending_attempt is not None
    # Another process: no memory of the snapshot, only the store on disk.
    fresh = world.publisher(store=SnapshotStore(world.store.root))
    done = await fresh.resolve()
    assert done is not None and done.outcome is PublishOutcome.PUBLISHED, done
    assert world.reg.status().default == VersionKey(EPOCH, "B")
    assert world.held("E1")[name_of("B")] is S.READY_LOCAL


# ------------------------------------------------------------------------ sessions wait


async def test_a_session_on_a_restarted_engine_resumes_its_exact_version(world: World) -> None:
    await world.publish("A")

    async def restore(engine_id: str, lora_path: str) -> None:
        await world.pub.reconcile([engine_id])

    sessions = SessionManager(
        world.reg, world.cluster.clients, on_version_missing=restore, resend_interval_s=0.01
    )
    s0, s1 = await sessions.open("s0"), await sessions.open("s1")  # s1 is routed to E1
    await s0.generate({"text": "hi"})
    await s1.generate({"text": "hi"})
    await world.publish("B")  # both sessions stay on A
    world.fakes["E1"].restart()
    out = await s1.generate({"text": "tool turn"})
    assert out["meta_info"]["lora_path"] == name_of("A") and out["meta_info"]["engine_id"] == "E1"
    assert s1.resends == 1 and s0.resends == 0
    sent = [g["lora_path"] for g in world.fakes["E1"].generations]
    assert sent == [name_of("A"), name_of("A")]  # never the base model, never B
    assert {r.lora_path for r in s1.requests} == {name_of("A")}
    await sessions.close_all()


async def test_without_a_recovery_hook_a_lost_version_is_a_typed_error_at_once(world: World) -> None:
    await world.publish("A")
    sessions = SessionManager(world.reg, world.cluster.clients)
    s0, s1 = await sessions.open("s0"), await sessions.open("s1")
    await s0.generate({"text": "hi"})  # the router assigns engines at first dispatch: s1 -> E1
    await s1.generate({"text": "hi"})
    world.fakes["E1"].restart()
    with pytest.raises(LoraVersionError) as e:
        await s1.generate({"text": "again"})
    assert e.value.code is ErrorCode.UNKNOWN_VERSION and s1.resends == 0
    await sessions.close_all()


async def test_a_request_during_the_restore_waits_for_ready_and_is_sent_again(world: World) -> None:
    await world.publish("A")
    sessions = SessionManager(world.reg, world.cluster.clients, not_ready_wait_s=10.0)
    s0, s1 = await sessions.open("s0"), await sessions.open("s1")
    await s0.generate({"text": "hi"})
    await s1.generate({"text": "hi"})
    fake = world.fakes["E1"]
    fake.restart()
    gate = fake.hold("end")  # the restore stops with every bucket there, before end
    restore = asyncio.ensure_future(world.pub.reconcile(["E1"]))
    await gate.arrived.wait()
    assert world.held("E1") == {name_of("A"): S.PREPARED}
    with pytest.raises(LoraVersionError) as e:
        await world.cluster.clients["E1"].generate({"text": "x", "lora_path": name_of("A")})
    assert e.value.code is ErrorCode.VERSION_NOT_READY and e.value.details["retry_after_s"] == 1
    turn = asyncio.ensure_future(s1.generate({"text": "turn 2"}))
    await asyncio.sleep(0.05)
    assert not turn.done()  # waiting, nothing admitted
    gate.release()
    (result,) = await restore
    assert result.outcome is RestoreOutcome.RESTORED
    out = await turn
    assert out["meta_info"]["lora_path"] == name_of("A") and s1.resends >= 1
    await sessions.close_all()


async def test_the_wait_is_bounded(world: World) -> None:
    await world.publish("A")
    sessions = SessionManager(world.reg, world.cluster.clients, not_ready_wait_s=0.2)
    s0, s1 = await sessions.open("s0"), await sessions.open("s1")
    await s0.generate({"text": "hi"})
    fake = world.fakes["E1"]
    fake.restart()
    await world.cluster.clients["E1"].begin(SNAP["A"].begin_request(PREFIX, EPOCH, "A", "rst-stuck"))
    with pytest.raises(LoraVersionError) as e:
        await s1.generate({"text": "hi"})
    assert e.value.code is ErrorCode.VERSION_NOT_READY
    assert world.reg.version(VersionKey(EPOCH, "A")).state is VersionState.PUBLISHED
    await sessions.close_all()


async def test_the_polling_loop_restores_without_any_request(world: World) -> None:
    await world.publish("A")
    world.fakes["E1"].restart()
    task = asyncio.ensure_future(world.pub.reconcile_forever(interval_s=0.01))
    try:
        for _ in range(300):
            if world.held("E1") == {name_of("A"): S.READY_LOCAL}:
                break
            await asyncio.sleep(0.01)
        assert world.held("E1") == {name_of("A"): S.READY_LOCAL}
    finally:
        task.cancel()


async def test_an_engine_declared_lost_gets_nothing_back(world: World) -> None:
    await world.publish("A")
    world.fakes["E1"].restart()
    world.reg.declare_engine_lost("E1", "its host is gone")
    calls = sum(world.fakes["E1"].calls.values())
    assert await world.pub.reconcile(["E1"]) == ()  # the session hook may still name it
    assert {r.engine_id for r in await world.pub.reconcile()} == {"E0"}
    assert sum(world.fakes["E1"].calls.values()) == calls and world.held("E1") == {}
