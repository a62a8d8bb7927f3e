#include "balancer/core/planner.h"

#include <algorithm>

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

namespace {

// EPLB replans every layer from scratch. Against the plan in force: a layer with no load
// keeps its placement (EPLB would give every spare slot to expert 0, learning nothing), and
// so does one whose new placement changes more slots of some rank than the budget (each
// changed slot is one weight copy into a free buffer, which the daemons must have).
void KeepLayersEplbCannotMove(const LoadMatrix& load, const Topology& topology,
                              const Plan& previous, int budget, Plan& plan) {
  const int S = topology.slots_per_rank;
  for (int l = 0; l < plan.num_layers(); ++l) {
    // No load as EPLB sees it, in float: values below float's range are 0 to it too.
    const auto row = load.row(l);
    bool keep = std::all_of(row.begin(), row.end(),
                            [](double v) { return !(static_cast<float>(v) > 0.0f); });
    for (int r = 0; r < topology.num_ranks && !keep && budget >= 0; ++r) {
      int changed = 0;
      for (int p = r * S; p < (r + 1) * S; ++p) {
        changed += plan.layers[l].slot_expert[p] != previous.layers[l].slot_expert[p];
      }
      keep = changed > budget;
    }
    if (keep) plan.layers[l] = previous.layers[l];
  }
}

}  // namespace

absl::StatusOr<Plan> ComputePlan(const LoadMatrix& load, const Topology& topology,
                                 const Plan* previous, const PlannerOptions& options) {
  if (previous != nullptr) {
    UBEP_RETURN_IF_ERROR(CheckPrevious(*previous, topology, load));
    UBEP_RETURN_IF_ERROR(ValidatePlan(*previous));
  }
  absl::StatusOr<Plan> plan;
  switch (options.policy) {
    case Policy::kEplb:
    case Policy::kEplbGlobal:
      plan = PlanEplb(load, topology, options.policy == Policy::kEplb);
      if (plan.ok() && previous != nullptr) {
        KeepLayersEplbCannotMove(load, topology, *previous, options.migration_budget, *plan);
      }
      break;
    case Policy::kUbep:
      plan = PlanUbep(load, topology, previous,
                      UbepPolicyOptions{.seed = options.seed,
                                        .migration_budget = options.migration_budget,
                                        .balance_slack = options.balance_slack});
      break;
  }
  if (!plan.ok()) return plan;
  plan->version = previous != nullptr ? previous->version + 1 : 1;
  // A policy's bug must not become a plan the data plane runs: no invalid plan leaves here.
  if (absl::Status s = ValidatePlan(*plan); !s.ok()) {
    return absl::InternalError(absl::StrCat("policy ", std::string(PolicyName(options.policy)),
                                            " made an invalid plan: ", s.message()));
  }
  return plan;
}

}  // namespace ubep::balancer
