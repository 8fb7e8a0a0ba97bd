#!/usr/bin/env bash
# Every test: lint, the C++ unit tests, the build against the oldest torch supported and the tests of
# what differs there, then the pytest suite (unit, distributed over gloo, the BERT application, the
# examples, the benchmark; GPU tests skip without a GPU). Expects scripts/setup.sh --tests to have run.
#
#   scripts/test.sh [PYTEST_ARGS...]      everything (under ten minutes on two cores)
#   scripts/test.sh --quick [PYTEST_ARGS...]   the edit loop's lane (under two minutes): lint and the
#                                         tests marked quick, the core's (the weighted maths, bad input, buckets)
set -euo pipefail
cd "$(dirname "$0")/.."

quick=false
if [ "${1:-}" = "--quick" ]; then
  quick=true
  shift
fi
.venv/bin/ruff check .
if $quick; then
  exec .venv/bin/python -m pytest -n 2 -m quick "$@"
fi
# C++ unit tests (setup.py already compiled the torch-dependent core against torch 2.14), rebuilt if changed.
./scripts/build_cpp_tests.sh
ctest --test-dir build/cmake --output-on-failure
./scripts/check_oldest_torch.sh
# Two workers on two cores: a test's ranks wait on rendezvous, peers and deadlines as often as they compute;
# work stealing keeps both busy to the end (the slowest tests, compiled ones, would otherwise finish alone).
.venv/bin/python -m pytest -n 2 --dist worksteal "$@"
