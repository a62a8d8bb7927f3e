#include "balancer/core/share_leveling.h"

#include "balancer/core/metrics.h"
#include "balancer/core/planner.h"
#include "gtest/gtest.h"

#include <limits>

namespace ubep::balancer {
namespace {

TEST(ShareLevelingTest, SplitsAReplicatedExpertToLevelTwoRanks) {
  // Rank 0: experts 0 (load 6) and 2 (replica); rank 1: expert 1 (load 2) and 2 (replica).
  // Expert 2 (load 4) goes 0 to rank 0 and 4 to rank 1 at best: loads 6 and 6.
  const Topology t{2, 1, 2, 1};
  LayerPlan layer{{0, 2, 1, 2}, {}};
  const std::vector<double> w = {6, 2, 4};
  const std::vector<double> loads = LevelShares(t, w, layer);
  EXPECT_NEAR(loads[0], 6.0, 1e-12);
  EXPECT_NEAR(loads[1], 6.0, 1e-12);
  EXPECT_NEAR(layer.slot_share[1], 0.0, 1e-12);
  EXPECT_NEAR(layer.slot_share[3], 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(layer.slot_share[0], 1.0);
}

TEST(ShareLevelingTest, ReachesTheMinMaxThroughAChainOfExperts) {
  // Ranks 0-1-2 linked by expert 3 (ranks 0,1) and expert 4 (ranks 1,2). Rank 0 carries a
  // fixed 9, so the optimum moves all of expert 3 off rank 0 and levels ranks 1 and 2:
  // total 9 + 3 + 3 + 6 = 21 is not 3 x 7 reachable (rank 0 alone holds 9), so max is 9 and
  // ranks 1, 2 take (3 + 3 + 6) / 2 = 6 each.
  const Topology t{3, 1, 2, 1};
  LayerPlan layer{{0, 3, 3, 4, 4, 1}, {}};
  const std::vector<double> w = {9, 3, 0, 3, 6};
  const std::vector<double> loads = LevelShares(t, w, layer);
  EXPECT_NEAR(loads[0], 9.0, 1e-9);
  EXPECT_NEAR(loads[1], 6.0, 1e-9);
  EXPECT_NEAR(loads[2], 6.0, 1e-9);
}

TEST(ShareLevelingTest, PerfectBalanceWhenTheGraphAllowsIt) {
  // Four ranks chained by experts 4 (ranks 0, 1), 5 (ranks 1, 2) and 6 (ranks 2, 3); the
  // total of 32 levels at 8 each: expert 4 splits 6/4, expert 5 4/6, expert 6 2/2.
  const Topology t{4, 2, 2, 1};
  LayerPlan layer{{0, 4, 4, 5, 5, 6, 6, 1}, {}};
  const std::vector<double> w = {2, 6, 0, 0, 10, 10, 4};
  const std::vector<double> loads = LevelShares(t, w, layer);
  for (double l : loads) EXPECT_NEAR(l, 8.0, 1e-9);
  EXPECT_NEAR(Balancedness(loads), 1.0, 1e-12);
}

TEST(ShareLevelingTest, SlackSpreadsSplitsTowardEqual) {
  // Expert 2 could go 0/4 for a perfect 6/6; a 20% slack lets it go closer to 2/2.
  const Topology t{2, 1, 2, 1};
  LayerPlan layer{{0, 2, 1, 2}, {}};
  const std::vector<double> w = {6, 2, 4};
  const std::vector<double> loads = LevelShares(t, w, layer, {.balance_slack = 0.2});
  // Cap is 7.2: rank 0 takes 1.2 of expert 2, rank 1 takes 2.8.
  EXPECT_NEAR(loads[0], 7.2, 1e-9);
  EXPECT_NEAR(layer.slot_share[1], 0.3, 1e-9);
  EXPECT_NEAR(layer.slot_share[3], 0.7, 1e-9);
}

// Loads of a few denormals (an EWMA of an idle system decays through them): the split of an
// expert rounds to parts of 0, and the shares stay as they were, valid, not 0 / 0.
TEST(ShareLevelingTest, DenormalLoadsKeepValidShares) {
  const double dm = std::numeric_limits<double>::denorm_min();
  LoadMatrix load(1, 4);
  load.at(0, 0) = 2 * dm;
  load.at(0, 1) = dm;
  const Topology t{2, 1, 3, 1};
  absl::StatusOr<Plan> plan = ComputePlan(load, t, nullptr, {.policy = Policy::kUbep});
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Decayed by half a step at a time down to 0, from loads of 1, each plan from the last.
  LoadMatrix decaying(1, 16);
  for (int e = 0; e < 16; ++e) decaying.at(0, e) = 1.0 + e;
  absl::StatusOr<Plan> last = ComputePlan(decaying, Topology{8, 1, 3, 1}, nullptr, {});
  ASSERT_TRUE(last.ok()) << last.status();
  for (int step = 0; step < 1200 && decaying.RowSum(0) > 0; ++step) {
    for (int e = 0; e < 16; ++e) decaying.at(0, e) *= 0.5;
    absl::StatusOr<Plan> next = ComputePlan(decaying, Topology{8, 1, 3, 1}, &*last, {});
    ASSERT_TRUE(next.ok()) << "step " << step << ": " << next.status();
    last = std::move(next);
  }
}

TEST(ShareLevelingTest, ZeroLoadKeepsEqualShares) {
  const Topology t{2, 1, 2, 1};
  LayerPlan layer{{0, 1, 0, 1}, {}};
  const std::vector<double> w = {0, 0};
  LevelShares(t, w, layer);
  EXPECT_EQ(layer.slot_share, (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
}

// Shares are fractions of an expert's load whatever its scale: loads decayed to 1e-170 (an
// EWMA in the server) or grown to 1e160 level as loads of 1 do, rather than underflowing to
// share 0 or overflowing to inf through load x load, or being too small to route at all.
TEST(ShareLevelingTest, TinyAndHugeLoadsGiveTheSharesOfOrdinaryOnes) {
  const Topology t{2, 1, 2, 1};
  for (const double scale : {1e-170, 1.0, 1e160}) {
    SCOPED_TRACE(scale);
    LayerPlan layer{{0, 2, 1, 2}, {}};  // As in SplitsAReplicatedExpertToLevelTwoRanks.
    const std::vector<double> w = {6 * scale, 2 * scale, 4 * scale};
    std::vector<double> loads = LevelShares(t, w, layer);
    EXPECT_NEAR(loads[0] / scale, 6.0, 1e-9);
    EXPECT_NEAR(loads[1] / scale, 6.0, 1e-9);
    EXPECT_NEAR(layer.slot_share[1], 0.0, 1e-12);
    EXPECT_NEAR(layer.slot_share[3], 1.0, 1e-12);
    // With slack the split moves toward equal, by the same fractions at every scale.
    loads = LevelShares(t, w, layer, {.balance_slack = 0.2});
    EXPECT_NEAR(loads[0] / scale, 7.2, 1e-9);
    EXPECT_NEAR(layer.slot_share[1], 0.3, 1e-9);
    EXPECT_NEAR(layer.slot_share[3], 0.7, 1e-9);

    // And through the planner: two experts of equal load on two ranks of two slots.
    LoadMatrix load(1, 2);
    load.at(0, 0) = load.at(0, 1) = scale;
    absl::StatusOr<Plan> plan = ComputePlan(load, t, nullptr, {.policy = Policy::kUbep});
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(ValidatePlan(*plan), absl::OkStatus());
    EXPECT_NEAR(SummarizeBalance(*plan, load).mean, 1.0, 0.05 + 1e-9);
  }
}

}  // namespace
}  // namespace ubep::balancer
