#!/usr/bin/env bash
# The RFC 7.2 / 7.3 acceptance suite (gpu_tests/) on this machine's device, in one command:
# bootstrap, detect the device (CUDA if torch sees a GPU, else CPU; ACCEPTANCE_DEVICE=cpu|cuda
# overrides), generate that device's fixtures (on CUDA: a bf16 random Qwen3 with Qwen3-0.6B's
# dimensions and rank-64 adapters, made locally, no download), run the suite, write the report
# (report.json + report.txt, and every engine log) under .runs/acceptance/<device>-<time>/.
#
#   bash scripts/gpu_acceptance.sh             # the suite on this device
#   bash scripts/gpu_acceptance.sh --dry-run   # no GPU needed: the GPU path as far as it goes
#                                              # without one (engine lines, bf16 fixtures, HF run)
# Extra arguments go to pytest. Not run on a GPU by us: no machine of ours has one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh

tests=(gpu_tests)
if [ "${1:-}" = "--dry-run" ]; then
  shift
  tests=(gpu_tests/test_device_profile.py)
fi
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
ACCEPTANCE_REPORT_DIR="$out" exec .venv/bin/python -m pytest "${tests[@]}" -ra "$@"
