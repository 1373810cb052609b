"""Online RL on CPU: a PEFT LoRA trained by a group-baseline policy gradient publishes a new
immutable version after every step while multi-turn agent rollouts keep going through the smg
gateway (``python -m examples.online_rl``; see README.md here).

Functional core: ``reward`` (the verifiable reward), ``task`` (prompts, the scripted tool),
``policy`` (staleness and backpressure), ``report`` (invariants, summary, plot). Imperative shell:
``trainer`` (the PEFT model and its update), ``rollout`` (episodes through the session layer),
``run`` (engines, gateway, the loop).
"""
