#include "balancer/formats/json_formats.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "balancer/core/planner.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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

// SGLang indexes its expert location by model layer: a plan of MoE layers 1 and 3 exports
// four rows, the dense layers 0 and 2 with the trivial placement (slot p, expert p % E).
TEST(SglangPlanTest, ExportsOneRowPerModelLayerUpToTheLastMoeLayer) {
  Plan plan;
  plan.version = 2;
  plan.topology = {2, 1, 2, 1};
  plan.num_experts = 3;
  plan.layer_ids = {1, 3};
  plan.layers = {LayerPlan{{2, 0, 1, 2}, {0.5, 1, 1, 0.5}}, LayerPlan{{1, 1, 0, 2}, {0.5, 1, 0.5, 1}}};
  EXPECT_EQ(PlanToSglangJson(plan),
            R"({"physical_to_logical_map":[[0,1,2,0],[2,0,1,2],[0,1,2,0],[1,1,0,2]]})");
}

// SGLang's loader also takes one [layers][experts] count per dump, [dumps][layers][experts],
// and sums over the dumps: so do these.
TEST(SglangLoadTest, CountsOfSeveralDumpsAreSummed) {
  absl::StatusOr<LoadMatrix> load = ParseSglangLoad(
      R"({"logical_count": [[[0,0,0],[1,2,3]], [[0,0,0],[4,0,6]]]})", "f.json");
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->layer_ids(), (std::vector<int>{1}));
  EXPECT_EQ(SglangLoadToJson(*load), R"({"logical_count":[[0.0,0.0,0.0],[5.0,2.0,9.0]]})");
  EXPECT_EQ(ParseSglangLoad(R"({"logical_count": [[[1,2]], [[1,2],[3,4]]]})", "f.json").status(),
            absl::InvalidArgumentError(
                "f.json: logical_count[1]: expected 1 per-layer arrays, as logical_count[0]"));
  EXPECT_EQ(ParseSglangLoad(R"({"logical_count": [[[1,2]], [[1,-2]]]})", "f.json").status(),
            absl::InvalidArgumentError(
                "f.json: logical_count[1][0][1]: is -2; must be finite and non-negative"));
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
        // An array where a count belongs is named by its kind, not written out (a deep one
        // would overflow a recursive dump's stack).
        BadLoad{absl::StrCat(R"({"logical_count": [[1,)", std::string(100000, '['),
                             std::string(100000, ']'), "]]}"),
                "in.json: logical_count[0][1]: expected a number, got an array"},
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
                "[json.exception.out_of_range.406] number overflow parsing '1e999'"},
        // Each count is finite, their sum is not: balancedness would be 0, shares NaN.
        BadLoad{R"({"logical_count": [[1, 2], [1e308, 1e308]]})",
                "in.json: logical_count[1]: sums to inf; a layer's counts must have a finite "
                "sum"},
        // Dumps (one count array per dump) summed: an expert whose counts overflow over them
        // is named, not shown as the null its inf would print as.
        BadLoad{R"({"logical_count": [[[1e308, 1]], [[1e308, 1]]]})",
                "in.json: logical_count[0..1][0][0]: sums to inf over the dumps; the counts "
                "must have a finite sum"},
        // Given twice: which is meant? (The parse would keep the last without a word.)
        BadLoad{R"({"logical_count": [[90,1,1,1]], "logical_count": [[1,1,1,90]]})",
                "in.json: logical_count: given twice in one object (which one is meant?)"}));

// A load is held to what a plan file holds (2^20 experts; layer ids, its rows' indices, up to
// 2^20): a plan made from a larger one could not be read back.
TEST(JsonFormatsTest, ALoadLargerThanAPlanHoldsIsRefused) {
  std::string wide = R"({"logical_count": [[)";
  for (int e = 0; e <= (1 << 20); ++e) wide += e == 0 ? "1" : ",0";
  wide += "]]}";
  EXPECT_EQ(ParseSglangLoad(wide, "in.json").status(),
            absl::InvalidArgumentError("in.json: logical_count[0]: has 1048577 experts, more than "
                                       "the 2^20 (1048576) a plan holds"));
  std::string deep = R"({"logical_count": [)";
  for (int l = 0; l <= (1 << 20) + 1; ++l) deep += l == 0 ? "[1]" : ",[0]";
  deep += "]}";
  EXPECT_EQ(ParseSglangLoad(deep, "in.json").status(),
            absl::InvalidArgumentError("in.json: logical_count: has 1048578 layers; a plan's layer "
                                       "ids go up to 2^20 (1048576)"));
  // 2^20 + 1 rows (layer ids 0 .. 2^20) and 2^20 experts are still taken.
  deep = R"({"logical_count": [)";
  for (int l = 0; l <= (1 << 20); ++l) deep += l == 0 ? "[1]" : ",[1]";
  deep += "]}";
  absl::StatusOr<LoadMatrix> load = ParseSglangLoad(deep, "in.json");
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->layer_ids().back(), 1 << 20);
}

TEST(ReadFileTest, MissingFileIsNotFound) {
  EXPECT_EQ(ReadSglangLoadFile("/nonexistent/x.json").status(),
            absl::NotFoundError("/nonexistent/x.json: cannot read: No such file or directory"));
}

// What is not a regular file is refused naming what it is, not parsed as empty (a directory)
// nor waited on (a FIFO) nor read until memory ends (a device).
TEST(ReadFileTest, WhatIsNotARegularFileIsRefusedNamingWhatItIs) {
  char dir_template[] = "/tmp/ubep-read-test-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  EXPECT_EQ(ReadTextFile(dir).status(),
            absl::InvalidArgumentError(dir + ": not a regular file (a directory)"));
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(ReadPlanFile(fifo).status(),
            absl::InvalidArgumentError(fifo + ": not a regular file (a device, FIFO or socket)"));
  EXPECT_EQ(ReadSglangLoadFile("/dev/zero").status(),
            absl::InvalidArgumentError("/dev/zero: not a regular file (a device, FIFO or socket)"));
  // A regular file is read to its end, whatever its size said (/proc's say 0).
  const absl::StatusOr<std::string> status = ReadTextFile("/proc/self/status");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(absl::StrContains(*status, "Name:")) << *status;
  std::filesystem::remove_all(dir);
}

// A file written through a temporary file of the writer's own and a rename: a directory at
// PATH is refused before anything is written (a usage error, not an internal one), a file
// the user keeps at PATH.tmp is not touched, and nothing but the file is left behind.
TEST(WriteTextFileTest, WritesWholeThroughItsOwnTemporaryFileAndRefusesADirectory) {
  char dir_template[] = "/tmp/ubep-write-test-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string path = dir + "/plan.json";
  std::filesystem::create_directories(path + "/inside");
  EXPECT_EQ(WriteTextFile(path, "{}\n"),
            absl::InvalidArgumentError(path + ": is a directory, not a file"));
  const std::string other = dir + "/other.json";
  std::ofstream(other + ".tmp") << "the user's";
  ASSERT_TRUE(WriteTextFile(other, "{}\n").ok());
  EXPECT_EQ(*ReadTextFile(other), "{}\n");
  EXPECT_EQ(*ReadTextFile(other + ".tmp"), "the user's");
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"other.json", "other.json.tmp", "plan.json"}));
  EXPECT_EQ(WriteTextFile(dir + "/none/x.json", "{}\n").code(), absl::StatusCode::kPermissionDenied);
  std::filesystem::remove_all(dir);
}

// A ready file: one a run before left (a regular file) is cleared; one published is written
// whole and removed by Withdraw and by the destructor; one never published is not removed (the
// path is another run's, or nobody's); anything but a regular file at the path is refused,
// named, and left alone.
TEST(ReadyFileTest, ClearsAStaleOnePublishesAndWithdrawsItsOwn) {
  char dir_template[] = "/tmp/ubep-ready-test-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string path = dir + "/ready.json";
  ASSERT_TRUE(WriteTextFile(path, "{\"pid\": 1}\n").ok());
  {
    ReadyFile ready(path);
    ASSERT_TRUE(ready.ClearStale(ReadyFile::Holder::kThisRun).ok());
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_TRUE(ready.ClearStale(ReadyFile::Holder::kThisRun).ok());  // Nothing there: nothing to do.
    ASSERT_TRUE(ready.Publish("{\"port\": 7}\n").ok());
    EXPECT_EQ(*ReadTextFile(path), "{\"port\": 7}\n");
    ready.Withdraw();
    EXPECT_FALSE(std::filesystem::exists(path));
    ASSERT_TRUE(ready.Publish("{\"port\": 8}\n").ok());
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  {
    ASSERT_TRUE(WriteTextFile(path, "another run's\n").ok());
    ReadyFile unpublished(path);
    unpublished.Withdraw();
  }
  EXPECT_EQ(*ReadTextFile(path), "another run's\n");
  std::filesystem::remove(path);
  std::filesystem::create_directories(path + "/inside");
  EXPECT_EQ(ReadyFile(path).ClearStale(ReadyFile::Holder::kThisRun),
            absl::FailedPreconditionError(
                path + " exists and is not a regular file (a directory); not replacing it: is "
                       "the ready file's path right?"));
  EXPECT_TRUE(std::filesystem::exists(path + "/inside"));
  const absl::Status unwritable = ReadyFile(dir + "/no/such/dir/ready.json").Publish("{}\n");
  EXPECT_EQ(unwritable, absl::PermissionDeniedError(
                            dir + "/no/such/dir/ready.json: cannot write: No such file or directory"));
  // Said before the server serves: by ClearStale, which leaves nothing beside a path it can
  // write.
  EXPECT_EQ(ReadyFile(dir + "/no/such/dir/ready.json").ClearStale(ReadyFile::Holder::kThisRun),
            absl::PermissionDeniedError(
                dir + "/no/such/dir/ready.json: cannot write: No such file or directory"));
  EXPECT_TRUE(ReadyFile(dir + "/fresh.json").ClearStale(ReadyFile::Holder::kThisRun).ok());
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_FALSE(absl::StrContains(entry.path().filename().string(), "fresh.json"))
        << entry.path();
  }
  EXPECT_TRUE(ReadyFile().ClearStale(ReadyFile::Holder::kThisRun).ok());
  EXPECT_TRUE(ReadyFile().Publish("{}\n").ok());
  std::filesystem::remove_all(dir);
}

// Where no lock says whose the path is (the balancer): a ready file naming a running process
// (the parent of this test) is left to it, and refused naming it; one naming a process that
// has exited, or none, is stale. A file another process wrote over this one's is not removed
// by this one's Withdraw.
TEST(ReadyFileTest, ALiveProcesssReadyFileIsLeftAndAnotherOnesIsNotWithdrawn) {
  char dir_template[] = "/tmp/ubep-ready-test-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string path = dir + "/ready.json";
  const std::string live = absl::StrCat("{\"pid\": ", getppid(), ", \"port\": 1}\n");
  ASSERT_TRUE(WriteTextFile(path, live).ok());
  EXPECT_EQ(ReadyFile(path).ClearStale(ReadyFile::Holder::kWhoeverItNames),
            absl::FailedPreconditionError(absl::StrCat(
                path, " is the ready file of process ", getppid(),
                ", which is running: is another server using this path?")));
  EXPECT_EQ(*ReadTextFile(path), live);
  // A child that has exited and been reaped: its pid names no process.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  ASSERT_TRUE(WriteTextFile(path, absl::StrCat("{\"pid\": ", child, "}\n")).ok());
  EXPECT_TRUE(ReadyFile(path).ClearStale(ReadyFile::Holder::kWhoeverItNames).ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  ASSERT_TRUE(WriteTextFile(path, "not JSON\n").ok());
  EXPECT_TRUE(ReadyFile(path).ClearStale(ReadyFile::Holder::kWhoeverItNames).ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  {
    ReadyFile mine(path);
    ASSERT_TRUE(mine.Publish("{\"port\": 7}\n").ok());
    ASSERT_TRUE(WriteTextFile(path, "{\"port\": 8}\n").ok());  // Another server's, since.
  }
  EXPECT_EQ(*ReadTextFile(path), "{\"port\": 8}\n");
  std::filesystem::remove_all(dir);
}

// Every field, each away from what a reader would assume without it: version 7, two expert
// groups, model layers 3 and 4 (excluded ranks: below).
TEST(PlanJsonTest, RoundTripsEveryField) {
  Plan plan = test::SmallPlan();
  plan.version = 7;
  plan.topology.num_groups = 2;
  absl::StatusOr<Plan> back = ParsePlanJson(PlanToJson(plan), "p.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->layer_ids, (std::vector<int>{3, 4}));
  EXPECT_EQ(back->topology.num_groups, 2);
  EXPECT_TRUE(*back == plan);
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

// shares[l][e] is aligned with the file's own log2phy[l][e], whatever order that lists the
// replicas in (EPLB lists them in creation order, not slot order).
TEST(PlanJsonTest, SharesFollowTheFilesOwnLog2phy) {
  const std::string text = R"({"topology": {"ranks": 2, "nodes": 1, "slots_per_rank": 2},
                               "phy2log": [[0,1,2,0]], "log2phy": [[[3,0],[1,-1],[2,-1]]],
                               "shares": [[[0.8,0.2],[1],[1]]]})";
  absl::StatusOr<Plan> plan = ParsePlanJson(text, "p.json");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layers[0].slot_share, (std::vector<double>{0.2, 1, 1, 0.8}));
  // Without log2phy, shares follow slot order (the order PlanToJson writes).
  absl::StatusOr<Plan> slot_order = ParsePlanJson(
      R"({"topology": {"ranks": 2, "nodes": 1, "slots_per_rank": 2},
          "phy2log": [[0,1,2,0]], "shares": [[[0.8,0.2],[1],[1]]]})",
      "p.json");
  ASSERT_TRUE(slot_order.ok()) << slot_order.status();
  EXPECT_EQ(slot_order->layers[0].slot_share, (std::vector<double>{0.8, 1, 1, 0.2}));
}

// A plan that excludes a node's ranks keeps them excluded through the file.
TEST(PlanJsonTest, RoundTripsExcludedRanks) {
  Plan plan = test::PlanExcludingRank0(/*version=*/4, /*layer_id=*/5);
  const std::string text = PlanToJson(plan);
  EXPECT_EQ(nlohmann::json::parse(text)["excluded_ranks"], nlohmann::json::array({0}));
  absl::StatusOr<Plan> back = ParsePlanJson(text, "p.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
  // Written only when there are some (a plain EPLB reader never sees the field).
  plan.excluded_ranks.clear();
  plan.layers[0].slot_share = {0.5, 0.5, 0.5, 0.5};
  EXPECT_FALSE(nlohmann::json::parse(PlanToJson(plan)).contains("excluded_ranks"));
  back = ParsePlanJson(PlanToJson(plan), "p.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, plan);
}

// The topology a caller gives must agree with the file's in every field it gives; 0 leaves
// a field to the file (nodes, groups, slots per rank).
TEST(PlanJsonTest, TopologyFromTheCallerMustAgreeOnNodesAndGroupsToo) {
  const std::string text = R"({"topology": {"ranks": 2, "nodes": 1, "slots_per_rank": 2,
                                            "groups": 1}, "phy2log": [[0,1,2,0]]})";
  EXPECT_EQ(ParsePlanJson(text, "p.json", Topology{2, 2, 0, 0}).status(),
            absl::InvalidArgumentError("p.json: topology.nodes: is 1, but 2 is expected"));
  EXPECT_EQ(ParsePlanJson(text, "p.json", Topology{2, 1, 2, 3}).status(),
            absl::InvalidArgumentError("p.json: topology.groups: is 1, but 3 is expected"));
  EXPECT_EQ(ParsePlanJson(text, "p.json", Topology{3, 0, 0, 0}).status(),
            absl::InvalidArgumentError("p.json: topology.ranks: is 2, but 3 is expected"));
  EXPECT_EQ(ParsePlanJson(text, "p.json", Topology{2, 1, 4, 0}).status(),
            absl::InvalidArgumentError(
                "p.json: topology.slots_per_rank: is 2, but 4 is expected"));
  for (const Topology& agrees : {Topology{2, 0, 0, 0}, Topology{2, 1, 2, 1}}) {
    absl::StatusOr<Plan> plan = ParsePlanJson(text, "p.json", agrees);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->topology, (Topology{2, 1, 2, 1}));
  }
  // Without a topology in the file, fields left at 0 take their defaults.
  absl::StatusOr<Plan> plain =
      ParsePlanJson(R"({"phy2log": [[0,1,2,0]]})", "p.json", Topology{2, 0, 0, 0});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->topology, (Topology{2, 1, 2, 1}));
}

// One rank of 65536 slots, expert 0 in 32769 of them: a valid plan whose padded EPLB arrays
// (32768 experts x 32769 replicas) would take 12 GiB. Reading it takes memory in proportion
// to the file.
TEST(PlanJsonTest, AnExpertWithManyReplicasIsReadWithoutPaddedArrays) {
  std::string text = R"({"topology": {"ranks": 1, "nodes": 1, "slots_per_rank": 65536},
                         "phy2log": [[)";
  for (int p = 0; p < 65536; ++p) {
    absl::StrAppend(&text, p == 0 ? "" : ",", p < 32769 ? 0 : p - 32768);
  }
  text += "]]}";
  absl::StatusOr<Plan> plan = ParsePlanJson(text, "p.json");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_experts, 32768);
  EXPECT_EQ(plan->layers[0].slot_share[0], 1.0 / 32769);
  EXPECT_EQ(plan->layers[0].slot_share[65535], 1.0);
}

class BadPlanTest : public ::testing::TestWithParam<BadLoad> {};

TEST_P(BadPlanTest, NamesFileFieldAndProblem) {
  absl::StatusOr<Plan> plan = ParsePlanJson(GetParam().text, "p.json");
  EXPECT_EQ(plan.status(), absl::InvalidArgumentError(GetParam().message));
}

constexpr char kTopology[] = R"("topology": {"ranks": 2, "nodes": 1, "slots_per_rank": 2})";
constexpr char kOneSlot[] = R"("topology": {"ranks": 1, "nodes": 1, "slots_per_rank": 1})";

// About 130 KB naming expert 1048575 in one of 65536 slots: refused before anything is sized
// by the expert count (EPLB's padded arrays would be 2^20 x 65535 entries, about 800 GB).
std::string TooManyExpertsForTheSlots() {
  std::string text = R"({"topology": {"ranks": 1, "nodes": 1, "slots_per_rank": 65536},
                         "phy2log": [[)";
  for (int p = 0; p < 65535; ++p) text += "0,";
  return text + "1048575]]}";
}

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
                "p.json: phy2log[0]: no slot holds expert 2 (of 4)"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "shares": [[[0.5,0.6],[1],[1]]]})",
                "p.json: plan: layer 0 expert 0 shares sum to 1.1, not 1"},
        BadLoad{TooManyExpertsForTheSlots(),
                "p.json: topology: slots (1 ranks x 65536 = 65536) are fewer than the 1048576 "
                "logical experts; every expert needs a slot"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0],[0,1,2,0]], "layer_ids": [3,3]})",
                "p.json: plan: layers 0 and 1 both have layer id 3"},
        // Padding past an expert's replicas must be 0.
        BadLoad{std::string("{") + kOneSlot + R"(, "phy2log": [[0]], "shares": [[[1, 0.7, "x"]]]})",
                "p.json: shares[0][0][1]: is padding (no replica there) and must be 0, got 0.7"},
        BadLoad{std::string("{") + kOneSlot + R"(, "phy2log": [[0]], "shares": [[[1, 0, "x"]]]})",
                "p.json: shares[0][0][2]: expected a number, got \"x\""},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "log2phy": [[[3,0],[1,-1],[2,-1]]],
                    "shares": [[[0.8,0.2],[1,0.5],[1]]]})",
                "p.json: shares[0][1][1]: is padding (no replica there) and must be 0, got 0.5"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "log2phy": [[[-1,3,0],[1,-1,-1],[2,-1,-1]]],
                    "shares": [[[0,0.8],[1],[1]]]})",
                "p.json: shares[0][0]: expected at least 3 shares"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "log2phy": [[[3,3],[1,-1],[2,-1]]]})",
                "p.json: log2phy[0][0]: does not list the slots phy2log assigns to this expert"},
        // Excluded ranks: in range, and their slots carry no share.
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,0,1]], "excluded_ranks": [2]})",
                "p.json: excluded_ranks[0]: is 2, outside [0, 1]"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,0,1]], "excluded_ranks": 0})",
                "p.json: excluded_ranks: expected an array of ranks"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,0,1]], "shares": [[[0,1],[0,1]]], "excluded_ranks": [0,0]})",
                "p.json: plan: excluded rank 0 is listed twice"},
        BadLoad{R"({"topology": {"ranks": 3, "nodes": 1, "slots_per_rank": 2},
                    "phy2log": [[0,1,0,1,0,1]], "excluded_ranks": [1,0]})",
                "p.json: plan: excluded rank 0 follows 1: the excluded ranks go in ascending "
                "order"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,0,1]], "excluded_ranks": [0]})",
                "p.json: plan: layer 0 slot 0 has share 0.5 but rank 0 is excluded"},
        // Past 2^63 - 1: refused as written, not read back as -1 (padding) or negative.
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "log2phy": [[[0,3],[1,18446744073709551615],[2,-1]]]})",
                "p.json: log2phy[0][1][1]: is 18446744073709551615, outside [-1, 3]"},
        BadLoad{std::string("{") + kTopology + R"(, "phy2log": [[0,1,9223372036854775808,0]]})",
                "p.json: phy2log[0][2]: is 9223372036854775808, outside [0, 1048575]"},
        BadLoad{std::string("{") + kTopology +
                 R"(, "phy2log": [[0,1,2,0]], "phy2log": [[0,1,2,1]]})",
                "p.json: phy2log: given twice in one object (which one is meant?)"}));

// Files as operators hand them over, damaged at random (fixed seed): a value somewhere in the
// tree replaced by one at the edges or of another type, an entry dropped or repeated, or the
// text cut short. Each is read, or refused as InvalidArgument with one line that starts with
// the file's name; a plan read passes ValidatePlan and round-trips. Nothing may crash or read
// out of bounds (the suite runs under AddressSanitizer and UBSan).
void MutateJson(nlohmann::json& root, std::mt19937_64& rng) {
  std::vector<nlohmann::json*> nodes;
  std::vector<nlohmann::json*> stack = {&root};
  while (!stack.empty()) {
    nlohmann::json* j = stack.back();
    stack.pop_back();
    nodes.push_back(j);
    if (j->is_structured()) {
      for (nlohmann::json& child : *j) stack.push_back(&child);
    }
  }
  nlohmann::json& j = *nodes[rng() % nodes.size()];
  static const nlohmann::json kValues[] = {
      0, 1, -1, 2, 3, 0.5, 1.0000001, -0.0, 1e308, -1e308, 4294967295u, 4294967296u,
      uint64_t{1} << 63, std::numeric_limits<uint64_t>::max(), std::numeric_limits<int64_t>::min(),
      1048575, 1048576, 65536, nullptr, true, "x", nlohmann::json::array(),
      nlohmann::json::object(), nlohmann::json::array({-1}), nlohmann::json::array({0, 0})};
  switch (rng() % 4) {
    case 0:
    case 1:
      j = kValues[rng() % (sizeof(kValues) / sizeof(kValues[0]))];
      break;
    case 2:
      if (j.is_array() && !j.empty()) {
        j.erase(j.begin() + static_cast<std::ptrdiff_t>(rng() % j.size()));
      } else if (j.is_object() && !j.empty()) {
        auto it = j.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % j.size()));
        j.erase(it);
      }
      break;
    default:
      if (j.is_array() && !j.empty()) j.push_back(j[rng() % j.size()]);
      break;
  }
}

template <typename Parse, typename Check>
void FuzzFile(const std::string& good, const char* name, uint64_t seed, Parse parse, Check check) {
  constexpr int kIterations = 4000;
  std::mt19937_64 rng(seed);
  const nlohmann::json base = nlohmann::json::parse(good);
  int read = 0;
  for (int i = 0; i < kIterations; ++i) {
    nlohmann::json j = base;
    for (int k = 1 + rng() % 3; k > 0; --k) MutateJson(j, rng);
    std::string text = j.dump();
    if (rng() % 10 == 0) text.resize(rng() % (text.size() + 1));
    const auto parsed = parse(text);
    if (parsed.ok()) {
      ++read;
      SCOPED_TRACE(text);
      ASSERT_NO_FATAL_FAILURE(check(*parsed));
      continue;
    }
    const std::string message(parsed.status().message());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_TRUE(absl::StartsWith(message, absl::StrCat(name, ": "))) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  EXPECT_GT(read, kIterations / 50);
}

TEST(JsonFuzzTest, DamagedPlanFilesAreReadOrRefusedNamingTheFile) {
  Plan plan = test::SmallPlan();
  plan.version = 7;
  plan.excluded_ranks = {};
  FuzzFile(
      PlanToJson(plan), "p.json", 6, [](const std::string& text) { return ParsePlanJson(text, "p.json"); },
      [](const Plan& read) {
        EXPECT_TRUE(ValidatePlan(read).ok()) << ValidatePlan(read);
        const absl::StatusOr<Plan> again = ParsePlanJson(PlanToJson(read), "again.json");
        ASSERT_TRUE(again.ok()) << again.status();
        EXPECT_TRUE(*again == read);
      });
}

TEST(JsonFuzzTest, DamagedLoadFilesAreReadOrRefusedNamingTheFile) {
  const std::string good = R"({"logical_count": [[5, 0, 3, 9], [0, 0, 0, 0], [1, 2, 3, 4]]})";
  const absl::StatusOr<LoadMatrix> undamaged = ParseSglangLoad(good, "l.json");
  ASSERT_TRUE(undamaged.ok()) << undamaged.status();
  EXPECT_EQ(undamaged->layer_ids(), (std::vector<int>{0, 2}));  // The dense layer skipped.
  EXPECT_EQ(undamaged->at(1, 3), 4.0);
  FuzzFile(
      good, "l.json", 7, [](const std::string& text) { return ParseSglangLoad(text, "l.json"); },
      [](const LoadMatrix& load) {
        // A load read has layers and experts, each count finite and not negative.
        ASSERT_GT(load.num_layers(), 0);
        ASSERT_GT(load.num_experts(), 0);
        for (int l = 0; l < load.num_layers(); ++l) {
          for (int e = 0; e < load.num_experts(); ++e) {
            EXPECT_TRUE(std::isfinite(load.at(l, e)) && load.at(l, e) >= 0) << load.at(l, e);
          }
        }
      });
}

}  // namespace
}  // namespace ubep::balancer
