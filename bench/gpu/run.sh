#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: runs the GPU tests (the CUDA backend checked byte for byte
# against the host backend, both protocols, ubep's counting and sending in one launch and one
# after the other, and ubepd --backend cuda end to end), then times dispatch + combine (128
# tokens per rank at 2, 4 and 8 ranks, 4096 at 2 and 4) with ranks run as processes sharing
# the GPU, ubep (both ways) and bsp on the same input, next to a device-to-device copy.
#
#   bench/gpu/run.sh [OUT_DIR]                  builds here for sm_90 (needs the project's
#                                               dependencies: scripts/install-deps.sh)
#   bench/gpu/run.sh --pack PACK_DIR [OUT_DIR]  runs what bench/gpu/pack.sh built elsewhere
#                                               (a GPU machine without those dependencies)
#   bench/gpu/run.sh --pack PACK_DIR --check    only checks that every packed binary loads,
#                                               each library from the pack or the machine's
#                                               own (C library, CUDA driver, NCCL); exit 2 if not
#
# Results: OUT_DIR/gpu_tests.log, OUT_DIR/cuda_bench_128.json and cuda_bench_4096.json
# (default OUT_DIR: build-gpu/results). Exit status: the GPU tests'.
set -euo pipefail
cd "$(dirname "$0")/../.."
pack=
check=0
if [[ ${1:-} == --pack ]]; then
  pack=$(realpath "$2")
  shift 2
  if [[ ${1:-} == --check ]]; then
    check=1
    shift
  fi
fi
out=${1:-build-gpu/results}

if [[ -n $pack ]]; then
  bin=$pack/bin
  tests=$pack/bin
  # NCCL: the machine's own (under /usr/local/cuda, or PyTorch's wheel).
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
           2>/dev/null || true)
  export LD_LIBRARY_PATH="$pack/lib:/usr/local/cuda/lib64${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ldd "$bin/ubepd" 2>&1 | grep -q "GLIBCXX\|libstdc++.*not found"; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$pack/lib-compat"
    echo "run.sh: this machine's libstdc++ is older than the build's; using the pack's"
  fi
  source bench/gpu/pack-libs.sh
  bad=0
  for b in "$bin"/*; do
    deps=$(ldd "$b" 2>&1)
    if grep "not found" <<< "$deps"; then
      echo "run.sh: $(basename "$b") cannot load the libraries above" >&2
      bad=1
    fi
    while read -r name path; do
      if [[ $name =~ $pack_system_libs || $name =~ $pack_compat_libs || $path == "$pack"/lib/* ]]; then
        continue
      fi
      echo "run.sh: $(basename "$b") loads $name from $path, outside the pack" >&2
      bad=1
    done < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<< "$deps")
  done
  if [[ $bad != 0 ]]; then exit 2; fi
  if [[ $check == 1 ]]; then exit 0; fi
  # The tests start ubepd and ubep-balancer from the pack; the bench reads data/ from here.
  export UBEP_BIN_DIR=$bin UBEP_SOURCE_DIR=$PWD
else
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DUBEP_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DUBEP_BUILD_TESTS=ON >/dev/null
  # The GPU tests, and the daemons the ubepd test starts (one ubepd, and a group over two
  # ubepd with ubep-balancer).
  cmake --build build-gpu -j "$(nproc)" --target cuda_ep_test daemon_cuda_test ubepd \
    ubep_balancer ubep_bench_cuda
  bin=build-gpu/bin
  tests=build-gpu/tests
fi

mkdir -p "$out"
gpu_listed=0
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then gpu_listed=1; fi
nvidia-smi -L || true
# Settings that change how ranks as processes share the card (read, never changed).
nvidia-smi --query-gpu=name,driver_version,persistence_mode,compute_mode,mig.mode.current \
  --format=csv 2>/dev/null || true
set +e
status=0
# Each step is bounded, together under 9 minutes (one device command may run 10): ranks as
# processes time-slice one GPU (no MPS: the card's settings stay as they are), so
# prefill-sized runs are slow, and a session's device time is short.
step() {  # step LIMIT_S NAME COMMAND...: runs it into the log; non-zero status fails the run.
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$@" 2>&1 | tee -a "$out/gpu_tests.log"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc" | tee -a "$out/gpu_tests.log"
  [[ $rc == 0 ]] || status=1
  return "$rc"
}
# First one small case (2 ranks): a machine that refuses the cross-process device memory
# (IPC, VMM handles) fails here in seconds, and the rest is not run.
smoke='RanksAndProtocols/CudaEpTest.MatchesTheHostBackendByteForByte/2_ranks_ubep'
if ! step 60 cuda_ep_smoke "$tests/cuda_ep_test" --gtest_color=no --gtest_filter="$smoke"; then
  echo "run.sh: the first case failed; the rest is not run" | tee -a "$out/gpu_tests.log"
  exit 1
fi
step 210 cuda_ep_test "$tests/cuda_ep_test" --gtest_color=no --gtest_filter="-$smoke"
step 90 daemon_cuda_test "$tests/daemon_cuda_test" --gtest_color=no
if [[ $gpu_listed == 1 ]] && grep -q "no CUDA device here" "$out/gpu_tests.log"; then
  echo "run.sh: nvidia-smi lists a GPU, but the tests found none usable (reason above)" |
    tee -a "$out/gpu_tests.log"
  status=1
fi
for run in "128 2,4,8 20 100" "4096 2,4 5 70"; do
  set -- $run
  timeout "$4" "$bin/ubep-bench-cuda" --ranks "$2" --tokens "$1" --hidden 7168 --iters "$3" \
    | tee "$out/cuda_bench_$1.json"
  rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] || echo "ubep-bench-cuda --tokens $1: exit $rc"
done
exit $status
