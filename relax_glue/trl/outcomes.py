"""What every rank learns about one step's publication: the outcome rank 0 decides and
broadcasts (builtins only on the wire), and the error every rank raises at the same step once
failures exceed the budget. Pure: no torch, no trl, no IO."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from lora_contract.errors import LoraVersionError
from relax_glue.step_publisher import SKIPPED

if TYPE_CHECKING:
    from relax_glue.step_publisher import PublicationRecord


def version_id(step: int, prefix: str = "step") -> str:
    return f"{prefix}{step}"


class OutcomeKind(StrEnum):
    PUBLISHED = "PUBLISHED"  # the step's version is committed: the new default
    SKIPPED = "SKIPPED"  # capacity backpressure: this step was not published (counted, bounded)
    FAILED = "FAILED"  # refused, failed on an engine, timed out, or raised: typed in ``code``


@dataclasses.dataclass(frozen=True)
class PublicationOutcome:
    """What every rank learns about one step's publication (rank 0 decides, all agree)."""

    step: int
    version_id: str
    kind: OutcomeKind
    lora_name: str | None = None  # the committed exact name (PUBLISHED)
    code: str | None = None  # the error code or publish outcome that decided a SKIP or a FAILED
    detail: str = ""
    attempts: int = 0
    capacity_refusals: int = 0
    seconds: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        """Builtins only: a small pickle for ``broadcast_object_list``."""
        return {**dataclasses.asdict(self), "kind": self.kind.value}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> PublicationOutcome:
        return cls(**{**wire, "kind": OutcomeKind(wire["kind"])})

    @classmethod
    def failed(cls, step: int, vid: str, code: str, detail: str = "", **kw: Any) -> PublicationOutcome:
        return cls(step, vid, OutcomeKind.FAILED, code=code, detail=detail[:500], **kw)

    @classmethod
    def raised(cls, step: int, vid: str, exc: BaseException) -> PublicationOutcome:
        """The step failed with ``exc``: a typed error keeps its code (a sharded adapter's
        INVALID_REQUEST), anything else is named by its type."""
        code = exc.code.value if isinstance(exc, LoraVersionError) else type(exc).__name__
        return cls.failed(step, vid, code, str(exc))


class PublicationFailed(RuntimeError):
    """Raised on every rank, at the same step, once failures exceed ``max_failures``."""

    def __init__(self, outcome: PublicationOutcome, failures: int) -> None:
        super().__init__(
            f"publication of {outcome.version_id} failed ({outcome.code}: {outcome.detail}); "
            f"{failures} failed publication(s) in this run"
        )
        self.outcome = outcome
        self.failures = failures


def outcome_of(rec: PublicationRecord) -> PublicationOutcome:
    """The step publisher's record of one step as the outcome every rank agrees on: published,
    a counted skip (the policy gave the step up), or a typed failure (the forced wait ran out:
    ``CAPACITY_ERROR``; or the publisher's own outcome with its error code)."""
    if rec.published:
        kind = OutcomeKind.PUBLISHED
    elif rec.outcome == SKIPPED:
        kind = OutcomeKind.SKIPPED
    else:
        kind = OutcomeKind.FAILED
    return PublicationOutcome(
        rec.step,
        rec.version_id,
        kind,
        lora_name=rec.lora_name,
        code=rec.code,
        detail=rec.detail[:500],
        attempts=rec.attempts,
        capacity_refusals=rec.capacity_refusals,
        seconds=round(rec.t_end - rec.t_start, 4),
    )
