#!/usr/bin/env bash
# TRL's GRPOTrainer on immutable LoRA versions: bootstrap (with the trl extra), then
# examples/trl_grpo on two local CPU SGLang engines behind the smg gateway (each step's LoRA
# published as a new version, every completion a multi-turn episode on one session). Extra
# arguments go to `python -m examples.trl_grpo` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m examples.trl_grpo "$@"
