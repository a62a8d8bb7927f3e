#!/usr/bin/env bash
# bench/gpu/pack.sh and run.sh --pack, the way a GPU machine without the project's
# dependencies gets its GPU checks: the pack is made from BUILD_DIR, every packed binary
# loads each library from the pack or the machine's own (and the check fails, naming the
# library, when one is missing from the pack), and run.sh --pack runs the GPU tests and the
# bench from it. Without a device every GPU case skips and the bench reports one error per
# case; with one, the GPU tests must pass.
# Usage: pack_test.sh BUILD_DIR
set -euo pipefail
build=$(realpath "$1")
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"

bench/gpu/pack.sh "$work/pack" "$build" > "$work/pack.log"
grep -q "^packed 5 binaries and [0-9]* libraries" "$work/pack.log" || { cat "$work/pack.log"; exit 1; }
for b in cuda_ep_test daemon_cuda_test ubepd ubep-balancer ubep-bench-cuda; do
  [[ -x $work/pack/bin/$b ]] || { echo "missing from the pack: $b"; exit 1; }
done
compgen -G "$work/pack/lib/libcudart.so.*" > /dev/null  # The toolkit's major, whichever.
[[ -f $work/pack/lib-compat/libstdc++.so.6 ]]
! ls "$work/pack/lib" | grep -E "^(libc|libnccl|libcuda)\." || { echo "system library packed"; exit 1; }

# A library missing from the pack is named, and the check fails with exit status 2.
mv "$work/pack/lib/libabsl_status.so."* "$work/"
set +e
bench/gpu/run.sh --pack "$work/pack" --check > "$work/check.log" 2>&1
rc=$?
set -e
[[ $rc == 2 ]] || { cat "$work/check.log"; echo "check exit $rc, expected 2"; exit 1; }
grep -q "^run.sh: cuda_ep_test loads libabsl_status.so.[0-9]* from /.*, outside the pack$" \
  "$work/check.log" || { cat "$work/check.log"; exit 1; }
mv "$work/libabsl_status.so."* "$work/pack/lib/"
bench/gpu/run.sh --pack "$work/pack" --check

# The whole run from the pack.
bench/gpu/run.sh --pack "$work/pack" "$work/out" > "$work/run.log" 2>&1 || {
  cat "$work/run.log"; exit 1; }
grep -qx "cuda_ep_smoke: exit 0" "$work/out/gpu_tests.log"
grep -qx "cuda_ep_test: exit 0" "$work/out/gpu_tests.log"
grep -qx "daemon_cuda_test: exit 0" "$work/out/gpu_tests.log"
# The bench exits 1 where a case gave an error row: every case, without a device.
bench_rc=0
if grep -q "no CUDA device here" "$work/out/gpu_tests.log"; then bench_rc=1; fi
grep -qx "ubep-bench-cuda --tokens 128: exit $bench_rc" "$work/out/gpu_tests.log"
grep -qx "ubep-bench-cuda --tokens 4096: exit $bench_rc" "$work/out/gpu_tests.log"
# Decode-sized at 2, 4 and 8 ranks, prefill-sized at 2 and 4: four methods each (ubep three
# ways, bsp), one row per line.
for run in "128 12" "4096 8"; do
  set -- $run
  rows=$(grep -c '"method":"\(ubep_cuda\|ubep_cuda_flagged\|ubep_cuda_count_first\|bsp_cuda\)"' \
    "$work/out/cuda_bench_$1.json")
  [[ $rows == "$2" ]] || { cat "$work/out/cuda_bench_$1.json"; echo "rows: $rows"; exit 1; }
done
if grep -q "no CUDA device here" "$work/out/gpu_tests.log"; then
  # No device: every case of the three GPU test steps skipped but cuda_ep_test's one that
  # needs none (a config over the launch limits refused at Create).
  [[ $(grep -c "^\[  PASSED  \] 0 tests" "$work/out/gpu_tests.log") == 2 ]]
  [[ $(grep -c "^\[  PASSED  \] 1 test\.$" "$work/out/gpu_tests.log") == 1 ]]
  [[ $(grep -c '"error":"rank [0-9]*: .*CUDA' "$work/out/cuda_bench_128.json") == 12 ]]
fi
# --mps into the same folder (after the tests, as docs/dataplane.md says to run it) writes its
# own log and leaves the tests' as it was, whether or not it can run here.
cp "$work/out/gpu_tests.log" "$work/tests.log"
bench/gpu/run.sh --pack "$work/pack" --mps "$work/out" > "$work/mps_run.log" 2>&1 || true
cmp "$work/tests.log" "$work/out/gpu_tests.log" || { echo "--mps changed gpu_tests.log"; exit 1; }
[[ -s $work/out/mps.log ]] || { cat "$work/mps_run.log"; echo "--mps wrote no mps.log"; exit 1; }
echo "pack_test: OK"
