"""The registry's pure rules, shared by its parts: which states hold a slot, may be reclaimed,
were committed, are pending; the legal transitions; the checks of every input (one rule each, the
name rules from :mod:`lora_contract.names`); the publisher token's shape; derived ids.

No state and no IO: functions and constants only, so each part of the registry
(:mod:`~relax_glue.registry_attempts`, :mod:`~relax_glue.registry_sessions`,
:mod:`~relax_glue.registry_reclaim`) and every reader outside it applies the same answer.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from typing import Any, NoReturn

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.names import DIGEST_PREFIX_LEN, make_lora_name, name_part, parse_lora_name
from relax_glue.registry_types import (
    AttemptPhase,
    ReclaimPhase,
    VersionKey,
    VersionRecord,
    VersionState,
    VersionView,
)

__all__ = [
    "COMMITTED_STATES",
    "PENDING_STATES",
    "SLOT_STATES",
    "TRANSITIONS",
    "UNKNOWN_PHASES",
    "checked_epoch",
    "checked_lora_name",
    "checked_publisher_token",
    "checked_seconds",
    "checked_text",
    "derive_id",
    "fail",
    "holds_slot",
    "is_committed",
    "may_start_reclaim",
    "new_publisher_token",
]

# ---------------------------------------------------------------------------------- states

SLOT_STATES = frozenset(
    {
        VersionState.LOADING,
        VersionState.PUBLISHED,
        VersionState.RETIRED,
        VersionState.RECLAIMING,
        VersionState.ABORTED,  # until cleanup is confirmed on every engine
    }
)


def holds_slot(state: VersionState) -> bool:
    """The one answer to "does a version in this state occupy a capacity slot?".

    Only FAILED_CLEAN and RECLAIMED free a slot: both are reached by confirmed receipts from
    every engine, never by a timeout or a guess.
    """
    return state in SLOT_STATES


def may_start_reclaim(record: VersionRecord | VersionView) -> bool:
    """The one answer to "may this version enter RECLAIMING now?": retired and no session can
    still ask for it. In-flight requests are the engine's business (native refcount)."""
    return record.state is VersionState.RETIRED and record.session_refs == 0


def is_committed(state: VersionState) -> bool:
    """The one answer to "was this version ever committed?" (it then never returns to a
    candidate state: PUBLISHED, RETIRED, RECLAIMING or RECLAIMED)."""
    return state in COMMITTED_STATES


# A RECLAIMED or FAILED_CLEAN version never returns: both have no way out.
TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    VersionState.LOADING: frozenset({VersionState.PUBLISHED, VersionState.ABORTED}),
    VersionState.PUBLISHED: frozenset({VersionState.RETIRED}),
    VersionState.RETIRED: frozenset({VersionState.RECLAIMING}),
    VersionState.RECLAIMING: frozenset({VersionState.RECLAIMED}),
    VersionState.ABORTED: frozenset({VersionState.FAILED_CLEAN}),
    VersionState.RECLAIMED: frozenset(),
    VersionState.FAILED_CLEAN: frozenset(),
}

PENDING_STATES = frozenset({VersionState.LOADING, VersionState.ABORTED})  # the one attempt in flight
COMMITTED_STATES = frozenset(
    {VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING, VersionState.RECLAIMED}
)

# an engine phase whose outcome is unknown, of an attempt or of a reclaim (the invariant check)
UNKNOWN_PHASES = frozenset({AttemptPhase.UNKNOWN, ReclaimPhase.UNKNOWN})

# ---------------------------------------------------------------------------------- inputs


def new_publisher_token() -> str:
    """A fresh publisher token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def checked_publisher_token(token: Any) -> str:
    """``token`` if it can be a publisher token; ValueError otherwise (never naming the value)."""
    if not isinstance(token, str) or not 16 <= len(token) <= 256 or not token.isascii():
        raise ValueError("a publisher token is an ASCII string of 16 to 256 characters")
    return token


def fail(code: ErrorCode, message: str, **details: Any) -> NoReturn:
    raise LoraVersionError(code, message, **details)


def derive_id(prefix: str, *parts: str) -> str:
    # Deterministic: a replayed history hands out the same ids. Unique per version because a
    # version has exactly one attempt and at most one reclaim in its life.
    digest = hashlib.sha256("\x1f".join((prefix, *parts)).encode()).hexdigest()[:24]
    return f"{prefix}-{digest}"


def checked_text(field: str, value: Any, pattern: re.Pattern[str] | None = None, max_len: int = 256) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        fail(ErrorCode.INVALID_REQUEST, f"{field} must be a non-empty string (<= {max_len} chars)")
    if pattern is not None and not pattern.fullmatch(value):
        fail(ErrorCode.INVALID_REQUEST, f"{field} has invalid characters: {value!r}", field=field)
    return value


def checked_seconds(field: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        fail(ErrorCode.INVALID_REQUEST, f"{field} must be a finite number of seconds")
    if value < 0 or (positive and value == 0):
        fail(ErrorCode.INVALID_REQUEST, f"{field} must be {'> 0' if positive else '>= 0'}")
    return float(value)


def checked_epoch(value: Any) -> str:
    """An epoch by the one rule of a name part (:func:`lora_contract.names.name_part`: the wire
    carries it as a string, ints are the same key), refused with its answer."""
    return name_part("epoch", value)


def checked_lora_name(key: VersionKey, digest: str, lora_name: Any) -> str:
    """``lora_name`` if it is exactly the managed name :func:`~lora_contract.names.make_lora_name`
    builds for ``key`` and ``digest`` (under any prefix); INVALID_REQUEST otherwise. The name a
    version is served under is then a function of its identity: an engine or a client parsing it
    back finds the epoch, version id and digest prefix the registry holds, and the name is free of
    ':' (OpenAI's ``model="base:adapter"``), '/' and whitespace by the same rule."""
    parsed = parse_lora_name(lora_name)
    if parsed is None or make_lora_name(parsed.prefix, key.epoch, key.version_id, digest) != lora_name:
        fail(
            ErrorCode.INVALID_REQUEST,
            f"lora_name must be the managed name of {key} and its digest "
            f"('<prefix>@{key.epoch}-{key.version_id}-{digest[:DIGEST_PREFIX_LEN]}'), got {lora_name!r:.120}",
            lora_name=lora_name,
        )
    return lora_name
