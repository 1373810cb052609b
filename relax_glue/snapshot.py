"""A frozen adapter snapshot: what one publication sends, computed once at the snapshot point.

RFC 3.1: the trainer exports/gathers the adapter at a fixed point; from then on the publication
(digest, name, every bucket to every engine) uses this one copy, never the live parameters. The
copies are CPU tensors with storage of their own, so an optimizer step on the live tensors
cannot change what is being published, nor make the bytes sent disagree with the digest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    BUCKET_TARGET_BYTES,
    BeginRequest,
    BucketSpec,
    Manifest,
    VersionKey,
    encode_bucket,
    make_lora_name,
    manifest_bucket_checksum,
    manifest_digest,
    manifest_from_tensors,
    parse_model,
    plan_buckets,
    read_peft_dir,
)

if TYPE_CHECKING:
    import torch


class EncodedBucket(NamedTuple):
    spec: BucketSpec
    payload: bytes  # safetensors bytes of spec.tensor_names
    sha256: str  # of payload


def _frozen_copy(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    # copy=True guarantees fresh storage even for a CPU tensor; contiguous_format makes it one
    # dense block of exactly numel * itemsize bytes (no hidden tail of a larger live buffer).
    return tensor.detach().to(device="cpu", copy=True, memory_format=torch.contiguous_format)


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """Frozen tensors + serving config + manifest + digest + bucket plan. Do not mutate tensors
    in place; ``verify()`` recomputes the digest to prove nobody did."""

    config: Mapping[str, Any]  # the normalised serving config (manifest.config)
    tensors: Mapping[str, torch.Tensor]  # read-only mapping of owned CPU copies
    manifest: Manifest
    digest: str
    bucket_plan: tuple[BucketSpec, ...]

    @classmethod
    def from_tensors(
        cls,
        config: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        *,
        max_bucket_bytes: int = BUCKET_TARGET_BYTES,
    ) -> Snapshot:
        """Copy ``tensors`` (any device) to owned CPU tensors, then describe the copies."""
        # Copy first, hash the copies: hashing the live tensors and copying afterwards could
        # describe bytes that differ from the ones we hold if training moves on in between.
        owned = {name: _frozen_copy(t) for name, t in tensors.items()}
        manifest = manifest_from_tensors(config, owned)
        return cls(
            config=MappingProxyType(manifest.config),
            tensors=MappingProxyType(owned),
            manifest=manifest,
            digest=manifest_digest(manifest),
            bucket_plan=tuple(plan_buckets(manifest, max_bucket_bytes)),
        )

    @classmethod
    def from_peft_model(
        cls, model: Any, adapter_name: str = "default", *, max_bucket_bytes: int = BUCKET_TARGET_BYTES
    ) -> Snapshot:
        """Freeze the adapter of a live PEFT model (what a trainer holds between steps): the
        same tensor names and config that ``model.save_pretrained`` would write, so the snapshot
        (and its digest) equals :meth:`from_peft_dir` of that saved directory."""
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(model, adapter_name=adapter_name)
        config = model.peft_config[adapter_name].to_dict()
        # A PeftConfig holds sets (target_modules); save_pretrained writes them as lists.
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        return cls.from_tensors(config, tensors, max_bucket_bytes=max_bucket_bytes)

    @classmethod
    def from_peft_dir(cls, path: str | Path, *, max_bucket_bytes: int = BUCKET_TARGET_BYTES) -> Snapshot:
        config, tensors = read_peft_dir(path)
        return cls.from_tensors(config, tensors, max_bucket_bytes=max_bucket_bytes)

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def lora_name(self, prefix: str, epoch: str | int, version_id: str | int) -> str:
        return make_lora_name(prefix, epoch, version_id, self.digest)

    def iter_buckets(self) -> Iterator[EncodedBucket]:
        """Payloads in plan order, encoded lazily: one payload in memory at a time."""
        for spec in self.bucket_plan:
            payload = encode_bucket(self.tensors, spec)
            yield EncodedBucket(spec, payload, manifest_bucket_checksum(self.manifest, payload))

    def begin_request(
        self,
        prefix: str,
        epoch: str | int,
        version_id: str | int,
        attempt_token: str,
        base_fingerprint: str | None = None,
    ) -> BeginRequest:
        """The ``begin`` body for this snapshot under ``(epoch, version_id)``; with the epoch's
        ``base_fingerprint`` an engine of another base refuses it (BASE_MISMATCH)."""
        # parse_model turns a bad token into LoraVersionError(INVALID_REQUEST), not a pydantic error.
        return parse_model(
            BeginRequest,
            {
                "lora_name": self.lora_name(prefix, epoch, version_id),
                "version_key": VersionKey(epoch=str(epoch), version_id=str(version_id)),
                "digest": self.digest,
                "attempt_token": attempt_token,
                "manifest": self.manifest,
                "bucket_plan": self.bucket_plan,
                "base_fingerprint": base_fingerprint,
            },
        )

    def verify(self) -> None:
        """Recompute the manifest from the held tensors; CHECKSUM_MISMATCH if anything changed."""
        if manifest_digest(manifest_from_tensors(self.config, self.tensors)) != self.digest:
            raise LoraVersionError(
                ErrorCode.CHECKSUM_MISMATCH, "snapshot tensors changed after the snapshot point"
            )
