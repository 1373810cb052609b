"""The trainer: a PEFT LoRA on the fixture tiny Qwen3, trained on CPU with a group-baseline
policy gradient (GRPO-style advantages, REINFORCE loss).

* **Loss from the trainer's own forward pass.** One fp32 forward over each episode's full
  multi-turn sequence (prompt, turn 1, tool turn, turn 2); only the positions of
  assistant-generated tokens count. ``loss = -sum_i A_i sum_{t in assistant(i)} log pi(y_t) /
  (number of assistant tokens)``.
* **Group baseline.** The episodes of one prompt in the batch form a group; an episode's
  advantage is its reward minus the group mean, divided by the group's standard deviation (0 for
  a group whose rewards are all equal: nothing to learn from it).
* **The engine's log-probabilities measure the lag and correct it.** Per step the trainer
  reports the absolute difference between its log-probability of every sampled token and the
  engine's, split into episodes of the trainer's current weights (staleness 0: the same weights on
  both sides, so this is the serving mismatch, about 1e-6 in fp32) and stale ones (the policy
  lag). With ``correction="tis"`` each token's term is weighted by the truncated importance ratio
  ``w_t = min(pi_theta(y_t) / mu(y_t), C)`` (detached), ``mu`` the engine's recorded probability
  under the version that generated it: the policy-gradient estimator for samples of another
  policy, with the ratio truncated at C (2 here) to bound its variance, per token rather than as
  a product over the episode (whose variance grows exponentially with its length). This is
  IMPALA's truncated ratio without the value function, and the "TIS" fix that verl and slime
  apply to the rollout/trainer mismatch. Fresh episodes get w = 1 up to the serving mismatch.

The LoRA config is what the engines serve: rank <= 8, alpha 2r, no dropout, the seven projection
modules of the fixture adapters.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Sample:
    """What one update needs from an episode."""

    tokens: tuple[int, ...]  # the full multi-turn sequence
    spans: tuple[tuple[int, int], ...]  # [start, end) of each assistant turn in tokens
    engine_logprobs: tuple[float, ...]  # the engine's, one per assistant token, in order
    reward: float
    group: Hashable  # the prompt: the baseline's group
    staleness: int
    # per assistant token, the staleness of the version the engine attested it ran (issue 39);
    # empty: every token has the episode's
    token_staleness: tuple[int, ...] = ()
    # the version (step) the trainer takes the episode for: its binding, or, per-turn, its first
    # turn's; the trainer measures how far that version's log-probabilities are from what served
    assumed_step: int | None = None


@dataclasses.dataclass(frozen=True)
class StepStats:
    step: int  # the optimizer step this update made (1 = the first)
    loss: float
    reward_mean: float
    episodes: int
    tokens: int
    grad_norm: float
    fresh_tokens: int  # assistant tokens of staleness-0 episodes
    fresh_abs_diff_mean: float | None  # |trainer - engine| log-prob, same weights: the serving mismatch
    fresh_abs_diff_max: float | None
    stale_tokens: int
    stale_abs_diff_mean: float | None  # the same for stale episodes: the policy lag
    stale_abs_diff_max: float | None
    seconds: float
    # the truncated importance weights of stale tokens (correction "tis"; None without stale ones)
    stale_weight_mean: float | None = None
    stale_weight_truncated: float | None = None  # share of stale tokens whose ratio hit the cap
    # Over every token (issue 40): the variance of the raw ratio pi_trainer / pi_served, and the
    # share the correction cut (tis: the ratio hit the cap; trl: the clipped region, as TRL counts)
    ratio_var: float | None = None
    cut_share: float | None = None
    # |log pi_assumed(y) - log pi_served(y)|: what a trainer that believes the episode's version
    # served it is off by, over every token and over the tokens another version served
    assumed_gap_mean: float | None = None
    switched_tokens: int = 0
    switched_gap_mean: float | None = None


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6) -> list[float]:
    """(r - mean of its group) / (std of its group + eps); 0 for a singleton or a flat group."""
    by_group: dict[Hashable, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups, strict=True):
        by_group[g].append(r)
    stats = {}
    for g, rs in by_group.items():
        mean = statistics.fmean(rs)
        std = statistics.stdev(rs) if len(rs) > 1 else 0.0
        stats[g] = (mean, std)
    out = []
    for r, g in zip(rewards, groups, strict=True):
        mean, std = stats[g]
        out.append(0.0 if std < eps else (r - mean) / (std + eps))
    return out


def truncated_ratio(logp: Any, behaviour_logp: Any, cap: float) -> Any:
    """Per token ``min(exp(logp - behaviour_logp), cap)``: the importance ratio of the trainer's
    policy over the one that sampled the token, truncated (no gradient flows through it)."""
    import torch

    return torch.clamp(torch.exp(logp - behaviour_logp), max=cap)


def trl_clipped_loss(logp: Any, behaviour_logp: Any, advantage: float, epsilon: float) -> tuple[Any, Any]:
    """TRL 1.16.0 AsyncGRPO's per-token loss (``async_grpo_trainer.py`` ``compute_loss``):
    ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r = exp(logp - old_logp)`` against the
    rollout's recorded log-probabilities; and the mask of tokens in the clipped region, as its
    ``clip_ratio/region_mean`` counts them."""
    import torch

    r = torch.exp(logp - behaviour_logp)
    per_token = -torch.min(r * advantage, torch.clamp(r, 1 - epsilon, 1 + epsilon) * advantage)
    clipped = ((r < 1 - epsilon) & (advantage < 0)) | ((r > 1 + epsilon) & (advantage > 0))
    return per_token, clipped


def _picked(logp_row: Any, ids_row: Any, pos: Any) -> Any:
    """The log-probability of each token at ``pos`` (position j - 1 predicts token j)."""
    return logp_row[pos - 1].gather(-1, ids_row[pos].unsqueeze(-1)).squeeze(-1)


def _mean_max(xs: list[float]) -> tuple[float | None, float | None]:
    return (statistics.fmean(xs), max(xs)) if xs else (None, None)


def lora_config(rank: int) -> Any:
    from peft import LoraConfig

    from lora_versions_dev.fixtures import TARGET_MODULES

    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        bias="none",
        target_modules=list(TARGET_MODULES),
        task_type="CAUSAL_LM",
    )


class Trainer:
    def __init__(self, model_dir: Path, *, rank: int, lr: float, seed: int, pad_id: int = 0) -> None:
        import torch
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        # One intra-op thread: the engines share these cores. With torch's default (one thread
        # per core) an update took 3.6 s on average while the engines decoded beside it; 0.2 s
        # with one (measured in full runs here; 0.06 s on an idle machine).
        torch.set_num_threads(1)
        torch.manual_seed(seed)  # the LoRA A init; B starts at zero, so W_0 is the base model
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = get_peft_model(base, lora_config(rank))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=lr)
        self.pad_id = pad_id
        self.step = 0  # optimizer steps done: the trainer holds W_step
        # the LoRA weights of the last few steps, to measure what an episode's assumed version
        # gives its tokens (the published snapshot of step v is exactly these weights)
        self.weights_at: dict[int, list[Any]] = {0: [p.detach().clone() for p in self.params]}

    def _keep_weights(self, keep: int = 8) -> None:
        self.weights_at[self.step] = [p.detach().clone() for p in self.params]
        for old in [s for s in self.weights_at if s <= self.step - keep]:
            del self.weights_at[old]

    def _logprobs_at(self, step: int, ids: Any, attn: Any) -> Any:
        """Log-probabilities of every next token under the weights of ``step`` (no gradient)."""
        import torch

        current = [p.data for p in self.params]
        try:
            for p, w in zip(self.params, self.weights_at[step], strict=True):
                p.data = w
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
            return torch.log_softmax(logits[:, :-1], dim=-1)
        finally:
            for p, w in zip(self.params, current, strict=True):
                p.data = w

    def snapshot(self) -> Any:
        from relax_glue.snapshot import Snapshot

        return Snapshot.from_peft_model(self.model)

    def train_step(
        self,
        samples: Sequence[Sample],
        correction: str = "none",
        tis_cap: float = 2.0,
        trl_epsilon: float = 0.2,
    ) -> StepStats:
        """One update on ``samples`` (blocking; run it in a thread so rollouts go on);
        ``correction``: "tis" weights each token by its truncated importance ratio over the
        engine's log-probability, "tis-label" over the log-probability of the version the sample
        is taken for (``assumed_step``, recomputed here), "trl" takes TRL's clipped surrogate,
        "none" neither."""
        if correction == "tis-label" and any(s.assumed_step not in self.weights_at for s in samples):
            raise ValueError("tis-label needs the weights of every sample's assumed_step")
        import torch

        t0 = time.monotonic()
        width = max(len(s.tokens) for s in samples)
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(samples), width), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
            attn[i, : len(s.tokens)] = 1
        # Right padding: the real tokens keep positions 0..n-1, exactly as the engine saw them.
        assumed = {
            step: self._logprobs_at(step, ids, attn)
            for step in {s.assumed_step for s in samples}
            if step is not None and step in self.weights_at
        }
        logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
        logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # position j-1 predicts token j
        advantages = group_advantages([s.reward for s in samples], [s.group for s in samples])
        n_tokens = sum(e - b for s in samples for b, e in s.spans)
        loss = logits.new_zeros(())
        fresh: list[float] = []
        stale: list[float] = []
        weights: list[float] = []
        ratios: list[float] = []
        cut: list[bool] = []
        gaps: list[float] = []
        switched: list[float] = []
        for i, s in enumerate(samples):
            pos = torch.tensor([j for b, e in s.spans for j in range(b, e)])
            lp = _picked(logp_all[i], ids[i], pos)
            behaviour = torch.tensor(s.engine_logprobs)
            ratio = torch.exp(lp.detach() - behaviour)
            # the log-probabilities of the version the trainer takes the episode for
            lp_label = _picked(assumed[s.assumed_step][i], ids[i], pos) if s.assumed_step in assumed else None
            if correction == "trl":
                token_loss, clipped = trl_clipped_loss(lp, behaviour, advantages[i], trl_epsilon)
                loss = loss + token_loss.sum() / n_tokens
                w = ratio
                cut += clipped.tolist()
            elif correction in ("tis", "tis-label"):
                # tis-label: the behaviour probabilities the trainer recomputes from the weights
                # of the version it takes the episode for, instead of the engine's own
                w = truncated_ratio(
                    lp.detach(), lp_label if correction == "tis-label" else behaviour, tis_cap
                )
                loss = loss - advantages[i] * (w * lp).sum() / n_tokens
                cut += (w >= tis_cap).tolist()
            else:
                w = torch.ones_like(lp)
                loss = loss - advantages[i] * lp.sum() / n_tokens
            ratios += ratio.tolist()
            diffs = (lp.detach() - behaviour).abs().tolist()
            per_token = s.token_staleness or (s.staleness,) * len(diffs)
            for d, st, wt in zip(diffs, per_token, w.tolist(), strict=True):
                (stale if st else fresh).append(d)
                if st:
                    weights.append(wt)
            if lp_label is not None:
                gap = (lp_label - behaviour).abs().tolist()
                gaps += gap
                # a token another version served: its staleness is not the episode's
                switched += [g for g, st in zip(gap, per_token, strict=True) if st != s.staleness]
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in self.params if p.grad is not None))
        self.opt.step()
        self.step += 1
        self._keep_weights()
        fm, fx = _mean_max(fresh)
        sm, sx = _mean_max(stale)
        truncated = (
            sum(x >= tis_cap for x in weights) / len(weights)
            if weights and correction in ("tis", "tis-label")
            else None
        )
        return StepStats(
            step=self.step,
            loss=float(loss.detach()),
            reward_mean=statistics.fmean(s.reward for s in samples),
            episodes=len(samples),
            tokens=n_tokens,
            grad_norm=grad_norm,
            fresh_tokens=len(fresh),
            fresh_abs_diff_mean=fm,
            fresh_abs_diff_max=fx,
            stale_tokens=len(stale),
            stale_abs_diff_mean=sm,
            stale_abs_diff_max=sx,
            seconds=time.monotonic() - t0,
            stale_weight_mean=statistics.fmean(weights) if weights else None,
            stale_weight_truncated=truncated,
            ratio_var=statistics.pvariance(ratios) if ratios else None,
            cut_share=sum(cut) / len(cut) if cut else (0.0 if correction == "none" else None),
            assumed_gap_mean=statistics.fmean(gaps) if gaps else None,
            switched_tokens=len(switched),
            switched_gap_mean=statistics.fmean(switched) if switched else None,
        )
