"""The engine control messages: routes, requests, receipts, replies and status, as pydantic
models, with parsing that answers typed errors."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, TypeAdapter, model_validator

from lora_contract.identity import Manifest, manifest_digest
from lora_contract.names import DIGEST_PREFIX_LEN, parse_lora_name
from lora_contract.transport import (
    ATTEMPT_TOKEN_HEADER,
    BUCKET_CONTENT_TYPE,
    BUCKET_INDEX_HEADER,
    BUCKET_SHA256_HEADER,
    BUCKET_SOURCE_HEADER,
    BUCKET_TRANSPORT_HEADER,
    HTTP_TRANSPORT,
    LORA_NAME_HEADER,
    BucketSpec,
    TransportName,
    plan_problem,
)
from lora_contract.wire_models import (
    LoraName,
    NamePart,
    NonNegInt,
    Sha256Hex,
    Token,
    WireModel,
    invalid,
    mismatch,
    parse_model,
    validate_data,
)

DEFAULT_LORA_PREFIX = "relax_policy_lora"
# SGLang 0.5.23's 503 for a generation its scheduler refused before running it (waiting queue full:
# Scheduler._abort_on_queued_limit): the trainer side reads it as "not admitted, may be sent again".
# An SGLang fact, here because both sides read it; the plugin checks it at start against the
# installed scheduler (sglang_ext.lora_registry_patch.MESSAGES).
QUEUE_FULL_MESSAGE = "The request queue is full."


# --------------------------------------------------------------------------------------------
# Engine control models
# --------------------------------------------------------------------------------------------


class Routes:
    """Engine control endpoint paths (mounted by the plugin in the engine's main process)."""

    BEGIN = "/lora_versions/begin"
    RECEIVE_BUCKET = "/lora_versions/receive_bucket"
    END = "/lora_versions/end"
    CLEANUP = "/lora_versions/cleanup"
    RECLAIM = "/lora_versions/reclaim"
    COLLECTIVE_CONNECT = "/lora_versions/collective/connect"
    STATUS = "/lora_versions"
    # only with SGLANG_LORA_VERSIONS_HOOK_TIMING=1 (sglang_ext.hook_timing)
    HOOK_TIMING = "/lora_versions/hook_timing"
    VERSION_STATUS = "/lora_versions/{lora_name}"


class VersionKey(WireModel):
    # Registries may keep epoch / version_id as ints; 3 and "3" are the same key on the wire.
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    epoch: NamePart
    version_id: NamePart


class BeginRequest(WireModel):
    """Fixes identity, attempt, manifest and bucket plan. Self-consistent by construction: the
    name matches the key and digest, the digest is the manifest's, the plan covers the manifest."""

    lora_name: LoraName
    version_key: VersionKey
    digest: Sha256Hex
    attempt_token: Token
    manifest: Manifest
    bucket_plan: tuple[BucketSpec, ...] = Field(min_length=1)
    # How the buckets travel: a registered transport (lora_contract.transport). Not part of the
    # identity: a retried begin is answered from the table whatever it says. Any transport but
    # HTTP has the engine get ready for its buckets (the collective one posts the receives on
    # its group) before PREPARED; TRANSPORT_UNAVAILABLE, changing nothing, when it cannot.
    transport: TransportName = HTTP_TRANSPORT
    # The out-of-band channel the trainer will send this attempt's bytes over (the collective
    # transport: its group id). Not part of the identity. An engine whose own channel is another
    # (a second sender replaced the group, or the engine restarted) refuses the begin with
    # TRANSPORT_UNAVAILABLE before anything changes, so the trainer connects again before any byte
    # moves instead of sending into a group nobody receives on. Only with a transport but HTTP.
    channel: Token | None = None
    # The epoch's base model (the registry's record): an engine with another base refuses the
    # begin (BASE_MISMATCH) before anything is reserved. Not part of the version's identity.
    base_fingerprint: Sha256Hex | None = None

    @model_validator(mode="after")
    def _consistent(self) -> BeginRequest:
        parsed = parse_lora_name(self.lora_name)
        assert parsed is not None  # LoraName already validated the shape
        if (parsed.epoch, parsed.version_id) != (self.version_key.epoch, self.version_key.version_id):
            raise ValueError("lora_name does not match version_key")
        if parsed.digest_prefix != self.digest[:DIGEST_PREFIX_LEN]:
            raise ValueError("lora_name does not match digest")
        if manifest_digest(self.manifest) != self.digest:
            raise mismatch("digest is not the sha256 of the canonical manifest")
        problem = plan_problem(self.manifest, self.bucket_plan)
        if problem:
            raise mismatch(problem)
        if self.channel is not None and self.transport == HTTP_TRANSPORT:
            raise ValueError("channel names an out-of-band transport's channel; HTTP has none")
        return self


class PreparedReceipt(WireModel):
    state: Literal["PREPARED"] = "PREPARED"
    lora_name: LoraName
    digest: Sha256Hex
    attempt_token: Token
    incarnation: Token


# a bare file name: no separator, no leading dot, nothing a path could be built from
LocalSourceName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")]


class ReceiveBucketMeta(WireModel):
    """The metadata of ``POST receive_bucket``; sent as headers, the body is the payload."""

    lora_name: LoraName
    attempt_token: Token
    index: NonNegInt
    sha256: Sha256Hex
    # A file name in the engine's local source directory that holds the payload (the body is
    # then empty): a trainer on the same host hands the bucket over without sending it.
    source: LocalSourceName | None = None
    # The registered transport the bucket came over. Any but HTTP carries it out of band (the
    # body is empty, e.g. over the engine's collective group): this call is its acknowledgement,
    # answered once it arrived and was verified.
    transport: TransportName = HTTP_TRANSPORT

    @model_validator(mode="after")
    def _one_source(self) -> ReceiveBucketMeta:
        if self.transport != HTTP_TRANSPORT and self.source is not None:
            raise invalid(f"a bucket comes from one place: a local source or the {self.transport} transport")
        return self

    def to_headers(self) -> dict[str, str]:
        headers = {
            LORA_NAME_HEADER: self.lora_name,
            ATTEMPT_TOKEN_HEADER: self.attempt_token,
            BUCKET_INDEX_HEADER: str(self.index),
            BUCKET_SHA256_HEADER: self.sha256,
            "Content-Type": BUCKET_CONTENT_TYPE,
        }
        if self.source is not None:
            headers[BUCKET_SOURCE_HEADER] = self.source
        if self.transport != HTTP_TRANSPORT:
            headers[BUCKET_TRANSPORT_HEADER] = self.transport
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> ReceiveBucketMeta:
        """Parse from request headers (case-insensitive); INVALID_REQUEST when absent or bad."""
        lowered = {k.lower(): v for k, v in headers.items()}
        fields = {
            "lora_name": LORA_NAME_HEADER,
            "attempt_token": ATTEMPT_TOKEN_HEADER,
            "index": BUCKET_INDEX_HEADER,
            "sha256": BUCKET_SHA256_HEADER,
        }
        missing = [h for h in fields.values() if h.lower() not in lowered]
        if missing:
            raise invalid(f"missing headers {missing}", missing=missing)
        values = {f: lowered[h.lower()] for f, h in fields.items()}
        if BUCKET_SOURCE_HEADER.lower() in lowered:
            values["source"] = lowered[BUCKET_SOURCE_HEADER.lower()]
        via = lowered.get(BUCKET_TRANSPORT_HEADER.lower())
        if via is not None:
            if via == HTTP_TRANSPORT:  # the default goes unsaid: naming it is not a message we send
                raise invalid(f"{BUCKET_TRANSPORT_HEADER} names a transport other than {HTTP_TRANSPORT!r}")
            values["transport"] = via
        return parse_model(cls, values)


class CollectiveConnectRequest(WireModel):
    """Join the trainer's collective group (rank 1 of 2; the trainer is rank 0 and hosts the
    rendezvous store at ``init_method``). Idempotent for the group being set up or up."""

    group_id: Token
    init_method: Annotated[str, StringConstraints(pattern=r"^tcp://[A-Za-z0-9.\-\[\]:]{1,260}$")]
    backend: Literal["gloo", "nccl"] = "gloo"


class CollectiveConnectReply(WireModel):
    group_id: Token
    state: Literal["CONNECTED"] = "CONNECTED"
    incarnation: Token
    timeout_s: float  # the engine's deadline for the rendezvous and for each bucket


class BucketAck(WireModel):
    index: NonNegInt
    accepted: bool
    duplicate: bool = False  # an already accepted bucket again: acknowledged, not rewritten


class EndRequest(WireModel):
    lora_name: LoraName
    attempt_token: Token


class ReadyReceipt(WireModel):
    state: Literal["READY_LOCAL"] = "READY_LOCAL"
    lora_name: LoraName
    version_key: VersionKey
    digest: Sha256Hex
    attempt_token: Token
    incarnation: Token


class CleanupRequest(WireModel):
    lora_name: LoraName
    attempt_token: Token


class CleanupReceipt(WireModel):
    state: Literal["CLEANED"] = "CLEANED"
    lora_name: LoraName
    attempt_token: Token
    incarnation: Token


class ReclaimRequest(WireModel):
    lora_name: LoraName
    reclaim_id: Token
    # How long the engine may wait for in-flight requests before answering DRAINING.
    timeout_s: Annotated[float, Field(ge=0.0, le=3600.0)] = 0.0


class UnloadedReceipt(WireModel):
    state: Literal["UNLOADED"] = "UNLOADED"
    lora_name: LoraName
    reclaim_id: Token
    incarnation: Token


class DrainingReply(WireModel):
    """A removal (reclaim, or cleanup of a loaded candidate) that has started but still waits for
    ``in_flight`` admitted requests: accepted, not finished (HTTP 202). Ask again with the same
    ``reclaim_id`` or ``attempt_token``; the engine goes on draining meanwhile."""

    state: Literal["DRAINING"] = "DRAINING"
    lora_name: LoraName
    in_flight: NonNegInt
    incarnation: Token
    reclaim_id: Token | None = None  # set for a reclaim
    attempt_token: Token | None = None  # set for a cleanup
    # Set when nothing is in flight any more but SGLang refused the physical unload (a scheduler
    # error, or the step fence could not know a launched step's completion): the removal has
    # started (the name is unregistered), so this is not a refusal that changed nothing; it goes
    # on at the next call, which tries the unload again.
    unload_error: Annotated[str, StringConstraints(max_length=2000)] | None = None

    @model_validator(mode="after")
    def _one_removal(self) -> DrainingReply:
        if (self.reclaim_id is None) == (self.attempt_token is None):
            raise ValueError("a DRAINING reply names either a reclaim_id or an attempt_token")
        return self


class EngineVersionState(StrEnum):
    """Engine-local lifecycle of one managed version (see design.md, "Engine side")."""

    PREPARED = "PREPARED"  # begin accepted; buckets arriving into the attempt's stash
    LOADING = "LOADING"  # end in progress: native load and exact-version probe
    READY_LOCAL = "READY_LOCAL"  # loaded, pinned, probed
    FAILED = "FAILED"  # the load or probe failed and what it loaded could not be removed: still
    # pinned in SGLang under lora_id, never servable, holds its slot until a cleanup removes it
    RECLAIMING = "RECLAIMING"  # unregistered; in-flight requests draining
    UNLOADED = "UNLOADED"  # physically unloaded (tombstone)
    CLEANED = "CLEANED"  # attempt cleaned up (tombstone: late calls are STALE_ATTEMPT)

    @property
    def holds_slot(self) -> bool:
        """The one rule for engine capacity: a version holds a pinned slot from begin until it is
        physically unloaded or cleaned (a PREPARED version will pin at end, so it counts already).
        The engine's table and the trainer's registry both count slots by it."""
        return self in _SLOT_HOLDING


_SLOT_HOLDING = frozenset(
    {
        EngineVersionState.PREPARED,
        EngineVersionState.LOADING,
        EngineVersionState.READY_LOCAL,
        EngineVersionState.FAILED,
        EngineVersionState.RECLAIMING,
    }
)


class VersionStatus(WireModel):
    lora_name: LoraName
    state: EngineVersionState
    version_key: VersionKey | None = None
    digest: Sha256Hex | None = None
    attempt_token: Token | None = None
    reclaim_id: Token | None = None
    pinned: bool = False
    lora_id: str | None = None  # engine-local; differs between engines and between loads
    in_flight: int | None = None  # SGLang's native request refcount, when loaded (raw: < 0 is an anomaly)
    buckets_received: NonNegInt = 0
    buckets_total: NonNegInt = 0
    incarnation: Token
    created_at: float  # unix seconds
    updated_at: float


class BaseIdentity(WireModel):
    """The base model an engine applies adapters to (:mod:`lora_contract.base_identity`): one
    fingerprint over four separately hashed parts, so a mismatch can say which part differs."""

    fingerprint: Sha256Hex
    config: Sha256Hex
    tokenizer: Sha256Hex
    weights: Sha256Hex
    serving: Sha256Hex


class EngineStatus(WireModel):
    incarnation: Token
    # None only from something that is not a plugin engine; the publisher refuses it
    base: BaseIdentity | None = None
    versions: tuple[VersionStatus, ...] = ()
    managed_capacity: NonNegInt | None = None  # pinned managed versions this engine accepts
    server_time: float | None = None  # unix seconds, for reading the timestamps above


BeginReply = Annotated[PreparedReceipt | ReadyReceipt, Field(discriminator="state")]
ReclaimReply = Annotated[UnloadedReceipt | DrainingReply, Field(discriminator="state")]
CleanupReply = Annotated[CleanupReceipt | DrainingReply, Field(discriminator="state")]
_BEGIN_REPLY: TypeAdapter[PreparedReceipt | ReadyReceipt] = TypeAdapter(BeginReply)
_RECLAIM_REPLY: TypeAdapter[UnloadedReceipt | DrainingReply] = TypeAdapter(ReclaimReply)
_CLEANUP_REPLY: TypeAdapter[CleanupReceipt | DrainingReply] = TypeAdapter(CleanupReply)


def parse_begin_reply(data: Any) -> PreparedReceipt | ReadyReceipt:
    """``begin`` answers PREPARED, or READY_LOCAL when this exact version is already loaded."""
    return validate_data(_BEGIN_REPLY.validate_json, _BEGIN_REPLY.validate_python, data, "begin reply")


def parse_reclaim_reply(data: Any) -> UnloadedReceipt | DrainingReply:
    return validate_data(_RECLAIM_REPLY.validate_json, _RECLAIM_REPLY.validate_python, data, "reclaim reply")


def parse_cleanup_reply(data: Any) -> CleanupReceipt | DrainingReply:
    return validate_data(_CLEANUP_REPLY.validate_json, _CLEANUP_REPLY.validate_python, data, "cleanup reply")
