"""The engine's end of the transports registered at the contract (issue 37, item 4): a receive
is registered under a name the contract knows, an engine builds one of each at start, and the
route mounts a transport's own setup calls (the collective's group connect) only where its
receive is, with no transport named in the route."""

from __future__ import annotations

import pytest
from _fake_native import FakeNative, fake_staging

from lora_contract.protocol import COLLECTIVE_TRANSPORT, HTTP_TRANSPORT, Routes
from sglang_ext.bucket_sources import ReceiveSetup, build_receives, register_receive
from sglang_ext.collective_receive import CollectiveReceive
from sglang_ext.engine_state import EngineState, assemble_engine
from sglang_ext.http_routes import build_routes
from sglang_ext.version_table import StagingLimits, VersionTable


def setup() -> ReceiveSetup:
    return ReceiveSetup(fake_staging(), 10**8, "inc", lambda _m: None)


def test_a_receive_is_registered_only_under_an_out_of_band_name_the_contract_knows() -> None:
    with pytest.raises(ValueError):
        register_receive("never-registered", lambda s: CollectiveReceive.build(s))
    with pytest.raises(ValueError):
        register_receive(HTTP_TRANSPORT, lambda s: CollectiveReceive.build(s))  # bodies need none


def test_an_engine_builds_the_collective_receive_with_its_incarnation() -> None:
    receives = {r.transport: r for r in build_receives(setup())}
    collective = receives[COLLECTIVE_TRANSPORT]
    assert isinstance(collective, CollectiveReceive) and collective.incarnation == "inc"
    assert [r.path for r in collective.setup_routes()] == [Routes.COLLECTIVE_CONNECT]


def paths(out_of_band: list) -> set[str]:
    from _publication_shell import GEOMETRY

    from sglang_ext.adapter_compat import EngineLoraShape

    limits = StagingLimits(2, EngineLoraShape(GEOMETRY, 8, None), 10**9, 10**8)
    state = assemble_engine(
        EngineState(incarnation="inc"),
        VersionTable("inc", limits),
        FakeNative(),
        fake_staging(),
        out_of_band=out_of_band,
    )
    return {path for path, _endpoint, _methods in build_routes(state)}


def test_the_route_mounts_a_transports_setup_call_only_where_its_receive_is() -> None:
    with_collective = paths(build_receives(setup()))
    assert Routes.COLLECTIVE_CONNECT in with_collective
    assert Routes.COLLECTIVE_CONNECT not in paths([])  # an engine built with HTTP only
    assert with_collective - paths([]) == {Routes.COLLECTIVE_CONNECT}
