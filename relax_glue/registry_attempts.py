"""Publication (RFC 3): the epoch's base, one attempt per version from reserve to commit or abort and
cleanup, and the cohort's engines (incarnations, unknown outcomes, an engine declared lost).

Every operation here is a publisher operation (``@operation(OpKind.PUBLISHER)``): it needs the
publisher token, checked by its declaration before anything else.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_contract.errors import ErrorCode
from lora_contract.names import SHA256_RE, TOKEN_RE
from relax_glue.registry_rules import (
    checked_lora_name,
    checked_text,
    derive_id,
    fail,
)
from relax_glue.registry_spec import OpKind, operation
from relax_glue.registry_state import RegistryState
from relax_glue.registry_types import (
    AbortResult,
    AttemptPhase,
    CleanupEvidence,
    CommitReceipt,
    EngineAck,
    EngineLostResult,
    EngineRecord,
    IncarnationResult,
    PreparedEvidence,
    ReadyEvidence,
    ReclaimPhase,
    ReserveResult,
    UnknownOutcome,
    VersionKey,
    VersionRecord,
    VersionState,
    evolve,
)


class AttemptOps(RegistryState):
    """reserve -> record_prepared / record_ready -> commit, or abort -> record_cleanup; and the
    engine events that change what an attempt's receipts are worth."""

    # ================================================================ publication (RFC 3)

    @operation(OpKind.PUBLISHER)
    def record_base(self, fingerprint: str, *, publisher_token: str | None = None) -> str:
        """Fix the epoch's base model (the cohort's fingerprint, read by the publisher before its
        first publication); the same fingerprint again changes nothing, another one is
        BASE_MISMATCH forever (versions of one epoch are deltas on one base)."""
        checked_text("fingerprint", fingerprint, SHA256_RE)
        if self._base is not None and self._base != fingerprint:
            fail(
                ErrorCode.BASE_MISMATCH,
                f"the epoch's base model is {self._base}, not {fingerprint}",
                expected_base=self._base,
                engine_base=fingerprint,
            )
        if self._base is None:
            self._base = fingerprint
            self._accepted()
        return self._base

    @operation(OpKind.PUBLISHER)
    def reserve(
        self,
        version_key: VersionKey | Sequence[str],
        digest: str,
        lora_name: str,
        request_id: str,
        *,
        publisher_token: str | None = None,
    ) -> ReserveResult:
        """Accept a new candidate in LOADING (one slot) and hand out its attempt token.

        Same key + same digest replays the existing version (no second slot, no second attempt);
        same key + other digest is VERSION_CONFLICT for the whole epoch.
        """
        key = self._key(version_key)
        checked_text("digest", digest, SHA256_RE)
        checked_lora_name(key, digest, lora_name)  # exactly the name the names module builds
        checked_text("request_id", request_id)
        args = (key, digest, lora_name)

        stored = self._reserve_requests.get(request_id)
        if stored is not None:
            if stored[0] != args:
                fail(
                    ErrorCode.INVALID_REQUEST,
                    "request_id reused with different arguments",
                    request_id=request_id,
                )
            return stored[1]

        rec = self._versions.get(key)
        if rec is not None:
            if rec.digest != digest:
                fail(
                    ErrorCode.VERSION_CONFLICT,
                    f"version {key} already has another digest in this epoch",
                    version_key=list(key),
                    digest=rec.digest,
                )
            if rec.lora_name != lora_name:
                fail(
                    ErrorCode.VERSION_CONFLICT,
                    f"version {key} is registered under another lora_name",
                    lora_name=rec.lora_name,
                )
            # Decision: a natural-key replay reports the version's current state (the caller
            # learns it is published / failed); one attempt per version ever, so a failed
            # version is retried under a new version_id (its engine tombstones never collide).
            result = ReserveResult(key, digest, lora_name, rec.attempt_token, rec.state, created=False)
            self._reserve_requests[request_id] = (args, result)
            self._accepted()
            return result

        # No other version holds this name: a managed name carries its version (checked above).
        if self._unknown:
            fail(
                ErrorCode.OUTCOME_UNKNOWN,
                "an engine outcome is unknown: no new publication until it is resolved",
                unknown=[f"{e}:{r}" for e, r in sorted(self._unknown)],
            )
        if self._pending is not None:
            pending = self._versions[self._pending]
            # Decision: an ABORTED candidate whose cleanup is unconfirmed is still the pending
            # attempt (single publisher, at most one attempt in flight, cleanup included).
            fail(
                ErrorCode.PUBLICATION_IN_PROGRESS,
                f"attempt for {pending.key} is still {pending.state.value}",
                pending=list(pending.key),
                state=pending.state.value,
            )
        if len(self._live) >= self.capacity:
            fail(
                ErrorCode.CAPACITY_ERROR,
                f"all {self.capacity} version slots are in use",
                in_use=[f"{k} {self._versions[k].state.value}" for k in sorted(self._live)],
            )

        token = derive_id("att", self.epoch, key.version_id, digest)
        rec = VersionRecord(
            key=key,
            digest=digest,
            lora_name=lora_name,
            attempt_token=token,
            state=VersionState.LOADING,
            attempt_phases=dict.fromkeys(self.engines, AttemptPhase.NONE),
        )
        result = ReserveResult(key, digest, lora_name, token, VersionState.LOADING, created=True)
        self._put(rec)
        self._by_token[token] = key
        self._by_name[lora_name] = key
        self._reserve_requests[request_id] = (args, result)
        self._accepted()
        return result

    @operation(OpKind.PUBLISHER)
    def record_prepared(
        self, engine_id: str, receipt: PreparedEvidence, *, publisher_token: str | None = None
    ) -> EngineAck:
        """An engine accepted ``begin`` for the live attempt (observability; commit needs READY)."""
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, PreparedEvidence)
        rec = self._attempt(receipt.attempt_token, receipt.version_key)
        self._current_incarnation(eng, receipt.incarnation)
        if rec.state is not VersionState.LOADING:
            self._not_live(rec)
        phase = rec.attempt_phases[engine_id]
        nk = ("prepared", engine_id, rec.attempt_token, receipt.incarnation)
        if phase in (AttemptPhase.PREPARED, AttemptPhase.READY) and nk in self._results:
            return self._results[nk]
        if phase is not AttemptPhase.NONE:
            # PREPARED after READY (late reply) or while UNKNOWN: only READY or a cleanup
            # resolves an unknown outcome, so this changes nothing.
            return self._attempt_ack(rec, engine_id, phase)
        new = self._with_phase(rec, engine_id, AttemptPhase.PREPARED)
        ack = self._attempt_ack(new, engine_id, AttemptPhase.PREPARED)
        self._put(new)
        self._results[nk] = ack
        self._accepted()
        return ack

    @operation(OpKind.PUBLISHER)
    def record_ready(
        self, engine_id: str, receipt: ReadyEvidence, *, publisher_token: str | None = None
    ) -> EngineAck:
        """READY_LOCAL from an engine's current incarnation for the live attempt."""
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, ReadyEvidence)
        rec = self._attempt(receipt.attempt_token, receipt.version_key)
        if receipt.digest != rec.digest:
            fail(
                ErrorCode.VERSION_CONFLICT,
                f"READY for {rec.key} carries another digest",
                expected=rec.digest,
                got=receipt.digest,
            )
        self._current_incarnation(eng, receipt.incarnation)
        nk = ("ready", engine_id, rec.attempt_token, receipt.incarnation)
        if rec.state is not VersionState.LOADING:
            if rec.commit is not None and nk in self._results:
                return self._results[nk]  # a late duplicate of a READY that counted
            self._not_live(rec)
        if rec.attempt_phases[engine_id] is AttemptPhase.READY and nk in self._results:
            return self._results[nk]
        new = self._with_phase(rec, engine_id, AttemptPhase.READY)
        ack = self._attempt_ack(new, engine_id, AttemptPhase.READY)
        self._put(new)
        self._unknown.pop((engine_id, rec.attempt_token), None)
        self._results[nk] = ack
        self._accepted()
        return ack

    @operation(OpKind.PUBLISHER)
    def commit(
        self,
        version_key: VersionKey | Sequence[str],
        attempt_token: str,
        expected_default_revision: int,
        *,
        publisher_token: str | None = None,
    ) -> CommitReceipt:
        """Make the candidate the default once every engine is READY from its current incarnation.

        Replaying a commit (same version and attempt) returns the stored receipt and changes
        nothing, even if the version has since been retired or reclaimed.
        """
        key = self._key(version_key)
        checked_text("attempt_token", attempt_token, TOKEN_RE)
        if not isinstance(expected_default_revision, int) or isinstance(expected_default_revision, bool):
            fail(ErrorCode.INVALID_REQUEST, "expected_default_revision must be an int")
        rec = self._version(key)
        if attempt_token != rec.attempt_token:
            fail(
                ErrorCode.STALE_ATTEMPT, f"{attempt_token} is not the attempt of {key}", version_key=list(key)
            )
        if rec.commit is not None:
            # Decision: the natural key of a commit is (version, attempt); a replay returns the
            # stored receipt whatever revision the retry expected (the receipt tells the truth).
            return rec.commit
        if rec.state is not VersionState.LOADING:
            self._not_live(rec)
        unknown = sorted(e for e, p in rec.attempt_phases.items() if p is AttemptPhase.UNKNOWN)
        if unknown:
            fail(ErrorCode.OUTCOME_UNKNOWN, "an engine outcome for this attempt is unknown", engines=unknown)
        missing = sorted(e for e, p in rec.attempt_phases.items() if p is not AttemptPhase.READY)
        if missing:
            fail(ErrorCode.NOT_ALL_READY, f"no current READY from {missing}", missing=missing)
        if expected_default_revision != self._revision:
            fail(
                ErrorCode.DEFAULT_REVISION_CONFLICT,
                f"default revision is {self._revision}, not {expected_default_revision}",
                default_revision=self._revision,
            )

        previous = self._default
        receipt = CommitReceipt(
            version_key=key,
            attempt_token=rec.attempt_token,
            digest=rec.digest,
            lora_name=rec.lora_name,
            default_revision=self._revision + 1,
            previous_default=previous,
        )
        new = self._transition(rec, VersionState.PUBLISHED, commit=receipt)
        retired = self._transition(self._versions[previous], VersionState.RETIRED) if previous else None
        if retired is not None:
            self._put(retired)
        self._put(new)
        self._default = key
        self._revision += 1
        self._accepted()
        return receipt

    @operation(OpKind.PUBLISHER)
    def abort(self, attempt_token: str, reason: str, *, publisher_token: str | None = None) -> AbortResult:
        """LOADING -> ABORTED. The slot stays held until every engine confirmed cleanup."""
        rec = self._attempt(attempt_token)
        checked_text("reason", reason, max_len=1024)
        if rec.commit is not None:
            fail(
                ErrorCode.STALE_ATTEMPT,
                f"attempt of {rec.key} is committed; it can only be retired and reclaimed",
                state=rec.state.value,
            )
        nk = ("abort", rec.attempt_token)
        if rec.state is not VersionState.LOADING:
            return self._results[nk]  # ABORTED / FAILED_CLEAN: the first answer
        result = AbortResult(rec.key, rec.attempt_token, reason)
        self._put(self._transition(rec, VersionState.ABORTED, abort_reason=reason))
        self._results[nk] = result
        self._accepted()
        return result

    @operation(OpKind.PUBLISHER)
    def record_cleanup(
        self,
        engine_id: str,
        attempt_token: str,
        receipt: CleanupEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck:
        """Cleanup confirmed on one engine; FAILED_CLEAN (slot freed) once every engine confirmed."""
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, CleanupEvidence)
        if receipt.attempt_token != attempt_token:
            fail(ErrorCode.INVALID_REQUEST, "cleanup receipt is for another attempt")
        rec = self._attempt(attempt_token)
        # Decision: a cleanup by an earlier incarnation stays true (its state died with it), so
        # any registered incarnation counts; an unregistered one must be registered first.
        self._known_incarnation(eng, receipt.incarnation)
        if rec.commit is not None:
            fail(ErrorCode.STALE_ATTEMPT, f"attempt of {rec.key} is committed; reclaim it instead")
        if rec.state is VersionState.LOADING:
            fail(ErrorCode.INVALID_REQUEST, f"attempt of {rec.key} is live: abort it before cleanup")
        nk = ("cleanup", engine_id, attempt_token)
        if rec.attempt_phases[engine_id] is AttemptPhase.CLEANED:
            return self._results[nk]
        new = self._with_phase(rec, engine_id, AttemptPhase.CLEANED)
        if all(p is AttemptPhase.CLEANED for p in new.attempt_phases.values()):
            new = self._transition(new, VersionState.FAILED_CLEAN)
        ack = self._attempt_ack(new, engine_id, AttemptPhase.CLEANED)
        self._put(new)
        self._unknown.pop((engine_id, attempt_token), None)
        self._results[nk] = ack
        self._accepted()
        return ack

    # ========================================================= the cohort's engines (RFC 3)

    @operation(OpKind.PUBLISHER)
    def register_engine_incarnation(
        self, engine_id: str, incarnation: str, *, publisher_token: str | None = None
    ) -> IncarnationResult:
        """A (re)started engine. A new incarnation drops that engine's PREPARED / READY for the
        pending attempt: a READY from an earlier incarnation never counts toward a commit."""
        eng = self._engine(engine_id)
        checked_text("incarnation", incarnation, TOKEN_RE)
        nk = ("incarnation", engine_id, incarnation)
        if eng.incarnation == incarnation:
            return self._results[nk]
        if incarnation in eng.history:
            fail(
                ErrorCode.STALE_INCARNATION,
                f"{incarnation} is an earlier incarnation of {engine_id}",
                current=eng.incarnation,
            )
        invalidated: list[str] = []
        new_rec: VersionRecord | None = None
        if self._pending is not None:
            rec = self._versions[self._pending]
            if rec.state is VersionState.LOADING and rec.attempt_phases[engine_id] in (
                AttemptPhase.PREPARED,
                AttemptPhase.READY,
            ):
                # An UNKNOWN stays UNKNOWN: only a receipt from the new incarnation resolves it.
                new_rec = self._with_phase(rec, engine_id, AttemptPhase.NONE)
                invalidated.append(rec.attempt_token)
        result = IncarnationResult(engine_id, incarnation, eng.incarnation, tuple(invalidated))
        self._engines[engine_id] = EngineRecord(engine_id, incarnation, (*eng.history, incarnation))
        if new_rec is not None:
            self._put(new_rec)
        self._results[nk] = result
        self._accepted()
        return result

    @operation(OpKind.PUBLISHER)
    def mark_engine_unknown(
        self, engine_id: str, ref: str, op: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineAck:
        """The publisher could not learn the outcome of ``op`` on ``engine_id`` for ``ref`` (an
        attempt token or a reclaim id). Nothing is freed; the engine's earlier PREPARED/READY for
        that attempt no longer counts; new publications are refused (OUTCOME_UNKNOWN) until a
        READY, cleanup or UNLOADED receipt from that engine resolves it."""
        self._engine(engine_id)
        checked_text("ref", ref, TOKEN_RE)
        checked_text("op", op, max_len=64)
        checked_text("reason", reason, max_len=1024)
        if ref in self._by_reclaim:
            rec = self._versions[self._by_reclaim[ref]]
            rphase = rec.reclaim_phases[engine_id]
            if rphase is not ReclaimPhase.PENDING:  # UNLOADED is final; UNKNOWN already marked
                return self._reclaim_ack(rec, engine_id, rphase)
            new = evolve(rec, reclaim_phases={**rec.reclaim_phases, engine_id: ReclaimPhase.UNKNOWN})
            ack = self._reclaim_ack(new, engine_id, ReclaimPhase.UNKNOWN)
        else:
            rec = self._attempt(ref)
            if rec.commit is not None:
                fail(ErrorCode.STALE_ATTEMPT, f"attempt of {rec.key} is committed", state=rec.state.value)
            phase = rec.attempt_phases[engine_id]
            if phase in (AttemptPhase.CLEANED, AttemptPhase.UNKNOWN):  # confirmed clean wins
                return self._attempt_ack(rec, engine_id, phase)
            new = self._with_phase(rec, engine_id, AttemptPhase.UNKNOWN)
            ack = self._attempt_ack(new, engine_id, AttemptPhase.UNKNOWN)
        self._put(new)
        self._unknown[(engine_id, ref)] = UnknownOutcome(engine_id, ref, rec.key, op, reason)
        self._accepted()
        return ack

    @operation(OpKind.PUBLISHER)
    def declare_engine_lost(
        self, engine_id: str, reason: str, *, publisher_token: str | None = None
    ) -> EngineLostResult:
        """An operator's declaration that ``engine_id`` is gone for good (its host died, its
        disk was wiped): it leaves the cohort for the rest of the epoch.

        Until this call, an engine that cannot answer blocks commit, cleanup and reclaim, and
        nothing it may hold is freed: a silent engine is not a confirmed one. After it, that
        engine's receipts are no longer needed nor accepted (UNKNOWN_ENGINE): its phases are
        dropped from every version, its unknown outcomes are settled, and a version whose only
        missing receipt was this engine's finishes (ABORTED -> FAILED_CLEAN, RECLAIMING ->
        RECLAIMED). A pending LOADING attempt is not committed here: the publisher commits it
        on fresh evidence from the remaining engines. The declaration is journaled like every
        call (the audit trail); a repeat returns the first answer.
        Decision: the last engine of a cohort cannot be declared lost (INVALID_REQUEST): a
        cohort without engines could commit nothing and free everything."""
        nk = ("lost", str(engine_id))
        if nk in self._results:
            return self._results[nk]
        self._engine(engine_id)
        checked_text("reason", reason, max_len=1024)
        if len(self.engines) == 1:
            fail(ErrorCode.INVALID_REQUEST, f"{engine_id} is the last engine of the cohort")
        cohort = tuple(e for e in self.engines if e != engine_id)
        updated: list[VersionRecord] = []
        finished: list[VersionKey] = []
        for rec in self._versions.values():
            phases = {e: p for e, p in rec.attempt_phases.items() if e != engine_id}
            rphases = {e: p for e, p in rec.reclaim_phases.items() if e != engine_id}
            new = evolve(rec, attempt_phases=phases, reclaim_phases=rphases)
            if rec.state is VersionState.ABORTED and all(p is AttemptPhase.CLEANED for p in phases.values()):
                new = self._transition(new, VersionState.FAILED_CLEAN)
                finished.append(rec.key)
            elif rec.state is VersionState.RECLAIMING and all(
                p is ReclaimPhase.UNLOADED for p in rphases.values()
            ):
                new = self._transition(new, VersionState.RECLAIMED)
                finished.append(rec.key)
            updated.append(new)
        result = EngineLostResult(engine_id, reason, cohort, tuple(finished))
        self.engines = cohort
        del self._engines[engine_id]
        for rec in updated:
            self._put(rec)
        self._unknown = {k: u for k, u in self._unknown.items() if k[0] != engine_id}
        self._lost[engine_id] = reason
        self._results[nk] = result
        self._accepted()
        return result
