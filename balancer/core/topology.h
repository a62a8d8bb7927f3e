// Topology: the shape a plan is made for: ranks, the nodes they sit on, physical expert slots
// per rank per MoE layer, and DeepSeek-style expert groups. Ranks are laid out node-major:
// rank r sits on node r / (num_ranks / num_nodes). Slot p = r * slots_per_rank + i.
// A plain value type; thread-compatible.
#ifndef UBEP_BALANCER_CORE_TOPOLOGY_H_
#define UBEP_BALANCER_CORE_TOPOLOGY_H_

#include <cstdint>

#include "absl/status/status.h"

namespace ubep::balancer {

// Most physical slots (ranks x slots_per_rank) a topology may have: the most a group ubepd
// and the balancer accept has (1024 ranks x 4096 slots, common/shape_limits.h), which keeps
// slot indices and the arrays sized by them (per layer) well within an int.
inline constexpr int64_t kMaxSlots = int64_t{1} << 22;
// The most experts, and the highest topology count and layer id, a plan holds (its JSON and
// proto forms are read to these bounds, and a load to plan is held to them).
inline constexpr int kMaxPlanIndex = 1 << 20;

struct Topology {
  int num_ranks = 0;
  int num_nodes = 1;
  int slots_per_rank = 0;
  int num_groups = 1;  // Expert groups; 1 = no grouping.

  // NOTE: an int; it cannot overflow once ValidateTopology has passed (kMaxSlots).
  int num_slots() const { return num_ranks * slots_per_rank; }
  int ranks_per_node() const { return num_ranks / num_nodes; }
  int NodeOfRank(int rank) const { return rank / ranks_per_node(); }
  int RankOfSlot(int slot) const { return slot / slots_per_rank; }

  friend bool operator==(const Topology&, const Topology&) = default;
};

// OK when `topology` can hold `num_experts` logical experts: positive counts, ranks divisible
// by nodes, at most kMaxSlots slots (counted in 64 bits), at least one slot per expert,
// experts divisible by groups. The message names the field and the problem.
absl::Status ValidateTopology(const Topology& topology, int num_experts);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_TOPOLOGY_H_
