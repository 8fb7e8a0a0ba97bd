#!/usr/bin/env bash
# Everything that needs a GPU, in one call: build the extension against the machine's own torch,
# run the GPU tests (CUDA kernels against torch ops, the NCCL path with several ranks on one GPU),
# the GPU benchmarks and then the rest of the suite, and write a report with the hardware and versions.
#
#   scripts/gpu_check.sh [REPORT_DIR]      (default: benchmarks/results)
#
# Uses the python3 on PATH and its torch (no virtual environment, no network needed).
set -uo pipefail
cd "$(dirname "$0")/.."
report_dir=${1:-benchmarks/results}
mkdir -p "$report_dir"
report="$report_dir/gpu-check-$(date -u +%Y-%m-%d).md"
export PYTHONUNBUFFERED=1

# A hung test must not eat the whole GPU lease: each test gets a deadline where pytest-timeout exists.
run_tests() {
  local deadline=()
  python3 -c "import pytest_timeout" 2>/dev/null && deadline=(--timeout 120)
  python3 -m pytest -q -p no:cacheprovider "${deadline[@]}" "$@" 2>&1 | tail -n 30
}

TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1

{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'PY'
import torch, hsync
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL (hsync) {hsync._C.nccl_version()}, "
      f"NCCL (torch) {'.'.join(map(str, torch.cuda.nccl.version()))}")
PY
  echo '```'
  echo
  echo '## GPU tests'
  echo
  echo '```'
  run_tests tests/gpu
  echo '```'
  echo
  echo '## Benchmarks (one GPU, one rank)'
  echo
  plot=()
  python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$report_dir/gpu-bench.png")
  python3 -m hsync.bench --device cuda --world-size 1 --json "$report_dir/gpu-bench.json" \
    --markdown "$report_dir/gpu-bench.md" "${plot[@]}" 2>&1 \
    | grep -v '^  '
  echo
  echo '## The rest of the suite, against this torch'
  echo
  echo '```'
  run_tests tests/unit tests/distributed
  echo '```'
} | tee "$report"
echo "report: $report"
