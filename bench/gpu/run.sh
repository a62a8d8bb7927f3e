#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds for sm_90, runs the GPU tests (the CUDA backend
# checked byte for byte against the host backend, both protocols), then times dispatch +
# combine for 2, 4 and 8 ranks run as processes sharing the GPU, ubep and bsp on the same
# input, next to a device-to-device copy.
# Usage: bench/gpu/run.sh [OUT_DIR]     (results: OUT_DIR/gpu_tests.log, OUT_DIR/cuda_bench.json)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build-gpu/results}
mkdir -p "$out"
nvidia-smi -L || true
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DUBEP_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DUBEP_BUILD_TESTS=ON >/dev/null
# The GPU tests, and the daemons the ubepd test starts (one ubepd, and a group over two
# ubepd with ubep-balancer).
cmake --build build-gpu -j "$(nproc)" --target cuda_ep_test daemon_cuda_test host_ep_test \
  ubepd ubep_balancer ubep_bench_cuda
set +e
ctest --test-dir build-gpu -L gpu --output-on-failure 2>&1 | tee "$out/gpu_tests.log"
tests=$?
set -e
for tokens in 128 4096; do
  build-gpu/bin/ubep-bench-cuda --ranks 2,4,8 --tokens "$tokens" --hidden 7168 --iters 50 \
    | tee "$out/cuda_bench_$tokens.json"
done
exit $tests
