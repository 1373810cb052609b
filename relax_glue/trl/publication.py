"""Rank 0 publishes each TRL step's adapter; every rank records the outcome they agree on.

The TRL-specific part is small: freeze the policy's adapter on rank 0 (``Snapshot.from_peft_model``
on the model TRL hands the callback), bound everything rank 0 does before the outcome broadcast
(``publish_timeout_s``: every exception and every hang becomes a typed FAILED outcome, so rank 0
always reaches the broadcast), and count failures on every rank. The publication itself follows
the capacity backpressure rule of :mod:`relax_glue.backpressure`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lora_contract.errors import ErrorCode
from relax_glue.backpressure import Decision, PublishDecision, publish_with_backpressure
from relax_glue.trl.config import VersionsConfig
from relax_glue.trl.event_loop import LoopThread
from relax_glue.trl.outcomes import (
    OutcomeKind,
    PublicationFailed,
    PublicationOutcome,
    outcome_of,
    version_id,
)
from relax_glue.trl.ranks import RankInfo

if TYPE_CHECKING:
    from relax_glue.engine_client import EngineClient
    from relax_glue.publisher import Publisher, PublishResult
    from relax_glue.snapshot import Snapshot


@dataclasses.dataclass
class PublishRecord:
    """Rank 0's record of one publication: the outcome and each engine's local ``lora_id``
    (what SGLang's unload log line names)."""

    outcome: PublicationOutcome
    t_start: float
    t_end: float
    lora_ids: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ReclaimRecord:
    lora_name: str
    version_id: str
    done: bool
    engines: dict[str, str]
    trigger: str
    t_start: float  # wall clock
    t_end: float


class StepPublication:
    """Every rank's view of the run's publications; rank 0 (the one with a ``publisher``) also
    publishes. ``clients``: the engines, read once per published version for its local id."""

    def __init__(
        self,
        loop: LoopThread | None,
        rank: RankInfo,
        config: VersionsConfig,
        publisher: Publisher | None = None,
        clients: Mapping[str, EngineClient] | None = None,
    ) -> None:
        self.loop, self.rank, self.config = loop, rank, config
        self.publisher, self.clients = publisher, dict(clients or {})
        self.outcomes: list[PublicationOutcome] = []  # every rank: the agreed outcomes, in order
        self.publications: list[PublishRecord] = []  # rank 0
        self.reclaims: list[ReclaimRecord] = []  # rank 0
        self.last_published = -1  # rank 0: the step of the engines' default
        self.failures = 0

    def vid(self, step: int) -> str:
        return version_id(step, self.config.version_prefix)

    # -------------------------------------------------------------- the synchronous side

    def submit(self, model: Any, step: int, *, required: bool) -> concurrent.futures.Future[Any]:
        """Rank 0: freeze ``model``'s adapter now (training may go on), publish it on the loop."""
        from relax_glue.snapshot import Snapshot  # lazy: it imports torch

        try:
            snapshot = Snapshot.from_peft_model(_unwrap(model))
        except Exception as exc:  # a snapshot that cannot be taken is this step's typed failure
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result(PublicationOutcome.raised(step, self.vid(step), exc))
            return done
        assert self.loop is not None, "rank 0 publishes on its loop"
        return self.loop.submit(self.publish_step(snapshot, step, required))

    def settle(self, step: int, future: concurrent.futures.Future[Any]) -> PublicationOutcome:
        """Rank 0: the publication's outcome within ``publish_timeout_s``, whatever happens. A
        publication still running then is left to finish (a cancelled control call would only
        make an unknown outcome); the next one first settles what it left (``resolve``)."""
        vid = self.vid(step)
        try:
            return future.result(self.config.publish_timeout_s)
        except concurrent.futures.TimeoutError:
            return PublicationOutcome.failed(
                step, vid, "PUBLISH_TIMEOUT", f"no outcome within {self.config.publish_timeout_s}s"
            )
        except Exception as exc:
            return PublicationOutcome.raised(step, vid, exc)

    def record(self, outcome: PublicationOutcome) -> None:
        """Every rank, with the agreed outcome: count it; past ``max_failures`` raise (on every
        rank at once, after the broadcast, so no rank waits in a collective)."""
        self.outcomes.append(outcome)
        if outcome.kind is OutcomeKind.FAILED:
            self.failures += 1
            if self.failures > self.config.max_failures:
                raise PublicationFailed(outcome, self.failures)

    # ------------------------------------------------------------------- on the loop

    async def publish_step(self, snapshot: Snapshot | None, step: int, required: bool) -> PublicationOutcome:
        t0, wall0 = time.monotonic(), time.time()
        vid = self.vid(step)
        try:
            outcome = await self._publish_with_backpressure(snapshot, step, vid, required, t0)
        except Exception as exc:  # a registry that cannot be reached, a bug: typed, never a hang
            outcome = PublicationOutcome.raised(step, vid, exc)
        rec = PublishRecord(outcome, wall0, time.time())
        if outcome.kind is OutcomeKind.PUBLISHED:
            self.last_published = step
            rec.lora_ids = await self._lora_ids(outcome.lora_name or "")
        self.publications.append(rec)
        return outcome

    async def _publish_with_backpressure(
        self, snapshot: Any, step: int, vid: str, required: bool, t0: float
    ) -> PublicationOutcome:
        assert self.publisher is not None, "only rank 0 publishes"
        publisher = self.publisher
        await publisher.resolve()  # settle what an earlier attempt left pending (slot held)
        await self.reclaim("before publish")

        async def attempt() -> PublishResult:
            result = await publisher.publish(snapshot, vid)
            if not result.ok and result.holds_slot and result.registry_state is not None:
                # an unknown or unconfirmed outcome keeps its slot: settle it now, once
                result = await publisher.resolve(snapshot) or result
            return result

        def decide(waited_s: float) -> Decision:
            return self.config.policy.on_capacity_error(
                step=step, last_published=self.last_published, waited_s=waited_s, required=required
            )

        run = await publish_with_backpressure(attempt, decide, self.wait_for_slot, started=t0)
        counts = {"attempts": run.attempts, "capacity_refusals": run.capacity_refusals}
        if run.gave_up is None:
            return outcome_of(step, vid, run.result, seconds=time.monotonic() - t0, **counts)
        kind = OutcomeKind.SKIPPED if run.gave_up is PublishDecision.SKIP else OutcomeKind.FAILED
        return PublicationOutcome(
            step,
            vid,
            kind,
            code=ErrorCode.CAPACITY_ERROR.value,
            detail="capacity backpressure: every slot held after the bounded wait",
            seconds=round(time.monotonic() - t0, 4),
            **counts,
        )

    async def wait_for_slot(self, timeout_s: float) -> None:
        """Reclaim what nobody holds, until a slot is free or ``timeout_s`` passed."""
        assert self.publisher is not None
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            await self.reclaim("capacity wait")
            status = await self.publisher.registry.status()
            if status.slots_used < status.capacity or time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))

    async def reclaim(self, trigger: str) -> None:
        """Rank 0: unload every retired version no session holds (each once per engine)."""
        assert self.publisher is not None
        t = time.time()
        for r in await self.publisher.reclaim_ready():
            self.reclaims.append(
                ReclaimRecord(
                    r.lora_name,
                    r.version_key.version_id,
                    r.done,
                    {e: str(o) for e, o in r.engines.items()},
                    trigger,
                    t,
                    time.time(),
                )
            )

    async def _lora_ids(self, lora_name: str) -> dict[str, str]:
        """Each engine's local ``lora_id`` of a version just published (best effort: a status
        that does not come back leaves that engine out of the record, not the run)."""
        out: dict[str, str] = {}
        for eid, client in self.clients.items():
            try:
                status = await client.status()
            except Exception:
                continue
            for v in status.versions:
                if v.lora_name == lora_name and v.lora_id:
                    out[eid] = v.lora_id
        return out


def _unwrap(model: Any) -> Any:
    """The PEFT model behind a DDP wrapper (TRL hands callbacks the unwrapped one already)."""
    import torch  # lazy: the model is a torch module, and this module imports without torch

    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
