"""The outcome every rank agrees on (relax_glue/trl/outcomes.py, ranks.py, publication.py): it
crosses the broadcast as builtins, the step publisher's record maps to a typed outcome, failures are counted
against the budget, a hang or an exception on rank 0 is a typed failure; and, in two real gloo
processes, a publication which never ends on rank 0 becomes the same typed failure on both ranks
instead of a rank left waiting in a collective."""

from __future__ import annotations

import concurrent.futures
import socket
from typing import Any

import pytest

from relax_glue.step_publisher import FAILED, PUBLISHED, SKIPPED, PublicationRecord
from relax_glue.trl import VersionsConfig
from relax_glue.trl.outcomes import OutcomeKind, PublicationFailed, PublicationOutcome, outcome_of
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo


def test_an_outcome_crosses_the_broadcast_as_builtins_and_comes_back_equal() -> None:
    o = PublicationOutcome(3, "step3", OutcomeKind.SKIPPED, code="CAPACITY_ERROR", attempts=4)
    wire = o.to_wire()
    assert all(isinstance(v, str | int | float | type(None)) for v in wire.values()), wire
    assert PublicationOutcome.from_wire(wire) == o


def record(outcome: str, refusals: tuple[str, ...] = (), detail: str = "", name: str | None = None):
    return PublicationRecord(3, "step3", name, outcome, 1, refusals, 0.0, 0, 10.0, 10.25, None, detail)


def test_a_step_publishers_record_maps_to_published_a_skip_or_a_typed_failure() -> None:
    ok = outcome_of(record(PUBLISHED, name="relax@e-step3-abc"))
    assert (ok.kind, ok.lora_name, ok.code, ok.seconds) == (
        OutcomeKind.PUBLISHED,
        "relax@e-step3-abc",
        None,
        0.25,
    )
    skipped = outcome_of(record(SKIPPED, ("CAPACITY_ERROR",) * 2, "capacity backpressure"))
    assert (skipped.kind, skipped.code, skipped.capacity_refusals) == (
        OutcomeKind.SKIPPED,
        "CAPACITY_ERROR",
        2,
    )
    forced = outcome_of(record(FAILED, ("CAPACITY_ERROR",)))
    assert (forced.kind, forced.code) == (OutcomeKind.FAILED, "CAPACITY_ERROR")
    clean = outcome_of(record("FAILED_CLEAN", ("CHECKSUM_MISMATCH",), "FAILED_CLEAN: bad bucket"))
    assert (clean.kind, clean.code) == (OutcomeKind.FAILED, "CHECKSUM_MISMATCH")
    assert "FAILED_CLEAN" in clean.detail
    unknown = outcome_of(record("OUTCOME_UNKNOWN", ("OUTCOME_UNKNOWN",)))
    assert (unknown.kind, unknown.code) == (OutcomeKind.FAILED, "OUTCOME_UNKNOWN")


def publication(max_failures: int, timeout_s: float = 120.0) -> StepPublication:
    config = VersionsConfig(max_failures=max_failures, publish_timeout_s=timeout_s)
    return StepPublication(None, RankInfo(), config)


def test_failures_are_counted_and_the_one_past_the_budget_raises_skips_never_do() -> None:
    v = publication(max_failures=1)
    v.record(PublicationOutcome(1, "step1", OutcomeKind.SKIPPED, code="CAPACITY_ERROR"))
    v.record(PublicationOutcome.failed(2, "step2", "CHECKSUM_MISMATCH"))
    assert v.failures == 1
    with pytest.raises(PublicationFailed) as err:
        v.record(PublicationOutcome.failed(3, "step3", "PUBLISH_TIMEOUT"))
    assert err.value.outcome.step == 3 and err.value.failures == 2
    assert [o.kind for o in v.outcomes] == [OutcomeKind.SKIPPED, OutcomeKind.FAILED, OutcomeKind.FAILED]


def test_settle_turns_a_hang_and_an_exception_into_typed_failures() -> None:
    v = publication(max_failures=0, timeout_s=0.05)
    hung: concurrent.futures.Future[Any] = concurrent.futures.Future()
    assert v.settle(4, hung).code == "PUBLISH_TIMEOUT"
    broken: concurrent.futures.Future[Any] = concurrent.futures.Future()
    broken.set_exception(ConnectionError("registry gone"))
    o = v.settle(4, broken)
    assert (o.kind, o.code, o.version_id) == (OutcomeKind.FAILED, "ConnectionError", "step4")


# ----------------------------------------------------------------- two ranks, one outcome


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_hung_publication_on_rank_0_is_the_same_typed_failure_on_both_ranks() -> None:
    import torch.multiprocessing as mp
    from _trl_rank_child import hung_publication_rank

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=hung_publication_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == [(0, "PUBLISH_TIMEOUT", 7), (1, "PUBLISH_TIMEOUT", 7)]
    assert all(p.exitcode == 0 for p in procs)
