"""One completion as TRL wants it, assembled from a multi-turn episode: the segments (assistant
turns with the engine's log-probabilities, environment turns without), the records of what each
turn ran on, and the columns of TRL's ``rollout_func`` result. Also how TRL's prompts and
sampling configuration become engine requests. Pure: no IO; the tokenizer and TRL's arguments are
passed in."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of a completion: an assistant turn (with the engine's log-probabilities of its
    tokens) or an environment turn (``logprobs`` None: not the model's tokens)."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None

    @property
    def is_model(self) -> bool:
        return self.logprobs is not None


def assemble_completion(segments: Sequence[Segment]) -> tuple[list[int], list[float], list[int]]:
    """``completion_ids``, ``logprobs`` and ``env_mask`` of one multi-turn completion: the
    segments in order; model tokens carry the engine's log-probability and mask 1, environment
    tokens 0.0 and mask 0 (TRL leaves them out of the loss)."""
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for seg in segments:
        if seg.logprobs is not None and len(seg.logprobs) != len(seg.ids):
            raise ValueError(f"{len(seg.logprobs)} logprobs for {len(seg.ids)} tokens")
        ids.extend(seg.ids)
        logprobs.extend(seg.logprobs if seg.logprobs is not None else [0.0] * len(seg.ids))
        mask.extend([1 if seg.is_model else 0] * len(seg.ids))
    return ids, logprobs, mask


def turn_logprobs(reply: Mapping[str, Any]) -> list[float]:
    """The sampled tokens' log-probabilities from ``meta_info.output_token_logprobs``
    (``[logprob, token_id, text]`` per token), checked against ``output_ids``."""
    entries = (reply.get("meta_info") or {}).get("output_token_logprobs") or []
    ids = [int(t) for t in reply.get("output_ids") or []]
    if [int(e[1]) for e in entries] != ids:
        raise ValueError(f"output_token_logprobs do not match output_ids ({len(entries)} vs {len(ids)})")
    return [float(e[0]) for e in entries]


def group_names(prompts: Sequence[Any], step: int) -> list[str]:
    """One session group per prompt: TRL repeats each prompt ``num_generations`` times in a row,
    so a run of equal consecutive prompts is one GRPO group. The name is the step and the
    prompt's content, so members on other ranks (a group split across processes) share it."""
    names: list[str] = []
    for p in prompts:
        text = p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str)
        names.append(f"s{step}-{hashlib.sha256(text.encode()).hexdigest()[:12]}")
    return names


def sampling_params(args: Any, max_new_tokens: int, *, ignore_eos: bool = False) -> dict[str, Any]:
    """SGLang sampling parameters from TRL's own (``GRPOConfig``, read by attribute so that this
    module does not import trl): the distribution the trainer's log-probabilities assume. TRL's
    ``top_k=0`` (off) is SGLang's ``-1``."""
    top_k = getattr(args, "top_k", 0) or 0
    params: dict[str, Any] = {
        "temperature": float(getattr(args, "temperature", 1.0)),
        "top_p": float(getattr(args, "top_p", 1.0)),
        "top_k": int(top_k) if top_k > 0 else -1,
        "max_new_tokens": int(max_new_tokens),
        "ignore_eos": ignore_eos,
    }
    if getattr(args, "min_p", None):
        params["min_p"] = float(args.min_p)
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        params["repetition_penalty"] = float(args.repetition_penalty)
    return params


def encode_prompt(tokenizer: Any, prompt: Any, chat_template_kwargs: Mapping[str, Any]) -> list[int]:
    """A TRL prompt as token ids: a message list through the chat template (with the generation
    prompt), a string as it is. ``tokenizer``: any Hugging Face tokenizer (typed ``Any``: this
    module does not import transformers)."""
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, **dict(chat_template_kwargs)
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5: a BatchEncoding
    return [int(t) for t in ids]


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    rid: str
    lora_path: str  # as sent on this request
    engine_id: str  # as the gateway reported it
    outcome: str
    tokens: int
    cached_tokens: int
    # what the engine attested it ran for this turn's tokens (the session layer refused the turn
    # had it been anything but the binding)
    served: tuple[str | None, ...] = ()


@dataclasses.dataclass
class CompletionRecord:
    """One completion (one session, one episode), as this process ran it."""

    step: int  # the trainer's global_step when TRL asked for it
    rank: int
    index: int  # its position in this process's batch
    group: str
    session: str
    prompt_ids: list[int]
    segments: list[Segment] = dataclasses.field(default_factory=list)
    turns: list[TurnRecord] = dataclasses.field(default_factory=list)
    bound_version: str | None = None  # the session's binding (exact lora_path), read at close
    version_id: str | None = None
    released: bool = False  # the registry released the session's ref
    error: str | None = None
    t_open: float = 0.0  # wall clock (comparable across processes of one host)
    t_close: float = 0.0

    @property
    def served_versions(self) -> list[str | None]:
        """The versions the engines attested for this completion's tokens, in order of first use
        (one: the binding, for an episode whose every turn succeeded)."""
        return list(dict.fromkeys(v for t in self.turns for v in t.served))

    @property
    def assistant_ids(self) -> list[int]:
        return [t for s in self.segments if s.is_model for t in s.ids]

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["segments"] = [{"ids": list(s.ids), "model": s.is_model} for s in self.segments]
        d["engine_logprobs"] = [lp for s in self.segments if s.logprobs is not None for lp in s.logprobs]
        return d


ROLLOUT_COLUMNS = (
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "env_mask",
    "bound_version",
    "version_id",
    "served_versions",
    "assistant_ids",
    "rollout_error",
)


def rollout_output(records: Sequence[CompletionRecord], fallback_id: int) -> dict[str, list[Any]]:
    """TRL's rollout_func result, one entry per completion in order. A failed episode becomes a
    one-token completion with mask 0 (no gradient from it) and its error for the reward
    functions: counted in ``rollout_error``, never a silent success."""
    out: dict[str, list[Any]] = {k: [] for k in ROLLOUT_COLUMNS}
    for r in records:
        if r.error is None and r.segments:
            ids, lps, mask = assemble_completion(r.segments)
        else:
            ids, lps, mask = [fallback_id], [0.0], [0]
        out["prompt_ids"].append(list(r.prompt_ids))
        out["completion_ids"].append(ids)
        out["logprobs"].append(lps)
        out["env_mask"].append(mask)
        out["bound_version"].append(r.bound_version)
        out["version_id"].append(r.version_id)
        out["served_versions"].append(r.served_versions)
        out["assistant_ids"].append(r.assistant_ids if r.error is None else [])
        out["rollout_error"].append(r.error)
    return out
