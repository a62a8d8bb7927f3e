#include "balancer/core/eplb_policy.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ubep::balancer {
namespace {

struct Packing {
  std::vector<int> pack_index;
  std::vector<int> rank_in_pack;
};

// eplb.py balanced_packing: items by weight descending, each into the lightest pack that still
// has room; every pack ends with exactly items / num_packs items.
Packing BalancedPacking(std::span<const float> weight, int num_packs) {
  const int n = static_cast<int>(weight.size());
  const int per_pack = n / num_packs;
  Packing out{std::vector<int>(n), std::vector<int>(n, 0)};
  if (per_pack == 1) {
    std::iota(out.pack_index.begin(), out.pack_index.end(), 0);
    return out;
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return weight[a] > weight[b]; });
  std::vector<float> pack_weight(num_packs, 0.0f);
  std::vector<int> pack_items(num_packs, 0);
  for (int item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    }
    out.pack_index[item] = best;
    out.rank_in_pack[item] = pack_items[best];
    pack_weight[best] += weight[item];
    ++pack_items[best];
  }
  return out;
}

struct Replication {
  std::vector<int> phy2log;  // [num_phy]
  std::vector<int> logcnt;   // [num_log]
};

// eplb.py replicate_experts: each redundant slot goes to the expert with the largest load per
// replica.
Replication ReplicateExperts(std::span<const float> weight, int num_phy) {
  const int num_log = static_cast<int>(weight.size());
  Replication out{std::vector<int>(num_phy), std::vector<int>(num_log, 1)};
  std::iota(out.phy2log.begin(), out.phy2log.begin() + num_log, 0);
  for (int i = num_log; i < num_phy; ++i) {
    int best = 0;
    float best_value = weight[0] / static_cast<float>(out.logcnt[0]);
    for (int e = 1; e < num_log; ++e) {
      const float v = weight[e] / static_cast<float>(out.logcnt[e]);
      if (v > best_value) {
        best = e;
        best_value = v;
      }
    }
    out.phy2log[i] = best;
    ++out.logcnt[best];
  }
  return out;
}

std::vector<int> Inverse(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int>(i);
  return inv;
}

}  // namespace

std::vector<int> EplbLayer(std::span<const double> weight_in, int num_physical, int num_groups,
                           int num_nodes, int num_gpus) {
  const int num_log = static_cast<int>(weight_in.size());
  std::vector<float> weight(weight_in.begin(), weight_in.end());
  const int group_size = num_log / num_groups;
  const int groups_per_node = num_groups / num_nodes;
  const int phy_per_gpu = num_physical / num_gpus;
  const int log_per_node = num_log / num_nodes;
  const int phy_per_node = num_physical / num_nodes;

  // Step 1: pack groups onto nodes.
  std::vector<float> tokens_per_group(num_groups, 0.0f);
  for (int g = 0; g < num_groups; ++g) {
    for (int j = 0; j < group_size; ++j) tokens_per_group[g] += weight[g * group_size + j];
  }
  const Packing groups = BalancedPacking(tokens_per_group, num_nodes);
  std::vector<int> log2mlog(num_log);
  for (int g = 0; g < num_groups; ++g) {
    const int base =
        (groups.pack_index[g] * groups_per_node + groups.rank_in_pack[g]) * group_size;
    for (int j = 0; j < group_size; ++j) log2mlog[g * group_size + j] = base + j;
  }
  const std::vector<int> mlog2log = Inverse(log2mlog);

  std::vector<int> phy2log(num_physical);
  for (int n = 0; n < num_nodes; ++n) {
    // Step 2: redundant experts within the node.
    std::vector<float> tokens_per_mlog(log_per_node);
    for (int j = 0; j < log_per_node; ++j) {
      tokens_per_mlog[j] = weight[mlog2log[n * log_per_node + j]];
    }
    const Replication rep = ReplicateExperts(tokens_per_mlog, phy_per_node);
    // Step 3: pack physical experts onto the node's GPUs.
    std::vector<float> tokens_per_phy(phy_per_node);
    for (int i = 0; i < phy_per_node; ++i) {
      const int m = rep.phy2log[i];
      tokens_per_phy[i] = tokens_per_mlog[m] / static_cast<float>(rep.logcnt[m]);
    }
    const Packing gpus = BalancedPacking(tokens_per_phy, num_gpus / num_nodes);
    std::vector<int> phy2pphy(phy_per_node);
    for (int i = 0; i < phy_per_node; ++i) {
      phy2pphy[i] = gpus.pack_index[i] * phy_per_gpu + gpus.rank_in_pack[i];
    }
    const std::vector<int> pphy2phy = Inverse(phy2pphy);
    for (int j = 0; j < phy_per_node; ++j) {
      const int mlog = rep.phy2log[pphy2phy[j]] + n * log_per_node;
      phy2log[n * phy_per_node + j] = mlog2log[mlog];
    }
  }
  return phy2log;
}

bool PlansHierarchically(const Topology& topology, bool hierarchical) {
  return hierarchical && topology.num_groups % topology.num_nodes == 0;
}

absl::StatusOr<Plan> PlanEplb(const LoadMatrix& load, const Topology& topology,
                              bool hierarchical) {
  UBEP_RETURN_IF_ERROR(ValidateLoad(load));
  UBEP_RETURN_IF_ERROR(ValidateTopology(topology, load.num_experts()));
  int groups = topology.num_groups;
  int nodes = topology.num_nodes;
  if (!PlansHierarchically(topology, hierarchical)) groups = nodes = 1;
  if (load.num_experts() % groups != 0) {
    return absl::InvalidArgumentError(absl::StrCat("eplb: experts (", load.num_experts(),
                                                   ") must be divisible by groups (", groups,
                                                   ")"));
  }
  // EPLB computes in float32, as its reference does: a layer whose sum a float cannot hold
  // (a double past FLT_MAX converts to float undefined) is refused, not planned at random.
  for (int l = 0; l < load.num_layers(); ++l) {
    if (load.RowSum(l) > std::numeric_limits<float>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "eplb: layer ", load.layer_ids()[l], " sums to ", load.RowSum(l),
          ", more than float32 holds (EPLB sums in float32); scale the counts down"));
    }
  }
  Plan plan;
  plan.topology = topology;
  plan.num_experts = load.num_experts();
  plan.layer_ids = load.layer_ids();
  for (int l = 0; l < load.num_layers(); ++l) {
    LayerPlan layer;
    layer.slot_expert =
        EplbLayer(load.row(l), topology.num_slots(), groups, nodes, topology.num_ranks);
    SetEqualShares(plan.num_experts, layer);
    plan.layers.push_back(std::move(layer));
  }
  return plan;
}

}  // namespace ubep::balancer
