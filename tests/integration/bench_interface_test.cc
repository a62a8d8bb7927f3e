// ubep-bench-dataplane's JSON is an interface other checks read (the data-plane issue names its
// fields): one object per case and method. Runs the real binary on a tiny case (ranks as
// processes, hidden 8) and checks the shape and the byte counts, never the times.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/cpus.h"
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

// The bench run with `args`; `as_given`: args is the whole command line, program first.
Ran Bench(const std::vector<std::string>& args, bool as_given = false) {
  test::TempDir dir;
  const std::string out = dir.path() + "/bench.out";
  std::vector<std::string> argv;
  if (!as_given) argv.push_back(test::BinaryPath("ubep-bench-dataplane"));
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv, out);
  Ran ran;
  ran.code = p.Wait(absl::Seconds(240)).value_or(-1);
  ran.output = test::ReadFile(out);
  return ran;
}

// The JSON array the bench printed: from its first line that opens one (stderr's warnings,
// in the same file, are lines of their own).
nlohmann::json Rows(const Ran& ran) {
  const size_t open = ran.output.rfind('[', 0) == 0 ? 0 : ran.output.find("\n[");
  if (open == std::string::npos) return nlohmann::json();
  return nlohmann::json::parse(ran.output.substr(open == 0 ? 0 : open + 1), nullptr, false);
}

TEST(BenchInterfaceTest, JsonHasOneObjectPerCaseAndMethodWithTheNamedFields) {
  const Ran ran = Bench({"--json", "--iters", "3", "--cases", "decode", "--ranks", "2",
                         "--hidden", "8", "--methods", "ubep,bsp,memcpy,ubep_flagged",
                         "--sender-thread", "on"});
  ASSERT_EQ(ran.code, 0) << ran.output;
  // Fewer than 100 iterations: said (on stderr), p99 being their slowest.
  EXPECT_THAT(ran.output, HasSubstr("ubep-bench-dataplane: 3 iterations: p99 is the slowest of "
                                    "them (fewer than 100)\n"));
  const nlohmann::json rows = Rows(ran);
  ASSERT_TRUE(rows.is_array()) << ran.output;
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
    // Each iteration's span (first start to last end) holds each rank's time, so its
    // percentiles are at least those of the slowest rank's; memcpy is one process.
    if (methods[i % 4] == "memcpy") {
      EXPECT_EQ(row["span_p50_us"], row["p50_us"]);
      EXPECT_EQ(row["span_p99_us"], row["p99_us"]);
    } else {
      EXPECT_GE(row["span_p50_us"].get<double>(), row["p50_us"].get<double>());
      EXPECT_GE(row["span_p99_us"].get<double>(), row["p99_us"].get<double>());
    }
    EXPECT_TRUE(row["bytes_moved"].is_number_unsigned());
    EXPECT_FALSE(row.contains("error"));
    // The CPUs this process may use (the test inherits them): as sched_getaffinity counts.
    EXPECT_EQ(row["cpus"], UsableCpus());
    EXPECT_EQ(row.contains("rate_vs_memcpy"), methods[i % 4] == "ubep");
    // The ratios of p50s, on ubep's row, for the methods that ran.
    EXPECT_EQ(row.contains("ubep_over_bsp"), methods[i % 4] == "ubep");
    EXPECT_EQ(row.contains("span_ubep_over_bsp"), methods[i % 4] == "ubep");
    EXPECT_EQ(row.contains("flagged_over_ubep"), methods[i % 4] == "ubep");
    EXPECT_FALSE(row.contains("mpi_over_ubep"));
    EXPECT_FALSE(row.contains("span_mpi_over_ubep"));
    if (methods[i % 4] == "ubep") {
      EXPECT_DOUBLE_EQ(row["ubep_over_bsp"].get<double>(),
                       row["p50_us"].get<double>() / rows[i + 1]["p50_us"].get<double>());
      EXPECT_DOUBLE_EQ(row["span_ubep_over_bsp"].get<double>(),
                       row["span_p50_us"].get<double>() /
                           rows[i + 1]["span_p50_us"].get<double>());
      EXPECT_DOUBLE_EQ(row["flagged_over_ubep"].get<double>(),
                       rows[i + 3]["p50_us"].get<double>() / row["p50_us"].get<double>());
    }
    // --sender-thread on: ubep's sender role has a thread of its own; bsp has no such role.
    if (methods[i % 4] == "memcpy") {
      EXPECT_FALSE(row.contains("threads_per_rank"));
    } else {
      EXPECT_EQ(row["threads_per_rank"], methods[i % 4] == "bsp" ? 1 : 2);
    }
  }
  for (size_t c = 0; c < 2; ++c) {
    const uint64_t ubep = rows[4 * c]["bytes_moved"];
    // bf16 rows of 8 values: every row dispatched and every partial sent back is 16 bytes.
    EXPECT_GT(ubep, 0u);
    EXPECT_EQ(ubep % 16, 0u);
    // Both protocols, flagged rows or not, move the same data for the same routing (bytes of
    // rows, not of their flags); memcpy copies them all.
    EXPECT_EQ(rows[4 * c + 1]["bytes_moved"], ubep);
    EXPECT_EQ(rows[4 * c + 2]["bytes_moved"], ubep);
    EXPECT_EQ(rows[4 * c + 3]["bytes_moved"], ubep);
  }
}

#ifdef UBEP_BENCH_HAS_MPI
// The MPI baseline moves the same bytes as ubep (same routing, same plan), and its row has the
// same fields; its iterations run in the same rounds.
TEST(BenchInterfaceTest, TheMpiBaselineMovesUbepsBytes) {
  const Ran ran = Bench({"--json", "--iters", "4", "--cases", "decode", "--ranks", "2",
                         "--hidden", "8", "--methods", "ubep,mpi_alltoallv",
                         "--sender-thread", "off"});
  ASSERT_EQ(ran.code, 0) << ran.output;
  const nlohmann::json rows = Rows(ran);
  ASSERT_TRUE(rows.is_array()) << ran.output;
  ASSERT_EQ(rows.size(), 4u) << rows.dump(1);  // 2 routings x 2 methods.
  for (size_t c = 0; c < 2; ++c) {
    const nlohmann::json& ubep = rows[2 * c];
    const nlohmann::json& mpi = rows[2 * c + 1];
    SCOPED_TRACE(mpi.dump());
    EXPECT_EQ(ubep["method"], "ubep");
    EXPECT_EQ(ubep["threads_per_rank"], 1);
    EXPECT_EQ(mpi["method"], "mpi_alltoallv");
    EXPECT_FALSE(mpi.contains("error"));
    EXPECT_EQ(mpi["iters"], 4);
    EXPECT_GT(mpi["bytes_moved"].get<uint64_t>(), 0u);
    EXPECT_EQ(mpi["bytes_moved"], ubep["bytes_moved"]);
    EXPECT_TRUE(mpi["p99_us"].get<double>() >= mpi["p50_us"].get<double>() &&
                mpi["p50_us"].get<double>() > 0);
    EXPECT_GE(mpi["span_p50_us"].get<double>(), mpi["p50_us"].get<double>());
    EXPECT_GE(mpi["span_p99_us"].get<double>(), mpi["p99_us"].get<double>());
    EXPECT_DOUBLE_EQ(ubep["mpi_over_ubep"].get<double>(),
                     mpi["p50_us"].get<double>() / ubep["p50_us"].get<double>());
    EXPECT_DOUBLE_EQ(ubep["span_mpi_over_ubep"].get<double>(),
                     mpi["span_p50_us"].get<double>() / ubep["span_p50_us"].get<double>());
  }
}

// A baseline that fails (here mpirun cannot be started: no PATH to find it or coreutils'
// timeout by) fails the run, and its row says why with no times: null, as are the ratios to
// it, never a 0 a reader would take for a time. ubep's own times stand.
TEST(BenchInterfaceTest, AFailedBaselinesRowHasItsErrorAndNoTimes) {
  const Ran ran = Bench({"/usr/bin/env", "PATH=/nonexistent", test::BinaryPath("ubep-bench-dataplane"),
                         "--json", "--iters", "2", "--cases", "decode", "--ranks", "2",
                         "--hidden", "8", "--methods", "ubep,mpi_alltoallv",
                         "--sender-thread", "off"}, /*as_given=*/true);
  EXPECT_EQ(ran.code, 1) << ran.output;
  const nlohmann::json rows = Rows(ran);
  ASSERT_TRUE(rows.is_array()) << ran.output;
  ASSERT_EQ(rows.size(), 4u) << rows.dump(1);
  for (size_t c = 0; c < 2; ++c) {
    const nlohmann::json& ubep = rows[2 * c];
    const nlohmann::json& mpi = rows[2 * c + 1];
    SCOPED_TRACE(mpi.dump());
    EXPECT_FALSE(ubep.contains("error"));
    EXPECT_GT(ubep["p50_us"].get<double>(), 0);
    EXPECT_TRUE(ubep["mpi_over_ubep"].is_null());
    EXPECT_TRUE(ubep["span_mpi_over_ubep"].is_null());
    EXPECT_THAT(mpi["error"].get<std::string>(), HasSubstr("mpirun exited with status 127: "));
    for (const char* time : {"p50_us", "p99_us", "span_p50_us", "span_p99_us"}) {
      EXPECT_TRUE(mpi.contains(time) && mpi[time].is_null()) << time;
    }
  }
}
#endif

TEST(BenchInterfaceTest, BadValuesAreRefusedNamingThem) {
  Ran ran = Bench({"--ranks", "4,6"});
  EXPECT_EQ(ran.code, 2);
  EXPECT_EQ(ran.output, "ubep-bench-dataplane: --ranks: 6 does not divide the 256 experts\n");
  ran = Bench({"--sender-thread", "yes"});
  EXPECT_EQ(ran.code, 2);
  EXPECT_EQ(ran.output,
            "ubep-bench-dataplane: --sender-thread: \"yes\"; expected auto, on or off\n");
}

TEST(BenchInterfaceTest, AnUnknownFlagPrintsTheUsageAndExitsWith2) {
  const Ran ran = Bench({"--ranks-per-node", "4"});
  EXPECT_EQ(ran.code, 2);
  EXPECT_THAT(ran.output,
              HasSubstr("usage: ubep-bench-dataplane [--json] [--iters N] "
                        "[--cases decode|prefill|all] [--ranks 4,8] [--hidden 7168,2048] "
                        "[--methods ubep,bsp,mpi_alltoallv,memcpy,ubep_flagged] "
                        "[--sender-thread auto|on|off]"));
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
