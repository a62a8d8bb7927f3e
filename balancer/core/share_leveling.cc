#include "balancer/core/share_leveling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "balancer/core/metrics.h"

namespace ubep::balancer {
namespace {

// The replicas of one expert that live on distinct ranks; duplicates on one rank (only when a
// rank has more slots than there are experts) share that rank's portion equally.
struct Block {
  int expert;
  std::vector<int> ranks;               // Distinct ranks holding the expert.
  std::vector<std::vector<int>> slots;  // Slots of the expert on each of those ranks.
};

std::vector<Block> MultiReplicaBlocks(const Topology& t, const LayerPlan& layer, int num_experts) {
  std::vector<std::vector<int>> slots_of(num_experts);
  for (int p = 0; p < t.num_slots(); ++p) slots_of[layer.slot_expert[p]].push_back(p);
  std::vector<Block> blocks;
  for (int e = 0; e < num_experts; ++e) {
    if (slots_of[e].size() < 2) continue;
    Block b{e, {}, {}};
    for (int p : slots_of[e]) {
      const int r = t.RankOfSlot(p);
      if (b.ranks.empty() || b.ranks.back() != r) {
        b.ranks.push_back(r);
        b.slots.emplace_back();
      }
      b.slots.back().push_back(p);
    }
    if (b.ranks.size() >= 2) blocks.push_back(std::move(b));
  }
  return blocks;
}

// Water level lambda with sum_j max(0, lambda - base_j) = amount; `sorted` ascending.
double WaterLevel(std::span<const double> sorted, double amount) {
  double prefix = 0.0;
  const size_t n = sorted.size();
  for (size_t k = 1; k <= n; ++k) {
    prefix += sorted[k - 1];
    const double level = (amount + prefix) / static_cast<double>(k);
    if (k == n || level <= sorted[k]) return level;
  }
  return sorted.back();
}

void NormalizeStart(int num_experts, LayerPlan& layer) {
  if (layer.slot_share.size() != layer.slot_expert.size()) {
    SetEqualShares(num_experts, layer);
    return;
  }
  std::vector<double> sum(num_experts, 0.0);
  for (size_t p = 0; p < layer.slot_expert.size(); ++p) {
    sum[layer.slot_expert[p]] += std::max(0.0, layer.slot_share[p]);
  }
  std::vector<int> count(num_experts, 0);
  for (int e : layer.slot_expert) ++count[e];
  for (size_t p = 0; p < layer.slot_expert.size(); ++p) {
    const int e = layer.slot_expert[p];
    layer.slot_share[p] =
        sum[e] > 0 ? std::max(0.0, layer.slot_share[p]) / sum[e] : 1.0 / count[e];
  }
}

}  // namespace

std::vector<double> LevelShares(const Topology& t, std::span<const double> expert_load,
                                LayerPlan& layer, const LevelingOptions& options) {
  const int num_experts = static_cast<int>(expert_load.size());
  NormalizeStart(num_experts, layer);
  std::vector<double> rank_load = RankLoads(t, layer, expert_load);
  const std::vector<Block> blocks = MultiReplicaBlocks(t, layer, num_experts);
  const double total = std::accumulate(rank_load.begin(), rank_load.end(), 0.0);
  if (blocks.empty() || total <= 0) return rank_load;
  const double epsilon = options.tolerance * total / t.num_ranks;

  std::vector<double> base;
  std::vector<double> sorted;
  std::vector<double> portion;  // Expert's load currently on each of the block's ranks.
  for (int sweep = 0; sweep < options.max_sweeps; ++sweep) {
    double moved = 0.0;
    for (const Block& b : blocks) {
      const double w = expert_load[b.expert];
      if (w <= 0) continue;
      const size_t n = b.ranks.size();
      base.resize(n);
      portion.resize(n);
      for (size_t j = 0; j < n; ++j) {
        double share = 0.0;
        for (int p : b.slots[j]) share += layer.slot_share[p];
        portion[j] = w * share;
        base[j] = rank_load[b.ranks[j]] - portion[j];
      }
      sorted.assign(base.begin(), base.end());
      std::sort(sorted.begin(), sorted.end());
      const double level = WaterLevel(sorted, w);
      for (size_t j = 0; j < n; ++j) {
        const double next = std::max(0.0, level - base[j]);
        moved = std::max(moved, std::abs(next - portion[j]));
        rank_load[b.ranks[j]] = base[j] + next;
        const double share = next / w / static_cast<double>(b.slots[j].size());
        for (int p : b.slots[j]) layer.slot_share[p] = share;
      }
    }
    if (moved <= epsilon) break;
  }
  // Renormalize so every expert's shares sum to 1 up to rounding.
  std::vector<double> sum(num_experts, 0.0);
  for (size_t p = 0; p < layer.slot_expert.size(); ++p) sum[layer.slot_expert[p]] += layer.slot_share[p];
  for (size_t p = 0; p < layer.slot_expert.size(); ++p) layer.slot_share[p] /= sum[layer.slot_expert[p]];
  return RankLoads(t, layer, expert_load);
}

}  // namespace ubep::balancer
