#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds once per configuration, and runs
# ctest in parallel: first under AddressSanitizer + UBSan, then the concurrent tests under
# ThreadSanitizer, last the full suite on the release build (its summary closes the output).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)

echo "== ASan + UBSan"
# Every tree gets its whole set of options each time: a tree configured before with others
# (by hand, scripts/build.sh build -DUBEP_SANITIZE=thread) keeps them in its cache otherwise.
UBEP_BUILD_TYPE=Debug scripts/build.sh build-asan -DUBEP_SANITIZE=address \
  -DUBEP_ENABLE_CUDA=OFF -DUBEP_BUILD_BENCHMARKS=OFF -DUBEP_BUILD_TESTS=ON \
  -DUBEP_BUILD_SHARED_CLIENT=OFF
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan -j "$jobs" --output-on-failure --no-tests=error -LE "gpu|ops"

echo "== TSan (label concurrent)"
UBEP_BUILD_TYPE=Debug scripts/build.sh build-tsan -DUBEP_SANITIZE=thread \
  -DUBEP_ENABLE_CUDA=OFF -DUBEP_BUILD_BENCHMARKS=OFF -DUBEP_BUILD_TESTS=ON \
  -DUBEP_BUILD_SHARED_CLIENT=OFF
TSAN_OPTIONS="halt_on_error=1 suppressions='$PWD/tests/tsan.supp'" ctest --test-dir build-tsan -j "$jobs" --output-on-failure --no-tests=error -L concurrent

echo "== Full suite (release build)"
# (CUDA as this machine's nvcc says, for the default architectures: not whatever an earlier
# configure of the tree left in its cache.)
UBEP_BUILD_TYPE=RelWithDebInfo scripts/build.sh build -DUBEP_SANITIZE= -DUBEP_BUILD_TESTS=ON \
  -DUBEP_BUILD_BENCHMARKS=ON -DUBEP_BUILD_SHARED_CLIENT=ON -UUBEP_ENABLE_CUDA \
  -UCMAKE_CUDA_ARCHITECTURES
ctest --test-dir build -j "$jobs" --output-on-failure --no-tests=error
