"""The parts of the publication scale bench (issue 42, ``bench/scale_publication.py``) that need no
engine: its HTTP/1.1 byte count, and its short form over HTTP (engine shells in process: the
plugin's real routes over the fake native edge), where the trainer's egress grows with N and an
engine lost mid-publication never lets the publication commit nor leaves anything staged."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is run from the repository root
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    path = REPO / "bench" / "scale_publication.py"
    spec = importlib.util.spec_from_file_location("scale_publication", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["scale_publication"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_a_request_counts_as_the_bytes_http11_puts_on_the_wire(bench: ModuleType) -> None:
    sized = httpx.Request("POST", "http://e0.local:30000/x", content=b"hello")
    conn, head = bench.request_head(sized)
    assert head == len(b"POST /x HTTP/1.1\r\nHost: e0.local:30000\r\nContent-Length: 5\r\n\r\n")
    assert bench.body_framing(conn, b"hello") == 5  # a sized body goes as it is

    async def two() -> object:
        yield b"hello"
        yield b"world!"

    chunked = httpx.Request("POST", "http://e0.local:30000/x", content=two())
    conn, _ = bench.request_head(chunked)
    # chunked: a size line and a CRLF around each chunk
    assert bench.body_framing(conn, b"hello") == len(b"5\r\nhello\r\n")
    assert bench.body_framing(conn, memoryview(b"world!")) == len(b"6\r\nworld!\r\n")
    assert bench.response_bytes(200, [(b"content-length", b"2")], b"{}") == len(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    )


def test_the_adapter_is_the_size_the_bench_says(bench: ModuleType) -> None:
    pytest.importorskip("torch")
    snap = bench.Adapters(1, 256 * 1024, seed=0).snapshot(0)
    assert snap.total_bytes == bench.BYTES_PER_RANK
    assert bench.rank_for(10.0) == 4 and bench.rank_for(0.1) == 1
    assert len(snap.bucket_plan) == 10
    assert snap.digest != bench.Adapters(1, 256 * 1024, seed=0).snapshot(1).digest  # a new version


async def test_short_form_egress_grows_with_n_and_a_lost_engine_never_commits(bench: ModuleType) -> None:
    pytest.importorskip("torch")
    cfg = bench.short_config(seed=3)
    cfg.reps = 1
    cells = await bench.measure(cfg, log=lambda _m: None)
    assert [(c.transport, c.engines) for c in cells] == [("http", 2), ("http", 4)]
    two, four = cells
    for cell in cells:
        for pub in [cell.first, *cell.reps]:
            assert pub.outcome == "PUBLISHED"
            assert pub.group_egress == 0  # HTTP only: nothing over a collective group
            # every engine got every bucket, and one begin, end and status read
            assert pub.calls["receive_bucket"] == cell.buckets * cell.engines
            assert pub.calls["begin"] == pub.calls["end"] == cell.engines
            # each engine's share: the adapter's bytes and a few percent of headers and manifest
            per_engine = pub.egress / cell.engines
            assert cell.adapter_bytes < per_engine < 1.10 * cell.adapter_bytes
            assert pub.egress_by_op["receive_bucket"] > cell.adapter_bytes * cell.engines
        lost = cell.lost
        assert lost is not None
        # the commit rule: no commit without every engine READY; the default never moved
        assert not lost.committed and lost.outcome == "OUTCOME_UNKNOWN", lost
        assert lost.registry_state == "LOADING" and not lost.default_moved
        assert lost.unknown_engines == [lost.engine]
        # cleanup: every engine that answers confirmed it; the lost one declared lost frees the slot
        assert lost.cleanup_outcome == "CLEANUP_PENDING" and lost.final_state == "FAILED_CLEAN"
        assert lost.leftovers == {}  # no survivor kept a version, a loaded adapter or a staged file
    # HTTP fan-out: the trainer sends every engine every byte, so egress is linear in N
    assert four.p50("egress") == pytest.approx(2 * two.p50("egress"), rel=0.01)
    rows = bench.table_rows(cells)
    assert [r[0] for r in rows] == ["2", "4"] and all(r[-1] == "0" for r in rows)
