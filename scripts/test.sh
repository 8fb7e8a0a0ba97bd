#!/usr/bin/env bash
# Lint, C++ unit tests, a build against the oldest torch supported with the tests of what the GPU
# check runs, then the Python test suite (unit, distributed over gloo; GPU tests skip without a
# GPU). Expects scripts/setup.sh to have run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check .
# C++ unit tests (setup.py already compiled the torch-dependent core against torch 2.14).
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build/cmake -j 2 --target test_bucket > /dev/null
ctest --test-dir build/cmake --output-on-failure
# A build against the oldest torch supported (the GPU machines'), and its tests there.
./scripts/check_oldest_torch.sh
.venv/bin/python -m pytest "$@"
