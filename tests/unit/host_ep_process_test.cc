// The host data plane with ranks as separate processes (fork after mapping the memfd arenas),
// including a rank killed with SIGKILL in the middle of a run.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/common/routing.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/shared_arena.h"

namespace ubep::kernels {
namespace {

constexpr int kRanks = 4;

// Shared between the test and its rank processes.
struct Board {
  std::atomic<int> steps_done[kRanks];
  char error[kRanks][256];
  int checked_rows[kRanks];
};

EpConfig Config(absl::Duration timeout) {
  return EpConfig{.num_ranks = kRanks,
                  .max_tokens = 32,
                  .hidden = 64,
                  .top_k = 4,
                  .num_experts = 8,
                  .slots_per_rank = 2,
                  .num_layers = 1,
                  .dtype = DType::kFloat32,
                  .protocol = Protocol::kUbep,
                  .timeout = timeout};
}

std::vector<std::byte> Plan() {
  std::vector<int> experts(kRanks * 2);
  std::vector<double> shares(kRanks * 2, 1.0);
  for (int p = 0; p < kRanks * 2; ++p) experts[p] = p;
  const LayerRouting layer{experts, shares};
  return *BuildPlanTable(1, 8, {&layer, 1});
}

// The payload of element h of token t of `rank`: exact in fp32, as are its sums below.
float Payload(int rank, int t, int h) { return rank * 1000 + t + h / 64.0f; }

// One rank's life: `steps` dispatch/combine rounds with self-checking payloads (Payload);
// every element of every received row and of the combined output is checked. Returns 0, or 3 with the error on the board.
int RankMain(int rank, const EpConfig& config, std::vector<std::byte*> arenas, int steps,
             Board* board) {
  auto fail = [&](const std::string& message) {
    std::snprintf(board->error[rank], sizeof(board->error[rank]), "%s", message.c_str());
    return 3;
  };
  absl::StatusOr<std::unique_ptr<HostEp>> ep = HostEp::Create(config, rank, arenas);
  if (!ep.ok()) return fail(std::string(ep.status().message()));
  const std::vector<std::byte> plan = Plan();
  const auto* table = reinterpret_cast<const PlanTableHeader*>(plan.data());
  std::mt19937 rng(rank);
  for (int step = 0; step < steps; ++step) {
    const int T = 1 + step % config.max_tokens;
    std::vector<float> x(T * config.hidden), combined(T * config.hidden);
    std::vector<int32_t> idx(T * config.top_k);
    std::vector<float> w(T * config.top_k);
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < config.hidden; ++h) x[t * config.hidden + h] = Payload(rank, t, h);
      for (int k = 0; k < config.top_k; ++k) {
        idx[t * config.top_k + k] = (t + 2 * k + step) % config.num_experts;
        w[t * config.top_k + k] = 0.25f;
      }
    }
    DispatchOutput out;
    absl::Status s = (*ep)->Dispatch(
        {x.data(), idx.data(), w.data(), T, config.hidden, 0, table}, out);
    if (!s.ok()) return fail(std::string(s.message()));
    const auto* rows = reinterpret_cast<const float*>(out.recv_x.data());
    for (int row = 0; row < out.num_rows(); ++row) {
      for (int h = 0; h < config.hidden; ++h) {
        if (rows[row * config.hidden + h] != Payload(out.src_rank[row], out.src_token[row], h)) {
          return fail(absl::StrCat("row ", row, " element ", h,
                                   " does not carry its source's payload"));
        }
      }
    }
    board->checked_rows[rank] += out.num_rows();
    // y = x: the combined output is sum_k 0.25 * x = x.
    s = (*ep)->Combine(out, out.recv_x.data(), combined.data());
    if (!s.ok()) return fail(std::string(s.message()));
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < config.hidden; ++h) {
        if (combined[t * config.hidden + h] != Payload(rank, t, h)) {
          return fail(absl::StrCat("combined token ", t, " element ", h, " is ",
                                   combined[t * config.hidden + h]));
        }
      }
    }
    board->steps_done[rank].fetch_add(1);
  }
  return 0;
}

class ProcessGroup {
 public:
  explicit ProcessGroup(const EpConfig& config)
      : config_(config), board_arena_(*SharedArena::Create("ubep-test-board", sizeof(Board))) {
    board_ = new (board_arena_.data()) Board{};
    for (int r = 0; r < kRanks; ++r) {
      arenas_.push_back(*SharedArena::Create(absl::StrCat("ubep-rank-", r),
                                             ArenaLayout(config).total_bytes));
      pointers_.push_back(arenas_.back().data());
    }
  }

  void Start(int steps) {
    for (int r = 0; r < kRanks; ++r) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) _exit(RankMain(r, config_, pointers_, steps, board_));
      pids_.push_back(pid);
    }
  }

  // Exit code of each rank (-signal when killed); a rank still alive at the deadline is killed
  // and reported as -1000.
  std::vector<int> WaitAll(absl::Duration limit) {
    std::vector<int> codes(kRanks, -1000);
    const absl::Time deadline = absl::Now() + limit;
    int left = kRanks;
    while (left > 0 && absl::Now() < deadline) {
      for (int r = 0; r < kRanks; ++r) {
        if (pids_[r] == 0) continue;
        int status = 0;
        if (waitpid(pids_[r], &status, WNOHANG) == pids_[r]) {
          codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
          pids_[r] = 0;
          --left;
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    for (int r = 0; r < kRanks; ++r) {
      if (pids_[r] != 0) {
        kill(pids_[r], SIGKILL);
        waitpid(pids_[r], nullptr, 0);
      }
    }
    return codes;
  }

  void Kill(int rank) { kill(pids_[rank], SIGKILL); }
  Board& board() { return *board_; }

 private:
  EpConfig config_;
  SharedArena board_arena_;
  Board* board_ = nullptr;
  std::vector<SharedArena> arenas_;
  std::vector<std::byte*> pointers_;
  std::vector<pid_t> pids_;
};

TEST(HostEpProcessTest, RanksAsProcessesExchangeSelfCheckingPayloads) {
  ProcessGroup group(Config(absl::Seconds(20)));
  group.Start(/*steps=*/40);
  const std::vector<int> codes = group.WaitAll(absl::Seconds(60));
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << group.board().error[r];
    EXPECT_EQ(group.board().steps_done[r].load(), 40);
    EXPECT_GT(group.board().checked_rows[r], 0);
  }
}

TEST(HostEpProcessTest, KilledRankTurnsIntoATimeoutNamingIt) {
  // A timeout no healthy step comes near, even with this test's four processes sharing two
  // busy cores with other tests (500 ms once timed out on a live rank there).
  ProcessGroup group(Config(absl::Seconds(3)));
  group.Start(/*steps=*/1000000);
  // Let every rank get going, then kill rank 1 in the middle of the run.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until) {
    bool all = true;
    for (int r = 0; r < kRanks; ++r) all &= group.board().steps_done[r].load() >= 20;
    if (all) break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  group.Kill(1);
  const std::vector<int> codes = group.WaitAll(absl::Seconds(20));
  EXPECT_EQ(codes[1], -SIGKILL);
  for (int r : {0, 2, 3}) {
    // Each survivor stops with an error naming rank 1, within its timeout (nobody hangs).
    EXPECT_EQ(codes[r], 3) << "rank " << r;
    const std::string error = group.board().error[r];
    EXPECT_EQ(error.rfind(absl::StrCat("rank ", r, ": timed out after 3s waiting for rank 1 ("),
                          0),
              0u)
        << error;
    EXPECT_NE(error.find("is rank 1 alive?"), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace ubep::kernels
