// Plan quality metrics, computed from a load matrix and a plan of the same layers:
// - balancedness of a layer = max rank load / mean rank load (1 is perfect);
// - changed slots versus a previous plan (plan.h: ChangedSlots);
// - cross-node share: fraction of routed pairs that leave their source node when sources are
//   spread evenly over ranks and each source node sends to its own node's replicas first,
//   within their shares (the data plane's local-first replica choice).
// Pure functions; thread-compatible.
#ifndef UBEP_BALANCER_CORE_METRICS_H_
#define UBEP_BALANCER_CORE_METRICS_H_

#include <span>
#include <vector>

#include "balancer/core/load_matrix.h"
#include "balancer/core/plan.h"

namespace ubep::balancer {

// Load each rank receives in one layer: sum over its slots of load[expert] * share.
std::vector<double> RankLoads(const Topology& topology, const LayerPlan& layer,
                              std::span<const double> expert_load);

// max / mean of `rank_loads`; 1 when all are zero.
double Balancedness(std::span<const double> rank_loads);

// A layer that carried no load is not balanced but unmeasured: no call reached it (its
// traffic stopped, or every step was dropped before it, as over a receive capacity). It is
// NaN in a per-layer list and left out of the mean and the worst, so that it cannot hide a
// layer that is out of balance.
double MeasuredBalancedness(std::span<const double> rank_loads);  // NaN for no load at all.

struct BalanceSummary {
  double mean = 1.0;   // Mean over the measured layers of per-layer balancedness.
  double worst = 1.0;  // Largest per-layer balancedness.
  int measured = 0;    // Layers that carried load; mean and worst are 1 when none did.
  std::vector<double> per_layer;  // NaN: no load.
};

// Mean and worst of `per_layer` (MeasuredBalancedness values), the NaNs left out.
BalanceSummary SummarizeLayers(std::vector<double> per_layer);

// `load` and `plan` must have the same number of layers and experts (checked by the caller).
BalanceSummary SummarizeBalance(const Plan& plan, const LoadMatrix& load);

// Fraction in [0, 1] of the routed pairs of all layers that cross nodes (see above).
double CrossNodeShare(const Plan& plan, const LoadMatrix& load);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_METRICS_H_
