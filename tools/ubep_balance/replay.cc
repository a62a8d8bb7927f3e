#include "tools/ubep_balance/replay.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "balancer/core/metrics.h"
#include "common/percentile.h"
#include "common/status_macros.h"

namespace ubep::balancer {
namespace {

void Summarize(ReplayResult& r) {
  r.scored_steps = static_cast<int>(r.step_imbalance.size());
  r.plans = static_cast<int>(r.plan_ms.size());
  double sum = 0;
  for (double b : r.step_imbalance) sum += b;
  r.imbalance_mean = r.scored_steps > 0 ? sum / r.scored_steps : 0;
  r.imbalance_p99 = Percentile(r.step_imbalance, 0.99);
  r.plan_ms_p50 = Percentile(r.plan_ms, 0.5);
  r.plan_ms_max = r.plan_ms.empty() ? 0 : *std::max_element(r.plan_ms.begin(), r.plan_ms.end());
}

}  // namespace

void ReplayResult::Merge(const ReplayResult& other) {
  step_imbalance.insert(step_imbalance.end(), other.step_imbalance.begin(),
                        other.step_imbalance.end());
  plan_ms.insert(plan_ms.end(), other.plan_ms.begin(), other.plan_ms.end());
  migrated_slots_total += other.migrated_slots_total;
  Summarize(*this);
}

absl::Status CheckReplayOptions(const ReplayOptions& options) {
  if (options.window <= 0 || options.rebalance_every <= 0 ||
      options.steps <= options.window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replay: need window > 0, rebalance-every > 0 and steps > window; got window ",
        options.window, ", rebalance-every ", options.rebalance_every, ", steps ",
        options.steps));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReplayResult> Replay(const std::vector<LoadMatrix>& step_loads,
                                    const Topology& topology, const PlannerOptions& planner,
                                    const ReplayOptions& options, ClockInterface& clock) {
  UBEP_RETURN_IF_ERROR(CheckReplayOptions(options));
  if (static_cast<int>(step_loads.size()) < options.steps) {
    return absl::InvalidArgumentError("replay: fewer step loads than steps");
  }
  ReplayResult result;
  std::optional<Plan> current;
  for (int step = options.window; step < options.steps; ++step) {
    if ((step - options.window) % options.rebalance_every == 0) {
      LoadMatrix window(step_loads[0].num_layers(), step_loads[0].num_experts());
      window.set_layer_ids(step_loads[0].layer_ids());
      for (int s = step - options.window; s < step; ++s) window.AddScaled(step_loads[s], 1.0);
      const int64_t start = clock.NowNanos();
      UBEP_ASSIGN_OR_RETURN(Plan next, ComputePlan(window, topology,
                                                   current ? &*current : nullptr, planner));
      result.plan_ms.push_back(static_cast<double>(clock.NowNanos() - start) / 1e6);
      if (current) result.migrated_slots_total += ChangedSlots(*current, next, nullptr);
      current = std::move(next);
    }
    result.step_imbalance.push_back(SummarizeBalance(*current, step_loads[step]).mean);
  }
  Summarize(result);
  return result;
}

}  // namespace ubep::balancer
