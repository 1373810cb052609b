"""Rollout workers: multi-turn agent episodes through the session layer and the smg gateway.

One episode is one session: it binds the registry's default at its first generation (the session
layer's one shared bind), and every later turn carries that exact ``lora_path``, whatever the
trainer publishes meanwhile. The ``per-turn`` rollout mode (issue 40, only to be compared) opens
one session per turn instead, so each turn runs on the default of its moment, as TRL AsyncGRPO's
turns do. Each turn asks the engine for the log-probabilities of the tokens
it sampled (``return_logprob``), which the trainer compares with its own. The session is closed
(its ref released exactly once) before the episode is handed to the trainer, and every close
pings the reclaimer: the version the episode held may now be free.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from examples.online_rl.config import RunConfig
from examples.online_rl.reward import episode_reward
from examples.online_rl.task import Task, prompt_of, tool_latency
from lora_contract.served_version import token_versions


@dataclasses.dataclass
class Turn:
    rid: str
    lora_path: str  # as sent on this request (the session layer's record)
    engine_id: str  # as the gateway reported it
    outcome: str
    input_len: int
    output_ids: list[int]
    engine_logprobs: list[float]  # the engine's log-probability of each sampled token
    cached_tokens: int
    t_start: float
    t_end: float
    # per output token, the version the engine attested it ran (read from the step's batch)
    served_by: list[str | None] = dataclasses.field(default_factory=list)
    bound_lora: str | None = None  # the binding of the session this turn ran in (at its close)


@dataclasses.dataclass
class Episode:
    index: int
    worker: int
    prompt_index: int
    session: str
    tool_latency_s: float
    t_start: float
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    tool_ids: list[int] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    # The version the trainer takes the episode for: the session's binding (pinned), or the
    # first turn's (per-turn: TRL's group model_version, read when the episode starts).
    bound_lora: str | None = None
    bind_calls: int = 0  # bind_first calls over the episode's sessions (one per session)
    released: bool = False  # the registry released every session's ref
    sessions: int = 0  # sessions the episode opened: 1 pinned, one per turn per-turn
    t_end: float = 0.0
    reward: float = 0.0
    error: str | None = None
    # Set by the trainer side.
    version: int | None = None
    fate: str = "unused"  # "used" | "dropped" | "unused" (still queued at the end) | "failed"
    trainer_step: int | None = None  # the trainer's step when it took the episode
    staleness: int | None = None

    @property
    def tokens(self) -> list[int]:
        """The full multi-turn sequence: prompt, turn 1, tool turn, turn 2."""
        out = list(self.prompt_ids)
        for i, turn in enumerate(self.turns):
            if i:
                out += self.tool_ids
            out += turn.output_ids
        return out

    def assistant_spans(self) -> list[tuple[int, int]]:
        """[start, end) of every assistant turn in :attr:`tokens` (the positions the loss counts)."""
        spans, pos = [], len(self.prompt_ids)
        for i, turn in enumerate(self.turns):
            if i:
                pos += len(self.tool_ids)
            spans.append((pos, pos + len(turn.output_ids)))
            pos += len(turn.output_ids)
        return spans

    @property
    def engine_logprobs(self) -> list[float]:
        return [lp for turn in self.turns for lp in turn.engine_logprobs]

    @property
    def token_versions(self) -> list[str | None]:
        """Per assistant token, in order, the version the engine attested it ran."""
        return [v for turn in self.turns for v in turn.served_by]

    @property
    def versions(self) -> list[str | None]:
        """The distinct versions attested for its tokens, in order of first use."""
        return list(dict.fromkeys(self.token_versions))


def _turn_logprobs(reply: dict[str, Any]) -> list[float]:
    """The sampled tokens' log-probabilities from ``meta_info.output_token_logprobs``
    ([logprob, token_id, text] per token), checked against ``output_ids``."""
    entries = reply.get("meta_info", {}).get("output_token_logprobs") or []
    ids = list(reply.get("output_ids") or [])
    if [int(e[1]) for e in entries] != ids:
        raise ValueError(f"output_token_logprobs do not match output_ids ({len(entries)} vs {len(ids)})")
    return [float(e[0]) for e in entries]


def _served_by(reply: dict[str, Any]) -> list[str | None]:
    """Per output token, what the engine attested it ran (the session layer already refused a
    reply whose tokens were not all the binding's)."""
    versions = token_versions(reply.get("meta_info") or {})
    if versions is None or len(versions) != len(reply.get("output_ids") or []):
        raise ValueError("the reply does not attest what served each of its tokens")
    return versions


async def run_episode(
    sessions: Any,
    task: Task,
    cfg: RunConfig,
    index: int,
    worker: int,
    clock: Callable[[], float],
    key_prefix: str = "",
) -> Episode:
    """One episode: ``cfg.assistant_turns`` assistant turns with the scripted tool (its latency,
    then its reply) between two of them. Pinned: one session, bound at the first generation.
    Per-turn: one session per turn, so each turn binds the default of its moment. Never raises:
    a failure is recorded in ``error`` (the run's invariants count it)."""
    p = prompt_of(index, len(task.prompts))
    # a prompt's episodes are one GRPO group: routed together, they share its prefix on one engine
    group = f"prompt{p}" if cfg.group_routing else None
    key = f"{key_prefix}ep{index}"
    ep = Episode(index, worker, p, key, tool_latency(cfg, index), clock())
    ep.prompt_ids, ep.tool_ids = list(task.prompts[p]), list(task.tool_replies[p])
    params = task.sampling_params(cfg.temperature)
    pinned = cfg.rollout == "pinned"
    ep.released = True
    episode_session = None
    try:
        if pinned:
            episode_session = await _open(sessions, key, group, ep)
        history = list(ep.prompt_ids)
        for turn_no in range(cfg.assistant_turns):
            if turn_no:
                await asyncio.sleep(ep.tool_latency_s)  # the tool runs; a pinned session stays bound
                history += ep.tool_ids
            session = episode_session or await _open(sessions, f"{key}.t{turn_no}", group, ep)
            try:
                turn = await _turn(session, history, params, clock)
            finally:
                bound = None if pinned else await _close(session, ep)
            turn.bound_lora = bound
            ep.turns.append(turn)
            history += turn.output_ids
        ep.reward = episode_reward([t.output_ids for t in ep.turns], task.targets)
    except Exception as exc:  # a typed refusal or an unknown outcome: recorded, never hidden
        ep.error = (ep.error or "") + f"{type(exc).__name__}: {exc}"
        ep.fate = "failed"
    finally:
        if episode_session is not None:
            bound = await _close(episode_session, ep)
            for t in ep.turns:
                t.bound_lora = bound
        ep.bound_lora = ep.turns[0].bound_lora if ep.turns else None
        ep.t_end = clock()
    return ep


async def _open(sessions: Any, key: str, group: str | None, ep: Episode) -> Any:
    ep.sessions += 1
    return await sessions.open(key, group=group)


async def _turn(
    session: Any, history: list[int], params: dict[str, object], clock: Callable[[], float]
) -> Turn:
    t0 = clock()
    reply = await session.generate({"input_ids": history, "sampling_params": params, "return_logprob": True})
    sent = session.requests[-1]  # what the session layer sent: rid, lora_path, engine
    return Turn(
        sent.rid,
        sent.lora_path,
        sent.engine_id,
        sent.outcome,
        len(history),
        [int(t) for t in reply["output_ids"]],
        _turn_logprobs(reply),
        int(reply.get("meta_info", {}).get("cached_tokens") or 0),
        t0,
        clock(),
        _served_by(reply),
    )


async def _close(session: Any, ep: Episode) -> str | None:
    """Close the session (its ref released exactly once); its binding, None if it never bound."""
    ep.bind_calls += session.bind_calls
    try:
        view = await session.close()
    except Exception as exc:
        ep.error = (ep.error or "") + f" close: {type(exc).__name__}: {exc}"
        ep.fate = "failed"
        ep.released = False
        return None
    ep.released = ep.released and bool(view.released)
    return view.binding.lora_name if view.binding is not None else None


class RolloutPool:
    """``workers`` concurrent episode loops feeding one bounded queue (at most one batch ahead
    of the trainer: a full queue is backpressure on the rollouts, and it bounds how long a
    finished episode waits before the trainer sees it)."""

    def __init__(
        self,
        sessions: Any,
        task: Task,
        cfg: RunConfig,
        clock: Callable[[], float],
        *,
        queue_size: int,
        on_closed: Callable[[Episode], None],
        key_prefix: str = "",
    ) -> None:
        self.sessions = sessions
        self.task = task
        self.cfg = cfg
        self.clock = clock
        self.queue: asyncio.Queue[Episode] = asyncio.Queue(maxsize=queue_size)
        self.on_closed = on_closed
        self.key_prefix = key_prefix  # session keys unique across the runs of one registry
        self.stop = asyncio.Event()
        self.episodes: list[Episode] = []  # every episode, in start order
        self._index = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._worker(w), name=f"rollout-worker-{w}") for w in range(self.cfg.workers)
        ]

    async def _worker(self, worker: int) -> None:
        while not self.stop.is_set():
            index = next(self._index)
            ep = await run_episode(
                self.sessions, self.task, self.cfg, index, worker, self.clock, self.key_prefix
            )
            self.episodes.append(ep)
            self.on_closed(ep)
            await self.queue.put(ep)

    async def get(self) -> Episode:
        return await self.queue.get()

    async def shutdown(self) -> list[Episode]:
        """Let every worker finish its episode (each closes its session), then return what
        was still queued. Nothing is cancelled mid-turn."""
        self.stop.set()
        left: list[Episode] = []
        while not all(t.done() for t in self._tasks):
            with contextlib.suppress(asyncio.QueueEmpty):
                while True:
                    left.append(self.queue.get_nowait())
            await asyncio.sleep(0.02)
        while not self.queue.empty():
            left.append(self.queue.get_nowait())
        for t in self._tasks:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return left
