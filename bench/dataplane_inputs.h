// Inputs shared by the data-plane benchmarks, so every method moves the same bytes: the
// cases, the routing of each rank's tokens (uniform, or drawn from the MoE layer of the real
// DeepSeek-V3 traces of the case's phase that loads the ranks most unevenly) and the
// expert-parallel plan (256 experts, one slot each); and how they time an iteration over the
// rank processes.
#ifndef UBEP_BENCH_DATAPLANE_INPUTS_H_
#define UBEP_BENCH_DATAPLANE_INPUTS_H_

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "balancer/formats/json_formats.h"
#include "kernels/common/plan_table.h"

namespace ubep::bench {

// The steady clock in ns: one clock for every process of the machine, so that the ranks'
// times compare.
inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One iteration over `ranks` rank processes, from each rank's start and end (NowNs): the
// slowest rank's own time, and the span from the first start to the last end (which also
// counts how unevenly the ranks began).
struct IterationTimes {
  double slowest_us = 0;
  double span_us = 0;
};
inline IterationTimes TimeIteration(const int64_t* start_ns, const int64_t* end_ns, int ranks) {
  int64_t slowest = 0, first = start_ns[0], last = end_ns[0];
  for (int r = 0; r < ranks; ++r) {
    slowest = std::max(slowest, end_ns[r] - start_ns[r]);
    first = std::min(first, start_ns[r]);
    last = std::max(last, end_ns[r]);
  }
  return {slowest / 1e3, (last - first) / 1e3};
}

inline constexpr int kTopK = 8;
inline constexpr int kExperts = 256;

struct Case {
  std::string name;  // decode / prefill
  int ranks, tokens, hidden;
  std::string routing;  // uniform / skewed
};

// Per expert, the probability of being among a token's K (K = kTopK) when experts are drawn in
// proportion to `counts`: K x its share, capped at 1 with the excess spread over the others in
// proportion; they sum to K (at least K experts with a count above 0 are needed).
inline std::vector<double> InclusionProbabilities(const std::vector<double>& counts) {
  std::vector<double> p(counts.size(), 0.0);
  std::vector<bool> capped(counts.size(), false);
  double left = kTopK;
  for (bool again = true; again;) {
    again = false;
    double free = 0;
    for (size_t e = 0; e < counts.size(); ++e) free += capped[e] ? 0 : counts[e];
    for (size_t e = 0; e < counts.size(); ++e) {
      if (capped[e]) continue;
      p[e] = free > 0 ? left * counts[e] / free : 0;
      if (p[e] > 1) {
        capped[e] = true;
        p[e] = 1;
        left -= 1;
        again = true;
      }
    }
  }
  return p;
}

// What a skewed case's tokens are drawn from: the (token, top-k) counts per expert of one MoE
// layer of a trace.
struct Skew {
  std::vector<double> counts;  // Per expert.
  std::string source;          // "<file> layer <l>".
  double rank_imbalance = 0;   // Max over mean of the ranks' loads under ExpertParallelPlan.
};

// Top-k distinct experts per token. Uniform: drawn uniformly. Skewed: each expert is among a
// token's K with probability K x its share of `skew.counts` (capped at 1, the excess spread
// over the others), as in the trace, by systematic sampling over a fresh random order of the
// experts (points u, u + 1, ..., u + K - 1 over the experts' consecutive intervals of those
// lengths: each interval, at most 1 long, holds at most one point, so the K are distinct).
inline std::vector<int32_t> RouteTokens(const Case& c, int rank, const Skew& skew) {
  std::mt19937_64 rng(1234 + rank);
  std::vector<int32_t> idx;
  idx.reserve(static_cast<size_t>(c.tokens) * kTopK);
  if (c.routing != "skewed") {
    std::uniform_int_distribution<int> uniform(0, kExperts - 1);
    for (int t = 0; t < c.tokens; ++t) {
      std::vector<int> chosen;
      while (static_cast<int>(chosen.size()) < kTopK) {
        const int e = uniform(rng);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      idx.insert(idx.end(), chosen.begin(), chosen.end());
    }
    return idx;
  }
  if (skew.counts.size() != static_cast<size_t>(kExperts)) {
    std::fprintf(stderr, "RouteTokens: a skewed routing needs %d expert counts, got %zu\n",
                 kExperts, skew.counts.size());
    std::abort();
  }
  const std::vector<double> p = InclusionProbabilities(skew.counts);
  std::vector<int> order(kExperts);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int t = 0; t < c.tokens; ++t) {
    for (int e = 0; e < kExperts; ++e) order[e] = e;
    std::shuffle(order.begin(), order.end(), rng);
    const double u = unit(rng);
    double end = 0;
    int next = 0;  // Points u + next .. are still to place.
    std::vector<bool> taken(kExperts, false);
    for (int i = 0; i < kExperts && next < kTopK; ++i) {
      end += p[order[i]];
      if (u + next < end) {
        taken[order[i]] = true;
        idx.push_back(order[i]);
        ++next;
      }
    }
    // Rounding can leave the last point just past the sum: the last experts not taken.
    for (int i = kExperts - 1; i >= 0 && next < kTopK; --i) {
      if (!taken[order[i]]) {
        taken[order[i]] = true;
        idx.push_back(order[i]);
        ++next;
      }
    }
  }
  return idx;
}

// A rank's activations for iterations of one parity (0: even, 1: odd): each value a signed
// power of two in [2^-8, 2^8], drawn by a hash of (rank, token, element) and moved by the
// parity (the exponent by 8 of 17 places, the sign flipped), so that every element differs
// from the other parity's and rows of different tokens or ranks differ (but by chance, one in
// 34 per element). With the experts the identity and each token's K weights 1/K (K = 8),
// the combine gives each token back exactly: n/K of a power of two (n <= K pairs of a token
// at one rank) is exact in bf16, and so is the sum of the partials. A row dropped, doubled,
// given to another token or read before it was stored (where the other parity's value of the
// iteration before lies) changes the output.
inline std::vector<uint16_t> CheckedInput(const Case& c, int rank, int parity) {
  std::vector<uint16_t> x(static_cast<size_t>(c.tokens) * c.hidden);
  for (int t = 0; t < c.tokens; ++t) {
    for (int h = 0; h < c.hidden; ++h) {
      // splitmix64's finalizer over the element's coordinates.
      uint64_t z = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(t) << 24) ^
                   static_cast<uint64_t>(h);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z ^= z >> 31;
      const int e = static_cast<int>((z % 17 + 8 * parity) % 17) - 8;  // [-8, 8]
      const uint16_t sign = (((z >> 32) ^ parity) & 1) != 0 ? 0x8000 : 0;
      x[static_cast<size_t>(t) * c.hidden + h] = static_cast<uint16_t>(sign | ((127 + e) << 7));
    }
  }
  return x;
}

// The first element where `out` differs from `x`, or -1.
inline int64_t FirstDifference(const std::vector<uint16_t>& out, const std::vector<uint16_t>& x) {
  const auto [a, b] = std::mismatch(out.begin(), out.end(), x.begin(), x.end());
  return a == out.end() && b == x.end() ? -1 : a - out.begin();
}

// Expert e in slot e: plain expert parallelism, 256 / ranks slots per rank.
inline std::vector<std::byte> ExpertParallelPlan() {
  std::vector<int> experts(kExperts);
  std::vector<double> shares(kExperts, 1.0);
  for (int p = 0; p < kExperts; ++p) experts[p] = p;
  const kernels::LayerRouting layer{experts, shares};
  return *kernels::BuildPlanTable(1, kExperts, {&layer, 1});
}

// Max over mean of the ranks' loads when rank r holds experts [r x E/R, (r+1) x E/R), as
// ExpertParallelPlan places them.
inline double RankImbalance(std::span<const double> counts, int ranks) {
  const int per_rank = kExperts / ranks;
  double most = 0, total = 0;
  for (int r = 0; r < ranks; ++r) {
    double load = 0;
    for (int e = r * per_rank; e < (r + 1) * per_rank; ++e) load += counts[e];
    most = std::max(most, load);
    total += load;
  }
  return total > 0 ? most * ranks / total : 0;
}

// The skewed routing of `phase` ("decode" or "prefill") at `ranks` ranks: of the MoE layers of
// every DeepSeek-V3 trace of that phase (data/traces/deepseek-v3/<phase>_*.json, in name
// order), the one whose load under the expert-parallel plan is most uneven across the ranks
// (the first of equals): what makes a rank hot under plain expert parallelism.
inline absl::StatusOr<Skew> SkewedDistribution(const std::string& source_dir,
                                              const std::string& phase, int ranks) {
  if (ranks < 1 || kExperts % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(ranks, " ranks do not divide ", kExperts, " experts"));
  }
  const std::filesystem::path dir = std::filesystem::path(source_dir) / "data/traces/deepseek-v3";
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, phase + "_") && absl::EndsWith(name, ".json")) files.push_back(name);
  }
  std::sort(files.begin(), files.end());
  Skew worst;
  for (const std::string& name : files) {
    absl::StatusOr<balancer::LoadMatrix> trace = balancer::ReadSglangLoadFile((dir / name).string());
    if (!trace.ok()) return trace.status();
    if (trace->num_experts() != kExperts) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has ", trace->num_experts(),
                                                     " experts, not ", kExperts));
    }
    for (int l = 0; l < trace->num_layers(); ++l) {
      if (trace->RowSum(l) <= 0) continue;  // A dense layer.
      const double imbalance = RankImbalance(trace->row(l), ranks);
      if (imbalance > worst.rank_imbalance) {
        worst.counts.assign(trace->row(l).begin(), trace->row(l).end());
        worst.source = absl::StrCat(name, " layer ", trace->layer_ids()[l]);
        worst.rank_imbalance = imbalance;
      }
    }
  }
  if (worst.counts.empty()) {
    return absl::NotFoundError(absl::StrCat("no MoE layer in ", dir.string(), "/", phase, "_*.json"));
  }
  return worst;
}

}  // namespace ubep::bench

#endif  // UBEP_BENCH_DATAPLANE_INPUTS_H_
