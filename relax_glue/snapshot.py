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
    import torch  # lazy heavy import: the registry host and the CLI load this module without torch

    # copy=True guarantees fresh storage even for a CPU tensor; contiguous_format makes it one
    # dense block of exactly numel * itemsize bytes (no hidden tail of a larger live buffer).
    return tensor.detach().to(device="cpu", copy=True, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ sharded parameters
#
# A sharded adapter is refused, not gathered here: a gather is a collective every rank must
# enter, and only the main process takes the snapshot (relax_glue/trl/publication.py), so a gather
# started here would wait forever for the other ranks. The caller gathers on every rank with
# its framework's own API and snapshots inside it (SHARDED_ADVICE).

SHARDED_ADVICE = (
    "gather the adapter on every rank first and snapshot the whole tensors: FSDP2 (fully_shard, "
    "DTensor): every rank computes {k: v.full_tensor() for k, v in "
    "get_peft_model_state_dict(model).items()} and the main process passes it as "
    "Snapshot.from_peft_model(model, gathered=...); FSDP1: snapshot inside "
    "FullyShardedDataParallel.summon_full_params(model); DeepSpeed ZeRO-3: snapshot inside "
    "deepspeed.zero.GatheredParameters(list(model.parameters()))"
)


def sharded_kind(tensor: Any) -> str | None:
    """How ``tensor`` holds only a shard of its values (None: it holds all of them): a DTensor
    (FSDP2's fully_shard, tensor parallelism), FSDP1's flat parameter, or a ZeRO-3 partitioned
    parameter not gathered now (DeepSpeed sets ``ds_id`` and ``ds_status`` on every parameter
    it partitions; its data is then empty)."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        return "DTensor"
    if getattr(tensor, "_is_flat_param", False):
        return "FSDP1 flat parameter"
    if hasattr(tensor, "ds_id"):
        status = getattr(getattr(tensor, "ds_status", None), "name", None)
        if status != "AVAILABLE":
            return f"ZeRO-3 partitioned parameter ({status or 'status unknown'})"
    return None


def _dtensor_type() -> type | None:
    import torch  # lazy heavy import (see _frozen_copy)

    if not torch.distributed.is_available():  # a build without torch.distributed shards nothing
        return None
    from torch.distributed.tensor import DTensor  # only where torch.distributed is built in

    return DTensor


def _fsdp1_sharded(module: Any) -> bool:
    """An FSDP1 wrapper whose parameters are not gathered now (outside summon_full_params: with
    use_orig_params its parameters are views of this rank's shard)."""
    if _dtensor_type() is None:
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel  # only where DTensor exists

    if not isinstance(module, FullyShardedDataParallel):
        return False
    return getattr(getattr(module, "training_state", None), "name", None) != "SUMMON_FULL_PARAMS"


def sharded_parameters(model: Any) -> list[tuple[str, str]]:
    """``(name, how)`` for every parameter of ``model`` that holds a shard only, and every FSDP1
    wrapper whose parameters are not gathered now."""
    found = [(name, kind) for name, p in model.named_parameters() if (kind := sharded_kind(p))]
    wrappers = [
        (name or "<model>", "FSDP1 wrapper") for name, m in model.named_modules() if _fsdp1_sharded(m)
    ]
    return found + wrappers


def refuse_sharded(found: list[tuple[str, str]]) -> None:
    """INVALID_REQUEST naming the sharded tensors and how to gather them; nothing is copied."""
    if found:
        kinds = sorted({kind for _, kind in found})
        raise LoraVersionError(
            ErrorCode.INVALID_REQUEST,
            f"the adapter is sharded ({', '.join(kinds)}: {len(found)} tensors, e.g. {found[0][0]}); "
            + SHARDED_ADVICE,
            sharding=kinds,
            tensors=[name for name, _ in found[:20]],
        )


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
        refuse_sharded([(name, kind) for name, t in tensors.items() if (kind := sharded_kind(t))])
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
        cls,
        model: Any,
        adapter_name: str = "default",
        *,
        gathered: Mapping[str, torch.Tensor] | None = None,
        max_bucket_bytes: int = BUCKET_TARGET_BYTES,
    ) -> Snapshot:
        """Freeze the adapter of a live PEFT model (what a trainer holds between steps): the
        same tensor names and config that ``model.save_pretrained`` would write, so the snapshot
        (and its digest) equals :meth:`from_peft_dir` of that saved directory. A sharded adapter
        is refused (INVALID_REQUEST, SHARDED_ADVICE says how to gather it); ``gathered``: its
        state dict as the caller gathered it (FSDP2), the model then only gives the config."""
        from peft import get_peft_model_state_dict  # lazy: peft is needed only for a live model

        if gathered is None:
            # Before the state dict: an FSDP1 state dict is itself a collective (the other ranks
            # are not in it), and a flat parameter can hide the adapter's tensors.
            refuse_sharded(sharded_parameters(model))
        tensors = (
            gathered if gathered is not None else get_peft_model_state_dict(model, adapter_name=adapter_name)
        )
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
