"""Rollout workers: multi-turn agent episodes through the session layer and the smg gateway.

One episode is one session: it binds the registry's default at its first generation (the session
layer's one shared bind), and every later turn carries that exact ``lora_path``, whatever the
trainer publishes meanwhile. Each turn asks the engine for the log-probabilities of the tokens
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
    bound_lora: str | None = None  # the registry's binding of the session (at close)
    bind_calls: int = 0
    released: bool = False  # the registry released the session's ref
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
    sessions: Any, task: Task, cfg: RunConfig, index: int, worker: int, clock: Callable[[], float]
) -> Episode:
    """One episode: assistant turn, the scripted tool (its latency, then its reply), assistant
    turn. Never raises: a failure is recorded in ``error`` (the run's invariants count it)."""
    p = prompt_of(index, len(task.prompts))
    # a prompt's episodes are one GRPO group: routed together, they share its prefix on one engine
    session = await sessions.open(f"ep{index}", group=f"prompt{p}" if cfg.group_routing else None)
    ep = Episode(index, worker, p, str(session.key), tool_latency(cfg, index), clock())
    ep.prompt_ids, ep.tool_ids = list(task.prompts[p]), list(task.tool_replies[p])
    params = task.sampling_params(cfg.temperature)
    try:
        history = list(ep.prompt_ids)
        for turn_no in range(2):
            if turn_no:
                await asyncio.sleep(ep.tool_latency_s)  # the tool runs; the session stays bound
                history += ep.tool_ids
            t0 = clock()
            reply = await session.generate(
                {"input_ids": history, "sampling_params": params, "return_logprob": True}
            )
            sent = session.requests[-1]  # what the session layer sent: rid, lora_path, engine
            out = [int(t) for t in reply["output_ids"]]
            ep.turns.append(
                Turn(
                    sent.rid,
                    sent.lora_path,
                    sent.engine_id,
                    sent.outcome,
                    len(history),
                    out,
                    _turn_logprobs(reply),
                    int(reply.get("meta_info", {}).get("cached_tokens") or 0),
                    t0,
                    clock(),
                    _served_by(reply),
                )
            )
            history += out
        ep.reward = episode_reward([t.output_ids for t in ep.turns], task.targets)
    except Exception as exc:  # a typed refusal or an unknown outcome: recorded, never hidden
        ep.error = f"{type(exc).__name__}: {exc}"
        ep.fate = "failed"
    finally:
        ep.bind_calls = session.bind_calls
        try:
            view = await session.close()
            ep.released = bool(view.released)
            ep.bound_lora = view.binding.lora_name if view.binding is not None else None
        except Exception as exc:
            ep.error = (ep.error or "") + f" close: {type(exc).__name__}: {exc}"
            ep.fate = "failed"
        ep.t_end = clock()
    return ep


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
    ) -> None:
        self.sessions = sessions
        self.task = task
        self.cfg = cfg
        self.clock = clock
        self.queue: asyncio.Queue[Episode] = asyncio.Queue(maxsize=queue_size)
        self.on_closed = on_closed
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
            ep = await run_episode(self.sessions, self.task, self.cfg, index, worker, self.clock)
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
