"""The engine's managed versions: a pure, synchronous state machine (no IO, no SGLang import).

The HTTP shell (:mod:`sglang_ext.publication`) asks this table what to do, performs the IO
(staging, native load, probe, unload) and reports the outcome back. Every method validates fully
before it mutates anything: a refused call (a raised :class:`LoraVersionError`) leaves no trace.

Per managed version (design.md, "Engine side")::

    PREPARED --end--> LOADING --load+probe ok--> READY_LOCAL --reclaim--> RECLAIMING --> UNLOADED
        |               |--failed, nothing left loaded--> PREPARED
        |               |--failed, removal failed--> FAILED (pinned leftover, holds the slot)
        +--cleanup--> CLEANED (attempt tombstoned) <--cleanup-- READY_LOCAL (never committed), FAILED

(a LOADING version's cleanup waits for its load to end first). The same as one table:
:data:`_TRANSITIONS`, the only place a state changes.

Attempt tokens that were cleaned up are remembered for the engine's lifetime, so a late begin,
bucket or end of that attempt is ``STALE_ATTEMPT`` and never recreates anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    BeginRequest,
    BucketSpec,
    CleanupReceipt,
    EngineVersionState,
    Manifest,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    VersionKey,
    VersionStatus,
    is_managed_name,
)
from sglang_ext.adapter_compat import EngineLoraShape, serving_problem

S = EngineVersionState

# Every state change of a managed version, from -> the states it may move to: the one table,
# checked in one place (:func:`_move`), as the registry's ``_TRANSITIONS`` is for its records.
# A begin creates a record in PREPARED (in place of none or of an earlier attempt's CLEANED
# tombstone: :data:`_REPLACEABLE`); UNLOADED and CLEANED are tombstones with no way out, so a
# reclaimed or cleaned version never returns. ``cleaning`` (a removal started) is a flag on
# LOADING, READY_LOCAL and FAILED, not a state: what a request or a cleanup may do reads both.
_TRANSITIONS: dict[EngineVersionState, frozenset[EngineVersionState]] = {
    S.PREPARED: frozenset({S.LOADING, S.CLEANED}),  # end starts the load; cleanup drops the stash
    # the load and probe succeeded; failed with nothing left loaded (end may be retried); failed
    # and what it loaded is still pinned
    S.LOADING: frozenset({S.READY_LOCAL, S.PREPARED, S.FAILED}),
    S.READY_LOCAL: frozenset({S.RECLAIMING, S.CLEANED}),  # committed: reclaim; a candidate: cleanup
    S.FAILED: frozenset({S.CLEANED}),  # only a cleanup that removes the leftover frees the slot
    S.RECLAIMING: frozenset({S.UNLOADED}),
    S.UNLOADED: frozenset(),
    S.CLEANED: frozenset(),
}
# what a begin of a new attempt may replace under the same name (besides no record at all)
_REPLACEABLE = frozenset({S.CLEANED})


def _move(v: ManagedVersion, to: EngineVersionState) -> None:
    """The one state change: refused (an AssertionError, a defect of the shell or the table, never
    a client's input, which the public methods refuse with a typed error before they mutate) when
    the table has no ``v.state -> to``."""
    if to not in _TRANSITIONS[v.state]:
        raise AssertionError(f"illegal transition {v.state.value} -> {to.value} for {v.lora_name}")
    v.state = to
    v.touch()


def may_unload_now(v: ManagedVersion | None, in_flight: int | None, *, resolvable: bool) -> bool:
    """The one predicate for "may this managed version be physically unloaded now" (the vLLM seed's
    lesson: release and eviction paths share one rule). Every path that unloads one asks it with
    SGLang's own reading of the id: removal (reclaim, cleanup, a failed probe or a partial load
    taken back: :func:`sglang_ext.removal.remove_version`) and the ``max_loaded_loras`` LRU
    eviction (:func:`sglang_ext.tokenizer_hooks.lru_never_picks_managed`).

    Yes only when all hold: the version's removal has started (reclaim, or cleanup of a candidate
    that never committed); its name no longer resolves to the id (``resolvable``: while it does,
    the next request can acquire it, so a zero count says nothing about the moment after); and
    its native in-flight count is exactly zero. A negative count never qualifies.

    ``in_flight=None`` means SGLang has no counter for the id. SGLang creates the counter when it
    registers an id and the plugin drops it only after the id's physical unload, so that is either
    a partial load that was never registered (no request could ever resolve to it: its count is
    zero by construction, ``v.registered`` is False) or a counter gone for a reason this table did
    not see: unknown, and an unknown count is never a yes (fail closed).

    Without the overlap scheduler (which the plugin refuses, ``setup_checks``), a count of zero
    also means every GPU step that read the adapter's slot has completed: SGLang's normal loop
    processes a batch's results before it plans the next. Under overlap it does not (a finish is
    streamed while the next batch, still holding the finished request's row, runs on the GPU);
    the fence that closes it is :func:`step_fence_passed`, the third term of this rule, evaluated
    in the scheduler process at the unload itself (:mod:`sglang_ext.step_fence`; gpu_tests/README.md,
    "The overlap scheduler")."""
    if v is None:
        return True  # not a managed version: stock rules apply
    if resolvable:
        return False
    removal_started = v.state is S.RECLAIMING or v.cleaning
    if in_flight is None:
        return removal_started and not v.registered
    return removal_started and in_flight == 0


@dataclass(frozen=True)
class LaunchedBatch:
    """A batch the scheduler launched whose results it may not have processed yet: the engine-
    local LoRA ids its rows read, and whether its GPU work is known complete (None: unknown)."""

    lora_ids: frozenset[str]
    done: bool | None


def step_fence_passed(lora_id: str, launched: list[LaunchedBatch]) -> bool:
    """The step fence of the vLLM seed (free only after the step that used the resource has
    completed), for one adapter: every launched batch either has no row on ``lora_id`` or is known
    complete. An unknown completion never passes: nothing is freed on a guess."""
    return all(lora_id not in b.lora_ids or b.done is True for b in launched)


def in_flight_anomaly(lora_name: str, in_flight: int | None) -> LoraVersionError | None:
    """The refusal for a native in-flight count below zero, or None. SGLang never clamps its
    counter: below zero means a release without an acquire somewhere, so the count no longer says
    whether requests still use the adapter, and its drain would never end. The removal is refused
    (typed, visible), never guessed; the status shows the raw count."""
    if in_flight is None or in_flight >= 0:
        return None
    return _err(
        ErrorCode.IN_FLIGHT_ANOMALY,
        f"SGLang's in-flight count of {lora_name!r} is {in_flight}: a release without an acquire; "
        "nothing is unloaded on a guess (restart the engine to recover the slot)",
        lora_name=lora_name,
        in_flight=in_flight,
    )


@dataclass(frozen=True)
class StagingLimits:
    managed_capacity: int  # pinned managed versions this engine accepts (max_loras_per_batch - 1)
    lora: EngineLoraShape  # what the engine serves exactly as PEFT computes it (adapter_compat)
    max_version_bytes: int
    max_bucket_bytes: int


@dataclass
class ManagedVersion:
    lora_name: str
    version_key: VersionKey
    digest: str
    attempt_token: str
    # What the attempt stages; shed once READY (see shed_staging): a long RL run publishes a
    # version per step, and every record outlives its version as a tombstone.
    manifest: Manifest | None
    plan: tuple[BucketSpec, ...]
    state: EngineVersionState
    buckets_total: int = 0
    bucket_sha: dict[int, str] = field(default_factory=dict)
    lora_id: str | None = None
    reclaim_id: str | None = None
    cleaning: bool = False  # cleanup has unregistered it natively; the unload may still be draining
    # SGLang's registry has held lora_id under this name, so requests may have acquired it and
    # only its counter says when none still does. False for a partial load SGLang never registered.
    registered: bool = False
    # SGLang confirmed the physical unload of lora_id. Set by the removal itself, before the state
    # says UNLOADED or CLEANED: a removal interrupted between the two goes on without a second one.
    unloaded: bool = False
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    @property
    def next_bucket(self) -> int:
        return len(self.bucket_sha)

    @property
    def all_buckets_received(self) -> bool:
        return self.next_bucket == self.buckets_total

    def shed_staging(self) -> None:
        """Drop the manifest and the bucket plan: nothing reads them after the load (a late
        duplicate bucket is answered from ``bucket_sha`` and ``buckets_total``). What stays is
        about 1 KiB per version instead of the whole manifest."""
        self.manifest = None
        self.plan = ()

    def touch(self) -> None:
        """Something of the version changed (a state change goes through :func:`_move`)."""
        self.updated_at = time.time()


class BucketDecision(Enum):
    ACCEPT = "accept"  # store it, then call accept_bucket
    DUPLICATE = "duplicate"  # acknowledged without a second write


class EndDecision(Enum):
    LOAD = "load"  # check the staged files, start_load (LOADING), load, probe, finish/fail_load
    JOIN = "join"  # a load for this attempt is already running: wait for it
    READY = "ready"  # already READY_LOCAL: answer the stored receipt


class ReclaimDecision(Enum):
    START = "start"  # state is now RECLAIMING: unregister, drain, unload
    RESUME = "resume"  # already RECLAIMING under this reclaim id: keep draining / unloading
    DONE = "done"  # already UNLOADED under this reclaim id: answer the stored receipt
    NOT_LOADED = "not_loaded"  # this incarnation never loaded it (e.g. after a restart): UNLOADED


class CleanupDecision(Enum):
    NOTHING = "nothing"  # already clean (or never seen): tombstone only
    DROP_STASH = "drop_stash"  # PREPARED (staged, never loaded): the stash goes, the token is tombstoned
    UNLOAD = "unload"  # loaded (or loading) candidate: unload it natively
    WAIT_FOR_LOAD = "wait_for_load"  # a load is running: wait for it, then ask again


def _err(code: ErrorCode, message: str, **details: object) -> LoraVersionError:
    return LoraVersionError(code, message, **details)


def _not_owner(v: ManagedVersion, attempt_token: str) -> LoraVersionError:
    return _err(
        ErrorCode.NOT_ATTEMPT_OWNER,
        f"{v.lora_name!r} is {v.state.value} here under attempt {v.attempt_token}; attempt "
        f"{attempt_token} holds nothing of it and can neither take it over nor remove it",
        lora_name=v.lora_name,
        state=v.state.value,
        owner_attempt_token=v.attempt_token,
    )


def failed_refusal(v: ManagedVersion) -> LoraVersionError:
    """The answer to every call about a FAILED version but its cleanup: the end whose removal
    failed (the one 4xx after which the version is not as it was: docs/serving.md) and every
    repeat of it say the same, naming the state and what stays loaded."""
    return _err(
        ErrorCode.LOAD_FAILED,
        f"{v.lora_name!r} failed to load and what it loaded is still pinned here; clean up attempt "
        f"{v.attempt_token} to remove it",
        lora_name=v.lora_name,
        state=S.FAILED.value,
        leftover_lora_id=v.lora_id,
    )


class VersionTable:
    def __init__(
        self,
        incarnation: str,
        limits: StagingLimits,
        clock: Callable[[], float] = time.time,
        normalize_targets: Callable[[list[str]], set[str]] = set,
        base_fingerprint: str | None = None,
    ) -> None:
        self.incarnation = incarnation
        self.limits = limits
        # this engine's base model (lora_contract.base_identity), checked against every begin
        self.base_fingerprint = base_fingerprint
        # SGLang stacks q/k/v and gate/up; the shell passes its normaliser so both compare alike.
        self._normalize_targets = normalize_targets
        self._clock = clock
        self.versions: dict[str, ManagedVersion] = {}
        self.cleaned: dict[str, CleanupReceipt] = {}  # attempt token -> receipt (tombstones)
        # attempt token -> the one lora_name it was ever used with in this incarnation. A name
        # fixes its digest here for the incarnation's lifetime (VERSION_CONFLICT), so this binds
        # the token to exactly one (name, digest): one attempt can never feed two versions.
        self.attempt_owner: dict[str, str] = {}
        # version key -> the one digest it was begun with in this incarnation (VERSION_CONFLICT)
        self.key_digest: dict[VersionKey, str] = {}

    # ----------------------------------------------------------------------------- queries

    def get(self, lora_name: str) -> ManagedVersion | None:
        return self.versions.get(lora_name)

    def slots_in_use(self) -> int:
        return sum(1 for v in self.versions.values() if v.state.holds_slot)

    def status_of(self, v: ManagedVersion, in_flight: int | None) -> VersionStatus:
        return VersionStatus(
            lora_name=v.lora_name,
            state=v.state,
            version_key=v.version_key,
            digest=v.digest,
            attempt_token=v.attempt_token,
            reclaim_id=v.reclaim_id,
            pinned=v.state in (S.READY_LOCAL, S.FAILED, S.RECLAIMING),
            lora_id=v.lora_id,
            # a negative count means a leaked release; it never reaches zero (may_unload_now)
            in_flight=in_flight,  # raw: a negative count is an anomaly to see, never clamped
            buckets_received=v.next_bucket,
            buckets_total=v.buckets_total,
            incarnation=self.incarnation,
            created_at=v.created_at,
            updated_at=v.updated_at,
        )

    def ready_receipt(self, v: ManagedVersion) -> ReadyReceipt:
        return ReadyReceipt(
            lora_name=v.lora_name,
            version_key=v.version_key,
            digest=v.digest,
            attempt_token=v.attempt_token,
            incarnation=self.incarnation,
        )

    def prepared_receipt(self, v: ManagedVersion) -> PreparedReceipt:
        return PreparedReceipt(
            lora_name=v.lora_name,
            digest=v.digest,
            attempt_token=v.attempt_token,
            incarnation=self.incarnation,
        )

    def request_gate(
        self, lora_name: str, registered_lora_id: str | None, *, probing: bool = False
    ) -> LoraVersionError | None:
        """Why a generation request naming ``lora_name`` must be refused (None: let it through).

        ``registered_lora_id`` is the id SGLang's registry resolves the name to right now;
        ``probing`` is true only for the plugin's own exact-version probe of a LOADING version.
        Names that do not look managed are left to stock SGLang. A managed-looking name is served
        only while READY_LOCAL under exactly the id this table loaded: never a fallback to the
        base model, never an implicit reload."""
        if not is_managed_name(lora_name):
            return None
        v = self.versions.get(lora_name)
        if probing and v is not None and v.state is S.LOADING:
            return None
        if v is None or v.state in (S.CLEANED, S.FAILED) or v.cleaning:
            return _err(
                ErrorCode.UNKNOWN_VERSION,
                f"{lora_name!r} is not a version on this engine",
                lora_name=lora_name,
            )
        if v.state in (S.PREPARED, S.LOADING):
            return _err(ErrorCode.VERSION_NOT_READY, f"{lora_name!r} is still staging", lora_name=lora_name)
        if v.state in (S.RECLAIMING, S.UNLOADED) or registered_lora_id != v.lora_id:
            return _err(
                ErrorCode.VERSION_RECLAIMED, f"{lora_name!r} is reclaimed on this engine", lora_name=lora_name
            )
        return None

    # ----------------------------------------------------------------------------- begin

    def _compat_problem(self, req: BeginRequest) -> LoraVersionError | None:
        lim = self.limits
        problem = serving_problem(req.manifest, lim.lora, self._normalize_targets)
        if problem is not None:
            return problem
        if req.manifest.total_bytes > lim.max_version_bytes:
            return _err(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"adapter is {req.manifest.total_bytes} bytes; this engine accepts at most "
                f"{lim.max_version_bytes}",
                limit=lim.max_version_bytes,
            )
        biggest = max(spec.total_bytes for spec in req.bucket_plan)
        if biggest > lim.max_bucket_bytes:
            return _err(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"bucket of {biggest} bytes exceeds this engine's bucket cap {lim.max_bucket_bytes}",
                limit=lim.max_bucket_bytes,
            )
        return None

    def _check_attempt_owner(self, lora_name: str, attempt_token: str) -> None:
        owner = self.attempt_owner.get(attempt_token)
        if owner is not None and owner != lora_name:
            raise _err(
                ErrorCode.ATTEMPT_MISMATCH,
                f"attempt {attempt_token} belongs to {owner!r}, not to {lora_name!r}",
                attempt_token=attempt_token,
                owner=owner,
            )

    def begin(self, req: BeginRequest) -> PreparedReceipt | ReadyReceipt:
        if req.base_fingerprint is not None and req.base_fingerprint != self.base_fingerprint:
            raise _err(
                ErrorCode.BASE_MISMATCH,
                f"this engine's base model is {self.base_fingerprint}, the epoch's is "
                f"{req.base_fingerprint}: an adapter for another base is never served here",
                engine_base=self.base_fingerprint,
                expected_base=req.base_fingerprint,
            )
        self._check_attempt_owner(req.lora_name, req.attempt_token)
        if req.attempt_token in self.cleaned:
            raise _err(
                ErrorCode.STALE_ATTEMPT,
                f"attempt {req.attempt_token} was cleaned up",
                attempt_token=req.attempt_token,
            )
        existing = self.versions.get(req.lora_name)
        if existing is not None and existing.digest != req.digest:
            raise _err(
                ErrorCode.VERSION_CONFLICT,
                f"{req.lora_name!r} exists here with another digest",
                lora_name=req.lora_name,
                digest=existing.digest,
            )
        keyed = self.key_digest.get(req.version_key)
        if keyed is not None and keyed != req.digest:
            # Another digest gives another name, so the check above cannot see it: a version
            # key names one adapter for the engine's lifetime, as the registry's does per epoch.
            raise _err(
                ErrorCode.VERSION_CONFLICT,
                f"version {req.version_key.epoch}/{req.version_key.version_id} exists here with another "
                "digest",
                digest=keyed,
            )
        if existing is not None and existing.state in (S.RECLAIMING, S.UNLOADED):
            raise _err(
                ErrorCode.VERSION_RECLAIMED,
                f"{req.lora_name!r} was reclaimed; versions never return",
                lora_name=req.lora_name,
            )
        if existing is not None and existing.state is S.READY_LOCAL:
            # Same name, same digest, already loaded: no second load. Only its own attempt hears
            # READY; another attempt is refused and changes nothing, so no token but the one that
            # loaded it can ever clean it up (a reply lost on the way to that other attempt must
            # not make its cleanup an unload of a committed version).
            if existing.attempt_token != req.attempt_token:
                raise _not_owner(existing, req.attempt_token)
            return self.ready_receipt(existing)
        if existing is not None and existing.state is S.FAILED:
            raise failed_refusal(existing)
        if existing is not None and existing.state in (S.PREPARED, S.LOADING):
            if existing.attempt_token == req.attempt_token:
                return self.prepared_receipt(existing)
            raise _err(
                ErrorCode.PUBLICATION_IN_PROGRESS,
                f"attempt {existing.attempt_token} is staging {req.lora_name!r}; clean it up first",
                attempt_token=existing.attempt_token,
            )
        problem = self._compat_problem(req)
        if problem is not None:
            raise problem
        if self.slots_in_use() >= self.limits.managed_capacity:
            raise _err(
                ErrorCode.CAPACITY_ERROR,
                f"{self.slots_in_use()} managed versions already hold this engine's "
                f"{self.limits.managed_capacity} pinned slots",
                capacity=self.limits.managed_capacity,
            )
        now = self._clock()
        v = ManagedVersion(
            lora_name=req.lora_name,
            version_key=req.version_key,
            digest=req.digest,
            attempt_token=req.attempt_token,
            manifest=req.manifest,
            plan=tuple(req.bucket_plan),
            buckets_total=len(req.bucket_plan),
            state=S.PREPARED,
            created_at=now,
            updated_at=now,
        )
        assert existing is None or existing.state in _REPLACEABLE, "every other state answered above"
        self.versions[req.lora_name] = v  # replaces a CLEANED record of an earlier attempt
        self.key_digest[req.version_key] = req.digest
        self.attempt_owner[req.attempt_token] = req.lora_name
        return self.prepared_receipt(v)

    # ----------------------------------------------------------------------------- buckets

    def _current_attempt(self, lora_name: str, attempt_token: str) -> ManagedVersion:
        self._check_attempt_owner(lora_name, attempt_token)
        if attempt_token in self.cleaned:
            raise _err(
                ErrorCode.STALE_ATTEMPT,
                f"attempt {attempt_token} was cleaned up",
                attempt_token=attempt_token,
            )
        v = self.versions.get(lora_name)
        if v is None:
            raise _err(
                ErrorCode.STALE_ATTEMPT,
                f"no attempt is staging {lora_name!r} (begin first)",
                lora_name=lora_name,
            )
        if v.attempt_token != attempt_token:
            raise _err(
                ErrorCode.STALE_ATTEMPT,
                f"attempt {attempt_token} is not the current attempt for {lora_name!r}",
                attempt_token=attempt_token,
            )
        return v

    def check_bucket(self, meta: ReceiveBucketMeta) -> BucketDecision:
        v = self._current_attempt(meta.lora_name, meta.attempt_token)
        if meta.index >= v.buckets_total:
            raise _err(
                ErrorCode.BUCKET_OUT_OF_ORDER,
                f"bucket {meta.index} is outside the plan of {v.buckets_total}",
                index=meta.index,
                expected=v.next_bucket,
            )
        if meta.index < v.next_bucket:
            if v.bucket_sha[meta.index] != meta.sha256:
                raise _err(
                    ErrorCode.CHECKSUM_MISMATCH,
                    f"bucket {meta.index} was accepted with another sha256",
                    index=meta.index,
                )
            return BucketDecision.DUPLICATE
        # No state check needed from here: every state but PREPARED has all its buckets (the only
        # way out of PREPARED is start_load, after plan_end saw every bucket; a CLEANED attempt's
        # token is refused above), so a bucket not received yet is one of a PREPARED version.
        if meta.index > v.next_bucket:
            raise _err(
                ErrorCode.BUCKET_OUT_OF_ORDER,
                f"bucket {meta.index} arrived before bucket {v.next_bucket}",
                index=meta.index,
                expected=v.next_bucket,
            )
        return BucketDecision.ACCEPT

    def accept_bucket(self, meta: ReceiveBucketMeta) -> None:
        v = self._current_attempt(meta.lora_name, meta.attempt_token)
        assert v.state is S.PREPARED and meta.index == v.next_bucket, "check_bucket first"
        v.bucket_sha[meta.index] = meta.sha256
        v.touch()

    def bucket_spec(self, meta: ReceiveBucketMeta) -> BucketSpec:
        return self._current_attempt(meta.lora_name, meta.attempt_token).plan[meta.index]

    # ----------------------------------------------------------------------------- end

    def plan_end(self, lora_name: str, attempt_token: str) -> EndDecision:
        """What ``end`` does now; changes nothing (the shell checks the staged files first, then
        :meth:`start_load` makes the version LOADING)."""
        v = self._current_attempt(lora_name, attempt_token)
        if v.state is S.READY_LOCAL:
            return EndDecision.READY
        if v.state is S.LOADING:
            return EndDecision.JOIN
        if v.state is S.FAILED:
            raise failed_refusal(v)
        if v.state is not S.PREPARED:
            raise _err(ErrorCode.STALE_ATTEMPT, f"{lora_name!r} is {v.state.value}")
        if not v.all_buckets_received:
            raise _err(
                ErrorCode.MANIFEST_MISMATCH,
                f"end before every bucket arrived ({v.next_bucket} of {v.buckets_total})",
                buckets_received=v.next_bucket,
                buckets_total=v.buckets_total,
            )
        return EndDecision.LOAD

    def start_load(self, lora_name: str, attempt_token: str) -> None:
        """PREPARED -> LOADING, once :meth:`plan_end` said LOAD and every check of the staged
        files passed (check before mutate: a refused end leaves the version as it was)."""
        if self.plan_end(lora_name, attempt_token) is not EndDecision.LOAD:
            raise AssertionError("start_load only after plan_end said LOAD")
        _move(self.versions[lora_name], S.LOADING)

    def finish_load(self, lora_name: str, attempt_token: str, lora_id: str) -> ReadyReceipt:
        v = self._current_attempt(lora_name, attempt_token)
        assert v.state is S.LOADING
        v.lora_id = lora_id
        v.registered = True
        _move(v, S.READY_LOCAL)
        v.shed_staging()
        return self.ready_receipt(v)

    def abandon_load(self, lora_name: str, attempt_token: str, lora_id: str, *, registered: bool) -> None:
        """The native load left ``lora_id`` loaded and failed (its probe failed: ``registered``;
        or SGLang refused it after some rank loaded it: never registered). Removing it starts now:
        the version is unservable and :func:`may_unload_now` may say yes."""
        v = self._current_attempt(lora_name, attempt_token)
        assert v.state is S.LOADING
        v.lora_id, v.registered, v.unloaded = lora_id, registered, False
        v.cleaning = True
        v.touch()

    def mark_unloaded(self, lora_name: str, lora_id: str) -> None:
        """SGLang confirmed the physical unload of ``lora_id`` (the removal goes on to its end)."""
        v = self.versions.get(lora_name)
        if v is not None and v.lora_id == lora_id:
            v.unloaded = True

    def fail_load(self, lora_name: str, attempt_token: str, leftover_lora_id: str | None = None) -> None:
        """The load (or its probe) failed. With nothing left loaded the attempt is PREPARED again
        (``end`` may be retried); when the removal of what it loaded did not finish
        (``leftover_lora_id``), the version is FAILED: still pinned in SGLang, never servable,
        holding its slot, and remembered so that only a cleanup that removes it frees the slot."""
        v = self.versions.get(lora_name)
        if v is not None and v.attempt_token == attempt_token and v.state is S.LOADING:
            v.cleaning = False
            if leftover_lora_id is not None:
                v.lora_id = leftover_lora_id
                _move(v, S.FAILED)
            else:
                v.lora_id, v.registered, v.unloaded = None, False, False
                _move(v, S.PREPARED)

    # ----------------------------------------------------------------------------- reclaim

    def start_reclaim(self, lora_name: str, reclaim_id: str) -> ReclaimDecision:
        v = self.versions.get(lora_name)
        if v is None or v.state is S.CLEANED:
            # Authoritative, not a guess: nothing is loaded under that name in this incarnation
            # (an engine restarted after commit holds none of its old versions). Without this a
            # restarted engine could never confirm the unload and the registry slot would stay held.
            return ReclaimDecision.NOT_LOADED
        if v.state in (S.RECLAIMING, S.UNLOADED):
            if v.reclaim_id != reclaim_id:
                raise _err(
                    ErrorCode.STALE_ATTEMPT,
                    f"{lora_name!r} is being reclaimed under reclaim id {v.reclaim_id}",
                    reclaim_id=v.reclaim_id,
                )
            return ReclaimDecision.DONE if v.state is S.UNLOADED else ReclaimDecision.RESUME
        if v.state is not S.READY_LOCAL or v.cleaning:
            raise _err(
                ErrorCode.VERSION_NOT_READY,
                f"{lora_name!r} is {v.state.value}; only a READY version "
                "is reclaimed (a candidate that never committed is cleaned up)",
                lora_name=lora_name,
            )
        v.reclaim_id = reclaim_id
        _move(v, S.RECLAIMING)
        return ReclaimDecision.START

    def finish_reclaim(self, lora_name: str, reclaim_id: str) -> None:
        v = self.versions[lora_name]
        assert v.state is S.RECLAIMING and v.reclaim_id == reclaim_id
        _move(v, S.UNLOADED)

    # ----------------------------------------------------------------------------- cleanup

    def plan_cleanup(self, lora_name: str, attempt_token: str) -> CleanupDecision:
        # A cleanup naming another version than its token's would tombstone the token under the
        # wrong name and leave the real candidate holding its pinned slot: refuse it.
        self._check_attempt_owner(lora_name, attempt_token)
        if attempt_token in self.cleaned:
            return CleanupDecision.NOTHING
        v = self.versions.get(lora_name)
        if v is None or v.state is S.CLEANED:
            return CleanupDecision.NOTHING  # nothing is held: the token is only tombstoned
        if v.attempt_token != attempt_token:
            # Another attempt holds the name (loaded, staging, failed or reclaimed): this token
            # owns nothing of it. Refused, nothing changed, never an unload on its behalf.
            raise _not_owner(v, attempt_token)
        if v.state is S.PREPARED:
            return CleanupDecision.DROP_STASH
        if v.state is S.LOADING:
            return CleanupDecision.WAIT_FOR_LOAD
        if v.state in (S.READY_LOCAL, S.FAILED):
            return CleanupDecision.UNLOAD
        # RECLAIMING or UNLOADED (every other state answered above): a committed version is
        # reclaimed, never cleaned; refuse rather than guess.
        raise _err(ErrorCode.VERSION_RECLAIMED, f"{lora_name!r} is under reclaim; cleanup does not apply")

    def mark_cleaning(self, lora_name: str, attempt_token: str) -> None:
        v = self._current_attempt(lora_name, attempt_token)
        assert v.state in (S.READY_LOCAL, S.FAILED)
        v.cleaning = True
        v.touch()

    def finish_cleanup(self, lora_name: str, attempt_token: str) -> CleanupReceipt:
        """Tombstone the attempt (also one never seen: a late begin must not recreate it)."""
        self._check_attempt_owner(lora_name, attempt_token)
        receipt = self.cleaned.get(attempt_token)
        if receipt is not None:
            return receipt
        v = self.versions.get(lora_name)
        if v is not None and v.state is not S.CLEANED and v.attempt_token != attempt_token:
            raise _not_owner(v, attempt_token)  # as plan_cleanup: never tombstones over an owner
        if v is not None and v.attempt_token == attempt_token:
            v.lora_id = None
            v.cleaning = False
            _move(v, S.CLEANED)
            v.shed_staging()
        receipt = CleanupReceipt(
            lora_name=lora_name, attempt_token=attempt_token, incarnation=self.incarnation
        )
        self.cleaned[attempt_token] = receipt
        self.attempt_owner[attempt_token] = lora_name
        return receipt
