"""The one driver for "publish this step under capacity backpressure", for every trainer that
publishes every optimizer step (the TRL integration, the online RL showcase, the lifecycle demo).

A trainer integration holds one :class:`StepPublisher` over the cohort's publisher and uses it
like this (all on the event loop the publisher lives on)::

    steps = StepPublisher(cohort.publisher, StalenessPolicy(max_staleness=2))
    steps.start()                         # optional: reclaim in the background as episodes close
    rec = await steps.publish_step(snapshot, step, "step7", required=(step == 0))
    if rec.outcome == FAILED: ...         # the forced wait ran out: something holds a slot forever
    steps.episode_closed()                # from each session close: its version may be reclaimable
    await steps.close()                   # stop the background loop (between two reclaims), reclaim once more

``publish_step`` settles what an earlier attempt left pending (``resolve``), reclaims what no
session holds, then publishes; an unknown or unconfirmed outcome that keeps its slot is resolved
once. On ``CAPACITY_ERROR`` the pure :class:`~relax_glue.backpressure.StalenessPolicy` decides
(:func:`~relax_glue.backpressure.publish_with_backpressure` is the one loop): RETRY waits for a
slot, SKIP gives the step up while the engines stay within the lag bound, FAIL ends a forced
wait (``required`` publications never skip). It returns a :class:`PublicationRecord` for every
outcome; it raises only what the publisher raises (a registry that cannot be reached, a bug),
after recording it as ``RAISED``.

Waiting for a slot is event driven, never a registry poll: one reclaim, one registry status read,
then the wait ends when a reclaim finishes that freed a slot (the background loop's, woken by
:meth:`episode_closed`), or, with no background loop, when an episode closes (the waiter then
reclaims itself), or when the policy's wait runs out.

Records, one type per fact, kept in order on :attr:`publications` and :attr:`reclaims`:
:class:`PublicationRecord` (one per ``publish_step``) and :class:`ReclaimRecord` (one per
version a reclaim run touched). Their times are on ``clock`` (injectable: the showcase counts
from its start, the TRL integration uses the wall clock); waits are measured on the same clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lora_contract.errors import ErrorCode
from relax_glue.backpressure import Decision, PublishDecision, StalenessPolicy, publish_with_backpressure

if TYPE_CHECKING:
    from relax_glue.publisher import Publisher, PublishResult
    from relax_glue.reclaimer import ReclaimResult
    from relax_glue.snapshot import Snapshot

PUBLISHED = "PUBLISHED"  # committed: the version is the engines' default (also a replayed one)
SKIPPED = "SKIPPED"  # the policy gave the step up; the engines stay on the previous version
FAILED = "FAILED"  # the policy's forced wait ran out with every slot still held
RAISED = "RAISED"  # the publisher raised (registry unreachable, a bug); publish_step re-raises
# any other outcome is the publisher's PublishOutcome value (OUTCOME_UNKNOWN, FAILED_CLEAN, ...)

BACKPRESSURE_DETAIL = "capacity backpressure: every slot held after the bounded wait"


@dataclasses.dataclass(frozen=True)
class PublicationRecord:
    """One step's publication, however it ended."""

    step: int  # the weights W_step
    version_id: str
    lora_name: str | None  # the published version's name; None unless PUBLISHED
    outcome: str  # PUBLISHED | SKIPPED | FAILED | RAISED | another PublishOutcome value
    attempts: int
    refusals: tuple[str, ...]  # the code of every refused attempt, in order
    waited_s: float  # from publish_step's start to the start of the last attempt
    lag_after: int  # steps the engines' default is behind the trainer after the decision
    t_start: float
    t_end: float
    publish_s: float | None = None  # the successful publish call (reserve .. commit)
    detail: str = ""  # why it did not publish

    @property
    def published(self) -> bool:
        return self.outcome == PUBLISHED

    @property
    def capacity_refusals(self) -> int:
        return sum(code == ErrorCode.CAPACITY_ERROR.value for code in self.refusals)

    @property
    def code(self) -> str | None:
        """The code of the refusal that decided a publication that did not happen."""
        return None if self.published or not self.refusals else self.refusals[-1]


@dataclasses.dataclass(frozen=True)
class ReclaimRecord:
    """One version a reclaim run touched."""

    step: int | None  # the step it was published at by this driver (None: not by this driver)
    version_id: str
    lora_name: str
    trigger: str  # "before publish" | "capacity wait" | "episode closed" | "final" | the caller's
    done: bool  # RECLAIMED: unloaded on every engine, its slot free
    engines: dict[str, str]  # engine -> how its part ended (UNLOADED, DRAINING:n, ...)
    t_start: float
    t_end: float


class StepPublisher:
    """Publishes a trainer's steps through ``publisher`` under ``policy`` and keeps the records.
    One per run, used from the publisher's event loop only."""

    def __init__(
        self,
        publisher: Publisher,
        policy: StalenessPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.publisher = publisher
        self.policy = policy
        self.clock = clock
        self.last_published = -1  # the step of the engines' default (-1: nothing yet)
        self.versions: dict[str, int] = {}  # lora_name -> step, for every version published here
        self.publications: list[PublicationRecord] = []
        self.reclaims: list[ReclaimRecord] = []
        self._closed = asyncio.Event()  # an episode closed: its version may be reclaimable now
        self._freed = asyncio.Event()  # a reclaim finished that freed a slot
        self._stopping = asyncio.Event()
        self._background: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------ publication

    async def publish_step(
        self, snapshot: Snapshot, step: int, version_id: str, *, required: bool = False
    ) -> PublicationRecord:
        """Publish ``snapshot`` (the weights after ``step`` updates) as ``version_id``; see the
        module docstring. ``required``: may not be skipped (the first version: nothing to roll
        out on without it)."""
        t0 = self.clock()
        try:
            await self.publisher.resolve()  # what an earlier attempt left pending holds a slot
            await self.reclaim("before publish")

            def decide(waited_s: float) -> Decision:
                return self.policy.on_capacity_error(
                    step=step, last_published=self.last_published, waited_s=waited_s, required=required
                )

            run = await publish_with_backpressure(
                lambda: self._attempt(snapshot, version_id), decide, self._wait_for_slot, self.clock, t0
            )
        except Exception as exc:
            self._keep(step, version_id, RAISED, None, 0, (), 0.0, t0, f"{type(exc).__name__}: {exc}")
            raise
        res, refusals = run.result, [ErrorCode.CAPACITY_ERROR.value] * run.capacity_refusals
        publish_s = None
        if run.gave_up is not None:
            outcome = SKIPPED if run.gave_up is PublishDecision.SKIP else FAILED
            name, detail = None, BACKPRESSURE_DETAIL
        elif res.ok:
            self.versions[res.lora_name] = step
            self.last_published = step
            outcome, name, detail, publish_s = PUBLISHED, res.lora_name, "", round(res.duration_s, 4)
        else:  # not the policy's refusal: recorded as it is
            refusals.append(res.error.code.value if res.error is not None else res.outcome.value)
            outcome, name = res.outcome.value, None
            detail = f"{res.outcome}: {res.error.message}" if res.error is not None else str(res.outcome)
        waited_s = run.last_attempt_s
        return self._keep(
            step, version_id, outcome, name, run.attempts, tuple(refusals), waited_s, t0, detail, publish_s
        )

    async def _attempt(self, snapshot: Snapshot, version_id: str) -> PublishResult:
        result = await self.publisher.publish(snapshot, version_id)
        if not result.ok and result.holds_slot:
            # an unknown or unconfirmed outcome keeps its slot: settle it now, once
            result = await self.publisher.resolve(snapshot) or result
        return result

    def _keep(
        self,
        step: int,
        version_id: str,
        outcome: str,
        lora_name: str | None,
        attempts: int,
        refusals: tuple[str, ...],
        waited_s: float,
        t0: float,
        detail: str,
        publish_s: float | None = None,
    ) -> PublicationRecord:
        rec = PublicationRecord(
            step,
            version_id,
            lora_name,
            outcome,
            attempts,
            refusals,
            round(waited_s, 3),
            step - self.last_published,
            round(t0, 3),
            round(self.clock(), 3),
            publish_s,
            detail,
        )
        self.publications.append(rec)
        return rec

    # ----------------------------------------------------------------------------- slots

    async def _wait_for_slot(self, timeout_s: float) -> None:
        """Reclaim what nobody holds; if no slot is free then, wait (at most ``timeout_s``) for
        a reclaim that frees one. Reads the registry once, whatever the wait."""
        self._freed.clear()
        if await self._reclaim_freed("capacity wait") or await self._slot_free():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        while not self._freed.is_set():
            # With the background loop running it takes the closes; otherwise this waiter does.
            events = [self._freed] if self._running() else [self._freed, self._closed]
            if not await _first_set(events, deadline - loop.time()):
                return  # the policy's wait ran out
            if self._closed.is_set() and not self._running():
                self._closed.clear()
                await self.reclaim("episode closed")

    async def _slot_free(self) -> bool:
        status = await self.publisher.registry.status()
        return status.slots_used < status.capacity

    async def _reclaim_freed(self, trigger: str) -> bool:
        return any(r.done for r in await self.reclaim(trigger))

    # --------------------------------------------------------------------------- reclaims

    async def reclaim(self, trigger: str) -> tuple[ReclaimResult, ...]:
        """One reclaim run (every retired version no session holds), recorded; one that freed a
        slot wakes a publication waiting for it."""
        t = self.clock()
        results = await self.publisher.reclaim_ready()
        t_end = round(self.clock(), 3)
        for r in results:
            self.reclaims.append(
                ReclaimRecord(
                    self.versions.get(r.lora_name),
                    r.version_key.version_id,
                    r.lora_name,
                    trigger,
                    r.done,
                    {e: str(o) for e, o in r.engines.items()},
                    round(t, 3),
                    t_end,
                )
            )
        if any(r.done for r in results):
            self._freed.set()
        return results

    def episode_closed(self) -> None:
        """An episode closed (its session released its ref): its version may be reclaimable.
        Wakes the background loop, or a publication waiting for a slot. Call it on the loop."""
        self._closed.set()

    async def reclaim_forever(self) -> None:
        """Reclaim as episodes close, until :meth:`close`. Stops between two reclaims, never
        inside one (a cancelled control call would be a call whose outcome nobody knows)."""
        while not self._stopping.is_set():
            await _first_set([self._closed, self._stopping], None)
            if self._closed.is_set():
                self._closed.clear()
                await self.reclaim("episode closed")

    def start(self) -> None:
        """Run :meth:`reclaim_forever` as a task of the running loop."""
        if self._background is None:
            self._background = asyncio.create_task(self.reclaim_forever(), name="step-publisher-reclaim")

    def _running(self) -> bool:
        return self._background is not None and not self._background.done()

    async def close(self) -> None:
        """Stop the background loop (after the reclaim it may be running) and reclaim once more:
        every session the caller closed before this is reclaimable now."""
        self._stopping.set()
        if self._background is not None:
            await self._background
            self._background = None
        await self.reclaim("final")


async def _first_set(events: list[asyncio.Event], timeout_s: float | None) -> bool:
    """Wait until one of ``events`` is set (True) or ``timeout_s`` passed (False)."""
    if any(e.is_set() for e in events):
        return True
    if timeout_s is not None and timeout_s <= 0:
        return False
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waits, return_exceptions=True)
    return bool(done)
