// ubep-balancer end to end on the host backend: a real balancer, a real ubepd and four real
// serving processes (ubep-moe-example) replaying a drifting mix of the bundled DeepSeek-V3
// traces; plans are computed online and committed at a step boundary while serving.
#include <signal.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <regex>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster.h"
#include "balancer/core/plan.h"
#include "balancer/formats/proto_convert.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "ubep/v1/control.grpc.pb.h"

namespace ubep {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using test::Process;
using test::ReadFile;
using test::WaitFor;

class BalancerTest : public ::testing::Test {
 public:  // LoseNodeB, a test body shared by two tests, uses the fixture.
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

  // A daemon acting as node `node`: socket NODE.sock, log NODE.log.
  std::unique_ptr<Process> StartDaemon(std::vector<std::string> extra = {},
                                       const std::string& node = "node-a") {
    std::filesystem::remove(path(node + ".ready"));
    std::vector<std::string> argv = {test::BinaryPath("ubepd"),
                                     "--socket=" + path(node + ".sock"),
                                     "--listen=127.0.0.1:0",
                                     "--metrics=127.0.0.1:0",
                                     "--ready_file=" + path(node + ".ready"),
                                     absl::StrCat("--balancer=127.0.0.1:", balancer_port_),
                                     "--node=" + node,
                                     "--harvest_interval=100ms",
                                     "--wait_timeout=60s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = std::make_unique<Process>(argv, path(node + ".log"));
    daemon_metrics_ = test::ReadyFile(path(node + ".ready"), path(node + ".log")).value("metrics_port", 0);
    return p;
  }

  std::unique_ptr<Process> StartClient(int rank, int steps, const std::string& node = "node-a",
                                       int slots_per_rank = 72, int tokens = 32,
                                       int drift_period = 200,
                                       std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{
            test::BinaryPath("ubep-moe-example"), "--socket=" + path(node + ".sock"),
            absl::StrCat("--rank=", rank), absl::StrCat("--world=", world_),
            absl::StrCat("--steps=", steps), absl::StrCat("--slots_per_rank=", slots_per_rank),
            absl::StrCat("--tokens=", tokens), absl::StrCat("--drift_period=", drift_period),
            "--step_delay=5ms",
            "--log=" + ClientLog(rank),
            "--traces=" + test::TracePath("decode_in1000out1000.json") + "," +
                test::TracePath("prefill_in1024.json")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(argv, path(absl::StrCat("client-", rank, ".out")));
  }

  std::string ClientLog(int rank) const { return path(absl::StrCat("client-", rank, ".log")); }

  // Ranks [0, survivors) finished `steps` steps, every one exact; where a step ran twice
  // (stopped mid-step, run again after the group re-formed) the last run counts; all agree on
  // each step's plan. Returns the plan version of each step.
  std::map<uint64_t, uint64_t> ExpectSurvivorsExact(int survivors, int steps) {
    std::map<uint64_t, uint64_t> plan_of_step;
    for (int r = 0; r < survivors; ++r) {
      const std::string log = ReadFile(ClientLog(r));
      EXPECT_THAT(log, HasSubstr(absl::StrCat("done steps ", steps, " failed 0"))) << log;
      std::map<uint64_t, uint64_t> last;
      for (const test::StepLine& line : test::StepLines(log)) {
        EXPECT_TRUE(line.ok) << "rank " << r << " step " << line.step;
        last[line.step] = line.plan;
      }
      EXPECT_EQ(last.size(), static_cast<size_t>(steps)) << "rank " << r;
      for (const auto& [step, plan] : last) {
        auto [it, inserted] = plan_of_step.emplace(step, plan);
        EXPECT_EQ(it->second, plan) << "rank " << r << " disagrees at step " << step;
      }
    }
    return plan_of_step;
  }

  // Every rank finished with every step correct; all ranks used the same plan at every step;
  // versions never went down. Returns the plan version of each step.
  std::map<uint64_t, uint64_t> ExpectConsistentRun(int steps) {
    std::map<uint64_t, uint64_t> plan_of_step;
    for (int r = 0; r < world_; ++r) {
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
  int world_ = 4;
};

TEST_F(BalancerTest, RebalancingLowersTheMeasuredImbalanceAndEveryStepStaysExact) {
  constexpr int kSteps = 600;
  auto balancer = StartBalancer();
  auto daemon = StartDaemon({"--free_buffers=16"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) clients.push_back(StartClient(r, kSteps));
  // Sample the balancer's view while serving: (plan version, measured imbalance).
  std::vector<std::pair<double, double>> samples;
  const absl::Time sample_until = absl::Now() + absl::Seconds(300);  // A hung rank ends it.
  while (clients[0]->running() && !clients[0]->Wait(absl::Milliseconds(100)).has_value() &&
         absl::Now() < sample_until) {
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
  // The last samples (the plans have settled), by their median: a sanitized build runs a few
  // steps per interval, and one window of them can read 1.10 between plans.
  std::vector<double> last(after.end() - std::min<size_t>(after.size(), 10), after.end());
  std::nth_element(last.begin(), last.begin() + last.size() / 2, last.end());
  const double after_median = last[last.size() / 2];
  std::cout << "measured imbalance: under plan v1 up to " << before_max << ", at the end "
            << after_median << " (median of the last " << last.size() << " samples; plan v"
            << samples.back().first << ")\n";
  EXPECT_GT(before_max, 1.3);   // Round-robin placement of the traces' skewed experts.
  EXPECT_LT(after_median, 1.1);
  const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
  EXPECT_GE(test::Sample(m, "ubep_balancer_plans_committed_total"), 1);
  // A plan is aborted only where a rank ran past its effective step (the step rate measured
  // while the machine stalled): each such abort is a "rebalance:" warning saying so, and the
  // next interval makes another plan. Any other abort is a defect.
  const std::string balancer_log = ReadFile(path("balancer.log"));
  int behind = 0;
  for (absl::string_view line : absl::StrSplit(balancer_log, '\n')) {
    behind += absl::StrContains(line, "rebalance: ABORTED: plan v") &&
              absl::StrContains(line, " is not ahead of rank ");
  }
  EXPECT_EQ(test::Sample(m, "ubep_balancer_plans_aborted_total"), behind) << balancer_log;
  EXPECT_LE(behind, 2) << balancer_log;  // More would be the step estimate gone wrong.
  EXPECT_GT(test::Sample(m, "ubep_balancer_migrated_slots_total"), 0);
  EXPECT_GT(test::Sample(m, "ubep_balancer_migrated_bytes_total"), 0);
  // The exposition passes promtool's lint, as ubepd's does (daemon_test).
  std::ofstream(path("balancer-metrics.txt")) << m;
  Process lint({"/bin/sh", "-c", "/usr/bin/promtool check metrics < " + path("balancer-metrics.txt")},
               path("lint.out"));
  EXPECT_EQ(lint.Wait(absl::Seconds(30)), 0) << ReadFile(path("lint.out"));
  EXPECT_EQ(ReadFile(path("lint.out")), "");
}

// A serving job started again (new clients of the same daemon) counts its steps from 0, before
// the effective step of the plan the job before ran last: the group resumes at step 0, the
// daemon follows that plan from there, and the balancer goes on taking its reports (their
// counts are that plan's) instead of refusing them as counted before the plan.
TEST_F(BalancerTest, AServingJobStartedAgainFromStep0IsStillReported) {
  constexpr int kSteps = 400;
  auto balancer = StartBalancer();
  auto daemon = StartDaemon({"--free_buffers=16"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) clients.push_back(StartClient(r, kSteps));
  for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(120)), 0);
  const std::map<uint64_t, uint64_t> plans = ExpectConsistentRun(kSteps);
  ASSERT_FALSE(plans.empty());
  const uint64_t last = plans.rbegin()->second;
  ASSERT_GE(last, 2u) << ReadFile(path("balancer.log"));
  uint64_t effective = 0;  // The first step the job ran under its last plan.
  while (plans.at(effective) != last) ++effective;
  // Room for a job of 100 steps or more, every one of them before that step.
  ASSERT_GE(effective, 101u) << ReadFile(path("balancer.log"));
  const int second_steps = static_cast<int>(effective) - 1;
  // A plan may still be committed as the job ends (its effective step past the job's last
  // step, so not in the logs); one committed after the second job's group formed would not be
  // followed from step 0, and that job's reports would be the old plan's. The second job
  // starts once the balancer's plan holds (five looks 300 ms apart; with no load coming in,
  // no plan is called for).
  double version = -1;
  for (int same = 0, looks = 0; same < 5 && looks < 100; ++looks) {
    const double now = test::Sample(test::HttpGet(balancer_metrics_, "/metrics"),
                                    "ubep_balancer_plan_version");
    same = now == version ? same + 1 : 0;
    version = now;
    absl::SleepFor(absl::Milliseconds(300));
  }
  const double taken_before =
      test::Sample(test::HttpGet(balancer_metrics_, "/metrics"), "ubep_balancer_reports_total");
  clients.clear();
  for (int r = 0; r < world_; ++r) {
    clients.push_back(StartClient(r, second_steps, "node-a", 72, 32, 200,
                                  {"--log=" + path(absl::StrCat("second-", r, ".log"))}));
  }
  for (int r = 0; r < world_; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0);
    const std::string log = ReadFile(path(absl::StrCat("second-", r, ".log")));
    EXPECT_THAT(log, HasSubstr(absl::StrCat("done steps ", second_steps, " failed 0"))) << log;
    const std::vector<test::StepLine> lines = test::StepLines(log);
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.front().step, 0u) << "rank " << r;
  }
  // The second job's reports are taken (the daemon reports every 300 ms; a few intervals).
  auto taken = [&] {
    return test::Sample(test::HttpGet(balancer_metrics_, "/metrics"),
                        "ubep_balancer_reports_total") - taken_before;
  };
  WaitFor([&] { return taken() >= 2; }, absl::Seconds(10));
  const std::string balancer_log = ReadFile(path("balancer.log"));
  // (Its plan may be a later one than the job's last: made once that job had ended.)
  EXPECT_THAT(balancer_log, ContainsRegex("plan v[0-9]+ is in force from step 0, not [0-9]+: "
                                          "node node-a's group resumed there"));
  EXPECT_GE(taken(), 2) << balancer_log;
}

// Two daemons acting as two nodes (ranks 0-3 and 4-7) form one EP group of 8 ranks: each
// maps the other's arenas, the group forms across them, and plans are committed on both.
// 32 slots per rank hold the 256 experts once: round-robin puts the traces' hot experts
// together (imbalance above 2); 128 tokens per rank keep the counters' noise small.
TEST_F(BalancerTest, TwoDaemonsServeOneGroupOfEightRanksAndRebalancingBringsTheImbalanceUnder1_1) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitized debug build runs 2 steps per second: the 500 steps would take over four
  // minutes. The two-daemon group itself runs under the sanitizers in
  // ADaemonKilledHasItsRanksExcludedAndTheSurvivorsKeepServingExactly.
  GTEST_SKIP() << "imbalance figures are measured in the release build";
#endif
  constexpr int kSteps = 500;
  world_ = 8;
  // One-second intervals (the default). The daemons read each layer's counters with the
  // dispatches they cover (the arena's load seqlock), so the figures are per dispatch and do
  // not depend on how many steps an interval holds (a loaded CI machine runs 8 per second).
  // A longer window and a threshold of 1.1: after the first plan the balancer does not chase
  // the counters' noise.
  auto balancer = StartBalancer({"--interval=1s", "--report_interval=1s", "--window=8",
                                 "--threshold=1.1"});
  // The two nodes are in two load/store domains: an expert new to a slot whose holders are
  // all in the other domain is read through the holder's daemon (ReadWeights over TCP), not
  // copied between arenas. (On one machine the host backend's data plane still maps every
  // arena; the domain decides how weights travel.)
  auto node_a = StartDaemon({"--ranks=0-3", "--free_buffers=32", "--domain=0"}, "node-a");
  auto node_b = StartDaemon({"--ranks=4-7", "--free_buffers=32", "--domain=1"}, "node-b");
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) {
    clients.push_back(StartClient(r, kSteps, r < 4 ? "node-a" : "node-b", /*slots_per_rank=*/32,
                                  /*tokens=*/128, /*drift_period=*/4000));
  }
  // (seconds since the first plan change, plan version, measured imbalance).
  struct Sample {
    double since_change;
    double version, measured;
  };
  std::vector<Sample> samples;
  absl::Time changed = absl::InfiniteFuture();
  const absl::Time sample_until = absl::Now() + absl::Seconds(300);  // A hung rank ends it.
  while (clients[0]->running() && !clients[0]->Wait(absl::Milliseconds(100)).has_value() &&
         absl::Now() < sample_until) {
    const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
    const double version = test::Sample(m, "ubep_balancer_plan_version");
    const double measured = test::MeanOf(m, "ubep_balancer_imbalance_ratio", "when=\"measured\"");
    if (version >= 2 && changed == absl::InfiniteFuture()) changed = absl::Now();
    if (version > 0 && measured > 0) {
      samples.push_back({absl::ToDoubleSeconds(absl::Now() - changed), version, measured});
    }
  }
  for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(180)), 0);
  const std::map<uint64_t, uint64_t> plans = ExpectConsistentRun(kSteps);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(plans.begin()->second, 1u);
  EXPECT_GE(plans.rbegin()->second, 2u) << ReadFile(path("balancer.log"));
  // Before: under plan v1. After: from 2 s after the first commit (the plan is in force at
  // its effective step, about 1 s later; the window then fills with its counts).
  std::vector<double> before, after;
  for (const Sample& s : samples) {
    if (s.version == 1) before.push_back(s.measured);
    if (s.since_change >= 2) after.push_back(s.measured);
  }
  ASSERT_FALSE(before.empty());
  ASSERT_GE(after.size(), 5u);
  const double before_max = *std::max_element(before.begin(), before.end());
  std::sort(after.begin(), after.end());
  const double after_median = after[after.size() / 2];
  std::cout << "measured imbalance, 8 ranks on 2 daemons: under plan v1 up to " << before_max
            << "; after the first rebalance median " << after_median << " over " << after.size()
            << " samples (plans up to v" << samples.back().version << ")\n";
  EXPECT_GT(before_max, 2.0);
  EXPECT_LT(after_median, 1.1);
  // Both daemons committed the plans, each mapped the other's arenas, and rank 0's daemon
  // formed the group.
  for (const std::string node : {"node-a", "node-b"}) {
    const std::string log = ReadFile(path(node + ".log"));
    // The first plan change is v2, or a later one where a rank ran past v2's effective step
    // (stalled while the balancer measured the step rate) and v2 was aborted.
    EXPECT_TRUE(std::regex_search(log, std::regex("committed plan v([2-9]|[1-9][0-9]+)"))) << node;
    EXPECT_THAT(log, HasSubstr("mapped the arenas of ranks " +
                               std::string(node == "node-a" ? "4-7" : "0-3")))
        << node;
  }
  EXPECT_THAT(ReadFile(path("node-a.log")), HasSubstr("group formed: generation 1, 8 ranks"));
  // Round-robin holds each expert once, so the first plan's new slots on one node mostly take
  // experts held only on the other: read from the other domain's daemon. Every step above was
  // exact, so every byte read arrived right.
  uint64_t remote_total = 0;
  for (const std::string node : {"node-a", "node-b"}) {
    const std::string log = ReadFile(path(node + ".log"));
    const std::regex staged(R"(prepared plan v2 for step \d+: (\d+) slots staged \((\d+) bytes\), (\d+) of them from other domains \((\d+) bytes\))");
    std::smatch match;
    ASSERT_TRUE(std::regex_search(log, match, staged)) << node << "\n" << log;
    const uint64_t slots = std::stoull(match[1]), remote = std::stoull(match[3]);
    EXPECT_GT(remote, 0u) << node;
    EXPECT_LT(remote, slots) << node;  // Some holders are in the node's own domain.
    EXPECT_EQ(std::stoull(match[4]) * slots, std::stoull(match[2]) * remote) << node;
    remote_total += std::stoull(match[4]);
    std::cout << node << " staged plan v2: " << slots << " slots, " << remote
              << " of them read from the other domain's daemon (" << match[4] << " bytes)\n";
  }
  const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
  EXPECT_GE(test::Sample(m, "ubep_balancer_migrated_cross_domain_bytes_total"), static_cast<double>(remote_total));
}

// ubepd --max_recv_rows between the balanced load and what round-robin placement routes to
// the busiest rank: the group drops every step that reaches a layer over the capacity, and
// the layers after it see no call. The daemon reports the dropped calls with its load, and
// the balancer plans on them, layer after layer as each becomes visible, until the group
// serves every step again.
TEST_F(BalancerTest, CallsOverAReceiveCapacityCallForPlansUntilEveryStepIsServedAgain) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A few steps per second: too few dispatches per interval to plan on, and the 1500 steps
  // would take many minutes. The drop trigger itself runs under the sanitizers in
  // balancer_server_test, the capacity in daemon_test.
  GTEST_SKIP() << "plans on the counters of a release build's step rate";
#endif
  constexpr int kSteps = 1500;
  constexpr int kCapacity = 1250;  // 4 ranks x 128 tokens x top-8: 1024 rows per rank on average.
  // A threshold of 1.15: a layer over the capacity is at 1250 / 1024 = 1.22 of the mean or
  // more, so every drop still calls for a plan; the counters' noise on a loaded machine (a
  // mean of 1.11 after the capacity is met) no longer does, whose plan may overflow again.
  auto balancer = StartBalancer({"--threshold=1.15"});
  auto daemon = StartDaemon({"--free_buffers=16", absl::StrCat("--max_recv_rows=", kCapacity)});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) {
    clients.push_back(StartClient(r, kSteps, "node-a", /*slots_per_rank=*/72, /*tokens=*/128,
                                  /*drift_period=*/1000000));
  }
  for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(300)), 0);
  std::set<uint64_t> dropped_by_rank0;
  for (int r = 0; r < world_; ++r) {
    const std::string log = ReadFile(ClientLog(r));
    std::set<uint64_t> dropped, served;
    for (const test::DroppedLine& line : test::DroppedLines(log)) dropped.insert(line.step);
    for (const test::StepLine& line : test::StepLines(log)) {
      EXPECT_TRUE(line.ok) << "rank " << r << " step " << line.step;
      served.insert(line.step);
    }
    EXPECT_EQ(served.size() + dropped.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    EXPECT_THAT(
        log, HasSubstr(absl::StrCat("done steps ", kSteps, " failed 0 dropped ", dropped.size())));
    if (r == 0) {
      dropped_by_rank0 = dropped;
    } else {
      EXPECT_EQ(dropped, dropped_by_rank0) << "rank " << r;
    }
  }
  const std::string balancer_log = ReadFile(path("balancer.log"));
  ASSERT_FALSE(dropped_by_rank0.empty()) << balancer_log;
  std::cout << dropped_by_rank0.size() << " of " << kSteps << " steps dropped, the last at step "
            << *dropped_by_rank0.rbegin() << "\n";
  // The plans came for the dropped calls: the last drop is before the effective step of the
  // last plan made for them, and every step from there to the end was served. (A plan for
  // the imbalance alone, on a loaded machine's noisy counters, may overflow again; the plan
  // for its drops follows.)
  const std::regex for_drops(R"(rebalance \(calls over the receive capacity\): plan v\d+ at step (\d+))");
  uint64_t last_for_drops = 0;
  for (std::sregex_iterator it(balancer_log.begin(), balancer_log.end(), for_drops), end;
       it != end; ++it) {
    last_for_drops = std::max<uint64_t>(last_for_drops, std::stoull((*it)[1]));
  }
  ASSERT_GT(last_for_drops, 0u) << balancer_log;
  EXPECT_LT(*dropped_by_rank0.rbegin(), last_for_drops) << balancer_log;
  EXPECT_LT(last_for_drops, static_cast<uint64_t>(kSteps)) << balancer_log;
  // Each rank counts one error per dropped call, and the daemon reported every one of them,
  // those of the first steps (before the balancer knew the plan, and before the daemon's
  // first report for its group) too.
  const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
  EXPECT_EQ(test::Sample(m, "ubep_balancer_over_capacity_calls_total"),
            static_cast<double>(world_ * dropped_by_rank0.size()));
}

// kill -9 of one of two daemons (a node lost): the balancer sees its health checks fail,
// commits a plan for the survivors (ranks 0-3 hold every expert; the lost node's ranks are
// excluded), the group forms again without them and the survivors keep serving, exactly.
// Two daemons serve a group of 8 ranks; node-b's daemon is killed (with the balancer down
// meanwhile when `balancer_down`: node-b never registers with the restarted balancer). Its
// ranks are excluded by plan v2 and node-a's ranks serve every step exactly.
// With `plan`, the daemons start from that plan file rather than round-robin.
void LoseNodeB(BalancerTest& t, bool balancer_down, const std::string& plan = "") {
  constexpr int kSteps = 300;
  t.world_ = 8;
  // Ten failed checks (3 s): a daemon slowed by a loaded machine is not taken for lost.
  const std::vector<std::string> flags = {"--auto_rebalance=false", "--health_failures=10",
                                          "--registration_grace=2s"};
  auto balancer = t.StartBalancer(flags);
  // Every survivor slot may take a new expert: as many free buffers as slots.
  std::vector<std::string> a_flags = {"--ranks=0-3", "--free_buffers=72"};
  std::vector<std::string> b_flags = {"--ranks=4-7", "--free_buffers=72"};
  if (!plan.empty()) {
    a_flags.push_back("--plan=" + plan);
    b_flags.push_back("--plan=" + plan);
  }
  auto node_a = t.StartDaemon(a_flags, "node-a");
  auto node_b = t.StartDaemon(b_flags, "node-b");
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < t.world_; ++r) {
    // The lost node's clients try to attach again for 2 s, then give up.
    clients.push_back(r < 4 ? t.StartClient(r, kSteps, "node-a")
                            : t.StartClient(r, kSteps, "node-b", 72, 32, 200, {"--reattach_timeout=2s"}));
  }
  ASSERT_TRUE(WaitFor([&] { return test::StepLines(ReadFile(t.ClientLog(0))).size() >= 60; },
                      absl::Seconds(60)))
      << ReadFile(t.ClientLog(0));
  if (balancer_down) {
    balancer->Signal(SIGKILL);
    EXPECT_EQ(balancer->Wait(absl::Seconds(10)), 128 + SIGKILL);
  }
  node_b->Signal(SIGKILL);
  EXPECT_EQ(node_b->Wait(absl::Seconds(10)), 128 + SIGKILL);
  if (balancer_down) balancer = t.StartBalancer(flags);  // Same port: node-a finds it again.
  for (int r = 0; r < 4; ++r) EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(t.ClientLog(r));
  // The survivors' daemon is alive: they are told that a rank of node-b left (or that the
  // members changed, if the balancer's plan came first), never that their ubepd is draining,
  // and they Rejoin where they are instead of attaching again.
  for (int r = 0; r < 4; ++r) {
    const std::string log = ReadFile(t.ClientLog(r));
    EXPECT_THAT(log, ::testing::ContainsRegex(absl::StrCat(
                         "error step [0-9]+: rank ", r,
                         ": (rank [4-7] left the group|the group's membership changed)")))
        << log;
    EXPECT_THAT(log, ::testing::Not(HasSubstr("draining"))) << log;
    EXPECT_THAT(log, HasSubstr("rejoined at step ")) << log;
  }
  // The lost node's clients saw their daemon exit and found none to attach to again.
  for (int r = 4; r < 8; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(60)), 3) << ReadFile(t.ClientLog(r));
    EXPECT_THAT(ReadFile(t.ClientLog(r)), HasSubstr("error attach: "));
  }
  const std::map<uint64_t, uint64_t> plan_of_step = t.ExpectSurvivorsExact(4, kSteps);
  const std::string balancer_log = ReadFile(t.path("balancer.log"));
  ASSERT_FALSE(plan_of_step.empty());
  EXPECT_EQ(plan_of_step.begin()->second, 1u);
  EXPECT_EQ(plan_of_step.rbegin()->second, 2u) << balancer_log;
  EXPECT_THAT(balancer_log, HasSubstr("rebalance (membership changed): plan v2"));
  if (balancer_down) {
    EXPECT_THAT(balancer_log, HasSubstr("ranks 4, 5, 6, 7 of plan v1 have had no registered "
                                        "daemon for 2s: excluded as down"));
  }
  const std::string a_log = ReadFile(t.path("node-a.log"));
  EXPECT_THAT(a_log, HasSubstr("plan v2 changes the group's members (excluded: 4, 5, 6, 7)"));
  EXPECT_THAT(a_log, HasSubstr("group formed: generation 2, 4 ranks (excluded: 4, 5, 6, 7)"));
  v1::ClusterStatus status;
  {
    auto stub = v1::Control::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", t.balancer_port_), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    ASSERT_TRUE(stub->GetStatus(&context, v1::GetStatusRequest(), &status).ok());
  }
  EXPECT_EQ(status.plan_version(), 2u);
  EXPECT_THAT(status.excluded_ranks(), ::testing::ElementsAre(4, 5, 6, 7));
  // node-b: down, or never seen by the restarted balancer.
  ASSERT_EQ(status.nodes_size(), balancer_down ? 1 : 2);
  EXPECT_TRUE(status.nodes(0).healthy());
  if (!balancer_down) {
    EXPECT_FALSE(status.nodes(1).healthy());
  }
}

TEST_F(BalancerTest, ADaemonKilledHasItsRanksExcludedAndTheSurvivorsKeepServingExactly) {
  LoseNodeB(*this, /*balancer_down=*/false);
}

// A node that dies while the balancer is down never registers with the restarted balancer:
// after the registration grace its ranks are taken to be down, as a failed health check would.
TEST_F(BalancerTest, ADaemonKilledWhileTheBalancerIsDownHasItsRanksExcludedAfterTheGrace) {
  LoseNodeB(*this, /*balancer_down=*/true);
}

// The experts 192-255 live on node-b's ranks alone (plan v1, from a file: ranks 0-3 hold
// experts 0-191, ranks 4-7 experts 192-255) when node-b's daemon is killed. The survivors'
// plan v2 needs them: node-a copies them from node-b's arenas, which it still maps (the
// balancer lists node-b as down with its ranks and domain), and every step of ranks 0-3 is
// exact, on weights that came from the dead node. (Listed as no daemon's, its ranks were
// taken for another domain's and read through a daemon that is gone: Prepare failed at
// every tick, "no healthy daemon of the group hosts rank 4", and the survivors never formed
// again.)
TEST_F(BalancerTest, ALostNodesExpertsThatNoSurvivorHoldsAreCopiedFromItsArenas) {
  constexpr int kRanks = 8, kSlots = 72, kExperts = 256, kLayers = 4;
  nlohmann::json phy2log = nlohmann::json::array();
  for (int l = 0; l < kLayers; ++l) {
    nlohmann::json layer = nlohmann::json::array();
    for (int r = 0; r < kRanks; ++r) {
      for (int i = 0; i < kSlots; ++i) {
        layer.push_back(r < 4 ? (r * kSlots + i) % 192 : 192 + ((r - 4) * kSlots + i) % 64);
      }
    }
    phy2log.push_back(layer);
  }
  const nlohmann::json plan = {
      {"version", 1},
      {"topology", {{"ranks", kRanks}, {"nodes", 1}, {"slots_per_rank", kSlots}, {"groups", 1}}},
      {"num_experts", kExperts},
      {"layer_ids", {0, 1, 2, 3}},
      {"phy2log", phy2log}};
  const std::string file = path("plan.json");
  std::ofstream(file) << plan.dump();
  LoseNodeB(*this, /*balancer_down=*/false, file);
  EXPECT_THAT(ReadFile(path("balancer.log")), ::testing::Not(HasSubstr("no healthy daemon")));
}

// A model change over two nodes, without restarting anything but the serving processes: the
// clients of both daemons run a 4-layer model, exit, and clients of a 3-layer model attach.
// Each daemon creates a new group (new arenas, a new incarnation); the balancer refuses the
// first node's new shape while the other serves the old one, and starts the cluster over
// with it once both have moved; the daemons map each other's new arenas and the 3-layer
// group serves every step exactly.
TEST_F(BalancerTest, AModelChangeOverTwoDaemonsStartsTheClusterOverWithTheNewShape) {
  constexpr int kSteps = 30;
  auto balancer = StartBalancer({"--auto_rebalance=false"});
  auto node_a = StartDaemon({"--ranks=0-1"}, "node-a");
  auto node_b = StartDaemon({"--ranks=2-3"}, "node-b");
  for (const int layers : {4, 3}) {
    SCOPED_TRACE(absl::StrCat(layers, " layers"));
    for (int r = 0; r < world_; ++r) std::filesystem::remove(ClientLog(r));
    std::vector<std::unique_ptr<Process>> clients;
    for (int r = 0; r < world_; ++r) {
      if (r == 2 && layers == 3) {
        // node-a's clients moved first: the balancer refused its new group, and says which
        // model it waits to serve.
        ASSERT_TRUE(WaitFor([&] {
          return absl::StrContains(ReadFile(path("node-a.log")),
                                   "node node-a serves another model than the cluster's");
        }, absl::Seconds(60))) << ReadFile(path("node-a.log"));
        Process ctl({test::BinaryPath("ubepctl"),
                     absl::StrCat("--balancer=127.0.0.1:", balancer_port_), "status"},
                    path("ubepctl.out"));
        EXPECT_EQ(ctl.Wait(absl::Seconds(60)), 0);
        const std::string table = ReadFile(path("ubepctl.out"));
        EXPECT_THAT(table, ContainsRegex("node-a +127.0.0.1:[0-9]+ +0-1 +healthy +new model"));
        EXPECT_EQ(test::Sample(test::HttpGet(balancer_metrics_, "/metrics"),
                               "ubep_balancer_daemons_awaiting_model"),
                  1);
        EXPECT_THAT(table, HasSubstr("\nnode-a: its group's model is not the cluster's (4 ranks "
                                     "x 72 slots, 3 layers x 256 experts, hidden 32, top-8, 32 "
                                     "tokens, 4096 bytes per expert, DTYPE_FLOAT32); the cluster "
                                     "takes it once every node holding ranks of its model "
                                     "registers it\n"));
      }
      clients.push_back(StartClient(r, kSteps, r < 2 ? "node-a" : "node-b", /*slots_per_rank=*/72,
                                    /*tokens=*/32, /*drift_period=*/200,
                                    {absl::StrCat("--layers=", layers)}));
    }
    for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(120)), 0);
    ExpectConsistentRun(kSteps);
  }
  // node-a, the first to move, was refused (its daemon logs why); node-b started it over.
  EXPECT_THAT(ReadFile(path("node-a.log")),
              HasSubstr("failed: node node-a serves another model than the cluster's: "
                        "num_layers is 3, the cluster's 4 (the cluster takes it once every node "
                        "holding ranks of its model registers it)"));
  const std::string log = ReadFile(path("balancer.log"));
  EXPECT_THAT(log, HasSubstr("node node-b registers a group of 4 ranks x 72 slots, 3 layers x "
                             "256 experts, hidden 32, top-8, 32 tokens, 4096 bytes per expert, "
                             "DTYPE_FLOAT32; no node serves the cluster's 4 ranks x 72 slots, 4 "
                             "layers x 256 experts, hidden 32, top-8, 32 tokens, 4096 bytes per "
                             "expert, DTYPE_FLOAT32 any more: starting over with the new group"));
  for (const std::string node : {"node-a", "node-b"}) {
    const std::string daemon_log = ReadFile(path(node + ".log"));
    // The peer's arenas of each group: mapped twice.
    const std::string peer = node == "node-a" ? "2-3" : "0-1";
    const std::regex mapped("\\] mapped the arenas of ranks " + peer);
    EXPECT_EQ(std::distance(std::sregex_iterator(daemon_log.begin(), daemon_log.end(), mapped),
                            std::sregex_iterator()),
              2)
        << node << "\n" << daemon_log;
  }
}

// The lost node's daemon comes back as a new process, with new and empty arenas, and the
// node's serving processes, which outlived it, attach to it again. It stays
// drained (the plan keeps its ranks excluded, the survivors are not stalled), its group
// starts under the cluster's plan, and its peer maps the new arenas. Undrained, a plan takes its ranks
// back: their weights are staged from the survivors' slots, every client takes the new
// arenas, the group forms with 8 ranks again and every step of every rank stays exact.
TEST_F(BalancerTest, ARestartedDaemonIsUndrainedAndItsRanksServeExactlyAgain) {
  constexpr int kSteps = 1000000;  // Until the test stops them.
  world_ = 8;
  // Ten failed checks (3 s): a daemon slowed by a loaded machine is not taken for lost.
  auto balancer = StartBalancer({"--auto_rebalance=false", "--health_failures=10"});
  auto node_a = StartDaemon({"--ranks=0-3", "--free_buffers=72"}, "node-a");
  auto node_b = StartDaemon({"--ranks=4-7", "--free_buffers=72"}, "node-b");
  std::vector<std::unique_ptr<Process>> clients;
  // Node-b's clients wait for their daemon for longer than the test's waits before it comes
  // back (up to 90 s on a slow machine; the default, 60 s, counts from the kill).
  for (int r = 0; r < world_; ++r) {
    clients.push_back(r < 4 ? StartClient(r, kSteps, "node-a")
                            : StartClient(r, kSteps, "node-b", 72, 32, 200,
                                          {"--reattach_timeout=600s"}));
  }
  auto steps_under = [&](int r, uint64_t plan) {
    int n = 0;
    for (const test::StepLine& line : test::StepLines(ReadFile(ClientLog(r)))) n += line.plan == plan;
    return n;
  };
  auto logs = [&] {
    std::string all = ReadFile(path("balancer.log")) + ReadFile(path("node-a.log")) + ReadFile(path("node-b.log"));
    for (int r = 0; r < world_; ++r) all += ReadFile(ClientLog(r));
    return all;
  };
  ASSERT_TRUE(WaitFor([&] { return steps_under(0, 1) >= 30; }, absl::Seconds(60))) << logs();
  node_b->Signal(SIGKILL);
  EXPECT_EQ(node_b->Wait(absl::Seconds(10)), 128 + SIGKILL);
  ASSERT_TRUE(WaitFor([&] {
    for (int r = 0; r < 4; ++r) {
      if (steps_under(r, 2) < 20) return false;
    }
    return true;
  }, absl::Seconds(60))) << logs();

  // The daemon comes back; the node's serving processes, which waited for it (the example
  // tries for --reattach_timeout, 60 s), attach to it again.
  node_b = StartDaemon({"--ranks=4-7", "--free_buffers=72"}, "node-b");
  for (int r = 4; r < 8; ++r) EXPECT_TRUE(clients[r]->running()) << ReadFile(ClientLog(r));
  auto stub = v1::Control::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", balancer_port_), grpc::InsecureChannelCredentials()));
  auto cluster = [&] {
    grpc::ClientContext context;
    v1::ClusterStatus s;
    EXPECT_TRUE(stub->GetStatus(&context, v1::GetStatusRequest(), &s).ok());
    return s;
  };
  ASSERT_TRUE(WaitFor([&] {
    const v1::ClusterStatus s = cluster();
    return s.nodes_size() == 2 && s.nodes(1).healthy() && s.nodes(1).drained();
  }, absl::Seconds(30))) << logs();
  ASSERT_TRUE(WaitFor([&] {
    return ReadFile(path("node-a.log")).find("re-mapped the arenas of ranks 4-7") != std::string::npos;
  }, absl::Seconds(30))) << logs();
  // The new daemon's group started under the cluster's plan (its ranks excluded), not v1.
  EXPECT_THAT(ReadFile(path("node-b.log")),
              ::testing::ContainsRegex("\\(hosting 4-7\\), .* plan v2 \\(the cluster's, from ubep-balancer\\)"));
  EXPECT_THAT(ReadFile(path("balancer.log")),
              HasSubstr("node node-b restarted (a new ubepd process): its ranks stay excluded"));
  absl::SleepFor(absl::Seconds(1));  // Ticks in which a wrong re-inclusion would happen.
  v1::ClusterStatus status = cluster();
  EXPECT_EQ(status.plan_version(), 2u);
  EXPECT_THAT(status.excluded_ranks(), ::testing::ElementsAre(4, 5, 6, 7));
  for (int r = 4; r < 8; ++r) EXPECT_EQ(steps_under(r, 2), 0) << "rank " << r << " ran while excluded";

  {
    grpc::ClientContext context;
    v1::DrainRequest request;
    request.set_node("node-b");
    v1::RebalanceResponse response;
    const grpc::Status undrained = stub->Undrain(&context, request, &response);
    ASSERT_TRUE(undrained.ok()) << undrained.error_message() << "\n" << logs();
  }
  ASSERT_TRUE(WaitFor([&] {
    for (int r = 0; r < 8; ++r) {
      if (steps_under(r, 3) < 20) return false;
    }
    return true;
  }, absl::Seconds(120))) << logs();
  for (auto& c : clients) c->Signal(SIGKILL);
  for (auto& c : clients) c->Wait(absl::Seconds(10));
  status = cluster();
  EXPECT_EQ(status.plan_version(), 3u);
  EXPECT_THAT(status.excluded_ranks(), ::testing::IsEmpty());

  // Every step of every rank exact; where a step ran twice (stopped mid-step, run again after
  // the group re-formed) the last run counts; versions only grow; all ranks agree on each
  // step's plan, with one exception the protocol allows: the step in flight when node-b
  // died. Its ranks need no daemon to finish a step, so they may finish it under v1 (every
  // peer's partials had arrived) while the survivors, stopped by the membership change
  // before their own combine ended, run it again under v2, without them.
  std::map<uint64_t, uint64_t> plan_of_step;
  for (int r = 0; r < world_; ++r) {  // Survivors first: they ran every step.
    std::map<uint64_t, uint64_t> last;
    const std::string log = ReadFile(ClientLog(r));
    // The membership changes (v2 excludes node-b's ranks, v3 takes them back) stop the
    // group's waits, and the clients are told so, not that a rank of no such number left.
    EXPECT_THAT(log, ::testing::Not(::testing::ContainsRegex("rank [0-9]{3,} left the group")))
        << log;
    for (const test::StepLine& line : test::StepLines(log)) {
      EXPECT_TRUE(line.ok) << "rank " << r << " step " << line.step;
      last[line.step] = line.plan;
    }
    uint64_t version = 0, last_v1_step = 0;
    for (const auto& [step, plan] : last) {
      if (plan == 1) last_v1_step = step;
    }
    for (const auto& [step, plan] : last) {
      EXPECT_GE(plan, version) << "rank " << r << " step " << step;
      version = plan;
      auto [it, inserted] = plan_of_step.emplace(step, plan);
      const bool finished_before_leaving =
          r >= 4 && step == last_v1_step && plan == 1 && it->second == 2;
      if (!finished_before_leaving) {
        EXPECT_EQ(it->second, plan) << "rank " << r << " disagrees at step " << step;
      }
    }
  }
  // The survivors' Rejoin into the group of 8 mapped node-b's new arenas and kept their own:
  // the weights each took at attach were still mapped after it (a read of every page), and
  // they served on under v3.
  for (int r = 0; r < 4; ++r) {
    const std::string log = ReadFile(ClientLog(r));
    const size_t rejoined = log.rfind("; the weights taken at attach are mapped (");
    ASSERT_NE(rejoined, std::string::npos) << log;
    EXPECT_THAT(log.substr(rejoined), ::testing::ContainsRegex("plan 3 max_rel_err [^ ]+ ok"));
  }
  const std::string a_log = ReadFile(path("node-a.log"));
  EXPECT_THAT(a_log, HasSubstr("plan v3 changes the group's members (excluded: none)"));
  // The returning ranks were staged whole: 4 ranks x 72 slots x 4 layers, from ranks 0-3.
  EXPECT_THAT(ReadFile(path("node-b.log")),
              ::testing::ContainsRegex("prepared plan v3 for step [0-9]+: 1152 slots staged"));
  // After the 4-rank generations, one of all 8 ranks (the arenas of ranks 4-7 re-mapped).
  const size_t remapped = a_log.find("re-mapped the arenas of ranks 4-7");
  ASSERT_NE(remapped, std::string::npos);
  EXPECT_THAT(a_log.substr(remapped), ::testing::ContainsRegex("group formed: generation [0-9]+, 8 ranks, resuming"));
}

// node-b's daemon restarts while the balancer is down. The restarted balancer never saw its old
// process, so node-b registers as a new node serving ranks the plan keeps; node-a, which maps
// the old process's arenas for them (and so forms no group with them), says so when it
// registers again. node-b is then kept out as a restarted node: a plan without its ranks is
// committed, node-a maps its new arenas, and the survivors serve every step exactly.
TEST_F(BalancerTest, ADaemonRestartTheRestartedBalancerDidNotSeeIsToldByItsPeer) {
  constexpr int kSteps = 300;
  constexpr int kForever = 1000000;  // node-b's clients, excluded: until the test stops them.
  world_ = 8;
  // Ten failed checks (3 s): a daemon slowed by a loaded machine is not taken for lost.
  const std::vector<std::string> flags = {"--auto_rebalance=false", "--health_failures=10"};
  auto balancer = StartBalancer(flags);
  auto node_a = StartDaemon({"--ranks=0-3", "--free_buffers=72"}, "node-a");
  auto node_b = StartDaemon({"--ranks=4-7", "--free_buffers=72"}, "node-b");
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) {
    clients.push_back(r < 4 ? StartClient(r, kSteps, "node-a") : StartClient(r, kForever, "node-b"));
  }
  auto logs = [&] {
    std::string all = ReadFile(path("balancer.log")) + ReadFile(path("node-a.log")) + ReadFile(path("node-b.log"));
    for (int r = 0; r < world_; ++r) all += ReadFile(ClientLog(r));
    return all;
  };
  ASSERT_TRUE(WaitFor([&] { return test::StepLines(ReadFile(ClientLog(0))).size() >= 30; },
                      absl::Seconds(60)))
      << logs();
  balancer->Signal(SIGKILL);
  EXPECT_EQ(balancer->Wait(absl::Seconds(10)), 128 + SIGKILL);
  node_b->Signal(SIGKILL);
  EXPECT_EQ(node_b->Wait(absl::Seconds(10)), 128 + SIGKILL);
  // The new node-b is up before the balancer: it registers as soon as the balancer is back.
  node_b = StartDaemon({"--ranks=4-7", "--free_buffers=72"}, "node-b");
  balancer = StartBalancer(flags);  // Same port.
  for (int r = 0; r < 4; ++r) EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << logs();
  for (int r = 4; r < 8; ++r) clients[r]->Signal(SIGKILL);
  for (int r = 4; r < 8; ++r) clients[r]->Wait(absl::Seconds(10));
  const std::string balancer_log = ReadFile(path("balancer.log"));
  EXPECT_THAT(balancer_log, HasSubstr("node node-b restarted (node node-a maps an older ubepd "
                                      "process's arenas for its ranks 4, 5, 6, 7): its ranks stay "
                                      "excluded until it is undrained"));
  EXPECT_THAT(balancer_log, HasSubstr("rebalance (membership changed): plan v2"));
  const std::string a_log = ReadFile(path("node-a.log"));
  EXPECT_THAT(a_log, HasSubstr("re-mapped the arenas of ranks 4-7"));
  const std::map<uint64_t, uint64_t> plan_of_step = ExpectSurvivorsExact(4, kSteps);
  ASSERT_FALSE(plan_of_step.empty());
  auto stub = v1::Control::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", balancer_port_), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::ClusterStatus status;
  ASSERT_TRUE(stub->GetStatus(&context, v1::GetStatusRequest(), &status).ok());
  // v2, or a later try of it: the new node-b refuses a Prepare until it has mapped node-a's
  // arenas ("the arenas of the peer daemons' ranks are not mapped yet"), and the plan is
  // aborted and made again. No other plan is made (--auto_rebalance=false).
  EXPECT_GE(status.plan_version(), 2u);
  EXPECT_EQ(plan_of_step.rbegin()->second, status.plan_version()) << logs();
  uint64_t aborted = 0;
  for (absl::string_view line : absl::StrSplit(balancer_log, '\n')) {
    if (!absl::StrContains(line, "rebalance: ABORTED")) continue;
    ++aborted;
    EXPECT_THAT(line, HasSubstr("the arenas of the peer daemons' ranks are not mapped yet"));
  }
  EXPECT_EQ(aborted, status.plan_version() - 2) << balancer_log;
  EXPECT_THAT(status.excluded_ranks(), ::testing::ElementsAre(4, 5, 6, 7));
  ASSERT_EQ(status.nodes_size(), 2);
  EXPECT_EQ(status.nodes(1).node(), "node-b");
  EXPECT_TRUE(status.nodes(1).healthy());
  EXPECT_TRUE(status.nodes(1).drained());
}

// ubepd hosting the whole group crashes and restarts; the serving processes outlive it (the
// data plane does not need it), notice that it exited, stop the group and attach again. The
// new daemon asks the balancer for the cluster's plan to start under; here the balancer is
// paused meanwhile, so the group starts under round-robin v1, and once the balancer is back
// it brings the daemon to the cluster's plan (CatchUp) at a step ahead of the ranks; the
// daemon's reports, stale until then, count again. Every step stays exact.
TEST_F(BalancerTest, ServingOutlivesADaemonRestartAndTheDaemonCatchesUpOnTheClustersPlan) {
  constexpr int kSteps = 1000000;  // Until the test stops them.
  auto balancer = StartBalancer({"--auto_rebalance=false"});
  auto daemon = StartDaemon({"--free_buffers=16"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) clients.push_back(StartClient(r, kSteps));
  auto lines = [&](int r) { return test::StepLines(ReadFile(ClientLog(r))); };
  auto steps_under = [&](int r, uint64_t plan) {
    int n = 0;
    for (const test::StepLine& line : lines(r)) n += line.plan == plan;
    return n;
  };
  auto logs = [&] {
    std::string all = ReadFile(path("balancer.log")) + ReadFile(path("node-a.log"));
    for (int r = 0; r < world_; ++r) all += ReadFile(ClientLog(r));
    return all;
  };
  ASSERT_TRUE(WaitFor([&] { return steps_under(0, 1) >= 20; }, absl::Seconds(60))) << logs();
  auto stub = v1::Control::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", balancer_port_), grpc::InsecureChannelCredentials()));
  // A rebalance on demand, once the balancer has load statistics (before, it refuses or
  // keeps the placement).
  v1::RebalanceResponse rebalanced;
  grpc::Status status;
  ASSERT_TRUE(WaitFor([&] {
    grpc::ClientContext context;
    status = stub->Rebalance(&context, v1::RebalanceRequest(), &rebalanced);
    return status.ok() && rebalanced.version() >= 2;
  }, absl::Seconds(30))) << status.error_message() << "\n" << logs();
  ASSERT_EQ(rebalanced.version(), 2u) << logs();
  ASSERT_TRUE(WaitFor([&] {
    for (int r = 0; r < world_; ++r) {
      if (steps_under(r, 2) < 20) return false;
    }
    return true;
  }, absl::Seconds(60))) << logs();

  balancer->Signal(SIGSTOP);
  daemon->Signal(SIGKILL);
  EXPECT_EQ(daemon->Wait(absl::Seconds(10)), 128 + SIGKILL);
  std::vector<size_t> before(world_);
  for (int r = 0; r < world_; ++r) before[r] = lines(r).size();
  daemon = StartDaemon({"--free_buffers=16"});
  // The clients attach again and serve under the new daemon's first plan.
  ASSERT_TRUE(WaitFor([&] {
    for (int r = 0; r < world_; ++r) {
      const std::vector<test::StepLine> l = lines(r);
      if (l.size() < before[r] + 20 || l.back().plan != 1) return false;
    }
    return true;
  }, absl::Seconds(90))) << logs();
  balancer->Signal(SIGCONT);
  ASSERT_TRUE(WaitFor([&] {
    return ReadFile(path("balancer.log")).find("node node-a caught up on plan v2") != std::string::npos;
  }, absl::Seconds(60))) << logs();
  ASSERT_TRUE(WaitFor([&] {
    for (int r = 0; r < world_; ++r) {
      const std::vector<test::StepLine> l = lines(r);
      if (l.back().plan != 2 || steps_under(r, 2) < 40) return false;
    }
    return true;
  }, absl::Seconds(60))) << logs();
  // Reports under plan v2 are taken again: the stale count stops (the report spanning the
  // switch may still land), the accepted count grows.
  bool counting = false;
  std::string m1, m2;
  for (int i = 0; i < 10 && !counting; ++i) {
    m1 = test::HttpGet(balancer_metrics_, "/metrics");
    absl::SleepFor(absl::Milliseconds(1500));  // Five report intervals.
    m2 = test::HttpGet(balancer_metrics_, "/metrics");
    counting = test::Sample(m2, "ubep_balancer_stale_reports_total") ==
                   test::Sample(m1, "ubep_balancer_stale_reports_total") &&
               test::Sample(m2, "ubep_balancer_reports_total") > test::Sample(m1, "ubep_balancer_reports_total");
  }
  EXPECT_TRUE(counting) << m2 << logs();
  for (auto& c : clients) c->Signal(SIGKILL);
  for (auto& c : clients) c->Wait(absl::Seconds(10));

  // Every step exact; the clients' steps go on across the restart (where a step ran twice,
  // the last run counts) and all ranks agree on each step's plan.
  // The first rank to notice the exit stopped the others ("draining" in their waits).
  std::map<uint64_t, uint64_t> plan_of_step;
  int noticed = 0;
  for (int r = 0; r < world_; ++r) {
    const std::string log = ReadFile(ClientLog(r));
    noticed += log.find("ubepd exited (it closed this rank's fd connection)") != std::string::npos;
    EXPECT_THAT(log, ::testing::ContainsRegex("error step [0-9]+: rank [0-9]+: ubepd (exited|is draining)"));
    std::map<uint64_t, uint64_t> last;
    for (const test::StepLine& line : test::StepLines(log)) {
      EXPECT_TRUE(line.ok) << "rank " << r << " step " << line.step;
      last[line.step] = line.plan;
    }
    EXPECT_EQ(last.size(), last.rbegin()->first + 1) << "rank " << r << " skipped steps";
    for (const auto& [step, plan] : last) {
      auto [it, inserted] = plan_of_step.emplace(step, plan);
      EXPECT_EQ(it->second, plan) << "rank " << r << " disagrees at step " << step;
    }
  }
  EXPECT_GE(noticed, 1);
  const std::string a_log = ReadFile(path("node-a.log"));
  EXPECT_THAT(a_log, HasSubstr("plan v1 (round-robin)"));
  EXPECT_THAT(a_log, ::testing::ContainsRegex("committed plan v2 \\(effective at step [0-9]+\\)"));
}

TEST_F(BalancerTest, BalancerKilledBetweenPrepareAndCommitRestartsAndTheClusterStaysConsistent) {
  constexpr int kSteps = 1000;
  // The first balancer prepares plan v2 and then sits on its decision; the effective step is
  // far enough ahead that the restarted balancer decides before any rank gets there.
  auto balancer = StartBalancer({"--pause_before_commit=60s", "--effective_margin=8s"});
  auto daemon = StartDaemon({"--free_buffers=16"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) clients.push_back(StartClient(r, kSteps));
  ASSERT_TRUE(WaitFor([&] { return ReadFile(path("node-a.log")).find("prepared plan v2") != std::string::npos; },
                      absl::Seconds(60)))
      << ReadFile(path("balancer.log"));
  balancer->Signal(SIGKILL);
  EXPECT_EQ(balancer->Wait(absl::Seconds(10)), 128 + SIGKILL);
  balancer = StartBalancer({"--effective_margin=8s"});  // Same port: the daemon finds it again.
  for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(180)), 0);
  const std::map<uint64_t, uint64_t> plans = ExpectConsistentRun(kSteps);
  for (const auto& [step, version] : plans) ASSERT_NE(version, 2u) << "step " << step << " used the orphan";
  EXPECT_THAT(ReadFile(path("balancer.log")), HasSubstr("recovery: aborted orphan plan v2"));
  EXPECT_THAT(ReadFile(path("node-a.log")), HasSubstr("aborted plan v2"));
}

TEST_F(BalancerTest, DaemonThatCannotPrepareAbortsThePlanAndNobodySwitches) {
  constexpr int kSteps = 300;
  // The daemon refuses every plan: its effective step (at least --min_margin_steps, 10, ahead)
  // is more than one step ahead of its ranks'. (A --migration_budget above the daemons' free
  // buffers no longer makes such plans: the balancer keeps to the lesser.)
  auto balancer = StartBalancer();
  auto daemon = StartDaemon({"--max_plan_lead_steps=1"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < world_; ++r) clients.push_back(StartClient(r, kSteps));
  EXPECT_TRUE(WaitFor([&] {
    return test::Sample(test::HttpGet(balancer_metrics_, "/metrics"), "ubep_balancer_plans_aborted_total") >= 1;
  }, absl::Seconds(60))) << ReadFile(path("balancer.log"));
  for (auto& c : clients) EXPECT_EQ(c->Wait(absl::Seconds(120)), 0);
  for (const auto& [step, version] : ExpectConsistentRun(kSteps)) ASSERT_EQ(version, 1u) << step;
  EXPECT_THAT(ReadFile(path("balancer.log")), HasSubstr("is more than 1 steps ahead of rank 0's step"));
  EXPECT_EQ(test::Sample(test::HttpGet(balancer_metrics_, "/metrics"), "ubep_balancer_plan_version"), 1);
}

// A daemon stand-in with a real gRPC server: it holds plan v1 of 2 ranks x 4 slots,
// 2 layers x 8 experts, and answers the balancer's health checks and GetState (or, with
// `state_fails`, fails GetState: a daemon the balancer cannot recover yet).
class FakeDaemon final : public v1::DaemonControl::Service {
 public:
  explicit FakeDaemon(bool state_fails = false) : state_fails_(state_fails) {
    balancer::Plan plan;
    plan.version = 1;
    plan.topology = {2, 1, 4, 1};
    plan.num_experts = 8;
    for (int l = 0; l < 2; ++l) {
      balancer::LayerPlan layer;
      layer.slot_expert = {0, 1, 2, 3, 4, 5, 6, 7};
      balancer::SetEqualShares(8, layer);
      plan.layer_ids.push_back(l);
      plan.layers.push_back(layer);
    }
    plan_ = balancer::ToProto(plan);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeDaemon() override { server_->Shutdown(); }
  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::DaemonState* state) override {
    if (state_fails_) return grpc::Status(grpc::StatusCode::INTERNAL, "state lost for the test");
    state->set_node("fake");
    state->set_committed_version(1);
    *state->mutable_committed_plan() = plan_;
    return grpc::Status::OK;
  }
  int port() const { return port_; }

 private:
  const bool state_fails_;
  v1::Plan plan_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// The balancer's own UNAVAILABLE ("node-b is still being recovered": it marks its errors,
// rpc_origin.h) is not a balancer ubepctl cannot reach: ubepctl says what the balancer said.
TEST_F(BalancerTest, UbepctlTellsTheBalancersOwnUnavailableFromAnUnreachableBalancer) {
  FakeDaemon a, b(/*state_fails=*/true);
  auto balancer = StartBalancer({"--auto_rebalance=false"});
  auto stub = v1::Control::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", balancer_port_),
                                                       grpc::InsecureChannelCredentials()));
  for (auto [node, fake, rank] : {std::tuple{"node-a", &a, 0u}, std::tuple{"node-b", &b, 1u}}) {
    v1::RegisterRequest reg;
    reg.set_node(node);
    reg.set_address(absl::StrCat("127.0.0.1:", fake->port()));
    reg.set_world_size(2);
    reg.add_ranks(rank);
    reg.mutable_shape()->set_num_layers(2);
    reg.mutable_shape()->set_num_experts(8);
    reg.mutable_shape()->set_slots_per_rank(4);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RegisterResponse registered;
    const grpc::Status status = stub->Register(&context, reg, &registered);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  // Once node-a's plan is learned (before, "no plan known yet"), a rebalance waits for node-b.
  std::string out;
  ASSERT_TRUE(WaitFor([&] {
    std::filesystem::remove(path("ubepctl.out"));  // Written on, not over.
    Process ctl({test::BinaryPath("ubepctl"), absl::StrCat("--balancer=127.0.0.1:", balancer_port_),
                 "rebalance"},
                path("ubepctl.out"));
    const std::optional<int> code = ctl.Wait(absl::Seconds(60));
    out = ReadFile(path("ubepctl.out"));
    return code == 1 && !absl::StrContains(out, "no plan known yet");
  }, absl::Seconds(60))) << out;
  EXPECT_EQ(out, "ubepctl: rebalance: node node-b is still being recovered\n");
}

// Flag values no balancer could run with are refused at start, exit 2, naming the flag: a
// zero interval would spin its loop, a zero health interval mark every daemon down, a
// negative step margin put effective steps behind the ranks.
TEST_F(BalancerTest, FlagValuesItCannotRunWithAreRefusedAtStart) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--interval=0s", "ubep-balancer: --interval 0 is not positive\n"},
      {"--health_interval=-1s", "ubep-balancer: --health_interval -1s is not positive\n"},
      {"--rpc_timeout=0s", "ubep-balancer: --rpc_timeout 0 is not positive\n"},
      {"--rpc_timeout=inf",
       "ubep-balancer: --rpc_timeout inf is not a time (every wait has an end: under 1000000h)\n"},
      {"--rpc_timeout=1000000h", "ubep-balancer: --rpc_timeout 1000000h is not a time (every "
                                 "wait has an end: under 1000000h)\n"},
      {"--recovery_grace=inf",
       "ubep-balancer: --recovery_grace inf is not a time (every wait has an end: under 1000000h)\n"},
      {"--min_margin_steps=-20", "ubep-balancer: --min_margin_steps -20 is negative\n"},
      {"--window=0",
       "ubep-balancer: --ewma in [0, 1], --window, --trigger_windows and --health_failures >= 1, "
       "--threshold >= 1\n"},
      {"--threshold=nan",
       "ubep-balancer: --ewma in [0, 1], --window, --trigger_windows and --health_failures >= 1, "
       "--threshold >= 1\n"},
      {"--effective_margin=-1s", "ubep-balancer: --effective_margin -1s is negative\n"},
      {"--registration_grace=-5s", "ubep-balancer: --registration_grace -5s is negative\n"},
      {"--migration_budget=-5",
       "ubep-balancer: --migration_budget -5 is below -1 (-1: the daemons' free weight "
       "buffers)\n"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [flag, message] = cases[i];
    const std::string log = path(absl::StrCat("flag", i, ".log"));
    Process p({test::BinaryPath("ubep-balancer"), "--listen=127.0.0.1:0", "--metrics=", flag}, log);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 2) << flag;
    EXPECT_EQ(ReadFile(log), message);
  }
}

// The ready file: one a killed balancer left is gone before a balancer starts (here one that
// cannot start, its metrics port taken by the running one's), so that nobody waiting takes
// its port for live; a running balancer's, one that cannot be written, or a path naming
// something else stops the balancer (exit 1, named); a balancer that stops removes its own.
TEST_F(BalancerTest, TheReadyFileOfARunBeforeIsClearedAndOneThatCannotBeWrittenStopsIt) {
  auto balancer = StartBalancer({"--auto_rebalance=false"});
  // The file of a process that has exited (waited for: its pid names no process now).
  Process gone({"/bin/true"}, path("gone.log"));
  ASSERT_EQ(gone.Wait(absl::Seconds(30)), 0);
  const std::string stale =
      dir_.Write("stale.ready", absl::StrCat("{\"pid\": ", gone.pid(), ", \"port\": 1}\n"));
  {
    Process p({test::BinaryPath("ubep-balancer"), "--listen=127.0.0.1:0",
               absl::StrCat("--metrics=127.0.0.1:", balancer_metrics_), "--ready_file=" + stale},
              path("metrics-taken.log"));
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 1);
    EXPECT_THAT(ReadFile(path("metrics-taken.log")),
                HasSubstr(absl::StrCat("ubep-balancer: --metrics 127.0.0.1:", balancer_metrics_, ": ")));
    EXPECT_FALSE(std::filesystem::exists(stale));
  }
  std::filesystem::create_directories(path("dir.ready"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      // The running balancer's: left to it (the balancer holds no lock on the path).
      {path("balancer.ready"),
       absl::StrCat("ubep-balancer: --ready_file: ", path("balancer.ready"),
                    " is the ready file of process ", balancer->pid(),
                    ", which is running: is another server using this path?\n")},
      {"/nonexistent/ready.json",
       "ubep-balancer: --ready_file: /nonexistent/ready.json: cannot write: No such file or "
       "directory\n"},
      {path("dir.ready"),
       "ubep-balancer: --ready_file: " + path("dir.ready") +
           " exists and is not a regular file (a directory); not replacing it: is the ready "
           "file's path right?\n"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string log = path(absl::StrCat("ready", i, ".log"));
    Process p({test::BinaryPath("ubep-balancer"), "--listen=127.0.0.1:0", "--metrics=",
               "--ready_file=" + cases[i].first},
              log);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 1) << cases[i].first;
    // Said before it serves (nothing else logged: no port bound, no daemon told of it).
    EXPECT_EQ(ReadFile(log), cases[i].second);
  }
  ASSERT_TRUE(std::filesystem::exists(path("balancer.ready")));
  EXPECT_EQ(nlohmann::json::parse(ReadFile(path("balancer.ready")))["pid"].get<pid_t>(),
            balancer->pid());
  balancer->Signal(SIGTERM);
  EXPECT_EQ(balancer->Wait(absl::Seconds(30)), 0);
  EXPECT_FALSE(std::filesystem::exists(path("balancer.ready")));
}

TEST_F(BalancerTest, MalformedReportsAreRejectedWithTheReasonCountedAndTheBalancerKeepsRunning) {
  FakeDaemon fake;
  auto balancer = StartBalancer({"--auto_rebalance=false"});
  auto stub = v1::Control::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", balancer_port_),
                                                       grpc::InsecureChannelCredentials()));
  auto call = [&](auto method, const auto& request, auto* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ((*stub).*method)(&context, request, response);
  };
  v1::RegisterRequest reg;
  reg.set_node("fake");
  reg.set_address(absl::StrCat("127.0.0.1:", fake.port()));
  reg.set_world_size(2);
  reg.add_ranks(0);
  reg.add_ranks(1);
  reg.mutable_shape()->set_num_layers(2);
  reg.mutable_shape()->set_num_experts(8);
  reg.mutable_shape()->set_slots_per_rank(4);
  v1::RegisterResponse registered;
  ASSERT_TRUE(call(&v1::Control::Stub::Register, reg, &registered).ok());

  uint64_t seq = 0;
  auto report = [&](std::function<void(v1::ReportLoadRequest&)> mutate) {
    v1::ReportLoadRequest q;
    q.set_node("fake");
    q.set_seq(++seq);
    q.set_max_step(10);
    v1::LoadReport* load = q.mutable_load();
    load->set_reporter("fake");
    load->set_plan_version(1);
    load->set_num_experts(8);
    load->set_first_step(0);
    load->set_last_step(10);
    for (int l = 0; l < 2; ++l) {
      v1::LayerLoad* layer = load->add_layers();
      layer->set_layer(l);
      for (int p = 0; p < 8; ++p) layer->add_slot(10 + p);
    }
    mutate(q);
    v1::ReportLoadResponse response;
    return call(&v1::Control::Stub::ReportLoad, q, &response);
  };
  // Until the balancer has read the plan from the daemon, reports cannot be attributed.
  ASSERT_TRUE(WaitFor([&] { return report([](auto&) {}).ok(); }, absl::Seconds(20)));
  ASSERT_TRUE(report([](auto&) {}).ok());
  const uint64_t accepted = seq;  // The last sequence number the balancer took (2 or more).

  struct Case {
    std::function<void(v1::ReportLoadRequest&)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& q) { q.set_node("ghost"); }, grpc::StatusCode::NOT_FOUND,
       "node \"ghost\" is not registered; register first"},
      {[&](auto& q) { q.set_seq(accepted - 1); }, grpc::StatusCode::INVALID_ARGUMENT,
       absl::StrCat("report seq ", accepted - 1, " of node fake is before ", accepted,
                    ", the last one taken (reordered)")},
      {[](auto& q) { q.set_seq(0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "report of node fake has seq 0; a daemon numbers its reports from 1"},
      {[](auto& q) { q.mutable_load()->add_layers()->set_layer(2); },
       grpc::StatusCode::INVALID_ARGUMENT, "report has 3 layers; the model has 2"},
      {[](auto& q) {
         q.mutable_load()->mutable_layers(0)->set_layer(1);
         q.mutable_load()->mutable_layers(1)->set_layer(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "load.layers[0] is layer 1; plan v1 has layer 0 there"},
      {[](auto& q) { q.mutable_load()->mutable_layers(0)->set_slot(1, static_cast<uint64_t>(-5)); },
       grpc::StatusCode::INVALID_ARGUMENT, "load.layers[0].slot[1]: count -5 is negative"},
      {[](auto& q) { q.mutable_load()->mutable_layers(1)->add_dispatches(static_cast<uint64_t>(-3)); },
       grpc::StatusCode::INVALID_ARGUMENT, "load.layers[1].dispatches[0]: count -3 is negative"},
      {[](auto& q) { q.mutable_load()->set_plan_version(0); }, grpc::StatusCode::FAILED_PRECONDITION,
       "report counted under plan v0 (steps 0-10); plan v1 is in force from step 0"},
  };
  for (const Case& c : cases) {
    const grpc::Status status = report(c.mutate);
    EXPECT_EQ(status.error_code(), c.code) << c.message;
    EXPECT_EQ(status.error_message(), c.message);
  }
  const grpc::Status short_layer = report([](auto& q) { q.mutable_load()->mutable_layers(1)->mutable_slot()->RemoveLast(); });
  EXPECT_EQ(short_layer.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(short_layer.error_message(),
            "load.layers[1] covers slots [0, 7); node fake hosts slots [0, 8)");
  // Still serving, and every rejection was counted by its reason.
  EXPECT_TRUE(report([](auto&) {}).ok());
  const std::string m = test::HttpGet(balancer_metrics_, "/metrics");
  EXPECT_EQ(test::Sample(m, "ubep_balancer_rejected_reports_total{reason=\"unknown_node\"}"), 1);
  EXPECT_EQ(test::Sample(m, "ubep_balancer_rejected_reports_total{reason=\"out_of_order\"}"), 1);
  EXPECT_EQ(test::Sample(m, "ubep_balancer_rejected_reports_total{reason=\"malformed\"}"), 4);
  EXPECT_EQ(test::Sample(m, "ubep_balancer_rejected_reports_total{reason=\"negative\"}"), 2);
  EXPECT_EQ(test::Sample(m, "ubep_balancer_rejected_reports_total{reason=\"stale_plan\"}"), 1);
  EXPECT_EQ(test::Sample(m, "ubep_balancer_stale_reports_total"), 1);
  EXPECT_TRUE(balancer->running());
}

}  // namespace
}  // namespace ubep
