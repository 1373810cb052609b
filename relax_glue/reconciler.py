"""Restoring committed versions onto engines that lost them (an engine restart after a commit).

The registry is the source of truth for which versions must be served: the default, and every
RETIRED version that sessions still hold (session refs > 0: their requests will keep naming it).
An engine that restarted (a new incarnation) holds none of them. The reconciler compares what the
registry wants with what each engine reports (``GET /lora_versions``) and stages each missing
version onto that engine through the same begin -> buckets -> end protocol as a publication,
with a fresh attempt token of its own and the snapshot read back from the on-disk
:class:`~relax_glue.snapshot_store.SnapshotStore` (its bytes checked against the digest).

* Default first, then retired versions by commit order (newest first): a new session binds the
  default, so it matters most.
* The registry is not changed: a restore does not create, commit or free anything, it only makes
  an engine hold again what the registry already says is live. Reclaim is unaffected: an engine
  that never got a version back answers a reclaim with an authoritative UNLOADED.
* A restore that fails is cleaned up on that engine (its own token) and retried by the next
  reconcile; leftovers of an interrupted restore (PREPARED or FAILED under a token the engine
  reports) are cleaned the same way. Nothing the registry counts is freed by this module.
* Until an engine holds a version again, requests for it there are refused with
  VERSION_NOT_READY (while staging) or UNKNOWN_VERSION (not begun yet): never the base model.

:func:`relax_glue.recovery_rules.restore_plan` is the pure rule; :class:`Reconciler` does the IO.
The publisher runs it under its publication and reclaim locks
(:meth:`relax_glue.publisher.Publisher.reconcile`), so a restore never races a publication or a
reclaim driven by the same publisher.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import parse_lora_name
from relax_glue.cohort_core import CohortCore, CohortDriver, EngineStep
from relax_glue.engine_client import CallOutcome, OutcomeUnknown
from relax_glue.recovery_rules import RestoreAction, restore_plan
from relax_glue.registry_types import StatusView, VersionKey, VersionState, VersionView
from relax_glue.snapshot import Snapshot
from relax_glue.snapshot_store import SnapshotStore
from relax_glue.stage import StagePlan, stage

__all__ = [
    "Reconciler",
    "RestoreOutcome",
    "RestoreResult",
    "wanted_versions",
]

S = protocol.EngineVersionState


class RestoreOutcome(StrEnum):
    HELD = "HELD"
    RESTORED = "RESTORED"
    FAILED = "FAILED"  # a step was refused or its outcome is unknown; cleaned (or to clean) there
    WAITING = "WAITING"
    CONFLICT = "CONFLICT"
    NO_SNAPSHOT = "NO_SNAPSHOT"  # the store has no (valid) entry for the digest
    UNREACHABLE = "UNREACHABLE"  # the engine's status could not be read


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    engine_id: str
    version_key: VersionKey | None  # None for an UNREACHABLE engine (nothing was planned)
    lora_name: str
    outcome: RestoreOutcome
    incarnation: str | None = None
    detail: str = ""
    duration_s: float = 0.0


def wanted_versions(status: StatusView) -> tuple[VersionView, ...]:
    """The versions every engine must hold: the default, then every RETIRED version that
    sessions still hold (newest commit first). RECLAIMING ones are not: their requests are
    refused anyway, and reclaim treats an engine that does not hold them as unloaded."""
    default = [v for v in status.versions if v.state is VersionState.PUBLISHED]
    retired = sorted(
        (v for v in status.versions if v.state is VersionState.RETIRED and v.session_refs > 0),
        key=lambda v: -(v.commit_revision or 0),
    )
    return (*default, *retired)


class Reconciler(CohortDriver):
    def __init__(self, cohort: CohortCore) -> None:
        if cohort.store is None:
            raise ValueError("restoring versions needs a cohort with a SnapshotStore")
        super().__init__(cohort)
        self.store: SnapshotStore = cohort.store
        self.steps: list[EngineStep] = []  # every engine call of the last reconcile, for audits

    async def reconcile(self, engines: Sequence[str] | None = None) -> tuple[RestoreResult, ...]:
        """One pass over ``engines`` (default: the whole cohort). Idempotent: an engine that
        holds every wanted version gets only a status read. Runs under the cohort's publication
        and reclaim lock: a restore never races a publication or a reclaim of this cohort."""
        async with self.cohort.publication_lock, self.cohort.reclaim_lock:
            return await self._reconcile(engines)

    async def _reconcile(self, engines: Sequence[str] | None) -> tuple[RestoreResult, ...]:
        await self._setup()
        self.steps = []
        status = await self.registry.status()
        wanted = wanted_versions(status)
        # Only cohort members: an engine declared lost gets nothing back, whoever names it.
        todo = [e for e in self._cohort if engines is None or e in engines]
        snapshots: dict[str, Snapshot | LoraVersionError] = {}
        ok, refused, unknown = await self._fanout(
            self.steps,
            "reconcile",
            todo,
            lambda e: self._reconcile_engine(e, wanted, snapshots, status.base_fingerprint),
        )
        results: list[RestoreResult] = []
        for engine in todo:
            if engine in ok:
                results.extend(ok[engine])
            else:
                exc = refused.get(engine) or unknown.get(engine)
                results.append(RestoreResult(engine, None, "", RestoreOutcome.UNREACHABLE, detail=str(exc)))
        return tuple(results)

    def _snapshot(
        self, view: VersionView, cache: dict[str, Snapshot | LoraVersionError]
    ) -> Snapshot | LoraVersionError:
        if view.digest not in cache:
            try:
                cache[view.digest] = self.store.get(view.digest)
            except LoraVersionError as err:
                cache[view.digest] = err
        return cache[view.digest]

    async def _reconcile_engine(
        self,
        engine: str,
        wanted: Sequence[VersionView],
        snapshots: dict[str, Snapshot | LoraVersionError],
        base: str | None,
    ) -> list[RestoreResult]:
        status = await self.engines[engine].status()  # refused / unknown: the whole engine is UNREACHABLE
        await self._note_incarnation(engine, status.incarnation)
        if base is not None and (status.base is None or status.base.fingerprint != base):
            # Restarted on another base model: nothing of the epoch is ever staged there.
            seen = status.base.fingerprint if status.base is not None else None
            detail = f"the engine runs base {seen}, the epoch's is {base}"
            conflict = RestoreOutcome.CONFLICT
            return [
                RestoreResult(engine, v.version_key, v.lora_name, conflict, status.incarnation, detail)
                for v in wanted
            ]
        results = []
        for view, action, vs in restore_plan(wanted, status):
            t0 = time.monotonic()

            def result(
                outcome: RestoreOutcome, detail: str = "", view: VersionView = view, t0: float = t0
            ) -> RestoreResult:
                return RestoreResult(
                    engine,
                    view.version_key,
                    view.lora_name,
                    outcome,
                    status.incarnation,
                    detail,
                    time.monotonic() - t0,
                )

            if action is RestoreAction.HELD:
                results.append(result(RestoreOutcome.HELD))
                continue
            if action is RestoreAction.WAIT:
                assert vs is not None
                results.append(
                    result(RestoreOutcome.WAITING, f"{vs.state.value} there under {vs.attempt_token}")
                )
                continue
            if action is RestoreAction.CONFLICT:
                assert vs is not None
                results.append(
                    result(RestoreOutcome.CONFLICT, f"engine holds it {vs.state.value} digest {vs.digest}")
                )
                continue
            snap = self._snapshot(view, snapshots)
            if isinstance(snap, LoraVersionError):
                results.append(result(RestoreOutcome.NO_SNAPSHOT, str(snap)))
                continue
            if action is RestoreAction.CLEAN_THEN_RESTORE:
                assert vs is not None and vs.attempt_token is not None
                if not await self._clean(engine, view.lora_name, vs.attempt_token):
                    results.append(
                        result(RestoreOutcome.FAILED, "an interrupted restore could not be cleaned yet")
                    )
                    continue
            outcome, detail = await self._restore(engine, view, snap, base)
            results.append(result(outcome, detail))
        return results

    async def _restore(
        self, engine: str, view: VersionView, snap: Snapshot, base: str | None
    ) -> tuple[RestoreOutcome, str]:
        """begin -> every bucket -> end on one engine under a fresh attempt token, through the
        publisher's own staging (:func:`relax_glue.stage.stage`)."""
        token = f"rst-{uuid.uuid4().hex}"
        # The one begin body, under the exact name the registry committed: its prefix, key and
        # digest, so a restore never invents another identity.
        parsed = parse_lora_name(view.lora_name)
        assert parsed is not None, f"the registry committed a name of another format: {view.lora_name}"
        plan = StagePlan.of(snap, parsed.prefix, view.version_key, token, base)
        # the store is content-addressed: the snapshot of this digest gives this very name
        assert plan.lora_name == view.lora_name, (plan.lora_name, view.lora_name)
        calls = _RestoreCalls(self)
        try:
            await stage(plan, self.engines, [engine], calls)
        except (LoraVersionError, OutcomeUnknown) as exc:
            if isinstance(exc, LoraVersionError) and exc.code is ErrorCode.NOT_ATTEMPT_OWNER:
                # The status read was stale: the engine holds the version, loaded under another
                # attempt (an earlier restore). Nothing of ours is there, nothing to clean.
                owner = exc.details.get("owner_attempt_token")
                return RestoreOutcome.HELD, f"held there under attempt {owner}"
            # Whatever part of it landed there is removed under our own token (or left for the
            # next reconcile to find and clean: the engine reports it with that token). A
            # cleanup never removes what another attempt holds (the engine refuses it).
            cleaned = await self._clean(engine, view.lora_name, token)
            return RestoreOutcome.FAILED, f"{calls.op}: {exc}; {'cleaned' if cleaned else 'cleanup pending'}"
        return RestoreOutcome.RESTORED, calls.detail

    async def _clean(self, engine: str, lora_name: str, token: str) -> bool:
        try:
            reply = await self.engines[engine].cleanup(
                protocol.CleanupRequest(lora_name=lora_name, attempt_token=token)
            )
        except LoraVersionError as exc:
            if exc.code is ErrorCode.NOT_ATTEMPT_OWNER:
                # Authoritative: this token holds nothing there (the name is another attempt's).
                self._step(engine, "restore_cleanup", f"nothing of {token} there: {exc.message}")
                return True
            self._step(engine, "restore_cleanup", f"not confirmed: {exc}")
            return False
        except OutcomeUnknown as exc:
            self._step(engine, "restore_cleanup", f"not confirmed: {exc}")
            return False
        done = not isinstance(reply, protocol.DrainingReply)
        self._step(engine, "restore_cleanup", "cleaned" if done else "draining")
        return done

    def _step(self, engine: str, op: str, detail: str) -> None:
        self.steps.append(EngineStep(engine, op, CallOutcome.OK, detail=detail))


class _RestoreCalls:
    """The reconciler's part of a staging (relax_glue.stage.StageCalls) on its one engine: a
    call's failure is raised to :meth:`Reconciler._restore`, which cleans up under its token;
    nothing is recorded in the registry (the version is committed already)."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self.op = "begin"  # the call running now, for the failure's detail
        self.detail = ""

    async def run(
        self, op: str, engines: Sequence[str], call: Callable[[str], Awaitable[Any]]
    ) -> tuple[Mapping[str, Any], None]:
        self.op = op
        return {engine: await call(engine) for engine in engines}, None

    async def begun(self, engine: str, reply: protocol.BeginReply) -> bool:
        self.reconciler._step(engine, "restore_begin", reply.incarnation)
        if isinstance(reply, protocol.ReadyReceipt):  # only a replay of this very attempt
            self.detail = f"already loaded by this attempt in {reply.incarnation}"
            return False
        return True

    async def ready(self, engine: str, receipt: protocol.ReadyReceipt) -> None:
        self.reconciler._step(engine, "restore_end", receipt.incarnation)
        await self.reconciler._note_incarnation(engine, receipt.incarnation)
        self.detail = f"READY in {receipt.incarnation}"
