#include "balancer/core/ubep_policy.h"

#include <algorithm>
#include <numeric>
#include <queue>
#include <tuple>
#include <utility>
#include <vector>

#include "balancer/core/metrics.h"
#include "balancer/core/share_leveling.h"
#include "common/status_macros.h"

namespace ubep::balancer {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Replica count per expert: one each, then every spare slot to the expert with the largest
// load per replica (lowest id on ties). An expert gets at most one replica per rank unless the
// slots outnumber experts x ranks.
std::vector<int> ReplicaCounts(std::span<const double> w, int num_slots, int num_ranks) {
  const int num_experts = static_cast<int>(w.size());
  const bool capped = static_cast<int64_t>(num_experts) * num_ranks >= num_slots;
  std::vector<int> count(num_experts, 1);
  using Entry = std::pair<double, int>;  // (load per replica, -expert)
  std::priority_queue<Entry> heap;
  for (int e = 0; e < num_experts; ++e) heap.emplace(w[e], -e);
  for (int spare = num_slots - num_experts; spare > 0;) {
    const int e = -heap.top().second;
    heap.pop();
    if (capped && count[e] == num_ranks) continue;
    ++count[e];
    --spare;
    heap.emplace(w[e] / count[e], -e);
  }
  return count;
}

double MaxOf(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// Greedy LPT placement of replicas (the fallback when FillPlacement cannot keep every rank
// within its slots): replica counts by ReplicaCounts, then replicas heaviest first onto the
// least-loaded rank with a free slot that does not hold the expert yet; an expert's extra
// replicas prefer nodes that hold none of it.
LayerPlan LptPlacement(std::span<const double> w, const Topology& t, uint64_t seed) {
  const int num_experts = static_cast<int>(w.size());
  const int R = t.num_ranks, S = t.slots_per_rank, N = t.num_nodes;
  const std::vector<int> count = ReplicaCounts(w, t.num_slots(), R);

  struct Replica {
    double load;
    int expert;
  };
  std::vector<Replica> replicas;
  replicas.reserve(t.num_slots());
  for (int e = 0; e < num_experts; ++e) {
    for (int i = 0; i < count[e]; ++i) replicas.push_back({w[e] / count[e], e});
  }
  std::stable_sort(replicas.begin(), replicas.end(),
                   [](const Replica& a, const Replica& b) { return a.load > b.load; });

  std::vector<uint64_t> tiebreak(R);
  for (int r = 0; r < R; ++r) tiebreak[r] = SplitMix64(seed * 0x100000001b3ULL + r);
  std::vector<double> rank_load(R, 0.0);
  std::vector<int> used(R, 0);
  std::vector<uint8_t> holds(static_cast<size_t>(R) * num_experts, 0);
  std::vector<int> node_count(static_cast<size_t>(N) * num_experts, 0);

  LayerPlan layer;
  layer.slot_expert.assign(t.num_slots(), -1);
  for (const Replica& rep : replicas) {
    const int e = rep.expert;
    const bool spread = count[e] > 1;
    int best = -1;
    std::tuple<int, double, uint64_t> best_key;
    for (int allow_duplicate = 0; allow_duplicate < 2 && best < 0; ++allow_duplicate) {
      for (int r = 0; r < R; ++r) {
        if (used[r] == S || (!allow_duplicate && holds[r * num_experts + e])) continue;
        const std::tuple<int, double, uint64_t> key{
            spread ? node_count[t.NodeOfRank(r) * num_experts + e] : 0, rank_load[r],
            tiebreak[r]};
        if (best < 0 || key < best_key) {
          best = r;
          best_key = key;
        }
      }
    }
    layer.slot_expert[best * S + used[best]] = e;
    ++used[best];
    rank_load[best] += rep.load;
    holds[best * num_experts + e] = 1;
    ++node_count[t.NodeOfRank(best) * num_experts + e];
  }
  SetEqualShares(num_experts, layer);
  return layer;
}

// Fill placement: every rank is filled to exactly the mean load C = W / R with at most S
// pieces, in the spirit of McNaughton's wrap-around rule with a slot budget. Experts sorted by
// load; each rank takes as many of the lightest experts as still leave room (in slots and
// load) to top it up to C with pieces of the heaviest remaining ones; a heavy expert that does
// not fit is split, and its rest opens the next rank. Each rank opens at most one split, so
// pieces <= E + R - 1. Consecutive fill ranks map to different nodes, so a split expert's
// replicas spread across nodes. Shares are exact (piece / expert load). Returns false when the
// slots cannot hold the pieces (fewer than R - 1 spare slots, or the last rank overflows).
bool FillPlacement(std::span<const double> w, const Topology& t, LayerPlan& layer) {
  const int num_experts = static_cast<int>(w.size());
  const int R = t.num_ranks, S = t.slots_per_rank, N = t.num_nodes;
  const double total = std::accumulate(w.begin(), w.end(), 0.0);
  if (total <= 0) return false;
  const double C = total / R;
  const double eps = 1e-12 * total;

  std::vector<int> order(num_experts);  // Ascending load; ties by id.
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return w[a] < w[b]; });

  struct Piece {
    int expert;
    double load;
  };
  std::vector<std::vector<Piece>> ranks(R);
  int front = 0;                  // Next light expert (whole).
  int back = num_experts - 1;     // Heaviest expert with load left.
  double back_left = w[order[back]];
  for (int k = 0; k < R && front <= back; ++k) {
    std::vector<Piece>& pieces = ranks[k];
    if (k == R - 1) {  // The last rank takes the rest.
      for (int i = front; i < back; ++i) pieces.push_back({order[i], w[order[i]]});
      pieces.push_back({order[back], back_left});
      front = back + 1;
      break;
    }
    // Largest a: a lightest experts plus the heavy pieces that top the rank up to C fit in S.
    int best_a = 0;
    double lights = 0;
    for (int a = 0; a <= S - 1; ++a) {
      if (a > 0) {
        if (front + a - 1 >= back) break;
        lights += w[order[front + a - 1]];
      }
      if (lights > C + eps) break;
      double need = C - lights;
      int heavy_pieces = 0;
      int j = back;
      double left = back_left;
      while (need > eps && j >= front + a) {
        const double take = std::min(left, need);
        need -= take;
        ++heavy_pieces;
        if (take < left) break;
        if (--j >= front + a) left = w[order[j]];
      }
      if (a + heavy_pieces <= S) best_a = a;
    }
    double load = 0;
    for (int a = 0; a < best_a; ++a, ++front) {
      pieces.push_back({order[front], w[order[front]]});
      load += w[order[front]];
    }
    while (static_cast<int>(pieces.size()) < S && C - load > eps && back >= front) {
      const double take = std::min(back_left, C - load);
      pieces.push_back({order[back], take});
      load += take;
      back_left -= take;
      if (back_left <= eps) {
        if (back_left > 0) pieces.back().load += back_left;  // Rounding dust stays together.
        if (--back >= front) back_left = w[order[back]];
      }
    }
  }
  if (front <= back) return false;  // Items left over: the ranks ran out of slots.
  for (const auto& pieces : ranks) {
    if (static_cast<int>(pieces.size()) > S) return false;
  }

  // Fill rank k -> physical rank striding across nodes.
  const int per_node = t.ranks_per_node();
  layer.slot_expert.assign(t.num_slots(), -1);
  layer.slot_share.assign(t.num_slots(), 0.0);
  std::vector<uint8_t> holds(static_cast<size_t>(R) * num_experts, 0);
  std::vector<int> count(num_experts, 0);
  std::vector<int> used(R, 0);
  for (int k = 0; k < R; ++k) {
    const int r = (k % N) * per_node + k / N;
    for (const Piece& piece : ranks[k]) {
      const int p = r * S + used[r]++;
      layer.slot_expert[p] = piece.expert;
      layer.slot_share[p] = w[piece.expert] > 0 ? piece.load / w[piece.expert] : 1.0;
      holds[r * num_experts + piece.expert] = 1;
      ++count[piece.expert];
    }
  }
  // Spare slots hold standby replicas of the experts with the most load per replica, at share
  // 0: free headroom for re-leveling when the load drifts, no weight moves needed then.
  using Entry = std::pair<double, int>;
  std::priority_queue<Entry> heap;
  for (int e = 0; e < num_experts; ++e) heap.emplace(w[e] / count[e], -e);
  for (int r = 0; r < R; ++r) {
    std::vector<Entry> skipped;
    while (used[r] < S && !heap.empty()) {
      const auto [value, neg_e] = heap.top();
      heap.pop();
      const int e = -neg_e;
      if (holds[r * num_experts + e]) {
        skipped.emplace_back(value, neg_e);
        continue;
      }
      const int p = r * S + used[r]++;
      layer.slot_expert[p] = e;
      layer.slot_share[p] = 0.0;
      holds[r * num_experts + e] = 1;
      heap.emplace(w[e] / ++count[e], neg_e);
    }
    for (const Entry& entry : skipped) heap.push(entry);
    if (used[r] < S) return false;  // More slots than experts on one rank: use LPT.
  }
  return true;
}

}  // namespace

LayerPlan UbepLayerFresh(std::span<const double> w, const Topology& t, uint64_t seed) {
  LayerPlan layer;
  if (!FillPlacement(w, t, layer)) layer = LptPlacement(w, t, seed);
  LevelShares(t, w, layer);
  return layer;
}

LayerPlan UbepLayerIncremental(std::span<const double> w, const Topology& t,
                               const LayerPlan& previous, const UbepPolicyOptions& options) {
  const int num_experts = static_cast<int>(w.size());
  const int R = t.num_ranks, S = t.slots_per_rank;
  LayerPlan current = previous;
  std::vector<double> rank_load = LevelShares(t, w, current);
  const double total = std::accumulate(rank_load.begin(), rank_load.end(), 0.0);
  if (total <= 0) return current;
  const double mean = total / R;

  std::vector<int> count(num_experts, 0);
  for (int e : current.slot_expert) ++count[e];
  std::vector<int> changed(R, 0);
  const int budget = options.migration_budget < 0 ? S : options.migration_budget;
  constexpr int kExpertCandidates = 4;
  constexpr int kRankCandidates = 4;

  std::vector<int> ranks_by_load(R);
  for (int move = 0; move < t.num_slots(); ++move) {
    const double max_load = MaxOf(rank_load);
    if (max_load / mean <= options.target_balancedness) break;
    // The hottest experts on the ranks at the top level (leveling makes whole groups of ranks
    // share the top load).
    std::vector<int> hot;
    for (int p = 0; p < t.num_slots(); ++p) {
      if (rank_load[t.RankOfSlot(p)] >= max_load - 1e-9 * mean && current.slot_share[p] > 0) {
        hot.push_back(current.slot_expert[p]);
      }
    }
    std::sort(hot.begin(), hot.end(), [&](int a, int b) { return std::tie(w[b], a) < std::tie(w[a], b); });
    hot.erase(std::unique(hot.begin(), hot.end()), hot.end());
    if (hot.size() > kExpertCandidates) hot.resize(kExpertCandidates);
    std::iota(ranks_by_load.begin(), ranks_by_load.end(), 0);
    std::stable_sort(ranks_by_load.begin(), ranks_by_load.end(),
                     [&](int a, int b) { return rank_load[a] < rank_load[b]; });

    bool accepted = false;
    for (int e : hot) {
      int tried = 0;
      for (int u : ranks_by_load) {
        if (tried == kRankCandidates || accepted) break;
        // The slot on u whose expert is replicated elsewhere and carries the least load;
        // it must stay within u's budget (restoring a slot's previous expert is free).
        int q = -1;
        bool holds_e = false;
        for (int p = u * S; p < (u + 1) * S; ++p) holds_e |= current.slot_expert[p] == e;
        if (holds_e) continue;
        for (int p = u * S; p < (u + 1) * S; ++p) {
          const int f = current.slot_expert[p];
          if (count[f] < 2) continue;
          const int delta = (previous.slot_expert[p] == e) - (previous.slot_expert[p] == f);
          if (changed[u] - delta > budget) continue;
          if (q < 0 || w[f] * current.slot_share[p] <
                           w[current.slot_expert[q]] * current.slot_share[q]) {
            q = p;
          }
        }
        if (q < 0) continue;
        ++tried;
        LayerPlan trial = current;
        const int f = trial.slot_expert[q];
        trial.slot_expert[q] = e;
        trial.slot_share[q] = 0.0;
        std::vector<double> trial_load = LevelShares(t, w, trial);
        if (MaxOf(trial_load) > max_load - options.min_gain * mean) continue;
        changed[u] += (previous.slot_expert[q] != e) - (previous.slot_expert[q] != f);
        --count[f];
        ++count[e];
        current = std::move(trial);
        rank_load = std::move(trial_load);
        accepted = true;
      }
      if (accepted) break;
    }
    if (!accepted) break;
  }
  return current;
}

absl::StatusOr<Plan> PlanUbep(const LoadMatrix& load, const Topology& topology,
                              const Plan* previous, const UbepPolicyOptions& options) {
  UBEP_RETURN_IF_ERROR(ValidateLoad(load));
  UBEP_RETURN_IF_ERROR(ValidateTopology(topology, load.num_experts()));
  if (previous != nullptr) {
    UBEP_RETURN_IF_ERROR(
        CheckSameShape(*previous, topology, load.num_experts(), load.num_layers()));
    UBEP_RETURN_IF_ERROR(ValidatePlan(*previous));
  }
  Plan plan;
  plan.topology = topology;
  plan.num_experts = load.num_experts();
  plan.layer_ids = load.layer_ids();
  plan.version = previous != nullptr ? previous->version + 1 : 1;
  plan.layers.reserve(load.num_layers());
  for (int l = 0; l < load.num_layers(); ++l) {
    plan.layers.push_back(
        previous != nullptr
            ? UbepLayerIncremental(load.row(l), topology, previous->layers[l], options)
            : UbepLayerFresh(load.row(l), topology, options.seed + static_cast<uint64_t>(l)));
  }
  return plan;
}

}  // namespace ubep::balancer
