#!/usr/bin/env bash
# The online RL showcase: bootstrap, then examples/online_rl on two local CPU SGLang engines behind
# the smg gateway (a LoRA trained on CPU publishes a new version every step while agent rollouts go
# on). Extra arguments go to `python -m examples.online_rl` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m examples.online_rl "$@"
