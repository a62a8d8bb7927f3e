// ubepd and libubep end to end: a real daemon process, real client processes (the example
// MoE serving program), real shared memory, fd passing and gRPC on a Unix socket.
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/unix_socket.h"
#include "examples/moe_serving/moe_model.h"
#include "kernels/host/arena_layout.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"
#include "tests/unit/test_util.h"
#include "ubep/ubep.h"
#include "ubep/ubep_c.h"
#include "ubep/v1/control.grpc.pb.h"
#include "ubep/v1/daemon.grpc.pb.h"

namespace ubep {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using test::BinaryPath;
using test::Process;
using test::ReadFile;
using test::HttpGet;
using test::Sample;
using test::WaitFor;

constexpr int kWorld = 4;
constexpr int kSteps = 100;

// How many times `needle` occurs in `text`.
int CountOf(std::string_view text, std::string_view needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string_view::npos;
       at = text.find(needle, at + needle.size())) {
    ++n;
  }
  return n;
}

struct StepLines {
  std::set<uint64_t> ok_steps;
  int mismatches = 0;
  std::set<uint64_t> generations;
};

StepLines ParseSteps(const std::string& log) {
  static const std::regex kStep(
      R"(^step (\d+) generation (\d+) plan (\d+) max_rel_err (\S+) (ok|MISMATCH)$)");
  StepLines out;
  for (const absl::string_view line : absl::StrSplit(log, '\n')) {
    const std::string s(line);
    std::smatch sm;
    if (!std::regex_match(s, sm, kStep)) continue;
    if (sm[5] == "ok") {
      out.ok_steps.insert(std::stoull(sm[1]));
    } else {
      ++out.mismatches;
    }
    out.generations.insert(std::stoull(sm[2]));
  }
  return out;
}

std::set<uint64_t> AllSteps() {
  std::set<uint64_t> all;
  for (uint64_t s = 0; s < kSteps; ++s) all.insert(s);
  return all;
}

class DaemonTest : public ::testing::Test {
 protected:
  std::string socket_path() const { return dir_.path() + "/ubepd.sock"; }
  std::string client_log(int rank) const { return dir_.path() + "/client-" + std::to_string(rank) + ".log"; }

  std::unique_ptr<Process> StartDaemon(std::vector<std::string> extra = {}) {
    const std::string ready = dir_.path() + "/ready.json";
    std::filesystem::remove(ready);
    std::vector<std::string> argv = {BinaryPath("ubepd"),
                                     "--socket=" + socket_path(),
                                     "--metrics=127.0.0.1:0",
                                     "--ready_file=" + ready,
                                     "--harvest_interval=50ms",
                                     "--wait_timeout=60s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto daemon = std::make_unique<Process>(argv, dir_.path() + "/ubepd.log");
    EXPECT_TRUE(WaitFor([&] { return std::filesystem::exists(ready); }, absl::Seconds(30)))
        << ReadFile(dir_.path() + "/ubepd.log");
    const nlohmann::json ports = nlohmann::json::parse(ReadFile(ready));
    metrics_port_ = ports["metrics_port"].get<int>();
    listen_port_ = ports["listen_port"].get<int>();
    return daemon;
  }

  std::unique_ptr<Process> StartClient(int rank, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {
        BinaryPath("ubep-moe-example"),
        "--socket=" + socket_path(),
        absl::StrCat("--rank=", rank),
        absl::StrCat("--world=", kWorld),
        absl::StrCat("--steps=", kSteps),
        "--log=" + client_log(rank),
        "--traces=" + test::TracePath("decode_in1000out1000.json") + "," +
            test::TracePath("prefill_in1024.json")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(argv, dir_.path() + "/client-" + std::to_string(rank) + ".out");
  }

  std::string Metrics() const { return HttpGet(metrics_port_, "/metrics"); }

  std::unique_ptr<v1::Daemon::Stub> Stub() const {
    return v1::Daemon::NewStub(
        grpc::CreateChannel("unix:" + socket_path(), grpc::InsecureChannelCredentials()));
  }

  static v1::AttachRequest Request(uint32_t rank, uint32_t world) {
    v1::AttachRequest q;
    q.set_rank(rank);
    q.set_world_size(world);
    q.set_pid(getpid());
    v1::ModelShape* s = q.mutable_shape();
    s->set_num_layers(2);
    s->set_num_experts(8);
    s->set_hidden(32);
    s->set_top_k(2);
    s->set_max_tokens(16);
    s->set_slots_per_rank(4);
    s->set_bytes_per_expert(1024);
    return q;
  }

  grpc::Status Attach(const v1::AttachRequest& q, v1::AttachResponse* response = nullptr) {
    v1::AttachResponse ignored;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return Stub()->Attach(&context, q, response != nullptr ? response : &ignored);
  }

  // Rank `rank` of a group of `world` attached and its arenas taken over the fd socket, as a
  // client does: the connection (the rank stays attached while it is open) and ubepd's reply
  // ("OK" and the arenas' fds); nullopt, with a failure added, where a step failed.
  struct Claimed {
    std::string token;
    UniqueFd connection;
    ReceivedMessage reply;
  };
  std::optional<Claimed> AttachAndClaim(uint32_t rank, uint32_t world) {
    v1::AttachResponse attached;
    if (const grpc::Status s = Attach(Request(rank, world), &attached); !s.ok()) {
      ADD_FAILURE() << "attach: " << s.error_message();
      return std::nullopt;
    }
    absl::StatusOr<UniqueFd> connection = ConnectUnix(attached.fd_socket());
    if (!connection.ok()) {
      ADD_FAILURE() << connection.status();
      return std::nullopt;
    }
    if (absl::Status s = SendMessage(connection->get(), attached.token(), {}); !s.ok()) {
      ADD_FAILURE() << s;
      return std::nullopt;
    }
    absl::StatusOr<ReceivedMessage> reply = ReceiveMessage(connection->get(), 4096, absl::Seconds(10));
    if (!reply.ok()) {
      ADD_FAILURE() << reply.status();
      return std::nullopt;
    }
    return Claimed{attached.token(), *std::move(connection), *std::move(reply)};
  }

  grpc::health::v1::HealthCheckResponse::ServingStatus Health() const {
    auto stub = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel("unix:" + socket_path(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = stub->Check(&context, request, &response);
    return status.ok() ? response.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }

  void ExpectAllStepsCorrect(int rank) {
    const std::string log = ReadFile(client_log(rank));
    const StepLines steps = ParseSteps(log);
    EXPECT_EQ(steps.mismatches, 0) << log;
    EXPECT_EQ(steps.ok_steps, AllSteps()) << log;
    EXPECT_THAT(log, HasSubstr("done steps 100 failed 0")) << log;
  }

  test::TempDir dir_;
  int metrics_port_ = 0;
  int listen_port_ = 0;
};

// The rows each layer's call routes to each rank, [step][layer][rank], from the clients' own
// routing (the example's MoeModel, with the options StartClient gives it) under the daemon's
// first plan, which puts expert e in slot e, on rank e / 64 (256 experts, 64 slots per rank).
std::vector<std::vector<std::vector<uint32_t>>> RoutedRows() {
  example::MoeModelOptions mo;
  mo.traces = {test::TracePath("decode_in1000out1000.json"), test::TracePath("prefill_in1024.json")};
  const absl::StatusOr<example::MoeModel> model = example::MoeModel::Create(mo);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<std::vector<std::vector<uint32_t>>> rows(
      kSteps, std::vector<std::vector<uint32_t>>(4, std::vector<uint32_t>(kWorld, 0)));
  if (!model.ok()) return rows;
  for (uint64_t step = 0; step < kSteps; ++step) {
    for (int source = 0; source < kWorld; ++source) {
      for (int l = 0; l < 4; ++l) {
        std::vector<int32_t> idx;
        std::vector<float> w;
        model->Route(step, source, l, idx, w);
        for (const int32_t e : idx) {
          if (e >= 0) ++rows[step][l][e / 64];
        }
      }
    }
  }
  return rows;
}

TEST_F(DaemonTest, FourClientsRunHundredStepsMatchingTheFloat64Reference) {
  auto daemon = StartDaemon();
  EXPECT_EQ(Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    ExpectAllStepsCorrect(r);
    EXPECT_EQ(ParseSteps(ReadFile(client_log(r))).generations, std::set<uint64_t>{1});
  }
  // The load counters: every rank routes 32 tokens x top-8 per layer per step, all received.
  std::string metrics;
  ASSERT_TRUE(WaitFor([&] {
    metrics = Metrics();
    return Sample(metrics, "ubep_daemon_received_tokens_total{layer=\"3\"}") == 4 * 32 * 8 * kSteps;
  }, absl::Seconds(20))) << metrics;
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(Sample(metrics, absl::StrCat("ubep_daemon_received_tokens_total{layer=\"", l, "\"}")),
              4 * 32 * 8 * kSteps);
  }
  for (int r = 0; r < kWorld; ++r) {
    const std::string rank = absl::StrCat("{rank=\"", r, "\"}");
    EXPECT_EQ(Sample(metrics, "ubep_daemon_dispatched_tokens_total" + rank), 32 * 4 * kSteps);
    EXPECT_EQ(Sample(metrics, "ubep_daemon_dispatch_seconds_count" + rank), 4 * kSteps);
    EXPECT_EQ(Sample(metrics, "ubep_daemon_step" + rank), kSteps - 1);
    EXPECT_EQ(Sample(metrics, "ubep_daemon_rank_up" + rank), 0);  // All detached.
    EXPECT_EQ(Sample(metrics, "ubep_daemon_wait_timeouts_total" + rank), 0);
    // A static plan, never changed: no step waited for a commit decision.
    EXPECT_EQ(Sample(metrics, "ubep_daemon_effective_step_waits_total" + rank), 0);
    EXPECT_EQ(Sample(metrics, "ubep_daemon_effective_step_wait_seconds_total" + rank), 0);
  }
  // Per rank, the pairs routed there (RoutedRows: the clients' own routing).
  const std::vector<std::vector<std::vector<uint32_t>>> routed = RoutedRows();
  for (int l = 0; l < 4; ++l) {
    double sum = 0;
    for (int r = 0; r < kWorld; ++r) {
      const double got = Sample(
          metrics, absl::StrCat("ubep_daemon_rank_received_total{rank=\"", r, "\",layer=\"", l, "\"}"));
      double want = 0;
      for (uint64_t step = 0; step < kSteps; ++step) want += routed[step][l][r];
      EXPECT_EQ(got, want) << "rank " << r << " layer " << l;
      sum += got;
    }
    EXPECT_EQ(sum, 4 * 32 * 8 * kSteps) << "layer " << l;
  }
  EXPECT_EQ(Sample(metrics, "ubep_daemon_attached_clients"), 0);
  EXPECT_EQ(Sample(metrics, "ubep_daemon_draining"), 0);
  EXPECT_EQ(Sample(metrics, "ubep_daemon_plan_version"), 1);
  EXPECT_EQ(Sample(metrics, "ubep_daemon_group_generation"), 1);
  // Measured over the last harvest: present (>= 1) if that harvest saw the last steps' pairs,
  // absent (-1 here) once one has seen nothing more arrive.
  const double imbalance = Sample(metrics, "ubep_daemon_imbalance_ratio{layer=\"0\"}");
  EXPECT_TRUE(imbalance == -1 || imbalance >= 1.0) << imbalance;

  // The exposition passes promtool's lint.
  const std::string file = dir_.Write("metrics.txt", metrics);
  // promtool reads the exposition from stdin.
  Process lint({"/bin/sh", "-c", "/usr/bin/promtool check metrics < " + file},
               dir_.path() + "/lint.out");
  EXPECT_EQ(lint.Wait(absl::Seconds(30)), 0) << ReadFile(dir_.path() + "/lint.out");
  EXPECT_EQ(ReadFile(dir_.path() + "/lint.out"), "");

  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0);
}

// --flagged_tokens: ubep calls of up to that many tokens move flag-in-granule rows, capped at
// the shape's max_tokens and told to clients with the layout; the example's 32-token steps
// then all go flagged, and every step still matches the float64 reference.
TEST_F(DaemonTest, FlaggedRowsServeTheSameStepsAndTheSettingIsCappedAtMaxTokens) {
  auto daemon = StartDaemon({"--flagged_tokens=100000"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    ExpectAllStepsCorrect(r);
  }
  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0);
  // A group of 16-token calls gets 16 (its rank stays attached; the daemon is killed at the
  // end of the test).
  daemon = StartDaemon({"--flagged_tokens=100000"});
  v1::AttachResponse response;
  const grpc::Status attached = Attach(Request(0, 2), &response);
  ASSERT_TRUE(attached.ok()) << attached.error_message();
  EXPECT_EQ(response.flagged_tokens(), 16u);
  EXPECT_EQ(response.near_ranks(), 0u);  // One daemon hosts every rank: all one hop apart.
}

// A receive capacity no step fits (--max_recv_rows=1): every step is dropped on every rank,
// and the example, having checked nothing, says so and exits 4 (it exited 0).
TEST_F(DaemonTest, AnExampleRunWhoseStepsAreAllDroppedExitsFour) {
  auto daemon = StartDaemon({"--max_recv_rows=1"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r, {"--steps=3"}));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 4) << ReadFile(client_log(r));
    const std::string log = ReadFile(client_log(r));
    EXPECT_THAT(log, HasSubstr("done steps 3 failed 0 dropped 3\nerror: every step run (3) was "
                               "dropped; none was checked\n"))
        << log;
  }
  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0);
}

// --max_recv_rows=500: round-robin placement routes rank 0 more than 500 rows in layer 0 of
// some steps (the traces' hot experts). Each such call fails on every rank at once (rank 0's
// Dispatch, the others' Combine, each naming rank 0), every rank drops that step, and the
// group stays in step: the same steps are dropped everywhere and every other one matches the
// float64 reference. The setting reaches the clients with the layout; a negative one is refused.
TEST_F(DaemonTest, AReceiveCapacityOverflowDropsTheSameStepsEverywhereAndTheRestMatch) {
  // The steps that overflow, and how many rows rank 0 was routed in the layer that did: the
  // first of the step's layers that routes rank 0 more than 500 rows (the step is dropped
  // there). No other rank goes over in this run (else the test would not know who is named).
  const std::vector<std::vector<std::vector<uint32_t>>> routed = RoutedRows();
  std::map<uint64_t, uint32_t> overflows;
  for (uint64_t step = 0; step < kSteps; ++step) {
    for (int l = 0; l < 4; ++l) {
      for (int r = 1; r < kWorld; ++r) ASSERT_LE(routed[step][l][r], 500u) << step << " " << l;
      if (routed[step][l][0] > 500) {
        overflows[step] = routed[step][l][0];
        break;
      }
    }
  }
  auto daemon = StartDaemon({"--max_recv_rows=500"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r));
  std::set<uint64_t> dropped_by_rank0;
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    const std::string log = ReadFile(client_log(r));
    std::set<uint64_t> dropped;
    for (const test::DroppedLine& line : test::DroppedLines(log)) {
      dropped.insert(line.step);
      EXPECT_EQ(line.rank, r) << line.error;
      // Rank 0 overflowed: at its own Dispatch, at the others' Combine, word for word (the
      // rows routed there differ by step; they are read back from the message).
      EXPECT_EQ(line.phase, r == 0 ? "dispatch" : "combine") << line.error;
      std::smatch rows;
      ASSERT_TRUE(std::regex_search(line.error, rows, std::regex("(\\d+) rows"))) << line.error;
      const kernels::ReceiveNotice notice{line.call, static_cast<uint32_t>(std::stoul(rows[1])),
                                          500};
      EXPECT_EQ(line.error, r == 0 ? kernels::OverCapacityStatus(0, line.call, notice).message()
                                   : kernels::PeerOverCapacityStatus(r, line.call, 0, notice)
                                         .message());
      EXPECT_GT(notice.rows, 500u) << line.error;
      EXPECT_EQ(notice.rows, overflows.count(line.step) ? overflows.at(line.step) : 0u)
          << line.error;
    }
    const StepLines steps = ParseSteps(log);
    EXPECT_EQ(steps.mismatches, 0) << log;
    std::set<uint64_t> all = steps.ok_steps;
    all.insert(dropped.begin(), dropped.end());
    EXPECT_EQ(all, AllSteps()) << log;
    EXPECT_EQ(all.size(), steps.ok_steps.size() + dropped.size()) << log;
    EXPECT_THAT(log, HasSubstr(absl::StrCat("done steps 100 failed 0 dropped ", dropped.size())));
    if (r == 0) {
      dropped_by_rank0 = dropped;
      // Exactly the steps whose routing overflows rank 0; some steps do and some do not, so
      // the group went on after each.
      std::set<uint64_t> expected;
      for (const auto& [step, rows] : overflows) expected.insert(step);
      EXPECT_EQ(dropped, expected) << log;
      EXPECT_GT(dropped.size(), 0u) << log;
      EXPECT_LT(dropped.size(), 100u) << log;
    } else {
      EXPECT_EQ(dropped, dropped_by_rank0) << log;
    }
  }
  // One error per rank and dropped step, for the operator, and one call over the capacity.
  const std::string metrics = Metrics();
  EXPECT_EQ(Sample(metrics,
                   "ubep_daemon_errors_total{code=\"RESOURCE_EXHAUSTED\",source=\"client\"}"),
            4 * dropped_by_rank0.size());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(Sample(metrics, absl::StrCat("ubep_daemon_over_capacity_calls_total{rank=\"", r,
                                           "\"}")),
              dropped_by_rank0.size())
        << "rank " << r;
  }
  daemon->Signal(SIGTERM);
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0);
  daemon = StartDaemon({"--max_recv_rows=500"});
  v1::AttachResponse response;
  const grpc::Status attached = Attach(Request(0, 2), &response);
  ASSERT_TRUE(attached.ok()) << attached.error_message();
  EXPECT_EQ(response.max_recv_rows(), 500u);
}

// What ubepd cannot start with is refused at start, naming it, and touches nothing of the
// daemon serving beside it (its sockets, its ports, its ready file).
TEST_F(DaemonTest, WhatItCannotStartWithIsRefusedAndLeavesTheRunningDaemonBe) {
  std::unique_ptr<Process> daemon = StartDaemon();
  v1::AttachResponse response;
  const grpc::Status attached = Attach(Request(0, 2), &response);
  ASSERT_TRUE(attached.ok()) << attached.error_message();
  // Flag values ubepd cannot run with: exit 2, naming the flag (a wait no call could pass is
  // refused at start, not blamed on each client's Attach later).
  const std::pair<std::string, std::string> refused[] = {
      {"--max_recv_rows=-1", "ubepd: --max_recv_rows -1 is negative\n"},
      {"--harvest_interval=0s", "ubepd: --harvest_interval 0 is not positive\n"},
      {"--wait_timeout=0s", "ubepd: --wait_timeout 0 is not positive\n"},
      {"--join_timeout=-1s", "ubepd: --join_timeout -1s is not positive\n"},
      {"--report_interval=500us", "ubepd: --report_interval 500us is under 10ms\n"},
      {"--report_interval=2h", "ubepd: --report_interval 2h is over 1h\n"},
      {"--advertise=node-a", "ubepd: --advertise \"node-a\": HOST:PORT is expected, with a port "
                             "in [1, 65535] (the balancer calls this daemon back there)\n"},
      {"--advertise=node-a:70000", "ubepd: --advertise \"node-a:70000\": HOST:PORT is expected, "
                                   "with a port in [1, 65535] (the balancer calls this daemon "
                                   "back there)\n"},
      {"--domain=4294967295", "ubepd: --domain 4294967295 stands for \"no domain\" in the "
                              "group's view (a rank no healthy daemon hosts): give another\n"},
      {"--harvest_interval=1ns", "ubepd: --harvest_interval 1ns is under 10ms\n"},
      {"--socket_mode=40000000660", "ubepd: --socket_mode 40000000660 is not an octal file mode\n"},
      {"--socket_mode=+660", "ubepd: --socket_mode +660 is not an octal file mode\n"},
      {"--socket_mode=1777", "ubepd: --socket_mode 1777 is not an octal file mode\n"},
      {"--socket_mode=0001777", "ubepd: --socket_mode 0001777 is not an octal file mode\n"},
      {"--max_arena_bytes=0", "ubepd: --max_arena_bytes 0 is not positive\n"},
      {"--wait_timeout=500us", "ubepd: --wait_timeout 500us is under 1ms\n"},
      {"--wait_timeout=inf",
       "ubepd: --wait_timeout inf is not a time (every wait has an end: under 1000000h)\n"},
      {"--wait_timeout=1000000h",
       "ubepd: --wait_timeout 1000000h is not a time (every wait has an end: under 1000000h)\n"},
      {"--drain_timeout=inf",
       "ubepd: --drain_timeout inf is not a time (every wait has an end: under 1000000h)\n"},
      {"--drain_timeout=-1s", "ubepd: --drain_timeout -1s is negative\n"},
      {"--ranks=0-2147483647",
       "ubepd: --ranks \"0-2147483647\": rank 2147483647 is past 1023 (an EP group has at most "
       "1024 ranks)\n"},
      {"--free_buffers=2147483647",
       "ubepd: --free_buffers 2147483647 is over 4096, the most slots a rank has\n"},
      {"--backend=gpu", "ubepd: --backend gpu: expected host or cuda\n"},
      // Its name goes into every peer's view of the group, metric labels and log lines.
      {"--node=node a", "ubepd: --node \"node a\": a name of at most 253 letters, digits, '.', "
                        "'-' and '_' is expected (a host or node name)\n"},
      {"--ranks=0-3", "ubepd: --ranks needs --balancer: the daemons of the group's other ranks "
                      "are found through it\n"},
      // A bare port would be every interface to the metrics server.
      {"--metrics=9464", "ubepd: --metrics 9464 is not HOST:PORT (e.g. 127.0.0.1:9464; "
                         "0.0.0.0:PORT for every interface)\n"},
      {"--listen=localhost:9x", "ubepd: --listen localhost:9x is not HOST:PORT (e.g. "
                                "127.0.0.1:9464; 0.0.0.0:PORT for every interface)\n"},
      // A stray argument would otherwise leave the default socket served.
      {"other.sock", "ubepd: unexpected argument \"other.sock\" (every setting is a flag: "
                     "--socket=PATH)\n"},
      // Its plan file is read at start, not first at the first attach.
      {"--plan=/nonexistent/plan.json",
       "ubepd: --plan: /nonexistent/plan.json: cannot read: No such file or directory\n"},
      {"--plan=/tmp", "ubepd: --plan: /tmp: not a regular file (a directory)\n"},
      {"--plan=" + test::TracePath("prefill_in1024.json"),
       "ubepd: --plan: " + test::TracePath("prefill_in1024.json") +
           ": phy2log: missing: not a plan (EPLB's arrays, docs/formats.md)\n"},
      // A socket its own user could not connect to.
      {"--socket_mode=0440",
       "ubepd: --socket_mode 0440 does not let its owner connect (write permission, 0200)\n"},
      // A ready file renamed over ubepd's own socket, or removed as a stale one over its lock.
      {"--ready_file=" + dir_.path() + "/other.sock.lock",
       "ubepd: --ready_file " + dir_.path() + "/other.sock.lock would be written over " +
           dir_.path() + "/other.sock.lock, one of ubepd's own files (its sockets and its "
           "lock): give it a path of its own\n"},
      {"--ready_file=" + dir_.path() + "/other.sock",
       "ubepd: --ready_file " + dir_.path() + "/other.sock would be written over " +
           dir_.path() + "/other.sock, one of ubepd's own files (its sockets and its lock): "
           "give it a path of its own\n"},
  };
  for (size_t i = 0; i < std::size(refused); ++i) {
    const auto& [flag, message] = refused[i];
    const std::string out = absl::StrCat(dir_.path(), "/refused", i, ".out");
    Process p({BinaryPath("ubepd"), "--socket=" + dir_.path() + "/other.sock", flag}, out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 2) << flag;
    EXPECT_EQ(ReadFile(out), message);
  }
  // --ranks without --node: every daemon of the machine would be named after its host.
  {
    const std::string out = dir_.path() + "/unnamed.out";
    Process p({BinaryPath("ubepd"), "--socket=" + dir_.path() + "/other.sock", "--ranks=0-1",
               "--balancer=127.0.0.1:1", "--listen=127.0.0.1:0", "--metrics="},
              out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 2);
    EXPECT_EQ(ReadFile(out),
              "ubepd: --ranks needs --node: the daemons of one machine's group are told apart by "
              "their names (the host name, the default, is theirs alike)\n");
  }
  // A socket path naming something that is not a socket (a mistyped path) is not replaced.
  {
    const std::string file = dir_.Write("ubepd.flags", "--ranks=0-3\n");
    const std::string out = dir_.path() + "/not-a-socket.out";
    Process p({BinaryPath("ubepd"), "--socket=" + file, "--metrics="}, out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 1);
    EXPECT_THAT(ReadFile(out), ::testing::EndsWith(absl::StrCat(
                                   "ubepd: ", file, " exists and is not a socket (a regular "
                                   "file); not replacing it: is the socket path right?\n")));
    EXPECT_EQ(ReadFile(file), "--ranks=0-3\n");
  }
  // --advertise without --listen: nothing would serve the address the balancer is given.
  {
    const std::string out = dir_.path() + "/advertise.out";
    Process p({BinaryPath("ubepd"), "--socket=" + dir_.path() + "/other.sock", "--metrics=",
               "--balancer=127.0.0.1:1", "--advertise=127.0.0.1:7071"},
              out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 2);
    EXPECT_EQ(ReadFile(out), "ubepd: --balancer needs --listen: the balancer calls this daemon "
                             "back there (--advertise only names that address to the balancer)\n");
  }
  // A socket another process listens on is not replaced as a stale one (here the lock file
  // of its path is free: removed under a running daemon, or another program's socket).
  {
    const std::string live = dir_.path() + "/live.sock";
    absl::StatusOr<UniqueFd> listener = ListenUnix(live, 0600);
    ASSERT_TRUE(listener.ok()) << listener.status();
    const std::string out = dir_.path() + "/live.out";
    Process p({BinaryPath("ubepd"), "--socket=" + live, "--metrics="}, out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 1);
    EXPECT_THAT(ReadFile(out), ::testing::EndsWith(absl::StrCat(
                                   "ubepd: ", live, " is a socket another process listens on; "
                                   "not replacing it: is the socket path right? (another ubepd, "
                                   "started without its lock file, or another program)\n")));
    struct stat st {};
    EXPECT_EQ(lstat(live.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
  }
  // A ready file that cannot be written: said, and the daemon stops (whoever waits for the
  // file would wait in vain), before it serves.
  {
    const std::string out = dir_.path() + "/ready.out";
    Process p({BinaryPath("ubepd"), "--socket=" + dir_.path() + "/third.sock", "--metrics=",
               "--ready_file=/nonexistent/ready.json"},
              out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 1);
    // Said before it serves (nothing else logged: no socket made, no client attached).
    EXPECT_EQ(ReadFile(out), "ubepd: --ready_file: /nonexistent/ready.json: cannot write: No "
                             "such file or directory\n");
  }
  // A metrics port taken (here by the running daemon's): refused before any client could
  // attach, its sockets never made. The ready file a killed daemon left on that socket's path
  // is gone all the same (this one held the lock): nobody waiting takes its ports for live.
  {
    const std::string out = dir_.path() + "/metrics-taken.out";
    const std::string socket = dir_.path() + "/fourth.sock";
    const std::string stale = dir_.Write("fourth.ready", "{\"pid\": 1, \"metrics_port\": 1}\n");
    Process p({BinaryPath("ubepd"), "--socket=" + socket,
               absl::StrCat("--metrics=127.0.0.1:", metrics_port_), "--ready_file=" + stale},
              out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 1);
    EXPECT_FALSE(std::filesystem::exists(stale));
    EXPECT_THAT(ReadFile(out), HasSubstr(absl::StrCat("ubepd: --metrics 127.0.0.1:", metrics_port_,
                                                      ": ")));
    EXPECT_FALSE(std::filesystem::exists(socket));
    EXPECT_FALSE(std::filesystem::exists(socket + ".fds"));
  }
  // A second daemon on the same socket path is refused, and leaves the first one's sockets
  // and ready file be.
  const std::string ready = ReadFile(dir_.path() + "/ready.json");
  Process second({BinaryPath("ubepd"), "--socket=" + socket_path(), "--metrics=",
                  "--ready_file=" + dir_.path() + "/ready.json"},
                 dir_.path() + "/second.out");
  EXPECT_EQ(second.Wait(absl::Seconds(30)), 1);
  EXPECT_EQ(ReadFile(dir_.path() + "/ready.json"), ready);
  EXPECT_THAT(ReadFile(dir_.path() + "/second.out"),
              ::testing::EndsWith(absl::StrCat("ubepd: another ubepd serves ", socket_path(),
                                               " (it holds ", socket_path(), ".lock)\n")));
  const grpc::Status again = Attach(Request(1, 2), &response);
  EXPECT_TRUE(again.ok()) << again.error_message();
}

// An EPLB plan file (no shares) with a topology of two nodes (ubepd takes the file's nodes as
// they are): 4 ranks x 65 slots, the last slot of each rank a second replica of some expert.
// Outputs must not depend on the plan.
TEST_F(DaemonTest, StaticPlanFromAnEplbFileRoutesWithReplicasAndEachPortServesItsOwnService) {
  nlohmann::json phy2log = nlohmann::json::array();
  for (int l = 0; l < 4; ++l) {
    nlohmann::json row = nlohmann::json::array();
    for (int r = 0; r < kWorld; ++r) {
      for (int i = 0; i < 64; ++i) row.push_back(r * 64 + i);
      row.push_back((l * 31 + r * 64 + 5) % 256);
    }
    phy2log.push_back(row);
  }
  const std::string plan = dir_.Write(
      "plan.json", nlohmann::json{{"version", 7},
                                  {"num_experts", 256},
                                  {"topology", {{"ranks", kWorld}, {"nodes", 2}, {"slots_per_rank", 65}}},
                                  {"phy2log", phy2log}}
                       .dump());
  auto daemon = StartDaemon({"--plan=" + plan, "--listen=127.0.0.1:0"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r, {"--slots_per_rank=65"}));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    ExpectAllStepsCorrect(r);
    EXPECT_THAT(ReadFile(client_log(r)), HasSubstr("step 0 generation 1 plan 7 "));
  }
  ASSERT_GT(listen_port_, 0);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", listen_port_),
                                     grpc::InsecureChannelCredentials());
  // The clients' service on the socket, the plan commit's on TCP, and neither on the other:
  // an Attach from the network would hold a rank's ticket away from its client.
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetPlanResponse got;
    ASSERT_TRUE(Stub()->GetPlan(&context, v1::GetPlanRequest(), &got).ok());
    EXPECT_EQ(got.plan().version(), 7u);
    ASSERT_EQ(got.plan().layers_size(), 4);
    EXPECT_EQ(got.plan().layers(2).slot_expert_size(), 260);
    EXPECT_EQ(got.plan().layers(2).slot_expert(64), (2 * 31 + 5) % 256);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::DaemonState state;
    ASSERT_TRUE(v1::DaemonControl::NewStub(channel)
                    ->GetState(&context, v1::GetStateRequest(), &state)
                    .ok());
    EXPECT_EQ(state.committed_version(), 7u);
    EXPECT_EQ(state.committed_plan().version(), 7u);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::AttachResponse response;
    EXPECT_EQ(v1::Daemon::NewStub(channel)->Attach(&context, Request(0, kWorld), &response).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::AbortRequest request;
    request.set_version(8);
    v1::AbortResponse response;
    EXPECT_EQ(v1::DaemonControl::NewStub(grpc::CreateChannel("unix:" + socket_path(),
                                                             grpc::InsecureChannelCredentials()))
                  ->Abort(&context, request, &response)
                  .error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  grpc::ClientContext health_context;
  grpc::health::v1::HealthCheckResponse health;
  ASSERT_TRUE(grpc::health::v1::Health::NewStub(channel)
                  ->Check(&health_context, grpc::health::v1::HealthCheckRequest(), &health)
                  .ok());
  EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(DaemonTest, PlanThatDoesNotFitTheModelIsRefusedNamingBothShapes) {
  const std::string plan = dir_.Write(
      "plan.json", R"({"version": 2, "num_experts": 8, "phy2log": [[0,1,2,3,4,5,6,7]]})");
  auto daemon = StartDaemon({"--plan=" + plan});
  const grpc::Status status = Attach(Request(0, 2));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "the static plan " + plan + " has 1 layers x 8 experts; the model has 2 x 8");
}

TEST_F(DaemonTest, KilledClientIsMarkedGoneAndTheRestartedClientRejoins) {
  auto daemon = StartDaemon();
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r, {"--step_delay=20ms"}));
  ASSERT_TRUE(WaitFor([&] { return ParseSteps(ReadFile(client_log(2))).ok_steps.count(30) > 0; },
                      absl::Seconds(60)));
  clients[2]->Signal(SIGKILL);
  EXPECT_EQ(clients[2]->Wait(absl::Seconds(10)), 128 + SIGKILL);

  // The daemon saw the fd connection close: every survivor gets an error naming rank 2 (the
  // daemon's notice, not a wait timeout: --wait_timeout is 60 s), and nobody hangs.
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(WaitFor([&] { return ReadFile(client_log(r)).find("rank 2 left the group") !=
                                      std::string::npos; },
                        absl::Seconds(30)))
        << ReadFile(client_log(r));
    EXPECT_THAT(ReadFile(client_log(r)), ::testing::Not(HasSubstr("timed out")));
  }
  std::string metrics;
  EXPECT_TRUE(WaitFor([&] {
    metrics = Metrics();
    return Sample(metrics, "ubep_daemon_rank_up{rank=\"2\"}") == 0 &&
           Sample(metrics, "ubep_daemon_rank_up{rank=\"0\"}") == 1;
  }, absl::Seconds(10))) << metrics;

  clients[2] = StartClient(2, {"--step_delay=20ms"});
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    ExpectAllStepsCorrect(r);
    // The group formed twice: before the kill and after rank 2 came back.
    EXPECT_EQ(ParseSteps(ReadFile(client_log(r))).generations, (std::set<uint64_t>{1, 2}))
        << ReadFile(client_log(r));
  }
}

// A rank killed and started again only after several join timeouts: the survivors' Rejoins
// end DeadlineExceeded meanwhile (rank 2 is not there), and they call Rejoin again, saying so,
// rather than give up (within --reattach_timeout); the group forms again when rank 2 is back.
TEST_F(DaemonTest, SurvivorsKeepRejoiningWhileAKilledPeerIsLateToComeBack) {
  auto daemon = StartDaemon();
  const std::vector<std::string> flags = {"--step_delay=20ms", "--join_timeout=1s"};
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r, flags));
  ASSERT_TRUE(WaitFor([&] { return ParseSteps(ReadFile(client_log(2))).ok_steps.count(30) > 0; },
                      absl::Seconds(60)));
  clients[2]->Signal(SIGKILL);
  EXPECT_EQ(clients[2]->Wait(absl::Seconds(10)), 128 + SIGKILL);
  // Each survivor's Rejoin ends at its join timeout, three times at least, and each time it
  // joins again (one long Rejoin past --join_timeout would say it once). (Which ranks each
  // names varies: the survivors' timeouts do not end together.)
  const std::string timed_out =
      "waiting for the group to form again: rank R: join: the group of 4 ranks did not form "
      "in time; waiting for rank";
  for (int r : {0, 1, 3}) {
    const std::string line = absl::StrReplaceAll(timed_out, {{"rank R", absl::StrCat("rank ", r)}});
    EXPECT_TRUE(WaitFor([&] { return CountOf(ReadFile(client_log(r)), line) >= 3; },
                        absl::Seconds(60)))
        << ReadFile(client_log(r));
  }
  clients[2] = StartClient(2, flags);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    ExpectAllStepsCorrect(r);
  }
}

// ubepd keeps an fd per arena of the group, past the usual soft open-files limit (1024) in a
// group of a thousand ranks: it raises its soft limit to the hard one. (Started here under a
// soft limit of 256.)
TEST_F(DaemonTest, TheSoftOpenFilesLimitIsRaisedToTheHardOne) {
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_max <= 256) GTEST_SKIP() << "the hard limit is " << limit.rlim_max;
  const rlim_t hard = std::min<rlim_t>(limit.rlim_max, rlim_t{1} << 20);
  const std::string ready = dir_.path() + "/ready.json";
  Process daemon({"/usr/bin/prlimit", "--nofile=256:", BinaryPath("ubepd"),
                  "--socket=" + socket_path(), "--metrics=", "--ready_file=" + ready},
                 dir_.path() + "/ubepd.log");
  ASSERT_TRUE(WaitFor([&] { return std::filesystem::exists(ready); }, absl::Seconds(30)))
      << ReadFile(dir_.path() + "/ubepd.log");
  std::string soft;
  const std::string limits = ReadFile(absl::StrCat("/proc/", daemon.pid(), "/limits"));
  for (const absl::string_view line : absl::StrSplit(limits, '\n')) {
    if (!absl::StartsWith(line, "Max open files")) continue;
    const std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (words.size() >= 5) soft = words[3];
  }
  EXPECT_EQ(soft, std::to_string(hard));
  EXPECT_THAT(ReadFile(dir_.path() + "/ubepd.log"),
              HasSubstr(absl::StrCat("open-files limit raised from 256 to ", hard)));
}

// The example refuses flags it cannot run with, naming the flag (exit 2), before it attaches.
TEST_F(DaemonTest, TheServingExampleRefusesFlagsItCannotRunWith) {
  const std::pair<std::vector<std::string>, std::string> refused[] = {
      {{"--world=0"}, "ubep-moe-example: --world 0 is not positive\n"},
      {{"--world=4", "--rank=4"}, "ubep-moe-example: --rank 4 is not in [0, 4)\n"},
      {{"--steps=-1"}, "ubep-moe-example: --steps -1 is negative\n"},
      {{"--join_timeout=0s"}, "ubep-moe-example: --join_timeout 0 is not positive\n"},
      {{"--reattach_timeout=-1s"}, "ubep-moe-example: --reattach_timeout -1s is not positive\n"},
      {{"--slots_per_rank=-1"},
       "ubep-moe-example: --slots_per_rank -1 is negative (0: experts / world)\n"},
      // Its log is what ubep-local and the tests read: one that cannot be written is said.
      {{"--log=/nonexistent/dir/x.log"},
       "ubep-moe-example: --log /nonexistent/dir/x.log: cannot open it: No such file or "
       "directory\n"},
  };
  for (size_t i = 0; i < std::size(refused); ++i) {
    const auto& [flags, message] = refused[i];
    std::vector<std::string> argv = {BinaryPath("ubep-moe-example"), "--socket=" + socket_path()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const std::string out = absl::StrCat(dir_.path(), "/example-refused", i, ".out");
    Process p(argv, out);
    EXPECT_EQ(p.Wait(absl::Seconds(30)), 2) << flags[0];
    EXPECT_EQ(ReadFile(out), message);
  }
}

// The example attaches once at least, however short --reattach_timeout: with 1ns its loop ran
// no try, and the run ended "error attach: An OK status is not a valid constructor argument to
// StatusOr<T>" (exit 3) without attaching.
TEST_F(DaemonTest, TheServingExampleAttachesOnceWhateverItsReattachTimeout) {
  auto daemon = StartDaemon({});
  const std::string out = dir_.path() + "/example-1ns.out";
  Process p({BinaryPath("ubep-moe-example"), "--socket=" + socket_path(), "--rank=0", "--world=1",
             "--steps=3", "--log=" + client_log(0),
             "--traces=" + test::TracePath("decode_in1000out1000.json"), "--reattach_timeout=1ns"},
            out);
  EXPECT_EQ(p.Wait(absl::Seconds(60)), 0) << ReadFile(out) << ReadFile(client_log(0));
}

// A rank whose peer never sends: its dispatch gives up at ubepd's --wait_timeout naming the
// peer, and the timeout is counted for that rank alone (its stats and ubepd's metrics); the
// peer that stalled, calling at last, learns that the group gave up on it.
TEST_F(DaemonTest, AWaitThatGivesUpIsCountedForItsRankAlone) {
  auto daemon = StartDaemon({"--wait_timeout=1s"});
  ClientOptions options;
  options.socket_path = socket_path();
  const ModelShape shape{.num_layers = 1, .num_experts = 4, .hidden = 8, .top_k = 2,
                         .max_tokens = 4, .slots_per_rank = 2};
  std::array<absl::StatusOr<std::unique_ptr<Rank>>, 2> ranks = {absl::UnknownError("not run"),
                                                                absl::UnknownError("not run")};
  {
    std::thread second([&] { ranks[1] = Rank::Attach(options, 1, 2, 0, shape); });
    ranks[0] = Rank::Attach(options, 0, 2, 0, shape);
    second.join();
  }
  ASSERT_TRUE(ranks[0].ok()) << ranks[0].status();
  ASSERT_TRUE(ranks[1].ok()) << ranks[1].status();
  Rank& waiting = **ranks[0];
  Rank& stalled = **ranks[1];
  ASSERT_TRUE(waiting.BeginStep(0).ok());
  ASSERT_TRUE(stalled.BeginStep(0).ok());
  const std::vector<float> x(4 * 8, 1.0f), w(4 * 2, 0.5f);
  const std::vector<int32_t> idx = {0, 2, 1, 3, 0, 3, 1, 2};  // Every token to both ranks.
  Dispatched d;
  const absl::Status gave_up = waiting.Dispatch(0, x.data(), idx.data(), w.data(), 4, d);
  EXPECT_EQ(gave_up, absl::DeadlineExceededError("rank 0: timed out after 1s waiting for rank 1 "
                                                "(dispatch counts, call 1); is rank 1 alive?"));
  EXPECT_EQ(waiting.stats().wait_timeouts, 1u);
  EXPECT_EQ(waiting.stats().errors, 1u);
  EXPECT_EQ(stalled.stats().wait_timeouts, 0u);

  const std::string metrics = Metrics();
  EXPECT_EQ(Sample(metrics, "ubep_daemon_wait_timeouts_total{rank=\"0\"}"), 1) << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_wait_timeouts_total{rank=\"1\"}"), 0) << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_errors_total{code=\"DEADLINE_EXCEEDED\",source=\"client\"}"), 1)
      << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_attached_clients"), 2) << metrics;

  const absl::Status told = stalled.Dispatch(0, x.data(), idx.data(), w.data(), 4, d);
  EXPECT_EQ(told, absl::UnavailableError(
                      "rank 1: dispatch call 1 refused: the group gave up on this rank in this "
                      "call or an earlier one; it must be re-formed"));
  // The rank is stopped, as after any Unavailable: its next step is refused with the same
  // words until it Rejoins (it began step 1 and failed every Dispatch, its group looking whole).
  EXPECT_EQ(stalled.BeginStep(1), told);
  EXPECT_EQ(stalled.stats().wait_timeouts, 0u);
  EXPECT_EQ(stalled.stats().errors, 1u);
  EXPECT_TRUE(waiting.Detach().ok());
  EXPECT_TRUE(stalled.Detach().ok());
}

TEST_F(DaemonTest, SigtermDrainsClientsSeeACleanErrorAndReattachToTheRestartedDaemon) {
  auto daemon = StartDaemon({"--drain_timeout=30s"});
  std::vector<std::unique_ptr<Process>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(StartClient(r, {"--step_delay=20ms"}));
  ASSERT_TRUE(WaitFor([&] { return ParseSteps(ReadFile(client_log(0))).ok_steps.count(20) > 0; },
                      absl::Seconds(60)));
  daemon->Signal(SIGTERM);
  // Every client detached within the drain timeout: exit code 0.
  EXPECT_EQ(daemon->Wait(absl::Seconds(60)), 0) << ReadFile(dir_.path() + "/ubepd.log");
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(ReadFile(client_log(r)), HasSubstr("ubepd is draining")) << ReadFile(client_log(r));
  }
  daemon = StartDaemon();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(clients[r]->Wait(absl::Seconds(120)), 0) << ReadFile(client_log(r));
    ExpectAllStepsCorrect(r);
  }
}

// A second signal during a drain that waits for a client (an operator who will not wait):
// ubepd stops at once, exit 3, saying so, its sockets gone. SIGHUP before it changes nothing.
TEST_F(DaemonTest, ASecondSignalEndsADrainThatWaitsForClients) {
  auto daemon = StartDaemon({"--drain_timeout=10m"});
  const std::optional<Claimed> claimed = AttachAndClaim(0, 2);
  ASSERT_TRUE(claimed.has_value());
  ASSERT_EQ(claimed->reply.bytes, "OK");
  // A hangup (its terminal closed) neither stops nor drains it: it still serves (the health
  // call runs after the signal, which, were it fatal, would have ended the process first).
  daemon->Signal(SIGHUP);
  EXPECT_EQ(Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(daemon->running());
  daemon->Signal(SIGTERM);
  ASSERT_TRUE(WaitFor([&] { return Health() == grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      absl::Seconds(10)));
  daemon->Signal(SIGTERM);  // The same signal again: an operator who will not wait.
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 3);
  EXPECT_THAT(ReadFile(dir_.path() + "/ubepd.log"),
              HasSubstr("ubepd: a second signal: stopping now, without waiting for clients to "
                        "detach\n"));
  EXPECT_FALSE(std::filesystem::exists(socket_path()));
  EXPECT_FALSE(std::filesystem::exists(socket_path() + ".fds"));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/ready.json"));
}

// A Ctrl-C reaches every process of the terminal's group, and a parent (ubep-local) then
// stops its children with SIGTERM: that SIGTERM, another signal right after the first, is not
// a second signal. The drain goes on, and ends cleanly once the client leaves.
TEST_F(DaemonTest, ASigtermRightAfterASigintDoesNotCutTheDrainShort) {
  auto daemon = StartDaemon({"--drain_timeout=10m"});
  std::optional<Claimed> claimed = AttachAndClaim(0, 2);
  ASSERT_TRUE(claimed.has_value());
  ASSERT_EQ(claimed->reply.bytes, "OK");
  daemon->Signal(SIGINT);
  daemon->Signal(SIGTERM);
  ASSERT_TRUE(WaitFor([&] { return Health() == grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      absl::Seconds(10)));
  EXPECT_TRUE(daemon->running());
  claimed.reset();  // The client goes (its fd connection closes).
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0) << ReadFile(dir_.path() + "/ubepd.log");
  EXPECT_THAT(ReadFile(dir_.path() + "/ubepd.log"), Not(HasSubstr("a second signal")));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/ready.json"));
}

TEST_F(DaemonTest, HealthIsNotServingWhileDrainingAndAttachIsRefused) {
  auto daemon = StartDaemon({"--drain_timeout=30s"});
  EXPECT_EQ(Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  // Rank 0 of a 2-rank group attaches and takes its arenas: the drain waits for it.
  std::optional<Claimed> claimed = AttachAndClaim(0, 2);
  ASSERT_TRUE(claimed.has_value());
  const ReceivedMessage* arenas = &claimed->reply;
  EXPECT_EQ(arenas->bytes, "OK");
  EXPECT_EQ(arenas->fds.size(), 2u);
  // The metrics: one client, the arenas' shared memory (the two memfds just received, one per
  // rank of the group), not draining.
  uint64_t shared_bytes = 0;
  for (const UniqueFd& fd : arenas->fds) {
    struct stat st {};
    ASSERT_EQ(fstat(fd.get(), &st), 0);
    shared_bytes += static_cast<uint64_t>(st.st_size);
  }
  std::string metrics = Metrics();
  EXPECT_EQ(Sample(metrics, "ubep_daemon_attached_clients"), 1) << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_arena_bytes{memory=\"host\"}"),
            static_cast<double>(shared_bytes))
      << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_arena_bytes{memory=\"device\"}"), 0) << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_draining"), 0) << metrics;

  daemon->Signal(SIGTERM);
  EXPECT_TRUE(WaitFor([&] { return Health() == grpc::health::v1::HealthCheckResponse::NOT_SERVING; },
                      absl::Seconds(10)));
  // Draining, and still holding the client and its arenas (the exposition stays up until exit).
  metrics = Metrics();
  EXPECT_EQ(Sample(metrics, "ubep_daemon_draining"), 1) << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_attached_clients"), 1) << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_arena_bytes{memory=\"host\"}"),
            static_cast<double>(shared_bytes))
      << metrics;
  EXPECT_EQ(Sample(metrics, "ubep_daemon_arena_bytes{memory=\"device\"}"), 0) << metrics;
  const grpc::Status refused = Attach(Request(1, 2));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(refused.error_message(),
            "ubepd is draining (shutting down); attach again when it is back");
  EXPECT_TRUE(daemon->running());

  v1::DetachRequest detach;
  detach.set_rank(0);
  detach.set_token(claimed->token);
  v1::DetachResponse detached;
  grpc::ClientContext context;
  const grpc::Status status = Stub()->Detach(&context, detach, &detached);
  EXPECT_TRUE(status.ok()) << status.error_message() << "\n" << ReadFile(dir_.path() + "/ubepd.log");
  EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0);
}

TEST_F(DaemonTest, ConflictingShapeIsFailedPreconditionNamingTheField) {
  auto daemon = StartDaemon();
  ASSERT_TRUE(Attach(Request(0, 2)).ok());
  v1::AttachRequest other = Request(1, 2);
  other.mutable_shape()->set_hidden(64);
  const grpc::Status status = Attach(other);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "shape conflicts with the attached group: hidden is 64, the group has 32");
  // A dtype by its name; of several fields, the first in the proto's order.
  v1::AttachRequest bf16 = Request(1, 2);
  bf16.mutable_shape()->set_dtype(v1::DTYPE_BFLOAT16);
  bf16.mutable_shape()->set_max_tokens(bf16.shape().max_tokens() + 1);
  const grpc::Status dtype = Attach(bf16);
  EXPECT_EQ(dtype.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(dtype.error_message(),
            absl::StrCat("shape conflicts with the attached group: max_tokens is ",
                         bf16.shape().max_tokens(), ", the group has ",
                         bf16.shape().max_tokens() - 1));
  bf16.mutable_shape()->set_max_tokens(bf16.shape().max_tokens() - 1);
  EXPECT_EQ(Attach(bf16).error_message(),
            "shape conflicts with the attached group: dtype is DTYPE_BFLOAT16, the group has "
            "DTYPE_FLOAT32");
  const grpc::Status world = Attach(Request(1, 3));
  EXPECT_EQ(world.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(world.error_message(),
            "shape conflicts with the attached group: world_size is 3, the group has 2");
  const grpc::Status twice = Attach(Request(0, 2));
  EXPECT_EQ(twice.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(twice.error_message(), absl::StrCat("rank 0 is already attached (pid ", getpid(),
                                                "); detach it or stop that process first"));
}

TEST_F(DaemonTest, MalformedAndOversizedRequestsAreRefusedAndTheDaemonKeepsServing) {
  auto daemon = StartDaemon({"--max_arena_bytes=1000000", "--max_message_bytes=1048576"});
  struct Case {
    std::function<void(v1::AttachRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::AttachRequest& q) { q.set_rank(5); }, "rank 5 is outside [0, 2)"},
      {[](v1::AttachRequest& q) { q.set_world_size(0); }, "world_size 0 is outside [1, 1024]"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_top_k(33); },
       "shape.top_k 33 exceeds 32"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_hidden(0); },
       "shape.hidden must be positive"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_num_experts(9); },
       "shape.slots_per_rank 4 x world_size 2 cannot hold 9 experts"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_max_tokens(2000000); },
       "shape.max_tokens 2000000 exceeds 1048576"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_num_layers(100000000); },
       "shape.num_layers 100000000 exceeds 4096"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_dtype(static_cast<v1::DType>(7)); },
       "shape.dtype 7 is not a DType"},
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_max_tokens(4096); },
       "this shape needs an arena of 2322432 bytes per rank, over the 1000000 bytes ubepd "
       "allows (--max_arena_bytes)"},
      // Times the 12 buffers of the arena, 2^61 wraps in 64 bits (to 2^63).
      {[](v1::AttachRequest& q) { q.mutable_shape()->set_bytes_per_expert(uint64_t{1} << 61); },
       "shape.bytes_per_expert 2305843009213693952 in 6 buffers per layer x 2 layers "
       "is over the 1000000 bytes per rank ubepd allows (--max_arena_bytes)"},
  };
  for (const Case& c : cases) {
    v1::AttachRequest q = Request(0, 2);
    c.mutate(q);
    const grpc::Status status = Attach(q);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_EQ(status.error_message(), c.message);
  }
  // A request over the message size limit (1 MiB here) is refused by gRPC before it is parsed.
  v1::AttachRequest huge = Request(0, 2);
  huge.GetReflection()->MutableUnknownFields(&huge)->AddLengthDelimited(1000, std::string(2 << 20, 'x'));
  EXPECT_EQ(Attach(huge).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Bytes that are not an AttachRequest at all.
  grpc::GenericStub generic(grpc::CreateChannel("unix:" + socket_path(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const std::string garbage = "\xff\xff\xff\xff\x0f";
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1), response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status garbage_status;
  generic.UnaryCall(&context, "/ubep.v1.Daemon/Attach", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      garbage_status = s;
                      done = true;
                      cv.notify_all();
                    });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  // gRPC refuses a request it cannot parse before any handler runs.
  EXPECT_EQ(garbage_status.error_code(), grpc::StatusCode::INTERNAL);
  // Still serving: a valid attach succeeds and the errors were counted.
  EXPECT_TRUE(Attach(Request(0, 2)).ok());
  EXPECT_EQ(Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Sample(Metrics(), "ubep_daemon_errors_total{code=\"INVALID_ARGUMENT\",source=\"rpc\"}"),
            static_cast<double>(cases.size()));
}

// A mode given with leading zeros (as `install -m 00640` takes it) is the same mode.
TEST_F(DaemonTest, ASocketModeWithLeadingZerosIsTaken) {
  auto daemon = StartDaemon({"--socket_mode=000640"});
  for (const std::string& path : {socket_path(), socket_path() + ".fds"}) {
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, 0640u) << path;
  }
}

TEST_F(DaemonTest, SocketsAreGroupOnlyAndOthersCannotConnect) {
  auto daemon = StartDaemon();
  for (const std::string& path : {socket_path(), socket_path() + ".fds"}) {
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
    EXPECT_TRUE(S_ISSOCK(st.st_mode)) << path;
    EXPECT_EQ(st.st_mode & 0777, 0660u) << path;
  }
  if (geteuid() != 0) GTEST_SKIP() << "needs root to try connecting as another user";
  // A process of another user and group (nobody) is refused by the kernel: by the sockets'
  // modes, the directory being one it may pass through (mkdtemp's 0700 would refuse it any
  // socket, and the test could not fail). A socket of mode 0666 beside them, which it may
  // connect to, shows that.
  ASSERT_EQ(chmod(dir_.path().c_str(), 0711), 0);
  const std::string open_path = dir_.path() + "/open.sock";
  absl::StatusOr<UniqueFd> open_listener = ListenUnix(open_path, 0666);
  ASSERT_TRUE(open_listener.ok()) << open_listener.status();
  auto connect_as_nobody = [](const std::string& path, int type) {
    const pid_t child = fork();
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
      const int fd = socket(AF_UNIX, type, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
      const int r = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      _exit(r == 0 ? 0 : (errno == EACCES ? 13 : 11));
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  const int control = connect_as_nobody(open_path, SOCK_SEQPACKET);
  if (control == 13) GTEST_SKIP() << dir_.path() << "'s parents are closed to other users";
  ASSERT_EQ(control, 0) << open_path << ": a socket of mode 0666";
  for (const std::string& path : {socket_path(), socket_path() + ".fds"}) {
    EXPECT_EQ(connect_as_nobody(path, path == socket_path() ? SOCK_STREAM : SOCK_SEQPACKET), 13)
        << path << ": expected EACCES";
  }
}

// A static plan whose slots do not hold their own index's expert (slot i holds expert i only
// under round-robin): the C and Python examples ask which expert each slot holds.
std::string PermutedPlan(const test::TempDir& dir) {
  const std::string path = dir.path() + "/permuted.json";
  std::ofstream(path) << R"({"phy2log": [[2, 0, 3, 1]], "num_experts": 4})";
  return path;
}

// The C example, under ubepd's round-robin plan and under a permuted one.
TEST_F(DaemonTest, CAbiClientDispatchesAndCombines) {
  for (const bool permuted : {false, true}) {
    SCOPED_TRACE(permuted ? "permuted plan" : "round-robin plan");
    auto daemon = StartDaemon(permuted ? std::vector<std::string>{"--plan=" + PermutedPlan(dir_)}
                                       : std::vector<std::string>{});
    const std::string out = dir_.path() + (permuted ? "/c-permuted.out" : "/c.out");
    Process c({BinaryPath("ubep-c-example"), socket_path()}, out);
    EXPECT_EQ(c.Wait(absl::Seconds(60)), 0) << ReadFile(out);
    EXPECT_EQ(ReadFile(out),
              "bad expert: code 3: topk_idx[2][1] = 7 is outside [-1, 4)\nc api ok: 8 rows\n");
    daemon->Signal(SIGTERM);
    EXPECT_EQ(daemon->Wait(absl::Seconds(30)), 0) << ReadFile(dir_.path() + "/ubepd.log");
  }
}

#ifdef UBEP_SHARED_CLIENT
// Python, standard library only, calls libubep.so through ctypes (as an engine's binding
// would): the same step as the C example, every value and the counters checked.
TEST_F(DaemonTest, PythonCallsLibubepThroughCtypes) {
  auto daemon = StartDaemon({"--plan=" + PermutedPlan(dir_)});  // Slot i holds another expert.
  const std::string out = dir_.path() + "/python.out";
  Process python({UBEP_PYTHON3, std::string(UBEP_SOURCE_DIR) + "/examples/python/ubep_ctypes.py",
                  UBEP_SHARED_CLIENT, socket_path()},
                 out);
  EXPECT_EQ(python.Wait(absl::Seconds(60)), 0) << ReadFile(out);
  EXPECT_EQ(ReadFile(out),
            "bad expert: code 3: topk_idx[2][1] = 7 is outside [-1, 4)\npython ffi ok: 8 rows\n");
}
#endif

// Calls out of order are refused with what was expected, and the rank goes on: a step before
// the one begun (its plan may route to slots that now hold other experts), a combine of an
// earlier dispatch's output (the backend would combine the last one's rows), a negative shape
// field (sent unsigned, it would read as a huge one), a null socket path through the C ABI.
TEST_F(DaemonTest, CallsOutOfOrderAreRefusedNamingWhatWasExpected) {
  auto daemon = StartDaemon();
  ClientOptions options;
  options.socket_path = socket_path();
  ModelShape shape{.num_layers = 2, .num_experts = 4, .hidden = 8, .top_k = 2, .max_tokens = 4,
                   .slots_per_rank = 4};
  shape.hidden = -8;
  EXPECT_EQ(Rank::Attach(options, 0, 1, 0, shape).status(),
            absl::InvalidArgumentError("ModelShape::hidden is -8; it must not be negative"));
  shape.hidden = 8;
  EXPECT_EQ(Rank::Attach(options, 0, 1, -1, shape).status(),
            absl::InvalidArgumentError("device -1 is negative"));
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, shape, 10);
  ASSERT_TRUE(rank.ok()) << rank.status();
  Rank& r = **rank;
  ASSERT_EQ(r.resume_step(), 10u);
  EXPECT_EQ(r.BeginStep(9), absl::InvalidArgumentError(
                                "rank 0: step 9 is before step 10, where this rank is (steps only "
                                "go forward; after Rejoin, from the step it returns)"));
  // A negative step passed as unsigned (-1 from an FFI caller): refused, where taken it made
  // every later step "before" it until a Rejoin.
  EXPECT_EQ(r.BeginStep(std::numeric_limits<uint64_t>::max()),
            absl::InvalidArgumentError("rank 0: step 18446744073709551615 is above 2^63 - 1 (a "
                                       "negative step passed as unsigned?)"));
  ASSERT_TRUE(r.BeginStep(12).ok());
  ASSERT_TRUE(r.BeginStep(12).ok());  // Again (after an error, say): the same plan.
  EXPECT_EQ(r.BeginStep(11).message(),
            "rank 0: step 11 is before step 12, where this rank is (steps only go forward; "
            "after Rejoin, from the step it returns)");
  std::vector<float> x(4 * 8, 1.0f), w(4 * 2, 0.5f), out(4 * 8);
  const std::vector<int32_t> idx = {0, 1, 1, 2, 2, 3, 3, 0};
  Dispatched none;
  EXPECT_EQ(r.Dispatch(0, x.data(), idx.data(), w.data(), 4, none),  // Refused: no step open.
            absl::FailedPreconditionError("rank 0: call BeginStep before Dispatch"));
  ASSERT_TRUE(r.BeginStep(13).ok());
  const std::vector<float> y(8 * 8, 1.0f);
  Dispatched first, second, never;
  ASSERT_TRUE(r.Dispatch(0, x.data(), idx.data(), w.data(), 4, first).ok());
  ASSERT_TRUE(r.Combine(first, y.data(), out.data()).ok());
  ASSERT_TRUE(r.Dispatch(1, x.data(), idx.data(), w.data(), 4, second).ok());
  EXPECT_EQ(r.Combine(first, y.data(), out.data()),
            absl::InvalidArgumentError("rank 0: combine takes the output of this rank's last "
                                       "dispatch (2 so far); this one is of dispatch 1"));
  EXPECT_EQ(r.Combine(never, y.data(), out.data()),
            absl::FailedPreconditionError("rank 0: combine without a dispatch (this output holds "
                                          "none: no Dispatch filled it, or its Dispatch failed)"));
  std::fill(out.begin(), out.end(), 0.0f);
  ASSERT_TRUE(r.Combine(second, y.data(), out.data()).ok());
  EXPECT_EQ(out, std::vector<float>(4 * 8, 1.0f));
  EXPECT_EQ(r.stats().combine_calls, 2u);
  const RankStats attached = r.stats();
  ASSERT_TRUE(r.Detach().ok());
  // Detached, the counts stay as they stood (the arena holding them is let go).
  const RankStats detached = r.stats();
  EXPECT_EQ(detached.combine_calls, 2u);
  EXPECT_EQ(detached.dispatch_calls, attached.dispatch_calls);
  EXPECT_EQ(detached.dispatched_tokens, attached.dispatched_tokens);
  EXPECT_EQ(detached.errors, attached.errors);
  // The two BeginSteps going back, the negative one and the two combines of the wrong output
  // (RankStats::errors: misuse that fails the group's call); not the Dispatch before BeginStep.
  EXPECT_EQ(detached.errors, 5u);
  // The rank attached again (its state may take the detached one's address, and its
  // dispatches count from 1 again) does not take the output of the one detached before.
  rank->reset();
  absl::StatusOr<std::unique_ptr<Rank>> again = Rank::Attach(options, 0, 1, 0, shape, 20);
  ASSERT_TRUE(again.ok()) << again.status();
  Rank& a = **again;
  ASSERT_TRUE(a.BeginStep(20).ok());
  Dispatched fresh;
  ASSERT_TRUE(a.Dispatch(0, x.data(), idx.data(), w.data(), 4, fresh).ok());
  ASSERT_TRUE(a.Combine(fresh, y.data(), out.data()).ok());
  ASSERT_TRUE(a.Dispatch(1, x.data(), idx.data(), w.data(), 4, fresh).ok());
  EXPECT_EQ(a.Combine(second, y.data(), out.data()),
            absl::InvalidArgumentError("rank 0: combine takes the output of this rank's last "
                                       "dispatch (2 so far); this one is not of this rank"));
  ASSERT_TRUE(a.Combine(fresh, y.data(), out.data()).ok());
  ASSERT_TRUE(a.Detach().ok());

  auto* c_rank = reinterpret_cast<ubep_rank*>(uintptr_t{0x10});  // Whatever was there.
  const ubep_model_shape good = {sizeof(ubep_model_shape), 1, 4, 8, 2, 4, 4, 0, UBEP_DTYPE_FLOAT32, 0};
  EXPECT_EQ(ubep_attach_at(nullptr, 0, 1, 0, &good, 7, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_attach_at: null argument");
  EXPECT_EQ(c_rank, nullptr);
  c_rank = reinterpret_cast<ubep_rank*>(uintptr_t{0x10});
  EXPECT_EQ(ubep_attach(socket_path().c_str(), 0, 1, 0, nullptr, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_attach: null argument");
  EXPECT_EQ(c_rank, nullptr);
}

// The C++ API on a rank that detached, and the C ABI on a null handle or an unknown dtype:
// a clear error each, never a crash (a rank of a group of one, against a real ubepd).
TEST_F(DaemonTest, ADetachedRankAndNullHandlesGetErrorsNotCrashes) {
  auto daemon = StartDaemon();
  ClientOptions options;
  options.socket_path = socket_path();
  const ModelShape shape{.num_layers = 1, .num_experts = 4, .hidden = 8, .top_k = 2,
                         .max_tokens = 4, .slots_per_rank = 4};
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, shape);
  ASSERT_TRUE(rank.ok()) << rank.status();
  Rank& r = **rank;
  ASSERT_TRUE(r.BeginStep(r.resume_step()).ok());
  std::vector<float> x(4 * 8, 1.0f), w(4 * 2, 0.5f), out(4 * 8);
  const std::vector<int32_t> idx = {0, 1, 1, 2, 2, 3, 3, 0};
  Dispatched earlier;  // A step's output, kept after its combine.
  ASSERT_TRUE(r.Dispatch(0, x.data(), idx.data(), w.data(), 4, earlier).ok());
  std::vector<float> ones(8 * 8, 1.0f);
  ASSERT_TRUE(r.Combine(earlier, ones.data(), out.data()).ok());
  ASSERT_TRUE(r.BeginStep(r.resume_step() + 1).ok());
  Dispatched d;
  ASSERT_TRUE(r.Dispatch(0, x.data(), idx.data(), w.data(), 4, d).ok());
  // A moved-from output is an empty one, reusable; a Combine without its buffers is refused
  // before any byte moves, and the right one then serves the call.
  Dispatched moved(std::move(d));
  EXPECT_EQ(d.num_rows(), 0);
  EXPECT_TRUE(d.slot_offsets().empty());
  ASSERT_EQ(moved.num_rows(), 8);
  EXPECT_EQ(r.Combine(moved, nullptr, out.data()),
            absl::InvalidArgumentError(
                "combine: y (with rows received) and out (with tokens sent) must be non-null"));
  // Moved into one that holds an output (of the step before), it is there alone: the one
  // moved from is emptied, not left holding the other's old output.
  earlier = std::move(moved);
  EXPECT_EQ(earlier.num_rows(), 8);
  EXPECT_EQ(moved.num_rows(), 0);
  EXPECT_TRUE(moved.slot_offsets().empty());
  moved = std::move(earlier);
  Dispatched& same = moved;
  moved = std::move(same);  // Moved into itself: kept.
  EXPECT_EQ(moved.num_rows(), 8);
  const std::vector<float> y(8 * 8, 1.0f);
  ASSERT_TRUE(r.Combine(moved, y.data(), out.data()).ok());
  EXPECT_EQ(out, std::vector<float>(4 * 8, 1.0f));  // Two experts' ones, weighted 0.5 each.
  absl::StatusOr<int> slot2 = r.SlotExpert(0, 2);
  ASSERT_TRUE(slot2.ok()) << slot2.status();
  EXPECT_FALSE(r.must_attach_again());
  EXPECT_TRUE(r.WeightsLoaded().ok());
  ASSERT_TRUE(r.Detach().ok());
  // Detached: only an Attach serves again (an engine's error handler that runs again on the
  // old Rank is not sent to Rejoin).
  EXPECT_TRUE(r.must_attach_again());
  const absl::Status detached = absl::FailedPreconditionError(
      "rank 0 is detached (Detach, or a failed Attach): attach again");
  EXPECT_EQ(r.Rejoin(std::nullopt).status(), detached);
  EXPECT_EQ(r.Dispatch(0, x.data(), idx.data(), w.data(), 4, d), detached);
  EXPECT_EQ(r.Combine(d, x.data(), out.data()), detached);
  EXPECT_EQ(r.ExpertWeights(0, 0).status(), detached);
  EXPECT_EQ(r.SlotExpert(0, 0).status(), detached);
  EXPECT_EQ(r.WeightsLoaded(), detached);
  EXPECT_EQ(r.BeginStep(r.resume_step() + 1), detached);
  EXPECT_EQ(ubep_weights_loaded(nullptr), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_weights_loaded: null handle");

  EXPECT_EQ(ubep_begin_step(nullptr, 0), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_begin_step: null handle");
  EXPECT_EQ(ubep_combine(nullptr, nullptr, nullptr, nullptr),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_combine: null handle");
  const ubep_model_shape bad_dtype = {sizeof(ubep_model_shape), 1, 4, 8, 2, 4, 4, 0, 7, 0};
  ubep_rank* c_rank = nullptr;
  EXPECT_EQ(ubep_attach(socket_path().c_str(), 0, 1, 0, &bad_dtype, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(),
               "ubep_attach: dtype 7 is neither UBEP_DTYPE_FLOAT32 (0) nor UBEP_DTYPE_BFLOAT16 (1)");
  EXPECT_EQ(c_rank, nullptr);
  // The shape's size is the caller's: one not set (or of another header) is refused by name.
  ubep_model_shape unsized = bad_dtype;
  unsized.dtype = UBEP_DTYPE_FLOAT32;
  unsized.struct_size = 0;
  EXPECT_EQ(ubep_attach(socket_path().c_str(), 0, 1, 0, &unsized, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(std::string(ubep_last_error()),
            absl::StrCat("ubep_attach: shape->struct_size is 0, not this library's "
                         "sizeof(ubep_model_shape) ", sizeof(ubep_model_shape),
                         " (set it to sizeof(ubep_model_shape))"));
  unsized.struct_size = sizeof(ubep_model_shape) + 8;
  EXPECT_EQ(ubep_attach(socket_path().c_str(), 0, 1, 0, &unsized, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(std::string(ubep_last_error()),
            absl::StrCat("ubep_attach: shape->struct_size is ", sizeof(ubep_model_shape) + 8,
                         ", not this library's sizeof(ubep_model_shape) ",
                         sizeof(ubep_model_shape),
                         " (the caller was built with a newer ubep_c.h than this libubep)"));
  EXPECT_EQ(c_rank, nullptr);
  // Each attach names itself.
  ubep_client_options with;
  ubep_client_options_init(&with, sizeof(with));
  const std::string socket_for_with = socket_path();
  with.socket_path = socket_for_with.c_str();
  EXPECT_EQ(ubep_attach_with(&with, 0, 1, 0, &bad_dtype, -1, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(),
               "ubep_attach_with: dtype 7 is neither UBEP_DTYPE_FLOAT32 (0) nor "
               "UBEP_DTYPE_BFLOAT16 (1)");
  EXPECT_EQ(ubep_attach_at(socket_path().c_str(), 0, 1, 0, &bad_dtype, 3, &c_rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(),
               "ubep_attach_at: dtype 7 is neither UBEP_DTYPE_FLOAT32 (0) nor "
               "UBEP_DTYPE_BFLOAT16 (1)");
  EXPECT_EQ(c_rank, nullptr);

  // The C ABI's attach at a known step, and the expert a slot holds, as the C++ API says.
  const ubep_model_shape good = {sizeof(ubep_model_shape), 1, 4, 8, 2, 4, 4, 0, UBEP_DTYPE_FLOAT32, 0};
  ASSERT_EQ(ubep_attach_at(socket_path().c_str(), 0, 1, 0, &good, 7, &c_rank), 0)
      << ubep_last_error();
  EXPECT_EQ(ubep_resume_step(c_rank), 7u);
  ASSERT_EQ(ubep_begin_step(c_rank, 7), 0) << ubep_last_error();
  int32_t expert = -1;
  ASSERT_EQ(ubep_slot_expert(c_rank, 0, 2, &expert), 0) << ubep_last_error();
  EXPECT_EQ(expert, *slot2);
  EXPECT_EQ(ubep_slot_expert(c_rank, 0, 9, &expert),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "(layer 0, slot 9) is outside the shape");
  EXPECT_EQ(ubep_slot_expert(c_rank, 0, 2, nullptr),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_slot_expert: expert is null");
  EXPECT_EQ(ubep_detach(c_rank), 0) << ubep_last_error();
}

// The C ABI's options: the defaults are ubep::ClientOptions', a struct not filled by init or
// a zero timeout is refused with an error naming it, and a group that never forms fails after
// the join timeout given (1 s here, of the default 60 s).
TEST_F(DaemonTest, CAbiOptionsAreCheckedAndUsed) {
  auto daemon = StartDaemon();
  ubep_client_options options;
  std::memset(&options, 0xab, sizeof(options));
  ubep_client_options_init(&options, sizeof(options));
  EXPECT_EQ(options.struct_size, sizeof(ubep_client_options));
  // An older caller's smaller struct: nothing past its size is written.
  {
    std::array<unsigned char, sizeof(ubep_client_options) + 16> bytes;
    bytes.fill(0xab);
    const size_t older = offsetof(ubep_client_options, join_timeout_ms);
    ubep_client_options_init(reinterpret_cast<ubep_client_options*>(bytes.data()), older);
    size_t struct_size = 0;
    std::memcpy(&struct_size, bytes.data(), sizeof(struct_size));
    EXPECT_EQ(struct_size, older);
    for (size_t i = older; i < bytes.size(); ++i) EXPECT_EQ(bytes[i], 0xab) << "byte " << i;
  }
  // A newer caller's larger struct: this library's fields are filled, nothing past them is
  // written, and the caller's size is kept, so that ubep_attach_with refuses the struct
  // rather than ignore its newer fields.
  {
    std::array<unsigned char, sizeof(ubep_client_options) + 16> bytes;
    bytes.fill(0xab);
    const size_t newer = sizeof(ubep_client_options) + 8;
    auto* larger = reinterpret_cast<ubep_client_options*>(bytes.data());
    ubep_client_options_init(larger, newer);
    EXPECT_EQ(larger->struct_size, newer);
    EXPECT_EQ(larger->rpc_timeout_ms, 10000);
    for (size_t i = sizeof(ubep_client_options); i < bytes.size(); ++i) {
      EXPECT_EQ(bytes[i], 0xab) << "byte " << i;
    }
    const ubep_model_shape one = {sizeof(ubep_model_shape), 1, 4, 8, 2, 4, 4, 0, UBEP_DTYPE_FLOAT32, 0};
    ubep_rank* none = nullptr;
    EXPECT_EQ(ubep_attach_with(larger, 0, 2, 0, &one, -1, &none),
              static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_EQ(std::string(ubep_last_error()),
              absl::StrCat("ubep_attach_with: options->struct_size is ", newer,
                           ", not this library's sizeof(ubep_client_options) ",
                           sizeof(ubep_client_options),
                           " (the caller was built with a newer ubep_c.h than this libubep)"));
    EXPECT_EQ(none, nullptr);
  }
  EXPECT_STREQ(options.socket_path, "/run/ubep/ubepd.sock");
  EXPECT_EQ(options.rpc_timeout_ms, 10000);
  EXPECT_EQ(options.join_timeout_ms, 60000);
  EXPECT_EQ(options.decision_timeout_ms, 30000);
  EXPECT_EQ(options.daemon_check_interval_ms, 1000);

  const ubep_model_shape shape = {sizeof(ubep_model_shape), 1, 4, 8, 2, 4, 4, 0, UBEP_DTYPE_FLOAT32, 0};
  const std::string socket = socket_path();
  options.socket_path = socket.c_str();
  ubep_rank* rank = nullptr;
  ubep_client_options unfilled = options;
  unfilled.struct_size = 0;
  EXPECT_EQ(ubep_attach_with(&unfilled, 0, 2, 0, &shape, -1, &rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(std::string(ubep_last_error()),
            absl::StrCat("ubep_attach_with: options->struct_size is 0, not this library's "
                         "sizeof(ubep_client_options) ", sizeof(ubep_client_options),
                         " (fill the options with ubep_client_options_init)"));
  EXPECT_EQ(ubep_attach_with(&options, 0, 2, 0, nullptr, -1, &rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_attach_with: null argument");
  ubep_client_options zero = options;
  zero.join_timeout_ms = 0;
  EXPECT_EQ(ubep_attach_with(&zero, 0, 2, 0, &shape, -1, &rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(),
               "ClientOptions::join_timeout must be positive and under 1000000h, not 0");
  EXPECT_EQ(rank, nullptr);
  // One that never ends (INT64_MAX ms) is refused too: every wait has an end.
  ubep_client_options forever = options;
  forever.decision_timeout_ms = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(ubep_attach_with(&forever, 0, 2, 0, &shape, -1, &rank),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ClientOptions::decision_timeout must be positive and under "
                                  "1000000h, not 2562047788015h12m55.807s");
  EXPECT_EQ(rank, nullptr);

  // Rank 0 of a group of 2 whose rank 1 never comes.
  options.join_timeout_ms = 1000;
  EXPECT_EQ(ubep_attach_with(&options, 0, 2, 0, &shape, -1, &rank),
            static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_STREQ(ubep_last_error(),
               "rank 0: join: the group of 2 ranks did not form in time; waiting for rank 1 "
               "(not attached)");
  EXPECT_EQ(rank, nullptr);
}

// ubep_stats: the counters of the C++ API's RankStats, after one step of a group of one;
// ubep_dispatched_plan: the plan and layer of a dispatch.
TEST_F(DaemonTest, CAbiStatsCountTheCalls) {
  auto daemon = StartDaemon();
  const ubep_model_shape shape = {sizeof(ubep_model_shape), 1, 4, 8, 2, 4, 4, 0, UBEP_DTYPE_FLOAT32, 0};
  ubep_client_options options;
  ubep_client_options_init(&options, sizeof(options));
  const std::string socket = socket_path();
  options.socket_path = socket.c_str();
  ubep_rank* rank = nullptr;
  ASSERT_EQ(ubep_attach_with(&options, 0, 1, 0, &shape, 5, &rank), 0) << ubep_last_error();
  ubep_rank_stats stats{};
  EXPECT_EQ(ubep_stats(rank, nullptr), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_stats: out is null");
  EXPECT_EQ(ubep_stats(nullptr, &stats), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_stats: null handle");
  EXPECT_EQ(ubep_stats(rank, &stats), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(std::string(ubep_last_error()),
            absl::StrCat("ubep_stats: out->struct_size is 0, not this library's "
                         "sizeof(ubep_rank_stats) ", sizeof(ubep_rank_stats)));
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(ubep_begin_step(rank, 5), 0) << ubep_last_error();
  std::vector<float> x(4 * 8, 1.0f), w(4 * 2, 0.5f), out(4 * 8);
  std::vector<int32_t> idx = {0, 1, 1, 2, 2, 3, 3, 0};
  ubep_dispatched* d = ubep_dispatched_new();
  ASSERT_EQ(ubep_dispatch(rank, 0, x.data(), idx.data(), w.data(), 4, d), 0) << ubep_last_error();
  int32_t rows = 0;
  const void* recv = nullptr;
  ubep_dispatched_view(d, &rows, &recv, nullptr, nullptr, nullptr, nullptr);
  uint64_t plan = 0;
  int32_t layer = -1;
  ASSERT_EQ(ubep_dispatched_plan(d, &plan, &layer), 0) << ubep_last_error();
  EXPECT_EQ(plan, 1u);
  EXPECT_EQ(layer, 0);
  EXPECT_EQ(ubep_dispatched_plan(nullptr, &plan, &layer),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "ubep_dispatched_plan: null handle");
  {
    // A null handle's view: no rows, null views (a caller's loop bound is never left unset).
    int32_t no_rows = 77;
    const void* no_recv = &no_rows;
    const int32_t* no_offsets = &no_rows;
    const float* no_weights = reinterpret_cast<const float*>(&no_rows);
    ubep_dispatched_view(nullptr, &no_rows, &no_recv, &no_offsets, nullptr, nullptr, &no_weights);
    EXPECT_EQ(no_rows, 0);
    EXPECT_EQ(no_recv, nullptr);
    EXPECT_EQ(no_offsets, nullptr);
    EXPECT_EQ(no_weights, nullptr);
  }
  ASSERT_EQ(ubep_combine(rank, d, recv, out.data()), 0) << ubep_last_error();
  idx[3] = 9;  // Out of range: counted as an error.
  EXPECT_EQ(ubep_dispatch(rank, 0, x.data(), idx.data(), w.data(), 4, d),
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_STREQ(ubep_last_error(), "topk_idx[1][1] = 9 is outside [-1, 4)");
  ASSERT_EQ(ubep_stats(rank, &stats), 0) << ubep_last_error();
  EXPECT_EQ(stats.generation, 1u);
  EXPECT_EQ(stats.step, 5u);
  EXPECT_EQ(stats.dispatched_tokens, 4u);
  EXPECT_EQ(stats.dispatch_calls, 1u);
  EXPECT_EQ(stats.combine_calls, 1u);
  EXPECT_EQ(stats.wait_timeouts, 0u);
  EXPECT_EQ(stats.errors, 1u);
  EXPECT_EQ(stats.plan_version, 1u);
  ubep_dispatched_free(d);
  EXPECT_EQ(ubep_detach(rank), 0) << ubep_last_error();
}

}  // namespace
}  // namespace ubep
