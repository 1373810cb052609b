"""A third transport on a real engine (issue 37, item 4): E1's launch wrapper registers the
test-only "shared-file" transport's engine end (``tests/engine_wrappers/
fake_transport_shared_file.py``), this process its trainer end, and the REAL publisher publishes a
version through it to E1, which then serves it. Nothing in the contract, the route, the shell,
the client or the publisher names the transport. A delivery that loses a bucket fails typed and
leaves nothing loaded. The same in process, over the fake engine: ``test_fake_transport.py``."""

from __future__ import annotations

import pytest
from _e2e_helpers import aclose_all, greedy, new_epoch, purge, snapshot_of
from engine_wrappers.fake_transport_shared_file import SHARED_FILE, register_trainer_side

from lora_contract.errors import ErrorCode
from lora_versions_dev.farm import ADMIN_KEY, PROMPT
from relax_glue.bucket_transport import bucket_transport
from relax_glue.cohort import open_publisher
from relax_glue.engine_client import EngineClient, generation_aborted
from relax_glue.publisher import PublishOutcome
from relax_glue.registry import LoRAVersionRegistry

pytestmark = pytest.mark.engine


async def test_a_version_published_through_a_registered_third_transport_serves_on_e1(
    engines, fixtures
) -> None:
    register_trainer_side()
    epoch = new_epoch()
    client = EngineClient("E1", engines[1].url, admin_key=ADMIN_KEY, transport=SHARED_FILE)  # by name
    registry = LoRAVersionRegistry(epoch=epoch, engines=("E1",))
    snap = snapshot_of(fixtures.adapter_dir("A"))
    try:
        result = await open_publisher(registry, {"E1": client}).publish(snap, "A")
        assert result.outcome is PublishOutcome.PUBLISHED, result
        assert len(snap.bucket_plan) > 1 and client.transport.sent == list(range(len(snap.bucket_plan)))
        status = await client.version_status(result.lora_name)
        assert status.state.value == "READY_LOCAL" and status.digest == snap.digest
        reply = await client.generate(
            {"input_ids": PROMPT, "lora_path": result.lora_name, "sampling_params": greedy(8)}
        )
        assert isinstance(reply, dict) and not generation_aborted(reply)
        assert len(reply["output_ids"]) == 8
    finally:
        left = await purge({"E1": client}, f"@{epoch}-")
        await aclose_all([client])
        assert not any(left.values()), left


async def test_a_delivery_that_loses_a_bucket_fails_typed_and_leaves_nothing_loaded(
    engines, fixtures
) -> None:
    register_trainer_side()
    epoch = new_epoch()
    lossy = bucket_transport(SHARED_FILE, drop=frozenset({1}))  # bucket 1's file is never written
    client = EngineClient("E1", engines[1].url, admin_key=ADMIN_KEY, transport=lossy)
    registry = LoRAVersionRegistry(epoch=epoch, engines=("E1",))
    try:
        result = await open_publisher(registry, {"E1": client}).publish(
            snapshot_of(fixtures.adapter_dir("A")), "A"
        )
        assert result.outcome is PublishOutcome.FAILED_CLEAN, result
        assert result.error is not None and result.error.code is ErrorCode.TRANSFER_FAILED
        assert lossy.sent == [0, 1]  # refused at the lost bucket; nothing after it was sent
        ours = [v for v in (await client.status()).versions if f"@{epoch}-" in v.lora_name]
        assert [(v.state.value, v.pinned) for v in ours] == [("CLEANED", False)]  # a tombstone only
        assert registry.status().default is None and registry.status().slots_used == 0
    finally:
        left = await purge({"E1": client}, f"@{epoch}-")
        await aclose_all([client])
        assert not any(left.values()), left
