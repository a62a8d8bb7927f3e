#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs a local UBEP cluster on the host
# backend (no GPU needed): ubep-balancer, 2 ubepd daemons acting as nodes and 8 serving ranks
# running the example MoE stack on a drifting mix of the bundled DeepSeek-V3 traces. It shows
# a live progress line and writes ubep-local-report/ (report.md, report.json, report.png).
# Extra arguments go to ubep-local, e.g. scripts/main.sh --policy none --steps 300.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
(
  cd "$root"
  scripts/install-deps.sh
  # The release tree, as scripts/test.sh builds it (the same options: one build serves both).
  UBEP_BUILD_TYPE=RelWithDebInfo scripts/build.sh build -DUBEP_SANITIZE= -DUBEP_BUILD_TESTS=ON \
    -DUBEP_BUILD_BENCHMARKS=ON -DUBEP_BUILD_SHARED_CLIENT=ON -UUBEP_ENABLE_CUDA \
    -UCMAKE_CUDA_ARCHITECTURES
)
# From where it was started: a relative path among the extra arguments (--report out) is the
# caller's. The report goes to the repository's ubep-local-report/ unless one is given.
exec "$root/build/bin/ubep-local" --ranks 8 --daemons 2 --steps 600 \
  --report "$root/ubep-local-report" "$@"
