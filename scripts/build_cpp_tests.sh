#!/usr/bin/env bash
# Builds the C++ unit tests (ctest --test-dir build/cmake runs them): configured once, then only what
# changed is compiled again. Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/cmake/CMakeCache.txt ] || cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build/cmake -j 2 --target test_bucket > /dev/null
