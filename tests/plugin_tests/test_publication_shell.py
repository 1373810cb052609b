"""The engine shell's failure branches (publication and reclaim services over the real version
table), driven through an in-memory native edge that fails on cue: probe failure, load failure,
unload failure, cleanup during a load, a cleanup still draining, and reclaim resumed across calls.
Each ends by checking what holds a slot, what is servable and how many physical unloads ran."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid

import pytest
from _fake_native import fake_staging
from _publication_shell import Shell, partial_load_of
from _source_trees import parse_file

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import (
    DrainingReply,
    ReceiveBucketMeta,
)
from sglang_ext.publication import PublicationService
from sglang_ext.reclaim import ReclaimService
from sglang_ext.removal import NameLocks, RemovalPending, remove_version


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

    monkeypatch.setattr(shell.native, "load_pinned", partial_load_of(shell.native, real_load))
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
    assert not may_unload_now(v, -1, resolvable=False)


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
            "drains": len(shell.reclaim_service._drain_started),
        }
        assert left == dict.fromkeys(left, 0), (i, left)


def test_the_publication_service_takes_the_lock_set_it_shares_with_reclaim():
    """No silent private lock set: publication and reclaim of one name must serialise on the
    same locks, so the service cannot be built without them."""
    sh = Shell()
    with pytest.raises(TypeError):
        PublicationService(sh.table, sh.native, fake_staging())  # type: ignore[call-arg]


# ---------------------------------------------------------------- remove_version, row by row


async def _ready_in(shell: Shell, seed: int, removal: str) -> tuple[str, str]:
    """A READY version whose removal is ``removal``: "none" (still served), "reclaim"
    (RECLAIMING under r1) or "cleanup" (a cleanup marked it cleaning)."""
    name, token = await shell.stage(seed)
    await shell.end(name, token)
    if removal == "reclaim":
        shell.table.start_reclaim(name, "r1")
    elif removal == "cleanup":
        shell.table.mark_cleaning(name, token)
    return name, token


@pytest.mark.parametrize(
    ("removal", "in_flight", "unloaded"),
    [
        ("none", 0, False),  # never unloaded while its removal has not started, even when idle
        ("none", 1, False),
        ("reclaim", 0, True),
        ("reclaim", 1, False),  # drained within the call's bound: still one request in it
        ("cleanup", 0, True),
        ("cleanup", 1, False),
    ],
)
async def test_remove_version_unloads_only_a_version_being_removed_with_nothing_in_flight(
    shell, removal: str, in_flight: int, unloaded: bool
):
    name, _ = await _ready_in(shell, 60, removal)
    lora_id = shell.table.get(name).lora_id
    for _ in range(in_flight):
        shell.native.acquire(name)
    result = await remove_version(shell.table, shell.native, name, lora_id, 0.02)
    assert name not in shell.native.registry  # unregistered first, whatever follows
    if unloaded:
        assert result is None and shell.native.unloads[name] == 1 and lora_id not in shell.native.loaded
    else:
        assert result == RemovalPending(in_flight) and shell.native.unloads[name] == 0
        assert lora_id in shell.native.loaded


async def test_remove_version_of_a_name_with_nothing_loaded_touches_nothing(shell):
    name, _ = await _ready_in(shell, 61, "reclaim")
    registry = dict(shell.native.registry)
    assert await remove_version(shell.table, shell.native, name, None, 0.02) is None
    assert shell.native.registry == registry and shell.native.unloads[name] == 0


@pytest.mark.parametrize("code", [c for c in ErrorCode if c is not ErrorCode.LOAD_FAILED])
async def test_only_sglangs_not_unloaded_answer_makes_a_removal_pending(shell, code: ErrorCode):
    """SGLang answering "not unloaded" (LOAD_FAILED) after the name was unregistered is a removal
    still pending: retried by the next call. Every other error is raised to the caller as it is,
    never turned into a pending removal that hides it."""

    name, _ = await _ready_in(shell, 62, "reclaim")
    lora_id = shell.table.get(name).lora_id
    shell.native.fail_next("physical_unload", LoraVersionError(code, "injected"))
    with pytest.raises(LoraVersionError) as info:
        await remove_version(shell.table, shell.native, name, lora_id, 0.02)
    assert info.value.code is code
    shell.native.fail_next("physical_unload")  # LOAD_FAILED
    pending = await remove_version(shell.table, shell.native, name, lora_id, 0.02)
    assert isinstance(pending, RemovalPending) and pending.in_flight == 0 and pending.unload_error
    assert await remove_version(shell.table, shell.native, name, lora_id, 0.02) is None
    assert shell.native.unloads[name] == 1


async def test_an_error_that_is_no_lora_version_error_is_raised_too(shell):
    name, _ = await _ready_in(shell, 63, "reclaim")
    shell.native.fail_next("physical_unload", RuntimeError("scheduler died"))
    with pytest.raises(RuntimeError):
        await remove_version(shell.table, shell.native, name, shell.table.get(name).lora_id, 0.02)


# ------------------------------------------------------------------------------ name locks


async def _ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_name_lock_serialises_every_holder_and_waiter_and_is_gone_after():
    """Holder, waiter, and a caller arriving while the waiter holds: never two inside at once
    (the lock must not be dropped while anyone still holds or waits for it); other names run
    alongside; the lock of a name exists only while someone holds or waits for it."""

    locks = NameLocks()
    inside: list[str] = []
    most = 0
    gates = {who: asyncio.Event() for who in ("t1", "t2", "t3", "other")}
    entered = {who: asyncio.Event() for who in gates}

    async def user(who: str, name: str = "a") -> None:
        nonlocal most
        async with locks[name]:
            inside.append(who)
            most = max(most, sum(1 for w in inside if w != "other"))
            entered[who].set()
            await gates[who].wait()
            inside.remove(who)

    t1 = asyncio.ensure_future(user("t1"))
    await entered["t1"].wait()
    t2 = asyncio.ensure_future(user("t2"))
    other = asyncio.ensure_future(user("other", "b"))
    await entered["other"].wait()  # another name is not blocked by "a"
    await _ticks()
    assert not entered["t2"].is_set()
    gates["t1"].set()
    await entered["t2"].wait()
    t3 = asyncio.ensure_future(user("t3"))  # arrives while t2 holds, nobody else waits
    await _ticks()
    assert not entered["t3"].is_set(), "a caller got in while the lock was held"
    gates["t2"].set()
    await entered["t3"].wait()
    gates["t3"].set()
    gates["other"].set()
    await asyncio.gather(t1, t2, t3, other)
    assert most == 1 and locks._locks == {}


async def test_a_cancelled_waiter_leaves_no_lock_behind():

    locks = NameLocks()
    release = asyncio.Event()

    async def hold() -> None:
        async with locks["a"]:
            await release.wait()

    holder = asyncio.ensure_future(hold())
    await _ticks()
    waiter = asyncio.ensure_future(hold())
    await _ticks()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert "a" in locks._locks  # still held
    release.set()
    await holder
    assert locks._locks == {}


# ------------------------------------------------------------------- begin and staging room


def _no_room(shell: Shell) -> list[int]:
    """The staging directory is full from now on; returns the sizes it was asked to hold."""
    asked: list[int] = []

    def full(nbytes: int, what: str) -> None:
        asked.append(nbytes)
        raise LoraVersionError(ErrorCode.PAYLOAD_TOO_LARGE, f"{what}: no room")

    shell.publication.staging.check_room = full
    return asked


async def test_every_new_attempt_is_checked_for_room_before_the_table_changes(shell):
    """A new attempt of a name, also one whose earlier attempt was cleaned up (the table holds a
    CLEANED record of it), is refused with nothing reserved when staging has no room; a retry of
    the current attempt (PREPARED or READY) is answered from the table, whatever the room."""
    cleaned_name, cleaned_token = await shell.stage(66)
    await shell.cleanup(cleaned_name, cleaned_token)
    prepared_name, _ = await shell.stage(64)
    ready_name, ready_token = await shell.stage(65)
    await shell.end(ready_name, ready_token)
    asked = _no_room(shell)
    assert (await shell.publication.begin(shell.begin_req[prepared_name])).state == "PREPARED"
    assert (await shell.publication.begin(shell.begin_req[ready_name])).state == "READY_LOCAL"
    assert asked == []
    fresh = shell.snapshots[66].begin_request("p", "e", "v66", uuid.uuid4().hex)  # same version, new attempt
    for req in (fresh, shell.snapshots[64].begin_request("p", "e", "v64b", uuid.uuid4().hex)):
        before = copy.deepcopy((shell.table.versions, shell.table.attempt_owner))
        with pytest.raises(LoraVersionError) as info:
            await shell.publication.begin(req)
        assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE
        assert (shell.table.versions, shell.table.attempt_owner) == before
    assert asked == [fresh.manifest.total_bytes, shell.snapshots[64].manifest.total_bytes]
    assert shell.table.get(cleaned_name).attempt_token == cleaned_token


# -------------------------------------------------------------------- reclaim, row by row


async def test_a_reclaim_of_a_name_this_engine_does_not_hold_is_unloaded_at_once(shell):
    """After a restart an engine holds none of its old versions: a reclaim of a name it never
    loaded, or holds only as a CLEANED tombstone, answers UNLOADED (authoritative, so the
    registry slot can be freed), unloads nothing and adds nothing to the table."""
    name, token = await shell.stage(67)
    await shell.cleanup(name, token)
    never = "relax_policy_lora@e-v99-" + "0" * 12
    for target in (never, name):
        before = copy.deepcopy(shell.table.versions)
        receipt = await shell.reclaim(target, "r1")
        assert receipt.state == "UNLOADED" and receipt.reclaim_id == "r1" and receipt.lora_name == target
        assert shell.table.versions == before and shell.native.unloads[target] == 0
    staging, _ = await shell.stage(68)
    with pytest.raises(LoraVersionError) as info:
        await shell.reclaim(staging, "r1")  # PREPARED: a candidate is cleaned up, never reclaimed
    assert info.value.code is ErrorCode.VERSION_NOT_READY


async def test_two_calls_of_one_reclaim_draining_together_both_end_unloaded_once(shell):
    """A repeated reclaim call (same id) joins the drain outside the name lock; when the last
    request ends, the first to finish unloads and the other finds the version UNLOADED: both
    answer UNLOADED, exactly one physical unload, no error."""
    name, token = await shell.stage(69)
    await shell.end(name, token)
    lora_id = shell.native.acquire(name)
    first = asyncio.ensure_future(shell.reclaim(name, "r1", timeout_s=5.0))
    second = asyncio.ensure_future(shell.reclaim(name, "r1", timeout_s=5.0))
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()
    shell.native.release(lora_id)
    answers = await asyncio.gather(first, second)
    assert [a.state for a in answers] == ["UNLOADED", "UNLOADED"]
    assert shell.native.unloads[name] == 1 and shell.table.get(name).state == "UNLOADED"
    assert shell.reclaim_service._drain_started == {}


# ------------------------------------------------------------------ racing calls of one name


async def _begun(shell: Shell, seed: int):
    """A staged begin without any bucket; (request, its snapshot's buckets)."""
    await shell.stage(seed)  # records the snapshot; its own version is left as it is
    snap = shell.snapshots[seed]
    req = snap.begin_request("p", "e", f"w{seed}", uuid.uuid4().hex)
    await shell.publication.begin(req)
    return req, list(snap.iter_buckets())


def _held_reader(payload: bytes, gate: asyncio.Event, started: asyncio.Event):
    async def read(cap: int, receiver) -> None:
        started.set()
        await gate.wait()
        receiver.feed(payload)

    return read


async def test_two_uploads_of_one_bucket_racing_are_both_acknowledged_and_stored_once(shell):
    """Both bodies are read outside the name lock; the check is asked again before the commit:
    the first stores the bucket, the second is answered as a duplicate and stores nothing."""
    req, buckets = await _begun(shell, 70)
    b = buckets[0]
    meta = ReceiveBucketMeta(
        lora_name=req.lora_name, attempt_token=req.attempt_token, index=0, sha256=b.sha256
    )
    gate = asyncio.Event()
    started = [asyncio.Event(), asyncio.Event()]
    uploads = [
        asyncio.ensure_future(shell.publication.receive_bucket(meta, _held_reader(b.payload, gate, s)))
        for s in started
    ]
    for s in started:
        await s.wait()  # both passed the first check and are reading
    gate.set()
    acks = await asyncio.gather(*uploads)
    assert sorted(a.duplicate for a in acks) == [False, True] and all(a.accepted for a in acks)
    assert shell.table.get(req.lora_name).next_bucket == 1
    key = (req.lora_name, req.attempt_token)
    files = sorted(p.name for p in shell.publication.staging.attempt_dir(key).iterdir())
    assert files == ["bucket-00000.safetensors"]
    assert not [p for p in shell.publication.staging.root.glob("incoming-*")]  # no stray part


async def test_a_bucket_whose_attempt_is_cleaned_while_its_body_is_read_is_refused_and_left_nowhere(shell):
    req, buckets = await _begun(shell, 71)
    b = buckets[0]
    meta = ReceiveBucketMeta(
        lora_name=req.lora_name, attempt_token=req.attempt_token, index=0, sha256=b.sha256
    )
    before = staged_files(shell)  # the other version's bucket only
    gate, started = asyncio.Event(), asyncio.Event()
    reader = _held_reader(b.payload, gate, started)
    upload = asyncio.ensure_future(shell.publication.receive_bucket(meta, reader))
    await started.wait()
    assert (await shell.cleanup(req.lora_name, req.attempt_token)).state == "CLEANED"
    gate.set()
    with pytest.raises(LoraVersionError) as info:
        await upload
    assert info.value.code is ErrorCode.STALE_ATTEMPT
    assert staged_files(shell) == before  # neither committed nor left as a stray part
    assert shell.table.get(req.lora_name).state == "CLEANED"


async def test_two_ends_racing_share_one_load(shell, monkeypatch):
    """A second end while the load runs joins it (JOIN): one native load, one probe, both
    answered READY_LOCAL with the same receipt."""
    name, token = await shell.stage(72)
    gate, loads = asyncio.Event(), []
    real_load = shell.native.load_pinned

    async def slow_load(*args):
        loads.append(args[0])
        await gate.wait()
        return await real_load(*args)

    monkeypatch.setattr(shell.native, "load_pinned", slow_load)
    first = asyncio.ensure_future(shell.end(name, token))
    await _ticks()
    second = asyncio.ensure_future(shell.end(name, token))
    await _ticks()
    assert shell.table.get(name).state == "LOADING" and not second.done()
    gate.set()
    receipts = await asyncio.gather(first, second)
    assert receipts[0] == receipts[1] and receipts[0].state == "READY_LOCAL"
    assert loads == [name] and len(shell.native.loaded) == 1
    assert (await shell.end(name, token)) == receipts[0]  # READY: the stored receipt, no load
    assert loads == [name]


class _DrainClock:
    """The reclaim service's monotonic clock, moved by hand, and the drain times it reported."""

    def __init__(self) -> None:
        self.now = 100.0
        self.drained: list[float] = []

    def __call__(self) -> float:
        return self.now

    def metrics(self):
        from sglang_ext.metrics import NO_METRICS

        clock = self

        class Recording(type(NO_METRICS)):
            def drained(self, seconds: float) -> None:
                clock.drained.append(seconds)

        return Recording()


async def test_a_reclaims_drain_time_runs_from_its_start_across_every_resumed_call(shell, monkeypatch):
    """The drain time a reclaim reports is from the call that started it to the unload, however
    many resumed calls (same reclaim id) polled it in between; it is reported once."""
    from types import SimpleNamespace

    import sglang_ext.reclaim as reclaim_module

    clock = _DrainClock()
    # the module's own clock only: asyncio's loop keeps the real one
    monkeypatch.setattr(reclaim_module, "time", SimpleNamespace(monotonic=clock))
    shell.reclaim_service = ReclaimService(shell.table, shell.native, shell.locks, clock.metrics())
    name, token = await shell.stage(73)
    await shell.end(name, token)
    lora_id = shell.native.acquire(name)
    assert isinstance(await shell.reclaim(name, "r1", timeout_s=0.01), DrainingReply)  # started at 100
    for now in (103.0, 105.0):
        clock.now = now
        assert isinstance(await shell.reclaim(name, "r1", timeout_s=0.01), DrainingReply)
    clock.now = 107.0
    shell.native.release(lora_id)
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"  # a replay reports nothing more
    assert clock.drained == [7.0]


def _attempt_dirs(shell: Shell) -> list:
    return sorted(p.name for p in shell.publication.staging.root.iterdir() if p.name.startswith("attempt-"))


async def test_only_a_begin_that_starts_staging_makes_a_staging_directory(shell):
    """A replayed begin of a READY version (nothing to stage) and a refused begin leave no
    directory behind: a directory per replay would outlive the version (reclaim removes none)."""
    name, token = await shell.stage(74)
    await shell.end(name, token)
    assert _attempt_dirs(shell) == []
    assert (await shell.publication.begin(shell.begin_req[name])).state == "READY_LOCAL"
    assert _attempt_dirs(shell) == []
    other = shell.begin_req[name].model_copy(update={"attempt_token": uuid.uuid4().hex})
    with pytest.raises(LoraVersionError) as info:
        await shell.publication.begin(other)
    assert info.value.code is ErrorCode.NOT_ATTEMPT_OWNER and _attempt_dirs(shell) == []
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"
    assert list(shell.publication.staging.root.iterdir()) == []


async def test_a_negative_count_is_recorded_as_an_anomaly_by_every_reclaim_call_it_refuses(shell):
    """The count is checked before anything changes, on the call that would start the reclaim
    and on every call that would resume it: each refusal is seen (typed and counted)."""
    anomalies: list[str] = []
    from sglang_ext.metrics import NO_METRICS

    class Recording(type(NO_METRICS)):
        def anomaly(self, kind: str) -> None:
            anomalies.append(kind)

    shell.reclaim_service = ReclaimService(shell.table, shell.native, shell.locks, Recording())
    name, token = await shell.stage(75)
    await shell.end(name, token)
    lora_id = shell.native.lora_id_of(name)
    shell.native.acquire(name)
    assert isinstance(await shell.reclaim(name, "r1", timeout_s=0.01), DrainingReply)  # started
    shell.native.release(lora_id)
    shell.native.release(lora_id)  # -1: a release without an acquire
    for _ in range(2):
        with pytest.raises(LoraVersionError) as info:
            await shell.reclaim(name, "r1")
        assert info.value.code is ErrorCode.IN_FLIGHT_ANOMALY
    assert anomalies == ["negative_in_flight", "negative_in_flight"]
    assert shell.native.unloads[name] == 0 and shell.table.get(name).state == "RECLAIMING"


async def test_a_body_that_declares_more_than_its_bucket_can_hold_is_refused_at_once(shell):
    """The receiver's cap is the bucket's own bound (its tensor bytes plus a header allowance),
    never the engine-wide bucket cap: a header length past it is PAYLOAD_TOO_LARGE on the first
    chunk, before anything more is read or buffered."""
    import struct

    from lora_contract.transport import max_payload_bytes

    req, buckets = await _begun(shell, 76)
    b = buckets[0]
    v = shell.table.get(req.lora_name)
    own_bound = max_payload_bytes(v.manifest, v.plan[0])
    assert own_bound + 2**16 < shell.table.limits.max_bucket_bytes
    meta = ReceiveBucketMeta(
        lora_name=req.lora_name, attempt_token=req.attempt_token, index=0, sha256=b.sha256
    )
    fed: list[int] = []

    async def read(cap: int, receiver) -> None:
        chunk = struct.pack("<Q", own_bound + 2**16) + b"{"  # a header longer than the bucket's cap
        fed.append(len(chunk))
        receiver.feed(chunk)
        fed.append(-1)  # never reached: refused inside feed

    before = staged_files(shell)
    with pytest.raises(LoraVersionError) as info:
        await shell.publication.receive_bucket(meta, read)
    assert info.value.code is ErrorCode.PAYLOAD_TOO_LARGE
    assert fed == [9] and staged_files(shell) == before and v.next_bucket == 0


async def _cleanup_case(shell: Shell, case: str) -> tuple[str, str]:
    if case == "never_seen":
        return "relax_policy_lora@e-v98-" + "0" * 12, uuid.uuid4().hex
    name, token = await shell.stage(77)
    if case in ("ready", "replayed", "failed"):
        if case == "failed":
            shell.native.fail_next("probe")
            shell.native.fail_next("physical_unload")
            with pytest.raises(LoraVersionError):
                await shell.end(name, token)
        else:
            await shell.end(name, token)
    if case == "replayed":
        await shell.cleanup(name, token)
    return name, token


@pytest.mark.parametrize("case", ["never_seen", "prepared", "ready", "failed", "replayed"])
async def test_a_cleanup_through_the_shell_ends_clean_for_every_decision_of_the_table(shell, case):
    """NOTHING (a token never seen, a replayed cleanup), DROP_STASH (staged only), UNLOAD (READY,
    or FAILED with its leftover): each answers CLEANED with the same receipt on a replay, leaves
    nothing loaded, staged or holding a slot, and unloads at most once."""
    name, token = await _cleanup_case(shell, case)
    receipt = await shell.cleanup(name, token)
    assert receipt.state == "CLEANED" and receipt.lora_name == name and receipt.attempt_token == token
    assert await shell.cleanup(name, token) == receipt
    assert shell.table.slots_in_use() == 0 and shell.native.loaded == {} and shell.native.registry == {}
    assert staged_files(shell) == [] and shell.native.unloads[name] == (
        1 if case in ("ready", "replayed", "failed") else 0
    )


async def test_a_duplicate_bucket_is_acknowledged_without_reading_its_body(shell):
    """A bucket already accepted is answered at once: its body is not read, no part is staged
    (a retried upload of a large bucket costs nothing)."""
    req, buckets = await _begun(shell, 78)
    b = buckets[0]
    meta = ReceiveBucketMeta(
        lora_name=req.lora_name, attempt_token=req.attempt_token, index=0, sha256=b.sha256
    )

    async def read(cap: int, receiver, payload: bytes = b.payload) -> None:
        receiver.feed(payload)

    assert not (await shell.publication.receive_bucket(meta, read)).duplicate
    before = staged_files(shell)
    reads: list[int] = []

    async def counted(cap: int, receiver) -> None:
        reads.append(cap)
        receiver.feed(b.payload)

    ack = await shell.publication.receive_bucket(meta, counted)
    assert ack.duplicate and ack.accepted and reads == []
    assert staged_files(shell) == before


def test_one_function_wires_the_engine_with_one_lock_set():
    """``assemble_engine`` is the only place the shipped code builds the services (the engine, the
    fake engine and these tests all call it), and both services hold the very same lock set."""
    import ast
    from pathlib import Path

    import sglang_ext

    builders = {"PublicationService", "ReclaimService", "NameLocks"}
    built_in: list[tuple[str, str]] = []
    for path in Path(sglang_ext.__file__).parent.rglob("*.py"):
        tree = parse_file(path)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) in builders:
                        built_in.append((path.name, fn.name))
    assert set(built_in) == {("engine_state.py", "assemble_engine")}, built_in
    sh = Shell()
    assert sh.publication._locks is sh.reclaim_service._locks


# ------------------------------------------------------------------ the one door to an unload


class UnloadSpy:
    """Wraps the native edge's physical unload: each call records whether the one rule said yes
    at that moment, asked with SGLang's reading of the id (its count, whether its name resolves)."""

    def __init__(self, shell: Shell, monkeypatch) -> None:
        from sglang_ext.version_table import may_unload_now

        self.calls: list[tuple[str, bool]] = []
        real = shell.native.physical_unload

        async def unload(lora_name: str, lora_id: str) -> None:
            native = shell.native
            allowed = may_unload_now(
                shell.table.get(lora_name),
                native.in_flight(lora_id),
                resolvable=native.lora_id_of(lora_name) == lora_id,
            )
            self.calls.append((lora_name, allowed))
            await real(lora_name, lora_id)

        monkeypatch.setattr(shell.native, "physical_unload", unload)

    def of(self, name: str) -> list[bool]:
        return [allowed for n, allowed in self.calls if n == name]


async def _path_reclaim_drains_first(shell: Shell) -> str:
    name, token = await shell.stage(90)
    await shell.end(name, token)
    lora_id = shell.native.acquire(name)
    assert isinstance(await shell.reclaim(name, "r1"), DrainingReply)
    shell.native.release(lora_id)
    assert (await shell.reclaim(name, "r1")).state == "UNLOADED"
    return name


async def _path_cleanup_drains_first(shell: Shell) -> str:
    name, token = await shell.stage(91)
    await shell.end(name, token)
    lora_id = shell.native.acquire(name)
    assert isinstance(await shell.cleanup(name, token, drain_timeout_s=0.02), DrainingReply)
    shell.native.release(lora_id)
    assert (await shell.cleanup(name, token)).state == "CLEANED"
    return name


async def _path_failed_probe(shell: Shell) -> str:
    name, token = await shell.stage(92)
    shell.native.fail_next("probe")
    with pytest.raises(LoraVersionError):
        await shell.end(name, token)
    assert shell.table.get(name).state == "PREPARED"
    return name


async def _path_partial_load_taken_back(shell: Shell) -> str:
    name, token = await shell.stage(93)
    real_load = shell.native.load_pinned
    shell.native.load_pinned = partial_load_of(shell.native, real_load)
    try:
        with pytest.raises(LoraVersionError) as info:
            await shell.end(name, token)
    finally:
        shell.native.load_pinned = real_load
    assert info.value.details["leftover_lora_id"] and shell.table.get(name).state == "PREPARED"
    return name


async def _path_failed_leftover_cleaned(shell: Shell) -> str:
    name, token = await shell.stage(94)
    real_load = shell.native.load_pinned
    shell.native.load_pinned = partial_load_of(shell.native, real_load)
    shell.native.fail_next("physical_unload")  # the take-back fails: FAILED, still loaded
    try:
        with pytest.raises(LoraVersionError):
            await shell.end(name, token)
    finally:
        shell.native.load_pinned = real_load
    assert shell.table.get(name).state == "FAILED"
    assert (await shell.cleanup(name, token)).state == "CLEANED"
    return name


_UNLOAD_PATHS = {
    # path -> the unload calls it makes, each the rule's yes (a failed take-back is one more call)
    "reclaim": (_path_reclaim_drains_first, [True]),
    "cleanup": (_path_cleanup_drains_first, [True]),
    "failed_probe": (_path_failed_probe, [True]),
    "partial_load_taken_back": (_path_partial_load_taken_back, [True]),
    "failed_leftover_cleaned": (_path_failed_leftover_cleaned, [True, True]),
}


@pytest.mark.parametrize("path", list(_UNLOAD_PATHS))
async def test_every_path_that_unloads_a_managed_version_does_so_only_on_the_rules_yes(
    shell, monkeypatch, path: str
):
    """Issue 36: reclaim, cleanup, a failed probe, a partial load taken back and the cleanup of a
    FAILED leftover each unload through the one removal, and only when may_unload_now says yes
    with SGLang's reading of the id at that moment; nothing stays loaded or registered."""
    spy = UnloadSpy(shell, monkeypatch)
    run, want = _UNLOAD_PATHS[path]
    name = await run(shell)
    assert spy.of(name) == want
    assert shell.native.loaded == {} and name not in shell.native.registry


async def test_a_registered_version_whose_count_is_gone_is_never_unloaded_on_a_guess(shell, monkeypatch):
    """Issue 36: remove_version skipped the rule once SGLang had no counter for the id, and so
    unloaded a registered version whose in-flight count nobody could read. Now an unknown count
    is pending (with the reason), nothing is unloaded, and the reclaim stays RECLAIMING."""
    spy = UnloadSpy(shell, monkeypatch)
    name, token = await shell.stage(95)
    await shell.end(name, token)
    lora_id = shell.native.lora_id_of(name)
    shell.native.acquire(name)  # a request holds it ...
    del shell.native.counters[lora_id]  # ... and its count is lost (no counter in SGLang)
    pending = await shell.reclaim(name, "r1")
    assert isinstance(pending, DrainingReply) and pending.unload_error
    assert "no in-flight count" in pending.unload_error
    assert spy.calls == [] and lora_id in shell.native.loaded
    assert shell.table.get(name).state == "RECLAIMING" and shell.table.slots_in_use() == 1


async def test_a_removal_cut_off_after_its_unload_ends_without_a_second_one(shell, monkeypatch):
    """The unload happened, then the cleanup failed before it recorded CLEANED (its staged files
    could not be removed). SGLang dropped the id's counter with the unload, so the retried
    cleanup has no count to read: it ends CLEANED from the table's record of the unload, with
    no second unload and no removal pending forever."""
    spy = UnloadSpy(shell, monkeypatch)
    name, token = await shell.stage(96)
    await shell.end(name, token)
    forget = shell.publication._forget
    calls = {"n": 0}

    def forget_failing_once(key):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("staging directory busy")
        forget(key)

    monkeypatch.setattr(shell.publication, "_forget", forget_failing_once)
    with pytest.raises(OSError):
        await shell.cleanup(name, token)
    assert spy.of(name) == [True] and shell.table.get(name).state == "READY_LOCAL"
    assert (await shell.cleanup(name, token)).state == "CLEANED"
    assert spy.of(name) == [True] and shell.table.slots_in_use() == 0


@pytest.mark.parametrize("state_name", ["READY_LOCAL", "LOADING", "RECLAIMING", "READY_CLEANING"])
@pytest.mark.parametrize("count", [0, 1])
async def test_the_lru_eviction_never_takes_a_managed_version_it_can_see(
    shell, monkeypatch, state_name, count
):
    """SGLang's max_loaded_loras eviction asks the same rule with its own reading: every candidate
    still resolves, so no managed version is evicted by the stock path in any state, even at
    zero in flight (a RECLAIMING one between its reclaim's start and its unregister included);
    a plain adapter is."""
    import types

    import sglang_ext.tokenizer_hooks as tokenizer_hooks
    from sglang_ext.tokenizer_hooks import lru_never_picks_managed
    from sglang_ext.version_table import S

    name, token = await shell.stage(97)
    await shell.end(name, token)
    v = shell.table.get(name)
    if state_name == "LOADING":
        v.state = S.LOADING
    elif state_name == "RECLAIMING":
        shell.table.start_reclaim(name, "r1")  # still registered: the reclaim has not unregistered yet
    elif state_name == "READY_CLEANING":
        shell.table.mark_cleaning(name, token)
    for _ in range(count):
        shell.native.acquire(name)
    state = types.SimpleNamespace(table=shell.table, native=shell.native)
    monkeypatch.setattr(tokenizer_hooks, "engine_state", lambda: state)  # bound there at import
    refs = {name: types.SimpleNamespace(pinned=False), "plain-a": types.SimpleNamespace(pinned=False)}
    registry = types.SimpleNamespace(
        _registry=refs, _registry_lock=types.SimpleNamespace(reader_lock=contextlib.nullcontext())
    )
    assert await lru_never_picks_managed(registry) == "plain-a"
    del refs["plain-a"]
    assert await lru_never_picks_managed(registry) is None


def test_nothing_but_the_one_removal_calls_sglangs_physical_unload():
    """A structural guard for the one door: in the plugin's source, ``physical_unload`` is called
    only inside removal.remove_version (which asks may_unload_now right before it)."""
    import ast
    from pathlib import Path

    import sglang_ext

    callers = []
    for path in sorted(Path(sglang_ext.__file__).parent.glob("*.py")):
        tree = parse_file(path)
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "physical_unload"
                ):
                    callers.append(f"{path.name}:{fn.name}")
    assert sorted(set(callers)) == ["removal.py:remove_version"], callers


def test_publication_and_reclaim_share_the_removal_and_neither_imports_the_other():
    """The one removal and the lock set live in sglang_ext.removal, which both services import:
    reclaim reaching into publication for them made the two shells one module in disguise."""
    import ast
    from pathlib import Path

    import sglang_ext

    def imported_from(name: str) -> set[str]:
        tree = parse_file(Path(sglang_ext.__file__).parent / name)
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "sglang_ext.publication" not in imported_from("reclaim.py")
    assert "sglang_ext.reclaim" not in imported_from("publication.py")
    assert "sglang_ext.removal" in imported_from("reclaim.py") & imported_from("publication.py")
