"""A third transport plugs in at the contract on both sides (issue 37, item 4), in process: the
test-only "shared-file" transport (``tests/engine_wrappers/fake_transport_shared_file.py``)
registers its engine end and its trainer end, and the REAL publisher publishes through it to the
REAL engine shell and routes (the fake engine's; only the native edge is fake). Nothing in the
contract, the route, the shell, the client or the publisher names it. The same transport on a
real engine (E1): ``test_fake_transport_engines.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _fake_engine
import httpx
import pytest
from _fake_engine import FakeEngine, make_snapshot
from _rg_helpers import new_registry
from engine_wrappers.fake_transport_shared_file import (
    SHARED_FILE,
    register_engine_side,
    register_trainer_side,
)

from lora_contract.errors import ErrorCode, LoraVersionError
from lora_contract.protocol import EngineVersionState
from relax_glue.bucket_transport import bucket_transport
from relax_glue.cohort import open_publisher
from relax_glue.engine_client import EngineClient
from relax_glue.publisher import PublishOutcome
from sglang_ext.bucket_sources import ReceiveSetup, build_receives


@pytest.fixture()
def shared_dir(tmp_path: Path) -> Path:
    register_engine_side(tmp_path)
    register_trainer_side(tmp_path)
    return tmp_path


@pytest.fixture()
def with_registered_receives(monkeypatch: pytest.MonkeyPatch, shared_dir: Path) -> Iterator[None]:
    """Fake engines built in this test get every registered receive, as a real engine does at
    start (``EngineState.attach``)."""
    real = _fake_engine.assemble_engine

    def assemble(state: Any, table: Any, native: Any, staging: Any, **kwargs: Any) -> Any:
        setup = ReceiveSetup(staging, table.limits.max_bucket_bytes, state.incarnation, lambda _m: None)
        return real(state, table, native, staging, out_of_band=build_receives(setup), **kwargs)

    monkeypatch.setattr(_fake_engine, "assemble_engine", assemble)
    yield


def client_of(engine: FakeEngine, transport: Any) -> EngineClient:
    return EngineClient(
        engine.engine_id,
        f"http://{engine.engine_id.lower()}.fake",
        control_transport=httpx.MockTransport(engine.handle),
        generation_transport=httpx.MockTransport(engine.handle),
        transport=transport,
    )


async def test_the_publisher_publishes_through_a_transport_registered_on_both_sides(
    with_registered_receives: None, shared_dir: Path
) -> None:
    engines = {e: FakeEngine(e) for e in ("E0", "E1")}
    clients = {e: client_of(f, SHARED_FILE) for e, f in engines.items()}  # built by name
    snap = make_snapshot(1)
    result = await open_publisher(new_registry(), clients).publish(snap, "v1")
    assert result.outcome is PublishOutcome.PUBLISHED, result
    buckets = len(snap.bucket_plan)
    for e, c in clients.items():
        assert c.transport.begin_transport == SHARED_FILE and c.transport.sent == list(range(buckets))
        assert engines[e].state_of(result.lora_name) is EngineVersionState.READY_LOCAL
    assert [f for d in shared_dir.iterdir() for f in d.iterdir()] == []  # each file went once acknowledged


async def test_a_lost_delivery_fails_typed_and_leaves_nothing_loaded(
    with_registered_receives: None, shared_dir: Path
) -> None:
    """Bucket 1 never reaches the shared directory: the engine refuses its acknowledgement
    (TRANSFER_FAILED), the publisher cleans the attempt up everywhere and frees the slot."""
    engines = {e: FakeEngine(e) for e in ("E0", "E1")}
    clients = {"E0": client_of(engines["E0"], SHARED_FILE)}
    clients["E1"] = client_of(engines["E1"], bucket_transport(SHARED_FILE, drop={1}))
    registry = new_registry()
    result = await open_publisher(registry, clients).publish(make_snapshot(2), "v1")
    assert result.outcome is PublishOutcome.FAILED_CLEAN, result
    assert result.error is not None and result.error.code is ErrorCode.TRANSFER_FAILED
    for f in engines.values():
        assert not [v for v in f.versions.values() if v.state.holds_slot]
    assert registry.status().default is None and registry.status().slots_used == 0


async def test_an_engine_without_the_transports_receive_refuses_the_begin_and_changes_nothing(
    shared_dir: Path,
) -> None:
    """The name is registered at the contract but this engine has no receive for it:
    TRANSPORT_UNAVAILABLE at begin, before its table changes."""
    engine = FakeEngine("E0")  # built without the registered receives
    client = client_of(engine, SHARED_FILE)
    snap = make_snapshot(3)
    result = await open_publisher(new_registry(engines=("E0",)), {"E0": client}).publish(snap, "v1")
    assert result.outcome is PublishOutcome.FAILED_CLEAN, result
    assert result.error is not None and result.error.code is ErrorCode.TRANSPORT_UNAVAILABLE
    assert not [v for v in engine.versions.values() if v.state.holds_slot]


def test_a_name_the_contract_does_not_know_is_refused_on_the_trainer_side() -> None:
    with pytest.raises(LoraVersionError) as err:
        bucket_transport("pigeon")
    assert err.value.code is ErrorCode.INVALID_REQUEST
