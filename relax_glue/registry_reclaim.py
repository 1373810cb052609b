"""Reclaim (RFC 5): a retired version no session can still ask for is claimed (RECLAIMING, a stable
reclaim id) and freed once every engine confirmed its unload (RECLAIMED).
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_contract.errors import ErrorCode
from relax_glue.registry_rules import (
    derive_id,
    fail,
    may_start_reclaim,
)
from relax_glue.registry_spec import OpKind, operation
from relax_glue.registry_state import RegistryState
from relax_glue.registry_types import (
    EngineAck,
    ReclaimClaim,
    ReclaimPhase,
    UnloadEvidence,
    VersionKey,
    VersionState,
    evolve,
)


class ReclaimOps(RegistryState):
    """claim_reclaim -> confirm_reclaim on every engine."""

    # ===================================================================== reclaim (RFC 5)

    @operation(OpKind.PUBLISHER)
    def claim_reclaim(
        self, version_key: VersionKey | Sequence[str], *, publisher_token: str | None = None
    ) -> ReclaimClaim:
        """RETIRED with session_refs == 0 -> RECLAIMING with a stable reclaim id (a repeat
        returns the same claim)."""
        key = self._key(version_key)
        rec = self._version(key)
        if rec.reclaim_id is not None:
            return self._claim(rec)
        if not may_start_reclaim(rec):
            if rec.state in (VersionState.PUBLISHED, VersionState.RETIRED):
                fail(
                    ErrorCode.VERSION_IN_USE,
                    f"{key} is {rec.state.value} with {rec.session_refs} session refs",
                    state=rec.state.value,
                    session_refs=rec.session_refs,
                )
            fail(
                ErrorCode.INVALID_REQUEST,
                f"{key} is {rec.state.value}, not a retired version",
                state=rec.state.value,
            )
        rid = derive_id("rcl", self.epoch, key.version_id, rec.digest)
        new = self._transition(
            rec,
            VersionState.RECLAIMING,
            reclaim_id=rid,
            reclaim_phases=dict.fromkeys(self.engines, ReclaimPhase.PENDING),
        )
        self._put(new)
        self._by_reclaim[rid] = key
        self._accepted()
        return self._claim(new)

    @operation(OpKind.PUBLISHER)
    def confirm_reclaim(
        self,
        version_key: VersionKey | Sequence[str],
        engine_id: str,
        receipt: UnloadEvidence,
        *,
        publisher_token: str | None = None,
    ) -> EngineAck:
        """UNLOADED on one engine; RECLAIMED (slot freed) once every engine confirmed. A late or
        duplicate receipt changes nothing."""
        key = self._key(version_key)
        eng = self._engine(engine_id)
        receipt = self._receipt(receipt, UnloadEvidence)
        rec = self._version(key)
        if rec.reclaim_id is None or receipt.reclaim_id != rec.reclaim_id:
            fail(
                ErrorCode.STALE_ATTEMPT,
                f"{receipt.reclaim_id} is not the reclaim of {key}",
                state=rec.state.value,
            )
        self._known_incarnation(eng, receipt.incarnation)
        nk = ("unloaded", engine_id, rec.reclaim_id)
        if rec.reclaim_phases[engine_id] is ReclaimPhase.UNLOADED:
            return self._results[nk]
        new = evolve(rec, reclaim_phases={**rec.reclaim_phases, engine_id: ReclaimPhase.UNLOADED})
        if all(p is ReclaimPhase.UNLOADED for p in new.reclaim_phases.values()):
            new = self._transition(new, VersionState.RECLAIMED)
        ack = self._reclaim_ack(new, engine_id, ReclaimPhase.UNLOADED)
        self._put(new)
        self._unknown.pop((engine_id, rec.reclaim_id), None)
        self._results[nk] = ack
        self._accepted()
        return ack
