#!/usr/bin/env bash
# Lint, C++ unit tests, then the Python test suite (unit, distributed over gloo; GPU tests skip
# without a GPU). Expects scripts/setup.sh to have run. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check .
# The CMake build: C++ unit tests, and the torch-dependent core compiled the IDE's way.
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PWD/.venv/bin/python" > /dev/null
cmake --build build/cmake -j 2 > /dev/null
ctest --test-dir build/cmake --output-on-failure
.venv/bin/python -m pytest "$@"
