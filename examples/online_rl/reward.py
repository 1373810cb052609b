"""The verifiable toy reward: the assistant answers with digits.

The reward of an episode is the share of its assistant-generated tokens that are digit tokens
(a token whose text is digits and spaces, at least one digit: ``'7'``, ``' 42'``...). 23 of the
fixture model's 512 ids are digit tokens; the random base model emits them about 4% of the time,
and a rank-8 LoRA learns to emit nothing else within a few dozen steps. Pure: it reads token ids
only, never the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def is_digit_text(text: str) -> bool:
    return any(c.isdigit() for c in text) and all(c.isdigit() or c.isspace() for c in text)


def digit_token_ids(decode: Callable[[int], str], vocab_size: int) -> frozenset[int]:
    """Ids whose text is a digit token. ``decode`` of an id with no text (the model's padding
    ids past the tokenizer's vocabulary) returns '', which is not a digit token."""
    return frozenset(i for i in range(vocab_size) if is_digit_text(decode(i)))


def episode_reward(assistant_turns: Iterable[Sequence[int]], targets: frozenset[int]) -> float:
    """Share of the assistant's tokens (all turns) that are in ``targets``; 0.0 for no tokens."""
    tokens = [t for turn in assistant_turns for t in turn]
    if not tokens:
        return 0.0
    return sum(t in targets for t in tokens) / len(tokens)
