"""TRL's GRPOTrainer on immutable LoRA versions (``python -m examples.trl_grpo``; see README.md
here): the integration (the ``relax_glue.trl`` package) on two CPU engines behind smg.

``task`` (the dataset, the tool turn, the reward, the CPU ``GRPOConfig``, the probes), ``train``
(one training process, and how several are launched), ``checks`` (pure checks over what every
rank recorded), ``run`` (engines, gateway, training, report and plot).
"""
