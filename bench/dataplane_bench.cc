// ubep-bench-dataplane: dispatch + combine latency of the host backend, ubep against the
// phase-by-phase bsp baseline and MPI_Alltoallv (Debian's OpenMPI, ubep-bench-mpi under
// mpirun) on the same bytes in the same run, next to a single-core memcpy of the bytes all
// ranks move. Ranks are processes sharing memfd arenas, as in production.
//
//   ubep-bench-dataplane [--json] [--iters N] [--cases decode|prefill|all] [--ranks 4,8]
//                        [--hidden 7168,2048] [--methods ubep,bsp,mpi_alltoallv,memcpy]
//                        [--sender-thread auto|on|off]
//
// --methods may also name ubep_flagged: ubep with every call's rows and partials as
// flag-in-granule rows (kernels/common/flagged_rows.h). --sender-thread: whether ubep's
// sender role has a thread of its own (EpConfig::sender_thread; auto: where the machine has
// two cores per rank); each row says how many threads a rank's call ran on.
//
// One iteration is one dispatch followed by one combine on every rank, all ranks starting
// together (an untimed start line, as the MPI baseline's MPI_Barrier); its latency is the
// slowest rank's, from that rank's start to its end. Reported per case and method: p50_us,
// p99_us over N iterations after warm-up (nearest rank: with N < 100, p99 is the slowest
// iteration); span_p50_us, span_p99_us, the same of each iteration's span from the first
// rank's start to the last rank's end (one steady clock for every process of the machine),
// which also counts how unevenly the ranks left the start line; bytes_moved (rows stored into
// the destinations' arenas by dispatch plus partial rows stored back by combine, all ranks; a
// rank's rows to itself included, as MPI_Alltoallv copies its own segment). Every method runs
// in rounds of N/4 iterations or fewer (a fresh group or mpirun
// and a warm-up per round, the order rotating), so that a shared machine's slow spells fall
// on all alike; the percentiles are over all rounds. Each rank checks every iteration's
// combine output against its input, outside the timing: the inputs alternate between two
// sets of powers of two (bench::CheckedInput), which the identity experts and K weights 1/K
// give back exactly, so a row dropped, doubled, given to another token or read before it was
// stored fails the case. The exit status is 1 when a method that ran failed (shown or not).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/dataplane_inputs.h"
#include "common/cpus.h"
#include "common/percentile.h"
#include "kernels/common/host_cpu.h"
#include "kernels/common/routing.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/shared_arena.h"
#include "kernels/host/signal.h"
#include "nlohmann/json.hpp"

namespace ubep::kernels {
namespace {

using bench::Case;

constexpr int kMaxRanks = 16;
constexpr int kMaxIters = 1000;
constexpr int kWarmup = 5;

struct Board {
  uint32_t arrived;   // Ranks at the start line of the next iteration (AlignStart).
  uint32_t released;  // Iterations whose start line every rank has passed.
  uint32_t sleepers;  // Ranks asleep on `released` (signal.h).
  // Each timed iteration's start and end on each rank (steady clock, ns).
  int64_t start_ns[kMaxIters][kMaxRanks];
  int64_t end_ns[kMaxIters][kMaxRanks];
  uint64_t bytes[kMaxRanks];
  int threads[kMaxRanks];  // HostEp::threads_per_call
  int failed;       // Set once, by the first rank that fails (Fail).
  char error[256];  // That rank's error.
};

// Records this rank's error unless another rank's came first (the first is the cause; the
// others are usually peers timing out behind it).
void Fail(Board* board, const std::string& error) {
  if (std::atomic_ref<int>(board->failed).exchange(1) != 0) return;
  std::snprintf(board->error, sizeof(board->error), "%s", error.c_str());
}

using bench::NowNs;

// The start line of iteration `round` (1-based): every rank leaves once all have arrived, as
// the MPI baseline's MPI_Barrier before each iteration, so no method's latency carries the
// previous iteration's skew between ranks. Untimed.
bool AlignStart(Board* board, int ranks, uint32_t round) {
  if (std::atomic_ref<uint32_t>(board->arrived).fetch_add(1) + 1 == static_cast<uint32_t>(ranks)) {
    std::atomic_ref<uint32_t>(board->arrived).store(0);
    Signal(&board->released, round, Doorbell::Own(&board->released, &board->sleepers));
    return true;
  }
  return WaitEpoch(&board->released, round, Doorbell::Own(&board->released, &board->sleepers),
                   DeadlineAfter(absl::Seconds(120)))
      .ok();
}

int RankMain(const Case& c, const EpConfig& config, int rank, std::vector<std::byte*> arenas,
             const std::vector<std::byte>& plan, const bench::Skew& skew, int iters,
             Board* board) {
  absl::StatusOr<std::unique_ptr<HostEp>> ep = HostEp::Create(config, rank, arenas);
  if (!ep.ok()) {
    Fail(board, std::string(ep.status().message()));
    return 3;
  }
  const int K = config.top_k;
  // Two inputs, even and odd iterations, each iteration's output checked against its own.
  const std::vector<uint16_t> inputs[2] = {bench::CheckedInput(c, rank, 0),
                                           bench::CheckedInput(c, rank, 1)};
  std::vector<uint16_t> out(inputs[0].size());
  const std::vector<int32_t> idx = bench::RouteTokens(c, rank, skew);
  const std::vector<float> w(idx.size(), 1.0f / K);
  const auto* table = reinterpret_cast<const PlanTableHeader*>(plan.data());
  DispatchOutput dispatched;
  board->threads[rank] = (*ep)->threads_per_call();
  for (int i = 0; i < kWarmup + iters; ++i) {
    const std::vector<uint16_t>& x = inputs[i % 2];
    if (!AlignStart(board, c.ranks, static_cast<uint32_t>(i + 1))) {
      Fail(board, absl::StrCat("rank ", rank, ": a peer never reached the start line of iteration ",
                               i + 1));
      return 3;
    }
    const int64_t start = NowNs();
    absl::Status s =
        (*ep)->Dispatch({x.data(), idx.data(), w.data(), c.tokens, c.hidden, 0, table}, dispatched);
    if (s.ok()) s = (*ep)->Combine(dispatched, dispatched.recv_x.data(), out.data());
    if (!s.ok()) {
      Fail(board, std::string(s.message()));
      return 3;
    }
    if (i >= kWarmup) {
      board->start_ns[i - kWarmup][rank] = start;
      board->end_ns[i - kWarmup][rank] = NowNs();
    }
    // Every iteration's output, outside the timing (CheckedInput says why it is exact).
    if (const int64_t wrong = bench::FirstDifference(out, x); wrong >= 0) {
      Fail(board, absl::StrFormat("rank %d, iteration %d: combine gave out[%d] = 0x%04x, not "
                                  "x[%d] = 0x%04x",
                                  rank, i + 1, wrong, out[wrong], wrong, x[wrong]));
      return 3;
    }
  }
  // Rows this rank stored into peers (dispatch) plus partial rows it stored back (combine).
  const uint64_t rows_sent = dispatched.handle.token_routes.size();  // One per (token, peer).
  uint64_t records = 0;
  for (int32_t n : dispatched.handle.records_from) records += n;
  board->bytes[rank] = rows_sent * c.hidden * 2 + records * c.hidden * 2;  // bf16 both ways.
  return 0;
}

struct Result {
  // Percentiles of latency_us and span_us over every round (RunMethods).
  double p50_us = 0, p99_us = 0, span_p50_us = 0, span_p99_us = 0;
  uint64_t bytes = 0;
  std::string error;
  std::vector<double> latency_us{};  // Per iteration, the slowest rank's.
  std::vector<double> span_us{};     // Per iteration, first start to last end.
  int threads = 0;                   // Per rank and call (host methods).
  bool unavailable = false;          // Not built here (MPI): an error that fails no run.
};

// The methods, in the order of their rows. ubep first: memcpy copies the bytes ubep moved.
enum class Method { kUbep, kBsp, kMpi, kMemcpy, kUbepFlagged };
constexpr const char* kMethodNames[] = {"ubep", "bsp", "mpi_alltoallv", "memcpy", "ubep_flagged"};

// A description of how a process ended, for an error.
std::string EndedHow(int status) {
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                        ")");
  }
  return absl::StrCat("exited with status ", WIFEXITED(status) ? WEXITSTATUS(status) : status);
}

Result RunHost(const Case& c, Method method, EpConfig::SenderThread sender_thread,
               const bench::Skew& skew, int iters) {
  EpConfig config{.num_ranks = c.ranks,
                  .max_tokens = c.tokens,
                  .hidden = c.hidden,
                  .top_k = 8,
                  .num_experts = 256,
                  .slots_per_rank = 256 / c.ranks,
                  .num_layers = 1,
                  .dtype = DType::kBFloat16,
                  .protocol = method == Method::kBsp ? Protocol::kBsp : Protocol::kUbep,
                  .timeout = absl::Seconds(60),
                  .sender_thread = sender_thread,
                  .flagged_tokens = method == Method::kUbepFlagged ? c.tokens : 0};
  const std::vector<std::byte> plan = bench::ExpertParallelPlan();
  absl::StatusOr<SharedArena> board_arena = SharedArena::Create("bench-board", sizeof(Board));
  if (!board_arena.ok()) return {.error = std::string(board_arena.status().message())};
  auto* board = new (board_arena->data()) Board{};
  std::vector<SharedArena> arenas;
  std::vector<std::byte*> pointers;
  for (int r = 0; r < c.ranks; ++r) {
    absl::StatusOr<SharedArena> arena =
        SharedArena::Create(absl::StrCat("bench-rank-", r), ArenaLayout(config).total_bytes);
    if (!arena.ok()) return {.error = std::string(arena.status().message())};
    arenas.push_back(std::move(*arena));
    pointers.push_back(arenas.back().data());
  }
  // The ranks, reaped as they end: the first to end abnormally is the cause (its own error,
  // or how it ended), and the others, which would wait for it until their timeout, are killed.
  std::vector<pid_t> pids;
  for (int r = 0; r < c.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(RankMain(c, config, r, pointers, plan, skew, iters, board));
    if (pid < 0) {
      Fail(board, absl::StrCat("fork for rank ", r, ": ", strerror(errno)));
      break;
    }
    pids.push_back(pid);
  }
  auto kill_the_rest = [&] {
    for (pid_t pid : pids) {
      if (pid > 0) kill(pid, SIGKILL);
    }
  };
  if (std::atomic_ref<int>(board->failed).load() != 0) kill_the_rest();
  for (size_t left = pids.size(); left > 0;) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    const auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;  // Not a rank of this group.
    *it = -1;
    --left;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      Fail(board, absl::StrCat("rank ", it - pids.begin(), " ", EndedHow(status)));
      kill_the_rest();
    }
  }
  Result result;
  if (board->failed) {
    result.error = board->error;
    return result;
  }
  for (int i = 0; i < iters; ++i) {
    const bench::IterationTimes t =
        bench::TimeIteration(board->start_ns[i], board->end_ns[i], c.ranks);
    result.latency_us.push_back(t.slowest_us);
    result.span_us.push_back(t.span_us);
  }
  for (int r = 0; r < c.ranks; ++r) {
    result.bytes += board->bytes[r];
    result.threads = std::max(result.threads, board->threads[r]);
  }
  return result;
}

// The MPI_Alltoallv baseline: ubep-bench-mpi under mpirun, on the same routing and bytes. Its
// result is the one JSON line of rank 0's that has the fields; anything mpirun prints around
// it (help messages, warnings) is passed over.
Result RunMpi(const Case& c, int iters) {
#ifdef UBEP_MPIRUN
  // Bounded as the host ranks' calls are: the whole job, by coreutils' timeout.
  const int limit_s = 120 + 10 * iters;
  const std::string command =
      absl::StrCat("timeout -k 10 ", limit_s, " ", UBEP_MPIRUN,
                   " --allow-run-as-root --oversubscribe --bind-to none -np ", c.ranks,
                   " ", UBEP_BENCH_MPI, " --phase ", c.name, " --tokens ", c.tokens,
                   " --hidden ", c.hidden, " --routing ", c.routing, " --iters ", iters, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {.error = absl::StrCat("cannot start mpirun: ", strerror(errno))};
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  // timeout's statuses: 124 when it stopped the job, 137 when it had to kill it (-k).
  if (WIFEXITED(status) && (WEXITSTATUS(status) == 124 || WEXITSTATUS(status) == 137)) {
    return {.error = absl::StrCat("mpirun ran past ", limit_s, " s and was stopped: ",
                                  output.substr(0, 300))};
  }
  if (status != 0) {
    return {.error = absl::StrCat("mpirun ", EndedHow(status), ": ", output.substr(0, 300))};
  }
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (!absl::StartsWith(line, "{")) continue;
    const nlohmann::json parsed = nlohmann::json::parse(line, nullptr, false);
    if (!parsed.is_object() || !parsed.contains("latency_us") ||
        !parsed["latency_us"].is_array() || !parsed.contains("span_us") ||
        !parsed["span_us"].is_array() || !parsed.contains("bytes_moved") ||
        !parsed["bytes_moved"].is_number_unsigned()) {
      continue;
    }
    Result result;
    result.bytes = parsed["bytes_moved"].get<uint64_t>();
    for (const auto& [key, to] : {std::pair{"latency_us", &result.latency_us},
                                  std::pair{"span_us", &result.span_us}}) {
      for (const nlohmann::json& us : parsed[key]) {
        if (us.is_number()) to->push_back(us.get<double>());
      }
    }
    if (static_cast<int>(result.latency_us.size()) != iters ||
        static_cast<int>(result.span_us.size()) != iters) {
      continue;
    }
    return result;
  }
  return {.error = absl::StrCat("mpirun printed no result line: ", output.substr(0, 300))};
#else
  (void)c;
  (void)iters;
  return {.error = "built without MPI", .unavailable = true};
#endif
}

// One core copying `bytes` (every rank's bytes of the case) from one buffer to another,
// `iters` times after a warm-up: through buffers of at most kMemcpyBuffer bytes, copied whole
// in turn (a prefill case's bytes at 8 ranks are gigabytes; a buffer that large is past every
// cache, as the ranks' arenas together are), the last one in part.
constexpr uint64_t kMemcpyBuffer = uint64_t{1} << 30;
Result RunMemcpy(uint64_t bytes, int iters) {
  const uint64_t total = std::max<uint64_t>(bytes, 64);
  const size_t n = std::min(total, kMemcpyBuffer);
  std::vector<char> from(n, 1), to(n, 0);
  Result result;
  result.bytes = bytes;
  for (int i = 0; i < kWarmup + iters; ++i) {
    const int64_t start = NowNs();
    for (uint64_t done = 0; done < total; done += n) {
      std::memcpy(to.data(), from.data(), std::min<uint64_t>(n, total - done));
    }
    if (i >= kWarmup) result.latency_us.push_back((NowNs() - start) / 1e3);
    from[i % n] = static_cast<char>(i);
  }
  result.span_us = result.latency_us;  // One process.
  return result;
}

// Every method on the same case, in rounds whose order changes (ubep bsp, bsp ubep, ... with
// two; with more, reversed every other round and rotated every two, so that each goes first
// equally often and none always follows the same one, whose teardown - freed buffers, the
// page cache - it would always inherit), each round a fresh group of rank processes
// (or a fresh mpirun) with its own warm-up: the slow phases of a shared machine fall on every
// method alike, which one long run each does not ensure. The iterations are split among the
// rounds; percentiles are over all of them. A method that fails is not run again.
// methods[0] is ubep, which runs first in the first round: memcpy copies its bytes.
std::vector<Result> RunMethods(const Case& c, const std::vector<Method>& methods,
                               EpConfig::SenderThread sender_thread,
                               const bench::Skew& skew, int iters) {
  const int V = static_cast<int>(methods.size());
  // At least 4 rounds, a whole number of the order's period: 4 for one or two methods, 2V
  // for more.
  const int rounds = std::min(V <= 2 ? 4 : 2 * V, iters);
  std::vector<Result> total(V);
  for (int round = 0; round < rounds; ++round) {
    const int n = iters * (round + 1) / rounds - iters * round / rounds;
    for (int j = 0; j < V; ++j) {
      const int which = ((round % 2 == 0 ? j : V - 1 - j) + round / 2) % V;
      Result& t = total[which];
      if (!t.error.empty()) continue;
      Result r;
      switch (methods[which]) {
        case Method::kMpi:
          r = RunMpi(c, n);
          break;
        case Method::kMemcpy:
          // The bytes ubep moved (its first round ran before this): none if it failed.
          r = total[0].error.empty() && total[0].bytes > 0
                  ? RunMemcpy(total[0].bytes, n)
                  : Result{.error = "ubep failed: no bytes to copy", .unavailable = true};
          break;
        default:
          r = RunHost(c, methods[which], sender_thread, skew, n);
      }
      t.error = r.error;
      t.unavailable = r.unavailable;
      if (r.error.empty()) t.bytes = r.bytes;
      t.threads = std::max(t.threads, r.threads);
      t.latency_us.insert(t.latency_us.end(), r.latency_us.begin(), r.latency_us.end());
      t.span_us.insert(t.span_us.end(), r.span_us.begin(), r.span_us.end());
    }
  }
  for (Result& t : total) {
    if (!t.error.empty() || t.latency_us.empty()) continue;
    t.p50_us = ubep::Percentile(t.latency_us, 0.5);
    t.p99_us = ubep::Percentile(t.latency_us, 0.99);
    t.span_p50_us = ubep::Percentile(t.span_us, 0.5);
    t.span_p99_us = ubep::Percentile(t.span_us, 0.99);
  }
  return total;
}

}  // namespace
}  // namespace ubep::kernels

int main(int argc, char** argv) {
  using namespace ubep::kernels;
  RequireHostCpu("ubep-bench-dataplane");
  bool json = false;
  int iters = 50;
  std::string which = "all";
  std::vector<int> rank_counts = {4, 8};
  std::vector<int> hiddens = {7168, 2048};
  std::vector<std::string> methods = {"ubep", "bsp", "mpi_alltoallv", "memcpy"};
  EpConfig::SenderThread sender_thread = EpConfig::SenderThread::kAuto;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--json") {
      json = true;
    } else if (flag == "--iters" && i + 1 < argc) {
      iters = std::clamp(std::atoi(argv[++i]), 1, kMaxIters);
    } else if (flag == "--cases" && i + 1 < argc) {
      which = argv[++i];
    } else if (flag == "--ranks" && i + 1 < argc) {
      rank_counts.clear();
      for (absl::string_view part : absl::StrSplit(argv[++i], ',')) {
        const int ranks = std::clamp(std::atoi(std::string(part).c_str()), 1, kMaxRanks);
        if (ubep::bench::kExperts % ranks != 0) {
          std::cerr << "ubep-bench-dataplane: --ranks: " << ranks << " does not divide the "
                    << ubep::bench::kExperts << " experts\n";
          return 2;
        }
        rank_counts.push_back(ranks);
      }
    } else if (flag == "--hidden" && i + 1 < argc) {
      hiddens.clear();
      for (absl::string_view part : absl::StrSplit(argv[++i], ',')) {
        hiddens.push_back(std::max(8, std::atoi(std::string(part).c_str())));
      }
    } else if (flag == "--methods" && i + 1 < argc) {
      methods = absl::StrSplit(argv[++i], ',');
      for (const std::string& method : methods) {
        if (std::find(std::begin(kMethodNames), std::end(kMethodNames), method) ==
            std::end(kMethodNames)) {
          std::cerr << "ubep-bench-dataplane: --methods: unknown method \"" << method
                    << "\"; expected ubep, bsp, mpi_alltoallv, memcpy or ubep_flagged\n";
          return 2;
        }
      }
    } else if (flag == "--sender-thread" && i + 1 < argc) {
      const std::string value = argv[++i];
      if (value == "auto") {
        sender_thread = EpConfig::SenderThread::kAuto;
      } else if (value == "on") {
        sender_thread = EpConfig::SenderThread::kOn;
      } else if (value == "off") {
        sender_thread = EpConfig::SenderThread::kOff;
      } else {
        std::cerr << "ubep-bench-dataplane: --sender-thread: \"" << value
                  << "\"; expected auto, on or off\n";
        return 2;
      }
    } else {
      std::cerr << "usage: ubep-bench-dataplane [--json] [--iters N] "
                   "[--cases decode|prefill|all] [--ranks 4,8] [--hidden 7168,2048] "
                   "[--methods ubep,bsp,mpi_alltoallv,memcpy,ubep_flagged] "
                   "[--sender-thread auto|on|off]\n";
      return 2;
    }
  }
  if (iters < 50) {
    std::cerr << "ubep-bench-dataplane: " << iters
              << " iterations: fewer than the 50 the reported figures are measured over\n";
  }
  if (iters < 100) {
    // Nearest rank: the 99th percentile of n < 100 samples is the slowest of them.
    std::cerr << "ubep-bench-dataplane: " << iters
              << " iterations: p99 is the slowest of them (fewer than 100)\n";
  }
  std::vector<ubep::bench::Case> cases;
  for (const char* name : {"decode", "prefill"}) {
    if (which != "all" && which != name) continue;
    for (int ranks : rank_counts) {
      for (int hidden : hiddens) {
        for (const char* routing : {"uniform", "skewed"}) {
          cases.push_back(
              {name, ranks, std::string(name) == "decode" ? 128 : 4096, hidden, routing});
        }
      }
    }
  }
  auto wanted = [&](Method method) {
    return std::find(methods.begin(), methods.end(),
                     kMethodNames[static_cast<int>(method)]) != methods.end();
  };
  // ubep always runs (first), and memcpy, whose rate ubep's row reports.
  std::vector<Method> run = {Method::kUbep};
  for (Method method : {Method::kBsp, Method::kMpi, Method::kMemcpy, Method::kUbepFlagged}) {
    if (wanted(method) || method == Method::kMemcpy) run.push_back(method);
  }
  nlohmann::json out = nlohmann::json::array();
  bool failed = false;
  // The CPUs the ranks share (this process's affinity, which they inherit): with fewer CPUs
  // than ranks, waits that sleep and waits that poll (MPI's) cost differently.
  const int cpus = ubep::UsableCpus();
  if (const int most = *std::max_element(rank_counts.begin(), rank_counts.end()); cpus < most) {
    std::cerr << "ubep-bench-dataplane: " << cpus << " CPUs for up to " << most
              << " ranks: oversubscribed (every row says cpus)\n";
  }
  for (const ubep::bench::Case& c : cases) {
    ubep::bench::Skew skew;
    if (c.routing == "skewed") {
      absl::StatusOr<ubep::bench::Skew> drawn =
          ubep::bench::SkewedDistribution(UBEP_SOURCE_DIR, c.name, c.ranks);
      if (!drawn.ok()) {
        std::cerr << "ubep-bench-dataplane: " << drawn.status().message() << "\n";
        return 2;
      }
      skew = *std::move(drawn);
    }
    const std::vector<Result> ran = RunMethods(c, run, sender_thread, skew, iters);
    // A method that ran and failed fails the run, shown or not (ubep runs always).
    for (const Result& r : ran) failed = failed || (!r.error.empty() && !r.unavailable);
    auto result_of = [&](Method method) -> const Result& {
      static const Result none;
      const auto at = std::find(run.begin(), run.end(), method);
      return at == run.end() ? none : ran[at - run.begin()];
    };
    const Result& ubep = result_of(Method::kUbep);
    const Result& bsp = result_of(Method::kBsp);
    const Result& mpi = result_of(Method::kMpi);
    const Result& copy = result_of(Method::kMemcpy);
    const Result& flagged = result_of(Method::kUbepFlagged);
    // All ranks' bytes over ubep's time, against one core copying them.
    const double rate_vs_memcpy = ubep.p50_us > 0 ? copy.p50_us / ubep.p50_us : 0.0;
    // p50 over p50 (of the slowest rank's times, or of the spans), where both ran.
    auto ratio = [](const Result& a, const Result& b, double Result::*p50 = &Result::p50_us) {
      return a.error.empty() && b.error.empty() && a.*p50 > 0 && b.*p50 > 0 ? a.*p50 / b.*p50
                                                                          : 0.0;
    };
    // In the JSON, a time or a ratio that was not measured (its method failed) is null, never
    // a 0 a reader would take for a time or a ratio.
    auto measured = [](double value) -> nlohmann::json {
      return value > 0 ? nlohmann::json(value) : nlohmann::json(nullptr);
    };
    for (Method method : {Method::kUbep, Method::kBsp, Method::kMpi, Method::kMemcpy,
                          Method::kUbepFlagged}) {
      if (!wanted(method)) continue;
      const Result& r = result_of(method);
      nlohmann::json row = {{"method", kMethodNames[static_cast<int>(method)]},
                            {"case", c.name},     {"ranks", c.ranks},
                            {"tokens", c.tokens}, {"hidden", c.hidden}, {"routing", c.routing},
                            {"p50_us", measured(r.p50_us)}, {"p99_us", measured(r.p99_us)},
                            {"span_p50_us", measured(r.span_p50_us)},
                            {"span_p99_us", measured(r.span_p99_us)},
                            {"bytes_moved", r.bytes}, {"iters", iters}, {"cpus", cpus}};
      if (r.threads > 0) row["threads_per_rank"] = r.threads;
      if (c.routing == "skewed") {
        row["skew_source"] = skew.source;
        row["skew_rank_imbalance"] = skew.rank_imbalance;
      }
      if (method == Method::kUbep) {
        row["rate_vs_memcpy"] = measured(rate_vs_memcpy);
        if (wanted(Method::kBsp)) {
          row["ubep_over_bsp"] = measured(ratio(ubep, bsp));
          row["span_ubep_over_bsp"] = measured(ratio(ubep, bsp, &Result::span_p50_us));
        }
        if (wanted(Method::kMpi)) {
          row["mpi_over_ubep"] = measured(ratio(mpi, ubep));
          row["span_mpi_over_ubep"] = measured(ratio(mpi, ubep, &Result::span_p50_us));
        }
        if (wanted(Method::kUbepFlagged)) {
          row["flagged_over_ubep"] = measured(ratio(flagged, ubep));
        }
      }
      if (!r.error.empty()) row["error"] = r.error;
      out.push_back(row);
    }
    if (!json) {
      // Only the methods asked for, so that no ratio is printed against a run that did not run.
      std::string line = absl::StrFormat("%-7s R=%d H=%-5d %-7s  ubep %9.1f us", c.name, c.ranks,
                                         c.hidden, c.routing, ubep.p50_us);
      if (wanted(Method::kBsp)) {
        absl::StrAppendFormat(&line, "  bsp %9.1f us (ubep/bsp %.2f)", bsp.p50_us,
                              ratio(ubep, bsp));
      }
      if (wanted(Method::kUbepFlagged)) {
        absl::StrAppendFormat(&line, "  ubep_flagged %9.1f us (flagged/ubep %.2f)",
                              flagged.p50_us, ratio(flagged, ubep));
      }
      if (wanted(Method::kMpi)) {
        absl::StrAppendFormat(&line, "  mpi %9.1f us (mpi/ubep %.2f)", mpi.p50_us,
                              ratio(mpi, ubep));
      }
      if (wanted(Method::kMemcpy)) {
        absl::StrAppendFormat(&line,
                              "  memcpy of the bytes %8.1f us (ubep rate vs memcpy %.0f%%)",
                              copy.p50_us, 100 * rate_vs_memcpy);
      }
      std::string errors;
      for (const Result* r : {&ubep, &bsp, &flagged, &mpi}) {
        if (!r->error.empty()) absl::StrAppend(&errors, errors.empty() ? "" : "; ", r->error);
      }
      std::printf("%s  %s\n", line.c_str(), errors.c_str());
      std::fflush(stdout);
    }
  }
  if (json) std::cout << out.dump(1) << "\n";
  return failed ? 1 : 0;
}
