#include "balancer/core/share_leveling.h"

#include "balancer/core/metrics.h"
#include "gtest/gtest.h"

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

TEST(ShareLevelingTest, ZeroLoadKeepsEqualShares) {
  const Topology t{2, 1, 2, 1};
  LayerPlan layer{{0, 1, 0, 1}, {}};
  const std::vector<double> w = {0, 0};
  LevelShares(t, w, layer);
  EXPECT_EQ(layer.slot_share, (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
}

}  // namespace
}  // namespace ubep::balancer
