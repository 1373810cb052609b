"""The one error vocabulary of the project, shared by the engine plugin and the trainer side.

Every refusal anywhere (registry, engine endpoint, session layer) is one of these codes, carries
one HTTP status, and travels as ``{"error": {"code", "message", ...details}}``. This module imports
nothing from SGLang so that ``relax_glue`` can use it without pulling the engine in.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    # identity and publication
    VERSION_CONFLICT = "VERSION_CONFLICT"
    CAPACITY_ERROR = "CAPACITY_ERROR"
    # An engine of the cohort has fewer managed slots than the epoch's capacity K (its
    # --max-loras-per-batch / --max-loaded-loras leave fewer than K + 1 LoRA slots): a setup
    # error, refused before anything is published, never mistaken for CAPACITY_ERROR's "full now"
    CAPACITY_MISMATCH = "CAPACITY_MISMATCH"
    PUBLICATION_IN_PROGRESS = "PUBLICATION_IN_PROGRESS"
    DEFAULT_REVISION_CONFLICT = "DEFAULT_REVISION_CONFLICT"
    STALE_ATTEMPT = "STALE_ATTEMPT"
    ATTEMPT_MISMATCH = "ATTEMPT_MISMATCH"  # an attempt token used with another version than its own
    # The version is held on this engine under another attempt (loaded, staging or failed there):
    # this token can neither take it over at begin nor remove it at cleanup. Ownership of an
    # engine's version never moves, so a cleanup after a lost reply cannot unload what another
    # attempt (a commit, a restore) made READY.
    NOT_ATTEMPT_OWNER = "NOT_ATTEMPT_OWNER"
    STALE_INCARNATION = "STALE_INCARNATION"
    NOT_ALL_READY = "NOT_ALL_READY"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    UNKNOWN_ENGINE = "UNKNOWN_ENGINE"
    # A publication-side registry call without the publisher token the registry was opened with
    # (a rollout worker's client carries none): only the publisher may change what is published
    NOT_PUBLISHER = "NOT_PUBLISHER"
    # data plane (staging, manifests)
    MANIFEST_MISMATCH = "MANIFEST_MISMATCH"
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    BUCKET_OUT_OF_ORDER = "BUCKET_OUT_OF_ORDER"
    INCOMPATIBLE_ADAPTER = "INCOMPATIBLE_ADAPTER"
    # The engine runs another base model (config, tokenizer, weights or dtype) than the one the
    # epoch's versions were published for: refused before any bucket moves
    BASE_MISMATCH = "BASE_MISMATCH"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    # transports: a registered transport this engine (or trainer) has no end for, or whose setup
    # is not usable now (the collective's group: connect first); this attempt's transfer failed
    TRANSPORT_UNAVAILABLE = "TRANSPORT_UNAVAILABLE"
    TRANSFER_FAILED = "TRANSFER_FAILED"
    INCOMPLETE_BODY = "INCOMPLETE_BODY"  # a request body that stalled past its deadline or was cut short
    # The native load or the exact-version probe failed: the version is not servable here and
    # still holds its slot (PREPARED when nothing stayed loaded, FAILED when what was loaded could
    # not be removed); only a cleanup of the attempt frees it.
    LOAD_FAILED = "LOAD_FAILED"
    # SGLang's native in-flight count of a version is below zero (a release without an acquire):
    # its removal is refused, nothing is unloaded on a guess; the engine needs a restart
    IN_FLIGHT_ANOMALY = "IN_FLIGHT_ANOMALY"
    # serving and sessions
    NO_PUBLISHED_VERSION = "NO_PUBLISHED_VERSION"
    VERSION_NOT_READY = "VERSION_NOT_READY"
    VERSION_RECLAIMED = "VERSION_RECLAIMED"
    UNKNOWN_VERSION = "UNKNOWN_VERSION"
    VERSION_IN_USE = "VERSION_IN_USE"  # reclaim refused: still the default or session refs > 0
    SESSION_CLOSED = "SESSION_CLOSED"
    SESSION_EXPIRED = "SESSION_EXPIRED"  # its lease ran out: closed by the reaper, never rebinds
    # a restarted registry found no database (missing or empty) where its state must be: it
    # refuses every call rather than serve an empty registry under the epoch's name
    REGISTRY_STATE_LOST = "REGISTRY_STATE_LOST"
    # The registry could not be reached (after the client's retries): its node is lost, its
    # actor not running, or no answer came. The call's outcome is unknown, so nothing is decided
    # on it; every registry op is idempotent, so asking again is safe (issue 42).
    REGISTRY_UNAVAILABLE = "REGISTRY_UNAVAILABLE"
    # The engine attested that a reply's tokens were served by another version than the session's
    # binding (or did not attest them at all): the reply is not handed on as the binding's. Not a
    # refusal: the engine did run the request, so it is not a 4xx (issue 39).
    SERVED_VERSION_MISMATCH = "SERVED_VERSION_MISMATCH"
    # A rollout worker cut off from the registry: its lease could not be renewed within its TTL,
    # so the registry may have ended it and released its sessions' refs. The worker refuses to
    # dispatch a turn (nothing was sent) until the link returns, instead of leaving the engine
    # as the only guard (issue 42). Not a 4xx: whether the lease still lives is unknown.
    WORKER_FENCED = "WORKER_FENCED"
    # guards
    MANAGED_ADAPTER = "MANAGED_ADAPTER"
    FORBIDDEN_FIELD = "FORBIDDEN_FIELD"
    INVALID_REQUEST = "INVALID_REQUEST"


# One status per code. Every refusal is a 4xx on purpose: the publisher reads 4xx as "clean,
# nothing changed" and anything else (5xx, timeout, lost reply) as "outcome unknown".
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.VERSION_CONFLICT: 409,
    ErrorCode.CAPACITY_ERROR: 409,
    ErrorCode.CAPACITY_MISMATCH: 409,
    ErrorCode.PUBLICATION_IN_PROGRESS: 409,
    ErrorCode.DEFAULT_REVISION_CONFLICT: 409,
    ErrorCode.STALE_ATTEMPT: 409,
    ErrorCode.ATTEMPT_MISMATCH: 409,
    ErrorCode.NOT_ATTEMPT_OWNER: 409,
    ErrorCode.STALE_INCARNATION: 409,
    ErrorCode.NOT_ALL_READY: 409,
    ErrorCode.OUTCOME_UNKNOWN: 409,
    ErrorCode.UNKNOWN_ENGINE: 400,
    ErrorCode.NOT_PUBLISHER: 403,
    ErrorCode.MANIFEST_MISMATCH: 422,
    ErrorCode.CHECKSUM_MISMATCH: 422,
    ErrorCode.BUCKET_OUT_OF_ORDER: 409,
    ErrorCode.INCOMPATIBLE_ADAPTER: 422,
    ErrorCode.BASE_MISMATCH: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.TRANSPORT_UNAVAILABLE: 409,
    ErrorCode.TRANSFER_FAILED: 409,
    ErrorCode.INCOMPLETE_BODY: 400,
    ErrorCode.LOAD_FAILED: 422,
    ErrorCode.IN_FLIGHT_ANOMALY: 409,
    ErrorCode.NO_PUBLISHED_VERSION: 409,
    ErrorCode.VERSION_NOT_READY: 409,
    ErrorCode.VERSION_RECLAIMED: 410,
    ErrorCode.UNKNOWN_VERSION: 404,
    ErrorCode.VERSION_IN_USE: 409,
    ErrorCode.SESSION_CLOSED: 409,
    ErrorCode.SESSION_EXPIRED: 409,
    ErrorCode.REGISTRY_STATE_LOST: 503,
    ErrorCode.REGISTRY_UNAVAILABLE: 503,
    ErrorCode.SERVED_VERSION_MISMATCH: 502,
    ErrorCode.WORKER_FENCED: 503,
    ErrorCode.MANAGED_ADAPTER: 409,
    ErrorCode.FORBIDDEN_FIELD: 400,
    ErrorCode.INVALID_REQUEST: 400,
}

assert set(HTTP_STATUS) == set(ErrorCode), "every error code needs exactly one HTTP status"

# Refusals that say "nothing was admitted, ask again shortly" carry a Retry-After (seconds). Only
# VERSION_NOT_READY: the engine is staging that exact version (a publication, or a restore onto a
# restarted engine) and will serve it once READY. Every other refusal is final for that request.
RETRY_AFTER_S: dict[ErrorCode, int] = {ErrorCode.VERSION_NOT_READY: 1}


class LoraVersionError(Exception):
    """A typed refusal. Raising one means: nothing was changed by the refused call."""

    def __init__(self, code: ErrorCode, message: str, **details: Any) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        self.details = details

    # The one factory of every encoding an error crosses a boundary in: JSON bodies (HTTP),
    # the registry actor's envelopes (Ray) and pickles (multiprocessing). Each encodes parts()
    # and rebuilds through from_parts(), so a field added here travels everywhere.
    def parts(self) -> tuple[str, str, dict[str, Any]]:
        return (self.code.value, self.message, dict(self.details))

    @classmethod
    def from_parts(cls, code: str, message: str, details: dict[str, Any]) -> LoraVersionError:
        """Raises ValueError for a code that is not ours (the caller decides what that means)."""
        return cls(ErrorCode(code), message, **details)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LoraVersionError.from_parts, self.parts())

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    @property
    def retry_after_s(self) -> int | None:
        """Seconds after which the same request may be sent again (None: do not resend it)."""
        return RETRY_AFTER_S.get(self.code)

    def to_body(self) -> dict[str, Any]:
        code, message, details = self.parts()
        return {"error": {"code": code, "message": message, **details}}

    @classmethod
    def from_body(cls, body: Any) -> LoraVersionError | None:
        """Rebuild the typed error from a JSON body; None when the body is not one of ours."""
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            return None
        err = dict(body["error"])
        code, message = err.pop("code", None), str(err.pop("message", ""))
        try:
            return cls.from_parts(code, message, err)
        except ValueError:
            return None
