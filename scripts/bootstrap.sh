#!/usr/bin/env bash
# One bootstrap for both README commands: creates .venv if missing and installs the project
# (editable, with its test and ray extras). Skips all work when nothing that shapes the
# environment changed, so a second run starts in seconds. Needs only Python 3.11 and pip.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.lora-versions-bootstrap"
EXTRAS="engine,trainer,test,ray,gateway,trl"

find_python() {
  for candidate in "${PYTHON:-}" python3.11 python3 python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "bootstrap: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2
  return 1
}

want=$( { cat pyproject.toml scripts/bootstrap.sh; echo "$EXTRAS"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  py=$(find_python)
  echo "bootstrap: creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
mkdir -p .runs
log=.runs/bootstrap-pip.log
echo "bootstrap: installing the project with [$EXTRAS] (cold: about 6 minutes, several GB; log: $log)"
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -e ".[$EXTRAS]" >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "bootstrap: pip install failed (full log: $log)" >&2
  exit 1
fi
echo "$want" >"$STAMP"
echo "bootstrap: done in $(( $(date +%s) - start ))s"
