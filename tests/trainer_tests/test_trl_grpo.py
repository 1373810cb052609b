"""The TRL integration's decisions, without engines (relax_glue/trl_grpo.py): the outcome every
rank agrees on, the assembly of a multi-turn completion for TRL,
and, in two real gloo processes, that a publication which never ends on rank 0 becomes the same
typed failure on both ranks instead of a rank left waiting in a collective."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from _publish_results import result

from lora_contract.errors import ErrorCode
from relax_glue.backpressure import StalenessPolicy
from relax_glue.publisher import PublishOutcome, PublishResult
from relax_glue.registry_types import VersionState
from relax_glue.trl_grpo import (
    CompletionRecord,
    GRPOVersions,
    OutcomeKind,
    PublicationFailed,
    PublicationOutcome,
    RankInfo,
    Segment,
    VersionsConfig,
    assemble_completion,
    group_names,
    outcome_of,
    rollout_output,
    sampling_params,
    turn_logprobs,
)

# ---------------------------------------------------------------------------------- outcomes


def test_an_outcome_crosses_the_broadcast_as_builtins_and_comes_back_equal() -> None:
    o = PublicationOutcome(3, "step3", OutcomeKind.SKIPPED, code="CAPACITY_ERROR", attempts=4)
    wire = o.to_wire()
    assert all(isinstance(v, str | int | float | type(None)) for v in wire.values()), wire
    assert PublicationOutcome.from_wire(wire) == o


def test_a_publish_result_maps_to_published_or_a_typed_failure() -> None:
    kw = {"attempts": 1, "capacity_refusals": 0, "seconds": 0.1}
    ok = outcome_of(3, "step3", result(PublishOutcome.PUBLISHED, state=VersionState.PUBLISHED), **kw)
    assert (ok.kind, ok.lora_name, ok.code) == (OutcomeKind.PUBLISHED, "relax@e-step3-abc", None)
    clean = result(PublishOutcome.FAILED_CLEAN, ErrorCode.CHECKSUM_MISMATCH, VersionState.FAILED_CLEAN)
    failed = outcome_of(3, "step3", clean, **kw)
    assert (failed.kind, failed.code) == (OutcomeKind.FAILED, "CHECKSUM_MISMATCH")
    assert "FAILED_CLEAN" in failed.detail
    unknown = outcome_of(3, "step3", result(PublishOutcome.OUTCOME_UNKNOWN, state=VersionState.LOADING), **kw)
    assert (unknown.kind, unknown.code) == (OutcomeKind.FAILED, "OUTCOME_UNKNOWN")


def versions(max_failures: int, timeout_s: float = 120.0, rank: RankInfo | None = None) -> GRPOVersions:
    config = VersionsConfig(max_failures=max_failures, publish_timeout_s=timeout_s)
    return GRPOVersions(None, rank or RankInfo(), "e", None, None, {}, None, config)  # type: ignore[arg-type]


def test_failures_are_counted_and_the_one_past_the_budget_raises_skips_never_do() -> None:
    v = versions(max_failures=1)
    v.record(PublicationOutcome(1, "step1", OutcomeKind.SKIPPED, code="CAPACITY_ERROR"))
    v.record(PublicationOutcome.failed(2, "step2", "CHECKSUM_MISMATCH"))
    assert v.failures == 1
    with pytest.raises(PublicationFailed) as err:
        v.record(PublicationOutcome.failed(3, "step3", "PUBLISH_TIMEOUT"))
    assert err.value.outcome.step == 3 and err.value.failures == 2
    assert [o.kind for o in v.outcomes] == [OutcomeKind.SKIPPED, OutcomeKind.FAILED, OutcomeKind.FAILED]


def test_settle_turns_a_hang_and_an_exception_into_typed_failures() -> None:
    v = versions(max_failures=0, timeout_s=0.05)
    hung: concurrent.futures.Future[Any] = concurrent.futures.Future()
    assert v.settle(4, hung).code == "PUBLISH_TIMEOUT"
    broken: concurrent.futures.Future[Any] = concurrent.futures.Future()
    broken.set_exception(ConnectionError("registry gone"))
    o = v.settle(4, broken)
    assert (o.kind, o.code, o.version_id) == (OutcomeKind.FAILED, "ConnectionError", "step4")


# ------------------------------------------------------------------------------ completions


def test_a_multi_turn_completion_masks_the_tool_tokens_and_zeroes_their_logprobs() -> None:
    segs = [Segment((5, 6), (-0.1, -0.2)), Segment((7, 8, 9)), Segment((10,), (-0.3,))]
    ids, lps, mask = assemble_completion(segs)
    assert ids == [5, 6, 7, 8, 9, 10]
    assert lps == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert mask == [1, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError):
        assemble_completion([Segment((1, 2), (-0.1,))])


def test_engine_logprobs_must_name_the_sampled_tokens() -> None:
    reply = {"output_ids": [4, 9], "meta_info": {"output_token_logprobs": [[-0.5, 4, "a"], [-1.5, 9, "b"]]}}
    assert turn_logprobs(reply) == [-0.5, -1.5]
    with pytest.raises(ValueError):
        turn_logprobs({**reply, "output_ids": [4, 8]})


def test_one_group_per_prompt_run_shared_by_equal_prompts_of_one_step() -> None:
    chat = [{"role": "user", "content": "6 x 7?"}]
    other = [{"role": "user", "content": "days in a week?"}]
    names = group_names([chat, chat, other, other], step=3)
    assert names[0] == names[1] != names[2] == names[3]
    assert group_names([chat], step=4)[0] != names[0]  # another step, another group
    assert group_names(["plain text"], 3)[0].startswith("s3-")


def test_sampling_follows_trls_config() -> None:
    class Args:
        temperature, top_p, top_k, min_p, repetition_penalty = 0.9, 0.95, 0, None, 1.0

    p = sampling_params(Args(), 8, ignore_eos=True)
    assert p == {"temperature": 0.9, "top_p": 0.95, "top_k": -1, "max_new_tokens": 8, "ignore_eos": True}
    Args.top_k, Args.min_p = 20, 0.05
    p = sampling_params(Args(), 8)
    assert (p["top_k"], p["min_p"]) == (20, 0.05)


def test_rollout_output_gives_trl_one_entry_per_completion_and_masks_a_failed_one() -> None:
    ok = CompletionRecord(2, 0, 0, "g", "s0", [1, 2], bound_version="lora@e-step2-x", version_id="step2")
    ok.segments = [Segment((5,), (-0.1,)), Segment((7,)), Segment((6,), (-0.2,))]
    bad = CompletionRecord(2, 0, 1, "g", "s1", [1, 2], error="TurnOutcomeUnknown: lost")
    out = rollout_output([ok, bad], fallback_id=3)
    assert out["prompt_ids"] == [[1, 2], [1, 2]]
    assert out["completion_ids"] == [[5, 7, 6], [3]]
    assert out["env_mask"] == [[1, 0, 1], [0]]
    assert out["logprobs"] == [[-0.1, 0.0, -0.2], [0.0]]
    assert out["bound_version"] == ["lora@e-step2-x", None]
    assert out["version_id"] == ["step2", None]
    assert out["assistant_ids"] == [[5, 6], []]
    assert out["rollout_error"] == [None, "TurnOutcomeUnknown: lost"]


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


# ------------------------------------------------------------ one episode (a fake session layer)


class FakeSession:
    """What ``_episode`` uses of a Session: generate (each reply 2 tokens), requests, close."""

    def __init__(self, hang_at: int | None) -> None:
        self.key, self.hang_at = "ep.key", hang_at
        self.bodies: list[dict] = []
        self.requests: list[SimpleNamespace] = []
        self.closes = 0

    async def generate(self, body: dict) -> dict:
        n = len(self.bodies)
        self.bodies.append(body)
        if n == self.hang_at:
            await asyncio.Event().wait()  # an engine that never answers
        out = [10 + 2 * n, 11 + 2 * n]
        self.requests.append(
            SimpleNamespace(rid=f"r{n}", lora_path="lora@e-step1-x", engine_id="E0", outcome="ok")
        )
        return {"output_ids": out, "meta_info": {"output_token_logprobs": [[-0.5, t, ""] for t in out]}}

    async def close(self) -> SimpleNamespace:
        self.closes += 1
        key = SimpleNamespace(version_id="step1")
        return SimpleNamespace(
            released=True, binding=SimpleNamespace(lora_name="lora@e-step1-x", version_key=key)
        )


class FakeSessions:
    def __init__(self, hang_at: int | None = None) -> None:
        self.opened: list[tuple[str, str | None, FakeSession]] = []
        self.hang_at = hang_at

    async def open(self, name: str, *, group: str | None = None) -> FakeSession:
        s = FakeSession(self.hang_at)
        self.opened.append((name, group, s))
        return s


def episode_versions(sessions: FakeSessions, timeout_s: float = 30.0) -> GRPOVersions:
    config = VersionsConfig(episode_timeout_s=timeout_s)
    return GRPOVersions(None, RankInfo(), "e", sessions, None, {}, None, config)  # type: ignore[arg-type]


async def test_an_episode_is_assistant_tool_assistant_on_one_session_then_closed() -> None:
    seen: list[list[list[int]]] = []

    def tool(prompt: Any, turns: list[list[int]]) -> list[int]:
        seen.append(turns)
        return [90, 91, 92]

    sessions = FakeSessions()
    v = episode_versions(sessions)
    rec = await v._episode(0, "q", [1, 2], "s1-g", 1, {"max_new_tokens": 2}, tool, 2)
    ((_, group, s),) = sessions.opened
    assert group == "s1-g" and s.closes == 1 and rec.error is None
    assert seen == [[[10, 11]]]  # the tool saw the first assistant turn
    assert [b["input_ids"] for b in s.bodies] == [[1, 2], [1, 2, 10, 11, 90, 91, 92]]
    assert all(b["return_logprob"] for b in s.bodies)
    assert (rec.bound_version, rec.version_id, rec.released) == ("lora@e-step1-x", "step1", True)
    assert [t.lora_path for t in rec.turns] == ["lora@e-step1-x"] * 2
    out = rollout_output([rec], fallback_id=3)
    assert out["completion_ids"] == [[10, 11, 90, 91, 92, 12, 13]]
    assert out["env_mask"] == [[1, 1, 0, 0, 0, 1, 1]]


async def test_an_episode_that_never_ends_is_a_recorded_masked_failure_and_its_session_closes() -> None:
    sessions = FakeSessions(hang_at=1)
    v = episode_versions(sessions, timeout_s=0.2)
    rec = await v._episode(0, "q", [1, 2], "g", 1, {}, lambda p, t: [90], 2)
    s = sessions.opened[0][2]
    assert rec.error is not None and rec.error.startswith("TimeoutError") and s.closes == 1
    out = rollout_output([rec], fallback_id=3)
    assert (out["completion_ids"], out["env_mask"], out["rollout_error"]) == ([[3]], [[0]], [rec.error])


# ----------------------------------------------------- backpressure (a fake publisher, rank 0)


class FakePublisher:
    """``publish`` answers each of ``results`` in turn (the last one forever); every slot stays
    held (the registry's status) unless ``free_after`` reclaims happened."""

    def __init__(self, results: list[PublishResult], free_after: int | None = None) -> None:
        self.results, self.free_after = results, free_after
        self.published = self.reclaims = 0
        self.registry = SimpleNamespace(status=self._status)

    async def _status(self) -> SimpleNamespace:
        free = self.free_after is not None and self.reclaims >= self.free_after
        return SimpleNamespace(slots_used=1 if free else 2, capacity=2)

    async def resolve(self, snapshot: Any = None) -> None:
        return None

    async def reclaim_ready(self) -> tuple:
        self.reclaims += 1
        return ()

    async def publish(self, snapshot: Any, vid: str) -> PublishResult:
        self.published += 1
        return self.results[min(self.published, len(self.results)) - 1]


CAPACITY = result(PublishOutcome.REFUSED, ErrorCode.CAPACITY_ERROR)
PUBLISHED = result(PublishOutcome.PUBLISHED, state=VersionState.PUBLISHED)


def publishing(pub: FakePublisher, last: int, forced_wait_s: float = 60.0) -> GRPOVersions:
    policy = StalenessPolicy(max_staleness=2, reclaim_wait_s=0.2, forced_wait_s=forced_wait_s)
    v = GRPOVersions(None, RankInfo(), "e", None, pub, {}, None, VersionsConfig(policy=policy))  # type: ignore[arg-type]
    v.last_published = last
    return v


async def test_capacity_held_is_reclaimed_waited_for_then_a_counted_skip() -> None:
    pub = FakePublisher([CAPACITY])
    v = publishing(pub, last=4)
    o = await v._publish_step(None, 5, required=False)
    assert (o.kind, o.code) == (OutcomeKind.SKIPPED, "CAPACITY_ERROR")
    assert o.capacity_refusals == pub.published >= 2 and pub.reclaims >= 2  # reclaimed, retried
    assert v.last_published == 4 and v.publications[-1].outcome == o


async def test_a_slot_freed_by_a_reclaim_is_used_by_the_retry() -> None:
    pub = FakePublisher([CAPACITY, PUBLISHED], free_after=2)
    v = publishing(pub, last=4)
    o = await v._publish_step(None, 5, required=False)
    assert (o.kind, o.capacity_refusals, o.attempts) == (OutcomeKind.PUBLISHED, 1, 2)
    assert v.last_published == 5


async def test_the_first_version_waits_within_the_forced_bound_and_then_fails_typed() -> None:
    pub = FakePublisher([CAPACITY])
    v = publishing(pub, last=-1, forced_wait_s=0.5)
    o = await v._publish_step(None, 0, required=True)
    assert (o.kind, o.code) == (OutcomeKind.FAILED, "CAPACITY_ERROR")
    assert o.attempts >= 2  # it waited and tried again: the first version is never skipped
