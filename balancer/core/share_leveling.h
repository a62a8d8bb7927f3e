// Share leveling: given where every replica sits, choose the traffic shares that level rank
// loads. Minimizes the sum of squared rank loads over all splits of each expert's load between
// its replicas; that minimizer also minimizes the largest rank load (balanced-flow property of
// separable convex objectives). Solved by block coordinate descent: each block is one expert
// with two or more replicas, water-filled exactly against the other load on its ranks.
// Pure; thread-compatible.
#ifndef UBEP_BALANCER_CORE_SHARE_LEVELING_H_
#define UBEP_BALANCER_CORE_SHARE_LEVELING_H_

#include <span>
#include <vector>

#include "balancer/core/plan.h"

namespace ubep::balancer {

struct LevelingOptions {
  int max_sweeps = 100;
  // Stop when no rank load moved by more than this fraction of the mean rank load in a sweep.
  double tolerance = 1e-5;
};

// Rewrites layer.slot_share (a valid starting point is kept warm; all-zero or missing shares
// are replaced by equal ones) and returns the resulting rank loads.
std::vector<double> LevelShares(const Topology& topology, std::span<const double> expert_load,
                                LayerPlan& layer, const LevelingOptions& options = {});

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_SHARE_LEVELING_H_
