#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: runs the GPU tests (the CUDA backend checked byte for byte
# against the host backend, both protocols, ubep's counting and sending in one launch and one
# after the other, and ubepd --backend cuda end to end) and times dispatch + combine (128
# tokens per rank at 2, 4 and 8 ranks, 4096 at 2 and 4) with ranks run as processes sharing
# the GPU, ubep (both ways) and bsp on the same input, next to device-to-device copies. A
# step that fails does not stop the others; a binary that cannot load skips the steps that
# need it; only a machine that refuses cross-process device memory ends the run early.
#
#   bench/gpu/run.sh [OUT_DIR]                  builds here for sm_90 (needs the project's
#                                               dependencies: scripts/install-deps.sh)
#   bench/gpu/run.sh --pack PACK_DIR [OUT_DIR]  runs what bench/gpu/pack.sh built elsewhere
#                                               (a GPU machine without those dependencies)
#   bench/gpu/run.sh --pack PACK_DIR --check    only checks that every packed binary loads,
#                                               each library from the pack or the machine's
#                                               own (C library, CUDA driver, NCCL); exit 2 if not
#   bench/gpu/run.sh [--pack PACK_DIR] --mps [OUT_DIR]
#                                               only the bench, its ranks as clients of an MPS
#                                               server this script starts and stops (the card's
#                                               settings are not touched): the ranks' kernels
#                                               run at once, as on a GPU each, instead of taking
#                                               turns in time slices
#
# Results, written as they come: OUT_DIR/gpu_tests.log (the library check, the tests, the
# bench's errors and every step's exit status), OUT_DIR/cuda_bench_128.json and
# cuda_bench_4096.json, one row per line (a run cut short leaves its rows without the closing
# bracket). Default OUT_DIR: build-gpu/results. Exit status: the GPU tests'. With --mps:
# OUT_DIR/mps.log and cuda_bench_mps_128.json, cuda_bench_mps_4096.json (2, 4 and 8 ranks
# each); exit status 0 when every case gave numbers under an MPS server seen serving them.
set -euo pipefail
cd "$(dirname "$0")/../.."
pack=
check=0
mps=0
if [[ ${1:-} == --pack ]]; then
  pack=$(realpath "$2")
  shift 2
  if [[ ${1:-} == --check ]]; then
    check=1
    shift
  fi
fi
if [[ ${1:-} == --mps ]]; then
  mps=1
  shift
fi
out=${1:-build-gpu/results}
log=/dev/null
if [[ $check == 0 ]]; then
  mkdir -p "$out"
  # --mps writes a log of its own: a run of the tests into the same OUT_DIR keeps its log.
  if [[ $mps == 1 ]]; then log=$out/mps.log; else log=$out/gpu_tests.log; fi
  : > "$log"
fi
say() { echo "$*" | tee -a "$log"; }
# Binaries that cannot load here: the steps that need them are skipped, the others run.
declare -A unusable=()

if [[ -n $pack ]]; then
  bin=$pack/bin
  tests=$pack/bin
  # NCCL: the machine's own (under /usr/local/cuda, or PyTorch's wheel: nvidia-nccl-cu13).
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
           2>/dev/null || true)
  export LD_LIBRARY_PATH="$pack/lib:/usr/local/cuda/lib64${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for b in "$bin"/*; do
    if ldd "$b" 2>&1 | grep -q "GLIBCXX\|libstdc++.*not found"; then
      export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$pack/lib-compat"
      say "run.sh: this machine's libstdc++ is older than the build's; using the pack's"
      break
    fi
  done
  source bench/gpu/pack-libs.sh
  for b in "$bin"/*; do
    name=$(basename "$b")
    deps=$(ldd "$b" 2>&1)
    if grep "not found" <<< "$deps" | tee -a "$log" >&2; then
      say "run.sh: $name cannot load the libraries above" >&2
      unusable[$name]=1
    fi
    while read -r lib path; do
      if [[ $lib =~ $pack_system_libs || $lib =~ $pack_compat_libs || $path == "$pack"/lib/* ]]; then
        continue
      fi
      say "run.sh: $name loads $lib from $path, outside the pack" >&2
      unusable[$name]=1
    done < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<< "$deps")
  done
  if [[ $check == 1 ]]; then
    [[ ${#unusable[@]} == 0 ]] || exit 2
    exit 0
  fi
  # The tests start ubepd and ubep-balancer from the pack.
  export UBEP_BIN_DIR=$bin
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

grep -q avx2 /proc/cpuinfo ||
  say "run.sh: this CPU does not report AVX2; the host code, built for x86-64-v3, may not run"
gpu_listed=0
if timeout -k 5 15 nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then gpu_listed=1; fi
timeout -k 5 15 nvidia-smi -L 2>&1 | tee -a "$log" || true
# Settings that change how ranks as processes share the card (read, never changed).
timeout -k 5 15 nvidia-smi \
  --query-gpu=name,driver_version,persistence_mode,compute_mode,mig.mode.current \
  --format=csv 2>/dev/null | tee -a "$log" || true
set +e
status=0
# Each step is bounded, together under 9 minutes (one device command may run 10): ranks as
# processes time-slice one GPU (the default run starts no MPS server), so
# prefill-sized runs are slow, and a session's device time is short. The steps run in the
# order of what a short run must not lose: the first case, the decode-sized bench, the daemon
# end to end, every other case, the prefill-sized bench.
usable() {  # usable BINARY...: whether every one loads here (else the step is skipped).
  local b
  for b in "$@"; do [[ -z ${unusable[$b]:-} ]] || return 1; done
}
step() {  # step LIMIT_S NAME COMMAND...: runs it into the log; non-zero status fails the run.
  local limit=$1 name=$2
  shift 2
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "$name: exit $rc"
  [[ $rc == 0 ]] || status=1
  return "$rc"
}
bench() {  # bench TOKENS RANKS ITERS LIMIT_S: one JSON file, its errors and exit in the log.
  if ! usable ubep-bench-cuda; then
    say "ubep-bench-cuda --tokens $1: skipped (cannot load)"
    return
  fi
  timeout -k 10 "$4" "$bin/ubep-bench-cuda" --ranks "$2" --tokens "$1" --hidden 7168 \
    --iters "$3" 2>> "$log" | tee "$out/cuda_bench_$1.json"
  # (Exit 1 where a case gave an "error" row; logged, not the run's status, which is the
  # GPU tests'.)
  say "ubep-bench-cuda --tokens $1: exit ${PIPESTATUS[0]}"
}
if [[ $mps == 1 ]]; then
  # MPS: a control daemon of this run's own (its pipes and logs in a temporary folder), which
  # starts a server for the ranks' contexts; the compute mode and every other setting of the
  # card stay as they are. Clients that cannot reach it would run as plain contexts, time
  # sliced, so each bench is checked to have been served: its ranks are new clients in the
  # control daemon's log (a server, once started, stays up, so the server list alone says
  # nothing of later cases); where the log names no clients, by the server list alone.
  if ! usable ubep-bench-cuda; then
    say "ubep-bench-cuda: cannot load; nothing to run"
    exit 1
  fi
  control=$(command -v nvidia-cuda-mps-control || true)
  if [[ -z $control ]]; then
    say "run.sh: nvidia-cuda-mps-control is not on this machine; --mps cannot run"
    exit 1
  fi
  mps_dir=$(mktemp -d)
  export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  stop_mps() {
    echo quit | timeout -k 5 20 "$control" >/dev/null 2>&1
    cat "$CUDA_MPS_LOG_DIRECTORY"/*.log >> "$log" 2>/dev/null
    rm -rf "$mps_dir"
  }
  trap stop_mps EXIT
  # Clients the control daemon has taken so far (its log's "NEW CLIENT" lines; 0 where its
  # log does not say).
  mps_clients() {
    local n
    n=$(grep -ci 'new client' "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null)
    echo "${n:-0}"
  }
  if ! timeout -k 5 20 "$control" -d; then
    say "run.sh: the MPS control daemon did not start"
    exit 1
  fi
  # tokens:iterations:seconds allowed per rank count (a case whose ranks cannot meet gives
  # up within 30 s; four cases, and the whole run under 8 minutes).
  for case in 128:50:60 4096:20:90; do
    IFS=: read -r tokens iters limit <<< "$case"
    json=$out/cuda_bench_mps_$tokens.json
    echo "[" > "$json"
    first=1
    for r in 2 4 8; do
      clients_before=$(mps_clients)
      rows=$(timeout -k 10 "$limit" "$bin/ubep-bench-cuda" --ranks "$r" --tokens "$tokens" \
               --hidden 7168 --iters "$iters" 2>> "$log")
      rc=$?
      servers=$(echo get_server_list | timeout -k 5 20 "$control" 2>&1)
      clients=$(( $(mps_clients) - clients_before ))
      say "ubep-bench-cuda --tokens $tokens --ranks $r (MPS): exit $rc; MPS servers: ${servers:-none}; new MPS clients: $clients"
      [[ $rc == 0 && -n $servers ]] || status=1
      if [[ $(mps_clients) -gt 0 && $clients -lt $r ]]; then
        say "  fewer MPS clients than ranks: some ranks ran time sliced; not an MPS figure"
        status=1
      fi
      grep -q '"error"' <<< "$rows" && status=1
      # One array of every rank count's rows ("[", one row per line, "]").
      while read -r row; do
        [[ $first == 1 ]] || echo "," >> "$json"
        printf ' %s' "$row" >> "$json"
        first=0
      done < <(sed -n 's/^ *\({.*}\),\{0,1\}$/\1/p' <<< "$rows")
    done
    printf '\n]\n' >> "$json"
    cat "$json"
  done
  exit $status
fi
# First one small case (2 ranks): a machine that refuses the cross-process device memory
# (IPC, VMM handles) fails here in seconds, and nothing else is run. Any other failure still
# leaves the bench, the daemon test and the byte-for-byte cases of every protocol to run.
smoke='RanksAndProtocols/CudaEpTest.MatchesTheHostBackendByteForByte/2_ranks_ubep'
smoke_ok=1
if ! usable cuda_ep_test; then
  say "cuda_ep_test: skipped (cannot load)"
  status=1
  smoke_ok=0
elif ! step 60 cuda_ep_smoke "$tests/cuda_ep_test" --gtest_color=no --gtest_filter="$smoke"; then
  smoke_ok=0
  if grep -q "cudaIpc\|cuMem" "$log"; then
    say "run.sh: this machine refuses cross-process device memory; the rest is not run"
    exit 1
  fi
fi
bench 128 2,4,8 20 100
if usable daemon_cuda_test ubepd ubep-balancer; then
  step 90 daemon_cuda_test "$tests/daemon_cuda_test" --gtest_color=no
else
  say "daemon_cuda_test: skipped (it or the daemons cannot load)"
  status=1
fi
if usable cuda_ep_test; then
  if [[ $smoke_ok == 1 ]]; then
    step 190 cuda_ep_test "$tests/cuda_ep_test" --gtest_color=no --gtest_filter="-$smoke"
  else
    step 90 cuda_ep_test "$tests/cuda_ep_test" --gtest_color=no \
      --gtest_filter='*MatchesTheHostBackendByteForByte*'
  fi
fi
if [[ $gpu_listed == 1 ]] && grep -q "no CUDA device here" "$log"; then
  say "run.sh: nvidia-smi lists a GPU, but the tests found none usable (reason above)"
  status=1
fi
bench 4096 2,4 5 70
exit $status
