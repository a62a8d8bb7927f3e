#include "balancer/core/topology.h"

#include "absl/strings/str_cat.h"

namespace ubep::balancer {

absl::Status ValidateTopology(const Topology& t, int num_experts) {
  if (t.num_ranks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("ranks must be positive, got ", t.num_ranks));
  }
  if (t.num_nodes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("nodes must be positive, got ", t.num_nodes));
  }
  if (t.slots_per_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots per rank must be positive, got ", t.slots_per_rank));
  }
  if (t.num_ranks % t.num_nodes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ranks (", t.num_ranks,
                                                   ") must be divisible by nodes (", t.num_nodes,
                                                   ")"));
  }
  if (num_experts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("experts must be positive, got ", num_experts));
  }
  // In 64 bits: each count may be up to 2^20, and an int product would wrap.
  const int64_t num_slots = int64_t{t.num_ranks} * t.slots_per_rank;
  if (num_slots > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slots (", t.num_ranks, " ranks x ", t.slots_per_rank, " = ", num_slots,
        ") are more than the ", kMaxSlots, " (2^22) a topology may have"));
  }
  if (num_slots < num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slots (", t.num_ranks, " ranks x ", t.slots_per_rank, " = ", num_slots,
        ") are fewer than the ", num_experts, " logical experts; every expert needs a slot"));
  }
  if (t.num_groups <= 0 || num_experts % t.num_groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat("experts (", num_experts,
                                                   ") must be divisible by groups (",
                                                   t.num_groups, ")"));
  }
  return absl::OkStatus();
}

}  // namespace ubep::balancer
