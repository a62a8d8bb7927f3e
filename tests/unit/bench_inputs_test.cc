// The data-plane benchmarks' inputs (bench/dataplane_inputs.h): which trace layer a skewed case
// is drawn from, and that the tokens drawn from it load the experts and the ranks as the
// trace does.
#include "bench/dataplane_inputs.h"

#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "balancer/formats/json_formats.h"
#include "gtest/gtest.h"

namespace ubep::bench {
namespace {

// Every MoE layer of every trace of `phase`, read here without SkewedDistribution: the
// largest rank imbalance among them at `ranks` (RankImbalance is checked below).
double WorstRankImbalance(const std::string& phase, int ranks) {
  double worst = 0;
  for (const char* file : {"decode_in1000out1000", "decode_in1800out100", "decode_in500out1500",
                           "prefill_in1000out1000", "prefill_in1024", "prefill_in2000out100",
                           "prefill_in2048", "prefill_in512"}) {
    if (std::string(file).rfind(phase + "_", 0) != 0) continue;
    absl::StatusOr<balancer::LoadMatrix> trace = balancer::ReadSglangLoadFile(
        std::string(UBEP_SOURCE_DIR) + "/data/traces/deepseek-v3/" + file + ".json");
    EXPECT_TRUE(trace.ok()) << trace.status();
    if (!trace.ok()) return 0;
    for (int l = 0; l < trace->num_layers(); ++l) {
      worst = std::max(worst, RankImbalance(trace->row(l), ranks));
    }
  }
  return worst;
}

// The skewed routing of each phase and rank count comes from that phase's traces, from the
// layer whose load is most uneven over the ranks of the expert-parallel plan.
TEST(BenchInputsTest, ASkewedCaseIsDrawnFromItsPhasesMostRankSkewedLayer) {
  for (const std::string phase : {"decode", "prefill"}) {
    for (int ranks : {2, 4, 8}) {
      SCOPED_TRACE(phase + " at " + std::to_string(ranks) + " ranks");
      absl::StatusOr<Skew> skew = SkewedDistribution(UBEP_SOURCE_DIR, phase, ranks);
      ASSERT_TRUE(skew.ok()) << skew.status();
      EXPECT_EQ(skew->source.rfind(phase + "_", 0), 0u) << skew->source;
      ASSERT_EQ(skew->counts.size(), static_cast<size_t>(kExperts));
      EXPECT_DOUBLE_EQ(skew->rank_imbalance, RankImbalance(skew->counts, ranks));
      EXPECT_DOUBLE_EQ(skew->rank_imbalance, WorstRankImbalance(phase, ranks));
      EXPECT_GT(skew->rank_imbalance, 1.5);  // Skewed: a hot rank, not a near-uniform load.
    }
  }
  EXPECT_EQ(SkewedDistribution(UBEP_SOURCE_DIR, "decode", 3).status(),
            absl::InvalidArgumentError("3 ranks do not divide 256 experts"));
  EXPECT_EQ(SkewedDistribution(UBEP_SOURCE_DIR, "warmup", 4).status(),
            absl::NotFoundError(std::string("no MoE layer in ") + UBEP_SOURCE_DIR +
                                "/data/traces/deepseek-v3/warmup_*.json"));
}

// Max over mean of the ranks' contiguous blocks of experts.
TEST(BenchInputsTest, RankImbalanceIsTheBusiestRanksLoadOverTheMean) {
  std::vector<double> counts(kExperts, 1.0);
  for (int e = 0; e < kExperts / 4; ++e) counts[e] = 3.0;  // Rank 0 of 4: 3 x the others.
  EXPECT_DOUBLE_EQ(RankImbalance(counts, 4), 3.0 * 4 / 6);
  EXPECT_DOUBLE_EQ(RankImbalance(std::vector<double>(kExperts, 2.0), 8), 1.0);
  EXPECT_EQ(RankImbalance(std::vector<double>(kExperts, 0.0), 8), 0.0);
}

// K times each expert's share, capped at 1 with the excess spread in proportion over the others.
TEST(BenchInputsTest, InclusionProbabilitiesSumToKAndNoneExceedsOne) {
  std::vector<double> counts(kExperts, 1.0);
  counts[0] = 1000.0;  // Alone, its share x 8 is far above 1.
  counts[1] = 3.0;
  const std::vector<double> p = InclusionProbabilities(counts);
  EXPECT_DOUBLE_EQ(p[0], 1.0);
  // The other 7 over 254 + 3 = 257 units of count.
  EXPECT_DOUBLE_EQ(p[1], 7.0 * 3.0 / 257.0);
  EXPECT_DOUBLE_EQ(p[2], 7.0 / 257.0);
  EXPECT_NEAR(std::accumulate(p.begin(), p.end(), 0.0), kTopK, 1e-12);
}

// Each token gets K distinct experts in range, each expert is drawn as often as the trace
// says (K x its share: a draw that flattened the hot experts fails), and so the ranks' loads
// are as uneven as the trace's layer.
TEST(BenchInputsTest, SkewedTokensLoadTheExpertsAsTheTraceDoes) {
  const Case c{"prefill", 4, 4096, 2048, "skewed"};
  absl::StatusOr<Skew> skew = SkewedDistribution(UBEP_SOURCE_DIR, c.name, c.ranks);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const std::vector<double> p = InclusionProbabilities(skew->counts);
  std::vector<double> drawn(kExperts, 0.0);
  const int n = c.tokens * c.ranks;
  for (int rank = 0; rank < c.ranks; ++rank) {
    const std::vector<int32_t> idx = RouteTokens(c, rank, *skew);
    ASSERT_EQ(idx.size(), static_cast<size_t>(c.tokens) * kTopK);
    for (int t = 0; t < c.tokens; ++t) {
      const std::set<int32_t> experts(idx.begin() + t * kTopK, idx.begin() + (t + 1) * kTopK);
      ASSERT_EQ(experts.size(), static_cast<size_t>(kTopK)) << "rank " << rank << " token " << t;
      ASSERT_GE(*experts.begin(), 0);
      ASSERT_LT(*experts.rbegin(), kExperts);
      for (int32_t e : experts) drawn[e] += 1;
    }
  }
  const double hottest = *std::max_element(p.begin(), p.end());
  EXPECT_GT(hottest, 0.3);  // The case has a hot expert to flatten.
  for (int e = 0; e < kExperts; ++e) {
    // Tokens draw independently: a binomial count; 6 standard deviations (and one token).
    const double sd = std::sqrt(n * p[e] * (1 - p[e]));
    EXPECT_NEAR(drawn[e], n * p[e], 6 * sd + 1) << "expert " << e;
  }
  EXPECT_NEAR(RankImbalance(drawn, c.ranks), skew->rank_imbalance, 0.05);
}

// A layer with an expert whose share is over 1/K, and fewer than K experts with any count:
// that expert is in every token's K (capped at 1), the other counted ones too (their shares,
// 7/3 each, capped), and the rest of each token's K come from the experts without a count.
TEST(BenchInputsTest, CappedAndTooFewExpertsStillGiveKDistinctExperts) {
  Skew skew;
  skew.counts.assign(kExperts, 0.0);
  skew.counts[0] = 1000;
  skew.counts[1] = skew.counts[2] = skew.counts[3] = 1;
  const std::vector<double> p = InclusionProbabilities(skew.counts);
  EXPECT_EQ(std::vector<double>(p.begin(), p.begin() + 5), (std::vector<double>{1, 1, 1, 1, 0}));
  const Case c{"decode", 4, 256, 8, "skewed"};
  const std::vector<int32_t> idx = RouteTokens(c, 0, skew);
  std::vector<int> drawn(kExperts, 0);
  for (int t = 0; t < c.tokens; ++t) {
    const std::set<int32_t> experts(idx.begin() + t * kTopK, idx.begin() + (t + 1) * kTopK);
    ASSERT_EQ(experts.size(), static_cast<size_t>(kTopK)) << "token " << t;
    for (int32_t e : experts) ++drawn[e];
  }
  for (int e = 0; e < 4; ++e) EXPECT_EQ(drawn[e], c.tokens) << "expert " << e;
  EXPECT_EQ(std::accumulate(drawn.begin() + 4, drawn.end(), 0), 4 * c.tokens);
}

// Uniform routing draws no trace: K distinct experts per token, each about equally often.
TEST(BenchInputsTest, UniformTokensLoadEveryExpertAlike) {
  const Case c{"decode", 4, 4096, 2048, "uniform"};
  std::vector<double> drawn(kExperts, 0.0);
  const std::vector<int32_t> idx = RouteTokens(c, 0, Skew{});
  for (int t = 0; t < c.tokens; ++t) {
    const std::set<int32_t> experts(idx.begin() + t * kTopK, idx.begin() + (t + 1) * kTopK);
    ASSERT_EQ(experts.size(), static_cast<size_t>(kTopK));
    for (int32_t e : experts) drawn[e] += 1;
  }
  const double p = static_cast<double>(kTopK) / kExperts;
  for (int e = 0; e < kExperts; ++e) {
    EXPECT_NEAR(drawn[e], c.tokens * p, 6 * std::sqrt(c.tokens * p * (1 - p)) + 1);
  }
}

}  // namespace
}  // namespace ubep::bench
