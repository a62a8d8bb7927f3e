// Inputs shared by the data-plane benchmarks, so every method moves the same bytes: the
// cases, the routing of each rank's tokens (uniform, or drawn from the most skewed MoE layer of
// a real DeepSeek-V3 prefill trace) and the expert-parallel plan (256 experts, one slot each);
// and how they time an iteration over the rank processes.
#ifndef UBEP_BENCH_DATAPLANE_INPUTS_H_
#define UBEP_BENCH_DATAPLANE_INPUTS_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
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

// top-k distinct experts per token.
inline std::vector<int32_t> RouteTokens(const Case& c, int rank, const std::vector<double>& skew) {
  std::mt19937_64 rng(1234 + rank);
  std::vector<int32_t> idx;
  std::discrete_distribution<int> skewed(skew.begin(), skew.end());
  std::uniform_int_distribution<int> uniform(0, kExperts - 1);
  for (int t = 0; t < c.tokens; ++t) {
    std::vector<int> chosen;
    while (static_cast<int>(chosen.size()) < kTopK) {
      const int e = c.routing == "skewed" ? skewed(rng) : uniform(rng);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    idx.insert(idx.end(), chosen.begin(), chosen.end());
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

// The per-expert distribution of the most skewed MoE layer of prefill_in1024.json.
inline absl::StatusOr<std::vector<double>> SkewedDistribution(const std::string& source_dir) {
  absl::StatusOr<balancer::LoadMatrix> trace = balancer::ReadSglangLoadFile(
      source_dir + "/data/traces/deepseek-v3/prefill_in1024.json");
  if (!trace.ok()) return trace.status();
  std::vector<double> skew;
  double worst = 0;
  for (int l = 0; l < trace->num_layers(); ++l) {
    const auto row = trace->row(l);
    const double ratio =
        *std::max_element(row.begin(), row.end()) * row.size() / trace->RowSum(l);
    if (ratio > worst) {
      worst = ratio;
      skew.assign(row.begin(), row.end());
    }
  }
  return skew;
}

}  // namespace ubep::bench

#endif  // UBEP_BENCH_DATAPLANE_INPUTS_H_
