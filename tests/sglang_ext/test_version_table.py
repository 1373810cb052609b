"""The engine's version table, pure: every refusal leaves the table exactly as it was."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch

from relax_glue.snapshot import Snapshot
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.protocol import EngineVersionState as S
from sglang_ext.protocol import ReceiveBucketMeta
from sglang_ext.version_table import (
    BucketDecision,
    CleanupDecision,
    EndDecision,
    StagingLimits,
    VersionTable,
    holds_engine_slot,
)

GEOMETRY = ModelGeometry(
    "Qwen3ForCausalLM", num_layers=3, hidden_size=16, intermediate_size=32, q_size=16, kv_size=8
)
LIMITS = StagingLimits(
    managed_capacity=2,
    lora=EngineLoraShape(GEOMETRY, max_lora_rank=8, served_modules=None),
    max_version_bytes=10**9,
    max_bucket_bytes=10**8,
)
CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def snap(seed: int, rank: int = 4) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(3):
        for module, out in (("q_proj", 16), ("v_proj", 8)):
            stem = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, 16, generator=g)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    return Snapshot.from_tensors({**CONFIG, "r": rank}, tensors, max_bucket_bytes=600)


def begin_req(s: Snapshot, version_id: str = "1", attempt: str | None = None):
    return s.begin_request("relax_policy_lora", "e1", version_id, attempt or uuid.uuid4().hex)


def metas(req, s: Snapshot):
    return [
        ReceiveBucketMeta(
            lora_name=req.lora_name, attempt_token=req.attempt_token, index=b.spec.index, sha256=b.sha256
        )
        for b in s.iter_buckets()
    ]


def staged_ready(table: VersionTable, s: Snapshot, version_id: str = "1"):
    req = begin_req(s, version_id)
    table.begin(req)
    for m in metas(req, s):
        assert table.check_bucket(m) is BucketDecision.ACCEPT
        table.accept_bucket(m)
    assert table.plan_end(req.lora_name, req.attempt_token) is EndDecision.LOAD
    table.start_load(req.lora_name, req.attempt_token)
    table.finish_load(req.lora_name, req.attempt_token, lora_id=f"id-{version_id}")
    return req


def refused_without_trace(table: VersionTable, call, code: ErrorCode) -> None:
    before = copy.deepcopy((table.versions, table.cleaned, table.attempt_owner))
    with pytest.raises(LoraVersionError) as info:
        call()
    assert info.value.code is code
    assert (table.versions, table.cleaned, table.attempt_owner) == before


@pytest.fixture
def table() -> VersionTable:
    return VersionTable("inc-1", LIMITS)


def test_begin_replays_and_ready_name_returns_ready_receipt(table):
    s = snap(1)
    req = begin_req(s)
    first = table.begin(req)
    assert table.begin(req) == first and first.state == "PREPARED"
    ready_req = staged_ready(VersionTable("inc-1", LIMITS), s)
    t2 = VersionTable("inc-1", LIMITS)
    staged = staged_ready(t2, s)
    receipt = t2.begin(staged)
    assert receipt.state == "READY_LOCAL" and receipt.attempt_token == staged.attempt_token
    assert ready_req.lora_name == staged.lora_name


def test_buckets_in_order_duplicates_and_refusals(table):
    s = snap(2)
    req = begin_req(s)
    table.begin(req)
    ms = metas(req, s)
    assert len(ms) >= 2
    refused_without_trace(table, lambda: table.check_bucket(ms[1]), ErrorCode.BUCKET_OUT_OF_ORDER)
    table.accept_bucket(ms[0])
    assert table.check_bucket(ms[0]) is BucketDecision.DUPLICATE
    other = ms[0].model_copy(update={"sha256": "0" * 64})
    refused_without_trace(table, lambda: table.check_bucket(other), ErrorCode.CHECKSUM_MISMATCH)
    refused_without_trace(
        table, lambda: table.plan_end(req.lora_name, req.attempt_token), ErrorCode.MANIFEST_MISMATCH
    )
    stale = ms[0].model_copy(update={"attempt_token": "f" * 32})
    refused_without_trace(table, lambda: table.check_bucket(stale), ErrorCode.STALE_ATTEMPT)


def test_capacity_is_one_predicate_and_refuses_before_any_change(table):
    staged_ready(table, snap(1), "1")
    table.begin(begin_req(snap(2), "2"))  # PREPARED holds a slot too
    assert table.slots_in_use() == 2
    refused_without_trace(table, lambda: table.begin(begin_req(snap(3), "3")), ErrorCode.CAPACITY_ERROR)
    assert [s for s in ("PREPARED", "LOADING", "READY_LOCAL", "RECLAIMING") if holds_engine_slot(s)] == [
        "PREPARED",
        "LOADING",
        "READY_LOCAL",
        "RECLAIMING",
    ]
    assert not holds_engine_slot("CLEANED") and not holds_engine_slot("UNLOADED")


def test_incompatible_rank_and_same_name_other_digest(table):
    refused_without_trace(
        table, lambda: table.begin(begin_req(snap(1, rank=16))), ErrorCode.INCOMPATIBLE_ADAPTER
    )
    a = begin_req(snap(1), "7")
    table.begin(a)
    b = begin_req(snap(2), "7")
    forged = b.model_copy(update={"lora_name": a.lora_name})  # skip the request's own validation
    refused_without_trace(table, lambda: table.begin(forged), ErrorCode.VERSION_CONFLICT)


def test_cleanup_tombstones_and_late_calls_are_stale(table):
    s = snap(4)
    req = begin_req(s)
    table.begin(req)
    assert table.plan_cleanup(req.lora_name, req.attempt_token) is CleanupDecision.DROP_STASH
    receipt = table.finish_cleanup(req.lora_name, req.attempt_token)
    assert table.finish_cleanup(req.lora_name, req.attempt_token) == receipt
    assert table.plan_cleanup(req.lora_name, req.attempt_token) is CleanupDecision.NOTHING
    for call in (
        lambda: table.begin(req),
        lambda: table.check_bucket(metas(req, s)[0]),
        lambda: table.plan_end(req.lora_name, req.attempt_token),
    ):
        refused_without_trace(table, call, ErrorCode.STALE_ATTEMPT)
    # a new attempt for the same name may start again
    assert table.begin(begin_req(s, "1")).state == "PREPARED"


def test_cleanup_of_a_never_seen_attempt_blocks_its_late_begin(table):
    req = begin_req(snap(5))
    table.finish_cleanup(req.lora_name, req.attempt_token)
    refused_without_trace(table, lambda: table.begin(req), ErrorCode.STALE_ATTEMPT)
    assert req.lora_name not in table.versions


def gate(table: VersionTable, name: str, **kw):
    """The gate as the engine asks it: with the id SGLang's registry holds for the name."""
    v = table.get(name)
    return table.request_gate(name, v.lora_id if v else None, **kw)


def test_request_gate_never_falls_back(table):
    assert gate(table, "my-plain-adapter") is None
    missing = "relax_policy_lora@e1-9-abcdefabcdef"
    assert gate(table, missing).code is ErrorCode.UNKNOWN_VERSION
    s = snap(6)
    req = begin_req(s)
    table.begin(req)
    assert gate(table, req.lora_name).code is ErrorCode.VERSION_NOT_READY
    ready = staged_ready(table, snap(7), "2")
    assert gate(table, ready.lora_name) is None
    # registered under another id than the one loaded (or not at all): never served
    assert table.request_gate(ready.lora_name, "other-id").code is ErrorCode.VERSION_RECLAIMED
    assert table.request_gate(ready.lora_name, None).code is ErrorCode.VERSION_RECLAIMED
    table.mark_cleaning(ready.lora_name, ready.attempt_token)
    assert gate(table, ready.lora_name).code is ErrorCode.UNKNOWN_VERSION
    table.finish_cleanup(ready.lora_name, ready.attempt_token)
    assert gate(table, ready.lora_name).code is ErrorCode.UNKNOWN_VERSION


def test_only_the_plugins_own_probe_passes_the_gate_while_loading(table):
    s = snap(19)
    req = begin_req(s)
    table.begin(req)
    for m in metas(req, s):
        table.accept_bucket(m)
    table.start_load(req.lora_name, req.attempt_token)
    assert table.request_gate(req.lora_name, "id-new").code is ErrorCode.VERSION_NOT_READY
    assert table.request_gate(req.lora_name, "id-new", probing=True) is None


def test_failed_load_returns_to_prepared_and_can_be_retried(table):
    s = snap(8)
    req = begin_req(s)
    table.begin(req)
    for m in metas(req, s):
        table.accept_bucket(m)
    before = copy.deepcopy(table.versions)
    assert table.plan_end(req.lora_name, req.attempt_token) is EndDecision.LOAD
    assert table.versions == before  # the plan changes nothing: the shell checks files first
    table.start_load(req.lora_name, req.attempt_token)
    assert table.plan_end(req.lora_name, req.attempt_token) is EndDecision.JOIN
    assert table.plan_cleanup(req.lora_name, req.attempt_token) is CleanupDecision.WAIT_FOR_LOAD
    table.fail_load(req.lora_name, req.attempt_token)
    assert table.plan_end(req.lora_name, req.attempt_token) is EndDecision.LOAD
    table.start_load(req.lora_name, req.attempt_token)
    table.finish_load(req.lora_name, req.attempt_token, "id-x")
    assert table.plan_end(req.lora_name, req.attempt_token) is EndDecision.READY
    assert table.plan_cleanup(req.lora_name, req.attempt_token) is CleanupDecision.UNLOAD


def test_reclaim_transitions_are_idempotent_by_reclaim_id(table):
    from sglang_ext.version_table import ReclaimDecision, may_unload_now

    ready = staged_ready(table, snap(9), "3")
    v = table.get(ready.lora_name)
    assert not may_unload_now(v, 0), "a READY version is never unloadable"
    assert table.start_reclaim(ready.lora_name, "r1") is ReclaimDecision.START
    assert gate(table, ready.lora_name).code is ErrorCode.VERSION_RECLAIMED
    assert not may_unload_now(v, 1) and not may_unload_now(v, -1) and not may_unload_now(v, None)
    assert may_unload_now(v, 0)
    assert table.start_reclaim(ready.lora_name, "r1") is ReclaimDecision.RESUME
    refused_without_trace(table, lambda: table.start_reclaim(ready.lora_name, "r2"), ErrorCode.STALE_ATTEMPT)
    table.finish_reclaim(ready.lora_name, "r1")
    assert table.start_reclaim(ready.lora_name, "r1") is ReclaimDecision.DONE
    refused_without_trace(table, lambda: table.begin(ready), ErrorCode.VERSION_RECLAIMED)
    assert table.slots_in_use() == 0


def test_reclaim_of_a_name_this_incarnation_never_loaded_is_unloaded(table):
    from sglang_ext.version_table import ReclaimDecision

    assert table.start_reclaim("relax_policy_lora@e1-5-abcdefabcdef", "r1") is ReclaimDecision.NOT_LOADED
    assert table.versions == {}
    staging = begin_req(snap(10), "4")
    table.begin(staging)
    refused_without_trace(
        table, lambda: table.start_reclaim(staging.lora_name, "r1"), ErrorCode.VERSION_NOT_READY
    )


def test_an_attempt_token_feeds_exactly_one_version(table):
    """Issue 15 (1): begin X and Y with one token, X's buckets, Y's buckets, end X served Y's
    weights. The token is bound to X at X's begin; every call for Y with it is refused."""
    x, y = snap(11), snap(12)
    req_x = begin_req(x, "11", attempt="T" * 32)
    req_y = begin_req(y, "12", attempt="T" * 32)
    table.begin(req_x)
    refused_without_trace(table, lambda: table.begin(req_y), ErrorCode.ATTEMPT_MISMATCH)
    foreign = metas(req_x, x)[0].model_copy(update={"lora_name": req_y.lora_name})
    refused_without_trace(table, lambda: table.check_bucket(foreign), ErrorCode.ATTEMPT_MISMATCH)
    refused_without_trace(
        table, lambda: table.plan_end(req_y.lora_name, req_x.attempt_token), ErrorCode.ATTEMPT_MISMATCH
    )


def test_cleanup_naming_another_version_is_refused_and_the_real_cleanup_frees_the_slot(table):
    """Issue 15 (3): a cleanup naming another version than its token's tombstoned the token under
    the wrong name and left the candidate PREPARED, holding its slot, with a false CLEANED."""
    v, other = begin_req(snap(13), "13"), begin_req(snap(14), "14")
    table.begin(v)
    refused_without_trace(
        table, lambda: table.plan_cleanup(other.lora_name, v.attempt_token), ErrorCode.ATTEMPT_MISMATCH
    )
    refused_without_trace(
        table, lambda: table.finish_cleanup(other.lora_name, v.attempt_token), ErrorCode.ATTEMPT_MISMATCH
    )
    assert table.plan_cleanup(v.lora_name, v.attempt_token) is CleanupDecision.DROP_STASH
    receipt = table.finish_cleanup(v.lora_name, v.attempt_token)
    assert receipt.lora_name == v.lora_name
    assert table.get(v.lora_name).state == "CLEANED" and table.slots_in_use() == 0


def test_a_token_first_seen_in_a_cleanup_is_bound_to_that_name(table):
    req = begin_req(snap(15), "15")
    table.finish_cleanup(req.lora_name, req.attempt_token)  # cleanup before begin
    other = begin_req(snap(16), "16", attempt=req.attempt_token)
    refused_without_trace(table, lambda: table.begin(other), ErrorCode.ATTEMPT_MISMATCH)


def test_a_ready_version_is_never_taken_over_by_another_attempt(table):
    """Ownership of a READY version does not move by begin: another token is refused and binds
    nothing, and its cleanup (e.g. after the refusal's reply was lost) is refused too: it never
    unloads what the owner made READY. The owner's own calls keep working."""
    ready = staged_ready(table, snap(17), "17")
    other = ready.model_copy(update={"attempt_token": "a" * 32})
    refused_without_trace(table, lambda: table.begin(other), ErrorCode.NOT_ATTEMPT_OWNER)
    refused_without_trace(
        table, lambda: table.plan_cleanup(ready.lora_name, "a" * 32), ErrorCode.NOT_ATTEMPT_OWNER
    )
    refused_without_trace(
        table, lambda: table.finish_cleanup(ready.lora_name, "a" * 32), ErrorCode.NOT_ATTEMPT_OWNER
    )
    v = table.get(ready.lora_name)
    assert v.state == "READY_LOCAL" and v.attempt_token == ready.attempt_token
    assert table.begin(ready).state == "READY_LOCAL"  # the owner's replay
    # the refused token was never bound: it may still start an attempt of another version
    table.begin(begin_req(snap(18), "18", attempt="a" * 32))
    assert table.plan_cleanup(ready.lora_name, ready.attempt_token) is CleanupDecision.UNLOAD


@pytest.mark.parametrize("state", ["PREPARED", "LOADING", "FAILED", "RECLAIMING", "UNLOADED"])
def test_a_cleanup_under_a_token_that_does_not_own_the_version_is_refused(table, state):
    """Every state in which an attempt holds the name: a foreign token's cleanup changes nothing
    (a CLEANED record or an absent name holds nothing: there the token is only tombstoned)."""
    req = begin_req(snap(19), "19")
    table.begin(req)
    v = table.get(req.lora_name)
    v.state = getattr(S, state)
    refused_without_trace(
        table, lambda: table.plan_cleanup(req.lora_name, "b" * 32), ErrorCode.NOT_ATTEMPT_OWNER
    )


def test_a_foreign_cleanup_of_a_cleaned_or_absent_name_only_tombstones_its_token(table):
    req = begin_req(snap(20), "20")
    table.begin(req)
    table.finish_cleanup(req.lora_name, req.attempt_token)
    assert table.plan_cleanup(req.lora_name, "c" * 32) is CleanupDecision.NOTHING
    table.finish_cleanup(req.lora_name, "c" * 32)
    assert "c" * 32 in table.cleaned and table.get(req.lora_name).attempt_token == req.attempt_token
    assert table.plan_cleanup("relax_policy_lora@e1-nope-" + "0" * 12, "d" * 32) is CleanupDecision.NOTHING
