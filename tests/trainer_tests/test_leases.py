"""Worker leases (issues 10 and 26, beyond the RFC): a rollout worker holds one lease and its
sessions hang on it; when a crashed worker's lease runs out, every session on it is closed, exactly
once and through the same transition as a normal close, so the retired version they held can be
reclaimed. Renewals are soft state (memory only); a lease's grant and end and a session's
attachment are journaled, the end as its decision. The registry stays pure: time is an argument
(``now``), stamped once by whoever hosts the registry.

Registry rows use the REAL registry (``Checked``: full invariants after each accepted call, no
change on a refusal); the session rows drive the REAL session layer over fake engines."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time
from pathlib import Path

import pytest
from _eventually import eventually
from _fake_engine import make_cluster, make_snapshot
from _rg_helpers import ENGINES, EPOCH, Publisher, new_registry, refused, sk, vk

from lora_contract.errors import ErrorCode
from relax_glue.actor import AsyncRegistryClient, RegistryActor
from relax_glue.cohort import open_publisher
from relax_glue.registry_types import LeaseView, SessionState, VersionState, loads
from relax_glue.sessions import SessionManager, SessionPhase
from relax_glue.store import DurableRegistry

T0 = 1_000_000.0


def _bound(reg, name: str = "s", lease: str | None = None):
    pub = Publisher(reg)
    pub.publish("A")
    reg.bind_first(sk(name), lease)
    return pub


def test_one_keep_alive_renews_every_session_of_a_worker_and_moves_only_forward() -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    view = reg.grant_lease("w", 10.0, T0)
    assert view.live and view.expires_at == T0 + 10
    for name in ("s1", "s2", "s3"):
        reg.bind_first(sk(name), "w")
    seq = reg.seq
    assert reg.keep_alive("w", T0 + 5).expires_at == T0 + 15  # all three sessions at once
    assert reg.keep_alive("w", T0 + 1).expires_at == T0 + 15  # never earlier
    assert reg.grant_lease("w", 10.0, T0 + 6).expires_at == T0 + 16  # a repeated grant: a keep-alive
    assert reg.seq == seq  # renewals are soft state: no transition, nothing to journal
    assert reg.leases_due(T0 + 15.9) == () and reg.leases_due(T0 + 16) == ("w",)


def test_expiry_closes_exactly_once_only_the_sessions_of_the_lease_that_ran_out() -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.grant_lease("dead", 10.0, T0)
    reg.grant_lease("live", 10.0, T0)
    reg.bind_first(sk("d1"), "dead")
    reg.open_session(sk("d2"), "dead")  # opened, never bound: closed too, nothing to release
    reg.bind_first(sk("l1"), "live")
    reg.bind_first(sk("free"))  # no lease: never expires
    assert reg.version(vk("A")).session_refs == 3
    reg.keep_alive("live", T0 + 9)
    seq = reg.seq
    assert reg.expire_leases(T0 + 9.999) == () and reg.seq == seq  # not yet: nothing changes
    assert reg.expire_leases(T0 + 10) == (sk("d1"), sk("d2"))
    for name in ("d1", "d2"):
        view = reg.session(sk(name))
        assert view.state is SessionState.CLOSED and view.expired and view.lease_id == "dead"
    assert reg.session(sk("d1")).released and not reg.session(sk("d2")).released
    assert reg.session(sk("l1")).state is SessionState.OPEN
    assert reg.version(vk("A")).session_refs == 2
    assert reg.expire_leases(T0 + 10**6) == (sk("l1"),) and reg.seq == seq + 2  # each exactly once
    assert reg.session(sk("free")).state is SessionState.OPEN
    assert reg.lease("dead") == LeaseView("dead", 10.0, False, None)


def test_the_first_bind_keeps_the_lease_set_at_open() -> None:
    """The session layer's order: open on the worker's lease, then bind_first at the first turn
    (no lease argument). A worker that dies right after the bind must still expire."""
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.grant_lease("w", 10.0, T0)
    reg.open_session(sk("s"), "w")
    reg.bind_first(sk("s"))
    assert reg.session(sk("s")).lease_id == "w"
    assert reg.expire_leases(T0 + 100) == (sk("s"),)
    assert reg.version(vk("A")).session_refs == 0


def test_a_bind_keeps_every_field_of_the_session_record() -> None:
    """``bind_first`` on an OPEN, unbound session changes its binding (and a lease it is given)
    and nothing else."""
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.grant_lease("w", 10.0, T0)
    reg.open_session(sk("s"), "w")
    before = reg._sessions[sk("s")]
    reg.bind_first(sk("s"))
    after = reg._sessions[sk("s")]
    assert {k: v for k, v in vars(after).items() if k != "binding"} == {
        k: v for k, v in vars(before).items() if k != "binding"
    }


def test_an_ended_lease_is_never_renewed_nor_granted_again_and_its_sessions_never_rebind() -> None:
    reg = new_registry()
    _bound(reg, lease=None)
    reg.grant_lease("w", 1.0, T0)
    reg.open_session(sk("s2"), "w")
    reg.expire_leases(T0 + 2)
    seq = reg.seq
    refused(ErrorCode.SESSION_EXPIRED, reg.keep_alive, "w", T0 + 3)
    refused(ErrorCode.SESSION_EXPIRED, reg.grant_lease, "w", 1.0, T0 + 3)
    refused(ErrorCode.SESSION_EXPIRED, reg.open_session, sk("new"), "w")
    refused(ErrorCode.SESSION_EXPIRED, reg.bind_first, sk("s2"))
    assert reg.seq == seq and reg.session(sk("new")) is None


def test_a_session_whose_owner_died_mid_close_expires_too() -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.grant_lease("w", 1.0, T0)
    reg.bind_first(sk("s"), "w")
    reg.begin_close(sk("s"))  # the owner died before close_and_release
    assert reg.expire_leases(T0 + 1) == (sk("s"),)
    assert reg.version(vk("A")).session_refs == 0


def test_sessions_without_a_lease_are_never_expired() -> None:
    reg = new_registry()
    _bound(reg)
    assert reg.expire_leases(T0 + 10**9) == ()


@pytest.mark.parametrize("ttl", [0, -1, math.inf, math.nan, "10", True, None])
def test_a_bad_ttl_is_refused(ttl: object) -> None:
    reg = new_registry()
    refused(ErrorCode.INVALID_REQUEST, reg.grant_lease, "w", ttl, T0)


def test_unknown_leases_foreign_attachments_and_another_ttl_are_refused() -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    refused(ErrorCode.INVALID_REQUEST, reg.keep_alive, "nobody", T0)
    refused(ErrorCode.INVALID_REQUEST, reg.open_session, sk("s"), "nobody")
    refused(ErrorCode.INVALID_REQUEST, reg.bind_first, sk("s"), "nobody")
    refused(ErrorCode.INVALID_REQUEST, reg.grant_lease, "bad/id", 1.0, T0)
    reg.grant_lease("w", 1.0, T0)
    refused(ErrorCode.INVALID_REQUEST, reg.grant_lease, "w", 2.0, T0)  # a TTL is fixed at grant
    reg.grant_lease("v", 1.0, T0)
    reg.open_session(sk("s"), "w")
    refused(ErrorCode.INVALID_REQUEST, reg.open_session, sk("s"), "v")  # hangs on w, not v
    refused(ErrorCode.INVALID_REQUEST, reg.bind_first, sk("s"), "v")
    refused(ErrorCode.INVALID_REQUEST, reg.expire_leases, math.nan)
    refused(ErrorCode.INVALID_REQUEST, reg.end_leases, "w")  # a list, not one id


def test_pruning_forgets_an_ended_lease_with_its_last_session() -> None:
    reg = new_registry()
    Publisher(reg).publish("A")
    reg.grant_lease("w", 1.0, T0)
    reg.bind_first(sk("s"), "w")
    reg.expire_leases(T0 + 1)
    reg.open_session(sk("later"))
    reg.open_session(sk("later-2"))
    assert reg.prune_sessions(1) == 1 and reg.lease("w") is None


# ------------------------------------------------------------------------------ durable host


def _journal(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT op, args FROM journal ORDER BY seq").fetchall()


def test_renewals_write_nothing_to_disk(tmp_path: Path) -> None:
    """A thousand keep-alives: no commit, no journal row, not a byte more in the database or
    its WAL (what the store writes is a lease's grant and end and a session's open/bind/close)."""
    path = tmp_path / "reg.db"
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        Publisher(d).publish("A")
        d.grant_lease("w", 30.0)
        for i in range(64):
            d.bind_first(sk(f"s{i}"), "w")
        commits, rows = d.commits, len(_journal(path))
        sizes = [p.stat().st_size for p in (path, path.with_name(path.name + "-wal"))]
        for _ in range(1000):
            d.keep_alive("w")
        assert d.commits == commits and len(_journal(path)) == rows
        assert [p.stat().st_size for p in (path, path.with_name(path.name + "-wal"))] == sizes


def test_an_expiry_is_journaled_as_its_decision_and_a_restart_gives_live_leases_a_fresh_ttl(
    tmp_path: Path,
) -> None:
    """The live lease's TTL is 30 s, so no delay of this loaded machine (three fsynced commits
    before the first expiry) ends it by accident (it had 0.3 s, and a slow disk could have ended
    it with the dead one); its deadlines are then checked at stated times, not by sleeping."""
    path = tmp_path / "reg.db"
    ttl = 30.0
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        _bound(d, "gone", lease=None)
        d.grant_lease("dead", 0.05)
        old_deadline = d.grant_lease("live", ttl).expires_at
        d.bind_first(sk("d"), "dead")
        d.bind_first(sk("l"), "live")
        time.sleep(0.06)
        assert d.expire_leases() == (sk("d"),)  # no now: the store's clock
        before = d.dump()
    ops = _journal(path)
    assert [loads(args) for op, args in ops if op == "end_leases"] == [{"lease_ids": ["dead"]}]
    assert "expire_leases" not in {op for op, _ in ops}  # the decision, never the clock
    opened = time.time()
    with DurableRegistry.open(path, EPOCH, ENGINES, 2) as d:
        assert d.dump() == before and d.session(sk("d")).expired  # the same decisions
        fresh = d.lease("live").expires_at
        assert fresh >= opened + ttl > old_deadline  # a fresh TTL from the restart
        assert d.expire_leases(now=old_deadline + 0.01) == ()  # its old deadline no longer ends it
        assert d.expire_leases(now=fresh - 0.01) == ()
        assert d.expire_leases(now=fresh) == (sk("l"),)  # but one TTL after the restart, unrenewed, it ends


# ------------------------------------------------------------------------------ session layer


async def _world(ttl: float, heartbeat: float | None):
    reg = new_registry()
    cluster = make_cluster()
    pub = open_publisher(
        reg, cluster.clients, registry_retry_delay_s=0.0, reclaim_wait_s=0.05, reclaim_poll_s=0.01
    )
    assert (await pub.publish(make_snapshot(seed=1), "A")).ok
    client = AsyncRegistryClient.in_process(reg, retries=0)
    mgr = SessionManager(client, cluster.clients, lease_ttl_s=ttl, heartbeat_s=heartbeat)
    return reg, cluster, pub, client, mgr


async def test_the_heartbeat_keeps_an_idle_session_alive_and_a_dead_worker_loses_its_sessions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="relax_glue.actor")
    # the live worker's TTL is 1 s, so a renewal up to 0.95 s late (a stalled event loop) still
    # lands; the dead worker's is 0.3 s, and it idles for well over that
    reg, cluster, pub, client, mgr = await _world(ttl=1.0, heartbeat=0.05)
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
        await asyncio.sleep(1.5)  # > 1 TTL idle (5 of the dead one's): the heartbeat renews the live one
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
        assert reaper.cancelled()  # it ran until cancelled
        assert not [r for r in caplog.records if "lease reaper" in r.getMessage()]  # no tick failed
        await mgr.aclose()
        await cluster.aclose()


async def test_an_in_process_client_reaps_the_leases_granted_through_it_with_no_reaper_started() -> None:
    """Safe default: nobody starts a reaper, yet a dead worker's sessions end one TTL later. The
    in-process client is the registry's host and reaps from the first lease granted through it;
    a client through which no lease was granted runs none (nothing to reap)."""
    reg, cluster, _pub, _client, _mgr = await _world(ttl=0.3, heartbeat=0.05)
    client = AsyncRegistryClient.in_process(reg, retries=0, lease_reaper_s=0.02)
    try:
        unleased = SessionManager(client, cluster.clients, lease_ttl_s=None)
        s = await unleased.open("no-lease")
        await s.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        await asyncio.sleep(0.1)
        assert not client.reaping
        dead_mgr = SessionManager(client, cluster.clients, lease_ttl_s=0.3, heartbeat_s=0.05)
        dead = await dead_mgr.open("dead")
        await dead.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert client.reaping
        await dead_mgr.aclose()  # the worker "dies": no heartbeat, no close
        t0 = time.monotonic()
        while not reg.session(dead.key).expired:
            assert time.monotonic() - t0 < 3.0, "the default reaper never ended the dead worker's lease"
            await asyncio.sleep(0.02)
        assert reg.session(dead.key).state is SessionState.CLOSED
        assert reg.session(s.key).state is SessionState.OPEN  # no lease: never expired
        assert reg.version(vk("A")).session_refs == 1
        await s.close()
    finally:
        client.close()
        await asyncio.sleep(0)  # the cancellation lands
        assert not client.reaping
        await _mgr.aclose()
        await cluster.aclose()


async def test_the_default_heartbeat_is_a_third_of_the_ttl_and_keeps_an_idle_session() -> None:
    """No heartbeat given (as the README's quickstart does): the manager renews every TTL / 3,
    so a session idle for several TTLs is never expired while its worker lives."""
    # a TTL of 1.2 s: a renewal 0.4 s late still lands (the event loop of a loaded machine can
    # stall that long; with 0.3 s, 0.2 s was enough to let the 0.02 s reaper end a live lease)
    reg, cluster, _pub, client, mgr = await _world(ttl=1.2, heartbeat=None)
    assert mgr.heartbeat_s == pytest.approx(0.4)
    reaper = asyncio.ensure_future(client.reap_leases_forever(0.02))
    try:
        s = await mgr.open("idle")
        await s.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        before, t0 = mgr.renewals, time.monotonic()
        await asyncio.sleep(2.0)  # more than a TTL without a turn
        assert reg.session(s.key).state is SessionState.OPEN
        renewals, idle_s = mgr.renewals - before, time.monotonic() - t0
        assert 3 <= renewals <= idle_s / 0.4 + 1, (renewals, idle_s)  # about one renewal per 0.4 s
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)
        await mgr.aclose()
        await cluster.aclose()


async def test_a_manager_given_the_registry_itself_stops_its_own_clients_lease_reaper_on_close() -> None:
    """A manager given a registry object makes its own in-process client, which reaps leases from
    the first one granted through it: closing the manager stops that reaper. (Seen in CI: the
    reaper outlived its manager, met the registry's closed store and died with an error nobody
    read.) A client passed in stays its caller's: the manager leaves its reaper running."""
    reg, cluster, _pub, client, mgr = await _world(ttl=0.3, heartbeat=0.05)
    try:
        own = SessionManager(reg, cluster.clients, lease_ttl_s=0.3, heartbeat_s=0.05)
        s = await own.open("own")
        await s.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert own.registry is not client and own.registry.reaping
        given = await mgr.open("given")
        await given.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert client.reaping
        await own.aclose()
        assert not own.registry.reaping  # stopped, and its end awaited
        await mgr.aclose()
        assert client.reaping  # the caller's client: the caller closes it
    finally:
        await client.aclose()
        assert not client.reaping
        await cluster.aclose()


async def test_a_lease_reaper_goes_on_after_an_unexpected_error_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reaper tick that fails with an error the client does not expect (not the registry
    unreachable: a bug, a store error) is logged and the next tick runs: before, the reaper's
    task died of it silently and no lease of that client expired again (a dead worker's
    sessions held their versions for good)."""
    reg, cluster, _pub, _client, _mgr = await _world(ttl=0.3, heartbeat=0.05)
    client = AsyncRegistryClient.in_process(reg, retries=0, lease_reaper_s=0.02)
    real_call, planted = client._acall, []

    async def the_first_reap_fails(op: str, kwargs: dict) -> object:
        if op == "expire_leases" and not planted:
            planted.append(op)
            raise RuntimeError("planted: one reaper tick fails")
        return await real_call(op, kwargs)

    client._acall = the_first_reap_fails
    try:
        with caplog.at_level("WARNING", logger="relax_glue.actor"):
            dead_mgr = SessionManager(client, cluster.clients, lease_ttl_s=0.3, heartbeat_s=0.05)
            dead = await dead_mgr.open("dead")
            await dead.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            await dead_mgr.aclose()  # the worker "dies"
            await eventually(lambda: reg.session(dead.key).expired, timeout=5.0, poll_s=0.02)
        assert planted and client.reaping
        assert any("planted: one reaper tick fails" in r.getMessage() for r in caplog.records)
    finally:
        await client.aclose()
        await _mgr.aclose()
        await cluster.aclose()


async def test_the_registry_actors_reaper_thread_goes_on_after_a_failed_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The actor's own reaper (a thread of its body, run here without Ray) outlives a tick whose
    registry call raised (a store error): logged, and the ticks go on. Before, the thread died
    of it and the actor never expired a lease again."""
    actor = RegistryActor(EPOCH, ENGINES, 2, None, "NORMAL", lease_reaper_s=0.02)
    reg = actor._registry
    assert reg is not None
    real, ticks = reg.expire_leases, []

    def one_tick_fails(**kwargs: object) -> object:
        ticks.append(kwargs)
        if len(ticks) == 2:
            raise RuntimeError("planted: the store failed one tick")
        return real(**kwargs)

    with caplog.at_level("WARNING", logger="relax_glue.actor"):
        reg.expire_leases = one_tick_fails  # type: ignore[method-assign]
        try:
            await eventually(lambda: len(ticks) >= 5, timeout=5.0, poll_s=0.02, what="more ticks")
        finally:
            actor.stop_reaping()
    assert any("planted: the store failed one tick" in r.getMessage() for r in caplog.records)
