"""A rollout worker that outlives its own lease (docs/fault-semantics.md, "Leases"): its heartbeat
stalls past the TTL while the worker lives, the registry's reaper ends the lease and closes its
sessions. The rule: its old sessions are refused with SESSION_EXPIRED and never rebind; its NEXT
session opens on a NEW lease, and that lease is kept alive by the worker's heartbeat.

The REAL session layer (``SessionManager``) over the REAL in-process registry client and registry,
fake engines (pure logic). The fault is injected into the real client's transport: the worker's
keep-alive calls hang (a stalled heartbeat: the call never comes back) until the test heals them;
every other call passes through untouched."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _eventually import eventually
from _fake_engine import make_snapshot
from _in_process_world import InProcessWorld
from _rg_helpers import vk

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.actor import AsyncRegistryClient, RegistryUnavailable
from relax_glue.registry_types import SessionState
from relax_glue.sessions import SessionPhase

TTL_S = 0.3
HEARTBEAT_S = 0.05
REAPER_S = 0.02
TURN = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}


class StalledKeepAlives:
    """The real client's transport, wrapped: while stalled, every ``keep_alive`` hangs until
    :meth:`heal`, then goes out as it was (late); while refused, every ``keep_alive`` fails at
    once as an unreachable registry does; every other call passes through. ``hold_reaper``: the
    registry's lease reaper hangs too (a registry that has not ended the lease yet)."""

    def __init__(self, client: AsyncRegistryClient) -> None:
        self._real = client._acall
        self._healed = asyncio.Event()
        self._healed.set()
        self._reaper_free = asyncio.Event()
        self._reaper_free.set()
        self.refusing = False
        self.hung = 0
        client._acall = self._call

    def stall(self) -> None:
        self._healed.clear()

    def refuse(self) -> None:
        self.refusing = True

    def hold_reaper(self) -> None:
        self._reaper_free.clear()

    def heal(self) -> None:
        self.refusing = False
        self._healed.set()
        self._reaper_free.set()

    async def _call(self, op: str, kwargs: dict[str, Any]) -> Any:
        if op == "expire_leases":
            await self._reaper_free.wait()
        if op == "keep_alive" and self.refusing:
            raise RegistryUnavailable(op, ConnectionRefusedError("the registry's node is cut off"))
        if op == "keep_alive" and not self._healed.is_set():
            self.hung += 1
            await self._healed.wait()
        return await self._real(op, kwargs)


class World(InProcessWorld):
    """The worker's sessions reach the registry through ``client``, whose keep-alives ``faults``
    can stall."""

    def __init__(self) -> None:
        super().__init__(publisher_options={"registry_retry_delay_s": 0.0})
        self.client = AsyncRegistryClient.in_process(self.reg, retries=0, lease_reaper_s=REAPER_S)
        self.faults = StalledKeepAlives(self.client)
        self.mgr = self.sessions(self.client, lease_ttl_s=TTL_S, heartbeat_s=HEARTBEAT_S)

    def sent(self) -> int:
        return sum(len(f.generations) for f in self.cluster.fakes.values())

    async def until(self, what: str, done: Any, limit_s: float = 3.0) -> None:
        await eventually(done, timeout=limit_s, poll_s=0.01, what=what)


@pytest.fixture()
async def world() -> AsyncIterator[World]:
    w = World()
    assert (await w.pub.publish(make_snapshot(seed=1), "A")).ok
    yield w
    w.faults.heal()
    await w.mgr.aclose()
    w.client.close()
    await w.cluster.aclose()


async def _outlive_the_lease(w: World) -> tuple[Any, str]:
    """The worker's session ``old`` bound on its lease; then its heartbeat stalls until the
    registry's reaper ended the lease (the worker itself is alive all along)."""
    old = await w.mgr.open("old")
    await old.generate(TURN)
    first_lease = w.mgr.lease_id
    assert first_lease is not None and old.lease_id == first_lease
    w.faults.stall()
    await w.until("the reaper ends the stalled lease", lambda: not w.reg.lease(first_lease).live)
    view = w.reg.session(old.key)
    assert view.state is SessionState.CLOSED and view.expired and view.released
    assert w.reg.version(vk("A")).session_refs == 0
    return old, first_lease


async def _kept_alive(w: World, session: Any, lease_id: str) -> None:
    """The session idles for more than three TTLs: its lease is renewed by the heartbeat all
    along (renewals counted by the worker, deadlines moved in the registry) and never ends."""
    granted_by = time.time()
    renewals = w.mgr.renewals
    await asyncio.sleep(4 * TTL_S)
    lease = w.reg.lease(lease_id)
    assert lease.live and lease.expires_at > granted_by + 3 * TTL_S  # renewed past its first TTL
    assert w.mgr.renewals - renewals >= 3 * TTL_S / HEARTBEAT_S / 2
    assert w.reg.session(session.key).state is SessionState.OPEN
    out = await session.generate(TURN)
    assert out["meta_info"]["lora_path"] == session.lora_path


async def _old_session_is_refused(w: World, old: Any) -> None:
    sent = w.sent()
    with pytest.raises(LoraVersionError) as e:
        await old.generate(TURN)
    assert e.value.code is ErrorCode.SESSION_EXPIRED
    assert old.phase is SessionPhase.EXPIRED and old.bind_calls == 1  # never rebound
    assert w.sent() == sent  # nothing reached an engine


async def test_after_the_heartbeat_learns_its_lease_ended_the_next_session_takes_a_new_lease(
    world: World,
) -> None:
    """The stall ends first: the late keep-alive answers SESSION_EXPIRED (the old session is
    marked EXPIRED), then the worker opens its next session: on a new lease, kept alive."""
    w = world
    old, first_lease = await _outlive_the_lease(w)
    w.faults.heal()
    await w.until("the worker marks its old session EXPIRED", lambda: old.phase is SessionPhase.EXPIRED)
    assert w.mgr.lease_id is None

    nxt = await w.mgr.open("next")
    assert nxt.lease_id is not None and nxt.lease_id != first_lease and nxt.lease_id == w.mgr.lease_id
    assert w.reg.session(nxt.key).lease_id == nxt.lease_id and w.reg.lease(nxt.lease_id).live
    await nxt.generate(TURN)
    assert w.reg.version(vk("A")).session_refs == 1
    await _kept_alive(w, nxt, nxt.lease_id)
    await _old_session_is_refused(w, old)
    await nxt.close()
    assert w.reg.version(vk("A")).session_refs == 0


async def test_a_session_opened_while_the_heartbeat_is_still_stalled_takes_a_new_lease(world: World) -> None:
    """The worker opens its next session before its stalled heartbeat heard anything: the
    registry refuses the ended lease (SESSION_EXPIRED), so the worker marks the old session
    EXPIRED and opens the new one on a new lease. The stalled keep-alive of the old lease,
    answered late, must not take the new lease from the worker: it is kept alive."""
    w = world
    old, first_lease = await _outlive_the_lease(w)
    assert w.mgr.lease_id == first_lease  # the worker has not heard yet

    nxt = await w.mgr.open("next")
    assert nxt.lease_id is not None and nxt.lease_id != first_lease and nxt.lease_id == w.mgr.lease_id
    assert w.reg.session(nxt.key).lease_id == nxt.lease_id and w.reg.lease(nxt.lease_id).live
    assert old.phase is SessionPhase.EXPIRED
    await nxt.generate(TURN)

    hung = w.faults.hung
    assert hung >= 1
    w.faults.heal()  # the old lease's keep-alive comes back now: SESSION_EXPIRED, of the OLD lease
    await _kept_alive(w, nxt, nxt.lease_id)
    assert w.mgr.lease_id == nxt.lease_id
    await _old_session_is_refused(w, old)
    await nxt.close()
    assert w.reg.version(vk("A")).session_refs == 0


async def test_an_unbound_sessions_first_turn_after_its_lease_ended_marks_the_worker_expired(
    world: World,
) -> None:
    """A session opened, not bound yet, when the stalled worker's lease ends: its first turn's
    bind is refused SESSION_EXPIRED by the registry. That answer is the lease's end: the session
    is marked EXPIRED (refused from now on, nothing sent, never bound), the worker drops the
    ended lease, and its next session opens on a new one without waiting for the heartbeat."""
    w = world
    unbound = await w.mgr.open("unbound")
    first_lease = w.mgr.lease_id
    w.faults.stall()
    await w.until("the reaper ends the stalled lease", lambda: not w.reg.lease(first_lease).live)
    sent = w.sent()
    with pytest.raises(LoraVersionError) as e:
        await unbound.generate(TURN)
    assert e.value.code is ErrorCode.SESSION_EXPIRED
    assert unbound.phase is SessionPhase.EXPIRED and unbound.binding is None
    assert w.mgr.lease_id is None and w.sent() == sent
    with pytest.raises(LoraVersionError) as e:
        await unbound.generate(TURN)  # refused here, no second bind asked for
    assert e.value.code is ErrorCode.SESSION_EXPIRED and unbound.bind_calls == 1

    nxt = await w.mgr.open("next")
    assert nxt.lease_id not in (None, first_lease) and w.reg.lease(nxt.lease_id).live
    w.faults.heal()
    await _kept_alive(w, nxt, nxt.lease_id)
    await nxt.close()
    assert w.reg.version(vk("A")).session_refs == 0


# --------------------------------------------------------------------- a worker cut off (issue 42)


def _cut(w: World, how: str) -> None:
    if how == "refused":
        w.faults.refuse()
    else:
        w.faults.stall()


async def _fenced(w: World, session: Any) -> None:
    """The turn is refused WORKER_FENCED within a heartbeat, nothing reaches an engine, and the
    session is left as it was (nothing decided on a guess)."""
    sent, fenced = w.sent(), w.mgr.fenced_turns
    with pytest.raises(LoraVersionError) as e:
        # bounded: before the fence, a hung keep-alive held the turn for as long as the cut lasted
        await asyncio.wait_for(session.generate(TURN), timeout=10 * HEARTBEAT_S)
    assert e.value.code is ErrorCode.WORKER_FENCED, e.value
    assert w.sent() == sent and w.mgr.fenced_turns == fenced + 1
    assert session.phase is SessionPhase.OPEN and session.binding is not None


@pytest.mark.parametrize("how", ["refused", "hung"])
async def test_a_worker_cut_off_from_the_registry_fences_itself_and_its_session_ends_closed(
    world: World, how: str
) -> None:
    """Its keep-alives cannot get through (refused at once, or never answered) while the worker
    lives, and the registry ends the lease it no longer hears of: the refs are released, so the
    version may be reclaimed. The worker must not dispatch on that lease (before the fence, a
    refused keep-alive let the turn go out, the engine the only guard). When the link returns,
    the session is EXPIRED: refused, nothing sent, its ref released once."""
    w = world
    s = await w.mgr.open("cut")
    await s.generate(TURN)
    lease = w.mgr.lease_id
    _cut(w, how)
    await w.until("the registry ends the lease it no longer hears of", lambda: not w.reg.lease(lease).live)
    await _fenced(w, s)
    await _fenced(w, s)  # and again, for as long as the cut lasts
    w.faults.heal()
    sent = w.sent()
    with pytest.raises(LoraVersionError) as e:
        await s.generate(TURN)
    assert e.value.code is ErrorCode.SESSION_EXPIRED and s.phase is SessionPhase.EXPIRED
    assert w.sent() == sent and w.reg.version(vk("A")).session_refs == 0


async def test_a_fenced_worker_whose_lease_outlived_the_cut_goes_on_with_the_same_binding(
    world: World,
) -> None:
    """The cut outlasts the worker's own view of its TTL, but the registry has not ended the lease
    yet (its reaper late): the worker fences itself all the same (it cannot know), and when the
    link returns the keep-alive renews the lease and the session goes on, on its binding."""
    w = world
    s = await w.mgr.open("cut")
    await s.generate(TURN)
    lease = w.mgr.lease_id
    w.faults.hold_reaper()
    w.faults.refuse()
    await asyncio.sleep(TTL_S + 2 * HEARTBEAT_S)  # stale by the worker's clock
    await _fenced(w, s)
    assert w.reg.lease(lease).live and w.reg.version(vk("A")).session_refs == 1
    w.faults.heal()
    out = await s.generate(TURN)
    assert out["meta_info"]["lora_path"] == s.lora_path and w.mgr.lease_id == lease
    assert s.phase is SessionPhase.OPEN and w.reg.lease(lease).live
    await s.close()
    assert w.reg.version(vk("A")).session_refs == 0
