#!/usr/bin/env bash
# Compiles every source of the extension, CUDA and NCCL parts included, against the headers of the
# oldest torch hsync supports, in the C++ standard that torch builds extensions with (C++17 for
# 2.11; torch 2.14, which the virtual environment runs, needs C++20). The GPU machines we test on
# carry torch 2.11 and no network: a newer API or language feature must fail here, not there.
# C++ sources: syntax and templates only (-fsyntax-only); the kernels: compiled for one architecture.
#
#   scripts/check_oldest_torch.sh      (expects scripts/setup.sh to have run)
set -euo pipefail
cd "$(dirname "$0")/.."

OLDEST_TORCH=2.11.0
STD=c++17
PY=.venv/bin/python
headers=.venv/oldest-torch/torch-$OLDEST_TORCH
if [ ! -f "$headers/nvidia/nccl/include/nccl.h" ]; then
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  # extract WHEEL PREFIX: unpacks the files under PREFIX into $headers; prints the wheel's NCCL requirement.
  extract() {
    "$PY" - "$1" "$2" "$headers" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = wheel.namelist()
    wheel.extractall(sys.argv[3], [name for name in names if name.startswith(sys.argv[2])])
    metadata = wheel.read(next(name for name in names if name.endswith(".dist-info/METADATA"))).decode()
print(" ".join(re.findall(r"^Requires-Dist: (nvidia-nccl-\S+==\S+)", metadata, re.MULTILINE)))
PY
  }
  # Only the headers are needed: torch's, and those of the NCCL it was released with (2.28 for torch
  # 2.11, which has no ncclCommRevoke: the code for older NCCL must compile too). The pinned
  # constraints name another torch, hence the empty constraint.
  PIP_CONSTRAINT='' "$PY" -m pip download -q --no-deps -d "$wheels" "torch==$OLDEST_TORCH"
  nccl=$(extract "$wheels"/torch-*.whl torch/include/)
  [ -n "$nccl" ] || { echo "torch $OLDEST_TORCH's wheel names no NCCL to check against" >&2; exit 1; }
  PIP_CONSTRAINT='' "$PY" -m pip download -q --no-deps -d "$wheels" "$nccl"
  extract "$wheels"/nvidia_nccl_*.whl nvidia/nccl/include/ > /dev/null
fi

include=(-Icsrc -I"$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
for sub in include include/torch/csrc/api/include; do include+=(-I"$headers/torch/$sub"); done
flags=(-std=$STD -fsyntax-only -fvisibility=hidden -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)

sources=(csrc/*.cpp csrc/comm/*.cpp csrc/kernels/*.cpp)
cuda_home=$(nvcc -dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1 || true)
if [ -n "$cuda_home" ]; then
  site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  include+=(-I"$cuda_home/include" -I"$site/nvidia/cu13/include" -I"$headers/nvidia/nccl/include")
  flags+=(-DHSYNC_WITH_CUDA)
else
  echo "no CUDA toolkit: checking the CPU sources only"
  sources=($(printf '%s\n' "${sources[@]}" | grep -v -e nccl_comm -e pack_cuda))
fi

printf '%s\n' "${sources[@]}" | xargs -P "${MAX_JOBS:-2}" -I{} g++ "${flags[@]}" "${include[@]}" {}
if [ -n "$cuda_home" ]; then
  for cu in csrc/kernels/*.cu; do
    nvcc -std=$STD -arch=sm_90 -DHSYNC_WITH_CUDA --expt-relaxed-constexpr "${include[@]}" -c -o /dev/null "$cu"
  done
fi
nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$headers/nvidia/nccl/include/nccl.h" | paste -sd.)
echo "compiles against the headers of torch $OLDEST_TORCH and NCCL $nccl_version in $STD: ${#sources[@]} C++ sources$([ -n "$cuda_home" ] && echo ' and the CUDA kernels')"
