"""The agent task: a user question, an assistant turn, a scripted tool reply, another assistant
turn. Built once from the fixture tokenizer (chat template of the fixture model), then only
token ids travel: every turn's prompt is the exact token history, so the trainer's forward pass
sees the very sequence the engine sampled from.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from examples.online_rl.config import RunConfig
from examples.online_rl.reward import digit_token_ids

# (user question, what the scripted tool answers): the questions want a number, the tool has it.
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is 6 times 7? Use the calculator.", "calculator: 42"),
    ("How many days are in a week? Search the web.", "search: a week has 7 days"),
    ("What is 2048 divided by 2? Use python.", "python: 1024"),
    ("Count from 1 to 5 for me.", "python: 1 2 3 4 5"),
)


@dataclasses.dataclass(frozen=True)
class Task:
    prompts: tuple[tuple[int, ...], ...]  # "<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n"
    tool_replies: tuple[tuple[int, ...], ...]  # closes the assistant turn, the tool's turn, reopens
    targets: frozenset[int]  # the reward's digit tokens
    tokens_per_turn: int

    def sampling_params(self, temperature: float) -> dict[str, object]:
        # ignore_eos: every assistant turn has exactly tokens_per_turn tokens (the reward and
        # the loss then weigh every episode alike); top_p/top_k off: plain sampling, the
        # distribution whose log-probabilities the engine reports and the trainer recomputes.
        return {
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": self.tokens_per_turn,
            "ignore_eos": True,
        }


def build_task(model_dir: Path, tokens_per_turn: int) -> Task:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts, replies = [], []
    for question, answer in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5: a BatchEncoding
        prompts.append(tuple(int(i) for i in ids))
        tool_turn = f"<|im_end|>\n<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"
        replies.append(tuple(tok.encode(tool_turn, add_special_tokens=False)))
    targets = digit_token_ids(lambda i: tok.decode([i]), len(tok))
    return Task(tuple(prompts), tuple(replies), targets, tokens_per_turn)


def prompt_of(episode_index: int, n_prompts: int) -> int:
    """Episodes take the prompts in turn, so every batch holds a group of each."""
    return episode_index % n_prompts


def tool_latency(cfg: RunConfig, episode_index: int) -> float:
    """How long the scripted tool takes in this episode: a seeded draw per episode (the same
    run seed gives the same schedule of slow calls, whatever the interleaving)."""
    rng = random.Random(f"{cfg.seed}:{episode_index}")
    lo, hi = cfg.slow_tool_latency_s if rng.random() < cfg.slow_tool_p else cfg.tool_latency_s
    return rng.uniform(lo, hi)
