// The main job and the operator's tools end to end: ubep-local (balancer, 2 daemons, 8 serving
// ranks on the host backend) runs a scenario from the bundled traces while a real Prometheus
// server (Debian's package) scrapes the daemons and the balancer, every query of the Grafana
// dashboard returns data from it, and ubepctl reads status, exports the plan (which
// ubep-balance eval accepts), drains and undrains a node. Label: integration;ops.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tests/unit/loopback.h"

namespace ubep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using test::Process;
using test::ReadFile;
using test::WaitFor;

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += absl::StrFormat("%%%02X", c);
    }
  }
  return out;
}

class LocalTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_.path() + "/" + name; }

  // Runs a command to completion (at most 60 s); its exit code, output in `output`.
  int Run(std::vector<std::string> argv, std::string* output) {
    const std::string out = path(absl::StrCat("cmd-", ++commands_, ".out"));
    Process p(std::move(argv), out);
    const std::optional<int> code = p.Wait(absl::Seconds(60));
    *output = ReadFile(out);
    return code.value_or(-1);
  }

  std::string Ctl(const std::vector<std::string>& args, int* code) {
    std::vector<std::string> argv = {test::BinaryPath("ubepctl"), "--balancer=" + balancer_};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string output;
    *code = Run(argv, &output);
    return output;
  }

  // ubep-local for a run that does not end by itself (4 ranks, 2 daemons), started in `local`
  // with its report in path("report"), once its ranks step: its working directory ("" if it
  // did not get there within 60 s each, with a failure added). Its balancer listens on
  // 127.0.0.2, not the default's 127.0.0.1: the daemons (and cluster.json) dial where it is.
  std::string StartLongRun(std::unique_ptr<Process>& local) {
    const std::string report = path("report");
    local = std::make_unique<Process>(
        std::vector<std::string>{test::BinaryPath("ubep-local"), "--ranks=4", "--daemons=2",
                                 "--steps=1000000", "--report=" + report,
                                 "--listen=127.0.0.2:0", "--metrics_port=0"},
        path("local.out"));
    if (!WaitFor([&] { return std::filesystem::exists(report + "/cluster.json"); },
                 absl::Seconds(60))) {
      ADD_FAILURE() << ReadFile(path("local.out"));
      return "";
    }
    const nlohmann::json cluster = nlohmann::json::parse(ReadFile(report + "/cluster.json"));
    EXPECT_THAT(cluster["balancer"].get<std::string>(), ::testing::StartsWith("127.0.0.2:"));
    const std::string workdir = cluster["workdir"];
    if (!WaitFor([&] { return ReadFile(path("local.out")).find("step ") != std::string::npos; },
                 absl::Seconds(60))) {
      ADD_FAILURE() << ReadFile(path("local.out"));
      return "";
    }
    return workdir;
  }

  // The processes whose command lines name `workdir` (ubep-local's children), and `binary`
  // where it is not empty.
  static std::vector<pid_t> ChildrenOf(const std::string& workdir, const std::string& binary) {
    std::vector<pid_t> pids;
    for (const auto& e : std::filesystem::directory_iterator("/proc")) {
      const std::string cmdline = ReadFile(e.path().string() + "/cmdline");
      if (cmdline.find(workdir) == std::string::npos) continue;
      if (!binary.empty() && cmdline.find(binary) == std::string::npos) continue;
      pids.push_back(std::stoi(e.path().filename().string()));
    }
    return pids;
  }

  nlohmann::json Status() {
    int code = 0;
    const std::string out = Ctl({"--json", "status"}, &code);
    EXPECT_EQ(code, 0) << out;
    try {
      return nlohmann::json::parse(out);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "status --json is not JSON: " << out;
      return nlohmann::json::object();
    }
  }

  test::TempDir dir_;
  std::string balancer_;
  int commands_ = 0;
};

TEST_F(LocalTest, UbepLocalServedWhilePrometheusScrapesAndUbepctlOperates) {
  const std::string report = path("report");
  auto local = std::make_unique<Process>(
      std::vector<std::string>{test::BinaryPath("ubep-local"), "--ranks=8", "--daemons=2",
                               "--steps=900", "--policy=ubep", "--report=" + report,
                               // 64 slots: the 4 ranks left after a drain hold every expert.
                               "--slots_per_rank=64",
                               "--listen=127.0.0.1:0", "--metrics_port=0"},
      path("local.out"));
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(report + "/prometheus-targets.json"); },
                      absl::Seconds(60)))
      << ReadFile(path("local.out"));
  const nlohmann::json cluster = nlohmann::json::parse(ReadFile(report + "/cluster.json"));
  balancer_ = cluster["balancer"];

  // A real Prometheus scraping every second, targets from ubep-local's file. Its port is
  // found free and then given to it: if something else listens there first, Prometheus exits
  // saying so, and it is started again on another port (three tries). Ready is read from its
  // own log, not from the port, which another server may hold.
  {
    std::ofstream config(path("prometheus.yml"));
    config << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"

           << "scrape_configs:\n  - job_name: ubep\n    file_sd_configs:\n      - files: ['"
           << report << "/prometheus-targets.json']\n        refresh_interval: 1s\n";
  }
  int prom_port = 0;
  std::unique_ptr<Process> prometheus;
  for (int attempt = 1; attempt <= 3; ++attempt) {
    prom_port = FreePort();
    const std::string log = path(absl::StrCat("prometheus-", attempt, ".log"));
    prometheus = std::make_unique<Process>(
        std::vector<std::string>{"/usr/bin/prometheus", "--config.file=" + path("prometheus.yml"),
                                 "--storage.tsdb.path=" + path("prometheus-data"),
                                 absl::StrCat("--web.listen-address=127.0.0.1:", prom_port)},
        log);
    // Exited (Wait reaps it), or ready.
    auto exited = [&] { return prometheus->Wait(absl::ZeroDuration()).has_value(); };
    ASSERT_TRUE(WaitFor([&] {
      return exited() ||
             ReadFile(log).find("Server is ready to receive web requests") != std::string::npos;
    }, absl::Seconds(60))) << ReadFile(log);
    if (!exited()) break;
    ASSERT_THAT(ReadFile(log), HasSubstr("address already in use"));
    ASSERT_LT(attempt, 3) << ReadFile(log);
  }

  // Both nodes registered with their ranks; then the first rebalance.
  ASSERT_TRUE(WaitFor([&] {
    const nlohmann::json s = Status();
    return s.contains("nodes") && s["nodes"].size() == 2 && s["world_size"] == 8;
  }, absl::Seconds(60))) << ReadFile(path("local.out"));
  ASSERT_TRUE(WaitFor([&] { return Status().value("plan_version", 0) > 1; }, absl::Seconds(90)))
      << ReadFile(path("local.out"));
  nlohmann::json s = Status();
  // 64-bit integers are JSON numbers (protobuf's JSON writes strings), a NaN null.
  EXPECT_TRUE(s["plan_version"].is_number_unsigned()) << s.dump();
  EXPECT_TRUE(s["plans_committed"].is_number_unsigned()) << s.dump();
  EXPECT_TRUE(s["nodes"][0]["max_step"].is_number_unsigned()) << s.dump();
  for (const nlohmann::json& b : s["imbalance"]) EXPECT_TRUE(b.is_null() || b.is_number()) << b;
  EXPECT_EQ(s["nodes"][0]["node"], "node-0");
  EXPECT_EQ(s["nodes"][0]["ranks"], nlohmann::json({0, 1, 2, 3}));
  EXPECT_EQ(s["nodes"][1]["ranks"], nlohmann::json({4, 5, 6, 7}));
  EXPECT_TRUE(s["nodes"][1]["healthy"].get<bool>());
  int code = 0;
  // ubepd's gRPC port is not the balancer's: said so, not an empty message.
  std::string out;
  EXPECT_EQ(Run({test::BinaryPath("ubepctl"),
                 "--balancer=" + s["nodes"][0]["address"].get<std::string>(), "status"},
                &out),
            1);
  EXPECT_EQ(out, absl::StrCat("ubepctl: status: the server at ", s["nodes"][0]["address"].get<std::string>(),
                              " does not serve ubep.v1.Control (UNIMPLEMENTED): is --balancer "
                              "ubep-balancer's address?\n"));
  const std::string table = Ctl({"status"}, &code);
  EXPECT_EQ(code, 0);
  EXPECT_THAT(table, HasSubstr("node-1"));
  EXPECT_THAT(table, HasSubstr("4-7"));
  EXPECT_THAT(table, HasSubstr("excluded: none"));

  // The exported EPLB-format plan is accepted by ubep-balance eval; SGLang's form has the map.
  const std::string exported = path("plan.json");
  out = Ctl({"plan", "export", "--format=eplb", "--out=" + exported}, &code);
  ASSERT_EQ(code, 0) << out;
  {
    // The model's 4 MoE layers are the trace's first 4: the load file for eval has those.
    const nlohmann::json trace =
        nlohmann::json::parse(ReadFile(test::TracePath("decode_in1000out1000.json")));
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& row : trace["logical_count"]) {
      double sum = 0;
      for (const auto& v : row) sum += v.get<double>();
      if (sum > 0 && rows.size() < 4) rows.push_back(row);
    }
    std::ofstream(path("load4.json")) << nlohmann::json{{"logical_count", rows}}.dump();
  }
  EXPECT_EQ(Run({test::BinaryPath("ubep-balance"), "eval", "--plan", exported, "--load",
                 path("load4.json")},
                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("balancedness"));
  out = Ctl({"plan", "export", "--format=sglang"}, &code);
  ASSERT_EQ(code, 0);
  const nlohmann::json sglang = nlohmann::json::parse(out);
  ASSERT_EQ(sglang["physical_to_logical_map"].size(), 4u);
  EXPECT_EQ(sglang["physical_to_logical_map"][0].size(), 8u * 64u);
  // The daemons number the layers 0..3; with the model's first MoE layer given, the map has a
  // row per model layer, the dense ones first with the trivial placement.
  out = Ctl({"plan", "export", "--format=sglang", "--first_moe_layer=3"}, &code);
  ASSERT_EQ(code, 0) << out;
  const nlohmann::json shifted = nlohmann::json::parse(out);
  ASSERT_EQ(shifted["physical_to_logical_map"].size(), 7u);
  EXPECT_EQ(shifted["physical_to_logical_map"][3], sglang["physical_to_logical_map"][0]);
  EXPECT_EQ(shifted["physical_to_logical_map"][6], sglang["physical_to_logical_map"][3]);
  EXPECT_EQ(shifted["physical_to_logical_map"][0][257], 1);  // Slot 257 of 256 experts.
  // A first layer whose plan would end past model layer 2^20 is refused, not gigabytes of rows.
  out = Ctl({"plan", "export", "--format=sglang", "--first_moe_layer=1048574"}, &code);
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, ::testing::MatchesRegex("ubepctl: --first_moe_layer 1048574: plan v[0-9]+'s 4 "
                                            "layers would end past model layer 2\\^20\n(.|\n)*"));
  // An answer standard output cannot take (a full disk) fails, saying so.
  EXPECT_EQ(Run({"/bin/sh", "-c",
                 absl::StrCat(test::BinaryPath("ubepctl"), " --balancer=", balancer_,
                              " plan export --format=sglang >/dev/full")},
                &out),
            1);
  EXPECT_EQ(out, "ubepctl: standard output could not be written in full\n");
  out = Ctl({"plan", "export", "--format=csv"}, &code);
  EXPECT_EQ(code, 2);
  EXPECT_THAT(out, HasSubstr("ubepctl: --format csv: expected eplb or sglang"));

  // Drain node-1: its ranks leave the group; undrain: they come back.
  out = Ctl({"drain", "node-1"}, &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("drain node-1: plan v"));
  s = Status();
  EXPECT_EQ(s["excluded_ranks"], nlohmann::json({4, 5, 6, 7}));
  EXPECT_TRUE(s["nodes"][1]["drained"].get<bool>());
  out = Ctl({"--json", "plan", "show"}, &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["excluded_ranks"], nlohmann::json({4, 5, 6, 7}));
  // SGLang's map has no shares: a plan excluding ranks is not exported in it.
  out = Ctl({"plan", "export", "--format=sglang"}, &code);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(out, ::testing::StartsWith("ubepctl: plan export: plan v"));
  EXPECT_THAT(out, ::testing::EndsWith(" excludes ranks 4,5,6,7; SGLang's map has no shares, so "
                                       "their slots would serve their experts: export it once "
                                       "every rank is back (or use --format=eplb, with a reader "
                                       "that honours its shares)\n"));
  // EPLB's arrays list the excluded slots among the replicas, with share 0: written, and said.
  out = Ctl({"plan", "export", "--format=eplb"}, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr(" excludes ranks 4,5,6,7: their slots are listed with share 0; a "
                             "reader that takes log2phy and logcnt without the shares would "
                             "send them traffic\n"));
  out = Ctl({"drain", "node-9"}, &code);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(out, HasSubstr("ubepctl: drain node-9: node \"node-9\" is not registered"));
  // A node that serves cannot be forgotten (only one down for good, its ranks out of the plan).
  out = Ctl({"forget", "node-1"}, &code);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(out, HasSubstr("ubepctl: forget node-1: node node-1 passes its health checks; only "
                             "a node that is down can be forgotten (stop its daemon first)"));
  out = Ctl({"undrain", "node-1"}, &code);
  ASSERT_EQ(code, 0) << out;
  s = Status();
  EXPECT_FALSE(s.contains("excluded_ranks") && !s["excluded_ranks"].empty()) << s.dump();
  EXPECT_FALSE(s["nodes"][1]["drained"].get<bool>());
  out = Ctl({"rebalance"}, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("rebalance: plan v"));

  // Every query of the dashboard returns data from the real Prometheus.
  const nlohmann::json dashboard =
      nlohmann::json::parse(ReadFile(std::string(UBEP_SOURCE_DIR) + "/deploy/grafana/ubep-dashboard.json"));
  std::vector<std::string> exprs;
  for (const auto& panel : dashboard["panels"]) {
    for (const auto& target : panel["targets"]) exprs.push_back(target["expr"]);
  }
  ASSERT_GE(exprs.size(), 12u);
  for (const std::string& expr : exprs) {
    std::string body;
    EXPECT_TRUE(WaitFor([&] {
      body = HttpGet(prom_port, "/api/v1/query?query=" + UrlEncode(expr));
      if (body.empty()) return false;
      const nlohmann::json r = nlohmann::json::parse(body, nullptr, false);
      return !r.is_discarded() && r.value("status", "") == "success" &&
             !r["data"]["result"].empty();
    }, absl::Seconds(60)))
        << expr << " -> " << body;
  }

  // Every metric the alert rules name is one the real daemons and balancer export (a renamed
  // metric would leave its alert silent for good).
  {
    const std::string rules =
        ReadFile(std::string(UBEP_SOURCE_DIR) + "/deploy/k8s/base/prometheusrule.yaml");
    std::set<std::string> names;
    for (size_t at = rules.find("ubep_"); at != std::string::npos; at = rules.find("ubep_", at)) {
      size_t end = at;
      while (end < rules.size() && (std::islower(rules[end]) || rules[end] == '_')) ++end;
      names.insert(rules.substr(at, end - at));
      at = end;
    }
    ASSERT_GE(names.size(), 10u);
    for (const std::string& name : names) {
      std::string body;
      EXPECT_TRUE(WaitFor([&] {
        body = HttpGet(prom_port, "/api/v1/query?query=" +
                                      UrlEncode(absl::StrCat("count({__name__=\"", name, "\"})")));
        const nlohmann::json r = nlohmann::json::parse(body, nullptr, false);
        return !r.is_discarded() && r.value("status", "") == "success" &&
               !r["data"]["result"].empty();
      }, absl::Seconds(30)))
          << name << " -> " << body;
    }
  }

  // The run ends on its own; the report shows the rebalance and every step correct.
  ASSERT_EQ(local->Wait(absl::Seconds(300)), 0) << ReadFile(path("local.out"));
  const nlohmann::json r = nlohmann::json::parse(ReadFile(report + "/report.json"));
  EXPECT_TRUE(r["correct"].get<bool>()) << r.dump(2);
  EXPECT_EQ(r["steps"], 900);
  ASSERT_TRUE(r["rebalances"].is_number_integer() && r["migrated_slots"].is_number_integer()) << r.dump(2);
  EXPECT_GE(r["rebalances"].get<int64_t>(), 3);  // The first, the drain, the undrain.
  EXPECT_GT(r["imbalance_before"].get<double>(), 1.5);
  EXPECT_LT(r["imbalance_after"].get<double>(), r["imbalance_before"].get<double>());
  EXPECT_GT(r["migrated_slots"].get<int64_t>(), 0);
  EXPECT_TRUE(std::filesystem::exists(report + "/report.png"));
  EXPECT_EQ(r["picture"], "report.png");
  EXPECT_THAT(ReadFile(report + "/report.md"), HasSubstr("| every step equal to its float64 reference | yes |"));
}

// --max_recv_rows=1 reaches every daemon: every step routes some rank more than one row, so
// every rank drops every step (the call fails on all of them at once), the run still ends
// well (no served step is wrong), and the report and the summary count the dropped steps.
TEST_F(LocalTest, AReceiveCapacityDropsTheStepsOnEveryRankAndTheReportCountsThem) {
  const std::string report = path("report");
  Process local({test::BinaryPath("ubep-local"), "--ranks=4", "--daemons=2", "--steps=60",
                 "--policy=none", "--max_recv_rows=1", "--report=" + report,
                 "--listen=127.0.0.1:0", "--metrics_port=0"},
                path("local.out"));
  ASSERT_EQ(local.Wait(absl::Seconds(120)), 0) << ReadFile(path("local.out"));
  EXPECT_THAT(ReadFile(path("local.out")),
              HasSubstr("no step served, 60 steps dropped over the receive capacity"));
  const nlohmann::json r = nlohmann::json::parse(ReadFile(report + "/report.json"));
  EXPECT_EQ(r["max_recv_rows"], 1);
  EXPECT_EQ(r["dropped_steps"], 60);
  EXPECT_EQ(r["served_steps"], 0);
  EXPECT_EQ(r["last_dropped_step"], 59);
  EXPECT_EQ(r["correct"], true);
  EXPECT_THAT(ReadFile(report + "/report.md"),
              HasSubstr("| every step equal to its float64 reference | no step served (each was "
                        "dropped over the receive capacity) |"));
  // A picture, also where the run ended before the balancer closed an interval (no
  // imbalance over time: the two load panels alone).
  EXPECT_EQ(r["picture"], "report.png");
  EXPECT_TRUE(std::filesystem::exists(report + "/report.png"));
}

// ubepctl against a balancer that is not there, and against one that takes the connection
// and never answers (busy, as with a plan change in flight): each said for what it is.
TEST_F(LocalTest, UbepctlSaysWhetherTheBalancerIsUnreachableOrDidNotAnswerInTime) {
  std::string out;
  EXPECT_EQ(Run({test::BinaryPath("ubepctl"), "--balancer=127.0.0.1:1", "--timeout=2s", "status"},
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("ubepctl: cannot reach ubep-balancer at 127.0.0.1:1: "));
  test::LoopbackListener silent;  // Listens, never speaks.
  ASSERT_GE(silent.fd(), 0);
  const std::string balancer = absl::StrCat("127.0.0.1:", silent.port());
  EXPECT_EQ(Run({test::BinaryPath("ubepctl"), "--balancer=" + balancer, "--timeout=1s", "drain",
                 "node-x"},
                &out),
            1);
  EXPECT_EQ(out, absl::StrCat("ubepctl: drain node-x: no answer from ubep-balancer at ", balancer,
                              " within --timeout 1s (unreachable, or busy: a change asked for "
                              "may still be made; see ubepctl status)\n"));
  silent.Close();
  EXPECT_EQ(Run({test::BinaryPath("ubepctl"), "--timeout=0s", "status"}, &out), 2);
  EXPECT_THAT(out, ::testing::StartsWith("ubepctl: --timeout 0 is not positive\n"));
}

// Flags that cannot apply are refused before any call (no balancer runs here: a call would
// exit 1, "cannot reach"); --help lists ubepctl's flags and --version names UBEP's version.
TEST_F(LocalTest, UbepctlRefusesFlagsThatCannotApplyBeforeAnyCall) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--balancer=127.0.0.1", "status"}, "ubepctl: --balancer 127.0.0.1: expected HOST:PORT\n"},
      {{"--out=plan.json", "status"}, "ubepctl: --out applies to plan export only\n"},
      {{"--format=sglang", "plan", "show"}, "ubepctl: --format applies to plan export only\n"},
      {{"--first_moe_layer=3", "drain", "node-0"},
       "ubepctl: --first_moe_layer applies to plan export only\n"},
      {{"--first_moe_layer=2147483647", "plan", "export", "--format=sglang"},
       "ubepctl: --first_moe_layer 2147483647 is outside [0, 2^20] (or -1: the plan's own layer "
       "ids)\n"},
      {{"--first_moe_layer=-3", "plan", "export", "--format=sglang"},
       "ubepctl: --first_moe_layer -3 is outside [0, 2^20] (or -1: the plan's own layer ids)\n"},
      {{"--first_moe_layer=3", "plan", "export"},
       "ubepctl: --first_moe_layer applies to --format=sglang only (the EPLB form has no model "
       "layers)\n"},
  };
  for (const auto& [args, said] : cases) {
    std::vector<std::string> argv = {test::BinaryPath("ubepctl"), "--balancer=127.0.0.1:1",
                                     "--timeout=2s"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string out;
    EXPECT_EQ(Run(argv, &out), 2) << out;
    EXPECT_THAT(out, ::testing::StartsWith(said));
  }
  std::string out;
  Run({test::BinaryPath("ubepctl"), "--help"}, &out);
  for (const char* flag : {"--balancer", "--json", "--timeout", "--format", "--out",
                           "--first_moe_layer"}) {
    EXPECT_THAT(out, HasSubstr(absl::StrCat("    ", flag, " ("))) << out;
  }
  EXPECT_EQ(Run({test::BinaryPath("ubepctl"), "--version"}, &out), 0);
  EXPECT_EQ(out, absl::StrCat("ubepctl ", UBEP_VERSION, "\n"));
}

// Flag values that cannot make a cluster are refused before anything starts, exit 2.
TEST_F(LocalTest, FlagValuesThatCannotMakeAClusterAreRefusedBeforeAnythingStarts) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--ranks=0",
       "ubep-local: need 1 <= --daemons <= --ranks, --steps >= 1 and --policy ubep, eplb or none\n"},
      {"--layers=-1", "ubep-local: --layers -1 is not positive\n"},
      {"--hidden=0", "ubep-local: --hidden 0 is not positive\n"},
      {"--slots_per_rank=-2", "ubep-local: --slots_per_rank -2 is negative\n"},
      {"--max_recv_rows=-1", "ubep-local: --max_recv_rows -1 is negative (0: unbounded)\n"},
      {"--step_delay=-5ms", "ubep-local: --step_delay -5ms is negative\n"},
      {"--drift_period=0", "ubep-local: --drift_period 0 is not positive\n"},
      {"--interval=1ms",
       "ubep-local: --interval 1ms is under 10ms (ubepd's --report_interval takes it)\n"},
      {"--interval=2h",
       "ubep-local: --interval 2h is over 1h (ubepd's --report_interval takes it)\n"},
      {"--metrics_port=65534",
       "ubep-local: --metrics_port 65534 leaves no port for daemon 1 (ports metrics_port to "
       "metrics_port + daemons; 0 = any free ones)\n"},
      {"--metrics_port=2147483647",
       "ubep-local: --metrics_port 2147483647 leaves no port for daemon 1 (ports metrics_port to "
       "metrics_port + daemons; 0 = any free ones)\n"},
      {"--metrics_port=-1", "ubep-local: --metrics_port -1 is negative (0 = any free ones)\n"},
      {"--layers=4097", "ubep-local: --layers 4097 is over 4096, the most ubepd takes\n"},
      {"--experts=1025", "ubep-local: --experts 1025 is over 1024, the most ubepd takes\n"},
      {"--slots_per_rank=5000",
       "ubep-local: --slots_per_rank 5000 is over 4096, the most ubepd takes\n"},
      {"--tokens=1048577", "ubep-local: --tokens 1048577 is over 1048576, the most ubepd takes\n"},
      {"--hidden=65537", "ubep-local: --hidden 65537 is over 65536, the most ubepd takes\n"},
      // What the serving processes or ubepd would refuse once everything had started.
      {"--experts=4", "ubep-local: --experts 4 is under the top-8 the serving processes route to\n"},
      {"--slots_per_rank=1",
       "ubep-local: --slots_per_rank 1 x --ranks 8 holds 8 slots, fewer than --experts 256\n"},
      {"--experts=64",
       "ubep-local: " + std::string(UBEP_SOURCE_DIR) +
           "/data/traces/deepseek-v3/decode_in1000out1000.json has 58 MoE layers x 256 experts; "
           "--layers 4 and --experts 64 need at least 4 x exactly 64\n"},
      {"--layers=59",
       "ubep-local: " + std::string(UBEP_SOURCE_DIR) +
           "/data/traces/deepseek-v3/decode_in1000out1000.json has 58 MoE layers x 256 experts; "
           "--layers 59 and --experts 256 need at least 59 x exactly 256\n"},
  };
  for (const auto& [flag, message] : cases) {
    std::string output;
    EXPECT_EQ(Run({test::BinaryPath("ubep-local"), "--report=" + path("report"), flag}, &output), 2)
        << flag;
    EXPECT_EQ(output, message);
  }
  EXPECT_FALSE(std::filesystem::exists(path("report")));
}

// A balancer that cannot start (its port taken) is seen exiting, and said so with its log, at
// once rather than after the 30 s a ready file is waited for.
TEST_F(LocalTest, ABalancerThatExitsAtStartIsNamedWithItsStatusAndLog) {
  test::LoopbackListener taken;
  ASSERT_GE(taken.fd(), 0);
  const std::string listen = absl::StrCat("127.0.0.1:", taken.port());
  // What an earlier run left in the report directory is not left as this one's.
  std::filesystem::create_directories(path("report"));
  const char* earlier[] = {"report.json", "report.md", "report.png", "cluster.json",
                           "prometheus-targets.json"};
  for (const char* name : earlier) std::ofstream(path("report") + "/" + name) << "an earlier run's";
  std::string output;
  EXPECT_EQ(Run({test::BinaryPath("ubep-local"), "--report=" + path("report"),
                 "--listen=" + listen, "--metrics_port=0"},
                &output),
            1);
  EXPECT_THAT(output, HasSubstr("ubep-local: ubep-balancer did not start (it exited with status "
                                "1); its log:\n"));
  EXPECT_THAT(output, HasSubstr("ubep-balancer: cannot listen on " + listen + "\n"));
  for (const char* name : earlier) {
    EXPECT_FALSE(std::filesystem::exists(path("report") + "/" + name)) << name;
  }
}

// A port a balancer serves is not shared by a second one (gRPC binds with SO_REUSEPORT unless
// told not to): the second cannot listen, and says so.
TEST_F(LocalTest, ASecondBalancerOnAPortInUseDoesNotStart) {
  const std::string ready = path("balancer-ready.json");
  Process first({test::BinaryPath("ubep-balancer"), "--listen=127.0.0.1:0", "--metrics=",
                 "--ready_file=" + ready},
                path("first.log"));
  ASSERT_TRUE(test::WaitFor([&] { return std::filesystem::exists(ready); }, absl::Seconds(30)))
      << ReadFile(path("first.log"));
  const int port = nlohmann::json::parse(ReadFile(ready))["port"].get<int>();
  const std::string listen = absl::StrCat("127.0.0.1:", port);
  Process second({test::BinaryPath("ubep-balancer"), "--listen=" + listen, "--metrics="},
                 path("second.log"));
  EXPECT_EQ(second.Wait(absl::Seconds(30)), 1);
  EXPECT_THAT(ReadFile(path("second.log")),
              HasSubstr("ubep-balancer: cannot listen on " + listen + "\n"));
}

// A run without a commit has no after window and so no picture: the report says so, and a
// picture an earlier run left in the directory is removed rather than shown as this run's.
// All of it ran under plan v1: that is its before window, the one the report has.
TEST_F(LocalTest, ARunWithoutACommitHasNoPictureAndLeavesNoEarlierOne) {
  const std::string report = path("report");
  std::filesystem::create_directories(report);
  std::ofstream(report + "/report.png") << "an earlier run's picture";
  std::string output;
  ASSERT_EQ(Run({test::BinaryPath("ubep-local"), "--ranks=2", "--daemons=1", "--steps=20",
                 "--interval=1h", "--report=" + report, "--listen=127.0.0.1:0",
                 "--metrics_port=0"},
                &output),
            0)
      << output;
  EXPECT_FALSE(std::filesystem::exists(report + "/report.png"));
  EXPECT_THAT(output, HasSubstr(absl::StrCat("  report: ", report, "/report.md, report.json (no "
                                             "picture: no plan was committed, so there is no "
                                             "after window)\n")));
  const std::string md = ReadFile(report + "/report.md");
  EXPECT_THAT(md, HasSubstr("\nNo picture: no plan was committed, so there is no after window.\n"));
  EXPECT_THAT(md, Not(HasSubstr("report.png")));
  EXPECT_THAT(md, HasSubstr("| rebalances committed | 0 |\n"));
  EXPECT_THAT(md, HasSubstr("), all / before (steps < 20) / after (no window) | 0 / 0 / - |\n"));
  EXPECT_THAT(md, HasSubstr("\nBefore: under plan v1, the whole run (no plan was committed). "
                            "After: none.\n"));
  const nlohmann::json r = nlohmann::json::parse(ReadFile(report + "/report.json"));
  EXPECT_TRUE(r["picture"].is_null());
  EXPECT_EQ(r["rebalances"], 0);
  EXPECT_GE(r["imbalance_before"].get<double>(), 1.0);
  EXPECT_TRUE(r["imbalance_after"].is_null());
  EXPECT_EQ(r["before_end_step"], 20);
  EXPECT_EQ(r["dropped_steps_before"], 0);
  EXPECT_TRUE(r["after_start_step"].is_null());
  EXPECT_TRUE(r["dropped_steps_after"].is_null());
}

// A Ctrl-C while gnuplot draws the picture (here one that never finishes) stops it and ends
// the run as interrupted, with no picture: ubep-local does not wait for gnuplot, nor take the
// interruption for gnuplot's failure.
TEST_F(LocalTest, InterruptWhilePlottingStopsGnuplotAndEndsTheRunAsInterrupted) {
  const std::string bin = path("bin"), started = path("gnuplot-started");
  std::filesystem::create_directories(bin);
  std::ofstream(bin + "/gnuplot") << "#!/bin/sh\ntouch " << started << "\nexec sleep 600\n";
  std::filesystem::permissions(bin + "/gnuplot", std::filesystem::perms::owner_all);
  const std::string path_before = getenv("PATH") != nullptr ? getenv("PATH") : "";
  setenv("PATH", (bin + ":" + path_before).c_str(), 1);  // Inherited by ubep-local.
  const std::string report = path("report");
  // Without a policy the picture compares the run's first and last thirds: no commit needed.
  Process local({test::BinaryPath("ubep-local"), "--ranks=2", "--daemons=1", "--steps=30",
                 "--policy=none", "--report=" + report, "--listen=127.0.0.1:0",
                 "--metrics_port=0"},
                path("local.out"));
  setenv("PATH", path_before.c_str(), 1);
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(started); }, absl::Seconds(60)))
      << ReadFile(path("local.out"));
  local.Signal(SIGINT);
  EXPECT_EQ(local.Wait(absl::Seconds(30)), 130) << ReadFile(path("local.out"));
  EXPECT_THAT(ReadFile(path("local.out")),
              HasSubstr("report.json (no picture: interrupted while plotting)\n"));
  const nlohmann::json r = nlohmann::json::parse(ReadFile(report + "/report.json"));
  EXPECT_TRUE(r["interrupted"].get<bool>());
  EXPECT_TRUE(r["picture"].is_null());
  EXPECT_FALSE(std::filesystem::exists(report + "/report.png"));
}

// Ctrl-C: every process ubep-local started stops, nothing is left in /dev/shm (the arenas
// are memfds, which go with their processes; a file there would be a leak), the working
// directory is gone, and the report says the run was interrupted.
TEST_F(LocalTest, InterruptStopsEveryProcessAndLeavesNothingBehind) {
  auto shm = [] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) names.push_back(e.path());
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> shm_before = shm();
  const std::string report = path("report");
  std::unique_ptr<Process> local;
  const std::string workdir = StartLongRun(local);
  ASSERT_FALSE(workdir.empty());
  EXPECT_EQ(ChildrenOf(workdir, "").size(), 1u + 2 + 4);  // The balancer, 2 daemons, 4 ranks.
  local->Signal(SIGINT);
  EXPECT_EQ(local->Wait(absl::Seconds(60)), 130) << ReadFile(path("local.out"));
  EXPECT_TRUE(ChildrenOf(workdir, "").empty());
  EXPECT_FALSE(std::filesystem::exists(workdir));
  EXPECT_EQ(shm(), shm_before);
  EXPECT_THAT(ReadFile(path("local.out")), HasSubstr("ubep-local: interrupted; stopping everything"));
  const nlohmann::json r = nlohmann::json::parse(ReadFile(report + "/report.json"));
  EXPECT_TRUE(r["interrupted"].get<bool>());
  EXPECT_FALSE(r["correct"].get<bool>());
  // The ranks stopped by the interruption are not named as failures (exit 143 each).
  EXPECT_FALSE(r.contains("problems")) << r["problems"];
}

// ubep-local killed outright (SIGKILL: no handler runs): its children go with it (each was
// started with SIGKILL as its parent-death signal), none is left serving or holding a port.
TEST_F(LocalTest, KillingUbepLocalOutrightTakesItsChildrenWithIt) {
  std::unique_ptr<Process> local;
  const std::string workdir = StartLongRun(local);
  ASSERT_FALSE(workdir.empty());
  ASSERT_EQ(ChildrenOf(workdir, "").size(), 1u + 2 + 4);
  local->Signal(SIGKILL);
  EXPECT_EQ(local->Wait(absl::Seconds(60)), 128 + SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return ChildrenOf(workdir, "").empty(); }, absl::Seconds(30)))
      << ChildrenOf(workdir, "").size() << " children left";
  std::filesystem::remove_all(workdir);
}

// The balancer killed while the ranks run: ubep-local names it with its status and log, stops
// everything and fails the run (it went on with the balancer's figures frozen, and said
// "every step correct").
TEST_F(LocalTest, ABalancerThatDiesMidRunIsNamedAndFailsTheRun) {
  const std::string report = path("report");
  std::unique_ptr<Process> local;
  const std::string workdir = StartLongRun(local);
  ASSERT_FALSE(workdir.empty());
  const std::vector<pid_t> balancer = ChildrenOf(workdir, "/ubep-balancer");
  ASSERT_EQ(balancer.size(), 1u);
  ASSERT_EQ(kill(balancer[0], SIGKILL), 0);
  EXPECT_EQ(local->Wait(absl::Seconds(60)), 1) << ReadFile(path("local.out"));
  EXPECT_THAT(ReadFile(path("local.out")),
              HasSubstr("ubep-local: ubep-balancer exited with status 137 while the ranks ran (" +
                        workdir + "/balancer.log)"));
  EXPECT_TRUE(ChildrenOf(workdir, "").empty());
  const nlohmann::json r = nlohmann::json::parse(ReadFile(report + "/report.json"));
  EXPECT_FALSE(r["correct"].get<bool>());
  std::filesystem::remove_all(workdir);  // Kept for the operator, as on every failed run.
}

}  // namespace
}  // namespace ubep
