// ubep-bench-dataplane's JSON is an interface other checks read (the data-plane issue names its
// fields): one object per case and method. Runs the real binary on a tiny case (ranks as
// processes, hidden 8) and checks the shape and the byte counts, never the times.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/process.h"
#include "tests/unit/test_util.h"

namespace ubep {
namespace {

using ::testing::HasSubstr;

struct Ran {
  int code = -1;
  std::string output;
};

Ran Bench(const std::vector<std::string>& args) {
  test::TempDir dir;
  const std::string out = dir.path() + "/bench.out";
  std::vector<std::string> argv = {test::BinaryPath("ubep-bench-dataplane")};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv, out);
  Ran ran;
  ran.code = p.Wait(absl::Seconds(240)).value_or(-1);
  ran.output = test::ReadFile(out);
  return ran;
}

TEST(BenchInterfaceTest, JsonHasOneObjectPerCaseAndMethodWithTheNamedFields) {
  const Ran ran = Bench({"--json", "--iters", "3", "--cases", "decode", "--ranks", "2",
                         "--hidden", "8", "--methods", "ubep,bsp,memcpy,ubep_flagged"});
  ASSERT_EQ(ran.code, 0) << ran.output;
  const size_t open = ran.output.find('[');
  ASSERT_NE(open, std::string::npos) << ran.output;
  const nlohmann::json rows = nlohmann::json::parse(ran.output.substr(open));
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), 8u) << rows.dump(1);  // 2 routings x 4 methods.
  const std::vector<std::string> methods = {"ubep", "bsp", "memcpy", "ubep_flagged"};
  const std::vector<std::string> routings = {"uniform", "skewed"};
  for (size_t i = 0; i < rows.size(); ++i) {
    const nlohmann::json& row = rows[i];
    SCOPED_TRACE(row.dump());
    EXPECT_EQ(row["method"], methods[i % 4]);
    EXPECT_EQ(row["routing"], routings[i / 4]);
    EXPECT_EQ(row["case"], "decode");
    EXPECT_EQ(row["ranks"], 2);
    EXPECT_EQ(row["tokens"], 128);
    EXPECT_EQ(row["hidden"], 8);
    EXPECT_EQ(row["iters"], 3);
    EXPECT_TRUE(row["p50_us"].is_number() && row["p50_us"].get<double>() > 0);
    EXPECT_TRUE(row["p99_us"].is_number() &&
                row["p99_us"].get<double>() >= row["p50_us"].get<double>());
    EXPECT_TRUE(row["bytes_moved"].is_number_unsigned());
    EXPECT_FALSE(row.contains("error"));
    EXPECT_EQ(row.contains("rate_vs_memcpy"), methods[i % 4] == "ubep");
  }
  for (size_t c = 0; c < 2; ++c) {
    const uint64_t ubep = rows[4 * c]["bytes_moved"];
    // bf16 rows of 8 values: every row dispatched and every partial sent back is 16 bytes.
    EXPECT_GT(ubep, 0u);
    EXPECT_EQ(ubep % 16, 0u);
    // Both protocols, flagged rows or not, move the same data for the same routing (bytes of
    // rows, not of their flags); memcpy copies one rank's share.
    EXPECT_EQ(rows[4 * c + 1]["bytes_moved"], ubep);
    EXPECT_EQ(rows[4 * c + 2]["bytes_moved"], ubep / 2);
    EXPECT_EQ(rows[4 * c + 3]["bytes_moved"], ubep);
  }
}

TEST(BenchInterfaceTest, AnUnknownFlagPrintsTheUsageAndExitsWith2) {
  const Ran ran = Bench({"--ranks-per-node", "4"});
  EXPECT_EQ(ran.code, 2);
  EXPECT_THAT(ran.output,
              HasSubstr("usage: ubep-bench-dataplane [--json] [--iters N] "
                        "[--cases decode|prefill|all] [--ranks 4,8] [--hidden 7168,2048] "
                        "[--methods ubep,bsp,mpi_alltoallv,memcpy,ubep_flagged]"));
}

TEST(BenchInterfaceTest, AnUnknownMethodIsRefusedNamingIt) {
  const Ran ran = Bench({"--methods", "ubep,mpi"});
  EXPECT_EQ(ran.code, 2);
  EXPECT_EQ(ran.output,
            "ubep-bench-dataplane: --methods: unknown method \"mpi\"; expected ubep, bsp, "
            "mpi_alltoallv, memcpy or ubep_flagged\n");
}

}  // namespace
}  // namespace ubep
