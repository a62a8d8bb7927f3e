#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds once per configuration, and runs
# ctest in parallel: first under AddressSanitizer + UBSan, then the concurrent tests under
# ThreadSanitizer, last the full suite on the release build (its summary closes the output).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ubep-ccache}"

echo "== ASan + UBSan"
UBEP_BUILD_TYPE=Debug scripts/build.sh build-asan -DUBEP_SANITIZE=address \
  -DUBEP_ENABLE_CUDA=OFF -DUBEP_BUILD_BENCHMARKS=OFF
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -j "$jobs" --output-on-failure -LE "gpu|ops"

echo "== TSan (label concurrent)"
UBEP_BUILD_TYPE=Debug scripts/build.sh build-tsan -DUBEP_SANITIZE=thread \
  -DUBEP_ENABLE_CUDA=OFF -DUBEP_BUILD_BENCHMARKS=OFF
TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/tests/tsan.supp" ctest --test-dir build-tsan -j "$jobs" --output-on-failure -L concurrent

echo "== Full suite (release build)"
scripts/build.sh build
ctest --test-dir build -j "$jobs" --output-on-failure
