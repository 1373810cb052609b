"""The engine shell's failure branches (publication and reclaim services over the real version
table), driven through an in-memory native edge that fails on cue: probe failure, load failure,
unload failure, cleanup during a load, a cleanup still draining, and reclaim resumed across calls.
Each ends by checking what holds a slot, what is servable and how many physical unloads ran."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch
from _fake_native import FakeNative, fake_staging

from relax_glue.snapshot import Snapshot
from sglang_ext.adapter_compat import EngineLoraShape, ModelGeometry
from sglang_ext.errors import ErrorCode, LoraVersionError
from sglang_ext.protocol import CleanupRequest, DrainingReply, EndRequest, ReceiveBucketMeta, ReclaimRequest
from sglang_ext.publication import NameLocks, PublicationService
from sglang_ext.reclaim import ReclaimService
from sglang_ext.version_table import StagingLimits, VersionTable

GEOMETRY = ModelGeometry(
    "Qwen3ForCausalLM", num_layers=2, hidden_size=16, intermediate_size=32, q_size=16, kv_size=16
)


class Shell:
    def __init__(self) -> None:
        limits = StagingLimits(
            managed_capacity=2,
            lora=EngineLoraShape(GEOMETRY, max_lora_rank=8, served_modules=None),
            max_version_bytes=10**9,
            max_bucket_bytes=10**8,
        )
        self.table = VersionTable("inc", limits)
        self.native = FakeNative()
        self.locks = locks = NameLocks()
        self.publication = PublicationService(self.table, self.native, fake_staging(), locks)
        self.reclaim_service = ReclaimService(self.table, self.native, locks)
        self.begin_req: dict = {}  # name -> its begin request
        self.snapshots: dict = {}  # seed -> its snapshot

    async def stage(self, seed: int) -> tuple[str, str]:
        """begin + every bucket of a fresh version; (name, attempt token)."""
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


@pytest.fixture
def shell() -> Shell:
    return Shell()


async def test_a_failed_probe_removes_what_it_loaded_and_end_can_be_retried(shell):
    name, token = await shell.stage(1)
    shell.native.fail_next("probe")
    with pytest.raises(LoraVersionError) as info:
        await shell.end(name, token)
    assert info.value.code is ErrorCode.LOAD_FAILED
    assert shell.table.get(name).state == "PREPARED" and not shell.table.get(name).cleaning
    assert shell.native.registry == {} and shell.native.unloads[name] == 1 and shell.native.loaded == {}
    assert not shell.servable(name) and shell.table.slots_in_use() == 1  # the candidate still holds it
    receipt = await shell.end(name, token)
    assert receipt.state == "READY_LOCAL" and shell.servable(name)


async def test_a_failed_load_leaves_nothing_loaded_and_end_can_be_retried(shell):
    name, token = await shell.stage(2)
    shell.native.fail_next("load_pinned")
    with pytest.raises(LoraVersionError):
        await shell.end(name, token)
    assert shell.table.get(name).state == "PREPARED"
    assert shell.native.registry == {} and shell.native.loaded == {} and shell.native.unloads[name] == 0
    assert (await shell.end(name, token)).state == "READY_LOCAL"


async def test_a_failed_unload_keeps_the_slot_and_a_retried_cleanup_finishes(shell):
    """SGLang refuses the physical unload after the name was unregistered: the cleanup answers
    DRAINING with the unload's error (the removal started; a 4xx would claim nothing changed),
    keeps the slot, and the retried cleanup finishes it."""
    name, token = await shell.stage(3)
    await shell.end(name, token)
    shell.native.fail_next("physical_unload")
    pending = await shell.cleanup(name, token)
    assert isinstance(pending, DrainingReply) and pending.in_flight == 0
    assert pending.unload_error and "physical_unload" in pending.unload_error
    v = shell.table.get(name)
    assert v.state == "READY_LOCAL" and v.cleaning, "not CLEANED on a failed unload: nothing freed on a guess"
    assert shell.table.slots_in_use() == 1 and not shell.servable(name)
    receipt = await shell.cleanup(name, token)
    assert receipt.state == "CLEANED" and shell.native.unloads[name] == 1 and shell.table.slots_in_use() == 0


async def test_cleanup_during_a_load_waits_for_it_then_unloads_once(shell, monkeypatch):
    name, token = await shell.stage(4)
    started, release = asyncio.Event(), asyncio.Event()
    real_load = shell.native.load_pinned

    async def slow_load(*args, **kwargs):
        started.set()
        await release.wait()
        return await real_load(*args, **kwargs)

    monkeypatch.setattr(shell.native, "load_pinned", slow_load)
    end = asyncio.ensure_future(shell.end(name, token))
    await started.wait()
    cleanup = asyncio.ensure_future(shell.cleanup(name, token))
    await asyncio.sleep(0.05)
    assert not cleanup.done(), "cleanup waits for the running load"
    release.set()
    assert (await cleanup).state == "CLEANED"
    assert (await end).state == "READY_LOCAL"  # the load finished; cleanup then took it out
    assert shell.native.unloads[name] == 1 and shell.native.registry == {} and shell.table.slots_in_use() == 0


async def test_a_cleanup_still_draining_is_not_clean_until_the_request_ends(shell):
    name, token = await shell.stage(5)
    await shell.end(name, token)
    lora_id = shell.native.acquire(name)  # a request admitted before the cleanup
    draining = await shell.cleanup(name, token, drain_timeout_s=0.05)
    assert isinstance(draining, DrainingReply) and draining.in_flight == 1
    assert draining.attempt_token == token and draining.reclaim_id is None
    assert not shell.servable(name) and shell.table.get(name).state == "READY_LOCAL"
    assert shell.native.unloads[name] == 0
    shell.native.release(lora_id)
    assert (await shell.cleanup(name, token)).state == "CLEANED"
    assert shell.native.unloads[name] == 1


async def test_reclaim_resumes_across_calls_and_unloads_once(shell):
    name, token = await shell.stage(6)
    await shell.end(name, token)
    lora_id = shell.native.acquire(name)
    first = await shell.reclaim(name, "r1")
    assert isinstance(first, DrainingReply) and first.in_flight == 1
    assert shell.table.get(name).state == "RECLAIMING" and not shell.servable(name)
    with pytest.raises(LoraVersionError) as info:
        await shell.reclaim(name, "r2")  # another reclaim id: refused, the first one goes on
    assert info.value.code is ErrorCode.STALE_ATTEMPT
    assert isinstance(await shell.reclaim(name, "r1"), DrainingReply)
    shell.native.release(lora_id)
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"
    assert shell.native.unloads[name] == 1 and shell.table.slots_in_use() == 0


async def test_a_reclaim_whose_unload_sglang_refuses_is_pending_not_refused(shell):
    """The reclaim started (RECLAIMING, unregistered, nothing in flight) and SGLang refuses the
    unload (e.g. the step fence cannot know a launched step's completion): DRAINING with the
    error, the same reclaim id goes on, and the next call unloads exactly once."""
    name, token = await shell.stage(25)
    await shell.end(name, token)
    shell.native.fail_next("physical_unload")
    pending = await shell.reclaim(name, "r1")
    assert isinstance(pending, DrainingReply) and pending.reclaim_id == "r1" and pending.unload_error
    assert shell.table.get(name).state == "RECLAIMING" and not shell.servable(name)
    assert shell.table.slots_in_use() == 1 and shell.native.unloads[name] == 0
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"
    assert shell.native.unloads[name] == 1 and shell.table.slots_in_use() == 0


async def test_a_failed_probe_whose_removal_fails_is_kept_failed_and_never_forgotten(shell):
    """Issue 9 (3): the removal after a failed probe had its errors suppressed and the table went
    back to PREPARED, forgetting an adapter SGLang still held pinned; a cleanup then answered
    CLEANED and freed the slot over it. Now the version is FAILED (visible, pinned, holding its
    slot, never servable) until a cleanup really removes it."""
    name, token = await shell.stage(7)
    shell.native.fail_next("probe")
    shell.native.fail_next("physical_unload")
    with pytest.raises(LoraVersionError) as info:
        await shell.end(name, token)
    assert info.value.code is ErrorCode.LOAD_FAILED
    v = shell.table.get(name)
    assert v.state == "FAILED" and v.lora_id in shell.native.loaded, "the leftover is remembered"
    assert shell.table.slots_in_use() == 1 and not shell.servable(name)
    assert shell.table.status_of(v, shell.native.in_flight(v.lora_id)).pinned
    for retry in (lambda: shell.end(name, token), lambda: shell.publication.begin(shell.begin_req[name])):
        with pytest.raises(LoraVersionError) as info:
            await retry()
        assert info.value.code is ErrorCode.LOAD_FAILED  # clean it up first
    receipt = await shell.cleanup(name, token)
    assert receipt.state == "CLEANED"
    assert shell.native.loaded == {} and shell.native.unloads[name] == 1 and shell.table.slots_in_use() == 0


async def test_a_partial_load_that_cannot_be_taken_back_is_kept_failed(shell, monkeypatch):
    """A load that failed after some rank loaded, whose undo failed too, reports its leftover id;
    the shell keeps it FAILED instead of forgetting it."""
    name, token = await shell.stage(8)
    real_load = shell.native.load_pinned

    async def partial_load(lora_name, adapter_dir):
        lora_id = await real_load(lora_name, adapter_dir)
        raise LoraVersionError(ErrorCode.LOAD_FAILED, "rank 1 failed", leftover_lora_id=lora_id)

    monkeypatch.setattr(shell.native, "load_pinned", partial_load)
    shell.native.fail_next("physical_unload")
    with pytest.raises(LoraVersionError):
        await shell.end(name, token)
    assert shell.table.get(name).state == "FAILED" and shell.native.loaded
    assert (await shell.cleanup(name, token)).state == "CLEANED" and shell.native.loaded == {}


async def test_a_negative_native_count_is_shown_raw_and_refuses_reclaim_and_cleanup(shell):
    """Issue 10: SGLang never clamps its counter; below zero (a release without an acquire) the
    drain can never end. The status shows the raw count, reclaim and cleanup refuse with
    IN_FLIGHT_ANOMALY before changing anything, and nothing is unloaded on a guess."""
    from sglang_ext.version_table import may_unload_now

    name, token = await shell.stage(7)
    await shell.end(name, token)
    lora_id = shell.native.lora_id_of(name)
    shell.native.release(lora_id)  # a release nobody acquired: the count goes to -1
    v = shell.table.get(name)
    assert shell.table.status_of(v, shell.native.in_flight(lora_id)).in_flight == -1  # never clamped
    for attempt in (shell.cleanup(name, token), shell.reclaim(name, "rcl-1")):
        with pytest.raises(LoraVersionError) as info:
            await attempt
        assert info.value.code is ErrorCode.IN_FLIGHT_ANOMALY and info.value.details["in_flight"] == -1
        v = shell.table.get(name)
        assert v.state == "READY_LOCAL" and not v.cleaning and shell.servable(name)  # nothing changed
    assert shell.native.unloads[name] == 0 and shell.native.registry[name] == lora_id
    assert not may_unload_now(v, -1)


async def test_a_count_that_goes_negative_during_the_drain_is_refused_not_unloaded(shell):
    name, token = await shell.stage(8)
    await shell.end(name, token)
    lora_id = shell.native.lora_id_of(name)
    shell.native.acquire(name)  # one request in flight: the reclaim drains
    assert isinstance(await shell.reclaim(name, "rcl-2"), DrainingReply)
    shell.native.release(lora_id)
    shell.native.release(lora_id)  # a second release of the same request: -1
    with pytest.raises(LoraVersionError) as info:
        await shell.reclaim(name, "rcl-2")
    assert info.value.code is ErrorCode.IN_FLIGHT_ANOMALY
    assert shell.native.unloads[name] == 0 and shell.table.get(name).state == "RECLAIMING"


def staged_files(shell: Shell) -> list:
    return sorted(p.name for p in shell.publication.staging.root.rglob("*") if p.is_file())


async def test_staged_files_go_at_ready_stay_after_a_failed_load_and_go_at_cleanup(shell):
    name, token = await shell.stage(21)
    assert staged_files(shell) == ["bucket-00000.safetensors"]
    shell.native.fail_next("load_pinned")
    with pytest.raises(LoraVersionError):
        await shell.end(name, token)
    # kept: the same attempt's end is sent again and loads the same verified files
    assert staged_files(shell) == ["adapter_config.json", "bucket-00000.safetensors"]
    assert (await shell.end(name, token)).state == "READY_LOCAL"
    assert staged_files(shell) == []  # the engine holds the weights; the files are gone
    loaded = next(iter(shell.native.loaded.values()))
    assert shell.native.configs[name]["r"] == 4 and len(loaded) == 8

    other, other_token = await shell.stage(22)
    assert staged_files(shell) == ["bucket-00000.safetensors"]
    await shell.cleanup(other, other_token)
    assert staged_files(shell) == [] and list(shell.publication.staging.root.iterdir()) == []


async def test_a_refused_bucket_leaves_no_file_and_changes_nothing(shell):
    name, token = await shell.stage(23)
    await shell.cleanup(name, token)
    snap = shell.snapshots[23]
    req = snap.begin_request("p", "e", "v23b", uuid.uuid4().hex)
    await shell.publication.begin(req)
    [b] = list(snap.iter_buckets())
    meta = ReceiveBucketMeta(
        lora_name=req.lora_name, attempt_token=req.attempt_token, index=0, sha256="0" * 64
    )

    async def read(cap: int, receiver) -> None:
        receiver.feed(b.payload)

    with pytest.raises(LoraVersionError) as info:
        await shell.publication.receive_bucket(meta, read)
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH
    assert staged_files(shell) == [] and shell.table.get(req.lora_name).next_bucket == 0


async def test_an_end_refused_by_its_file_check_changes_nothing(shell):
    """Check before mutate: the staged files are checked while the version is still PREPARED.
    A refused end leaves the record exactly as it was (state, timestamps, plan) and the version
    is never LOADING, not even between the check and the refusal."""
    import copy

    name, token = await shell.stage(24)
    for f in shell.publication.staging.root.rglob("bucket-*.safetensors"):
        f.unlink()  # the verified file is gone: what would be loaded is not the plan
    before = copy.deepcopy(shell.table.get(name))
    states: list[str] = []
    check = shell.publication.staging.check_bucket_files

    def spy(key, buckets):
        states.append(shell.table.get(name).state.value)
        return check(key, buckets)

    shell.publication.staging.check_bucket_files = spy
    with pytest.raises(LoraVersionError) as info:
        await shell.end(name, token)
    assert info.value.code is ErrorCode.MANIFEST_MISMATCH
    assert states == ["PREPARED"]
    assert shell.table.get(name) == before
    assert shell.native.loaded == {} and name not in shell.publication._loads


async def test_the_shells_per_version_state_is_bounded_by_live_versions(shell):
    """A long run publishes a version per step: after each version is reclaimed or cleaned, the
    shell keeps nothing per version (name locks, running loads, phase times, stashes, drain
    clocks). Only the table's small tombstones remember the past."""
    for i in range(12):
        name, token = await shell.stage(100 + i)
        await shell.end(name, token)
        if i % 2:
            assert (await shell.reclaim(name, f"r{i}")).state == "UNLOADED"
        else:
            assert (await shell.cleanup(name, token)).state == "CLEANED"
        pub = shell.publication
        left = {
            "locks": len(shell.locks._locks),
            "loads": len(pub._loads),
            "phases": len(pub._phases),
            "stashes": len(pub._stashes),
            "drains": len(shell.reclaim_service._drain_started),
        }
        assert left == dict.fromkeys(left, 0), (i, left)


def test_the_publication_service_takes_the_lock_set_it_shares_with_reclaim():
    """No silent private lock set: publication and reclaim of one name must serialise on the
    same locks, so the service cannot be built without them."""
    sh = Shell()
    with pytest.raises(TypeError):
        PublicationService(sh.table, sh.native, fake_staging())  # type: ignore[call-arg]
