#!/usr/bin/env bash
# The main job: installs what is missing, builds, and replays online expert rebalancing on the
# bundled real DeepSeek-V3 expert-load traces (drifting mix, synthetic time axis), ubep against
# DeepSeek's EPLB side by side, then scores one-shot plans on every trace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build
traces=(data/traces/deepseek-v3/*.json)

for topology in "32 4 9" "64 8 5"; do
  read -r ranks nodes slots <<<"$topology"
  echo "== Online replay, EP$ranks ($nodes nodes, $((ranks * slots)) slots): ubep vs eplb-global"
  echo "   (real DeepSeek-V3 distributions, drifting mix; the time axis is synthetic)"
  build/bin/ubep-balance replay --load "${traces[@]}" --ranks "$ranks" --nodes "$nodes" \
    --slots-per-rank "$slots" --policy ubep --baseline eplb-global --steps 600 \
    --rebalance-every 50 --window 50 --seed 1 --seeds 3
done

echo "== One-shot plans on every trace (balancedness = max/mean rank load; 1 is perfect)"
build/bin/ubep-bench-balancer --repeats 3 --table
