"""TRL's ``rollout_func`` over the session layer: every completion TRL asks for is one
multi-turn episode on one session (assistant turn, environment turn, assistant turn, ... all on
the exact ``lora_path`` the session bound at its first generation), one session group per
prompt, the session closed before TRL gets the completion. Never raises for an episode: a
failure is a recorded, masked completion (:func:`~relax_glue.trl.completions.rollout_output`)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relax_glue.trl.completions import (
    CompletionRecord,
    Segment,
    TurnRecord,
    encode_prompt,
    group_names,
    rollout_output,
    sampling_params,
    turn_logprobs,
)
from relax_glue.trl.config import VersionsConfig
from relax_glue.trl.event_loop import LoopThread
from relax_glue.trl.ranks import RankInfo

if TYPE_CHECKING:
    from relax_glue.sessions import Session, SessionManager

# ``env_turn(prompt, assistant_turns_so_far) -> token ids``, sync or async
EnvTurn = Callable[[Any, list[list[int]]], "Sequence[int] | Awaitable[Sequence[int]]"]
RolloutFunc = Callable[[list[Any], Any], dict[str, list[Any]]]


class Rollouts:
    """This rank's episodes: run on ``loop`` through ``sessions``, kept in ``completions``
    (when ``config.keep_completions``); ``on_episode_closed`` is told of every close."""

    def __init__(
        self,
        loop: LoopThread | None,
        rank: RankInfo,
        sessions: SessionManager,
        config: VersionsConfig,
        *,
        on_episode_closed: Callable[[], None] | None = None,
    ) -> None:
        self.loop, self.rank, self.sessions, self.config = loop, rank, sessions, config
        # called on the loop after each close: rank 0's step publisher waits for a slot on it
        self.on_episode_closed = on_episode_closed
        self.completions: list[CompletionRecord] = []

    def rollout_func(
        self,
        *,
        env_turn: EnvTurn,
        max_new_tokens: int,
        assistant_turns: int = 2,
        ignore_eos: bool = False,
    ) -> RolloutFunc:
        """TRL's ``rollout_func(prompts, trainer)``: one session per completion, one session
        group per prompt, ``assistant_turns`` assistant turns with an environment turn between
        each two (``env_turn(prompt, assistant_turns_so_far) -> token ids``, sync or async:
        the tool's reply in the chat format, closing the assistant turn and opening the next)."""
        if assistant_turns < 1:
            raise ValueError("an episode has at least one assistant turn")

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            # ``trainer``: TRL's GRPOTrainer (typed Any: this module does not import trl)
            tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
            kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
            prompt_ids = [encode_prompt(tok, p, kwargs) for p in prompts]
            params = sampling_params(trainer.args, max_new_tokens, ignore_eos=ignore_eos)
            step = int(trainer.state.global_step)
            batch = self.batch(prompts, prompt_ids, step, params, env_turn, assistant_turns)
            assert self.loop is not None
            records = self.loop.call(batch, self.config.rollout_timeout_s)
            if self.config.keep_completions:
                self.completions.extend(records)
            fallback = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
            return rollout_output(records, int(fallback or 0))

        return rollout

    async def batch(
        self,
        prompts: Sequence[Any],
        prompt_ids: Sequence[list[int]],
        step: int,
        params: Mapping[str, Any],
        env_turn: EnvTurn,
        turns: int,
    ) -> list[CompletionRecord]:
        groups = group_names(prompts, step)
        return list(
            await asyncio.gather(
                *(
                    self.episode(i, prompts[i], prompt_ids[i], groups[i], step, params, env_turn, turns)
                    for i in range(len(prompts))
                )
            )
        )

    async def episode(
        self,
        index: int,
        prompt: Any,
        prompt_ids: list[int],
        group: str,
        step: int,
        params: Mapping[str, Any],
        env_turn: EnvTurn,
        turns: int,
    ) -> CompletionRecord:
        """One completion on one session, then its close. Never raises: a failure (a typed
        refusal, an unknown outcome, ``episode_timeout_s`` running out) is recorded in
        ``error``; the close aborts by rid whatever the episode still had in flight."""
        rec = CompletionRecord(step, self.rank.rank, index, group, "", list(prompt_ids), t_open=time.time())
        session = None
        try:
            async with asyncio.timeout(self.config.episode_timeout_s):
                session = await self.sessions.open(f"s{step}.r{self.rank.rank}.c{index}", group=group)
                rec.session = str(session.key)
                await self._turns(session, rec, prompt, params, env_turn, turns)
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            await self._close(session, rec)
            if self.on_episode_closed is not None:
                self.on_episode_closed()
        return rec

    async def _turns(
        self,
        session: Session,
        rec: CompletionRecord,
        prompt: Any,
        params: Mapping[str, Any],
        env_turn: EnvTurn,
        turns: int,
    ) -> None:
        """Assistant turn, environment turn, assistant turn, ...: every turn on the exact
        ``lora_path`` the session bound at its first generation, with the engine's log-probs."""
        history = list(rec.prompt_ids)
        for k in range(turns):
            if k:
                so_far = [list(s.ids) for s in rec.segments if s.is_model]
                env_ids = await _maybe_await(env_turn(prompt, so_far))
                rec.segments.append(Segment(tuple(int(t) for t in env_ids)))
                history += rec.segments[-1].ids
            # a copy: the session layer keeps the body it sent (a resend must send those very ids)
            body = {"input_ids": list(history), "sampling_params": dict(params), "return_logprob": True}
            reply = await session.generate(body)
            out = [int(t) for t in reply["output_ids"]]
            rec.segments.append(Segment(tuple(out), tuple(turn_logprobs(reply))))
            sent = session.requests[-1]  # what the session layer sent: rid, lora_path, engine
            cached = int((reply.get("meta_info") or {}).get("cached_tokens") or 0)
            rec.turns.append(
                TurnRecord(
                    sent.rid, sent.lora_path, sent.engine_id, sent.outcome, len(out), cached, sent.served
                )
            )
            history += out

    async def _close(self, session: Session | None, rec: CompletionRecord) -> None:
        if session is None:
            rec.t_close = time.time()
            return
        try:
            view = await session.close()
            rec.released = bool(view.released)
            if view.binding is not None:
                rec.bound_version = view.binding.lora_name
                rec.version_id = view.binding.version_key.version_id
        except Exception as exc:
            rec.error = ((rec.error or "") + f" close: {type(exc).__name__}: {exc}")[:500]
        rec.t_close = time.time()


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
