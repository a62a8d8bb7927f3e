#include "balancer/formats/proto_convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "balancer/core/planner.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace ubep::balancer {
namespace {

// SmallPlan with its fields away from their defaults: version 7, two expert groups.
Plan EveryFieldSet() {
  Plan plan = test::SmallPlan();
  plan.version = 7;
  plan.topology.num_groups = 2;
  return plan;
}

TEST(ProtoConvertTest, PlanRoundTrips) {
  const Plan plan = EveryFieldSet();
  const v1::Plan proto = ToProto(plan);
  EXPECT_EQ(proto.topology().ranks_size(), 4);
  EXPECT_EQ(proto.topology().ranks(3).node(), 1u);
  absl::StatusOr<Plan> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);
  // And a plan that excludes a rank.
  const Plan excluding = test::PlanExcludingRank0(/*version=*/4, /*layer_id=*/5);
  back = FromProto(ToProto(excluding));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->excluded_ranks, (std::vector<int>{0}));
  EXPECT_TRUE(*back == excluding);
}

TEST(ProtoConvertTest, CompactPlanRoundTripsAndIsChecked) {
  const Plan plan = EveryFieldSet();
  v1::Plan proto = ToProto(plan, PlanEncoding::kCompact);
  EXPECT_EQ(proto.layers(0).experts_size(), 0);
  EXPECT_EQ(proto.layers(0).slot_share_size(), 8);
  absl::StatusOr<Plan> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);
  proto.mutable_layers(1)->mutable_slot_share()->RemoveLast();
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError("plan.layers[1]: 8 slots, 7 shares and 0 experts; the "
                                       "compact form needs 8, 8 and 0"));
  proto = ToProto(plan, PlanEncoding::kCompact);
  proto.mutable_layers(0)->set_slot_share(0, 0.25);  // The expert's shares no longer sum to 1.
  EXPECT_EQ(FromProto(proto).status(), absl::InvalidArgumentError(
                                         "plan: layer 0 expert 5 shares sum to 0.660256, not 1"));
}

// Recovery compares a daemon's pending plan (decoded from the Prepare) with the plan the
// balancer holds (its own, or decoded from another daemon's state) by fingerprint: it must
// survive either encoding exactly, and tell apart plans that differ in any field.
TEST(ProtoConvertTest, APlansFingerprintSurvivesEitherEncodingAndTellsPlansApart) {
  LoadMatrix load(3, 16);
  for (int l = 0; l < 3; ++l) {
    for (int e = 0; e < 16; ++e) load.at(l, e) = 100.0 / (1 + (e * 7 + l * 3) % 11) + 0.3 * e;
  }
  load.set_layer_ids({2, 5, 9});
  absl::StatusOr<Plan> plan = ComputePlan(load, Topology{4, 2, 6, 1}, nullptr, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  plan->version = 7;
  const uint64_t fingerprint = PlanFingerprint(*plan);
  EXPECT_NE(fingerprint, 0u);
  for (const PlanEncoding encoding : {PlanEncoding::kCompact, PlanEncoding::kFull}) {
    absl::StatusOr<Plan> back = FromProto(ToProto(*plan, encoding));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(PlanFingerprint(*back), fingerprint);
    absl::StatusOr<Plan> again = FromProto(ToProto(*back, PlanEncoding::kCompact));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(PlanFingerprint(*again), fingerprint);
  }
  Plan other = *plan;
  other.layers[1].slot_share[0] = std::nextafter(other.layers[1].slot_share[0], 2.0);
  EXPECT_NE(PlanFingerprint(other), fingerprint);
  other = *plan;
  std::swap(other.layers[2].slot_expert[0], other.layers[2].slot_expert[23]);
  EXPECT_NE(PlanFingerprint(other), fingerprint);
  other = *plan;
  other.version = 8;
  EXPECT_NE(PlanFingerprint(other), fingerprint);
}

TEST(ProtoConvertTest, RejectsInconsistentPlans) {
  v1::Plan proto = ToProto(test::SmallPlan());
  proto.mutable_layers(1)->mutable_experts(0)->mutable_replicas(0)->set_slot(99);
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError(
                "plan.layers[1].experts[0]: replica slot 99 does not hold expert 0"));
  proto = ToProto(test::SmallPlan());
  proto.mutable_topology()->mutable_ranks(2)->set_node(0);
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError("topology.ranks: rank 2 is on node 0; ranks must be "
                                       "numbered node-major (rank r on node r / 2)"));
  proto = ToProto(test::SmallPlan());
  proto.clear_topology();
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError("topology: 0 ranks on 0 nodes (missing?)"));
  // Layer ids as the JSON form reads them: one past 2^31 would become negative.
  proto = ToProto(test::SmallPlan());
  proto.set_layer_ids(1, 2147483648u);
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError("plan: layer_ids[1] 2147483648 is outside [0, 2^20]"));
}

// In the full form a replica listed twice for one slot would have the last listing win.
TEST(ProtoConvertTest, RejectsAReplicaListedTwice) {
  v1::Plan proto = ToProto(test::SmallPlan());
  v1::ExpertPlacement* expert = proto.mutable_layers(1)->mutable_experts(0);
  const uint32_t slot = expert->replicas(0).slot();
  *expert->add_replicas() = expert->replicas(0);
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError(absl::StrCat("plan.layers[1].experts[0]: replica slot ",
                                                    slot, " is listed twice")));
}

TEST(ProtoConvertTest, RejectsARepeatedLayerId) {
  v1::Plan proto = ToProto(test::SmallPlan());
  proto.set_layer_ids(1, proto.layer_ids(0));
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError("plan: layers 0 and 1 both have layer id 3"));
}

// Each count is within 2^20, their product is not: refused before anything is sized by it.
TEST(ProtoConvertTest, RejectsATopologyOfTooManySlots) {
  v1::Plan proto;
  proto.mutable_topology()->set_num_ranks(65536);
  proto.mutable_topology()->set_num_nodes(1);
  proto.mutable_topology()->set_slots_per_rank(65537);
  proto.set_num_experts(8);
  EXPECT_EQ(FromProto(proto).status(),
            absl::InvalidArgumentError("plan.topology: slots (65536 ranks x 65537 = 4295032832) "
                                       "are more than the 4194304 (2^22) a topology may have"));
}

TEST(ProtoConvertTest, FoldsSlotCountsOntoLogicalExperts) {
  const Plan plan = test::SmallPlan();
  v1::LoadReport report;
  report.set_reporter("node-0");
  report.set_num_experts(6);
  v1::LayerLoad* layer = report.add_layers();
  layer->set_layer(4);
  for (int p = 0; p < 8; ++p) layer->add_slot(10 + p);
  absl::StatusOr<LoadMatrix> load = LoadFromProto(report, &plan);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->layer_ids(), (std::vector<int>{4}));
  std::vector<double> expected(6, 0.0);
  for (int p = 0; p < 8; ++p) expected[plan.layers[1].slot_expert[p]] += 10 + p;
  for (int e = 0; e < 6; ++e) EXPECT_EQ(load->at(0, e), expected[e]);

  layer->set_layer(7);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError(
                "load report from 'node-0' layers[0]: layer 7 is not in plan v1"));
  layer->add_logical(1);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError(
                "load report from 'node-0' layers[0]: has both logical and slot counts"));
}

// A report's shape is bounded, and matched against the plan, before anything is allocated
// from it: a few bytes naming 2^31 - 1 experts are refused, not a matrix of gigabytes made.
TEST(ProtoConvertTest, RefusesAReportOfTooManyExpertsOrOtherThanThePlansBeforeAllocating) {
  const Plan plan = test::SmallPlan();
  v1::LoadReport report;
  report.set_reporter("node-0");
  report.set_num_experts(2147483647);
  for (int l = 0; l < 61; ++l) report.add_layers()->set_layer(l);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-0': 61 layers x 2147483647 "
                                       "experts, over the limits of 4096 x 1024"));
  EXPECT_EQ(LoadFromProto(report, nullptr).status(),
            absl::InvalidArgumentError("load report from 'node-0': 61 layers x 2147483647 "
                                       "experts, over the limits of 4096 x 1024"));
  report.set_num_experts(4294967295);  // Not read as -1.
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-0': 61 layers x 4294967295 "
                                       "experts, over the limits of 4096 x 1024"));
  report.set_num_experts(7);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-0': 7 experts; plan v1 has 6"));
}

// A report of node 1 of SmallPlan, which hosts ranks 2 and 3 (slots [4, 8)), for layer 3
// with these slot counts.
v1::LoadReport NodeOneReport(std::initializer_list<uint64_t> counts) {
  v1::LoadReport report;
  report.set_reporter("node-1");
  report.set_num_experts(6);
  v1::LayerLoad* layer = report.add_layers();
  layer->set_layer(3);
  layer->set_first_slot(4);
  for (uint64_t count : counts) layer->add_slot(count);
  return report;
}

TEST(ProtoConvertTest, FoldsANodesOwnSlotRange) {
  const Plan plan = test::SmallPlan();
  v1::LoadReport report = NodeOneReport({104, 105, 106, 107});
  v1::LayerLoad* layer = report.mutable_layers(0);
  absl::StatusOr<LoadMatrix> load = LoadFromProto(report, &plan);
  ASSERT_TRUE(load.ok()) << load.status();
  std::vector<double> expected(6, 0.0);
  for (int p = 4; p < 8; ++p) expected[plan.layers[0].slot_expert[p]] += 100 + p;
  for (int e = 0; e < 6; ++e) EXPECT_EQ(load->at(0, e), expected[e]);
  layer->add_slot(1);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-1' layers[0]: slot counts for "
                                       "slots [4, 9), plan has 8 slots"));
}

// Rank 2 was read one dispatch further than rank 3: its counts are scaled to the mean (3),
// so that both weigh per dispatch. SmallPlan has 2 slots per rank.
TEST(ProtoConvertTest, ScalesEachRanksCountsToTheMeanDispatches) {
  const Plan plan = test::SmallPlan();
  v1::LoadReport report = NodeOneReport({40, 80, 20, 60});  // Slots 4, 5 | 6, 7.
  v1::LayerLoad* layer = report.mutable_layers(0);
  layer->add_dispatches(4);  // Rank 2: 10 and 20 pairs per dispatch.
  layer->add_dispatches(2);  // Rank 3: 10 and 30.
  EXPECT_EQ(MeanDispatches(report), 3.0);
  absl::StatusOr<LoadMatrix> load = LoadFromProto(report, &plan);
  ASSERT_TRUE(load.ok()) << load.status();
  std::vector<double> expected(6, 0.0);
  const double per_dispatch[] = {10, 20, 10, 30};
  for (int p = 4; p < 8; ++p) expected[plan.layers[0].slot_expert[p]] += 3 * per_dispatch[p - 4];
  for (int e = 0; e < 6; ++e) EXPECT_EQ(load->at(0, e), expected[e]) << "expert " << e;

  layer->set_dispatches(1, 0);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError(
                "load report from 'node-1' layers[0]: slot 6 counts 20 pairs over 0 dispatches"));
  layer->add_dispatches(1);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-1' layers[0]: 4 slot counts are "
                                       "not whole ranks of 3 dispatch counts"));
  // Whole, but not ranks: one dispatch count over all four slots, or two from slot 3.
  layer->clear_dispatches();
  layer->add_dispatches(2);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-1' layers[0]: dispatch counts for "
                                       "1 rank over slots [4, 8), which are not whole ranks of "
                                       "plan v1 (2 slots each)"));
  layer->add_dispatches(2);
  layer->set_first_slot(3);
  EXPECT_EQ(LoadFromProto(report, &plan).status(),
            absl::InvalidArgumentError("load report from 'node-1' layers[0]: dispatch counts for "
                                       "2 ranks over slots [3, 7), which are not whole ranks of "
                                       "plan v1 (2 slots each)"));
  layer->set_first_slot(4);
  layer->clear_dispatches();
  EXPECT_EQ(MeanDispatches(report), std::nullopt);
}

}  // namespace
}  // namespace ubep::balancer
