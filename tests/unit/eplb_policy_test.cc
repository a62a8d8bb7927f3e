#include "balancer/core/eplb_policy.h"

#include <algorithm>

#include "balancer/core/metrics.h"
#include "balancer/core/planner.h"
#include "gtest/gtest.h"

namespace ubep::balancer {
namespace {

// The example of DeepSeek's EPLB README: 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes,
// 8 GPUs.
LoadMatrix ReadmeWeights() {
  const double weights[2][12] = {{90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86},
                                 {20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27}};
  LoadMatrix load(2, 12);
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 12; ++e) load.at(l, e) = weights[l][e];
  }
  return load;
}

TEST(EplbPolicyTest, HierarchicalMatchesTheReadmeExampleExactly) {
  absl::StatusOr<Plan> plan = PlanEplb(ReadmeWeights(), Topology{8, 2, 2, 4}, true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layers[0].slot_expert,
            (std::vector<int>{5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1}));
  EXPECT_EQ(plan->layers[1].slot_expert,
            (std::vector<int>{7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1}));
}

TEST(EplbPolicyTest, SharesAreEqualPerReplicaAndLogcntMatches) {
  absl::StatusOr<Plan> plan = PlanEplb(ReadmeWeights(), Topology{8, 2, 2, 4}, true);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(ValidatePlan(*plan).ok());
  const EplbArrays arrays = ToEplbArrays(*plan);
  // Layer 0: experts 1, 4, 5 and 10 have two replicas (slots 13/15, 5/7, 0/2, 8/10).
  EXPECT_EQ(arrays.logcnt[0], (std::vector<int>{1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1}));
  EXPECT_EQ(arrays.log2phy[0][5], (std::vector<int>{0, 2}));
  EXPECT_EQ(arrays.log2phy[0][0], (std::vector<int>{12, -1}));
  EXPECT_DOUBLE_EQ(plan->layers[0].slot_share[0], 0.5);
  EXPECT_DOUBLE_EQ(plan->layers[0].slot_share[12], 1.0);
}

TEST(EplbPolicyTest, FallsBackToGlobalWhenGroupsDoNotDivideByNodes) {
  // 3 groups on 2 nodes: rebalance_experts uses the global policy, as eplb-global does.
  LoadMatrix load(1, 12);
  for (int e = 0; e < 12; ++e) load.at(0, e) = 10 + 7 * e;
  absl::StatusOr<Plan> hierarchical = PlanEplb(load, Topology{8, 2, 2, 3}, true);
  absl::StatusOr<Plan> global = PlanEplb(load, Topology{8, 2, 2, 3}, false);
  ASSERT_TRUE(hierarchical.ok() && global.ok());
  EXPECT_EQ(hierarchical->layers[0].slot_expert, global->layers[0].slot_expert);
}

TEST(EplbPolicyTest, GlobalReplicatesTheHeaviestExpert) {
  LoadMatrix load(1, 4);
  load.at(0, 0) = 100;
  load.at(0, 1) = 10;
  load.at(0, 2) = 10;
  load.at(0, 3) = 10;
  absl::StatusOr<Plan> plan = PlanEplb(load, Topology{2, 1, 3, 1}, false);
  ASSERT_TRUE(plan.ok());
  const EplbArrays arrays = ToEplbArrays(*plan);
  EXPECT_EQ(arrays.logcnt[0], (std::vector<int>{3, 1, 1, 1}));
}

TEST(EplbPolicyTest, RejectsTooFewSlots) {
  LoadMatrix load(1, 12);
  absl::StatusOr<Plan> plan = PlanEplb(load, Topology{4, 1, 2, 1}, false);
  EXPECT_EQ(plan.status(),
            absl::InvalidArgumentError("slots (4 ranks x 2 = 8) are fewer than the 12 logical "
                                       "experts; every expert needs a slot"));
}

// EPLB sums in float32: a layer a float cannot hold is refused, naming it, not converted
// (undefined) and planned at random.
TEST(EplbPolicyTest, RejectsALayerWhoseSumFloat32CannotHold) {
  LoadMatrix load(2, 4);
  for (int e = 0; e < 4; ++e) load.at(0, e) = e + 1;
  load.at(1, 0) = 1e300;
  load.set_layer_ids({3, 7});
  EXPECT_EQ(PlanEplb(load, Topology{2, 1, 2, 1}, /*hierarchical=*/false).status(),
            absl::InvalidArgumentError("eplb: layer 7 sums to 1e+300, more than float32 holds "
                                       "(EPLB sums in float32); scale the counts down"));
}

TEST(EplbPolicyTest, PlannerNamesPolicies) {
  EXPECT_EQ(*ParsePolicy("eplb-global"), Policy::kEplbGlobal);
  EXPECT_EQ(PolicyName(Policy::kUbep), "ubep");
  EXPECT_EQ(ParsePolicy("random").status(),
            absl::InvalidArgumentError(
                "unknown policy 'random'; expected eplb, eplb-global or ubep"));
}

// A layer whose loads are below float's range (EPLB works in float) has no load to EPLB: it
// keeps its placement, rather than have every spare slot go to expert 0.
TEST(EplbPolicyTest, ALayerBelowFloatsRangeKeepsItsPlacement) {
  const Topology t{4, 1, 6, 1};
  LoadMatrix load(1, 16);
  for (int e = 0; e < 16; ++e) load.at(0, e) = 100.0 + e;
  absl::StatusOr<Plan> first = ComputePlan(load, t, nullptr, {.policy = Policy::kEplbGlobal});
  ASSERT_TRUE(first.ok()) << first.status();
  for (int e = 0; e < 16; ++e) load.at(0, e) = 1e-50 * (e + 1);
  absl::StatusOr<Plan> next = ComputePlan(load, t, &*first, {.policy = Policy::kEplbGlobal});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(ChangedSlots(*first, *next, nullptr), 0);
}

// Per node, the experts of each of its ranks (each rank's sorted, the node's ranks sorted):
// what a plan places where, whatever the ranks' and slots' numbering within a node.
std::vector<std::vector<std::vector<int>>> RankSetsByNode(const LayerPlan& layer, const Topology& t) {
  std::vector<std::vector<std::vector<int>>> nodes(t.num_nodes);
  for (int r = 0; r < t.num_ranks; ++r) {
    std::vector<int> experts(layer.slot_expert.begin() + r * t.slots_per_rank,
                             layer.slot_expert.begin() + (r + 1) * t.slots_per_rank);
    std::sort(experts.begin(), experts.end());
    nodes[t.NodeOfRank(r)].push_back(experts);
  }
  for (auto& node : nodes) std::sort(node.begin(), node.end());
  return nodes;
}

// Against the plan in force, an EPLB layer with no load keeps its placement, and so does one
// whose new placement changes more slots of a rank than the budget; a layer within it moves,
// to what EPLB planned afresh, its ranks renumbered within their nodes to keep what they can.
TEST(EplbPolicyTest, LayersWithoutLoadOrOverTheBudgetKeepTheirPlacement) {
  const Topology t{8, 2, 2, 4};
  const LoadMatrix load = ReadmeWeights();
  absl::StatusOr<Plan> first = ComputePlan(load, t, nullptr, {.policy = Policy::kEplb});
  ASSERT_TRUE(first.ok()) << first.status();
  // Layer 0's load swapped with layer 1's; then layer 1 without load.
  LoadMatrix moved(2, 12);
  for (int e = 0; e < 12; ++e) moved.at(0, e) = load.at(1, e);
  absl::StatusOr<Plan> fresh = ComputePlan(moved, t, nullptr, {.policy = Policy::kEplb});
  ASSERT_TRUE(fresh.ok()) << fresh.status();

  absl::StatusOr<Plan> unlimited = ComputePlan(moved, t, &*first, {.policy = Policy::kEplb});
  ASSERT_TRUE(unlimited.ok()) << unlimited.status();
  EXPECT_EQ(RankSetsByNode(unlimited->layers[0], t), RankSetsByNode(fresh->layers[0], t));
  EXPECT_EQ(unlimited->layers[1], first->layers[1]);  // No load: kept.
  EXPECT_TRUE(ValidatePlan(*unlimited).ok());
  std::vector<int64_t> per_rank;
  ChangedSlots(*first, *unlimited, &per_rank);
  const int64_t most = *std::max_element(per_rank.begin(), per_rank.end());
  ASSERT_GT(most, 0);
  // Renumbered within its nodes, it moves fewer slots than EPLB's own numbering would.
  Plan unaligned = *first;
  unaligned.layers[0] = fresh->layers[0];
  EXPECT_LT(ChangedSlots(*first, *unlimited, nullptr), ChangedSlots(*first, unaligned, nullptr));

  absl::StatusOr<Plan> within = ComputePlan(
      moved, t, &*first, {.policy = Policy::kEplb, .migration_budget = static_cast<int>(most)});
  ASSERT_TRUE(within.ok()) << within.status();
  EXPECT_EQ(within->version, 2u);
  EXPECT_EQ(within->layers, unlimited->layers);  // Moved.

  absl::StatusOr<Plan> over = ComputePlan(
      moved, t, &*first, {.policy = Policy::kEplb, .migration_budget = static_cast<int>(most) - 1});
  ASSERT_TRUE(over.ok()) << over.status();
  EXPECT_EQ(ChangedSlots(*first, *over, nullptr), 0);
}

// EPLB numbers ranks and slots in its packing order: loads [4, 3, 2, 1] and [3, 4, 1, 2] pack
// the same pairs of experts ({0, 3} and {1, 2}) on the two ranks in another order. Against the
// plan in force the second plan is renumbered to keep them in place, not counted as four
// moved slots (a weight copy each) and made for that, within the budget of 2. So too for the
// hierarchical policy over 2 nodes of one rank and 1 group, which plans as the global one
// (groups do not divide by nodes), and so renumbers across its nodes.
TEST(EplbPolicyTest, APlanThatOnlyRenumbersRanksMovesNothing) {
  for (const auto& [policy, t] : {std::pair{Policy::kEplbGlobal, Topology{2, 1, 2, 1}},
                                  std::pair{Policy::kEplb, Topology{2, 2, 2, 1}}}) {
    SCOPED_TRACE(PolicyName(policy));
    LoadMatrix load(1, 4);
    for (int e = 0; e < 4; ++e) load.at(0, e) = 4 - e;
    absl::StatusOr<Plan> first = ComputePlan(load, t, nullptr, {.policy = policy});
    ASSERT_TRUE(first.ok()) << first.status();
    const std::vector<double> drifted = {3, 4, 1, 2};
    for (int e = 0; e < 4; ++e) load.at(0, e) = drifted[e];
    absl::StatusOr<Plan> fresh = ComputePlan(load, t, nullptr, {.policy = policy});
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    ASSERT_EQ(ChangedSlots(*first, *fresh, nullptr), 4);  // Unaligned: every slot differs.
    absl::StatusOr<Plan> next =
        ComputePlan(load, t, &*first, {.policy = policy, .migration_budget = 2});
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(ChangedSlots(*first, *next, nullptr), 0);
    EXPECT_EQ(next->layers[0].slot_expert, first->layers[0].slot_expert);
  }
}

}  // namespace
}  // namespace ubep::balancer
