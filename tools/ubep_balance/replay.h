// Replay: runs a placement policy online over a Scenario, out of sample. Steps [0, window) are
// observed only; at step `window` and then every `rebalance_every` steps a plan is computed from
// the loads of the previous `window` steps and put in force for the steps that follow, which
// are scored with it. The time axis of every Scenario is synthetic.
// Thread-compatible; timing goes through the injected clock.
#ifndef UBEP_TOOLS_UBEP_BALANCE_REPLAY_H_
#define UBEP_TOOLS_UBEP_BALANCE_REPLAY_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "balancer/core/planner.h"
#include "balancer/core/scenario.h"
#include "balancer/core/topology.h"
#include "common/clock.h"

namespace ubep::balancer {

struct ReplayOptions {
  int steps = 600;
  int rebalance_every = 50;
  int window = 50;
};

struct ReplayResult {
  double imbalance_mean = 0;  // Mean over scored steps of the mean-over-layers balancedness.
  double imbalance_p99 = 0;
  int64_t migrated_slots_total = 0;  // Changed slots summed over every replan after the first.
  double plan_ms_p50 = 0;
  double plan_ms_max = 0;
  int plans = 0;
  int scored_steps = 0;
  std::vector<double> step_imbalance;  // Per scored step.
  std::vector<double> plan_ms;         // Per plan.

  // Folds another run (another scenario seed) into this one: statistics over all scored
  // steps and plans of both, migrations summed.
  void Merge(const ReplayResult& other);
};

// The policies replay the same sampled loads, so results are comparable side by side.
// `step_loads` is Scenario::Step for every step in [0, options.steps).
// Whether the options make a replay (window > 0, rebalance_every > 0, steps > window): checked
// before any step's load is drawn, and again by Replay.
absl::Status CheckReplayOptions(const ReplayOptions& options);
absl::StatusOr<ReplayResult> Replay(const std::vector<LoadMatrix>& step_loads,
                                    const Topology& topology, const PlannerOptions& planner,
                                    const ReplayOptions& options, ClockInterface& clock);

}  // namespace ubep::balancer

#endif  // UBEP_TOOLS_UBEP_BALANCE_REPLAY_H_
