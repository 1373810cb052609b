"""The acceptance suite's own rules, pure (no engine): the epsilon derived from the baselines'
spread, the scoring positions that tell A from B, RFC 7.3's no-progress gap, latency
percentiles, and the report's thresholds, fixed once and on disk before the run they govern."""

from __future__ import annotations

import json

import pytest
from _acceptance import (
    Report,
    Stream,
    derive_epsilon,
    latency_summary,
    max_no_progress_gap,
    scoring_positions,
    spread,
)

from lora_versions_dev.device_profile import cpu_profile


def test_epsilon_is_the_largest_measured_spread_times_the_factor_never_below_the_floor() -> None:
    assert spread([[-1.0, -2.0], [-1.0, -2.0]]) == 0.0
    assert spread([[-1.0, -2.0], [-1.5, -2.0], [-1.2, -1.9]]) == pytest.approx(0.5)
    assert derive_epsilon([0.0, 0.0], 2.0, 0.0) == 0.0  # no spread and no floor: bit-equality
    assert derive_epsilon([0.001, 0.004], 2.0, 0.001) == pytest.approx(0.008)
    assert derive_epsilon([0.0], 2.0, 0.001) == 0.001


def test_scoring_positions_are_where_the_versions_differ_by_more_than_two_epsilon() -> None:
    own, other = [-1.0, -2.0, -3.0, -4.0], [-1.0, -2.05, -3.3, -2.0]
    assert scoring_positions(own, other, 0.0) == [1, 2, 3]
    assert scoring_positions(own, other, 0.1) == [2, 3]  # 0.3 > 0.2, 0.05 is not
    assert scoring_positions(own, other, 1.0) == []
    with pytest.raises(ValueError):
        scoring_positions(own, other[:2], 0.0)


def _stream(engine: str, started: float, chunks: list[float]) -> Stream:
    return Stream("s", "A", engine, started, t=chunks)


def test_no_progress_gap_counts_only_time_with_a_request_in_flight_and_no_chunk() -> None:
    streams = [
        _stream("E0", 0.0, [0.1, 0.2, 0.3]),
        _stream("E0", 0.25, [0.35, 2.35]),  # 2.0 s without a chunk while in flight: a stall
        _stream("E0", 5.0, [5.1]),  # idle from 2.35 to 5.0: not a gap
        _stream("E1", 0.0, [0.5, 0.6]),
    ]
    assert max_no_progress_gap(streams, "E0", 0.0, 10.0) == pytest.approx(2.0)
    assert max_no_progress_gap(streams, "E1", 0.0, 10.0) == pytest.approx(0.5)  # a prefill waited 0.5 s
    assert max_no_progress_gap(streams, "E0", 3.0, 10.0) == pytest.approx(0.1)  # clipped to the window
    assert max_no_progress_gap(streams, "E0", 0.0, 1.0) == pytest.approx(0.65)
    assert max_no_progress_gap([], "E0", 0.0, 1.0) == 0.0


def test_latency_summary_gives_nearest_rank_percentiles() -> None:
    summary = latency_summary([float(i) for i in range(1, 101)])
    assert summary == {"n": 100, "p50_s": 50.0, "p95_s": 95.0, "p99_s": 99.0, "max_s": 100.0}


def test_a_threshold_is_fixed_once_and_written_before_the_run(tmp_path) -> None:
    report = Report(cpu_profile(), tmp_path, {"code": {"commit": "abc"}})
    assert report.fix("rfc73.max_no_progress_gap_s", 5.0, "cpu") == 5.0
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["thresholds"]["rfc73.max_no_progress_gap_s"]["value"] == 5.0
    assert on_disk["provenance"] == {"code": {"commit": "abc"}}
    assert report.fix("rfc73.max_no_progress_gap_s", 5.0) == 5.0  # the same value again: fine
    with pytest.raises(ValueError, match=r"fixed at 5\.0"):
        report.fix("rfc73.max_no_progress_gap_s", 50.0)
    assert (
        json.loads((tmp_path / "report.json").read_text())["thresholds"]["rfc73.max_no_progress_gap_s"][
            "value"
        ]
        == 5.0
    )
