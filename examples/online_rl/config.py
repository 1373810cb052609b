"""Every knob of the online RL example, in one frozen record (written into the report)."""

from __future__ import annotations

import dataclasses

ROLLOUTS = ("pinned", "per-turn")
CORRECTIONS = ("tis", "trl", "none", "tis-label")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = 30  # optimizer steps; one publication attempt after each
    # Stop before ``steps`` once the mean batch reward of the last report.REWARD_WINDOW updates
    # reaches this (a target-reward stop, as RL runs have); None: every step runs.
    until_reward: float | None = None
    workers: int = 4  # concurrent rollout workers, one episode (one session) at a time each
    seed: int = 0  # LoRA init and the tool's latencies (engine sampling is not seeded)
    engines: int = 2
    # The objective: a GRPO-style group baseline over the episodes of one prompt in a batch.
    group_size: int = 8  # episodes per prompt per batch; batch = group_size x len(prompts)
    tokens_per_turn: int = 4  # sampled tokens per assistant turn (ignore_eos: exactly this many)
    assistant_turns: int = 2  # assistant turns per episode, a tool turn between two of them
    # Which version each turn runs (issue 40; "per-turn" exists only to be compared, see
    # docs/why-pin.md): "pinned" = this project's rule, the episode binds the default at its
    # first generation and every turn carries it; "per-turn" = TRL AsyncGRPO's, every turn asks
    # for the default of the moment (here: one session per turn), so one episode may span versions.
    rollout: str = "pinned"
    lr: float = 3e-2  # Adam on the LoRA parameters (measured offline: reward takes off in 5-9 steps)
    rank: int = 8  # the engines run with --max-lora-rank 8
    temperature: float = 1.0
    # Staleness and backpressure (see policy.py). Episodes of the last max_staleness + 1 policies
    # may be in flight at once, so the epoch's capacity K = max_staleness + 1 publishes every step
    # without waiting for old episodes (the engines have 5 LoRA slots: K <= 4).
    max_staleness: int = 2
    capacity: int = 3
    # Off-policy correction (trainer.py): "tis" = per-token truncated importance ratio
    # pi_trainer / pi_engine (the engine's recorded logprobs of the version attested for each
    # token), capped at tis_cap; "trl" = TRL AsyncGRPO's clipped surrogate against the same
    # logprobs (epsilon trl_epsilon); "none"; "tis-label" = the truncated ratio over the
    # probabilities of the version the episode is taken for, recomputed by the trainer (what a
    # trainer that trusts its version label computes; exact only if every token came from it).
    correction: str = "tis"
    tis_cap: float = 2.0
    trl_epsilon: float = 0.2  # TRL 1.16.0 AsyncGRPOConfig.epsilon's default (epsilon_high = epsilon)
    # Route the episodes of one prompt together (sessions.open(..., group=prompt)): one engine per
    # group, so the group's shared prompt is prefilled once there.
    group_routing: bool = True
    reclaim_wait_s: float = 1.0
    forced_wait_s: float = 60.0
    # The scripted tool: most calls answer fast, a few are slow (a straggler episode holds its
    # version, and with it a slot, which is what makes capacity a real backpressure signal).
    tool_latency_s: tuple[float, float] = (0.02, 0.15)
    slow_tool_p: float = 0.1
    slow_tool_latency_s: tuple[float, float] = (3.0, 8.0)
    # Sampling of the slots in use (registry and engines), for the report.
    sample_every_s: float = 0.2

    def __post_init__(self) -> None:
        if self.steps < 1 or self.workers < 1 or self.engines < 1 or self.group_size < 2:
            raise ValueError("steps, workers and engines must be >= 1, group_size >= 2")
        if not 1 <= self.rank <= 8:
            raise ValueError("the engines serve LoRA ranks up to 8 (--max-lora-rank 8)")
        if not 2 <= self.capacity <= 4:
            raise ValueError("capacity must be 2..4 (the CPU engines hold 4 managed versions)")
        if self.until_reward is not None and not 0.0 < self.until_reward <= 1.0:
            raise ValueError("until_reward is a mean reward in (0, 1]")
        if self.correction not in CORRECTIONS or self.tis_cap < 1.0 or not 0 < self.trl_epsilon < 1:
            raise ValueError(f"correction is one of {CORRECTIONS} (tis_cap >= 1, 0 < trl_epsilon < 1)")
        if self.rollout not in ROLLOUTS or self.assistant_turns < 1:
            raise ValueError(f"rollout is one of {ROLLOUTS}; assistant_turns >= 1")
        if self.max_staleness < 1:
            raise ValueError(
                "max_staleness must be >= 1 (0 would forbid any overlap of rollout and training)"
            )
