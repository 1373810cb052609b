"""One base model per epoch (issue 24, item 3): the registry records the cohort's base at the
first publication; an engine that runs another base is refused before any bucket moves, by the
publisher (its status) and by the engine (the fingerprint in ``begin``), and never gets a
restore. The real-engine proof with two bases of one shape is in test_base_model_engines.py.

Engines are ``_fake_engine.FakeEngine`` (the plugin's real routes and version table behind the
REAL EngineClient); each reports the base it was given; the registry is the REAL one."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fake_engine import fake_base, make_cluster, make_snapshot
from _rg_helpers import EPOCH, new_registry, sk

from lora_contract import protocol
from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.cohort import open_publisher
from relax_glue.publisher import CommitEvidence, Publisher, PublishOutcome, commit_evidence
from relax_glue.reconciler import RestoreOutcome
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.registry_types import VersionKey, VersionState
from relax_glue.snapshot_store import SnapshotStore
from relax_glue.store import DurableRegistry

SNAP = {name: make_snapshot(seed=i) for i, name in enumerate("ABC")}


def publisher(reg, cluster, store: SnapshotStore | None = None) -> Publisher:
    return open_publisher(reg, cluster.clients, registry_retry_delay_s=0.0, store=store)


async def test_the_first_publication_records_the_cohorts_base_and_no_other_read_follows() -> None:
    reg, cluster = new_registry(), make_cluster()
    pub = publisher(reg, cluster)
    assert reg.status().base_fingerprint is None
    assert (await pub.publish(SNAP["A"], "A")).outcome is PublishOutcome.PUBLISHED
    assert reg.status().base_fingerprint == cluster.fakes["E0"].base.fingerprint
    reads = {e: f.ops().count("status") for e, f in cluster.fakes.items()}
    assert (await pub.publish(SNAP["B"], "B")).outcome is PublishOutcome.PUBLISHED
    # later publications read a status only before their commit (the base is the registry's)
    assert {e: f.ops().count("status") for e, f in cluster.fakes.items()} == {
        e: n + 1 for e, n in reads.items()
    }


async def test_a_cohort_of_two_bases_is_refused_before_anything_is_reserved_or_sent() -> None:
    reg, cluster = new_registry(), make_cluster(bases={"E1": "other"})
    seq = reg.seq
    result = await publisher(reg, cluster).publish(SNAP["A"], "A")
    assert result.outcome is PublishOutcome.REFUSED and result.error.code is ErrorCode.BASE_MISMATCH
    assert result.error.details["differ"] == {"E1": ["config", "tokenizer", "weights", "serving"]}
    assert reg.seq == seq + 2  # the two incarnations learnt from the reads; nothing else
    assert reg.version(VersionKey(EPOCH, "A")) is None and reg.status().base_fingerprint is None
    assert all(f.ops("begin") == [] for f in cluster.fakes.values())


async def test_an_engine_restarted_on_another_base_refuses_the_begin_and_gets_no_bucket() -> None:
    reg, cluster = new_registry(), make_cluster()
    pub = publisher(reg, cluster)
    assert (await pub.publish(SNAP["A"], "A")).outcome is PublishOutcome.PUBLISHED
    e1 = cluster.fakes["E1"]
    e1.base = fake_base("other")
    e1.restart()
    buckets = len(e1.ops("receive_bucket"))
    result = await pub.publish(SNAP["B"], "B")
    assert result.outcome is PublishOutcome.FAILED_CLEAN, result
    assert result.error is not None and result.error.code is ErrorCode.BASE_MISMATCH
    assert len(e1.ops("receive_bucket")) == buckets and e1.table.versions == {}  # refused at begin
    assert reg.status().default == VersionKey(EPOCH, "A")  # the old default stays


def test_commit_evidence_needs_the_epochs_base() -> None:
    from test_publisher import _engine_status

    from lora_contract.protocol import EngineVersionState

    name, token, digest = "p@e-v-aaaaaaaaaaaa", "tok", "a" * 64
    ready = {
        "lora_name": name,
        "attempt_token": token,
        "digest": digest,
        "state": EngineVersionState.READY_LOCAL,
    }
    ours, theirs = fake_base("ours"), fake_base("theirs")
    status = _engine_status("i1", ready).model_copy(update={"base": ours})
    assert commit_evidence(status, name, token, digest, ours.fingerprint) is CommitEvidence.READY
    assert commit_evidence(status, name, token, digest, theirs.fingerprint) is CommitEvidence.NOT_READY
    unknown_base = status.model_copy(update={"base": None})
    assert commit_evidence(unknown_base, name, token, digest, ours.fingerprint) is CommitEvidence.NOT_READY
    assert commit_evidence(status, name, token, digest) is CommitEvidence.READY  # no record yet


def test_the_registry_fixes_the_base_once_per_epoch(tmp_path: Path) -> None:
    reg = LoRAVersionRegistry(EPOCH, ("E0", "E1"))
    a, b = "a" * 64, "b" * 64
    assert reg.record_base(a, publisher_token=reg.publisher_token) == a
    seq = reg.seq
    assert (
        reg.record_base(a, publisher_token=reg.publisher_token) == a and reg.seq == seq
    )  # a replay changes nothing
    with pytest.raises(LoraVersionError) as info:
        reg.record_base(b, publisher_token=reg.publisher_token)
    assert info.value.code is ErrorCode.BASE_MISMATCH and reg.seq == seq
    with pytest.raises(LoraVersionError) as info:
        reg.record_base("not-a-digest", publisher_token=reg.publisher_token)
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert LoRAVersionRegistry.load(reg.dump()).status().base_fingerprint == a

    db = tmp_path / "r.db"
    durable = DurableRegistry.open(db, EPOCH, ("E0", "E1"))
    durable.record_base(a, publisher_token=durable.publisher_token)
    durable.close()
    reopened = DurableRegistry.open(db, EPOCH, ("E0", "E1"))  # journal replay
    assert reopened.status().base_fingerprint == a
    with pytest.raises(LoraVersionError, match="BASE_MISMATCH"):
        reopened.record_base(b, publisher_token=reopened.publisher_token)
    reopened.close()


async def test_a_restarted_engine_on_another_base_gets_no_restore(tmp_path: Path) -> None:
    reg, cluster = new_registry(), make_cluster()
    store = SnapshotStore(tmp_path / "snapshots")
    pub = publisher(reg, cluster, store)
    assert (await pub.publish(SNAP["A"], "A")).outcome is PublishOutcome.PUBLISHED
    reg.bind_first(sk("s"))
    e1 = cluster.fakes["E1"]
    e1.base = fake_base("other")
    e1.restart()
    begins = len(e1.ops("begin"))
    (result,) = await pub.reconcile(["E1"])
    assert result.outcome is RestoreOutcome.CONFLICT and "base" in result.detail
    assert len(e1.ops("begin")) == begins and e1.table.versions == {}
    assert reg.version(VersionKey(EPOCH, "A")).state is VersionState.PUBLISHED


def _status(base_label: str | None) -> protocol.EngineStatus:
    return protocol.EngineStatus(incarnation="i1", base=fake_base(base_label) if base_label else None)


_ALL_PARTS = ["config", "tokenizer", "weights", "serving"]


@pytest.mark.parametrize(
    ("bases", "differ"),
    [
        ({"E0": "ours", "E1": "ours"}, {}),
        ({"E0": "ours", "E1": "theirs"}, {"E1": _ALL_PARTS}),
        ({"E0": "ours", "E1": None}, {"E1": ["no fingerprint"]}),
        # the reference is the first engine that HAS a fingerprint, not the first engine
        ({"E0": None, "E1": "ours", "E2": "theirs"}, {"E0": ["no fingerprint"], "E2": _ALL_PARTS}),
        ({"E0": None, "E1": None}, {"E0": ["no fingerprint"], "E1": ["no fingerprint"]}),
        ({"E0": "ours", "E1": "theirs", "E2": "ours"}, {"E1": _ALL_PARTS}),
    ],
)
def test_base_mismatch_names_every_engine_that_differs_and_how(
    bases: dict[str, str | None], differ: dict[str, list[str]]
) -> None:
    """The refusal's details, engine by engine: an engine without a fingerprint (not a plugin
    engine, or one that could not fingerprint its base) is named as such, never skipped; an
    engine on another base is named with the parts that differ from the reference."""
    from relax_glue.publisher import base_mismatch

    statuses = {e: _status(label) for e, label in bases.items()}
    err = base_mismatch(statuses)
    assert err.code is ErrorCode.BASE_MISMATCH
    assert err.details["differ"] == differ
    assert err.details["fingerprints"] == {
        e: fake_base(label).fingerprint if label else None for e, label in bases.items()
    }


def test_base_mismatch_names_only_the_parts_that_differ() -> None:
    from relax_glue.publisher import base_mismatch

    ours = fake_base("ours")
    tokenizer_only = ours.model_copy(update={"tokenizer": fake_base("x").tokenizer, "fingerprint": "c" * 64})
    statuses = {
        "E0": protocol.EngineStatus(incarnation="i1", base=ours),
        "E1": protocol.EngineStatus(incarnation="i1", base=tokenizer_only),
    }
    assert base_mismatch(statuses).details["differ"] == {"E1": ["tokenizer"]}
