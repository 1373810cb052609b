"""The two "engine state -> action" rules of recovery, side by side (pure, tables first).

- :func:`resolve_action`: ``Publisher.resolve()`` settling a publication whose outcome is
  unknown: what to do on one engine for *this attempt* (token and digest).
- :func:`restore_plan`: the reconciler restoring committed versions onto engines that lost them:
  what one engine needs for each *wanted version* (whatever attempt loaded it).

Both read the engine's own status of the name (``None``: the engine does not know it) and answer
from one table per rule; a state missing from a table is an error, never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from lora_contract import protocol
from relax_glue.registry_types import VersionView

S = protocol.EngineVersionState


class ResolveAction(StrEnum):
    """What ``resolve()`` does on one engine, decided from that engine's view of the attempt."""

    READY = "READY"  # READY for this attempt: record it
    END = "END"  # every bucket is there (or the load runs): end alone finishes it
    REDRIVE = "REDRIVE"  # begin again from the snapshot (never got begin, or lost it in a restart)
    DOOMED = "DOOMED"  # this attempt cannot finish there: abort and clean up


class RestoreAction(StrEnum):
    """What one engine needs for one wanted version."""

    HELD = "HELD"  # READY_LOCAL with the registry's digest: nothing to do
    RESTORE = "RESTORE"  # unknown there (restarted), or a CLEANED tombstone: stage it
    CLEAN_THEN_RESTORE = "CLEAN_THEN_RESTORE"  # an interrupted restore (PREPARED / FAILED) holds the name
    WAIT = "WAIT"  # LOADING (a load is running there), or a stale view: look again next round
    CONFLICT = "CONFLICT"  # another digest, or being reclaimed there: never touched, reported


# This attempt's state on the engine -> action. PREPARED depends on whether every bucket
# arrived, so it is decided in resolve_action.
RESOLVE_BY_STATE: dict[protocol.EngineVersionState, ResolveAction] = {
    S.READY_LOCAL: ResolveAction.READY,
    S.LOADING: ResolveAction.END,  # a repeated end joins the shielded load
    S.CLEANED: ResolveAction.DOOMED,  # tombstoned: never recreated
    S.FAILED: ResolveAction.DOOMED,  # only its cleanup frees it
    S.RECLAIMING: ResolveAction.DOOMED,
    S.UNLOADED: ResolveAction.DOOMED,
}

# The wanted version's state on the engine (same digest) -> action. Another digest is CONFLICT
# whatever the state: the engine fixes a name's digest for its lifetime, even past a cleanup (its
# begin would be VERSION_CONFLICT), so it is never touched, only reported.
RESTORE_BY_STATE: dict[protocol.EngineVersionState, RestoreAction] = {
    S.READY_LOCAL: RestoreAction.HELD,
    S.LOADING: RestoreAction.WAIT,
    S.CLEANED: RestoreAction.RESTORE,  # only a tombstone of an earlier attempt: nothing held
    S.PREPARED: RestoreAction.CLEAN_THEN_RESTORE,  # under some attempt: clean it, stage afresh
    S.FAILED: RestoreAction.CLEAN_THEN_RESTORE,
    S.RECLAIMING: RestoreAction.CONFLICT,  # being reclaimed there
    S.UNLOADED: RestoreAction.CONFLICT,
}


def resolve_action(vs: protocol.VersionStatus | None, attempt_token: str, digest: str) -> ResolveAction:
    """The one rule of resolve() per engine: ``vs`` is the engine's status of the version."""
    if vs is None:
        return ResolveAction.REDRIVE
    if vs.attempt_token != attempt_token or vs.digest != digest:
        return ResolveAction.DOOMED  # another attempt owns the name there
    if vs.state is S.PREPARED:
        complete = vs.buckets_total > 0 and vs.buckets_received == vs.buckets_total
        return ResolveAction.END if complete else ResolveAction.REDRIVE
    return RESOLVE_BY_STATE[vs.state]


def restore_action(want: VersionView, vs: protocol.VersionStatus | None) -> RestoreAction:
    """What the engine whose status of the name is ``vs`` needs for the wanted version."""
    if vs is None:
        return RestoreAction.RESTORE
    if vs.digest != want.digest:
        return RestoreAction.CONFLICT
    action = RESTORE_BY_STATE[vs.state]
    if action is RestoreAction.CLEAN_THEN_RESTORE and vs.attempt_token == want.attempt_token:
        # The committing attempt itself half staged or failed: only a stale view shows that (the
        # commit took its READY there, a restart forgets everything). A cleanup under its token
        # would unload the committed version: nothing is touched, the next round looks again.
        return RestoreAction.WAIT
    return action


def restore_plan(
    wanted: Sequence[VersionView], engine: protocol.EngineStatus
) -> list[tuple[VersionView, RestoreAction, protocol.VersionStatus | None]]:
    """For each wanted version, what ``engine`` needs."""
    held = {v.lora_name: v for v in engine.versions}
    return [
        (want, restore_action(want, held.get(want.lora_name)), held.get(want.lora_name)) for want in wanted
    ]
