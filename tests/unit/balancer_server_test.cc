// The balancer's state machine in process: the load window, and Register / ReportLoad from
// many threads while the loop ticks (run under TSan: label concurrent). The end-to-end
// behaviour with real daemons is tests/integration/balancer_test.cc.
#include <atomic>
#include <thread>

#include "balancer/core/plan.h"
#include "balancer/server/balancer.h"
#include "balancer/server/load_window.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"

namespace ubep::balancer {
namespace {

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

TEST(LoadWindowTest, EwmaWeighsTheNewestInterval) {
  LoadWindow window(2, 3, 1, /*ewma_alpha=*/0.25);
  window.Add(Filled(4));
  window.Close();
  EXPECT_EQ(window.Current().at(0, 0), 4);  // The first interval seeds the average.
  window.Add(Filled(8));
  window.Close();
  EXPECT_EQ(window.Current().at(0, 0), 0.25 * 8 + 0.75 * 4);
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

TEST(BalancerServerTest, RegistrationsAndReportsRaceTheLoopSafely) {
  BalancerOptions options;
  options.interval = absl::Milliseconds(5);
  options.health_interval = absl::Milliseconds(5);
  options.rpc_timeout = absl::Milliseconds(50);
  options.health_failures = 1000;
  auto registry = std::make_shared<prometheus::Registry>();
  Balancer balancer(options, registry);
  balancer.Start();
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
        v1::ReportLoadResponse response;
        // The balancer never learns a plan here (no daemon answers GetState): every report
        // is refused with no_plan, after its steps were recorded.
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
            "node b serves 4 ranks x 2 slots, 2 layers x 8 experts; the cluster has 4 x 2, 2 x 6");
  other = Registration("b", 2);
  other.set_ranks(1, 9);
  EXPECT_EQ(balancer.Register(nullptr, &other, &response).error_message(), "rank 9 is outside [0, 4)");
}

}  // namespace
}  // namespace ubep::balancer
