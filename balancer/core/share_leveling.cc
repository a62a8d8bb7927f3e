#include "balancer/core/share_leveling.h"

#include <algorithm>
#include <cmath>
#include <limits>
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

std::vector<Block> MultiReplicaBlocks(const Topology& t, const LayerPlan& layer,
                                      std::span<const double> w) {
  const int num_experts = static_cast<int>(w.size());
  std::vector<std::vector<int>> slots_of(num_experts);
  for (int p = 0; p < t.num_slots(); ++p) slots_of[layer.slot_expert[p]].push_back(p);
  std::vector<Block> blocks;
  for (int e = 0; e < num_experts; ++e) {
    if (slots_of[e].size() < 2 || w[e] <= 0) continue;
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

// Dinic's max flow on a small graph with double capacities.
class MaxFlow {
 public:
  explicit MaxFlow(int num_nodes)
      : head_(num_nodes, -1), level_(num_nodes), next_(num_nodes), queue_(num_nodes) {}

  int AddEdge(int from, int to, double capacity) {
    edges_.push_back({to, head_[from], capacity});
    head_[from] = static_cast<int>(edges_.size()) - 1;
    edges_.push_back({from, head_[to], 0.0});
    head_[to] = static_cast<int>(edges_.size()) - 1;
    return static_cast<int>(edges_.size()) - 2;
  }
  void SetCapacity(int edge, double capacity) {
    edges_[edge].capacity = capacity;
    edges_[edge ^ 1].capacity = 0.0;
  }
  // Restores every edge to its capacity as added (or last set), with no flow.
  void Reset() {
    for (size_t e = 0; e < edges_.size(); e += 2) {
      edges_[e].capacity += edges_[e + 1].capacity;
      edges_[e + 1].capacity = 0.0;
    }
  }
  double Flow(int edge) const { return edges_[edge ^ 1].capacity; }

  double Run(int source, int sink, double epsilon) {
    epsilon_ = epsilon;
    double total = 0;
    while (Bfs(source, sink)) {
      next_ = head_;
      while (double pushed = Dfs(source, sink, std::numeric_limits<double>::infinity())) {
        total += pushed;
      }
    }
    return total;
  }
  // After Run: whether `node` is reachable from the source in the residual graph.
  bool Reachable(int node) const { return level_[node] >= 0; }

 private:
  struct Edge {
    int to;
    int next;
    double capacity;
  };

  bool Bfs(int source, int sink) {
    std::fill(level_.begin(), level_.end(), -1);
    size_t tail = 0;
    queue_[tail++] = source;
    level_[source] = 0;
    for (size_t i = 0; i < tail; ++i) {
      for (int e = head_[queue_[i]]; e >= 0; e = edges_[e].next) {
        if (edges_[e].capacity > epsilon_ && level_[edges_[e].to] < 0) {
          level_[edges_[e].to] = level_[queue_[i]] + 1;
          queue_[tail++] = edges_[e].to;
        }
      }
    }
    return level_[sink] >= 0;
  }

  double Dfs(int node, int sink, double limit) {
    if (node == sink) return limit;
    for (int& e = next_[node]; e >= 0; e = edges_[e].next) {
      Edge& edge = edges_[e];
      if (edge.capacity <= epsilon_ || level_[edge.to] != level_[node] + 1) continue;
      const double pushed = Dfs(edge.to, sink, std::min(limit, edge.capacity));
      if (pushed > 0) {
        edge.capacity -= pushed;
        edges_[e ^ 1].capacity += pushed;
        return pushed;
      }
    }
    return 0;
  }

  std::vector<Edge> edges_;
  std::vector<int> head_;
  std::vector<int> level_;
  std::vector<int> next_;
  std::vector<int> queue_;
  double epsilon_ = 0;
};

// Smallest achievable largest rank load, and shares achieving it. Dinkelbach-style: route the
// replicated experts' load with every rank capped at `level`; when some load is left over, the
// ranks still reachable from the source form a closed set X (every expert that can reach X
// has all of its replicas in X), so the optimum is at least load(X) / |X|: raise the level to
// that and route again. Each round grows X; a handful of rounds is typical.
void MinMaxShares(const Topology& t, std::span<const double> w, const std::vector<Block>& blocks,
                  const std::vector<double>& fixed, LayerPlan& layer) {
  const int num_blocks = static_cast<int>(blocks.size());
  const int R = t.num_ranks;
  const int source = 0, sink = 1, first_block = 2, first_rank = 2 + num_blocks;
  MaxFlow flow(2 + num_blocks + R);
  double moving = 0;
  std::vector<std::vector<int>> block_edges(num_blocks);
  for (int i = 0; i < num_blocks; ++i) {
    const double load = w[blocks[i].expert];
    moving += load;
    flow.AddEdge(source, first_block + i, load);
    for (int r : blocks[i].ranks) {
      block_edges[i].push_back(flow.AddEdge(first_block + i, first_rank + r, load));
    }
  }
  std::vector<int> sink_edges(R);
  for (int r = 0; r < R; ++r) sink_edges[r] = flow.AddEdge(first_rank + r, sink, 0.0);
  // Tolerances relative to the load (moving > 0: blocks hold only loaded experts), so that
  // loads of any scale level alike; an absolute floor would leave loads below it unrouted.
  const double total = moving + std::accumulate(fixed.begin(), fixed.end(), 0.0);
  const double epsilon = 1e-12 * total;
  double level = std::max(total / R, *std::max_element(fixed.begin(), fixed.end()));
  for (int round = 0; round < R + 1; ++round) {
    MaxFlow& fresh = flow;
    fresh.Reset();
    for (int r = 0; r < R; ++r) fresh.SetCapacity(sink_edges[r], std::max(0.0, level - fixed[r]));
    const double routed = fresh.Run(source, sink, epsilon);
    double closed_load = 0;
    int closed_ranks = 0;
    if (routed < moving * (1 - 1e-9)) {
      for (int i = 0; i < num_blocks; ++i) {
        if (fresh.Reachable(first_block + i)) closed_load += w[blocks[i].expert];
      }
      for (int r = 0; r < R; ++r) {
        if (fresh.Reachable(first_rank + r)) {
          closed_load += fixed[r];
          ++closed_ranks;
        }
      }
    }
    const double next = closed_ranks > 0 ? closed_load / closed_ranks : level;
    if (closed_ranks == 0 || next <= level * (1 + 1e-12)) {
      for (int i = 0; i < num_blocks; ++i) {
        double sum = 0;
        for (int e : block_edges[i]) sum += fresh.Flow(e);
        for (size_t j = 0; j < blocks[i].ranks.size(); ++j) {
          // Any rounding shortfall is spread in proportion, so shares still sum to 1.
          const double share = sum > 0 ? fresh.Flow(block_edges[i][j]) / sum
                                       : 1.0 / blocks[i].ranks.size();
          for (int p : blocks[i].slots[j]) {
            layer.slot_share[p] = share / static_cast<double>(blocks[i].slots[j].size());
          }
        }
      }
      return;
    }
    level = next;
  }
}

// The projection of the equal split onto {x : sum x = amount, 0 <= x <= hi}: x_j = min(y, hi_j)
// with y the level at which the capped sum reaches `amount` (needs sum hi >= amount). O(n log n)
// over the caps in ascending order; `order` is scratch space.
void ProjectEqualSplit(double amount, std::span<const double> hi, std::span<double> x,
                       std::vector<int>& order) {
  const size_t n = hi.size();
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return hi[a] < hi[b]; });
  double below = 0;  // Sum of the caps under the level.
  double level = hi[order[n - 1]];
  for (size_t k = 0; k < n; ++k) {
    const double y = (amount - below) / static_cast<double>(n - k);
    if (y <= hi[order[k]]) {
      level = y;
      break;
    }
    below += hi[order[k]];
  }
  for (size_t j = 0; j < n; ++j) x[j] = std::min(level, hi[j]);
}

// Moves every replicated expert's split as close to equal as the cap on rank loads allows
// (block coordinate descent; each step keeps every rank at or under `cap`). Equal splits keep
// a rank's load a mix of many experts, so the plan holds up when the load drifts.
void SpreadShares(std::span<const double> w, const std::vector<Block>& blocks, double cap,
                  std::vector<double>& rank_load, int sweeps, LayerPlan& layer) {
  std::vector<double> base, hi, x;
  std::vector<int> order;
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    for (const Block& b : blocks) {
      const double load = w[b.expert];
      const size_t n = b.ranks.size();
      base.resize(n);
      hi.resize(n);
      x.resize(n);
      double room = 0;
      for (size_t j = 0; j < n; ++j) {
        double share = 0.0;
        for (int p : b.slots[j]) share += layer.slot_share[p];
        base[j] = rank_load[b.ranks[j]] - load * share;
        hi[j] = std::max(0.0, cap - base[j]);
        room += hi[j];
      }
      if (room < load) continue;  // Rounding left no room: keep the current split.
      ProjectEqualSplit(load, hi, x, order);
      double sum = 0;
      for (size_t j = 0; j < n; ++j) sum += x[j];
      // A load of a few denormals splits into parts that round to 0: no split to take (the
      // fractions would be 0 / 0); the current one stays.
      if (!(sum > 0)) continue;
      for (size_t j = 0; j < n; ++j) {
        // The fraction first: x[j] * load is of the order of load^2, which overflows for
        // loads above ~1e154 and underflows to 0 below ~1e-154 (decayed rates).
        const double fraction = x[j] / sum;
        rank_load[b.ranks[j]] = base[j] + fraction * load;
        const double share = fraction / static_cast<double>(b.slots[j].size());
        for (int p : b.slots[j]) layer.slot_share[p] = share;
      }
    }
  }
}

}  // namespace

std::vector<double> LevelShares(const Topology& t, std::span<const double> w, LayerPlan& layer,
                                const LevelingOptions& options) {
  const std::vector<Block> blocks = MultiReplicaBlocks(t, layer, w);
  SetEqualShares(static_cast<int>(w.size()), layer);
  if (blocks.empty()) return RankLoads(t, layer, w);
  std::vector<double> fixed(t.num_ranks, 0.0);
  {
    std::vector<uint8_t> moving(w.size(), 0);
    for (const Block& b : blocks) moving[b.expert] = 1;
    for (int p = 0; p < t.num_slots(); ++p) {
      const int e = layer.slot_expert[p];
      if (!moving[e]) fixed[t.RankOfSlot(p)] += w[e] * layer.slot_share[p];
    }
  }
  MinMaxShares(t, w, blocks, fixed, layer);
  std::vector<double> rank_load = RankLoads(t, layer, w);
  const double cap = *std::max_element(rank_load.begin(), rank_load.end()) *
                     (1 + options.balance_slack);
  SpreadShares(w, blocks, cap, rank_load, options.spread_sweeps, layer);
  return RankLoads(t, layer, w);
}

}  // namespace ubep::balancer
