"""The engine shell (publication and reclaim services over the real version table) on the
in-memory native edge (tests/_fake_native.py), as the shell's unit tests drive it."""

from __future__ import annotations

import uuid

import torch
from _fake_native import FakeNative, fake_staging

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import CleanupRequest, EndRequest, ReceiveBucketMeta, ReclaimRequest
from relax_glue.snapshot import Snapshot
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.engine_state import EngineState, assemble_engine
from sglang_ext.version_table import StagingLimits, VersionTable

GEOMETRY = ModelGeometry(
    "Qwen3ForCausalLM", num_layers=2, hidden_size=16, intermediate_size=32, q_size=16, kv_size=16
)


class Shell:
    def __init__(self, managed_capacity: int = 2) -> None:
        limits = StagingLimits(
            managed_capacity=managed_capacity,
            lora=EngineLoraShape(GEOMETRY, max_lora_rank=8, served_modules=None),
            max_version_bytes=10**9,
            max_bucket_bytes=10**8,
        )
        self.table = VersionTable("inc", limits)
        self.native = FakeNative()
        state = assemble_engine(EngineState(incarnation="inc"), self.table, self.native, fake_staging())
        assert state.publication is not None and state.reclaim is not None
        self.state = state
        self.publication, self.reclaim_service = state.publication, state.reclaim
        self.locks = state.publication._locks  # the one set both services share
        self.begin_req: dict = {}  # name -> its begin request
        self.snapshots: dict = {}  # seed -> its snapshot

    async def stage(self, seed: int) -> tuple[str, str]:
        """begin + every bucket of a fresh version; (name, attempt token)."""
        snap = self.snapshot(seed)
        req = snap.begin_request("p", "e", f"v{seed}", uuid.uuid4().hex)
        self.begin_req[req.lora_name] = req
        await self.publication.begin(req)
        for b in snap.iter_buckets():
            meta = ReceiveBucketMeta(
                lora_name=req.lora_name, attempt_token=req.attempt_token, index=b.spec.index, sha256=b.sha256
            )

            async def read(cap: int, receiver, payload: bytes = b.payload) -> None:
                receiver.feed(payload)

            await self.publication.receive_bucket(meta, read)
        return req.lora_name, req.attempt_token

    def snapshot(self, seed: int) -> Snapshot:
        """The snapshot of seed ``seed`` (a small adapter, one bucket), recorded in snapshots."""
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(2):
            for m in ("q_proj", "v_proj"):
                stem = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(4, 16, generator=g)
                tensors[f"{stem}.lora_B.weight"] = torch.randn(16, 4, generator=g)
        snap = Snapshot.from_tensors(
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, tensors
        )
        self.snapshots[seed] = snap
        return snap

    async def end(self, name: str, token: str):
        return await self.publication.end(EndRequest(lora_name=name, attempt_token=token))

    async def cleanup(self, name: str, token: str, drain_timeout_s: float = 5.0):
        return await self.publication.cleanup(
            CleanupRequest(lora_name=name, attempt_token=token), drain_timeout_s
        )

    async def reclaim(self, name: str, reclaim_id: str, timeout_s: float = 0.05):
        return await self.reclaim_service.reclaim(
            ReclaimRequest(lora_name=name, reclaim_id=reclaim_id, timeout_s=timeout_s)
        )

    def servable(self, name: str) -> bool:
        return self.table.request_gate(name, self.native.lora_id_of(name)) is None


def partial_load_of(native: FakeNative, real_load):
    """A load SGLang refuses after some rank loaded it: the adapter is loaded, its id was never
    registered (no name resolves to it, no counter), and LOAD_FAILED names it (native_lora)."""

    async def partial_load(lora_name, adapter_dir):
        lora_id = await real_load(lora_name, adapter_dir)
        del native.registry[lora_name], native.counters[lora_id]  # as if never registered
        raise LoraVersionError(ErrorCode.LOAD_FAILED, "rank 1 failed", leftover_lora_id=lora_id)

    return partial_load
