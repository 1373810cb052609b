"""The reconciler against real engines: the double fault (issue 24, item 5).

A stale status read of E1 (taken before A was published, so A looks missing there) and a lost
reply to the restore's ``begin``, injected by wrapping the REAL engine client (the calls reach the
engine; only what the reconciler hears is changed). The reconciler then cleans up under its own
token. The committed version must stay READY on E1, never unloaded, and keep serving the session
bound to it, token for token."""

from __future__ import annotations

import pytest
from _e2e_helpers import PROMPTS, aclose_all, greedy, make_clients, new_epoch, purge, snapshot_of

from lora_contract import protocol
from lora_versions_dev.engine_log import unload_lines
from lora_versions_dev.farm import ADMIN_KEY
from lora_versions_dev.fault_injection import FaultInjectingClient
from relax_glue.cohort import open_publisher
from relax_glue.publisher import PublishOutcome
from relax_glue.reconciler import RestoreOutcome
from relax_glue.registry import LoRAVersionRegistry
from relax_glue.sessions import SessionManager
from relax_glue.snapshot_store import SnapshotStore

pytestmark = pytest.mark.engine


async def test_a_stale_status_and_a_lost_begin_reply_leave_the_committed_version_serving(
    engines, fixtures, tmp_path
) -> None:
    epoch = new_epoch()
    registry = LoRAVersionRegistry(epoch=epoch, engines=("E0", "E1"))
    clients = make_clients(engines, ADMIN_KEY, ("E0", "E1"))
    store = SnapshotStore(tmp_path / "snapshots")
    e1 = engines[1]
    mgr = SessionManager(registry, {"E1": clients["E1"]})  # the session's turns run on E1
    try:
        stale = await clients["E1"].status()  # A is not on E1 yet
        pub = open_publisher(registry, clients, store=store)
        published = await pub.publish(snapshot_of(fixtures.adapter_dir("A")), "A")
        assert published.outcome is PublishOutcome.PUBLISHED, published
        session = await mgr.open("bound-to-a")
        prompt = list(PROMPTS[0])
        first = await session.generate({"input_ids": prompt, "sampling_params": greedy(6)})
        held = await clients["E1"].version_status(published.lora_name)
        assert held.state is protocol.EngineVersionState.READY_LOCAL and held.lora_id

        faulty = FaultInjectingClient(clients["E1"])
        faulty.stale_reply("status", 1, stale).drop_reply("begin", 1)
        results = await open_publisher(registry, {**clients, "E1": faulty}, store=store).reconcile(["E1"])
        assert [(f.op, f.kind.value) for f in faulty.injected] == [
            ("status", "STALE_REPLY"),
            ("begin", "DROP_REPLY"),
        ], results

        # The committed version is untouched on E1: same attempt, same engine-local id, no unload.
        after = await clients["E1"].version_status(published.lora_name)
        assert unload_lines(e1.log_path, held.lora_id) == 0
        assert (after.state, after.attempt_token, after.lora_id) == (
            protocol.EngineVersionState.READY_LOCAL,
            held.attempt_token,
            held.lora_id,
        )
        again = await session.generate({"input_ids": prompt, "sampling_params": greedy(6)})
        assert session.lora_path == published.lora_name
        assert again["output_ids"] == first["output_ids"]  # the same exact adapter served it

        (begin,) = [f for f in faulty.injected if f.op == "begin"]
        assert begin.real_outcome == "refused:NOT_ATTEMPT_OWNER"
        (result,) = results
        assert result.outcome is RestoreOutcome.FAILED, result  # it could not know what happened
        (held_now,) = await open_publisher(registry, clients, store=store).reconcile(["E1"])
        assert held_now.outcome is RestoreOutcome.HELD
        await session.close()
    finally:
        await mgr.close_all()
        await mgr.aclose()
        left = await purge(clients, f"@{epoch}-")
        await aclose_all(clients.values())
        assert not any(left.values()), left
