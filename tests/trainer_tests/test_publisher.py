"""Pure-logic tests of the publisher and reclaimer (RFC 3.4 and 5.2 rows, no engine).

The engines are ``_fake_engine.FakeEngine`` test doubles (protocol semantics behind
``httpx.MockTransport``, driven through the REAL ``EngineClient``); the registry is the REAL
``LoRAVersionRegistry`` (wrapped by ``_rg_helpers.Checked``, which checks every invariant after
each accepted call and that a refused call changed nothing). Ambiguous outcomes are injected by
``FaultInjectingClient`` around the real client, or by the fake engine's scripted faults.
Real-engine end-to-end runs live elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import Any

import pytest
from _eventually import eventually
from _fake_engine import Cluster, make_cluster, make_snapshot
from _in_process_world import FAST_RECLAIM, InProcessWorld
from _rg_helpers import EPOCH, new_registry, refused, sk

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import EngineVersionState
from relax_glue.actor import AsyncRegistryClient, RegistryClient
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome, PublishResult
from relax_glue.reclaimer import EngineReclaim, EngineReclaimState, ReclaimResult
from relax_glue.registry import PUBLIC_OPS, LoRAVersionRegistry
from relax_glue.registry_types import AttemptPhase, ReclaimPhase, VersionKey, VersionState

SNAP = {name: make_snapshot(seed=i) for i, name in enumerate("ABCD")}


def rendered(result: ReclaimResult) -> dict[str, str]:
    """A reclaim result's per-engine outcomes as the CLI prints them."""
    return {e: str(outcome) for e, outcome in result.engines.items()}


def vk(vid: str) -> VersionKey:
    return VersionKey(EPOCH, vid)


def name_of(vid: str) -> str:
    return SNAP[vid].lora_name("relax_policy_lora", EPOCH, vid)


class World(InProcessWorld):
    def __init__(self, registry: Any, cluster: Cluster) -> None:
        super().__init__(registry=registry, cluster=cluster, publisher_options=FAST_RECLAIM)

    async def publish(self, vid: str) -> PublishResult:
        return await self.pub.publish(SNAP[vid], vid)

    def status(self) -> Any:
        return self.reg.status()

    def version(self, vid: str) -> Any:
        return self.reg.version(vk(vid))

    def engine_states(self, vid: str) -> dict[str, EngineVersionState | None]:
        return {e: f.state_of(name_of(vid)) for e, f in self.fakes.items()}


@pytest.fixture()
def world() -> Iterator[World]:
    w = World(new_registry(), make_cluster())
    yield w
    w.assert_no_stop_the_world()


class LossyRegistry:
    """Test double around the REAL registry: the Nth call of an op runs and its reply is lost
    (``lose``), or calls of an op fail before running (``down``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()
        self.lose: dict[str, int] = {}
        self.down: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in PUBLIC_OPS:
            return attr

        def call(**kwargs: Any) -> Any:
            self.calls[name] += 1
            if name in self.down:
                raise ConnectionError(f"registry unreachable for {name}")
            result = attr(**kwargs)
            if self.lose.get(name) == self.calls[name]:
                raise ConnectionError(f"reply of {name} lost")
            return result

        return call


# ------------------------------------------------------------------------------ happy path


@pytest.mark.parametrize("flavour", ["memory", "sync_client", "async_client"])
async def test_bootstrap_and_happy_path_on_every_registry_flavour(flavour: str) -> None:
    core = LoRAVersionRegistry(EPOCH, ("E0", "E1"))
    registry: Any = {
        "memory": core,
        "sync_client": RegistryClient.in_process(core),
        "async_client": AsyncRegistryClient.in_process(core),
    }[flavour]
    cluster = make_cluster()
    pub = open_publisher(registry, cluster.clients)
    try:
        # Bootstrap: nothing to bind before the first commit (RFC 6).
        refused(ErrorCode.NO_PUBLISHED_VERSION, core.bind_first, sk("early"))
        a = await pub.publish(SNAP["A"], "A")
        assert a.outcome is PublishOutcome.PUBLISHED and a.ok and a.error is None and a.unknown == ()
        assert a.commit is not None and a.commit.default_revision == 1 and a.commit.previous_default is None
        assert a.registry_state is VersionState.PUBLISHED and a.lora_name == name_of("A")
        assert set(a.phase_s) >= {"reserve", "begin", "buckets", "end", "commit"}
        assert core.bind_first(sk("s1")).lora_name == name_of("A")

        b = await pub.publish(SNAP["B"], "B")
        assert b.outcome is PublishOutcome.PUBLISHED and b.commit.previous_default == vk("A")
        assert core.version(vk("A")).state is VersionState.RETIRED
        assert core.bind_first(sk("s1")).lora_name == name_of("A")  # bound once, stays A
        assert core.bind_first(sk("s2")).lora_name == name_of("B")
        for fake in cluster.fakes.values():
            assert fake.state_of(name_of("A")) is EngineVersionState.READY_LOCAL
            assert fake.state_of(name_of("B")) is EngineVersionState.READY_LOCAL
        assert cluster.audit.forbidden() == []
    finally:
        if isinstance(registry, AsyncRegistryClient):
            registry.close()


async def test_phases_are_ordered_and_each_bucket_is_acked_by_all_before_the_next(world: World) -> None:
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.PUBLISHED
    log = [(e, op, d) for e, op, d in world.cluster.log]
    n = len(SNAP["A"].bucket_plan)
    assert n >= 3
    buckets = [(e, int(d)) for e, op, d in log if op == "receive_bucket"]
    for engine in ("E0", "E1"):
        assert [i for e, i in buckets if e == engine] == list(range(n))
    # Bucket k reached every engine before any engine saw bucket k + 1.
    assert [i for _, i in buckets] == sorted(i for _, i in buckets)
    ops = [op for _, op, _ in log]
    first_bucket, last_bucket = ops.index("receive_bucket"), len(ops) - 1 - ops[::-1].index("receive_bucket")
    # the epoch's first publication reads every engine's base model, then begins everywhere
    assert ops[:first_bucket] == ["status", "status", "begin", "begin"]
    assert set(ops[last_bucket + 1 :]) == {"end", "status"}
    assert ops[last_bucket + 1 :][:2] == ["end", "end"]  # ends before the pre-commit status check
    view = world.version("A")
    assert all(p is AttemptPhase.READY for p in view.attempt_phases.values())


async def test_ready_recorded_as_receipts_arrive_default_moves_only_at_commit(world: World) -> None:
    """RFC 3.4 happy path: B READY on E0 only -> S_mid binds A; after commit S_new binds B."""
    await world.publish("A")
    assert world.reg.bind_first(sk("S_old")).lora_name == name_of("A")
    gate = world.fakes["E1"].hold("end")
    task = asyncio.create_task(world.publish("B"))
    await gate.arrived.wait()
    await eventually(lambda: world.version("B").attempt_phases["E0"] is AttemptPhase.READY)
    assert world.version("B").attempt_phases["E1"] is AttemptPhase.PREPARED
    assert world.status().default == vk("A")
    assert world.reg.bind_first(sk("S_mid")).lora_name == name_of("A")
    gate.release()
    result = await task
    assert result.outcome is PublishOutcome.PUBLISHED
    assert world.reg.bind_first(sk("S_new")).lora_name == name_of("B")
    for s in ("S_old", "S_mid"):
        assert world.reg.bind_first(sk(s)).lora_name == name_of("A")


async def test_replay_touches_no_engine_and_other_content_is_a_conflict(world: World) -> None:
    first = await world.publish("A")
    calls = len(world.cluster.log)
    again = await world.publish("A")
    assert again.outcome is PublishOutcome.ALREADY_PUBLISHED and again.commit == first.commit
    assert len(world.cluster.log) == calls
    other = await world.pub.publish(SNAP["B"], "A")  # same version id, other content
    assert other.outcome is PublishOutcome.REFUSED and other.error.code is ErrorCode.VERSION_CONFLICT
    assert len(world.cluster.log) == calls and world.status().default_revision == 1


async def test_a_snapshot_mutated_after_the_snapshot_point_is_refused_before_reserve(world: World) -> None:
    snap = make_snapshot(seed=9)
    next(iter(snap.tensors.values())).add_(1.0)
    result = await world.pub.publish(snap, "X")
    assert result.outcome is PublishOutcome.REFUSED and result.error.code is ErrorCode.CHECKSUM_MISMATCH
    assert world.status().versions == () and world.cluster.log == []


async def test_engine_clients_must_match_the_registry_cohort(world: World) -> None:
    pub = open_publisher(world.reg, {"E0": world.engines["E0"]})
    with pytest.raises(ValueError, match="cohort"):
        await pub.publish(SNAP["A"], "A")


# -------------------------------------------------------------------------------- capacity


@pytest.mark.parametrize("k", [2, 4])
async def test_capacity_k_holds_k_versions_and_refuses_the_next_before_any_begin(k: int) -> None:
    """Capacity is the epoch's K: K versions live at once (each held by a session), the K+1th
    is CAPACITY_ERROR before any engine sees it, and one reclaim makes room for exactly one."""
    cluster = make_cluster(capacity=k)
    w = World(new_registry(capacity=k), cluster)
    snaps = [make_snapshot(seed=100 + i) for i in range(k + 1)]
    for i in range(k):
        assert (await w.pub.publish(snaps[i], f"v{i}")).outcome is PublishOutcome.PUBLISHED
        w.reg.bind_first(sk(f"S{i}"))
    seen = len(w.cluster.log)
    over = await w.pub.publish(snaps[k], f"v{k}")
    assert over.outcome is PublishOutcome.REFUSED and over.error.code is ErrorCode.CAPACITY_ERROR
    assert len(w.cluster.log) == seen and w.reg.version(vk(f"v{k}")) is None
    w.reg.close_and_release(sk("S0"))
    (res,) = await w.pub.reclaim_ready()
    assert res.done and res.version_key == vk("v0")
    assert (await w.pub.publish(snaps[k], f"v{k}")).outcome is PublishOutcome.PUBLISHED
    assert all(f.unloads[snaps[0].lora_name("relax_policy_lora", EPOCH, "v0")] == 1 for f in w.fakes.values())


async def test_an_engine_with_fewer_slots_than_the_epochs_capacity_is_refused_before_anything_moves() -> None:
    """K = 4 on a cohort where E1 holds only 2 managed versions: the first publication is
    refused with CAPACITY_MISMATCH (not CAPACITY_ERROR, which backpressure loops wait on),
    naming E1 and both figures; nothing is reserved and no engine sees a begin. Checked with the
    base, at the epoch's first publication: after a refusal, the next publication checks again."""
    cluster = make_cluster(capacity={"E0": 4, "E1": 2})
    w = World(new_registry(capacity=4), cluster)
    r = await w.publish("A")
    assert r.outcome is PublishOutcome.REFUSED and r.error.code is ErrorCode.CAPACITY_MISMATCH
    assert r.error.details == {"engine_capacity": {"E1": 2}, "capacity": 4}
    assert w.version("A") is None and w.status().default_lora_name is None
    assert not [op for f in w.fakes.values() for op in f.ops() if op != "status"]
    cluster.fakes["E1"].capacity = 4  # the operator restarts E1 with more slots
    cluster.fakes["E1"].restart()
    assert (await w.publish("A")).outcome is PublishOutcome.PUBLISHED


async def test_capacity_refusal_before_any_begin_then_reclaim_frees_the_slot(world: World) -> None:
    """RFC 5.2: A RETIRED + B PUBLISHED -> C is CAPACITY_ERROR and no engine sees anything."""
    await world.publish("A")
    world.reg.bind_first(sk("S_a"))
    await world.publish("B")
    seen = len(world.cluster.log)
    c = await world.publish("C")
    assert c.outcome is PublishOutcome.REFUSED and c.error.code is ErrorCode.CAPACITY_ERROR
    assert c.registry_state is None and c.attempt_token is None
    assert len(world.cluster.log) == seen, "no begin (or any other call) reached an engine"
    assert world.version("C") is None

    assert await world.pub.reclaim_ready() == ()  # A still has a session ref
    world.reg.close_and_release(sk("S_a"))
    (res,) = await world.pub.reclaim_ready()
    assert res.done and res.version_key == vk("A") and rendered(res) == {"E0": "UNLOADED", "E1": "UNLOADED"}
    assert all(f.unloads[name_of("A")] == 1 for f in world.fakes.values())
    assert world.status().slots_used == 1

    gate = world.fakes["E0"].hold("end")
    task = asyncio.create_task(world.publish("C"))
    await gate.arrived.wait()
    assert world.status().default == vk("B")  # default stays B until C commits
    gate.release()
    assert (await task).outcome is PublishOutcome.PUBLISHED
    assert world.status().default == vk("C")
    (res_b,) = await world.pub.reclaim_ready()
    assert res_b.version_key == vk("B") and res_b.done
    assert all(f.unloads[name_of("A")] == 1 for f in world.fakes.values()), "A is unloaded once"


# ---------------------------------------------------------------------------- clean failure


@pytest.mark.parametrize(
    ("op", "nth", "code"),
    [
        ("receive_bucket", 2, ErrorCode.CHECKSUM_MISMATCH),
        ("end", 1, ErrorCode.LOAD_FAILED),
        ("begin", 1, ErrorCode.CAPACITY_ERROR),
    ],
)
async def test_clean_refusal_aborts_cleans_everywhere_and_frees_only_after_all_confirm(
    world: World, op: str, nth: int, code: ErrorCode
) -> None:
    await world.publish("A")
    world.reg.bind_first(sk("S_a"))
    before = {e: len(f.ops("receive_bucket")) for e, f in world.fakes.items()}
    world.fakes["E1"].fail(op, nth, code=code)
    gate = world.fakes["E1"].hold("cleanup")
    task = asyncio.create_task(world.publish("B"))
    await gate.arrived.wait()
    await eventually(lambda: world.version("B").attempt_phases["E0"] is AttemptPhase.CLEANED)
    view = world.version("B")
    assert view.state is VersionState.ABORTED and view.holds_slot  # E1 not confirmed yet
    assert world.status().slots_used == 2
    gate.release()
    result = await task
    assert result.outcome is PublishOutcome.FAILED_CLEAN and result.error.code is code
    assert result.registry_state is VersionState.FAILED_CLEAN and not result.holds_slot
    e1_state = None if op == "begin" else EngineVersionState.CLEANED  # E1 never created it
    assert world.engine_states("B") == {"E0": EngineVersionState.CLEANED, "E1": e1_state}
    # Either way the attempt token is tombstoned on both: a late begin cannot resurrect it.
    assert all(result.attempt_token in f.cleaned for f in world.fakes.values())
    assert world.status().default == vk("A") and world.status().slots_used == 1
    if op == "receive_bucket":
        # The transfer stopped everywhere at the failed bucket.
        sent = {e: len(f.ops("receive_bucket")) - before[e] for e, f in world.fakes.items()}
        assert sent == {"E0": nth, "E1": nth}
    # A keeps serving, and a new publication may start.
    out = await world.engines["E0"].generate({"rid": "r", "lora_path": name_of("A")})
    assert out["meta_info"]["lora_path"] == name_of("A")
    assert (await world.publish("C")).outcome is PublishOutcome.PUBLISHED


async def test_unconfirmed_cleanup_keeps_the_slot_until_resolved(world: World) -> None:
    world.fakes["E1"].fail("end", code=ErrorCode.LOAD_FAILED)
    world.fakes["E1"].fail("cleanup", status=503)
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.CLEANUP_PENDING and result.unknown == ("E1",)
    assert result.registry_state is VersionState.ABORTED and result.holds_slot
    status = world.status()
    assert status.slots_used == 1 and [u.engine_id for u in status.unknown_outcomes] == ["E1"]
    c = await world.publish("C")
    assert c.outcome is PublishOutcome.REFUSED and c.error.code is ErrorCode.OUTCOME_UNKNOWN
    resolved = await world.pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.FAILED_CLEAN
    assert world.fakes["E0"].ops("cleanup") == ["cleanup"]  # only the unconfirmed engine again
    assert world.fakes["E1"].ops("cleanup") == ["cleanup", "cleanup"]
    assert world.status().slots_used == 0 and world.status().unknown_outcomes == ()
    assert await world.pub.resolve() is None


async def test_a_cleanup_the_engine_refuses_is_an_unknown_outcome_that_keeps_the_slot(world: World) -> None:
    """Issue 10 (a mutation the suite missed): a *refused* cleanup is not a confirmed one."""
    world.fakes["E1"].fail("end", code=ErrorCode.LOAD_FAILED)
    world.fakes["E1"].fail("cleanup", code=ErrorCode.INVALID_REQUEST)
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.CLEANUP_PENDING and result.unknown == ("E1",)
    assert result.holds_slot and world.status().slots_used == 1
    (u,) = world.status().unknown_outcomes
    assert (u.engine_id, u.op) == ("E1", "cleanup") and "INVALID_REQUEST" in u.reason
    c = await world.publish("C")
    assert c.outcome is PublishOutcome.REFUSED and c.error.code is ErrorCode.OUTCOME_UNKNOWN


async def test_a_commit_that_never_reaches_the_registry_is_not_committed(world: World) -> None:
    """Issue 10: status reads work, every commit call is lost before the registry: the result
    is NOT_COMMITTED (the registry says the version has no commit), never PUBLISHED."""
    lossy = LossyRegistry(world.reg)
    lossy.down = {"commit"}
    result = await world.publisher(lossy).publish(SNAP["A"], "A")
    assert result.outcome is PublishOutcome.NOT_COMMITTED and not result.ok, result
    assert result.commit is None and world.version("A").state is VersionState.LOADING
    assert world.status().default is None


async def test_resolve_aborts_when_an_engine_holds_the_attempt_with_another_digest(world: World) -> None:
    """Issue 10: the right attempt token with another digest is not this attempt: abort, clean."""
    world.wrap("E1").drop_reply("end", nth=1)
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.OUTCOME_UNKNOWN
    world.fakes["E1"].versions[name_of("A")].digest = "f" * 64  # what E1 now reports
    resolved = await world.pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.FAILED_CLEAN, resolved
    assert world.version("A").state is VersionState.FAILED_CLEAN and world.status().slots_used == 0
    assert world.status().default is None
    assert world.fakes["E0"].ops("cleanup") == ["cleanup"]


# ----------------------------------------------------------------------- ambiguous outcome


async def test_lost_end_reply_keeps_the_slot_blocks_publications_and_resolves_from_status(
    world: World,
) -> None:
    e1 = world.wrap("E1").drop_reply("end", nth=1)
    result = await world.publish("A")  # bootstrap through the same protocol
    assert result.outcome is PublishOutcome.OUTCOME_UNKNOWN and result.unknown == ("E1",)
    assert not result.ok and result.holds_slot and result.registry_state is VersionState.LOADING
    assert world.engine_states("A")["E1"] is EngineVersionState.READY_LOCAL  # the engine did it
    view = world.version("A")
    assert view.attempt_phases == {"E0": AttemptPhase.READY, "E1": AttemptPhase.UNKNOWN}
    assert world.status().default is None and world.status().slots_used == 1
    refused(ErrorCode.NO_PUBLISHED_VERSION, world.reg.bind_first, sk("s"))  # nothing on a guess
    seen = len(world.cluster.log)
    blocked = await world.publish("B")
    assert blocked.outcome is PublishOutcome.REFUSED and blocked.error.code is ErrorCode.OUTCOME_UNKNOWN
    assert len(world.cluster.log) == seen

    resolved = await world.pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED
    assert world.fakes["E1"].ops("end") == ["end"]  # learnt from GET /lora_versions/{name}, not re-sent
    assert world.fakes["E1"].ops("version_status") == ["version_status"]
    assert e1.injected[0].real_outcome == "ok"
    assert world.status().unknown_outcomes == () and world.reg.bind_first(sk("s")).lora_name == name_of("A")


@pytest.mark.parametrize("memory", ["remembered", "passed", "none"])
async def test_lost_bucket_reply_is_resolved_by_driving_the_engine_again(world: World, memory: str) -> None:
    world.wrap("E1").drop_reply("receive_bucket", nth=2)
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.OUTCOME_UNKNOWN and result.unknown == ("E1",)
    assert [len(f.ops("receive_bucket")) for f in world.fakes.values()] == [2, 2]  # stopped at bucket 1
    if memory == "remembered":
        resolved = await world.pub.resolve()
    else:  # a fresh publisher (e.g. after a restart) knows nothing about the snapshot
        resolved = await world.publisher().resolve(SNAP["A"] if memory == "passed" else None)
    assert resolved is not None
    if memory == "none":
        # Presumed abort: without the data the attempt cannot finish; it is cleaned up.
        assert resolved.outcome is PublishOutcome.FAILED_CLEAN
        assert world.engine_states("A") == {
            "E0": EngineVersionState.CLEANED,
            "E1": EngineVersionState.CLEANED,
        }
        return
    assert resolved.outcome is PublishOutcome.PUBLISHED
    dups = [s.detail for s in resolved.steps if s.op == "receive_bucket" and s.detail.endswith("dup")]
    assert dups == ["#0 dup", "#0 dup", "#1 dup", "#1 dup"]
    assert [f.ops("begin") for f in world.fakes.values()] == [["begin"] * 2] * 2


@pytest.mark.parametrize("fault", ["503_before", "timeout_after"])
async def test_unknown_begin_is_resolved_by_status_then_redrive(world: World, fault: str) -> None:
    if fault == "503_before":
        world.fakes["E1"].fail("begin", status=503)
    else:
        world.fakes["E1"].fail("begin", timeout=True, after=True)
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.OUTCOME_UNKNOWN and result.unknown == ("E1",)
    assert world.fakes["E1"].ops("receive_bucket") == [] and world.fakes["E0"].ops("receive_bucket") == []
    expected = None if fault == "503_before" else EngineVersionState.PREPARED
    assert world.engine_states("A")["E1"] is expected
    resolved = await world.pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED


async def test_unreachable_engine_stays_unknown_through_resolve(world: World) -> None:
    e1 = world.wrap("E1").drop_reply("end", nth=1).fail_before_send("version_status", nth=1)
    assert (await world.publish("A")).outcome is PublishOutcome.OUTCOME_UNKNOWN
    still = await world.pub.resolve()
    assert still is not None and still.outcome is PublishOutcome.OUTCOME_UNKNOWN and still.unknown == ("E1",)
    assert world.version("A").state is VersionState.LOADING and world.status().slots_used == 1
    assert e1.pending() == []
    assert (await world.pub.resolve()).outcome is PublishOutcome.PUBLISHED


async def test_refusal_on_one_engine_and_unknown_on_the_other_cleans_both(world: World) -> None:
    world.fakes["E0"].fail("end", code=ErrorCode.LOAD_FAILED)
    world.wrap("E1").drop_reply("end", nth=1)
    result = await world.publish("A")
    # The attempt is doomed by the refusal; cleaning E1 is what resolves its unknown end.
    assert result.outcome is PublishOutcome.FAILED_CLEAN and result.error.code is ErrorCode.LOAD_FAILED
    assert world.fakes["E1"].unloads[name_of("A")] == 1  # E1 had loaded it: unloaded by cleanup
    assert world.status().unknown_outcomes == () and world.status().slots_used == 0


# -------------------------------------------------------------------------------- commit


async def test_lost_commit_reply_is_resolved_by_asking_the_registry(world: World) -> None:
    lossy = LossyRegistry(world.reg)
    lossy.lose["commit"] = 1
    result = await world.publisher(lossy).publish(SNAP["A"], "A")
    assert result.outcome is PublishOutcome.PUBLISHED
    assert result.commit == world.reg.commit(vk("A"), result.attempt_token, 0)  # the stored receipt
    assert lossy.calls["commit"] == 2 and world.status().default_revision == 1  # committed once
    assert result.commit is not None and result.commit.default_revision == 1


async def test_commit_unknown_until_the_registry_answers_then_resolve(world: World) -> None:
    lossy = LossyRegistry(world.reg)
    pub = world.publisher(lossy)
    lossy.down = {"commit", "version"}
    result = await pub.publish(SNAP["A"], "A")
    assert result.outcome is PublishOutcome.COMMIT_UNKNOWN and result.registry_state is None
    assert lossy.calls["commit"] == 3  # the adapter's bounded retries, then it asks and gives up
    assert world.version("A").state is VersionState.LOADING  # nothing was freed or guessed
    lossy.down = set()
    resolved = await pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED


async def test_engine_restart_between_ready_and_commit_is_refused_until_ready_again(world: World) -> None:
    restarted: list[str] = []

    def restart_once(nth: int) -> None:
        if nth == 2:  # read 1 is the epoch's base, before the reserve; read 2 the pre-commit one
            restarted.append(world.fakes["E1"].restart())

    world.fakes["E1"].before("status", restart_once)
    result = await world.publish("A")
    assert restarted, "E1 restarted after READY and before commit"
    assert result.outcome is PublishOutcome.NOT_COMMITTED and result.error.code is ErrorCode.NOT_ALL_READY
    assert world.version("A").attempt_phases == {"E0": AttemptPhase.READY, "E1": AttemptPhase.NONE}
    assert world.status().engines["E1"] == restarted[0] and world.status().default is None
    resolved = await world.pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED
    assert world.fakes["E1"].ops("begin") == ["begin", "begin"]  # once per incarnation
    assert world.fakes["E0"].ops("begin") == ["begin"]
    assert world.engine_states("A")["E1"] is EngineVersionState.READY_LOCAL


# -------------------------------------------------------------------------------- reclaim


@pytest.mark.parametrize("fault", ["503", "timeout"])
async def test_no_commit_while_an_engine_cannot_answer_after_its_ready(world: World, fault: str) -> None:
    """Issue 9 (1): an engine that restarted after its READY and is still booting (503) or cannot
    be reached (timeout) must block the commit: only fresh READY evidence from every engine counts.
    Before: the failed pre-commit read was "no news" and the publication committed."""
    # status read 1 is the epoch's base, before the reserve; read 2 is the pre-commit one
    if fault == "503":
        world.fakes["E1"].fail("status", 2, status=503)
    else:
        world.fakes["E1"].fail("status", 2, timeout=True)
    result = await world.publish("A")
    assert result.outcome is PublishOutcome.OUTCOME_UNKNOWN and result.unknown == ("E1",)
    assert world.version("A").state is VersionState.LOADING and world.status().default is None
    assert world.version("A").attempt_phases["E1"] is AttemptPhase.UNKNOWN  # its old READY no longer counts
    blocked = await world.publish("B")  # the slot and the pending attempt block the next one
    assert blocked.outcome is PublishOutcome.REFUSED and blocked.error.code is ErrorCode.OUTCOME_UNKNOWN
    resolved = await world.pub.resolve()  # E1 answers now: READY in its current incarnation
    assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED
    assert world.fakes["E1"].ops("begin") == ["begin"]  # learnt from its status, nothing re-sent


def _engine_status(incarnation: str, *versions: dict) -> protocol.EngineStatus:
    """An engine's status as an engine writes it: every version in its current incarnation."""
    import time as _time

    return protocol.EngineStatus(
        incarnation=incarnation,
        versions=tuple(
            protocol.VersionStatus(
                **{
                    "version_key": protocol.VersionKey(epoch="e", version_id="v"),
                    "incarnation": incarnation,
                    "created_at": _time.time(),
                    "updated_at": _time.time(),
                    **v,
                }
            )
            for v in versions
        ),
    )


def test_commit_evidence_is_fresh_and_positive_only():
    """Every row an engine can answer, right before the commit. Only READY_LOCAL of exactly this
    attempt and digest, in the status the engine gives now, is evidence; everything else is not
    (a restarted engine holds nothing, or holds the name under another attempt or digest)."""
    from relax_glue.publisher import CommitEvidence, commit_evidence

    name, token, digest = "p@e-v-aaaaaaaaaaaa", "tok", "a" * 64
    ours = {"lora_name": name, "attempt_token": token, "digest": digest}

    def evidence(**changes) -> CommitEvidence:
        return commit_evidence(_engine_status("i2", {**ours, **changes}), name, token, digest)

    assert evidence(state=EngineVersionState.READY_LOCAL) is CommitEvidence.READY
    for state in set(EngineVersionState) - {EngineVersionState.READY_LOCAL}:
        assert evidence(state=state) is CommitEvidence.NOT_READY, state
    ready = EngineVersionState.READY_LOCAL
    assert evidence(state=ready, attempt_token="other") is CommitEvidence.NOT_READY
    assert evidence(state=ready, digest="b" * 64) is CommitEvidence.NOT_READY
    other_name = {**ours, "lora_name": "p@e-w-aaaaaaaaaaaa", "state": ready}
    assert commit_evidence(_engine_status("i2", other_name), name, token, digest) is CommitEvidence.NOT_READY
    # restarted: a new incarnation that holds nothing, whatever the registry recorded before
    assert commit_evidence(_engine_status("i3"), name, token, digest) is CommitEvidence.NOT_READY
    # restarted and driven again by resolve() under the same attempt: READY in the new incarnation
    again = _engine_status("i3", {**ours, "state": ready})
    assert commit_evidence(again, name, token, digest) is CommitEvidence.READY
    assert commit_evidence(None, name, token, digest) is CommitEvidence.UNREACHABLE


def test_commit_evidence_refuses_a_status_that_mixes_incarnations():
    """Defence against a status assembled from two reads (no engine writes one): a version line
    from another incarnation than the status itself is not evidence of the engine now."""
    from relax_glue.publisher import CommitEvidence, commit_evidence

    name, token, digest = "p@e-v-aaaaaaaaaaaa", "tok", "a" * 64
    mixed = _engine_status(
        "i2",
        {
            "lora_name": name,
            "attempt_token": token,
            "digest": digest,
            "state": EngineVersionState.READY_LOCAL,
            "incarnation": "i1",
        },
    )
    assert commit_evidence(mixed, name, token, digest) is CommitEvidence.NOT_READY


@pytest.mark.timeout(30)  # a broken drain rule hangs here: fail in seconds, not at the suite's 900 s
async def test_reclaim_polls_through_draining_and_unloads_once(world: World) -> None:
    await world.publish("A")
    e0 = world.fakes["E0"]
    e0.hold_generations()
    running = asyncio.create_task(world.engines["E0"].generate({"rid": "r1", "lora_path": name_of("A")}))
    await eventually(lambda: e0.in_flight[name_of("A")] == 1)
    await world.publish("B")  # A RETIRED, no session refs

    (first,) = await world.pub.reclaim_ready(deadline_s=0.15)
    assert not first.done and first.registry_state is VersionState.RECLAIMING
    assert first.engines["E0"] == EngineReclaim(
        EngineReclaimState.DRAINING, in_flight=1, calls=first.engines["E0"].calls
    )
    assert first.engines["E1"].state is EngineReclaimState.UNLOADED
    assert len(e0.ops("reclaim")) >= 1 and e0.state_of(name_of("A")) is EngineVersionState.RECLAIMING
    assert world.version("A").reclaim_phases == {"E0": ReclaimPhase.PENDING, "E1": ReclaimPhase.UNLOADED}
    assert world.status().slots_used == 2  # RECLAIMING still holds the slot
    with pytest.raises(LoraVersionError) as exc:  # unregistered: new requests get a version error
        await world.engines["E0"].generate({"rid": "r2", "lora_path": name_of("A")})
    assert exc.value.code is ErrorCode.VERSION_RECLAIMED

    async def finish_later() -> None:
        await asyncio.sleep(0.1)
        e0.release_generations()

    releaser = asyncio.create_task(finish_later())
    calls_before = len(e0.ops("reclaim"))
    (second,) = await world.pub.reclaim_ready()
    await releaser
    assert second.done and rendered(second) == {"E0": "UNLOADED", "E1": "UNLOADED"}
    assert len(e0.ops("reclaim")) - calls_before > 1  # polled through DRAINING, bounded wait per call
    assert (await running)["meta_info"]["finish_reason"]["type"] == "length"  # never cut short
    assert e0.unloads[name_of("A")] == 1 and world.fakes["E1"].unloads[name_of("A")] == 1
    assert world.status().slots_used == 1
    assert await world.pub.reclaim_ready() == ()


async def test_unknown_reclaim_outcome_keeps_the_slot_and_the_next_run_resolves(world: World) -> None:
    world.wrap("E1").drop_reply("reclaim", nth=1)
    await world.publish("A")
    await world.publish("B")
    (first,) = await world.pub.reclaim_ready()
    assert rendered(first) == {"E0": "UNLOADED", "E1": "UNKNOWN"} and not first.done
    assert first.engines["E1"] == EngineReclaim(EngineReclaimState.UNKNOWN)
    assert world.version("A").reclaim_phases["E1"] is ReclaimPhase.UNKNOWN
    c = await world.publish("C")
    assert c.outcome is PublishOutcome.REFUSED and c.error.code is ErrorCode.OUTCOME_UNKNOWN
    (second,) = await world.pub.reclaim_ready()
    assert second.done and world.fakes["E1"].unloads[name_of("A")] == 1
    assert (await world.publish("C")).outcome is PublishOutcome.PUBLISHED


@pytest.mark.parametrize("fault", ["end_not_sent", "last_bucket_reply_lost"])
async def test_resolve_finishes_with_end_alone_when_the_engine_has_every_bucket(
    world: World, fault: str
) -> None:
    n = len(SNAP["A"].bucket_plan)
    e1 = world.wrap("E1")
    if fault == "end_not_sent":
        e1.fail_before_send("end", nth=1)
    else:
        e1.drop_reply("receive_bucket", nth=n)
    assert (await world.publish("A")).outcome is PublishOutcome.OUTCOME_UNKNOWN
    # A fresh publisher without the snapshot: nothing needs to be sent again but `end`.
    resolved = await world.publisher().resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.PUBLISHED
    assert len(world.fakes["E1"].ops("receive_bucket")) == n and world.fakes["E1"].ops("begin") == ["begin"]
    assert world.fakes["E1"].ops("end") == ["end"]


async def test_publishing_the_same_version_again_resumes_the_pending_attempt(world: World) -> None:
    world.wrap("E1").drop_reply("end", nth=1)
    first = await world.publish("A")
    assert first.outcome is PublishOutcome.OUTCOME_UNKNOWN
    again = await world.publisher().publish(SNAP["A"], "A")  # e.g. the trainer restarted
    assert again.outcome is PublishOutcome.PUBLISHED and again.attempt_token == first.attempt_token
    assert world.status().slots_used == 1 and world.status().default_revision == 1
    assert world.fakes["E1"].ops("end") == ["end"]


def test_resolve_has_one_action_for_every_engine_state():
    """The resolve table covers every engine state (a missing entry would be a KeyError)."""
    import time as _time

    from lora_contract.protocol import EngineVersionState, VersionKey, VersionStatus
    from relax_glue.recovery_rules import ResolveAction, resolve_action

    token, digest = "tok-1", "a" * 64

    def status(state, **kw):
        fields = dict(
            lora_name="p@e-v-aaaaaaaaaaaa",
            state=state,
            version_key=VersionKey(epoch="e", version_id="v"),
            digest=digest,
            attempt_token=token,
            incarnation="inc",
            created_at=_time.time(),
            updated_at=_time.time(),
            buckets_received=2,
            buckets_total=2,
        )
        return VersionStatus(**{**fields, **kw})

    got = {s: resolve_action(status(s), token, digest) for s in EngineVersionState}
    assert got == {
        EngineVersionState.PREPARED: ResolveAction.END,
        EngineVersionState.LOADING: ResolveAction.END,
        EngineVersionState.READY_LOCAL: ResolveAction.READY,
        EngineVersionState.RECLAIMING: ResolveAction.DOOMED,
        EngineVersionState.UNLOADED: ResolveAction.DOOMED,
        EngineVersionState.CLEANED: ResolveAction.DOOMED,
        EngineVersionState.FAILED: ResolveAction.DOOMED,
    }
    assert (
        resolve_action(status(EngineVersionState.PREPARED, buckets_received=1), token, digest)
        is ResolveAction.REDRIVE
    )
    assert resolve_action(None, token, digest) is ResolveAction.REDRIVE
    assert (
        resolve_action(status(EngineVersionState.READY_LOCAL, attempt_token="other"), token, digest)
        is ResolveAction.DOOMED
    )


def _version_status(state: EngineVersionState, **kw: Any) -> protocol.VersionStatus:
    fields = dict(
        lora_name="p@e-v-aaaaaaaaaaaa",
        state=state,
        version_key=protocol.VersionKey(epoch="e", version_id="v"),
        digest="a" * 64,
        attempt_token="tok-1",
        incarnation="inc",
        created_at=0.0,
        updated_at=0.0,
    )
    return protocol.VersionStatus(**{**fields, **kw})


@pytest.mark.parametrize(
    ("received", "total", "action"),
    [
        (0, 0, "REDRIVE"),  # a status that reports no plan proves nothing arrived: begin again
        (0, 1, "REDRIVE"),
        (1, 1, "END"),
        (0, 3, "REDRIVE"),
        (1, 3, "REDRIVE"),
        (2, 3, "REDRIVE"),  # one bucket short is not complete
        (3, 3, "END"),
    ],
)
def test_resolve_ends_a_prepared_attempt_only_when_every_planned_bucket_is_there(
    received: int, total: int, action: str
) -> None:
    from relax_glue.recovery_rules import ResolveAction, resolve_action

    vs = _version_status(EngineVersionState.PREPARED, buckets_received=received, buckets_total=total)
    assert resolve_action(vs, "tok-1", "a" * 64) is ResolveAction(action)


@pytest.mark.parametrize("state", list(EngineVersionState))
@pytest.mark.parametrize("foreign", ["attempt_token", "digest", "both"])
def test_resolve_never_drives_a_name_another_attempt_or_digest_holds(state, foreign: str) -> None:
    """Whatever its state (even READY_LOCAL with every bucket), a name held under another
    attempt token or another digest is DOOMED for this attempt: never recorded READY, never
    ended, never re-driven over."""
    from relax_glue.recovery_rules import ResolveAction, resolve_action

    other = {"attempt_token": "tok-other", "digest": "b" * 64}
    changes = other if foreign == "both" else {foreign: other[foreign]}
    vs = _version_status(state, buckets_received=2, buckets_total=2, **changes)
    assert resolve_action(vs, "tok-1", "a" * 64) is ResolveAction.DOOMED


@pytest.mark.parametrize("outcome", list(PublishOutcome))
@pytest.mark.parametrize("state", [None, *VersionState])
def test_a_publish_result_is_ok_only_when_published_and_holds_a_slot_by_the_registry_rule(outcome, state):
    """``ok``: the version is the default now (committed by this call or earlier); every other
    outcome is not. ``holds_slot``: the registry's one slot rule on the state read after the
    run; a result with no state read (not reserved, registry unreachable) holds nothing."""
    from relax_glue.registry import holds_slot

    result = PublishResult(outcome, VersionKey(EPOCH, "A"), "n", "a" * 64, None, state)
    assert result.ok == (outcome in (PublishOutcome.PUBLISHED, PublishOutcome.ALREADY_PUBLISHED))
    assert result.holds_slot == (state is not None and holds_slot(state))


# ---------------------------------------------------------------------------- N engines

THREE = ("E0", "E1", "E2")


async def test_a_cohort_of_three_commits_only_when_all_three_are_ready_and_reclaims_on_all() -> None:
    w = World(new_registry(engines=THREE), make_cluster(THREE))
    w.fakes["E2"].fail("end", code=ErrorCode.LOAD_FAILED)
    res = await w.publish("A")
    assert res.outcome is PublishOutcome.FAILED_CLEAN, res  # E0/E1 READY are not enough
    assert set(w.engine_states("A").values()) <= {EngineVersionState.CLEANED, None}
    assert w.status().slots_used == 0
    for vid in ("B", "C"):
        assert (await w.publish(vid)).outcome is PublishOutcome.PUBLISHED
    assert w.version("B").attempt_phases == dict.fromkeys(THREE, AttemptPhase.READY)
    (done,) = await w.pub.reclaim_ready()  # B retired with no session refs
    assert done.done and rendered(done) == dict.fromkeys(THREE, "UNLOADED")
    assert w.version("B").reclaim_phases == dict.fromkeys(THREE, ReclaimPhase.UNLOADED)
    assert set(w.engine_states("B").values()) == {EngineVersionState.UNLOADED}
    assert w.cluster.audit.forbidden() == []


async def test_no_commit_when_an_engine_answers_not_ready_in_the_same_incarnation(world: World) -> None:
    """E1 answered READY, then (same process, same incarnation) its copy is cleaned up by
    someone else before the commit's status read: the READY the registry recorded is stale
    evidence. The commit is refused (NOT_ALL_READY naming E1), the default does not move, and
    resolve() then finds the attempt doomed there and cleans it up."""
    e1 = world.wrap("E1")
    token: list[str] = []

    async def clean_e1() -> None:  # a real cleanup on the engine, right before the status read
        (att,) = [v for v in world.status().versions if v.state is VersionState.LOADING]
        token.append(att.attempt_token)
        await world.cluster.clients["E1"].cleanup(
            protocol.CleanupRequest(lora_name=att.lora_name, attempt_token=att.attempt_token)
        )

    e1.before_send("status", 2, clean_e1)  # read 1 is the epoch's base; read 2 the pre-commit one
    incarnation = world.fakes["E1"].incarnation
    result = await world.publish("A")
    assert token and world.fakes["E1"].incarnation == incarnation  # no restart: the same incarnation
    assert result.outcome is PublishOutcome.NOT_COMMITTED, result
    assert result.error.code is ErrorCode.NOT_ALL_READY and result.error.details["engines"] == ["E1"]
    assert world.status().default is None and world.version("A").state is VersionState.LOADING
    resolved = await world.pub.resolve()
    assert resolved is not None and resolved.outcome is PublishOutcome.FAILED_CLEAN, resolved
    assert world.engine_states("A") == {"E0": EngineVersionState.CLEANED, "E1": EngineVersionState.CLEANED}
