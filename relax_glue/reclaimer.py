"""Reclaim of committed versions across the cohort (RFC 5): every RETIRED version with no
session refs is claimed in the registry (from then on requests for it are refused), reclaimed on
every engine (polling through DRAINING with a bounded wait per call while SGLang's native
in-flight count drains) and confirmed per engine; the registry frees the slot only when every
engine confirmed the physical unload."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from enum import StrEnum

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.cohort_core import CohortCore, CohortDriver, EngineStep
from relax_glue.registry import may_start_reclaim
from relax_glue.registry_types import ReclaimPhase, UnloadEvidence, VersionKey, VersionState, VersionView


class EngineReclaimState(StrEnum):
    UNLOADED = "UNLOADED"  # the registry holds this engine's UNLOADED receipt
    DRAINING = "DRAINING"  # unregistered there, requests still in flight when the deadline came
    UNKNOWN = "UNKNOWN"  # the call's outcome is unknown (marked in the registry, slot kept)
    REFUSED = "REFUSED"  # the engine (or the registry, for its receipt) refused, with a code
    PENDING = "PENDING"  # not reached in this run


@dataclasses.dataclass(frozen=True)
class EngineReclaim:
    """How one engine's part of a reclaim run ended."""

    state: EngineReclaimState
    in_flight: int | None = None  # DRAINING: SGLang's native count at the last call
    code: ErrorCode | None = None  # REFUSED
    calls: int = 0  # reclaim calls this run made to the engine

    def __str__(self) -> str:
        if self.state is EngineReclaimState.DRAINING:
            return f"DRAINING:{self.in_flight}"
        if self.state is EngineReclaimState.REFUSED:
            return f"REFUSED:{self.code.value if self.code else '?'}"
        return self.state.value

    def step_detail(self) -> str:
        """The engine step's line: with the number of calls an unload took."""
        if self.state is EngineReclaimState.UNLOADED:
            return f"UNLOADED after {self.calls} call(s)"
        return str(self)


@dataclasses.dataclass(frozen=True)
class ReclaimResult:
    version_key: VersionKey
    lora_name: str
    reclaim_id: str | None
    registry_state: VersionState | None
    engines: Mapping[str, EngineReclaim]  # every cohort engine (empty: the claim was refused)
    error: LoraVersionError | None = None  # the registry refused the claim
    steps: tuple[EngineStep, ...] = ()
    duration_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.registry_state is VersionState.RECLAIMED


class Reclaimer(CohortDriver):
    def __init__(
        self, cohort: CohortCore, *, wait_s: float = 2.0, poll_s: float = 0.1, deadline_s: float = 60.0
    ) -> None:
        super().__init__(cohort)
        self.reclaim_wait_s = wait_s
        self.reclaim_poll_s = poll_s
        self.reclaim_deadline_s = deadline_s
        # Held by every reclaim run, and by whoever must not run beside one (a restore).
        self.lock = cohort.reclaim_lock

    async def reclaim_ready(self, *, deadline_s: float | None = None) -> tuple[ReclaimResult, ...]:
        """Reclaim every RETIRED version without session refs, and continue every version
        already RECLAIMING (an earlier run that hit its deadline or an unknown outcome). Then the
        cohort's snapshot store drops the versions that became RECLAIMED."""
        async with self.lock:
            await self._setup()
            status = await self.registry.status()
            todo = [v for v in status.versions if v.state is VersionState.RECLAIMING or may_start_reclaim(v)]
            deadline = time.monotonic() + (self.reclaim_deadline_s if deadline_s is None else deadline_s)
            results = tuple([await self._reclaim_version(v, deadline) for v in todo])
        await self.cohort.retain_live_snapshots()
        return results

    async def _reclaim_version(self, view: VersionView, deadline: float) -> ReclaimResult:
        t0 = time.monotonic()
        try:
            claim = await self.registry.claim_reclaim(version_key=view.version_key)
        except LoraVersionError as err:  # e.g. a session still holds it
            return ReclaimResult(view.version_key, view.lora_name, None, view.state, {}, error=err)
        phases = dict(view.reclaim_phases)
        todo = [e for e in self._cohort if phases.get(e) is not ReclaimPhase.UNLOADED]
        steps: list[EngineStep] = []

        async def one(engine: str) -> EngineReclaim:
            polls = 0
            while True:
                wait = max(0.0, min(self.reclaim_wait_s, deadline - time.monotonic()))
                reply = await self.engines[engine].reclaim(
                    protocol.ReclaimRequest(
                        lora_name=claim.lora_name, reclaim_id=claim.reclaim_id, timeout_s=wait
                    )
                )
                polls += 1
                if isinstance(reply, protocol.UnloadedReceipt):
                    await self._note_incarnation(engine, reply.incarnation)
                    unloaded = UnloadEvidence(claim.reclaim_id, reply.incarnation)
                    await self._record(
                        self.registry.confirm_reclaim(
                            version_key=view.version_key, engine_id=engine, receipt=unloaded
                        )
                    )
                    return EngineReclaim(EngineReclaimState.UNLOADED, calls=polls)
                # DRAINING: the name is unregistered, in-flight requests are finishing. Known
                # state, not an unknown one: keep polling until the deadline, then report it.
                # An unload SGLang refused (unload_error) is the same: started, retried next call.
                if time.monotonic() + self.reclaim_poll_s >= deadline:
                    return EngineReclaim(EngineReclaimState.DRAINING, reply.in_flight, calls=polls)
                await asyncio.sleep(self.reclaim_poll_s)

        ok, refused, unknown = await self._fanout(steps, "reclaim", todo, one, EngineReclaim.step_detail)
        for engine, u in unknown.items():
            await self._mark_unknown(engine, claim.reclaim_id, "reclaim", u.cause)
        after = await self.registry.version(version_key=view.version_key)
        engines: dict[str, EngineReclaim] = {}
        for e in self._cohort:
            calls = ok[e].calls if e in ok else 0
            if after is not None and after.reclaim_phases.get(e) is ReclaimPhase.UNLOADED:
                engines[e] = EngineReclaim(EngineReclaimState.UNLOADED, calls=calls)
            elif e in unknown:
                engines[e] = EngineReclaim(EngineReclaimState.UNKNOWN)
            elif e in refused:
                engines[e] = EngineReclaim(EngineReclaimState.REFUSED, code=refused[e].code)
            else:
                engines[e] = ok.get(e, EngineReclaim(EngineReclaimState.PENDING))
        return ReclaimResult(
            view.version_key,
            claim.lora_name,
            claim.reclaim_id,
            after.state if after is not None else None,
            engines,
            steps=tuple(steps),
            duration_s=time.monotonic() - t0,
        )
