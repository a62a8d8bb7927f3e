// Node: ubepd's group state machine, in process (the integration tests run it as a daemon).
#include "daemon/node.h"

#include "daemon/balancer_link.h"
#include "daemon/fd_server.h"
#include "daemon/metrics.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <cstring>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <filesystem>

#include "absl/strings/match.h"
#include "balancer/formats/proto_convert.h"
#include "balancer/core/plan.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "kernels/common/plan_area.h"
#include "gtest/gtest.h"
#include "kernels/host/rank_arena.h"
#include "kernels/host/shared_arena.h"
#include "common/channel.h"
#include "tests/unit/loopback.h"
#include "tests/unit/node_fixtures.h"
#include "tests/unit/test_util.h"
#include "tests/wait_for.h"

namespace ubep::daemon {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

NodeOptions Options(int free_buffers = 2) {
  NodeOptions o;
  o.fd_socket_path = "/unused";
  o.free_buffers = free_buffers;
  return o;
}

struct Attached {
  std::string token;
  std::vector<kernels::SharedArena> arenas;
  kernels::RankArenaLayout layout;
};

Attached Claim(Node& node, const absl::StatusOr<v1::AttachResponse>& response, int64_t connection) {
  EXPECT_TRUE(response.ok()) << response.status();
  Attached a;
  a.token = response->token();
  a.layout.total_bytes = response->layout().total_bytes();
  a.layout.control = response->layout().control_offset();
  a.layout.ep = response->layout().ep_offset();
  a.layout.plan = response->layout().plan_offset();
  a.layout.plan_capacity = response->layout().plan_capacity();
  a.layout.slot_map = response->layout().slot_map_offset();
  a.layout.weights = response->layout().weights_offset();
  a.layout.weight_stride = response->layout().weight_stride();
  a.layout.buffers_per_layer = response->layout().buffers_per_layer();
  absl::StatusOr<std::vector<UniqueFd>> fds = node.ClaimArenas(a.token, connection);
  EXPECT_TRUE(fds.ok()) << fds.status();
  for (const UniqueFd& fd : *fds) a.arenas.push_back(*kernels::SharedArena::Map(fd.get()));
  return a;
}

Attached AttachAndClaim(Node& node, uint32_t rank, uint32_t world, int64_t connection) {
  return Claim(node, node.Attach(Request(rank, world)), connection);
}

v1::JoinRequest JoinOf(uint32_t rank, const std::string& token) {
  v1::JoinRequest q;
  q.set_rank(rank);
  q.set_token(token);
  return q;
}

v1::DetachRequest DetachOf(uint32_t rank, const std::string& token) {
  v1::DetachRequest q;
  q.set_rank(rank);
  q.set_token(token);
  return q;
}

kernels::EpConfig ConfigOf(uint32_t world) {
  kernels::EpConfig c;
  c.num_ranks = static_cast<int>(world);
  c.max_tokens = 8;
  c.hidden = 16;
  c.top_k = 2;
  c.num_experts = 8;
  c.slots_per_rank = 4;
  c.num_layers = 2;
  return c;
}

uint32_t AbortWord(const Attached& a, int rank, uint32_t world) {
  const size_t offset = a.layout.ep + kernels::ArenaLayout(ConfigOf(world)).abort;
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(a.arenas[rank].data() + offset))
      .load();
}

// Ranks 0 and 1 join at once (each Join waits for the other), giving next steps `next0` and
// `next1`; their answers.
std::pair<absl::StatusOr<v1::JoinResponse>, absl::StatusOr<v1::JoinResponse>> JoinBoth(
    Node& node, const Attached& a0, uint64_t next0, const Attached& a1, uint64_t next1) {
  absl::StatusOr<v1::JoinResponse> j0;
  std::thread t([&] {
    v1::JoinRequest q = JoinOf(0, a0.token);
    q.set_next_step(next0);
    j0 = node.Join(q, absl::Now() + absl::Seconds(30));
  });
  v1::JoinRequest q1 = JoinOf(1, a1.token);
  q1.set_next_step(next1);
  absl::StatusOr<v1::JoinResponse> j1 = node.Join(q1, absl::Now() + absl::Seconds(30));
  t.join();
  return {std::move(j0), std::move(j1)};
}

// A static plan file (--plan) in EPLB's own form, without a topology or shares: the group's
// ranks and slots fill it in, and a topology of several nodes is taken as the file says
// (only ranks and slots must be the group's). Each file's plan is the group's first.
TEST(NodeTest, AStaticPlanFileWithOrWithoutATopologyIsTheGroupsFirstPlan) {
  test::TempDir dir;
  const std::vector<std::vector<uint32_t>> phy2log = {{7, 6, 5, 4, 3, 2, 1, 0},
                                                      {0, 1, 2, 3, 4, 5, 6, 7}};
  for (const std::string& topology :
       {std::string(), std::string(R"(, "topology": {"ranks": 2, "nodes": 2, "slots_per_rank": 4})")}) {
    SCOPED_TRACE(topology);
    NodeOptions options = Options();
    options.plan_path = dir.path() + "/plan.json";
    {
      std::ofstream(options.plan_path)
          << R"({"version": 7, "num_experts": 8, "phy2log": [[7, 6, 5, 4, 3, 2, 1, 0], )"
          << R"([0, 1, 2, 3, 4, 5, 6, 7]])" << topology << "}";
    }
    Node node(options);
    ASSERT_TRUE(node.Attach(Request(0, 2)).ok());
    absl::StatusOr<v1::GetPlanResponse> plan = node.GetPlan();
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->plan().version(), 7u);
    EXPECT_EQ(plan->plan().topology().num_nodes(), topology.empty() ? 1u : 2u);
    ASSERT_EQ(plan->plan().layers_size(), 2);
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(std::vector<uint32_t>(plan->plan().layers(l).slot_expert().begin(),
                                      plan->plan().layers(l).slot_expert().end()),
                phy2log[l]);
    }
  }
}

// A new group starts under the cluster's plan, asked for before the Attach's deadline;
// where asking fails, the Attach fails with it and creates nothing (no round-robin v1 that
// would take the place of the cluster's plan).
TEST(NodeTest, AGroupStartsUnderTheClustersPlanOrNotAtAll) {
  NodeOptions options = Options();
  std::vector<absl::Time> asked;
  absl::StatusOr<std::optional<balancer::Plan>> answer =
      absl::DeadlineExceededError("no answer in time");
  options.cluster_plan = [&](absl::Time deadline) {
    asked.push_back(deadline);
    return answer;
  };
  Node node(options);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  EXPECT_EQ(node.Attach(Request(0, 2), deadline).status(),
            absl::DeadlineExceededError("no answer in time"));
  // Asked to answer a tenth of the time left before the Attach's deadline (the margin the
  // Attach's answer needs).
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_LT(asked[0], deadline - absl::Seconds(2));
  EXPECT_GT(asked[0], deadline - absl::Seconds(4));
  EXPECT_FALSE(node.GroupShape().has_value());
  answer = SwappedPlan();
  Attached a = Claim(node, node.Attach(Request(0, 2), deadline), 1);
  EXPECT_EQ(asked.size(), 2u);
  EXPECT_EQ(node.CommittedPlanIdentity().version, 2u);
  uint64_t version = 0;
  ASSERT_NE(kernels::SelectPlan(a.arenas[0].data() + a.layout.plan, 0, &version), nullptr);
  EXPECT_EQ(version, 2u);
  // The group exists: the next rank's Attach asks nothing.
  Claim(node, node.Attach(Request(1, 2), deadline), 2);
  EXPECT_EQ(asked.size(), 2u);
}

// An Attach that finds a group to join (another shape, its client's token still valid) asks
// the balancer for nothing; where that client is gone by the time the Attach takes the lock to
// replace the group, it is answered "attach again", not given a group under round-robin v1.
// (The clock moves a minute past the token's expiry between the two looks.)
TEST(NodeTest, AGroupReleasedBetweenAnAttachsTwoLooksIsNotReplacedRoundRobin) {
  class SteppingClock final : public ClockInterface {
   public:
    int64_t NowNanos() const override {
      return armed_.load() && reads_++ > 0 ? absl::ToInt64Nanoseconds(absl::Minutes(1)) : 0;
    }
    void SleepFor(absl::Duration) override {}
    void Arm() { armed_ = true; }

   private:
    std::atomic<bool> armed_{false};
    mutable std::atomic<int> reads_{0};
  } clock;
  NodeOptions options = Options();
  options.ticket_clock = &clock;
  int fetches = 0;
  options.cluster_plan = [&](absl::Time) {
    ++fetches;
    return std::optional<balancer::Plan>(SwappedPlan());
  };
  Node node(options);
  ASSERT_TRUE(node.Attach(Request(0, 2)).ok());  // Not claimed: its token expires.
  EXPECT_EQ(fetches, 1);
  v1::AttachRequest other = Request(0, 2);
  other.mutable_shape()->set_hidden(32);
  clock.Arm();
  EXPECT_EQ(node.Attach(other).status(),
            absl::UnavailableError(
                "the group's last client left while this attach looked at it; attach again"));
  ASSERT_TRUE(node.GroupShape().has_value());
  EXPECT_EQ(node.GroupShape()->shape().hidden(), 16u);  // Not replaced.
  // Attached again, it asks and starts under the cluster's plan.
  ASSERT_TRUE(node.Attach(other).ok());
  EXPECT_EQ(fetches, 2);
  EXPECT_EQ(node.CommittedPlanIdentity().version, 2u);
  EXPECT_EQ(node.GroupShape()->shape().hidden(), 32u);
}

// ubepd's question to the balancer: a balancer that takes the connection and never answers is
// taken for down after the patience (no plan: the group starts under v1), unless the Attach's
// deadline comes first, which fails the Attach.
TEST(NodeTest, FetchingTheClustersPlanGivesUpAtTheAttachsDeadlineOrItsOwn) {
  test::LoopbackListener silent;  // Never accepts: gRPC's handshake never completes.
  ASSERT_GE(silent.fd(), 0);
  std::unique_ptr<v1::Control::Stub> stub =
      v1::Control::NewStub(ControlChannel(absl::StrCat("127.0.0.1:", silent.port())));
  EXPECT_EQ(FetchClusterPlan(*stub, absl::Now() + absl::Milliseconds(200), absl::Minutes(1))
                .status(),
            absl::DeadlineExceededError(
                "the Attach's deadline passed while the balancer was asked for the cluster's "
                "plan, which a new group starts under"));
  absl::StatusOr<std::optional<balancer::Plan>> none =
      FetchClusterPlan(*stub, absl::InfiniteFuture(), absl::Milliseconds(200));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
}

// While peers' arenas are not mapped the link asks the balancer for the group at once, then
// less often while the same peers stay missing, up to once a second.
TEST(NodeTest, TheLinkAsksForMissingPeersLessOftenTheLongerNothingChanges) {
  EXPECT_EQ(PeerPollInterval(0), absl::Milliseconds(100));
  EXPECT_EQ(PeerPollInterval(1), absl::Milliseconds(200));
  EXPECT_EQ(PeerPollInterval(2), absl::Milliseconds(400));
  EXPECT_EQ(PeerPollInterval(3), absl::Milliseconds(800));
  EXPECT_EQ(PeerPollInterval(4), absl::Seconds(1));
  EXPECT_EQ(PeerPollInterval(1 << 30), absl::Seconds(1));
}

TEST(NodeTest, GroupFormsWhenEveryRankJoinsAndTakesTheLeastNextStep) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  Attached a1 = AttachAndClaim(node, 1, 2, 2);
  auto [j0, j1] = JoinBoth(node, a0, 7, a1, 5);
  ASSERT_TRUE(j0.ok()) << j0.status();
  ASSERT_TRUE(j1.ok()) << j1.status();
  EXPECT_EQ(j0->generation(), 1u);
  EXPECT_EQ(j1->generation(), 1u);
  EXPECT_EQ(j0->resume_step(), 5u);
  EXPECT_EQ(j1->resume_step(), 5u);
  const kernels::RankControl* c = kernels::ControlOf(a0.arenas[1].data(), a0.layout);
  EXPECT_EQ(c->group_state, kernels::kGroupReady);
  EXPECT_EQ(c->generation, 1u);
  EXPECT_EQ(c->rank, 1u);
}

// The arenas' files go to every client and peer daemon that maps them: none of them can
// change a file's size under the others' mappings (which would raise SIGBUS in them all).
TEST(NodeTest, TheArenasAClientReceivesCannotBeResized) {
  Node node(Options());
  ASSERT_TRUE(node.Attach(Request(0, 2)).ok());
  absl::StatusOr<v1::AttachResponse> response = node.Attach(Request(1, 2));
  ASSERT_TRUE(response.ok()) << response.status();
  absl::StatusOr<std::vector<UniqueFd>> fds = node.ClaimArenas(response->token(), 1);
  ASSERT_TRUE(fds.ok()) << fds.status();
  ASSERT_EQ(fds->size(), 2u);
  for (const UniqueFd& fd : *fds) {
    struct stat st;
    ASSERT_EQ(fstat(fd.get(), &st), 0);
    ASSERT_GT(st.st_size, 4096);
    errno = 0;
    EXPECT_EQ(ftruncate(fd.get(), 4096), -1);
    EXPECT_EQ(errno, EPERM);
    errno = 0;
    EXPECT_EQ(ftruncate(fd.get(), st.st_size + 4096), -1);
    EXPECT_EQ(errno, EPERM);
    EXPECT_EQ(fcntl(fd.get(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    ASSERT_EQ(fstat(fd.get(), &st), 0);
    EXPECT_GT(st.st_size, 4096);
  }
}

// A rank that finds the group broken reads why from its abort word (libubep's BeginStep), so
// every arena holds the code before any reads the broken state.
TEST(NodeTest, ClosedConnectionBreaksTheGroupNamingTheRankInEveryArena) {
  std::function<void()> stopping = [] {};
  NodeOptions options = Options();
  options.stopping_hook = [&] { stopping(); };
  Node node(options);
  Attached a0 = AttachAndClaim(node, 0, 2, 10);
  Attached a1 = AttachAndClaim(node, 1, 2, 11);
  std::thread t([&] { ASSERT_TRUE(node.Join(JoinOf(0, a0.token), absl::Now() + absl::Seconds(30)).ok()); });
  ASSERT_TRUE(node.Join(JoinOf(1, a1.token), absl::Now() + absl::Seconds(30)).ok());
  t.join();
  int stops = 0;
  stopping = [&] {
    ++stops;
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(AbortWord(a0, r, 2), kernels::kAbortRankGone | 1u) << "rank " << r;
      EXPECT_EQ(kernels::ControlOf(a0.arenas[r].data(), a0.layout)->group_state, kernels::kGroupReady)
          << "rank " << r;
    }
  };
  node.ConnectionClosed(11);
  EXPECT_EQ(stops, 1);
  stopping = [] {};
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(AbortWord(a0, r, 2), kernels::kAbortRankGone | 1u);
    EXPECT_EQ(kernels::ControlOf(a0.arenas[r].data(), a0.layout)->group_state, kernels::kGroupBroken);
  }
  EXPECT_EQ(node.Snapshot().rank_up, (std::vector<std::pair<int, bool>>{{0, true}, {1, false}}));
  // The survivor's join waits for rank 1, which is not attached.
  absl::StatusOr<v1::JoinResponse> alone =
      node.Join(JoinOf(0, a0.token), absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(std::string(alone.status().message()),
            "the group of 2 ranks did not form in time; waiting for rank 1 (not attached)");
  // Rank 1 comes back to the same arenas; the group re-forms with the signals reset.
  Attached again = AttachAndClaim(node, 1, 2, 12);
  std::thread t2([&] { ASSERT_TRUE(node.Join(JoinOf(0, a0.token), absl::Now() + absl::Seconds(30)).ok()); });
  absl::StatusOr<v1::JoinResponse> j = node.Join(JoinOf(1, again.token), absl::Now() + absl::Seconds(30));
  t2.join();
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->generation(), 2u);
  EXPECT_EQ(AbortWord(a0, 0, 2), 0u);
  EXPECT_EQ(AbortWord(a0, 1, 2), 0u);
}

TEST(NodeTest, TokensAreSingleUseAndRequiredEverywhere) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  EXPECT_EQ(node.ClaimArenas(a0.token, 2).status(),
            absl::NotFoundError("unknown or already used attach token; attach again"));
  EXPECT_EQ(node.Join(JoinOf(0, "nope"), absl::Now()).status(),
            absl::FailedPreconditionError("rank 0 is not attached with this token; attach again"));
  // Rank 1 attached but never took its arenas: it cannot join yet.
  absl::StatusOr<v1::AttachResponse> r1 = node.Attach(Request(1, 2));
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(node.Join(JoinOf(1, r1->token()), absl::Now()).status(),
            absl::FailedPreconditionError(
                "rank 1 has not taken its arenas from the fd socket /unused"));
}

// An attach whose arenas are not taken within the ticket timeout expires: its token is
// refused, and the rank is free to attach again (from another process).
TEST(NodeTest, AnUnclaimedAttachExpiresAfterTheTicketTimeout) {
  FakeClock clock;
  NodeOptions options = Options();
  options.ticket_timeout = absl::Milliseconds(300);
  options.ticket_clock = &clock;
  Node node(options);
  absl::StatusOr<v1::AttachResponse> first = node.Attach(Request(0, 2));
  ASSERT_TRUE(first.ok()) << first.status();
  clock.Advance(absl::Milliseconds(300));
  EXPECT_FALSE(node.AwaitDetached(absl::Milliseconds(1)));  // At its deadline: still held.
  clock.Advance(absl::Nanoseconds(1));
  EXPECT_EQ(node.ClaimArenas(first->token(), 1).status(),
            absl::DeadlineExceededError("attach token expired; attach again"));
  v1::AttachRequest other = Request(0, 2);
  other.set_pid(999);
  absl::StatusOr<v1::AttachResponse> again = node.Attach(other);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->token(), first->token());
  // Never claimed either: once expired, it holds no drain back.
  EXPECT_FALSE(node.AwaitDetached(absl::Milliseconds(1)));
  clock.Advance(absl::Milliseconds(301));
  EXPECT_TRUE(node.AwaitDetached(absl::Milliseconds(1)));
}

// A drain does not wait for an attach whose arenas were never claimed (its client may have
// died in between): the token is let go of, and a late claim is refused as draining.
TEST(NodeTest, ADrainDoesNotWaitForAnUnclaimedAttach) {
  Node node(Options());
  const absl::StatusOr<v1::AttachResponse> response =
      node.Attach(Request(0, 2), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(node.Snapshot().attached, 1);
  node.Drain();
  EXPECT_TRUE(node.AwaitDetached(absl::ZeroDuration()));
  EXPECT_EQ(node.ClaimArenas(response->token(), 1).status(),
            absl::UnavailableError("ubepd is draining (shutting down); attach again when it is "
                                   "back"));
}

TEST(NodeTest, DrainFailsJoinsAndAttachesAndStopsEveryWait) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  absl::StatusOr<v1::JoinResponse> joined;
  std::thread t([&] { joined = node.Join(JoinOf(0, a0.token), absl::Now() + absl::Seconds(30)); });
  // Let the join start waiting, then drain: it returns at once.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (node.Snapshot().joining != 1 && absl::Now() < until) {
    std::this_thread::yield();
  }
  EXPECT_EQ(node.Snapshot().joining, 1);
  node.Drain();
  t.join();
  EXPECT_EQ(joined.status(), absl::UnavailableError(
                                  "ubepd is draining (shutting down); attach again when it is back"));
  EXPECT_EQ(AbortWord(a0, 0, 2), kernels::kAbortDraining);
  EXPECT_EQ(std::string(node.Attach(Request(1, 2)).status().message()),
            "ubepd is draining (shutting down); attach again when it is back");
  EXPECT_FALSE(node.AwaitDetached(absl::Milliseconds(10)));
  v1::DetachRequest d;
  d.set_rank(0);
  d.set_token(a0.token);
  EXPECT_TRUE(node.Detach(d).ok());
  EXPECT_TRUE(node.AwaitDetached(absl::Milliseconds(10)));
}

// SwappedPlan (v2) prepared for step 20 and committed: rank 0 reads it from step 20 on.
void ExpectSwappedPlanGoesThroughAtStep20(Node& node, const Attached& a) {
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 20);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(node.Commit(2).ok());
  uint64_t version = 0;
  ASSERT_NE(kernels::SelectPlan(a.arenas[0].data() + a.layout.plan, 20, &version), nullptr);
  EXPECT_EQ(version, 2u);
}

// Plan v2 prepared on ranks 0 and 1, and aborted in rank 1's plan area behind the daemon's back
// (its client may write there): the Commit commits neither rank's, rather than leaving the
// two ranks on two plans from step 10, and says which area lost it.
TEST(NodeTest, ACommitThatOneHostedAreaCannotTakeCommitsNone) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(kernels::AbortPlan(a.arenas[1].data() + a.layout.plan, 2).ok());
  EXPECT_EQ(node.Commit(2),
            absl::DataLossError("rank 1's plan area lost plan v2 (plan v2 is not prepared here): "
                                "committed on no rank of this daemon (did its client write into "
                                "its plan area?)"));
  uint64_t version = 0;
  ASSERT_NE(kernels::SelectPlan(a.arenas[0].data() + a.layout.plan, 10, &version), nullptr);
  EXPECT_EQ(version, 1u);
  EXPECT_TRUE(kernels::UndecidedAt(a.arenas[0].data() + a.layout.plan, 10));
}

// Plan v2 prepared on ranks 0 and 1, and lost from rank 1's plan area behind the daemon's back:
// its Abort aborts it on rank 0 and leaves it undecided nowhere, says which area lost it, and
// the next plan is prepared (one broken area refused every later Prepare).
TEST(NodeTest, AnAbortThatOneHostedAreaCannotTakeAbortsTheRest) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  for (int i = 0; i < 2; ++i) {
    kernels::PlanSlotHeader* slot = kernels::PlanSlot(a.arenas[1].data() + a.layout.plan, i);
    if (slot->version == 2) *slot = kernels::PlanSlotHeader{};  // Zeroed by its client.
  }
  EXPECT_EQ(node.Abort(2),
            absl::DataLossError("plan v2 is aborted here, but the plan area of rank 1 (plan v2 "
                                "is not prepared here) did not take the abort (did its client "
                                "write into its plan area?)"));
  EXPECT_FALSE(kernels::UndecidedAt(a.arenas[0].data() + a.layout.plan, 10));
  EXPECT_EQ(node.State().pending_version(), 0u);
  balancer::Plan third = SwappedPlan();
  third.version = 3;
  const v1::PrepareResponse again = node.Prepare(third, 20);
  EXPECT_TRUE(again.prepared()) << again.reason();
}

TEST(NodeTest, PrepareStagesWeightsInFreeBuffersAndCommitSwitchesAtTheEffectiveStep) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  const kernels::EpConfig config = ConfigOf(2);
  // The clients' weights: every byte of (rank r, layer l, buffer i) is the expert it holds + 16 l.
  for (int r = 0; r < 2; ++r) {
    for (int l = 0; l < 2; ++l) {
      for (uint32_t i = 0; i < 4; ++i) {
        std::memset(kernels::WeightBuffer(a.arenas[r].data(), a.layout, l, i), r * 4 + i + 16 * l, 256);
      }
    }
  }
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.copied_slots(), 4u);  // 2 slots x 2 layers.
  EXPECT_EQ(prepared.copied_bytes(), 4u * 256);
  EXPECT_EQ(node.State().pending_version(), 2u);
  // Undecided: every step still uses v1.
  uint64_t version = 0;
  void* area = a.arenas[0].data() + a.layout.plan;
  ASSERT_NE(kernels::SelectPlan(area, 50, &version), nullptr);
  EXPECT_EQ(version, 1u);
  ASSERT_TRUE(node.Commit(2).ok());
  ASSERT_TRUE(node.Commit(2).ok());  // Idempotent.
  version = 0;
  ASSERT_NE(kernels::SelectPlan(area, 9, &version), nullptr);
  EXPECT_EQ(version, 1u);
  const kernels::PlanTableHeader* table = kernels::SelectPlan(area, 10, &version);
  EXPECT_EQ(version, 2u);
  const int buffer = table == kernels::PlanBuffer(area, 0) ? 0 : 1;
  for (int l = 0; l < 2; ++l) {
    // Rank 0 slot 0 now reads expert 5's weights (rank 1's buffer 1), in a free buffer.
    const uint32_t b0 = kernels::SlotMap(a.arenas[0].data(), a.layout, config, buffer)[l * 4 + 0];
    EXPECT_GE(b0, 4u);
    EXPECT_EQ(static_cast<int>(*kernels::WeightBuffer(a.arenas[0].data(), a.layout, l, b0)), 5 + 16 * l);
    const uint32_t b1 = kernels::SlotMap(a.arenas[1].data(), a.layout, config, buffer)[l * 4 + 1];
    EXPECT_GE(b1, 4u);
    EXPECT_EQ(static_cast<int>(*kernels::WeightBuffer(a.arenas[1].data(), a.layout, l, b1)), 0 + 16 * l);
    // Unchanged slots keep their buffers.
    EXPECT_EQ(kernels::SlotMap(a.arenas[0].data(), a.layout, config, buffer)[l * 4 + 2], 2u);
  }
  EXPECT_EQ(node.State().committed_version(), 2u);
  EXPECT_EQ(node.State().committed_effective_step(), 10u);  // What a restarted balancer learns.
  EXPECT_EQ(node.State().pending_version(), 0u);
}

// A version names one plan: a Prepare repeated under it is answered Prepared only with the
// same plan (a retry), and an Abort of the committed plan is refused, not answered OK (the
// balancer would take it as aborted here while this daemon's ranks run it).
TEST(NodeTest, ARepeatedPrepareMustBeTheSamePlanAndTheCommittedPlanIsNeverAborted) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  ASSERT_TRUE(node.Prepare(SwappedPlan(), 10).prepared());
  const v1::PrepareResponse retried = node.Prepare(SwappedPlan(), 10);
  EXPECT_TRUE(retried.prepared()) << retried.reason();
  balancer::Plan other = SwappedPlan();
  std::swap(other.layers[1].slot_expert[2], other.layers[1].slot_expert[6]);
  const v1::PrepareResponse refused = node.Prepare(other, 10);
  EXPECT_FALSE(refused.prepared());
  EXPECT_EQ(refused.reason(),
            "plan v2 is prepared here with other contents; a version names one plan");
  EXPECT_EQ(node.State().pending_version(), 2u);  // The first one stays prepared.
  // What recovery compares with the plan committed under v2 elsewhere.
  EXPECT_EQ(node.State().pending_fingerprint(), balancer::PlanFingerprint(SwappedPlan()));
  EXPECT_NE(balancer::PlanFingerprint(other), balancer::PlanFingerprint(SwappedPlan()));
  ASSERT_TRUE(node.Commit(2).ok());
  const absl::StatusOr<balancer::Plan> committed = balancer::FromProto(node.State().committed_plan());
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_TRUE(*committed == SwappedPlan());  // The plan prepared first, not the other one.
  EXPECT_FALSE(*committed == other);
  EXPECT_EQ(node.Abort(2), absl::FailedPreconditionError(
                               "plan v2 is committed here; a committed plan is never aborted"));
  EXPECT_EQ(node.State().committed_version(), 2u);
  EXPECT_TRUE(node.Abort(3).ok());  // Nothing of v3 here: nothing to abort.
  // Past the newest: v2's Commit sent again (its answer was lost) is done, and an Abort of it
  // still refused, after v3 is committed.
  balancer::Plan third = SwappedPlan();
  third.version = 3;
  std::swap(third.layers[0].slot_expert[1], third.layers[0].slot_expert[5]);
  for (int r = 0; r < 2; ++r) {  // v2 in force: the ranks are at its effective step.
    std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[r].data(), a.layout)->step).store(10);
  }
  const v1::PrepareResponse prepared = node.Prepare(third, 30);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(node.Commit(3).ok());
  EXPECT_TRUE(node.Commit(2).ok());
  EXPECT_EQ(node.Abort(2), absl::FailedPreconditionError(
                               "plan v2 is committed here; a committed plan is never aborted"));
  EXPECT_EQ(node.State().committed_version(), 3u);
  // A Prepare of a version not above the committed one (a balancer behind) is refused: the
  // plan version never goes back.
  for (const uint64_t version : {3u, 2u}) {
    balancer::Plan behind = third;
    behind.version = version;
    std::swap(behind.layers[1].slot_expert[1], behind.layers[1].slot_expert[5]);
    const v1::PrepareResponse refused_behind = node.Prepare(behind, 40);
    EXPECT_FALSE(refused_behind.prepared());
    EXPECT_EQ(refused_behind.reason(),
              absl::StrCat("version ", version, " is not above the committed v3"));
  }
  EXPECT_EQ(node.State().pending_version(), 0u);
}

// Every rank detaches while a plan is prepared and undecided, and a group of another shape
// attaches: it starts under its own first plan with nothing undecided, and takes the next plan
// (in its own arenas) as any group does.
TEST(NodeTest, AGroupCreatedAgainDropsThePlanUndecidedInTheOldOne) {
  Node node(Options());
  Attached old_group = AttachAndClaim(node, 0, 2, 1);
  ASSERT_TRUE(node.Prepare(SwappedPlan(), 10).prepared());
  ASSERT_TRUE(node.Detach(DetachOf(0, old_group.token)).ok());
  v1::AttachRequest other_shape = Request(0, 2);
  other_shape.mutable_shape()->set_max_tokens(16);
  Attached a = Claim(node, node.Attach(other_shape), 2);
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_EQ(node.State().committed_version(), 1u);
  ExpectSwappedPlanGoesThroughAtStep20(node, a);
}

// A stray store of the rank's process into its slot map (a buffer past the layout's) is found
// before a copy reads or writes through it: Prepare fails naming the entry, and so does a
// read of the slot's weights.
TEST(NodeTest, ASlotMapWrittenOutsideUbepdIsRefusedBeforeAnyCopy) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  uint64_t version = 0;
  void* area = a.arenas[1].data() + a.layout.plan;
  const kernels::PlanTableHeader* table = kernels::SelectPlan(area, 0, &version);
  ASSERT_NE(table, nullptr);
  const int buffer = table == kernels::PlanBuffer(area, 0) ? 0 : 1;
  kernels::SlotMap(a.arenas[1].data(), a.layout, ConfigOf(2), buffer)[1 * 4 + 3] = 1000;
  const std::string message =
      "rank 1's slot map says layer 1 slot 3 is in weight buffer 1000, outside [0, 6): its arena "
      "was written outside ubepd";
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), message);
  EXPECT_EQ(node.State().pending_version(), 0u);
  v1::ReadWeightsRequest read;
  read.set_plan_version(1);
  read.set_layer(0);
  read.set_slot(4);  // Rank 1's slot 0.
  EXPECT_EQ(node.ReadWeights(read).status(), absl::DataLossError(message));
}

// A read that takes the copy of last resort (the holder's daemon restarted: its arenas are
// new) is refused until the rank's client says its weights are loaded; any other read is
// served as ever. The word is in the rank's control block, set by Rank::WeightsLoaded.
TEST(NodeTest, ACopyOfLastResortIsReadOnlyOnceTheClientSaidItsWeightsAreLoaded) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  v1::ReadWeightsRequest read;
  read.set_plan_version(1);
  read.set_layer(0);
  read.set_slot(4);  // Rank 1's slot 0.
  EXPECT_TRUE(node.ReadWeights(read).ok());
  read.set_require_loaded(true);
  EXPECT_EQ(node.ReadWeights(read).status(),
            absl::FailedPreconditionError(
                "rank 1's weights are not loaded: its daemon restarted, and no client of its new "
                "arenas has said their weights are in place (Rank::WeightsLoaded), so the copy "
                "of last resort is not taken from them"));
  std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[1].data(), a.layout)->weights_loaded)
      .store(1);
  const absl::StatusOr<v1::ReadWeightsResponse> loaded = node.ReadWeights(read);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->data().size(), loaded->bytes_per_expert());
}

TEST(NodeTest, PrepareFailsWithoutFreeBuffersAndChangesNothing) {
  Node node(Options(/*free_buffers=*/0));
  Attached a = AttachAndClaim(node, 0, 2, 1);
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(),
            "rank 0 layer 0: 1 slots change but only 0 weight buffers are free (--free_buffers 0)");
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_EQ(node.State().committed_version(), 1u);
  EXPECT_EQ(std::string(node.Commit(2).message()), "plan v2 is not prepared here");
  EXPECT_TRUE(node.Abort(2).ok());
}

// A Prepare taken up after its caller's deadline (it waited for the lock, or came late) is
// not carried out: the balancer's Abort may have come first and found nothing to abort, and
// the plan would stay pending with nobody to decide it.
TEST(NodeTest, APrepareTakenUpAfterItsDeadlineIsRefusedAndLeavesNothingPending) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  EXPECT_TRUE(node.Abort(2).ok());  // The balancer's Abort, before the Prepare is taken up.
  Node::RemoteWeights late;
  late.caller_deadline = absl::Now() - absl::Milliseconds(1);
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10, late);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(),
            "the caller's deadline for this Prepare passed before ubepd took it up (the "
            "balancer has given up on it, and may have sent its Abort already)");
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_EQ(node.State().committed_version(), 1u);
  EXPECT_FALSE(kernels::UndecidedAt(a.arenas[0].data() + a.layout.plan, 10));
  // In time, the same plan is prepared.
  Node::RemoteWeights in_time;
  in_time.caller_deadline = absl::Now() + absl::Seconds(30);
  EXPECT_TRUE(node.Prepare(SwappedPlan(), 10, in_time).prepared());
  EXPECT_EQ(node.State().pending_version(), 2u);
}

// Staged past its deadline (here the copies take it), a Prepare is withdrawn before anything
// is published: no plan is left pending.
TEST(NodeTest, APrepareWhoseStagingOutlastsItsDeadlineLeavesNothingPending) {
  // The deadline 2 s ahead, which a loaded machine reaches Prepare's start well inside; the
  // staging outlasts it.
  Node::RemoteWeights remote;
  NodeOptions options = Options();
  options.staging_hook = [&remote] {
    absl::SleepFor(remote.caller_deadline - absl::Now() + absl::Milliseconds(10));
  };
  Node node(options);
  Attached a = AttachAndClaim(node, 0, 2, 1);
  remote.caller_deadline = absl::Now() + absl::Seconds(2);
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10, remote);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(),
            "the caller's deadline for this Prepare passed while it was carried out (the "
            "balancer has given up on it, and may have sent its Abort already)");
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_FALSE(kernels::UndecidedAt(a.arenas[0].data() + a.layout.plan, 10));
  EXPECT_EQ(std::string(node.Commit(2).message()), "plan v2 is not prepared here");
}

// A client wrote over its arena's plan-area header (every client maps its arena read-write):
// ubepd's Prepare places and bounds the table by its own layout, refuses the area naming what
// it found, and aborts what it had prepared on the other rank; nothing is written past the
// area (the old code copied the table 2^56 bytes past it, into ubepd's memory).
TEST(NodeTest, APlanAreaHeaderAClientWroteOverFailsThePrepareNotUbepd) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  size_t capacity = 0;
  node.ForEachArena([&](int r, std::byte* base, const kernels::RankArenaLayout& layout,
                        const kernels::EpConfig&) {
    capacity = layout.plan_capacity;
    if (r == 1) {
      static_cast<kernels::PlanAreaHeader*>(static_cast<void*>(base + layout.plan))->capacity_bytes =
          ~uint64_t{0} >> 8;
    }
  });
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), absl::StrCat("the plan area's header says its buffers hold "
                                            "72057594037927935 bytes, not ",
                                            capacity, ": something other than ubepd wrote over it"));
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_FALSE(kernels::UndecidedAt(a.arenas[0].data() + a.layout.plan, 10));
}

TEST(NodeTest, PrepareRefusesAnEffectiveStepARankHasReached) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[1].data(), a.layout)->step).store(12);
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 12);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "effective step 12 is not ahead of rank 1's step 12");
}

// An effective step far ahead of every rank (a balancer's estimate gone wrong) is refused: the
// plan would be committed but not in force for that long, and every later plan would wait.
TEST(NodeTest, PrepareRefusesAnEffectiveStepTooFarAhead) {
  NodeOptions options = Options();
  options.max_plan_lead_steps = 100;
  Node node(options);
  Attached a = AttachAndClaim(node, 0, 2, 1);
  std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[0].data(), a.layout)->step).store(7);
  std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[1].data(), a.layout)->step).store(12);
  v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 113);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(),
            "effective step 113 is more than 100 steps ahead of rank 1's step 12 "
            "(--max_plan_lead_steps)");
  EXPECT_EQ(node.State().pending_version(), 0u);
  prepared = node.Prepare(SwappedPlan(), 112);  // Exactly the bound.
  EXPECT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(node.State().pending_version(), 2u);
}

// Clients that attach anew resume at the least step they give, which may be before the
// committed plan's effective step: the plan is followed from there (its start moves down in
// every arena), and the daemon says so where it reports the plan (BalancerLink's reports).
TEST(NodeTest, AGroupThatResumesBeforeThePlansEffectiveStepFollowsItFromThere) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  Attached a1 = AttachAndClaim(node, 1, 2, 2);
  ExpectSwappedPlanGoesThroughAtStep20(node, a0);
  EXPECT_EQ(node.CommittedPlanIdentity().effective_step, std::optional<uint64_t>(20));
  auto [j0, j1] = JoinBoth(node, a0, 3, a1, 9);
  ASSERT_TRUE(j0.ok()) << j0.status();
  ASSERT_TRUE(j1.ok()) << j1.status();
  EXPECT_EQ(j1->resume_step(), 3u);
  const Node::PlanIdentity plan = node.CommittedPlanIdentity();
  EXPECT_EQ(plan.version, 2u);
  EXPECT_EQ(plan.effective_step, std::optional<uint64_t>(3));
  for (int r = 0; r < 2; ++r) {
    uint64_t version = 0;
    ASSERT_NE(kernels::SelectPlan(a0.arenas[r].data() + a0.layout.plan, 3, &version), nullptr);
    EXPECT_EQ(version, 2u) << "rank " << r;
  }
}

// Staging may take seconds, and the steps were checked before it: a rank that began the
// effective step meanwhile ran it under the plan in force, without the chance to see the new
// one. The daemon reads the steps again once the plan is in the arenas and withdraws it.
TEST(NodeTest, APlanWhoseEffectiveStepARankReachedDuringStagingIsWithdrawn) {
  std::function<void()> during_staging;
  NodeOptions options = Options();
  options.staging_hook = [&] { during_staging(); };
  Node node(options);
  Attached a = AttachAndClaim(node, 0, 2, 1);
  during_staging = [&] {
    std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[1].data(), a.layout)->step).store(10);
  };
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(),
            "rank 1 reached step 10 while plan v2 was staged; effective step 10 is no longer "
            "ahead of it");
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_EQ(node.State().committed_version(), 1u);
  EXPECT_EQ(std::string(node.Commit(2).message()), "plan v2 is not prepared here");
  for (int r = 0; r < 2; ++r) {
    void* area = a.arenas[r].data() + a.layout.plan;
    EXPECT_FALSE(kernels::UndecidedAt(area, 10)) << "rank " << r;  // Nobody waits for it.
    uint64_t version = 0;
    ASSERT_NE(kernels::SelectPlan(area, 10, &version), nullptr);
    EXPECT_EQ(version, 1u) << "rank " << r;
  }
  // Prepared again further ahead, under the same version (as the balancer retries a catch-up
  // with the cluster's plan), the plan goes through.
  during_staging = [] {};
  ExpectSwappedPlanGoesThroughAtStep20(node, a);
}

// The next plan may overwrite the buffers of the one before the plan in force, which a rank
// still reads until it reaches the effective step: the daemon reports the plan in force (the
// balancer waits for that) and refuses the next one before, naming the rank.
TEST(NodeTest, APlanIsInForceOnceEveryConnectedRankReachedItsEffectiveStep) {
  Node node(Options());
  Attached a = AttachAndClaim(node, 0, 2, 1);
  auto step_of_rank0 = [&] {
    return std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[0].data(), a.layout)->step);
  };
  EXPECT_TRUE(node.CommittedPlanIdentity().in_force);  // v1, in force from step 0.
  ASSERT_TRUE(node.Prepare(SwappedPlan(), 10).prepared());
  ASSERT_TRUE(node.Commit(2).ok());
  step_of_rank0().store(5);
  EXPECT_FALSE(node.CommittedPlanIdentity().in_force);
  EXPECT_FALSE(node.State().plan_in_force());
  balancer::Plan v3 = SwappedPlan();
  v3.version = 3;
  v1::PrepareResponse prepared = node.Prepare(v3, 20);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "plan v2 is not in force on rank 0 yet (step 5 < 10)");
  // Rank 1 never attached (not connected): only rank 0 decides.
  step_of_rank0().store(10);
  EXPECT_TRUE(node.CommittedPlanIdentity().in_force);
  EXPECT_TRUE(node.State().plan_in_force());
  prepared = node.Prepare(v3, 20);
  EXPECT_TRUE(prepared.prepared()) << prepared.reason();
}

// Adds one dispatch's received pairs per local slot (4 slots) to `rank`'s counters of
// `layer`, in the arenas `a` maps, laid out by `config`.
void AddLoad(const Attached& a, int rank, int layer, std::vector<int32_t> per_slot,
             const kernels::EpConfig& config) {
  kernels::AddLayerLoad(a.arenas[rank].data() + a.layout.ep, kernels::ArenaLayout(config), 4,
                        layer, per_slot.data());
}

// The step word of `rank`'s control block, which its client stores at every BeginStep.
std::atomic_ref<uint64_t> StepOf(const Attached& a, int rank) {
  return std::atomic_ref<uint64_t>(kernels::ControlOf(a.arenas[rank].data(), a.layout)->step);
}

// ubep-balancer's side of the reporting, in process on loopback: asks for reports every
// 10 ms and keeps the ones it takes. While refusing it answers UNAVAILABLE (the balancer
// away) and takes nothing; while losing answers it takes each report and answers UNAVAILABLE
// all the same (the answer lost on the way). Reports are not told apart by seq here: what
// is taken twice is kept twice.
class FakeBalancer final : public v1::Control::Service {
 public:
  FakeBalancer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~FakeBalancer() override { server_->Shutdown(std::chrono::system_clock::now()); }

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    registrations_.push_back(*request);
    response->set_report_interval_ms(10);
    return grpc::Status::OK;
  }
  // The first registration of a group of `world` ranks, waited for up to 20 s.
  std::optional<v1::RegisterRequest> RegistrationOf(uint32_t world) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const v1::RegisterRequest& r : registrations_) {
          if (r.world_size() == world) return r;
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return std::nullopt;
  }
  void ForgetRegistrations() {
    std::lock_guard<std::mutex> lock(mu_);
    registrations_.clear();
  }
  grpc::Status ReportLoad(grpc::ServerContext*, const v1::ReportLoadRequest* request,
                          v1::ReportLoadResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (refusing_) {
      ++refused_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "away for the test");
    }
    taken_.push_back(*request);
    if (losing_) return grpc::Status(lose_code_, "answer lost for the test");
    return grpc::Status::OK;
  }

  // A link of node "node-a" reporting here.
  BalancerLinkOptions LinkOptions() const {
    BalancerLinkOptions options;
    options.balancer = absl::StrCat("127.0.0.1:", port_);
    options.node = "node-a";
    options.address = "127.0.0.1:1";
    return options;
  }
  void Refuse(bool refusing) {
    std::lock_guard<std::mutex> lock(mu_);
    refusing_ = refusing;
    if (refusing) {
      since_refusal_ = taken_.size();
      refused_ = 0;
    }
  }
  // Whether `n` reports were refused since Refuse(true), within 20 s.
  bool AwaitRefusals(int n) {
    return test::WaitFor([&] {
      std::lock_guard<std::mutex> lock(mu_);
      return refused_ >= n;
    }, absl::Seconds(20));
  }
  // Reports are taken and answered `code` (what a proxy or a transport may say).
  void LoseAnswers(bool losing, grpc::StatusCode code = grpc::StatusCode::UNAVAILABLE) {
    std::lock_guard<std::mutex> lock(mu_);
    losing_ = losing;
    lose_code_ = code;
  }
  std::vector<v1::ReportLoadRequest> Taken() {
    std::lock_guard<std::mutex> lock(mu_);
    return taken_;
  }
  // The reports accepted since the last refusal, up to the first that reaches `last_step`;
  // none if none does within 20 s.
  std::vector<v1::LoadReport> ReportsUpTo(uint64_t last_step) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<v1::LoadReport> reports;
        for (size_t i = since_refusal_; i < taken_.size(); ++i) {
          reports.push_back(taken_[i].load());
          if (reports.back().last_step() == last_step) return reports;
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return {};
  }

 private:
  int port_ = 0;
  std::mutex mu_;
  bool refusing_ = false;
  int refused_ = 0;  // Since Refuse(true).
  bool losing_ = false;
  grpc::StatusCode lose_code_ = grpc::StatusCode::UNAVAILABLE;
  std::vector<v1::ReportLoadRequest> taken_;  // Every report taken, as sent.
  std::vector<v1::RegisterRequest> registrations_;
  size_t since_refusal_ = 0;                  // Where the reports taken since then begin.
  std::unique_ptr<grpc::Server> server_;
};

// A balancer that takes calls and never answers them (hung): each Register waits until its
// caller cancels it (bounded, 60 s, so that a test that fails still ends).
class HangingBalancer final : public v1::Control::Service {
 public:
  HangingBalancer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~HangingBalancer() override { server_->Shutdown(std::chrono::system_clock::now()); }
  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest*,
                        v1::RegisterResponse*) override {
    ++calls_;
    const absl::Time until = absl::Now() + absl::Seconds(60);
    while (!context->IsCancelled() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    if (context->IsCancelled()) ++cancelled_;
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "hung for the test");
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int calls() const { return calls_.load(); }
  int cancelled() const { return cancelled_.load(); }

 private:
  int port_ = 0;
  std::atomic<int> calls_{0}, cancelled_{0};
  std::unique_ptr<grpc::Server> server_;
};

// A link whose balancer hangs is destroyed (ubepd stopping): the RPC in flight is cancelled
// rather than waited out (an hour here; 2 s each in ubepd, and a tick makes several), and
// the destructor returns.
TEST(NodeTest, ALinkBeingDestroyedCancelsTheRpcItWaitsOn) {
  HangingBalancer balancer;
  Node node(Options());
  BalancerLinkOptions options;
  options.balancer = balancer.address();
  options.node = "node-a";
  options.address = "127.0.0.1:1";
  options.rpc_timeout = absl::Hours(1);
  auto link = std::make_unique<BalancerLink>(options, &node);
  ASSERT_TRUE(test::WaitFor([&] { return balancer.calls() == 1; }, absl::Seconds(30)));
  link.reset();
  // The server sees the cancel on its own thread, soon after.
  EXPECT_TRUE(test::WaitFor([&] { return balancer.cancelled() == 1; }, absl::Seconds(30)));
  EXPECT_EQ(balancer.calls(), 1);  // No call after it.
}

// Each group the daemon creates (its clients attached again with another model) has new
// arenas, and registers as a new incarnation of the daemon: peers that mapped the group before
// map the new one as a restarted daemon's (the same model again included, whose arenas are
// new too), and the balancer takes its ranks as a new process's.
TEST(NodeTest, EachGroupTheDaemonCreatesRegistersAsANewIncarnation) {
  FakeBalancer balancer;
  Node node{Options()};
  BalancerLink link(balancer.LinkOptions(), &node);
  std::vector<std::string> incarnations;
  for (const uint32_t world : {2u, 4u, 2u}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    balancer.ForgetRegistrations();
    Attached a = AttachAndClaim(node, 0, world, 1);
    const std::optional<v1::RegisterRequest> registered = balancer.RegistrationOf(world);
    ASSERT_TRUE(registered.has_value());
    incarnations.push_back(registered->incarnation());
    node.ConnectionClosed(1);  // The client exits.
  }
  ASSERT_EQ(incarnations.size(), 3u);
  const std::string process = incarnations[0].substr(0, incarnations[0].rfind('.'));
  EXPECT_EQ(incarnations, (std::vector<std::string>{process + ".1", process + ".2", process + ".3"}));
}

// A daemon registers at once, and while unregistered tries again every second at most,
// whatever its report interval (an hour here): the balancer counts the ranks of a daemon it
// does not know as down once its registration grace is over. (The first registration waited
// a whole report interval.)
TEST(NodeTest, TheFirstRegistrationDoesNotWaitForTheReportInterval) {
  FakeBalancer balancer;
  Node node{Options()};
  Attached a = AttachAndClaim(node, 0, 2, 1);
  BalancerLinkOptions options = balancer.LinkOptions();
  options.report_interval = absl::Hours(1);
  BalancerLink link(options, &node);
  const std::optional<v1::RegisterRequest> registered = balancer.RegistrationOf(2);
  ASSERT_TRUE(registered.has_value());
  EXPECT_EQ(registered->node(), "node-a");
}

// Ranks 0 and 1 of a one-daemon group, attached; rank 0 has counted 30 pairs in slot 0 of
// layer 0 and is at step 50. Then a BalancerLink starts reporting to `balancer`.
struct ReportingGroup {
  explicit ReportingGroup(FakeBalancer& balancer, BalancerLinkStats* stats = nullptr) {
    AddLoad(a0, 0, 0, {30, 0, 0, 0}, ConfigOf(2));
    StepOf(a0, 0).store(50);
    BalancerLinkOptions options = balancer.LinkOptions();
    options.stats = stats;
    link = std::make_unique<BalancerLink>(options, &node);
  }
  Node node{Options()};
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  Attached a1 = AttachAndClaim(node, 1, 2, 2);
  std::unique_ptr<BalancerLink> link;  // Last: stops first.
};

// One fd connection holds one rank, whose process its closing says ended: a second token
// claimed on a connection that holds a rank is refused, and stays good on a connection of its
// own.
TEST(NodeTest, AConnectionHoldingARankClaimsNoOther) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  const absl::StatusOr<v1::AttachResponse> second = node.Attach(Request(1, 2));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(node.ClaimArenas(second->token(), 1).status(),
            absl::FailedPreconditionError("this connection holds rank 0 already; each rank "
                                          "claims its arenas on a connection of its own"));
  EXPECT_TRUE(node.ClaimArenas(second->token(), 2).ok());
}

// The group re-forms at step 50 after v2 (effective at 100) was committed: v2 is in force from
// 50 (RetargetPlan). The counters the link had not read by then hold step 50's pairs under v1
// (9 in slot 2); a report claiming steps from 50 under v2 would pass them for v2's, and the
// balancer would take them (its stale check sees no step before v2's start). That interval is
// not reported: the load the balancer takes as v2's is v2's alone (4 in slot 1).
TEST(NodeTest, CountsOfThePlanBeforeAGroupFormedAgainDoNotPassForTheNewPlans) {
  FakeBalancer balancer;
  ReportingGroup group(balancer);  // v1; rank 0 at step 50, 30 pairs in slot 0.
  Node& node = group.node;
  ASSERT_FALSE(balancer.ReportsUpTo(50).empty());
  balancer.Refuse(true);  // The next report is made and held: no counter is read meanwhile.
  ASSERT_TRUE(balancer.AwaitRefusals(1));
  AddLoad(group.a0, 0, 0, {0, 0, 9, 0}, ConfigOf(2));  // Step 50 goes on under v1,
  std::atomic_ref<uint64_t>(kernels::ControlOf(group.a0.arenas[0].data(), group.a0.layout)
                                ->over_capacity_calls)
      .store(3);  // and 3 of its calls were over a receive capacity.
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 100);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(node.Commit(2).ok());
  auto [j0, j1] = JoinBoth(node, group.a0, 50, group.a1, 50);  // Stopped, formed again at 50.
  ASSERT_TRUE(j0.ok()) << j0.status();
  ASSERT_TRUE(j1.ok()) << j1.status();
  ASSERT_EQ(node.CommittedPlanIdentity().effective_step, std::optional<uint64_t>(50));
  balancer.Refuse(false);
  // The held report goes, then the link reads the counters again, under v2.
  ASSERT_TRUE(test::WaitFor([&] {
    for (const v1::ReportLoadRequest& r : balancer.Taken()) {
      if (r.load().plan_version() == 2) return true;
    }
    return false;
  }, absl::Seconds(20)));
  AddLoad(group.a0, 0, 0, {0, 4, 0, 0}, ConfigOf(2));  // v2's own.
  StepOf(group.a0, 0).store(60);
  ASSERT_FALSE(balancer.ReportsUpTo(60).empty());
  std::vector<uint64_t> v2(8, 0);  // What the balancer takes as v2's: from its start on.
  for (const v1::ReportLoadRequest& r : balancer.Taken()) {
    if (r.load().plan_version() != 2 || r.load().first_step() < r.plan_effective_step()) continue;
    for (int p = 0; p < 8; ++p) v2[p] += r.load().layers(0).slot(p);
  }
  EXPECT_THAT(v2, ::testing::ElementsAre(0, 4, 0, 0, 0, 0, 0, 0));
  // The calls dropped over a capacity are counted whatever plan they ran under: the interval
  // not reported passes them on to the next report, apart from v2's own.
  uint64_t over_capacity = 0, before = 0;
  for (const v1::ReportLoadRequest& r : balancer.Taken()) {
    over_capacity += r.over_capacity_calls();
    before += r.over_capacity_calls_before();
  }
  EXPECT_EQ(over_capacity, 0u);
  EXPECT_EQ(before, 3u);
}

// A load counter below its last reading (stored by something other than the data plane: every
// serving process maps its arenas writable) counts 0 for that interval instead of a delta
// that wraps, which the balancer would refuse with the whole report, rank 1's counts too;
// the next report goes on from where it stands.
TEST(NodeTest, ALoadCounterThatWentBackCountsNothingAndTheOthersAreReported) {
  FakeBalancer balancer;
  ReportingGroup group(balancer);  // Rank 0 at step 50, 30 pairs in slot 0.
  ASSERT_FALSE(balancer.ReportsUpTo(50).empty());
  AddLoad(group.a0, 0, 0, {-5, 0, 0, 0}, ConfigOf(2));  // 30 -> 25.
  AddLoad(group.a0, 1, 0, {0, 7, 0, 0}, ConfigOf(2));
  StepOf(group.a0, 0).store(60);
  // Layer 0's counts in every report taken, up to the one of `step` (the reports are deltas;
  // which of them holds which change depends on when the link read the counters).
  auto reported = [&](uint64_t step) {
    std::vector<uint64_t> slots(8, 0), dispatches(2, 0);
    for (const v1::LoadReport& r : balancer.ReportsUpTo(step)) {
      for (int p = 0; p < 8; ++p) slots[p] += r.layers(0).slot(p);
      for (int q = 0; q < 2; ++q) dispatches[q] += r.layers(0).dispatches(q);
    }
    return std::pair(slots, dispatches);
  };
  // The 5 taken off are not taken off the balancer's count (a wrapped delta summed would).
  auto [slots, dispatches] = reported(60);
  EXPECT_THAT(slots, ::testing::ElementsAre(30, 0, 0, 0, 0, 7, 0, 0));
  EXPECT_THAT(dispatches, ::testing::ElementsAre(2, 1));
  AddLoad(group.a0, 0, 0, {3, 0, 0, 0}, ConfigOf(2));  // 25 -> 28: 3 more.
  StepOf(group.a0, 0).store(70);
  std::tie(slots, dispatches) = reported(70);
  EXPECT_THAT(slots, ::testing::ElementsAre(33, 0, 0, 0, 0, 7, 0, 0));
  EXPECT_THAT(dispatches, ::testing::ElementsAre(3, 1));
  // Rank 1's dispatch count set back (its layer-0 sequence word, 2 per dispatch, stored 0),
  // then 5 pairs counted in one update: its dispatch count stands, and pairs over no dispatch,
  // which the balancer would refuse with the whole report, count 0. Rank 0's 4 are reported.
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(
                                group.a0.arenas[1].data() + group.a0.layout.ep +
                                kernels::ArenaLayout(ConfigOf(2)).load_seq))
      .store(0);
  AddLoad(group.a0, 1, 0, {0, 5, 0, 0}, ConfigOf(2));
  AddLoad(group.a0, 0, 0, {4, 0, 0, 0}, ConfigOf(2));
  StepOf(group.a0, 0).store(80);
  std::tie(slots, dispatches) = reported(80);
  EXPECT_THAT(slots, ::testing::ElementsAre(37, 0, 0, 0, 0, 7, 0, 0));
  EXPECT_THAT(dispatches, ::testing::ElementsAre(4, 1));
}

// v2 committed while rank 0 waited at its start (step 60 begun, the last report read there):
// no re-form, and what is counted from then on is v2's alone, reported (a cut at every plan
// change whose start the last report reached would drop it).
TEST(NodeTest, APlanCommittedWhileTheRanksWaitAtItsStartIsReportedFromThere) {
  FakeBalancer balancer;
  ReportingGroup group(balancer);  // v1; rank 0 at step 50, 30 pairs in slot 0.
  Node& node = group.node;
  ASSERT_FALSE(balancer.ReportsUpTo(50).empty());
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 60);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  StepOf(group.a0, 0).store(60);  // Begun, waiting for the decision.
  ASSERT_FALSE(balancer.ReportsUpTo(60).empty());
  ASSERT_TRUE(node.Commit(2).ok());
  AddLoad(group.a0, 0, 0, {0, 4, 0, 0}, ConfigOf(2));  // v2's.
  StepOf(group.a0, 0).store(70);
  ASSERT_FALSE(balancer.ReportsUpTo(70).empty());
  std::vector<uint64_t> v2(8, 0);
  for (const v1::ReportLoadRequest& r : balancer.Taken()) {
    if (r.load().plan_version() != 2 || r.load().first_step() < r.plan_effective_step()) continue;
    for (int p = 0; p < 8; ++p) v2[p] += r.load().layers(0).slot(p);
  }
  EXPECT_THAT(v2, ::testing::ElementsAre(0, 4, 0, 0, 0, 0, 0, 0));
}

// ReportingGroup's ranks leave (connections 1 and 2) and a group of another hidden size (new
// arenas) forms: rank 0 (connection 3), 7 pairs counted in slot 1 of layer 0, at step 12.
Attached FormAgainWider(Node& node) {
  node.ConnectionClosed(1);
  node.ConnectionClosed(2);
  v1::AttachRequest wider = Request(0, 2);
  wider.mutable_shape()->set_hidden(32);
  Attached b0 = Claim(node, node.Attach(wider), 3);
  kernels::EpConfig config = ConfigOf(2);
  config.hidden = 32;
  AddLoad(b0, 0, 0, {0, 7, 0, 0}, config);
  StepOf(b0, 0).store(12);
  return b0;
}

// A group formed again (new arenas, their counters from zero, their ranks' steps from where
// the clients resumed) is reported from scratch: all it counted, from step 0, not the
// difference from the old arenas' counters nor from the old arenas' last step (which would
// claim the report starts at its last step, or after it).
TEST(NodeTest, AGroupFormedAgainIsReportedFromItsOwnCountersAndFromStepZero) {
  FakeBalancer balancer;
  ReportingGroup group(balancer);
  Node& node = group.node;
  // Layer 0's slot counts over `reports` (a report may land before the counts or the step
  // it is read with were stored: what matters is what they add up to).
  auto counted = [](const std::vector<v1::LoadReport>& reports) {
    std::vector<uint64_t> slots(8, 0), dispatches(2, 0);
    for (const v1::LoadReport& report : reports) {
      for (int p = 0; p < report.layers(0).slot_size(); ++p) slots[p] += report.layers(0).slot(p);
      for (int r = 0; r < report.layers(0).dispatches_size(); ++r) {
        dispatches[r] += report.layers(0).dispatches(r);
      }
    }
    return std::make_pair(slots, dispatches);
  };
  std::vector<v1::LoadReport> reports = balancer.ReportsUpTo(50);
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().first_step(), 0u);
  EXPECT_THAT(counted(reports).first, ElementsAre(30, 0, 0, 0, 0, 0, 0, 0));

  // The balancer goes away; both ranks leave, and a group of another hidden size forms.
  balancer.Refuse(true);
  Attached b0 = FormAgainWider(node);
  balancer.Refuse(false);
  reports = balancer.ReportsUpTo(12);
  ASSERT_FALSE(reports.empty());
  EXPECT_EQ(reports.back().first_step(), 0u);
  EXPECT_THAT(counted(reports).first, ElementsAre(0, 7, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(counted(reports).second, ElementsAre(1, 0));
}

// A report whose answer was lost is sent again under its seq, which the balancer takes once
// per registration; but the group formed again (new arenas) registers as a new incarnation,
// whose seqs the balancer takes afresh. The old arenas' report, unanswered, is then dropped,
// not sent again under the new registration (where it would be counted twice if it had been
// taken): every report after the new registration counts the new arenas only.
TEST(NodeTest, AnUnansweredReportOfArenasGoneIsNotSentUnderTheNewRegistration) {
  FakeBalancer balancer;
  balancer.LoseAnswers(true);
  ReportingGroup group(balancer);
  Node& node = group.node;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (balancer.Taken().size() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(balancer.Taken().size(), 2u);
  ASSERT_EQ(balancer.Taken()[0].load().layers(0).slot(0), 30u);
  // No report is taken meanwhile; both ranks leave and a group of another shape forms.
  balancer.Refuse(true);
  balancer.LoseAnswers(false);
  balancer.ForgetRegistrations();
  Attached b0 = FormAgainWider(node);
  ASSERT_TRUE(balancer.RegistrationOf(2).has_value());
  balancer.Refuse(false);
  const std::vector<v1::LoadReport> reports = balancer.ReportsUpTo(12);
  ASSERT_FALSE(reports.empty());
  std::vector<uint64_t> slots(8, 0);
  for (const v1::LoadReport& report : reports) {
    for (int p = 0; p < 8; ++p) slots[p] += report.layers(0).slot(p);
  }
  EXPECT_THAT(slots, ElementsAre(0, 7, 0, 0, 0, 0, 0, 0));
}

// A client killed inside its update of a layer's load counters leaves the layer's sequence
// word odd. While the rank is held, that reads as an owner mid-update (an error after 100 ms,
// the read tried again later); once the rank has no client, nobody will finish the update:
// the counters are taken as they stand, and the other ranks' counts are read with them
// rather than lost to every read until the rank is back.
TEST(NodeTest, LoadCountersAKilledClientLeftMidUpdateAreTakenAsTheyStandOnceItIsGone) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  Attached a1 = AttachAndClaim(node, 1, 2, 2);
  const kernels::ArenaLayout ep(ConfigOf(2));
  AddLoad(a0, 0, 0, {3, 0, 0, 0}, ConfigOf(2));
  // Rank 1's client, killed mid-update: the word odd, the first counter added (4 pairs).
  std::byte* arena1 = a1.arenas[1].data() + a1.layout.ep;
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(arena1 + ep.load_seq)).store(1);
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(arena1 + ep.load_counters)).store(4);
  EXPECT_EQ(node.ReadSlotLoads().status(),
            absl::DeadlineExceededError("rank 1: load counters of layer 0 kept changing for "
                                        "100ms (sequence 1): their owner stopped mid-update"));
  node.ConnectionClosed(2);
  absl::StatusOr<Node::SlotLoads> loads = node.ReadSlotLoads();
  ASSERT_TRUE(loads.ok()) << loads.status();
  EXPECT_THAT(loads->slots[0], ElementsAre(3, 0, 0, 0, 4, 0, 0, 0));
  EXPECT_THAT(loads->dispatches[0], ElementsAre(1, 1));
  EXPECT_EQ(std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(arena1 + ep.load_seq)).load(), 2u);
}

// A harvest whose read of the load counters fails (here a held rank's layer mid-update) says
// so, once while the same reason lasts (a ubepd without --balancer said nothing, and its load
// metrics stood still).
TEST(NodeTest, AHarvestThatCannotReadTheLoadCountersSaysSoOnce) {
  Node node(Options());
  Attached a0 = AttachAndClaim(node, 0, 2, 1);
  Attached a1 = AttachAndClaim(node, 1, 2, 2);
  const kernels::ArenaLayout ep(ConfigOf(2));
  std::byte* arena1 = a1.arenas[1].data() + a1.layout.ep;
  std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(arena1 + ep.load_seq)).store(1);
  DaemonMetrics metrics(&node, absl::Hours(1));  // Harvests when the test calls it.
  testing::internal::CaptureStderr();
  metrics.Harvest();
  metrics.Harvest();
  const std::string said = testing::internal::GetCapturedStderr();
  const std::string why =
      "metrics: cannot read the load counters (the load metrics stand still until they can): "
      "rank 1: load counters of layer 0 kept changing for 100ms (sequence 1): their owner "
      "stopped mid-update\n";
  EXPECT_TRUE(absl::EndsWith(said, why)) << said;
  EXPECT_EQ(said.find(why), said.size() - why.size()) << said;  // Once.
}

// A report whose answer does not come may have been taken: it goes again as it was, under
// its seq (only the step it tells is new), until an answer comes; the balancer takes a seq
// once. Its counts are never carried into a report under a new seq, which would count them
// twice.
// Any answer but the balancer's own (OK, INVALID_ARGUMENT and FAILED_PRECONDITION: taken or
// refused for good; NOT_FOUND: register again) may come from a transport or a proxy that
// never passed the report on: UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL, ...
class ReportAnswerLostTest : public ::testing::TestWithParam<grpc::StatusCode> {};

TEST_P(ReportAnswerLostTest, AReportWhoseAnswerIsLostGoesAgainUnderItsSeq) {
  FakeBalancer balancer;
  balancer.LoseAnswers(true, GetParam());
  ReportingGroup group(balancer);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (balancer.Taken().size() < 3 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  balancer.LoseAnswers(false);
  AddLoad(group.a0, 0, 0, {0, 5, 0, 0}, ConfigOf(2));
  StepOf(group.a0, 0).store(60);
  ASSERT_FALSE(balancer.ReportsUpTo(60).empty());

  const std::vector<v1::ReportLoadRequest> taken = balancer.Taken();
  ASSERT_GE(taken.size(), 4u);
  // The first report went at least three times, the same each time, and every later one
  // under the next seq.
  EXPECT_EQ(taken[0].seq(), 1u);
  EXPECT_EQ(taken[0].load().SerializeAsString(), taken[1].load().SerializeAsString());
  EXPECT_EQ(taken[0].load().SerializeAsString(), taken[2].load().SerializeAsString());
  EXPECT_EQ(taken[2].seq(), 1u);
  // Taken once per seq, as the balancer takes them, the counts are all there, once.
  std::vector<uint64_t> slots(8, 0);
  const v1::ReportLoadRequest* first = nullptr;  // Of the seq taken last.
  for (const v1::ReportLoadRequest& report : taken) {
    if (first != nullptr && report.seq() == first->seq()) {
      EXPECT_EQ(report.load().SerializeAsString(), first->load().SerializeAsString())
          << "seq " << report.seq();
      continue;
    }
    EXPECT_EQ(report.seq(), first == nullptr ? 1u : first->seq() + 1);
    first = &report;
    for (int p = 0; p < 8; ++p) slots[p] += report.load().layers(0).slot(p);
  }
  EXPECT_THAT(slots, ElementsAre(30, 5, 0, 0, 0, 0, 0, 0));
}

INSTANTIATE_TEST_SUITE_P(Codes, ReportAnswerLostTest,
                         ::testing::Values(grpc::StatusCode::UNAVAILABLE,
                                           grpc::StatusCode::INTERNAL,
                                           grpc::StatusCode::CANCELLED,
                                           grpc::StatusCode::UNKNOWN),
                         [](const auto& info) { return absl::StrCat("code_", info.param); });

// Answers the same report would get again (too large for the balancer, not a balancer,
// refused credentials): the report is dropped and the next one goes under the next seq with
// only its own counts, rather than the same one sent again for good, holding up every report
// after it.
class ReportRefusedForGoodTest : public ::testing::TestWithParam<grpc::StatusCode> {};

TEST_P(ReportRefusedForGoodTest, AReportRefusedForGoodIsDroppedAndTheNextGoesOn) {
  FakeBalancer balancer;
  balancer.LoseAnswers(true, GetParam());
  ReportingGroup group(balancer);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (balancer.Taken().empty() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  AddLoad(group.a0, 0, 0, {0, 5, 0, 0}, ConfigOf(2));
  StepOf(group.a0, 0).store(60);
  balancer.LoseAnswers(false);
  ASSERT_FALSE(balancer.ReportsUpTo(60).empty());
  const std::vector<v1::ReportLoadRequest> taken = balancer.Taken();
  ASSERT_GE(taken.size(), 2u);
  std::vector<uint64_t> slots(8, 0);
  for (size_t i = 0; i < taken.size(); ++i) {
    EXPECT_EQ(taken[i].seq(), i + 1) << "report " << i << " went again";
    for (int p = 0; p < 8; ++p) slots[p] += taken[i].load().layers(0).slot(p);
  }
  EXPECT_EQ(taken[0].load().layers(0).slot(0), 30u);
  EXPECT_THAT(slots, ElementsAre(30, 5, 0, 0, 0, 0, 0, 0));
}

INSTANTIATE_TEST_SUITE_P(Codes, ReportRefusedForGoodTest,
                         ::testing::Values(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                           grpc::StatusCode::UNIMPLEMENTED,
                                           grpc::StatusCode::PERMISSION_DENIED,
                                           grpc::StatusCode::UNAUTHENTICATED),
                         [](const auto& info) { return absl::StrCat("code_", info.param); });

// A group of 4 ranks over two daemons in one process: ranks 0-1 on `first` 0, 2-3 on 2.
NodeOptions Hosting(int first) {
  NodeOptions o = Options();
  o.first_rank = first;
  o.num_ranks = 2;
  return o;
}

// An Attach that would start a new group (another shape, no client attached) but that the
// daemon refuses anyway (a rank it does not host) is refused before the group is replaced: a
// new group is a restart for its peers and the balancer.
// Before any rank attached there is no plan to give; a daemon told it hosts ranks past the
// group's size refuses the attach that would create that group, naming both.
TEST(NodeTest, NoPlanBeforeTheFirstAttachAndNoGroupSmallerThanTheHostedRanks) {
  Node node(Hosting(2));
  EXPECT_EQ(node.GetPlan().status(),
            absl::FailedPreconditionError("no plan yet: it is made when the first rank attaches"));
  EXPECT_EQ(node.Attach(Request(2, 3), absl::Now() + absl::Seconds(10)).status(),
            absl::FailedPreconditionError(
                "this daemon hosts ranks 2-3 (--ranks) but the group has 3 ranks"));
  EXPECT_EQ(node.Snapshot().attached, 0);
}

TEST(NodeTest, AnAttachRefusedForItsRankLeavesTheGroupAsItWas) {
  Node node(Hosting(0));
  v1::AttachRequest first = Request(0, 2);  // A group of two, both ranks hosted here.
  absl::StatusOr<v1::AttachResponse> attached = node.Attach(first);
  ASSERT_TRUE(attached.ok()) << attached.status();
  const absl::Status not_hosted = absl::InvalidArgumentError(
      "rank 3 is not hosted by this daemon (it hosts ranks 0-1); attach to the daemon of its "
      "node");
  // While the group has a client: the rank is what is wrong, not the group's shape.
  EXPECT_EQ(node.Attach(Request(3, 4)).status(), not_hosted);
  v1::DetachRequest d;
  d.set_rank(0);
  d.set_token(attached->token());
  ASSERT_TRUE(node.Detach(d).ok());
  v1::AttachRequest other = Request(3, 4);  // Another shape, and a rank of the other node.
  other.mutable_shape()->set_hidden(32);
  EXPECT_EQ(node.Attach(other).status(), not_hosted);
  const Node::GroupIdentity identity = node.Identity();
  EXPECT_EQ(identity.arenas_created, 1u);
  ASSERT_TRUE(identity.shape.has_value());
  EXPECT_EQ(identity.shape->world_size(), 2u);
  EXPECT_EQ(identity.shape->shape().hidden(), 16u);
}

// Maps `from`'s arenas into `into` as the balancer link does, naming `from`'s incarnation.
absl::Status MapPeer(Node& into, const Node& from, const std::string& incarnation) {
  absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> arenas = from.ArenasForPeer(into.PeerKey());
  if (!arenas.ok()) return arenas.status();
  std::vector<int> fds;
  for (const UniqueFd& fd : arenas->second) fds.push_back(fd.get());
  return into.AddPeerArenas(arenas->first, fds, incarnation);
}

// Attach of `rank` to `node`, which waits for the peers' arenas; `map` maps them meanwhile.
absl::StatusOr<v1::AttachResponse> AttachMapping(Node& node, uint32_t rank,
                                                 const std::function<void()>& map) {
  absl::StatusOr<v1::AttachResponse> response;
  std::thread t([&] { response = node.Attach(Request(rank, 4), absl::Now() + absl::Seconds(30)); });
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (node.PeerKey().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  map();
  t.join();
  return response;
}

// Slot p holds expert p % 8 (every expert on ranks 0-1 and again on 2-3); `excluded` ranks'
// slots have share 0.
balancer::Plan FourRankPlan(uint64_t version, std::vector<int> excluded) {
  balancer::Plan plan;
  plan.version = version;
  plan.topology = {4, 2, 4, 1};
  plan.num_experts = 8;
  plan.excluded_ranks = excluded;
  for (int l = 0; l < 2; ++l) {
    balancer::LayerPlan layer;
    for (int p = 0; p < 16; ++p) layer.slot_expert.push_back(p % 8);
    for (int p = 0; p < 16; ++p) {
      const bool out = std::find(excluded.begin(), excluded.end(), p / 4) != excluded.end();
      layer.slot_share.push_back(out ? 0.0 : excluded.empty() ? 0.5 : 1.0);
    }
    plan.layer_ids.push_back(l);
    plan.layers.push_back(layer);
  }
  return plan;
}

// A peer daemon restarts (new process, new arenas): its old arenas stay mapped, stale, while
// a plan that may be in force includes its ranks; no plan including them is prepared. Once a
// committed plan excludes them the new arenas replace the old, the arena epoch moves, and a
// client refreshing gets the new ones.
// Ranks 0 (node a, hosting 0-1) and 2 (node b, hosting 2-3) of four attach and take their
// arenas, each node mapping the other's as the balancer link does ("a-1", "b-1").
struct TwoNodes {
  absl::StatusOr<v1::AttachResponse> r0, r2;
  Attached x0, x2;
};
TwoNodes AttachTwoNodes(Node& a, Node& b) {
  TwoNodes t;
  std::thread tb([&] { t.r2 = b.Attach(Request(2, 4), absl::Now() + absl::Seconds(30)); });
  t.r0 = AttachMapping(a, 0, [&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (b.PeerKey().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_TRUE(MapPeer(a, b, "b-1").ok());
    EXPECT_TRUE(MapPeer(b, a, "a-1").ok());
  });
  tb.join();
  t.x0 = Claim(a, t.r0, 1);
  t.x2 = Claim(b, t.r2, 2);
  return t;
}

// Four ranks on two nodes: 0-1 on a, 2-3 on b, all attached and holding their connections.
struct GroupOfFour {
  explicit GroupOfFour(const NodeOptions& options_a = Hosting(0),
                       const NodeOptions& options_b = Hosting(2))
      : a(options_a), b(options_b) {}
  // All four join at once (each Join waits for the others); their answers.
  std::array<absl::StatusOr<v1::JoinResponse>, 4> Join() {
    std::array<absl::StatusOr<v1::JoinResponse>, 4> j;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    std::thread join0([&] { j[0] = a.Join(JoinOf(0, t.x0.token), deadline); });
    std::thread join1([&] { j[1] = a.Join(JoinOf(1, x1.token), deadline); });
    std::thread join2([&] { j[2] = b.Join(JoinOf(2, t.x2.token), deadline); });
    j[3] = b.Join(JoinOf(3, x3.token), deadline);
    join0.join();
    join1.join();
    join2.join();
    return j;
  }
  Node a;
  Node b;
  TwoNodes t = AttachTwoNodes(a, b);
  Attached x1 = AttachAndClaim(a, 1, 4, 3);
  Attached x3 = AttachAndClaim(b, 3, 4, 4);
};

// Node a's Prepare of plan v2, which drops ranks 2-3, on a thread of its own; returned once
// the Prepare has stopped the group (rank 0's abort word) and waits for its ranks to stop.
std::thread PrepareDroppingRanks2And3(Node& a, const TwoNodes& t, v1::PrepareResponse* prepared) {
  std::thread prepare([&a, prepared] { *prepared = a.Prepare(FourRankPlan(2, {2, 3}), 10); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (AbortWord(t.x0, 0, 4) != kernels::kAbortMembership && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return prepare;
}

// The lead daemon (a, of rank 0) reads every member's join ticket, and rank 3's process dies
// on node b before a publishes the group: b finds no group formed to stop. Once published,
// a reads the tickets again and stops the group it formed, naming rank 3, rather than leave
// ranks 0-2 running a generation whose waits for rank 3 would only time out.
TEST(NodeTest, AGroupFormedAsAPeerDaemonsRankLeftIsStoppedNamingIt) {
  Node* other = nullptr;
  bool once = false;
  NodeOptions options = Hosting(0);
  options.forming_hook = [&] {
    if (std::exchange(once, true)) return;
    other->ConnectionClosed(4);  // Rank 3's client (GroupOfFour's connection 4) dies.
  };
  GroupOfFour g(options);
  other = &g.b;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> j = g.Join();
  ASSERT_TRUE(once);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
    EXPECT_EQ(j[r]->generation(), 1u);
  }
  EXPECT_EQ(j[3].status(), absl::FailedPreconditionError("rank 3 detached while joining"));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(AbortWord(g.t.x0, r, 4), kernels::kAbortRankGone | 3u) << "rank " << r;
    EXPECT_EQ(std::atomic_ref<const uint32_t>(
                  kernels::ControlOf(g.t.x0.arenas[r].data(), g.t.x0.layout)->group_state)
                  .load(),
              kernels::kGroupBroken)
        << "rank " << r;
  }
}

// A rank's join ticket as its daemon would write it, in the arenas `x` holds.
void SetTicket(const Attached& x, int rank, uint64_t ticket) {
  std::atomic_ref<uint64_t>(kernels::ControlOf(x.arenas[rank].data(), x.layout)->join_ticket)
      .store(ticket);
}

// Rank 3's Join on node b runs out of time just as the lead daemon (a, of rank 0) forms the
// group on its ticket, and a's second look at the tickets comes before b withdraws it: the
// group runs with rank 3 in it. Its Join says so (the generation), rather than that the
// group did not form, which would leave ranks 0-2 waiting for rank 3 in the data plane until
// their own waits time out.
TEST(NodeTest, AJoinThatRunsOutAsThePeerLeadFormsTheGroupOnItsTicketJoins) {
  GroupOfFour* g = nullptr;
  std::array<absl::StatusOr<v1::JoinResponse>, 2> lead_joins;
  bool once = false;
  NodeOptions options_b = Hosting(2);
  options_b.join_expiring_hook = [&](int rank) {
    if (rank != 3 || std::exchange(once, true)) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    std::thread join0([&] { lead_joins[0] = g->a.Join(JoinOf(0, g->t.x0.token), deadline); });
    lead_joins[1] = g->a.Join(JoinOf(1, g->x1.token), deadline);
    join0.join();
  };
  GroupOfFour four(Hosting(0), options_b);
  g = &four;
  auto control = [&](int r) {
    return kernels::ControlOf(four.t.x0.arenas[r].data(), four.t.x0.layout);
  };
  absl::StatusOr<v1::JoinResponse> join2;
  std::thread rank2([&] {
    join2 = four.b.Join(JoinOf(2, four.t.x2.token), absl::Now() + absl::Seconds(30));
  });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (std::atomic_ref<uint64_t>(control(2)->join_ticket).load() != 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const absl::StatusOr<v1::JoinResponse> join3 =
      four.b.Join(JoinOf(3, four.x3.token), absl::Now() + absl::Seconds(1));
  rank2.join();
  ASSERT_TRUE(once);
  ASSERT_TRUE(join3.ok()) << join3.status();
  EXPECT_EQ(join3->generation(), 1u);
  ASSERT_TRUE(join2.ok()) << join2.status();
  EXPECT_EQ(join2->generation(), 1u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(lead_joins[r].ok()) << "rank " << r << ": " << lead_joins[r].status();
    EXPECT_EQ(lead_joins[r]->generation(), 1u);
  }
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(AbortWord(four.t.x0, r, 4), 0u) << "rank " << r;
    EXPECT_EQ(std::atomic_ref<const uint32_t>(control(r)->group_state).load(),
              kernels::kGroupReady)
        << "rank " << r;
    EXPECT_EQ(std::atomic_ref<const uint64_t>(control(r)->join_ticket).load(),
              1u | kernels::kTicketClaimed)
        << "rank " << r;
  }
}

// As above, with rank 3's withdrawal between the lead's publishing the group and its claiming
// the tickets: the withdrawal wins, so the Join says that the group formed as it ran out and
// stops for it, and the lead stops the group naming rank 3 (the rank was told that it joined
// while the lead stopped the group for its leaving, both).
TEST(NodeTest, AJoinThatRunsOutAsTheLeadPublishesTheGroupWithdrawsOrJoinsNotBoth) {
  GroupOfFour* g = nullptr;
  auto control = [&](int r) {
    return kernels::ControlOf(g->t.x0.arenas[r].data(), g->t.x0.layout);
  };
  auto await = [](const std::function<bool()>& done) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!done() && absl::Now() < until) absl::SleepFor(absl::Microseconds(100));
  };
  NodeOptions options_a = Hosting(0);
  bool published = false;
  options_a.published_hook = [&] {
    if (std::exchange(published, true)) return;
    await([&] { return std::atomic_ref<uint64_t>(control(3)->join_ticket).load() == 0; });
  };
  std::array<absl::StatusOr<v1::JoinResponse>, 2> lead_joins;
  std::thread join0, join1;
  bool expiring = false;
  NodeOptions options_b = Hosting(2);
  options_b.join_expiring_hook = [&](int rank) {
    if (rank != 3 || std::exchange(expiring, true)) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    join0 = std::thread([&, deadline] { lead_joins[0] = g->a.Join(JoinOf(0, g->t.x0.token), deadline); });
    join1 = std::thread([&, deadline] { lead_joins[1] = g->a.Join(JoinOf(1, g->x1.token), deadline); });
    await([&] { return std::atomic_ref<uint64_t>(control(3)->generation).load() == 1; });
  };
  GroupOfFour four(options_a, options_b);
  g = &four;
  absl::StatusOr<v1::JoinResponse> join2;
  std::thread rank2([&] {
    join2 = four.b.Join(JoinOf(2, four.t.x2.token), absl::Now() + absl::Seconds(30));
  });
  await([&] { return std::atomic_ref<uint64_t>(control(2)->join_ticket).load() == 1; });
  const absl::StatusOr<v1::JoinResponse> join3 =
      four.b.Join(JoinOf(3, four.x3.token), absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(expiring);
  join0.join();
  join1.join();
  rank2.join();
  ASSERT_TRUE(published);
  EXPECT_EQ(join3.status(), absl::DeadlineExceededError(
                                "the group of 4 ranks formed (generation 1) as rank 3's join ran "
                                "out of time, and stops for it: join again"));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(lead_joins[r].ok()) << "rank " << r << ": " << lead_joins[r].status();
    EXPECT_EQ(lead_joins[r]->generation(), 1u);
  }
  ASSERT_TRUE(join2.ok()) << join2.status();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(AbortWord(four.t.x0, r, 4), kernels::kAbortRankGone | 3u) << "rank " << r;
    EXPECT_EQ(std::atomic_ref<const uint32_t>(control(r)->group_state).load(),
              kernels::kGroupBroken)
        << "rank " << r;
  }
}

// The lead is part-way through forming generation 1: rank 0 reads ready and still generation
// 0 (published last), holding generation 1's ticket. Rank 3, not joined, detaches then: its
// daemon stops the ranks still running its generation (0), which rank 0 is not (it was
// stopped, "rank 3 left", and the group the lead then published was half stopped).
TEST(NodeTest, ARankLeavingAsTheLeadFormsTheGroupStopsNoneOfTheRanksBeingFormed) {
  GroupOfFour g;
  kernels::RankControl* c0 = kernels::ControlOf(g.t.x0.arenas[0].data(), g.t.x0.layout);
  std::atomic_ref<uint32_t>(c0->group_state).store(kernels::kGroupReady);
  SetTicket(g.t.x0, 0, 1);
  ASSERT_TRUE(g.b.Detach(DetachOf(3, g.x3.token)).ok());
  EXPECT_EQ(AbortWord(g.t.x0, 0, 4), 0u);
  EXPECT_EQ(std::atomic_ref<const uint32_t>(c0->group_state).load(), kernels::kGroupReady);
}

// Node a is cut off from the balancer as node b commits plan v2, which takes ranks 0-1 (a's)
// out; its ranks rejoin on a, which still leads under v1. As b forms the group of ranks 2-3,
// every ticket asks for generation 1 and v1 is still committed in b's other plan buffer: a
// sees that b's ranks committed a newer plan and forms nothing (it used to form a group of
// four over b's, both generation 1, and reset the words of ranks b's group was running), and
// its Joins say why.
TEST(NodeTest, ADaemonBehindOnAChangeOfMembersFormsNoGroupOverTheNewOne) {
  GroupOfFour* g = nullptr;
  std::array<absl::StatusOr<v1::JoinResponse>, 2> behind;
  bool once = false;
  NodeOptions options_b = Hosting(2);
  options_b.forming_hook = [&] {
    if (std::exchange(once, true)) return;
    const absl::Time deadline = absl::Now() + absl::Milliseconds(500);
    std::thread join0([&] { behind[0] = g->a.Join(JoinOf(0, g->t.x0.token), deadline); });
    behind[1] = g->a.Join(JoinOf(1, g->x1.token), deadline);
    join0.join();
  };
  GroupOfFour four(Hosting(0), options_b);
  g = &four;
  std::array<absl::StatusOr<v1::JoinResponse>, 2> joined;
  std::thread join2([&] {
    joined[0] = four.b.Join(JoinOf(2, four.t.x2.token), absl::Now() + absl::Seconds(30));
  });
  std::thread join3([&] {
    joined[1] = four.b.Join(JoinOf(3, four.x3.token), absl::Now() + absl::Seconds(30));
  });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (four.b.Snapshot().joining < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  const v1::PrepareResponse prepared = four.b.Prepare(FourRankPlan(2, {0, 1}), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(four.b.Commit(2).ok());
  join2.join();
  join3.join();
  ASSERT_TRUE(once);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(joined[i].ok()) << "rank " << i + 2 << ": " << joined[i].status();
    EXPECT_EQ(joined[i]->generation(), 1u);
  }
  const absl::Status why = absl::DeadlineExceededError(
      "the group of 4 ranks did not form in time: the daemon of ranks 2, 3 committed plan v2, "
      "and this daemon is on v1 (ubep-balancer has not given it the plan: is its link to the "
      "balancer down?)");
  EXPECT_EQ(behind[0].status(), why);
  EXPECT_EQ(behind[1].status(), why);
  for (int r : {2, 3}) {
    EXPECT_EQ(AbortWord(four.t.x0, r, 4), 0u) << "rank " << r;
    EXPECT_EQ(std::atomic_ref<const uint32_t>(
                  kernels::ControlOf(four.t.x0.arenas[r].data(), four.t.x0.layout)->group_state)
                  .load(),
              kernels::kGroupReady)
        << "rank " << r;
  }
  // Joined again once b's group runs (a's ranks ask for generation 2): the same answer, not
  // that ranks 2-3 (running) are awaited.
  EXPECT_EQ(four.a.Join(JoinOf(0, four.t.x0.token), absl::Now() + absl::Milliseconds(300)).status(),
            why);
}

// Every member asks for the generation, and still the group does not form: a Join that runs
// out says what holds it back (it used to say "waiting for ranks " and name none). Here: the
// lead daemon (a, of rank 0) does not form it, for no call of a's looks at the tickets.
TEST(NodeTest, AJoinThatRunsOutWithEveryMemberJoinedNamesTheLeadDaemon) {
  GroupOfFour g;
  for (int r : {0, 1, 3}) SetTicket(g.t.x0, r, 1);
  EXPECT_EQ(g.b.Join(JoinOf(2, g.t.x2.token), absl::Now() + absl::Milliseconds(300)).status(),
            absl::DeadlineExceededError(
                "the group of 4 ranks did not form in time: every member joined, and the daemon "
                "of rank 0, which forms the group, has not formed it (is it up, and has it "
                "mapped every rank's arenas?)"));
}

// ... a member's daemon has not committed the plan in force here.
TEST(NodeTest, AJoinThatRunsOutWithEveryMemberJoinedNamesTheDaemonsBehindOnThePlan) {
  GroupOfFour g;
  const v1::PrepareResponse prepared = g.a.Prepare(FourRankPlan(2, {}), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(g.a.Commit(2).ok());
  for (int r : {1, 2, 3}) SetTicket(g.t.x0, r, 1);
  EXPECT_EQ(g.a.Join(JoinOf(0, g.t.x0.token), absl::Now() + absl::Milliseconds(300)).status(),
            absl::DeadlineExceededError(
                "the group of 4 ranks did not form in time: every member joined, and the daemon "
                "of ranks 2, 3 has not committed plan v2 (the group forms once every member runs "
                "it)"));
}

// ... a member's daemon committed a plan this one has prepared: its Commit is on its way (the
// balancer commits on every daemon at once), not a link to the balancer down.
TEST(NodeTest, AJoinThatRunsOutBehindAPlanPreparedHereSaysItsCommitHasNotCome) {
  GroupOfFour g;
  for (Node* node : {&g.b, &g.a}) {
    const v1::PrepareResponse prepared = node->Prepare(FourRankPlan(2, {}), 10);
    ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  }
  ASSERT_TRUE(g.b.Commit(2).ok());
  EXPECT_EQ(g.a.Join(JoinOf(0, g.t.x0.token), absl::Now() + absl::Milliseconds(300)).status(),
            absl::DeadlineExceededError(
                "the group of 4 ranks did not form in time: the daemon of ranks 2, 3 committed "
                "plan v2, and this daemon is on v1, the plan prepared here and its Commit not "
                "come yet"));
}

// ... a member's daemon restarted: the tickets read are in its old arenas (it died as its
// ranks joined), and the group waits for a plan that excludes them.
TEST(NodeTest, AJoinThatRunsOutWithARestartedMembersDaemonNamesIt) {
  Node a(Hosting(0));
  auto b = std::make_unique<Node>(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, *b);
  const Attached x1 = AttachAndClaim(a, 1, 4, 3);
  for (int r : {1, 2, 3}) SetTicket(t.x0, r, 1);
  b = std::make_unique<Node>(Hosting(2));  // The daemon of ranks 2-3 restarts.
  const Attached y2 =
      Claim(*b, AttachMapping(*b, 2, [&] { EXPECT_TRUE(MapPeer(*b, a, "a-1").ok()); }), 3);
  ASSERT_TRUE(a.PeerArenasWanted(2, 2, "b-2"));
  EXPECT_EQ(a.Join(JoinOf(0, t.x0.token), absl::Now() + absl::Milliseconds(300)).status(),
            absl::DeadlineExceededError(
                "the group of 4 ranks did not form in time: the daemon of ranks 2, 3 restarted "
                "and its new arenas are not mapped here yet (they are once a committed plan "
                "excludes them, which the balancer makes)"));
}

// As above, with node b draining instead: its ranks' Joins say so (not the group formed
// meanwhile), and the words the lead reset say again that they drain, so that their clients
// detach (must_attach_again) rather than join the draining daemon again.
TEST(NodeTest, AGroupFormedAsAPeerDaemonDrainsIsStoppedAndItsRanksStillDrain) {
  Node* other = nullptr;
  bool once = false;
  NodeOptions options = Hosting(0);
  options.forming_hook = [&] {
    if (std::exchange(once, true)) return;
    other->Drain();
  };
  GroupOfFour g(options);
  other = &g.b;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> j = g.Join();
  ASSERT_TRUE(once);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
  for (int r = 2; r < 4; ++r) {
    EXPECT_EQ(j[r].status(), absl::UnavailableError(
                                 "ubepd is draining (shutting down); attach again when it is "
                                 "back"))
        << "rank " << r;
  }
  auto state = [&](int r) {
    return std::atomic_ref<const uint32_t>(
               kernels::ControlOf(g.t.x0.arenas[r].data(), g.t.x0.layout)->group_state)
        .load();
  };
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(AbortWord(g.t.x0, r, 4), kernels::kAbortRankGone | 2u) << "rank " << r;
    EXPECT_EQ(state(r), kernels::kGroupBroken) << "rank " << r;
  }
  EXPECT_FALSE(g.b.AwaitDetached(absl::Milliseconds(10)));  // Its ranks are still attached.
  for (int r = 2; r < 4; ++r) {
    EXPECT_EQ(AbortWord(g.t.x0, r, 4), kernels::kAbortDraining) << "rank " << r;
    EXPECT_EQ(state(r), kernels::kGroupDraining) << "rank " << r;
  }
}

// A change of members stops the hosted ranks before it stages; the balancer's Abort of the
// plan while they stop (its Prepare timed out) is kept for it: once they have stopped, the
// Prepare fails and nothing is left undecided, which would block every later plan.
TEST(NodeTest, AnAbortWhileTheRanksStopForAChangeOfMembersFailsThatPrepare) {
  Node a(Hosting(0));
  auto b = std::make_unique<Node>(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, *b);
  v1::PrepareResponse prepared;
  std::thread prepare = PrepareDroppingRanks2And3(a, t, &prepared);
  EXPECT_TRUE(a.Abort(2).ok());
  prepare.join();
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "plan v2 was aborted while the hosted ranks stopped for it");
  EXPECT_EQ(a.State().pending_version(), 0u);
  EXPECT_EQ(a.State().committed_version(), 1u);
}

// A Prepare refused while another stops the group for a change of members ("being staged")
// leaves that change pending: the ranks joining again do not form the old group meanwhile
// (the refused Prepare used to clear the flag that holds formation back).
TEST(NodeTest, APrepareRefusedDuringAChangeOfMembersLeavesItPending) {
  GroupOfFour g;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> first = g.Join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(first[r].ok()) << "rank " << r << ": " << first[r].status();
  v1::PrepareResponse prepared;
  std::thread prepare = PrepareDroppingRanks2And3(g.a, g.t, &prepared);
  const v1::PrepareResponse refused = g.a.Prepare(FourRankPlan(3, {}), 20);
  EXPECT_FALSE(refused.prepared());
  EXPECT_EQ(refused.reason(), "the weights of plan v2 are being staged");
  // Every rank joins again; node a's ranks end plan v2's stop (it is prepared), and no group
  // forms at node a while v2 is undecided.
  std::array<absl::StatusOr<v1::JoinResponse>, 4> again;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  std::thread join1([&] { again[1] = g.a.Join(JoinOf(1, g.x1.token), deadline); });
  std::thread join2([&] { again[2] = g.b.Join(JoinOf(2, g.t.x2.token), deadline); });
  std::thread join3([&] { again[3] = g.b.Join(JoinOf(3, g.x3.token), deadline); });
  again[0] = g.a.Join(JoinOf(0, g.t.x0.token), deadline);
  join1.join();
  join2.join();
  join3.join();
  prepare.join();
  EXPECT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(again[0].status(),
            absl::DeadlineExceededError(
                "the group of 4 ranks did not form in time: plan v2, a change of members, is "
                "prepared here and undecided (the group forms once the balancer commits or "
                "aborts it)"));
}

// A drain while the hosted ranks stop for a change of members ends the Prepare at once, saying
// so (it used to wait out the stop, then blame ranks "still in a step").
TEST(NodeTest, ADrainWhileTheRanksStopForAChangeOfMembersFailsThatPrepareSayingSo) {
  Node a(Hosting(0));
  auto b = std::make_unique<Node>(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, *b);
  v1::PrepareResponse prepared;
  std::thread prepare = PrepareDroppingRanks2And3(a, t, &prepared);
  a.Drain();
  prepare.join();
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "ubepd is draining");
  EXPECT_EQ(a.State().pending_version(), 0u);
}

// Each daemon stops only the ranks a change of members asks it to stop (its own, and those
// whose membership changes). Here plan v2 drops node b's ranks 2-3: node a commits first and
// forms the new group of ranks 0-1 at once; node b's Commit, arriving after, stops its own
// ranks and leaves the new group running. (It used to mark every arena it maps broken, with
// no abort code: ranks 0-1 then failed their next step with "the group has re-formed or is
// forming without this rank" while their peers, past that check, waited for them.)
TEST(NodeTest, APeersLateCommitOfAChangeOfMembersLeavesTheGroupFormedWithoutItsRanks) {
  Node a(Hosting(0));
  Node b(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, b);
  const Attached x1 = AttachAndClaim(a, 1, 4, 3);
  absl::StatusOr<v1::JoinResponse> j0, j1, j2;
  std::thread join0([&] { j0 = a.Join(JoinOf(0, t.x0.token), absl::Now() + absl::Seconds(30)); });
  std::thread join1([&] { j1 = a.Join(JoinOf(1, x1.token), absl::Now() + absl::Seconds(30)); });
  std::thread join2([&] { j2 = b.Join(JoinOf(2, t.x2.token), absl::Now() + absl::Seconds(30)); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((a.Snapshot().joining < 2 || b.Snapshot().joining < 1) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  for (Node* node : {&a, &b}) {
    const v1::PrepareResponse prepared = node->Prepare(FourRankPlan(2, {2, 3}), 10);
    ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  }
  ASSERT_TRUE(a.Commit(2).ok());
  join0.join();
  join1.join();
  ASSERT_TRUE(j0.ok()) << j0.status();
  ASSERT_TRUE(j1.ok()) << j1.status();
  EXPECT_EQ(j0->generation(), 1u);
  EXPECT_EQ(j1->generation(), 1u);
  ASSERT_TRUE(b.Commit(2).ok());
  for (int r : {0, 1}) {
    const kernels::RankControl* c = kernels::ControlOf(t.x0.arenas[r].data(), t.x0.layout);
    EXPECT_EQ(std::atomic_ref<const uint32_t>(c->group_state).load(), kernels::kGroupReady)
        << "rank " << r;
    EXPECT_EQ(std::atomic_ref<const uint64_t>(c->generation).load(), 1u) << "rank " << r;
    EXPECT_EQ(AbortWord(t.x0, r, 4), 0u) << "rank " << r;
  }
  // Node b's own ranks are stopped, named as a change of members.
  for (int r : {2, 3}) {
    const kernels::RankControl* c = kernels::ControlOf(t.x2.arenas[r].data(), t.x2.layout);
    EXPECT_EQ(std::atomic_ref<const uint32_t>(c->group_state).load(), kernels::kGroupBroken)
        << "rank " << r;
    EXPECT_EQ(AbortWord(t.x2, r, 4), kernels::kAbortMembership) << "rank " << r;
  }
  // Rank 3, excluded, attaches and joins with a short deadline: it is told so, and why.
  const Attached x3 = AttachAndClaim(b, 3, 4, 4);
  EXPECT_EQ(b.Join(JoinOf(3, x3.token), absl::Now() + absl::Milliseconds(100)).status(),
            absl::DeadlineExceededError(
                "rank 3 is excluded from the EP group by plan v2 (its node failed or was "
                "drained); join again to wait for a plan that includes it"));
  // Rank 2, excluded, waits in Join for a plan that includes it, until it detaches.
  EXPECT_TRUE(b.Detach(DetachOf(2, t.x2.token)).ok());
  join2.join();
  EXPECT_EQ(j2.status(), absl::FailedPreconditionError("rank 2 detached while joining"));
}

// A plan that takes rank 1 back and drops node b's ranks 2-3: the group of ranks 0-1 forms as
// soon as node a has committed it (b hosts no member), and b's Commit, later, stops only the
// ranks it drops, not rank 1, which runs in the new group already. (It stopped every rank
// whose membership changed, rank 1 too: the group just formed broke at once.)
TEST(NodeTest, ALateCommitOnADaemonWithNoMembersLeavesTheRanksItTakesBackRunning) {
  balancer::Plan without1 = FourRankPlan(2, {1});  // The cluster's plan as the groups start.
  for (balancer::LayerPlan& layer : without1.layers) {
    for (int p = 0; p < 16; ++p) layer.slot_share[p] = p / 4 == 1 ? 0.0 : p % 8 < 4 ? 0.5 : 1.0;
  }
  NodeOptions options_a = Hosting(0), options_b = Hosting(2);
  for (NodeOptions* o : {&options_a, &options_b}) {
    o->cluster_plan = [&](absl::Time) { return std::optional<balancer::Plan>(without1); };
  }
  GroupOfFour g(options_a, options_b);
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::array<absl::StatusOr<v1::JoinResponse>, 4> j;
  {
    std::thread join0([&] { j[0] = g.a.Join(JoinOf(0, g.t.x0.token), deadline); });
    std::thread join2([&] { j[2] = g.b.Join(JoinOf(2, g.t.x2.token), deadline); });
    j[3] = g.b.Join(JoinOf(3, g.x3.token), deadline);
    join0.join();
    join2.join();
  }
  for (int r : {0, 2, 3}) ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
  // v3: ranks 0-1 only. Each daemon's Prepare stops its ranks, which join again.
  const balancer::Plan v3 = FourRankPlan(3, {2, 3});
  std::thread join0([&] { j[0] = g.a.Join(JoinOf(0, g.t.x0.token), deadline); });
  std::thread join1([&] { j[1] = g.a.Join(JoinOf(1, g.x1.token), deadline); });
  const v1::PrepareResponse on_a = g.a.Prepare(v3, 10);
  ASSERT_TRUE(on_a.prepared()) << on_a.reason();
  const absl::Time soon = absl::Now() + absl::Seconds(3);
  std::thread join2([&] { j[2] = g.b.Join(JoinOf(2, g.t.x2.token), soon); });
  std::thread join3([&] { j[3] = g.b.Join(JoinOf(3, g.x3.token), soon); });
  const v1::PrepareResponse on_b = g.b.Prepare(v3, 10);
  ASSERT_TRUE(on_b.prepared()) << on_b.reason();
  ASSERT_TRUE(g.a.Commit(3).ok());
  join0.join();
  join1.join();
  ASSERT_TRUE(j[0].ok()) << j[0].status();
  ASSERT_TRUE(j[1].ok()) << j[1].status();
  ASSERT_TRUE(g.b.Commit(3).ok());
  const auto& x = g.t.x0;  // Rank 0's mappings: every rank's arena.
  for (int r : {0, 1}) {
    EXPECT_EQ(std::atomic_ref<const uint32_t>(kernels::ControlOf(x.arenas[r].data(), x.layout)->group_state)
                  .load(),
              kernels::kGroupReady)
        << "rank " << r;
    EXPECT_EQ(AbortWord(x, r, 4), 0u) << "rank " << r;
  }
  join2.join();
  join3.join();
  for (int r : {2, 3}) {
    EXPECT_EQ(j[r].status(),
              absl::DeadlineExceededError(absl::StrCat(
                  "rank ", r, " is excluded from the EP group by plan v3 (its node failed or was "
                  "drained); join again to wait for a plan that includes it")));
  }
}

// A change of members that only one daemon prepared: node a stops its ranks 0-1 for plan v2
// (which drops rank 1, so node b's ranks 2-3 are stopped by their own daemon's Prepare, not by
// a's) and the Prepare fails there (its ranks do not stop in time); node b never gets it. Rank
// 0 joins again; ranks 2-3 still run generation 1, where they would wait for rank 0 until
// their wait timeout. Its Join stops those of them in that generation, naming rank 0 (rank 3
// is made to read as a member of a newer one, and is left alone).
TEST(NodeTest, AJoinStopsThePeersStillRunningTheGenerationTheRankWasStoppedIn) {
  NodeOptions quick = Hosting(0);
  quick.wait_timeout = absl::Milliseconds(50);  // Node a's Prepare waits this long for 0-1.
  GroupOfFour g(quick);
  Node& a = g.a;
  const TwoNodes& t = g.t;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> j = g.Join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
  ASSERT_EQ(j[0]->generation(), 1u);
  // Without rank 1: experts 0-3 stay on ranks 0 and 2, half each; 4-7 are rank 3's alone.
  balancer::Plan without1 = FourRankPlan(2, {1});
  for (balancer::LayerPlan& layer : without1.layers) {
    for (int p = 0; p < 16; ++p) layer.slot_share[p] = p / 4 == 1 ? 0.0 : p % 8 < 4 ? 0.5 : 1.0;
  }
  const v1::PrepareResponse prepared = a.Prepare(without1, 10);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(),
            "the hosted ranks did not stop within 50ms for the change of members (ranks 0, 1 "
            "still in a step: a serving loop that calls no BeginStep, Dispatch or Combine for "
            "that long?); the balancer tries again");
  auto state = [&](int r) {
    return std::atomic_ref<const uint32_t>(
               kernels::ControlOf(t.x0.arenas[r].data(), t.x0.layout)->group_state)
        .load();
  };
  EXPECT_EQ(state(0), kernels::kGroupBroken);
  EXPECT_EQ(state(1), kernels::kGroupBroken);
  EXPECT_EQ(state(2), kernels::kGroupReady);
  EXPECT_EQ(state(3), kernels::kGroupReady);
  std::atomic_ref<uint64_t>(kernels::ControlOf(t.x0.arenas[3].data(), t.x0.layout)->generation)
      .store(2);
  // Rank 0 joins again: the group of four cannot form (ranks 1-3 are not joining).
  const absl::StatusOr<v1::JoinResponse> again =
      a.Join(JoinOf(0, t.x0.token), absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(again.status(), absl::DeadlineExceededError(
                                "the group of 4 ranks did not form in time; waiting for ranks 1, 2 (on a "
                                "peer daemon), 3 (on a peer daemon)"));
  EXPECT_EQ(state(2), kernels::kGroupBroken);
  EXPECT_EQ(AbortWord(t.x0, 2, 4), kernels::kAbortRankGone | 0u);
  EXPECT_EQ(state(3), kernels::kGroupReady);
  EXPECT_EQ(AbortWord(t.x0, 3, 4), 0u);
  for (int r : {0, 1}) EXPECT_EQ(AbortWord(t.x0, r, 4), kernels::kAbortMembership) << "rank " << r;
}

// A change of members that this daemon refuses (here: the balancer puts its ranks in another
// load/store domain) stops nothing: the group runs on under the plan in force. (The group used
// to be stopped first, and every retry of the plan stopped it again.)
TEST(NodeTest, AChangeOfMembersRefusedByItsChecksStopsNoRank) {
  GroupOfFour g;
  Node& a = g.a;
  const TwoNodes& t = g.t;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> j = g.Join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
  balancer::Plan without1 = FourRankPlan(2, {1});
  for (balancer::LayerPlan& layer : without1.layers) {
    for (int p = 0; p < 16; ++p) layer.slot_share[p] = p / 4 == 1 ? 0.0 : p % 8 < 4 ? 0.5 : 1.0;
  }
  Node::RemoteWeights elsewhere;
  elsewhere.rank_domain = {7, 7, 0, 0};
  const v1::PrepareResponse prepared = a.Prepare(without1, 10, elsewhere);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "rank 0 is in domain 7 for the balancer but this daemon's is 0");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(std::atomic_ref<const uint32_t>(
                  kernels::ControlOf(t.x0.arenas[r].data(), t.x0.layout)->group_state)
                  .load(),
              kernels::kGroupReady)
        << "rank " << r;
    EXPECT_EQ(AbortWord(t.x0, r, 4), 0u) << "rank " << r;
  }
}

// Rank 3 found its daemon gone and wrote "rank 3 left" into rank 0's word; rank 0 answers it
// with a Join before rank 3 gets to the others' words. The others are told what rank 0 was
// told, that rank 3 left (not that rank 0 did, which would send an operator after the wrong
// rank), and rank 3 itself that rank 0 left.
TEST(NodeTest, ARankThatRejoinsPassesOnWhichRankLeft) {
  GroupOfFour g;
  Node& a = g.a;
  const TwoNodes& t = g.t;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> j = g.Join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
  const size_t abort = t.x0.layout.ep + kernels::ArenaLayout(ConfigOf(4)).abort;
  std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(t.x0.arenas[0].data() + abort))
      .store(kernels::kAbortRankGone | 3u);
  const absl::StatusOr<v1::JoinResponse> again =
      a.Join(JoinOf(0, t.x0.token), absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(again.status(), absl::DeadlineExceededError(
                                "the group of 4 ranks did not form in time; waiting for ranks 1, 2 (on a "
                                "peer daemon), 3 (on a peer daemon)"));
  for (int r : {0, 1, 2}) EXPECT_EQ(AbortWord(t.x0, r, 4), kernels::kAbortRankGone | 3u) << "rank " << r;
  EXPECT_EQ(AbortWord(t.x0, 3, 4), kernels::kAbortRankGone | 0u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(std::atomic_ref<const uint32_t>(
                  kernels::ControlOf(t.x0.arenas[r].data(), t.x0.layout)->group_state)
                  .load(),
              kernels::kGroupBroken)
        << "rank " << r;
  }
}

// A peer that offers arenas for ranks this daemon hosts (its --ranks misconfigured, or a stale
// record of the group) is refused before anything is marked: the hosted ranks do not read as
// restarted, which would refuse every plan until the group is created again.
TEST(NodeTest, ArenasOfferedForHostedRanksAreRefusedAndMarkNothing) {
  GroupOfFour g;
  const std::array<absl::StatusOr<v1::JoinResponse>, 4> j = g.Join();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(j[r].ok()) << "rank " << r << ": " << j[r].status();
  absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> arenas = g.b.ArenasForPeer(g.a.PeerKey());
  ASSERT_TRUE(arenas.ok()) << arenas.status();
  std::vector<int> fds;
  for (const UniqueFd& fd : arenas->second) fds.push_back(fd.get());
  EXPECT_EQ(g.a.AddPeerArenas(0, fds, "b-2"),
            absl::FailedPreconditionError("rank 0 is hosted here, not by the peer"));
  // A first rank near INT_MAX (the peer's own word) does not wrap past the range check.
  EXPECT_EQ(g.a.AddPeerArenas(std::numeric_limits<int>::max(), fds, "b-2"),
            absl::InvalidArgumentError(absl::StrCat("peer ranks ", std::numeric_limits<int>::max(),
                                                    "+", fds.size(), " are outside the group of 4")));
  const v1::PrepareResponse prepared = g.a.Prepare(FourRankPlan(2, {}), 10);
  EXPECT_TRUE(prepared.prepared()) << prepared.reason();
  // A member of another process said to host ranks 0-2, two of them b's peer's and one its
  // own: wrong as a whole, it marks none of the peer's ranks stale.
  EXPECT_FALSE(g.b.PeerArenasWanted(0, 3, "other"));
  EXPECT_TRUE(g.b.RestartedMembers().empty());
  const v1::PrepareResponse prepared_b = g.b.Prepare(FourRankPlan(2, {}), 10);
  EXPECT_TRUE(prepared_b.prepared()) << prepared_b.reason();
}

// The link's registration and every load report's outcome are ubepd's metrics: taken;
// refused by the balancer (INVALID_ARGUMENT, dropped); dropped for an answer the same report
// would get again (UNIMPLEMENTED: not a balancer); unanswered (UNAVAILABLE, sent again). A
// daemon whose reports stopped reaching the balancer showed nothing but a log line.
TEST(NodeTest, TheLinksRegistrationAndReportsAreCounted) {
  FakeBalancer balancer;
  BalancerLinkStats stats;
  ReportingGroup group(balancer, &stats);
  auto await = [&](const std::atomic<uint64_t>& counter) {
    return test::WaitFor([&] { return counter.load() > 0; }, absl::Seconds(20));
  };
  ASSERT_TRUE(await(stats.reports_taken));
  EXPECT_EQ(stats.registered.load(), 1);
  balancer.LoseAnswers(true, grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(await(stats.reports_refused));
  balancer.LoseAnswers(true, grpc::StatusCode::UNIMPLEMENTED);
  ASSERT_TRUE(await(stats.reports_dropped));
  balancer.LoseAnswers(false);
  balancer.Refuse(true);
  ASSERT_TRUE(await(stats.reports_unanswered));
  group.link.reset();  // Stopped: the counts hold still.
  DaemonMetrics metrics(&group.node, absl::Hours(1));
  std::map<std::string, double> seen;
  auto collect = [&] {
    seen.clear();
    for (const prometheus::MetricFamily& f : metrics.Collect()) {
      for (const prometheus::ClientMetric& m : f.metric) {
        if (f.name == "ubep_daemon_balancer_registered") seen[f.name] = m.gauge.value;
        if (f.name == "ubep_daemon_load_reports_total") {
          seen[f.name + "{" + m.label.at(0).value + "}"] = m.counter.value;
        }
      }
    }
  };
  collect();
  EXPECT_TRUE(seen.empty());  // A daemon without --balancer has none of them.
  metrics.ExposeLink(&stats);
  collect();
  EXPECT_EQ(seen, (std::map<std::string, double>{
                      {"ubep_daemon_balancer_registered", 1},
                      {"ubep_daemon_load_reports_total{dropped}",
                       static_cast<double>(stats.reports_dropped.load())},
                      {"ubep_daemon_load_reports_total{refused}",
                       static_cast<double>(stats.reports_refused.load())},
                      {"ubep_daemon_load_reports_total{taken}",
                       static_cast<double>(stats.reports_taken.load())},
                      {"ubep_daemon_load_reports_total{unanswered}",
                       static_cast<double>(stats.reports_unanswered.load())}}));
}

// ubep_daemon_imbalance_ratio is max over mean of the last harvest's received pairs over
// this daemon's own ranks: the peer's ranks, whose counters it does not read, do not count as
// idle ranks (which would double the ratio of two ranks of four).
TEST(NodeTest, TheImbalanceGaugeIsOverTheDaemonsOwnRanks) {
  Node a(Hosting(0));
  auto b = std::make_unique<Node>(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, *b);
  auto add = [&](int rank, int layer, std::vector<int32_t> per_slot) {
    AddLoad(t.x0, rank, layer, std::move(per_slot), ConfigOf(4));
  };
  auto gauge = [](const DaemonMetrics& metrics, const std::string& layer) -> std::optional<double> {
    for (const prometheus::MetricFamily& f : metrics.Collect()) {
      if (f.name != "ubep_daemon_imbalance_ratio") continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        if (m.label.size() == 1 && m.label[0].value == layer) return m.gauge.value;
      }
    }
    return std::nullopt;
  };
  add(0, 0, {30, 0, 0, 0});
  add(1, 0, {5, 5, 0, 0});
  add(0, 1, {0, 10, 0, 0});
  add(1, 1, {0, 0, 4, 16});
  add(2, 0, {0, 0, 0, 0});  // The peer's ranks: idle (and not this daemon's to judge).
  DaemonMetrics metrics(&a, absl::Hours(1));
  metrics.Harvest();
  EXPECT_EQ(gauge(metrics, "0"), 1.5);  // 30 x 2 ranks / 40.
  EXPECT_EQ(gauge(metrics, "1"), 20.0 * 2 / 30);
  // The next harvest judges what arrived since: 20 pairs, all on rank 1.
  add(1, 0, {20, 0, 0, 0});
  metrics.Harvest();
  EXPECT_EQ(gauge(metrics, "0"), 2.0);
  EXPECT_EQ(gauge(metrics, "1"), 20.0 * 2 / 30);  // Nothing new: the last measure stays,
  for (int i = 2; i < 10; ++i) metrics.Harvest();
  EXPECT_EQ(gauge(metrics, "1"), 20.0 * 2 / 30);
  // ... until ten harvests in a row saw nothing arrive: then no series (the last measure, held,
  // would read as current for as long as the layer is idle).
  metrics.Harvest();
  EXPECT_EQ(gauge(metrics, "1"), std::nullopt);
  EXPECT_EQ(gauge(metrics, "0"), 2.0);  // Its pairs came one harvest later.
  metrics.Harvest();
  EXPECT_EQ(gauge(metrics, "0"), std::nullopt);
  add(0, 1, {0, 0, 0, 8});
  add(1, 1, {0, 0, 8, 0});
  metrics.Harvest();
  EXPECT_EQ(gauge(metrics, "1"), 1.0);
}

// A group created again with the same layers and ranks (another model: here max_tokens)
// has new counters, from zero: the imbalance is judged from them alone, and the pairs the
// old group received stay counted (the counter only grows within the process).
TEST(NodeTest, AGroupCreatedAgainIsHarvestedFromItsOwnCounters) {
  Node node(Options());
  std::vector<Attached> old_group;
  old_group.push_back(AttachAndClaim(node, 0, 2, 1));
  old_group.push_back(AttachAndClaim(node, 1, 2, 2));
  auto family = [](const DaemonMetrics& metrics, const std::string& name) {
    std::vector<double> values;
    for (const prometheus::MetricFamily& f : metrics.Collect()) {
      if (f.name != name) continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        values.push_back(name == "ubep_daemon_imbalance_ratio" ? m.gauge.value : m.counter.value);
      }
    }
    return values;
  };
  DaemonMetrics metrics(&node, absl::Hours(1));
  AddLoad(old_group[0], 0, 0, {100, 0, 0, 0}, ConfigOf(2));
  AddLoad(old_group[0], 1, 0, {0, 100, 0, 0}, ConfigOf(2));
  metrics.Harvest();
  // Layer 0's pairs; layer 1 never received any: unmeasured, no series.
  EXPECT_THAT(family(metrics, "ubep_daemon_imbalance_ratio"), ElementsAre(1.0));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(node.Detach(DetachOf(r, old_group[r].token)).ok());
  }
  std::vector<Attached> group;
  for (uint32_t r = 0; r < 2; ++r) {
    v1::AttachRequest other_shape = Request(r, 2);
    other_shape.mutable_shape()->set_max_tokens(16);
    group.push_back(Claim(node, node.Attach(other_shape), 3 + r));
  }
  kernels::EpConfig config = ConfigOf(2);
  config.max_tokens = 16;
  AddLoad(group[0], 0, 0, {30, 0, 0, 0}, config);
  AddLoad(group[0], 1, 0, {0, 10, 0, 0}, config);
  metrics.Harvest();
  EXPECT_THAT(family(metrics, "ubep_daemon_received_tokens_total"), ElementsAre(240, 0));
  // The new group's 30 and 10 pairs: 30 x 2 ranks / 40 (not 30 - 100 and 10 - 100, nothing).
  EXPECT_THAT(family(metrics, "ubep_daemon_imbalance_ratio"), ElementsAre(1.5));
}

TEST(NodeTest, APeersNewArenasReplaceTheStaleOnesOnlyWhileItsRanksAreExcluded) {
  Node a(Hosting(0));
  auto b = std::make_unique<Node>(Hosting(2));
  TwoNodes t = AttachTwoNodes(a, *b);
  const absl::StatusOr<v1::AttachResponse>& r0 = t.r0;
  const absl::StatusOr<v1::AttachResponse>& r2 = t.r2;
  Attached& x0 = t.x0;
  // Two nodes of two ranks: each rank's senders visit near and far destinations in turn.
  EXPECT_EQ(r0->near_ranks(), 2u);
  EXPECT_EQ(r2->near_ranks(), 2u);
  EXPECT_FALSE(a.PeerArenasWanted(2, 2, "b-1"));

  b = std::make_unique<Node>(Hosting(2));  // The daemon of ranks 2-3 restarts.
  Attached y2 = Claim(*b, AttachMapping(*b, 2, [&] { EXPECT_TRUE(MapPeer(*b, a, "a-1").ok()); }), 3);
  std::memset(kernels::WeightBuffer(y2.arenas[2].data(), y2.layout, 0, 0), 0x5a, 256);
  EXPECT_TRUE(a.PeerArenasWanted(2, 2, "b-2"));
  EXPECT_EQ(MapPeer(a, *b, "b-2"),
            absl::FailedPreconditionError("rank 2 is a member under plan v1: its daemon's new "
                                          "arenas are mapped once a committed plan excludes it"));
  v1::PrepareResponse prepared = a.Prepare(FourRankPlan(2, {}), 10);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "the daemon of ranks 2, 3 restarted and its new arenas are not "
                               "mapped here yet (they are, once a committed plan excludes them)");

  // A change of members stops the hosted ranks first: rank 0 waits in Join (rank 1 never
  // attaches, so the group does not form).
  absl::StatusOr<v1::JoinResponse> joined;
  std::thread join([&] { joined = a.Join(JoinOf(0, x0.token), absl::Now() + absl::Seconds(30)); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (a.Snapshot().joining == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  prepared = a.Prepare(FourRankPlan(2, {2, 3}), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.copied_slots(), 0u);  // Ranks 0-1 keep their experts; 2-3 are not staged.
  ASSERT_TRUE(a.Commit(2).ok());
  ASSERT_TRUE(MapPeer(a, *b, "b-2").ok());
  EXPECT_FALSE(a.PeerArenasWanted(2, 2, "b-2"));
  absl::StatusOr<std::pair<uint64_t, std::vector<UniqueFd>>> refreshed = a.RefreshArenas(1);
  ASSERT_TRUE(refreshed.ok()) << refreshed.status();
  EXPECT_EQ(refreshed->first, r0->arena_epoch() + 1);
  ASSERT_EQ(refreshed->second.size(), 4u);
  absl::StatusOr<kernels::SharedArena> rank2 = kernels::SharedArena::Map(refreshed->second[2].get());
  ASSERT_TRUE(rank2.ok()) << rank2.status();
  EXPECT_EQ(static_cast<int>(*kernels::WeightBuffer(rank2->data(), x0.layout, 0, 0)), 0x5a);
  EXPECT_EQ(a.RefreshArenas(7).status(), absl::FailedPreconditionError("this connection holds no rank"));
  // A plan taking ranks 2-3 back is prepared now (their staging is their own daemon's).
  prepared = a.Prepare(FourRankPlan(3, {}), 10);
  EXPECT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_TRUE(a.Detach(DetachOf(0, x0.token)).ok());
  join.join();
  EXPECT_EQ(joined.status(), absl::FailedPreconditionError("rank 0 detached while joining"));
}

// Node b is cut off while node a commits plans v2 (without ranks 2-3) and v3 (with them
// again): a's plan areas keep v2 and v3, not b's v1. The plan that catches b up excludes its
// ranks, so it stages nothing and reads none of a's slot maps: b takes it (it refused it,
// "plan v1 is not in the plan area of rank 0", at every try, for good), and its ranks stop.
TEST(NodeTest, ADaemonTwoPlansBehindTakesThePlanThatExcludesItsRanks) {
  Node a(Hosting(0));
  Node b(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, b);
  // A change of members waits for the hosted ranks to stop: ranks 0 and 2 wait in Join (ranks
  // 1 and 3 never attach, so no group forms).
  absl::StatusOr<v1::JoinResponse> joined0, joined2;
  std::thread join0([&] { joined0 = a.Join(JoinOf(0, t.x0.token), absl::Now() + absl::Seconds(30)); });
  std::thread join2([&] { joined2 = b.Join(JoinOf(2, t.x2.token), absl::Now() + absl::Seconds(30)); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((a.Snapshot().joining == 0 || b.Snapshot().joining == 0) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  for (const auto& [version, excluded] :
       std::vector<std::pair<uint64_t, std::vector<int>>>{{2, {2, 3}}, {3, {}}}) {
    const v1::PrepareResponse prepared = a.Prepare(FourRankPlan(version, excluded), 10);
    ASSERT_TRUE(prepared.prepared()) << "v" << version << ": " << prepared.reason();
    ASSERT_TRUE(a.Commit(version).ok()) << "v" << version;
  }
  const v1::PrepareResponse prepared = b.Prepare(FourRankPlan(4, {2, 3}), 10);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.copied_slots(), 0u);
  ASSERT_TRUE(b.Commit(4).ok());
  EXPECT_EQ(b.State().committed_version(), 4u);
  EXPECT_EQ(AbortWord(t.x0, 2, 4), kernels::kAbortMembership);
  EXPECT_EQ(AbortWord(t.x0, 3, 4), kernels::kAbortMembership);
  // A plan that keeps b's ranks still reads the holders' maps, and still cannot be taken.
  const v1::PrepareResponse keeping = b.Prepare(FourRankPlan(5, {}), 10);
  EXPECT_FALSE(keeping.prepared());
  EXPECT_EQ(keeping.reason(), "plan v4 is not in the plan area of rank 0");
  for (auto [node, rank, token] : {std::tuple(&a, 0, t.x0.token), std::tuple(&b, 2, t.x2.token)}) {
    EXPECT_TRUE(node->Detach(DetachOf(rank, token)).ok()) << "rank " << rank;
  }
  join0.join();
  join2.join();
  EXPECT_EQ(joined0.status(), absl::FailedPreconditionError("rank 0 detached while joining"));
  EXPECT_EQ(joined2.status(), absl::FailedPreconditionError("rank 2 detached while joining"));
}

// Data-plane settings come from each daemon's flags, not from the clients' shape: a peer whose
// arenas were laid out for other ones (here flagged rows, then bsp) is refused by name before
// its arena size is compared, and nothing is mapped.
TEST(NodeTest, APeersArenasLaidOutForOtherDataPlaneSettingsAreRefusedByName) {
  Node a(Hosting(0));
  NodeOptions flagged = Hosting(2);
  flagged.flagged_tokens = 6;
  NodeOptions bsp = Hosting(2);
  bsp.protocol = kernels::Protocol::kBsp;
  bsp.free_buffers = 3;
  for (const auto& [options, expected] : std::vector<std::pair<NodeOptions, std::string>>{
           {flagged,
            "the peer's arena for rank 2 is laid out for protocol ubep, flagged_tokens "
            "6, 6 weight buffers per layer, host memory; this daemon's for protocol "
            "ubep, flagged_tokens 0, 6 weight buffers per layer, host memory: start "
            "every daemon of a group with the same --protocol, --flagged_tokens, "
            "--free_buffers and --backend"},
           {bsp,
            "the peer's arena for rank 2 is laid out for protocol bsp, flagged_tokens 0, 7 "
            "weight buffers per layer, host memory; this daemon's for protocol ubep, "
            "flagged_tokens 0, 6 weight buffers per layer, host memory: start every daemon "
            "of a group with the same --protocol, --flagged_tokens, --free_buffers and "
            "--backend"}}) {
    Node b(options);
    absl::StatusOr<v1::AttachResponse> r0, r2;
    std::thread ta([&] { r0 = a.Attach(Request(0, 4), absl::Now() + absl::Milliseconds(300)); });
    std::thread tb([&] { r2 = b.Attach(Request(2, 4), absl::Now() + absl::Milliseconds(300)); });
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while ((a.PeerKey().empty() || b.PeerKey().empty()) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(MapPeer(a, b, "b-1"), absl::FailedPreconditionError(expected));
    ta.join();
    tb.join();
    EXPECT_TRUE(a.PeerArenasWanted(2, 2, "b-1"));  // Nothing of b's was mapped.
  }
}

// Weights are copied without the node's lock: an RPC that takes it (ReportStep) is served
// meanwhile, and an Abort of the plan being staged makes the Prepare fail (nothing is left
// prepared).
TEST(NodeTest, StagingRunsWithoutTheLockAndAnAbortMeanwhileFailsThePrepare) {
  std::atomic<bool> in_hook = false;
  bool abort_in_hook = true;
  absl::Status report_status = absl::UnknownError("not called");
  Node* node_ptr = nullptr;
  std::string token;
  NodeOptions options = Options();
  options.staging_hook = [&] {
    in_hook = true;
    v1::ReportStepRequest report;
    report.set_rank(0);
    report.set_token(token);
    report_status = node_ptr->ReportStep(report).status();  // Would deadlock under the lock.
    if (abort_in_hook) {
      EXPECT_TRUE(node_ptr->Abort(2).ok());
    }
  };
  Node node(options);
  node_ptr = &node;
  Attached a = AttachAndClaim(node, 0, 2, 1);
  token = a.token;
  const v1::PrepareResponse prepared = node.Prepare(SwappedPlan(), 10);
  EXPECT_TRUE(in_hook);
  EXPECT_TRUE(report_status.ok()) << report_status;
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "plan v2 was aborted while its weights were staged");
  EXPECT_EQ(node.State().pending_version(), 0u);
  EXPECT_EQ(node.State().committed_version(), 1u);
  // The next Prepare of the same plan stages again and succeeds.
  abort_in_hook = false;
  const v1::PrepareResponse again = node.Prepare(SwappedPlan(), 10);
  EXPECT_TRUE(again.prepared()) << again.reason();
  EXPECT_EQ(again.copied_slots(), 4u);
  EXPECT_EQ(node.State().pending_version(), 2u);
}

// A plan over 4 ranks whose slots hold, per rank, `experts[r]` (4 each); equal shares.
balancer::Plan PlacedPlan(uint64_t version, const std::vector<std::vector<int>>& experts) {
  balancer::Plan plan;
  plan.version = version;
  plan.topology = {4, 2, 4, 1};
  plan.num_experts = 8;
  for (int l = 0; l < 2; ++l) {
    balancer::LayerPlan layer;
    for (const std::vector<int>& e : experts) layer.slot_expert.insert(layer.slot_expert.end(), e.begin(), e.end());
    balancer::SetEqualShares(8, layer);
    plan.layer_ids.push_back(l);
    plan.layers.push_back(layer);
  }
  return plan;
}

// A daemon whose ranks the plan all excludes computes no weight schedule. Under b's plan in
// force (v2) expert 6 is on rank 1 alone, and the Prepare says ranks 0 and 1 are in other
// domains with their daemon down: a plan moving expert 6 to rank 0 that b would stage for is
// refused by name, but b takes the one that excludes its ranks (b computed the schedule over
// its own plan before, which a daemon cut off from the cluster does over a stale one: it
// refused the plan that catches it up at every try while a holder of that plan was down).
TEST(NodeTest, ADaemonWhoseRanksThePlanExcludesComputesNoWeightSchedule) {
  Node a(Hosting(0));
  Node b(Hosting(2));
  const TwoNodes t = AttachTwoNodes(a, b);
  // v2: rank 3's slots 2-3 take experts 0-1, so that experts 6-7 are on rank 1 alone.
  const balancer::Plan v2 = PlacedPlan(2, {{0, 1, 2, 3}, {4, 5, 6, 7}, {0, 1, 2, 3}, {4, 5, 0, 1}});
  for (Node* node : {&a, &b}) {
    const v1::PrepareResponse prepared = node->Prepare(v2, 10);
    ASSERT_TRUE(prepared.prepared()) << prepared.reason();
    ASSERT_TRUE(node->Commit(2).ok());
  }
  for (int r : {0, 2}) {  // The ranks reach v2's step.
    std::atomic_ref<uint64_t>(kernels::ControlOf(t.x0.arenas[r].data(), t.x0.layout)->step).store(10);
  }
  // The change of members waits for the hosted ranks to stop: rank 2 waits in Join.
  absl::StatusOr<v1::JoinResponse> joined2;
  std::thread join2([&] { joined2 = b.Join(JoinOf(2, t.x2.token), absl::Now() + absl::Seconds(30)); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (b.Snapshot().joining == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  Node::RemoteWeights remote;
  remote.rank_domain = {7, 8, 0, 0};
  remote.rank_link = {-1, -1, 0, 0};  // Node a is down.
  // Experts 0 and 6 trade places between ranks 0 and 1.
  auto swapped = [](uint64_t version, std::vector<int> excluded) {
    balancer::Plan plan = FourRankPlan(version, std::move(excluded));
    for (balancer::LayerPlan& layer : plan.layers) std::swap(layer.slot_expert[0], layer.slot_expert[6]);
    return plan;
  };
  const v1::PrepareResponse staging = b.Prepare(swapped(3, {}), 20, remote);
  EXPECT_FALSE(staging.prepared());
  EXPECT_EQ(staging.reason(),
            "layer 0: expert 6 is held only in other domains by ranks whose daemons are down "
            "(rank 1)");
  const v1::PrepareResponse excluding = b.Prepare(swapped(4, {2, 3}), 20, remote);
  ASSERT_TRUE(excluding.prepared()) << excluding.reason();
  EXPECT_EQ(excluding.copied_slots(), 0u);
  ASSERT_TRUE(b.Commit(4).ok());
  EXPECT_EQ(b.State().committed_version(), 4u);
  EXPECT_EQ(AbortWord(t.x0, 2, 4), kernels::kAbortMembership);
  EXPECT_TRUE(b.Detach(DetachOf(2, t.x2.token)).ok());
  join2.join();
  EXPECT_EQ(joined2.status(), absl::FailedPreconditionError("rank 2 detached while joining"));
}

// Two daemons in two load/store domains (ranks 0-1 in domain 0, 2-3 in domain 1): a slot's new
// expert comes from the nearest holder; a holder only in the other domain is read through its
// daemon (ReadWeights), which serves exactly the buffer its committed plan maps.
TEST(NodeTest, WeightsOfHoldersInAnotherDomainAreReadThroughTheirDaemon) {
  NodeOptions oa = Hosting(0), ob = Hosting(2);
  oa.free_buffers = ob.free_buffers = 4;
  ob.domain = 1;
  Node a(oa), b(ob);
  absl::StatusOr<v1::AttachResponse> r2;
  std::thread tb([&] { r2 = b.Attach(Request(2, 4), absl::Now() + absl::Seconds(30)); });
  const absl::StatusOr<v1::AttachResponse> r0 = AttachMapping(a, 0, [&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (b.PeerKey().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_TRUE(MapPeer(a, b, "b-1").ok());
    EXPECT_TRUE(MapPeer(b, a, "a-1").ok());
  });
  tb.join();
  Attached x0 = Claim(a, r0, 1);
  Attached x2 = Claim(b, r2, 2);
  const kernels::EpConfig config = ConfigOf(4);
  // Every byte of (rank r, layer l, buffer i) is 16 r + 4 l + i: which buffer a copy came from.
  for (int r = 0; r < 4; ++r) {
    for (int l = 0; l < 2; ++l) {
      for (uint32_t i = 0; i < 8; ++i) std::memset(kernels::WeightBuffer(x0.arenas[r].data(), x0.layout, l, i), 16 * r + 4 * l + i, 256);
    }
  }
  Node::RemoteWeights remote;
  remote.rank_domain = {0, 0, 1, 1};
  std::vector<std::string> reads;
  auto read_from = [&](Node& holder) {
    return [&reads, &holder](int rank, uint64_t version, int layer, int slot, std::byte* out,
                              size_t bytes, const std::function<bool()>&) {
      for (size_t offset = 0; offset < bytes; offset += 100) {  // In chunks, as ubepd does.
        v1::ReadWeightsRequest q;
        q.set_plan_version(version);
        q.set_layer(static_cast<uint32_t>(layer));
        q.set_slot(static_cast<uint32_t>(slot));
        q.set_offset(offset);
        q.set_length(std::min<size_t>(100, bytes - offset));
        absl::StatusOr<v1::ReadWeightsResponse> read = holder.ReadWeights(q);
        if (!read.ok()) return read.status();
        std::memcpy(out + offset, read->data().data(), read->data().size());
      }
      reads.push_back(absl::StrCat("rank ", rank, " layer ", layer, " slot ", slot));
      return absl::OkStatus();
    };
  };
  // v2: experts 0-3 on ranks 0-1, 4-7 on ranks 2-3 (from v1's p % 8: copies within each domain).
  const balancer::Plan v2 = PlacedPlan(2, {{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}});
  remote.fetch = read_from(b);
  v1::PrepareResponse prepared = a.Prepare(v2, 10, remote);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.copied_slots(), 8u);  // Rank 1's 4 slots x 2 layers, from rank 0.
  EXPECT_EQ(prepared.remote_slots(), 0u);
  remote.fetch = read_from(a);
  prepared = b.Prepare(v2, 10, remote);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.remote_slots(), 0u);
  EXPECT_TRUE(reads.empty());
  ASSERT_TRUE(a.Commit(2).ok());
  ASSERT_TRUE(b.Commit(2).ok());
  for (int r : {0, 2}) std::atomic_ref<uint64_t>(kernels::ControlOf(x0.arenas[r].data(), x0.layout)->step).store(10);

  // v3: rank 0's slot 0 takes expert 4 (held only in domain 1), rank 2's slot 0 expert 0
  // (only in domain 0), rank 3's slot 3 expert 4 (rank 2 holds it: same domain).
  const balancer::Plan v3 = PlacedPlan(3, {{4, 1, 2, 3}, {0, 1, 2, 3}, {0, 5, 6, 7}, {4, 5, 6, 4}});
  v1::ReadWeightsRequest stale;
  stale.set_plan_version(3);
  stale.set_slot(8);
  EXPECT_EQ(b.ReadWeights(stale).status(), absl::FailedPreconditionError("this daemon is on plan v2, not v3"));
  stale.set_plan_version(2);
  stale.set_slot(4);
  EXPECT_EQ(b.ReadWeights(stale).status(),
            absl::InvalidArgumentError("slot 4 is on rank 1, which this daemon does not host (ranks 2-3)"));
  stale.set_slot(16);
  EXPECT_EQ(b.ReadWeights(stale).status(), absl::InvalidArgumentError("slot 16 is outside [0, 16)"));
  stale.set_slot(8);
  stale.set_layer(2);
  EXPECT_EQ(b.ReadWeights(stale).status(), absl::InvalidArgumentError("layer 2 is outside [0, 2)"));
  stale.set_layer(0);
  stale.set_offset(257);
  EXPECT_EQ(b.ReadWeights(stale).status(), absl::OutOfRangeError("offset 257 is past the expert's 256 bytes"));
  stale.set_offset(0);
  stale.set_length(Node::kMaxReadWeightsBytes + 1);
  EXPECT_EQ(b.ReadWeights(stale).status(),
            absl::InvalidArgumentError(absl::StrCat("length ", Node::kMaxReadWeightsBytes + 1,
                                                    " is over the ", Node::kMaxReadWeightsBytes,
                                                    " bytes of one read")));
  stale.set_length(0);

  // A holder daemon that cannot be read fails the Prepare, naming the copy.
  remote.fetch = [](int, uint64_t, int, int, std::byte*, size_t, const std::function<bool()>&) {
    return absl::UnavailableError("node-a (127.0.0.1:1): connection refused");
  };
  prepared = b.Prepare(v3, 20, remote);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "layer 0: staging rank 2's weights from rank 0 (domain 0): "
                               "node-a (127.0.0.1:1): connection refused");
  EXPECT_EQ(b.State().pending_version(), 0u);

  remote.fetch = read_from(b);
  prepared = a.Prepare(v3, 20, remote);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.copied_slots(), 2u);
  EXPECT_EQ(prepared.remote_slots(), 2u);
  EXPECT_EQ(prepared.remote_bytes(), 2u * 256);
  remote.fetch = read_from(a);
  prepared = b.Prepare(v3, 20, remote);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_EQ(prepared.copied_slots(), 4u);  // Rank 2 slot 0 (remote), rank 3 slot 3 (local).
  EXPECT_EQ(prepared.remote_slots(), 2u);
  // Rank 0 reads expert 4 from rank 2's slot 8 (its first holder after rank 1); rank 2 reads
  // expert 0 from rank 0's slot 0.
  EXPECT_THAT(reads, ::testing::ElementsAre("rank 2 layer 0 slot 8", "rank 2 layer 1 slot 8",
                                            "rank 0 layer 0 slot 0", "rank 0 layer 1 slot 0"));
  ASSERT_TRUE(a.Commit(3).ok());
  ASSERT_TRUE(b.Commit(3).ok());
  void* area = x0.arenas[0].data() + x0.layout.plan;
  uint64_t version = 0;
  const kernels::PlanTableHeader* table = kernels::SelectPlan(area, 20, &version);
  ASSERT_EQ(version, 3u);
  const int in_force = table == kernels::PlanBuffer(area, 0) ? 0 : 1;
  // What the copies brought: the bytes of the buffer each holder's slot mapped under v2.
  const auto buffer_of = [&](int r, int l, int i, int plan_buffer) {
    return kernels::SlotMap(x0.arenas[r].data(), x0.layout, config, plan_buffer)[l * 4 + i];
  };
  const auto bytes_of = [&](int r, int l, uint32_t buffer) {
    const std::byte* w = kernels::WeightBuffer(x0.arenas[r].data(), x0.layout, l, buffer);
    return std::vector<std::byte>(w, w + 256);
  };
  for (int l = 0; l < 2; ++l) {
    // Rank 2's slot 0 under v2 held expert 4 as staged from rank 3's buffer 0 (16 * 3 + 4 l).
    const std::vector<std::byte> expert4 = bytes_of(2, l, buffer_of(2, l, 0, 1 - in_force));
    EXPECT_EQ(static_cast<int>(expert4[0]), 16 * 3 + 4 * l);
    EXPECT_EQ(bytes_of(0, l, buffer_of(0, l, 0, in_force)), expert4);
    // Rank 0's slot 0 under v2 held expert 0 in its own buffer 0 (4 l).
    const std::vector<std::byte> expert0 = bytes_of(0, l, buffer_of(0, l, 0, 1 - in_force));
    EXPECT_EQ(static_cast<int>(expert0[255]), 4 * l);
    EXPECT_EQ(bytes_of(2, l, buffer_of(2, l, 0, in_force)), expert0);
    // Rank 3's slot 3 took expert 4 from rank 2 (same domain), a copy between arenas.
    EXPECT_EQ(bytes_of(3, l, buffer_of(3, l, 3, in_force)), expert4);
  }
  // A peer asking for arenas names its backend: a host daemon gives none to a cuda one (whose
  // arenas come with device arenas), and a request without one is malformed.
  const std::string key = a.PeerKey();
  ASSERT_TRUE(key.starts_with("host:"));
  EXPECT_EQ(b.ArenasForPeer("cuda:" + key.substr(5)).status(),
            absl::FailedPreconditionError("the peer daemon runs the cuda backend, this one host"));
  EXPECT_EQ(b.ArenasForPeer("no backend named").status(), absl::InvalidArgumentError("malformed peer request"));
  EXPECT_TRUE(b.ArenasForPeer(key).ok());

  // A drain while a read from another domain hangs: the read is told to stop (it asks between
  // its chunks, as ubepd's reads do) and the Prepare fails saying why, at once, rather than
  // holding the drain (and the daemon's exit) until the balancer's deadline.
  for (int r : {0, 2}) std::atomic_ref<uint64_t>(kernels::ControlOf(x0.arenas[r].data(), x0.layout)->step).store(20);
  const balancer::Plan v4 = PlacedPlan(4, {{5, 1, 2, 3}, {0, 1, 2, 3}, {0, 5, 6, 7}, {4, 5, 6, 4}});
  std::atomic<bool> told_to_stop{false}, fetching{false};
  remote.fetch = [&](int, uint64_t, int, int, std::byte*, size_t,
                     const std::function<bool()>& stopped) {
    fetching = true;
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (!stopped() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
    told_to_stop = stopped();
    return absl::CancelledError("the staging stopped");
  };
  std::thread drain([&] {  // Once the read hangs (not before the Prepare reaches it).
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (!fetching && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    a.Drain();
  });
  prepared = a.Prepare(v4, 30, remote);
  drain.join();
  EXPECT_TRUE(told_to_stop);
  EXPECT_FALSE(prepared.prepared());
  EXPECT_EQ(prepared.reason(), "ubepd is draining");
  (void)x2;
}

// The group's staging schedule, which every daemon computes alike (the NCCL link's sends and
// receives are matched by it): nearest holder first, in (layer, rank, slot) order; a rank
// taken back is staged whole; excluded ranks are neither staged nor holders.
TEST(NodeTest, SlotCopiesTakeTheNearestHolderInOneOrderForEveryDaemon) {
  const balancer::Plan v2 = PlacedPlan(2, {{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}});
  const balancer::Plan v3 = PlacedPlan(3, {{4, 1, 2, 3}, {0, 1, 2, 3}, {0, 5, 6, 7}, {4, 5, 6, 4}});
  const auto domain = [](int r) { return static_cast<uint32_t>(r / 2); };
  absl::StatusOr<std::vector<Node::SlotCopy>> copies = Node::SlotCopies(v2, v3, domain);
  ASSERT_TRUE(copies.ok()) << copies.status();
  std::vector<std::string> got;
  for (const Node::SlotCopy& c : *copies) {
    got.push_back(absl::StrCat(c.layer, ":", c.rank, ".", c.slot, "<-", c.holder, "@", c.distance));
  }
  EXPECT_THAT(got, ::testing::ElementsAre("0:0.0<-8@2", "0:2.0<-0@2", "0:3.3<-12@0",
                                          "1:0.0<-8@2", "1:2.0<-0@2", "1:3.3<-12@0"));
  // One domain: rank 2's expert 0 now comes from rank 0 at distance 1.
  copies = Node::SlotCopies(v2, v3, [](int) { return 0u; });
  ASSERT_TRUE(copies.ok());
  EXPECT_EQ((*copies)[1].holder, 0);
  EXPECT_EQ((*copies)[1].distance, 1);
  // Rank 1 excluded under v2 and taken back by v3: all its slots; rank 3 excluded by v3.
  balancer::Plan v2x = v2, v3x = v3;
  v2x.excluded_ranks = {1};
  v3x.excluded_ranks = {3};
  copies = Node::SlotCopies(v2x, v3x, domain);
  ASSERT_TRUE(copies.ok());
  got.clear();
  for (const Node::SlotCopy& c : *copies) {
    if (c.layer == 0) got.push_back(absl::StrCat(c.rank, ".", c.slot, "<-", c.holder, "@", c.distance));
  }
  EXPECT_THAT(got, ::testing::ElementsAre("0.0<-8@2", "1.0<-0@1", "1.1<-1@1", "1.2<-2@1", "1.3<-3@1",
                                          "2.0<-0@2"));
  // An expert no included rank holds.
  v2x.excluded_ranks = {2, 3};
  EXPECT_EQ(Node::SlotCopies(v2x, v3, domain).status(),
            absl::FailedPreconditionError("layer 0: expert 4 has no holder"));
  // Three domains, rank 2's daemon down (the plan that excludes it is being staged): rank 0
  // takes expert 4 from rank 3, which also holds it, not from rank 2, which comes first and
  // cannot be read. With rank 3's daemon down too, no copy can be made, and that is said.
  const balancer::Plan v4 = PlacedPlan(4, {{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}});
  balancer::Plan v5 = PlacedPlan(5, {{4, 1, 2, 3}, {0, 5, 6, 7}, {0, 1, 2, 3}, {4, 5, 6, 7}});
  v5.excluded_ranks = {2};
  const std::vector<uint32_t> three = {0, 0, 1, 2};
  const auto domain_of = [&](int r) { return three[r]; };
  copies = Node::SlotCopies(v4, v5, domain_of, [](int q) { return q != 2; });
  ASSERT_TRUE(copies.ok()) << copies.status();
  got.clear();
  for (const Node::SlotCopy& c : *copies) {
    if (c.layer == 0) got.push_back(absl::StrCat(c.rank, ".", c.slot, "<-", c.holder, "@", c.distance));
  }
  EXPECT_THAT(got, ::testing::ElementsAre("0.0<-12@2", "1.1<-13@2", "1.2<-14@2", "1.3<-15@2"));
  EXPECT_EQ(Node::SlotCopies(v4, v5, domain_of, [](int q) { return q < 2; }).status(),
            absl::FailedPreconditionError("layer 0: expert 4 is held only in other domains by "
                                          "ranks whose daemons are down (rank 2)"));
  // Rank 2's daemon restarted instead (its new arenas may not hold the weights yet): rank 3,
  // which also holds expert 4, is taken first; with rank 3's restarted too, rank 2 is still
  // read (the copy of last resort) rather than no copy made.
  const auto rank_restarted = [](std::set<int> restarted) {
    return [restarted](int q) { return restarted.contains(q); };
  };
  copies = Node::SlotCopies(v4, v5, domain_of, nullptr, rank_restarted({2}));
  ASSERT_TRUE(copies.ok()) << copies.status();
  got.clear();
  for (const Node::SlotCopy& c : *copies) {
    if (c.layer == 0 && c.rank == 0) got.push_back(absl::StrCat(c.rank, ".", c.slot, "<-", c.holder, "@", c.distance));
  }
  EXPECT_THAT(got, ::testing::ElementsAre("0.0<-12@2"));
  copies = Node::SlotCopies(v4, v5, domain_of, nullptr, rank_restarted({2, 3}));
  ASSERT_TRUE(copies.ok()) << copies.status();
  got.clear();
  for (const Node::SlotCopy& c : *copies) {
    if (c.layer == 0 && c.rank == 0) got.push_back(absl::StrCat(c.rank, ".", c.slot, "<-", c.holder, "@", c.distance));
  }
  EXPECT_THAT(got, ::testing::ElementsAre("0.0<-8@2"));
}

// Over an NCCL link each daemon issues its share of the schedule: every pair of daemons gets
// matching sends and receives in the same order and in the same batches, whatever the other
// daemons' copies between them.
TEST(NodeTest, LinkOpsPairEverySendWithItsReceiveInOrderAndBatch) {
  const balancer::Plan v2 = PlacedPlan(2, {{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}});
  const balancer::Plan v3 = PlacedPlan(3, {{4, 1, 2, 3}, {0, 1, 2, 3}, {0, 5, 6, 7}, {4, 5, 6, 4}});
  // Three daemons: ranks 0 (link rank 0), 1 (2) and 2-3 (1), each its own domain.
  const std::vector<int> rank_link = {0, 2, 1, 1};
  const std::vector<uint32_t> domains = {0, 2, 1, 1};
  const std::vector<Node::SlotCopy> schedule =
      *Node::SlotCopies(v2, v3, [&](int r) { return domains[r]; });
  const std::vector<std::pair<int, int>> hosting = {{0, 1}, {2, 2}, {1, 1}};  // By link rank.
  std::vector<std::vector<Node::LinkOp>> ops;
  for (const auto& [first, hosted] : hosting) {
    absl::StatusOr<std::vector<Node::LinkOp>> got = Node::LinkOps(schedule, first, hosted, rank_link, 4, 3);
    ASSERT_TRUE(got.ok()) << got.status();
    ops.push_back(*got);
  }
  const auto describe = [](const std::vector<Node::LinkOp>& list) {
    std::vector<std::string> out;
    for (const Node::LinkOp& op : list) {
      out.push_back(absl::StrCat(op.send ? "send " : "recv ", op.copy, " peer ", op.peer, " batch ", op.batch));
    }
    return out;
  };
  // Schedule: [0] 0:0.0<-8, [1] 0:2.0<-0, [2] 0:3.3<-12 (same rank), [3] 1:0.0<-8, [4] 1:2.0<-0,
  // [5] 1:3.3<-12; four cross-domain copies, three per batch.
  EXPECT_THAT(describe(ops[0]), ::testing::ElementsAre("recv 0 peer 1 batch 0", "send 1 peer 1 batch 0",
                                                       "recv 3 peer 1 batch 0", "send 4 peer 1 batch 1"));
  EXPECT_THAT(describe(ops[1]), ::testing::ElementsAre("send 0 peer 0 batch 0", "recv 1 peer 0 batch 0",
                                                       "send 3 peer 0 batch 0", "recv 4 peer 0 batch 1"));
  EXPECT_THAT(describe(ops[2]), ::testing::IsEmpty());  // Rank 1's slots keep their experts.
  // Generally: what A sends B, in order and batch, is what B receives from A.
  for (int a = 0; a < 3; ++a) {
    for (int b = 0; b < 3; ++b) {
      std::vector<std::pair<int, int>> sent, received;
      for (const Node::LinkOp& op : ops[a]) if (op.send && op.peer == b) sent.push_back({op.copy, op.batch});
      for (const Node::LinkOp& op : ops[b]) if (!op.send && op.peer == a) received.push_back({op.copy, op.batch});
      EXPECT_EQ(sent, received) << a << " -> " << b;
    }
  }
  EXPECT_EQ(Node::LinkOps(schedule, 0, 1, {0, 2, -1, 1}, 4, 3).status(),
            absl::FailedPreconditionError("layer 0: rank 2 is on no daemon of the NCCL link"));
}

// The daemon's fd socket: an FdServer over a Node, with short timeouts.
class FdServerTest : public ::testing::Test {
 protected:
  FdServerTest() {
    NodeOptions options = Options();
    options.fd_socket_path = path_;
    node_ = std::make_unique<Node>(options);
    FdServerOptions server;
    server.send_timeout = absl::Milliseconds(200);
    server.unclaimed_timeout = absl::Seconds(1);
    server.max_unclaimed = 3;
    Serve(server);
  }

  // The server on path_, started again with `options`.
  void Serve(const FdServerOptions& options) {
    server_.reset();
    absl::StatusOr<std::unique_ptr<FdServer>> started = FdServer::Start(path_, 0600, node_.get(), options);
    EXPECT_TRUE(started.ok()) << started.status();
    if (started.ok()) server_ = *std::move(started);
  }

  UniqueFd Connect() {
    absl::StatusOr<UniqueFd> c = ConnectUnix(path_, absl::Seconds(5));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : UniqueFd();
  }
  // Rank 0 of a one-rank group, attached and claimed on a connection, as libubep does.
  UniqueFd Claimed() { return ClaimedRank(0, 1, nullptr); }
  // Rank `rank` of a group of `world`, likewise; its attach token into `token`.
  UniqueFd ClaimedRank(uint32_t rank, uint32_t world, std::string* token) {
    v1::AttachRequest request = Request(rank, world);
    request.mutable_shape()->set_num_experts(4);
    absl::StatusOr<v1::AttachResponse> attached = node_->Attach(request);
    EXPECT_TRUE(attached.ok()) << attached.status();
    if (token != nullptr && attached.ok()) *token = attached->token();
    UniqueFd c = Connect();
    EXPECT_TRUE(SendMessage(c.get(), attached->token(), {}).ok());
    absl::StatusOr<ReceivedMessage> reply = ReceiveMessage(c.get(), 64, absl::Seconds(5));
    EXPECT_TRUE(reply.ok()) << reply.status();
    if (reply.ok()) {
      EXPECT_EQ(reply->bytes, "OK");
    }
    return c;
  }
  // The answer the server gives a connection that sends an unknown token.
  std::string AnswerToABadToken() {
    UniqueFd c = Connect();
    absl::StatusOr<ReceivedMessage> reply = Exchange(c.get(), "no such token", 256, absl::Seconds(5));
    return reply.ok() ? reply->bytes : std::string(reply.status().message());
  }

  test::TempDir dir_;
  const std::string path_ = dir_.path() + "/ubepd.sock.fds";
  std::unique_ptr<Node> node_;
  std::unique_ptr<FdServer> server_;  // Destroyed before the node it serves.
};

// A connection that sends nothing is closed after the unclaimed timeout; one that holds a
// rank stays open however quiet it is.
TEST_F(FdServerTest, AConnectionThatClaimsNoRankIsClosedAndOneThatHoldsARankIsKept) {
  UniqueFd idle = Connect();
  UniqueFd claimed = Claimed();
  absl::StatusOr<ReceivedMessage> end = ReceiveMessage(idle.get(), 64, absl::Seconds(10));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->closed);
  absl::StatusOr<ReceivedMessage> none = ReceiveMessage(claimed.get(), 64, absl::Milliseconds(500));
  EXPECT_EQ(none.status(), absl::DeadlineExceededError("no message within 500ms"));
  EXPECT_EQ(node_->Snapshot().attached, 1);
}

// A client that detaches by RPC and keeps its fd connection open holds no rank any more: the
// connection is unclaimed again, and closed after the unclaimed timeout (repeated, such
// connections would use up the daemon's descriptors).
TEST_F(FdServerTest, AConnectionWhoseRankWasDetachedIsClosedAfterTheUnclaimedTimeout) {
  FdServerOptions options;
  options.unclaimed_timeout = absl::Milliseconds(300);
  options.held_check_interval = absl::Milliseconds(50);
  Serve(options);
  std::string token;
  UniqueFd kept = ClaimedRank(0, 2, nullptr);
  UniqueFd detached = ClaimedRank(1, 2, &token);
  ASSERT_EQ(node_->Snapshot().attached, 2);
  ASSERT_TRUE(node_->Detach(DetachOf(1, token)).ok());
  absl::StatusOr<ReceivedMessage> end = ReceiveMessage(detached.get(), 64, absl::Seconds(10));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->closed);
  absl::StatusOr<ReceivedMessage> none = ReceiveMessage(kept.get(), 64, absl::Milliseconds(500));
  EXPECT_EQ(none.status(), absl::DeadlineExceededError("no message within 500ms"));
  EXPECT_EQ(node_->Snapshot().attached, 1);
}

// A connection that holds a rank and claims another (a second token on it) is refused and
// closed by ubepd: its rank is gone, and the log says that ubepd closed the connection and
// why, not that the rank's process disconnected.
TEST_F(FdServerTest, AConnectionUbepdClosesIsLoggedAsClosedByUbepdWithTheReason) {
  UniqueFd held = ClaimedRank(0, 2, nullptr);
  v1::AttachRequest second = Request(1, 2);
  second.mutable_shape()->set_num_experts(4);
  const absl::StatusOr<v1::AttachResponse> attached = node_->Attach(second);
  ASSERT_TRUE(attached.ok()) << attached.status();
  ::testing::internal::CaptureStderr();
  absl::StatusOr<ReceivedMessage> reply = Exchange(held.get(), attached->token(), 256, absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->bytes, "ERR this connection holds rank 0 already; each rank claims its arenas "
                          "on a connection of its own");
  absl::StatusOr<ReceivedMessage> end = ReceiveMessage(held.get(), 64, absl::Seconds(10));
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->closed);
  // Rank 1's ticket stays.
  const bool gone = test::WaitFor([&] { return node_->Snapshot().attached == 1; }, absl::Seconds(10));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(gone);
  EXPECT_THAT(log, HasSubstr(std::string(
                       "rank 0 (pid 100): ubepd closed its fd connection (a claim refused: "
                       "FAILED_PRECONDITION: this connection holds rank 0 already; each rank "
                       "claims its arenas on a connection of its own): marking it gone")));
  EXPECT_THAT(log, Not(HasSubstr("disconnected without detaching")));
}

// A connection that holds no rank and is closed by ubepd (here, for a claim it refused) is
// logged with the pid of the process that connected and the reason; its client gets the
// reason too. Before, only a connection that held a rank was logged.
TEST_F(FdServerTest, AConnectionThatHeldNoRankClosedByUbepdIsLoggedWithItsPidAndWhy) {
  ::testing::internal::CaptureStderr();
  UniqueFd c = Connect();
  absl::StatusOr<ReceivedMessage> reply = Exchange(c.get(), "no such token", 256, absl::Seconds(5));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->bytes, "ERR unknown or already used attach token; attach again");
  // The server logs before it closes the connection.
  absl::StatusOr<ReceivedMessage> end = ReceiveMessage(c.get(), 64, absl::Seconds(10));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_TRUE(end->closed);
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "fd server: closed the connection of pid ", getpid(),
                       ", which held no rank: a claim refused: NOT_FOUND: unknown or already "
                       "used attach token; attach again")));
}

// A client that sends requests and never reads the replies fills its queue: the server gives
// up on it after the send timeout (its rank is detached) and goes on serving others.
TEST_F(FdServerTest, AClientThatTakesNoReplyCannotStallTheServer) {
  UniqueFd greedy = Claimed();
  ::testing::internal::CaptureStderr();
  int sent = 0;
  while (sent < 100000 &&
         SendMessage(greedy.get(), kArenaRefreshRequest, {}, absl::Seconds(2)).ok()) {
    ++sent;
  }
  EXPECT_LT(sent, 100000) << "the server kept taking requests whose replies are not read";
  EXPECT_EQ(AnswerToABadToken(), "ERR unknown or already used attach token; attach again");
  EXPECT_EQ(node_->Snapshot().attached, 0);
  // The log names the process whose reply was not sent.
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr(absl::StrCat("fd server: a reply to pid ", getpid(), " was not sent: ")));
}

// A connection that holds a rank and sends anything but a refresh (a peer's request, its
// token again) is closed, and the rank with it: the client sees its connection end, and the
// daemon does not keep a rank attached to a connection it no longer has (which would refuse
// the rank's next Attach as held by another process, and hold every drain until its timeout).
TEST_F(FdServerTest, AMessageOutOfPlaceOnARanksConnectionEndsTheConnectionAndTheRank) {
  // Each message, and the refusal it is answered before the end.
  const std::pair<std::string, std::string> cases[] = {
      {std::string(kPeerRequest) + "key", "ERR malformed peer request"},
      {"a token", "ERR unknown or already used attach token; attach again"}};
  for (const auto& [message, refusal] : cases) {
    SCOPED_TRACE(message);
    UniqueFd claimed = Claimed();
    ASSERT_EQ(node_->Snapshot().attached, 1);
    ASSERT_TRUE(SendMessage(claimed.get(), message, {}).ok());
    absl::StatusOr<ReceivedMessage> reply = ReceiveMessage(claimed.get(), 256, absl::Seconds(5));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_FALSE(reply->closed);
    EXPECT_EQ(reply->bytes, refusal);
    reply = ReceiveMessage(claimed.get(), 256, absl::Seconds(5));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_TRUE(reply->closed);
    EXPECT_EQ(node_->Snapshot().attached, 0);
  }
}

// Descriptors a client passes along with its message (none is asked for) are closed by the
// server whatever the message: a bad token, a malformed peer request, a good claim. Each
// message carries the write end of a pipe; once the server has answered and this end is
// closed here, the read end sees end-of-file only if no copy of the write end is left open.
TEST_F(FdServerTest, DescriptorsAClientPassesAreClosedWhateverItsMessage) {
  std::string token;
  {
    v1::AttachRequest request = Request(0, 1);
    request.mutable_shape()->set_num_experts(4);
    absl::StatusOr<v1::AttachResponse> attached = node_->Attach(request);
    ASSERT_TRUE(attached.ok()) << attached.status();
    token = attached->token();
  }
  const std::pair<std::string, std::string> cases[] = {
      {"no such token", "ERR unknown or already used attach token; attach again"},
      {std::string(kPeerRequest) + "key", "ERR malformed peer request"},
      {token, "OK"}};
  for (const auto& [message, answer] : cases) {
    SCOPED_TRACE(message);
    int ends[2];
    ASSERT_EQ(pipe2(ends, O_CLOEXEC), 0);
    UniqueFd read_end(ends[0]), write_end(ends[1]);
    UniqueFd c = Connect();
    const int passed[] = {write_end.get(), write_end.get()};
    ASSERT_TRUE(SendMessage(c.get(), message, passed).ok());
    absl::StatusOr<ReceivedMessage> reply = ReceiveMessage(c.get(), 256, absl::Seconds(5));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->bytes, answer);
    write_end.reset();
    pollfd p{read_end.get(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 5000), 1) << "a copy of the write end is still open";
    char byte;
    EXPECT_EQ(read(read_end.get(), &byte, 1), 0);
  }
}

// Connections that claim no rank are bounded: past the limit, the oldest that sent nothing
// (a client sends its token at once) is answered and closed to make room, so that idle
// connections cannot keep clients out (they did, each for the unclaimed timeout: a process
// holding 64 open shut out every client and peer daemon); where every one has spoken (ranks
// detached by RPC, their connections kept), a new connection is answered at once (its client
// fails, rather than waiting out its timeout) and closed.
TEST_F(FdServerTest, ConnectionsPastTheLimitOfUnclaimedOnesAreAnsweredAndClosed) {
  FdServerOptions options;
  options.max_unclaimed = 3;
  options.unclaimed_timeout = absl::Seconds(30);  // Kept open however slow the machine.
  options.held_check_interval = absl::Milliseconds(20);
  Serve(options);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(Connect());
  EXPECT_EQ(AnswerToABadToken(), "ERR unknown or already used attach token; attach again");
  absl::StatusOr<ReceivedMessage> evicted = ReceiveMessage(idle[0].get(), 256, absl::Seconds(10));
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_EQ(evicted->bytes,
            "ERR the daemon holds 3 connections that claimed no rank yet (at most 3); this one, "
            "the oldest that sent nothing, is closed to make room: attach again");
  // A connection that holds a rank does not count, and one that claims makes room as well.
  UniqueFd claimed = Claimed();
  EXPECT_EQ(node_->Snapshot().attached, 1);
  idle.clear();
  claimed = UniqueFd();
  ASSERT_TRUE(test::WaitFor([&] { return node_->Snapshot().attached == 0; }, absl::Seconds(10)));
  // Three ranks detached by RPC, their connections kept: unclaimed again, but they spoke.
  std::vector<UniqueFd> detached;
  for (uint32_t r = 0; r < 3; ++r) {
    std::string token;
    detached.push_back(ClaimedRank(r, 3, &token));
    ASSERT_TRUE(node_->Detach(DetachOf(r, token)).ok());
  }
  const std::string refused =
      "ERR the daemon holds 3 connections that claimed no rank yet (at most 3); attach again "
      "later";
  std::string answer;
  EXPECT_TRUE(test::WaitFor([&] { return (answer = AnswerToABadToken()) == refused; },
                            absl::Seconds(10)))
      << answer;
  detached.pop_back();
  EXPECT_TRUE(test::WaitFor(
      [&] {
        return (answer = AnswerToABadToken()) ==
               "ERR unknown or already used attach token; attach again";
      },
      absl::Seconds(10)))
      << answer;
}

// Out of file descriptors, the server cannot accept a connection, which stays queued: it
// takes it with a spare descriptor kept for this, answers why, and closes it, rather than
// spinning on the listener while the client waits out its timeout. Once descriptors are
// free, it serves as before.
TEST_F(FdServerTest, OutOfFileDescriptorsAConnectionIsAnsweredWhyAndTheServerGoesOn) {
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  int highest = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(highest) + 32;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<UniqueFd> filler;
  while (true) {
    UniqueFd fd(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) break;
    filler.push_back(std::move(fd));
  }
  ASSERT_FALSE(filler.empty());
  filler.pop_back();  // One left: the client's socket takes it, the server's accept finds none.
  std::string answer;
  {
    absl::StatusOr<UniqueFd> c = ConnectUnix(path_, absl::Seconds(5));
    if (c.ok()) {
      absl::StatusOr<ReceivedMessage> reply = Exchange(c->get(), "no such token", 256, absl::Seconds(5));
      answer = reply.ok() ? reply->bytes : std::string(reply.status().message());
    } else {
      answer = std::string(c.status().message());
    }
  }
  filler.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_EQ(answer,
            "ERR the daemon is out of file descriptors (Too many open files); attach again later");
  EXPECT_EQ(AnswerToABadToken(), "ERR unknown or already used attach token; attach again");
  UniqueFd claimed = Claimed();
  EXPECT_EQ(node_->Snapshot().attached, 1);
}

// Fails every accept4 of the calling thread, and of the threads it starts later, with EACCES,
// as a security module refusing a connection does (a seccomp filter); false where the kernel
// or the container takes no filter.
bool RefuseAccepts() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_accept4, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EACCES & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// An accept that fails for another reason than a connection gone or out of resources (here
// a security module's EACCES) leaves the connection queued: the listener rests and says why,
// rather than being polled, readable, and failed again at once, unseen, for as long as the
// connection waits (the server thread spun on it).
TEST(FdServerAcceptTest, AnAcceptRefusedOtherwiseRestsTheListenerAndSaysWhy) {
  // The child runs this binary afresh, single-threaded: earlier tests leave gRPC's threads
  // behind, and a child forked from a threaded process may start none under ThreadSanitizer.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const pid_t probe = fork();  // Whether this kernel takes a filter, in a child of its own.
  if (probe == 0) _exit(RefuseAccepts() ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(probe, &status, 0), probe);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) GTEST_SKIP() << "no seccomp filters here";
  test::TempDir dir;
  const std::string path = dir.path() + "/ubepd.sock.fds";
  auto serve_one_refused_connection = [&] {
    if (!RefuseAccepts()) _exit(3);
    NodeOptions options = Options();
    options.fd_socket_path = path;
    Node node(options);
    absl::StatusOr<std::unique_ptr<FdServer>> server = FdServer::Start(path, 0600, &node);
    if (!server.ok()) _exit(4);
    absl::StatusOr<UniqueFd> client = ConnectUnix(path, absl::Seconds(5));
    if (!client.ok()) _exit(5);
    // The first accept follows the connection at once; time for a loaded machine to run it.
    absl::SleepFor(absl::Seconds(2));
    std::filesystem::remove_all(dir.path());  // The child's own (it ran the test afresh).
    _exit(0);
  };
  EXPECT_EXIT(serve_one_refused_connection(), ::testing::ExitedWithCode(0),
              "fd server: cannot accept a connection: Permission denied; trying again every "
              "100ms");
}

}  // namespace
}  // namespace ubep::daemon
