// A faithful re-implementation of DeepSeek's EPLB (github.com/deepseek-ai/EPLB, eplb.py):
// replicate the heaviest experts (largest load per replica first), then pack replicas onto
// ranks by greedy balanced packing; hierarchical when expert groups divide evenly by nodes
// (groups are pinned to nodes first), else global. Every replica gets an equal share.
// Arithmetic is float32 and ties break to the lowest index, as torch does on CPU, so phy2log
// matches the Python output. Pure; thread-compatible.
#ifndef UBEP_BALANCER_CORE_EPLB_POLICY_H_
#define UBEP_BALANCER_CORE_EPLB_POLICY_H_

#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "balancer/core/load_matrix.h"
#include "balancer/core/plan.h"

namespace ubep::balancer {

// `hierarchical` asks for EPLB's rebalance_experts dispatch (hierarchical when
// num_groups % num_nodes == 0); false forces the global policy (groups = nodes = 1).
absl::StatusOr<Plan> PlanEplb(const LoadMatrix& load, const Topology& topology,
                              bool hierarchical);
// Whether PlanEplb(..., hierarchical) packs expert groups onto nodes (else it plans as the
// global policy does).
bool PlansHierarchically(const Topology& topology, bool hierarchical);

// One layer of rebalance_experts_hierarchical; returns phy2log. Exposed for tests.
std::vector<int> EplbLayer(std::span<const double> weight, int num_physical, int num_groups,
                           int num_nodes, int num_gpus);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_EPLB_POLICY_H_
