"""One episode on one session (relax_glue/trl/rollouts.py), with a fake session layer: assistant
turn, tool turn, assistant turn on the session's one bound version, then the close, announced
once to ``on_episode_closed`` (rank 0's step publisher); an episode that never ends is a
recorded, masked failure whose session still closes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from relax_glue.trl import GRPOVersions, VersionsConfig
from relax_glue.trl.completions import rollout_output
from relax_glue.trl.publication import StepPublication
from relax_glue.trl.ranks import RankInfo
from relax_glue.trl.rollouts import Rollouts

NAME = "lora@e-step1-x"


class FakeSession:
    """What ``Rollouts.episode`` uses of a Session: generate (each reply 2 tokens), requests, close."""

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
            SimpleNamespace(rid=f"r{n}", lora_path=NAME, engine_id="E0", outcome="ok", served=(NAME,))
        )
        return {"output_ids": out, "meta_info": {"output_token_logprobs": [[-0.5, t, ""] for t in out]}}

    async def close(self) -> SimpleNamespace:
        self.closes += 1
        key = SimpleNamespace(version_id="step1")
        return SimpleNamespace(released=True, binding=SimpleNamespace(lora_name=NAME, version_key=key))


class FakeSessions:
    def __init__(self, hang_at: int | None = None) -> None:
        self.opened: list[tuple[str, str | None, FakeSession]] = []
        self.hang_at = hang_at

    async def open(self, name: str, *, group: str | None = None) -> FakeSession:
        s = FakeSession(self.hang_at)
        self.opened.append((name, group, s))
        return s


def episode_rollouts(sessions: FakeSessions, timeout_s: float = 30.0, closed: list | None = None) -> Rollouts:
    config = VersionsConfig(episode_timeout_s=timeout_s)
    on_closed = (lambda: closed.append(sessions.opened[-1][2].closes)) if closed is not None else None
    return Rollouts(None, RankInfo(), sessions, config, on_episode_closed=on_closed)  # type: ignore[arg-type]


async def test_an_episode_is_assistant_tool_assistant_on_one_session_then_closed() -> None:
    seen: list[list[list[int]]] = []

    def tool(prompt: Any, turns: list[list[int]]) -> list[int]:
        seen.append(turns)
        return [90, 91, 92]

    sessions = FakeSessions()
    closed: list[int] = []
    v = episode_rollouts(sessions, closed=closed)
    rec = await v.episode(0, "q", [1, 2], "s1-g", 1, {"max_new_tokens": 2}, tool, 2)
    ((_, group, s),) = sessions.opened
    assert group == "s1-g" and s.closes == 1 and rec.error is None
    assert closed == [1]  # the close is announced after it happened, once
    assert seen == [[[10, 11]]]  # the tool saw the first assistant turn
    assert [b["input_ids"] for b in s.bodies] == [[1, 2], [1, 2, 10, 11, 90, 91, 92]]
    assert all(b["return_logprob"] for b in s.bodies)
    assert (rec.bound_version, rec.version_id, rec.released) == (NAME, "step1", True)
    assert [t.lora_path for t in rec.turns] == [NAME] * 2
    out = rollout_output([rec], fallback_id=3)
    assert out["completion_ids"] == [[10, 11, 90, 91, 92, 12, 13]]
    assert out["env_mask"] == [[1, 1, 0, 0, 0, 1, 1]]


async def test_an_episode_that_never_ends_is_a_recorded_masked_failure_and_its_session_closes() -> None:
    sessions = FakeSessions(hang_at=1)
    closed: list[int] = []
    v = episode_rollouts(sessions, timeout_s=0.2, closed=closed)
    rec = await v.episode(0, "q", [1, 2], "g", 1, {}, lambda p, t: [90], 2)
    s = sessions.opened[0][2]
    assert rec.error is not None and rec.error.startswith("TimeoutError") and s.closes == 1
    assert closed == [1]  # told once, after the close (rank 0's step publisher may reclaim now)
    out = rollout_output([rec], fallback_id=3)
    assert (out["completion_ids"], out["env_mask"], out["rollout_error"]) == ([[3]], [[0]], [rec.error])


async def test_every_episode_close_of_the_run_reaches_its_publication() -> None:
    """GRPOVersions wires its rollouts to its publication: on rank 0 a close wakes a publication
    waiting for a slot (test_trl_capacity_backpressure.py)."""
    config = VersionsConfig()
    publication = StepPublication(None, RankInfo(), config)
    told: list[str] = []
    publication.episode_closed = lambda: told.append("closed")  # type: ignore[method-assign]
    sessions = FakeSessions()
    v = GRPOVersions(
        None,  # type: ignore[arg-type]
        RankInfo(),
        "e",
        config,
        sessions=sessions,  # type: ignore[arg-type]
        publication=publication,
        clients={},
        gateway=None,  # type: ignore[arg-type]
    )
    await v.rollouts.episode(0, "q", [1, 2], "g", 1, {}, lambda p, t: [90], 1)
    assert told == ["closed"] and sessions.opened[0][2].closes == 1
