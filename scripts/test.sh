#!/usr/bin/env bash
# The test command: bootstrap, lint, then every test (unit tests and real CPU SGLang engines).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/trainer_tests -q`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
