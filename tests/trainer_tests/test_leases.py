"""Session leases (issue 10, beyond the RFC): a crashed rollout worker's sessions are closed when
their lease runs out, exactly once and through the same transition as a normal close, so the
retired version they held can be reclaimed. The registry stays pure: time is an argument
(``now``), stamped once by whoever hosts the registry and journaled with the call.

Registry rows use the REAL registry (``Checked``: full invariants after each accepted call, no
change on a refusal); the session rows drive the REAL session layer over fake engines."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
from _fake_engine import make_cluster, make_snapshot
from _rg_helpers import ENGINES, EPOCH, Publisher, new_registry, refused, sk, vk

from lora_contract.errors import ErrorCode
from relax_glue.actor import AsyncRegistryClient
from relax_glue.publisher import Publisher as EnginePublisher
from relax_glue.registry_types import SessionState, VersionState
from relax_glue.sessions import SessionManager, SessionPhase
from relax_glue.store import DurableRegistry

T0 = 1_000_000.0


def _bound(reg, name: str = "s"):
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk(name))
    return pub


def test_a_lease_is_renewed_forward_only_and_a_replay_changes_nothing() -> None:
    reg = new_registry()
    _bound(reg)
    view = reg.renew_lease(sk("s"), 10.0, T0)
    assert view.lease_expires_at == T0 + 10
    seq = reg.seq
    assert reg.renew_lease(sk("s"), 10.0, T0) == view  # a replay
    assert reg.renew_lease(sk("s"), 5.0, T0 + 1) == view  # would move it earlier: no change
    assert reg.seq == seq
    assert reg.renew_lease(sk("s"), 10.0, T0 + 3).lease_expires_at == T0 + 13
    assert reg.seq == seq + 1


def test_expiry_closes_exactly_once_through_the_close_transition() -> None:
    reg = new_registry()
    pub = _bound(reg)
    reg.renew_lease(sk("s"), 10.0, T0)
    pub.publish("B")  # A retired, held by s
    seq = reg.seq
    assert reg.expire_leases(T0 + 9.999) == () and reg.seq == seq  # not yet: nothing changes
    assert reg.expire_leases(T0 + 10) == (sk("s"),)
    assert reg.seq == seq + 1
    view = reg.session(sk("s"))
    assert (
        view.state is SessionState.CLOSED and view.released and view.expired and view.lease_expires_at is None
    )
    assert reg.version(vk("A")).session_refs == 0
    assert reg.expire_leases(T0 + 100) == () and reg.seq == seq + 1  # exactly once
    assert reg.close_and_release(sk("s")) == view and reg.seq == seq + 1  # the owner's late close
    reg.claim_reclaim(vk("A"))  # the retired version can go now


def test_the_first_bind_keeps_the_lease_set_at_open() -> None:
    """The session layer's order: open, renew (the lease starts at open), bind_first, and only then
    the next renewal. A worker that dies between the bind and that renewal must still expire."""
    reg = new_registry()
    pub = Publisher(reg)
    pub.publish("A")
    reg.open_session(sk("s"))
    reg.renew_lease(sk("s"), 10.0, T0)
    binding = reg.bind_first(sk("s"))
    assert reg.session(sk("s")).lease_expires_at == T0 + 10  # the bind kept it
    assert reg.bind_first(sk("s")) == binding  # a repeat bind changes nothing either
    assert reg.session(sk("s")).lease_expires_at == T0 + 10
    pub.publish("B")  # A retired, held only by the dead worker's session
    assert reg.expire_leases(T0 + 100) == (sk("s"),)
    assert reg.version(vk("A")).session_refs == 0
    reg.claim_reclaim(vk("A"))


def test_a_bind_keeps_every_field_of_the_session_record() -> None:
    """bind_first changes exactly the binding: whatever else the record holds stays (one rule for
    every field, so a field added later cannot be dropped by the bind either)."""
    import dataclasses

    reg = new_registry()
    Publisher(reg).publish("A")
    reg.open_session(sk("s"))
    reg.renew_lease(sk("s"), 10.0, T0)
    before = reg._sessions[sk("s")]
    reg.bind_first(sk("s"))
    after = reg._sessions[sk("s")]
    changed = {
        f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)
    }
    assert changed == {"binding"}


def test_an_expired_session_never_rebinds() -> None:
    reg = new_registry()
    _bound(reg)
    reg.renew_lease(sk("s"), 1.0, T0)
    reg.expire_leases(T0 + 2)
    for call in (
        lambda: reg.bind_first(sk("s")),
        lambda: reg.open_session(sk("s")),
        lambda: reg.renew_lease(sk("s"), 1.0, T0 + 3),
    ):
        refused(ErrorCode.SESSION_EXPIRED, call)
    reg.begin_close(sk("s"))  # a late close is a no-op, not an error


def test_a_session_whose_owner_died_mid_close_expires_too() -> None:
    reg = new_registry()
    _bound(reg)
    reg.renew_lease(sk("s"), 1.0, T0)
    reg.begin_close(sk("s"))  # CLOSING, ref still held; the worker dies here
    assert reg.version(vk("A")).session_refs == 1
    assert reg.expire_leases(T0 + 1) == (sk("s"),)
    assert reg.version(vk("A")).session_refs == 0


def test_a_closing_session_cannot_renew_its_lease_but_still_expires() -> None:
    """A session its owner began to close takes no new lease (nothing will run on it again);
    if the owner dies before close_and_release, the lease it had is what releases the ref."""
    reg = new_registry()
    _bound(reg)
    reg.renew_lease(sk("s"), 1.0, T0)
    reg.begin_close(sk("s"))
    seq = reg.seq
    refused(ErrorCode.SESSION_CLOSED, reg.renew_lease, sk("s"), 100.0, T0 + 0.5)
    assert reg.seq == seq and reg.session(sk("s")).lease_expires_at == T0 + 1
    assert reg.expire_leases(T0 + 1) == (sk("s"),)


def test_sessions_without_a_lease_are_never_expired() -> None:
    reg = new_registry()
    _bound(reg)
    assert reg.expire_leases(T0 + 10**9) == ()
    assert reg.session(sk("s")).state is SessionState.OPEN


@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, True, "5"])
def test_a_bad_ttl_is_refused(ttl: object) -> None:
    reg = new_registry()
    _bound(reg)
    refused(ErrorCode.INVALID_REQUEST, reg.renew_lease, sk("s"), ttl, T0)


def test_renewing_an_unknown_or_closed_session_is_refused() -> None:
    reg = new_registry()
    _bound(reg)
    refused(ErrorCode.INVALID_REQUEST, reg.renew_lease, sk("nobody"), 1.0, T0)
    reg.close_and_release(sk("s"))
    refused(ErrorCode.SESSION_CLOSED, reg.renew_lease, sk("s"), 1.0, T0)
    refused(ErrorCode.INVALID_REQUEST, reg.expire_leases, math.nan)


def test_the_durable_store_stamps_now_once_and_replays_the_same_decisions(tmp_path: Path) -> None:
    path = tmp_path / "reg.db"
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        _bound(d)
        t = time.time()
        view = d.renew_lease(sk("s"), 0.05)  # no now: the store's clock
        assert t <= view.lease_expires_at - 0.05 <= time.time()
        time.sleep(0.06)
        assert d.expire_leases() == (sk("s"),)
        before = d.dump()
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        assert d.dump() == before and d.session(sk("s")).expired


# ------------------------------------------------------------------------------ session layer


async def _world(ttl: float, heartbeat: float | None):
    reg = new_registry()
    cluster = make_cluster()
    pub = EnginePublisher(
        reg, cluster.clients, registry_retry_delay_s=0.0, reclaim_wait_s=0.05, reclaim_poll_s=0.01
    )
    assert (await pub.publish(make_snapshot(seed=1), "A")).ok
    client = AsyncRegistryClient.in_process(reg, retries=0)
    mgr = SessionManager(client, cluster.clients, lease_ttl_s=ttl, heartbeat_s=heartbeat)
    return reg, cluster, pub, client, mgr


async def test_the_heartbeat_keeps_an_idle_session_alive_and_a_dead_worker_loses_its_sessions() -> None:
    reg, cluster, pub, client, mgr = await _world(ttl=0.3, heartbeat=0.05)
    reaper = asyncio.ensure_future(client.reap_leases_forever(0.02))  # the host stamps its clock
    try:
        live = await mgr.open("live")
        await live.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        # the "crashed worker": its own manager, bound, then its heartbeat and requests stop
        dead_mgr = SessionManager(client, cluster.clients, lease_ttl_s=0.3, heartbeat_s=0.05)
        dead = await dead_mgr.open("dead")
        await dead.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        await dead_mgr.aclose()
        assert (await pub.publish(make_snapshot(seed=2), "B")).ok  # A retired, held by both
        assert reg.version(vk("A")).session_refs == 2
        await asyncio.sleep(1.0)  # > 3 TTLs idle: the live one is renewed by its heartbeat
        assert reg.session(live.key).state is SessionState.OPEN
        assert reg.session(dead.key).expired and reg.version(vk("A")).session_refs == 1
        out = await live.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["lora_path"] == live.lora_path
        # the dead worker's late request: typed SESSION_EXPIRED, nothing sent, never rebound
        sent = sum(len(f.generations) for f in cluster.fakes.values())
        with pytest.raises(Exception) as e:
            await dead.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
        assert getattr(e.value, "code", None) is ErrorCode.SESSION_EXPIRED
        assert dead.phase is SessionPhase.EXPIRED and dead.bind_calls == 1
        assert sum(len(f.generations) for f in cluster.fakes.values()) == sent
        await live.close()
        (res,) = await pub.reclaim_ready()
        assert res.done and reg.version(vk("A")).state is VersionState.RECLAIMED
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)
        assert reaper.cancelled()  # it ran until cancelled: no call of it raised
        await mgr.aclose()
        await cluster.aclose()



async def test_the_default_heartbeat_is_a_third_of_the_ttl_and_keeps_an_idle_session() -> None:
    """No heartbeat given (as the README's quickstart does): the manager renews every TTL / 3,
    so a session idle for several TTLs is never expired while its worker lives."""
    reg, cluster, _pub, client, mgr = await _world(ttl=0.3, heartbeat=None)
    assert mgr.heartbeat_s == pytest.approx(0.1)
    reaper = asyncio.ensure_future(client.reap_leases_forever(0.02))
    try:
        s = await mgr.open("idle")
        await s.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        before = mgr.renewals
        await asyncio.sleep(1.0)  # more than 3 TTLs without a turn
        assert reg.session(s.key).state is SessionState.OPEN
        assert 6 <= mgr.renewals - before <= 14  # about one renewal per 0.1 s
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)
        await mgr.aclose()
        await cluster.aclose()
