// Structured random mutation of ubepd's inputs from the wire, fed to its Node: attach
// requests (a client's model shape and rank) and plans a balancer prepares (v1::Plan through
// FromProto, as DaemonControl.Prepare takes them). Nothing may crash, read out of bounds or
// leak (the suite runs under AddressSanitizer and UBSan); an attach is refused with a status
// or given arenas within --max_arena_bytes; a plan is prepared (and then aborted) or refused
// with its reason, and the node's plan state is as before; and it still takes a good plan
// after them all, whatever versions they were aborted under. Fixed seeds: the same inputs every
// run.
#include <sys/stat.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>

#include "balancer/core/plan.h"
#include "balancer/formats/proto_convert.h"
#include "common/shape_limits.h"
#include "daemon/node.h"
#include "gtest/gtest.h"
#include "tests/unit/node_fixtures.h"
#include "tests/unit/proto_mutate.h"

namespace ubep::daemon {
namespace {

constexpr uint64_t kMaxArenaBytes = uint64_t{1} << 20;

NodeOptions Options() {
  NodeOptions o;
  o.fd_socket_path = "/unused";
  o.max_arena_bytes = kMaxArenaBytes;
  return o;
}

TEST(NodeFuzzTest, AttachRequestsAreRefusedOrGivenArenasWithinTheBound) {
  constexpr int kIterations = 3000;
  std::mt19937_64 rng(3);
  int accepted = 0;
  std::map<absl::StatusCode, int> refusals;
  for (int i = 0; i < kIterations; ++i) {
    v1::AttachRequest q = Request(0, 2);
    const int mutations = 1 + rng() % 3;
    for (int k = 0; k < mutations; ++k) test::Mutate(&q, rng);
    Node node(Options());
    const absl::StatusOr<v1::AttachResponse> attached = node.Attach(q, absl::Now() + absl::Seconds(1));
    if (!attached.ok()) {
      ++refusals[attached.status().code()];
      EXPECT_FALSE(attached.status().message().empty()) << q.ShortDebugString();
      continue;
    }
    ++accepted;
    const v1::ArenaLayout& layout = attached->layout();
    EXPECT_LE(layout.total_bytes(), kMaxArenaBytes) << q.ShortDebugString();
    EXPECT_EQ(static_cast<uint32_t>(attached->arena_ranks_size()), q.world_size());
    absl::StatusOr<std::vector<UniqueFd>> fds = node.ClaimArenas(attached->token(), 1);
    ASSERT_TRUE(fds.ok()) << fds.status() << "\n" << q.ShortDebugString();
    ASSERT_EQ(fds->size(), static_cast<size_t>(attached->arena_ranks_size()));
    for (const UniqueFd& fd : *fds) {
      struct stat st {};
      ASSERT_EQ(fstat(fd.get(), &st), 0);
      EXPECT_EQ(static_cast<uint64_t>(st.st_size), layout.total_bytes()) << q.ShortDebugString();
    }
  }
  // Both paths are exercised, and a refusal is the caller's (a bad request or a shape this
  // daemon cannot take), never an internal error.
  EXPECT_GT(accepted, kIterations / 50);
  for (const auto& [code, n] : refusals) {
    EXPECT_TRUE(code == absl::StatusCode::kInvalidArgument ||
                code == absl::StatusCode::kFailedPrecondition)
        << absl::StatusCodeToString(code) << " x " << n;
  }
}

TEST(NodeFuzzTest, PlansFromTheWireArePreparedOrRefusedAndLeaveThePlanInForce) {
  constexpr int kIterations = 3000;
  Node node(Options());
  const absl::StatusOr<v1::AttachResponse> r0 = node.Attach(Request(0, 2));
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(node.ClaimArenas(r0->token(), 1).ok());
  const v1::Plan base = balancer::ToProto(SwappedPlan());
  std::mt19937_64 rng(4);
  int prepared = 0, converted = 0;
  for (int i = 0; i < kIterations; ++i) {
    v1::Plan p = base;
    const int mutations = 1 + rng() % 3;
    for (int k = 0; k < mutations; ++k) test::Mutate(&p, rng);
    // First a version above the committed one, so that the plan's content is what is judged;
    // in the last sixth, the version as mutated.
    if (i < kIterations * 5 / 6) p.set_version(2 + rng() % 1000);
    const absl::StatusOr<balancer::Plan> plan = balancer::FromProto(p);
    if (!plan.ok()) continue;
    ++converted;
    const v1::PrepareResponse response = node.Prepare(*plan, rng() % 4 == 0 ? rng() % 200 : 10);
    if (response.prepared()) {
      ++prepared;
      EXPECT_EQ(node.State().pending_version(), plan->version);
      EXPECT_TRUE(node.Abort(plan->version).ok()) << p.ShortDebugString();
    } else {
      EXPECT_FALSE(response.reason().empty()) << p.ShortDebugString();
    }
    const v1::DaemonState state = node.State();
    ASSERT_EQ(state.committed_version(), 1u) << p.ShortDebugString();
    ASSERT_EQ(state.pending_version(), 0u) << p.ShortDebugString();
  }
  EXPECT_GT(converted, kIterations / 50);
  EXPECT_GT(prepared, kIterations / 50);
  // The aborted plans hold no version back, one under the last version among them: the good
  // plan v2 is prepared and committed.
  balancer::Plan last = SwappedPlan();
  last.version = UINT64_MAX;  // Past the highest a plan takes: no plan after it could be numbered.
  EXPECT_EQ(node.Prepare(last, 10).reason(),
            "plan version 18446744073709551615 is above 2^63 - 1 (no plan after it could be "
            "numbered)");
  last.version = kMaxPlanVersion;
  // Nor at a step no rank reaches (libubep takes none past 2^63 - 1), lead bound or none.
  EXPECT_EQ(node.Prepare(last, kMaxStep + 1).reason(),
            "effective step 9223372036854775808 is above 2^63 - 1 (no rank reaches it)");
  ASSERT_TRUE(node.Prepare(last, 10).prepared());
  ASSERT_TRUE(node.Abort(kMaxPlanVersion).ok());
  const v1::PrepareResponse response = node.Prepare(SwappedPlan(), 10);
  ASSERT_TRUE(response.prepared()) << response.reason();
  EXPECT_TRUE(node.Commit(2).ok());
  EXPECT_EQ(node.State().committed_version(), 2u);
}

}  // namespace
}  // namespace ubep::daemon
