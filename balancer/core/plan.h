// Plan: per MoE layer, the logical expert held by every physical slot and the share of that
// expert's traffic the slot receives. The data plane splits an expert's (token, k) pairs between
// its replicas by these shares, so shares need not be equal. Versions only grow.
// A value type; thread-compatible.
//
// Invariants (ValidatePlan): the topology is valid for num_experts (ValidateTopology); one
// layer id per layer, no id twice; every slot holds an expert in [0, num_experts); every
// expert has at least one replica; shares are in [0, 1] and an expert's shares sum to 1 within
// 1e-9; excluded ranks are ascending, in range, not all ranks, and their slots have share 0.
#ifndef UBEP_BALANCER_CORE_PLAN_H_
#define UBEP_BALANCER_CORE_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "balancer/core/load_matrix.h"
#include "balancer/core/topology.h"

namespace ubep::balancer {

struct LayerPlan {
  std::vector<int> slot_expert;    // phy2log: [num_slots].
  std::vector<double> slot_share;  // [num_slots]: share of slot_expert[p]'s traffic at slot p.

  friend bool operator==(const LayerPlan&, const LayerPlan&) = default;
};

struct Plan {
  uint64_t version = 0;
  Topology topology;
  int num_experts = 0;
  std::vector<int> layer_ids;  // Model layer index of each entry of `layers`.
  std::vector<LayerPlan> layers;
  // Ranks out of the group (node failed or drained), ascending: their slots have share 0.
  std::vector<int> excluded_ranks;

  bool excluded(int rank) const;
  int num_layers() const { return static_cast<int>(layers.size()); }

  // Every field alike (shares exactly): the same plan.
  friend bool operator==(const Plan&, const Plan&) = default;
};

// Tolerance on the sum of an expert's shares.
inline constexpr double kShareSumTolerance = 1e-9;

absl::Status ValidatePlan(const Plan& plan);

// EPLB's array form (DeepSeek eplb.py): log2phy lists each expert's physical slots padded
// with -1 to the largest replica count; shares is aligned with log2phy (0 in padding).
// Replicas are listed in slot order.
struct EplbArrays {
  std::vector<std::vector<int>> phy2log;                // [L][num_slots]
  std::vector<std::vector<std::vector<int>>> log2phy;   // [L][E][max_replicas]
  std::vector<std::vector<int>> logcnt;                 // [L][E]
  std::vector<std::vector<std::vector<double>>> shares; // [L][E][max_replicas]
};

EplbArrays ToEplbArrays(const Plan& plan);

// Gives every replica of each expert an equal share (EPLB's semantics).
void SetEqualShares(int num_experts, LayerPlan& layer);

// Slots whose expert differs between two plans of the same shape, in total and per rank
// (per_rank may be null).
int64_t ChangedSlots(const Plan& before, const Plan& after, std::vector<int64_t>* per_rank);

// OK when `previous` is a plan for `topology` (ranks, nodes, slots) and the shape of `load`:
// its experts, and its layers by model layer id, in the same order.
absl::Status CheckSameShape(const Plan& previous, const Topology& topology,
                            const LoadMatrix& load);

// OK when `previous` can be the plan before a plan of every rank for `topology` and `load`:
// of their shape (CheckSameShape), excluding no rank (a plan for the members left starts from
// the members' part of it, as the balancer's PlanForMembers makes it; from the whole, the
// excluded ranks would get traffic again), and of a version below 2^64 - 1 (the next one is
// higher).
absl::Status CheckPrevious(const Plan& previous, const Topology& topology, const LoadMatrix& load);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_PLAN_H_
