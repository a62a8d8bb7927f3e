// ubep-bench-cuda: dispatch and combine on the CUDA backend, ranks as processes sharing one
// GPU (CUDA IPC), next to device-to-device copies measured in the same run.
// Prints a JSON array, one row per line as each rank count finishes: per (ranks, tokens, hidden) and
// method (ubep_cuda: counting and sending in one cooperative launch; ubep_cuda_flagged: the same
// with flag-in-granule rows and partials, kernels/common/flagged_rows.h; ubep_cuda_count_first:
// the counting kernel, then the senders; bsp_cuda; all on the same input): p50_us/p99_us of
// dispatch+combine (slowest rank), span_p50_us/span_p99_us (each iteration's first start to
// last end over the ranks, one steady clock), bytes_moved, GB/s, and two device-to-device
// copies measured by rank 0 after its iterations; on ubep_cuda's row, the run's ratios
// ubep_over_bsp, span_ubep_over_bsp, flagged_over_ubep and count_first_over_ubep (p50 over
// p50; null where either failed). The copies: d2d_copy_gbps, 1 GiB (past the L2 cache:
// the card's memory rate, the ceiling of the stores), and d2d_copy_same_size_gbps, rank 0's
// own bytes; both count bytes copied (each read once and written once), as bytes_moved counts
// rows stored.
// Every iteration's ranks leave a start line together (untimed), as ubep-bench-dataplane's
// do, so no iteration carries the previous one's skew between ranks; and every iteration's
// combine output is copied back and checked against its input outside the timing: the inputs
// alternate between two sets of powers of two (bench::CheckedInput) that the identity experts
// and K weights 1/K give back exactly, so a row dropped, doubled, misplaced or read before it
// was stored fails the case.
// A rank that dies or fails gives its case an "error" row instead of numbers, and the exit
// status 1.
//
//   ubep-bench-cuda [--ranks 2,4,8] [--tokens 128] [--hidden 7168] [--iters 50] [--rounds 2]
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/dataplane_inputs.h"
#include "common/percentile.h"
#include "kernels/common/routing.h"
#include "kernels/cuda/cuda_ep.h"
#include "kernels/host/shared_arena.h"
#include "nlohmann/json.hpp"

namespace ubep::kernels {
namespace {

constexpr int kMaxRanks = 8, kMaxIters = 1000, kWarmup = 5;
// How long a rank waits for its peers outside a call (to start, to finish): long enough for
// ranks time-slicing one GPU, short enough that a dead rank costs a case seconds, not minutes.
constexpr absl::Duration kMeetTimeout = absl::Seconds(20);
// A dispatch or combine waiting for a peer: a step of 8 ranks x 4096 tokens time-slicing one
// GPU takes well under a second.
constexpr absl::Duration kCallTimeout = absl::Seconds(10);

struct Board {
  // ready: ranks whose arena handle is posted; set_up: ranks done setting up (peers opened,
  // CudaEp created, inputs on the device), which the parent waits for before `go`.
  std::atomic<int> ready, set_up, go, done;
  // Ranks that reached the start line of each iteration (warm-up included).
  std::atomic<int> line[kWarmup + kMaxIters];
  std::byte handles[kMaxRanks][64];
  // Each timed iteration's start and end on each rank (steady clock, ns).
  int64_t start_ns[kMaxIters][kMaxRanks];
  int64_t end_ns[kMaxIters][kMaxRanks];
  uint64_t bytes[kMaxRanks];
  double copy_gbps, copy_same_size_gbps;
  std::atomic<int> failed;
  char error[256];
};

int RankMain(const bench::Case& c, Protocol protocol, EpConfig::SenderThread sender_thread,
             bool flagged, int rank, int iters,
             const bench::Skew& skew, Board* board) {
  bool posted_ready = false, posted_set_up = false;
  auto fail = [&](const std::string& m) {
    // The first rank to fail names the case's error (the others often only saw it give up);
    // every rank's goes to stderr.
    std::fprintf(stderr, "ubep-bench-cuda: %d ranks, %d tokens: rank %d: %s\n", c.ranks,
                 c.tokens, rank, m.c_str());
    if (board->failed.exchange(1) == 0) {
      std::snprintf(board->error, sizeof(board->error), "rank %d: %s", rank, m.c_str());
    }
    if (!posted_ready) board->ready.fetch_add(1);
    if (!posted_set_up) board->set_up.fetch_add(1);
    // Keep this rank's arena alive until every peer is done with it.
    board->done.fetch_add(1);
    const absl::Time until = absl::Now() + kMeetTimeout;
    while (board->done.load() < c.ranks && absl::Now() < until) usleep(100);
    return 3;
  };
// A CUDA call that fails ends the rank with the call and the error.
#define BENCH_CUDA(call)                                                          \
  if (const cudaError_t error_ = (call); error_ != cudaSuccess) {                 \
    return fail(std::string(#call) + ": " + cudaGetErrorString(error_));          \
  }
  BENCH_CUDA(cudaSetDevice(0));
  const EpConfig config{.num_ranks = c.ranks, .max_tokens = c.tokens, .hidden = c.hidden,
                        .top_k = bench::kTopK, .num_experts = bench::kExperts,
                        .slots_per_rank = bench::kExperts / c.ranks, .num_layers = 1,
                        .dtype = DType::kBFloat16, .protocol = protocol,
                        .timeout = kCallTimeout, .sender_thread = sender_thread,
                        .flagged_tokens = flagged ? c.tokens : 0};
  auto arena = DeviceArena::Create(ArenaLayout(config).total_bytes);
  if (!arena.ok()) return fail(std::string(arena.status().message()));
  if (!(*arena)->IpcHandle(board->handles[rank]).ok()) return fail("ipc handle");
  board->ready.fetch_add(1);
  posted_ready = true;
  const absl::Time give_up = absl::Now() + kMeetTimeout;
  while (board->ready.load() < c.ranks && absl::Now() < give_up) usleep(100);
  if (board->ready.load() < c.ranks) return fail("a peer never got ready");
  std::vector<std::unique_ptr<DeviceArena>> peers;
  std::vector<std::byte*> pointers(c.ranks);
  for (int s = 0; s < c.ranks; ++s) {
    if (s == rank) {
      pointers[s] = (*arena)->data();
      continue;
    }
    auto peer = DeviceArena::OpenPeer(board->handles[s]);
    if (!peer.ok()) return fail(std::string(peer.status().message()));
    pointers[s] = (*peer)->data();
    peers.push_back(std::move(*peer));
  }
  auto ep = CudaEp::Create(config, rank, pointers);
  if (!ep.ok()) return fail(std::string(ep.status().message()));
  const std::vector<int32_t> idx = bench::RouteTokens(c, rank, skew);
  const std::vector<float> w(idx.size(), 1.0f / bench::kTopK);
  const std::vector<std::byte> plan = bench::ExpertParallelPlan();
  // Two inputs, even and odd iterations, each iteration's output checked against its own.
  const std::vector<uint16_t> inputs[2] = {bench::CheckedInput(c, rank, 0),
                                           bench::CheckedInput(c, rank, 1)};
  const size_t x_bytes = inputs[0].size() * sizeof(uint16_t);
  std::vector<uint16_t> out_host(inputs[0].size());
  void *d_x[2], *d_idx, *d_w, *d_plan, *d_out;
  for (int parity = 0; parity < 2; ++parity) {
    BENCH_CUDA(cudaMalloc(&d_x[parity], x_bytes));
    BENCH_CUDA(cudaMemcpy(d_x[parity], inputs[parity].data(), x_bytes, cudaMemcpyHostToDevice));
  }
  BENCH_CUDA(cudaMalloc(&d_out, x_bytes));
  BENCH_CUDA(cudaMalloc(&d_idx, idx.size() * 4));
  BENCH_CUDA(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&d_w, w.size() * 4));
  BENCH_CUDA(cudaMemcpy(d_w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&d_plan, plan.size()));
  BENCH_CUDA(cudaMemcpy(d_plan, plan.data(), plan.size(), cudaMemcpyHostToDevice));
  const auto* host_plan = reinterpret_cast<const PlanTableHeader*>(plan.data());
  // Bytes stored: one row per (token, destination), out and back, bf16 (a rank's rows to
  // itself included, as the host bench and MPI_Alltoallv count them).
  uint64_t records = 0;
  for (int t = 0; t < c.tokens; ++t) {
    std::vector<int> dests;
    for (int k = 0; k < bench::kTopK; ++k) {
      const int d = RouteSlot(host_plan, 0, rank, t, k, idx[t * bench::kTopK + k]) /
                    (bench::kExperts / c.ranks);
      if (std::find(dests.begin(), dests.end(), d) == dests.end()) dests.push_back(d);
    }
    records += dests.size();
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  board->set_up.fetch_add(1);
  posted_set_up = true;
  const absl::Time start_by = absl::Now() + kMeetTimeout;
  while (board->go.load() == 0 && absl::Now() < start_by) usleep(100);
  CudaDispatchOutput out;
  for (int i = 0; i < kWarmup + iters; ++i) {
    // The start line: every rank leaves once all have arrived (untimed).
    board->line[i].fetch_add(1);
    const absl::Time line_by = absl::Now() + kMeetTimeout;
    for (uint64_t spins = 1; board->line[i].load() < c.ranks; ++spins) {
      if (spins % 4096 == 0 && absl::Now() > line_by) {
        return fail(absl::StrCat("a peer never reached the start line of iteration ", i + 1));
      }
    }
    const int64_t start = bench::NowNs();
    absl::Status s = (*ep)->Dispatch({d_x[i % 2], static_cast<int32_t*>(d_idx),
                                      static_cast<float*>(d_w), c.tokens, 0,
                                      static_cast<PlanTableHeader*>(d_plan), host_plan},
                                     out);
    if (s.ok()) s = (*ep)->Combine(out.recv_x, d_out);
    if (!s.ok()) return fail(std::string(s.message()));
    if (i >= kWarmup) {
      board->start_ns[i - kWarmup][rank] = start;
      board->end_ns[i - kWarmup][rank] = bench::NowNs();
    }
    // Every iteration's output, outside the timing (CheckedInput says why it is exact).
    BENCH_CUDA(cudaMemcpy(out_host.data(), d_out, x_bytes, cudaMemcpyDeviceToHost));
    const std::vector<uint16_t>& x = inputs[i % 2];
    if (const int64_t wrong = bench::FirstDifference(out_host, x); wrong >= 0) {
      return fail(absl::StrFormat("iteration %d: combine gave out[%d] = 0x%04x, not x[%d] = "
                                  "0x%04x",
                                  i + 1, wrong, out_host[wrong], wrong, x[wrong]));
    }
  }
  board->bytes[rank] = records * c.hidden * 2 * 2;
  // Every rank's iterations end before the references are timed: a peer's last combine would
  // share the card with them.
  board->done.fetch_add(1);
  const absl::Time end = absl::Now() + kMeetTimeout;
  while (board->done.load() < c.ranks && absl::Now() < end) usleep(100);
  if (rank == 0) {
    // References: device-to-device copies, 3 untimed, then the median of 11 timed one by one.
    auto copy_gbps = [&](size_t n, double* gbps) -> cudaError_t {
      void *a = nullptr, *b = nullptr;
      cudaEvent_t e0 = nullptr, e1 = nullptr;
      cudaError_t error = cudaMalloc(&a, n);
      if (error == cudaSuccess) error = cudaMalloc(&b, n);
      if (error == cudaSuccess) error = cudaEventCreate(&e0);
      if (error == cudaSuccess) error = cudaEventCreate(&e1);
      std::vector<double> each;
      for (int i = 0; i < 14 && error == cudaSuccess; ++i) {
        float ms = 0;
        error = cudaEventRecord(e0);
        if (error == cudaSuccess) error = cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice);
        if (error == cudaSuccess) error = cudaEventRecord(e1);
        if (error == cudaSuccess) error = cudaEventSynchronize(e1);
        if (error == cudaSuccess) error = cudaEventElapsedTime(&ms, e0, e1);
        if (error == cudaSuccess && i >= 3) each.push_back(n / (ms * 1e6));
      }
      if (error == cudaSuccess) *gbps = ubep::Percentile(each, 0.5);
      cudaFree(a);
      cudaFree(b);
      if (e0 != nullptr) cudaEventDestroy(e0);
      if (e1 != nullptr) cudaEventDestroy(e1);
      return error;
    };
    BENCH_CUDA(copy_gbps(size_t{1} << 30, &board->copy_gbps));
    BENCH_CUDA(copy_gbps(std::max<uint64_t>(board->bytes[0], 1 << 20), &board->copy_same_size_gbps));
  }
  return 0;
#undef BENCH_CUDA
}

}  // namespace
}  // namespace ubep::kernels

int main(int argc, char** argv) {
  using namespace ubep::kernels;
  std::vector<int> ranks = {2, 4, 8};
  int tokens = 128, hidden = 7168, iters = 50, rounds = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--ranks") {
      ranks.clear();
      for (absl::string_view p : absl::StrSplit(argv[i + 1], ',')) {
        ranks.push_back(std::clamp(std::atoi(std::string(p).c_str()), 1, kMaxRanks));
      }
    } else if (flag == "--tokens") {
      tokens = std::atoi(argv[i + 1]);
    } else if (flag == "--hidden") {
      hidden = std::atoi(argv[i + 1]);
    } else if (flag == "--iters") {
      iters = std::clamp(std::atoi(argv[i + 1]), 1, kMaxIters);
    } else if (flag == "--rounds") {
      rounds = std::clamp(std::atoi(argv[i + 1]), 1, 8);
    }
  }
  // Uniform routing only (a skewed case would draw from bench::SkewedDistribution).
  const ubep::bench::Skew skew;
  // Each row is printed as soon as its case is done, so that a run cut short by a time limit
  // still leaves the cases it finished.
  bool first_row = true;
  bool failed = false;  // A case gave an error row.
  std::printf("[");
  for (int r : ranks) {
    if (ubep::bench::kExperts % r != 0) {
      std::fprintf(stderr, "ranks %d: 256 experts do not divide evenly; skipped\n", r);
      continue;
    }
    // Every method on the same input, in rounds (--rounds, 2 by default) whose order is
    // reversed every other round and rotated every two (0 1 2 3, 3 2 1 0, 1 2 3 0, ...: with
    // two rounds every method's mean place is the same), each run a fresh group of rank
    // processes with its own warm-up, so that a GPU's clocks and a shared host's slow spells
    // fall on every method alike. The iterations are split among the rounds; percentiles are
    // over all of them.
    struct Method {
      const char* name;
      Protocol protocol;
      EpConfig::SenderThread sender_thread;
      bool flagged;
    };
    const Method methods[] = {
        {"ubep_cuda", Protocol::kUbep, EpConfig::SenderThread::kAuto, false},
        {"ubep_cuda_flagged", Protocol::kUbep, EpConfig::SenderThread::kAuto, true},
        {"ubep_cuda_count_first", Protocol::kUbep, EpConfig::SenderThread::kOff, false},
        {"bsp_cuda", Protocol::kBsp, EpConfig::SenderThread::kAuto, false}};
    constexpr int kMethods = 4;
    constexpr int kUbepCuda = 0, kFlagged = 1, kCountFirst = 2, kBspCuda = 3;  // As above.
    struct Pooled {
      std::vector<double> lat, span;  // Per iteration: the slowest rank's time; the span.
      uint64_t bytes = 0;
      double copy_gbps = 0, copy_same_size_gbps = 0;
      std::string error;
    };
    Pooled pooled[kMethods];
    const int round_count = std::min(rounds, iters);
    const ubep::bench::Case c{"cuda", r, tokens, hidden, "uniform"};
    for (int round = 0; round < round_count; ++round) {
      const int n = iters * (round + 1) / round_count - iters * round / round_count;
      for (int j = 0; j < kMethods; ++j) {
        const int which = ((round % 2 == 0 ? j : kMethods - 1 - j) + round / 2) % kMethods;
        const Method& m = methods[which];
        Pooled& into = pooled[which];
        if (!into.error.empty()) continue;  // A method that failed is not run again.
        absl::StatusOr<SharedArena> created = SharedArena::Create("cuda-bench", sizeof(Board));
        if (!created.ok()) {
          into.error = absl::StrCat("the ranks' board: ", created.status().message());
          continue;
        }
        SharedArena board_arena = *std::move(created);
        auto* board = new (board_arena.data()) Board{};
        std::vector<pid_t> pids;
        for (int rank = 0; rank < r; ++rank) {
          const pid_t pid = fork();
          if (pid == 0) {
            _exit(RankMain(c, m.protocol, m.sender_thread, m.flagged, rank, n, skew, board));
          }
          pids.push_back(pid);
        }
        // Every rank set up (or one dead: its peers give up on their own), then go, so that
        // no rank's first call waits on a peer's set-up under the call timeout; every rank
        // reaped, and a rank that died (a signal, or an exit the board does not explain)
        // turns the method into an error row rather than numbers.
        std::vector<int> status(r, -1);
        auto reap = [&](int options) {
          for (int rank = 0; rank < r; ++rank) {
            if (status[rank] == -1 && waitpid(pids[rank], &status[rank], options) <= 0) {
              status[rank] = -1;
            }
          }
        };
        const absl::Time until = absl::Now() + kMeetTimeout;
        while (board->set_up.load() < r && absl::Now() < until &&
               std::count(status.begin(), status.end(), -1) == r) {
          usleep(1000);
          reap(WNOHANG);
        }
        board->go.store(1);
        reap(0);
        std::string died;
        for (int rank = 0; rank < r && died.empty(); ++rank) {
          if (WIFSIGNALED(status[rank])) {
            died = absl::StrCat("rank ", rank, " killed by signal ", WTERMSIG(status[rank]));
          } else if (!WIFEXITED(status[rank]) || WEXITSTATUS(status[rank]) != 0) {
            if (!board->failed) died = absl::StrCat("rank ", rank, " exited with status ", status[rank]);
          }
        }
        if (board->failed || !died.empty()) {
          into.error = board->failed ? std::string(board->error) : died;
          continue;
        }
        for (int i = 0; i < n; ++i) {
          const ubep::bench::IterationTimes t =
              ubep::bench::TimeIteration(board->start_ns[i], board->end_ns[i], r);
          into.lat.push_back(t.slowest_us);
          into.span.push_back(t.span_us);
        }
        into.bytes = 0;
        for (int i = 0; i < r; ++i) into.bytes += board->bytes[i];
        into.copy_gbps = board->copy_gbps;
        into.copy_same_size_gbps = board->copy_same_size_gbps;
      }
    }
    for (int which = 0; which < kMethods; ++which) {
      const Pooled& p = pooled[which];
      nlohmann::json row = {{"method", methods[which].name}, {"ranks", r}, {"tokens", tokens},
                            {"hidden", hidden}, {"routing", "uniform"}, {"rounds", round_count}};
      if (!p.error.empty()) {
        row["error"] = p.error;
        failed = true;
      } else {
        const double p50 = ubep::Percentile(p.lat, 0.5);
        row["p50_us"] = p50;
        row["p99_us"] = ubep::Percentile(p.lat, 0.99);
        row["span_p50_us"] = ubep::Percentile(p.span, 0.5);
        row["span_p99_us"] = ubep::Percentile(p.span, 0.99);
        row["bytes_moved"] = p.bytes;
        row["gbps"] = p.bytes / (p50 * 1e3);
        row["d2d_copy_gbps"] = p.copy_gbps;
        row["d2d_copy_same_size_gbps"] = p.copy_same_size_gbps;
      }
      if (which == kUbepCuda) {
        // The comparisons of this run, on ubep_cuda's row as ubep-bench-dataplane puts them
        // (p50 over p50 of the same case and rounds); null where either side failed.
        auto ratio = [&](int a, int b, bool span) -> nlohmann::json {
          if (!pooled[a].error.empty() || !pooled[b].error.empty()) return nullptr;
          const double x = ubep::Percentile(span ? pooled[a].span : pooled[a].lat, 0.5);
          const double y = ubep::Percentile(span ? pooled[b].span : pooled[b].lat, 0.5);
          return y > 0 ? nlohmann::json(x / y) : nlohmann::json(nullptr);
        };
        row["ubep_over_bsp"] = ratio(kUbepCuda, kBspCuda, false);
        row["span_ubep_over_bsp"] = ratio(kUbepCuda, kBspCuda, true);
        row["flagged_over_ubep"] = ratio(kFlagged, kUbepCuda, false);
        row["count_first_over_ubep"] = ratio(kCountFirst, kUbepCuda, false);
      }
      std::printf("%s\n %s", first_row ? "" : ",", row.dump().c_str());
      std::fflush(stdout);
      first_row = false;
    }
  }
  std::printf("\n]\n");
  return failed ? 1 : 0;
}
