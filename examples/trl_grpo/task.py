"""The TRL example's task: the online RL showcase's agent task (a question, an assistant turn, a
scripted tool reply, another assistant turn) and its verifiable reward, as TRL pieces: a
dataset of chat prompts, the environment turn, a reward function, the LoRA and the CPU
``GRPOConfig``. Plus two probes the report and the tests read: what the reward functions
received, and the trainer's log-probabilities beside the engine's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from examples.online_rl.reward import digit_token_ids, episode_reward
from examples.online_rl.task import QUESTIONS

TOOL_REPLY = "<|im_end|>\n<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def train_dataset(repeat: int) -> Any:
    """The four questions as chat prompts, ``repeat`` times (TRL samples prompts from it)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [chat(q) for _ in range(repeat) for q, _ in QUESTIONS]})


class ToolTurn:
    """The environment turn: the scripted tool's reply to the prompt's question, in the chat
    format (it closes the assistant turn, gives the tool's turn and opens the next assistant
    turn). Token ids, so the engine continues the exact sequence the trainer scores."""

    def __init__(self, tokenizer: Any) -> None:
        self.replies = {
            q: [int(t) for t in tokenizer.encode(TOOL_REPLY.format(answer=a), add_special_tokens=False)]
            for q, a in QUESTIONS
        }

    def __call__(self, prompt: Any, assistant_turns: list[list[int]]) -> list[int]:
        return self.replies[prompt[-1]["content"]]


def digit_reward(tokenizer: Any) -> Callable[..., list[float]]:
    """The showcase's verifiable reward as a TRL reward function: the share of the assistant's
    tokens (``assistant_ids``: both turns, not the tool's) that are digit tokens."""
    targets = digit_token_ids(lambda i: tokenizer.decode([i]), len(tokenizer))

    def digits(completions: Sequence[Any], assistant_ids: Sequence[Sequence[int]], **_: Any) -> list[float]:
        return [episode_reward([ids], targets) for ids in assistant_ids]

    digits.__name__ = "digits"
    return digits


def lora_config(rank: int = 8) -> Any:
    """What the engines serve exactly: rank <= 8, alpha 2r, no dropout, the seven projections
    (the showcase's adapter)."""
    from examples.online_rl.trainer import lora_config as showcase_lora

    return showcase_lora(rank)


def grpo_config(out_dir: Path, **overrides: Any) -> Any:
    """TRL's GRPO on CPU (its defaults are bf16 and gradient checkpointing): fp32, no KL term
    (beta 0: no reference model), nothing reported or saved; a constant learning rate."""
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(out_dir),
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "beta": 0.0,
        "report_to": [],
        "save_strategy": "no",
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "disable_tqdm": True,
        "temperature": 1.0,
        "max_completion_length": 64,
        **overrides,
    }
    return GRPOConfig(**settings)


# ------------------------------------------------------------------------------------ probes


@dataclasses.dataclass
class RewardCall:
    step: int
    bound_version: list[str | None]
    version_id: list[str | None]
    served_versions: list[list[str | None]]  # what the engines attested they ran, per completion
    completion_ids: list[list[int]]
    rewards: list[float]


class RewardProbe:
    """Wraps a reward function and records what TRL passed it (the bound versions among them)."""

    def __init__(self, fn: Callable[..., list[float]]) -> None:
        self.fn = fn
        self.calls: list[RewardCall] = []
        self.__name__ = fn.__name__

    def __call__(self, prompts: Any, completions: Any, completion_ids: Any, **kw: Any) -> list[float]:
        rewards = self.fn(completions, **kw)
        state = kw.get("trainer_state")
        self.calls.append(
            RewardCall(
                int(state.global_step) if state is not None else -1,
                list(kw["bound_version"]),
                list(kw["version_id"]),
                [list(v) for v in kw["served_versions"]],
                [list(map(int, c)) for c in completion_ids],
                [float(r) for r in rewards],
            )
        )
        return rewards


@dataclasses.dataclass
class RolloutCall:
    step: int  # the trainer's global_step: it holds W_step, published as step{step}
    bound_version: list[str | None]
    version_id: list[str | None]
    completion_ids: list[list[int]]
    # |trainer - engine| log-probability of every model token, per completion whose version is
    # the trainer's own weights (None for the others: sampled by an older version)
    same_weights_diff: list[list[float] | None]


def trainer_logprobs(
    trainer: Any, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> list[list[float]]:
    """The log-probabilities TRL's loss computes for these completions with the trainer's current
    weights: its own padding (prompts left, completions right) and its own per-token function
    (``GRPOTrainer._get_per_token_logps_and_entropies``, trl 1.16.0), without gradients."""
    import torch
    from trl.trainer.utils import pad

    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    device = trainer.accelerator.device
    p = [torch.tensor(list(x)) for x in prompt_ids]
    c = [torch.tensor(list(x)) for x in completion_ids]
    ids = torch.cat(
        [pad(p, tok.pad_token_id, padding_side="left"), pad(c, tok.pad_token_id, padding_side="right")], dim=1
    )
    ones = [torch.ones(len(x), dtype=torch.long) for x in (*p, *c)]
    mask = torch.cat(
        [pad(ones[: len(p)], 0, padding_side="left"), pad(ones[len(p) :], 0, padding_side="right")], dim=1
    )
    width = max(len(x) for x in completion_ids)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids.to(device), mask.to(device), width
        )
    return [logps[i, : len(x)].tolist() for i, x in enumerate(completion_ids)]


class RolloutProbe:
    """Wraps TRL's rollout_func: records its output and, right after it (the trainer still holds
    the weights of this step), the trainer's own log-probabilities of every completion."""

    def __init__(
        self, rollout: Callable[[list[Any], Any], dict[str, list[Any]]], prefix: str = "step"
    ) -> None:
        self.rollout = rollout
        self.prefix = prefix
        self.calls: list[RolloutCall] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = self.rollout(prompts, trainer)
        step = int(trainer.state.global_step)
        mine = f"{self.prefix}{step}"
        ours = trainer_logprobs(trainer, out["prompt_ids"], out["completion_ids"])
        diffs: list[list[float] | None] = []
        for vid, lps, mask, tl in zip(out["version_id"], out["logprobs"], out["env_mask"], ours, strict=True):
            same = vid == mine
            diffs.append([abs(a - b) for a, b, m in zip(tl, lps, mask, strict=True) if m] if same else None)
        self.calls.append(
            RolloutCall(
                step, list(out["bound_version"]), list(out["version_id"]), out["completion_ids"], diffs
            )
        )
        return out
