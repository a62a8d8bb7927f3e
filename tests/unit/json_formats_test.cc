#include "balancer/formats/json_formats.h"

#include "balancer/core/planner.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace ubep::balancer {
namespace {

TEST(SglangLoadTest, SkipsDenseLayersAndKeepsTheirIndices) {
  absl::StatusOr<LoadMatrix> load =
      ParseSglangLoad(R"({"logical_count": [[0,0,0],[1,2,3],[0,0,0],[4,5,6]]})", "f.json");
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->num_layers(), 2);
  EXPECT_EQ(load->num_experts(), 3);
  EXPECT_EQ(load->layer_ids(), (std::vector<int>{1, 3}));
  EXPECT_EQ(load->at(1, 2), 6);
  // And back: dense layers come back as zero rows.
  EXPECT_EQ(SglangLoadToJson(*load),
            R"({"logical_count":[[0.0,0.0,0.0],[1.0,2.0,3.0],[0.0,0.0,0.0],[4.0,5.0,6.0]]})");
}

TEST(SglangLoadTest, ReadsTheBundledTraces) {
  absl::StatusOr<LoadMatrix> load =
      ReadSglangLoadFile(test::TracePath("prefill_in1024.json"));
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->num_layers(), 58);
  EXPECT_EQ(load->num_experts(), 256);
  EXPECT_EQ(load->layer_ids().front(), 3);
}

struct BadLoad {
  std::string text;
  std::string message;
  friend void PrintTo(const BadLoad& b, std::ostream* os) { *os << b.text; }
};

class BadLoadTest : public ::testing::TestWithParam<BadLoad> {};

TEST_P(BadLoadTest, NamesFileFieldAndProblem) {
  absl::StatusOr<LoadMatrix> load = ParseSglangLoad(GetParam().text, "in.json");
  EXPECT_EQ(load.status(), absl::InvalidArgumentError(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, BadLoadTest,
    ::testing::Values(
        BadLoad{R"({"logical_count": [[1,2],[3]]})",
                "in.json: logical_count[1]: has 1 experts, logical_count[0] has 2 (ragged rows)"},
        BadLoad{R"({"logical_count": [[1,2],[3,-4]]})",
                "in.json: logical_count[1][1]: is -4; must be finite and non-negative"},
        BadLoad{R"({"logical_count": [[1,"x"]]})",
                "in.json: logical_count[0][1]: expected a number, got \"x\""},
        BadLoad{R"({"logical_count": [[0,0]]})",
                "in.json: logical_count: every layer sums to zero; no MoE layer to plan"},
        BadLoad{R"({"counts": []})",
                "in.json: logical_count: missing; expected {\"logical_count\": [[...], ...]}"},
        BadLoad{R"({"logical_count": []})",
                "in.json: logical_count: expected a non-empty array of per-layer arrays"},
        BadLoad{R"({"logical_count": [[1, NaN]]})",
                "in.json: (document): malformed JSON at byte 24: [json.exception.parse_error.101] "
                "parse error at line 1, column 24: syntax error while parsing value - invalid "
                "literal; last read: '1, N'"},
        BadLoad{R"({"logical_count": [[1, 1e999]]})",
                "in.json: (document): malformed JSON at byte 28: "
                "[json.exception.out_of_range.406] number overflow parsing '1e999'"}));

TEST(ReadFileTest, MissingFileIsNotFound) {
  EXPECT_EQ(ReadSglangLoadFile("/nonexistent/x.json").status(),
            absl::NotFoundError("/nonexistent/x.json: cannot read: No such file or directory"));
}

TEST(PlanJsonTest, RoundTripsEveryField) {
  const Plan plan = test::SmallPlan();
  absl::StatusOr<Plan> back = ParsePlanJson(PlanToJson(plan), "p.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version, plan.version);
  EXPECT_EQ(back->topology, plan.topology);
  EXPECT_EQ(back->num_experts, plan.num_experts);
  EXPECT_EQ(back->layer_ids, (std::vector<int>{3, 4}));
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(back->layers[l].slot_expert, plan.layers[l].slot_expert);
    EXPECT_EQ(back->layers[l].slot_share, plan.layers[l].slot_share);
  }
}

TEST(PlanJsonTest, AcceptsPlainEplbOutputWithTopologyFromCaller) {
  const std::string eplb = R"({"phy2log": [[0,1,2,0]], "logcnt": [[2,1,1]],
                               "log2phy": [[[0,3],[1,-1],[2,-1]]]})";
  EXPECT_EQ(ParsePlanJson(eplb, "e.json").status(),
            absl::InvalidArgumentError(
                "e.json: topology: missing; pass --ranks (and --nodes) for a plain EPLB plan"));
  absl::StatusOr<Plan> plan = ParsePlanJson(eplb, "e.json", Topology{2, 1, 2, 1});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layers[0].slot_share, (std::vector<double>{0.5, 1, 1, 0.5}));
}

class BadPlanTest : public ::testing::TestWithParam<BadLoad> {};

TEST_P(BadPlanTest, NamesFileFieldAndProblem) {
  absl::StatusOr<Plan> plan = ParsePlanJson(GetParam().text, "p.json");
  EXPECT_EQ(plan.status(), absl::InvalidArgumentError(GetParam().message));
}

constexpr char kTopology[] = R"("topology": {"ranks": 2, "nodes": 1, "slots_per_rank": 2})";

INSTANTIATE_TEST_SUITE_P(
    Inputs, BadPlanTest,
    ::testing::Values(
        BadLoad{R"({"phy2log": [[0,1,2,0]]})",
                "p.json: topology: missing; pass --ranks (and --nodes) for a plain EPLB plan"},
        BadLoad{std::string("{") + kTopology + R"(, "phy2log": [[0,1,2]]})",
                "p.json: phy2log[0]: has 3 slots, topology has 2 ranks x 2 = 4"},
        BadLoad{std::string("{") + kTopology + R"(, "phy2log": [[0,1,2,0],[0,1]]})",
                "p.json: phy2log[1]: has 2 entries, expected 4"},
        BadLoad{std::string("{") + kTopology + R"(, "phy2log": [[0,1,-2,0]]})",
                "p.json: phy2log[0][2]: is -2, outside [0, 1048575]"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "logcnt": [[1,1,1]]})",
                "p.json: logcnt[0][0]: is 1 but phy2log holds 2 replicas of expert 0"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,3,0]], "num_experts": 4})",
                "p.json: plan: layer 0 expert 2 has no replica (or only zero shares)"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "shares": [[[0.5,0.6],[1],[1]]]})",
                "p.json: plan: layer 0 expert 0 shares sum to 1.1, not 1"}));

}  // namespace
}  // namespace ubep::balancer
