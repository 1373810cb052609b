"""One base model per epoch, on real engines (issue 24, item 3): EB runs a base of exactly the
cohort's shape, config and tokenizer, other weights only. Every adapter fits it, so before this
check it passed ``begin`` and served the adapter on the wrong weights."""

from __future__ import annotations

import pytest
from _e2e_helpers import aclose_all, make_clients, new_epoch, purge, snapshot_of

from lora_contract.errors import ErrorCode
from lora_versions_dev.farm import ADMIN_KEY
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome
from relax_glue.registry import LoRAVersionRegistry

pytestmark = pytest.mark.engine


async def test_engines_of_one_model_agree_and_another_base_of_the_same_shape_is_told_apart(
    engines, other_base_engine
) -> None:
    clients = make_clients([*engines, other_base_engine], ADMIN_KEY, ("E0", "E1", "EB"))
    try:
        e0, e1, eb = [(await clients[e].status()).base for e in ("E0", "E1", "EB")]
        assert e0 is not None and e0 == e1  # two engines of one model: one fingerprint
        assert eb is not None and eb.fingerprint != e0.fingerprint
        assert (eb.config, eb.tokenizer, eb.serving) == (e0.config, e0.tokenizer, e0.serving)
        assert eb.weights != e0.weights
    finally:
        await aclose_all(clients.values())


async def test_a_cohort_of_two_bases_is_refused_before_anything_is_sent(
    engines, other_base_engine, fixtures
) -> None:
    epoch = new_epoch()
    clients = make_clients([engines[0], other_base_engine], ADMIN_KEY, ("E0", "EB"))
    registry = LoRAVersionRegistry(epoch=epoch, engines=("E0", "EB"))
    try:
        result = await open_publisher(registry, clients).publish(snapshot_of(fixtures.adapter_dir("A")), "A")
        assert result.outcome is PublishOutcome.REFUSED, result
        assert result.error.code is ErrorCode.BASE_MISMATCH and result.error.details["differ"] == {
            "EB": ["weights"]
        }
        assert registry.status().versions == () and registry.status().base_fingerprint is None
        for c in clients.values():  # not a single begin reached either engine
            assert not [v for v in (await c.status()).versions if f"@{epoch}-" in v.lora_name]
    finally:
        left = await purge(clients, f"@{epoch}-")
        await aclose_all(clients.values())
        assert not any(left.values()), left


async def test_an_engine_of_another_base_refuses_the_begin_of_the_epochs_base(
    engines, other_base_engine, fixtures
) -> None:
    """The epoch's base is already recorded (E0's); EB joins the cohort: its own begin check
    refuses (BASE_MISMATCH, a clean refusal), so no bucket moves there; the attempt is cleaned."""
    epoch = new_epoch()
    clients = make_clients([engines[0], other_base_engine], ADMIN_KEY, ("E0", "EB"))
    registry = LoRAVersionRegistry(epoch=epoch, engines=("E0", "EB"))
    try:
        fingerprint = (await clients["E0"].status()).base.fingerprint
        registry.record_base(fingerprint, publisher_token=registry.publisher_token)
        result = await open_publisher(registry, clients).publish(snapshot_of(fixtures.adapter_dir("A")), "A")
        assert result.outcome is PublishOutcome.FAILED_CLEAN, result
        assert result.error is not None and result.error.code is ErrorCode.BASE_MISMATCH
        begins = [s for s in result.steps if s.op == "begin" and s.engine_id == "EB"]
        assert begins and begins[0].code is ErrorCode.BASE_MISMATCH
        assert not [s for s in result.steps if s.op == "receive_bucket" and s.engine_id == "EB"]
        eb_versions = [v for v in (await clients["EB"].status()).versions if f"@{epoch}-" in v.lora_name]
        assert eb_versions == []
        assert registry.status().default is None and registry.status().slots_used == 0
    finally:
        left = await purge(clients, f"@{epoch}-")
        await aclose_all(clients.values())
        assert not any(left.values()), left
