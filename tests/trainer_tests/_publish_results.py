"""A publisher's result as the trainer-side loops see it (not a test module): shared by the
backpressure tests and the TRL integration's tests."""

from __future__ import annotations

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.publisher import PublishOutcome, PublishResult
from relax_glue.registry_types import VersionKey, VersionState


def result(outcome: PublishOutcome, code: ErrorCode | None = None, state: VersionState | None = None):
    err = LoraVersionError(code, f"{code} happened") if code is not None else None
    return PublishResult(outcome, VersionKey("e", "step3"), "relax@e-step3-abc", "d", "t", state, error=err)
