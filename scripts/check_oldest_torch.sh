#!/usr/bin/env bash
# Builds hsync against the oldest torch it supports, 2.11: what the GPU machines carry, with no
# network to fetch another (C++17, NCCL 2.28, which has no ncclCommRevoke). The build, CUDA and
# NCCL parts included, runs in a virtual environment of its own on a copy of the sources; then the
# CPU side of the code the GPU check runs is tested there. A newer API, C++ or Python, fails here
# rather than on a GPU machine.
#
#   scripts/check_oldest_torch.sh      (expects scripts/setup.sh to have run)
set -euo pipefail
cd "$(dirname "$0")/.."

OLDEST_TORCH=2.11.0
root=$PWD
venv=$root/.venv/torch-$OLDEST_TORCH
tree=$root/build/torch-$OLDEST_TORCH  # the build writes hsync/_C*.so beside the sources: a copy of its own

export PIP_NO_CACHE_DIR=1 PIP_CONSTRAINT=''  # any pinned constraints name the other torch
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
# requirements-dev.txt's pins, with this torch (and the NCCL and setuptools it names) instead, and no
# linter; the build takes setuptools from this environment.
grep -v -e '^torch==' -e '^ruff==' requirements-dev.txt > "$venv/requirements.txt"
"$venv/bin/pip" install -q "torch==$OLDEST_TORCH" "setuptools>=70.1" -r "$venv/requirements.txt"

# Every file git would commit, modification times kept so that ninja rebuilds only what changed.
mkdir -p "$tree"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' file; do
  [ -e "$file" ] && printf '%s\0' "$file"
done | xargs -0 cp -p --parents -t "$tree"

cd "$tree"
if ! command -v nvidia-smi > /dev/null; then export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}; fi
MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/pip" install -q --no-build-isolation --no-deps -e .
"$venv/bin/python" -c "import hsync, torch; print(f'hsync built against torch {torch.__version__}',
                       f'and NCCL {hsync._C.nccl_version()}' if hsync._C.cuda_enabled else '(CPU only)')"
# The drop-in scenarios too, but two whose reference, torch 2.11's own DDP, fails them (an in-place
# buffer broadcast between two forwards; dynamo's nested graph breaks through DDP's forward).
dropin=tests/distributed/test_ddp_dropin.py
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/unit tests/gpu tests/distributed/test_parity.py \
  tests/distributed/test_comm_dtype.py tests/distributed/test_faults.py tests/distributed/test_bench_smoke.py \
  tests/distributed/test_bench_compiled.py $dropin \
  --deselect $dropin::test_two_forwards_one_backward_with_batch_norm \
  --deselect "$dropin::test_a_compiled_wrapper_compiles_once_as_a_compiled_ddp_does[nested-graph-breaks]"
