#include "kernels/common/plan_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ubep::kernels {

absl::StatusOr<std::vector<std::byte>> BuildPlanTable(uint64_t version, uint32_t num_experts,
                                                      std::span<const LayerRouting> layers,
                                                      uint32_t num_ranks,
                                                      std::span<const int> excluded) {
  if (layers.empty() || num_experts == 0) {
    return absl::InvalidArgumentError("plan table: no layers or no experts");
  }
  const size_t num_slots = layers[0].slot_expert.size();
  if (num_ranks > 0 && num_slots % num_ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("plan table: ", num_slots,
                                                   " slots do not divide among ", num_ranks,
                                                   " ranks"));
  }
  uint32_t max_replicas = 1;
  std::vector<std::vector<std::pair<uint32_t, double>>> replicas(num_experts);
  std::vector<uint32_t> counts(num_experts);
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].slot_expert.size() != num_slots || layers[l].slot_share.size() != num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("plan table: layer ", l, " has ",
                                                     layers[l].slot_expert.size(),
                                                     " slots, layer 0 has ", num_slots));
    }
    std::fill(counts.begin(), counts.end(), 0);
    for (size_t p = 0; p < num_slots; ++p) {
      const int e = layers[l].slot_expert[p];
      if (e < 0 || static_cast<uint32_t>(e) >= num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("plan table: layer ", l, " slot ", p,
                                                       " holds expert ", e, ", outside [0, ",
                                                       num_experts, ")"));
      }
      if (layers[l].slot_share[p] > 0) max_replicas = std::max(max_replicas, ++counts[e]);
    }
  }
  std::vector<std::byte> bytes(
      PlanTableBytes(layers.size(), num_experts, max_replicas, num_ranks));
  PlanTableHeader header{kPlanTableMagic, static_cast<uint32_t>(layers.size()), num_experts,
                         static_cast<uint32_t>(num_slots), max_replicas, num_ranks, version};
  std::memcpy(bytes.data(), &header, sizeof(header));
  auto* mask = reinterpret_cast<uint32_t*>(
      bytes.data() + PlanRoutesEnd(layers.size(), num_experts, max_replicas));
  for (int r : excluded) {
    if (r < 0 || static_cast<uint32_t>(r) >= num_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("plan table: excluded rank ", r,
                                                     " is outside [0, ", num_ranks, ")"));
    }
    mask[r / 32] |= 1u << (r % 32);
  }
  auto* table = reinterpret_cast<PlanTableHeader*>(bytes.data());
  for (size_t l = 0; l < layers.size(); ++l) {
    for (auto& r : replicas) r.clear();
    for (size_t p = 0; p < num_slots; ++p) {
      const double share = layers[l].slot_share[p];
      if (!(share >= 0)) {
        return absl::InvalidArgumentError(absl::StrCat("plan table: layer ", l, " slot ", p,
                                                       " has share ", share));
      }
      // The data plane neither sends to nor waits for an excluded rank: a share there would
      // be pairs dropped.
      if (share > 0 && num_ranks > 0 &&
          RankExcluded(table, static_cast<uint32_t>(p / (num_slots / num_ranks)))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan table: layer ", l, " slot ", p, " has share ", share, " but its rank ",
            p / (num_slots / num_ranks), " is excluded from the group"));
      }
      if (share > 0) replicas[layers[l].slot_expert[p]].emplace_back(p, share);
    }
    for (uint32_t e = 0; e < num_experts; ++e) {
      auto* route = const_cast<ExpertRoute*>(FindRoute(table, l, e));
      if (replicas[e].empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan table: layer ", l, " expert ", e, " has no replica"));
      }
      double sum = 0;
      for (const auto& [slot, share] : replicas[e]) sum += share;
      if (std::abs(sum - 1.0) > 1e-6) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan table: layer ", l, " expert ", e, " shares sum to ", sum, ", not 1"));
      }
      route->count = static_cast<uint32_t>(replicas[e].size());
      auto* out = const_cast<ReplicaRoute*>(Replicas(route));
      double cumulative = 0;
      for (size_t j = 0; j < replicas[e].size(); ++j) {
        cumulative += replicas[e][j].second / sum;
        const double bound = std::min(4294967295.0, std::floor(cumulative * 4294967296.0));
        out[j] = {replicas[e][j].first, j + 1 == replicas[e].size()
                                            ? 0xFFFFFFFFu
                                            : static_cast<uint32_t>(bound)};
      }
    }
  }
  return bytes;
}

absl::Status ValidatePlanTable(std::span<const std::byte> bytes) {
  if (bytes.size() < sizeof(PlanTableHeader)) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan table: ", bytes.size(), " bytes, smaller than its header"));
  }
  const auto* table = reinterpret_cast<const PlanTableHeader*>(bytes.data());
  if (table->magic != kPlanTableMagic) {
    return absl::InvalidArgumentError("plan table: bad magic (not a plan table)");
  }
  // The size the header implies, computed wide: a header whose sizes wrap a size_t must not
  // pass for a short table.
  const unsigned __int128 implied =
      sizeof(PlanTableHeader) +
      static_cast<unsigned __int128>(table->num_layers) * table->num_experts *
          (sizeof(ExpertRoute) + static_cast<unsigned __int128>(sizeof(ReplicaRoute)) *
                                     table->max_replicas) +
      sizeof(uint32_t) * ((static_cast<unsigned __int128>(table->num_ranks) + 31) / 32);
  if (table->max_replicas == 0 || implied != bytes.size()) {
    return absl::InvalidArgumentError("plan table: sizes in the header disagree with its length");
  }
  // As BuildPlanTable writes none: with no experts the length says nothing of the layers.
  if (table->num_layers == 0 || table->num_experts == 0) {
    return absl::InvalidArgumentError(absl::StrCat("plan table: ", table->num_layers,
                                                   " layers of ", table->num_experts,
                                                   " experts"));
  }
  // Checked before what is sized from them: an expert's replicas take distinct slots, and the
  // slots divide among the ranks.
  if (table->num_slots > kMaxPlanSlots) {
    return absl::InvalidArgumentError(absl::StrCat("plan table: ", table->num_slots,
                                                   " slots, over ", kMaxPlanSlots));
  }
  if (table->max_replicas > table->num_slots) {
    return absl::InvalidArgumentError(absl::StrCat("plan table: up to ", table->max_replicas,
                                                   " replicas of an expert in ",
                                                   table->num_slots, " slots"));
  }
  if (table->num_ranks > 0 && table->num_slots % table->num_ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("plan table: ", table->num_slots,
                                                   " slots do not divide among ",
                                                   table->num_ranks, " ranks"));
  }
  // Which expert each slot of a layer serves: one at most, so that a token's distinct experts
  // take distinct slots (routing.h's MaxPairsPerToken, which sizes the receive side). An entry
  // is (layer + 1) << 32 | expert, so that a new layer needs no clearing: the work is the
  // table's length, not its layers times its slots.
  std::vector<uint64_t> served_by(table->num_slots, 0);
  for (uint32_t l = 0; l < table->num_layers; ++l) {
    const uint64_t this_layer = (static_cast<uint64_t>(l) + 1) << 32;
    for (uint32_t e = 0; e < table->num_experts; ++e) {
      const ExpertRoute* route = FindRoute(table, l, e);
      if (route->count == 0 || route->count > table->max_replicas) {
        return absl::InvalidArgumentError(absl::StrCat("plan table: layer ", l, " expert ", e,
                                                       " has ", route->count, " replicas"));
      }
      for (uint32_t j = 0; j < route->count; ++j) {
        const uint32_t slot = Replicas(route)[j].slot;
        if (slot >= table->num_slots) {
          return absl::InvalidArgumentError(absl::StrCat("plan table: layer ", l, " expert ", e,
                                                         " routes to slot ", slot, " of ",
                                                         table->num_slots));
        }
        if (table->num_ranks > 0 &&
            RankExcluded(table, slot / (table->num_slots / table->num_ranks))) {
          return absl::InvalidArgumentError(absl::StrCat(
              "plan table: layer ", l, " expert ", e, " routes to slot ", slot, " of rank ",
              slot / (table->num_slots / table->num_ranks), ", which is excluded"));
        }
        if (served_by[slot] >> 32 == this_layer >> 32 && served_by[slot] != (this_layer | e)) {
          return absl::InvalidArgumentError(absl::StrCat("plan table: layer ", l, " slot ", slot,
                                                         " serves experts ",
                                                         static_cast<uint32_t>(served_by[slot]),
                                                         " and ", e));
        }
        served_by[slot] = this_layer | e;
        // The replicas' hash ranges follow each other and cover every hash, as BuildPlanTable
        // writes them: bounds that go back move traffic off the shares the plan set; a last
        // bound short of 2^32 - 1 (which ChooseSlot does not read) is a table not so built.
        const uint32_t bound = Replicas(route)[j].cum_share;
        if ((j > 0 && bound < Replicas(route)[j - 1].cum_share) ||
            (j + 1 == route->count && bound != 0xFFFFFFFFu)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "plan table: layer ", l, " expert ", e, " replica ", j, " ends its hash range at ",
              bound, j + 1 == route->count ? ", not at 2^32 - 1" : ", before the one before it"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ubep::kernels
