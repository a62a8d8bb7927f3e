// Share leveling: given where every replica sits, choose the traffic shares that level rank
// loads. First the exact minimum of the largest rank load, by max flow (experts with two or
// more replicas route their load to the ranks that hold them, ranks capped at a level raised
// Dinkelbach-style to the optimum); then a few sweeps of block coordinate descent that move
// each expert's split as close to equal as that maximum (plus an optional slack) allows, so
// that a rank's load stays a mix of experts and the plan holds up when the load drifts.
// Pure; thread-compatible.
#ifndef UBEP_BALANCER_CORE_SHARE_LEVELING_H_
#define UBEP_BALANCER_CORE_SHARE_LEVELING_H_

#include <span>
#include <vector>

#include "balancer/core/plan.h"

namespace ubep::balancer {

struct LevelingOptions {
  // The spreading pass may leave the largest rank load this fraction above the optimum.
  double balance_slack = 0.0;
  int spread_sweeps = 8;
};

// Rewrites layer.slot_share and returns the resulting rank loads. Experts with one replica,
// or no load, keep equal shares.
std::vector<double> LevelShares(const Topology& topology, std::span<const double> expert_load,
                                LayerPlan& layer, const LevelingOptions& options = {});

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_SHARE_LEVELING_H_
