#include "balancer/core/planner.h"

#include <algorithm>
#include <vector>

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

// EPLB numbers ranks and slots in its packing order, so a small drift of the load permutes
// them where each rank would keep its experts, and every slot would count as moved (a weight
// copy each): each layer is renumbered against the plan in force to keep what it can in
// place (AlignToPrevious), within each node for the hierarchical policy, whose nodes each
// hold the expert groups packed there.
void AlignEplbToPrevious(const Topology& topology, bool hierarchical, const Plan& previous,
                         Plan& plan) {
  const int nodes = PlansHierarchically(topology, hierarchical) ? topology.num_nodes : 1;
  const Topology part{.num_ranks = topology.num_ranks / nodes,
                      .num_nodes = 1,
                      .slots_per_rank = topology.slots_per_rank};
  const size_t span = static_cast<size_t>(part.num_slots());
  for (int l = 0; l < plan.num_layers(); ++l) {
    LayerPlan& layer = plan.layers[l];
    const LayerPlan& before = previous.layers[l];
    for (int n = 0; n < nodes; ++n) {
      const size_t first = n * span;
      auto slice = [&](const auto& v) {
        return std::vector(v.begin() + first, v.begin() + first + span);
      };
      const LayerPlan was{slice(before.slot_expert), slice(before.slot_share)};
      LayerPlan fresh{slice(layer.slot_expert), slice(layer.slot_share)};
      AlignToPrevious(part, was, fresh);
      std::copy(fresh.slot_expert.begin(), fresh.slot_expert.end(), layer.slot_expert.begin() + first);
      std::copy(fresh.slot_share.begin(), fresh.slot_share.end(), layer.slot_share.begin() + first);
    }
  }
}

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
        AlignEplbToPrevious(topology, options.policy == Policy::kEplb, *previous, *plan);
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
