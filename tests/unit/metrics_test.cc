#include "balancer/core/metrics.h"

#include <cmath>

#include "gtest/gtest.h"

namespace ubep::balancer {
namespace {

Plan TwoNodePlan() {
  // 4 ranks on 2 nodes, 2 slots each; expert 0 on ranks 0 (node 0) and 2 (node 1).
  Plan plan;
  plan.topology = Topology{4, 2, 2, 1};
  plan.num_experts = 7;
  plan.layer_ids = {0};
  plan.layers.push_back({{0, 1, 2, 3, 0, 4, 5, 6}, {0.25, 1, 1, 1, 0.75, 1, 1, 1}});
  return plan;
}

TEST(MetricsTest, RankLoadsUseShares) {
  const Plan plan = TwoNodePlan();
  const std::vector<double> w = {8, 1, 2, 3, 4, 5, 6};
  EXPECT_EQ(RankLoads(plan.topology, plan.layers[0], w), (std::vector<double>{3, 5, 10, 11}));
}

TEST(MetricsTest, BalancednessIsMaxOverMean) {
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{3, 5, 10, 11}), 11.0 / 7.25);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{}), 1.0);
}

TEST(MetricsTest, SummaryReportsMeanAndWorstLayer) {
  Plan plan = TwoNodePlan();
  plan.layers.push_back(plan.layers[0]);
  plan.layer_ids.push_back(1);
  LoadMatrix load(2, 7);
  const double w0[] = {8, 1, 2, 3, 4, 5, 6};
  for (int e = 0; e < 7; ++e) {
    load.at(0, e) = w0[e];
    load.at(1, e) = 1;  // Ranks get 1.25, 2, 1.75, 2: max 2 over mean 1.75.
  }
  const BalanceSummary summary = SummarizeBalance(plan, load);
  ASSERT_EQ(summary.per_layer.size(), 2u);
  EXPECT_DOUBLE_EQ(summary.per_layer[0], 11.0 / 7.25);
  EXPECT_DOUBLE_EQ(summary.per_layer[1], 2 / 1.75);
  EXPECT_DOUBLE_EQ(summary.worst, 11.0 / 7.25);
  EXPECT_DOUBLE_EQ(summary.mean, (11.0 / 7.25 + 2 / 1.75) / 2);
}

// A layer that carried no load is unmeasured (NaN), and left out of the mean and the worst.
TEST(MetricsTest, ALayerWithoutLoadIsUnmeasuredAndLeftOut) {
  EXPECT_TRUE(std::isnan(MeasuredBalancedness(std::vector<double>{0, 0, 0})));
  EXPECT_DOUBLE_EQ(MeasuredBalancedness(std::vector<double>{3, 5, 10, 11}), 11.0 / 7.25);
  Plan plan = TwoNodePlan();
  plan.layers.push_back(plan.layers[0]);
  plan.layer_ids.push_back(1);
  LoadMatrix load(2, 7);  // Layer 1 stays zero.
  const double w0[] = {8, 1, 2, 3, 4, 5, 6};
  for (int e = 0; e < 7; ++e) load.at(0, e) = w0[e];
  const BalanceSummary summary = SummarizeBalance(plan, load);
  ASSERT_EQ(summary.per_layer.size(), 2u);
  EXPECT_TRUE(std::isnan(summary.per_layer[1]));
  EXPECT_EQ(summary.measured, 1);
  EXPECT_DOUBLE_EQ(summary.mean, 11.0 / 7.25);  // Not (11 / 7.25 + 1) / 2.
  EXPECT_DOUBLE_EQ(summary.worst, 11.0 / 7.25);
  const BalanceSummary none = SummarizeLayers({std::nan(""), std::nan("")});
  EXPECT_EQ(none.measured, 0);
  EXPECT_EQ(none.mean, 1.0);
  EXPECT_EQ(none.worst, 1.0);
}

TEST(MetricsTest, CrossNodeShareCountsLocalFirstRouting) {
  const Plan plan = TwoNodePlan();
  LoadMatrix load(1, 7);
  // Only expert 0 has load: node 0 holds share 0.25, node 1 holds 0.75. Each node sources
  // half: node 0 keeps 0.25, node 1 keeps 0.5, so 0.25 of the traffic crosses.
  load.at(0, 0) = 100;
  EXPECT_DOUBLE_EQ(CrossNodeShare(plan, load), 0.25);
  // Only expert 1 (node 0 alone): half of its sources are on node 1.
  load.at(0, 0) = 0;
  load.at(0, 1) = 10;
  EXPECT_DOUBLE_EQ(CrossNodeShare(plan, load), 0.5);
  // Node 1 drained (its ranks excluded): it sources nothing, so nothing crosses to node 0.
  Plan drained = plan;
  drained.excluded_ranks = {2, 3};
  EXPECT_DOUBLE_EQ(CrossNodeShare(drained, load), 0.0);
  // Only rank 3 out: node 0 sources 2 of the 3 members' pairs, node 1 the third.
  drained.excluded_ranks = {3};
  EXPECT_DOUBLE_EQ(CrossNodeShare(drained, load), 1.0 / 3);
}

// At the largest topologies (2^20 ranks, each its own node, one slot each, one expert per
// slot): every expert's load is on one node and every node sources 2^-20 of it, so all but
// that part crosses. An expert x node table of 2^40 doubles failed to allocate here.
TEST(MetricsTest, CrossNodeShareAtTheLargestTopologies) {
  constexpr int kN = 1 << 20;
  Plan plan;
  plan.version = 1;
  plan.topology = {kN, kN, 1, 1};
  plan.num_experts = kN;
  plan.layer_ids = {0};
  LayerPlan layer;
  for (int p = 0; p < kN; ++p) layer.slot_expert.push_back(p);
  layer.slot_share.assign(kN, 1.0);
  plan.layers.push_back(std::move(layer));
  LoadMatrix load(1, kN);
  for (int e = 0; e < kN; ++e) load.at(0, e) = 1;
  EXPECT_DOUBLE_EQ(CrossNodeShare(plan, load), 1.0 - 1.0 / kN);
}

TEST(MetricsTest, ChangedSlotsPerRank) {
  const Plan before = TwoNodePlan();
  Plan after = before;
  after.layers[0].slot_expert[1] = 6;
  after.layers[0].slot_expert[7] = 1;
  std::vector<int64_t> per_rank;
  EXPECT_EQ(ChangedSlots(before, after, &per_rank), 2);
  EXPECT_EQ(per_rank, (std::vector<int64_t>{1, 0, 0, 1}));
}

TEST(MetricsTest, ValidatePlanNamesTheProblem) {
  Plan plan = TwoNodePlan();
  plan.layers[0].slot_share[4] = 0.5;
  EXPECT_EQ(ValidatePlan(plan),
            absl::InvalidArgumentError("layer 0 expert 0 shares sum to 0.75, not 1"));
  plan = TwoNodePlan();
  plan.layers[0].slot_expert[3] = 9;
  EXPECT_EQ(ValidatePlan(plan),
            absl::InvalidArgumentError("layer 0 slot 3 holds expert 9, outside [0, 7)"));
  plan = TwoNodePlan();
  plan.layers[0].slot_expert[3] = 1;
  plan.layers[0].slot_share[1] = 0.5;
  plan.layers[0].slot_share[3] = 0.5;
  EXPECT_EQ(ValidatePlan(plan), absl::InvalidArgumentError(
                                    "layer 0 expert 3 has no replica (or only zero shares)"));
}

// Two entries of one model layer would make the data plane and the load reports pair layers
// by position, whichever of the two they mean.
TEST(MetricsTest, ValidatePlanRejectsARepeatedLayerId) {
  Plan plan = TwoNodePlan();
  plan.layers.push_back(plan.layers[0]);
  plan.layer_ids = {3, 3};
  EXPECT_EQ(ValidatePlan(plan),
            absl::InvalidArgumentError("layers 0 and 1 both have layer id 3"));
  plan.layer_ids = {3, 4};
  EXPECT_EQ(ValidatePlan(plan), absl::OkStatus());
}

// ranks x slots_per_rank is counted in 64 bits: 65536 x 65537 would wrap to 65536 in an int
// and pass for 8 experts, and the policies would then write past their slot arrays.
TEST(MetricsTest, ValidateTopologyCountsSlotsWithoutOverflowAndCapsThem) {
  EXPECT_EQ(ValidateTopology(Topology{65536, 1, 65537, 1}, 8),
            absl::InvalidArgumentError("slots (65536 ranks x 65537 = 4295032832) are more than "
                                       "the 4194304 (2^22) a topology may have"));
  EXPECT_EQ(ValidateTopology(Topology{1024, 1, 4097, 1}, 8),
            absl::InvalidArgumentError("slots (1024 ranks x 4097 = 4195328) are more than "
                                       "the 4194304 (2^22) a topology may have"));
  // The largest group ubepd and the balancer accept (common/shape_limits.h).
  EXPECT_EQ(ValidateTopology(Topology{1024, 1, 4096, 1}, 8), absl::OkStatus());
}

}  // namespace
}  // namespace ubep::balancer
