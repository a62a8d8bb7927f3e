#include "balancer/core/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace ubep::balancer {

absl::Status ValidatePlan(const Plan& plan) {
  const Topology& t = plan.topology;
  if (absl::Status s = ValidateTopology(t, plan.num_experts); !s.ok()) return s;
  if (plan.layer_ids.size() != plan.layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("plan has ", plan.layers.size(),
                                                   " layers but ", plan.layer_ids.size(),
                                                   " layer ids"));
  }
  if (absl::Status s = CheckDistinctLayerIds(plan.layer_ids, "layers"); !s.ok()) return s;
  const int num_slots = t.num_slots();
  for (size_t i = 0; i < plan.excluded_ranks.size(); ++i) {
    const int r = plan.excluded_ranks[i];
    if (r < 0 || r >= t.num_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("excluded rank ", r, " is out of range [0, ", t.num_ranks, ")"));
    }
    if (i > 0 && r == plan.excluded_ranks[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("excluded rank ", r, " is listed twice"));
    }
    if (i > 0 && r < plan.excluded_ranks[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("excluded rank ", r, " follows ",
                                                     plan.excluded_ranks[i - 1],
                                                     ": the excluded ranks go in ascending order"));
    }
  }
  if (static_cast<int>(plan.excluded_ranks.size()) >= t.num_ranks && t.num_ranks > 0) {
    return absl::InvalidArgumentError("every rank is excluded");
  }
  std::vector<double> share_sum(plan.num_experts);
  for (int l = 0; l < plan.num_layers(); ++l) {
    const LayerPlan& layer = plan.layers[l];
    if (static_cast<int>(layer.slot_expert.size()) != num_slots ||
        static_cast<int>(layer.slot_share.size()) != num_slots) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", l, " has ", layer.slot_expert.size(), " slots, topology has ", num_slots));
    }
    std::fill(share_sum.begin(), share_sum.end(), 0.0);
    for (int p = 0; p < num_slots; ++p) {
      const int e = layer.slot_expert[p];
      if (e < 0 || e >= plan.num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", l, " slot ", p, " holds expert ",
                                                       e, ", outside [0, ", plan.num_experts,
                                                       ")"));
      }
      const double s = layer.slot_share[p];
      if (!std::isfinite(s) || s < 0 || s > 1 + kShareSumTolerance) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, " slot ", p, " has share ", s, ", outside [0, 1]"));
      }
      if (s > 0 && plan.excluded(p / t.slots_per_rank)) {
        return absl::InvalidArgumentError(absl::StrCat("layer ", l, " slot ", p, " has share ", s,
                                                       " but rank ", p / t.slots_per_rank,
                                                       " is excluded"));
      }
      share_sum[e] += s;
    }
    for (int e = 0; e < plan.num_experts; ++e) {
      if (std::abs(share_sum[e] - 1.0) > kShareSumTolerance) {
        return absl::InvalidArgumentError(
            share_sum[e] == 0.0
                ? absl::StrCat("layer ", l, " expert ", e, " has no replica (or only zero shares)")
                : absl::StrCat("layer ", l, " expert ", e, " shares sum to ", share_sum[e],
                               ", not 1"));
      }
    }
  }
  return absl::OkStatus();
}

bool Plan::excluded(int rank) const {
  return std::binary_search(excluded_ranks.begin(), excluded_ranks.end(), rank);
}

EplbArrays ToEplbArrays(const Plan& plan) {
  EplbArrays out;
  const int num_slots = plan.topology.num_slots();
  int max_replicas = 1;
  for (const LayerPlan& layer : plan.layers) {
    std::vector<int> count(plan.num_experts, 0);
    for (int e : layer.slot_expert) max_replicas = std::max(max_replicas, ++count[e]);
  }
  for (const LayerPlan& layer : plan.layers) {
    out.phy2log.push_back(layer.slot_expert);
    std::vector<std::vector<int>> log2phy(plan.num_experts, std::vector<int>(max_replicas, -1));
    std::vector<std::vector<double>> shares(plan.num_experts,
                                            std::vector<double>(max_replicas, 0.0));
    std::vector<int> count(plan.num_experts, 0);
    for (int p = 0; p < num_slots; ++p) {
      const int e = layer.slot_expert[p];
      log2phy[e][count[e]] = p;
      shares[e][count[e]] = layer.slot_share[p];
      ++count[e];
    }
    out.log2phy.push_back(std::move(log2phy));
    out.logcnt.push_back(std::move(count));
    out.shares.push_back(std::move(shares));
  }
  return out;
}

void SetEqualShares(int num_experts, LayerPlan& layer) {
  std::vector<int> count(num_experts, 0);
  for (int e : layer.slot_expert) ++count[e];
  layer.slot_share.resize(layer.slot_expert.size());
  for (size_t p = 0; p < layer.slot_expert.size(); ++p) {
    layer.slot_share[p] = 1.0 / count[layer.slot_expert[p]];
  }
}

int64_t ChangedSlots(const Plan& before, const Plan& after, std::vector<int64_t>* per_rank) {
  const Topology& t = after.topology;
  if (per_rank != nullptr) per_rank->assign(t.num_ranks, 0);
  int64_t changed = 0;
  const int num_layers = std::min(before.num_layers(), after.num_layers());
  for (int l = 0; l < num_layers; ++l) {
    const auto& a = before.layers[l].slot_expert;
    const auto& b = after.layers[l].slot_expert;
    for (size_t p = 0; p < std::min(a.size(), b.size()); ++p) {
      if (a[p] == b[p]) continue;
      ++changed;
      if (per_rank != nullptr) ++(*per_rank)[t.RankOfSlot(static_cast<int>(p))];
    }
  }
  return changed;
}

absl::Status CheckSameShape(const Plan& previous, const Topology& topology,
                            const LoadMatrix& load) {
  const Topology& p = previous.topology;
  if (p.num_ranks != topology.num_ranks || p.num_nodes != topology.num_nodes ||
      p.slots_per_rank != topology.slots_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "previous plan is for ", previous.topology.num_ranks, " ranks x ",
        previous.topology.slots_per_rank, " slots on ", previous.topology.num_nodes,
        " nodes, not ", topology.num_ranks, " x ", topology.slots_per_rank, " on ",
        topology.num_nodes));
  }
  if (previous.num_experts != load.num_experts()) {
    return absl::InvalidArgumentError(absl::StrCat("previous plan has ", previous.num_experts,
                                                   " experts, load has ", load.num_experts()));
  }
  if (previous.num_layers() != load.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("previous plan has ", previous.num_layers(),
                                                   " layers, load has ", load.num_layers()));
  }
  // Layers pair by model layer: a plan for layers 3 and 4 is no previous plan for 3 and 5.
  const std::vector<int>& ids = load.layer_ids();
  if (previous.layer_ids.size() != ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("previous plan has ", previous.layer_ids.size(),
                                                   " layer ids, load has ", ids.size()));
  }
  for (size_t l = 0; l < ids.size(); ++l) {
    if (previous.layer_ids[l] != ids[l]) {
      return absl::InvalidArgumentError(
          absl::StrCat("previous plan's layer ", l, " is model layer ", previous.layer_ids[l],
                       ", the load's is model layer ", ids[l]));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckPrevious(const Plan& previous, const Topology& topology, const LoadMatrix& load) {
  UBEP_RETURN_IF_ERROR(CheckSameShape(previous, topology, load));
  if (!previous.excluded_ranks.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "previous plan v", previous.version, " excludes rank",
        previous.excluded_ranks.size() > 1 ? "s " : " ", absl::StrJoin(previous.excluded_ranks, ", "),
        "; a plan for every rank does not start from it"));
  }
  if (previous.version == std::numeric_limits<uint64_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("previous plan's version ", previous.version,
                                                   " is the highest there is: no plan follows it"));
  }
  return absl::OkStatus();
}

}  // namespace ubep::balancer
