#include "balancer/core/ubep_policy.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstdlib>
#include <queue>
#include <tuple>
#include <utility>
#include <vector>

#include "balancer/core/metrics.h"
#include "balancer/core/share_leveling.h"
#include "common/hash.h"
#include "common/status_macros.h"

namespace ubep::balancer {
namespace {


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

constexpr double kMaxAutoSlack = 0.05;

// Sum over ranks of the squared load above the mean, in units of the mean (mean > 0): squares
// of raw loads would overflow above ~1e154 and vanish below ~1e-154.
double Excess(const std::vector<double>& rank_load, double mean) {
  double sum = 0;
  for (double l : rank_load) {
    const double above = (l - mean) / mean;
    sum += l > mean ? above * above : 0.0;
  }
  return sum;
}

double MaxOf(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// Pairwise exchange of single-replica experts between the most and the least loaded rank
// (loads at equal shares), while an exchange narrows the gap between the two. LPT under a slot
// limit leaves its last, forced placements uneven; this evens them out so share leveling only
// has small residues to move along the chain.
void SwapSingles(std::span<const double> w, const Topology& t, const std::vector<int>& count,
                 std::vector<double>& rank_load, LayerPlan& layer) {
  const int S = t.slots_per_rank;
  for (int round = 0; round < 4 * t.num_ranks; ++round) {
    const auto [lo, hi] = std::minmax_element(rank_load.begin(), rank_load.end());
    const int r_lo = static_cast<int>(lo - rank_load.begin());
    const int r_hi = static_cast<int>(hi - rank_load.begin());
    const double gap = *hi - *lo;
    if (gap <= 0) return;
    // Moving d = w[a] - w[b] from r_hi to r_lo leaves the pair's gap at |gap - 2d|.
    int best_p = -1, best_q = -1;
    double best_gap = gap * (1 - 1e-9);
    for (int p = r_hi * S; p < (r_hi + 1) * S; ++p) {
      const int a = layer.slot_expert[p];
      if (count[a] != 1) continue;
      for (int q = r_lo * S; q < (r_lo + 1) * S; ++q) {
        const int b = layer.slot_expert[q];
        if (count[b] != 1) continue;
        const double d = w[a] - w[b];
        if (d <= 0) continue;
        const double new_gap = std::abs(gap - 2 * d);
        if (new_gap < best_gap) {
          best_gap = new_gap;
          best_p = p;
          best_q = q;
        }
      }
    }
    if (best_p < 0) return;
    const double d = w[layer.slot_expert[best_p]] - w[layer.slot_expert[best_q]];
    std::swap(layer.slot_expert[best_p], layer.slot_expert[best_q]);
    rank_load[r_hi] -= d;
    rank_load[r_lo] += d;
  }
}

// Chain placement. Replica counts come from ReplicaCounts (the heaviest experts get the
// spare slots, so no replica carries much more than a rank's fair share: a rank's load stays a
// mix of experts and moves little when one expert's load drifts). The replicated experts are
// then laid along a chain of ranks, each one covering consecutive chain ranks and sharing its
// first rank with the previous expert's last, so that with R - 1 spare slots the chain links
// every rank: share leveling can then move load between any two ranks. Single-replica experts
// fill the remaining slots heaviest first onto the least-loaded rank (LPT). Consecutive chain
// ranks sit on different nodes, so a replicated expert spreads across nodes.
LayerPlan ChainPlacement(std::span<const double> w, const Topology& t, uint64_t seed) {
  const int num_experts = static_cast<int>(w.size());
  const int R = t.num_ranks, S = t.slots_per_rank, N = t.num_nodes;
  const std::vector<int> count = ReplicaCounts(w, t.num_slots(), R);
  std::vector<int> chain_rank(R);
  for (int k = 0; k < R; ++k) chain_rank[k] = (k % N) * t.ranks_per_node() + k / N;

  std::vector<uint64_t> tiebreak(R);
  for (int r = 0; r < R; ++r) tiebreak[r] = SplitMix64(seed * 0x100000001b3ULL + r);
  std::vector<double> rank_load(R, 0.0);
  std::vector<int> used(R, 0);
  // The expert a rank last took a slot for. An expert's copies are placed one after another,
  // so "rank r holds e" while e is placed is holding[r] == e: O(R), where a rank x expert
  // table took R x E bytes (4 GiB and int-overflowing indices at 2^16 ranks and experts).
  std::vector<int> holding(R, -1);
  LayerPlan layer;
  layer.slot_expert.assign(t.num_slots(), -1);
  auto place = [&](int r, int e, double load) {
    layer.slot_expert[r * S + used[r]++] = e;
    rank_load[r] += load;
    holding[r] = e;
  };
  // Picks the least-loaded rank with a free slot, preferring ranks without `e`.
  auto least_loaded = [&](int e) {
    int best = -1;
    for (int allow_duplicate = 0; allow_duplicate < 2 && best < 0; ++allow_duplicate) {
      for (int r = 0; r < R; ++r) {
        if (used[r] == S || (!allow_duplicate && holding[r] == e)) continue;
        if (best < 0 || std::tie(rank_load[r], tiebreak[r]) <
                            std::tie(rank_load[best], tiebreak[best])) {
          best = r;
        }
      }
    }
    return best;
  };

  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return w[a] > w[b]; });
  int position = 0;  // Chain rank where the next replicated expert starts.
  for (int e : order) {
    if (count[e] < 2) continue;
    const double load = w[e] / count[e];
    int k = position;  // In [0, R): an expert's copies may be millions (R x S slots).
    for (int i = 0; i < count[e]; ++i) {
      // Next chain rank (wrapping) with a free slot and without e; LPT if none is left.
      int r = -1;
      for (int tries = 0; tries < R && r < 0; ++tries, k = (k + 1) % R) {
        const int candidate = chain_rank[k];
        if (used[candidate] < S && holding[candidate] != e) r = candidate;
      }
      if (r < 0) r = least_loaded(e);
      place(r, e, load);
    }
    position = (k + R - 1) % R;  // The last rank of this expert opens the next one.
  }
  // Single-replica experts, heaviest first, onto the least-loaded rank with a free slot.
  using RankKey = std::tuple<double, uint64_t, int>;  // (load, tiebreak, rank)
  std::priority_queue<RankKey, std::vector<RankKey>, std::greater<>> open;
  for (int r = 0; r < R; ++r) {
    if (used[r] < S) open.emplace(rank_load[r], tiebreak[r], r);
  }
  for (int e : order) {
    if (count[e] >= 2) continue;
    const int r = std::get<2>(open.top());
    open.pop();
    place(r, e, w[e]);
    if (used[r] < S) open.emplace(rank_load[r], tiebreak[r], r);
  }
  SwapSingles(w, t, count, rank_load, layer);
  SetEqualShares(num_experts, layer);
  return layer;
}

}  // namespace

LayerPlan UbepLayerFresh(std::span<const double> w, const Topology& t,
                         const UbepPolicyOptions& options) {
  LayerPlan layer = ChainPlacement(w, t, options.seed);
  LevelShares(t, w, layer, {.balance_slack = options.balance_slack});
  return layer;
}

LayerPlan UbepLayerIncremental(std::span<const double> w, const Topology& t,
                               const LayerPlan& previous, const UbepPolicyOptions& options,
                               int* trials_run) {
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
  // Each trial re-levels the layer (a max-flow leveling): at most kMaxIncrementalTrials per
  // layer, which bounds the time a layer takes to plan.
  int trials = 0;
  for (int move = 0; move < t.num_slots() && trials < kMaxIncrementalTrials; ++move) {
    const double max_load = MaxOf(rank_load);
    if (max_load / mean <= options.target_balancedness) break;
    const double excess = Excess(rank_load, mean);
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
        if (tried == kRankCandidates || accepted || trials == kMaxIncrementalTrials) break;
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
        ++trials;
        LayerPlan trial = current;
        const int f = trial.slot_expert[q];
        trial.slot_expert[q] = e;
        trial.slot_share[q] = 0.0;
        std::vector<double> trial_load = LevelShares(t, w, trial);
        // Leveling spreads a gain over every rank at the top level, so the maximum alone can
        // barely move; the excess above the mean, squared, shows progress it cannot.
        if (MaxOf(trial_load) > max_load + 1e-12 * mean ||
            Excess(trial_load, mean) > excess * (1 - options.min_gain)) {
          continue;
        }
        changed[u] += (previous.slot_expert[q] != e) - (previous.slot_expert[q] != f);
        --count[f];
        ++count[e];
        current = std::move(trial);
        rank_load = std::move(trial_load);
        accepted = true;
      }
      if (accepted || trials == kMaxIncrementalTrials) break;
    }
    if (!accepted) {
      // No replica helps (none is spare, or the hot experts are on every cold rank): exchange
      // a heavy single-replica expert of a top rank with a lighter one of a cold rank, the
      // pair whose difference best halves the two ranks' gap.
      const int u_count = std::min<int>(kRankCandidates, R);
      for (int h = 0; h < R && !accepted && trials < kMaxIncrementalTrials; ++h) {
        if (rank_load[h] < max_load - 1e-9 * mean) continue;
        for (int ui = 0; ui < u_count && !accepted && trials < kMaxIncrementalTrials; ++ui) {
          const int u = ranks_by_load[ui];
          const double gap = rank_load[h] - rank_load[u];
          if (u == h || gap <= 0) continue;
          int best_p = -1, best_q = -1;
          double best_gap = gap * (1 - 1e-9);
          for (int p = h * S; p < (h + 1) * S; ++p) {
            const int a = current.slot_expert[p];
            if (count[a] != 1) continue;
            for (int q = u * S; q < (u + 1) * S; ++q) {
              const int b = current.slot_expert[q];
              if (count[b] != 1 || w[a] <= w[b]) continue;
              const int new_h = changed[h] + (previous.slot_expert[p] != b) - (previous.slot_expert[p] != a);
              const int new_u = changed[u] + (previous.slot_expert[q] != a) - (previous.slot_expert[q] != b);
              if (new_h > budget || new_u > budget) continue;
              const double left = std::abs(gap - 2 * (w[a] - w[b]));
              if (left < best_gap) {
                best_gap = left;
                best_p = p;
                best_q = q;
              }
            }
          }
          if (best_p < 0) continue;
          ++trials;
          LayerPlan trial = current;
          std::swap(trial.slot_expert[best_p], trial.slot_expert[best_q]);
          std::vector<double> trial_load = LevelShares(t, w, trial);
          if (MaxOf(trial_load) > max_load + 1e-12 * mean ||
              Excess(trial_load, mean) > excess * (1 - options.min_gain)) {
            continue;
          }
          const int a = current.slot_expert[best_p], b = current.slot_expert[best_q];
          changed[h] += (previous.slot_expert[best_p] != b) - (previous.slot_expert[best_p] != a);
          changed[u] += (previous.slot_expert[best_q] != a) - (previous.slot_expert[best_q] != b);
          current = std::move(trial);
          rank_load = std::move(trial_load);
          accepted = true;
        }
      }
    }
    if (!accepted) break;
  }
  if (trials_run != nullptr) *trials_run = trials;
  if (options.balance_slack > 0) {
    LevelShares(t, w, current, {.balance_slack = options.balance_slack});
  }
  return current;
}

// Renumbers the ranks of `fresh` (whole slot blocks move) to keep as many of each rank's
// experts where `previous` had them, greedily by overlap, then orders each rank's slots so
// that an expert kept on its rank keeps its slot. Rank loads and shares move with the slots.
void AlignToPrevious(const Topology& t, const LayerPlan& previous, LayerPlan& fresh) {
  const int R = t.num_ranks, S = t.slots_per_rank;
  int num_experts = 0;
  for (int e : previous.slot_expert) num_experts = std::max(num_experts, e + 1);
  for (int e : fresh.slot_expert) num_experts = std::max(num_experts, e + 1);
  std::vector<std::vector<int>> old_ranks_of(num_experts);
  for (int p = 0; p < t.num_slots(); ++p) {
    old_ranks_of[previous.slot_expert[p]].push_back(t.RankOfSlot(p));
  }
  // For each fresh rank i, the old ranks j that held some of its experts, and how many
  // (counted in a scratch row of R, so memory stays O(R + pairs), not R x R).
  std::vector<std::tuple<int, int, int>> pairs;  // (-overlap, new rank, old rank)
  std::vector<int> overlap(R, 0), touched;
  for (int i = 0; i < R; ++i) {
    for (int p = i * S; p < (i + 1) * S; ++p) {
      for (int j : old_ranks_of[fresh.slot_expert[p]]) {
        if (overlap[j]++ == 0) touched.push_back(j);
      }
    }
    for (int j : touched) {
      pairs.emplace_back(-overlap[j], i, j);
      overlap[j] = 0;
    }
    touched.clear();
  }
  std::sort(pairs.begin(), pairs.end());
  std::vector<int> target(R, -1), taken(R, 0);
  for (const auto& [neg, i, j] : pairs) {
    if (target[i] < 0 && !taken[j]) {
      target[i] = j;
      taken[j] = 1;
    }
  }
  for (int i = 0, j = 0; i < R; ++i) {
    if (target[i] >= 0) continue;
    while (taken[j]) ++j;
    target[i] = j;
    taken[j] = 1;
  }
  LayerPlan aligned{std::vector<int>(t.num_slots(), -1), std::vector<double>(t.num_slots(), 0)};
  for (int i = 0; i < R; ++i) {
    const int j = target[i];
    std::vector<uint8_t> placed(S, 0);
    // First the experts the old rank held, in their old slots.
    for (int a = 0; a < S; ++a) {
      const int e = fresh.slot_expert[i * S + a];
      for (int b = 0; b < S; ++b) {
        if (aligned.slot_expert[j * S + b] < 0 && previous.slot_expert[j * S + b] == e) {
          aligned.slot_expert[j * S + b] = e;
          aligned.slot_share[j * S + b] = fresh.slot_share[i * S + a];
          placed[a] = 1;
          break;
        }
      }
    }
    for (int a = 0, b = 0; a < S; ++a) {
      if (placed[a]) continue;
      while (aligned.slot_expert[j * S + b] >= 0) ++b;
      aligned.slot_expert[j * S + b] = fresh.slot_expert[i * S + a];
      aligned.slot_share[j * S + b] = fresh.slot_share[i * S + a];
    }
  }
  fresh = std::move(aligned);
}

// After AlignToPrevious: single-replica experts that LPT put elsewhere only because loads
// shifted a little go back to their old slots, by swapping two single-replica experts whose
// loads differ by at most `tolerance` of the mean rank load (each swap restores at least one
// slot; leveling absorbs the small difference afterwards).
void RestoreSingles(std::span<const double> w, const Topology& t, const LayerPlan& previous,
                    double tolerance, LayerPlan& fresh) {
  const int num_experts = static_cast<int>(w.size());
  std::vector<int> count(num_experts, 0), slot_of(num_experts, -1);
  for (int p = 0; p < t.num_slots(); ++p) {
    ++count[fresh.slot_expert[p]];
    slot_of[fresh.slot_expert[p]] = p;
  }
  const double limit = tolerance * std::accumulate(w.begin(), w.end(), 0.0) / t.num_ranks;
  for (int p = 0; p < t.num_slots(); ++p) {
    const int a = fresh.slot_expert[p], b = previous.slot_expert[p];
    if (a == b || count[a] != 1 || b >= num_experts || count[b] != 1) continue;
    const int q = slot_of[b];
    if (std::abs(w[a] - w[b]) > limit) continue;
    std::swap(fresh.slot_expert[p], fresh.slot_expert[q]);
    std::swap(fresh.slot_share[p], fresh.slot_share[q]);
    slot_of[a] = q;
    slot_of[b] = p;
  }
}

// Balancedness of a layer if every replica got an equal share: how much the plan leans on
// tuned shares, which is what goes stale when the load drifts.
double EqualShareBalancedness(std::span<const double> w, const Topology& t, LayerPlan layer) {
  SetEqualShares(static_cast<int>(w.size()), layer);
  return Balancedness(RankLoads(t, layer, w));
}

absl::StatusOr<Plan> PlanUbep(const LoadMatrix& load, const Topology& topology,
                              const Plan* previous, const UbepPolicyOptions& options) {
  UBEP_RETURN_IF_ERROR(ValidateLoad(load));
  UBEP_RETURN_IF_ERROR(ValidateTopology(topology, load.num_experts()));
  if (previous != nullptr) {
    UBEP_RETURN_IF_ERROR(CheckPrevious(*previous, topology, load));
    UBEP_RETURN_IF_ERROR(ValidatePlan(*previous));
  }
  Plan plan;
  plan.topology = topology;
  plan.num_experts = load.num_experts();
  plan.layer_ids = load.layer_ids();
  plan.version = previous != nullptr ? previous->version + 1 : 1;
  plan.layers.reserve(load.num_layers());
  std::vector<UbepPolicyOptions> layer_options(load.num_layers(), options);
  for (int l = 0; l < load.num_layers(); ++l) {
    // Seeded by the layer's id in the model, not its row: a layer planned alone (the server
    // plans chunks of layers in parallel) gets the plan it gets among all layers.
    const int id = l < static_cast<int>(load.layer_ids().size()) ? load.layer_ids()[l] : l;
    layer_options[l].seed = options.seed + static_cast<uint64_t>(id);
    if (options.balance_slack < 0) {
      // Counts are Poisson-like: a rank's measured load is uncertain by about sqrt(load).
      // Leveling tighter than a few of those is fitting noise, so that much is given to
      // splits closer to equal instead.
      const double mean_rank_load = load.RowSum(l) / topology.num_ranks;
      layer_options[l].balance_slack =
          mean_rank_load > 0
              ? std::min(kMaxAutoSlack, options.noise_z / std::sqrt(mean_rank_load))
              : 0.0;
    }
  }
  if (previous == nullptr) {
    for (int l = 0; l < load.num_layers(); ++l) {
      plan.layers.push_back(UbepLayerFresh(load.row(l), topology, layer_options[l]));
    }
    return plan;
  }
  // Keep each layer's placement (within the per-rank budget), then, without a per-rank
  // budget, replan from scratch the layers whose kept placement leans hardest on tuned shares,
  // as long as the slots that change stay within max_moved_fraction of all slots.
  std::vector<LayerPlan> fresh(load.num_layers());
  std::vector<std::pair<double, int>> gains;  // (equal-share balancedness gained, layer)
  // A budget of at least a rank's slots cannot bind: a fresh plan is allowed as it is, and
  // beats a long local search when the kept placement is far off (a first plan from a
  // round-robin placement).
  const bool budget_binds =
      options.migration_budget >= 0 && options.migration_budget < topology.slots_per_rank;
  for (int l = 0; l < load.num_layers(); ++l) {
    if (!(load.RowSum(l) > 0)) {
      // No load in the window (no call reached the layer, or the balancer just started):
      // nothing to plan by. The layer keeps its placement and its shares, as EPLB's does;
      // leveled against nothing, its shares would go equal and make a plan of no change.
      plan.layers.push_back(previous->layers[l]);
      continue;
    }
    if (options.migration_budget >= 0 && !budget_binds) {
      LayerPlan candidate = UbepLayerFresh(load.row(l), topology, layer_options[l]);
      AlignToPrevious(topology, previous->layers[l], candidate);
      RestoreSingles(load.row(l), topology, previous->layers[l], options.restore_tolerance,
                     candidate);
      LevelShares(topology, load.row(l), candidate,
                  {.balance_slack = layer_options[l].balance_slack});
      if (EqualShareBalancedness(load.row(l), topology, previous->layers[l]) -
              EqualShareBalancedness(load.row(l), topology, candidate) >
          options.fresh_gain) {
        plan.layers.push_back(std::move(candidate));
        continue;
      }
    }
    plan.layers.push_back(
        UbepLayerIncremental(load.row(l), topology, previous->layers[l], layer_options[l]));
    if (options.migration_budget >= 0) continue;
    fresh[l] = UbepLayerFresh(load.row(l), topology, layer_options[l]);
    AlignToPrevious(topology, previous->layers[l], fresh[l]);
    RestoreSingles(load.row(l), topology, previous->layers[l], options.restore_tolerance,
                   fresh[l]);
    LevelShares(topology, load.row(l), fresh[l],
                {.balance_slack = layer_options[l].balance_slack});
    const double gain = EqualShareBalancedness(load.row(l), topology, plan.layers[l]) -
                        EqualShareBalancedness(load.row(l), topology, fresh[l]);
    if (gain > options.fresh_gain) gains.emplace_back(gain, l);
  }
  std::sort(gains.begin(), gains.end(), std::greater<>());
  auto moved = [&](int l, const LayerPlan& layer) {
    int64_t n = 0;
    for (int p = 0; p < topology.num_slots(); ++p) {
      n += layer.slot_expert[p] != previous->layers[l].slot_expert[p];
    }
    return n;
  };
  int64_t moved_total = 0;
  for (int l = 0; l < load.num_layers(); ++l) moved_total += moved(l, plan.layers[l]);
  const double cap = options.max_moved_fraction * topology.num_slots() * load.num_layers();
  for (const auto& [gain, l] : gains) {
    const int64_t extra = moved(l, fresh[l]) - moved(l, plan.layers[l]);
    // A fresh plan that moves no more slots than the local search did is taken even where the
    // local search's moves alone passed the cap: it balances better and moves no more.
    if (extra > 0 && moved_total + extra > cap) continue;
    moved_total += extra;
    plan.layers[l] = std::move(fresh[l]);
  }
  return plan;
}

}  // namespace ubep::balancer
