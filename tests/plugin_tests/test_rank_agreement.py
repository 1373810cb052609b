"""Every TP rank's answer to a managed step, merged (sglang_ext.rank_agreement): the pure merge,
and the scheduler hooks' check-before-mutate with another rank's answers scripted in place of
the all-reduce and the gather (the engine tests, test_tp_engines.py, run the real collectives
between two real ranks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from _eventually import eventually_sync

from sglang_ext import lora_registry_patch as upstream
from sglang_ext import prepared_load as pl
from sglang_ext import rank_agreement as ranks
from sglang_ext.prepared_load import LoadKey, OffLoopWorker, Op, Preparations, State
from sglang_ext.rank_agreement import RankAnswer, merge
from sglang_ext.step_fence import complete_the_step_before_unload

NAME = "relax_policy_lora@1-1-abcdefabcdef"
KEY = LoadKey("id-1", NAME, "/staged/attempt-0")
PENDING = pl.PENDING_MESSAGE

# ------------------------------------------------------------------------------ the merge


def test_one_rank_is_its_own_answer() -> None:
    only = RankAnswer(False, "boom", {"a": "/a"})
    assert merge([only]) == ranks.Merged(False, False, "boom", {"a": "/a"})


def test_every_rank_must_succeed_and_each_failure_names_its_rank() -> None:
    ok = RankAnswer(True, None, {NAME: "/p"})
    assert merge([ok, ok]).success
    out = merge([ok, RankAnswer(False, "disk read failed", {})])
    assert not out.success and not out.pending
    assert out.error_message == "TP rank 1: disk read failed"
    two = merge([RankAnswer(False, "x"), RankAnswer(False, None)])
    assert two.error_message == "TP rank 0: x; TP rank 1: failed"


def test_a_poll_is_pending_until_every_rank_is_ready_and_a_failure_wins_over_pending() -> None:
    ready, waiting = RankAnswer(True), RankAnswer(False, PENDING, pending=True)
    out = merge([ready, waiting], PENDING)
    assert not out.success and out.pending and out.error_message == PENDING
    out = merge([waiting, RankAnswer(False, "corrupt file")], PENDING)
    assert not out.success and not out.pending and out.error_message == "TP rank 1: corrupt file"


def test_what_any_rank_holds_is_held() -> None:
    """A load some rank still holds reads as loaded: the main process takes it out of every rank."""
    out = merge([RankAnswer(False, "x", {"other": "/o"}), RankAnswer(False, "y", {NAME: "/p"})])
    assert out.loaded_adapters == {"other": "/o", NAME: "/p"}
    assert merge([RankAnswer(True), RankAnswer(True)]).loaded_adapters is None


def test_a_pending_answer_is_told_apart_only_by_the_pending_text() -> None:
    assert RankAnswer.of(
        SimpleNamespace(success=False, error_message=PENDING, loaded_adapters=None), PENDING
    ).pending
    other = SimpleNamespace(success=False, error_message="boom", loaded_adapters=None)
    assert not RankAnswer.of(other, PENDING).pending


# ------------------------------------------------- the hooks, with rank 1's answers scripted


class Peer:
    """Rank 1, as the gather returns it: one scripted answer per gather, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *answers: RankAnswer) -> None:
        self.answers = list(answers)
        self.gathered: list[RankAnswer] = []
        monkeypatch.setattr(upstream, "tp_peers", lambda scheduler: (2, "gloo group"))
        monkeypatch.setattr(ranks, "gather", self.gather)
        monkeypatch.setattr(ranks, "worst_kind", self.worst_kind)

    def worst_kind(self, scheduler: Any, kind: int) -> int:
        """The all-reduce: rank 1's answer is used up here unless a gather follows (a failure)."""
        assert self.answers, "an all-reduce rank 1 would not have made: the ranks would hang"
        worst = min(kind, ranks.kind_of(self.answers[0]))
        if worst != ranks.FAILED:
            self.answers.pop(0)
        return worst

    def gather(self, scheduler: Any, answer: RankAnswer) -> list[RankAnswer]:
        assert self.answers, "a gather rank 1 would not have made: the ranks would hang"
        self.gathered.append(answer)
        return [answer, self.answers.pop(0)]


class Manager:
    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    def create_lora_update_result(self, success: bool, error_message: str = "") -> Any:
        return upstream.lora_update_output(success, error_message, dict(self.loaded))


@pytest.fixture
def rank0(monkeypatch: pytest.MonkeyPatch) -> Any:
    preps = Preparations(OffLoopWorker("test-prepare"))
    monkeypatch.setattr(pl, "PREPARATIONS", preps)
    manager = Manager()
    scheduler = SimpleNamespace(manager=manager, taken_back=[])
    monkeypatch.setattr(upstream, "lora_manager_of", lambda s: s.manager)

    def take_back(s: Any, lora_name: str, lora_id: str) -> Any:
        s.taken_back.append(lora_id)
        s.manager.loaded.pop(lora_name, None)

    monkeypatch.setattr(upstream, "take_back_a_load", take_back)
    assert preps.start(KEY, lambda: "prepared") is None
    eventually_sync(lambda: preps.state(KEY)[0] is State.PREPARED)
    return scheduler


def request(op: Op) -> Any:
    return SimpleNamespace(
        rid=pl.rid_for(op), lora_name=KEY.lora_name, lora_path=KEY.lora_path, lora_id=KEY.lora_id
    )


def installing(scheduler: Any, calls: list[str], success: bool = True) -> Any:
    def original(self: Any, recv_req: Any) -> Any:
        calls.append("install")
        if success:
            pl.PREPARATIONS.take(KEY)
            self.manager.loaded[NAME] = KEY.lora_path
        return self.manager.create_lora_update_result(success, "" if success else "pool refused")

    return original


def test_an_install_waits_for_every_rank_to_be_prepared_and_changes_nothing_otherwise(
    monkeypatch, rank0
) -> None:
    peer = Peer(monkeypatch, RankAnswer(False, "nothing prepared to install: unknown"))
    calls: list[str] = []
    out = pl.prepare_then_install(installing(rank0, calls), rank0, request(Op.INSTALL))
    assert not out.success and out.error_message == "TP rank 1: nothing prepared to install: unknown"
    assert calls == [], "no rank installs unless every rank can"
    assert pl.PREPARATIONS.state(KEY)[0] is State.PREPARED, "the main process's discard drops it"
    assert peer.answers == [] and len(peer.gathered) == 1


def test_an_install_that_failed_on_another_rank_is_taken_back_out_of_this_one(monkeypatch, rank0) -> None:
    peer = Peer(
        monkeypatch, RankAnswer(True), RankAnswer(False, "pool refused", {}), RankAnswer(False, None, {})
    )
    calls: list[str] = []
    out = pl.prepare_then_install(installing(rank0, calls), rank0, request(Op.INSTALL))
    assert calls == ["install"] and rank0.taken_back == [KEY.lora_id]
    assert not out.success and out.error_message == "TP rank 1: pool refused"
    assert NAME not in (out.loaded_adapters or {}), "no rank holds it when rank 0 replies"
    assert peer.answers == [], "every rank gathered as often as this one"


def test_a_rank_whose_own_install_failed_gathers_as_often_as_the_one_that_takes_it_back(
    monkeypatch, rank0
) -> None:
    peer = Peer(
        monkeypatch, RankAnswer(True), RankAnswer(True, None, {NAME: "/p"}), RankAnswer(False, None, {})
    )
    calls: list[str] = []
    out = pl.prepare_then_install(installing(rank0, calls, success=False), rank0, request(Op.INSTALL))
    assert rank0.taken_back == [], "nothing to take back here"
    assert not out.success and "TP rank 0: pool refused" in out.error_message
    assert peer.answers == []


def test_an_install_on_every_rank_succeeds(monkeypatch, rank0) -> None:
    Peer(monkeypatch, RankAnswer(True), RankAnswer(True, None, {NAME: "/p"}))
    calls: list[str] = []
    out = pl.prepare_then_install(installing(rank0, calls), rank0, request(Op.INSTALL))
    assert out.success and calls == ["install"] and rank0.taken_back == []


def test_a_poll_is_ready_only_when_every_rank_is(monkeypatch, rank0) -> None:
    Peer(monkeypatch, RankAnswer(False, PENDING, pending=True), RankAnswer(True))
    hook = pl.prepare_then_install
    first = hook(None, rank0, request(Op.POLL))
    assert not first.success and first.error_message == PENDING
    assert hook(None, rank0, request(Op.POLL)).success


def test_a_discard_gathers_nothing(monkeypatch, rank0) -> None:
    peer = Peer(monkeypatch)
    assert pl.prepare_then_install(None, rank0, request(Op.DISCARD)).success
    assert peer.gathered == [] and pl.PREPARATIONS.state(KEY)[0] is State.UNKNOWN


def test_an_unload_waits_for_the_fence_on_every_rank(monkeypatch) -> None:
    """Rank 1's fence refused: no rank unloads (check before mutate)."""
    peer = Peer(monkeypatch, RankAnswer(False, "step fence: unknown completion"))
    one_of_two = SimpleNamespace(world_size=2, rank_in_group=0)
    scheduler = SimpleNamespace(enable_overlap=False, result_queue=[], last_batch=None, tp_group=one_of_two)
    calls: list[str] = []

    def unload(self: Any, recv_req: Any) -> Any:
        calls.append("unload")
        return upstream.lora_update_output(True)

    req = SimpleNamespace(lora_name=NAME, lora_id="L1")
    out = complete_the_step_before_unload(unload, scheduler, req)
    assert not out.success and "TP rank 1: step fence" in out.error_message and calls == []
    peer.answers = [RankAnswer(True), RankAnswer(False, "rank 1 unload failed")]
    out = complete_the_step_before_unload(unload, scheduler, req)
    assert calls == ["unload"] and not out.success and "TP rank 1: rank 1 unload failed" in out.error_message
