#!/usr/bin/env bash
# Everything that needs a GPU, in one command that ends within ten minutes on a bare GPU machine:
# build the extension against the machine's own torch, run every GPU test (the CUDA kernels against
# torch's ops; the NCCL path with several ranks on one GPU: faults, busy time, torch's NCCL group
# beside hsync's, the trainer without host syncs, balancing a slowed rank), then a short GPU
# benchmark. The CPU suite is CI's.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Every section runs under its own time limit, within GPU_CHECK_SECONDS in all (default 570), and
# writes its log into OUT_DIR as it runs; OUT_DIR/report.md grows a section at a time, so a run
# cut short still leaves what it had: the sections' logs, the report, the benchmark's JSON and page,
# the step's profile, and failures.md where a test failed. Uses the python3 on PATH
# and its torch (no network needed). GPU_CHECK_TESTS, where set, names the tests to run instead of
# all of tests/gpu; GPU_CHECK_BENCH=0 leaves the benchmark and the profile out (a rerun of some tests).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
report="$out/report.md"
started=$SECONDS
budget=${GPU_CHECK_SECONDS:-570}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # no network to ask

# section NAME LIMIT_S COMMAND...: runs COMMAND for at most LIMIT_S (less if the budget is nearly
# spent), its output tee'd to OUT_DIR/NAME.log, and adds its status and last lines to the report.
section() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - started)))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    printf '\n## %s\n\nskipped: the time budget was spent\n' "$name" >> "$report"
    return 1
  fi
  local begun=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local status=${PIPESTATUS[0]}
  local verdict="passed"
  if ((status == 124 || status == 137)); then
    verdict="timed out after $limit s"
  elif ((status != 0)); then
    verdict="failed (exit $status)"
  fi
  {
    printf '\n## %s: %s in %d s\n\n```\n' "$name" "$verdict" $((SECONDS - begun))
    tail -n 25 "$out/$name.log"
    printf '```\n'
  } >> "$report"
  return $status
}

versions() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL (torch) '
                                  + '.'.join(map(str, torch.cuda.nccl.version())))"
  python3 -c "import hsync; print('NCCL (hsync)', hsync._C.nccl_version())" 2>/dev/null || true
}

# -v names each test as it starts, so the log of a section cut short shows which test hung;
# pytest-timeout, where installed, ends a hung test before the section's limit ends everything.
# -rfEs lists failures, errors and skips by name at the end, where the report's tail shows them.
pytest_args=(-v -p no:cacheprovider -rfEs --durations=5)
python3 -c "import pytest_timeout" 2>/dev/null && pytest_args+=(--timeout 100)

printf '# GPU check, %s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')" > "$report"
# HSYNC_WITH_CUDA=1: a build that cannot find the toolkit fails here, not as skipped GPU tests.
HSYNC_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
  section build 240 python3 -m pip install --no-build-isolation --no-deps -e .
built=$?
# torchft for the failover test, from wheels carried along (no network there): .whl/, which scripts/gpu_wheels.sh
# fills for the GPU machine's Python. Without them that test skips.
# Only the wheels of what the machine lacks: a newer protobuf or typing_extensions ahead of its own on PYTHONPATH
# would change what every later section imports.
missing_wheels() {
  python3 - .whl/*.whl <<'PY'
import importlib.metadata, sys
for wheel in sys.argv[1:]:
    try:
        importlib.metadata.version(wheel.rsplit("/", 1)[-1].split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PY
}
if compgen -G ".whl/*.whl" > /dev/null; then
  mapfile -t wheels < <(missing_wheels)
  if ((${#wheels[@]} > 0)); then
    section wheels 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/hsync-site "${wheels[@]}" && export PYTHONPATH=/tmp/hsync-site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export -f versions  # timeout runs commands, not shell functions
section versions 30 bash -c versions
((built == 0)) || exit 1
# The tests first: the GPU path's correctness is what has never run. Figures the tests measure
# (busy times, the balancing plan) come into the report through HSYNC_CHECK_NOTES.
# Each failure's traceback goes into failures.md as it happens (tests/gpu/conftest.py).
export HSYNC_CHECK_NOTES="$out/notes.md" HSYNC_CHECK_FAILURES="$out/failures.md"
# The NCCL tests first and the failover test (three groups, a restart: the longest) last, so a section cut short
# loses the least. GPU_CHECK_TESTS: some tests' ids, to run those again alone.
first_and_last=(-e test_nccl.py -e test_failover_cuda.py)
default_tests="tests/gpu/test_nccl.py $(ls tests/gpu/test_*.py | grep -v "${first_and_last[@]}" | tr '\n' ' ')"
read -ra tests <<< "${GPU_CHECK_TESTS:-$default_tests tests/gpu/test_failover_cuda.py}"
section tests 380 python3 -m pytest "${pytest_args[@]}" "${tests[@]}"
if [ -f "$HSYNC_CHECK_NOTES" ]; then
  { printf '\n## measured by the tests\n\n'; cat "$HSYNC_CHECK_NOTES"; } >> "$report"
  rm -f "$HSYNC_CHECK_NOTES"
fi
[ -f "$HSYNC_CHECK_FAILURES" ] && { printf '\n## failures\n'; cat "$HSYNC_CHECK_FAILURES"; } >> "$report"
# One rank, where nothing overlaps: hsync against the no-sync floor and against DDP, gradients copied
# and as bucket views (the mode the 1% target is for); the pack kernel against a copy.
[ "${GPU_CHECK_BENCH:-1}" = 0 ] || section bench 150 python3 -m hsync.bench --device cuda --world-size 1 \
  --only '^bert-base$' '^bert-base-bucket-views$' '^comm-path-64MiB' \
  --rounds 5 --steps 8 --json "$out/bench.json" --markdown "$out/bench.md"
# Where the rest of one rank's step goes: hsync's kernels against the floor's, per step (Note [A host that blocks]
# and issue 41's 1% target).
[ "${GPU_CHECK_BENCH:-1}" = 0 ] || section profile 90 python3 -m hsync.bench.step_profile --device cuda \
  --markdown "$out/profile.md"
# The GPU targets, read off the benchmark.
[ -f "$out/bench.json" ] && python3 - "$out/bench.json" >> "$report" 2>&1 <<'PY' || true
import json, sys
rows = {r["workload"]: r for r in json.load(open(sys.argv[1]))["results"]}
print("\n## targets\n")
for name, target in (("bert-base-bucket-views", " (target: at most +1%)"), ("bert-base", "")):
    if name in rows:
        r = rows[name]
        print(f"- {name}, 1 rank: hsync {100 * r['hsync_overhead_vs_nosync']:+.2f}% over no sync{target}, "
              f"DDP {100 * r['ddp_overhead_vs_nosync']:+.2f}%; hsync / DDP {r['ratio_vs_ddp']:.3f}; the host "
              f"queued the floor's step in {100 * r['extra'].get('floor_host_share', float('nan')):.0f}% of its "
              "time (near 100%: bound by kernel launches)")
for name, target in (("comm-path-64MiB", " (target at least 90%)"), ("comm-path-64MiB-bf16", "")):
    if name in rows:
        extra = rows[name]["extra"]
        print(f"- pack, {name}: {extra['pack_gb_per_s']:.0f} GB/s against a copy's {extra['copy_gb_per_s']:.0f} "
              f"GB/s, {100 * extra['pack_vs_copy']:.1f}%{target}")
PY
printf '\nwhole check: %d s\n' $((SECONDS - started)) >> "$report"
echo "report: $report"
