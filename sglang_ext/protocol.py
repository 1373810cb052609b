"""The wire protocol shared by the engine plugin and the trainer side, in three parts:

- :mod:`sglang_ext.identity`: the normalised serving config, the canonical manifest and its digest
  (what a LoRA version *is*), read from a PEFT directory;
- :mod:`sglang_ext.transport`: the bucket plan and the bucket payloads (how its tensors travel);
- :mod:`sglang_ext.messages`: the engine control requests, receipts, replies and status;

on top of the dependency-free name rules (:mod:`sglang_ext.names`) and the pydantic base
(:mod:`sglang_ext.wire`). This module re-exports all of it as the one import for users of the
contract; each name is defined in exactly one of those modules.

Import discipline: imported by ``relax_glue`` (no engine) and by the plugin inside every SGLang
process, so at import time it touches only stdlib and pydantic.
"""

from __future__ import annotations

from sglang_ext.identity import (
    DTYPE_ITEMSIZE,
    MANIFEST_SCHEMA_VERSION,
    SERVING_CONFIG_FIELDS,
    Manifest,
    TensorEntry,
    canonical_manifest_bytes,
    check_tensor_against_manifest,
    check_tensor_set,
    manifest_digest,
    manifest_from_tensors,
    normalise_serving_config,
    read_peft_dir,
    tensor_entry,
)
from sglang_ext.messages import (
    DEFAULT_LORA_PREFIX,
    BeginReply,
    BeginRequest,
    BucketAck,
    CleanupReceipt,
    CleanupReply,
    CleanupRequest,
    CollectiveConnectReply,
    CollectiveConnectRequest,
    DrainingReply,
    EndRequest,
    EngineStatus,
    EngineVersionState,
    PreparedReceipt,
    ReadyReceipt,
    ReceiveBucketMeta,
    ReclaimReply,
    ReclaimRequest,
    Routes,
    UnloadedReceipt,
    VersionKey,
    VersionStatus,
    parse_begin_reply,
    parse_cleanup_reply,
    parse_reclaim_reply,
)
from sglang_ext.names import (
    DIGEST_PREFIX_LEN,
    ParsedLoraName,
    is_managed_name,
    make_lora_name,
    parse_lora_name,
)
from sglang_ext.transport import (
    ATTEMPT_TOKEN_HEADER,
    BUCKET_CONTENT_TYPE,
    BUCKET_INDEX_HEADER,
    BUCKET_SHA256_HEADER,
    BUCKET_SOURCE_HEADER,
    BUCKET_TARGET_BYTES,
    BUCKET_TRANSPORT_HEADER,
    LORA_NAME_HEADER,
    BucketSpec,
    bucket_checksum,
    bucket_header,
    check_bucket_plan,
    check_bucket_tensors,
    decode_bucket,
    encode_bucket,
    manifest_bucket_checksum,
    max_payload_bytes,
    plan_buckets,
)
from sglang_ext.wire import (
    parse_model,
)

__all__ = [
    "ATTEMPT_TOKEN_HEADER",
    "BUCKET_CONTENT_TYPE",
    "BUCKET_INDEX_HEADER",
    "BUCKET_SHA256_HEADER",
    "BUCKET_SOURCE_HEADER",
    "BUCKET_TARGET_BYTES",
    "BUCKET_TRANSPORT_HEADER",
    "DEFAULT_LORA_PREFIX",
    "DIGEST_PREFIX_LEN",
    "DTYPE_ITEMSIZE",
    "LORA_NAME_HEADER",
    "MANIFEST_SCHEMA_VERSION",
    "SERVING_CONFIG_FIELDS",
    "BeginReply",
    "BeginRequest",
    "BucketAck",
    "BucketSpec",
    "CleanupReceipt",
    "CleanupReply",
    "CleanupRequest",
    "CollectiveConnectReply",
    "CollectiveConnectRequest",
    "DrainingReply",
    "EndRequest",
    "EngineStatus",
    "EngineVersionState",
    "Manifest",
    "ParsedLoraName",
    "PreparedReceipt",
    "ReadyReceipt",
    "ReceiveBucketMeta",
    "ReclaimReply",
    "ReclaimRequest",
    "Routes",
    "TensorEntry",
    "UnloadedReceipt",
    "VersionKey",
    "VersionStatus",
    "bucket_checksum",
    "bucket_header",
    "canonical_manifest_bytes",
    "check_bucket_plan",
    "check_bucket_tensors",
    "check_tensor_against_manifest",
    "check_tensor_set",
    "decode_bucket",
    "encode_bucket",
    "is_managed_name",
    "make_lora_name",
    "manifest_bucket_checksum",
    "manifest_digest",
    "manifest_from_tensors",
    "max_payload_bytes",
    "normalise_serving_config",
    "parse_begin_reply",
    "parse_cleanup_reply",
    "parse_lora_name",
    "parse_model",
    "parse_reclaim_reply",
    "plan_buckets",
    "read_peft_dir",
    "tensor_entry",
]
