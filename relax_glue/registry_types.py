"""Value types of the LoRA version registry: keys, states, receipts, results, and their codec.

Everything here is an immutable value (frozen dataclass, NamedTuple or enum) so it can be
returned to callers, stored as an op result, pickled across a Ray actor boundary and written to
the SQLite journal without any chance of a caller mutating registry state through a reference.

The JSON codec at the bottom is tagged (``{"$t": "VersionKey", ...}``) so that a journal row
decodes back to exactly the typed value that was passed in; the store relies on that to replay
the journal and to compare recomputed results with the stored ones.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from enum import Enum, StrEnum
from typing import Any, NamedTuple

# --------------------------------------------------------------------------------------- keys


class VersionKey(NamedTuple):
    """``(deployment_epoch, version_id)``: the logical identity of one managed LoRA version."""

    epoch: str
    version_id: str

    def __str__(self) -> str:
        return f"{self.epoch}/{self.version_id}"


class SessionKey(NamedTuple):
    """``(deployment_epoch, nonce)``: one session lifecycle; a reused name gets a fresh nonce."""

    epoch: str
    nonce: str

    def __str__(self) -> str:
        return f"{self.epoch}/{self.nonce}"


# ------------------------------------------------------------------------------------- states


class VersionState(StrEnum):
    LOADING = "LOADING"  # reserved, attempt live, engines preparing / loading
    PUBLISHED = "PUBLISHED"  # the default; new sessions bind it
    RETIRED = "RETIRED"  # replaced as default; bound sessions keep using it
    RECLAIMING = "RECLAIMING"  # no session can ask for it any more; engines unloading
    RECLAIMED = "RECLAIMED"  # every engine confirmed UNLOADED (terminal)
    ABORTED = "ABORTED"  # attempt failed; waiting for cleanup on every engine
    FAILED_CLEAN = "FAILED_CLEAN"  # every engine confirmed cleanup (terminal)


class SessionState(StrEnum):
    OPEN = "OPEN"  # may bind (once) and dispatch
    CLOSING = "CLOSING"  # begin_close seen: no later open/bind; ref still held
    CLOSED = "CLOSED"  # ref released (or never held); a tombstone, never reopens


class AttemptPhase(StrEnum):
    """What the registry knows about one engine's part of one publication attempt."""

    NONE = "NONE"  # nothing confirmed (or invalidated by an engine restart)
    PREPARED = "PREPARED"  # begin accepted by the current incarnation
    READY = "READY"  # READY_LOCAL from the current incarnation
    UNKNOWN = "UNKNOWN"  # the publisher could not learn an outcome: never treat as clean
    CLEANED = "CLEANED"  # cleanup confirmed (only after abort)


class ReclaimPhase(StrEnum):
    PENDING = "PENDING"  # reclaim claimed, no receipt yet
    UNKNOWN = "UNKNOWN"  # reclaim call outcome unknown: the slot stays held
    UNLOADED = "UNLOADED"  # UNLOADED receipt for this reclaim id


# ----------------------------------------------------------------------------------- evidence
# What the registry records of an engine's reply, per engine and attempt. Distinct from the wire
# receipts (lora_contract.messages), which carry the engine's full answer: the registry keeps only
# what its decisions need (which attempt, which incarnation), in plain dataclasses the journal
# encodes by type name.


@dataclasses.dataclass(frozen=True)
class PreparedEvidence:
    """An engine accepted ``begin`` for this attempt (PREPARED)."""

    version_key: VersionKey
    attempt_token: str
    incarnation: str


@dataclasses.dataclass(frozen=True)
class ReadyEvidence:
    """An engine finished ``end``: manifest verified, adapter loaded pinned, probe passed."""

    version_key: VersionKey
    digest: str
    attempt_token: str
    incarnation: str


@dataclasses.dataclass(frozen=True)
class CleanupEvidence:
    """An engine confirmed that nothing of this attempt is left (and tombstoned its token)."""

    attempt_token: str
    incarnation: str


@dataclasses.dataclass(frozen=True)
class UnloadEvidence:
    """An engine confirmed the physical unload for this reclaim id."""

    reclaim_id: str
    incarnation: str


# ------------------------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True)
class ReserveResult:
    version_key: VersionKey
    digest: str
    lora_name: str
    attempt_token: str
    state: VersionState  # state when this answer was first given
    created: bool  # True only for the call that created the candidate


@dataclasses.dataclass(frozen=True)
class EngineAck:
    """Answer to a PREPARED / READY / cleanup receipt or an unknown-outcome mark."""

    version_key: VersionKey
    engine_id: str
    ref: str  # attempt token or reclaim id the receipt was about
    phase: str  # AttemptPhase / ReclaimPhase value recorded for this engine
    state: VersionState  # version state right after this receipt
    confirmed: tuple[str, ...]  # engines that have confirmed this phase so far (sorted)
    complete: bool  # every engine of the cohort confirmed


@dataclasses.dataclass(frozen=True)
class CommitReceipt:
    version_key: VersionKey
    attempt_token: str
    digest: str
    lora_name: str
    default_revision: int  # revision after this commit
    previous_default: VersionKey | None  # now RETIRED


@dataclasses.dataclass(frozen=True)
class AbortResult:
    version_key: VersionKey
    attempt_token: str
    reason: str


@dataclasses.dataclass(frozen=True)
class IncarnationResult:
    engine_id: str
    incarnation: str
    previous: str | None
    invalidated: tuple[str, ...]  # attempt tokens whose PREPARED/READY on this engine were dropped


@dataclasses.dataclass(frozen=True)
class EngineLostResult:
    """An operator declared an engine lost: it left the cohort for the rest of the epoch."""

    engine_id: str
    reason: str
    cohort: tuple[str, ...]  # the engines that remain
    finished: tuple[VersionKey, ...]  # versions whose last missing receipt was that engine's
    # (an ABORTED attempt now FAILED_CLEAN, a RECLAIMING version now RECLAIMED: slots freed)


@dataclasses.dataclass(frozen=True)
class Binding:
    session_key: SessionKey
    version_key: VersionKey
    lora_name: str
    digest: str
    default_revision: int  # the revision that was current at bind time


@dataclasses.dataclass(frozen=True)
class SessionView:
    session_key: SessionKey
    state: SessionState
    binding: Binding | None
    released: bool  # the session ref was given back (exactly once)
    lease_id: str | None = None  # the worker lease it hangs on; None: no lease
    expired: bool = False  # closed by lease expiry, not by its owner


@dataclasses.dataclass(frozen=True)
class LeaseView:
    """A rollout worker's lease: its sessions live while it is kept alive.

    ``expires_at`` is soft state (the registry host's clock, renewed in memory by keep-alives,
    never journaled); ``live`` and ``ttl_s`` are journaled."""

    lease_id: str
    ttl_s: float
    live: bool
    expires_at: float | None  # None once ended


@dataclasses.dataclass(frozen=True)
class ReclaimClaim:
    version_key: VersionKey
    reclaim_id: str
    lora_name: str
    digest: str


@dataclasses.dataclass(frozen=True)
class UnknownOutcome:
    engine_id: str
    ref: str  # attempt token or reclaim id
    version_key: VersionKey
    op: str  # what the publisher was doing (begin, end, cleanup, reclaim, ...)
    reason: str


@dataclasses.dataclass(frozen=True)
class VersionView:
    version_key: VersionKey
    digest: str
    lora_name: str
    state: VersionState
    session_refs: int
    holds_slot: bool
    attempt_token: str
    attempt_phases: Mapping[str, AttemptPhase]
    reclaim_id: str | None
    reclaim_phases: Mapping[str, ReclaimPhase]
    abort_reason: str | None
    commit_revision: int | None


@dataclasses.dataclass(frozen=True)
class StatusView:
    epoch: str
    capacity: int
    slots_used: int
    default: VersionKey | None
    default_lora_name: str | None
    default_revision: int
    pending_attempt: str | None  # token of the LOADING / ABORTED attempt, if any
    engines: Mapping[str, str | None]  # engine -> current incarnation
    versions: tuple[VersionView, ...]
    unknown_outcomes: tuple[UnknownOutcome, ...]
    sessions: Mapping[str, int]  # count per SessionState
    seq: int  # accepted transitions so far
    base_fingerprint: str | None = None  # the epoch's base model, fixed by its first publication


# ---------------------------------------------------------------------- internal state records
# Frozen so that an op can build the new records first and swap them in only after every check
# passed (a half-updated record can not exist). The dict fields are never mutated in place:
# every change builds a new dict (copy on write).


@dataclasses.dataclass(frozen=True)
class VersionRecord:
    key: VersionKey
    digest: str
    lora_name: str
    attempt_token: str
    state: VersionState
    attempt_phases: dict[str, AttemptPhase]
    session_refs: int = 0
    abort_reason: str | None = None
    commit: CommitReceipt | None = None
    reclaim_id: str | None = None
    reclaim_phases: dict[str, ReclaimPhase] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SessionRecord:
    key: SessionKey
    state: SessionState
    binding: Binding | None = None
    released: bool = False
    lease_id: str | None = None
    expired: bool = False
    closed_seq: int | None = None  # the transition that made it CLOSED (for pruning)


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """The journaled part of a lease: granted with a fixed TTL, LIVE until it ends (once)."""

    lease_id: str
    ttl_s: float
    live: bool = True


@dataclasses.dataclass(frozen=True)
class EngineRecord:
    engine_id: str
    incarnation: str | None = None
    history: tuple[str, ...] = ()  # every incarnation ever registered, oldest first


def evolve(record: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` for the frozen records, without its per-call field introspection
    (it dominated the in-memory op cost). The records have no ``__post_init__`` to skip."""
    if __debug__:
        unknown = set(changes) - set(record.__dict__)
        assert not unknown, f"{type(record).__name__} has no field(s) {unknown}"
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update(changes)
    return new


# -------------------------------------------------------------------------------------- codec

_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (
        VersionKey,
        SessionKey,
        VersionState,
        SessionState,
        AttemptPhase,
        ReclaimPhase,
        PreparedEvidence,
        ReadyEvidence,
        CleanupEvidence,
        UnloadEvidence,
        ReserveResult,
        EngineAck,
        CommitReceipt,
        AbortResult,
        IncarnationResult,
        EngineLostResult,
        Binding,
        SessionView,
        LeaseView,
        ReclaimClaim,
        UnknownOutcome,
        VersionView,
        StatusView,
        VersionRecord,
        SessionRecord,
        LeaseRecord,
        EngineRecord,
    )
}


_SCALARS = (type(None), bool, int, float, str)
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def encode(obj: Any) -> Any:
    """Typed value -> JSON-able value that :func:`decode` turns back into an equal value."""
    cls = type(obj)
    if cls in _SCALARS:  # exact types first: this runs for every field of every journal row
        return obj
    if isinstance(obj, Enum):
        return {"$e": cls.__name__, "v": obj.value}
    if cls is VersionKey or cls is SessionKey:
        return {"$t": cls.__name__, "f": [encode(v) for v in obj]}
    names = _FIELD_NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        return {"$t": cls.__name__, "d": {n: encode(getattr(obj, n)) for n in names}}
    if isinstance(obj, bool | int | float | str):  # subclasses of scalars
        return obj
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, Mapping):
        return {"$map": [[encode(k), encode(v)] for k, v in obj.items()]}
    raise TypeError(f"cannot encode {cls.__name__}")


def decode(data: Any) -> Any:
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if "$e" in data:
        return _TYPES[data["$e"]](data["v"])
    if "$tuple" in data:
        return tuple(decode(v) for v in data["$tuple"])
    if "$map" in data:
        return {decode(k): decode(v) for k, v in data["$map"]}
    cls = _TYPES[data["$t"]]
    if "f" in data:
        return cls(*(decode(v) for v in data["f"]))
    return cls(**{k: decode(v) for k, v in data["d"].items()})


def dumps(obj: Any) -> str:
    """Canonical JSON text of a typed value (stable across runs: used to compare replays)."""
    return json.dumps(encode(obj), sort_keys=True, separators=(",", ":"))


def loads(text: str) -> Any:
    return decode(json.loads(text))
