#!/usr/bin/env bash
# hsync against the oldest torch it supports, 2.11: what the GPU machines carry, with no network to
# fetch another (C++17, NCCL 2.28.9). A virtual environment of its own builds a copy of the sources,
# CUDA and NCCL parts included, so that a newer API, C++ or Python, fails here rather than on a GPU
# machine; then the tests of what differs between the two torches run there.
#
#   scripts/check_oldest_torch.sh --setup   installs torch 2.11 and builds (scripts/setup.sh --tests)
#   scripts/check_oldest_torch.sh           builds what changed since, then runs those tests
#
# Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."

OLDEST_TORCH=2.11.0
root=$PWD
venv=$root/.venv/torch-$OLDEST_TORCH
tree=$root/build/torch-$OLDEST_TORCH  # the build writes hsync/_C*.so beside the sources: a copy of its own
installed() { "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$OLDEST_TORCH')" 2> /dev/null; }

export PIP_NO_CACHE_DIR=1 PIP_CONSTRAINT=''  # any pinned constraints name the other torch
if [ "${1:-}" = "--setup" ] || ! installed; then
  # Only torch itself and the NCCL it names are its own (about 1.4 GiB): everything else, its CUDA
  # libraries (3 GiB) and the test dependencies among them, is the main environment's, put after its
  # own on the path. A second full copy would not fit on every CI machine's disk.
  main_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -x "$venv/bin/python" ] || .venv/bin/python -m venv "$venv"  # the same Python, to share its packages
  own_site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$main_site" > "$own_site/main-environment.pth"
  free_gib=$(df -Pk "$venv" | awk 'NR == 2 {print int($4 / 1048576)}')
  if ! installed && [ "$free_gib" -lt 3 ]; then
    # As the GPU tests skip without a GPU: the GPU check builds against this torch in any case.
    echo "check_oldest_torch.sh: SKIPPED: $free_gib GiB of disk free, torch $OLDEST_TORCH needs 3 to install" >&2
    exit 0
  fi
  "$venv/bin/pip" install -q --no-deps "torch==$OLDEST_TORCH" "setuptools>=70.1"
  nccl=$("$venv/bin/python" -c "from importlib.metadata import requires
print(next(r.split(';')[0].strip() for r in requires('torch') if r.startswith('nvidia-nccl')))")
  "$venv/bin/pip" install -q --no-deps "$nccl"
fi

# Every file git would commit, modification times kept so that ninja rebuilds only what changed; a
# file of an earlier copy that git no longer has (moved, deleted) goes, but for the build's outputs.
mkdir -p "$tree"
files=$(mktemp)
git ls-files --cached --others --exclude-standard | while IFS= read -r file; do
  [ -e "$file" ] && printf '%s\n' "$file"
done | sort > "$files"
tr '\n' '\0' < "$files" | xargs -0 cp -p --parents -t "$tree"
(cd "$tree" && find csrc hsync tests examples scripts -type f ! -name '*.so' ! -name '*.pyc' | sort |
  comm -23 - "$files" | tr '\n' '\0' | xargs -0 -r rm -f)
rm -f "$files"

cd "$tree"
if ! command -v nvidia-smi > /dev/null; then export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}; fi
# Built again only if an extension is missing or a file they are built from is newer than one (the copy kept
# their times): pip's editable install takes 9 s even when ninja finds nothing to do.
built() {
  local so
  for so in _C _planner; do
    so=$(find hsync -maxdepth 1 -name "$so.*.so" -print -quit)
    [ -n "$so" ] && [ -z "$(find csrc setup.py pyproject.toml -newer "$so" -print -quit)" ] || return 1
  done
}
if ! built; then
  MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/pip" install -q --no-build-isolation --no-deps -e .
fi
"$venv/bin/python" -c "import hsync, torch; print(f'hsync built against torch {torch.__version__}',
                       f'and NCCL {hsync._C.nccl_version()}' if hsync._C.cuda_enabled else '(CPU only)')"
[ "${1:-}" = "--setup" ] && exit 0

# What differs between the torches: the extension's loading and kernels, the Python side of every GPU
# test (collected and skipped here, so that an import that 2.11 lacks fails), the weighted maths and
# torch.compile's handling of the wrapper (dynamo changes from release to release: a compiled wrapper's
# exact steps and its graphs split at the buckets), DDP's surface as this torch's DDP has it (attributes,
# arguments, methods, comm hooks, compiled graphs, and Join, whose group of hsync's is entered in
# torch.distributed's tables: hsync/join.py), checkpoints' loading, and the benchmark's command line and its
# rows against DDP. A save killed midway is left out: it tests the file system, which no torch release
# changes. Two scenarios are left out too: their reference, torch 2.11's own DDP, fails them (an in-place
# buffer broadcast between two forwards; dynamo's nested graph breaks through DDP's forward).
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 tests/unit tests/gpu tests/bench/test_bench_cli.py \
  tests/bert/test_checkpoint.py tests/distributed/test_parity.py tests/distributed/test_comm_dtype.py \
  tests/distributed/test_ddp_dropin.py -k "((not test_ddp_dropin and not test_comm_dtype) or attribute or argument \
or method or unwraps or compiled_graphs_split or hook or join) and not compile_keeps_weighted_steps_exact[module] \
and not killed_midway"
