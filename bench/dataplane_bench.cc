// ubep-bench-dataplane: dispatch + combine latency of the host backend, ubep against the
// phase-by-phase bsp baseline and MPI_Alltoallv (Debian's OpenMPI, ubep-bench-mpi under
// mpirun) on the same bytes in the same run, next to a single-core memcpy of the bytes one
// rank moves. Ranks are processes sharing memfd arenas, as in production.
//
//   ubep-bench-dataplane [--json] [--iters N] [--cases decode|prefill|all] [--ranks 4,8]
//                        [--hidden 7168,2048] [--methods ubep,bsp,mpi_alltoallv,memcpy]
//
// --methods may also name ubep_flagged: ubep with every call's rows and partials as
// flag-in-granule rows (kernels/common/flagged_rows.h), in the same alternating rounds.
//
// One iteration is one dispatch followed by one combine on every rank, all ranks starting
// together (an untimed start line, as the MPI baseline's MPI_Barrier); its latency is the
// slowest rank's. Reported per case and method: p50_us, p99_us over N iterations after warm-up,
// bytes_moved (rows stored into peers' arenas by dispatch plus partial rows stored back by
// combine, all ranks). ubep and bsp run in alternating rounds of N/4 iterations each (a fresh
// group and warm-up per round, the order rotating), so that a shared machine's slow spells
// fall on both alike.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/dataplane_inputs.h"
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
  double us[kMaxIters][kMaxRanks];
  uint64_t bytes[kMaxRanks];
  int failed;       // Set once, by the first rank that fails (Fail).
  char error[256];  // That rank's error.
};

// Records this rank's error unless another rank's came first (the first is the cause; the
// others are usually peers timing out behind it).
void Fail(Board* board, const std::string& error) {
  if (std::atomic_ref<int>(board->failed).exchange(1) != 0) return;
  std::snprintf(board->error, sizeof(board->error), "%s", error.c_str());
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
             const std::vector<std::byte>& plan, const std::vector<double>& skew, int iters,
             Board* board) {
  absl::StatusOr<std::unique_ptr<HostEp>> ep = HostEp::Create(config, rank, arenas);
  if (!ep.ok()) {
    Fail(board, std::string(ep.status().message()));
    return 3;
  }
  const int K = config.top_k;
  std::vector<uint16_t> x(static_cast<size_t>(c.tokens) * c.hidden, 0x3f80);  // bf16 1.0
  std::vector<uint16_t> out(x.size());
  const std::vector<int32_t> idx = bench::RouteTokens(c, rank, skew);
  const std::vector<float> w(idx.size(), 1.0f / K);
  const auto* table = reinterpret_cast<const PlanTableHeader*>(plan.data());
  DispatchOutput dispatched;
  for (int i = 0; i < kWarmup + iters; ++i) {
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
    if (i >= kWarmup) board->us[i - kWarmup][rank] = (NowNs() - start) / 1e3;
  }
  // Rows this rank stored into peers (dispatch) plus partial rows it stored back (combine).
  const uint64_t rows_sent = dispatched.handle.token_routes.size();  // One per (token, peer).
  uint64_t records = 0;
  for (int32_t n : dispatched.handle.records_from) records += n;
  board->bytes[rank] = rows_sent * c.hidden * 2 + records * c.hidden * 2;  // bf16 both ways.
  return 0;
}

struct Result {
  double p50_us = 0, p99_us = 0;
  uint64_t bytes = 0;
  std::string error;
  std::vector<double> latency_us{};  // Per iteration, the slowest rank's.
};

// How a group runs: ubep, bsp, or ubep with flag-in-granule rows.
struct Variant {
  Protocol protocol;
  bool flagged;
};

Result RunHost(const Case& c, Variant variant, const std::vector<double>& skew, int iters) {
  EpConfig config{.num_ranks = c.ranks,
                  .max_tokens = c.tokens,
                  .hidden = c.hidden,
                  .top_k = 8,
                  .num_experts = 256,
                  .slots_per_rank = 256 / c.ranks,
                  .num_layers = 1,
                  .dtype = DType::kBFloat16,
                  .protocol = variant.protocol,
                  .timeout = absl::Seconds(60),
                  .flagged_tokens = variant.flagged ? c.tokens : 0};
  const std::vector<std::byte> plan = bench::ExpertParallelPlan();
  SharedArena board_arena = *SharedArena::Create("bench-board", sizeof(Board));
  auto* board = new (board_arena.data()) Board{};
  std::vector<SharedArena> arenas;
  std::vector<std::byte*> pointers;
  for (int r = 0; r < c.ranks; ++r) {
    absl::StatusOr<SharedArena> arena =
        SharedArena::Create(absl::StrCat("bench-rank-", r), ArenaLayout(config).total_bytes);
    if (!arena.ok()) return {.error = std::string(arena.status().message())};
    arenas.push_back(std::move(*arena));
    pointers.push_back(arenas.back().data());
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < c.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(RankMain(c, config, r, pointers, plan, skew, iters, board));
    pids.push_back(pid);
  }
  for (int r = 0; r < c.ranks; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      Fail(board, absl::StrCat("rank ", r, " ended abnormally (wait status ", status, ")"));
    }
  }
  Result result;
  if (board->failed) {
    result.error = board->error;
    return result;
  }
  for (int i = 0; i < iters; ++i) {
    result.latency_us.push_back(*std::max_element(board->us[i], board->us[i] + c.ranks));
  }
  result.p50_us = ubep::Percentile(result.latency_us, 0.5);
  result.p99_us = ubep::Percentile(result.latency_us, 0.99);
  for (int r = 0; r < c.ranks; ++r) result.bytes += board->bytes[r];
  return result;
}

// Every variant on the same case, in rounds whose order rotates (ubep bsp, bsp ubep, ... with
// two; with three, each goes first once in three rounds), each round a fresh group of rank
// processes with its own warm-up: the slow phases of a shared machine fall on every variant
// alike, which one long run each does not ensure. The iterations are split among the rounds;
// percentiles are over all of them.
std::vector<Result> RunVariants(const Case& c, const std::vector<Variant>& variants,
                                const std::vector<double>& skew, int iters) {
  constexpr int kRounds = 4;
  const int rounds = std::min(kRounds, iters);
  const int V = static_cast<int>(variants.size());
  std::vector<Result> total(V);
  for (int round = 0; round < rounds; ++round) {
    const int n = iters * (round + 1) / rounds - iters * round / rounds;
    for (int j = 0; j < V; ++j) {
      // Two variants alternate (0 1, 1 0, ...); more rotate.
      const int which = V == 2 && round % 2 == 1 ? 1 - j : (j + round) % V;
      Result r = RunHost(c, variants[which], skew, n);
      Result& t = total[which];
      if (t.error.empty()) t.error = r.error;
      t.bytes = r.bytes;
      t.latency_us.insert(t.latency_us.end(), r.latency_us.begin(), r.latency_us.end());
    }
  }
  for (Result& t : total) {
    if (!t.error.empty() || t.latency_us.empty()) continue;
    t.p50_us = ubep::Percentile(t.latency_us, 0.5);
    t.p99_us = ubep::Percentile(t.latency_us, 0.99);
  }
  return total;
}

// The MPI_Alltoallv baseline: ubep-bench-mpi under mpirun, on the same routing and bytes.
Result RunMpi(const Case& c, int iters) {
#ifdef UBEP_MPIRUN
  const std::string command =
      absl::StrCat(UBEP_MPIRUN, " --allow-run-as-root --oversubscribe --bind-to none -np ", c.ranks,
                   " ", UBEP_BENCH_MPI, " --tokens ", c.tokens, " --hidden ", c.hidden,
                   " --routing ", c.routing, " --iters ", iters, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {.error = "cannot start mpirun"};
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  const size_t brace = output.rfind('{');
  nlohmann::json parsed = brace == std::string::npos
                              ? nlohmann::json()
                              : nlohmann::json::parse(output.substr(brace), nullptr, false);
  if (status != 0 || !parsed.is_object()) {
    return {.error = absl::StrCat("mpirun failed: ", output.substr(0, 200))};
  }
  return {parsed["p50_us"].get<double>(), parsed["p99_us"].get<double>(),
          parsed["bytes_moved"].get<uint64_t>(), ""};
#else
  return {.error = "built without MPI"};
#endif
}

// One core copying the bytes one rank moves (the largest share), cold buffers.
Result RunMemcpy(uint64_t bytes, int iters) {
  const size_t n = std::max<uint64_t>(bytes, 64);
  std::vector<char> from(n, 1), to(n, 0);
  std::vector<double> us;
  for (int i = 0; i < kWarmup + iters; ++i) {
    const int64_t start = NowNs();
    std::memcpy(to.data(), from.data(), n);
    if (i >= kWarmup) us.push_back((NowNs() - start) / 1e3);
    from[i % n] = static_cast<char>(i);
  }
  return {ubep::Percentile(us, 0.5), ubep::Percentile(us, 0.99), bytes, ""};
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
  const std::vector<std::string> all_methods = {"ubep", "bsp", "mpi_alltoallv", "memcpy",
                                                "ubep_flagged"};
  std::vector<std::string> methods(all_methods.begin(), all_methods.end() - 1);
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
        rank_counts.push_back(std::clamp(std::atoi(std::string(part).c_str()), 1, kMaxRanks));
      }
    } else if (flag == "--hidden" && i + 1 < argc) {
      hiddens.clear();
      for (absl::string_view part : absl::StrSplit(argv[++i], ',')) {
        hiddens.push_back(std::max(8, std::atoi(std::string(part).c_str())));
      }
    } else if (flag == "--methods" && i + 1 < argc) {
      methods = absl::StrSplit(argv[++i], ',');
      for (const std::string& method : methods) {
        if (std::find(all_methods.begin(), all_methods.end(), method) == all_methods.end()) {
          std::cerr << "ubep-bench-dataplane: --methods: unknown method \"" << method
                    << "\"; expected ubep, bsp, mpi_alltoallv, memcpy or ubep_flagged\n";
          return 2;
        }
      }
    } else {
      std::cerr << "usage: ubep-bench-dataplane [--json] [--iters N] "
                   "[--cases decode|prefill|all] [--ranks 4,8] [--hidden 7168,2048] "
                   "[--methods ubep,bsp,mpi_alltoallv,memcpy,ubep_flagged]\n";
      return 2;
    }
  }
  absl::StatusOr<std::vector<double>> skew = ubep::bench::SkewedDistribution(UBEP_SOURCE_DIR);
  if (!skew.ok()) {
    std::cerr << skew.status().message() << "\n";
    return 2;
  }
  std::vector<Case> cases;
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
  nlohmann::json out = nlohmann::json::array();
  auto wanted = [&](const char* method) {
    return std::find(methods.begin(), methods.end(), method) != methods.end();
  };
  for (const Case& c : cases) {
    // memcpy copies the bytes one rank moves, which the ubep run counts: it always runs.
    std::vector<Variant> variants = {{Protocol::kUbep, false}};
    if (wanted("bsp")) variants.push_back({Protocol::kBsp, false});
    if (wanted("ubep_flagged")) variants.push_back({Protocol::kUbep, true});
    const std::vector<Result> ran = RunVariants(c, variants, *skew, iters);
    const Result& ubep = ran[0];
    const Result bsp = wanted("bsp") ? ran[1] : Result{};
    const Result flagged = wanted("ubep_flagged") ? ran.back() : Result{};
    const Result mpi = wanted("mpi_alltoallv") ? RunMpi(c, iters) : Result{};
    const Result copy = RunMemcpy(ubep.bytes / std::max(1, c.ranks), iters);
    // All ranks' bytes over ubep's time, against one core copying one rank's bytes.
    const double rate_vs_memcpy = ubep.p50_us > 0 ? (copy.p50_us * c.ranks) / ubep.p50_us : 0.0;
    for (const auto& [method, r] : {std::pair<const char*, const Result&>{"ubep", ubep},
                                    {"bsp", bsp},
                                    {"mpi_alltoallv", mpi},
                                    {"memcpy", copy},
                                    {"ubep_flagged", flagged}}) {
      if (!wanted(method)) continue;
      nlohmann::json row = {{"method", method},   {"case", c.name},     {"ranks", c.ranks},
                            {"tokens", c.tokens}, {"hidden", c.hidden}, {"routing", c.routing},
                            {"p50_us", r.p50_us}, {"p99_us", r.p99_us}, {"bytes_moved", r.bytes},
                            {"iters", iters}};
      if (std::string(method) == "ubep") row["rate_vs_memcpy"] = rate_vs_memcpy;
      if (!r.error.empty()) row["error"] = r.error;
      out.push_back(row);
    }
    if (!json) {
      // Only the methods asked for, so that no ratio is printed against a run that did not run.
      std::string line = absl::StrFormat("%-7s R=%d H=%-5d %-7s  ubep %9.1f us", c.name, c.ranks,
                                         c.hidden, c.routing, ubep.p50_us);
      if (wanted("bsp")) {
        absl::StrAppendFormat(&line, "  bsp %9.1f us (ubep/bsp %.2f)", bsp.p50_us,
                              bsp.p50_us > 0 ? ubep.p50_us / bsp.p50_us : 0.0);
      }
      if (wanted("ubep_flagged")) {
        absl::StrAppendFormat(&line, "  ubep_flagged %9.1f us (flagged/ubep %.2f)",
                              flagged.p50_us, ubep.p50_us > 0 ? flagged.p50_us / ubep.p50_us : 0.0);
      }
      if (wanted("mpi_alltoallv")) {
        absl::StrAppendFormat(&line, "  mpi %9.1f us (mpi/ubep %.2f)", mpi.p50_us,
                              ubep.p50_us > 0 ? mpi.p50_us / ubep.p50_us : 0.0);
      }
      if (wanted("memcpy")) {
        absl::StrAppendFormat(&line,
                              "  memcpy of a rank's bytes %8.1f us (ubep rate vs memcpy %.0f%%)",
                              copy.p50_us, 100 * rate_vs_memcpy);
      }
      std::printf("%s  %s\n", line.c_str(),
                  (ubep.error + bsp.error + flagged.error + mpi.error).c_str());
      std::fflush(stdout);
    }
  }
  if (json) std::cout << out.dump(1) << "\n";
  return 0;
}
