"""Every key of a PEFT adapter config, classified once (``lora_contract/identity.py``): a key that can
change what the adapter computes and is not served exactly is refused with INCOMPATIBLE_ADAPTER
naming it, on the trainer side (snapshot) and at an engine's ``begin``; only keys proven to be
bookkeeping are dropped. PEFT is the oracle: real PEFT models on a tiny Qwen3 base show that the
refused configs compute another function than the engine would serve (base + each adapter tensor
applied to the base layer its name gives)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from _fake_native import FakeNative, fake_staging
from fastapi import FastAPI
from safetensors.torch import save_file

from lora_contract import protocol as p
from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.identity import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE
from relax_glue.snapshot import Snapshot
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.engine_state import EngineState, assemble_engine
from sglang_ext.http_routes import install
from sglang_ext.version_table import StagingLimits, VersionTable

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.tensor([[1, 5, 7, 9, 3, 2, 11]])
MINIMAL = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS}


def tiny_base(layers: int = 4) -> Any:
    """A deterministic 4-layer Qwen3 with weights large enough that adapters move the logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval()


def lora_config(**kw: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **kw})


def peft_model(**kw: Any) -> Any:
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about the inits it offers
        return get_peft_model(tiny_base(), lora_config(**kw)).eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def served_function(tensors: dict[str, torch.Tensor], r: int = 4, alpha: float = 8) -> torch.Tensor:
    """What the engine computes from these tensors: the ORIGINAL base, each lora_A/lora_B applied
    to the base layer its name gives, scaled by alpha / r (PEFT's plain LoRA as the oracle)."""
    from peft import get_peft_model, set_peft_model_state_dict

    model = get_peft_model(tiny_base(), lora_config(r=r, lora_alpha=alpha, init_lora_weights=False)).eval()
    result = set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys, result.unexpected_keys
    return logits(model)


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def assert_incompatible(call: Callable[[], Any], key: str) -> LoraVersionError:
    with pytest.raises(LoraVersionError) as info:
        call()
    err = info.value
    assert err.code is ErrorCode.INCOMPATIBLE_ADAPTER and err.http_status == 422, err
    assert repr(key) in err.message, err.message
    return err


def assert_refused_on_the_trainer_side(model: Any, tmp_path: Path, key: str) -> None:
    """Snapshot of the live PEFT model and of the directory PEFT saves: both refused."""
    assert_incompatible(lambda: Snapshot.from_peft_model(model), key)
    model.save_pretrained(str(tmp_path / "saved"))
    assert_incompatible(lambda: Snapshot.from_peft_dir(tmp_path / "saved"), key)


# ------------------------------------------------------------------------ layer_replication


def test_layer_replication_computes_another_function_than_layers_by_index_and_is_refused(tmp_path):
    """PEFT stacks base layers 0,1,1,2 and gives each copy its own adapter (saved as layers.0..3);
    the engine would apply layers.N to base layer N of the unchanged 4-layer base."""
    model = peft_model(layer_replication=[[0, 2], [1, 3]], init_lora_weights=False)
    stack = [layer.self_attn.q_proj.base_layer.weight for layer in model.base_model.model.model.layers]
    base = [layer.self_attn.q_proj.weight for layer in tiny_base().model.layers]
    # PEFT's stack really is base layers 0,1,1,2 (copies 1 and 2 share base layer 1's weights)
    assert [next(i for i, w in enumerate(base) if torch.equal(w, s)) for s in stack] == [0, 1, 1, 2]
    tensors = adapter_tensors(model)
    assert {k.split(".layers.")[1].split(".")[0] for k in tensors} == {"0", "1", "2", "3"}
    assert not torch.allclose(logits(model), served_function(tensors), atol=1e-3)
    assert_refused_on_the_trainer_side(model, tmp_path, "layer_replication")


# --------------------------------------------------------------- initialisations of the base


def _corda_model() -> Any:
    from peft import get_peft_model
    from peft.tuners.lora.config import CordaConfig
    from peft.tuners.lora.corda import preprocess_corda

    base = tiny_base()
    config = lora_config(init_lora_weights="corda", corda_config=CordaConfig(corda_method="ipm"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preprocess_corda(base, config, run_model=lambda: base(IDS, use_cache=False))
        return get_peft_model(base, config).eval()


def _lora_ga_model() -> Any:
    from peft import get_peft_model
    from peft.tuners.lora.config import LoraGAConfig
    from peft.tuners.lora.loraga import preprocess_loraga

    base = tiny_base()
    config = lora_config(init_lora_weights="lora_ga", lora_ga_config=LoraGAConfig())

    def train_step() -> None:
        with torch.enable_grad():
            base(IDS, labels=IDS, use_cache=False).loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preprocess_loraga(base, config, train_step)
        return get_peft_model(base, config).eval()


BASE_MUTATING: dict[str, Callable[[], Any]] = {
    "pissa": lambda: peft_model(init_lora_weights="pissa"),
    "pissa_niter_4": lambda: peft_model(init_lora_weights="pissa_niter_4"),
    "olora": lambda: peft_model(init_lora_weights="olora"),
    "corda": _corda_model,
    "lora_ga": _lora_ga_model,
}


def base_weights(model: Any) -> dict[str, torch.Tensor]:
    """The base model's own weights inside a PEFT model, under the base model's names."""
    out = {}
    for name, param in model.base_model.model.named_parameters():
        if "lora_" not in name:
            out[name.replace(".base_layer.", ".")] = param.detach()
    return out


@pytest.mark.parametrize("init", sorted(BASE_MUTATING))
def test_an_init_that_rewrites_the_base_weights_is_refused(init, tmp_path):
    """PiSSA, OLoRA, CorDA and LoRA-GA subtract the initial scale * B @ A from the base weights
    (LoraLayer.pissa_init & co.): the trainer computes W_res + BA, the engine would serve W + BA."""
    model = BASE_MUTATING[init]()
    original = tiny_base().state_dict()
    changed = [n for n, w in base_weights(model).items() if not torch.equal(w, original[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed, changed
    assert not torch.allclose(logits(model), served_function(adapter_tensors(model)), atol=1e-3)
    assert_refused_on_the_trainer_side(model, tmp_path, "init_lora_weights")


def test_a_loftq_config_saved_by_peft_is_refused(tmp_path):
    """LoftQ replaces each base weight by its quantised residual (LoraLayer.loftq_init). PEFT
    cannot build it here (its loftq_init needs bitsandbytes, which has no CPU build installed),
    so the config is the one PEFT's own LoraConfig writes, over the tensors of a plain adapter."""
    from peft import LoftQConfig

    config = lora_config(init_lora_weights="loftq", loftq_config=LoftQConfig(loftq_bits=4))
    tensors = adapter_tensors(peft_model(init_lora_weights=False))
    config.save_pretrained(str(tmp_path))
    save_file(tensors, str(tmp_path / PEFT_WEIGHTS_FILE))
    saved = json.loads((tmp_path / PEFT_CONFIG_FILE).read_text())
    assert saved["init_lora_weights"] == "loftq" and saved["loftq_config"]["loftq_bits"] == 4
    assert_incompatible(lambda: Snapshot.from_peft_dir(tmp_path), "init_lora_weights")


NEUTRAL_INITS: list[Any] = [True, False, "gaussian", "orthogonal", "mica", "eva"]


@pytest.mark.parametrize("init", NEUTRAL_INITS, ids=str)
def test_an_init_that_leaves_the_base_alone_is_admitted_with_the_digest_of_plain_lora(init):
    """eva is built without its data pass (initialize_lora_eva_weights only sets lora_A and the
    rank/alpha patterns, both part of what is served and checked)."""
    model = peft_model(init_lora_weights=init)
    original = tiny_base().state_dict()
    assert all(torch.equal(w, original[n]) for n, w in base_weights(model).items())
    tensors = adapter_tensors(model)
    # the adapter applied by index on the original base is exactly PEFT's function
    assert torch.allclose(logits(model), served_function(tensors), atol=1e-6)
    snap = Snapshot.from_peft_model(model)
    assert snap.digest == Snapshot.from_tensors(MINIMAL, tensors).digest


def test_pissa_converted_by_peft_for_the_original_base_is_admitted_and_serves_its_function(tmp_path):
    """PEFT's own way to serve a PiSSA adapter on the unmodified base: save_pretrained with
    path_initial_model_for_weight_conversion writes a rank-2r plain LoRA (init_lora_weights=True)."""
    model = peft_model(init_lora_weights="pissa")
    model.save_pretrained(str(tmp_path / "initial"))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # stands for training: the factors move away from their init
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    trained = logits(model)
    model.save_pretrained(
        str(tmp_path / "converted"), path_initial_model_for_weight_conversion=str(tmp_path / "initial")
    )
    snap = Snapshot.from_peft_dir(tmp_path / "converted")
    assert snap.config["r"] == 8
    served = served_function(dict(snap.tensors), r=8, alpha=snap.config["lora_alpha"])
    assert torch.allclose(trained, served, atol=1e-4)


# -------------------------------------------------------------------------- the one table


def _minimal_adapter() -> dict[str, torch.Tensor]:
    return adapter_tensors(peft_model(init_lora_weights=False))


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    return _minimal_adapter()


@pytest.mark.parametrize("key, value", [("use_future_lora_trick", True), ("future_field", None)])
def test_a_key_peft_does_not_have_is_refused_naming_it(plain, tmp_path, key, value):
    """A field a later PEFT adds is not classified yet: refused, never dropped in silence."""
    assert_incompatible(lambda: p.manifest_from_tensors({**MINIMAL, key: value}, plain), key)
    (tmp_path / PEFT_CONFIG_FILE).write_text(json.dumps({**MINIMAL, key: value}))
    save_file(plain, str(tmp_path / PEFT_WEIGHTS_FILE))
    assert_incompatible(lambda: Snapshot.from_peft_dir(tmp_path), key)


# One example per bookkeeping field, other than PEFT's default: each must leave the digest alone.
BOOKKEEPING_EXAMPLES: dict[str, Any] = {
    "task_type": "CAUSAL_LM",
    "auto_mapping": {"base_model_class": "Qwen3ForCausalLM", "parent_library": "transformers"},
    "peft_version": "0.21.2",
    "base_model_name_or_path": "/models/Qwen3-0.6B",
    "revision": "main",
    "inference_mode": True,
    "lora_dropout": 0.1,
    "megatron_core": "megatron.core",
    "qalora_group_size": 32,
    "loftq_config": {"loftq_bits": 4, "loftq_iter": 1},
    "eva_config": {"rho": 2.0, "tau": 0.99},
    "corda_config": {"corda_method": "kpm"},
    "lora_ga_config": {"direction": "ArB2r", "scale": "stable", "stable_gamma": 16},
    "velora_config": {"num_groups": 4},
    "monteclora_config": {"num_samples": 8},
    "runtime_config": {"ephemeral_gpu_offload": True},
}


@pytest.mark.parametrize("key", sorted(BOOKKEEPING_EXAMPLES))
def test_every_bookkeeping_key_leaves_the_digest_unchanged(plain, key):
    from lora_contract.identity import BOOKKEEPING_CONFIG_FIELDS

    assert key in BOOKKEEPING_CONFIG_FIELDS
    digest = p.manifest_digest(p.manifest_from_tensors(MINIMAL, plain))
    config = {**MINIMAL, key: BOOKKEEPING_EXAMPLES[key]}
    assert p.manifest_digest(p.manifest_from_tensors(config, plain)) == digest


# One value per refused-unless-neutral field that PEFT acts on (see the table for what it does).
NOT_NEUTRAL: dict[str, list[Any]] = {
    "init_lora_weights": [
        "pissa",
        "pissa_niter_16",
        "olora",
        "OLoRA",
        "corda",
        "loftq",
        "lora_ga",
        "kaiming",
        1,
    ],
    "layer_replication": [[[0, 2], [1, 3]], [[0, 4]]],
    "lora_bias": [True],
    "use_qalora": [True],
    "trainable_token_indices": [[1, 2], {"embed_tokens": [1]}],
    "target_parameters": [["mlp.experts.gate_up_proj"]],
    "alora_invocation_tokens": [[5, 6]],
    "megatron_config": [{"tensor_model_parallel_size": 2}],
    "use_bdlora": [{"target_modules_bd_a": ["q_proj"], "nblocks": 2}],
    "arrow_config": [{"top_k": 2}],
    "kasa_config": [{"beta": 1e-4}],
    "ensure_weight_tying": [True],
}


@pytest.mark.parametrize("key, value", [(k, v) for k, vs in sorted(NOT_NEUTRAL.items()) for v in vs], ids=str)
def test_a_key_peft_acts_on_is_refused_unless_neutral(plain, key, value):
    assert_incompatible(lambda: p.manifest_from_tensors({**MINIMAL, key: value}, plain), key)


def _peft_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def test_the_neutral_values_are_pefts_defaults_and_are_dropped_from_the_digest(plain):
    """A config PEFT saves for a plain adapter names every field at its default: its identity is
    the one of the bare serving config, so existing adapters keep their digests."""
    from peft import LoraConfig

    from lora_contract.identity import NEUTRAL_ONLY_CONFIG_FIELDS

    defaults = {f.name: _peft_default(f) for f in dataclasses.fields(LoraConfig)}
    digest = p.manifest_digest(p.manifest_from_tensors(MINIMAL, plain))
    for key in NEUTRAL_ONLY_CONFIG_FIELDS:
        config = {**MINIMAL, key: defaults[key]}
        assert p.manifest_digest(p.manifest_from_tensors(config, plain)) == digest, key
    saved = {**lora_config().to_dict(), **MINIMAL}  # what save_pretrained writes, sets as lists
    assert set(saved) >= set(NEUTRAL_ONLY_CONFIG_FIELDS)
    assert p.manifest_digest(p.manifest_from_tensors(saved, plain)) == digest


def test_the_table_classifies_every_field_of_the_installed_lora_config():
    """A PEFT upgrade that adds a LoraConfig field fails here until the field is classified."""
    from peft import LoraConfig

    from lora_contract.identity import (
        BOOKKEEPING_CONFIG_FIELDS,
        NEUTRAL_ONLY_CONFIG_FIELDS,
        SERVING_CONFIG_FIELDS,
    )

    serving, bookkeeping = set(SERVING_CONFIG_FIELDS), set(BOOKKEEPING_CONFIG_FIELDS)
    neutral_only = set(NEUTRAL_ONLY_CONFIG_FIELDS)
    assert not (serving & bookkeeping or serving & neutral_only or bookkeeping & neutral_only)
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    assert fields == serving | bookkeeping | neutral_only, {
        "unclassified": sorted(fields - serving - bookkeeping - neutral_only),
        "not in LoraConfig": sorted((serving | bookkeeping | neutral_only) - fields),
    }
    assert set(BOOKKEEPING_EXAMPLES) == bookkeeping and set(NOT_NEUTRAL) == neutral_only
    assert all(reason.strip() for reason in BOOKKEEPING_CONFIG_FIELDS.values())


# --------------------------------------------------------------------- begin at an engine


def _engine_app() -> tuple[httpx.AsyncClient, VersionTable]:
    """The engine's real control plane (routes, publication, version table) over a fake native
    edge, for the tiny base's geometry."""
    geometry = ModelGeometry.from_hf_config(tiny_base().config)
    assert geometry is not None
    limits = StagingLimits(
        managed_capacity=2,
        lora=EngineLoraShape(geometry, max_lora_rank=8, served_modules=None),
        max_version_bytes=10**9,
        max_bucket_bytes=10**8,
    )
    state = EngineState(incarnation=f"inc-{uuid.uuid4().hex[:12]}")
    table = VersionTable(state.incarnation, limits)
    assemble_engine(state, table, FakeNative(), fake_staging())
    app = FastAPI()
    install(app, state)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
    return client, table


def hand_built_begin(snap: Snapshot, extra: dict[str, Any]) -> bytes:
    """A begin body from a sender that does not normalise its config: ``extra`` in the manifest's
    config, the digest and name computed over that manifest as this protocol defines them."""
    manifest = snap.manifest.model_dump(mode="json")
    manifest["config"] = {**manifest["config"], **extra}
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(canonical.encode("ascii")).hexdigest()
    return json.dumps(
        {
            "lora_name": p.make_lora_name("p", "e", "v1", digest),
            "version_key": {"epoch": "e", "version_id": "v1"},
            "digest": digest,
            "attempt_token": uuid.uuid4().hex,
            "manifest": manifest,
            "bucket_plan": [b.model_dump(mode="json") for b in snap.bucket_plan],
        }
    ).encode()


@pytest.mark.parametrize(
    "key, value",
    [
        ("layer_replication", [[0, 2], [1, 3]]),
        ("init_lora_weights", "pissa"),
        ("use_future_lora_trick", True),
    ],
)
async def test_a_hand_built_begin_with_a_refused_key_is_incompatible_at_the_engine(plain, key, value):
    client, table = _engine_app()
    snap = Snapshot.from_tensors(MINIMAL, plain)
    async with client:
        r = await client.post(p.Routes.BEGIN, content=hand_built_begin(snap, {key: value}))
        assert r.status_code == 422, r.text
        err = LoraVersionError.from_body(r.json())
        assert err is not None and err.code is ErrorCode.INCOMPATIBLE_ADAPTER, r.text
        assert repr(key) in err.message, err.message
        assert table.versions == {}  # nothing admitted, nothing changed
        # the same adapter, normalised as the trainer side sends it, is admitted
        ok = await client.post(p.Routes.BEGIN, content=hand_built_begin(snap, {}))
        assert ok.status_code == 200, ok.text


def test_the_one_table_is_what_the_manifest_validator_applies(plain):
    """The engine parses every manifest through the same normalisation as the trainer side."""
    snap = Snapshot.from_tensors(MINIMAL, plain)
    data = snap.manifest.model_dump(mode="json")
    for key, value in (("lora_bias", True), ("trainable_token_indices", [3])):
        bad = {**data, "config": {**data["config"], key: value}}
        assert_incompatible(lambda bad=bad: p.parse_model(p.Manifest, bad), key)
