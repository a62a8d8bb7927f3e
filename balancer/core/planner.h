// Planner: one entry point over the placement policies, so the CLI, benchmarks and the control
// plane pick a policy by name.
//
//   PlannerOptions options{.policy = Policy::kUbep, .migration_budget = 2};
//   absl::StatusOr<Plan> plan = ComputePlan(load, topology, &previous, options);
//
// Pure; thread-compatible.
#ifndef UBEP_BALANCER_CORE_PLANNER_H_
#define UBEP_BALANCER_CORE_PLANNER_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "balancer/core/load_matrix.h"
#include "balancer/core/plan.h"

namespace ubep::balancer {

enum class Policy {
  kEplb,        // DeepSeek EPLB: hierarchical when groups divide by nodes, else global.
  kEplbGlobal,  // DeepSeek EPLB with groups = nodes = 1.
  kUbep,        // ubep_policy.h.
};

absl::StatusOr<Policy> ParsePolicy(std::string_view name);
std::string_view PolicyName(Policy policy);

struct PlannerOptions {
  Policy policy = Policy::kUbep;
  uint64_t seed = 0;
  int migration_budget = -1;  // Changed slots per rank per layer; negative = unlimited.
  double balance_slack = -1;  // ubep only; negative = from the counts. See UbepPolicyOptions.
};

// The EPLB policies replan every layer from scratch; against `previous`, a layer with no
// load, or whose new placement changes more than `migration_budget` slots of some rank, keeps
// its previous placement (EPLB, moving most slots, needs a budget near slots_per_rank to move
// a layer at all). `ubep` starts from `previous` and moves slots within the budget. The new
// plan's version is previous->version + 1, or 1. `previous` must be valid, of the load's
// shape, layer ids included, and exclude no rank (CheckPrevious). The plan returned is valid (ValidatePlan); a
// policy that made an invalid one is an Internal error.
absl::StatusOr<Plan> ComputePlan(const LoadMatrix& load, const Topology& topology,
                                 const Plan* previous, const PlannerOptions& options);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_PLANNER_H_
