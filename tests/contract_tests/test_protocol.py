"""Pure tests of the shared wire protocol: manifest, digest, names, buckets, models. No engine."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from safetensors.torch import save, save_file

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["v_proj", "q_proj"],
    "lora_dropout": 0.05,
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": "/some/where/Qwen3-0.6B",
    "bias": "none",
}


def make_tensors(seed: int = 0, layers: int = 2, hidden: int = 16, r: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for mod in ("q_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            out[f"{stem}.lora_A.weight"] = torch.randn(r, hidden, generator=gen).to(torch.bfloat16)
            out[f"{stem}.lora_B.weight"] = torch.randn(hidden, r, generator=gen)
    return out


def digest_of(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    return p.manifest_digest(p.manifest_from_tensors(config, tensors))


@contextmanager
def expect_error(code: ErrorCode) -> Iterator[pytest.ExceptionInfo[LoraVersionError]]:
    with pytest.raises(LoraVersionError) as info:
        yield info
    assert info.value.code is code, info.value


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return make_tensors()


@pytest.fixture(scope="module")
def manifest(tensors: dict[str, torch.Tensor]) -> p.Manifest:
    return p.manifest_from_tensors(BASE_CONFIG, tensors)


# ------------------------------------------------------------------ config normalisation


def test_normalise_keeps_serving_fields_only_and_writes_defaults() -> None:
    cfg = p.normalise_serving_config(BASE_CONFIG)
    assert list(cfg) == list(p.SERVING_CONFIG_FIELDS)
    assert "lora_dropout" not in cfg and "base_model_name_or_path" not in cfg
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    assert cfg["use_dora"] is False and cfg["rank_pattern"] == {} and cfg["modules_to_save"] is None
    assert p.normalise_serving_config(cfg) == cfg  # idempotent


@pytest.mark.parametrize(
    "variant",
    [
        {"target_modules": ["q_proj", "v_proj", "q_proj"]},
        {"target_modules": ("v_proj", "q_proj")},
        {"lora_alpha": 8.0},
        {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False},
        {"modules_to_save": []},
        {"modules_to_save": None, "rank_pattern": None, "layers_to_transform": []},
        {"peft_type": "lora"},
        {"lora_dropout": 0.0, "inference_mode": True, "revision": "x"},
        # PEFT's neutral values of the keys refused otherwise (PEFT writes them all)
        {"init_lora_weights": True, "layer_replication": None, "lora_bias": False, "use_qalora": False},
        {"init_lora_weights": "gaussian", "target_parameters": [], "trainable_token_indices": None},
        {"alora_invocation_tokens": None, "megatron_config": None, "ensure_weight_tying": False},
    ],
)
def test_equivalent_configs_normalise_identically(variant: dict[str, Any]) -> None:
    assert p.normalise_serving_config({**BASE_CONFIG, **variant}) == p.normalise_serving_config(BASE_CONFIG)


def test_normalisation_details() -> None:
    cfg = p.normalise_serving_config(
        {
            **BASE_CONFIG,
            "target_modules": ".*proj",
            "lora_alpha": 12.5,
            "layers_to_transform": 3,
            "rank_pattern": {"b": 2, "a": 8},
            "alpha_pattern": {"x": 4.0},
        }
    )
    assert cfg["target_modules"] == ".*proj"  # regex string kept verbatim
    assert cfg["lora_alpha"] == 12.5
    assert cfg["layers_to_transform"] == [3]
    assert list(cfg["rank_pattern"]) == ["a", "b"]
    assert cfg["alpha_pattern"] == {"x": 4} and isinstance(cfg["alpha_pattern"]["x"], int)


@pytest.mark.parametrize(
    "bad",
    [
        {"r": None},
        {"r": True},
        {"r": 0},
        {"r": "4"},
        {"lora_alpha": float("nan")},
        {"lora_alpha": float("inf")},
        {"lora_alpha": True},
        {"lora_alpha": "8"},
        {"target_modules": []},
        {"target_modules": None},
        {"target_modules": ["q_proj", ""]},
        {"use_dora": "false"},
        {"rank_pattern": {"a": 0}},
        {"layers_to_transform": [-1]},
    ],
)
def test_invalid_config_refused(bad: dict[str, Any]) -> None:
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.normalise_serving_config({**BASE_CONFIG, **bad})


@pytest.mark.parametrize(
    "bad",
    [
        {"layer_replication": [[0, 2], [1, 3]]},
        {"init_lora_weights": "pissa"},
        {"lora_bias": True},
        {"a_field_of_a_later_peft": False},
    ],
)
def test_a_key_that_changes_the_function_is_refused_not_dropped(bad: dict[str, Any]) -> None:
    """Issue 24 (2): these were dropped, so the engine served another function than PEFT's."""
    with expect_error(ErrorCode.INCOMPATIBLE_ADAPTER) as info:
        p.normalise_serving_config({**BASE_CONFIG, **bad})
    assert repr(next(iter(bad))) in info.value.message


# ------------------------------------------------------------------ manifest and digest


def test_manifest_shape(manifest: p.Manifest, tensors: dict[str, torch.Tensor]) -> None:
    assert list(manifest.names) == sorted(tensors)
    entry = manifest.entry("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert entry is not None and entry.dtype == "bfloat16" and entry.shape == (4, 16) and entry.nbytes == 128
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_tensor_sha_is_sha_of_safetensors_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    import hashlib

    assert p.tensor_entry("x", t).sha256 == hashlib.sha256(t.numpy().tobytes()).hexdigest()
    # non-contiguous input hashes as its contiguous bytes
    assert p.tensor_entry("x", t.t()).sha256 == p.tensor_entry("x", t.t().contiguous()).sha256


def test_golden_digest() -> None:
    """Pins the canonical format: a change here breaks trainer/engine compatibility on purpose."""
    tensors = {
        "a.lora_A.weight": torch.arange(8, dtype=torch.float32).reshape(2, 4),
        "a.lora_B.weight": torch.arange(8, dtype=torch.bfloat16).reshape(4, 2),
    }
    cfg = {"r": 2, "lora_alpha": 4, "target_modules": ["a"]}
    manifest = p.manifest_from_tensors(cfg, tensors)
    assert p.canonical_manifest_bytes(manifest).startswith(b'{"config":{"alpha_pattern":{},"bias":"none",')
    assert p.manifest_digest(manifest) == GOLDEN_DIGEST


GOLDEN_DIGEST = "8bd4aed1eab23c66b0eacb6c4a7399c09504f301b62de981f18f8cf1ec0ce8dd"


def test_digest_stable_across_calls_order_and_irrelevant_config(tensors: dict[str, torch.Tensor]) -> None:
    d = digest_of(BASE_CONFIG, tensors)
    assert d == digest_of(BASE_CONFIG, dict(reversed(list(tensors.items()))))
    assert d == digest_of(dict(reversed(list(BASE_CONFIG.items()))), tensors)
    assert d == digest_of({**BASE_CONFIG, "lora_dropout": 0.3, "task_type": None}, tensors)
    assert d == digest_of(BASE_CONFIG, {k: v.clone() for k, v in tensors.items()})
    assert len(d) == 64 and int(d, 16) >= 0


def _first(tensors: dict[str, torch.Tensor]) -> str:
    return sorted(tensors)[0]


def _flip_one_bit(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in ts.items()}
    raw = out[_first(out)].view(torch.uint8).reshape(-1)
    raw[-1] ^= 1
    return out


def _reshape(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = _first(ts)
    return {**ts, k: ts[k].reshape(-1)}  # same bytes, other shape


def _retype(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = _first(ts)
    return {**ts, k: ts[k].view(torch.float16)}  # same bytes, other dtype (bf16 -> f16)


def _rename(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    k = _first(ts)
    out = dict(ts)
    out[k + "_x"] = out.pop(k)
    return out


def _drop(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ts.items() if k != _first(ts)}


@pytest.mark.parametrize("change", [_flip_one_bit, _reshape, _retype, _rename, _drop])
def test_digest_sensitive_to_tensors(tensors: dict[str, torch.Tensor], change: Any) -> None:
    assert digest_of(BASE_CONFIG, change(tensors)) != digest_of(BASE_CONFIG, tensors)


@pytest.mark.parametrize(
    "variant",
    [
        {"r": 8},
        {"lora_alpha": 16},
        {"lora_alpha": 8.5},
        {"target_modules": ["q_proj"]},
        {"target_modules": ["q_proj", "v_proj", "k_proj"]},
        {"use_rslora": True},
        {"use_dora": True},
        {"bias": "all"},
        {"fan_in_fan_out": True},
        {"modules_to_save": ["lm_head"]},
        {"rank_pattern": {"q_proj": 2}},
    ],
)
def test_digest_sensitive_to_config(tensors: dict[str, torch.Tensor], variant: dict[str, Any]) -> None:
    assert digest_of({**BASE_CONFIG, **variant}, tensors) != digest_of(BASE_CONFIG, tensors)


def test_canonical_bytes_are_compact_sorted_json(manifest: p.Manifest) -> None:
    raw = p.canonical_manifest_bytes(manifest)
    assert b" " not in raw and b"\n" not in raw
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()


def test_manifest_json_round_trip_keeps_digest(manifest: p.Manifest) -> None:
    again = p.parse_model(p.Manifest, manifest.model_dump_json())
    assert again == manifest and p.manifest_digest(again) == p.manifest_digest(manifest)


def test_manifest_validation(manifest: p.Manifest) -> None:
    data = manifest.model_dump(mode="json")
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.parse_model(p.Manifest, {**data, "tensors": list(reversed(data["tensors"]))})
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.parse_model(p.Manifest, {**data, "tensors": [data["tensors"][0], data["tensors"][0]]})
    bad_size = {**data["tensors"][0], "nbytes": data["tensors"][0]["nbytes"] + 1}
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.parse_model(p.Manifest, {**data, "tensors": [bad_size]})
    with expect_error(ErrorCode.INVALID_REQUEST):  # not canonical
        p.parse_model(p.Manifest, {**data, "config": {**data["config"], "lora_alpha": 8.0}})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.Manifest, {**data, "config": {**data["config"], "lora_dropout": 0.1}})
    # a key refused by the one table keeps its code through pydantic, as the engine parses begin
    with expect_error(ErrorCode.INCOMPATIBLE_ADAPTER) as info:
        p.parse_model(p.Manifest, {**data, "config": {**data["config"], "layer_replication": [[0, 1]]}})
    assert "'layer_replication'" in info.value.message
    with expect_error(ErrorCode.INVALID_REQUEST):  # its neutral value: dropped, so not canonical
        p.parse_model(p.Manifest, {**data, "config": {**data["config"], "layer_replication": None}})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.Manifest, {**data, "config": {**data["config"], 3: object()}})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.Manifest, {**data, "config": {**data["config"], "target_modules": {"q_proj"}}})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.Manifest, {**data, "tensors": []})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.Manifest, {**data, "tensors": [{**data["tensors"][0], "dtype": "complex64"}]})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.Manifest, {**data, "tensors": [{**data["tensors"][0], "sha256": "AB" * 32}]})


def test_manifest_from_tensors_refusals() -> None:
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.manifest_from_tensors(BASE_CONFIG, {"x" * 2000: torch.zeros(1)})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.manifest_from_tensors(BASE_CONFIG, {})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.manifest_from_tensors(BASE_CONFIG, {"x": torch.zeros(2, dtype=torch.complex64)})


def test_check_tensor_against_manifest(manifest: p.Manifest, tensors: dict[str, torch.Tensor]) -> None:
    name = _first(tensors)
    p.check_tensor_against_manifest(manifest, name, tensors[name].clone())
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_tensor_against_manifest(manifest, "nope", tensors[name])
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_tensor_against_manifest(manifest, name, tensors[name].float())
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_tensor_against_manifest(manifest, name, tensors[name].reshape(-1))
    changed = _flip_one_bit(tensors)[name]
    with expect_error(ErrorCode.CHECKSUM_MISMATCH):
        p.check_tensor_against_manifest(manifest, name, changed)
    p.check_tensor_against_manifest(manifest, name, changed, verify_content=False)


def test_check_tensor_set(manifest: p.Manifest) -> None:
    p.check_tensor_set(manifest, reversed(manifest.names))
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_tensor_set(manifest, manifest.names[1:])
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_tensor_set(manifest, [*manifest.names, "extra"])


# ------------------------------------------------------------------ lora_name

DIGEST = "0123456789abcdef" * 4


def test_version_key_accepts_ints() -> None:
    assert p.VersionKey(epoch=3, version_id=7) == p.VersionKey(epoch="3", version_id="7")  # type: ignore[arg-type]
    for bad in (-1, True, "1-2", ""):
        with expect_error(ErrorCode.INVALID_REQUEST):
            p.parse_model(p.VersionKey, {"epoch": bad, "version_id": "1"})


def test_name_format_and_round_trip() -> None:
    name = p.make_lora_name("relax_policy_lora", 3, "v12", DIGEST)
    assert name == "relax_policy_lora@3-v12-0123456789ab"
    parsed = p.parse_lora_name(name)
    assert parsed == ("relax_policy_lora", "3", "v12", "0123456789ab")
    assert parsed is not None and (parsed.epoch, parsed.version_id) == ("3", "v12")
    assert p.is_managed_name(name) and p.is_managed_name(name, "relax_policy_lora")
    assert not p.is_managed_name(name, "other")


@pytest.mark.parametrize(
    ("prefix", "epoch", "version_id", "digest"),
    [
        ("base:adapter", 1, 1, DIGEST),
        ("a/b", 1, 1, DIGEST),
        ("a b", 1, 1, DIGEST),
        ("", 1, 1, DIGEST),
        ("a@b", 1, 1, DIGEST),
        ("p", "1-2", 1, DIGEST),
        ("p", -1, 1, DIGEST),
        ("p", True, 1, DIGEST),
        ("p", 1, "", DIGEST),
        ("p", 1, "v:1", DIGEST),
        ("p", 1, "v\n", DIGEST),
        ("p", 1, "x" * 65, DIGEST),
        ("p", 1, 1, DIGEST.upper()),
        ("p", 1, 1, DIGEST[:12]),
        ("p", 1, 1, DIGEST + "\n"),
    ],
)
def test_name_refusals(prefix: Any, epoch: Any, version_id: Any, digest: Any) -> None:
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.make_lora_name(prefix, epoch, version_id, digest)


@pytest.mark.parametrize(
    "name",
    [
        "base:adapter",
        "plain_adapter",
        "p@1-2",
        "p@1-2-3-0123456789ab",
        "p@1-2-0123456789AB",
        "p@1-2-0123456789a",
        "p@1-2-0123456789ab\n",
        "@1-2-0123456789ab",
        "p@@1-2-0123456789ab",
        "p@1-2-0123456789ab:x",
        "",
    ],
)
def test_parse_rejects_foreign_names(name: str) -> None:
    assert p.parse_lora_name(name) is None
    assert not p.is_managed_name(name)


_part = st.text(alphabet="abcXYZ019_.", min_size=1, max_size=64)


@settings(max_examples=200, deadline=None)
@given(
    prefix=_part,
    epoch=_part | st.integers(0, 10**12),
    version_id=_part,
    digest=st.binary(min_size=32, max_size=32),
)
def test_name_round_trip_property(prefix: str, epoch: str | int, version_id: str, digest: bytes) -> None:
    hexd = digest.hex()
    name = p.make_lora_name(prefix, epoch, version_id, hexd)
    assert ":" not in name and "/" not in name and not any(c.isspace() for c in name)
    assert p.parse_lora_name(name) == (prefix, str(epoch), version_id, hexd[:12])


# ------------------------------------------------------------------ bucket plan


def fake_manifest(sizes: list[int]) -> p.Manifest:
    """A manifest of uint8 tensors of the given sizes, without torch."""
    entries = [
        p.TensorEntry(name=f"t{i:04d}", dtype="uint8", shape=(n,), nbytes=n, sha256="0" * 64)
        for i, n in enumerate(sizes)
    ]
    return p.Manifest(config=p.normalise_serving_config(BASE_CONFIG), tensors=tuple(entries))


def assert_plan_ok(manifest: p.Manifest, plan: list[p.BucketSpec], cap: int) -> None:
    p.check_bucket_plan(manifest, plan)
    assert [b.index for b in plan] == list(range(len(plan)))
    assert [n for b in plan for n in b.tensor_names] == list(manifest.names)  # fixed order, once each
    for b in plan:
        assert b.total_bytes <= cap or len(b.tensor_names) == 1


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40), cap=st.integers(1, 8000))
def test_plan_property(sizes: list[int], cap: int) -> None:
    manifest = fake_manifest(sizes)
    plan = p.plan_buckets(manifest, cap)
    assert_plan_ok(manifest, plan, cap)
    # greedy: no two neighbouring buckets could have been merged under the cap
    for a, b in itertools.pairwise(plan):
        assert a.total_bytes + manifest.entry(b.tensor_names[0]).nbytes > cap  # type: ignore[union-attr]


def test_plan_edges() -> None:
    manifest = fake_manifest([10, 10, 100, 10])
    assert [b.tensor_names for b in p.plan_buckets(manifest, 25)] == [
        ("t0000", "t0001"),
        ("t0002",),  # larger than the cap: a bucket of its own
        ("t0003",),
    ]
    assert len(p.plan_buckets(manifest, 10**9)) == 1
    assert len(p.plan_buckets(manifest, 1)) == 4
    for bad in (0, -5, True, 1.5):
        with expect_error(ErrorCode.INVALID_REQUEST):
            p.plan_buckets(manifest, bad)  # type: ignore[arg-type]


def test_bucket_cap_is_not_identity(tensors: dict[str, torch.Tensor]) -> None:
    m1, m2 = p.manifest_from_tensors(BASE_CONFIG, tensors), p.manifest_from_tensors(BASE_CONFIG, tensors)
    assert p.plan_buckets(m1, 1) != p.plan_buckets(m2, 10**9)
    assert p.manifest_digest(m1) == p.manifest_digest(m2)


def test_check_bucket_plan_refusals() -> None:
    manifest = fake_manifest([10, 10, 10])
    good = p.plan_buckets(manifest, 10)
    spec = p.BucketSpec
    cases = [
        [],
        good[:2],
        [*good, spec(index=3, tensor_names=("t0000",), total_bytes=10)],
        [good[1], good[0], good[2]],
        [spec(index=0, tensor_names=("t0000", "t0001", "t0002"), total_bytes=29)],
        [spec(index=0, tensor_names=("t0000", "t0001", "t0002", "zz"), total_bytes=30)],
    ]
    for plan in cases:
        with expect_error(ErrorCode.MANIFEST_MISMATCH):
            p.check_bucket_plan(manifest, plan)


# ------------------------------------------------------------------ bucket payloads


@pytest.fixture(scope="module")
def mixed() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(3, 5),
        "b": torch.randn(4, 2).to(torch.bfloat16),
        "c": torch.randn(7).to(torch.float16),
        "d": torch.tensor(1.5),  # 0-d
        "e": torch.zeros(0, 4),  # empty
        "f": torch.randn(6, 3).t(),  # non-contiguous
    }


def test_encode_decode_round_trip(mixed: dict[str, torch.Tensor]) -> None:
    manifest = p.manifest_from_tensors(BASE_CONFIG, mixed)
    plan = p.plan_buckets(manifest, 64)
    received: dict[str, torch.Tensor] = {}
    for spec in plan:
        payload = p.encode_bucket(mixed, spec)
        assert payload == p.encode_bucket(mixed, spec)  # deterministic bytes
        assert len(payload) <= p.max_payload_bytes(manifest, spec)
        decoded = p.decode_bucket(payload, expected_sha256=p.bucket_checksum(payload))
        assert set(decoded) == set(spec.tensor_names)
        p.check_bucket_tensors(manifest, spec, decoded)
        received.update(decoded)
    p.check_tensor_set(manifest, received)
    for name, t in mixed.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t)


def test_decode_detects_corruption(mixed: dict[str, torch.Tensor]) -> None:
    manifest = p.manifest_from_tensors(BASE_CONFIG, mixed)
    spec = p.plan_buckets(manifest, 10**9)[0]
    payload = p.encode_bucket(mixed, spec)
    sha = p.bucket_checksum(payload)
    corrupt = bytearray(payload)
    corrupt[-1] ^= 0xFF
    with expect_error(ErrorCode.CHECKSUM_MISMATCH):
        p.decode_bucket(bytes(corrupt), expected_sha256=sha)
    # consistent sha, content not the manifest's: caught per tensor
    tampered = p.decode_bucket(bytes(corrupt), expected_sha256=p.bucket_checksum(bytes(corrupt)))
    with expect_error(ErrorCode.CHECKSUM_MISMATCH):
        p.check_bucket_tensors(manifest, spec, tampered)
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.decode_bucket(b"not safetensors at all")
    # not safetensors: refused as such whatever checksum comes with it
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.decode_bucket(b"not safetensors at all", expected_sha256=sha)


def test_check_bucket_tensors_layout(mixed: dict[str, torch.Tensor]) -> None:
    manifest = p.manifest_from_tensors(BASE_CONFIG, mixed)
    plan = p.plan_buckets(manifest, 10**9)
    spec = plan[0]
    decoded = p.decode_bucket(p.encode_bucket(mixed, spec))
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_bucket_tensors(manifest, spec, {**decoded, "zz": torch.zeros(1)})
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_bucket_tensors(manifest, spec, {k: v for k, v in decoded.items() if k != "a"})
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_bucket_tensors(manifest, spec, {**decoded, "a": decoded["a"].reshape(5, 3)})
    with expect_error(ErrorCode.MANIFEST_MISMATCH):
        p.check_bucket_tensors(manifest, spec, {**decoded, "a": decoded["a"].double()})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.encode_bucket({"a": mixed["a"]}, spec)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8]),
    cap=st.integers(1, 400),
)
def test_bucket_round_trip_property(shapes: list[list[int]], dtype: torch.dtype, cap: int) -> None:
    ts = {f"w{i}": (torch.rand(tuple(s)) * 100).to(dtype) for i, s in enumerate(shapes)}
    manifest = p.manifest_from_tensors(BASE_CONFIG, ts)
    out: dict[str, torch.Tensor] = {}
    for spec in p.plan_buckets(manifest, cap):
        payload = p.encode_bucket(ts, spec)
        decoded = p.decode_bucket(payload, expected_sha256=p.bucket_checksum(payload))
        p.check_bucket_tensors(manifest, spec, decoded)
        out.update(decoded)
    assert p.manifest_digest(p.manifest_from_tensors(BASE_CONFIG, out)) == p.manifest_digest(manifest)


# ------------------------------------------------------------------ PEFT directory


def test_read_peft_dir(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(BASE_CONFIG))
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    config, loaded = p.read_peft_dir(tmp_path)
    assert config == BASE_CONFIG
    assert digest_of(config, loaded) == digest_of(BASE_CONFIG, tensors)


def test_read_peft_dir_refusals(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps(BASE_CONFIG))
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.read_peft_dir(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.read_peft_dir(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(save({"x": torch.zeros(1)}))
    (tmp_path / "adapter_config.json").write_text("[1, 2]")
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.read_peft_dir(tmp_path)


# ------------------------------------------------------------------ control models

NAME = p.make_lora_name("relax_policy_lora", 1, 7, DIGEST)
KEY = {"epoch": "1", "version_id": "7"}
INC = "a1b2c3d4"


def begin_payload(manifest: p.Manifest, cap: int = 100) -> dict[str, Any]:
    digest = p.manifest_digest(manifest)
    return {
        "lora_name": p.make_lora_name("relax_policy_lora", 1, 7, digest),
        "version_key": KEY,
        "digest": digest,
        "attempt_token": "att-1",
        "manifest": manifest.model_dump(mode="json"),
        "bucket_plan": [b.model_dump(mode="json") for b in p.plan_buckets(manifest, cap)],
    }


SAMPLES: dict[type[BaseModel], dict[str, Any]] = {
    p.VersionKey: KEY,
    p.PreparedReceipt: {"lora_name": NAME, "digest": DIGEST, "attempt_token": "t1", "incarnation": INC},
    p.ReceiveBucketMeta: {"lora_name": NAME, "attempt_token": "t1", "index": 0, "sha256": DIGEST},
    p.BucketAck: {"index": 0, "accepted": True, "duplicate": False},
    p.EndRequest: {"lora_name": NAME, "attempt_token": "t1"},
    p.ReadyReceipt: {
        "lora_name": NAME,
        "version_key": KEY,
        "digest": DIGEST,
        "attempt_token": "t1",
        "incarnation": INC,
    },
    p.CleanupRequest: {"lora_name": NAME, "attempt_token": "t1"},
    p.CleanupReceipt: {"lora_name": NAME, "attempt_token": "t1", "incarnation": INC},
    p.ReclaimRequest: {"lora_name": NAME, "reclaim_id": "r1", "timeout_s": 1.5},
    p.UnloadedReceipt: {"lora_name": NAME, "reclaim_id": "r1", "incarnation": INC},
    p.DrainingReply: {"lora_name": NAME, "reclaim_id": "r1", "in_flight": 2, "incarnation": INC},
    p.VersionStatus: {
        "lora_name": NAME,
        "state": "READY_LOCAL",
        "digest": DIGEST,
        "attempt_token": "t1",
        "pinned": True,
        "lora_id": "abc",
        "in_flight": 0,
        "incarnation": INC,
        "created_at": 1.0,
        "updated_at": 2.0,
    },
    p.EngineStatus: {"incarnation": INC, "versions": []},
    p.BucketSpec: {"index": 0, "tensor_names": ["a"], "total_bytes": 4},
}


@pytest.mark.parametrize("model", list(SAMPLES), ids=lambda m: m.__name__)
def test_models_round_trip_forbid_extra_and_frozen(model: type[BaseModel]) -> None:
    obj = p.parse_model(model, SAMPLES[model])
    assert p.parse_model(model, obj.model_dump_json()) == obj
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(model, {**SAMPLES[model], "lora_id_forged": 1})
    field = next(iter(SAMPLES[model]))
    with pytest.raises(ValidationError):
        setattr(obj, field, SAMPLES[model][field])


def test_receipt_states_are_fixed() -> None:
    assert p.parse_model(p.PreparedReceipt, SAMPLES[p.PreparedReceipt]).state == "PREPARED"
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(p.PreparedReceipt, {**SAMPLES[p.PreparedReceipt], "state": "READY_LOCAL"})


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (p.EndRequest, "lora_name", "base:adapter"),
        (p.EndRequest, "lora_name", NAME + "\n"),
        (p.EndRequest, "attempt_token", "has space"),
        (p.EndRequest, "attempt_token", ""),
        (p.PreparedReceipt, "digest", DIGEST.upper()),
        (p.PreparedReceipt, "digest", DIGEST + "\n"),
        (p.ReclaimRequest, "timeout_s", -1),
        (p.DrainingReply, "in_flight", -1),
        (p.VersionStatus, "state", "WHATEVER"),
        (p.VersionKey, "epoch", "1-2"),
    ],
)
def test_field_validation(model: type[BaseModel], field: str, value: Any) -> None:
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_model(model, {**SAMPLES[model], field: value})


def test_begin_request_consistency(manifest: p.Manifest) -> None:
    good = begin_payload(manifest)
    req = p.parse_model(p.BeginRequest, json.dumps(good))
    assert req.manifest == manifest and p.parse_model(p.BeginRequest, req.model_dump_json()) == req
    with expect_error(ErrorCode.INVALID_REQUEST):  # name says another version_id
        p.parse_model(p.BeginRequest, {**good, "version_key": {"epoch": "1", "version_id": "8"}})
    with expect_error(ErrorCode.INVALID_REQUEST):  # name's digest prefix differs
        p.parse_model(p.BeginRequest, {**good, "lora_name": NAME})
    other = p.manifest_from_tensors({**BASE_CONFIG, "r": 8}, make_tensors())
    with expect_error(ErrorCode.MANIFEST_MISMATCH):  # digest is not the manifest's
        p.parse_model(p.BeginRequest, {**good, "manifest": other.model_dump(mode="json")})
    with expect_error(ErrorCode.MANIFEST_MISMATCH):  # plan misses a tensor
        p.parse_model(p.BeginRequest, {**good, "bucket_plan": good["bucket_plan"][:-1]})


def test_reply_unions() -> None:
    ready = p.parse_begin_reply(SAMPLES[p.ReadyReceipt] | {"state": "READY_LOCAL"})
    prepared = p.parse_begin_reply(json.dumps(SAMPLES[p.PreparedReceipt] | {"state": "PREPARED"}))
    assert isinstance(ready, p.ReadyReceipt) and isinstance(prepared, p.PreparedReceipt)
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.parse_begin_reply(SAMPLES[p.PreparedReceipt])  # no discriminator
    draining = p.parse_reclaim_reply(SAMPLES[p.DrainingReply] | {"state": "DRAINING"})
    unloaded = p.parse_reclaim_reply(SAMPLES[p.UnloadedReceipt] | {"state": "UNLOADED"})
    assert isinstance(draining, p.DrainingReply) and draining.in_flight == 2
    assert isinstance(unloaded, p.UnloadedReceipt)
    # one DRAINING reply for both removals: a cleanup names its attempt, a reclaim its reclaim id
    cleanup_draining = {
        **SAMPLES[p.DrainingReply],
        "state": "DRAINING",
        "reclaim_id": None,
        "attempt_token": "t1",
    }
    assert p.parse_cleanup_reply(cleanup_draining).attempt_token == "t1"
    cleaned = p.parse_cleanup_reply(SAMPLES[p.CleanupReceipt] | {"state": "CLEANED"})
    assert isinstance(cleaned, p.CleanupReceipt)
    for ids in ({"reclaim_id": None}, {"attempt_token": "t1"}):  # neither, or both
        with expect_error(ErrorCode.INVALID_REQUEST):
            p.parse_cleanup_reply({**SAMPLES[p.DrainingReply], "state": "DRAINING", **ids})


def test_bucket_headers_round_trip() -> None:
    meta = p.parse_model(p.ReceiveBucketMeta, SAMPLES[p.ReceiveBucketMeta])
    headers = meta.to_headers()
    assert headers["X-Bucket-Index"] == "0" and headers["Content-Type"] == "application/octet-stream"
    assert p.ReceiveBucketMeta.from_headers({k.lower(): v for k, v in headers.items()}) == meta
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.ReceiveBucketMeta.from_headers({k: v for k, v in headers.items() if k != "X-Bucket-Sha256"})
    with expect_error(ErrorCode.INVALID_REQUEST):
        p.ReceiveBucketMeta.from_headers({**headers, "X-Bucket-Index": "-1"})


def test_errors_carry_details_and_survive_json() -> None:
    with pytest.raises(LoraVersionError) as info:
        p.parse_model(p.EndRequest, b"{not json")
    body = info.value.to_body()
    assert body["error"]["code"] == "INVALID_REQUEST" and body["error"]["errors"]
    assert json.loads(json.dumps(body)) == body


# ------------------------------------------------------------------ import hygiene


def test_protocol_import_is_light() -> None:
    code = (
        "import sys, lora_contract.protocol, lora_contract.errors; "
        "heavy = [m for m in ('torch', 'safetensors', 'sglang', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
