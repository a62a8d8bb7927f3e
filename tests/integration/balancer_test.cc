// ubep-balancer end to end on the host backend: a real balancer, a real ubepd and four real
// serving processes (ubep-moe-example) replaying a drifting mix of the bundled DeepSeek-V3
// traces; plans are computed online and committed at a step boundary while serving.
#include <signal.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "ubep/v1/control.grpc.pb.h"

namespace ubep {
namespace {

using ::testing::HasSubstr;
using test::Process;
using test::ReadFile;
using test::WaitFor;

constexpr int kWorld = 4;

class BalancerTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_.path() + "/" + name; }

  std::unique_ptr<Process> StartBalancer(std::vector<std::string> extra = {}) {
    std::filesystem::remove(path("balancer.ready"));
    std::vector<std::string> argv = {test::BinaryPath("ubep-balancer"),
                                     balancer_port_ == 0 ? "--listen=127.0.0.1:0"
                                                         : absl::StrCat("--listen=127.0.0.1:", balancer_port_),
                                     "--metrics=127.0.0.1:0",
                                     "--ready_file=" + path("balancer.ready"),
                                     "--interval=300ms",
                                     "--report_interval=300ms",
                                     "--health_interval=300ms",
                                     "--window=4",
                                     "--trigger_windows=2",
                                     "--threshold=1.05",
                                     "--effective_margin=1s",
                                     "--min_margin_steps=20",
                                     "--recovery_grace=1s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = std::make_unique<Process>(argv, path("balancer.log"));
    const nlohmann::json ready = test::ReadyFile(path("balancer.ready"), path("balancer.log"));
    balancer_port_ = ready.value("port", 0);
    balancer_metrics_ = ready.value("metrics_port", 0);
    return p;
  }

  std::unique_ptr<Process> StartDaemon(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {test::BinaryPath("ubepd"),
                                     "--socket=" + path("ubepd.sock"),
                                     "--listen=127.0.0.1:0",
                                     "--metrics=127.0.0.1:0",
                                     "--ready_file=" + path("ubepd.ready"),
                                     absl::StrCat("--balancer=127.0.0.1:", balancer_port_),
                                     "--node=node-a",
                                     "--harvest_interval=100ms",
                                     "--wait_timeout=60s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = std::make_unique<Process>(argv, path("ubepd.log"));
    daemon_metrics_ = test::ReadyFile(path("ubepd.ready"), path("ubepd.log")).value("metrics_port", 0);
    return p;
  }

  std::unique_ptr<Process> StartClient(int rank, int steps) {
    return std::make_unique<Process>(
        std::vector<std::string>{
            test::BinaryPath("ubep-moe-example"), "--socket=" + path("ubepd.sock"),
            absl::StrCat("--rank=", rank), absl::StrCat("--world=", kWorld),
            absl::StrCat("--steps=", steps), "--slots_per_rank=72", "--step_delay=5ms",
            "--log=" + ClientLog(rank),
            "--traces=" + test::TracePath("decode_in1000out1000.json") + "," +
                test::TracePath("prefill_in1024.json")},
        path(absl::StrCat("client-", rank, ".out")));
  }

  std::string ClientLog(int rank) const { return path(absl::StrCat("client-", rank, ".log")); }

  // Every rank finished with every step correct; all ranks used the same plan at every step;
  // versions never went down. Returns the plan version of each step.
  std::map<uint64_t, uint64_t> ExpectConsistentRun(int steps) {
    std::map<uint64_t, uint64_t> plan_of_step;
    for (int r = 0; r < kWorld; ++r) {
      const std::string log = ReadFile(ClientLog(r));
      EXPECT_THAT(log, HasSubstr(absl::StrCat("done steps ", steps, " failed 0"))) << log;
      uint64_t last_version = 0, last_step = 0;
      std::set<uint64_t> seen;
      for (const test::StepLine& line : test::StepLines(log)) {
        EXPECT_TRUE(line.ok) << "rank " << r << " step " << line.step;
        if (line.step >= last_step) {
          EXPECT_GE(line.plan, last_version) << "rank " << r << " step " << line.step;
        }
        last_version = line.plan;
        last_step = line.step;
        seen.insert(line.step);
        auto [it, inserted] = plan_of_step.emplace(line.step, line.plan);
        EXPECT_EQ(it->second, line.plan) << "rank " << r << " disagrees at step " << line.step;
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(steps)) << "rank " << r;
    }
    return plan_of_step;
  }

  test::TempDir dir_;
  int balancer_port_ = 0, balancer_metrics_ = 0, daemon_metrics_ = 0;
};

TEST_F(BalancerTest, RebalancingLowersTheMeasuredImbalanceAndEveryStepStaysExact) {
  constexpr int kSteps = 600;
  auto balancer = StartBalancer();
  auto daemon = StartDaemon({"--free_buffers=16"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r, kSteps));
  // Sample the balancer's view while serving: (plan version, measured imbalance).
  std::vector<std::pair<double, double>> samples;
  while (clients[0]->running() && !clients[0]->Wait(absl::Milliseconds(100)).has_value()) {
    const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
    const double version = test::Sample(m, "ubep_balancer_plan_version");
    const double measured = test::MeanOf(m, "ubep_balancer_imbalance_ratio", "when=\"measured\"");
    if (version > 0 && measured > 0) samples.emplace_back(version, measured);
  }
  for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(120)), 0);
  const std::map<uint64_t, uint64_t> plans = ExpectConsistentRun(kSteps);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(plans.begin()->second, 1u);
  EXPECT_GE(plans.rbegin()->second, 2u) << ReadFile(path("balancer.log"));

  std::vector<double> before, after;
  for (const auto& [version, measured] : samples) (version == 1 ? before : after).push_back(measured);
  ASSERT_FALSE(before.empty());
  ASSERT_GE(after.size(), 4u);
  const double before_max = *std::max_element(before.begin(), before.end());
  // The last samples: the plans have settled.
  const double after_last = after.back();
  std::cout << "measured imbalance: under plan v1 up to " << before_max << ", at the end "
            << after_last << " (plan v" << samples.back().first << ")\n";
  EXPECT_GT(before_max, 1.3);   // Round-robin placement of the traces' skewed experts.
  EXPECT_LT(after_last, 1.1);
  const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
  EXPECT_GE(test::Sample(m, "ubep_balancer_plans_committed_total"), 1);
  EXPECT_EQ(test::Sample(m, "ubep_balancer_plans_aborted_total"), 0) << ReadFile(path("balancer.log"));
  EXPECT_GT(test::Sample(m, "ubep_balancer_migrated_slots_total"), 0);
  EXPECT_GT(test::Sample(m, "ubep_balancer_migrated_bytes_total"), 0);
}

}  // namespace
}  // namespace ubep
