// The balancer's state machine in process: the load window, and Register / ReportLoad from
// many threads while the loop ticks (run under TSan: label concurrent). The end-to-end
// behaviour with real daemons is tests/integration/balancer_test.cc.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <map>
#include <tuple>

#include "balancer/core/plan.h"
#include "balancer/formats/proto_convert.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "balancer/server/balancer.h"
#include "balancer/server/load_window.h"
#include "grpcpp/grpcpp.h"
#include "gmock/gmock.h"
#include "common/clock.h"
#include "common/shape_limits.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "tests/unit/proto_mutate.h"
#include "tests/wait_for.h"

namespace ubep::balancer {
namespace {

using ::testing::DoubleNear;
using ::testing::Optional;

LoadMatrix Filled(double value) {
  LoadMatrix m(2, 3);
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 3; ++e) m.at(l, e) = value * (e + 1);
  }
  return m;
}

TEST(LoadWindowTest, KeepsTheLastIntervals) {
  LoadWindow window(2, 3, /*intervals=*/2);
  window.Add(Filled(1));
  window.Add(Filled(1));  // Same interval: summed.
  window.Close();
  window.Add(Filled(10));
  window.Close();
  EXPECT_EQ(window.Current().at(1, 2), 2 * 3 + 30);
  window.Add(Filled(100));
  window.Close();  // The first interval falls out.
  EXPECT_EQ(window.Current().at(1, 2), 30 + 300);
  EXPECT_EQ(window.closed_intervals(), 3);
}

// Read as counts: the average times (2 - alpha) / alpha = 7 intervals.
TEST(LoadWindowTest, EwmaWeighsTheNewestInterval) {
  LoadWindow window(2, 3, 1, /*ewma_alpha=*/0.25);
  window.Close();  // Nothing reported yet: no data, not zero load.
  window.Add(Filled(4));
  window.Close();
  EXPECT_EQ(window.Current().at(0, 0), 4 * 7);  // The first interval with data seeds it.
  window.Add(Filled(8));
  window.Close();
  EXPECT_EQ(window.Current().at(0, 0), (0.25 * 8 + 0.75 * 4) * 7);
  window.Close();  // An interval without reports leaves it.
  EXPECT_EQ(window.Current().at(0, 0), (0.25 * 8 + 0.75 * 4) * 7);
  window.Add(Filled(0));  // Reports of no load: zero load.
  window.Close();
  EXPECT_EQ(window.Current().at(0, 0), 0.75 * (0.25 * 8 + 0.75 * 4) * 7);
}

// A steady load reads alike through a window of N intervals and an EWMA of alpha 2 / (N + 1):
// the policy's noise model (its slack) sees the same counts either way.
TEST(LoadWindowTest, ASteadyLoadReadsAlikeThroughAWindowAndTheMatchingEwma) {
  LoadWindow window(2, 3, /*intervals=*/9);
  LoadWindow ewma(2, 3, 1, /*ewma_alpha=*/2.0 / (9 + 1));
  for (int i = 0; i < 12; ++i) {
    window.Add(Filled(100));
    window.Close();
    ewma.Add(Filled(100));
    ewma.Close();
  }
  EXPECT_DOUBLE_EQ(window.Current().at(1, 2), 900 * 3);
  EXPECT_DOUBLE_EQ(ewma.Current().at(1, 2), 900 * 3);
}

v1::RegisterRequest Registration(const std::string& node, uint32_t first_rank) {
  v1::RegisterRequest q;
  q.set_node(node);
  q.set_address("127.0.0.1:1");  // Nobody there: health checks fail, reports still count.
  q.set_world_size(4);
  q.add_ranks(first_rank);
  q.add_ranks(first_rank + 1);
  q.mutable_shape()->set_num_layers(2);
  q.mutable_shape()->set_num_experts(6);
  q.mutable_shape()->set_slots_per_rank(2);
  q.set_free_buffers(1);
  return q;
}

// A shape out of range is refused, naming the field, and does not become the cluster's: a
// daemon with a good one then registers.
TEST(BalancerServerTest, ARegistrationWithAShapeOutOfRangeIsRefused) {
  Balancer balancer(BalancerOptions{}, std::make_shared<prometheus::Registry>());
  struct Case {
    std::function<void(v1::RegisterRequest&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::RegisterRequest& q) { q.set_world_size(3000000000u); },
       "world_size 3000000000 is outside [1, 1024]"},
      {[](v1::RegisterRequest& q) { q.mutable_shape()->set_num_layers(100000000); },
       "shape.num_layers 100000000 is outside [1, 4096]"},
      {[](v1::RegisterRequest& q) { q.mutable_shape()->set_num_experts(0); },
       "shape.num_experts 0 is outside [1, 1024]"},
      {[](v1::RegisterRequest& q) { q.mutable_shape()->set_slots_per_rank(5000); },
       "shape.slots_per_rank 5000 is outside [1, 4096]"},
      {[](v1::RegisterRequest& q) { q.mutable_shape()->set_num_experts(9); },
       "shape.slots_per_rank 2 x world_size 4 cannot hold 9 experts"},
      // As an int, a budget that wrapped negative: read as no limit on changed slots.
      {[](v1::RegisterRequest& q) { q.set_free_buffers(0x80000000u); },
       "free_buffers 2147483648 is over 4096, the most slots a rank has"},
  };
  v1::RegisterResponse response;
  for (const Case& c : cases) {
    v1::RegisterRequest q = Registration("node-0", 0);
    c.mutate(q);
    const grpc::Status status = balancer.Register(nullptr, &q, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_EQ(status.error_message(), c.message);
  }
  EXPECT_TRUE(balancer.Status().nodes.empty());
  const v1::RegisterRequest good = Registration("node-0", 0);
  EXPECT_TRUE(balancer.Register(nullptr, &good, &response).ok());
}

// A node registering ranks another healthy node serves is refused, naming the rank and the
// node serving it; the cluster keeps the first node's registration.
TEST(BalancerServerTest, ARegistrationOfRanksAnotherNodeServesIsRefused) {
  Balancer balancer(BalancerOptions{}, std::make_shared<prometheus::Registry>());
  v1::RegisterResponse response;
  const v1::RegisterRequest a = Registration("node-a", 0);
  ASSERT_TRUE(balancer.Register(nullptr, &a, &response).ok());
  const v1::RegisterRequest c = Registration("node-c", 1);  // Ranks 1-2.
  const grpc::Status status = balancer.Register(nullptr, &c, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(status.error_message(), "rank 1 of node node-c is already served by node node-a");
  const auto nodes = balancer.Status().nodes;
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].name, "node-a");
  EXPECT_EQ(nodes[0].ranks, (std::vector<int>{0, 1}));
}

// Two ubepd given the same --node (a copied configuration): the second, at another address
// with other ranks, is refused while the first answers its health checks
// (it was taken for a restart of the first, which replaced its registration: its ranks mapped
// by no daemon, its reports refused). A restart, with the same ranks, is taken.
TEST(BalancerServerTest, ASecondDaemonUnderANodesNameIsRefusedWhileTheFirstIsUp) {
  Balancer balancer(BalancerOptions{}, std::make_shared<prometheus::Registry>());
  v1::RegisterResponse response;
  v1::RegisterRequest first = Registration("host-1", 0);
  first.set_incarnation("100-1.1");
  ASSERT_TRUE(balancer.Register(nullptr, &first, &response).ok());
  v1::RegisterRequest second = Registration("host-1", 2);
  second.set_address("127.0.0.1:2");
  second.set_incarnation("200-1.1");
  // Its first registration, naming no ranks yet (before its clients attach), is refused too
  // (it replaced the first's). Either leaves the first's registration as it was.
  v1::RegisterRequest unattached = second;
  unattached.clear_ranks();
  unattached.clear_shape();
  for (const auto& [request, message] : std::vector<std::pair<v1::RegisterRequest, std::string>>{
           {second,
            "node host-1 is registered by another ubepd (at 127.0.0.1:1, ranks 0-1) that "
            "answers its health checks; this one (at 127.0.0.1:2, ranks 2-3) needs a --node of "
            "its own"},
           {unattached,
            "node host-1 is registered by another ubepd (at 127.0.0.1:1, ranks 0-1) that "
            "answers its health checks; this one (at 127.0.0.1:2, no ranks yet) is taken once "
            "that one fails them (a restart at a new address), or needs a --node of its own"}}) {
    const grpc::Status status = balancer.Register(nullptr, &request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
    EXPECT_EQ(status.error_message(), message);
    const auto nodes = balancer.Status().nodes;
    ASSERT_EQ(nodes.size(), 1u);
    EXPECT_EQ(nodes[0].ranks, (std::vector<int>{0, 1}));
    EXPECT_EQ(nodes[0].address, "127.0.0.1:1");
  }
  // Restarted at another address, hosting the same ranks: taken.
  v1::RegisterRequest restarted = Registration("host-1", 0);
  restarted.set_address("127.0.0.1:3");
  restarted.set_incarnation("300-1.1");
  ASSERT_TRUE(balancer.Register(nullptr, &restarted, &response).ok());
  const auto nodes = balancer.Status().nodes;
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].address, "127.0.0.1:3");
}

TEST(BalancerServerTest, RegistrationsAndReportsRaceTheLoopSafely) {
  BalancerOptions options;
  options.interval = absl::Milliseconds(5);
  options.health_interval = absl::Milliseconds(5);
  options.rpc_timeout = absl::Milliseconds(50);
  options.health_failures = 1000;
  auto registry = std::make_shared<prometheus::Registry>();
  Balancer balancer(options, registry);
  balancer.Start();
  // Register makes the node's channel on its caller's thread. The first channel of the process
  // initializes gRPC's lazy globals (its default resource quota), which gRPC's own threads then
  // read under synchronization that ThreadSanitizer cannot see in the uninstrumented library.
  // One channel made here, before the racing threads exist, orders that initialization before
  // every thread of the test; the races under test are the balancer's, not gRPC's start-up.
  grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials());
  std::atomic<int> answered{0};
  std::vector<std::thread> threads;
  for (int n = 0; n < 2; ++n) {
    threads.emplace_back([&, n] {
      const std::string node = "node-" + std::to_string(n);
      v1::RegisterResponse registered;
      const v1::RegisterRequest request = Registration(node, 2 * n);
      ASSERT_TRUE(balancer.Register(nullptr, &request, &registered).ok());
      EXPECT_EQ(registered.report_interval_ms(), 1000);
      for (uint64_t seq = 1; seq <= 200; ++seq) {
        v1::ReportLoadRequest q;
        q.set_node(node);
        q.set_seq(seq);
        q.set_max_step(seq);
        q.set_over_capacity_calls(seq % 3);
        v1::ReportLoadResponse response;
        // The balancer never learns a plan here (no daemon answers GetState): every report
        // is refused with no_plan, after its steps and its dropped calls were recorded.
        const grpc::Status status = balancer.ReportLoad(nullptr, &q, &response);
        EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
        EXPECT_EQ(status.error_message(), "the balancer has not learned the cluster's plan yet");
        ++answered;
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < 50; ++i) {
      const BalancerStatus status = balancer.Status();
      EXPECT_LE(status.nodes.size(), 2u);
      balancer.RequestRebalance();
    }
  });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(answered.load(), 400);
  const BalancerStatus status = balancer.Status();
  ASSERT_EQ(status.nodes.size(), 2u);
  EXPECT_EQ(status.nodes[0].max_step, 200u);
  EXPECT_EQ(status.nodes[1].ranks, (std::vector<int>{2, 3}));
  EXPECT_EQ(status.plan_version, 0u);
  double over_capacity = -1;
  for (const prometheus::MetricFamily& f : registry->Collect()) {
    if (f.name == "ubep_balancer_over_capacity_calls_total") {
      over_capacity = f.metric.at(0).counter.value;
    }
  }
  EXPECT_EQ(over_capacity, 402);  // Two nodes, each the sum of seq % 3 over seq 1..200.
}

TEST(BalancerServerTest, ShapeConflictsAreRefusedNamingBothShapes) {
  auto registry = std::make_shared<prometheus::Registry>();
  Balancer balancer(BalancerOptions{}, registry);
  v1::RegisterResponse response;
  v1::RegisterRequest first = Registration("a", 0);
  ASSERT_TRUE(balancer.Register(nullptr, &first, &response).ok());
  v1::RegisterRequest other = Registration("b", 2);
  other.mutable_shape()->set_num_experts(8);
  const grpc::Status status = balancer.Register(nullptr, &other, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "node b serves another model than the cluster's: num_experts is 8, the cluster's 6 "
            "(the cluster takes it once every node holding ranks of its model registers it)");
  other = Registration("b", 2);
  other.set_ranks(1, 9);
  EXPECT_EQ(balancer.Register(nullptr, &other, &response).error_message(), "rank 9 is outside [0, 4)");
}

// Ranks come with the group's shape they are checked against, once each and as one block:
// a registration naming ranks without a shape, or ranks listed twice or with a gap, is
// refused before anything is kept (a rank far out of range would otherwise be excluded by the
// next plan, past the end of its tables).
TEST(BalancerServerTest, ARegistrationsRanksAreOneBlockAndComeWithTheShape) {
  Balancer balancer(BalancerOptions{}, std::make_shared<prometheus::Registry>());
  v1::RegisterResponse response;
  v1::RegisterRequest no_shape = Registration("node-0", 0);
  no_shape.clear_shape();
  no_shape.set_ranks(1, 1000);
  grpc::Status status = balancer.Register(nullptr, &no_shape, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "2 ranks (from rank 0) come without the group's shape (a daemon with no group "
            "attached registers no ranks)");
  v1::RegisterRequest twice = Registration("node-0", 2);
  twice.set_ranks(1, 2);
  status = balancer.Register(nullptr, &twice, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "ranks 2, 2 are not one block of consecutive ranks, each once");
  v1::RegisterRequest gap = Registration("node-0", 0);
  gap.set_ranks(1, 3);
  EXPECT_EQ(balancer.Register(nullptr, &gap, &response).error_message(),
            "ranks 0, 3 are not one block of consecutive ranks, each once");
  // A node's name is a host or node name (it goes into every daemon's GetGroup answer, metric
  // labels and log lines); restarted peers' ranks come with a group, within it.
  const std::string bad_name = "node: a name of at most 253 letters, digits, '.', '-' and '_' "
                               "is expected (a host or node name); ";
  v1::RegisterRequest odd = Registration("node-0\nE0101 forged", 0);
  EXPECT_EQ(balancer.Register(nullptr, &odd, &response).error_message(),
            bad_name + "this one has other characters");
  v1::RegisterRequest long_name = Registration(std::string(254, 'n'), 0);
  EXPECT_EQ(balancer.Register(nullptr, &long_name, &response).error_message(),
            bad_name + "this one has 254 bytes");
  v1::RegisterRequest restarted = Registration("node-0", 0);
  restarted.clear_shape();
  restarted.clear_ranks();
  restarted.add_restarted_ranks(2);
  EXPECT_EQ(balancer.Register(nullptr, &restarted, &response).error_message(),
            "1 restarted_ranks (from rank 2) come without the group's shape (a daemon with no "
            "group maps no peer)");
  restarted = Registration("node-0", 0);
  restarted.add_restarted_ranks(4);
  EXPECT_EQ(balancer.Register(nullptr, &restarted, &response).error_message(),
            "restarted_ranks: rank 4 is outside [0, 4)");
  // Lists longer than the group are refused by their length, not listed back (a message of
  // 20000 ranks would pass gRPC's limit on a status and arrive as another error).
  v1::RegisterRequest many = Registration("node-0", 0);
  for (int i = 0; i < 20000; ++i) many.add_ranks(0);
  EXPECT_EQ(balancer.Register(nullptr, &many, &response).error_message(),
            "20002 ranks for a group of 4");
  many.clear_shape();
  EXPECT_EQ(balancer.Register(nullptr, &many, &response).error_message(),
            "20002 ranks (from rank 0) come without the group's shape (a daemon with no group "
            "attached registers no ranks)");
  restarted = Registration("node-0", 0);
  for (int i = 0; i < 5; ++i) restarted.add_restarted_ranks(2);
  EXPECT_EQ(balancer.Register(nullptr, &restarted, &response).error_message(),
            "5 restarted_ranks for a group of 4");
  // The other strings are of the sizes they have, printable: each goes into every daemon's
  // GetGroup answer (an arena socket of megabytes would pass what a daemon takes of one).
  v1::RegisterRequest field = Registration("node-0", 0);
  field.set_address("127.0.0.1:1\nE0101 forged");
  EXPECT_EQ(balancer.Register(nullptr, &field, &response).error_message(),
            "address: a control character at byte 11");
  field = Registration("node-0", 0);
  field.set_arena_socket(std::string(4097, 's'));
  EXPECT_EQ(balancer.Register(nullptr, &field, &response).error_message(),
            "arena_socket: 4097 bytes, over the 4096 it may have");
  field = Registration("node-0", 0);
  field.set_incarnation(std::string(5 << 20, 'i'));
  EXPECT_EQ(balancer.Register(nullptr, &field, &response).error_message(),
            "incarnation: 5242880 bytes, over the 256 it may have");
  EXPECT_TRUE(balancer.Status().nodes.empty());
  // Without ranks and shape (no group attached yet), and in reverse order, are fine.
  no_shape.clear_ranks();
  EXPECT_TRUE(balancer.Register(nullptr, &no_shape, &response).ok());
  v1::RegisterRequest reversed = Registration("node-1", 2);
  reversed.set_ranks(0, 3);
  reversed.set_ranks(1, 2);
  status = balancer.Register(nullptr, &reversed, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(balancer.Status().nodes.size(), 2u);
}

// Calls that each wait, up to their deadline, until `expected` of them are in flight at once
// (from any number of servers); it records the most that were.
class Gathering {
 public:
  explicit Gathering(int expected) : expected_(expected) {}
  void Arrive(std::chrono::system_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    most_ = std::max(most_, ++in_flight_);
    all_in_.notify_all();
    all_in_.wait_until(lock, deadline, [&] { return most_ >= expected_; });
    --in_flight_;
  }
  int most() {
    std::lock_guard<std::mutex> lock(mu_);
    return most_;
  }

 private:
  const int expected_;
  std::mutex mu_;
  std::condition_variable all_in_;
  int in_flight_ = 0, most_ = 0;
};

// A daemon's DaemonControl, in process on loopback, with the gRPC health service the
// balancer checks: it serves `plan` as committed (in force from `effective_step`), prepares
// and commits whatever it is sent but a version it is told to refuse, and records the Prepare
// requests and CreateLink calls. A Prepare it is told to hold waits until it is let go.
class FakeDaemon final : public v1::DaemonControl::Service {
 public:
  FakeDaemon(std::string name, const v1::Plan& plan, bool link_fails = false,
             uint64_t effective_step = 0)
      : name_(std::move(name)), committed_(plan), effective_step_(effective_step),
        link_fails_(link_fails) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeDaemon() override { server_->Shutdown(std::chrono::system_clock::now()); }

  grpc::Status Prepare(grpc::ServerContext* context, const v1::PrepareRequest* request,
                       v1::PrepareResponse* response) override {
    Gather("Prepare", context);
    std::unique_lock<std::mutex> lock(mu_);
    prepares_.push_back(*request);
    // Bounded, so that a test that fails before letting it go still ends.
    let_go_.wait_for(lock, std::chrono::seconds(60), [&] { return !hold_prepares_; });
    if (request->plan().version() == refused_ || refused_ == kEveryVersion) {
      response->set_reason("refused for the test");
      return grpc::Status::OK;
    }
    if (keep_pending_) {  // As ubepd: one plan pending at a time, until decided.
      if (pending_ != 0 && pending_ != request->plan().version()) {
        response->set_reason(absl::StrCat("plan v", pending_, " is prepared and undecided"));
        return grpc::Status::OK;
      }
      pending_ = request->plan().version();
    }
    response->set_prepared(true);
    return grpc::Status::OK;
  }
  grpc::Status Commit(grpc::ServerContext* context, const v1::CommitRequest* request,
                      v1::CommitResponse*) override {
    Gather("Commit", context);
    std::lock_guard<std::mutex> lock(mu_);
    commit_requests_.push_back(request->version());
    if (request->version() == damaged_commit_) {  // As ubepd: pending, and refused for good.
      pending_ = request->version();
      return grpc::Status(grpc::StatusCode::DATA_LOSS,
                          absl::StrCat("rank 2's plan area lost plan v", request->version(),
                                       " (plan v", request->version(),
                                       " is not prepared here): committed on no rank of this "
                                       "daemon (did its client write into its plan area?)"));
    }
    if (request->version() == lost_commit_) {  // Taken, but its answer is lost: still pending.
      lost_commit_ = 0;
      pending_ = request->version();
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the commit's answer was lost");
    }
    if (pending_ == request->version()) pending_ = 0;
    for (const v1::PrepareRequest& p : prepares_) {
      if (p.plan().version() == request->version()) committed_ = p.plan();
    }
    commits_.push_back(request->version());
    return grpc::Status::OK;
  }
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse*) override {
    Gather("Abort", context);
    std::lock_guard<std::mutex> lock(mu_);
    abort_requests_.push_back(request->version());
    if (request->version() == damaged_commit_ && pending_ == request->version()) {
      // As ubepd: undecided no more, but the damaged area did not take the abort.
      pending_ = 0;
      return grpc::Status(grpc::StatusCode::DATA_LOSS,
                          absl::StrCat("plan v", request->version(), " is aborted here, but the "
                                       "plan area of rank 2 (plan v", request->version(),
                                       " is not prepared here) did not take the abort (did its "
                                       "client write into its plan area?)"));
    }
    if (request->version() == lost_abort_) {  // Not taken: the prepared plan stays pending.
      lost_abort_ = 0;
      pending_ = request->version();
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the abort was lost");
    }
    if (pending_ == request->version()) {
      pending_ = 0;
      aborted_.push_back(request->version());
    }
    return grpc::Status::OK;
  }
  grpc::Status GetState(grpc::ServerContext* context, const v1::GetStateRequest*,
                        v1::DaemonState* state) override {
    Gather("GetState", context);
    std::lock_guard<std::mutex> lock(mu_);
    ++state_requests_;
    if (state_unavailable_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "unreachable for the test");
    state->set_pending_version(pending_);
    for (const v1::PrepareRequest& p : prepares_) {
      if (pending_ == 0 || p.plan().version() != pending_) continue;
      absl::StatusOr<Plan> plan = FromProto(p.plan());
      if (plan.ok()) state->set_pending_fingerprint(PlanFingerprint(*plan));  // The last one.
    }
    state->set_node(name_ + std::string(pad_, ' '));
    state->set_committed_version(committed_.version());
    state->set_plan_in_force(true);
    state->set_committed_effective_step(effective_step_);
    state->set_max_step(max_step_);
    *state->mutable_committed_plan() = committed_;
    return grpc::Status::OK;
  }
  grpc::Status CreateLink(grpc::ServerContext* context, const v1::CreateLinkRequest*,
                          v1::CreateLinkResponse* response) override {
    Gather("CreateLink", context);
    std::lock_guard<std::mutex> lock(mu_);
    ++links_;
    if (link_fails_) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "ubepd was built without NCCL");
    response->set_nccl_unique_id("unique id " + std::to_string(links_) + " of " + name_);
    return grpc::Status::OK;
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::vector<v1::PrepareRequest> prepares() {
    std::lock_guard<std::mutex> lock(mu_);
    return prepares_;
  }
  int links() {
    std::lock_guard<std::mutex> lock(mu_);
    return links_;
  }
  uint64_t committed_version() {
    std::lock_guard<std::mutex> lock(mu_);
    return committed_.version();
  }
  // Refuses to prepare plan `version` (every plan: kEveryVersion).
  static constexpr uint64_t kEveryVersion = ~uint64_t{0};
  void Refuse(uint64_t version) {
    std::lock_guard<std::mutex> lock(mu_);
    refused_ = version;
  }
  void HoldPrepares(bool hold) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_prepares_ = hold;
    }
    let_go_.notify_all();
  }
  // The Commit of `version` is taken no further and answered UNAVAILABLE (it stays pending).
  void LoseCommitOf(uint64_t version) {
    std::lock_guard<std::mutex> lock(mu_);
    lost_commit_ = version;
  }
  // The Commit of `version` is refused for good (DATA_LOSS), as ubepd refuses one where a
  // client wrote into a rank's plan area: the plan stays pending until an Abort, which it
  // takes, answering DATA_LOSS too.
  void DamageCommitOf(uint64_t version) {
    std::lock_guard<std::mutex> lock(mu_);
    damaged_commit_ = version;
  }
  int state_requests() {  // GetState calls taken.
    std::lock_guard<std::mutex> lock(mu_);
    return state_requests_;
  }
  std::vector<uint64_t> commit_requests() {  // Every Commit taken, whatever it found.
    std::lock_guard<std::mutex> lock(mu_);
    return commit_requests_;
  }
  // The Abort of `version` is not taken and answered UNAVAILABLE (the plan stays pending).
  void LoseAbortOf(uint64_t version) {
    std::lock_guard<std::mutex> lock(mu_);
    lost_abort_ = version;
  }
  // `plan` prepared here and undecided, as a balancer that died before deciding leaves it.
  void SetPending(const v1::Plan& plan) {
    std::lock_guard<std::mutex> lock(mu_);
    v1::PrepareRequest prepared;
    *prepared.mutable_plan() = plan;
    prepares_.push_back(prepared);
    pending_ = plan.version();
  }
  // A plan it prepares stays pending until it is committed or aborted, and it refuses to
  // prepare another meanwhile, as ubepd does (a Prepare that lands after its Abort leaves one).
  void KeepPreparedPending(bool keep) {
    std::lock_guard<std::mutex> lock(mu_);
    keep_pending_ = keep;
  }
  uint64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_;
  }
  // GetState's answer carries `bytes` more (in its node name).
  void PadState(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    pad_ = bytes;
  }
  // The plan it serves as committed from now on (a new group's, say).
  void SetCommitted(const v1::Plan& plan) {
    std::lock_guard<std::mutex> lock(mu_);
    committed_ = plan;
  }
  // What its health service answers: SERVING or NOT_SERVING.
  void SetServing(bool serving) { server_->GetHealthCheckService()->SetServingStatus(serving); }
  std::vector<uint64_t> commits() {  // Versions committed, in order.
    std::lock_guard<std::mutex> lock(mu_);
    return commits_;
  }
  // Calls of `method` (Prepare, Commit, Abort, GetState, CreateLink) wait at `gathering`
  // first.
  void GatherAt(const std::string& method, Gathering* gathering) {
    std::lock_guard<std::mutex> lock(mu_);
    gatherings_[method] = gathering;
  }
  // The step its ranks are at, as GetState answers.
  void SetMaxStep(uint64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    max_step_ = step;
  }
  void SetStateUnavailable(bool unavailable) {
    std::lock_guard<std::mutex> lock(mu_);
    state_unavailable_ = unavailable;
  }
  std::vector<uint64_t> abort_requests() {  // Every Abort taken, whatever it found.
    std::lock_guard<std::mutex> lock(mu_);
    return abort_requests_;
  }
  std::vector<uint64_t> aborted() {  // Pending versions aborted.
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }

 private:
  void Gather(const std::string& method, const grpc::ServerContext* context) {
    Gathering* gathering = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = gatherings_.find(method); it != gatherings_.end()) gathering = it->second;
    }
    if (gathering != nullptr) gathering->Arrive(context->deadline());
  }

  std::string name_;
  std::mutex mu_;
  std::condition_variable let_go_;
  bool hold_prepares_ = false;
  bool keep_pending_ = false;
  v1::Plan committed_;
  uint64_t effective_step_;
  uint64_t refused_ = 0;
  uint64_t lost_commit_ = 0, lost_abort_ = 0, damaged_commit_ = 0, pending_ = 0;
  std::vector<uint64_t> commit_requests_;
  int state_requests_ = 0;
  size_t pad_ = 0;
  std::vector<uint64_t> commits_;
  bool state_unavailable_ = false;
  uint64_t max_step_ = 0;
  std::map<std::string, Gathering*> gatherings_;
  std::vector<uint64_t> aborted_;
  std::vector<uint64_t> abort_requests_;
  std::vector<v1::PrepareRequest> prepares_;
  int links_ = 0;
  bool link_fails_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// 4 ranks x 4 slots, 2 layers x `experts` experts, slot p holding expert p % experts: v1.
v1::Plan FirstPlan(int experts = 6) {
  Plan plan;
  plan.version = 1;
  plan.topology = {4, 2, 4, 1};
  plan.num_experts = experts;
  for (int l = 0; l < 2; ++l) {
    LayerPlan layer;
    for (int p = 0; p < 16; ++p) layer.slot_expert.push_back(p % experts);
    SetEqualShares(experts, layer);
    plan.layer_ids.push_back(l);
    plan.layers.push_back(layer);
  }
  return ToProto(plan, PlanEncoding::kFull);
}

v1::RegisterRequest DaemonRegistration(const FakeDaemon& d, const std::string& node, uint32_t first_rank,
                                       uint32_t domain, const std::string& backend) {
  v1::RegisterRequest q;
  q.set_node(node);
  q.set_address(d.address());
  q.set_world_size(4);
  q.add_ranks(first_rank);
  q.add_ranks(first_rank + 1);
  q.set_domain(domain);
  q.set_backend(backend);
  q.mutable_shape()->set_num_layers(2);
  q.mutable_shape()->set_num_experts(6);
  q.mutable_shape()->set_slots_per_rank(4);
  q.set_free_buffers(4);
  return q;
}

// The fakes serve health checks, but no test here wants a daemon marked down by one slow
// check: never, or ...
BalancerOptions NeverMarkedDown() {
  BalancerOptions options;
  options.health_failures = 1000;
  return options;
}

// ... at its second failed check in a row (one slow check of a live daemon under a sanitizer
// does not).
BalancerOptions QuickToMarkDown() {
  BalancerOptions options;
  options.health_failures = 2;
  options.health_interval = absl::Milliseconds(500);
  return options;
}

// A gRPC status as "CODE: message", for comparing both at once (Abseil's codes are gRPC's).
std::string StatusOf(const grpc::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      ": ", status.error_message());
}

// Drain (or undrain) of `node` through the RPC; its answer in *response.
grpc::Status Drain(Balancer& balancer, const std::string& node, bool drain,
                   v1::RebalanceResponse* response) {
  v1::DrainRequest request;
  request.set_node(node);
  return drain ? balancer.Drain(nullptr, &request, response)
               : balancer.Undrain(nullptr, &request, response);
}

// Drains node b (a change of members, so a new plan whatever the load) with daemons a and b
// registered as given; returns the Prepare requests a and b got.
std::pair<v1::PrepareRequest, v1::PrepareRequest> PrepareOnDrain(FakeDaemon& a, FakeDaemon& b,
                                                                 uint32_t domain_b, const std::string& backend) {
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  v1::RegisterResponse registered;
  v1::RegisterRequest ra = DaemonRegistration(a, "node-a", 0, 0, backend);
  v1::RegisterRequest rb = DaemonRegistration(b, "node-b", 2, domain_b, backend);
  EXPECT_TRUE(balancer.Register(nullptr, &ra, &registered).ok());
  EXPECT_TRUE(balancer.Register(nullptr, &rb, &registered).ok());
  balancer.Tick();  // Learns v1 from the daemons.
  v1::RebalanceResponse drained;
  const grpc::Status status = Drain(balancer, "node-b", true, &drained);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(drained.version(), 2u);
  EXPECT_EQ(a.prepares().size(), 1u);
  EXPECT_EQ(b.prepares().size(), 1u);
  if (a.prepares().empty() || b.prepares().empty()) return {};
  return {a.prepares()[0], b.prepares()[0]};
}

// Draining node-b would leave 8 slots for 10 experts: the drain is refused, naming why, and
// undone (the node is not drained; the next drain of it is judged again, not taken as done).
TEST(BalancerServerTest, ADrainNoPlanCanServeIsRefusedAndUndone) {
  FakeDaemon a("node-a", FirstPlan(10)), b("node-b", FirstPlan(10));
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  v1::RegisterResponse registered;
  for (auto [daemon, node, first] : {std::tuple{&a, "node-a", 0u}, std::tuple{&b, "node-b", 2u}}) {
    v1::RegisterRequest q = DaemonRegistration(*daemon, node, first, 0, "host");
    q.mutable_shape()->set_num_experts(10);
    ASSERT_TRUE(balancer.Register(nullptr, &q, &registered).ok());
  }
  balancer.Tick();  // Learns v1 from the daemons.
  for (int attempt = 0; attempt < 2; ++attempt) {
    v1::RebalanceResponse response;
    const grpc::Status status = Drain(balancer, "node-b", true, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(status.error_message(), "the 2 ranks left hold 8 slots, fewer than the 10 experts");
    v1::ClusterStatus cluster;
    ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
    for (const auto& n : cluster.nodes()) EXPECT_FALSE(n.drained()) << n.node();
  }
  EXPECT_TRUE(a.prepares().empty());
  EXPECT_TRUE(b.prepares().empty());
}

// Every Prepare lists the group's daemons with their ranks and domains (where weights of other
// domains come from); CUDA daemons over several domains also get one NCCL unique id, made by
// the first daemon (CreateLink) and relayed to all.
TEST(BalancerServerTest, APrepareOverSeveralCudaDomainsCarriesTheFirstDaemonsNcclUniqueId) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  const auto [pa, pb] = PrepareOnDrain(a, b, /*domain_b=*/1, "cuda");
  EXPECT_EQ(a.links(), 1);
  EXPECT_EQ(b.links(), 0);
  EXPECT_EQ(pa.nccl_unique_id(), "unique id 1 of node-a");
  EXPECT_EQ(pb.nccl_unique_id(), "unique id 1 of node-a");
  EXPECT_EQ(pa.base_version(), 1u);  // Every daemon's copy schedule is computed over v1.
  ASSERT_EQ(pa.daemons_size(), 2);
  EXPECT_EQ(pa.daemons(0).node(), "node-a");
  EXPECT_EQ(pa.daemons(0).address(), a.address());
  EXPECT_EQ(pa.daemons(0).domain(), 0u);
  EXPECT_EQ(pa.daemons(1).node(), "node-b");
  EXPECT_EQ(pa.daemons(1).domain(), 1u);
  EXPECT_EQ(std::vector<uint32_t>(pa.daemons(1).ranks().begin(), pa.daemons(1).ranks().end()),
            (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(pb.daemons_size(), 2);
}

TEST(BalancerServerTest, NoNcclLinkForOneDomainTheHostBackendOrARootThatCannotMakeOne) {
  {
    FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
    const auto [pa, pb] = PrepareOnDrain(a, b, /*domain_b=*/0, "cuda");  // One domain.
    EXPECT_EQ(a.links(), 0);
    EXPECT_EQ(pa.nccl_unique_id(), "");
    EXPECT_EQ(pa.daemons_size(), 2);
  }
  {
    FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
    const auto [pa, pb] = PrepareOnDrain(a, b, /*domain_b=*/1, "host");
    EXPECT_EQ(a.links(), 0);
    EXPECT_EQ(pb.nccl_unique_id(), "");
    EXPECT_EQ(pb.daemons(1).domain(), 1u);
  }
  {
    // The root cannot make a link: the plan is still prepared and committed, without one
    // (the daemons read other domains' weights with ReadWeights).
    FakeDaemon a("node-a", FirstPlan(), /*link_fails=*/true), b("node-b", FirstPlan());
    const auto [pa, pb] = PrepareOnDrain(a, b, /*domain_b=*/1, "cuda");
    EXPECT_EQ(a.links(), 1);
    EXPECT_EQ(pa.nccl_unique_id(), "");
    EXPECT_EQ(pb.nccl_unique_id(), "");
  }
}

// FirstPlan's placement as v2, with ranks 2 and 3 (node-b's) excluded.
v1::Plan PlanWithoutNodeB() {
  absl::StatusOr<Plan> plan = FromProto(FirstPlan());
  EXPECT_TRUE(plan.ok()) << plan.status();
  plan->version = 2;
  plan->excluded_ranks = {2, 3};
  for (LayerPlan& layer : plan->layers) {
    std::vector<int> replicas(plan->num_experts, 0);
    for (int p = 0; p < 8; ++p) ++replicas[layer.slot_expert[p]];
    for (int p = 0; p < 16; ++p) layer.slot_share[p] = p < 8 ? 1.0 / replicas[layer.slot_expert[p]] : 0;
  }
  EXPECT_TRUE(ValidatePlan(*plan).ok()) << ValidatePlan(*plan);
  return ToProto(*plan, PlanEncoding::kFull);
}

// Ticks until `node` fails a health check (one every health interval), for at most 10 s.
void TickUntilDown(Balancer& balancer, const std::string& node) {
  for (const absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(20))) {
    balancer.Tick();
    for (const BalancerStatus::Node& n : balancer.Status().nodes) {
      if (n.name == node && !n.healthy) return;
    }
  }
  ADD_FAILURE() << node << " was not marked down within 10s";
}

void Register(Balancer& balancer, const v1::RegisterRequest& request) {
  v1::RegisterResponse response;
  const grpc::Status status = balancer.Register(nullptr, &request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
}

// A balancer with `options`, daemon `a` registered as node `name_a` (ranks 0 and 1) and `b` as
// `name_b` (ranks 2 and 3), ticked once when `tick` (it learns their plan).
std::unique_ptr<Balancer> WithTwoDaemons(const BalancerOptions& options, FakeDaemon& a,
                                         FakeDaemon& b, bool tick = true,
                                         const std::string& name_a = "node-a",
                                         const std::string& name_b = "node-b") {
  auto balancer = std::make_unique<Balancer>(options, std::make_shared<prometheus::Registry>());
  Register(*balancer, DaemonRegistration(a, name_a, 0, 0, "host"));
  Register(*balancer, DaemonRegistration(b, name_b, 2, 0, "host"));
  if (tick) balancer->Tick();
  return balancer;
}

// A report of `node` (ranks 2 n, 2 n + 1; slots 8 n to 8 n + 7) of steps (first, last] under
// plan `version`, its ranks' slots each with `per_slot` pairs of both layers.
v1::ReportLoadRequest ReportOf(const std::string& node, int n, uint64_t seq, uint64_t first,
                               uint64_t last, uint64_t version, uint64_t per_slot) {
  v1::ReportLoadRequest q;
  q.set_node(node);
  q.set_seq(seq);
  q.set_max_step(last);
  q.set_plan_in_force(true);
  v1::LoadReport* load = q.mutable_load();
  load->set_reporter(node);
  load->set_first_step(first);
  load->set_last_step(last);
  load->set_plan_version(version);
  load->set_num_experts(6);
  for (int l = 0; l < 2; ++l) {
    v1::LayerLoad* layer = load->add_layers();
    layer->set_layer(l);
    layer->set_first_slot(8 * n);
    for (int p = 0; p < 8; ++p) layer->add_slot(per_slot);
  }
  return q;
}

// ... that its ranks are at `max_step`, sent.
grpc::Status ReportSteps(Balancer& balancer, const std::string& node, int n, uint64_t seq,
                         uint64_t max_step, uint64_t version = 1, uint64_t first_step = 0) {
  const v1::ReportLoadRequest q = ReportOf(node, n, seq, first_step, max_step, version, 1);
  v1::ReportLoadResponse response;
  return balancer.ReportLoad(nullptr, &q, &response);
}

// A drained daemon behind the cluster's plan gets it (CatchUp). Taken, its ranks come back at
// once when it is undrained (a catch-up leaves no daemon "being recovered"). Refused, it is
// tried again every interval, holding back no other plan, and an undrain takes the ranks back
// once the daemon has caught up: a plan taking them back from a daemon behind would stage their
// weights from a plan it lacks.
TEST(BalancerServerTest, ACatchUpTakenOrRefusedHoldsBackNoPlan) {
  for (const bool refuse : {false, true}) {
    SCOPED_TRACE(refuse ? "refused" : "taken");
    FakeDaemon a("node-a", PlanWithoutNodeB()), b("node-b", FirstPlan());
    if (refuse) b.Refuse(2);
    // Learns v2 from node-a; node-b, all of whose ranks it excludes, is drained. (RPCs may
    // take an hour: a plan that waited for node-b to report v2 in force would not end.)
    BalancerOptions options = NeverMarkedDown();
    options.rpc_timeout = absl::Hours(1);
    std::unique_ptr<Balancer> learned = WithTwoDaemons(options, a, b);
    Balancer& balancer = *learned;
    ASSERT_EQ(b.prepares().size(), 1u);
    EXPECT_EQ(b.prepares()[0].plan().version(), 2u);
    EXPECT_EQ(b.committed_version(), refuse ? 1u : 2u);
    v1::RebalanceResponse response;
    const grpc::Status status = Drain(balancer, "node-b", false, &response);
    if (refuse) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
      EXPECT_EQ(status.error_message(),
                "node node-b is undrained, but it holds plan v1, not the cluster's v2 yet: its "
                "ranks come back once it has caught up");
      EXPECT_EQ(a.prepares().size(), 0u);
      // node-b, undrained but behind with its ranks excluded, has no plan in force to wait
      // for: a plan for the members goes ahead (the same placement, on no load).
      v1::RebalanceResponse same;
      const grpc::Status requested = balancer.Rebalance(nullptr, nullptr, &same);
      EXPECT_TRUE(requested.ok()) << requested.error_message();
      EXPECT_EQ(same.version(), 2u);
      b.Refuse(0);
      balancer.Tick();  // node-b catches up, and the plan taking its ranks back follows.
      ASSERT_EQ(b.prepares().size(), 3u);
      EXPECT_EQ(b.prepares()[1].plan().version(), 2u);
    } else {
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(response.version(), 3u);
      EXPECT_TRUE(response.changed());
      ASSERT_EQ(b.prepares().size(), 2u);
    }
    EXPECT_EQ(a.committed_version(), 3u);
    EXPECT_EQ(b.committed_version(), 3u);
    EXPECT_EQ(b.prepares().back().plan().version(), 3u);
    EXPECT_EQ(b.prepares().back().base_version(), 2u);
    EXPECT_TRUE(b.prepares().back().plan().excluded_ranks().empty());
  }
}

// After a restart of the balancer, node-b registers only once it learned v2, which excludes
// node-b's ranks (it was drained): node-b is taken to be drained, as if it had registered
// before, and no plan takes its ranks back until it is undrained.
TEST(BalancerServerTest, ANodeRegisteringLateWithEveryRankExcludedStaysDrained) {
  FakeDaemon a("node-a", PlanWithoutNodeB()), b("node-b", PlanWithoutNodeB());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
  balancer.Tick();  // Learns v2 from node-a.
  Register(balancer, DaemonRegistration(b, "node-b", 2, 0, "host"));
  balancer.Tick();
  balancer.Tick();
  EXPECT_TRUE(a.prepares().empty());
  EXPECT_TRUE(b.prepares().empty());
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
  ASSERT_EQ(cluster.nodes_size(), 2);
  EXPECT_TRUE(cluster.nodes(1).drained());
  EXPECT_EQ(cluster.plan_version(), 2u);
  v1::RebalanceResponse response;
  const grpc::Status status = Drain(balancer, "node-b", false, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.version(), 3u);
  EXPECT_EQ(b.committed_version(), 3u);
}

// A restarted balancer learns from which step the plan in force is in force: a report whose
// steps straddle it mixes two plans' counts and is refused.
TEST(BalancerServerTest, ARestartedBalancerLearnsThePlansEffectiveStep) {
  FakeDaemon a("node-a", FirstPlan(), false, /*effective_step=*/500);
  FakeDaemon b("node-b", FirstPlan(), false, /*effective_step=*/500);
  std::unique_ptr<Balancer> learned = WithTwoDaemons(NeverMarkedDown(), a, b);
  Balancer& balancer = *learned;
  const grpc::Status straddling = ReportSteps(balancer, "node-a", 0, 1, 510, 1, 490);
  EXPECT_EQ(straddling.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(straddling.error_message(),
            "report counted under plan v1 (steps 490-510); plan v1 is in force from step 500");
  const grpc::Status after = ReportSteps(balancer, "node-a", 0, 2, 520, 1, 510);
  EXPECT_TRUE(after.ok()) << after.error_message();
}

// A daemon tags its counts with the plan it committed, which its ranks follow only from the
// effective step: a report of steps all before it holds the previous plan's counts.
TEST(BalancerServerTest, AReportOfStepsBeforeThePlansEffectiveStepIsStale) {
  FakeDaemon a("node-a", FirstPlan(), false, /*effective_step=*/500);
  FakeDaemon b("node-b", FirstPlan(), false, /*effective_step=*/500);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  const grpc::Status before = ReportSteps(*balancer, "node-a", 0, 1, 480, 1, 470);
  EXPECT_EQ(before.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(before.error_message(),
            "report counted under plan v1 (steps 470-480); plan v1 is in force from step 500");
  // A group idle since step 480 (serving stopped before the effective step) reports no step
  // and no count each interval: taken, adding nothing, not counted stale (an idle cluster's
  // stale count grew until traffic came back, and UbepStaleLoadReports fired on it); a
  // report of no step with counts, or of steps without, is still refused.
  v1::ReportLoadRequest idle = ReportOf("node-a", 0, 2, 480, 480, 1, 0);
  v1::ReportLoadResponse response;
  const grpc::Status taken = balancer->ReportLoad(nullptr, &idle, &response);
  EXPECT_TRUE(taken.ok()) << taken.error_message();
  v1::ReportLoadRequest counted = ReportOf("node-a", 0, 3, 480, 480, 1, 1);
  const grpc::Status counts_without_step = balancer->ReportLoad(nullptr, &counted, &response);
  EXPECT_EQ(counts_without_step.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(counts_without_step.error_message(),
            "report counted under plan v1 (steps 480-480); plan v1 is in force from step 500");
  v1::ReportLoadRequest stepped = ReportOf("node-a", 0, 4, 480, 490, 1, 0);
  const grpc::Status steps_without_counts = balancer->ReportLoad(nullptr, &stepped, &response);
  EXPECT_EQ(steps_without_counts.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(steps_without_counts.error_message(),
            "report counted under plan v1 (steps 480-490); plan v1 is in force from step 500");
}

// ... from a daemon with member ranks: node-0, whose ranks v2 excludes, caught up on v2 at a
// step of its own, and is asked first.
TEST(BalancerServerTest, TheEffectiveStepIsLearnedFromADaemonWithMemberRanks) {
  FakeDaemon drained("node-0", PlanWithoutNodeB(), false, /*effective_step=*/900);
  FakeDaemon a("node-a", PlanWithoutNodeB(), false, /*effective_step=*/500);
  std::unique_ptr<Balancer> balancer =
      WithTwoDaemons(NeverMarkedDown(), a, drained, true, "node-a", "node-0");
  const grpc::Status straddling = ReportSteps(*balancer, "node-a", 0, 1, 510, 2, 490);
  EXPECT_EQ(straddling.error_message(),
            "report counted under plan v2 (steps 490-510); plan v2 is in force from step 500");
}

// A daemon that went down is not extrapolated at its last step rate: the plan excluding its
// ranks is effective a margin after the live daemon's step, not far ahead of it.
TEST(BalancerServerTest, TheStepOfAPlanIsEstimatedFromLiveDaemonsOnly) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), *a, *b, /*tick=*/false);
  // (Before the plan is known the reports are refused, but their steps count.)
  const std::pair<const char*, uint64_t> reports[] = {
      {"node-a", 100}, {"node-a", 100},         // Not moving: no rate.
      {"node-b", 100}, {"node-b", 1'000'000}};  // A million steps in microseconds.
  for (size_t i = 0; i < std::size(reports); ++i) {
    const auto [node, step] = reports[i];
    const grpc::Status refused = ReportSteps(*balancer, node, static_cast<int>(i / 2), i % 2 + 1, step);
    EXPECT_EQ(refused.error_message(), "the balancer has not learned the cluster's plan yet");
  }
  b.reset();
  TickUntilDown(*balancer, "node-b");  // And the plan without its ranks is made.
  ASSERT_EQ(a->prepares().size(), 1u);
  EXPECT_EQ(a->prepares()[0].effective_step(), 110u);  // 100 + min_margin_steps.
  EXPECT_EQ(a->committed_version(), 2u);
}

// The ranks go on while a plan is made (seconds for a large model): its effective step is
// estimated once it is made, from the steps reported meanwhile, not before planning, which
// would give the daemons a step the ranks may have passed (refused) or less than the margin.
TEST(BalancerServerTest, APlansEffectiveStepIsEstimatedFromTheStepsReachedWhileItWasMade) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  FakeClock clock;  // The steps' clock: rates are what the test makes them.
  BalancerOptions options = NeverMarkedDown();
  options.step_clock = &clock;
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);  // Learns v1.
  for (int n = 0; n < 2; ++n) {
    const grpc::Status taken = ReportSteps(*balancer, n == 0 ? "node-a" : "node-b", n, 1, 100);
    ASSERT_TRUE(taken.ok()) << taken.error_message();
  }
  int plans_made = 0;
  balancer->set_after_planning_for_testing([&] {
    // While the plan was made (a second), node-a's ranks went from step 100 to 5000.
    if (plans_made++ == 0) {
      clock.Advance(absl::Seconds(1));
      const grpc::Status moved = ReportSteps(*balancer, "node-a", 0, 2, 5000, 1, 100);
      EXPECT_TRUE(moved.ok()) << moved.error_message();
    }
  });
  v1::RebalanceResponse response;
  const grpc::Status drained = Drain(*balancer, "node-b", true, &response);
  ASSERT_TRUE(drained.ok()) << drained.error_message();
  EXPECT_EQ(plans_made, 1);
  ASSERT_EQ(a.prepares().size(), 1u);
  // 5000, then the effective margin (1 s) at 4900 steps a second, then min_margin_steps.
  // Estimated before planning it would be 100 + 10.
  EXPECT_EQ(a.prepares()[0].effective_step(), 5000u + 4900 + 10);
  EXPECT_EQ(a.committed_version(), 2u);
}

// A step learned from a daemon's state (recovery's GetState) is the step at that time: the
// next report's rate counts from it and from then. Counted from the report before it, the
// steps would spread over time they did not take, and a plan placed by that rate would land
// at a step the ranks have passed (which the daemons refuse).
TEST(BalancerServerTest, AStepLearnedFromADaemonsStateCountsFromWhenItWasLearned) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  FakeClock clock;  // The steps' clock: rates are what the test makes them.
  BalancerOptions options = NeverMarkedDown();
  options.step_clock = &clock;
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);  // Learns v1.
  for (int n = 0; n < 2; ++n) {
    const grpc::Status taken = ReportSteps(*balancer, n == 0 ? "node-a" : "node-b", n, 1, 100);
    ASSERT_TRUE(taken.ok()) << taken.error_message();
  }
  clock.Advance(absl::Seconds(2));
  a.SetMaxStep(2100);
  Register(*balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));  // Its state is asked again.
  balancer->Tick();
  clock.Advance(absl::Milliseconds(250));
  // 250 steps in 0.25 s since the state: 1000 steps a second.
  const grpc::Status moved = ReportSteps(*balancer, "node-a", 0, 2, 2350, 1, 2100);
  ASSERT_TRUE(moved.ok()) << moved.error_message();
  v1::RebalanceResponse response;
  const grpc::Status drained = Drain(*balancer, "node-b", true, &response);
  ASSERT_TRUE(drained.ok()) << drained.error_message();
  ASSERT_EQ(a.prepares().size(), 1u);
  // 2350, the effective margin (1 s) at 1000 steps a second, min_margin_steps. Counted from
  // the report before (the 250 steps over 2.25 s, 111 a second), it would be 2350 + 112 + 10.
  EXPECT_EQ(a.prepares()[0].effective_step(), 2350u + 1000 + 10);
}

// A serving job's steps are its own numbering. Past 2^53 (where a double rounds them) a plan
// takes effect min_margin_steps after the furthest step reported, and after the steps its
// rate adds; near 2^64, where no step would be left after the margin, a report is refused
// (steps end at 2^63 - 1, as libubep's BeginStep says), and no plan is made from it (rather
// than one at a step wrapped past 0, which every daemon would refuse as reached); nor from
// steps whose plan would take effect past 2^63 - 1.
TEST(BalancerServerTest, StepsPast2To53AreCountedWholeAndNear2To64NoPlanIsMade) {
  const uint64_t kFar = (uint64_t{1} << 60) + 1100;
  {
    FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
    FakeClock clock;  // The steps' clock: rates are what the test makes them.
    BalancerOptions options = NeverMarkedDown();
    options.step_clock = &clock;
    std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
    for (int n = 0; n < 2; ++n) {
      const grpc::Status taken =
          ReportSteps(*balancer, n == 0 ? "node-a" : "node-b", n, 1, kFar, 1, kFar - 10);
      EXPECT_TRUE(taken.ok()) << taken.error_message();
    }
    // node-a moves one step in 62.5 ms: 16 steps a second, which over the effective margin
    // (1 s) puts the plan 16 steps further (a double at 2^60 rounds by 256, and would lose
    // them).
    clock.Advance(absl::Microseconds(62500));
    const grpc::Status moved = ReportSteps(*balancer, "node-a", 0, 2, kFar + 1, 1, kFar);
    ASSERT_TRUE(moved.ok()) << moved.error_message();
    v1::RebalanceResponse response;
    const grpc::Status drained = Drain(*balancer, "node-b", true, &response);
    ASSERT_TRUE(drained.ok()) << drained.error_message();
    ASSERT_FALSE(a.prepares().empty());
    EXPECT_EQ(a.prepares().back().effective_step(), kFar + 1 + 16 + 10);
  }
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  const uint64_t kLast = std::numeric_limits<uint64_t>::max() - 4;
  for (int n = 0; n < 2; ++n) {
    const std::string node = n == 0 ? "node-a" : "node-b";
    const grpc::Status refused = ReportSteps(*balancer, node, n, 1, kLast, 1, kLast - 10);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(refused.error_message(),
              absl::StrCat("report of node ", node, " says step 18446744073709551611, above "
                           "2^63 - 1 (libubep refuses such a step)"));
  }
  EXPECT_TRUE(a.prepares().empty());
  // Steps near the last one libubep takes (2^63 - 1), a step a second: the plan would take
  // effect past it, where no rank goes; none is made.
  balancer.reset();
  FakeDaemon c("node-a", FirstPlan()), d("node-b", FirstPlan());
  FakeClock clock;
  BalancerOptions options = NeverMarkedDown();
  options.step_clock = &clock;
  std::unique_ptr<Balancer> near_the_end = WithTwoDaemons(options, c, d);
  for (int n = 0; n < 2; ++n) {
    const grpc::Status taken = ReportSteps(*near_the_end, n == 0 ? "node-a" : "node-b", n, 1,
                                           kMaxStep - 8, 1, kMaxStep - 10);
    ASSERT_TRUE(taken.ok()) << taken.error_message();
  }
  clock.Advance(absl::Seconds(1));
  const grpc::Status moved =
      ReportSteps(*near_the_end, "node-a", 0, 2, kMaxStep - 7, 1, kMaxStep - 8);
  ASSERT_TRUE(moved.ok()) << moved.error_message();
  v1::RebalanceResponse response;
  const grpc::Status drained = Drain(*near_the_end, "node-b", true, &response);
  EXPECT_EQ(drained.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // node-a's step, and one more over the effective margin (1 s) at a step a second.
  EXPECT_EQ(drained.error_message(),
            "the serving job is at step 9223372036854775801 (estimated): no step is left after it "
            "for a plan to take effect at (steps end at 2^63 - 1)");
  EXPECT_TRUE(c.prepares().empty());
}

// New clients attached to both daemons and the group formed again at step 0, before v1's
// effective step (500): the daemons follow v1 from step 0 (RetargetPlan) and say so in their
// reports, whose counts are v1's and are taken; the steps the ranks are at drop with them, and
// the next plan is in force a margin after those, not after the steps of the clients before.
TEST(BalancerServerTest, AGroupThatResumedBeforeThePlansEffectiveStepIsFollowedThere) {
  FakeDaemon a("node-a", FirstPlan(), false, /*effective_step=*/500);
  FakeDaemon b("node-b", FirstPlan(), false, /*effective_step=*/500);
  std::unique_ptr<Balancer> learned = WithTwoDaemons(NeverMarkedDown(), a, b);
  Balancer& balancer = *learned;
  for (int n = 0; n < 2; ++n) {
    const grpc::Status before = ReportSteps(balancer, n == 0 ? "node-a" : "node-b", n, 1, 600, 1, 500);
    ASSERT_TRUE(before.ok()) << before.error_message();
  }
  // A report of steps before 500 that does not say the plan's start moved is stale ...
  const grpc::Status unsaid = ReportSteps(balancer, "node-a", 0, 2, 40, 1, 0);
  EXPECT_EQ(unsaid.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(unsaid.error_message(),
            "report counted under plan v1 (steps 0-40); plan v1 is in force from step 500");
  // ... one that says so is taken, and so is the other daemon's after it.
  for (int n = 0; n < 2; ++n) {
    v1::ReportLoadRequest q = ReportOf(n == 0 ? "node-a" : "node-b", n, 3, 0, 40, 1, 1);
    q.set_plan_effective_step(0);
    v1::ReportLoadResponse response;
    const grpc::Status resumed = balancer.ReportLoad(nullptr, &q, &response);
    EXPECT_TRUE(resumed.ok()) << "node " << n << ": " << resumed.error_message();
  }
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
  ASSERT_EQ(cluster.nodes_size(), 2);
  EXPECT_EQ(cluster.nodes(0).max_step(), 40u);
  EXPECT_EQ(cluster.nodes(1).max_step(), 40u);
  v1::RebalanceResponse response;
  const grpc::Status drained = Drain(balancer, "node-b", true, &response);
  ASSERT_TRUE(drained.ok()) << drained.error_message();
  ASSERT_FALSE(a.prepares().empty());
  EXPECT_EQ(a.prepares().back().effective_step(), 50u);  // 40 + min_margin_steps.
}

// A change of members (a drain) stops the group and is in force from the step it resumes at,
// which the daemons say in their reports: the counts of steps before it, tagged with the new
// plan but counted under the old placement, are stale, as they are for a plan of no change.
TEST(BalancerServerTest, AfterAChangeOfMembersStepsBeforeTheGroupResumedAreStale) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> learned = WithTwoDaemons(NeverMarkedDown(), a, b);
  Balancer& balancer = *learned;
  v1::RebalanceResponse drained;
  const grpc::Status drain = Drain(balancer, "node-b", true, &drained);
  ASSERT_TRUE(drain.ok()) << drain.error_message();
  ASSERT_EQ(a.committed_version(), 2u);
  auto report = [&](uint64_t seq, uint64_t first, uint64_t last) {
    v1::ReportLoadRequest q = ReportOf("node-a", 0, seq, first, last, 2, 1);
    q.set_plan_effective_step(120);  // node-a's group resumed at step 120.
    v1::ReportLoadResponse response;
    return balancer.ReportLoad(nullptr, &q, &response);
  };
  // A malformed report (one layer of the model's two) saying the group resumed at step 0 is
  // refused, and moves nothing: the old code learned step 0 from it before refusing it, and
  // took the counts of steps 100-119, the old placement's, for v2's.
  v1::ReportLoadRequest malformed = ReportOf("node-a", 0, 1, 0, 90, 2, 1);
  malformed.set_plan_effective_step(0);
  malformed.mutable_load()->mutable_layers()->RemoveLast();
  v1::ReportLoadResponse refused;
  const grpc::Status status = balancer.ReportLoad(nullptr, &malformed, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "report has 1 layers; the model has 2");
  const grpc::Status straddling = report(2, 100, 130);
  EXPECT_EQ(straddling.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(straddling.error_message(),
            "report counted under plan v2 (steps 100-130); plan v2 is in force from step 120");
  const grpc::Status after = report(3, 130, 140);
  EXPECT_TRUE(after.ok()) << after.error_message();
  // Another plan's counts are stale whatever their shape (a daemon still under another
  // model's plan): counted so, not refused as malformed.
  v1::ReportLoadRequest old_plan = ReportOf("node-a", 0, 4, 140, 150, 1, 1);
  old_plan.mutable_load()->mutable_layers()->RemoveLast();
  const grpc::Status stale = balancer.ReportLoad(nullptr, &old_plan, &refused);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(stale.error_message(),
            "report counted under plan v1 (steps 140-150); plan v2 is in force from step 120");
}

// A daemon that registered without a group (no client attached yet) and died: nothing of the
// cluster waits on it, so its entry goes rather than be health-checked forever; one down that
// hosts ranks stays (its ranks are excluded, and forgetting it is the operator's call).
TEST(BalancerServerTest, ADaemonDownThatHostsNoRankIsForgotten) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  auto idle = std::make_unique<FakeDaemon>("node-c", FirstPlan());
  BalancerOptions options = QuickToMarkDown();
  options.registration_grace = absl::Seconds(1);  // Down this long, hosting no rank: gone.
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
  v1::RegisterRequest groupless;
  groupless.set_node("node-c");
  groupless.set_address(idle->address());
  groupless.set_incarnation("c.1");
  Register(*balancer, groupless);
  idle.reset();
  b.SetServing(false);
  auto names = [&] {
    std::vector<std::string> out;
    for (const BalancerStatus::Node& n : balancer->Status().nodes) out.push_back(n.name);
    return out;
  };
  for (const absl::Time until = absl::Now() + absl::Seconds(10);
       absl::Now() < until && names().size() == 3; absl::SleepFor(absl::Milliseconds(20))) {
    balancer->Tick();
  }
  EXPECT_EQ(names(), (std::vector<std::string>{"node-a", "node-b"}));
  // node-b, down as long, hosts ranks: it stays, down.
  EXPECT_FALSE(balancer->Status().nodes[1].healthy);
}

// Each node's health after four health intervals of ticks (QuickToMarkDown's).
std::map<std::string, bool> HealthAfterFourChecks(Balancer& balancer) {
  const absl::Time until = absl::Now() + 4 * QuickToMarkDown().health_interval;
  while (absl::Now() < until) {
    balancer.Tick();
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::map<std::string, bool> healthy;
  for (const BalancerStatus::Node& n : balancer.Status().nodes) healthy[n.name] = n.healthy;
  return healthy;
}

// node-a goes down and node-c takes over one of its two ranks (node-a's entry is kept: rank 1
// is nobody else's); node-a answers its health checks again: it stays out, rather than be a
// second healthy owner of rank 0 (both would get rank 0's plan, peers two arenas for it).
TEST(BalancerServerTest, ANodeBackAfterAnotherTookOverSomeOfItsRanksStaysOut) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan()), c("node-c", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), a, b);
  a.SetServing(false);
  TickUntilDown(*balancer, "node-a");
  v1::RegisterRequest rank0 = DaemonRegistration(c, "node-c", 0, 0, "host");
  rank0.clear_ranks();
  rank0.add_ranks(0);
  Register(*balancer, rank0);
  a.SetServing(true);
  EXPECT_EQ(HealthAfterFourChecks(*balancer),
            (std::map<std::string, bool>{{"node-a", false}, {"node-b", true}, {"node-c", true}}));
  // node-c undrained, rank 0 is in the plan again, as node-c's: node-a can still be forgotten
  // (rank 0 is not its any more; rank 1 is excluded).
  v1::RebalanceResponse undrained;
  const grpc::Status undrain = Drain(*balancer, "node-c", false, &undrained);
  ASSERT_TRUE(undrain.ok()) << undrain.error_message();
  ASSERT_TRUE(balancer->CurrentPlan().has_value());
  EXPECT_EQ(balancer->CurrentPlan()->excluded_ranks, std::vector<int>{1});
  v1::ForgetRequest forget;
  forget.set_node("node-a");
  v1::ForgetResponse forgotten;
  const grpc::Status forgot = balancer->Forget(nullptr, &forget, &forgotten);
  EXPECT_TRUE(forgot.ok()) << forgot.error_message();
}

// As above, but node-c, undrained, refuses the Commit of the plan taking rank 0 back for good
// (a client wrote into its plan area): it is sent no plan, yet it still holds rank 0 (and its
// arena), so node-a answering its health checks again still stays out.
TEST(BalancerServerTest, ANodeBackAfterARefusedNodeTookOverSomeOfItsRanksStaysOut) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan()), c("node-c", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), a, b);
  a.SetServing(false);
  TickUntilDown(*balancer, "node-a");
  balancer->Tick();  // Plans without node-a's ranks.
  v1::RegisterRequest rank0 = DaemonRegistration(c, "node-c", 0, 0, "host");
  rank0.clear_ranks();
  rank0.add_ranks(0);
  Register(*balancer, rank0);
  balancer->Tick();  // node-c, drained as it took over rank 0, catches up.
  ASSERT_TRUE(balancer->CurrentPlan().has_value());
  const uint64_t taking_back = balancer->CurrentPlan()->version + 1;
  c.DamageCommitOf(taking_back);
  v1::RebalanceResponse undrained;
  const grpc::Status refused = Drain(*balancer, "node-c", false, &undrained);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(refused.error_message(),
            "node node-c is undrained, but it refused the Commit of plan v3: rank 2's plan area "
            "lost plan v3 (plan v3 is not prepared here): committed on no rank of this daemon "
            "(did its client write into its plan area?): its ranks come back once it registers "
            "again (restart its ubepd)");
  ASSERT_FALSE(c.commit_requests().empty());
  EXPECT_EQ(c.commit_requests().back(), taking_back);
  a.SetServing(true);
  EXPECT_EQ(HealthAfterFourChecks(*balancer),
            (std::map<std::string, bool>{{"node-a", false}, {"node-b", true}, {"node-c", true}}));
}

// node-b goes down and node-c takes its ranks over: node-b's entry goes, node-c's ranks stay
// excluded until it is undrained (new arenas, as a restarted daemon's), and then come back.
TEST(BalancerServerTest, ANodeTakingOverADownNodesRanksReplacesIt) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), *a, *b);  // Learns v1.
  b.reset();
  TickUntilDown(*balancer, "node-b");  // v2 excludes ranks 2 and 3.
  ASSERT_EQ(a->committed_version(), 2u);
  FakeDaemon c("node-c", FirstPlan());
  Register(*balancer, DaemonRegistration(c, "node-c", 2, 0, "host"));
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
  ASSERT_EQ(cluster.nodes_size(), 2);
  EXPECT_EQ(cluster.nodes(0).node(), "node-a");
  EXPECT_EQ(cluster.nodes(1).node(), "node-c");
  EXPECT_TRUE(cluster.nodes(1).drained());
  EXPECT_EQ(std::vector<uint32_t>(cluster.excluded_ranks().begin(), cluster.excluded_ranks().end()),
            (std::vector<uint32_t>{2, 3}));
  balancer->Tick();  // node-c catches up on v2.
  EXPECT_EQ(c.committed_version(), 2u);
  v1::RebalanceResponse response;
  const grpc::Status status = Drain(*balancer, "node-c", false, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.version(), 3u);
  EXPECT_EQ(c.committed_version(), 3u);
  ASSERT_EQ(c.prepares().size(), 2u);
  EXPECT_TRUE(c.prepares()[1].plan().excluded_ranks().empty());
  ASSERT_EQ(c.prepares()[1].daemons_size(), 2);  // node-b is not listed.
  EXPECT_EQ(c.prepares()[1].daemons(1).node(), "node-c");
  // node-c registers again (as after an unanswered report): the same process is not drained.
  Register(*balancer, DaemonRegistration(c, "node-c", 2, 0, "host"));
  balancer->Tick();
  EXPECT_EQ(c.prepares().size(), 2u);
  v1::ClusterStatus after;
  ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &after).ok());
  ASSERT_EQ(after.nodes_size(), 2);
  EXPECT_FALSE(after.nodes(1).drained());
  EXPECT_EQ(after.excluded_ranks_size(), 0);
}

// node-b, with ranks 2 and 3, goes down; node-c takes rank 2 over and node-d rank 3: node-b's
// entry goes once both have registered.
TEST(BalancerServerTest, ANodeWhoseRanksOthersTookOverIsForgotten) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), *a, *b);
  b.reset();
  TickUntilDown(*balancer, "node-b");
  FakeDaemon c("node-c", FirstPlan()), d("node-d", FirstPlan());
  v1::RegisterRequest rc = DaemonRegistration(c, "node-c", 2, 0, "host");
  rc.mutable_ranks()->RemoveLast();
  v1::RegisterRequest rd = DaemonRegistration(d, "node-d", 3, 0, "host");
  rd.mutable_ranks()->RemoveLast();
  auto names = [&] {
    std::vector<std::string> n;
    for (const BalancerStatus::Node& node : balancer->Status().nodes) n.push_back(node.name);
    return n;
  };
  Register(*balancer, rc);
  EXPECT_EQ(names(), (std::vector<std::string>{"node-a", "node-b", "node-c"}));
  Register(*balancer, rd);
  EXPECT_EQ(names(), (std::vector<std::string>{"node-a", "node-c", "node-d"}));
}

// The nodes `balancer` lists as drained (GetStatus).
std::vector<std::string> DrainedNodes(Balancer& balancer) {
  v1::ClusterStatus cluster;
  EXPECT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
  std::vector<std::string> names;
  for (const v1::NodeStatus& n : cluster.nodes()) {
    if (n.drained()) names.push_back(n.node());
  }
  return names;
}

// Before the balancer has learned the cluster's plan it cannot tell whether a down node's
// ranks are out of it: the node is not forgotten.
TEST(BalancerServerTest, ANodeIsNotForgottenBeforeThePlanIsLearned) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  a->SetStateUnavailable(true);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), *a, *b, /*tick=*/false);
  b.reset();
  TickUntilDown(*balancer, "node-b");
  ASSERT_FALSE(balancer->CurrentPlan().has_value());
  v1::ForgetRequest request;
  request.set_node("node-b");
  v1::ForgetResponse response;
  const grpc::Status status = balancer->Forget(nullptr, &request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "node node-b is down, but the balancer has not learned the cluster's plan yet; try "
            "again once it has");
}

// A balancer served on loopback (127.0.0.1, a port of the kernel's choice), and a Control
// stub to it; `server` is null if it could not be served.
struct Served {
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Control::Stub> control;
};
Served Serve(Balancer& balancer) {
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&balancer);
  Served served;
  served.server = builder.BuildAndStart();
  if (port == 0) served.server.reset();
  served.control = v1::Control::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  return served;
}

// A Drain of `node` through `control` with a deadline `deadline` from now.
grpc::Status DrainWithin(v1::Control::Stub& control, const std::string& node,
                         absl::Duration deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  v1::DrainRequest request;
  request.set_node(node);
  v1::RebalanceResponse answer;
  return control.Drain(&context, request, &answer);
}

// ubepctl forget while a plan change is in flight, which lasts as long as its daemons' RPCs
// (here the plan without node-b's ranks, whose Prepare node-a holds): the balancer, served on
// loopback, answers before the caller's deadline and forgets nothing then, and forgets the
// node once the change is done.
TEST(BalancerServerTest, AForgetDrainOrRebalanceDuringAPlanChangeIsAnsweredBeforeItsDeadline) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  BalancerOptions options = QuickToMarkDown();
  options.rpc_timeout = absl::Seconds(30);  // The held Prepare is let go, not timed out.
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(*a, "node-a", 0, 0, "host"));
  Register(balancer, DaemonRegistration(*b, "node-b", 2, 0, "host"));
  balancer.Tick();  // Learns v1.
  const Served served = Serve(balancer);
  ASSERT_NE(served.server, nullptr);
  v1::Control::Stub* control = served.control.get();
  auto forget = [&](absl::Duration deadline, v1::ForgetResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::ForgetRequest request;
    request.set_node("node-b");
    return control->Forget(&context, request, response);
  };
  a->HoldPrepares(true);
  b.reset();
  std::thread ticks([&] { TickUntilDown(balancer, "node-b"); });  // v2 stops at Prepare.
  test::WaitFor([&] { return !a->prepares().empty(); }, absl::Seconds(10));
  // A drain and a rebalance asked meanwhile are answered the same way, and not done later.
  // The three at once, each with 6 s: the answer comes a tenth of that before the deadline,
  // which a loaded machine's delays stay inside (300 ms did not, once).
  const absl::Duration deadline = absl::Seconds(6);
  v1::ForgetResponse response;
  grpc::Status status, drain, rebalance;
  std::thread forgetting([&] { status = forget(deadline, &response); });
  std::thread draining([&] { drain = DrainWithin(*control, "node-a", deadline); });
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::RebalanceResponse answer;
    rebalance = control->Rebalance(&context, v1::RebalanceRequest(), &answer);
  }
  forgetting.join();
  draining.join();
  const bool prepared = !a->prepares().empty();
  a->HoldPrepares(false);
  ticks.join();
  ASSERT_TRUE(prepared) << "no plan change was in flight";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(status.error_message(),
            "a plan change or recovery is in flight; node node-b was not forgotten: try again "
            "once it is done");
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(drain.error_message(),
            "a plan change or recovery is in flight; node node-a was not drained: try again once "
            "it is done");
  EXPECT_EQ(rebalance.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(rebalance.error_message(),
            "a plan change or recovery is in flight; no rebalance was made: try again once it is "
            "done");
  balancer.Tick();
  v1::ClusterStatus after;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &after).ok());
  for (const v1::NodeStatus& n : after.nodes()) EXPECT_FALSE(n.drained()) << n.node();
  ASSERT_EQ(a->committed_version(), 2u);  // Without node-b's ranks.
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
  EXPECT_EQ(cluster.nodes_size(), 2);  // node-b is still known: the refused Forget took nothing.
  status = forget(absl::Seconds(10), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(std::vector<uint32_t>(response.ranks().begin(), response.ranks().end()),
            (std::vector<uint32_t>{2, 3}));
  served.server->Shutdown(std::chrono::system_clock::now());
}

// node-a and node-b, each keeping a plan it prepared pending until it is decided (as ubepd
// does), under a balancer that learned v1 from them (--rpc_timeout 30s: a caller's deadline
// comes first), served on loopback; destroyed server first, then balancer, then daemons.
struct PendingPair {
  std::unique_ptr<FakeDaemon> a, b;
  std::unique_ptr<Balancer> balancer;
  Served served;
};
PendingPair StartPendingPair(absl::Duration pause_before_commit) {
  PendingPair pair;
  pair.a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  pair.b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  pair.a->KeepPreparedPending(true);
  pair.b->KeepPreparedPending(true);
  BalancerOptions options = NeverMarkedDown();
  options.rpc_timeout = absl::Seconds(30);
  options.pause_before_commit = pause_before_commit;
  pair.balancer = WithTwoDaemons(options, *pair.a, *pair.b);
  pair.served = Serve(*pair.balancer);
  return pair;
}

// A drain whose plan is not prepared everywhere before the caller's deadline (node-a holds
// its Prepare, and its Abort) is aborted everywhere: the caller is answered before its
// deadline with what was done (nothing; the drain stays asked for), not left to time out
// while the plan is committed after all. The next interval commits the drain.
TEST(BalancerServerTest, APlanNotPreparedBeforeTheCallersDeadlineIsAbortedAndTheCallerToldSo) {
  PendingPair pair = StartPendingPair(absl::ZeroDuration());
  ASSERT_NE(pair.served.server, nullptr);
  FakeDaemon* a = pair.a.get();
  FakeDaemon* b = pair.b.get();
  Balancer* balancer = pair.balancer.get();
  v1::Control::Stub* control = pair.served.control.get();
  // node-a, cut off as it were, holds its Prepare and then its Abort (until the RPC's own
  // deadline): the caller is still answered in time.
  Gathering held_aborts(2);
  a->HoldPrepares(true);
  a->GatherAt("Abort", &held_aborts);
  // 6 s: the answer goes a tenth of that (600 ms) before the deadline, which a loaded 2-core
  // machine's timers have been seen to overrun by 300 ms (with 3 s, the answer came late).
  const grpc::Status drain = DrainWithin(*control, "node-b", absl::Seconds(6));
  a->GatherAt("Abort", nullptr);
  a->HoldPrepares(false);
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(drain.error_message(),
            "plan v2 aborted: node-a: no answer to Prepare before the caller's deadline; the "
            "drain stays asked for: each interval tries it again (undrain cancels it)");
  EXPECT_TRUE(a->commits().empty());
  EXPECT_TRUE(b->commits().empty());
  // node-a's Prepare, let go, leaves v2 pending there (unless its held Abort, let go at its
  // own deadline, comes after it and aborts it): recovery aborts what is pending, and the
  // drain asked for is committed as v3.
  ASSERT_TRUE(test::WaitFor([&] { return a->pending() == 2 || !a->aborted().empty(); },
                            absl::Seconds(10)));
  for (int i = 0; i < 3 && a->commits().empty(); ++i) balancer->Tick();
  // node-b's Abort had 50 ms (the decision round's time past the caller's margin): taken
  // then, or by recovery at the ticks.
  EXPECT_EQ(b->aborted(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(a->aborted(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(a->commits(), (std::vector<uint64_t>{3}));
  EXPECT_EQ(b->commits(), (std::vector<uint64_t>{3}));
  EXPECT_EQ(DrainedNodes(*balancer), (std::vector<std::string>{"node-b"}));
}

// A plan every node prepared, but only after the caller's deadline left time to commit it
// (here the balancer pauses before deciding, past that deadline), is aborted, not committed
// behind the caller's back; the drain stays asked for and the next interval commits it.
TEST(BalancerServerTest, APlanPreparedEverywhereAfterTheCallersDeadlineIsAborted) {
  PendingPair pair = StartPendingPair(/*pause_before_commit=*/absl::Seconds(3));
  ASSERT_NE(pair.served.server, nullptr);
  FakeDaemon* a = pair.a.get();
  FakeDaemon* b = pair.b.get();
  const grpc::Status drain = DrainWithin(*pair.served.control, "node-b", absl::Seconds(2));
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);  // The pause outlasts it.
  // The decision: Abort, sent after the pause with 50 ms to it (it may be lost), or delivered
  // by recovery at a tick (which waits for the drain's plan change to end first, and may then
  // commit the drain, still asked for, as v3).
  for (const absl::Time until = absl::Now() + absl::Seconds(10);
       (a->pending() == 2 || b->pending() == 2) && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(50));
    if (a->pending() == 2 || b->pending() == 2) pair.balancer->Tick();
  }
  EXPECT_EQ(a->aborted(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(b->aborted(), (std::vector<uint64_t>{2}));
  for (FakeDaemon* d : {a, b}) {
    const std::vector<uint64_t> commits = d->commits();
    EXPECT_EQ(std::count(commits.begin(), commits.end(), 2u), 0) << "v2 committed";
  }
}

// A drain over two CUDA domains whose NCCL link (CreateLink at node-a, held until its
// deadline) takes the time left before the caller's deadline is answered in time with nothing
// prepared anywhere; the drain stays asked for and the next interval commits it.
TEST(BalancerServerTest, ADrainWhoseNcclLinkTakesTheTimeLeftIsAnsweredWithNothingPrepared) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  BalancerOptions options = NeverMarkedDown();
  options.rpc_timeout = absl::Seconds(30);  // The caller's deadline comes first.
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "cuda"));
  Register(balancer, DaemonRegistration(b, "node-b", 2, /*domain=*/1, "cuda"));
  balancer.Tick();  // Learns v1.
  const Served served = Serve(balancer);
  ASSERT_NE(served.server, nullptr);
  Gathering held_links(2);  // Only one comes: it is held until its deadline.
  a.GatherAt("CreateLink", &held_links);
  // 6 s: the answer comes 600 ms before the deadline, which a loaded machine's delays stay
  // inside.
  const grpc::Status drain = DrainWithin(*served.control, "node-b", absl::Seconds(6));
  a.GatherAt("CreateLink", nullptr);
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(drain.error_message(),
            "plan v2 was not prepared: the NCCL link took the time left before the caller's "
            "deadline; the drain stays asked for: each interval tries it again (undrain cancels "
            "it)");
  EXPECT_EQ(held_links.most(), 1);
  EXPECT_TRUE(a.prepares().empty());
  EXPECT_TRUE(b.prepares().empty());
  // The held CreateLink makes its id once let go (at its deadline, the caller gone): the next
  // link is the second.
  ASSERT_TRUE(test::WaitFor([&] { return a.links() >= 1; }, absl::Seconds(10)));
  ASSERT_EQ(a.links(), 1);
  balancer.Tick();
  EXPECT_EQ(a.commits(), (std::vector<uint64_t>{3}));
  EXPECT_EQ(b.commits(), (std::vector<uint64_t>{3}));
  ASSERT_EQ(a.prepares().size(), 1u);
  EXPECT_EQ(a.prepares()[0].nccl_unique_id(), "unique id 2 of node-a");
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-b"}));
  served.server->Shutdown(std::chrono::system_clock::now());
}

// A drain whose plan takes the time left before the caller's deadline to make (a test hook
// stretches the planner's time past the balancer's answer time, a tenth of the 5 s before the
// deadline) is answered in time with nothing prepared anywhere and no version spent; the
// drain stays asked for and the next interval commits it as v2.
TEST(BalancerServerTest, ADrainWhosePlanTakesTheTimeLeftIsAnsweredWithNothingPrepared) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  BalancerOptions options = NeverMarkedDown();
  options.rpc_timeout = absl::Seconds(30);  // The caller's deadline comes first.
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);  // Learns v1.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  std::atomic<int> plans_made{0};
  balancer->set_after_planning_for_testing([&] {
    // The first plan ends 400 ms before the deadline: 100 ms past the answer time (500 ms
    // before it), and 400 ms for the answer to arrive (250 ms left little to a loaded,
    // sanitized run).
    if (plans_made++ == 0) absl::SleepFor(deadline - absl::Milliseconds(400) - absl::Now());
  });
  const Served served = Serve(*balancer);
  ASSERT_NE(served.server, nullptr);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::DrainRequest request;
  request.set_node("node-b");
  v1::RebalanceResponse answer;
  const grpc::Status drain = served.control->Drain(&context, request, &answer);
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(drain.error_message(),
              ::testing::MatchesRegex(
                  "a plan was made in [0-9.]+m?s; none was prepared before the caller's "
                  "deadline; the drain stays asked for: each interval tries it again "
                  "\\(undrain cancels it\\)"));
  EXPECT_EQ(plans_made.load(), 1);
  EXPECT_TRUE(a.prepares().empty());
  EXPECT_TRUE(b.prepares().empty());
  EXPECT_EQ(DrainedNodes(*balancer), (std::vector<std::string>{"node-b"}));
  balancer->Tick();
  EXPECT_EQ(plans_made.load(), 2);
  EXPECT_EQ(a.commits(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(b.commits(), (std::vector<uint64_t>{2}));
  served.server->Shutdown(std::chrono::system_clock::now());
}

// A balancer over node-a and node-b (RPCs given `rpc_timeout`) that learned v1 and committed
// v2, node-b drained; no report says v2 is in force on node-a's ranks yet.
std::unique_ptr<Balancer> WithNodeBDrainedUnderV2(FakeDaemon& a, FakeDaemon& b,
                                                  absl::Duration rpc_timeout) {
  BalancerOptions options = NeverMarkedDown();
  options.rpc_timeout = rpc_timeout;
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
  v1::RebalanceResponse drained;
  const grpc::Status drain = Drain(*balancer, "node-b", true, &drained);
  EXPECT_TRUE(drain.ok()) << drain.error_message();
  EXPECT_EQ(drained.version(), 2u);
  return balancer;
}

// A rebalance asked while the plan committed last (v2, node-b drained) is not yet reported in
// force on node-a's ranks waits for that only until the caller's deadline, and then says why
// no plan was made; once node-a reports v2 in force, the rebalance is made.
TEST(BalancerServerTest, ARebalanceWaitingForThePlanToBeInForceIsAnsweredBeforeItsDeadline) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  // The wait would last 60 s (2 x rpc_timeout).
  std::unique_ptr<Balancer> balancer = WithNodeBDrainedUnderV2(a, b, absl::Seconds(30));
  const Served served = Serve(*balancer);
  ASSERT_NE(served.server, nullptr);
  auto rebalance = [&](v1::RebalanceResponse* answer) {
    grpc::ClientContext context;
    // 6 s: the answer comes 600 ms before the deadline, which a loaded machine's delays
    // stay inside (300 ms did not, once).
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(6)));
    return served.control->Rebalance(&context, v1::RebalanceRequest(), answer);
  };
  v1::RebalanceResponse answer;
  grpc::Status status = rebalance(&answer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(status.error_message(),
            "plan v2 is not in force on every rank yet; no plan was made before the caller's "
            "deadline");
  EXPECT_EQ(a.prepares().size(), 1u);  // v2's only.
  ASSERT_TRUE(ReportSteps(*balancer, "node-a", 0, /*seq=*/1, /*max_step=*/5, /*version=*/2).ok());
  status = rebalance(&answer);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(answer.version(), 2u);  // Nothing to move under an even load.
  EXPECT_FALSE(answer.changed());
  served.server->Shutdown(std::chrono::system_clock::now());
}

// A Rebalance (deadline 20 s) over the wire, with plan v2 (node-b drained, rpc_timeout 1 s) not
// in force on node-a's ranks: the balancer waits its own 2 x rpc_timeout, then makes no plan
// and spends no version.
void ExpectARebalanceMakesNoPlanWhileV2IsNotInForce(Balancer& balancer, FakeDaemon& a) {
  const Served served = Serve(balancer);
  ASSERT_NE(served.server, nullptr);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  v1::RebalanceResponse answer;
  const grpc::Status status =
      served.control->Rebalance(&context, v1::RebalanceRequest(), &answer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(),
            "plan v2 is not in force on every rank after 2s; no plan was made");
  EXPECT_EQ(a.prepares().size(), 1u);  // v2's only.
  served.server->Shutdown(std::chrono::system_clock::now());
}

// The same wait, bounded by the balancer's own 2 x rpc_timeout before the caller's deadline:
// no plan is made (the daemons would refuse it while v2 is not in force on node-a's ranks),
// and no version is spent.
TEST(BalancerServerTest, ARebalanceWhosePlanInForceStaysPendingMakesNoPlan) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  // (The setup's own Prepare and Commit get 1 s each, on a loaded machine.)
  std::unique_ptr<Balancer> balancer = WithNodeBDrainedUnderV2(a, b, absl::Seconds(1));
  ExpectARebalanceMakesNoPlanWhileV2IsNotInForce(*balancer, a);
}

// A report refused (here as of plan v3, which the cluster does not have) says nothing of
// which plan node-a's ranks follow: the wait for v2 to be in force everywhere goes on, and
// ends with no plan made, as with no report at all.
TEST(BalancerServerTest, ARefusedReportDoesNotTellThatThePlanIsInForce) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithNodeBDrainedUnderV2(a, b, absl::Seconds(1));
  const grpc::Status refused = ReportSteps(*balancer, "node-a", 0, /*seq=*/1, /*max_step=*/5,
                                           /*version=*/3);
  EXPECT_EQ(refused.error_message(),
            "report counted under plan v3 (steps 0-5); plan v2 is in force from step 0");
  ExpectARebalanceMakesNoPlanWhileV2IsNotInForce(*balancer, a);
}

// A report's steps run forwards: otherwise its step count (which scales every node's counts
// in the window) is no count of steps run. One that ends past the step its ranks are at now is
// taken (sent again after the group formed again at an earlier step).
TEST(BalancerServerTest, AReportOfStepsBackwardsIsRefused) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);  // Learns v1.
  v1::ReportLoadResponse response;
  const v1::ReportLoadRequest backwards = ReportOf("node-a", 0, 1, 300, 200, 1, 1);
  grpc::Status status = balancer->ReportLoad(nullptr, &backwards, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "report of node node-a counts steps 300-200, backwards");
  // Refused before anything of it is kept: sent again, it is refused again (it was answered
  // OK as a resend of a report taken), and a step past 2^63 - 1 leaves the node's step as it
  // was (it left no step for a plan).
  status = balancer->ReportLoad(nullptr, &backwards, &response);
  EXPECT_EQ(status.error_message(), "report of node node-a counts steps 300-200, backwards");
  v1::ReportLoadRequest far = ReportOf("node-a", 0, 1, 100, 200, 1, 1);
  far.set_max_step(UINT64_MAX);
  status = balancer->ReportLoad(nullptr, &far, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "report of node node-a says step 18446744073709551615, "
                                    "above 2^63 - 1 (libubep refuses such a step)");
  v1::ReportLoadRequest resent = ReportOf("node-a", 0, 2, 100, 200, 1, 1);
  resent.set_max_step(3);
  status = balancer->ReportLoad(nullptr, &resent, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  // A daemon that registered no rank (no client attached to it yet) has no slots to report.
  FakeDaemon c("node-c", FirstPlan());
  v1::RegisterRequest rc = DaemonRegistration(c, "node-c", 0, 0, "host");
  rc.clear_ranks();
  rc.clear_shape();
  Register(*balancer, rc);
  const v1::ReportLoadRequest rankless = ReportOf("node-c", 0, 1, 100, 200, 1, 1);
  status = balancer->ReportLoad(nullptr, &rankless, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "node node-c registered no rank: it has no slots to report the load of");
}

// Plan v2 (node-b drained) is committed on node-b, but node-a's Commit answer is lost, and
// node-a cannot be asked its state for a while; meanwhile node-b goes down and is forgotten.
// v2 is the balancer's plan, committed: recovery commits it on node-a, not aborts it (which
// would leave node-a under v1 while the cluster is under v2).
TEST(BalancerServerTest, APlanCommittedOnlyOnAForgottenNodeIsStillCommittedOnTheOthers) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  BalancerOptions options = QuickToMarkDown();
  options.recovery_grace = absl::ZeroDuration();
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, *a, *b);  // Learns v1.
  a->LoseCommitOf(2);
  a->SetStateUnavailable(true);
  v1::RebalanceResponse response;
  // Committed, with one Commit's answer lost: the operator is told it was made.
  const grpc::Status drained = Drain(*balancer, "node-b", true, &response);
  ASSERT_TRUE(drained.ok()) << drained.error_message();
  EXPECT_EQ(response.version(), 2u);
  EXPECT_TRUE(response.changed());
  // ... and told which node has not acknowledged it yet.
  EXPECT_EQ(std::vector<std::string>(response.commit_unacknowledged().begin(),
                                     response.commit_unacknowledged().end()),
            std::vector<std::string>{"node-a"});
  ASSERT_EQ(b->committed_version(), 2u);
  ASSERT_EQ(a->committed_version(), 1u);
  b.reset();
  TickUntilDown(*balancer, "node-b");
  v1::ForgetRequest forget;
  forget.set_node("node-b");
  v1::ForgetResponse forgotten;
  const grpc::Status status = balancer->Forget(nullptr, &forget, &forgotten);
  ASSERT_TRUE(status.ok()) << status.error_message();
  a->SetStateUnavailable(false);
  for (int i = 0; i < 5 && a->committed_version() < 2; ++i) balancer->Tick();
  EXPECT_EQ(a->committed_version(), 2u);
  EXPECT_TRUE(a->aborted().empty());
}

// Plan v2 (node-b drained): every node prepared it, and no node's Commit answer came. The
// caller is not told it is committed: until a node has it committed, a balancer restarted
// would abort it. This balancer delivers it at its next ticks.
TEST(BalancerServerTest, APlanNoNodeAcknowledgedTheCommitOfIsNotAnsweredCommitted) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);  // Learns v1.
  a.LoseCommitOf(2);
  b.LoseCommitOf(2);
  v1::RebalanceResponse response;
  const grpc::Status drained = Drain(*balancer, "node-b", true, &response);
  EXPECT_EQ(drained.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(drained.error_message(),
            "plan v2 was decided (every node prepared it), but no node acknowledged its Commit "
            "before the answer was due: until one does, a balancer restarted would abort it; "
            "this one delivers it at its next ticks (ubepctl status shows the plan in force)");
  EXPECT_EQ(a.committed_version(), 1u);
  EXPECT_EQ(b.committed_version(), 1u);
  for (int i = 0; i < 5 && (a.committed_version() < 2 || b.committed_version() < 2); ++i) {
    balancer->Tick();
  }
  EXPECT_EQ(a.committed_version(), 2u);
  EXPECT_EQ(b.committed_version(), 2u);
  EXPECT_TRUE(a.aborted().empty());
  EXPECT_TRUE(b.aborted().empty());
}

// Registers node-a (incarnation a-1, ranks 0-1) and node-b (b-1, ranks 2-3), learns v1 and
// drains node-b (v2); returns node-b's registration.
v1::RegisterRequest RegisterAndDrainNodeB(Balancer& balancer, FakeDaemon& a, FakeDaemon& b) {
  v1::RegisterRequest ra = DaemonRegistration(a, "node-a", 0, 0, "host");
  v1::RegisterRequest rb = DaemonRegistration(b, "node-b", 2, 0, "host");
  ra.set_incarnation("a-1");
  rb.set_incarnation("b-1");
  Register(balancer, ra);
  Register(balancer, rb);
  balancer.Tick();  // Learns v1.
  v1::RebalanceResponse response;
  const grpc::Status status = Drain(balancer, "node-b", true, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return rb;
}

// Plan v3 (node-b undrained) is committed on node-a, and node-b refuses its Commit for good
// (DATA_LOSS: a client wrote into a plan area of its ranks; ubepd keeps the plan pending, and
// none of its ranks can take it). The cluster does not wait on node-b for ever: node-b is
// marked refused (status and the gauge say so), asked no more (no GetState, Prepare or
// Commit), its reports are not taken, and the next tick excludes its ranks (v4, on node-a
// alone), as a down node's. Neither its registering again as the same process (as when a
// peer restarted) nor an undrain brings it back; its ubepd restarted, it registers again and
// comes back drained, and an undrain takes its ranks back.
TEST(BalancerServerTest, ANodeThatRefusesACommitForGoodIsExcludedAndHoldsBackNoPlan) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  a.KeepPreparedPending(true);
  b.KeepPreparedPending(true);
  auto registry = std::make_shared<prometheus::Registry>();
  Balancer balancer(NeverMarkedDown(), registry);
  auto refused_daemons = [&] {
    for (const prometheus::MetricFamily& f : registry->Collect()) {
      if (f.name == "ubep_balancer_refused_daemons") return f.metric.at(0).gauge.value;
    }
    return -1.0;
  };
  const v1::RegisterRequest rb = RegisterAndDrainNodeB(balancer, a, b);
  ASSERT_EQ(b.committed_version(), 2u);
  v1::RebalanceResponse response;
  grpc::Status status;
  b.DamageCommitOf(3);
  const std::string refused =
      "refused the Commit of plan v3: rank 2's plan area lost plan v3 (plan v3 is not prepared "
      "here): committed on no rank of this daemon (did its client write into its plan area?)";
  const std::string not_back = absl::StrCat(
      "FAILED_PRECONDITION: node node-b is undrained, but it ", refused,
      ": its ranks come back once it registers again (restart its ubepd)");
  // Committed on node-a; the operator is told that node-b's ranks are not back.
  EXPECT_EQ(StatusOf(Drain(balancer, "node-b", false, &response)), not_back);
  EXPECT_EQ(a.committed_version(), 3u);
  EXPECT_EQ(b.pending(), 3u);
  auto node_b = [&] {
    v1::ClusterStatus cluster;
    EXPECT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
    EXPECT_EQ(cluster.nodes_size(), 2);
    return cluster.nodes_size() == 2 ? cluster.nodes(1) : v1::NodeStatus();
  };
  EXPECT_EQ(node_b().refused(), refused);
  const int states = b.state_requests();
  balancer.Tick();  // Excludes node-b's ranks.
  EXPECT_EQ(refused_daemons(), 1);
  balancer.Tick();
  EXPECT_EQ(a.committed_version(), 4u);
  ASSERT_TRUE(balancer.CurrentPlan().has_value());
  EXPECT_EQ(balancer.CurrentPlan()->version, 4u);
  EXPECT_EQ(balancer.CurrentPlan()->excluded_ranks, (std::vector<int>{2, 3}));
  // Its reports are refused as a refused node's (not as stale ones).
  EXPECT_EQ(StatusOf(ReportSteps(balancer, "node-b", 1, 1, 10, 2)),
            absl::StrCat("FAILED_PRECONDITION: node node-b ", refused,
                         "; its reports are not taken until it registers again"));
  // The same process registering again (a peer of it restarted, say) is still refused, and
  // an undrain takes nothing back.
  Register(balancer, rb);
  EXPECT_EQ(node_b().refused(), refused);
  EXPECT_EQ(StatusOf(Drain(balancer, "node-b", false, &response)), not_back);
  balancer.Tick();
  EXPECT_EQ(balancer.CurrentPlan()->version, 4u);
  // node-b was asked nothing after the Commit it refused.
  EXPECT_EQ(b.state_requests(), states);
  EXPECT_EQ(b.prepares().back().plan().version(), 3u);
  EXPECT_EQ(b.commit_requests(), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(b.pending(), 3u);
  {
    // A balancer restarted now finds v3 pending on node-b below v4, aborts it as superseded,
    // and node-b's area refuses that too: refused again, not taken back as caught up.
    Balancer restarted(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
    v1::RegisterRequest ra = DaemonRegistration(a, "node-a", 0, 0, "host");
    ra.set_incarnation("a-1");
    Register(restarted, ra);
    Register(restarted, rb);
    restarted.Tick();
    restarted.Tick();
    v1::ClusterStatus cluster;
    ASSERT_TRUE(restarted.GetStatus(nullptr, nullptr, &cluster).ok());
    ASSERT_EQ(cluster.nodes_size(), 2);
    EXPECT_EQ(cluster.nodes(1).refused(),
              "refused the Abort of plan v3: plan v3 is aborted here, but the plan area of rank 2 "
              "(plan v3 is not prepared here) did not take the abort (did its client write into "
              "its plan area?)");
    EXPECT_EQ(b.committed_version(), 2u);  // Not caught up on v4.
  }
  // Its ubepd restarted: a new process (here at another address), under its own first plan,
  // nothing pending.
  FakeDaemon restarted("node-b", FirstPlan());
  v1::RegisterRequest again = DaemonRegistration(restarted, "node-b", 2, 0, "host");
  again.set_incarnation("b-2");
  Register(balancer, again);
  EXPECT_EQ(node_b().refused(), "");
  EXPECT_TRUE(node_b().drained());
  balancer.Tick();  // It catches up on v4 (which excludes its ranks).
  EXPECT_EQ(refused_daemons(), 0);
  EXPECT_EQ(restarted.committed_version(), 4u);
  status = Drain(balancer, "node-b", false, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.version(), 5u);
  EXPECT_EQ(a.committed_version(), 5u);
  EXPECT_EQ(restarted.committed_version(), 5u);
  EXPECT_TRUE(balancer.CurrentPlan()->excluded_ranks.empty());
}

// A node that refused a Commit for good is not asked its state again, but its state is known
// (the refused plan pending, no later one): recovery does not count it among the daemons that
// may have committed an orphan plan, and aborts one left pending on node-a at once rather than
// after the registration grace (an hour here).
TEST(BalancerServerTest, ARefusedNodeHoldsBackNoAbortOfAnOrphanPlan) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  a.KeepPreparedPending(true);
  b.KeepPreparedPending(true);
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  options.registration_grace = absl::Hours(1);
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  RegisterAndDrainNodeB(balancer, a, b);
  ASSERT_EQ(b.committed_version(), 2u);
  v1::RebalanceResponse response;
  b.DamageCommitOf(3);
  const grpc::Status refused = Drain(balancer, "node-b", false, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(refused.error_message(),
            "node node-b is undrained, but it refused the Commit of plan v3: rank 2's plan area "
            "lost plan v3 (plan v3 is not prepared here): committed on no rank of this daemon "
            "(did its client write into its plan area?): its ranks come back once it registers "
            "again (restart its ubepd)");
  balancer.Tick();  // v4, without node-b's ranks.
  ASSERT_EQ(a.committed_version(), 4u);
  // v5 pending on node-a (a Prepare of a balancer before this one, landed late), found when
  // node-a's state is read again.
  v1::Plan orphan = FirstPlan();
  orphan.set_version(5);
  a.SetPending(orphan);
  v1::RegisterRequest ra = DaemonRegistration(a, "node-a", 0, 0, "host");
  ra.set_incarnation("a-1");  // The same process.
  Register(balancer, ra);
  balancer.Tick();
  EXPECT_EQ(a.aborted(), std::vector<uint64_t>{5});
  EXPECT_EQ(a.pending(), 0u);
}

// A GetState past gRPC's default receive limit of 4 MiB, as the committed plan of a large
// group makes it (1024 ranks x 8 slots x 58 layers is 4.7 MB; here a padded node name stands
// in for it, a plan that size taking minutes to build under ThreadSanitizer). The balancer
// reads it all the same, and learns the plan.
TEST(BalancerServerTest, AGetStatePastGrpcsDefaultMessageSizeIsRead) {
#if defined(__SANITIZE_THREAD__)
  // 5 MB through gRPC take longer than the RPC's deadline here; a size limit is not a race.
  GTEST_SKIP() << "not under ThreadSanitizer";
#endif
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  a.PadState(size_t{5} << 20);
  b.PadState(size_t{5} << 20);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  const std::optional<Plan> learned = balancer->CurrentPlan();
  ASSERT_TRUE(learned.has_value());
  EXPECT_EQ(learned->version, 1u);
}

// The first plan of a group of 4 ranks x 4 slots, 6 experts, `layers` layers (round-robin).
v1::Plan FirstPlanOfLayers(int layers) {
  Plan plan;
  plan.version = 1;
  plan.topology = {4, 1, 4, 1};
  plan.num_experts = 6;
  for (int l = 0; l < layers; ++l) {
    LayerPlan layer;
    for (int p = 0; p < 16; ++p) layer.slot_expert.push_back(p % 6);
    SetEqualShares(6, layer);
    plan.layer_ids.push_back(l);
    plan.layers.push_back(layer);
  }
  return ToProto(plan, PlanEncoding::kFull);
}

// One daemon serves the whole group; its clients attach again with a model of 3 layers, and
// it registers its new group. With no other node serving the old shape, the balancer starts
// over with the new one (it refused it for good before: the cluster's shape was set once)
// and learns the new group's plan; a second node of the old shape would still refuse it.
TEST(BalancerServerTest, TheOnlyNodeOfTheClusterRegisteringAGroupOfAnotherShapeStartsItOver) {
  FakeDaemon a("node-a", FirstPlan());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  v1::RegisterRequest whole = DaemonRegistration(a, "node-a", 0, 0, "host");
  whole.add_ranks(2);
  whole.add_ranks(3);
  whole.set_incarnation("a-1");
  Register(balancer, whole);
  balancer.Tick();
  ASSERT_TRUE(balancer.CurrentPlan().has_value());
  ASSERT_EQ(balancer.CurrentPlan()->num_layers(), 2);
  // The new group: 3 layers, under its own first plan.
  a.SetCommitted(FirstPlanOfLayers(3));
  v1::RegisterRequest reshaped = whole;
  reshaped.mutable_shape()->set_num_layers(3);
  v1::RegisterResponse response;
  const grpc::Status status = balancer.Register(nullptr, &reshaped, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  balancer.Tick();
  const std::optional<Plan> learned = balancer.CurrentPlan();
  ASSERT_TRUE(learned.has_value());
  EXPECT_EQ(learned->num_layers(), 3);
  EXPECT_EQ(learned->version, 1u);
  // Another node of the old shape is refused now, naming the new one as the cluster's.
  FakeDaemon b("node-b", FirstPlan());
  v1::RegisterRequest old_shape = DaemonRegistration(b, "node-b", 0, 0, "host");
  EXPECT_EQ(balancer.Register(nullptr, &old_shape, &response).error_message(),
            "node node-b serves another model than the cluster's: num_layers is 2, the cluster's "
            "3 (the cluster takes it once every node holding ranks of its model registers it)");
  // A node that served part of the group does not start it over, even with the rest down.
  auto c = std::make_unique<FakeDaemon>("node-c", FirstPlan());
  FakeDaemon d("node-d", FirstPlan());
  std::unique_ptr<Balancer> two = WithTwoDaemons(QuickToMarkDown(), *c, d, true, "node-c", "node-d");
  c.reset();
  TickUntilDown(*two, "node-c");
  v1::RegisterRequest part = DaemonRegistration(d, "node-d", 2, 0, "host");
  part.mutable_shape()->set_num_layers(3);
  const grpc::Status refused = two->Register(nullptr, &part, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(refused.error_message(),
            "node node-d serves another model than the cluster's: num_layers is 3, the cluster's "
            "2 (the cluster takes it once every node holding ranks of its model registers it)");
}

// A model change over several nodes: the clients of each attach again with another model and
// each daemon registers its new group (as a new incarnation: new arenas). The first is refused,
// another node serving the old shape, and remembered to ask for the new one; a node that asks
// for a third shape holds the change back; once the nodes serving every rank of the old group
// have asked for the same shape, the cluster starts over with it, and the first node is taken
// when it registers again (its daemon retries). Neither node is kept out as restarted: both
// groups are new.
TEST(BalancerServerTest, EveryNodeOfTheClusterMovingToAnotherShapeStartsItOver) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  ASSERT_TRUE(balancer->CurrentPlan().has_value());
  ASSERT_EQ(balancer->CurrentPlan()->num_layers(), 2);
  a.SetCommitted(FirstPlanOfLayers(3));
  b.SetCommitted(FirstPlanOfLayers(3));
  auto reshaped = [](v1::RegisterRequest q, int layers, const std::string& incarnation) {
    q.mutable_shape()->set_num_layers(static_cast<uint32_t>(layers));
    q.set_incarnation(incarnation);
    return q;
  };
  const v1::RegisterRequest a3 = reshaped(DaemonRegistration(a, "node-a", 0, 0, "host"), 3, "a.2");
  const v1::RegisterRequest b4 = reshaped(DaemonRegistration(b, "node-b", 2, 0, "host"), 4, "b.2");
  const v1::RegisterRequest b3 = reshaped(DaemonRegistration(b, "node-b", 2, 0, "host"), 3, "b.3");
  v1::RegisterResponse response;
  grpc::Status status = balancer->Register(nullptr, &a3, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "node node-a serves another model than the cluster's: num_layers is 3, the cluster's "
            "2 (the cluster takes it once every node holding ranks of its model registers it)");
  status = balancer->Register(nullptr, &b4, &response);
  EXPECT_EQ(status.error_message(),
            "node node-b serves another model than the cluster's: num_layers is 4, the cluster's "
            "2 (the cluster takes it once every node holding ranks of its model registers it)");
  balancer->Tick();
  EXPECT_EQ(balancer->CurrentPlan()->num_layers(), 2);
  // The operator sees which model each node waits to serve.
  auto new_models = [&] {
    v1::ClusterStatus cluster;
    EXPECT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
    std::vector<std::string> models;
    for (const auto& n : cluster.nodes()) models.push_back(n.node() + ": " + n.new_model());
    return models;
  };
  EXPECT_EQ(new_models(), (std::vector<std::string>{
                              "node-a: 4 ranks x 4 slots, 3 layers x 6 experts, hidden 0, top-0, "
                              "0 tokens, 0 bytes per expert, DTYPE_FLOAT32",
                              "node-b: 4 ranks x 4 slots, 4 layers x 6 experts, hidden 0, top-0, "
                              "0 tokens, 0 bytes per expert, DTYPE_FLOAT32"}));
  // node-b moves to node-a's shape: every rank of the old group has moved.
  status = balancer->Register(nullptr, &b3, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  status = balancer->Register(nullptr, &a3, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  balancer->Tick();
  const std::optional<Plan> learned = balancer->CurrentPlan();
  ASSERT_TRUE(learned.has_value());
  EXPECT_EQ(learned->num_layers(), 3);
  EXPECT_EQ(learned->version, 1u);
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
  ASSERT_EQ(cluster.nodes_size(), 2);
  for (const auto& n : cluster.nodes()) {
    EXPECT_FALSE(n.drained()) << n.node();
    EXPECT_EQ(n.ranks_size(), 2) << n.node();
    EXPECT_EQ(n.new_model(), "") << n.node();
  }
  // A node of the old shape is refused now.
  const v1::RegisterRequest a2 = DaemonRegistration(a, "node-a", 0, 0, "host");
  EXPECT_EQ(StatusOf(balancer->Register(nullptr, &a2, &response)),
            "FAILED_PRECONDITION: node node-a serves another model than the cluster's: "
            "num_layers is 2, the cluster's 3 (the cluster takes it once every node holding "
            "ranks of its model registers it)");
}

// node-a once saw node-b's ranks restart (its registration names them); then the cluster
// moves to another model, node-b first to be taken: what node-a saw was of the old group, and
// node-b, a new group's, is not kept out as restarted (it was, by node-a's stored
// registration, as soon as the balancer learned the new group's plan).
TEST(BalancerServerTest, ARestartSeenInTheOldModelKeepsNoNodeOfTheNewOneOut) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  ASSERT_TRUE(balancer->CurrentPlan().has_value());
  v1::RegisterRequest saw = DaemonRegistration(a, "node-a", 0, 0, "host");
  saw.add_restarted_ranks(2);
  saw.add_restarted_ranks(3);
  Register(*balancer, saw);
  a.SetCommitted(FirstPlanOfLayers(3));
  b.SetCommitted(FirstPlanOfLayers(3));
  v1::RegisterRequest a3 = DaemonRegistration(a, "node-a", 0, 0, "host");
  a3.mutable_shape()->set_num_layers(3);
  a3.set_incarnation("a.2");
  v1::RegisterRequest b3 = DaemonRegistration(b, "node-b", 2, 0, "host");
  b3.mutable_shape()->set_num_layers(3);
  b3.set_incarnation("b.2");
  v1::RegisterResponse response;
  EXPECT_EQ(balancer->Register(nullptr, &a3, &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  const grpc::Status status = balancer->Register(nullptr, &b3, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  balancer->Tick();  // Before node-a registers again: its stored registration is the old one.
  ASSERT_TRUE(balancer->CurrentPlan().has_value());
  EXPECT_EQ(balancer->CurrentPlan()->num_layers(), 3);
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
  for (const auto& n : cluster.nodes()) EXPECT_FALSE(n.drained()) << n.node();
}

// What holds a model change back is a node that holds ranks of the cluster's model and has
// not asked for the new one, up or down:
// - a node whose daemon started again without a group (its clients not back yet) still does:
//   a canary of another model on one node does not take the cluster over while another node's
//   daemon restarts;
// - a node down does, until it is forgotten, which a model change allows although the plan in
//   force still has its ranks (no plan of the old model is committed again);
// - ranks no node holds do not: a restarted balancer knows only the nodes that registered
//   since; one that moved before is refused without being remembered, and the last node to
//   move starts the cluster over.
// A change of any field of the model (here max_tokens alone, which the plans do not use) is a
// model change: the daemons made new groups (new incarnations), and nobody is drained for it.

TEST(BalancerServerTest, AModelChangeIsHeldBackOnlyByNodesHoldingRanksOfTheOldModel) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  auto with_tokens = [](v1::RegisterRequest q, uint32_t tokens, const std::string& incarnation) {
    q.mutable_shape()->set_max_tokens(tokens);
    q.set_incarnation(incarnation);
    return q;
  };
  const v1::RegisterRequest a_old = with_tokens(DaemonRegistration(a, "node-a", 0, 0, "host"), 8, "a.1");
  const v1::RegisterRequest b_old = with_tokens(DaemonRegistration(b, "node-b", 2, 0, "host"), 8, "b.1");
  const v1::RegisterRequest a_new = with_tokens(DaemonRegistration(a, "node-a", 0, 0, "host"), 16, "a.2");
  const v1::RegisterRequest b_new = with_tokens(DaemonRegistration(b, "node-b", 2, 0, "host"), 16, "b.2");
  v1::RegisterRequest b_restarted;  // A new ubepd of node-b, no client attached yet.
  b_restarted.set_node("node-b");
  b_restarted.set_address(b.address());
  b_restarted.set_incarnation("b2.0");
  auto drained_nodes = [](Balancer& balancer) {
    v1::ClusterStatus cluster;
    EXPECT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
    std::vector<std::string> drained;
    for (const auto& n : cluster.nodes()) {
      if (n.drained()) drained.push_back(n.node());
    }
    return drained;
  };
  v1::RegisterResponse response;
  {
    SCOPED_TRACE("a node restarted without a group");
    Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
    Register(balancer, a_old);
    Register(balancer, b_old);
    balancer.Tick();
    const grpc::Status refused = balancer.Register(nullptr, &a_new, &response);
    EXPECT_EQ(refused.error_message(),
              "node node-a serves another model than the cluster's: max_tokens is 16, the "
              "cluster's 8 (the cluster takes it once every node holding ranks of its model "
              "registers it)");
    Register(balancer, b_restarted);
    EXPECT_EQ(balancer.Register(nullptr, &a_new, &response).error_message(),
              refused.error_message());
    Register(balancer, b_new);  // node-b's clients are back, with the new model.
    Register(balancer, a_new);
    EXPECT_EQ(drained_nodes(balancer), std::vector<std::string>{});
    balancer.Tick();
    ASSERT_TRUE(balancer.CurrentPlan().has_value());
  }
  {
    SCOPED_TRACE("a node down");
    auto gone = std::make_unique<FakeDaemon>("node-b", FirstPlan());
    std::unique_ptr<Balancer> balancer = WithTwoDaemons(QuickToMarkDown(), a, *gone);
    // node-a cannot prepare a plan of the old model (its group has the new one): none that
    // excludes node-b is committed.
    a.Refuse(FakeDaemon::kEveryVersion);
    gone.reset();
    TickUntilDown(*balancer, "node-b");
    v1::ForgetResponse forgotten;
    v1::ForgetRequest forget;
    forget.set_node("node-b");
    // Before any node asked for another model: the plan in force still has node-b's ranks.
    EXPECT_EQ(StatusOf(balancer->Forget(nullptr, &forget, &forgotten)),
              "FAILED_PRECONDITION: node node-b is down, but plan v1 still has its ranks 2, 3; "
              "it can be forgotten once a plan without them is committed");
    const v1::RegisterRequest a_new_here =
        with_tokens(DaemonRegistration(a, "node-a", 0, 0, "host"), 16, "a.3");
    EXPECT_EQ(StatusOf(balancer->Register(nullptr, &a_new_here, &response)),
              "FAILED_PRECONDITION: node node-a serves another model than the cluster's: "
              "max_tokens is 16, the cluster's 0 (the cluster takes it once every node holding "
              "ranks of its model registers it)");
    const grpc::Status status = balancer->Forget(nullptr, &forget, &forgotten);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(forgotten.ranks_size(), 2);
    Register(*balancer, a_new_here);
  }
  {
    SCOPED_TRACE("a restarted balancer");
    Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
    Register(balancer, b_old);  // node-a, which moved already, is not known yet.
    EXPECT_EQ(StatusOf(balancer.Register(nullptr, &a_new, &response)),
              "FAILED_PRECONDITION: node node-a serves another model than the cluster's: "
              "max_tokens is 16, the cluster's 8 (the cluster takes it once every node holding "
              "ranks of its model registers it)");
    Register(balancer, b_new);
    Register(balancer, a_new);
    balancer.Tick();
    v1::ClusterStatus cluster;
    ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
    ASSERT_EQ(cluster.nodes_size(), 2);
    for (const auto& n : cluster.nodes()) EXPECT_EQ(n.ranks_size(), 2) << n.node();
    EXPECT_EQ(drained_nodes(balancer), std::vector<std::string>{});
  }
}

// node-b's clients moved to another model (its registration refused as not the cluster's,
// node-a still serving the cluster's): its ranks are served no more, so a plan without them is
// committed on node-a, and node-b, whose group is of the other model and would refuse every
// plan of this one, gets no Prepare (it held every change of node-a's group back).
TEST(BalancerServerTest, ANodeWhoseGroupMovedToAnotherModelIsLeftOutOfThePlans) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  b.Refuse(FakeDaemon::kEveryVersion);
  v1::RegisterRequest b_new = DaemonRegistration(b, "node-b", 2, 0, "host");
  b_new.mutable_shape()->set_max_tokens(b_new.shape().max_tokens() + 8);
  b_new.set_incarnation("b.2");
  v1::RegisterResponse response;
  EXPECT_EQ(StatusOf(balancer->Register(nullptr, &b_new, &response)),
            "FAILED_PRECONDITION: node node-b serves another model than the cluster's: "
            "max_tokens is 8, the cluster's 0 (the cluster takes it once every node holding "
            "ranks of its model registers it)");
  for (int tick = 0; tick < 3; ++tick) balancer->Tick();  // Catch-ups and recovery too.
  EXPECT_TRUE(b.prepares().empty());
  EXPECT_EQ(a.committed_version(), 2u);
  ASSERT_EQ(a.prepares().size(), 1u);
  // Listed as down: a weight of its ranks may still be read from its arenas, but no link or
  // Prepare waits for it.
  ASSERT_EQ(a.prepares()[0].daemons_size(), 1);
  EXPECT_EQ(a.prepares()[0].daemons(0).node(), "node-a");
  ASSERT_EQ(a.prepares()[0].down_daemons_size(), 1);
  EXPECT_EQ(a.prepares()[0].down_daemons(0).node(), "node-b");
  ASSERT_TRUE(balancer->CurrentPlan().has_value());
  EXPECT_THAT(balancer->CurrentPlan()->excluded_ranks, ::testing::ElementsAre(2, 3));
}

// Recovery takes a daemon's committed plan as the cluster's only when it is of the cluster's
// shape: node-b holds v5 of a 3-layer model (its group changed model after it registered),
// which the next plan would index the cluster's 2-layer load by.
TEST(BalancerServerTest, RecoveryDoesNotTakeAPlanOfAnotherShape) {
  v1::Plan other = FirstPlanOfLayers(3);
  other.set_version(5);
  FakeDaemon a("node-a", FirstPlan()), b("node-b", other);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  EXPECT_EQ(balancer->Status().plan_version, 1u);
  const grpc::Status report = ReportSteps(*balancer, "node-a", 0, 1, 10);
  EXPECT_TRUE(report.ok()) << report.error_message();
}

// FirstPlan as version `version`.
v1::Plan FirstPlanAs(uint64_t version) {
  v1::Plan plan = FirstPlan();
  plan.set_version(version);
  return plan;
}

// A balancer that restarted after committing v2 on node-b only finds v2 pending on node-a.
// Whether it was committed is known only to node-b: while node-b is unknown (not registered
// again, or its state not read), v2 stays pending on node-a, past the recovery grace; then
// it is committed there, as on node-b. (Aborted, node-a's ranks would run the steps from v2's
// effective step under v1, node-b's under v2.) Once the registration grace is over, a daemon
// still unknown no longer holds it back.
TEST(BalancerServerTest, AnOrphanPlanIsNotAbortedWhileADaemonThatMayHaveCommittedItIsUnknown) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlanAs(2));
  a.SetPending(FirstPlanAs(2));
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  options.registration_grace = absl::Hours(1);
  {
    Balancer balancer(options, std::make_shared<prometheus::Registry>());
    Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
    for (int i = 0; i < 3; ++i) balancer.Tick();  // node-b has not registered.
    EXPECT_TRUE(a.aborted().empty());
    b.SetStateUnavailable(true);
    Register(balancer, DaemonRegistration(b, "node-b", 2, 0, "host"));
    for (int i = 0; i < 3; ++i) balancer.Tick();  // node-b's state cannot be read.
    EXPECT_TRUE(a.aborted().empty());
    EXPECT_TRUE(a.commits().empty());
    b.SetStateUnavailable(false);
    for (int i = 0; i < 5 && a.commits().empty(); ++i) balancer.Tick();
    EXPECT_EQ(a.commits(), std::vector<uint64_t>{2});
    EXPECT_TRUE(a.aborted().empty());
  }
  // The registration grace over, a plan committed on no daemon known is aborted.
  FakeDaemon c("node-c", FirstPlan());
  c.SetPending(FirstPlanAs(2));
  options.registration_grace = absl::ZeroDuration();
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(c, "node-c", 0, 0, "host"));
  balancer.Tick();
  EXPECT_EQ(c.aborted(), std::vector<uint64_t>{2});
  EXPECT_TRUE(c.commits().empty());
}

// node-b drained under v2 (which excludes its ranks); the balancer prepared the undrain v3 on
// both nodes, and died after node-b's Commit. A restarted balancer that hears from node-a
// alone (v2 committed, v3 pending) does not abort v3 past the recovery grace: node-b, whose
// ranks v2 excludes, may hold it committed (it does). Once node-b registers, v3 is committed
// on node-a, and node-b, registered while the balancer held v2, is not kept drained by it:
// v3 takes its ranks back, and no plan drains it again.
TEST(BalancerServerTest, AnUndrainCommittedOnTheDrainedNodeAloneSurvivesARestart) {
  FakeDaemon a("node-a", PlanWithoutNodeB()), b("node-b", FirstPlanAs(3));
  a.SetPending(FirstPlanAs(3));
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  options.registration_grace = absl::Hours(1);
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
  for (int i = 0; i < 3; ++i) balancer.Tick();  // node-b has not registered.
  EXPECT_TRUE(a.aborted().empty());
  ASSERT_TRUE(balancer.CurrentPlan().has_value());
  EXPECT_EQ(balancer.CurrentPlan()->version, 2u);
  Register(balancer, DaemonRegistration(b, "node-b", 2, 0, "host"));
  for (int i = 0; i < 6; ++i) balancer.Tick();
  EXPECT_EQ(a.commits(), std::vector<uint64_t>{3});
  EXPECT_TRUE(a.aborted().empty());
  ASSERT_TRUE(balancer.CurrentPlan().has_value());
  EXPECT_EQ(balancer.CurrentPlan()->version, 3u);
  EXPECT_TRUE(balancer.CurrentPlan()->excluded_ranks.empty());
  for (const v1::PrepareRequest& p : b.prepares()) {
    EXPECT_LE(p.plan().version(), 3u) << "node-b drained again by plan v" << p.plan().version();
  }
}

// A daemon holding a plan version past the highest a plan takes (2^64 - 1, which ubepd now
// refuses; a daemon of another build, or a bad caller): recovery aborts it, and the next plan
// is numbered from the versions below the cap (counted, it wrapped to 0, which every daemon
// refused, and no plan was ever committed again).
TEST(BalancerServerTest, AVersionPastTheHighestAPlanTakesDoesNotNumberTheNextPlan) {
  FakeDaemon a("node-a", FirstPlan());
  a.SetPending(FirstPlanAs(UINT64_MAX));
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  options.registration_grace = absl::ZeroDuration();
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
  // (The pending plan is the first of a.prepares(); the plan for the ranks node-a hosts, ranks
  // 2 and 3 having no daemon, comes next.)
  for (int i = 0; i < 10 && a.prepares().size() < 2; ++i) balancer.Tick();
  EXPECT_EQ(a.aborted(), std::vector<uint64_t>{UINT64_MAX});
  ASSERT_GE(a.prepares().size(), 2u);
  for (size_t i = 1; i < a.prepares().size(); ++i) {
    EXPECT_EQ(a.prepares()[i].plan().version(), 2u);
  }
}

// node-b does not answer Prepare within --rpc_timeout (its weight copies take longer): the plan
// is aborted, and the reason says which flags give a plan's copies more time.
TEST(BalancerServerTest, APrepareThatOutlastsTheTimeoutIsAbortedSayingWhatToRaise) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  BalancerOptions options = QuickToMarkDown();
  // 2 s: every RPC of the balancer has it (the ticks' health checks and GetStates too), and
  // node-a's answers must come inside it on a loaded machine.
  options.rpc_timeout = absl::Seconds(2);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
  b.HoldPrepares(true);
  v1::RebalanceResponse response;
  const grpc::Status aborted = Drain(*balancer, "node-b", true, &response);
  b.HoldPrepares(false);
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(aborted.error_message(),
            "plan v2 aborted: node-b: no answer to Prepare within --rpc_timeout (2s); if its "
            "weight copies take longer, raise --rpc_timeout and --effective_margin "
            "(docs/operations.md, \"Large experts\"); the drain stays asked for: each interval "
            "tries it again (undrain cancels it)");
}

// Experts 4 and 5 live on node-b's ranks alone (v1: ranks 0, 1 hold experts 0-3, ranks 2, 3
// experts 4, 5) and the daemons take one changed slot per rank and layer (--free_buffers 1).
// Draining node-b, the plan for the members puts 4 and 5 on ranks 0 and 1 with one change
// each, within what the daemons take. (Planned afresh from round-robin, rank 1 changed four
// slots, and every daemon would refuse such a plan.) With a budget of none, the balancer says
// which --free_buffers the change needs.
TEST(BalancerServerTest, ADrainPlacesTheExpertsOnlyTheDrainedNodeHeldWithinTheFreeBuffers) {
  Plan first;
  first.version = 1;
  first.topology = {4, 2, 4, 1};
  first.num_experts = 6;
  for (int l = 0; l < 2; ++l) {
    LayerPlan layer;
    layer.slot_expert = {0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5};
    SetEqualShares(6, layer);
    first.layer_ids.push_back(l);
    first.layers.push_back(layer);
  }
  // A --migration_budget above the daemons' free buffers does not raise what they take.
  for (const auto [free_buffers, migration_budget] :
       std::vector<std::pair<int, int>>{{1, -1}, {0, -1}, {1, 4}, {0, 4}}) {
    SCOPED_TRACE(absl::StrCat(free_buffers, " free buffers, --migration_budget ", migration_budget));
    FakeDaemon a("node-a", ToProto(first, PlanEncoding::kFull)),
        b("node-b", ToProto(first, PlanEncoding::kFull));
    BalancerOptions options = NeverMarkedDown();
    options.migration_budget = migration_budget;
    Balancer balancer(options, std::make_shared<prometheus::Registry>());
    for (auto [d, name, rank] : {std::tuple{&a, "node-a", 0u}, std::tuple{&b, "node-b", 2u}}) {
      v1::RegisterRequest q = DaemonRegistration(*d, name, rank, 0, "host");
      q.set_free_buffers(free_buffers);
      Register(balancer, q);
    }
    balancer.Tick();
    v1::RebalanceResponse response;
    const grpc::Status status = Drain(balancer, "node-b", true, &response);
    if (free_buffers == 0) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
      EXPECT_EQ(status.error_message(),
                "the ranks left need 1 new experts on one rank in layer 0 (their only replicas "
                "were on the excluded ranks), but the daemons take 0 per rank and layer: "
                "restart them with ubepd --free_buffers 1 or more");
      EXPECT_TRUE(a.prepares().empty());
      continue;
    }
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(a.prepares().size(), 1u);
    absl::StatusOr<Plan> plan = FromProto(a.prepares()[0].plan());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->excluded_ranks, (std::vector<int>{2, 3}));
    EXPECT_EQ(a.committed_version(), 2u);
    for (int l = 0; l < 2; ++l) {
      std::set<int> held;
      for (int r = 0; r < 2; ++r) {
        int changed = 0;
        for (int i = 0; i < 4; ++i) {
          held.insert(plan->layers[l].slot_expert[r * 4 + i]);
          changed += plan->layers[l].slot_expert[r * 4 + i] != first.layers[l].slot_expert[r * 4 + i];
        }
        EXPECT_LE(changed, 1) << "layer " << l << " rank " << r;
      }
      EXPECT_EQ(held, (std::set<int>{0, 1, 2, 3, 4, 5})) << "layer " << l;
    }
  }
}

// The slots repaired for a drain count against the budget of the rank and layer they are in,
// not every layer's: layer 0's two experts held only by the drained ranks take the one free
// buffer of ranks 0 and 1 there, and layer 1, which needs no repair, still gets its one move
// (before, the largest repair of any layer was taken off every layer's budget, and layer 1,
// hot on rank 0, could only re-level its shares).
TEST(BalancerServerTest, RepairsForADrainTakeTheBudgetOfTheirLayerAlone) {
  Plan first;
  first.version = 1;
  first.topology = {4, 2, 4, 1};
  first.num_experts = 6;
  first.layer_ids = {0, 1};
  first.layers.resize(2);
  first.layers[0].slot_expert = {0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5};
  first.layers[1].slot_expert = {0, 1, 2, 3, 4, 5, 0, 1, 4, 5, 2, 3, 4, 5, 2, 3};
  for (LayerPlan& layer : first.layers) SetEqualShares(6, layer);
  ASSERT_TRUE(ValidatePlan(first).ok());
  LoadMatrix load(2, 6);
  load.set_layer_ids({0, 1});
  for (int e = 0; e < 6; ++e) load.at(0, e) = 100;
  for (int e = 0; e < 6; ++e) load.at(1, e) = e == 2 || e == 3 ? 1000 : 10;
  absl::StatusOr<Plan> plan = PlanForMembers(
      load, first, {2, 3}, {.policy = Policy::kUbep, .migration_budget = 1}, /*threads=*/1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->excluded_ranks, (std::vector<int>{2, 3}));
  int moved_in_layer1 = 0;
  for (int l = 0; l < 2; ++l) {
    for (int r = 0; r < 2; ++r) {
      int changed = 0;
      for (int i = 0; i < 4; ++i) {
        changed += plan->layers[l].slot_expert[r * 4 + i] != first.layers[l].slot_expert[r * 4 + i];
      }
      EXPECT_LE(changed, 1) << "layer " << l << " rank " << r;  // The daemons' budget.
      if (l == 1) moved_in_layer1 += changed;
    }
  }
  EXPECT_EQ(moved_in_layer1, 1) << "layer 1 got no move";
  // Layer 1's move put a hot expert on rank 1: ranks 0 and 1 now share 2 and 3's load.
  const std::vector<int>& after = plan->layers[1].slot_expert;
  EXPECT_TRUE(std::count(after.begin() + 4, after.begin() + 8, 2) +
                  std::count(after.begin() + 4, after.begin() + 8, 3) ==
              1);
}

// Drains node-b under plan v1: node-b refuses v2, which is aborted, and node-a's Abort is
// lost (v2 stays pending there) while node-a's state cannot be read.
void DrainAbortedWithNodeAsAbortLost(Balancer& balancer, FakeDaemon& a, FakeDaemon& b) {
  a.LoseAbortOf(2);
  a.SetStateUnavailable(true);
  b.Refuse(2);
  v1::RebalanceResponse response;
  const grpc::Status aborted = Drain(balancer, "node-b", true, &response);
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(aborted.error_message(),
            "plan v2 aborted: node-b: refused for the test; the drain stays asked for: each "
            "interval tries it again (undrain cancels it)");
}

// v2 is aborted (node-b refused it) and node-a's Abort is lost; node-a then fails its health
// checks and v3, excluding its ranks, is committed on node-b. When node-a is back, v2 is
// still pending there, below the cluster's v3: it is aborted as superseded, not committed (it
// was committed nowhere). (The balancer's memory of its aborts, which v3's commit clears up
// to v3, decides in AVersionThisBalancerAbortedIsAbortedAtOnce... below.)
TEST(BalancerServerTest, AVersionAbortedWhoseAbortWasLostIsAbortedWhereItIsStillPending) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  BalancerOptions options = QuickToMarkDown();
  options.recovery_grace = absl::ZeroDuration();
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);  // Learns v1.
  ASSERT_NO_FATAL_FAILURE(DrainAbortedWithNodeAsAbortLost(*balancer, a, b));
  v1::RebalanceResponse response;
  const grpc::Status undrained = Drain(*balancer, "node-b", false, &response);
  EXPECT_TRUE(undrained.ok()) << undrained.error_message();
  a.SetServing(false);
  TickUntilDown(*balancer, "node-a");
  for (int i = 0; i < 5 && b.committed_version() < 3; ++i) balancer->Tick();
  ASSERT_EQ(b.committed_version(), 3u);  // node-a's ranks excluded.
  a.SetServing(true);
  a.SetStateUnavailable(false);
  for (int i = 0; i < 100 && a.aborted().empty(); ++i) {
    balancer->Tick();
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(a.aborted(), std::vector<uint64_t>{2});
  const std::vector<uint64_t> commits = a.commits();
  EXPECT_EQ(std::count(commits.begin(), commits.end(), 2u), 0) << "v2 committed on node-a";
}

// v2 is aborted (node-b refused it) and node-a's Abort is lost. When node-a's state is read
// again, v2 pending there is above every plan held or committed, and the recovery grace (an
// hour) has not passed: only this balancer's memory of having aborted v2 can decide it, and
// it is aborted at once, not left pending (which would refuse every later Prepare there).
TEST(BalancerServerTest, AVersionThisBalancerAbortedIsAbortedAtOnceWhereItIsStillPending) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::Hours(1);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);  // Learns v1.
  ASSERT_NO_FATAL_FAILURE(DrainAbortedWithNodeAsAbortLost(*balancer, a, b));
  ASSERT_EQ(a.pending(), 2u);
  v1::RebalanceResponse response;
  ASSERT_TRUE(a.aborted().empty());
  const grpc::Status undrained = Drain(*balancer, "node-b", false, &response);
  ASSERT_TRUE(undrained.ok()) << undrained.error_message();
  EXPECT_EQ(response.version(), 1u);  // Nothing to change: nothing prepared.
  a.SetStateUnavailable(false);
  for (int i = 0; i < 3 && a.aborted().empty(); ++i) balancer->Tick();
  EXPECT_EQ(a.aborted(), std::vector<uint64_t>{2});
  EXPECT_TRUE(a.commits().empty());
  EXPECT_TRUE(b.commits().empty());
}

// A restarted balancer that did not know node-b's state (its GetState failing) numbered its
// own plan v2, as node-b held another v2 pending from the balancer before. Back, node-b is
// told to abort its v2, not to commit it: committed, its ranks would take that plan's
// placements for the cluster's v2 (PlanFingerprint tells the two apart).
TEST(BalancerServerTest, RecoveryCommitsAPendingPlanOnlyIfItIsThePlanCommittedUnderItsVersion) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  absl::StatusOr<Plan> swapped = FromProto(FirstPlanAs(2));
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  std::swap(swapped->layers[0].slot_expert[0], swapped->layers[0].slot_expert[1]);
  std::swap(swapped->layers[0].slot_share[0], swapped->layers[0].slot_share[1]);
  b.SetPending(ToProto(*swapped));
  b.SetStateUnavailable(true);
  b.SetServing(false);
  BalancerOptions options = QuickToMarkDown();
  options.recovery_grace = absl::ZeroDuration();
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
  TickUntilDown(*balancer, "node-b");
  for (int i = 0; i < 5 && a.committed_version() < 2; ++i) balancer->Tick();
  ASSERT_EQ(a.committed_version(), 2u);  // The cluster's v2: node-b's ranks excluded.
  b.SetStateUnavailable(false);
  b.SetServing(true);
  for (int i = 0; i < 100 && b.aborted().empty(); ++i) {
    balancer->Tick();
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(b.aborted(), std::vector<uint64_t>{2});
  EXPECT_TRUE(b.commits().empty());
}

// node-a has committed v2; node-c holds the same v2 pending (its Commit was lost); node-b holds
// another plan under v2. Recovery aborts node-b's and commits node-c's; node-c's Commit is
// lost again, and asked once more, node-c is told to commit, not to abort: aborting node-b's
// v2 is not aborting the version.
TEST(BalancerServerTest, AbortingAnotherPlanUnderTheHeldVersionAbortsNotThatVersion) {
  FakeDaemon a("node-a", FirstPlanAs(2)), b("node-b", FirstPlan()), c("node-c", FirstPlan());
  absl::StatusOr<Plan> swapped = FromProto(FirstPlanAs(2));
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  std::swap(swapped->layers[0].slot_expert[0], swapped->layers[0].slot_expert[1]);
  std::swap(swapped->layers[0].slot_share[0], swapped->layers[0].slot_share[1]);
  b.SetPending(ToProto(*swapped));
  c.SetPending(FirstPlanAs(2));
  c.LoseCommitOf(2);
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
  v1::RegisterRequest rb = DaemonRegistration(b, "node-b", 2, 0, "host");
  rb.clear_ranks();  // No rank: what it holds is node-b's alone.
  Register(balancer, rb);
  Register(balancer, DaemonRegistration(c, "node-c", 2, 0, "host"));
  for (int i = 0; i < 3; ++i) balancer.Tick();
  EXPECT_EQ(b.aborted(), std::vector<uint64_t>{2});
  EXPECT_TRUE(c.aborted().empty());
  EXPECT_EQ(c.commits(), std::vector<uint64_t>{2});
  EXPECT_EQ(c.committed_version(), 2u);
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
  EXPECT_EQ(cluster.plans_aborted(), 0u);
}

// node-b's Prepare of the drain's v2 outlasts --rpc_timeout; the balancer aborts v2, and the
// Abort reaches node-b before its Prepare is done (nothing pending yet: answered OK). The
// drain is undone and recovery reads node-b's state while its Prepare is still held (nothing
// pending), so the balancer has no reason to look again; the Prepare then lands and leaves
// v2 pending, which makes node-b refuse every later plan. The next drain's Prepare, refused
// for it, is what sends node-b through GetState again, and recovery aborts v2 there.
TEST(BalancerServerTest, APrepareThatLandsAfterItsAbortIsAbortedWhereItLeftThePlanPending) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  b.KeepPreparedPending(true);
  BalancerOptions options = QuickToMarkDown();
  // 2 s: every RPC of the balancer has it (the ticks' health checks and GetStates too), and
  // node-a's answers must come inside it on a loaded machine.
  options.rpc_timeout = absl::Seconds(2);
  options.recovery_grace = absl::ZeroDuration();
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
  b.HoldPrepares(true);
  v1::RebalanceResponse response;
  const grpc::Status timed_out = Drain(*balancer, "node-b", true, &response);
  EXPECT_EQ(timed_out.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(timed_out.error_message(),
            "plan v2 aborted: node-b: no answer to Prepare within --rpc_timeout (2s); if its "
            "weight copies take longer, raise --rpc_timeout and --effective_margin "
            "(docs/operations.md, \"Large experts\"); the drain stays asked for: each interval "
            "tries it again (undrain cancels it)");
  const grpc::Status undrained = Drain(*balancer, "node-b", false, &response);
  ASSERT_TRUE(undrained.ok()) << undrained.error_message();
  EXPECT_EQ(response.version(), 1u);
  for (int i = 0; i < 3; ++i) balancer->Tick();  // node-b's state read: nothing pending.
  // The Abort of v2 has reached node-b (with nothing there to abort) before its Prepare is let
  // go: the order this test is about, whatever the machine's load did to the Abort's delivery.
  // (An Abort that has not come in 30 s, long past its 2 s deadline, was dropped on the
  // way: there is then no order to set, and nothing to show.)
  if (!test::WaitFor(
          [&] {
            const std::vector<uint64_t> taken = b.abort_requests();
            return std::find(taken.begin(), taken.end(), 2u) != taken.end();
          },
          absl::Seconds(30))) {
    b.HoldPrepares(false);
    GTEST_SKIP() << "node-b never took the Abort of v2";
  }
  ASSERT_TRUE(b.aborted().empty());
  b.HoldPrepares(false);
  // The Prepare lands and leaves v2 pending.
  ASSERT_TRUE(test::WaitFor([&] { return b.pending() == 2; }, absl::Seconds(10)));
  for (int i = 0; i < 3; ++i) balancer->Tick();
  ASSERT_TRUE(b.aborted().empty()) << "recovery looked at node-b with no reason to";
  const grpc::Status refused = Drain(*balancer, "node-b", true, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(refused.error_message(),
            "plan v3 aborted: node-b: plan v2 is prepared and undecided; the drain stays asked "
            "for: each interval tries it again (undrain cancels it)");
  for (int i = 0; i < 20 && b.aborted().empty(); ++i) balancer->Tick();
  EXPECT_EQ(b.aborted(), std::vector<uint64_t>{2});
  // And the drain, still asked for, goes through.
  for (int i = 0; i < 20 && a.committed_version() < 4; ++i) balancer->Tick();
  EXPECT_EQ(a.committed_version(), 4u);
}

// A health service whose checks each wait at a Gathering of `expected`.
class GatheringHealth final : public grpc::health::v1::Health::Service {
 public:
  explicit GatheringHealth(int expected) : gathering_(expected) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~GatheringHealth() override { server_->Shutdown(std::chrono::system_clock::now()); }
  grpc::Status Check(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* response) override {
    gathering_.Arrive(context->deadline());
    response->set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int most() { return gathering_.most(); }

 private:
  Gathering gathering_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// The health checks of a tick go out at once: a daemon that does not answer costs the tick
// one timeout, not one per daemon (K blackholed machines made each tick K timeouts long).
TEST(BalancerServerTest, TheHealthChecksOfATickGoOutAtOnce) {
  GatheringHealth health(3);
  BalancerOptions options = NeverMarkedDown();
  options.health_interval = absl::Seconds(2);
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  for (uint32_t i = 0; i < 3; ++i) {
    v1::RegisterRequest q;
    q.set_node(absl::StrCat("node-", i));
    q.set_address(health.address());
    q.set_world_size(6);
    q.add_ranks(2 * i);
    q.add_ranks(2 * i + 1);
    q.set_backend("host");
    q.mutable_shape()->set_num_layers(2);
    q.mutable_shape()->set_num_experts(6);
    q.mutable_shape()->set_slots_per_rank(4);
    Register(balancer, q);
  }
  balancer.Tick();
  EXPECT_EQ(health.most(), 3);
}

// Recovery asks the daemons for their state at once, and sends each decision to its daemons at
// once: daemons that do not answer cost it one timeout, not one each.
TEST(BalancerServerTest, RecoveryAsksAndDecidesAtOnce) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  v1::Plan second = FirstPlan();
  second.set_version(2);
  a.SetPending(second);  // Left undecided by a balancer that died; committed nowhere.
  b.SetPending(second);
  Gathering asked(2), aborted(2);
  for (FakeDaemon* d : {&a, &b}) {
    d->GatherAt("GetState", &asked);
    d->GatherAt("Abort", &aborted);
  }
  BalancerOptions options = NeverMarkedDown();
  options.recovery_grace = absl::ZeroDuration();
  options.rpc_timeout = absl::Seconds(3);
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(options, a, b);
  EXPECT_EQ(asked.most(), 2);
  EXPECT_EQ(aborted.most(), 2);
  EXPECT_EQ(a.aborted(), std::vector<uint64_t>{2});
  EXPECT_EQ(b.aborted(), std::vector<uint64_t>{2});
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
  EXPECT_EQ(cluster.plans_aborted(), 1u);
}

// The daemons behind the cluster's plan catch up at once: Prepare to all, then Commit to all.
TEST(BalancerServerTest, DaemonsBehindCatchUpAtOnce) {
  FakeDaemon a("node-a", PlanWithoutNodeB()), b("node-b", FirstPlan()), c("node-c", FirstPlan());
  Gathering prepared(2), committed(2);
  for (FakeDaemon* d : {&b, &c}) {
    d->GatherAt("Prepare", &prepared);
    d->GatherAt("Commit", &committed);
  }
  BalancerOptions options = NeverMarkedDown();
  options.rpc_timeout = absl::Seconds(3);
  Balancer balancer(options, std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
  for (auto [d, node, rank] : {std::tuple{&b, "node-b", 2u}, std::tuple{&c, "node-c", 3u}}) {
    v1::RegisterRequest q = DaemonRegistration(*d, node, rank, 0, "host");
    q.clear_ranks();
    q.add_ranks(rank);  // Every rank of node-b and node-c is excluded from v2.
    Register(balancer, q);
  }
  balancer.Tick();  // Learns v2 from node-a; node-b and node-c catch up on it.
  EXPECT_EQ(prepared.most(), 2);
  EXPECT_EQ(committed.most(), 2);
  EXPECT_EQ(b.committed_version(), 2u);
  EXPECT_EQ(c.committed_version(), 2u);
}

// node-a (ranks 0, 1) and node-b (ranks 2, 3) registered by their processes a-1 and b-2;
// returns their registrations, to send again.
std::pair<v1::RegisterRequest, v1::RegisterRequest> RegisterProcesses(Balancer& balancer,
                                                                      FakeDaemon& a,
                                                                      FakeDaemon& b) {
  v1::RegisterRequest ra = DaemonRegistration(a, "node-a", 0, 0, "host");
  ra.set_incarnation("a-1");
  v1::RegisterRequest rb = DaemonRegistration(b, "node-b", 2, 0, "host");
  rb.set_incarnation("b-2");
  Register(balancer, ra);
  Register(balancer, rb);
  return {ra, rb};
}

// node-b's ubepd restarts (a new process at the same address registers) while the plan of a
// drain of node-a is being made: nothing is prepared (not on node-b's new process, whose state
// recovery has not read, nor anywhere), the version is not spent, and the drain stays asked
// for; the next interval plans again, with node-b recovered.
TEST(BalancerServerTest, ANodeThatRegistersAgainWhileAPlanIsMadeGetsNothingPreparedForItsPredecessor) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  auto [ra, rb] = RegisterProcesses(balancer, a, b);
  balancer.Tick();  // Learns v1.
  int plans_made = 0;
  balancer.set_after_planning_for_testing([&] {
    if (plans_made++ > 0) return;
    rb.set_incarnation("b-3");
    Register(balancer, rb);
  });
  v1::RebalanceResponse response;
  const grpc::Status drain = Drain(balancer, "node-a", true, &response);
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(drain.error_message(),
            "node node-b registered again or changed while plan v2 was made: nothing was "
            "prepared; the next interval plans again; the drain stays asked for: each interval "
            "tries it again (undrain cancels it)");
  EXPECT_TRUE(a.prepares().empty());
  EXPECT_TRUE(b.prepares().empty());
  EXPECT_EQ(balancer.CurrentPlan()->version, 1u);
}

// A balancer that restarted did not see node-b restart meanwhile (it registered as new);
// node-a, which maps the arenas of node-b's old process, says so when it registers. node-b is
// then kept out as a restarted node (drained: its peers may map its new arenas only while a
// plan excludes its ranks), once: after an undrain, the same word again changes nothing.
TEST(BalancerServerTest, ANodeAPeerSawRestartIsKeptOutAsARestartedOne) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  auto [ra, rb] = RegisterProcesses(balancer, a, b);
  // The registrant's own ranks say nothing of another node.
  ra.add_restarted_ranks(0);
  Register(balancer, ra);
  balancer.Tick();  // Learns v1, which keeps every rank.
  EXPECT_TRUE(DrainedNodes(balancer).empty());
  // node-a's word comes before the balancer has learned the plan (as it re-registers at once
  // after a restart of the balancer): taken at the next tick.
  Balancer restarted(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  Register(restarted, rb);
  ra.clear_restarted_ranks();
  ra.add_restarted_ranks(2);
  ra.add_restarted_ranks(3);
  Register(restarted, ra);
  EXPECT_TRUE(DrainedNodes(restarted).empty());  // No plan yet: nothing to keep the ranks out of.
  for (int i = 0; i < 5 && a.committed_version() < 2; ++i) restarted.Tick();
  EXPECT_EQ(DrainedNodes(restarted), (std::vector<std::string>{"node-b"}));
  ASSERT_EQ(a.committed_version(), 2u);  // A plan without node-b's ranks.
  const v1::Plan plan = a.prepares().back().plan();
  EXPECT_EQ(std::vector<uint32_t>(plan.excluded_ranks().begin(), plan.excluded_ranks().end()),
            (std::vector<uint32_t>{2, 3}));
  // The Prepare says node-b restarted: its new arenas hold none of v1's weights, so no daemon
  // of another domain reads them as a holder.
  auto restarted_in = [](const v1::PrepareRequest& q) {
    std::vector<std::string> nodes;
    for (const v1::PeerDaemon& d : q.daemons()) {
      if (d.restarted()) nodes.push_back(d.node());
    }
    return nodes;
  };
  EXPECT_EQ(restarted_in(a.prepares().back()), (std::vector<std::string>{"node-b"}));
  v1::RebalanceResponse response;
  const grpc::Status undrained = Drain(restarted, "node-b", false, &response);
  ASSERT_TRUE(undrained.ok()) << undrained.error_message();
  EXPECT_EQ(response.version(), 3u);
  EXPECT_TRUE(restarted_in(a.prepares().back()).empty());
  // The same word, late (and kept with node-a's registration): node-b's process was kept out
  // already.
  Register(restarted, ra);
  restarted.Tick();
  EXPECT_TRUE(DrainedNodes(restarted).empty());
  EXPECT_EQ(a.committed_version(), 3u);
}

// With node-a and node-b registered: learns v1, then drains node-a (v2 committed on node-b).
void DrainNodeA(Balancer& balancer, FakeDaemon& b) {
  balancer.Tick();  // Learns v1.
  v1::RebalanceResponse response;
  const grpc::Status drained = Drain(balancer, "node-a", true, &response);
  ASSERT_TRUE(drained.ok()) << drained.error_message();
  ASSERT_EQ(b.committed_version(), 2u);  // Without node-a's ranks.
}

// A peer's word that a node restarted does not keep that node out where no rank would be left
// serving (here the peer itself is drained): the node's ranks stay in, said once, and are kept
// out once the peer serves again.
TEST(BalancerServerTest, APeersWordThatWouldLeaveNoRankServingKeepsNoNodeOut) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  auto [ra, rb] = RegisterProcesses(balancer, a, b);
  ASSERT_NO_FATAL_FAILURE(DrainNodeA(balancer, b));
  v1::RebalanceResponse response;
  ra.add_restarted_ranks(2);
  ra.add_restarted_ranks(3);
  Register(balancer, ra);
  balancer.Tick();
  balancer.Tick();
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-a"}));
  EXPECT_EQ(b.committed_version(), 2u);
  EXPECT_EQ(b.prepares().size(), 1u);
  // node-a serves again: the plan taking its ranks back keeps node-b's out, as restarted.
  const grpc::Status undrained = Drain(balancer, "node-a", false, &response);
  ASSERT_TRUE(undrained.ok()) << undrained.error_message();
  for (int i = 0; i < 3; ++i) balancer.Tick();
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-b"}));
  const v1::Plan plan = a.prepares().back().plan();
  EXPECT_EQ(std::vector<uint32_t>(plan.excluded_ranks().begin(), plan.excluded_ranks().end()),
            (std::vector<uint32_t>{2, 3}));
}

// node-a drained by its operator, node-b's ubepd restarts: drained as a restarted node, it
// would leave no rank serving (every plan refused, "every rank is excluded", at every tick),
// so it stays in, as a drain of it would be refused; the plan in force stands.
TEST(BalancerServerTest, ARestartOfTheLastServingNodeLeavesItIn) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  auto [ra, rb] = RegisterProcesses(balancer, a, b);
  ASSERT_NO_FATAL_FAILURE(DrainNodeA(balancer, b));
  v1::RebalanceResponse response;
  rb.set_incarnation("b-3");  // A new ubepd process.
  Register(balancer, rb);
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-a"}));
  for (int i = 0; i < 3; ++i) balancer.Tick();
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-a"}));
  EXPECT_EQ(b.prepares().size(), 1u);  // No plan made (none could be, all ranks out).
  // Once node-a serves again, a restart of node-b drains it as before.
  const grpc::Status undrained = Drain(balancer, "node-a", false, &response);
  ASSERT_TRUE(undrained.ok()) << undrained.error_message();
  rb.set_incarnation("b-4");
  Register(balancer, rb);
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-b"}));
}

// node-b drained, then node-a down: every rank is out. A drain of node-b asked again cannot
// leave fewer ranks serving; it is answered as the plan goes (none can be made) and leaves
// node-b drained (a refusal used to undo the drain, and the next plan took node-b's ranks
// back, under maintenance).
TEST(BalancerServerTest, ADrainAskedAgainOfADrainedNodeLeavesItDrained) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  FakeDaemon b("node-b", FirstPlan());
  Balancer balancer(QuickToMarkDown(), std::make_shared<prometheus::Registry>());
  RegisterAndDrainNodeB(balancer, *a, b);
  ASSERT_EQ(b.committed_version(), 2u);
  a.reset();
  TickUntilDown(balancer, "node-a");
  v1::RebalanceResponse response;
  const grpc::Status again = Drain(balancer, "node-b", true, &response);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(again.error_message(), "every rank is excluded");
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-b"}));
  const size_t prepares = b.prepares().size();
  for (int i = 0; i < 3; ++i) balancer.Tick();
  EXPECT_EQ(DrainedNodes(balancer), (std::vector<std::string>{"node-b"}));
  EXPECT_EQ(b.prepares().size(), prepares);  // No plan takes ranks 2 and 3 back.
  EXPECT_EQ(b.committed_version(), 2u);
}

// A node down for good is forgotten on request (ubepctl forget), once the plan in force
// excludes its ranks: it is no longer listed nor counted, no plan changes, and a daemon
// registering under its name later is a new node (drained, as a restarted one).
TEST(BalancerServerTest, ADownNodeIsForgottenOnRequestOnceThePlanExcludesItsRanks) {
  auto a = std::make_unique<FakeDaemon>("node-a", FirstPlan());
  auto b = std::make_unique<FakeDaemon>("node-b", FirstPlan());
  auto registry = std::make_shared<prometheus::Registry>();
  Balancer balancer(QuickToMarkDown(), registry);
  Register(balancer, DaemonRegistration(*a, "node-a", 0, 0, "host"));
  Register(balancer, DaemonRegistration(*b, "node-b", 2, 0, "host"));
  balancer.Tick();  // Learns v1.
  auto forget = [&](const std::string& node, v1::ForgetResponse* response) {
    v1::ForgetRequest request;
    request.set_node(node);
    return balancer.Forget(nullptr, &request, response);
  };
  auto gauge = [&](const std::string& name) {
    for (const prometheus::MetricFamily& f : registry->Collect()) {
      if (f.name == name) return f.metric.at(0).gauge.value;
    }
    return -1.0;
  };
  v1::ForgetResponse response;
  grpc::Status status = forget("node-z", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "node \"node-z\" is not registered");
  status = forget("node-b", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "node node-b passes its health checks; only a node that is down can be forgotten "
            "(stop its daemon first)");
  // node-b goes down; node-a refuses the plan without its ranks, so v1 keeps them.
  a->Refuse(2);
  b.reset();
  TickUntilDown(balancer, "node-b");
  ASSERT_EQ(a->committed_version(), 1u);
  status = forget("node-b", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(status.error_message(),
            "node node-b is down, but plan v1 still has its ranks 2, 3; it can be forgotten once "
            "a plan without them is committed");
  a->Refuse(0);
  for (int i = 0; i < 50 && a->committed_version() == 1; ++i) {
    balancer.Tick();
    absl::SleepFor(absl::Milliseconds(20));
  }
  const uint64_t version = a->committed_version();
  ASSERT_GT(version, 1u);
  EXPECT_EQ(gauge("ubep_balancer_registered_daemons"), 2);
  EXPECT_EQ(gauge("ubep_balancer_healthy_daemons"), 1);
  status = forget("node-b", &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(std::vector<uint32_t>(response.ranks().begin(), response.ranks().end()),
            (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(response.plan_version(), version);
  EXPECT_EQ(gauge("ubep_balancer_registered_daemons"), 1);
  EXPECT_EQ(gauge("ubep_balancer_healthy_daemons"), 1);
  EXPECT_EQ(gauge("ubep_balancer_registered_ranks"), 2);
  const size_t prepares = a->prepares().size();
  balancer.Tick();
  EXPECT_EQ(a->prepares().size(), prepares);  // No plan changes.
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
  ASSERT_EQ(cluster.nodes_size(), 1);
  EXPECT_EQ(cluster.nodes(0).node(), "node-a");
  EXPECT_EQ(std::vector<uint32_t>(cluster.excluded_ranks().begin(), cluster.excluded_ranks().end()),
            (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(StatusOf(forget("node-b", &response)), "NOT_FOUND: node \"node-b\" is not registered");
  // A daemon registering as node-b again: a new node, its ranks out until it is undrained.
  FakeDaemon back("node-b", FirstPlan());
  Register(balancer, DaemonRegistration(back, "node-b", 2, 0, "host"));
  v1::ClusterStatus again;
  ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &again).ok());
  ASSERT_EQ(again.nodes_size(), 2);
  EXPECT_EQ(again.nodes(1).node(), "node-b");
  EXPECT_TRUE(again.nodes(1).drained());
  EXPECT_EQ(again.excluded_ranks_size(), 2);
}

// A plan waits for every daemon of the group: one that registered without its group (no
// client attached yet, or not registered again after a restart of the balancer) would not get
// it.
TEST(BalancerServerTest, APlanWaitsForEveryRankOfTheGroupToHaveItsDaemon) {
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  Balancer balancer(NeverMarkedDown(), std::make_shared<prometheus::Registry>());
  Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
  v1::RegisterRequest no_group = DaemonRegistration(b, "node-b", 2, 0, "host");
  no_group.clear_ranks();
  no_group.clear_shape();
  Register(balancer, no_group);
  balancer.Tick();  // Learns v1 from node-a.
  v1::RebalanceResponse response;
  grpc::Status status = balancer.Rebalance(nullptr, nullptr, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(status.error_message(),
            "ranks 2, 3 of the group have no registered daemon; a plan waits for every daemon "
            "of the group to register");
  EXPECT_TRUE(a.prepares().empty());
  Register(balancer, DaemonRegistration(b, "node-b", 2, 0, "host"));
  balancer.Tick();
  status = balancer.Rebalance(nullptr, nullptr, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// With a daemon registered without its group, ranks of the plan no daemon lists may be its:
// they wait however long. With none, ranks missing for the registration grace are down (a
// node that died while the balancer was down never registers again): a plan excludes them,
// and their daemon, if it comes back, is kept drained until it is undrained.
TEST(BalancerServerTest, RanksNoDaemonRegistersForTheGraceAreExcluded) {
  for (const bool groupless : {true, false}) {
    SCOPED_TRACE(groupless ? "a daemon without its group" : "no daemon without its group");
    FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
    BalancerOptions options = NeverMarkedDown();
    options.registration_grace = absl::ZeroDuration();
    Balancer balancer(options, std::make_shared<prometheus::Registry>());
    Register(balancer, DaemonRegistration(a, "node-a", 0, 0, "host"));
    if (groupless) {
      v1::RegisterRequest no_group = DaemonRegistration(b, "node-b", 2, 0, "host");
      no_group.clear_ranks();
      no_group.clear_shape();
      Register(balancer, no_group);
    }
    balancer.Tick();
    balancer.Tick();
    if (groupless) {
      EXPECT_TRUE(a.prepares().empty());
      continue;
    }
    const std::vector<v1::PrepareRequest> prepares = a.prepares();
    ASSERT_EQ(prepares.size(), 1u);
    EXPECT_EQ(a.committed_version(), 2u);
    EXPECT_EQ(std::vector<uint32_t>(prepares[0].plan().excluded_ranks().begin(),
                                    prepares[0].plan().excluded_ranks().end()),
              (std::vector<uint32_t>{2, 3}));
    Register(balancer, DaemonRegistration(b, "node-b", 2, 0, "host"));
    balancer.Tick();  // node-b catches up on v2, drained.
    EXPECT_EQ(b.committed_version(), 2u);
    EXPECT_EQ(a.prepares().size(), 1u);
    v1::ClusterStatus cluster;
    ASSERT_TRUE(balancer.GetStatus(nullptr, nullptr, &cluster).ok());
    ASSERT_EQ(cluster.nodes_size(), 2);
    EXPECT_TRUE(cluster.nodes(1).drained());
  }
}

// Registrations and load reports from the wire, mutated at random (tests/unit/proto_mutate.h;
// fixed seed) around node-a's and node-b's own, while the balancer ticks: each is taken or
// refused with a code and a message, never a crash (the suite runs under AddressSanitizer and
// UBSan). Afterwards both daemons register as they are and their reports are taken again.
TEST(BalancerServerTest, RegistrationsAndReportsFromTheWireAreTakenOrRefused) {
  constexpr int kIterations = 3000;
  FakeDaemon a("node-a", FirstPlan()), b("node-b", FirstPlan());
  std::unique_ptr<Balancer> balancer = WithTwoDaemons(NeverMarkedDown(), a, b);
  std::mt19937_64 rng(5);
  std::map<grpc::StatusCode, int> refused;
  std::array<uint64_t, 2> seq = {0, 0};
  uint64_t step = 0, version = 1;
  int taken = 0;
  for (int i = 0; i < kIterations; ++i) {
    const int n = i % 2;
    const std::string node = n == 0 ? "node-a" : "node-b";
    grpc::Status status;
    if (rng() % 10 == 0) {
      v1::RegisterRequest q = DaemonRegistration(n == 0 ? a : b, node, 2 * n, 0, "host");
      const std::string address = q.address();
      for (int k = 1 + rng() % 3; k > 0; --k) test::Mutate(&q, rng);
      // The address stays the fake's (or empty, which is refused): one mutated into a name
      // ("x") would be looked up in DNS, and traffic stays on loopback; and the balancer would
      // replace the node's gRPC channel at every such registration, a churn of gRPC's own
      // threads that ThreadSanitizer reports inside the uninstrumented library (libupb).
      if (!q.address().empty()) q.set_address(address);
      v1::RegisterResponse response;
      status = balancer->Register(nullptr, &q, &response);
    } else {
      // Under the plan in force, from the step the group (re)formed at: the report reaches
      // the checks past the plan's.
      v1::ReportLoadRequest q = ReportOf(node, n, ++seq[n], step, step + 10, version, 5);
      q.set_plan_effective_step(0);
      for (v1::LayerLoad& layer : *q.mutable_load()->mutable_layers()) {
        layer.add_dispatches(10);
        layer.add_dispatches(10);
      }
      for (int k = 1 + rng() % 3; k > 0; --k) test::Mutate(&q, rng);
      v1::ReportLoadResponse response;
      status = balancer->ReportLoad(nullptr, &q, &response);
      // The balancer keeps a report's seq once the seq itself passed (whatever is refused
      // after): the next report goes on from it, as its daemon's would.
      const std::string why(status.error_message());
      if (q.node() == node && why.find(" seq ") == std::string::npos &&
          why.find("is not registered") == std::string::npos) {
        seq[n] = std::max(seq[n], q.seq());
      }
    }
    if (status.ok()) {
      ++taken;
    } else {
      ++refused[status.error_code()];
      EXPECT_FALSE(status.error_message().empty()) << "iteration " << i;
    }
    if (n == 1) step += 10;
    if (i % 50 == 49) {
      balancer->Tick();
      v1::ClusterStatus cluster;
      ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
      version = cluster.plan_version();
    }
  }
  // Refused as the caller's doing (a bad or out-of-place request, an unknown node, a name
  // another daemon holds, a report of another plan), never as the balancer's failure.
  for (const auto& [code, count] : refused) {
    EXPECT_TRUE(code == grpc::StatusCode::INVALID_ARGUMENT ||
                code == grpc::StatusCode::NOT_FOUND ||
                code == grpc::StatusCode::ALREADY_EXISTS ||
                code == grpc::StatusCode::FAILED_PRECONDITION)
        << "code " << code << " x " << count;
  }
  EXPECT_GT(taken, kIterations / 50);
  // Nodes registered under a mutated name that hold ranks (from a fake's address) let them go,
  // as a daemon started again without a group does: a healthy holder keeps its ranks.
  for (const BalancerStatus::Node& held : balancer->Status().nodes) {
    if (held.name == "node-a" || held.name == "node-b" || held.ranks.empty()) continue;
    v1::RegisterRequest q;
    q.set_node(held.name);
    q.set_address(held.address);
    q.set_incarnation("let-go");
    Register(*balancer, q);
  }
  // Both daemons, started again (new incarnations), register and report under the plan in
  // force: taken (their seqs start over).
  for (const std::string node : {"node-a", "node-b"}) {
    const int n = node == "node-a" ? 0 : 1;
    v1::RegisterRequest q = DaemonRegistration(n == 0 ? a : b, node, 2 * n, 0, "host");
    q.set_incarnation("after-the-fuzz");
    Register(*balancer, q);
  }
  balancer->Tick();
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer->GetStatus(nullptr, nullptr, &cluster).ok());
  for (int n = 0; n < 2; ++n) {
    // (In force from step 0 on its ranks, as a daemon whose group formed anew says.)
    v1::ReportLoadRequest q = ReportOf(n == 0 ? "node-a" : "node-b", n, 1, step, step + 10,
                                       cluster.plan_version(), 1);
    q.set_plan_effective_step(0);
    v1::ReportLoadResponse response;
    const grpc::Status status = balancer->ReportLoad(nullptr, &q, &response);
    EXPECT_TRUE(status.ok()) << status.error_message() << "\n" << cluster.ShortDebugString();
  }
}

// A group whose calls reach only layer 0 (every step dropped there, over a receive capacity):
// node-a and node-b under v1 (FirstPlan), the balancer ticked by hand.
class UnreachedLayerTest : public ::testing::Test {
 protected:
  UnreachedLayerTest()
      : a_("node-a", FirstPlan()), b_("node-b", FirstPlan()), c_("node-c", FirstPlan()) {}

  // The shape's top_k and max_tokens, registered by both nodes (0: not given).
  uint32_t top_k_ = 0, max_tokens_ = 0;
  // Every report's calls over a capacity of an interval its daemon did not report.
  uint64_t over_capacity_before_ = 0;

  // threshold 1.2; a plan is judged after `trigger_windows` intervals above it. `idle_node`:
  // a third daemon registers too, hosting no rank (no client attached to it).
  // `health_failures`: failed health checks in a row that mark a daemon down. `report_interval`
  // (where not zero): the daemons' and the intervals' both, a node's last rate stale after
  // window_intervals of them without a report.
  void Start(int trigger_windows, bool idle_node = false, int health_failures = 1000,
             absl::Duration report_interval = absl::ZeroDuration()) {
    BalancerOptions options = NeverMarkedDown();
    options.health_failures = health_failures;
    if (report_interval > absl::ZeroDuration()) {
      options.interval = report_interval;
      options.report_interval = report_interval;
    }
    options.threshold = 1.2;
    options.trigger_windows = trigger_windows;
    options.min_intervals = 1;
    balancer_ = std::make_unique<Balancer>(options, registry_);
    v1::RegisterResponse registered;
    v1::RegisterRequest ra = DaemonRegistration(a_, "node-a", 0, 0, "host");
    v1::RegisterRequest rb = DaemonRegistration(b_, "node-b", 2, 0, "host");
    for (v1::RegisterRequest* r : {&ra, &rb}) {
      r->mutable_shape()->set_top_k(top_k_);
      r->mutable_shape()->set_max_tokens(max_tokens_);
    }
    ASSERT_TRUE(balancer_->Register(nullptr, &ra, &registered).ok());
    ASSERT_TRUE(balancer_->Register(nullptr, &rb, &registered).ok());
    if (idle_node) {
      v1::RegisterRequest rc = DaemonRegistration(c_, "node-c", 0, 0, "host");
      rc.clear_ranks();
      rc.clear_shape();
      const grpc::Status status = balancer_->Register(nullptr, &rc, &registered);
      ASSERT_TRUE(status.ok()) << status.error_message();
    }
    balancer_->Tick();  // Learns v1 from the daemons.
  }

  // One interval: each node reports 10 dispatches per rank of layer 0, whose ranks received
  // `rank_load` pairs (in each rank's first slot); of layer 1, `layer1` pairs per rank in 10
  // dispatches, or no dispatch (0); `over_capacity` calls failed over a receive capacity; and
  // whether the plan was in force on all its ranks when it sent the report. Then the interval
  // closes.
  void Interval(const std::array<uint64_t, 4>& rank_load, uint64_t over_capacity,
                uint64_t layer1 = 0, bool plan_in_force = true) {
    ++seq_;
    for (int n = 0; n < 2; ++n) {
      v1::ReportLoadRequest q = IntervalReport(n, rank_load, over_capacity, layer1, plan_in_force);
      v1::ReportLoadResponse response;
      const grpc::Status status = balancer_->ReportLoad(nullptr, &q, &response);
      ASSERT_TRUE(status.ok()) << status.error_message();
      if (n == 0 && send_a_twice_) {
        // As a daemon whose answer was lost sends it again: the same, at the step it is at.
        q.set_max_step(q.max_step() + 2);
        const grpc::Status again = balancer_->ReportLoad(nullptr, &q, &response);
        ASSERT_TRUE(again.ok()) << again.error_message();
      }
    }
    step_ += 10;
    balancer_->Tick();
  }

  // Node n's report of the interval from step_ (Interval).
  v1::ReportLoadRequest IntervalReport(int n, const std::array<uint64_t, 4>& rank_load,
                                       uint64_t over_capacity, uint64_t layer1,
                                       bool plan_in_force) const {
    v1::ReportLoadRequest q =
        ReportOf(n == 0 ? "node-a" : "node-b", n, seq_, step_, step_ + 10, version_, 0);
    q.set_plan_in_force(plan_in_force);
    q.set_over_capacity_calls(over_capacity);
    q.set_over_capacity_calls_before(over_capacity_before_);
    for (int l = 0; l < 2; ++l) {
      v1::LayerLoad* layer = q.mutable_load()->mutable_layers(l);
      for (int p = 0; p < 8; p += 4) layer->set_slot(p, l == 0 ? rank_load[2 * n + p / 4] : layer1);
      for (int r = 0; r < 2; ++r) layer->add_dispatches(l == 0 || layer1 > 0 ? 10 : 0);
    }
    return q;
  }

  // `q` is refused as INVALID_ARGUMENT with `message`.
  void ExpectRefused(const v1::ReportLoadRequest& q, const std::string& message) {
    v1::ReportLoadResponse response;
    const grpc::Status status = balancer_->ReportLoad(nullptr, &q, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_EQ(status.error_message(), message);
  }

  // The reports are counted under the plan node-a prepared last, from its effective step.
  void SwitchToThePlanPrepared() {
    ASSERT_FALSE(a_.prepares().empty());
    version_ = a_.prepares().back().plan().version();
    step_ = std::max(step_, a_.prepares().back().effective_step());
  }

  // The value of a sample of ubep_balancer_* in the registry (a histogram's count), if it is
  // there: the family's first, or the one whose label `name` is `value`.
  std::optional<double> Sample(const std::string& family, const std::string& value = "",
                               const std::string& name = "layer") {
    for (const prometheus::MetricFamily& f : registry_->Collect()) {
      if (f.name != family) continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        bool match = value.empty();
        for (const prometheus::ClientMetric::Label& label : m.label) {
          match |= label.name == name && label.value == value;
        }
        if (!match) continue;
        switch (f.type) {
          case prometheus::MetricType::Counter: return m.counter.value;
          case prometheus::MetricType::Histogram:  // How many were observed.
            return static_cast<double>(m.histogram.sample_count);
          default: return m.gauge.value;
        }
      }
    }
    return std::nullopt;
  }

  FakeDaemon a_, b_, c_;
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  std::unique_ptr<Balancer> balancer_;
  uint64_t seq_ = 0;
  bool send_a_twice_ = false;  // Interval sends node-a's report twice, under one seq.
  uint64_t step_ = 0;     // The reports' first step.
  uint64_t version_ = 1;  // Of the plan the reports are counted under.
};

// A daemon that hosts no rank (registered before any client attached to it) reports no plan
// in force and is sent none; it must not hold back the plans of the group the others serve.
TEST_F(UnreachedLayerTest, ADaemonHostingNoRankDoesNotHoldBackPlans) {
  Start(/*trigger_windows=*/2, /*idle_node=*/true);
  for (int i = 0; i < 3; ++i) Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_EQ(a_.prepares().size(), 0u);  // The mean, 1.15, is under the threshold of 1.2.
  Interval({13, 10, 10, 7}, 0);
  Interval({13, 10, 10, 7}, 0);
  ASSERT_EQ(a_.prepares().size(), 1u);
  // node-c has no group, no arenas to prepare (ubepd would refuse: "no group is attached").
  EXPECT_EQ(c_.prepares().size(), 0u);
  // v2 is in force where ranks are (node-c never reports a plan in force): it is judged, and
  // planned for again (whether that changes the placement is the planner's business).
  EXPECT_EQ(Sample("ubep_balancer_plan_compute_seconds"), 1);
  SwitchToThePlanPrepared();
  for (int i = 0; i < 2; ++i) Interval({16, 10, 8, 6}, 0);
  EXPECT_EQ(Sample("ubep_balancer_plan_compute_seconds"), 2);
}

// The window sums layer 0 of `load` (over the experts).
double LayerSum(const LoadMatrix& load, int layer) {
  double sum = 0;
  for (int e = 0; e < load.num_experts(); ++e) sum += load.at(layer, e);
  return sum;
}

// node-b drained: its ranks run no step, and its reports say so (no step, no count). Its rate
// from before the drain is not its load: the window holds node-a's counts alone (node-b's
// last rate, kept, counted its experts' load twice for as long as the drain lasted).
TEST_F(UnreachedLayerTest, ADrainedNodesLastRateIsNotCountedAgain) {
  Start(/*trigger_windows=*/100);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  v1::RebalanceResponse drained;
  const grpc::Status status = Drain(*balancer_, "node-b", true, &drained);
  ASSERT_TRUE(status.ok()) << status.error_message();
  SwitchToThePlanPrepared();
  ASSERT_EQ(version_, 2u);
  for (int i = 0; i < 10; ++i) {  // A whole window (window_intervals 10).
    ++seq_;
    v1::ReportLoadResponse response;
    v1::ReportLoadRequest a = IntervalReport(0, {20, 20, 0, 0}, 0, /*layer1=*/10, true);
    ASSERT_TRUE(balancer_->ReportLoad(nullptr, &a, &response).ok());
    v1::ReportLoadRequest b = ReportOf("node-b", 1, seq_, step_, step_, version_, 0);
    b.set_plan_in_force(false);
    const grpc::Status taken = balancer_->ReportLoad(nullptr, &b, &response);
    ASSERT_TRUE(taken.ok()) << taken.error_message();
    step_ += 10;
    balancer_->Tick();
  }
  EXPECT_EQ(LayerSum(balancer_->WindowLoad(), 0), 10 * 40.0);
}

// A member without a rate (node-b, registered again by its process: its interval starts over)
// leaves the window as it was, rather than add an interval in which the experts only it hosts
// read as cold.
TEST_F(UnreachedLayerTest, AnIntervalWithoutEveryMembersRateIsNotAddedToTheWindow) {
  Start(/*trigger_windows=*/100);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  const double before = LayerSum(balancer_->WindowLoad(), 0);
  ASSERT_EQ(before, 40.0);
  v1::RegisterResponse registered;
  v1::RegisterRequest rb = DaemonRegistration(b_, "node-b", 2, 0, "host");
  ASSERT_TRUE(balancer_->Register(nullptr, &rb, &registered).ok());
  ++seq_;
  v1::ReportLoadResponse response;
  v1::ReportLoadRequest a = IntervalReport(0, {10, 10, 10, 10}, 0, /*layer1=*/10, true);
  ASSERT_TRUE(balancer_->ReportLoad(nullptr, &a, &response).ok());
  step_ += 10;
  balancer_->Tick();
  EXPECT_EQ(LayerSum(balancer_->WindowLoad(), 0), before);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  EXPECT_EQ(LayerSum(balancer_->WindowLoad(), 0), 2 * before);
}

// node-a is down (failing its health checks) while its ranks go on and it reports (no plan
// without its ranks could be made: both daemons refuse every Prepare): those reports count for
// nothing, and are let go of as each interval closes. Back, the intervals it closes hold only
// what it reported since, not the outage's skewed counts (weighed as one interval's).
TEST_F(UnreachedLayerTest, ADaemonBackFromDownCountsOnlyTheIntervalSinceItCameBack) {
  // (Two failed checks in a row: one slow check under a sanitizer marks no daemon down.)
  Start(/*trigger_windows=*/100, /*idle_node=*/false, /*health_failures=*/2);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), 1.0);
  a_.Refuse(FakeDaemon::kEveryVersion);
  b_.Refuse(FakeDaemon::kEveryVersion);
  a_.SetServing(false);
  TickUntilDown(*balancer_, "node-a");  // The plan without its ranks is refused.
  for (int i = 0; i < 3; ++i) Interval({100, 10, 10, 10}, 0, /*layer1=*/10);
  v1::ClusterStatus cluster;
  ASSERT_TRUE(balancer_->GetStatus(nullptr, nullptr, &cluster).ok());
  ASSERT_FALSE(cluster.nodes(0).healthy()) << cluster.ShortDebugString();
  // Nothing measured while its ranks' load is unknown (counted as none, it read 2.0). (No
  // series at all: the ticks that waited for node-a to be marked down closed a window of
  // intervals without a report, AWindowWithoutReportsLeavesNoMeasuredSeries.)
  const std::optional<double> during = Sample("ubep_balancer_imbalance_ratio", "0");
  EXPECT_EQ(during, std::nullopt);
  a_.SetServing(true);
  for (int i = 0; i < 500 && !cluster.nodes(0).healthy(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    balancer_->Tick();
    cluster.Clear();
    ASSERT_TRUE(balancer_->GetStatus(nullptr, nullptr, &cluster).ok());
  }
  ASSERT_TRUE(cluster.nodes(0).healthy()) << cluster.ShortDebugString();
  ASSERT_EQ(cluster.plan_version(), 1u);
  // The tick that found it healthy closed an interval with nothing reported in it: nothing
  // new was measured (with the outage's counts in it: 3.08, node-a's ranks 10 to 1).
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), during);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), 1.0);
}

// An idle cluster (no report) keeps the measured gauges for less than a window of intervals
// (a report and an interval's close drift in phase: a series that came and went would reset
// an alert's `for`), and has none once a whole window passed without one (an alert on the
// last value held would fire all night); the next report measures again.
TEST_F(UnreachedLayerTest, AWindowWithoutReportsLeavesNoMeasuredSeries) {
  Start(/*trigger_windows=*/100);
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_THAT(Sample("ubep_balancer_imbalance_ratio", "0"), Optional(DoubleNear(1.3, 1e-12)));
  for (int i = 1; i < BalancerOptions().window_intervals; ++i) balancer_->Tick();
  EXPECT_THAT(Sample("ubep_balancer_imbalance_ratio", "0"), Optional(DoubleNear(1.3, 1e-12)));
  balancer_->Tick();
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), std::nullopt);
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "1"), std::nullopt);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), 1.0);
}

// Likewise a window of intervals in which node-b reports and node-a (up, answering its health
// checks) does not, once node-a's last rate is stale: nothing can be measured without node-a's
// ranks, and the gauges do not hold 1.3 for as long as that lasts. (Intervals of 1 ms here,
// each waited out 20 ms: node-a's rate is stale from the first.)
TEST_F(UnreachedLayerTest, AWindowWithoutEveryMembersReportLeavesNoMeasuredSeries) {
  Start(/*trigger_windows=*/100, /*idle_node=*/false, /*health_failures=*/1000,
        /*report_interval=*/absl::Milliseconds(1));
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_THAT(Sample("ubep_balancer_imbalance_ratio", "0"), Optional(DoubleNear(1.3, 1e-12)));
  auto node_b_alone = [&] {
    absl::SleepFor(absl::Milliseconds(20));
    ++seq_;
    const v1::ReportLoadRequest q = IntervalReport(1, {10, 10, 10, 10}, 0, 10, true);
    v1::ReportLoadResponse response;
    const grpc::Status status = balancer_->ReportLoad(nullptr, &q, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    step_ += 10;
    balancer_->Tick();
  };
  for (int i = 1; i < BalancerOptions().window_intervals; ++i) node_b_alone();
  EXPECT_THAT(Sample("ubep_balancer_imbalance_ratio", "0"), Optional(DoubleNear(1.3, 1e-12)));
  node_b_alone();
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), std::nullopt);
  Interval({10, 10, 10, 10}, 0, /*layer1=*/10);
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "0"), 1.0);
}

// Layer 0 at 1.3 is above the threshold of 1.2; counting layer 1, which no call reached, as
// balanced (1.0) would put the mean at 1.15, below it, and no plan would ever come. Layer 1 is
// left out of the mean, and of the gauges, instead.
TEST_F(UnreachedLayerTest, ALayerNoCallReachedIsLeftOutOfTheMeanThatCallsForAPlan) {
  Start(/*trigger_windows=*/2);
  // The first interval teaches the balancer the nodes' step rates (StepRatesKnown), which
  // a plan's effective step needs; layer 1 is still reached then.
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_THAT(Sample("ubep_balancer_imbalance_ratio", "0"), Optional(DoubleNear(1.3, 1e-12)));
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "1"), 1.0);
  // From here no call reaches layer 1: its series goes, and GetStatus has NaN for it.
  Interval({13, 10, 10, 7}, 0);
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "1"), std::nullopt);
  const BalancerStatus status = balancer_->Status();
  ASSERT_EQ(status.measured_imbalance.size(), 2u);
  EXPECT_TRUE(std::isnan(status.measured_imbalance[1]));
  EXPECT_EQ(a_.prepares().size(), 0u);
  Interval({13, 10, 10, 7}, 0);  // The second interval in a row above the threshold.
  ASSERT_EQ(a_.prepares().size(), 1u);
  EXPECT_EQ(b_.prepares().size(), 1u);
  EXPECT_EQ(a_.prepares()[0].plan().version(), 2u);
}

// Once the plan in force has had calls over a receive capacity, the worst measured layer is
// judged instead of the mean: here the last layer is balanced (1.0), so the mean (1.15) stays
// below the threshold of 1.2 while layer 0, at 1.3, routes some rank more than its capacity.
// Under the next plan, without such calls, the mean rules again.
TEST_F(UnreachedLayerTest, CallsOverTheReceiveCapacityPutTheWorstLayerBeforeTheMean) {
  Start(/*trigger_windows=*/2);
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);  // Step rates.
  EXPECT_EQ(Sample("ubep_balancer_imbalance_ratio", "1"), 1.0);
  for (int i = 0; i < 3; ++i) Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_EQ(a_.prepares().size(), 0u);
  Interval({13, 10, 10, 7}, 3, /*layer1=*/10);
  EXPECT_EQ(a_.prepares().size(), 0u);  // One interval above: trigger_windows is 2.
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  ASSERT_EQ(a_.prepares().size(), 1u);
  EXPECT_EQ(b_.prepares().size(), 1u);
  EXPECT_EQ(Sample("ubep_balancer_over_capacity_calls_total"), 6);
  SwitchToThePlanPrepared();
  for (int i = 0; i < 5; ++i) Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_EQ(a_.prepares().size(), 1u);
}

// Calls over the capacity while every layer they reach is within the threshold: the capacity
// is below the balanced load, and no plan is made for it (the threshold still rules).
TEST_F(UnreachedLayerTest, CallsOverTheCapacityOfABalancedLayerCallForNoPlan) {
  Start(/*trigger_windows=*/2);
  for (int i = 0; i < 6; ++i) Interval({11, 10, 10, 9}, 3);
  EXPECT_EQ(a_.prepares().size(), 0u);
  EXPECT_EQ(Sample("ubep_balancer_over_capacity_calls_total"), 36);
}

// Calls a daemon reports before the plan is in force on all its ranks are counted, but they
// may be the previous plan's: they do not make the worst layer rule.
TEST_F(UnreachedLayerTest, CallsReportedBeforeThePlanIsInForceOnTheirRanksAreNotItsOwn) {
  Start(/*trigger_windows=*/2);
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);  // Step rates; v1 in force everywhere.
  for (int i = 0; i < 4; ++i) {
    Interval({13, 10, 10, 7}, 3, /*layer1=*/10, /*plan_in_force=*/false);
  }
  EXPECT_EQ(a_.prepares().size(), 0u);  // The mean, 1.15, is under the threshold of 1.2.
  EXPECT_EQ(Sample("ubep_balancer_over_capacity_calls_total"), 24);
}

// Calls over a capacity of an interval a daemon did not report (the plan before's, across a
// re-form) are counted, and do not make the worst layer rule for the plan in force (without
// them the mean, 1.15, is under the threshold of 1.2); a count of them that wrapped is refused.
TEST_F(UnreachedLayerTest, CallsOfAnIntervalNotReportedAreCountedButNotTheirPlans) {
  Start(/*trigger_windows=*/2);
  Interval({13, 10, 10, 7}, 0, /*layer1=*/10);  // Step rates; v1 in force everywhere.
  over_capacity_before_ = 3;
  for (int i = 0; i < 4; ++i) Interval({13, 10, 10, 7}, 0, /*layer1=*/10);
  EXPECT_EQ(a_.prepares().size(), 0u);
  EXPECT_EQ(Sample("ubep_balancer_over_capacity_calls_total"), 24);
  over_capacity_before_ = ~uint64_t{0} - 1;
  ++seq_;
  ExpectRefused(IntervalReport(0, {13, 10, 10, 7}, 0, 10, true),
                "over_capacity_calls_before: count -2 is negative");
  EXPECT_EQ(Sample("ubep_balancer_rejected_reports_total", "negative", "reason"), 1);
}

// A report sent again under its seq (its daemon got no answer, and cannot tell whether it
// was taken) is answered OK and taken once: its counts are added once (4 reports taken of
// 6 sent) and its dropped calls count once (6, not 9). A report under the last seq that says
// something else, under an earlier seq, or under seq 0, is refused.
TEST_F(UnreachedLayerTest, AReportSentAgainUnderItsSeqIsTakenOnce) {
  Start(/*trigger_windows=*/1);
  send_a_twice_ = true;
  Interval({10, 10, 10, 10}, /*over_capacity=*/3, /*layer1=*/10);
  Interval({10, 10, 10, 10}, /*over_capacity=*/0, /*layer1=*/10);
  EXPECT_EQ(Sample("ubep_balancer_reports_total"), 4);
  EXPECT_EQ(Sample("ubep_balancer_over_capacity_calls_total"), 6);
  v1::ReportLoadResponse response;
  // node-a's last report (seq 2, of the interval before step_) with one count more: a daemon
  // that numbered two reports alike.
  step_ -= 10;
  v1::ReportLoadRequest reused = IntervalReport(0, {10, 10, 10, 10}, 0, 10, true);
  step_ += 10;
  ASSERT_EQ(reused.seq(), 2u);
  reused.mutable_load()->mutable_layers(1)->set_slot(4, 11);
  ExpectRefused(reused,
                "report seq 2 of node node-a differs from the report taken under that seq (a "
                "report sent again must be the same; a new one takes the next seq)");
  EXPECT_EQ(Sample("ubep_balancer_rejected_reports_total", "seq_reused", "reason"), 1);
  EXPECT_EQ(Sample("ubep_balancer_reports_total"), 4);
  ExpectRefused(ReportOf("node-a", 0, 1, step_, step_ + 10, version_, 0),
                "report seq 1 of node node-a is before 2, the last one taken (reordered)");
  ExpectRefused(ReportOf("node-a", 0, 0, step_, step_ + 10, version_, 0),
                "report of node node-a has seq 0; a daemon numbers its reports from 1");
  // A seq more than 2^32 ahead of the last one taken is not its daemon's: taken, it would have
  // every later report refused as reordered. At 2^32 ahead it is taken, and the next is.
  ExpectRefused(ReportOf("node-a", 0, (uint64_t{1} << 32) + 3, step_, step_ + 10, version_, 0),
                "report seq 4294967299 of node node-a is more than 2^32 ahead of 2, the last "
                "one taken (a daemon numbers its reports one after another)");
  EXPECT_EQ(Sample("ubep_balancer_rejected_reports_total", "malformed", "reason"), 2);
  EXPECT_EQ(Sample("ubep_balancer_reports_total"), 4);
  for (const uint64_t seq : {(uint64_t{1} << 32) + 2, (uint64_t{1} << 32) + 3}) {
    const v1::ReportLoadRequest next = ReportOf("node-a", 0, seq, step_, step_ + 10, version_, 0);
    const grpc::Status status = balancer_->ReportLoad(nullptr, &next, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_EQ(Sample("ubep_balancer_reports_total"), 6);
}

// A count of calls over the receive capacity past int64's range is a delta that wrapped (new
// counters less old ones): refused as the per-slot counts are, its 1.8e19 calls counted
// nowhere.
TEST_F(UnreachedLayerTest, AnOverCapacityCountThatWrappedIsRefused) {
  Start(/*trigger_windows=*/1);
  Interval({10, 10, 10, 10}, /*over_capacity=*/3, /*layer1=*/10);
  ++seq_;
  ExpectRefused(IntervalReport(0, {10, 10, 10, 10}, ~uint64_t{0} - 4, 10, true),
                "over_capacity_calls: count -5 is negative");
  EXPECT_EQ(Sample("ubep_balancer_rejected_reports_total", "negative", "reason"), 1);
  EXPECT_EQ(Sample("ubep_balancer_over_capacity_calls_total"), 6);
}

// Counts no data plane can make are refused: with top-2 and 5 tokens over 4 ranks a rank
// receives at most 4 x 5 x 2 = 40 pairs a dispatch call. 400 in 10 calls is taken, 401 is
// not; nor are counts whose sum passes 2^64 (each below 2^63, so none is "negative").
TEST_F(UnreachedLayerTest, CountsNoDataPlaneCanMakeAreRefused) {
  top_k_ = 2;
  max_tokens_ = 5;
  Start(/*trigger_windows=*/1);
  Interval({400, 400, 400, 400}, /*over_capacity=*/0, /*layer1=*/10);
  EXPECT_EQ(Sample("ubep_balancer_reports_total"), 2);
  ++seq_;
  ExpectRefused(IntervalReport(1, {400, 400, 400, 401}, 0, 10, true),
                "load.layers[0]: rank 3 received 401 pairs in 10 dispatch calls, over the 40 a "
                "call can bring it (world 4 x max_tokens 5 x min(top_k 2, slots_per_rank 4))");
  v1::ReportLoadRequest huge = IntervalReport(0, {400, 400, 400, 400}, 0, 10, true);
  for (int p = 4; p < 8; ++p) {
    huge.mutable_load()->mutable_layers(1)->set_slot(p, (uint64_t{1} << 63) - 1);
  }
  ExpectRefused(huge,
                "load.layers[1]: rank 1 received 2^64 or more pairs in 10 dispatch calls, over "
                "the 40 a call can bring it (world 4 x max_tokens 5 x min(top_k 2, "
                "slots_per_rank 4))");
  EXPECT_EQ(Sample("ubep_balancer_rejected_reports_total", "implausible", "reason"), 2);
  EXPECT_EQ(Sample("ubep_balancer_reports_total"), 2);
}

}  // namespace
}  // namespace ubep::balancer
