#include "balancer/core/planner.h"

#include "absl/strings/str_cat.h"
#include "balancer/core/eplb_policy.h"
#include "balancer/core/ubep_policy.h"
#include "common/status_macros.h"

namespace ubep::balancer {

absl::StatusOr<Policy> ParsePolicy(std::string_view name) {
  if (name == "eplb") return Policy::kEplb;
  if (name == "eplb-global") return Policy::kEplbGlobal;
  if (name == "ubep") return Policy::kUbep;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", std::string(name), "'; expected eplb, eplb-global or ubep"));
}

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kEplb: return "eplb";
    case Policy::kEplbGlobal: return "eplb-global";
    case Policy::kUbep: return "ubep";
  }
  return "?";
}

absl::StatusOr<Plan> ComputePlan(const LoadMatrix& load, const Topology& topology,
                                 const Plan* previous, const PlannerOptions& options) {
  if (previous != nullptr) {
    UBEP_RETURN_IF_ERROR(
        CheckSameShape(*previous, topology, load.num_experts(), load.num_layers()));
  }
  absl::StatusOr<Plan> plan;
  switch (options.policy) {
    case Policy::kEplb:
    case Policy::kEplbGlobal:
      plan = PlanEplb(load, topology, options.policy == Policy::kEplb);
      break;
    case Policy::kUbep:
      plan = PlanUbep(load, topology, previous,
                      UbepPolicyOptions{.seed = options.seed,
                                        .migration_budget = options.migration_budget,
                                        .balance_slack = options.balance_slack});
      break;
  }
  if (plan.ok()) plan->version = previous != nullptr ? previous->version + 1 : 1;
  return plan;
}

}  // namespace ubep::balancer
