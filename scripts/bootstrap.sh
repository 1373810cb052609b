#!/usr/bin/env bash
# One bootstrap for both README commands: creates .venv if missing and installs the project
# (editable, with its test and ray extras; with uv, or pip when uv cannot). Skips all work when
# nothing that shapes the environment changed, so a second run starts in seconds. Needs only
# Python 3.11 and pip.
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
: >"$log"

# uv installs the same resolution as pip (checked on this machine: the same 227 packages and
# versions) in about 1 minute against pip's 4-5, most of CI's bootstrap. It does not read pip's
# configuration, so the machine's indexes, wheel folders and constraints are handed over; pip's
# best-match over all indexes is asked for. Any failure falls back to plain pip.
UV_VERSION=0.13.9
pip_config_for_uv() {
  "$VENV/bin/python" -m pip config list 2>/dev/null | while IFS= read -r line; do
    key=${line%%=*}; value=${line#*=}; value=${value#"'"}; value=${value%"'"}
    case "$key" in
      *.index-url) echo "--index-url"; echo "$value" ;;
      *.extra-index-url) for v in $value; do echo "--extra-index-url"; echo "$v"; done ;;
      *.find-links) for v in $value; do echo "--find-links"; echo "$v"; done ;;
      *.constraint) for v in $value; do echo "--constraint"; echo "$v"; done ;;
    esac
  done
}
install_with_uv() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "uv==$UV_VERSION" >>"$log" 2>&1 || return 1
  local args=()
  mapfile -t args < <(pip_config_for_uv)
  # --compile-bytecode: pip writes every .pyc at install and uv does not by default; where
  # PYTHONDONTWRITEBYTECODE is set (this machine), every engine process would otherwise compile
  # SGLang and torch from source at each start.
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode \
    "${args[@]}" -e ".[$EXTRAS]" >>"$log" 2>&1
}

echo "bootstrap: installing the project with [$EXTRAS] (cold: 1-6 minutes, several GB; log: $log)"
if [ "${LORA_VERSIONS_BOOTSTRAP_PIP:-0}" != "1" ] && install_with_uv; then
  echo "bootstrap: installed with uv $UV_VERSION"
elif ! "$VENV/bin/python" -m pip install --disable-pip-version-check -e ".[$EXTRAS]" >>"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "bootstrap: pip install failed (full log: $log)" >&2
  exit 1
fi
echo "$want" >"$STAMP"
echo "bootstrap: done in $(( $(date +%s) - start ))s"
