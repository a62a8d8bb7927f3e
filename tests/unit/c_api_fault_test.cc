// The C ABI when C++ throws inside it: this binary replaces the global operator new with one
// that fails the n-th allocation of the calling thread, and each case runs a C function once
// for every n until it completes. A C caller must get an error code and message every time,
// never an exception (which would unwind into C) and never a crash.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/daemon.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"
#include "ubep/ubep_c.h"

namespace {

// -1: no failure armed. n >= 0: the calling thread's allocation n from now fails (then none).
thread_local long fail_countdown = -1;
thread_local bool failed_one = false;

void* Allocate(std::size_t size) {
  if (fail_countdown == 0) {
    fail_countdown = -1;
    failed_one = true;
    throw std::bad_alloc();
  }
  if (fail_countdown > 0) --fail_countdown;
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t size) { return Allocate(size); }
void* operator new[](std::size_t size) { return Allocate(size); }
// The nothrow forms too (gRPC's, in the ubepd a case starts): every form this binary's delete
// frees must come from malloc (AddressSanitizer checks the pairs). Never failed on purpose.
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return std::malloc(size == 0 ? 1 : size);
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return std::malloc(size == 0 ? 1 : size);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

// (code, ubep_last_error())
using Outcome = std::pair<int, std::string>;

// Runs `call` in a fresh thread (its thread-locals, the last error among them, new) with its
// allocation n failing, for n = 0, 1, ... until a run fails none; returns every outcome seen
// with how many runs ended with an injected failure.
template <typename Call>
std::pair<std::set<Outcome>, int> Sweep(Call call) {
  std::set<Outcome> outcomes;
  int failed_runs = 0;
  for (long n = 0;; ++n) {
    if (n == 1000) {
      ADD_FAILURE() << "the call allocates without end";
      return {outcomes, failed_runs};
    }
    Outcome outcome;
    bool failed = false;
    std::thread([&] {
      fail_countdown = n;
      const int code = call();
      fail_countdown = -1;
      failed = failed_one;
      outcome = Outcome{code, ubep_last_error()};
    }).join();
    outcomes.insert(outcome);
    if (!failed) return {outcomes, failed_runs};
    ++failed_runs;
  }
}

ubep_model_shape Shape() {
  return ubep_model_shape{.struct_size = sizeof(ubep_model_shape), .num_layers = 1,
                          .num_experts = 4, .hidden = 8, .top_k = 2, .max_tokens = 4,
                          .slots_per_rank = 4, .bytes_per_expert = 0,
                          .dtype = UBEP_DTYPE_FLOAT32, .reserved = 0};
}

TEST(CAbiFaultTest, OutOfMemoryInAnErrorPathIsAnErrorCodeAndMessage) {
  const std::string refusal =
      "ubep_attach_with: options->struct_size is 7, not this library's "
      "sizeof(ubep_client_options) " + std::to_string(sizeof(ubep_client_options)) +
      " (fill the options with ubep_client_options_init)";
  auto [outcomes, failed_runs] = Sweep([] {
    ubep_client_options options{};
    options.struct_size = 7;
    options.socket_path = "/nonexistent/ubepd.sock";
    const ubep_model_shape shape = Shape();
    ubep_rank* rank = reinterpret_cast<ubep_rank*>(&options);  // must be cleared
    const int code = ubep_attach_with(&options, 0, 1, -1, &shape, -1, &rank);
    return rank == nullptr ? code : -1;
  });
  // The message is built in two allocations at least (the text, the status holding it) and
  // copied into the thread's last error (a third, in a fresh thread): each failure is one of
  // these outcomes, and the last run is the plain refusal.
  EXPECT_GE(failed_runs, 3);
  const std::set<Outcome> expected = {
      {8, "ubep_attach_with: out of memory"},
      {3, "out of memory: the message of error 3 could not be kept"},
      {3, refusal},
  };
  EXPECT_EQ(outcomes, expected);
}

TEST(CAbiFaultTest, ANullHandlesErrorOutOfMemoryIsAnErrorCodeAndMessage) {
  auto [outcomes, failed_runs] = Sweep([] { return ubep_begin_step(nullptr, 1); });
  EXPECT_GE(failed_runs, 2);
  const std::set<Outcome> expected = {
      {8, "ubep_begin_step: out of memory"},
      {3, "out of memory: the message of error 3 could not be kept"},
      {3, "ubep_begin_step: null handle"},
  };
  EXPECT_EQ(outcomes, expected);
}

TEST(CAbiFaultTest, DispatchedNewOutOfMemoryReturnsNullAndSaysWhy) {
  ubep_dispatched* d = nullptr;
  std::thread([&] {
    fail_countdown = 0;
    d = ubep_dispatched_new();
    fail_countdown = -1;
    EXPECT_EQ(std::string(ubep_last_error()), "ubep_dispatched_new: out of memory");
  }).join();
  EXPECT_EQ(d, nullptr);
  d = ubep_dispatched_new();
  ASSERT_NE(d, nullptr);
  int32_t rows = -1;
  ubep_dispatched_view(d, &rows, nullptr, nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(rows, 0);
  ubep_dispatched_free(d);
}

// Out of memory for the defaults, init leaves a zero struct_size (not the caller's bytes), and
// ubep_attach_with refuses it saying how to fill the options.
TEST(CAbiFaultTest, OptionsInitOutOfMemoryLeavesOptionsAttachRefuses) {
  ubep_client_options options;
  std::memset(&options, 0x5a, sizeof(options));
  std::thread([&] {
    fail_countdown = 0;
    ubep_client_options_init(&options, sizeof(options));
    fail_countdown = -1;
    EXPECT_TRUE(failed_one);
  }).join();
  const ubep_client_options zero{};
  EXPECT_EQ(std::memcmp(&options, &zero, sizeof(options)), 0);
  const ubep_model_shape shape = Shape();
  ubep_rank* rank = nullptr;
  EXPECT_EQ(ubep_attach_with(&options, 0, 1, -1, &shape, -1, &rank), 3);
  EXPECT_EQ(std::string(ubep_last_error()),
            "ubep_attach_with: options->struct_size is 0, not this library's "
            "sizeof(ubep_client_options) " + std::to_string(sizeof(ubep_client_options)) +
            " (fill the options with ubep_client_options_init)");
  ubep_client_options_init(&options, sizeof(options));
  EXPECT_EQ(options.struct_size, sizeof(options));
  EXPECT_STREQ(options.socket_path, "/run/ubep/ubepd.sock");
}

// ubep_attach runs out of memory filling its default options (the first allocation of the
// call): RESOURCE_EXHAUSTED, not the refusal of options (struct_size 0) its caller never
// passed, and *out cleared as on every other error.
TEST(CAbiFaultTest, AttachOutOfMemoryForItsDefaultsSaysSo) {
  int code = -1;
  std::string error;
  ubep_rank* rank = nullptr;
  std::thread([&] {
    const ubep_model_shape shape = Shape();
    rank = reinterpret_cast<ubep_rank*>(&code);  // must be cleared
    fail_countdown = 0;
    code = ubep_attach("/nonexistent/ubepd.sock", 0, 1, 0, &shape, &rank);
    fail_countdown = -1;
    EXPECT_TRUE(failed_one);
    error = ubep_last_error();
  }).join();
  EXPECT_EQ(code, 8);
  EXPECT_EQ(error, "ubep_attach: out of memory");
  EXPECT_EQ(rank, nullptr);
}

// An in-process ubepd and rank 0 of a one-rank group attached to it through the C ABI (null
// `rank`, with a failure added, where either did not start). The test detaches the rank.
struct OneRankThroughTheCAbi {
  OneRankThroughTheCAbi() {
    ubep::daemon::DaemonOptions options;
    options.socket_path = dir.path() + "/ubepd.sock";
    absl::StatusOr<std::unique_ptr<ubep::daemon::Daemon>> started =
        ubep::daemon::Daemon::Start(options);
    if (!started.ok()) {
      ADD_FAILURE() << started.status();
      return;
    }
    ubepd = *std::move(started);
    const ubep_model_shape shape = Shape();
    if (ubep_attach(options.socket_path.c_str(), 0, 1, 0, &shape, &rank) != 0) {
      ADD_FAILURE() << ubep_last_error();
    }
  }
  ubep::test::TempDir dir;
  std::unique_ptr<ubep::daemon::Daemon> ubepd;
  ubep_rank* rank = nullptr;
};

// ubep_must_attach_again finds the daemon gone and stops the group, building the error later
// calls return: out of memory there is a yes and a message, not an exception into C, and the
// stop it cut short is tried again by the next call (each run of the sweep gets further,
// until one completes), not taken as done.
TEST(CAbiFaultTest, MustAttachAgainOutOfMemoryIsStillAYes) {
  OneRankThroughTheCAbi one;
  ASSERT_NE(one.rank, nullptr);
  ubep_rank* rank = one.rank;
  one.ubepd.reset();  // ubepd exits: the rank's fd connection closes.
  auto [outcomes, failed_runs] = Sweep([rank] { return ubep_must_attach_again(rank); });
  // The message, its status and the plan's first check each allocate: every one of them
  // failed in a run of its own, the next run trying the stop again.
  EXPECT_GE(failed_runs, 2);
  const std::set<Outcome> expected = {{1, "ubep_must_attach_again: out of memory"}, {1, ""}};
  EXPECT_EQ(outcomes, expected);
  EXPECT_EQ(ubep_detach(rank), 0) << ubep_last_error();
}

// ubep_excluded's first look at a newly committed plan copies and checks its table: out of
// memory there is a no and a message, not an exception into C.
TEST(CAbiFaultTest, ExcludedOutOfMemoryIsANo) {
  OneRankThroughTheCAbi one;
  ASSERT_NE(one.rank, nullptr);
  ubep_rank* rank = one.rank;
  ubep::daemon::Daemon* ubepd = one.ubepd.get();
  // Plan v2, the same placement as the first, committed: not yet checked by the rank.
  ubep::balancer::Plan plan;
  plan.version = 2;
  plan.topology.num_ranks = 1;
  plan.topology.slots_per_rank = 4;
  plan.num_experts = 4;
  plan.layer_ids = {0};
  plan.layers.push_back(ubep::balancer::LayerPlan{{0, 1, 2, 3}, {1.0, 1.0, 1.0, 1.0}});
  const ubep::v1::PrepareResponse prepared = ubepd->node().Prepare(plan, 1000);
  ASSERT_TRUE(prepared.prepared()) << prepared.reason();
  ASSERT_TRUE(ubepd->node().Commit(2).ok());
  auto [outcomes, failed_runs] = Sweep([rank] { return ubep_excluded(rank); });
  EXPECT_GE(failed_runs, 1);
  const std::set<Outcome> expected = {{0, "ubep_excluded: out of memory"}, {0, ""}};
  EXPECT_EQ(outcomes, expected);
  EXPECT_EQ(ubep_detach(rank), 0) << ubep_last_error();
}

}  // namespace

namespace {

// The step the data-plane sweeps run on OneRankThroughTheCAbi's rank: 4 tokens of hidden 8,
// each to 2 experts with weight 0.5, all ones (the output is the input again).
struct OneStep {
  const std::vector<float> x = std::vector<float>(4 * 8, 1.0f);
  const std::vector<float> w = std::vector<float>(4 * 2, 0.5f);
  const std::vector<int32_t> idx = {0, 1, 2, 3, 0, 2, 1, 3};
  std::vector<float> out = std::vector<float>(4 * 8);

  int Dispatch(ubep_rank* rank, ubep_dispatched* d) const {
    return ubep_dispatch(rank, 0, x.data(), idx.data(), w.data(), 4, d);
  }
  // Into `out`, NaN before each call: a combine that says 0 and writes nothing is not taken
  // for one that wrote an earlier call's result.
  int Combine(ubep_rank* rank, ubep_dispatched* d) {
    std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
    int32_t rows = 0;
    const void* received = nullptr;
    ubep_dispatched_view(d, &rows, &received, nullptr, nullptr, nullptr, nullptr);
    return ubep_combine(rank, d, received, out.data());
  }
};

// `call` on a fresh thread with its allocation n failing.
struct FailingRun {
  int code = 0;
  bool failed = false;  // An allocation failed (else the call ran through).
  std::string message;
};
template <typename Call>
FailingRun RunWithAllocationFailing(long n, Call call) {
  FailingRun run;
  std::thread([&] {
    fail_countdown = n;
    run.code = call();
    fail_countdown = -1;
    run.failed = failed_one;
    failed_one = false;
    run.message = ubep_last_error();
  }).join();
  return run;
}

// After a call of step `step` that ran out of memory: the rank's next call either goes on
// (true: nothing of the failed call had begun) or says to Rejoin (13, its message into
// `said`), and the rank rejoins at a later step (`step` moves to where it resumes).
bool NextCallGoesOnOrRejoins(ubep_rank* rank, uint64_t& step, std::set<std::string>& said) {
  const int next = ubep_begin_step(rank, step + 1);
  if (next == 0) return true;
  EXPECT_EQ(next, 13);
  said.insert(ubep_last_error());
  uint64_t resume = 0;
  EXPECT_EQ(ubep_rejoin(rank, static_cast<int64_t>(step + 2), &resume), 0) << ubep_last_error();
  step = resume;
  return false;
}

// ubep_dispatch runs out of memory at each of its allocations in turn (the layout's buffers
// among them, after the call took part and its sender threads started): every time it is
// code 8 and a message, the call's senders are stopped before it returns (none reads its
// input after), and the rank's next call says to Rejoin, not that a dispatch came twice;
// Rejoin re-forms the group and the next step runs. Under AddressSanitizer a sender still
// reading the call's input after it returned is a use after scope.
TEST(CAbiFaultTest, DispatchOutOfMemoryStopsTheCallAndTheNextCallSaysToRejoin) {
  OneRankThroughTheCAbi one;
  ASSERT_NE(one.rank, nullptr);
  ubep_rank* rank = one.rank;
  OneStep io;
  uint64_t step = 0;
  std::set<std::string> said;
  int failed_runs = 0;
  for (long n = 0;; ++n) {
    ASSERT_LT(n, 1000) << "the call allocates without end";
    ASSERT_EQ(ubep_begin_step(rank, step), 0) << ubep_last_error();
    ubep_dispatched* dispatched = ubep_dispatched_new();
    ASSERT_NE(dispatched, nullptr);
    const FailingRun run =
        RunWithAllocationFailing(n, [&] { return io.Dispatch(rank, dispatched); });
    if (!run.failed) {
      ASSERT_EQ(run.code, 0) << run.message;
      ASSERT_EQ(io.Combine(rank, dispatched), 0) << ubep_last_error();
      EXPECT_EQ(io.out, io.x);  // 0.5 x 1 + 0.5 x 1 through one rank's slots.
      ubep_dispatched_free(dispatched);
      break;
    }
    ++failed_runs;
    EXPECT_EQ(run.code, 8);
    EXPECT_EQ(run.message, "ubep_dispatch: out of memory");
    ubep_dispatched_free(dispatched);
    // Never a dispatch that came twice: where the step goes on, its dispatch runs.
    if (NextCallGoesOnOrRejoins(rank, step, said)) {
      ubep_dispatched* again = ubep_dispatched_new();
      const int code_again = io.Dispatch(rank, again);
      EXPECT_EQ(code_again, 0) << ubep_last_error();
      if (code_again == 0) {
        EXPECT_EQ(io.Combine(rank, again), 0) << ubep_last_error();
        EXPECT_EQ(io.out, io.x);
      }
      ubep_dispatched_free(again);
      step += 2;
    }
  }
  EXPECT_GE(failed_runs, 3);
  // At least one failure came after the call took part (the layout's buffers).
  EXPECT_EQ(said, (std::set<std::string>{
                      "rank 0: a dispatch ran out of memory after it began; the group must be "
                      "re-formed: call Rejoin"}));
  EXPECT_EQ(ubep_detach(rank), 0) << ubep_last_error();
}

// ubep_combine runs out of memory at each of its allocations in turn (its sums' scratch after
// the call took part among them): every time it is code 8 and a message, and the rank's next
// call says to Rejoin (the group gave up on it: a peer would not have all its partials), or,
// where nothing of the call had begun, the combine runs again; Rejoin re-forms the group and
// the next step runs.
TEST(CAbiFaultTest, CombineOutOfMemoryStopsTheRankUntilItRejoins) {
  OneRankThroughTheCAbi one;
  ASSERT_NE(one.rank, nullptr);
  ubep_rank* rank = one.rank;
  OneStep io;
  uint64_t step = 0;
  std::set<std::string> said;
  int failed_runs = 0;
  for (long n = 0;; ++n) {
    ASSERT_LT(n, 1000) << "the call allocates without end";
    ASSERT_EQ(ubep_begin_step(rank, step), 0) << ubep_last_error();
    ubep_dispatched* dispatched = ubep_dispatched_new();
    ASSERT_NE(dispatched, nullptr);
    ASSERT_EQ(io.Dispatch(rank, dispatched), 0) << ubep_last_error();
    const FailingRun run =
        RunWithAllocationFailing(n, [&] { return io.Combine(rank, dispatched); });
    if (!run.failed) {
      ASSERT_EQ(run.code, 0) << run.message;
      EXPECT_EQ(io.out, io.x);  // 0.5 x 1 + 0.5 x 1 through one rank's slots.
      ubep_dispatched_free(dispatched);
      break;
    }
    ++failed_runs;
    EXPECT_EQ(run.code, 8);
    EXPECT_EQ(run.message, "ubep_combine: out of memory");
    if (NextCallGoesOnOrRejoins(rank, step, said)) {
      EXPECT_EQ(io.Combine(rank, dispatched), 0) << ubep_last_error();
      EXPECT_EQ(io.out, io.x);
      step += 2;
    }
    ubep_dispatched_free(dispatched);
  }
  EXPECT_GE(failed_runs, 1);
  EXPECT_EQ(said, (std::set<std::string>{
                      "rank 0: a combine ran out of memory; the group must be re-formed: call "
                      "Rejoin"}));
  EXPECT_EQ(ubep_detach(rank), 0) << ubep_last_error();
}

}  // namespace
