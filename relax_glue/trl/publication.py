"""Rank 0 publishes each TRL step's adapter through the step publisher; every rank records the
outcome they agree on.

This module only adapts a trainer step to :class:`~relax_glue.step_publisher.StepPublisher`
(which owns the capacity backpressure loop, the reclaims and their records): freeze the policy's
adapter on rank 0 (``Snapshot.from_peft_model`` on the model the callback gets), bound
everything rank 0 does before the outcome broadcast (``publish_timeout_s``: every exception and
every hang becomes a typed FAILED outcome, so rank 0 always reaches the broadcast), turn the
driver's record into the outcome every rank agrees on, and count failures on every rank. Not
TRL-specific: any trainer with a PEFT model and ``torch.distributed`` ranks can use it."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relax_glue.step_publisher import PublicationRecord, ReclaimRecord, StepPublisher
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
    from relax_glue.publisher import Publisher
    from relax_glue.snapshot import Snapshot


class StepPublication:
    """Every rank's view of the run's publications; rank 0 (given the cohort's ``publisher``)
    also publishes, through its step publisher (wall-clock records: they are compared with the
    episodes' open and close times, across processes of one host). ``clients``: the engines, read
    once per published version for its engine-local ``lora_id`` (what SGLang's unload log line
    names)."""

    def __init__(
        self,
        loop: LoopThread | None,
        rank: RankInfo,
        config: VersionsConfig,
        publisher: Publisher | None = None,
        clients: Mapping[str, EngineClient] | None = None,
    ) -> None:
        self.loop, self.rank, self.config, self.clients = loop, rank, config, dict(clients or {})
        self.steps = StepPublisher(publisher, config.policy, clock=time.time) if publisher else None
        self.outcomes: list[PublicationOutcome] = []  # every rank: the agreed outcomes, in order
        self.failures = 0
        self.lora_ids: dict[str, dict[str, str]] = {}  # rank 0: lora_name -> engine -> lora_id

    def vid(self, step: int) -> str:
        return version_id(step, self.config.version_prefix)

    @property
    def publications(self) -> list[PublicationRecord]:
        return self.steps.publications if self.steps is not None else []

    @property
    def reclaims(self) -> list[ReclaimRecord]:
        return self.steps.reclaims if self.steps is not None else []

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
        """Rank 0: one step through the step publisher, as the outcome every rank will agree on."""
        assert self.steps is not None, "only rank 0 publishes"
        vid = self.vid(step)
        try:
            rec = await self.steps.publish_step(snapshot, step, vid, required=required)  # type: ignore[arg-type]
        except Exception as exc:  # a registry that cannot be reached, a bug: typed, never a hang
            return PublicationOutcome.raised(step, vid, exc)
        if rec.published and rec.lora_name:
            self.lora_ids[rec.lora_name] = await self._lora_ids(rec.lora_name)
        return outcome_of(rec)

    def episode_closed(self) -> None:
        """Rank 0, on the loop: one of this process's episodes closed (a slot may be free now)."""
        if self.steps is not None:
            self.steps.episode_closed()

    async def finish(self) -> None:
        """Rank 0, once every episode has ended: the step publisher's last reclaim."""
        if self.steps is not None:
            await self.steps.close()

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
