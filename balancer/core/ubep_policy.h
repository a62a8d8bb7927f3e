// The `ubep` placement policy (docs/balancer.md). Per layer:
//  1. replica counts: each spare slot goes to the expert with the most load per replica;
//  2. chain placement: replicated experts laid along a chain of ranks that links every rank,
//     consecutive chain ranks on different nodes (no group is pinned to a node); single-replica
//     experts by LPT, then evened out by pairwise exchanges;
//  3. shares: the exact min-max leveling for that placement, then splits moved toward equal
//     within a slack derived from the counts' sampling noise (share_leveling.h).
// Given a previous plan it is migration-aware instead: it keeps the previous placement,
// re-levels shares for the new load (free: no weights move) and then changes single slots,
// each one only when it lowers the squared excess over the mean by `min_gain`, until the target
// balancedness is reached or the per-rank budget is spent. Without a budget, the layers whose
// kept placement has gone stale are replanned from scratch, within a cap on moved slots.
// Deterministic for a given (load, topology, previous plan, options). Pure; thread-compatible.
#ifndef UBEP_BALANCER_CORE_UBEP_POLICY_H_
#define UBEP_BALANCER_CORE_UBEP_POLICY_H_

#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "balancer/core/load_matrix.h"
#include "balancer/core/plan.h"

namespace ubep::balancer {

struct UbepPolicyOptions {
  uint64_t seed = 0;  // Breaks ties between equally loaded ranks.
  // Most slots of one rank in one layer that may hold another expert than in the previous
  // plan (each is one expert-weight copy); negative = unlimited.
  int migration_budget = -1;
  // With a previous plan: stop changing slots once a layer's balancedness is at most this.
  double target_balancedness = 1.002;
  // With a previous plan: a slot change must not raise the layer's largest rank load and must
  // lower the sum of squared rank loads above the mean by at least this fraction.
  double min_gain = 0.01;
  // Shares may leave a layer's largest rank load this fraction above the optimum for the
  // planning load, in exchange for splits closer to equal (share_leveling.h), which hold up
  // better on the steps that follow. Negative: derived from the counts, noise_z / sqrt(mean
  // rank load) (at most 5%), since loads are counts of routed pairs whose noise is about the
  // square root of the count; leveling below that fits noise.
  double balance_slack = -1;
  double noise_z = 2.0;
  // With a previous plan and no per-rank budget: a layer is replanned from scratch (then
  // renumbered to keep what it can in place) when its kept placement leans on tuned shares so
  // much that its balancedness under equal shares is worse than the fresh plan's by more than
  // fresh_gain; largest gains first, while the slots that change in one replan stay within
  // max_moved_fraction of all slots. The local search's own moves count toward that, but are
  // not capped by it (at most 2 x kMaxIncrementalTrials slots a layer): where they alone pass
  // it, only fresh plans that move no more slots than the local search's are taken, and the
  // replan moves more than the fraction.
  double fresh_gain = 0.02;
  double max_moved_fraction = 0.2;
  // Fresh replans swap single-replica experts back to their old slots when their loads differ
  // by at most this fraction of the mean rank load (RestoreSingles).
  double restore_tolerance = 0.005;
};

// Callers take plans through ComputePlan (planner.h), which refuses an invalid output.
absl::StatusOr<Plan> PlanUbep(const LoadMatrix& load, const Topology& topology,
                              const Plan* previous, const UbepPolicyOptions& options);

// Renumbers the ranks of `fresh` (whole slot blocks move) to keep as many of each rank's
// experts where `previous` had them, then orders each rank's slots so that an expert kept on
// its rank keeps its slot; shares move with their slots. Both layers are over `t`.
void AlignToPrevious(const Topology& t, const LayerPlan& previous, LayerPlan& fresh);

// One layer from scratch. Exposed for tests and benchmarks.
LayerPlan UbepLayerFresh(std::span<const double> expert_load, const Topology& topology,
                         const UbepPolicyOptions& options);

// Most single-slot changes UbepLayerIncremental tries in one layer (each one a leveling of
// the layer's shares), accepted or not: the bound on a layer's planning time.
inline constexpr int kMaxIncrementalTrials = 96;

// One layer starting from `previous`. Exposed for tests and benchmarks; `trials_run`, when
// given, receives the changes it tried.
LayerPlan UbepLayerIncremental(std::span<const double> expert_load, const Topology& topology,
                               const LayerPlan& previous, const UbepPolicyOptions& options,
                               int* trials_run = nullptr);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_UBEP_POLICY_H_
