#include "balancer/core/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace ubep::balancer {

std::vector<double> RankLoads(const Topology& topology, const LayerPlan& layer,
                              std::span<const double> expert_load) {
  std::vector<double> loads(topology.num_ranks, 0.0);
  for (int p = 0; p < topology.num_slots(); ++p) {
    loads[topology.RankOfSlot(p)] += expert_load[layer.slot_expert[p]] * layer.slot_share[p];
  }
  return loads;
}

double Balancedness(std::span<const double> rank_loads) {
  if (rank_loads.empty()) return 1.0;
  const double total = std::accumulate(rank_loads.begin(), rank_loads.end(), 0.0);
  if (total <= 0) return 1.0;
  const double max = *std::max_element(rank_loads.begin(), rank_loads.end());
  return max * static_cast<double>(rank_loads.size()) / total;
}

double MeasuredBalancedness(std::span<const double> rank_loads) {
  const double total = std::accumulate(rank_loads.begin(), rank_loads.end(), 0.0);
  return total > 0 ? Balancedness(rank_loads) : std::numeric_limits<double>::quiet_NaN();
}

BalanceSummary SummarizeLayers(std::vector<double> per_layer) {
  BalanceSummary summary;
  double sum = 0.0, worst = 0.0;
  for (double b : per_layer) {
    if (std::isnan(b)) continue;
    sum += b;
    worst = std::max(worst, b);
    ++summary.measured;
  }
  if (summary.measured > 0) {
    summary.mean = sum / summary.measured;
    summary.worst = worst;
  }
  summary.per_layer = std::move(per_layer);
  return summary;
}

BalanceSummary SummarizeBalance(const Plan& plan, const LoadMatrix& load) {
  std::vector<double> per_layer;
  for (int l = 0; l < plan.num_layers(); ++l) {
    std::vector<double> loads = RankLoads(plan.topology, plan.layers[l], load.row(l));
    // Ranks out of the group carry nothing and do not count.
    for (auto r = plan.excluded_ranks.rbegin(); r != plan.excluded_ranks.rend(); ++r) {
      if (*r < static_cast<int>(loads.size())) loads.erase(loads.begin() + *r);
    }
    per_layer.push_back(MeasuredBalancedness(loads));
  }
  return SummarizeLayers(std::move(per_layer));
}

double CrossNodeShare(const Plan& plan, const LoadMatrix& load) {
  const Topology& t = plan.topology;
  double total = 0.0;
  double local = 0.0;
  // Each node sources its member ranks' part of an expert's pairs (a node the plan leaves out,
  // drained, sources none) and keeps up to its replicas' share.
  std::vector<double> source_fraction(t.num_nodes, 0.0);
  int members = 0;
  for (int r = 0; r < t.num_ranks; ++r) {
    if (plan.excluded(r)) continue;
    source_fraction[t.NodeOfRank(r)] += 1;
    ++members;
  }
  if (members == 0) return 0.0;
  for (double& f : source_fraction) f /= members;
  // Per layer, the slots grouped by expert (a counting sort), and per expert its nodes'
  // shares summed over its own replicas: O(slots + experts + nodes) memory and time, where an
  // expert x node table took E x N doubles (terabytes at 2^20 of each).
  std::vector<int> start(static_cast<size_t>(plan.num_experts) + 1);
  std::vector<int> by_expert(t.num_slots());
  std::vector<double> node_share(t.num_nodes, 0.0);
  std::vector<int> touched;
  for (int l = 0; l < plan.num_layers(); ++l) {
    const LayerPlan& layer = plan.layers[l];
    std::fill(start.begin(), start.end(), 0);
    for (int p = 0; p < t.num_slots(); ++p) ++start[layer.slot_expert[p] + 1];
    for (int e = 0; e < plan.num_experts; ++e) start[e + 1] += start[e];
    std::vector<int> next(start.begin(), start.end() - 1);
    for (int p = 0; p < t.num_slots(); ++p) by_expert[next[layer.slot_expert[p]]++] = p;
    for (int e = 0; e < plan.num_experts; ++e) {
      const double w = load.at(l, e);
      total += w;
      for (int i = start[e]; i < start[e + 1]; ++i) {
        const int p = by_expert[i];
        const int n = t.NodeOfRank(t.RankOfSlot(p));
        if (node_share[n] == 0.0) touched.push_back(n);  // Twice after a 0 share: harmless.
        node_share[n] += layer.slot_share[p];
      }
      for (int n : touched) {
        local += w * std::min(source_fraction[n], node_share[n]);
        node_share[n] = 0.0;
      }
      touched.clear();
    }
  }
  return total > 0 ? (total - local) / total : 0.0;
}

}  // namespace ubep::balancer
