#!/usr/bin/env bash
# The RFC 7.2 / 7.3 acceptance suite (gpu_tests/) on this machine's device, in one command:
# bootstrap, detect the device (CUDA if torch sees a GPU, else CPU; ACCEPTANCE_DEVICE=cpu|cuda
# overrides), generate that device's fixtures (on CUDA: a bf16 random Qwen3 with Qwen3-0.6B's
# dimensions and adapters of ranks 32/16/48 in a rank-64 pool, made locally, no download), run
# the suite, write the report (report.json + report.txt, and every engine log) under
# .runs/acceptance/<device>-<time>/.
#
#   bash scripts/gpu_acceptance.sh                    # the suite on this device
#   bash scripts/gpu_acceptance.sh --wheels DIR       # install from a wheel folder, no package index
#   bash scripts/gpu_acceptance.sh --dry-run          # no GPU needed: the GPU path as far as it goes
#                                                     # without one (engine lines, bf16 fixtures, HF run)
#
# A GPU host without a package index: make the wheel folder on a connected Linux x86_64 host with
# Python 3.11, from this repository's root (about 6 GB: torch's CUDA build, sglang, sgl-kernel):
#
#   python3.11 -m pip download -d wheels ".[engine,trainer,test,ray,gateway,trl]" "setuptools>=68" wheel
#
# and copy it with the repository; --wheels DIR then installs with pip from DIR only
# (--no-index --find-links DIR; uv is not used). Options may be combined; everything after them
# goes to pytest. Not run on a GPU by us: no machine of ours has one.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=(gpu_tests)
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) tests=(gpu_tests/test_device_profile.py gpu_tests/test_acceptance_rules.py); shift ;;
    --wheels)
      [ -d "${2:-}" ] || { echo "gpu_acceptance: --wheels needs a folder of wheels, got '${2:-}'" >&2; exit 2; }
      PIP_FIND_LINKS=$(cd "$2" && pwd)
      export PIP_FIND_LINKS PIP_NO_INDEX=1 LORA_VERSIONS_BOOTSTRAP_PIP=1
      echo "gpu_acceptance: installing from $PIP_FIND_LINKS only (no package index)"
      shift 2 ;;
    *) break ;;
  esac
done
bash scripts/bootstrap.sh

device=$(.venv/bin/python -c "from lora_versions_dev.device_profile import detect_profile; print(detect_profile().device)")
out=${ACCEPTANCE_REPORT_DIR:-.runs/acceptance/$device-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
echo "gpu_acceptance: device=$device, report and engine logs in $out"
.venv/bin/python - <<'PY'
from lora_versions_dev.device_profile import detect_profile, ensure_acceptance_fixtures, ensure_gpu_fixtures

profile = detect_profile()
print("gpu_acceptance:", profile.banner())
print("gpu_acceptance: fixtures", ensure_acceptance_fixtures(profile).model_dir.parent)
if profile.device == "cpu":
    print("gpu_acceptance: GPU-profile fixtures (dry-run input)", ensure_gpu_fixtures())
PY
ACCEPTANCE_REPORT_DIR="$out" exec .venv/bin/python -m pytest "${tests[@]}" -ra --durations=0 "$@"
