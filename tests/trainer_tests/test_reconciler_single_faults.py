"""The reconciler and the recovery rules, one fault at a time (docs/fault-semantics.md, "Restore"):
each test injects exactly one fault into the REAL component and checks the one answer the rules
give for it. Nothing committed is ever unloaded or re-staged on a stale view, nothing is freed
on a guess (a cleanup that answers DRAINING keeps the slot, and the round after asks again).

Engines are ``_fake_engine.FakeEngine`` doubles running the plugin's real control plane behind the
REAL ``EngineClient``; faults go through ``FaultInjectingClient`` (a stale status reply) or the
fake native edge's scripted failures (a physical unload that fails: the engine answers DRAINING).
The registry is the REAL one (``Checked``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fake_engine import make_snapshot
from _rg_helpers import EPOCH, sk
from test_reconciler import World as ReconcilerWorld

from lora_contract import protocol
from lora_contract.errors import ErrorCode
from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.publisher import Publisher, PublishOutcome
from relax_glue.reconciler import RestoreOutcome
from relax_glue.recovery_rules import ResolveAction, RestoreAction, resolve_action, restore_action

S = protocol.EngineVersionState
SNAP = make_snapshot(seed=0)
PREFIX = "relax_policy_lora"
NAME = SNAP.lora_name(PREFIX, EPOCH, "A")


class World(ReconcilerWorld):
    """test_reconciler's world (the real registry, fake engines behind real clients, a snapshot
    store), with a publisher whose client of one engine is wrapped for injection."""

    def faulty(self, engine: str) -> tuple[FaultInjectingClient, Publisher]:
        """A publisher whose client of ``engine`` is the real one, wrapped for injection."""
        wrapped = FaultInjectingClient(self.cluster.clients[engine])
        return wrapped, self.publisher(clients={**self.cluster.clients, engine: wrapped})


@pytest.fixture()
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    yield w
    w.assert_no_stop_the_world()


def _held(fake: Any) -> tuple[Any, ...]:
    v = fake.versions[NAME]
    return v.state, v.attempt_token, v.lora_id


# ------------------------------------------------------------- (a) a stale status, alone


async def test_a_stale_status_missing_a_held_version_reports_it_held_and_touches_nothing(
    world: World,
) -> None:
    """The status the reconciler reads of E1 was taken before A was published there (A looks
    missing); every other reply is real. The restore's begin meets A held under the attempt that
    committed it (NOT_ATTEMPT_OWNER): the answer is HELD, no cleanup is sent (nothing of the
    restore's is there), A stays READY under its own attempt and load, the registry unchanged."""
    fake = world.fakes["E1"]
    stale = await world.cluster.clients["E1"].status()  # E1 holds nothing yet
    assert (await world.pub.publish(SNAP, "A")).outcome is PublishOutcome.PUBLISHED
    before, seq = _held(fake), world.reg.seq

    wrapped, pub = world.faulty("E1")
    wrapped.stale_reply("status", 1, stale)
    (result,) = await pub.reconcile(["E1"])

    assert [(f.op, f.kind.value) for f in wrapped.injected] == [("status", "STALE_REPLY")]
    assert result.outcome is RestoreOutcome.HELD, result
    assert _held(fake)[1] in result.detail  # held there under the committing attempt
    assert wrapped.calls["begin"] == 1 and wrapped.calls["cleanup"] == 0
    assert wrapped.calls["receive_bucket"] == 0 and wrapped.calls["end"] == 0
    assert _held(fake) == before and fake.unloads[NAME] == 0
    assert world.reg.seq == seq
    (again,) = await pub.reconcile(["E1"])  # a fresh status: held, a status read only
    assert again.outcome is RestoreOutcome.HELD and wrapped.calls["begin"] == 1


async def test_a_stale_status_showing_the_committed_attempt_half_staged_never_cleans_it(
    world: World,
) -> None:
    """The status the reconciler reads of E1 was taken mid-publication: A PREPARED under the
    very attempt that then committed it. That is no leftover of a restore: a cleanup under the
    committing attempt's token would unload the committed version. Nothing is cleaned, unloaded
    or staged; the answer is to look again, and the round after (a fresh status) finds A held."""
    fake = world.fakes["E1"]
    gate = fake.hold("end")
    publishing = asyncio.ensure_future(world.pub.publish(SNAP, "A"))
    await gate.arrived.wait()
    stale = await world.cluster.clients["E1"].status()  # A PREPARED under the publication's token
    gate.release()
    assert (await publishing).outcome is PublishOutcome.PUBLISHED
    (vs,) = stale.versions
    assert vs.state is S.PREPARED and vs.attempt_token == _held(fake)[1]
    before = _held(fake)

    wrapped, pub = world.faulty("E1")
    wrapped.stale_reply("status", 1, stale)
    (result,) = await pub.reconcile(["E1"])

    assert wrapped.calls["cleanup"] == 0 and wrapped.calls["begin"] == 0
    assert _held(fake) == before and fake.unloads[NAME] == 0
    assert result.outcome is RestoreOutcome.WAITING, result
    (again,) = await pub.reconcile(["E1"])
    assert again.outcome is RestoreOutcome.HELD
    assert _held(fake) == before and fake.unloads[NAME] == 0


def test_the_restore_rule_never_cleans_under_the_committing_attempt() -> None:
    """The pure rule behind the test above: a wanted version's own (committing) attempt seen
    PREPARED or FAILED on an engine can only be a stale view (the commit took its READY there,
    a restart forgets everything): WAIT, never CLEAN_THEN_RESTORE; the same states under
    another token are a leftover of a restore: cleaned, then staged afresh."""
    from relax_glue.registry_types import VersionKey, VersionState, VersionView

    want = VersionView(
        version_key=VersionKey(EPOCH, "A"),
        digest=SNAP.digest,
        lora_name=NAME,
        state=VersionState.PUBLISHED,
        session_refs=0,
        holds_slot=True,
        attempt_token="att-committed",
        attempt_phases={},
        reclaim_id=None,
        reclaim_phases={},
        abort_reason=None,
        commit_revision=1,
    )

    def seen(state: S, token: str) -> protocol.VersionStatus:
        return protocol.VersionStatus(
            lora_name=NAME,
            state=state,
            digest=SNAP.digest,
            attempt_token=token,
            incarnation="E1-i2",
            created_at=0.0,
            updated_at=0.0,
        )

    for state in (S.PREPARED, S.FAILED):
        assert restore_action(want, seen(state, "att-committed")) is RestoreAction.WAIT, state
        assert restore_action(want, seen(state, "rst-died")) is RestoreAction.CLEAN_THEN_RESTORE, state
    assert restore_action(want, seen(S.READY_LOCAL, "att-committed")) is RestoreAction.HELD
    assert restore_action(want, seen(S.READY_LOCAL, "rst-earlier")) is RestoreAction.HELD


# ------------------------------------------- (b) a leftover whose cleanup is still draining


async def test_a_leftover_whose_cleanup_answers_draining_keeps_its_slot_and_is_asked_again(
    world: World,
) -> None:
    """E1 restarted; its restore of A fails at the probe, and the native unload of what was
    loaded fails too (LOAD_FAILED from SGLang: the engine answers the cleanup DRAINING): a
    FAILED leftover holds A's slot there. Each round with a DRAINING cleanup answers FAILED and
    stages nothing over it (no begin), the leftover and its slot kept; the round whose cleanup
    is confirmed restores A."""
    assert (await world.pub.publish(SNAP, "A")).outcome is PublishOutcome.PUBLISHED
    world.reg.bind_first(sk("s"))
    fake = world.fakes["E1"]
    fake.restart()
    fake.native.fail_next("probe")  # the restore's load answers, its probe fails
    fake.native.fail_next("physical_unload")  # the failed probe's own removal
    fake.native.fail_next("physical_unload")  # the restore's cleanup: DRAINING
    seq = world.reg.seq

    (first,) = await world.pub.reconcile(["E1"])
    assert first.outcome is RestoreOutcome.FAILED and "cleanup pending" in first.detail, first
    state, leftover_token, lora_id = _held(fake)
    assert state is S.FAILED and leftover_token.startswith("rst-") and lora_id is not None
    assert fake.table.slots_in_use() == 1 and fake.unloads[NAME] == 0

    fake.native.fail_next("physical_unload")  # the next round's cleanup drains again
    begins = len(fake.ops("begin"))
    (second,) = await world.pub.reconcile(["E1"])
    assert second.outcome is RestoreOutcome.FAILED, second
    assert "could not be cleaned yet" in second.detail
    assert len(fake.ops("begin")) == begins  # nothing staged over a leftover still held
    assert _held(fake) == (S.FAILED, leftover_token, lora_id)  # freed on no guess
    assert fake.table.slots_in_use() == 1 and fake.unloads[NAME] == 0
    drained = [s for s in world.pub.reconciler.steps if s.op == "restore_cleanup"]
    assert [s.detail for s in drained] == ["draining"]

    (third,) = await world.pub.reconcile(["E1"])  # the unload goes through: cleaned, restored
    assert third.outcome is RestoreOutcome.RESTORED, third
    assert fake.unloads[NAME] == 1 and leftover_token in fake.cleaned
    state, token, _ = _held(fake)
    assert state is S.READY_LOCAL and token != leftover_token
    assert fake.table.slots_in_use() == 1
    assert world.reg.seq == seq + 1  # the registry learnt E1's incarnation, nothing else


# ---------------------------------------------- the resolve rule: the cells without a test


def _status(state: S, **kw: Any) -> protocol.VersionStatus:
    fields: dict[str, Any] = dict(
        lora_name=NAME,
        state=state,
        digest=SNAP.digest,
        attempt_token="att-1",
        incarnation="E1-i1",
        created_at=time.time(),
        updated_at=time.time(),
        buckets_received=2,
        buckets_total=2,
    )
    return protocol.VersionStatus(**{**fields, **kw})


@pytest.mark.parametrize("state", list(S))
def test_resolve_dooms_this_attempts_token_under_another_digest_in_every_state(state: S) -> None:
    """The engine reports the attempt's token with another digest: the name there is not this
    attempt's bytes, whatever its state (never READY, never END on it)."""
    got = resolve_action(_status(state, digest="f" * 64), "att-1", SNAP.digest)
    assert got is ResolveAction.DOOMED


def test_resolve_redrives_a_prepared_attempt_whose_bucket_plan_is_not_known() -> None:
    """PREPARED with no bucket total yet (nothing planned there): not complete, so an end alone
    could not finish it: begin again. Complete only when every planned bucket arrived."""
    assert resolve_action(_status(S.PREPARED, buckets_received=0, buckets_total=0), "att-1", SNAP.digest) is (
        ResolveAction.REDRIVE
    )
    assert resolve_action(_status(S.PREPARED, buckets_received=3, buckets_total=2), "att-1", SNAP.digest) is (
        ResolveAction.REDRIVE
    )
    assert resolve_action(_status(S.PREPARED), "att-1", SNAP.digest) is ResolveAction.END


async def test_an_engine_that_refuses_a_restores_begin_for_capacity_keeps_what_it_holds(world: World) -> None:
    """One fault: E1 (restarted) refuses the restore's begin with CAPACITY_ERROR. The answer is
    FAILED for that version, nothing of it is left there, and the next round restores it."""
    assert (await world.pub.publish(SNAP, "A")).outcome is PublishOutcome.PUBLISHED
    fake = world.fakes["E1"]
    fake.restart()
    fake.fail("begin", code=ErrorCode.CAPACITY_ERROR)
    (first,) = await world.pub.reconcile(["E1"])
    assert first.outcome is RestoreOutcome.FAILED and "CAPACITY_ERROR" in first.detail, first
    assert fake.table.slots_in_use() == 0 and NAME not in {n for n, v in fake.versions.items() if v.lora_id}
    (second,) = await world.pub.reconcile(["E1"])
    assert second.outcome is RestoreOutcome.RESTORED
