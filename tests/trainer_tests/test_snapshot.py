"""Pure tests of the trainer-side snapshot: isolation from live tensors, identity, buckets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.snapshot import Snapshot

CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 16.0,
    "target_modules": ["v_proj", "q_proj"],
    "lora_dropout": 0.1,
}


def live_params(layers: int = 3, hidden: int = 32, r: int = 4) -> dict[str, torch.Tensor]:
    """Stand-ins for live trainer parameters: grads on, some non-contiguous, some views."""
    torch.manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    fused = torch.randn(2 * hidden, r, requires_grad=True)  # one buffer, two views into it
    for i in range(layers):
        for mod in ("q_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            out[f"{stem}.lora_A.weight"] = torch.nn.Parameter(torch.randn(hidden, r).t())  # non-contig
            out[f"{stem}.lora_B.weight"] = torch.nn.Parameter(torch.randn(hidden, r).to(torch.bfloat16))
    out["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"] = fused[:hidden]
    out["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] = fused[hidden:]
    return out


@pytest.fixture()
def live() -> dict[str, torch.Tensor]:
    return live_params()


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_copies_share_no_storage_with_live_tensors(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live)
    live_ptrs = {storage_ptr(t) for t in live.values()}
    snap_ptrs = [storage_ptr(t) for t in snap.tensors.values()]
    assert not live_ptrs & set(snap_ptrs)
    assert len(set(snap_ptrs)) == len(snap_ptrs)  # no two snapshot tensors share storage either
    for name, t in snap.tensors.items():
        assert t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
        # exactly its own bytes: a view of a larger live buffer does not drag the buffer along
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert torch.equal(t, live[name].detach())


def test_live_updates_do_not_change_snapshot(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live)
    before = {k: v.clone() for k, v in snap.tensors.items()}
    digest, payloads = snap.digest, [b.payload for b in snap.iter_buckets()]
    with torch.no_grad():
        for t in live.values():
            t.add_(1.0)  # an optimizer step
        live[next(iter(live))].zero_()
    live["new.lora_A.weight"] = torch.ones(2, 2)  # the live dict grows too
    assert all(torch.equal(before[k], snap.tensors[k]) for k in before)
    assert "new.lora_A.weight" not in snap.tensors
    assert snap.digest == digest and [b.payload for b in snap.iter_buckets()] == payloads
    snap.verify()
    assert Snapshot.from_tensors(CONFIG, live).digest != digest


def test_snapshot_is_read_only(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live)
    with pytest.raises(TypeError):
        snap.tensors["x"] = torch.zeros(1)  # type: ignore[index]
    with pytest.raises(TypeError):
        snap.config["r"] = 99  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.digest = "0" * 64  # type: ignore[misc]


def test_verify_detects_in_place_mutation_of_snapshot(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live)
    next(iter(snap.tensors.values())).mul_(2)
    with pytest.raises(LoraVersionError) as info:
        snap.verify()
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH


def test_identity_fields(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live, max_bucket_bytes=512)
    assert dict(snap.config) == p.normalise_serving_config(CONFIG)
    assert snap.manifest == p.manifest_from_tensors(CONFIG, live)
    assert snap.digest == p.manifest_digest(snap.manifest)
    assert snap.bucket_plan == tuple(p.plan_buckets(snap.manifest, 512))
    assert snap.total_bytes == sum(t.numel() * t.element_size() for t in live.values())


def test_bucket_cap_changes_plan_not_digest(live: dict[str, torch.Tensor]) -> None:
    small = Snapshot.from_tensors(CONFIG, live, max_bucket_bytes=256)
    big = Snapshot.from_tensors(CONFIG, live)
    assert len(small.bucket_plan) > 1 and len(big.bucket_plan) == 1
    assert small.digest == big.digest and small.manifest == big.manifest


def test_iter_buckets_round_trip(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live, max_bucket_bytes=300)
    buckets = snap.iter_buckets()
    assert iter(buckets) is buckets  # lazy: one payload at a time
    received: dict[str, torch.Tensor] = {}
    for i, (spec, payload, sha) in enumerate(buckets):
        assert spec == snap.bucket_plan[i] and sha == p.bucket_checksum(payload)
        decoded = p.decode_bucket(payload, expected_sha256=sha)
        p.check_bucket_tensors(snap.manifest, spec, decoded)
        received.update(decoded)
    p.check_tensor_set(snap.manifest, received)
    assert Snapshot.from_tensors(CONFIG, received).digest == snap.digest


def test_lora_name_and_begin_request(live: dict[str, torch.Tensor]) -> None:
    snap = Snapshot.from_tensors(CONFIG, live)
    name = snap.lora_name("relax_policy_lora", 2, "17")
    assert name == f"relax_policy_lora@2-17-{snap.digest[:12]}"
    assert p.parse_lora_name(name) == ("relax_policy_lora", "2", "17", snap.digest[:12])
    req = snap.begin_request("relax_policy_lora", 2, "17", attempt_token="attempt-1")
    assert req.lora_name == name and req.digest == snap.digest
    assert req.version_key == p.VersionKey(epoch="2", version_id="17")
    assert p.parse_model(p.BeginRequest, req.model_dump_json()) == req
    with pytest.raises(LoraVersionError) as info:
        snap.lora_name("relax:policy", 2, 17)
    assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(LoraVersionError) as info:
        snap.begin_request("relax_policy_lora", 2, 17, attempt_token="no spaces allowed")
    assert info.value.code is ErrorCode.INVALID_REQUEST


def test_from_peft_dir_matches_and_is_isolated_from_the_file(
    tmp_path: Path, live: dict[str, torch.Tensor]
) -> None:
    plain = {k: v.detach().contiguous() for k, v in live.items()}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**CONFIG, "task_type": "CAUSAL_LM"}))
    save_file(plain, str(tmp_path / "adapter_model.safetensors"))
    snap = Snapshot.from_peft_dir(tmp_path, max_bucket_bytes=300)
    assert snap.digest == Snapshot.from_tensors(CONFIG, live).digest
    # the fixed-name overwrite RL frameworks do today must not reach an existing snapshot
    save_file({k: v + 1 for k, v in plain.items()}, str(tmp_path / "adapter_model.safetensors"))
    snap.verify()
    assert Snapshot.from_peft_dir(tmp_path).digest != snap.digest


def test_refusals() -> None:
    with pytest.raises(LoraVersionError) as info:
        Snapshot.from_tensors(CONFIG, {})
    assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(LoraVersionError) as info:
        Snapshot.from_tensors({"r": 4}, {"x": torch.zeros(2)})
    assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(LoraVersionError):
        Snapshot.from_tensors(CONFIG, {"x": torch.zeros(2)}, max_bucket_bytes=0)
