#include "balancer/core/scenario.h"

#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace ubep::balancer {
namespace {

std::vector<LoadMatrix> TwoSources() {
  LoadMatrix hot_first(2, 4), hot_last(2, 4);
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 4; ++e) {
      hot_first.at(l, e) = e == 0 ? 70 : 10;
      hot_last.at(l, e) = e == 3 ? 700 : 100;
    }
  }
  return {hot_first, hot_last};
}

TEST(ScenarioTest, MixRotatesThroughSourcesAndSumsToOne) {
  absl::StatusOr<Scenario> s = Scenario::Create(
      TwoSources(), {.seed = 3, .period_steps = 100, .burst_probability = 0});
  ASSERT_TRUE(s.ok()) << s.status();
  // Source k peaks at step k * period / K.
  EXPECT_NEAR(s->MixWeights(0)[0], 1.0, 1e-12);
  EXPECT_NEAR(s->MixWeights(50)[1], 1.0, 1e-12);
  EXPECT_NEAR(s->MixWeights(25)[0], 0.5, 1e-12);
  for (int step : {0, 13, 77}) {
    const std::vector<double> w = s->MixWeights(step);
    EXPECT_NEAR(std::accumulate(w.begin(), w.end(), 0.0), 1.0, 1e-12);
  }
}

// One source is the mix at every step, half a period in too (where its cosine is -1).
TEST(ScenarioTest, OneSourceIsTheWholeMixAtEveryStep) {
  absl::StatusOr<Scenario> s =
      Scenario::Create({TwoSources()[1]}, {.pairs_per_step = 1000, .period_steps = 400});
  ASSERT_TRUE(s.ok()) << s.status();
  for (int step : {0, 100, 200, 600}) {
    ASSERT_EQ(s->MixWeights(step), std::vector<double>{1.0}) << "step " << step;
    const LoadMatrix expected = s->ExpectedStep(step);
    EXPECT_DOUBLE_EQ(expected.at(1, 3), 700.0) << "step " << step;  // 1000 x 0.7.
    const LoadMatrix drawn = s->Step(step);
    double sum = 0;
    for (int e = 0; e < 4; ++e) sum += drawn.at(1, e);
    EXPECT_EQ(sum, 1000.0) << "step " << step;
    EXPECT_LT(drawn.at(1, 0), 1000.0) << "step " << step;  // Not every pair to expert 0.
    EXPECT_GT(drawn.at(1, 3), 500.0) << "step " << step;
  }
}

TEST(ScenarioTest, StepsAreSeededMultinomialDraws) {
  const ScenarioOptions options{.seed = 9, .pairs_per_step = 10000};
  absl::StatusOr<Scenario> a = Scenario::Create(TwoSources(), options);
  absl::StatusOr<Scenario> b = Scenario::Create(TwoSources(), options);
  ASSERT_TRUE(a.ok() && b.ok());
  const LoadMatrix x = a->Step(42), y = b->Step(42), z = a->Step(43);
  bool differs = false;
  for (int l = 0; l < 2; ++l) {
    EXPECT_DOUBLE_EQ(x.RowSum(l), 10000.0);
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(x.at(l, e), y.at(l, e));
      differs |= x.at(l, e) != z.at(l, e);
    }
  }
  EXPECT_TRUE(differs);
  // At step 0 the mix is all source 0: expert 0 draws about 70% of the pairs.
  const LoadMatrix first = a->Step(0);
  const double expected = a->ExpectedStep(0).at(0, 0);
  EXPECT_NEAR(expected, 7000.0, 1e-6);
  EXPECT_NEAR(first.at(0, 0), expected, 5 * std::sqrt(10000 * 0.7 * 0.3));
}

// A burst makes one source 80% of the mix for burst_steps steps: against the same scenario
// without bursts, the burst source's weight is 0.2 of its calm weight plus 0.8, the other's
// 0.2 of its own. A period of 100 steps, so that the calm mix alone is even at step 25.
TEST(ScenarioTest, BurstsMakeOneSourceDominate) {
  const ScenarioOptions bursty{
      .seed = 5, .period_steps = 100, .burst_probability = 1.0, .burst_steps = 10, .max_steps = 30};
  ScenarioOptions calm_options = bursty;
  calm_options.burst_probability = 0;
  absl::StatusOr<Scenario> s = Scenario::Create(TwoSources(), bursty);
  absl::StatusOr<Scenario> calm = Scenario::Create(TwoSources(), calm_options);
  ASSERT_TRUE(s.ok() && calm.ok());
  EXPECT_NEAR(calm->MixWeights(25)[0], 0.5, 1e-12);
  int burst = -1;
  for (int step = 0; step < 30; ++step) {
    const std::vector<double> w = s->MixWeights(step), c = calm->MixWeights(step);
    const int b = w[0] > w[1] ? 0 : 1;
    EXPECT_NEAR(w[b], 0.2 * c[b] + 0.8, 1e-12) << "step " << step;
    EXPECT_NEAR(w[1 - b], 0.2 * c[1 - b], 1e-12) << "step " << step;
    if (step % 10 == 0) burst = b;  // Each burst lasts its 10 steps.
    EXPECT_EQ(b, burst) << "step " << step;
  }
}

TEST(ScenarioTest, RejectsSourcesOfDifferentShapes) {
  std::vector<LoadMatrix> sources = TwoSources();
  sources.push_back(LoadMatrix(3, 4));
  EXPECT_EQ(Scenario::Create(sources, {}).status(),
            absl::InvalidArgumentError(
                "scenario source 2 is 3 layers x 4 experts; source 0 is 2 x 4"));
  EXPECT_EQ(Scenario::Create({}, {}).status(),
            absl::InvalidArgumentError("scenario needs at least one source"));
  LoadMatrix empty_layer(2, 4);
  empty_layer.at(0, 1) = 1;
  EXPECT_EQ(Scenario::Create({empty_layer}, {}).status(),
            absl::InvalidArgumentError("scenario source 0 layer 1 has no load"));
}

// Mixed row by row, the sources must be the same model layers; NaN options and a period under
// one step (step / period infinite) are refused, each value named.
TEST(ScenarioTest, RejectsSourcesOfOtherLayersAndOptionsThatAreNaN) {
  std::vector<LoadMatrix> sources = TwoSources();
  sources[1].set_layer_ids({0, 5});
  EXPECT_EQ(Scenario::Create(sources, {}).status(),
            absl::InvalidArgumentError(
                "scenario source 1 has model layers 0, 5; source 0 has 0, 1"));
  auto refused = [](double period, double probability) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scenario options: pairs_per_step (32768), burst_steps (25) and max_steps (100000) must "
        "be positive, period_steps (", period, ") finite and at least 1, burst_probability (",
        probability, ") in [0, 1]"));
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(Scenario::Create(TwoSources(), {.period_steps = nan}).status(), refused(nan, 0.01));
  EXPECT_EQ(Scenario::Create(TwoSources(), {.burst_probability = nan}).status(),
            refused(400, nan));
  EXPECT_EQ(Scenario::Create(TwoSources(), {.period_steps = 1e-320}).status(),
            refused(1e-320, 0.01));
  EXPECT_TRUE(Scenario::Create(TwoSources(), {.period_steps = 1}).ok());
}

}  // namespace
}  // namespace ubep::balancer
