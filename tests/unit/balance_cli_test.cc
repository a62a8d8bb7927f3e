#include "tools/ubep_balance/balance_cli.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "balancer/formats/json_formats.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/unit/test_util.h"

namespace ubep::balancer {
namespace {

using Json = nlohmann::json;

struct Result {
  int code;
  std::string out;
  std::string err;
};

Result RunCli(std::vector<std::string> args) {
  std::ostringstream out, err;
  FakeClock clock;
  const int code = RunBalanceCli(args, out, err, clock);
  return {code, out.str(), err.str()};
}

const std::string kTrace = test::TracePath("decode_in1800out100.json");

// --help and --version on stdout with status 0, as every UBEP binary answers them; no command
// at all is a usage error.
TEST(BalanceCliTest, HelpAndVersionAnswerOnStdout) {
  const Result help = RunCli({"--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_EQ(help.out, "usage: ubep-balance plan|eval|replay [flags]; see docs/ubep-balance.md\n");
  EXPECT_EQ(help.err, "");
  const Result version = RunCli({"--version"});
  EXPECT_EQ(version.code, 0);
  EXPECT_EQ(version.out, "ubep-balance " UBEP_VERSION "\n");
  EXPECT_EQ(version.err, "");
  const Result none = RunCli({});
  EXPECT_EQ(none.code, 2);
  EXPECT_EQ(none.out, "");
  EXPECT_EQ(none.err, "usage: ubep-balance plan|eval|replay [flags]; see docs/ubep-balance.md\n");
}

TEST(BalanceCliTest, PlanWritesAnEplbCompatiblePlanThatEvalScores) {
  test::TempDir dir;
  const std::string plan_path = dir.path() + "/plan.json";
  Result plan = RunCli({"plan", "--load", kTrace, "--ranks", "32", "--nodes", "4",
                     "--slots-per-rank", "9", "--policy", "ubep", "--seed", "3", "--out",
                     plan_path});
  ASSERT_EQ(plan.code, 0) << plan.err;
  const Json summary = Json::parse(plan.out);
  EXPECT_EQ(summary["policy"], "ubep");
  EXPECT_EQ(summary["version"], 1);
  EXPECT_EQ(summary["layers"], 58);
  EXPECT_LE(summary["balancedness_mean"].get<double>(), 1.01);

  Result eval = RunCli({"eval", "--plan", plan_path, "--load", kTrace});
  ASSERT_EQ(eval.code, 0) << eval.err;
  const Json scored = Json::parse(eval.out);
  EXPECT_EQ(scored["layers"], 58);
  EXPECT_EQ(scored["slots"], 288);
  EXPECT_DOUBLE_EQ(scored["balancedness_mean"].get<double>(),
                   summary["balancedness_mean"].get<double>());
  EXPECT_DOUBLE_EQ(scored["balancedness_worst"].get<double>(),
                   summary["balancedness_worst"].get<double>());

  const Json file = Json::parse(*ReadTextFile(plan_path));
  EXPECT_EQ(file["phy2log"].size(), 58u);
  EXPECT_EQ(file["phy2log"][0].size(), 288u);
  EXPECT_EQ(file["logcnt"][0].size(), 256u);
  EXPECT_EQ(file["topology"]["ranks"], 32);
}

TEST(BalanceCliTest, PreviousPlanAndBudgetAreHonoured) {
  test::TempDir dir;
  const std::string first = dir.path() + "/v1.json", second = dir.path() + "/v2.json";
  const std::vector<std::string> topology = {"--ranks", "16", "--nodes", "2",
                                             "--slots-per-rank", "17"};
  std::vector<std::string> args = {"plan", "--load", kTrace, "--out", first};
  args.insert(args.end(), topology.begin(), topology.end());
  ASSERT_EQ(RunCli(args).code, 0);
  args = {"plan",           "--load",      test::TracePath("prefill_in512.json"),
          "--previous",     first,         "--migration-budget",
          "1",              "--out",       second};
  args.insert(args.end(), topology.begin(), topology.end());
  Result r = RunCli(args);
  ASSERT_EQ(r.code, 0) << r.err;
  const Json summary = Json::parse(r.out);
  EXPECT_EQ(summary["version"], 2);
  // The budget is per rank and layer: at most one slot of each changes its expert; some do
  // (the load moved), and the summary counts exactly those.
  std::ifstream in1(first), in2(second);
  const Json v1 = Json::parse(in1), v2 = Json::parse(in2);
  ASSERT_EQ(v1["phy2log"].size(), v2["phy2log"].size());
  int changed = 0;
  for (size_t l = 0; l < v1["phy2log"].size(); ++l) {
    ASSERT_EQ(v1["phy2log"][l].size(), 16u * 17u);
    ASSERT_EQ(v2["phy2log"][l].size(), 16u * 17u);
    for (int rank = 0; rank < 16; ++rank) {
      int of_rank = 0;
      for (int i = 0; i < 17; ++i) {
        of_rank += v1["phy2log"][l][rank * 17 + i] != v2["phy2log"][l][rank * 17 + i];
      }
      EXPECT_LE(of_rank, 1) << "layer " << l << " rank " << rank;
      changed += of_rank;
    }
  }
  EXPECT_GT(changed, 0);
  EXPECT_EQ(summary["changed_slots"].get<int>(), changed);
}

TEST(BalanceCliTest, EvalTakesAPlainEplbPlanWithRanksFromTheCommandLine) {
  test::TempDir dir;
  const std::string load = dir.Write("load.json", R"({"logical_count": [[0,0],[3,1]]})");
  const std::string plan = dir.Write("plan.json", R"({"phy2log": [[0,1,0,1]]})");
  Result r = RunCli({"eval", "--plan", plan, "--load", load, "--ranks", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  const Json scored = Json::parse(r.out);
  // Each rank holds half of each expert: perfectly balanced.
  EXPECT_DOUBLE_EQ(scored["balancedness_mean"].get<double>(), 1.0);
  EXPECT_EQ(scored["ranks"], 2);
  Result bad = RunCli({"eval", "--plan", plan, "--load", load, "--ranks", "3"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.err, "ubep-balance eval: " + plan + ": phy2log[0]: 4 slots do not divide by 3 ranks\n");
}

TEST(BalanceCliTest, ReplayComparesWithABaselineOnTheSameLoads) {
  Result r = RunCli({"replay", "--load", kTrace, test::TracePath("prefill_in512.json"),
                  "--ranks", "8", "--nodes", "2", "--slots-per-rank", "36", "--policy", "ubep",
                  "--baseline", "eplb-global", "--steps", "40", "--rebalance-every", "10",
                  "--window", "10", "--seed", "1", "--migration-budget", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  const Json result = Json::parse(r.out);
  for (const char* key : {"imbalance_mean", "imbalance_p99", "migrated_slots_total",
                          "plan_ms_p50", "plan_ms_max"}) {
    EXPECT_TRUE(result.contains(key)) << key;
    EXPECT_TRUE(result["baseline"].contains(key)) << key;
  }
  EXPECT_EQ(result["plans"], 3);
  EXPECT_EQ(result["scored_steps"], 30);
  EXPECT_EQ(result["baseline"]["policy"], "eplb-global");
  EXPECT_NE(result["time_axis"].get<std::string>().find("synthetic"), std::string::npos);
  // ubep keeps placements: far fewer weight moves than replanning from scratch.
  EXPECT_LT(result["migrated_slots_total"].get<int>(),
            result["baseline"]["migrated_slots_total"].get<int>() / 4);
}

struct BadRun {
  std::vector<std::string> args;
  std::string error;
  friend void PrintTo(const BadRun& r, std::ostream* os) { *os << r.error; }
};

class BadRunTest : public ::testing::TestWithParam<BadRun> {};

TEST_P(BadRunTest, ExitsTwoWithOneLineNamingTheProblem) {
  Result r = RunCli(GetParam().args);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, GetParam().error + "\n");
  EXPECT_EQ(r.out, "");
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, BadRunTest,
    ::testing::Values(
        BadRun{{"plan", "--load", "/nonexistent.json", "--ranks", "8", "--slots-per-rank", "32",
                "--out", "/tmp/x.json"},
               "ubep-balance plan: /nonexistent.json: cannot read: No such file or directory"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "31", "--out",
                "/tmp/x.json"},
               "ubep-balance plan: " + kTrace +
                   ": slots (8 ranks x 31 = 248) are fewer than the 256 logical experts; "
                   "every expert needs a slot"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "8", "--nodes", "3", "--slots-per-rank",
                "32", "--out", "/tmp/x.json"},
               "ubep-balance plan: " + kTrace + ": ranks (8) must be divisible by nodes (3)"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32", "--groups",
                "3", "--out", "/tmp/x.json"},
               "ubep-balance plan: " + kTrace + ": experts (256) must be divisible by groups (3)"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "eight", "--slots-per-rank", "32", "--out",
                "/tmp/x.json"},
               "ubep-balance plan: --ranks: 'eight' is not an integer"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32",
                "--policy", "magic", "--out", "/tmp/x.json"},
               "ubep-balance plan: unknown policy 'magic'; expected eplb, eplb-global or ubep"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32",
                "--frobnicate", "1"},
               "ubep-balance plan: unknown flag --frobnicate"},
        BadRun{{"plan", "--ranks", "8"}, "ubep-balance plan: missing --load"},
        BadRun{{"transmogrify"},
               "ubep-balance: unknown command 'transmogrify'; usage: ubep-balance "
               "plan|eval|replay [flags]; see docs/ubep-balance.md"},
        BadRun{{"replay", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32",
                "--policy", "ubep", "--steps", "10", "--rebalance-every", "5", "--window",
                "10"},
               "ubep-balance replay: replay: need window > 0, rebalance-every > 0 and steps > "
               "window; got window 10, rebalance-every 5, steps 10"},
        // Said before any step is drawn (18000 steps of loads would take a minute and 2 GiB).
        BadRun{{"replay", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32",
                "--policy", "ubep", "--steps", "18000", "--rebalance-every", "5", "--window",
                "18000"},
               "ubep-balance replay: replay: need window > 0, rebalance-every > 0 and steps > "
               "window; got window 18000, rebalance-every 5, steps 18000"},
        BadRun{{"replay", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32",
                "--policy", "ubep", "--steps", "100000", "--rebalance-every", "100", "--window",
                "10"},
               "ubep-balance replay: --steps 100000 of 58 layers x 256 experts are 11328 MiB of "
               "loads, over the 2048 MiB a replay holds; take at most 18078 steps"},
        // Each count within 2^20, their product over it (and over an int: it would wrap).
        BadRun{{"plan", "--load", kTrace, "--ranks", "65536", "--slots-per-rank", "65537",
                "--out", "/tmp/x.json"},
               "ubep-balance plan: " + kTrace +
                   ": slots (65536 ranks x 65537 = 4295032832) are more than the 4194304 "
                   "(2^22) a topology may have"},
        BadRun{{"plan", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "32",
                "--balance-slack=", "--out", "/tmp/x.json"},
               "ubep-balance plan: --balance-slack: '' is not a number in [0, 1]"}));

TEST(BalanceCliTest, PreviousPlanOfAnotherShapeIsRejected) {
  test::TempDir dir;
  const std::string first = dir.path() + "/v1.json";
  ASSERT_EQ(RunCli({"plan", "--load", kTrace, "--ranks", "16", "--slots-per-rank", "17", "--out",
                 first})
                .code,
            0);
  Result r = RunCli({"plan", "--load", kTrace, "--ranks", "8", "--slots-per-rank", "34",
                  "--previous", first, "--out", dir.path() + "/v2.json"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance plan: " + first +
                       ": previous plan is for 16 ranks x 17 slots on 1 nodes, not 8 x 34 on "
                       "1\n");
}

// Layers pair by model layer id: a previous plan for layers 0 and 1 does not fit a load
// whose MoE layers are 0 and 2, though both have two.
TEST(BalanceCliTest, PreviousPlanOfOtherLayersIsRejected) {
  test::TempDir dir;
  const std::string first_load = dir.Write("a.json", R"({"logical_count": [[1,2,3,4],[4,3,2,1]]})");
  const std::string second_load =
      dir.Write("b.json", R"({"logical_count": [[1,2,3,4],[0,0,0,0],[4,3,2,1]]})");
  const std::string first = dir.path() + "/v1.json";
  ASSERT_EQ(RunCli({"plan", "--load", first_load, "--ranks", "2", "--slots-per-rank", "3",
                    "--out", first})
                .code,
            0);
  Result r = RunCli({"plan", "--load", second_load, "--ranks", "2", "--slots-per-rank", "3",
                     "--previous", first, "--out", dir.path() + "/v2.json"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance plan: " + first +
                       ": previous plan's layer 1 is model layer 1, the load's is model layer "
                       "2\n");
}

// A previous plan in EPLB's plain form (phy2log alone) takes the topology of the flags, as
// eval's --plan does: it was refused, "pass --ranks", with --ranks given.
TEST(BalanceCliTest, APlainEplbPreviousPlanTakesTheTopologyOfTheFlags) {
  test::TempDir dir;
  const std::string load = dir.Write("load.json", R"({"logical_count": [[1,2,3,4]]})");
  const std::string previous = dir.Write("prev.json", R"({"phy2log": [[0,1,2,3,0,1]]})");
  Result r = RunCli({"plan", "--load", load, "--ranks", "2", "--slots-per-rank", "3",
                     "--previous", previous, "--out", dir.path() + "/next.json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Json::parse(r.out)["layers"], 1);
  r = RunCli({"plan", "--load", load, "--ranks", "3", "--slots-per-rank", "3",
              "--previous", previous, "--out", dir.path() + "/next.json"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err.find("pass --ranks"), std::string::npos) << r.err;
}

// Replayed loads of other MoE layers are refused naming the file, not "scenario source 1".
TEST(BalanceCliTest, ReplayLoadsOfOtherLayersAreRefusedNamingTheFile) {
  test::TempDir dir;
  const std::string a = dir.Write("a.json", R"({"logical_count": [[0,0],[1,2],[3,4]]})");
  const std::string b = dir.Write("b.json", R"({"logical_count": [[1,2],[3,4],[0,0]]})");
  Result r = RunCli({"replay", "--load", a, b, "--ranks", "2", "--slots-per-rank", "1",
                     "--policy", "eplb", "--steps", "4", "--rebalance-every", "1", "--window",
                     "2"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance replay: " + b + ": its MoE layers are model layers 0, 1; " + a +
                       "'s are 1, 2\n");
}

// A path that is not UTF-8 (a file name is any bytes) is printed with U+FFFD in the summary:
// the plan is written and the run exits 0 (the summary's dump threw after the work).
TEST(BalanceCliTest, AnOutputPathThatIsNotUtf8IsWrittenAndSummarized) {
  test::TempDir dir;
  const std::string out = dir.path() + "/p\xff.json";
  Result r = RunCli({"plan", "--load", kTrace, "--ranks", "32", "--slots-per-rank", "9", "--out",
                     out});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Json::parse(r.out)["out"], dir.path() + "/p\xEF\xBF\xBD.json");
  EXPECT_TRUE(ReadTextFile(out).ok());
}

// A directory at --out is a usage error, said before the plan is computed.
TEST(BalanceCliTest, AnOutputThatIsADirectoryIsRefused) {
  test::TempDir dir;
  Result r = RunCli({"plan", "--load", kTrace, "--ranks", "32", "--slots-per-rank", "9", "--out",
                     dir.path()});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance plan: " + dir.path() + ": is a directory, not a file\n");
  EXPECT_TRUE(r.out.empty());
}

// An empty --out is a usage error, said before the plan is computed (the rename to "" failed
// after planning, as an internal error).
TEST(BalanceCliTest, AnEmptyOutputIsRefused) {
  Result r = RunCli({"plan", "--load", kTrace, "--ranks", "32", "--slots-per-rank", "9", "--out",
                     ""});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance plan: --out: empty; name the plan's file\n");
  EXPECT_TRUE(r.out.empty());
}

// eval pairs a plan's layers with the load's by model layer: a plan that names other layers
// is refused, naming the first that differs; a plan without layer ids takes the load's.
TEST(BalanceCliTest, EvalOfAPlanForOtherLayersIsRejected) {
  test::TempDir dir;
  const std::string load =
      dir.Write("load.json", R"({"logical_count": [[0,0],[3,1],[0,0],[1,3]]})");  // Layers 1, 3.
  const std::string other = dir.Write(
      "other.json",
      R"({"phy2log": [[0,1,0,1],[0,1,0,1]], "layer_ids": [1,2], "topology": {"ranks": 2, "nodes": 1, "slots_per_rank": 2}})");
  Result r = RunCli({"eval", "--plan", other, "--load", load});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance eval: " + other + ": layer_ids[1]: is 2 but " + load +
                       "'s MoE layer 1 is model layer 3\n");
  const std::string plain = dir.Write("plain.json", R"({"phy2log": [[0,1,0,1],[0,1,0,1]]})");
  EXPECT_EQ(RunCli({"eval", "--plan", plain, "--load", load, "--ranks", "2"}).code, 0);
  // Named 0 and 1 (an all-MoE model's first layers) is a plan for layers 0 and 1, not 1 and 3.
  const std::string first = dir.Write(
      "first.json", R"({"phy2log": [[0,1,0,1],[0,1,0,1]], "layer_ids": [0,1]})");
  Result named = RunCli({"eval", "--plan", first, "--load", load, "--ranks", "2"});
  EXPECT_EQ(named.code, 2);
  EXPECT_EQ(named.err, "ubep-balance eval: " + first + ": layer_ids[0]: is 0 but " + load +
                           "'s MoE layer 0 is model layer 1\n");
}

// A baseline that moved no slot (ubep on one rank of 8 spare slots keeps its replicas where
// they are; EPLB moves its with the load) gives no migration ratio, not an infinite one.
TEST(BalanceCliTest, AReplayAgainstABaselineThatMovedNothingHasNoMigrationRatio) {
  Result r = RunCli({"replay", "--load", kTrace, "--ranks", "1", "--slots-per-rank", "264",
                     "--policy", "eplb", "--baseline", "ubep", "--steps", "40",
                     "--rebalance-every", "10", "--window", "10", "--seed", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  const Json result = Json::parse(r.out);
  EXPECT_EQ(result["baseline"]["migrated_slots_total"], 0);
  EXPECT_GT(result["migrated_slots_total"].get<int64_t>(), 0);
  EXPECT_TRUE(result["migrated_slots_ratio"].is_null()) << result["migrated_slots_ratio"];
}

// eval's --nodes must agree with the plan's topology; left out, the plan's holds.
TEST(BalanceCliTest, EvalComparesNodesWithThePlansTopology) {
  test::TempDir dir;
  const std::string load = dir.Write("load.json", R"({"logical_count": [[3,1]]})");
  const std::string plan = dir.Write(
      "plan.json",
      R"({"topology": {"ranks": 2, "nodes": 2, "slots_per_rank": 2}, "phy2log": [[0,1,0,1]]})");
  Result r = RunCli({"eval", "--plan", plan, "--load", load, "--ranks", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Json::parse(r.out)["ranks"], 2);
  r = RunCli({"eval", "--plan", plan, "--load", load, "--ranks", "2", "--nodes", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = RunCli({"eval", "--plan", plan, "--load", load, "--ranks", "2", "--nodes", "1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance eval: " + plan +
                       ": topology.nodes: is 2, but 1 is expected\n");
  // --nodes alone is refused, not dropped.
  r = RunCli({"eval", "--plan", plan, "--load", load, "--nodes", "1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "ubep-balance eval: --nodes needs --ranks (the ranks the nodes divide)\n");
}

TEST(BalanceCliTest, TheBinaryExitsTwoOnBadInput) {
  test::TempDir dir;
  const std::string bad = dir.Write("bad.json", R"({"logical_count": [[1,2],[3]]})");
  const std::string command = std::string(UBEP_BINARY_DIR) + "/bin/ubep-balance plan --load " +
                              bad + " --ranks 2 --slots-per-rank 1 --out " + dir.path() +
                              "/p.json 2>" + dir.path() + "/err.txt";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_EQ(*ReadTextFile(dir.path() + "/err.txt"),
            "ubep-balance plan: " + bad +
                ": logical_count[1]: has 1 experts, logical_count[0] has 2 (ragged rows)\n");
}

// Its summary on a standard output that cannot take it (a full disk): exit 1 saying so, not 0
// with the output cut short.
TEST(BalanceCliTest, TheBinaryFailsWhenItsOutputCannotBeWritten) {
  test::TempDir dir;
  const std::string command = std::string(UBEP_BINARY_DIR) + "/bin/ubep-balance plan --load " +
                              kTrace + " --ranks 32 --slots-per-rank 9 --out " + dir.path() +
                              "/p.json > /dev/full 2>" + dir.path() + "/err.txt";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_EQ(*ReadTextFile(dir.path() + "/err.txt"), "ubep-balance: cannot write the output\n");
}

}  // namespace
}  // namespace ubep::balancer
