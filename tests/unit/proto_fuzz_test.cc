// Structured random mutation of the control plane's inputs from the wire: plans
// (v1::Plan, as a balancer sends them in Prepare) through FromProto, and load reports
// (v1::LoadReport, as daemons send them) through LoadFromProto. Fields, picked at random
// through protobuf reflection, take values at the edges (0, -1, 2^31 - 1, 2^32 - 1, NaN, inf,
// ...), repeated fields grow and shrink. Nothing may crash or read out of bounds (the suite
// runs under AddressSanitizer and UBSan); every refusal is a Status; and a plan FromProto
// accepts is one the data plane can route: BuildPlanTable writes it and ValidatePlanTable
// passes it (but a plan of no layers, which the daemons refuse by their model's layer count).
// Fixed seeds: the same inputs every run.
#include <cstdint>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "balancer/formats/proto_convert.h"
#include "gtest/gtest.h"
#include "kernels/common/plan_table.h"
#include "tests/unit/proto_mutate.h"
#include "tests/unit/test_util.h"

namespace ubep::balancer {
namespace {
using test::Mutate;

// The plan table the daemons would write for `plan`, which FromProto accepted.
void ExpectATable(const Plan& plan) {
  std::vector<kernels::LayerRouting> routing;
  for (const LayerPlan& l : plan.layers) routing.push_back({l.slot_expert, l.slot_share});
  absl::StatusOr<std::vector<std::byte>> table =
      kernels::BuildPlanTable(plan.version, static_cast<uint32_t>(plan.num_experts), routing,
                              static_cast<uint32_t>(plan.topology.num_ranks), plan.excluded_ranks);
  if (plan.layers.empty()) {
    EXPECT_EQ(table.status(), absl::InvalidArgumentError("plan table: no layers or no experts"));
    return;
  }
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE(kernels::ValidatePlanTable(*table).ok());
}

// A report of node `n` of SmallPlan (ranks 2n, 2n + 1: slots 4n to 4n + 3), both layers.
v1::LoadReport ReportOfNode(int n) {
  v1::LoadReport report;
  report.set_reporter(absl::StrCat("node-", n));
  report.set_first_step(10);
  report.set_last_step(20);
  report.set_plan_version(1);
  report.set_num_experts(6);
  for (int layer : {3, 4}) {
    v1::LayerLoad* l = report.add_layers();
    l->set_layer(layer);
    l->set_first_slot(4 * n);
    for (int p = 0; p < 4; ++p) l->add_slot(100 + p);
    l->add_dispatches(10);
    l->add_dispatches(10);
  }
  return report;
}

TEST(ProtoFuzzTest, PlansFromTheWireAreRefusedOrRoutable) {
  constexpr int kIterations = 20000;
  const v1::Plan bases[] = {ToProto(test::SmallPlan()),
                            ToProto(test::SmallPlan(), PlanEncoding::kCompact),
                            ToProto(test::PlanExcludingRank0(3, 1))};
  std::mt19937_64 rng(1);
  int accepted = 0;
  for (int i = 0; i < kIterations; ++i) {
    v1::Plan p = bases[i % 3];
    const int mutations = 1 + rng() % 4;
    for (int k = 0; k < mutations; ++k) Mutate(&p, rng);
    absl::StatusOr<Plan> plan = FromProto(p);
    if (!plan.ok()) continue;
    ++accepted;
    ASSERT_NO_FATAL_FAILURE(ExpectATable(*plan)) << "iteration " << i;
  }
  // Some mutations leave a valid plan (a share moved within its expert, another version):
  // the accepted path is exercised too.
  EXPECT_GT(accepted, kIterations / 50);
}

TEST(ProtoFuzzTest, LoadReportsFromTheWireAreRefusedOrRead) {
  constexpr int kIterations = 20000;
  const Plan plan = test::SmallPlan();
  const v1::LoadReport bases[] = {ReportOfNode(0), ReportOfNode(1)};
  ASSERT_TRUE(LoadFromProto(bases[0], &plan).ok()) << LoadFromProto(bases[0], &plan).status();
  std::mt19937_64 rng(2);
  int accepted = 0;
  for (int i = 0; i < kIterations; ++i) {
    v1::LoadReport report = bases[i % 2];
    const int mutations = 1 + rng() % 4;
    for (int k = 0; k < mutations; ++k) Mutate(&report, rng);
    absl::StatusOr<LoadMatrix> load = LoadFromProto(report, &plan);
    if (load.ok()) {
      ++accepted;
      EXPECT_EQ(load->num_experts(), 6);
    }
    (void)LoadFromProto(report, nullptr);
  }
  EXPECT_GT(accepted, kIterations / 50);
}

}  // namespace
}  // namespace ubep::balancer
