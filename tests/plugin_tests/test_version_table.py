"""The engine's version table, pure: every refusal leaves the table exactly as it was."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import EngineVersionState as S
from lora_contract.protocol import ReceiveBucketMeta
from relax_glue.snapshot import Snapshot
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.version_table import (
    BucketDecision,
    CleanupDecision,
    EndDecision,
    StagingLimits,
    VersionTable,
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
    assert [s for s in ("PREPARED", "LOADING", "READY_LOCAL", "RECLAIMING") if S(s).holds_slot] == [
        "PREPARED",
        "LOADING",
        "READY_LOCAL",
        "RECLAIMING",
    ]
    assert not S("CLEANED").holds_slot and not S("UNLOADED").holds_slot


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
    assert not may_unload_now(v, 0, resolvable=False), "a READY version is never unloadable"
    assert table.start_reclaim(ready.lora_name, "r1") is ReclaimDecision.START
    assert gate(table, ready.lora_name).code is ErrorCode.VERSION_RECLAIMED
    for in_flight in (1, -1, None):
        assert not may_unload_now(v, in_flight, resolvable=False)
    assert not may_unload_now(v, 0, resolvable=True), "not while its name still resolves"
    assert may_unload_now(v, 0, resolvable=False)
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


# ------------------------------------------------------------------- the rules, row by row
# Every state a version can be in, each reached through the table's own transitions (never set
# by hand), so a row's answer is the answer the engine would give.

STATES = (
    "ABSENT",
    "PREPARED",
    "LOADING",
    "LOADING_CLEANING",  # the load ran, its probe failed, the removal started (abandon_load)
    "READY_LOCAL",
    "READY_LOCAL_CLEANING",  # a cleanup unregistered it and is still draining (mark_cleaning)
    "FAILED",
    "RECLAIMING",
    "UNLOADED",
    "CLEANED",
)


def table_in(label: str, seed: int = 40, earlier: str | None = None) -> tuple[VersionTable, object]:
    """A fresh table whose one version (its begin request returned) is in ``label``; RECLAIMING
    and UNLOADED are under reclaim id ``r1``, a leftover of FAILED is ``id-left``. ``earlier``:
    an attempt token that staged the same version first and was cleaned up."""
    t = VersionTable("inc-1", LIMITS)
    s = snap(seed)
    req = begin_req(s, str(seed))
    if earlier is not None:
        first = req.model_copy(update={"attempt_token": earlier})
        t.begin(first)
        t.finish_cleanup(first.lora_name, first.attempt_token)
    if label == "ABSENT":
        return t, req
    t.begin(req)
    name, token = req.lora_name, req.attempt_token
    if label == "CLEANED":
        t.finish_cleanup(name, token)
        return t, req
    if label != "PREPARED":
        for m in metas(req, s):
            t.accept_bucket(m)
        t.start_load(name, token)
    if label == "LOADING_CLEANING":
        t.abandon_load(name, token, "id-probed", registered=True)
    elif label == "FAILED":
        t.fail_load(name, token, leftover_lora_id="id-left")
    elif label in ("READY_LOCAL", "READY_LOCAL_CLEANING", "RECLAIMING", "UNLOADED"):
        t.finish_load(name, token, lora_id="id-ready")
        if label == "READY_LOCAL_CLEANING":
            t.mark_cleaning(name, token)
        if label in ("RECLAIMING", "UNLOADED"):
            t.start_reclaim(name, "r1")
        if label == "UNLOADED":
            t.finish_reclaim(name, "r1")
    expected = label.removesuffix("_CLEANING")
    assert t.get(name).state == expected and t.get(name).cleaning == label.endswith("_CLEANING")
    return t, req


def snapshot_of(t: VersionTable):
    return copy.deepcopy((t.versions, t.cleaned, t.attempt_owner))


# start_reclaim(name, "r1") and (name, "r2") in every state: a decision, or the refusal's code.
# Only a READY_LOCAL version not being cleaned up starts; a name this incarnation does not hold
# (never loaded, or only a CLEANED tombstone) is NOT_LOADED, authoritatively.
_RECLAIM_ROWS = {
    "ABSENT": ("NOT_LOADED", "NOT_LOADED"),
    "CLEANED": ("NOT_LOADED", "NOT_LOADED"),
    "PREPARED": (ErrorCode.VERSION_NOT_READY, ErrorCode.VERSION_NOT_READY),
    "LOADING": (ErrorCode.VERSION_NOT_READY, ErrorCode.VERSION_NOT_READY),
    "LOADING_CLEANING": (ErrorCode.VERSION_NOT_READY, ErrorCode.VERSION_NOT_READY),
    "READY_LOCAL": ("START", "START"),
    "READY_LOCAL_CLEANING": (ErrorCode.VERSION_NOT_READY, ErrorCode.VERSION_NOT_READY),
    "FAILED": (ErrorCode.VERSION_NOT_READY, ErrorCode.VERSION_NOT_READY),
    "RECLAIMING": ("RESUME", ErrorCode.STALE_ATTEMPT),  # under r1: another id is refused
    "UNLOADED": ("DONE", ErrorCode.STALE_ATTEMPT),
}


@pytest.mark.parametrize("label", STATES)
@pytest.mark.parametrize("reclaim_id", ["r1", "r2"])
def test_start_reclaim_has_one_answer_for_every_state(label, reclaim_id):
    from sglang_ext.version_table import ReclaimDecision

    assert set(_RECLAIM_ROWS) == set(STATES)
    t, req = table_in(label)
    want = _RECLAIM_ROWS[label][reclaim_id == "r2"]
    if isinstance(want, ErrorCode):
        refused_without_trace(t, lambda: t.start_reclaim(req.lora_name, reclaim_id), want)
        return
    before = snapshot_of(t)
    assert t.start_reclaim(req.lora_name, reclaim_id) is ReclaimDecision(want.lower())
    if want == "START":
        v = t.get(req.lora_name)
        assert v.state == "RECLAIMING" and v.reclaim_id == reclaim_id
        assert t.request_gate(req.lora_name, v.lora_id).code is ErrorCode.VERSION_RECLAIMED
    else:
        assert snapshot_of(t) == before  # a replay or an authoritative "not here" changes nothing


# plan_cleanup(name, token) under the version's own token in every state. A committed version
# is reclaimed, never cleaned: RECLAIMING / UNLOADED refuse even the owner.
_CLEANUP_OWN = {
    "ABSENT": CleanupDecision.NOTHING,  # never seen: only the token is tombstoned
    "PREPARED": CleanupDecision.DROP_STASH,
    "LOADING": CleanupDecision.WAIT_FOR_LOAD,
    "LOADING_CLEANING": CleanupDecision.WAIT_FOR_LOAD,
    "READY_LOCAL": CleanupDecision.UNLOAD,
    "READY_LOCAL_CLEANING": CleanupDecision.UNLOAD,  # a retried cleanup after DRAINING goes on
    "FAILED": CleanupDecision.UNLOAD,  # its pinned leftover is removed
    "RECLAIMING": ErrorCode.VERSION_RECLAIMED,
    "UNLOADED": ErrorCode.VERSION_RECLAIMED,
    "CLEANED": CleanupDecision.NOTHING,
}


@pytest.mark.parametrize("label", STATES)
def test_plan_cleanup_by_the_owner_has_one_answer_for_every_state_and_changes_nothing(label):
    assert set(_CLEANUP_OWN) == set(STATES)
    t, req = table_in(label)
    want = _CLEANUP_OWN[label]
    if isinstance(want, ErrorCode):
        refused_without_trace(t, lambda: t.plan_cleanup(req.lora_name, req.attempt_token), want)
        return
    before = snapshot_of(t)
    assert t.plan_cleanup(req.lora_name, req.attempt_token) is want
    assert snapshot_of(t) == before  # a plan, never a change


@pytest.mark.parametrize("label", STATES)
def test_a_cleanup_of_an_already_cleaned_token_answers_nothing_whoever_holds_the_name_now(label):
    """A token cleaned up earlier (a replayed cleanup, e.g. its reply was lost) is answered from
    its tombstone: NOTHING to plan and the stored receipt, never NOT_ATTEMPT_OWNER because a
    newer attempt holds the name now, never a change to that newer attempt."""
    old = "e" * 32
    t, req = table_in(label, earlier=old)
    receipt = t.cleaned[old]
    assert label == "ABSENT" or t.get(req.lora_name).attempt_token == req.attempt_token
    before = snapshot_of(t)
    assert t.plan_cleanup(req.lora_name, old) is CleanupDecision.NOTHING
    assert t.finish_cleanup(req.lora_name, old) == receipt
    assert snapshot_of(t) == before


# fail_load acts only on a LOADING version of its own attempt; every other call (a late or
# duplicated failure report) changes nothing.
@pytest.mark.parametrize("label", STATES)
@pytest.mark.parametrize("leftover", [None, "id-left-2"])
def test_fail_load_changes_only_a_loading_version_of_its_own_attempt(label, leftover):
    t, req = table_in(label)
    before = snapshot_of(t)
    t.fail_load(req.lora_name, "f" * 32, leftover_lora_id=leftover)  # another attempt: never
    assert snapshot_of(t) == before
    t.fail_load(req.lora_name, req.attempt_token, leftover_lora_id=leftover)
    if not label.startswith("LOADING"):
        assert snapshot_of(t) == before, label
        return
    v = t.get(req.lora_name)
    assert not v.cleaning
    if leftover is None:  # nothing stays loaded: end may be retried
        assert v.state == "PREPARED" and t.plan_end(req.lora_name, req.attempt_token) is EndDecision.LOAD
    else:  # still pinned in SGLang: FAILED, holding its slot, remembered by its id
        assert v.state == "FAILED" and v.lora_id == leftover and S(v.state).holds_slot


def test_check_bucket_answers_every_index_at_every_point_of_the_reception(table):
    """For k buckets received of n, bucket i: i < k is a DUPLICATE (its own sha256) or
    CHECKSUM_MISMATCH (another one); i == k < n is the one to ACCEPT; any other i, including
    i == n and beyond the plan once every bucket is in, is BUCKET_OUT_OF_ORDER. Every refusal
    leaves the table as it was."""
    s = snap(41)
    req = begin_req(s, "41")
    table.begin(req)
    ms = metas(req, s)
    n = len(ms)
    assert n >= 2

    def meta(i: int, sha: str | None = None) -> ReceiveBucketMeta:
        real = ms[i].sha256 if i < n else "1" * 64
        return ReceiveBucketMeta(
            lora_name=req.lora_name, attempt_token=req.attempt_token, index=i, sha256=sha or real
        )

    for k in range(n + 1):
        for i in range(n + 2):
            if i < k:
                assert table.check_bucket(meta(i)) is BucketDecision.DUPLICATE, (k, i)
                refused_without_trace(
                    table, lambda i=i: table.check_bucket(meta(i, "0" * 64)), ErrorCode.CHECKSUM_MISMATCH
                )
            elif i == k < n:
                assert table.check_bucket(meta(i)) is BucketDecision.ACCEPT, (k, i)
            else:
                refused_without_trace(
                    table, lambda i=i: table.check_bucket(meta(i)), ErrorCode.BUCKET_OUT_OF_ORDER
                )
        if k < n:
            table.accept_bucket(ms[k])
    assert table.plan_end(req.lora_name, req.attempt_token) is EndDecision.LOAD


def _limits(max_version_bytes: int, max_bucket_bytes: int) -> StagingLimits:
    return StagingLimits(
        managed_capacity=2,
        lora=LIMITS.lora,
        max_version_bytes=max_version_bytes,
        max_bucket_bytes=max_bucket_bytes,
    )


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_the_version_size_limit_admits_exactly_its_own_size(delta):
    """``max_version_bytes`` is the largest version accepted: one byte over is PAYLOAD_TOO_LARGE
    (nothing reserved), exactly the limit and below are accepted."""
    req = begin_req(snap(42), "42")
    total = req.manifest.total_bytes
    t = VersionTable("inc-1", _limits(total + delta, 10**8))
    if delta < 0:
        refused_without_trace(t, lambda: t.begin(req), ErrorCode.PAYLOAD_TOO_LARGE)
        assert t.slots_in_use() == 0
    else:
        assert t.begin(req).state == "PREPARED"


def _first_bucket_smaller() -> Snapshot:
    """A version whose biggest bucket is not its first: k_proj (out 8) sorts before q_proj (16)."""
    g = torch.Generator().manual_seed(47)
    tensors = {}
    for i in range(3):
        for module, out in (("k_proj", 8), ("q_proj", 16), ("v_proj", 8)):
            stem = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(4, 16, generator=g)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, 4, generator=g)
    config = {**CONFIG, "target_modules": ["k_proj", "q_proj", "v_proj"]}
    return Snapshot.from_tensors(config, tensors, max_bucket_bytes=600)


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_the_bucket_size_limit_admits_exactly_its_own_size(delta):
    """``max_bucket_bytes`` bounds the largest planned bucket the same way: over it is refused at
    begin, before any byte moves; exactly the limit is accepted."""
    req = begin_req(_first_bucket_smaller(), "43")
    sizes = [spec.total_bytes for spec in req.bucket_plan]
    biggest = max(sizes)
    assert sizes[0] < biggest  # the biggest bucket decides, not the first
    t = VersionTable("inc-1", _limits(10**9, biggest + delta))
    if delta < 0:
        refused_without_trace(t, lambda: t.begin(req), ErrorCode.PAYLOAD_TOO_LARGE)
        assert t.slots_in_use() == 0
    else:
        assert t.begin(req).state == "PREPARED"


# begin in every state, by the version's own attempt and by a fresh one: the receipt's state or
# the refusal's code. A replay never changes the table (a retried begin while the version loads
# must not restart it); only ABSENT and a CLEANED record take a new attempt.
_BEGIN_ROWS = {
    "ABSENT": ("PREPARED", "PREPARED"),
    "PREPARED": ("PREPARED", ErrorCode.PUBLICATION_IN_PROGRESS),
    "LOADING": ("PREPARED", ErrorCode.PUBLICATION_IN_PROGRESS),
    "READY_LOCAL": ("READY_LOCAL", ErrorCode.NOT_ATTEMPT_OWNER),
    "FAILED": (ErrorCode.LOAD_FAILED, ErrorCode.LOAD_FAILED),
    "RECLAIMING": (ErrorCode.VERSION_RECLAIMED, ErrorCode.VERSION_RECLAIMED),
    "UNLOADED": (ErrorCode.VERSION_RECLAIMED, ErrorCode.VERSION_RECLAIMED),
    "CLEANED": (ErrorCode.STALE_ATTEMPT, "PREPARED"),  # its own token is tombstoned for good
}


@pytest.mark.parametrize("label", list(_BEGIN_ROWS))
@pytest.mark.parametrize("whose", ["own", "fresh"])
def test_begin_has_one_answer_for_every_state_and_a_replay_changes_nothing(label, whose):
    t, req = table_in(label)
    if whose == "fresh":
        req = req.model_copy(update={"attempt_token": "d" * 32})
    want = _BEGIN_ROWS[label][whose == "fresh"]
    if isinstance(want, ErrorCode):
        refused_without_trace(t, lambda: t.begin(req), want)
        return
    before = snapshot_of(t)
    receipt = t.begin(req)
    assert receipt.state == want and receipt.attempt_token == req.attempt_token
    v = t.get(req.lora_name)
    if label in ("ABSENT", "CLEANED"):  # a new attempt: PREPARED, holding a slot, bound to its token
        assert v.state == "PREPARED" and v.next_bucket == 0
        assert t.attempt_owner[req.attempt_token] == req.lora_name
    else:
        assert snapshot_of(t) == before


# plan_end in every state, by the version's own attempt (PREPARED as table_in leaves it: no
# bucket yet). It decides and never changes anything; only a complete PREPARED loads.
_END_ROWS = {
    "ABSENT": ErrorCode.STALE_ATTEMPT,  # no attempt is staging it
    "PREPARED": ErrorCode.MANIFEST_MISMATCH,
    "LOADING": EndDecision.JOIN,
    "READY_LOCAL": EndDecision.READY,
    "FAILED": ErrorCode.LOAD_FAILED,
    "RECLAIMING": ErrorCode.STALE_ATTEMPT,  # committed, every bucket once received: never again LOAD
    "UNLOADED": ErrorCode.STALE_ATTEMPT,
    "CLEANED": ErrorCode.STALE_ATTEMPT,
}


@pytest.mark.parametrize("label", list(_END_ROWS))
def test_plan_end_has_one_answer_for_every_state_and_changes_nothing(label):
    t, req = table_in(label)
    want = _END_ROWS[label]
    if isinstance(want, ErrorCode):
        refused_without_trace(t, lambda: t.plan_end(req.lora_name, req.attempt_token), want)
        if label in ("RECLAIMING", "UNLOADED"):
            with pytest.raises(LoraVersionError):
                t.start_load(req.lora_name, req.attempt_token)
            assert t.get(req.lora_name).state == label
        return
    before = snapshot_of(t)
    assert t.plan_end(req.lora_name, req.attempt_token) is want
    assert snapshot_of(t) == before


@pytest.mark.parametrize("label", ["ABSENT", "PREPARED", "READY_LOCAL_CLEANING", "FAILED", "CLEANED"])
def test_a_finished_cleanup_leaves_a_tombstone_that_holds_nothing(label):
    """Whatever it removed, the attempt's record is CLEANED and holds nothing: no engine-local
    id (its status shows none, it is not pinned), no staging, no slot; its token is tombstoned
    and bound to the name."""
    t, req = table_in(label)
    receipt = t.finish_cleanup(req.lora_name, req.attempt_token)
    assert receipt.lora_name == req.lora_name and receipt.attempt_token == req.attempt_token
    assert t.cleaned[req.attempt_token] == receipt and t.attempt_owner[req.attempt_token] == req.lora_name
    assert t.slots_in_use() == 0
    v = t.get(req.lora_name)
    if label == "ABSENT":
        assert v is None  # never seen: only the token is tombstoned
        return
    assert v.state == "CLEANED" and v.lora_id is None and not v.cleaning
    assert v.manifest is None and v.plan == ()
    status = t.status_of(v, None)
    assert status.lora_id is None and not status.pinned


@pytest.mark.parametrize("label", STATES)
def test_a_name_keeps_its_digest_in_every_state_for_the_engines_lifetime(label):
    """Same name, another digest: VERSION_CONFLICT whatever the name's record says, a CLEANED
    tombstone and an UNLOADED version too (the engine fixes a name's digest for its lifetime);
    only a name it never saw takes it."""
    t, req = table_in(label)
    other = begin_req(snap(44), "44").model_copy(update={"lora_name": req.lora_name})
    assert other.digest != req.digest
    if label == "ABSENT":
        assert t.begin(other).state == "PREPARED"
    else:
        refused_without_trace(t, lambda: t.begin(other), ErrorCode.VERSION_CONFLICT)


@pytest.mark.parametrize(
    ("engine_base", "req_base", "accepted"),
    [
        (None, None, True),
        ("a" * 64, None, True),  # a begin that names no base is not checked against one
        ("a" * 64, "a" * 64, True),
        ("a" * 64, "b" * 64, False),
        (None, "a" * 64, False),  # an engine without a fingerprint never takes an epoch's base
    ],
)
def test_begin_checks_the_base_it_names_against_the_engines_own(engine_base, req_base, accepted):
    t = VersionTable("inc-1", LIMITS, base_fingerprint=engine_base)
    req = begin_req(snap(45), "45").model_copy(update={"base_fingerprint": req_base})
    if accepted:
        assert t.begin(req).state == "PREPARED"
    else:
        refused_without_trace(t, lambda: t.begin(req), ErrorCode.BASE_MISMATCH)


# The gate in every state, with the id SGLang's registry holds for the name: the id the table
# loaded, another one, or none. Only READY_LOCAL under exactly its own id is served; the
# plugin's own probe passes a LOADING version (its id is not recorded until the load finished).
_GATE = {
    "ABSENT": ErrorCode.UNKNOWN_VERSION,
    "PREPARED": ErrorCode.VERSION_NOT_READY,
    "LOADING": ErrorCode.VERSION_NOT_READY,
    "LOADING_CLEANING": ErrorCode.UNKNOWN_VERSION,
    "READY_LOCAL": None,
    "READY_LOCAL_CLEANING": ErrorCode.UNKNOWN_VERSION,
    "FAILED": ErrorCode.UNKNOWN_VERSION,
    "RECLAIMING": ErrorCode.VERSION_RECLAIMED,
    "UNLOADED": ErrorCode.VERSION_RECLAIMED,
    "CLEANED": ErrorCode.UNKNOWN_VERSION,
}


@pytest.mark.parametrize("label", STATES)
@pytest.mark.parametrize("registered", ["own", "other", "none"])
def test_the_request_gate_has_one_answer_for_every_state_and_registered_id(label, registered):
    assert set(_GATE) == set(STATES)
    t, req = table_in(label)
    v = t.get(req.lora_name)
    own = v.lora_id if v is not None else None
    rid = {"own": own, "other": "id-other", "none": None}[registered]
    want = _GATE[label]
    if want is None and rid != own:
        want = ErrorCode.VERSION_RECLAIMED  # registered under another id (or not at all): never served
    before = snapshot_of(t)
    got = t.request_gate(req.lora_name, rid)
    assert (got.code if got else None) is want, (label, registered)
    if label in ("PREPARED", "LOADING", "READY_LOCAL"):
        probe = t.request_gate(req.lora_name, rid, probing=True)
        assert (probe is None) == (label == "LOADING" or (label == "READY_LOCAL" and rid == own))
    assert t.request_gate("a-plain-adapter", rid) is None  # not managed: stock SGLang decides
    assert snapshot_of(t) == before


@pytest.mark.parametrize("label", [s for s in STATES if s != "ABSENT"])
@pytest.mark.parametrize("in_flight", [None, -2, -1, 0, 1, 2])
@pytest.mark.parametrize("resolvable", [False, True])
def test_may_unload_now_only_once_removal_started_unresolvable_and_exactly_zero_in_flight(
    label, in_flight, resolvable
):
    """Every version here was registered (a probe's, a READY one's) or holds no id: an unknown
    count (None: no counter) is never a yes for them."""
    from sglang_ext.version_table import may_unload_now

    t, req = table_in(label)
    v = t.get(req.lora_name)
    removal_started = label in ("RECLAIMING",) or label.endswith("_CLEANING")
    want = removal_started and in_flight == 0 and not resolvable
    assert may_unload_now(v, in_flight, resolvable=resolvable) == want


@pytest.mark.parametrize("in_flight", [None, -2, -1, 0, 1, 2])
@pytest.mark.parametrize("resolvable", [False, True])
def test_a_partial_load_never_registered_has_no_count_and_is_unloadable_once_abandoned(in_flight, resolvable):
    """SGLang refused a load after some rank loaded it: the id was never registered, so no request
    could ever resolve to it and it has no counter (None). Only that, for a version whose removal
    started, is a yes without a count; a count it somehow has is read as any other."""
    from sglang_ext.version_table import may_unload_now

    t, req = table_in("LOADING")
    v = t.get(req.lora_name)
    assert not may_unload_now(v, None, resolvable=False), "not before its removal started"
    t.abandon_load(req.lora_name, req.attempt_token, "id-partial", registered=False)
    want = not resolvable and in_flight in (None, 0)
    assert may_unload_now(v, in_flight, resolvable=resolvable) == want
    t.fail_load(req.lora_name, req.attempt_token, leftover_lora_id="id-partial")  # its removal failed
    t.mark_cleaning(req.lora_name, req.attempt_token)  # a cleanup of the FAILED leftover
    assert may_unload_now(v, in_flight, resolvable=resolvable) == want


@pytest.mark.parametrize("in_flight", [None, -2, -1, 0, 1, 2])
@pytest.mark.parametrize("resolvable", [False, True])
def test_a_name_the_table_does_not_manage_follows_stock_rules(in_flight, resolvable):
    from sglang_ext.version_table import may_unload_now

    assert may_unload_now(None, in_flight, resolvable=resolvable) is True


@pytest.mark.parametrize("in_flight", [None, -5, -1, 0, 1, 7])
def test_only_a_count_below_zero_is_an_in_flight_anomaly(in_flight):
    from sglang_ext.version_table import in_flight_anomaly

    err = in_flight_anomaly("relax_policy_lora@e1-1-abcdefabcdef", in_flight)
    if in_flight is not None and in_flight < 0:
        assert err.code is ErrorCode.IN_FLIGHT_ANOMALY and err.details["in_flight"] == in_flight
    else:
        assert err is None


_SLOT = {"PREPARED", "LOADING", "READY_LOCAL", "FAILED", "RECLAIMING"}
_PINNED = {"READY_LOCAL", "FAILED", "RECLAIMING"}  # loaded in SGLang


@pytest.mark.parametrize("label", [s for s in STATES if s != "ABSENT"])
def test_slots_and_pins_follow_the_state_alone(label):
    """A version holds a slot from begin until it is unloaded or cleaned (a PREPARED one pins at
    end); it is pinned in SGLang while loaded. Both answers come from the state alone."""
    t, req = table_in(label)
    v = t.get(req.lora_name)
    state = label.removesuffix("_CLEANING")
    assert S(v.state).holds_slot == (state in _SLOT)
    assert t.slots_in_use() == (1 if state in _SLOT else 0)
    assert t.status_of(v, 0).pinned == (state in _PINNED)


def test_holds_slot_answers_every_engine_state():
    assert {s.value for s in S if S(s).holds_slot} == _SLOT


@pytest.mark.parametrize("label", ["PREPARED", "PREPARED_COMPLETE", "READY_LOCAL", "FAILED"])
def test_after_its_cleanup_every_late_call_of_the_attempt_is_stale(label):
    """Once an attempt is tombstoned, its late calls are STALE_ATTEMPT and change nothing, also
    a bucket that was accepted before the cleanup (never acknowledged again as a duplicate) and
    an end of an attempt whose every bucket had arrived."""
    t = VersionTable("inc-1", LIMITS)
    s = snap(46)
    req = begin_req(s, "46")
    t.begin(req)
    ms = metas(req, s)
    name, token = req.lora_name, req.attempt_token
    if label != "PREPARED":
        for m in ms:
            t.accept_bucket(m)
    if label in ("READY_LOCAL", "FAILED"):
        t.start_load(name, token)
        if label == "FAILED":
            t.fail_load(name, token, leftover_lora_id="id-left")
        else:
            t.finish_load(name, token, lora_id="id-46")
        t.mark_cleaning(name, token)
    t.finish_cleanup(name, token)
    late = [lambda: t.begin(req), lambda: t.plan_end(name, token), lambda: t.start_load(name, token)]
    late += [lambda m=m: t.check_bucket(m) for m in ms]
    late += [lambda m=m: t.bucket_spec(m) for m in ms]
    for call in late:
        refused_without_trace(t, call, ErrorCode.STALE_ATTEMPT)


# The steps the shell reports back, each allowed only in the state its decision left (the
# precondition is on the state; a removal in progress does not change it: a retried cleanup
# marks cleaning again); in every other state the call is refused (a LoraVersionError, or an
# AssertionError for a shell that skipped the decision) and the table stays as it was.
_STEP_ALLOWED = {
    "start_load": {"PREPARED_COMPLETE"},  # only after plan_end said LOAD
    "finish_load": {"LOADING"},
    "abandon_load": {"LOADING", "LOADING_CLEANING"},
    "mark_cleaning": {"READY_LOCAL", "READY_LOCAL_CLEANING", "FAILED"},
    "finish_reclaim": {"RECLAIMING"},
}


_STEP_LEAVES = {  # state after the step (None: unchanged), and the cleaning flag
    "start_load": ("LOADING", False),
    "finish_load": ("READY_LOCAL", False),
    "abandon_load": ("LOADING", True),
    "mark_cleaning": (None, True),
    "finish_reclaim": ("UNLOADED", False),
}


def _step(t: VersionTable, req, step: str) -> None:
    name, token = req.lora_name, req.attempt_token
    {
        "start_load": lambda: t.start_load(name, token),
        "finish_load": lambda: t.finish_load(name, token, "id-new"),
        "abandon_load": lambda: t.abandon_load(name, token, "id-probed", registered=True),
        "mark_cleaning": lambda: t.mark_cleaning(name, token),
        "finish_reclaim": lambda: t.finish_reclaim(name, "r1"),
    }[step]()


def _table_for_step(label: str):
    if label != "PREPARED_COMPLETE":
        return table_in(label)
    t, req = table_in("PREPARED")
    s = snap(40)
    for m in metas(req, s):
        t.accept_bucket(m)
    return t, req


_STEP_ROWS = [
    (step, label)
    for step in _STEP_ALLOWED
    for label in [s for s in STATES if s != "ABSENT"] + ["PREPARED_COMPLETE"]
    # a load whose probe failed is never reported finished (fail_load follows abandon_load)
    if not (step == "finish_load" and label == "LOADING_CLEANING")
]


@pytest.mark.parametrize(("step", "label"), _STEP_ROWS)
def test_each_reported_step_is_taken_only_in_its_own_state(step, label):
    t, req = _table_for_step(label)
    allowed = label in _STEP_ALLOWED[step]
    before = snapshot_of(t)
    if allowed:
        _step(t, req, step)
        state, cleaning = _STEP_LEAVES[step]
        v = t.get(req.lora_name)
        assert (v.state.value, v.cleaning) == (state or before[0][req.lora_name].state.value, cleaning)
        return
    with pytest.raises((AssertionError, LoraVersionError, KeyError)):
        _step(t, req, step)
    assert snapshot_of(t) == before, (step, label)


def test_an_adapter_sglang_cannot_serve_is_refused_as_such_even_when_it_is_also_too_large():
    """The refusals of begin come in one order: what the engine can serve first (a rank the
    engine cannot hold is INCOMPATIBLE_ADAPTER whatever its size), then the size limits."""
    req = begin_req(snap(48, rank=16), "48")
    tiny = VersionTable("inc-1", _limits(1, 1))
    refused_without_trace(tiny, lambda: tiny.begin(req), ErrorCode.INCOMPATIBLE_ADAPTER)
    fits = begin_req(snap(48), "48")
    refused_without_trace(tiny, lambda: tiny.begin(fits), ErrorCode.PAYLOAD_TOO_LARGE)


@pytest.mark.parametrize("label", [s for s in STATES if s != "ABSENT"])
@pytest.mark.parametrize("in_flight", [None, -1, 0, 3])
def test_a_status_line_reports_the_record_as_it_is_and_the_native_count_raw(label, in_flight):
    """What the status shows is the record itself: state, attempt, reclaim id, engine-local id,
    bucket progress, this incarnation; the native in-flight count is shown raw (below zero is
    an anomaly to see, never clamped to zero)."""
    t, req = table_in(label)
    v = t.get(req.lora_name)
    st = t.status_of(v, in_flight)
    assert (st.lora_name, st.state, st.digest, st.attempt_token) == (
        v.lora_name,
        v.state,
        v.digest,
        v.attempt_token,
    )
    assert (st.reclaim_id, st.lora_id, st.incarnation) == (v.reclaim_id, v.lora_id, "inc-1")
    assert (st.buckets_received, st.buckets_total) == (v.next_bucket, v.buckets_total)
    assert st.in_flight == in_flight


def test_begin_with_another_base_is_refused_before_anything_changes() -> None:
    """The engine's own check: the epoch's fingerprint in begin, another base here."""
    table = VersionTable("inc", LIMITS, base_fingerprint="a" * 64)
    other = begin_req(snap(1)).model_copy(update={"base_fingerprint": "b" * 64})
    refused_without_trace(table, lambda: table.begin(other), ErrorCode.BASE_MISMATCH)
    same = begin_req(snap(2)).model_copy(update={"base_fingerprint": "a" * 64})
    assert table.begin(same).state == "PREPARED"
    unchecked = begin_req(snap(3), "3")  # no expectation (a hand-built body): not compared
    assert table.begin(unchecked).state == "PREPARED"


# ------------------------------------------------------------------ the one transition table


def _table_edges() -> set[tuple[S, S]]:
    from sglang_ext.version_table import _TRANSITIONS

    return {(start, to) for start, targets in _TRANSITIONS.items() for to in targets}


def test_the_transition_table_covers_every_state_and_only_the_tombstones_have_no_way_out():
    """Every engine state has its row; a version can move exactly while it holds its slot, so
    UNLOADED and CLEANED (reclaimed, cleaned up) never return, as the registry's terminal states."""
    from sglang_ext.version_table import _TRANSITIONS

    assert set(_TRANSITIONS) == set(S)
    for state, targets in _TRANSITIONS.items():
        assert targets <= set(S) and state not in targets, state
        assert bool(targets) == state.holds_slot, state


@pytest.mark.parametrize(("start", "to"), [(a, b) for a in S for b in S])
def test_a_state_change_outside_the_table_is_refused_and_changes_nothing(start, to):
    from sglang_ext.version_table import _move

    t, req = table_in("PREPARED")
    v = t.get(req.lora_name)
    v.state = start  # the precondition, set directly: the move under test is the only change
    if (start, to) in _table_edges():
        _move(v, to)
        assert v.state is to
        return
    before = copy.deepcopy(v)
    with pytest.raises(AssertionError, match=f"illegal transition {start.value} -> {to.value}"):
        _move(v, to)
    assert v == before


def test_the_public_methods_make_exactly_the_tables_state_changes(monkeypatch):
    """Every path through the table's public methods (begin to reclaim, a load that fails either
    way, each cleanup) moves a version only along the table, and every row of the table is taken
    by one of them: a row nothing takes is a dead case, one they need and lack is refused."""
    import sglang_ext.version_table as version_table

    made: set[tuple[S, S]] = set()
    move = version_table._move

    def recorded(v, to):
        made.add((v.state, to))
        move(v, to)

    monkeypatch.setattr(version_table, "_move", recorded)
    for label in STATES:
        table_in(label)  # begin, start_load, finish_load, fail_load (FAILED), reclaim, cleanup
    t, req = table_in("LOADING")
    t.fail_load(req.lora_name, req.attempt_token)  # nothing left loaded: PREPARED again
    assert t.get(req.lora_name).state is S.PREPARED
    for label in ("READY_LOCAL", "FAILED"):  # a candidate's cleanup, after its removal
        t, req = table_in(label)
        t.mark_cleaning(req.lora_name, req.attempt_token)
        t.finish_cleanup(req.lora_name, req.attempt_token)
    assert made == _table_edges()


@pytest.mark.parametrize(
    "label", ["LOADING", "LOADING_CLEANING", "READY_LOCAL", "FAILED", "RECLAIMING", "UNLOADED"]
)
def test_a_late_bucket_after_the_end_is_a_duplicate_or_out_of_the_plan_and_changes_nothing(label):
    """Every state an end left has all its buckets: a late bucket is answered from ``bucket_sha``
    (DUPLICATE) or is past the plan (BUCKET_OUT_OF_ORDER); none is ever accepted again."""
    t, req = table_in(label)
    v = t.get(req.lora_name)
    n = v.buckets_total
    for i in range(n + 2):
        sha = v.bucket_sha.get(i, "1" * 64)
        meta = ReceiveBucketMeta(
            lora_name=req.lora_name, attempt_token=req.attempt_token, index=i, sha256=sha
        )
        if i < n:
            before = snapshot_of(t)
            assert t.check_bucket(meta) is BucketDecision.DUPLICATE, i
            assert snapshot_of(t) == before
        else:
            refused_without_trace(t, lambda meta=meta: t.check_bucket(meta), ErrorCode.BUCKET_OUT_OF_ORDER)
