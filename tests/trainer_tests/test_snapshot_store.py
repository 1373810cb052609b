"""The on-disk, content-addressed snapshot store (restore after an engine or trainer restart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _fake_engine import make_snapshot
from _rg_helpers import Publisher as RegistryDriver
from _rg_helpers import new_registry, sk

from lora_contract.errors import ErrorCode, LoraVersionError
from relax_glue.snapshot_store import SnapshotStore, live_digests


def test_a_snapshot_reads_back_with_its_digest_tensors_and_bucket_plan(tmp_path: Path) -> None:
    snap = make_snapshot(seed=3, max_bucket_bytes=600)  # not the default plan: it must survive
    store = SnapshotStore(tmp_path)
    store.put(snap)
    back = store.get(snap.digest)
    assert back.digest == snap.digest
    assert back.bucket_plan == snap.bucket_plan and len(back.bucket_plan) > 1
    assert set(back.tensors) == set(snap.tensors)
    assert all(back.tensors[n].equal(t) for n, t in snap.tensors.items())
    assert [b.sha256 for b in back.iter_buckets()] == [b.sha256 for b in snap.iter_buckets()]
    assert store.digests() == {snap.digest} and snap.digest in store


def test_put_is_once_per_digest(tmp_path: Path) -> None:
    snap = make_snapshot(seed=1)
    store = SnapshotStore(tmp_path)
    first = store.put(snap)
    mtime = (first / "tensors.safetensors").stat().st_mtime_ns
    assert store.put(snap) == first
    assert (first / "tensors.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [snap.digest]  # no temp leftovers


def test_damaged_entries_are_refused_never_served(tmp_path: Path) -> None:
    snap = make_snapshot(seed=2)
    store = SnapshotStore(tmp_path)
    entry = store.put(snap)
    weights = entry / "tensors.safetensors"
    good = weights.read_bytes()
    # one flipped byte in the last tensor's data: loads fine, hashes differently
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0x01]))
    with pytest.raises(LoraVersionError) as e:
        store.get(snap.digest)
    assert e.value.code is ErrorCode.CHECKSUM_MISMATCH
    weights.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(LoraVersionError) as e:
        store.get(snap.digest)
    assert e.value.code is ErrorCode.CHECKSUM_MISMATCH
    weights.write_bytes(good)
    (entry / "bucket_plan.json").write_text(
        json.dumps([{"index": 0, "tensor_names": ["x"], "total_bytes": 1}])
    )
    with pytest.raises(LoraVersionError) as e:
        store.get(snap.digest)
    assert e.value.code is ErrorCode.CHECKSUM_MISMATCH


def test_missing_and_malformed_digests(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    with pytest.raises(LoraVersionError) as e:
        store.get("a" * 64)
    assert e.value.code is ErrorCode.UNKNOWN_VERSION
    for bad in ("../etc", "A" * 64, "a" * 63):
        with pytest.raises(LoraVersionError) as e:
            store.get(bad)
        assert e.value.code is ErrorCode.INVALID_REQUEST
        assert bad not in store


def test_retain_keeps_exactly_the_live_digests_and_drops_half_written_entries(tmp_path: Path) -> None:
    a, b = make_snapshot(seed=10), make_snapshot(seed=11)
    store = SnapshotStore(tmp_path)
    store.put(a)
    store.put(b)
    (tmp_path / ".tmp-crashed-writer").mkdir()
    assert store.retain({b.digest}) == (a.digest,)
    assert store.digests() == {b.digest}
    assert sorted(p.name for p in tmp_path.iterdir()) == [b.digest]


def test_live_digests_follow_the_one_slot_predicate() -> None:
    reg = new_registry()
    drv = RegistryDriver(reg)
    drv.publish("A")
    reg.bind_first(sk("s1"))  # A keeps a session ref after B is published
    drv.publish("B")

    def digests(*vids: str) -> set[str]:
        return {v.digest for v in reg.status().versions if v.version_key.version_id in vids}

    assert live_digests(reg.status()) == digests("A", "B")  # RETIRED with a ref holds its slot
    reg.close_and_release(sk("s1"))
    assert live_digests(reg.status()) == digests("A", "B")  # RETIRED, not reclaimed yet: still live
    drv.reclaim("A")
    assert live_digests(reg.status()) == digests("B")
    drv.reserve("C")  # pending: holds a slot (its snapshot must survive a trainer restart)
    assert live_digests(reg.status()) == digests("B", "C")
    drv.fail("C")  # FAILED_CLEAN frees the slot: its entry goes at the next retain
    assert live_digests(reg.status()) == digests("B")
