"""An operator declares an engine lost (issue 9): before that, a silent engine blocks commit,
cleanup and reclaim and nothing is freed; after it, the engine leaves the cohort, its receipts
are refused, and what only waited for it finishes. Registry rows run on the REAL registry
(``Checked``: full invariants after every accepted call, no change on a refusal); the publisher
rows use fake engines behind the REAL engine client."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fake_engine import make_cluster, make_snapshot
from _rg_helpers import ENGINES, EPOCH, Publisher, new_registry, refused, sk, vk

from lora_contract.errors import ErrorCode
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome
from relax_glue.reclaimer import EngineReclaimState
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.registry_types import AttemptPhase, ReclaimPhase, VersionState
from relax_glue.store import DurableRegistry


def test_an_aborted_attempt_waiting_only_for_the_lost_engine_frees_its_slot() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.reserve("B")
    reg.abort(pub.token("B"), "E1 refused")
    pub.cleanup("B", "E0")
    reg.mark_engine_unknown("E1", pub.token("B"), "cleanup", "no answer")
    # Before the declaration nothing is freed on a guess: B holds its slot, C is refused.
    assert reg.version(vk("B")).state is VersionState.ABORTED and reg.status().slots_used == 2
    refused(ErrorCode.OUTCOME_UNKNOWN, reg.reserve, vk("C"), "c" * 64, "x@7-C-cccccccccccc", "r-c")

    res = reg.declare_engine_lost("E1", "host E1 died; disk replaced")
    assert res.cohort == ("E0",) and res.finished == (vk("B"),)
    assert reg.version(vk("B")).state is VersionState.FAILED_CLEAN
    assert reg.status().unknown_outcomes == () and reg.status().slots_used == 1
    assert dict(reg.version(vk("A")).attempt_phases) == {"E0": AttemptPhase.READY}
    assert reg.declare_engine_lost("E1", "again") == res  # idempotent: the first answer


def test_a_reclaim_waiting_only_for_the_lost_engine_completes() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    pub.publish("B")
    claim = reg.claim_reclaim(vk("A"))
    pub.unloaded("A", "E0", claim)
    reg.mark_engine_unknown("E1", claim.reclaim_id, "reclaim", "timeout")
    assert reg.version(vk("A")).state is VersionState.RECLAIMING
    res = reg.declare_engine_lost("E1", "gone")
    assert res.finished == (vk("A"),)
    view = reg.version(vk("A"))
    assert view.state is VersionState.RECLAIMED and dict(view.reclaim_phases) == {"E0": ReclaimPhase.UNLOADED}


def test_a_loading_attempt_commits_on_the_remaining_engines_only_through_commit() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.reserve("A")
    pub.prepared("A", "E0")
    pub.ready("A", "E0")
    reg.mark_engine_unknown("E1", pub.token("A"), "end", "connection refused")
    refused(ErrorCode.OUTCOME_UNKNOWN, reg.commit, vk("A"), pub.token("A"), 0)
    res = reg.declare_engine_lost("E1", "gone")
    assert res.finished == ()  # the declaration never commits anything itself
    assert reg.version(vk("A")).state is VersionState.LOADING
    pub.commit("A")
    assert reg.status().default == vk("A")


def test_after_the_declaration_the_engine_is_refused_everywhere() -> None:
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.declare_engine_lost("E1", "gone")
    err = refused(ErrorCode.UNKNOWN_ENGINE, reg.register_engine_incarnation, "E1", "E1-i9")
    assert "declared lost: gone" in err.message
    refused(ErrorCode.UNKNOWN_ENGINE, reg.mark_engine_unknown, "E1", pub.token("A"), "x", "y")
    refused(ErrorCode.UNKNOWN_ENGINE, reg.declare_engine_lost, "E9", "never was")
    refused(ErrorCode.INVALID_REQUEST, reg.declare_engine_lost, "E0", "the last one")
    assert reg.status().engines.keys() == {"E0"}
    # Sessions and new publications go on with the remaining engine.
    reg.bind_first(sk("s"))
    pub.reserve("B")
    pub.prepared("B", "E0")
    pub.ready("B", "E0")
    pub.commit("B")


def test_the_declaration_survives_dump_load_and_a_journal_replay(tmp_path: Path) -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.declare_engine_lost("E1", "gone")
    back = LoRAVersionRegistry.load(reg.dump())
    assert back.dump() == reg.dump() and back.engines == ("E0",)

    path = tmp_path / "reg.db"
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        Publisher(d).publish("A")
        d.declare_engine_lost("E1", "gone", publisher_token=d.publisher_token)
        before = d.dump()
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        assert d.dump() == before and tuple(d.status().engines) == ("E0",)


async def test_the_publisher_finishes_a_stuck_reclaim_and_publishes_without_the_lost_engine() -> None:
    snaps = {v: make_snapshot(seed=i) for i, v in enumerate("ABC")}
    reg = new_registry()
    cluster = make_cluster()
    pub = open_publisher(
        reg,
        cluster.clients,
        reclaim_wait_s=0.05,
        reclaim_poll_s=0.01,
        reclaim_deadline_s=1.0,
        registry_retry_delay_s=0.0,
    )
    for v in "AB":
        assert (await pub.publish(snaps[v], v)).outcome is PublishOutcome.PUBLISHED
    e1 = cluster.fakes["E1"]
    for n in range(1, 50):  # E1 is gone: every call times out from now on
        for op in ("reclaim", "begin", "status"):
            e1.fail(op, nth=n, timeout=True)
    (stuck,) = await pub.reclaim_ready()
    assert stuck.registry_state is VersionState.RECLAIMING
    assert stuck.engines["E1"].state is EngineReclaimState.UNKNOWN
    blocked = await pub.publish(snaps["C"], "C")
    assert blocked.outcome is PublishOutcome.REFUSED and blocked.error.code is ErrorCode.OUTCOME_UNKNOWN

    reg.declare_engine_lost("E1", "operator: E1's host is gone")
    assert reg.version(vk("A")).state is VersionState.RECLAIMED  # E0 had confirmed its unload
    calls = sum(e1.calls.values())
    res = await pub.publish(snaps["C"], "C")
    assert res.outcome is PublishOutcome.PUBLISHED, res
    assert sum(e1.calls.values()) == calls  # the lost engine is never driven again
    assert reg.status().default == vk("C")
    await cluster.aclose()


@pytest.mark.parametrize("reason", ["", "x" * 2000])
def test_a_declaration_needs_a_reason_of_bounded_size(reason: str) -> None:
    reg = new_registry()
    refused(ErrorCode.INVALID_REQUEST, reg.declare_engine_lost, "E1", reason)


THREE = ("E0", "E1", "E2")
_ATTEMPT_ROWS = ["CLEANED", "NONE", "UNKNOWN"]
_RECLAIM_ROWS = ["UNLOADED", "PENDING", "UNKNOWN"]


@pytest.mark.parametrize("e0", _ATTEMPT_ROWS)
@pytest.mark.parametrize("e1", _ATTEMPT_ROWS)
def test_losing_an_engine_finishes_an_aborted_attempt_only_if_every_other_engine_cleaned(
    e0: str, e1: str
) -> None:
    """Cohort of three, E2 lost while B is ABORTED: B becomes FAILED_CLEAN (its slot freed) only
    when both remaining engines confirmed its cleanup; one engine not (yet) clean or unknown
    keeps it ABORTED, holding its slot, and its unknown outcome stays."""
    reg = new_registry(engines=THREE, capacity=3)
    pub = Publisher(reg)
    pub.reserve("B")
    reg.abort(pub.token("B"), "x")
    reg.mark_engine_unknown("E2", pub.token("B"), "cleanup", "gone")
    for engine, phase in (("E0", e0), ("E1", e1)):
        if phase == "CLEANED":
            pub.cleanup("B", engine)
        elif phase == "UNKNOWN":
            reg.mark_engine_unknown(engine, pub.token("B"), "cleanup", "no answer")
    res = reg.declare_engine_lost("E2", "host died")
    done = e0 == e1 == "CLEANED"
    assert res.finished == ((vk("B"),) if done else ())
    view = reg.version(vk("B"))
    assert view.state is (VersionState.FAILED_CLEAN if done else VersionState.ABORTED)
    assert dict(view.attempt_phases) == {"E0": AttemptPhase(e0), "E1": AttemptPhase(e1)}
    assert reg.status().slots_used == (0 if done else 1)
    still_unknown = sorted(e for e, p in (("E0", e0), ("E1", e1)) if p == "UNKNOWN")
    assert [u.engine_id for u in reg.status().unknown_outcomes] == still_unknown


@pytest.mark.parametrize("e0", _RECLAIM_ROWS)
@pytest.mark.parametrize("e1", _RECLAIM_ROWS)
def test_losing_an_engine_finishes_a_reclaim_only_if_every_other_engine_unloaded(e0: str, e1: str) -> None:
    reg = new_registry(engines=THREE, capacity=3)
    pub = Publisher(reg)
    pub.publish("A")
    pub.publish("B")
    claim = reg.claim_reclaim(vk("A"))
    reg.mark_engine_unknown("E2", claim.reclaim_id, "reclaim", "gone")
    for engine, phase in (("E0", e0), ("E1", e1)):
        if phase == "UNLOADED":
            pub.unloaded("A", engine, claim)
        elif phase == "UNKNOWN":
            reg.mark_engine_unknown(engine, claim.reclaim_id, "reclaim", "no answer")
    res = reg.declare_engine_lost("E2", "host died")
    done = e0 == e1 == "UNLOADED"
    assert res.finished == ((vk("A"),) if done else ())
    view = reg.version(vk("A"))
    assert view.state is (VersionState.RECLAIMED if done else VersionState.RECLAIMING)
    assert dict(view.reclaim_phases) == {"E0": ReclaimPhase(e0), "E1": ReclaimPhase(e1)}
    assert reg.status().slots_used == (1 if done else 2)
