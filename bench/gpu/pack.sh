#!/usr/bin/env bash
# Packs the GPU checks for a GPU machine that lacks this project's dependencies (one with the
# CUDA driver and NCCL but no gRPC, Abseil, protobuf or prometheus-cpp, where run.sh could
# not configure the project): builds here, where nvcc is and no GPU need be, then copies the
# GPU test binaries, ubepd, ubep-balancer and ubep-bench-cuda, stripped, with every shared
# library they load except the C library, the CUDA driver and NCCL (the GPU machine's own;
# NCCL alone is 200 MB). libstdc++ and libgcc_s go to lib-compat/, which run.sh adds only
# where the machine's own are older than the build's.
#
# Usage: bench/gpu/pack.sh [PACK_DIR] [BUILD_DIR]    (defaults: .gpu-pack, build-pack)
# A BUILD_DIR already configured is used as it is (it must have the CUDA backend on, as the
# README's builds do wherever nvcc is); a new one is configured for sm_90, Release.
# Then, on the GPU machine, from the repository root: bench/gpu/run.sh --pack PACK_DIR OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
pack=${1:-.gpu-pack}
build=${2:-build-pack}  # Its own tree: the test command's `build` keeps its own options.

if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DUBEP_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DUBEP_BUILD_TESTS=ON -DUBEP_BUILD_BENCHMARKS=ON >/dev/null
fi
cmake --build "$build" -j "$(nproc)" --target cuda_ep_test daemon_cuda_test ubepd \
  ubep_balancer ubep_bench_cuda

rm -rf "$pack"
mkdir -p "$pack/bin" "$pack/lib" "$pack/lib-compat"
binaries=("$build/tests/cuda_ep_test" "$build/tests/daemon_cuda_test" "$build/bin/ubepd"
          "$build/bin/ubep-balancer" "$build/bin/ubep-bench-cuda")
for b in "${binaries[@]}"; do
  strip --strip-debug -o "$pack/bin/$(basename "$b")" "$b"
done

source bench/gpu/pack-libs.sh
for b in "${binaries[@]}"; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ $name =~ $pack_system_libs ]]; then continue; fi
  if [[ $name =~ $pack_compat_libs ]]; then
    cp -L "$path" "$pack/lib-compat/$name"
  else
    cp -L "$path" "$pack/lib/$name"
  fi
done
strip --strip-unneeded "$pack"/lib/*.so* "$pack"/lib-compat/*.so* 2>/dev/null || true

# Every library a packed binary loads must come from the pack or be one of the machine's own.
bench/gpu/run.sh --pack "$pack" --check
echo "packed $(ls "$pack/bin" | wc -l) binaries and $(ls "$pack/lib" | wc -l) libraries" \
  "($(du -sh "$pack" | cut -f1)) in $pack"
