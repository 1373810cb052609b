#!/usr/bin/env bash
# The main job: bootstrap, then the demo on two local CPU SGLang engines with the built-in tiny
# model. Extra arguments go to `lora-versions-dev demo` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/lora-versions-dev demo "$@"
