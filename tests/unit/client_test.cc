// libubep against a ubepd whose answers it must not trust: a real gRPC server on a Unix socket
// in a temporary directory, answering Attach and Join from a real Node (the daemon's group
// state) and then altering the answer, and an fd socket whose replies come late; and against
// a real ubepd in process. (The integration tests run the client against ubepd processes.)
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/http_get.h"
#include "common/rpc_origin.h"
#include "common/unix_socket.h"
#include "daemon/daemon.h"
#include "daemon/node.h"
#include "kernels/common/plan_area.h"
#include "kernels/host/arena_layout.h"
#include "kernels/host/rank_arena.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"
#include "tests/wait_for.h"
#include "ubep/ubep.h"
#include "ubep/ubep_c.h"
#include "ubep/v1/control.grpc.pb.h"
#include "ubep/v1/daemon.grpc.pb.h"

namespace ubep {
namespace {

// Attach answers from a Node, passed through `alter`; Detach goes to the Node and is recorded.
class AlteringUbepd final : public v1::Daemon::Service {
 public:
  AlteringUbepd(const std::string& socket, std::function<void(v1::AttachResponse&)> alter)
      : node_([&] {
          daemon::NodeOptions options;
          // Reached only where a test serves it (the others' answers are refused first).
          options.fd_socket_path = socket + ".fds";
          options.free_buffers = 2;
          return options;
        }()),
        alter_(std::move(alter)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket, grpc::InsecureServerCredentials());
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~AlteringUbepd() override { server_->Shutdown(std::chrono::system_clock::now()); }

  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest* request,
                      v1::AttachResponse* response) override {
    absl::StatusOr<v1::AttachResponse> attached = node_.Attach(*request);
    if (!attached.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, attached.status().ToString());
    std::lock_guard<std::mutex> lock(mu_);
    original_ = *attached;
    *response = *std::move(attached);
    alter_(*response);
    return grpc::Status::OK;
  }
  // Join goes to the Node; its answer's arena epoch moved by `join_epoch_offset`.
  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      join_deadlines_.push_back(context->deadline());
      if (!join_answer_.ok()) {
        // Marked as ubepd's own answer (its interceptor does it for the real daemon), or left
        // unmarked as a failure of the transport would be.
        if (join_answer_marked_) context->AddTrailingMetadata(kUbepOrigin, "ubepd");
        return join_answer_;
      }
    }
    absl::StatusOr<v1::JoinResponse> joined = node_.Join(*request, absl::Now() + absl::Seconds(10));
    if (!joined.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, joined.status().ToString());
    *response = *std::move(joined);
    response->set_arena_epoch(response->arena_epoch() + join_epoch_offset);
    return grpc::Status::OK;
  }
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest* request,
                      v1::DetachResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    detaches_.push_back(*request);
    const absl::Status detached = node_.Detach(*request);
    return detached.ok() ? grpc::Status::OK
                         : grpc::Status(grpc::StatusCode::INTERNAL, detached.ToString());
  }

  v1::AttachResponse original() {
    std::lock_guard<std::mutex> lock(mu_);
    return original_;
  }
  std::vector<v1::DetachRequest> detaches() {
    std::lock_guard<std::mutex> lock(mu_);
    return detaches_;
  }
  int attached() { return node_.Snapshot().attached; }
  // The deadline of every Join so far, as the server saw it.
  std::vector<std::chrono::system_clock::time_point> join_deadlines() {
    std::lock_guard<std::mutex> lock(mu_);
    return join_deadlines_;
  }
  // Every Join from now on is answered `answer` (OK: the Node's answer again).
  void AnswerJoins(grpc::Status answer, bool marked = true) {
    std::lock_guard<std::mutex> lock(mu_);
    join_answer_ = std::move(answer);
    join_answer_marked_ = marked;
  }
  daemon::Node& node() { return node_; }

  std::atomic<uint64_t> join_epoch_offset{0};

 private:
  daemon::Node node_;
  std::function<void(v1::AttachResponse&)> alter_;
  std::mutex mu_;
  v1::AttachResponse original_;
  std::vector<v1::DetachRequest> detaches_;
  std::vector<std::chrono::system_clock::time_point> join_deadlines_;
  grpc::Status join_answer_;
  bool join_answer_marked_ = true;
  std::unique_ptr<grpc::Server> server_;
};

ModelShape Shape() {
  ModelShape shape;
  shape.num_layers = 2;
  shape.num_experts = 4;
  shape.hidden = 16;
  shape.top_k = 2;
  shape.max_tokens = 8;
  shape.slots_per_rank = 4;
  shape.bytes_per_expert = 256;
  return shape;
}

// Attaches rank 0 of a one-rank group through a ubepd that alters its answer by `alter`;
// returns the error, the ubepd's unaltered answer, and whether the rank was detached (the
// ubepd got a Detach naming it, and freed it).
struct Refusal {
  absl::Status status;
  v1::AttachResponse original;
  bool detached = false;
};
Refusal AttachThrough(std::function<void(v1::AttachResponse&)> alter) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, std::move(alter));
  ClientOptions options;
  options.socket_path = socket;
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  Refusal refusal{rank.status(), ubepd.original()};
  const std::vector<v1::DetachRequest> detaches = ubepd.detaches();
  refusal.detached = detaches.size() == 1 && detaches[0].rank() == 0 &&
                     detaches[0].token() == refusal.original.token() && ubepd.attached() == 0;
  return refusal;
}

// An arena layout that is not the one this library computes for the shape (another ubepd
// version, or a damaged answer: an offset moved, fewer weight buffers than slots) is refused
// before any offset of it is used, and the rank is detached at once.
TEST(ClientTest, AnArenaLayoutOtherThanTheLibrarysIsRefusedAndTheRankDetached) {
  const std::vector<std::pair<std::function<void(v1::ArenaLayout&)>, int>> cases = {
      {[](v1::ArenaLayout& l) { l.set_weights_offset(l.weights_offset() + 64); }, 6},
      {[](v1::ArenaLayout& l) { l.set_buffers_per_layer(3); }, 3}};
  for (const auto& [alter, buffers] : cases) {
    SCOPED_TRACE(buffers);
    const Refusal refusal = AttachThrough([&](v1::AttachResponse& r) { alter(*r.mutable_layout()); });
    EXPECT_EQ(refusal.status,
              absl::DataLossError(absl::StrCat(
                  "rank 0: ubepd's arena layout (", refusal.original.layout().total_bytes(),
                  " bytes, ", buffers, " weight buffers per layer) differs from this library's "
                  "for the shape; ubepd and libubep versions differ")));
    EXPECT_TRUE(refusal.detached);
  }
}

TEST(ClientTest, ADataPlaneLayoutOtherThanTheLibrarysIsRefused) {
  const Refusal refusal = AttachThrough([](v1::AttachResponse& r) {
    r.mutable_layout()->set_ep_bytes(r.layout().ep_bytes() + 64);
  });
  const uint64_t ours = refusal.original.layout().ep_bytes();
  EXPECT_EQ(refusal.status,
            absl::DataLossError(absl::StrCat("rank 0: ubepd's data-plane layout (", ours + 64,
                                             " bytes) differs from this library's (", ours,
                                             "); ubepd and libubep versions differ")));
  EXPECT_TRUE(refusal.detached);
}

// ubepd in process, its socket in `dir`; and the options of a client of it.
// `metrics`: HOST:PORT of its Prometheus exposition ("": none).
absl::StatusOr<std::unique_ptr<daemon::Daemon>> StartUbepd(const test::TempDir& dir,
                                                            int max_recv_rows = 0,
                                                            const std::string& metrics = "") {
  daemon::DaemonOptions options;
  options.socket_path = dir.path() + "/ubepd.sock";
  options.node.max_recv_rows = max_recv_rows;
  options.metrics = metrics;
  return daemon::Daemon::Start(options);
}
ClientOptions ClientOf(const test::TempDir& dir) {
  ClientOptions client;
  client.socket_path = dir.path() + "/ubepd.sock";
  return client;
}

// Plan v2 of a one-rank group of Shape(): slots 0 and 1 swap experts.
balancer::Plan SwappedPlan() {
  balancer::Plan plan;
  plan.version = 2;
  plan.topology = {1, 1, 4, 1};
  plan.num_experts = 4;
  for (int l = 0; l < 2; ++l) {
    balancer::LayerPlan layer;
    layer.slot_expert = {1, 0, 2, 3};
    balancer::SetEqualShares(4, layer);
    plan.layer_ids.push_back(l);
    plan.layers.push_back(layer);
  }
  return plan;
}

// One step of `rank` (a one-rank group of Shape()) that goes through: one token to experts 0
// and 1 at weight 0.5, two rows, and the identity as the experts give the token back.
void ExpectAStepGoesThrough(Rank& rank, uint64_t step) {
  const std::vector<float> x(16, 1.0f);
  const std::vector<int32_t> idx = {0, 1};
  const std::vector<float> w = {0.5f, 0.5f};
  ASSERT_TRUE(rank.BeginStep(step).ok());
  Dispatched dispatched;
  ASSERT_TRUE(rank.Dispatch(0, x.data(), idx.data(), w.data(), 1, dispatched).ok());
  EXPECT_EQ(dispatched.num_rows(), 2);
  std::vector<float> out(16, 0.0f);
  ASSERT_TRUE(rank.Combine(dispatched, dispatched.rows(), out.data()).ok());
  EXPECT_EQ(out, x);  // 0.5 x 1.0 + 0.5 x 1.0, through two slots of the one rank.
}

// A plan prepared for step 5 and never decided (its balancer died between Prepare and
// Commit): BeginStep(5) waits the decision timeout, then fails naming the plan and what
// decides it; the steps before it run.
TEST(ClientTest, APlanLeftUndecidedAtItsStepFailsBeginStepNamingIt) {
  test::TempDir dir;
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = StartUbepd(dir, 0, "127.0.0.1:0");
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  ClientOptions client = ClientOf(dir);
  client.decision_timeout = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(client, 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  const v1::PrepareResponse prepared = (*ubepd)->node().Prepare(SwappedPlan(), 5);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  EXPECT_TRUE((*rank)->BeginStep(4).ok());
  EXPECT_EQ((*rank)->BeginStep(5),
            absl::UnavailableError("rank 0: plan v2 is prepared for step 5 and still undecided "
                                   "after 200ms; is ubep-balancer alive? (restarted, it commits "
                                   "or aborts v2 from the daemons' state)"));
  // One step waited (step 5; step 4 ran under v1), for the whole decision timeout; the
  // failure is the client's, counted as such.
  const std::string metrics = HttpGet((*ubepd)->metrics_port(), "/metrics");
  EXPECT_EQ(test::Sample(metrics, "ubep_daemon_effective_step_waits_total{rank=\"0\"}"), 1) << metrics;
  EXPECT_GE(test::Sample(metrics, "ubep_daemon_effective_step_wait_seconds_total{rank=\"0\"}"), 0.2)
      << metrics;
  EXPECT_EQ(test::Sample(metrics, "ubep_daemon_errors_total{code=\"UNAVAILABLE\",source=\"client\"}"), 1)
      << metrics;
}

// A Rejoin that let go of its data plane and could not build it again (here: ubepd's arena
// for this rank no longer carries the data plane's header) stops every call with the reason,
// rather than running one on no data plane; a Rejoin that completes starts them again.
TEST(ClientTest, ARejoinThatLostItsDataPlaneStopsEveryCallUntilARejoinCompletes) {
  test::TempDir dir;
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = StartUbepd(dir);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  ClientOptions client = ClientOf(dir);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(client, 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  // The first word of the data plane's header in this rank's arena, as ubepd holds it.
  uint32_t* magic = nullptr;
  (*ubepd)->node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                    const kernels::EpConfig&) {
    magic = reinterpret_cast<uint32_t*>(base + layout.ep);
  });
  ASSERT_NE(magic, nullptr);
  const uint32_t kept = *magic;
  *magic = kept ^ 1u;
  const absl::StatusOr<uint64_t> rejoined = (*rank)->Rejoin(3);
  const std::string why =
      "rank 0: the arena was laid out for another configuration (ranks 1, max_tokens 8, "
      "hidden 16, top_k 2, experts 4, slots 4, layers 2, dtype float32, flagged_tokens 0, "
      "protocol ubep)";
  EXPECT_EQ(rejoined.status(), absl::FailedPreconditionError(why));
  // The client's own (taking the data plane after the Join), so counted; the calls refused
  // below for it are not counted again.
  EXPECT_EQ((*rank)->stats().errors, 1u);
  const absl::Status stopped = absl::FailedPreconditionError(
      "rank 0: the last Rejoin did not complete (" + why + "); call Rejoin again");
  EXPECT_EQ((*rank)->BeginStep(3), stopped);
  Dispatched dispatched;
  const std::vector<float> x(16, 1.0f);
  const std::vector<int32_t> idx = {0, 1};
  const std::vector<float> w = {0.5f, 0.5f};
  EXPECT_EQ((*rank)->Dispatch(0, x.data(), idx.data(), w.data(), 1, dispatched), stopped);

  *magic = kept;
  EXPECT_EQ((*rank)->stats().errors, 1u);
  ASSERT_EQ((*rank)->Rejoin(3).value_or(0), 3u);
  ExpectAStepGoesThrough(**rank, 3);
  EXPECT_TRUE((*rank)->Detach().ok());
}

// Rank 0's Dispatch of layer 0 is refused (bad input) and its engine goes on to layer 1 rather
// than calling layer 0 again, while rank 1 dispatches layer 0: the call is out of step, and it
// fails on both ranks at their Dispatch (Aborted), libubep completing its combine for each, so
// that the group stays in step: the next step goes through on both.
TEST(ClientTest, ACallOutOfStepFailsOnEveryRankAndTheGroupStaysInStep) {
  test::TempDir dir;
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = StartUbepd(dir);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  absl::StatusOr<std::unique_ptr<Rank>> rank0, rank1;
  {
    std::thread attach0([&] { rank0 = Rank::Attach(ClientOf(dir), 0, 2, 0, Shape()); });
    rank1 = Rank::Attach(ClientOf(dir), 1, 2, 0, Shape());
    attach0.join();
  }
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  const std::vector<float> x(16, 1.0f);
  const std::vector<int32_t> idx = {0, 1}, bad = {0, 9};
  const std::vector<float> w = {0.5f, 0.5f};
  absl::Status refused0, dispatched0, dispatched1;
  {
    std::thread r0([&] {
      ASSERT_TRUE((*rank0)->BeginStep(0).ok());
      Dispatched d;
      refused0 = (*rank0)->Dispatch(0, x.data(), bad.data(), w.data(), 1, d);
      dispatched0 = (*rank0)->Dispatch(1, x.data(), idx.data(), w.data(), 1, d);
    });
    ASSERT_TRUE((*rank1)->BeginStep(0).ok());
    Dispatched d;
    dispatched1 = (*rank1)->Dispatch(0, x.data(), idx.data(), w.data(), 1, d);
    r0.join();
  }
  EXPECT_EQ(refused0, absl::InvalidArgumentError("topk_idx[0][1] = 9 is outside [-1, 4)"));
  auto out_of_step = [](int r, int layer, int peer, int peer_layer, uint32_t call) {
    return absl::AbortedError(absl::StrCat(
        "rank ", r, ", dispatch call ", call, ": pairs layer ", layer, " of step 0 here with layer ",
        peer_layer, " of step 0 on rank ", peer,
        ": the ranks' calls are out of step (a rank's caller went on to another call after one "
        "that failed, rather than calling it again); the call fails on every rank of the group, "
        "its dispatch complete but for the combine, which every rank still calls"));
  };
  EXPECT_EQ(dispatched0, out_of_step(0, 1, 1, 0, 1));
  EXPECT_EQ(dispatched1, out_of_step(1, 0, 0, 1, 1));
  std::thread r0([&] { ExpectAStepGoesThrough(**rank0, 1); });
  ExpectAStepGoesThrough(**rank1, 1);
  r0.join();
  EXPECT_TRUE((*rank0)->Detach().ok());
  EXPECT_TRUE((*rank1)->Detach().ok());
}

// A Dispatch that fails leaves its output empty, not a partial layout (over the receive
// capacity, the offsets would count rows that are not there); combining it, or an output no
// Dispatch filled, is a combine without a dispatch.
TEST(ClientTest, AFailedDispatchLeavesNoRowsToCombine) {
  test::TempDir dir;
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = StartUbepd(dir, /*max_recv_rows=*/1);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(ClientOf(dir), 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  const std::vector<float> x(16, 1.0f), y(2 * 16, 1.0f);
  const std::vector<int32_t> idx = {0, 1};  // Two rows for a capacity of one.
  const std::vector<float> w = {0.5f, 0.5f};
  std::vector<float> out(16, 0.0f);
  const absl::Status refused = absl::FailedPreconditionError(
      "rank 0: combine without a dispatch (this output holds none: no Dispatch filled it, or "
      "its Dispatch failed)");
  Dispatched never;
  ASSERT_TRUE((*rank)->BeginStep(0).ok());
  EXPECT_EQ((*rank)->Combine(never, y.data(), out.data()), refused);
  // Layer 0 goes through and fills the output; layer 1, over the capacity, into the same
  // output, must leave it empty, not showing layer 0's rows.
  Dispatched dispatched;
  const std::vector<int32_t> one = {0, -1};
  ASSERT_TRUE((*rank)->Dispatch(0, x.data(), one.data(), w.data(), 1, dispatched).ok());
  ASSERT_EQ(dispatched.num_rows(), 1);
  ASSERT_TRUE((*rank)->Combine(dispatched, dispatched.rows(), out.data()).ok());
  EXPECT_EQ(out, std::vector<float>(16, 0.5f));
  EXPECT_EQ((*rank)->Dispatch(1, x.data(), idx.data(), w.data(), 1, dispatched),
            absl::ResourceExhaustedError(
                "rank 0, dispatch call 2: 2 rows routed here, more than its receive capacity of "
                "1 (max_recv_rows); the first 1 are laid out, and this call's combine fails on "
                "every rank of the group"));
  EXPECT_EQ(dispatched.num_rows(), 0);
  EXPECT_EQ(dispatched.rows(), nullptr);
  EXPECT_TRUE(dispatched.slot_offsets().empty());
  EXPECT_TRUE(dispatched.src_rank().empty());
  EXPECT_TRUE(dispatched.src_token().empty());
  EXPECT_TRUE(dispatched.weights().empty());
  EXPECT_EQ(dispatched.plan_version(), 0u);
  EXPECT_EQ(dispatched.layer(), -1);
  EXPECT_EQ((*rank)->Combine(dispatched, y.data(), out.data()), refused);
  // The group stays in step: the next step goes through.
  ASSERT_TRUE((*rank)->BeginStep(1).ok());
  std::fill(out.begin(), out.end(), 0.0f);
  ASSERT_TRUE((*rank)->Dispatch(0, x.data(), one.data(), w.data(), 1, dispatched).ok());
  EXPECT_EQ(dispatched.num_rows(), 1);
  EXPECT_EQ(dispatched.layer(), 0);
  ASSERT_TRUE((*rank)->Combine(dispatched, dispatched.rows(), out.data()).ok());
  EXPECT_EQ(out, std::vector<float>(16, 0.5f));
  EXPECT_TRUE((*rank)->Detach().ok());
}

// The fds of this process open on a memfd named `name` (ubepd names rank r's arena
// "ubep-rank-r").
int MemfdsNamed(const std::string& name) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::filesystem::path target = std::filesystem::read_symlink(entry.path(), error);
    if (!error && absl::StartsWith(target.string(), "/memfd:" + name + " ")) ++count;
  }
  return count;
}

// A rank maps every rank's arena and keeps no fd of them (only the mapping): a rank of a
// group of 1024 would otherwise hold 1024 fds, and run into the usual limit. Here the only
// fd on the arena is ubepd's own (in this process), once its fd server has closed the
// duplicates it sent, just after the send (the rank may be attached before that).
TEST(ClientTest, AnAttachedRankKeepsNoArenaFd) {
  test::TempDir dir;
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = StartUbepd(dir);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(ClientOf(dir), 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_TRUE(test::WaitFor([] { return MemfdsNamed("ubep-rank-0") == 1; }, absl::Seconds(5)))
      << MemfdsNamed("ubep-rank-0") << " fds on the arena";
  ExpectAStepGoesThrough(**rank, 0);  // The mapping serves.
  EXPECT_TRUE((*rank)->Detach().ok());
}

std::vector<int> RawFds(const std::vector<UniqueFd>& fds) {
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  return raw;
}

// ubepd's fd socket's answer to a claim: reads the token on `connection` and sends back "OK"
// with `node`'s arenas for it, claimed as connection `id`.
void AnswerClaim(daemon::Node& node, int connection, int64_t id) {
  absl::StatusOr<ReceivedMessage> token = ReceiveMessage(connection, 4096, absl::Seconds(10));
  ASSERT_TRUE(token.ok()) << token.status();
  absl::StatusOr<std::vector<UniqueFd>> claimed = node.ClaimArenas(token->bytes, id);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  ASSERT_TRUE(SendMessage(connection, "OK", RawFds(*claimed)).ok());
}

// ubepd's fd socket at `path` for one client: it answers the claim of the arenas from
// `claims_from` (as connection 1), or, given none, reads the claim and answers nothing; and
// then nothing more, until destroyed, but that it sees the connection close (closed()).
class SilentFdSocket {
 public:
  SilentFdSocket(const std::string& path, daemon::Node* claims_from)
      : listener_(*ListenUnix(path, 0600)), thread_([this, claims_from] { Serve(claims_from); }) {}
  ~SilentFdSocket() {
    done_ = true;
    thread_.join();
  }
  // Every copy of the client's end of the connection is closed.
  bool closed() const { return closed_.load(); }

 private:
  void Serve(daemon::Node* claims_from) {
    pollfd p{listener_.get(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 10000), 1);
    UniqueFd connection(accept(listener_.get(), nullptr, nullptr));
    if (claims_from != nullptr) {
      ASSERT_NO_FATAL_FAILURE(AnswerClaim(*claims_from, connection.get(), 1));
    } else {
      ASSERT_TRUE(ReceiveMessage(connection.get(), 4096, absl::Seconds(10)).ok());
    }
    while (!done_ && !closed_) {  // What the client sends (a REFRESH) is left unanswered.
      absl::StatusOr<ReceivedMessage> got =
          ReceiveMessage(connection.get(), 4096, absl::Milliseconds(5));
      if (got.ok() && got->closed) closed_ = true;
    }
    while (!done_) absl::SleepFor(absl::Milliseconds(5));
  }
  UniqueFd listener_;
  std::atomic<bool> done_{false}, closed_{false};
  std::thread thread_;  // Last: starts after the members it uses.
};

// On ubepd's side of a rank's fd connection: takes a REFRESH and answers it with `node`'s
// arenas one arena epoch ahead (as a Join after a peer daemon's restart says), running
// `before_reply` just before the reply goes; then holds the connection until the rank
// detaches (ubepd's fd socket holds it while the rank is attached).
void AnswerRefreshThenHold(daemon::Node& node, int connection,
                           const std::function<void()>& before_reply = [] {}) {
  absl::StatusOr<ReceivedMessage> refresh = ReceiveMessage(connection, 4096, absl::Seconds(30));
  ASSERT_TRUE(refresh.ok()) << refresh.status();
  ASSERT_EQ(refresh->bytes, kArenaRefreshRequest);
  absl::StatusOr<std::pair<uint64_t, std::vector<UniqueFd>>> arenas = node.RefreshArenas(1);
  ASSERT_TRUE(arenas.ok()) << arenas.status();
  before_reply();
  ASSERT_TRUE(
      SendMessage(connection, absl::StrCat("OK ", arenas->first + 1), RawFds(arenas->second)).ok());
  (void)ReceiveMessage(connection, 4096, absl::Seconds(30));
}

// ubepd's fd socket for one client, answering from `node`: the claim of the arenas, then
// each REFRESH with two replies, as when an earlier refresh's reply comes late: first one of
// an older arena epoch carrying fds of no arena, then the node's arenas under `epoch_offset`
// more than the node's epoch (as the Join said).
class LateRefreshFdSocket {
 public:
  LateRefreshFdSocket(daemon::Node& node, const std::string& path, uint64_t epoch_offset)
      : listener_(*ListenUnix(path, 0600)),
        thread_([this, &node, epoch_offset] { Serve(node, epoch_offset); }) {}
  ~LateRefreshFdSocket() {
    stop_ = true;
    thread_.join();
  }
  int refreshes() const { return refreshes_; }

 private:
  void Serve(daemon::Node& node, uint64_t epoch_offset) {
    UniqueFd connection;
    while (!stop_ && connection.get() < 0) {
      pollfd p{listener_.get(), POLLIN, 0};
      if (poll(&p, 1, 10) == 1) connection = UniqueFd(accept(listener_.get(), nullptr, nullptr));
    }
    if (stop_) return;
    ASSERT_NO_FATAL_FAILURE(AnswerClaim(node, connection.get(), 1));
    while (!stop_) {
      absl::StatusOr<ReceivedMessage> request =
          ReceiveMessage(connection.get(), 4096, absl::Milliseconds(10));
      if (absl::IsDeadlineExceeded(request.status())) continue;  // Nothing yet.
      ASSERT_TRUE(request.ok()) << request.status();
      if (request->closed) return;
      ASSERT_EQ(request->bytes, kArenaRefreshRequest);
      absl::StatusOr<std::pair<uint64_t, std::vector<UniqueFd>>> arenas = node.RefreshArenas(1);
      ASSERT_TRUE(arenas.ok()) << arenas.status();
      std::vector<UniqueFd> none;
      for (size_t i = 0; i < arenas->second.size(); ++i) {
        none.emplace_back(memfd_create("not-an-arena", 0));
        ASSERT_EQ(ftruncate(none.back().get(), 4096), 0);
      }
      const uint64_t epoch = arenas->first + epoch_offset;
      ++refreshes_;  // Before the replies: the client goes on once it has them.
      ASSERT_TRUE(SendMessage(connection.get(), absl::StrCat("OK ", epoch - 1), RawFds(none)).ok());
      ASSERT_TRUE(
          SendMessage(connection.get(), absl::StrCat("OK ", epoch), RawFds(arenas->second)).ok());
    }
  }
  UniqueFd listener_;
  std::atomic<bool> stop_{false};
  std::atomic<int> refreshes_{0};
  std::thread thread_;  // Last: starts after the members it uses.
};

// A Join whose arena epoch is ahead of the rank's makes it take its arenas again (REFRESH).
// A reply of an older epoch that comes first (an earlier refresh's, late) is passed over:
// taken, its fds would replace the rank's arenas with memory that is no arena.
TEST(ClientTest, ARefreshReplyOfAnOlderArenaEpochIsPassedOver) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  ubepd.join_epoch_offset = 1;
  LateRefreshFdSocket fd_socket(ubepd.node(), socket + ".fds", 1);
  ClientOptions options;
  options.socket_path = socket;
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_EQ(fd_socket.refreshes(), 1);  // The Join in Attach.
  ExpectAStepGoesThrough(**rank, 0);
  EXPECT_TRUE((*rank)->Detach().ok());
}

// ubepd's fd socket answers the claim of the arenas and then nothing, while the Join says
// they are newer (a peer daemon restarted): the refresh gives up after rpc_timeout with
// Unavailable, saying what ubepd was asked (not DeadlineExceeded, which says a peer of the
// group did not come, and is counted as a wait that timed out).
TEST(ClientTest, ARefreshUbepdDoesNotAnswerIsUnavailableSayingWhatWasAsked) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  ubepd.join_epoch_offset = 1;
  SilentFdSocket silent(socket + ".fds", &ubepd.node());  // The REFRESH is never answered.
  ClientOptions options;
  options.socket_path = socket;
  options.rpc_timeout = absl::Seconds(5);  // (Also the Attach's and the claim's, on a loaded machine.)
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  EXPECT_EQ(rank.status(),
            absl::UnavailableError("rank 0: asking ubepd for the new arenas over its fd socket: "
                                   "no answer within 5s (rpc_timeout)"));
}

// ubepd's fd socket answers a refresh only after the rank gave up on it (rpc_timeout), with a
// refusal that was true then. The next refresh (the rank's Rejoin) reads that reply first:
// it is passed over, not taken for ubepd's answer to the refresh asked now, which it answers
// with the arenas.
TEST(ClientTest, TheLateRefusalOfARefreshThatGaveUpIsNotTheNextRefreshsAnswer) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  UniqueFd listener = *ListenUnix(socket + ".fds", 0600);
  std::atomic<bool> gave_up{false};
  std::thread late([&] {
    pollfd p{listener.get(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 10000), 1);
    UniqueFd connection(accept(listener.get(), nullptr, nullptr));
    ASSERT_NO_FATAL_FAILURE(AnswerClaim(ubepd.node(), connection.get(), 1));
    absl::StatusOr<ReceivedMessage> first = ReceiveMessage(connection.get(), 4096, absl::Seconds(30));
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_EQ(first->bytes, kArenaRefreshRequest);
    ASSERT_TRUE(test::WaitFor([&] { return gave_up.load(); }, absl::Seconds(30)));
    ASSERT_TRUE(SendMessage(connection.get(), "ERR the group's arenas are not all mapped", {}).ok());
    AnswerRefreshThenHold(ubepd.node(), connection.get());
  });
  ClientOptions options;
  options.socket_path = socket;
  // (Also the Attach's and the claim's, and the time the next refresh's answer has, on a
  // loaded machine.)
  options.rpc_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  EXPECT_TRUE(rank.ok()) << rank.status();
  if (rank.ok()) {
    ubepd.join_epoch_offset = 1;  // A peer daemon restarted: the group's arenas are newer.
    EXPECT_EQ((*rank)->Rejoin(std::nullopt).status(),
              absl::UnavailableError("rank 0: asking ubepd for the new arenas over its fd "
                                     "socket: no answer within 5s (rpc_timeout)"));
    gave_up = true;
    const absl::StatusOr<uint64_t> rejoined = (*rank)->Rejoin(std::nullopt);
    EXPECT_TRUE(rejoined.ok()) << rejoined.status();
    if (rejoined.ok()) ExpectAStepGoesThrough(**rank, *rejoined);
    EXPECT_TRUE((*rank)->Detach().ok());
  }
  gave_up = true;
  late.join();
}

// A refresh whose reply's fds do not fit this process's descriptor table (its open-files limit
// reached since Attach: loaders, NCCL) is ResourceExhausted saying to raise the limit, as an
// Attach's is: not Unavailable, which callers retry by joining again (breaking the group each
// time) to fail alike. The fd socket takes every free descriptor of this process (under a
// limit lowered for the test) before it answers.
TEST(ClientTest, ARefreshWhoseFdsDoNotFitThisProcessIsResourceExhausted) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  UniqueFd listener = *ListenUnix(socket + ".fds", 0600);
  std::vector<UniqueFd> taken;
  std::thread fd_socket([&] {
    pollfd p{listener.get(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 10000), 1);
    UniqueFd connection(accept(listener.get(), nullptr, nullptr));
    ASSERT_NO_FATAL_FAILURE(AnswerClaim(ubepd.node(), connection.get(), 1));
    AnswerRefreshThenHold(ubepd.node(), connection.get(), [&] {
      for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) taken.emplace_back(fd);
    });
  });
  ClientOptions options;
  options.socket_path = socket;
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  EXPECT_TRUE(rank.ok()) << rank.status();
  if (rank.ok()) {
    rlimit kept{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &kept), 0);
    const rlimit lowered = {std::min<rlim_t>(kept.rlim_cur, 4096), kept.rlim_max};
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
    ubepd.join_epoch_offset = 1;  // A peer daemon restarted: the group's arenas are newer.
    const absl::StatusOr<uint64_t> rejoined = (*rank)->Rejoin(std::nullopt);
    taken.clear();
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &kept), 0);
    // (How many of the fds fit depends on what the process's other threads closed meanwhile:
    // not asserted.)
    EXPECT_EQ(rejoined.status().code(), absl::StatusCode::kResourceExhausted) << rejoined.status();
    EXPECT_TRUE(absl::StartsWith(rejoined.status().message(),
                                 "rank 0: asking ubepd for the new arenas over its fd socket: "
                                 "out of file descriptors: "))
        << rejoined.status();
    EXPECT_TRUE(absl::EndsWith(rejoined.status().message(),
                               absl::StrCat("(its open-files limit is ", lowered.rlim_cur,
                                            "; raise it, ulimit -n)")))
        << rejoined.status();
    rank->reset();
  }
  fd_socket.join();
}

// ubepd's fd socket refusing a claim (one of the refusals docs/daemon.md lists) and closing
// the connection, as ubepd does: Attach fails Unavailable with ubepd's reason, and the rank
// is detached at once (a Detach RPC), not stopped as if its daemon had exited.
TEST(ClientTest, ARefusedClaimOfTheArenasFailsAttachAndDetachesTheRank) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  UniqueFd listener = *ListenUnix(socket + ".fds", 0600);
  std::thread refuse([&] {
    pollfd p{listener.get(), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 10000), 1);
    UniqueFd connection(accept(listener.get(), nullptr, nullptr));
    ASSERT_TRUE(ReceiveMessage(connection.get(), 4096, absl::Seconds(10)).ok());
    ASSERT_TRUE(SendMessage(connection.get(),
                            "ERR the daemon holds 64 connections that claimed no rank yet", {})
                    .ok());
  });  // The connection closes here.
  ClientOptions options;
  options.socket_path = socket;
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  refuse.join();
  EXPECT_EQ(rank.status(),
            absl::UnavailableError("rank 0: ubepd refused the arenas: the daemon holds 64 "
                                   "connections that claimed no rank yet"));
  const std::vector<v1::DetachRequest> detaches = ubepd.detaches();
  ASSERT_EQ(detaches.size(), 1u);
  EXPECT_EQ(detaches[0].token(), ubepd.original().token());
  EXPECT_EQ(ubepd.attached(), 0);
}

// ubepd's fd socket taking the claim of the arenas and answering nothing: Attach gives up
// after rpc_timeout with Unavailable, saying what ubepd was asked (not DeadlineExceeded, which
// says a peer of the group did not come), and the rank is detached.
TEST(ClientTest, AClaimUbepdDoesNotAnswerIsUnavailableAndDetachesTheRank) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  SilentFdSocket silent(socket + ".fds", nullptr);  // The claim is never answered.
  ClientOptions options;
  options.socket_path = socket;
  // Also the Attach RPC's, which a loaded machine running sanitizers may take seconds over.
  options.rpc_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  EXPECT_EQ(rank.status(), absl::UnavailableError(absl::StrCat(
                               "rank 0: ubepd's fd socket ", socket,
                               ".fds: no answer within 5s (rpc_timeout)")));
  ASSERT_EQ(ubepd.detaches().size(), 1u);
  EXPECT_EQ(ubepd.attached(), 0);
}

// Rank 0 of a group of 1, attached to an in-process ubepd whose fd socket answers the claim
// and then only watches the connection.
struct AttachedOverSilentFdSocket {
  test::TempDir dir;
  std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd{socket, [](v1::AttachResponse&) {}};
  SilentFdSocket fd_socket{socket + ".fds", &ubepd.node()};
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach({.socket_path = socket}, 0, 1, 0, Shape());
};

// Rank::WeightsLoaded is what lets ubepd serve the rank's weights as the copy of last resort
// (a read with require_loaded): refused before it, served after.
TEST(ClientTest, WeightsLoadedLetsTheDaemonServeTheCopyOfLastResort) {
  AttachedOverSilentFdSocket attached;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = attached.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  v1::ReadWeightsRequest read;
  read.set_plan_version(attached.ubepd.node().State().committed_version());
  read.set_layer(1);
  read.set_slot(2);
  read.set_require_loaded(true);
  EXPECT_EQ(attached.ubepd.node().ReadWeights(read).status(),
            absl::FailedPreconditionError(
                "rank 0's weights are not loaded: its daemon restarted, and no client of its new "
                "arenas has said their weights are in place (Rank::WeightsLoaded), so the copy "
                "of last resort is not taken from them"));
  ASSERT_TRUE((*rank)->WeightsLoaded().ok());
  const absl::StatusOr<v1::ReadWeightsResponse> served = attached.ubepd.node().ReadWeights(read);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(served->data().size(), 256u);
}

// A child forked after Attach (a data-loader worker, say) that never touches the rank holds
// none of its fd connection (closed in the child at the fork): the rank's process letting it
// go closes it for ubepd, which takes that for the rank's process ending, while the child
// lives on.
TEST(ClientTest, AChildForkedAfterAttachHoldsNoneOfTheRanksFdConnection) {
  AttachedOverSilentFdSocket attached;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = attached.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  int go[2];
  ASSERT_EQ(pipe2(go, O_CLOEXEC), 0);
  UniqueFd go_read(go[0]), go_write(go[1]);
  const pid_t child = fork();
  if (child == 0) {
    go_write.reset();  // The parent's end alone: its closing is the word to go.
    pollfd p{go_read.get(), POLLIN, 0};
    poll(&p, 1, 30000);  // Until the parent is done (30 s at most).
    std::_Exit(0);
  }
  ASSERT_GT(child, 0);
  rank->reset();
  EXPECT_TRUE(test::WaitFor([&] { return attached.fd_socket.closed(); }, absl::Seconds(10)));
  EXPECT_EQ(waitpid(child, nullptr, WNOHANG), 0) << "the child ended first";
  go_write.reset();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// A forked child's copy of its parent's Rank is inert: its calls are refused (BeginStep,
// Rejoin, Detach: the rank is the parent's, which goes on using it), it must attach its own,
// and destroying it detaches nothing.
TEST(ClientTest, AForkedChildsCopyOfARankDetachesNothing) {
  AttachedOverSilentFdSocket attached;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = attached.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child == 0) {
    // Nothing of it reaches the parent's rank, its group or its connection's number (closed
    // in the child, and maybe reused there): calls say so, and it must attach its own.
    auto refused = [&](const char* what) {
      return absl::FailedPreconditionError(absl::StrCat("rank 0 was attached by process ", parent,
                                                        "; process ", getpid(),
                                                        ", forked from it, cannot ", what, " it"));
    };
    int wrong = 0;
    wrong += (*rank)->BeginStep(0) != refused("use");
    wrong += (*rank)->Rejoin(std::nullopt).status() != refused("use");
    wrong += (*rank)->ExpertWeights(0, 0).status() != refused("use");
    wrong += (*rank)->SlotExpert(0, 0).status() != refused("use");
    wrong += (*rank)->WeightsLoaded() != refused("use");
    wrong += !(*rank)->must_attach_again();
    wrong += (*rank)->Detach() != refused("detach");
    rank->reset();
    std::_Exit(wrong == 0 ? 0 : 3);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  // Bounded: a child that called into gRPC after the fork may hang (it is killed then).
  const bool ended =
      test::WaitFor([&] { return waitpid(child, &status, WNOHANG) == child; }, absl::Seconds(10));
  if (!ended) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  ASSERT_TRUE(ended) << "the child did not end";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(attached.ubepd.detaches().empty());
  ExpectAStepGoesThrough(**rank, 0);
  EXPECT_TRUE((*rank)->Detach().ok());
  EXPECT_EQ(attached.ubepd.detaches().size(), 1u);
}

// ubepd's fd socket for several clients, answering from `node`: each connection's claim of
// the arenas (connection ids 1, 2, ... in order of accepting), and no more; Close(i) closes
// the i-th connection, as a ubepd that exits closes them all.
class ClosableFdSocket {
 public:
  ClosableFdSocket(daemon::Node& node, const std::string& path)
      : listener_(*ListenUnix(path, 0600)), thread_([this, &node] { Serve(node); }) {}
  ~ClosableFdSocket() {
    stop_ = true;
    thread_.join();
  }
  void Close(int i) {
    std::lock_guard<std::mutex> lock(mu_);
    connections_.at(i - 1).reset();
  }

 private:
  void Serve(daemon::Node& node) {
    for (int64_t id = 1; !stop_;) {
      pollfd p{listener_.get(), POLLIN, 0};
      if (poll(&p, 1, 10) != 1) continue;
      UniqueFd connection(accept(listener_.get(), nullptr, nullptr));
      ASSERT_NO_FATAL_FAILURE(AnswerClaim(node, connection.get(), id++));
      std::lock_guard<std::mutex> lock(mu_);
      connections_.push_back(std::move(connection));
    }
  }

  UniqueFd listener_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<UniqueFd> connections_;
  std::thread thread_;  // Last: starts after the members it uses.
};

// Rank 0 of a one-rank group attached through an AlteringUbepd that alters nothing and a
// ClosableFdSocket of its node, with `options` (their socket path set here).
struct OneRankThroughUbepd {
  explicit OneRankThroughUbepd(ClientOptions options = {}) {
    options.socket_path = socket;
    rank = Rank::Attach(options, 0, 1, 0, Shape());
  }
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd{socket, [](v1::AttachResponse&) {}};
  ClosableFdSocket fd_socket{ubepd.node(), socket + ".fds"};
  absl::StatusOr<std::unique_ptr<Rank>> rank;  // Last: detached first.
};

// An attach answer libubep cannot use safely is refused before the data plane runs on it,
// naming what is wrong: a wait timeout of no time (every wait would give up at once), more
// arenas announced than the fd socket passes, an arena that is not the rank's it says.
TEST(ClientTest, AnAttachAnswerThatCannotBeUsedIsRefusedNamingWhy) {
  struct Case {
    std::function<void(v1::AttachResponse&, daemon::Node&)> alter;
    absl::Status refused;
  };
  const std::vector<Case> cases = {
      {[](v1::AttachResponse& r, daemon::Node&) { r.set_wait_timeout_ms(0); },
       absl::DataLossError("rank 0: ubepd's wait timeout, 0 ms, is not positive")},
      {[](v1::AttachResponse& r, daemon::Node&) { r.add_arena_ranks(0); },
       absl::DataLossError("rank 0: expected 2 arena fds, got 1")},
      {[](v1::AttachResponse&, daemon::Node& node) {
         node.ForEachArena([](int, std::byte* base, const kernels::RankArenaLayout& layout,
                              const kernels::EpConfig&) {
           kernels::ControlOf(base, layout)->rank = 7;
         });
       },
       absl::DataLossError(absl::StrCat("rank 0: arena 0 is not a version ",
                                        kernels::kRankArenaVersion, " arena of rank 0"))},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.refused.message());
    test::TempDir dir;
    const std::string socket = dir.path() + "/ubepd.sock";
    daemon::Node* node = nullptr;
    AlteringUbepd ubepd(socket, [&](v1::AttachResponse& response) { c.alter(response, *node); });
    node = &ubepd.node();
    ClosableFdSocket fd_socket(ubepd.node(), socket + ".fds");
    ClientOptions options;
    options.socket_path = socket;
    options.rpc_timeout = absl::Seconds(10);
    EXPECT_EQ(Rank::Attach(options, 0, 1, 0, Shape()).status(), c.refused);
  }
}

// A daemon destroyed without a drain first (an in-process owner going away) ends a Join that
// waits for a rank still to come, at once and saying so, rather than hold its own
// destruction until the join timeout (a minute).
TEST(ClientTest, ADaemonDestroyedEndsTheJoinsThatWait) {
  test::TempDir dir;
  daemon::DaemonOptions daemon_options;
  daemon_options.socket_path = dir.path() + "/ubepd.sock";
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = daemon::Daemon::Start(daemon_options);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  ClientOptions options;
  options.socket_path = daemon_options.socket_path;
  absl::StatusOr<std::unique_ptr<Rank>> rank;
  std::thread attach([&] { rank = Rank::Attach(options, 0, 2, 0, Shape()); });
  ASSERT_TRUE(test::WaitFor([&] { return (*ubepd)->node().Snapshot().joining == 1; },
                            absl::Seconds(30)));
  ubepd->reset();
  attach.join();
  EXPECT_EQ(rank.status(),
            absl::UnavailableError("rank 0: join: ubepd is draining (shutting down); attach "
                                   "again when it is back"));
}

// The C ABI's join_timeout_ms is the deadline of the Join that waits for the group (an
// option dropped on the way would leave the default 60 s there).
TEST(ClientTest, TheCOptionsJoinTimeoutIsTheJoinsDeadline) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse&) {});
  ClosableFdSocket fd_socket(ubepd.node(), socket + ".fds");
  ubep_client_options options;
  ubep_client_options_init(&options, sizeof(options));
  options.socket_path = socket.c_str();
  options.join_timeout_ms = 4321;
  const ModelShape s = Shape();
  const ubep_model_shape shape = {sizeof(ubep_model_shape), s.num_layers, s.num_experts,
                                  s.hidden,   s.top_k,      s.max_tokens,  s.slots_per_rank,
                                  s.bytes_per_expert, UBEP_DTYPE_FLOAT32, 0};
  ubep_rank* rank = nullptr;
  const auto before = std::chrono::system_clock::now();
  ASSERT_EQ(ubep_attach_with(&options, 0, 1, 0, &shape, -1, &rank), 0) << ubep_last_error();
  const auto after = std::chrono::system_clock::now();
  const std::vector<std::chrono::system_clock::time_point> deadlines = ubepd.join_deadlines();
  ASSERT_EQ(deadlines.size(), 1u);
  // gRPC sends the time left, which the server adds to its clock: within the call, give or
  // take the way there and the encoding's rounding.
  const auto slack = std::chrono::milliseconds(250);
  EXPECT_GE(deadlines[0], before + std::chrono::milliseconds(4321) - slack);
  EXPECT_LE(deadlines[0], after + std::chrono::milliseconds(4321) + slack);
  ubep_detach(rank);
}

// A group stopped under a rank (its state broken) says why from the rank's abort word: a wait
// that timed out names the rank waited on; with no word, the group re-formed without this
// rank. The answer stays until Rejoin.
TEST(ClientTest, AStoppedGroupSaysWhyFromTheAbortWord) {
  struct Case {
    uint32_t abort_word;
    std::string message;
  };
  for (const Case& c : {Case{kernels::kAbortTimedOutBase + 0,
                             "rank 0: the group stopped after a wait on rank 0 timed out; call "
                             "Rejoin"},
                        Case{0, "rank 0: the group has re-formed or is forming without this "
                                "rank; call Rejoin"}}) {
    OneRankThroughUbepd one;
    absl::StatusOr<std::unique_ptr<Rank>>& rank = one.rank;
    ASSERT_TRUE(rank.ok()) << rank.status();
    ASSERT_TRUE((*rank)->BeginStep(0).ok());
    one.ubepd.node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                      const kernels::EpConfig& config) {
      std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(
                                    base + layout.ep + kernels::ArenaLayout(config).abort))
          .store(c.abort_word);
      std::atomic_ref<uint32_t>(kernels::ControlOf(base, layout)->group_state)
          .store(kernels::kGroupBroken);
    });
    EXPECT_EQ((*rank)->BeginStep(1), absl::UnavailableError(c.message));
    EXPECT_EQ((*rank)->BeginStep(2), absl::UnavailableError(c.message));
    EXPECT_FALSE((*rank)->must_attach_again());
  }
}

// ubepd's own answer to a Join (a rank the plan excludes gets DeadlineExceeded at every join
// timeout, and calls Rejoin again) is no error of the client's: neither a data-plane wait
// that gave up nor a client error in the rank's statistics (which ubepd exports).
TEST(ClientTest, UbepdsAnswerToAJoinIsNotCountedAsTheClientsError) {
  OneRankThroughUbepd one;
  AlteringUbepd& ubepd = one.ubepd;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = one.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  ubepd.AnswerJoins(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                 "rank 0 is excluded from the EP group by plan v2 (its node failed or "
                                 "was drained); join again to wait for a plan that includes it"));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ((*rank)->Rejoin(std::nullopt).status(),
              absl::DeadlineExceededError(
                  "rank 0: join: rank 0 is excluded from the EP group by plan v2 (its node "
                  "failed or was drained); join again to wait for a plan that includes it"));
  }
  const RankStats stats = (*rank)->stats();
  EXPECT_EQ(stats.wait_timeouts, 0u);
  EXPECT_EQ(stats.errors, 0u);
  ubepd.AnswerJoins(grpc::Status::OK);
  EXPECT_TRUE((*rank)->Detach().ok());
}

// The plan table in a rank's arena written over outside ubepd (an expert left with no
// replica): BeginStep refuses the step with DataLoss, naming the version and the fault, and
// records the refusal where the peers, waiting for this rank in the step's call, read it.
TEST(ClientTest, ACorruptPlanTableIsRefusedAtBeginStepAndThePeersAreTold) {
  OneRankThroughUbepd one;
  AlteringUbepd& ubepd = one.ubepd;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = one.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  const uint64_t step = (*rank)->resume_step();
  std::byte* ep = nullptr;
  std::optional<kernels::ArenaLayout> ep_layout;
  ubepd.node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                const kernels::EpConfig& config) {
    void* area = base + layout.plan;
    const kernels::PlanTableHeader* table = kernels::SelectPlan(area, step);
    ASSERT_NE(table, nullptr);
    const_cast<kernels::ExpertRoute*>(kernels::FindRoute(table, 1, 2))->count = 0;
    ep = base + layout.ep;
    ep_layout.emplace(config);
  });
  ASSERT_NE(ep, nullptr);
  ASSERT_TRUE(ep_layout.has_value());
  const std::string corrupt = absl::StrCat(
      "rank 0: plan v1 in force at step ", step,
      " is corrupt (plan table: layer 1 expert 2 has 0 replicas): something other than ubepd "
      "wrote over it");
  EXPECT_EQ((*rank)->BeginStep(step), absl::DataLossError(corrupt));
  EXPECT_EQ(kernels::ReadRefusal(ep, *ep_layout, kernels::CallPhase{false, 1}), corrupt);
  EXPECT_TRUE((*rank)->Detach().ok());
}

// A step going back, or above 2^63 - 1, is the caller's own mistake: refused, and recorded as
// the rank's refusal of the call its peers wait for it in, so that a peer that gives up on it
// says why rather than asking whether it is alive; so is a Dispatch with no step begun, which
// keeps the BeginStep's reason.
TEST(ClientTest, AStepRefusedAtBeginStepIsTheRanksRefusalOfTheCall) {
  OneRankThroughUbepd one;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = one.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  std::byte* ep = nullptr;
  std::optional<kernels::ArenaLayout> ep_layout;
  one.ubepd.node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                    const kernels::EpConfig& config) {
    ep = base + layout.ep;
    ep_layout.emplace(config);
  });
  ASSERT_NE(ep, nullptr);
  ASSERT_TRUE(ep_layout.has_value());
  const std::vector<float> x(16, 1.0f), w = {0.5f, 0.5f};
  const std::vector<int32_t> idx = {0, 1};
  Dispatched none;
  EXPECT_EQ((*rank)->Dispatch(0, x.data(), idx.data(), w.data(), 1, none),
            absl::FailedPreconditionError("rank 0: call BeginStep before Dispatch"));
  EXPECT_EQ(kernels::ReadRefusal(ep, *ep_layout, kernels::CallPhase{false, 1}),
            "rank 0: call BeginStep before Dispatch");
  const uint64_t step = (*rank)->resume_step() + 5;
  ExpectAStepGoesThrough(**rank, step);  // Takes part in call 1: the record is withdrawn.
  EXPECT_EQ(kernels::ReadRefusal(ep, *ep_layout, kernels::CallPhase{false, 1}), "");
  const std::string back = absl::StrCat(
      "rank 0: step ", step - 1, " is before step ", step,
      ", where this rank is (steps only go forward; after Rejoin, from the step it returns)");
  EXPECT_EQ((*rank)->BeginStep(step - 1), absl::InvalidArgumentError(back));
  EXPECT_EQ(kernels::ReadRefusal(ep, *ep_layout, kernels::CallPhase{false, 2}), back);
  EXPECT_EQ((*rank)->Dispatch(0, x.data(), idx.data(), w.data(), 1, none),
            absl::FailedPreconditionError("rank 0: call BeginStep before Dispatch"));
  EXPECT_EQ(kernels::ReadRefusal(ep, *ep_layout, kernels::CallPhase{false, 2}), back);
  EXPECT_EQ((*rank)->BeginStep(uint64_t{1} << 63),
            absl::InvalidArgumentError("rank 0: step 9223372036854775808 is above 2^63 - 1 (a "
                                       "negative step passed as unsigned?)"));
  EXPECT_TRUE((*rank)->Detach().ok());
}

// A plan table consistent in itself but of another shape (one layer where the group has two,
// as something other than ubepd could write): refused with DataLoss, not read past its end by
// SlotExpert or BeginStep.
TEST(ClientTest, APlanTableOfAnotherShapeIsRefusedNotReadPastItsEnd) {
  OneRankThroughUbepd one;
  AlteringUbepd& ubepd = one.ubepd;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = one.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  const uint64_t step = (*rank)->resume_step();
  ubepd.node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                const kernels::EpConfig&) {
    void* area = base + layout.plan;
    const kernels::PlanTableHeader* table = kernels::SelectPlan(area, step);
    ASSERT_NE(table, nullptr);
    ASSERT_EQ(table->num_layers, 2u);
    const_cast<kernels::PlanTableHeader*>(table)->num_layers = 1;
    // Its length as the header now says, and an empty exclusion mask where layer 1 began:
    // a table valid in itself.
    std::memset(reinterpret_cast<unsigned char*>(const_cast<kernels::PlanTableHeader*>(table)) +
                    kernels::PlanRoutesEnd(1, table->num_experts, table->max_replicas),
                0, sizeof(uint32_t));
    for (int i = 0; i < 2; ++i) {
      if (kernels::PlanBuffer(area, i) == table) {
        kernels::PlanSlot(area, i)->table_bytes = kernels::PlanTableBytes(table);
      }
    }
  });
  const ModelShape shape = Shape();
  const std::string refused = absl::StrCat(
      "rank 0: plan v1 in force at step ", step, " is for 1 layers x ", shape.num_experts,
      " experts x ", shape.slots_per_rank, " slots (1 ranks), not this group's 2 x ",
      shape.num_experts, " x ", shape.slots_per_rank,
      " (1): something other than ubepd wrote over it");
  EXPECT_EQ((*rank)->SlotExpert(1, 0).status(), absl::DataLossError(refused));
  EXPECT_EQ((*rank)->BeginStep(step), absl::DataLossError(refused));
  EXPECT_TRUE((*rank)->Detach().ok());
}

// The abort word of each rank's arena, as ubepd holds them.
std::vector<uint32_t> AbortWords(daemon::Node& node) {
  std::vector<uint32_t> words;
  node.ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                        const kernels::EpConfig& config) {
    words.push_back(std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(
                                                  base + layout.ep + kernels::ArenaLayout(config).abort))
                        .load());
  });
  return words;
}

// Ranks 0 and 1 of a group of two, each told by its ubepd that it hosts rank 0 alone (as if
// rank 1 were a peer daemon's). Rank 0's fd connection closes, as when its ubepd exits; at its
// next BeginStep rank 0 stops its daemon's ranks as for a drain and tells rank 1, the peer
// daemon's, that it left: rank 1 is to Rejoin where it is, not to attach again. If rank 1's
// control block shows a generation newer than rank 0's (a group formed without rank 0), rank
// 0 leaves it alone.
// Which call of rank 0 first looks at its connection after it closed.
enum class NoticedBy { kBeginStep, kMustAttachAgain, kDetach };

// Ranks 0 and 1 of a group of two through one ubepd that tells each it hosts rank 0 alone
// (rank 1 as if a peer daemon's), both attached: rank 1 once rank 0 holds connection 1 and
// waits in its Join (which waits for both).
struct TwoRanksOneHosted {
  explicit TwoRanksOneHosted(ClientOptions options = {}) {
    options.socket_path = socket;
    options.rpc_timeout = absl::Seconds(10);
    std::thread attach0([&] { rank0 = Rank::Attach(options, 0, 2, 0, Shape()); });
    EXPECT_TRUE(test::WaitFor([&] { return ubepd.node().Snapshot().joining == 1; },
                              absl::Seconds(10)));
    rank1 = Rank::Attach(options, 1, 2, 0, Shape());
    attach0.join();
  }
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd{socket, [](v1::AttachResponse& response) {
                        response.set_hosted_first(0);
                        response.set_hosted_count(1);
                      }};
  ClosableFdSocket fd_socket{ubepd.node(), socket + ".fds"};
  absl::StatusOr<std::unique_ptr<Rank>> rank0, rank1;  // Last: detached first.
};

void ExpectADaemonExitStopsItsRanksAndTellsThePeers(bool peer_in_a_newer_generation,
                                                    NoticedBy noticed_by = NoticedBy::kBeginStep) {
  ClientOptions options;
  options.daemon_check_interval = absl::Nanoseconds(1);  // Every BeginStep looks.
  TwoRanksOneHosted two(options);
  AlteringUbepd& ubepd = two.ubepd;
  ClosableFdSocket& fd_socket = two.fd_socket;
  absl::StatusOr<std::unique_ptr<Rank>>& rank0 = two.rank0;
  absl::StatusOr<std::unique_ptr<Rank>>& rank1 = two.rank1;
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  ASSERT_TRUE((*rank0)->BeginStep(0).ok());
  ASSERT_TRUE((*rank1)->BeginStep(0).ok());
  if (peer_in_a_newer_generation) {
    ubepd.node().ForEachArena([](int r, std::byte* base, const kernels::RankArenaLayout& layout,
                                 const kernels::EpConfig&) {
      if (r == 1) std::atomic_ref<uint64_t>(kernels::ControlOf(base, layout)->generation).fetch_add(1);
    });
  }
  fd_socket.Close(1);
  switch (noticed_by) {
    case NoticedBy::kBeginStep:
      EXPECT_EQ((*rank0)->BeginStep(1),
                absl::UnavailableError("rank 0: ubepd exited (it closed this rank's fd "
                                       "connection); detach, and attach again when it is back"));
      EXPECT_TRUE((*rank0)->must_attach_again());
      break;
    case NoticedBy::kMustAttachAgain:  // Asked after an error, as docs say to.
      EXPECT_TRUE((*rank0)->must_attach_again());
      break;
    case NoticedBy::kDetach:  // Nothing to detach from, and no RPC to a daemon gone.
      EXPECT_EQ((*rank0)->Detach(), absl::OkStatus());
      EXPECT_TRUE(ubepd.detaches().empty());
      break;
  }
  if (peer_in_a_newer_generation) {
    EXPECT_EQ(AbortWords(ubepd.node()), (std::vector<uint32_t>{kernels::kAbortDraining, 0u}));
    return;
  }
  EXPECT_EQ(AbortWords(ubepd.node()),
            (std::vector<uint32_t>{kernels::kAbortDraining, kernels::kAbortRankGone | 0u}));
  // Rank 1's daemon is alive: its call fails naming rank 0, and it Rejoins, not attaches.
  ASSERT_TRUE((*rank1)->BeginStep(1).ok());
  Dispatched dispatched;
  const std::vector<float> x(16, 1.0f);
  const std::vector<int32_t> idx = {0, 1};
  const std::vector<float> w = {0.5f, 0.5f};
  EXPECT_EQ((*rank1)->Dispatch(0, x.data(), idx.data(), w.data(), 1, dispatched),
            absl::UnavailableError("rank 1: rank 0 left the group (it detached, rejoined or ended, "
                                   "or its ubepd exited) during dispatch counts of call 1; join "
                                   "again once rank 0 is back"));
  EXPECT_FALSE((*rank1)->must_attach_again());
}

// Ranks 0 and 1 of a group of two, ubepd telling each that it hosts rank 0 alone (rank 1 as if
// a peer daemon's). Rank 0 Rejoins, and its ubepd exits while the Join waits (the Join fails,
// the fd connection closed). The rank's join ticket, in its arena, is withdrawn, so that the
// lead does not take it as a live rank's; and where the lead had already formed the next
// generation with it (`formed`: the generation words moved to the ticket), the ranks of that
// generation are told that rank 0 left rather than wait for it until their timeout. Where
// ubepd answered the Join before it exited (`answered`: its drain ends the joins, then it
// closes the fd connections), the Rejoin fails with that answer, whichever the rank saw first.
void ExpectAJoinWhoseDaemonExitedWithdrawsItsTicket(bool formed, bool answered = false) {
  TwoRanksOneHosted two;
  AlteringUbepd& ubepd = two.ubepd;
  ClosableFdSocket& fd_socket = two.fd_socket;
  absl::StatusOr<std::unique_ptr<Rank>>& rank0 = two.rank0;
  absl::StatusOr<std::unique_ptr<Rank>>& rank1 = two.rank1;
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  const uint64_t generation = (*rank0)->stats().generation;
  // What ubepd's Join had done before it exited: rank 0's ticket for the next generation,
  // and (formed) the lead's forming it, rank 1 with it.
  ubepd.node().ForEachArena([&](int r, std::byte* base, const kernels::RankArenaLayout& layout,
                                const kernels::EpConfig&) {
    kernels::RankControl* c = kernels::ControlOf(base, layout);
    if (r == 0) std::atomic_ref<uint64_t>(c->join_ticket).store(generation + 1);
    if (formed) std::atomic_ref<uint64_t>(c->generation).store(generation + 1);
  });
  if (answered) {
    ubepd.AnswerJoins(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "ubepd is draining (shutting down); attach again when it is back"));
  } else {
    ubepd.AnswerJoins(grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed"), /*marked=*/false);
  }
  fd_socket.Close(1);
  EXPECT_EQ((*rank0)->Rejoin(std::nullopt).status(),
            answered ? absl::UnavailableError("rank 0: join: ubepd is draining (shutting down); "
                                              "attach again when it is back")
                     : absl::UnavailableError("rank 0: ubepd exited (it closed this rank's fd "
                                              "connection); detach, and attach again when it is back"));
  uint64_t ticket = 1;
  ubepd.node().ForEachArena([&](int r, std::byte* base, const kernels::RankArenaLayout& layout,
                                const kernels::EpConfig&) {
    if (r == 0) ticket = std::atomic_ref<uint64_t>(kernels::ControlOf(base, layout)->join_ticket).load();
  });
  EXPECT_EQ(ticket, 0u);
  // Rank 1: told that rank 0 left, in the generation it is in (formed: the new one).
  EXPECT_EQ(AbortWords(ubepd.node()),
            (std::vector<uint32_t>{kernels::kAbortDraining, kernels::kAbortRankGone | 0u}));
  EXPECT_TRUE((*rank0)->must_attach_again());
  ubepd.AnswerJoins(grpc::Status::OK);
}

TEST(ClientTest, AJoinWhoseDaemonExitedWithdrawsItsTicket) {
  ExpectAJoinWhoseDaemonExitedWithdrawsItsTicket(/*formed=*/false);
}

TEST(ClientTest, AJoinWhoseDaemonExitedAfterTheGroupFormedWithItStopsThatGroup) {
  ExpectAJoinWhoseDaemonExitedWithdrawsItsTicket(/*formed=*/true);
}

TEST(ClientTest, AJoinUbepdAnsweredBeforeItExitedFailsWithTheAnswerAndWithdrawsItsTicket) {
  ExpectAJoinWhoseDaemonExitedWithdrawsItsTicket(/*formed=*/true, /*answered=*/true);
}

TEST(ClientTest, ARankThatFindsItsDaemonGoneStopsItsRanksAsDrainingAndTellsThePeersItLeft) {
  ExpectADaemonExitStopsItsRanksAndTellsThePeers(/*peer_in_a_newer_generation=*/false);
}

TEST(ClientTest, ARankThatFindsItsDaemonGoneLeavesAPeerOfANewerGenerationAlone) {
  ExpectADaemonExitStopsItsRanksAndTellsThePeers(/*peer_in_a_newer_generation=*/true);
}

// must_attach_again() and Detach find the daemon gone as BeginStep does, and stop the group
// alike: the peers learn that the rank left at once, not after their wait timeout.
TEST(ClientTest, MustAttachAgainThatFindsTheDaemonGoneStopsTheGroup) {
  ExpectADaemonExitStopsItsRanksAndTellsThePeers(false, NoticedBy::kMustAttachAgain);
}

TEST(ClientTest, ADetachThatFindsTheDaemonGoneStopsTheGroupAndSucceeds) {
  ExpectADaemonExitStopsItsRanksAndTellsThePeers(false, NoticedBy::kDetach);
}

// ubepd dies while a rank waits in BeginStep for the decision on a plan prepared for its
// step: the wait looks at the connection as BeginStep does and stops the group, instead of
// waiting out the decision timeout and blaming the balancer.
TEST(ClientTest, ARankWaitingForAPlansDecisionFindsItsDaemonGone) {
  ClientOptions options;
  options.decision_timeout = absl::Seconds(60);
  options.daemon_check_interval = absl::Milliseconds(1);
  OneRankThroughUbepd one(options);
  AlteringUbepd& ubepd = one.ubepd;
  ClosableFdSocket& fd_socket = one.fd_socket;
  absl::StatusOr<std::unique_ptr<Rank>>& rank = one.rank;
  ASSERT_TRUE(rank.ok()) << rank.status();
  const v1::PrepareResponse prepared = ubepd.node().Prepare(SwappedPlan(), 5);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  // ubepd exits once the rank waits for the decision (its control block counts the wait at
  // its start): the wait, not BeginStep's first look, finds the daemon gone.
  std::atomic<bool> waited{false};
  std::thread exit([&] {
    waited = test::WaitFor(
        [&] {
          uint64_t waits = 0;
          ubepd.node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                        const kernels::EpConfig&) {
            waits = std::atomic_ref<uint64_t>(kernels::ControlOf(base, layout)->decision_waits).load();
          });
          return waits == 1;
        },
        absl::Seconds(30));
    fd_socket.Close(1);
  });
  const absl::Status begun = (*rank)->BeginStep(5);
  exit.join();
  EXPECT_TRUE(waited.load());
  EXPECT_EQ(begun, absl::UnavailableError("rank 0: ubepd exited (it closed this rank's fd "
                                          "connection); detach, and attach again when it is back"));
  EXPECT_EQ(AbortWords(ubepd.node()), (std::vector<uint32_t>{kernels::kAbortDraining}));
  EXPECT_TRUE((*rank)->must_attach_again());
}

// The fd socket is found next to the gRPC socket the client reached: a daemon started with a
// relative --socket names its fd socket relative to its own working directory.
TEST(ClientTest, TheFdSocketIsFoundInTheDirectoryOfTheSocketTheClientReached) {
  test::TempDir dir;
  const std::string socket = dir.path() + "/ubepd.sock";
  AlteringUbepd ubepd(socket, [](v1::AttachResponse& response) {
    response.set_fd_socket("ubepd.sock.fds");
  });
  ClosableFdSocket fd_socket(ubepd.node(), socket + ".fds");
  ClientOptions options;
  options.socket_path = socket;
  options.rpc_timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  EXPECT_TRUE((*rank)->BeginStep(0).ok());
}

// The slot map is shared memory: a word outside the weight buffers (a stray store by any
// process of the group) is refused as ubepd refuses it, not handed out as a span past the
// arena's end.
TEST(ClientTest, ASlotMapWordOutsideTheWeightBuffersIsRefused) {
  test::TempDir dir;
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = StartUbepd(dir);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(ClientOf(dir), 0, 1, 0, Shape());
  ASSERT_TRUE(rank.ok()) << rank.status();
  ASSERT_TRUE((*rank)->BeginStep(0).ok());
  ASSERT_TRUE((*rank)->ExpertWeights(0, 1).ok());
  int buffers = 0;
  (*ubepd)->node().ForEachArena([&](int, std::byte* base, const kernels::RankArenaLayout& layout,
                                    const kernels::EpConfig& config) {
    buffers = layout.buffers_per_layer;
    for (int b = 0; b < 2; ++b) kernels::SlotMap(base, layout, config, b)[1] = 0xfffffff0u;
  });
  EXPECT_EQ((*rank)->ExpertWeights(0, 1).status(),
            absl::DataLossError(absl::StrCat(
                "rank 0's slot map says layer 0 slot 1 is in weight buffer 4294967280, outside "
                "[0, ", buffers, "): its arena was written outside ubepd")));
  EXPECT_TRUE((*rank)->ExpertWeights(0, 0).ok());
}

// ubepd's own "not yet" (a peer daemon's arenas are not mapped) reads as ubepd said it, as
// docs/serving-integration.md promises; only the transport's failures are "not reachable".
TEST(ClientTest, TheDaemonsOwnUnavailableIsNotCalledUnreachable) {
  test::TempDir dir;
  daemon::DaemonOptions options;
  options.socket_path = dir.path() + "/ubepd.sock";
  options.balancer = "unix:" + dir.path() + "/no-balancer.sock";  // Never answers.
  options.listen = "127.0.0.1:0";
  options.node.num_ranks = 1;  // Hosts rank 0 of 2: rank 1's daemon never registers.
  options.node_name = "node-0";
  options.node.join_timeout = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = daemon::Daemon::Start(options);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  EXPECT_EQ(Rank::Attach(ClientOf(dir), 0, 2, 0, Shape()).status(),
            absl::UnavailableError(
                "rank 0: attach: the arenas of rank 1 are not mapped yet: their daemons have "
                "not attached a client or not registered with the balancer; attach again"));
  // Only gRPC's own words between the two parts vary.
  test::TempDir empty;
  const absl::Status unreachable = Rank::Attach(ClientOf(empty), 0, 1, 0, Shape()).status();
  EXPECT_EQ(unreachable.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(unreachable.message(), "rank 0: attach: ubepd is not reachable ("))
      << unreachable;
  EXPECT_TRUE(absl::EndsWith(unreachable.message(), "); is it running?")) << unreachable;
}

// A ubepd that takes the connection and never answers (stopped, hung: here a socket that
// listens and never accepts) is Unavailable at rpc_timeout, saying so: not DeadlineExceeded,
// which says that a peer of the group did not come ("attach: Deadline Exceeded").
TEST(ClientTest, AnAttachUbepdDoesNotAnswerIsUnavailable) {
  test::TempDir dir;
  ClientOptions options = ClientOf(dir);
  UniqueFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(options.socket_path.size(), sizeof(address.sun_path));
  std::memcpy(address.sun_path, options.socket_path.data(), options.socket_path.size());
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener.get(), 16), 0);
  options.rpc_timeout = absl::Milliseconds(500);
  EXPECT_EQ(Rank::Attach(options, 0, 1, 0, Shape()).status(),
            absl::UnavailableError("rank 0: attach: ubepd did not answer within 500ms "
                                   "(rpc_timeout); is it stopped or hung?"));
}

// The errors of ubepd's control RPCs (the balancer's and peer daemons') are counted as the
// clients' RPCs are (errors_total{source="rpc"}) and marked as ubepd's own.
TEST(ClientTest, ControlRpcErrorsAreCountedAndMarkedAsUbepds) {
  test::TempDir dir;
  daemon::DaemonOptions options;
  options.socket_path = dir.path() + "/ubepd.sock";
  options.listen = "127.0.0.1:0";
  options.metrics = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<daemon::Daemon>> ubepd = daemon::Daemon::Start(options);
  ASSERT_TRUE(ubepd.ok()) << ubepd.status();
  auto stub = v1::DaemonControl::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*ubepd)->listen_port()), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext context;
    v1::CommitRequest request;
    request.set_version(99);
    v1::CommitResponse response;
    const grpc::Status status = stub->Commit(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(status.error_message(), "plan v99 is not prepared here");
    EXPECT_EQ(context.GetServerTrailingMetadata().count(kUbepOrigin), 1u);
  }
  const std::string metrics = HttpGet((*ubepd)->metrics_port(), "/metrics");
  EXPECT_TRUE(absl::StrContains(
      metrics, "ubep_daemon_errors_total{code=\"NOT_FOUND\",source=\"rpc\"} 2\n"))
      << metrics;
}

}  // namespace
}  // namespace ubep
