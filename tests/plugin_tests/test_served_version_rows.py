"""The scheduler side of the attestation (issue 39), as pure logic: what each row of a step ran,
read from the slots the backend received, and one entry per output token. The real scheduler
path is tested on a real engine (test_served_version_engines.py)."""

from __future__ import annotations

from array import array

from lora_contract.served_version import BASE_MODEL, SERVED_TOKENS_KEY
from sglang_ext import served_version as sv


def test_a_row_runs_what_its_slot_holds_and_a_slot_of_rank_zero_is_the_base_model():
    names = [None, "A", "B"]  # slot 0: the base model's
    rows = sv.rows_served(([1, 2, 0, 1], [0, 8, 4]), ["ia", "ib", None, "ia"], names)
    assert rows == ["A", "B", BASE_MODEL, "A"]
    # a slot that held A before but has no rank this step: its rows run the base model
    assert sv.rows_served(([1], [0, 0, 4]), ["ia"], names) == [BASE_MODEL]


def test_what_cannot_be_read_is_unattested_never_guessed():
    names = [None, "A"]
    assert sv.rows_served(([1], [0, 8]), ["ia", "ib"], names) == [None, None]  # rows mismatch
    assert sv.rows_served(([5], [0, 8]), ["ia"], names) == [None]  # no such slot
    assert sv.rows_served(([1], [0, 8]), ["ia"], [None, None]) == [None]  # no ref for the holder
    assert sv.rows_served(sv.UNREADABLE, ["ia"], names) == [None]
    # the backend not asked: only an all-base batch (upstream skips it for that alone)
    assert sv.rows_served(None, [None, None], names) == [BASE_MODEL, BASE_MODEL]
    assert sv.rows_served(None, [None, "ia"], names) == [None, None]


class Req:
    def __init__(self) -> None:
        self.output_ids = array("q")
        self.customized_info = None
        self.lora_id = "ia"


def entries(req: Req) -> list:
    return req.customized_info[SERVED_TOKENS_KEY]


def test_each_new_token_gets_what_its_last_step_ran():
    req = Req()
    sv._SERVED[req] = "A"
    req.output_ids.append(7)
    sv.attest_new_tokens(req)
    sv.attest_new_tokens(req)  # nothing new: nothing added
    assert entries(req) == ["A"]
    sv._SERVED[req] = "B"
    req.output_ids.extend([8, 9])
    sv.attest_new_tokens(req)
    assert entries(req) == ["A", "B", "B"]
    del req.output_ids[1:]  # upstream restarted the output (a retraction of an embeds request)
    sv.attest_new_tokens(req)
    assert entries(req) == ["A"]
    fresh = Req()  # never seen by a step: unattested
    fresh.output_ids.append(1)
    sv.attest_new_tokens(fresh)
    assert entries(fresh) == [None]


def test_the_reporting_backend_notes_what_it_receives_and_is_still_the_backend():
    seen = []

    class Backend:
        def prepare_lora_batch(self, forward_batch, weight_indices, lora_ranks, scalings, graph):
            seen.append((weight_indices, lora_ranks))
            return "prepared"

    cls = sv.backend_that_reports_its_rows(Backend)
    assert sv.backend_that_reports_its_rows(Backend) is cls and issubclass(cls, Backend)
    backend = cls()
    assert backend.prepare_lora_batch("fb", [1, 0], [0, 8], [0.0, 1.0], False) == "prepared"
    assert sv._STEP.slots == ([1, 0], [0, 8]) and seen == [([1, 0], [0, 8])]
    backend.prepare_lora_batch("fb", weight_indices=[0], lora_ranks=[0], scalings=[0.0], graph=False)
    assert sv._STEP.slots == ([0], [0])
