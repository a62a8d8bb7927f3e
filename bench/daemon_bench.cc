// ubep-bench-daemon: what the daemon design costs a serving process.
//
//  - attach latency: Rank::Attach of a one-rank group against a real ubepd (Attach RPC over
//    the Unix socket, arena fds over SCM_RIGHTS, mmap, Join), p50/p99 over --iters;
//  - step time: BeginStep + Dispatch + Combine through libubep (ranks as threads of this
//    process, arenas from ubepd, plan from the arena's plan area), against HostEp called
//    directly on arenas this process made, same config, same tokens, same plan. Blocks of 10
//    steps alternate between the two so both see the same machine; p50/p99 of rank 0's step.
//    Each block's ranks leave a start line together (a barrier, untimed). Every step's combine
//    output is checked against its input outside the timing, as ubep-bench-dataplane does:
//    the inputs alternate between two sets of powers of two (CheckedInput) that the identity
//    experts and K weights 1/K give back exactly, so a row lost, doubled or misplaced on
//    either way fails the run (exit status 1, naming the rank, the way and the element).
//
//   ubep-bench-daemon [--json] [--iters N] [--ranks 2,4] [--ubepd PATH]
// Prints a table, or with --json one object:
//   {"attach_ms_p50", "attach_ms_p99", "cases": [{"ranks", "tokens", "hidden", "routing",
//     "libubep_p50_us", "libubep_p99_us", "direct_p50_us", "direct_p99_us",
//     "overhead_ratio"}], "overhead_ratio_geomean"}
//   overhead_ratio = libubep p50 / direct p50; the geometric mean pools the cases.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/dataplane_inputs.h"
#include "common/percentile.h"
#include "kernels/common/host_cpu.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/shared_arena.h"
#include "nlohmann/json.hpp"
#include "ubep/ubep.h"

extern char** environ;

namespace ubep::bench {
namespace {

constexpr int kBlock = 10;

class DaemonProcess {
 public:
  // Starts ubepd on `socket`, its log in SOCKET.log; waits until it serves (--ready_file).
  DaemonProcess(const std::string& binary, const std::string& socket) : socket_(socket) {
    const std::string ready = socket + ".ready";
    std::vector<std::string> argv = {binary, "--socket=" + socket, "--metrics=",
                                     "--wait_timeout=30s", "--ready_file=" + ready};
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    const std::string log = socket + ".log";
    posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (posix_spawn(&pid_, binary.c_str(), &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    for (int i = 0; i < 3000 && pid_ > 0 && !std::filesystem::exists(ready); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ready_ = std::filesystem::exists(ready);
    std::filesystem::remove(ready);
  }
  ~DaemonProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status;
      waitpid(pid_, &status, 0);
    }
  }
  bool ok() const { return pid_ > 0 && ready_; }

 private:
  std::string socket_;
  pid_t pid_ = -1;
  bool ready_ = false;
};

ModelShape ShapeOf(const Case& c) {
  ModelShape s;
  s.num_layers = 1;
  s.num_experts = kExperts;
  s.hidden = c.hidden;
  s.top_k = kTopK;
  s.max_tokens = c.tokens;
  s.slots_per_rank = kExperts / c.ranks;
  s.dtype = DType::kBFloat16;
  return s;
}

struct Inputs {
  std::vector<std::vector<uint16_t>> x[2];  // Per parity, per rank: CheckedInput.
  std::vector<std::vector<int32_t>> idx;
  std::vector<std::vector<float>> w;
};

Inputs MakeInputs(const Case& c, const Skew& skew) {
  Inputs in;
  for (int r = 0; r < c.ranks; ++r) {
    for (int parity = 0; parity < 2; ++parity) in.x[parity].push_back(CheckedInput(c, r, parity));
    in.idx.push_back(RouteTokens(c, r, skew));
    in.w.emplace_back(static_cast<size_t>(c.tokens) * kTopK, 1.0f / kTopK);
  }
  return in;
}

// Runs `steps` steps on every rank (one thread each, all leaving a start line together);
// appends rank 0's step times (us). `check(r, i)` follows each step, untimed; a wrong output
// is the block's error before any step's (the peers of a rank that stopped on one time out).
template <typename StepFn, typename CheckFn>
absl::Status RunBlock(int ranks, int steps, StepFn step, CheckFn check,
                      std::vector<double>* times) {
  std::vector<absl::Status> status(ranks), wrong(ranks);
  std::barrier start_line(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      start_line.arrive_and_wait();
      for (int i = 0; i < steps && status[r].ok(); ++i) {
        const absl::Time start = absl::Now();
        status[r] = step(r, i);
        if (r == 0 && times != nullptr) {
          times->push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
        }
        if (status[r].ok()) status[r] = wrong[r] = check(r, i);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::vector<absl::Status>* statuses : {&wrong, &status}) {
    for (const absl::Status& s : *statuses) {
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> RunCase(const Case& c, const std::string& socket, int iters,
                                       const Skew& skew) {
  const Inputs in = MakeInputs(c, skew);
  // libubep: every rank attaches (concurrently: Attach waits for the whole group).
  std::vector<std::unique_ptr<Rank>> ranks(c.ranks);
  {
    std::vector<absl::Status> status(c.ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < c.ranks; ++r) {
      threads.emplace_back([&, r] {
        ClientOptions options;
        options.socket_path = socket;
        absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, r, c.ranks, 0, ShapeOf(c));
        if (rank.ok()) {
          ranks[r] = *std::move(rank);
        } else {
          status[r] = rank.status();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : status) {
      if (!s.ok()) return s;
    }
  }
  std::vector<Dispatched> dispatched(c.ranks);
  std::vector<std::vector<uint16_t>> out(c.ranks, std::vector<uint16_t>(in.x[0][0].size()));
  // Step i's input on rank r is in.x[i % 2][r]; its combine output must be the same bytes.
  auto checked = [&](const char* way) {
    return [&, way](int r, int i) -> absl::Status {
      const std::vector<uint16_t>& x = in.x[i % 2][r];
      if (const int64_t wrong = FirstDifference(out[r], x); wrong >= 0) {
        return absl::InternalError(absl::StrFormat(
            "%d ranks, hidden %d, %s: rank %d's combine through %s gave out[%d] = 0x%04x, "
            "not its input's 0x%04x",
            c.ranks, c.hidden, c.routing, r, way, wrong, out[r][wrong], x[wrong]));
      }
      return absl::OkStatus();
    };
  };
  uint64_t next_step = ranks[0]->resume_step();
  std::vector<uint64_t> step_of(c.ranks, next_step);
  auto via_client = [&](int r, int i) -> absl::Status {
    Rank& rank = *ranks[r];
    if (absl::Status s = rank.BeginStep(step_of[r]++); !s.ok()) return s;
    if (absl::Status s = rank.Dispatch(0, in.x[i % 2][r].data(), in.idx[r].data(), in.w[r].data(),
                                       c.tokens, dispatched[r]);
        !s.ok()) {
      return s;
    }
    return rank.Combine(dispatched[r], dispatched[r].rows(), out[r].data());
  };

  // Direct: HostEp on arenas made here, the same plan as ubepd's round-robin one.
  kernels::EpConfig config;
  config.num_ranks = c.ranks;
  config.max_tokens = c.tokens;
  config.hidden = c.hidden;
  config.top_k = kTopK;
  config.num_experts = kExperts;
  config.slots_per_rank = kExperts / c.ranks;
  config.dtype = kernels::DType::kBFloat16;
  config.protocol = kernels::Protocol::kUbep;
  config.timeout = absl::Seconds(30);
  const size_t bytes = kernels::ArenaLayout(config).total_bytes;
  std::vector<kernels::SharedArena> arenas;
  std::vector<std::byte*> bases;
  for (int r = 0; r < c.ranks; ++r) {
    absl::StatusOr<kernels::SharedArena> a = kernels::SharedArena::Create("bench", bytes);
    if (!a.ok()) return a.status();
    bases.push_back(a->data());
    arenas.push_back(*std::move(a));
  }
  std::vector<std::unique_ptr<kernels::HostEp>> eps;
  for (int r = 0; r < c.ranks; ++r) {
    absl::StatusOr<std::unique_ptr<kernels::HostEp>> ep = kernels::HostEp::Create(config, r, bases);
    if (!ep.ok()) return ep.status();
    eps.push_back(*std::move(ep));
  }
  const std::vector<std::byte> table = ExpertParallelPlan();
  const auto* plan = reinterpret_cast<const kernels::PlanTableHeader*>(table.data());
  std::vector<kernels::DispatchOutput> direct_out(c.ranks);
  auto direct = [&](int r, int i) -> absl::Status {
    kernels::DispatchInput d;
    d.x = in.x[i % 2][r].data();
    d.topk_idx = in.idx[r].data();
    d.topk_weights = in.w[r].data();
    d.num_tokens = c.tokens;
    d.hidden = c.hidden;
    d.plan = plan;
    if (absl::Status s = eps[r]->Dispatch(d, direct_out[r]); !s.ok()) return s;
    return eps[r]->Combine(direct_out[r], direct_out[r].recv_x.data(), out[r].data());
  };

  // Warm-up, then alternate blocks.
  const auto check_client = checked("libubep");
  const auto check_direct = checked("HostEp directly");
  if (absl::Status s = RunBlock(c.ranks, kBlock, via_client, check_client, nullptr); !s.ok()) {
    return s;
  }
  if (absl::Status s = RunBlock(c.ranks, kBlock, direct, check_direct, nullptr); !s.ok()) {
    return s;
  }
  std::vector<double> client_us, direct_us;
  // A B B A ...: neither way always runs first.
  for (int round = 0; round * kBlock < iters; ++round) {
    for (int half = 0; half < 2; ++half) {
      const bool client_turn = (round + half) % 2 == 0;
      absl::Status s = client_turn
                           ? RunBlock(c.ranks, kBlock, via_client, check_client, &client_us)
                           : RunBlock(c.ranks, kBlock, direct, check_direct, &direct_us);
      if (!s.ok()) return s;
    }
  }
  for (auto& rank : ranks) {
    if (absl::Status s = rank->Detach(); !s.ok()) return s;
  }
  const double cp50 = Percentile(client_us, 0.5), dp50 = Percentile(direct_us, 0.5);
  return nlohmann::json{{"ranks", c.ranks},
                        {"tokens", c.tokens},
                        {"hidden", c.hidden},
                        {"routing", c.routing},
                        {"iters", client_us.size()},
                        {"libubep_p50_us", cp50},
                        {"libubep_p99_us", Percentile(client_us, 0.99)},
                        {"direct_p50_us", dp50},
                        {"direct_p99_us", Percentile(direct_us, 0.99)},
                        {"overhead_ratio", cp50 / dp50}};
}

absl::StatusOr<std::pair<double, double>> AttachLatency(const std::string& socket, int iters) {
  ModelShape shape;
  shape.num_layers = 4;
  shape.num_experts = 256;
  shape.hidden = 7168;
  shape.top_k = 8;
  shape.max_tokens = 128;
  shape.slots_per_rank = 256;
  shape.dtype = DType::kBFloat16;
  ClientOptions options;
  options.socket_path = socket;
  std::vector<double> ms;
  for (int i = 0; i < iters + 3; ++i) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, 0, 1, 0, shape);
    const double took = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (!rank.ok()) return rank.status();
    if (i >= 3) ms.push_back(took);  // The first attaches create the group's arenas.
    if (absl::Status s = (*rank)->Detach(); !s.ok()) return s;
  }
  return std::make_pair(Percentile(ms, 0.5), Percentile(ms, 0.99));
}

}  // namespace
}  // namespace ubep::bench

int main(int argc, char** argv) {
  using namespace ubep::bench;
  ubep::kernels::RequireHostCpu("ubep-bench-daemon");
  bool json = false;
  int iters = 100;
  std::vector<int> rank_counts = {2, 4};
  std::string ubepd = UBEP_UBEPD;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--json") {
      json = true;
    } else if (flag == "--iters" && i + 1 < argc) {
      iters = std::max(kBlock, std::atoi(argv[++i]));
    } else if (flag == "--ranks" && i + 1 < argc) {
      rank_counts.clear();
      for (absl::string_view r : absl::StrSplit(argv[++i], ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(r, &n) || n < 1 || kExperts % n != 0) {
          std::cerr << "ubep-bench-daemon: --ranks takes divisors of 256, comma-separated\n";
          return 2;
        }
        rank_counts.push_back(n);
      }
    } else if (flag == "--ubepd" && i + 1 < argc) {
      ubepd = argv[++i];
    } else {
      std::cerr << "usage: ubep-bench-daemon [--json] [--iters N] [--ranks 2,4] [--ubepd PATH]\n";
      return 2;
    }
  }
  char dir_template[] = "/tmp/ubep-bench-daemon-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  nlohmann::json result;
  auto fail = [&](const absl::Status& s) {
    std::cerr << "ubep-bench-daemon: " << s.message() << "\n";
    std::filesystem::remove_all(dir);
    return 1;
  };
  {
    DaemonProcess daemon(ubepd, dir + "/attach.sock");
    if (!daemon.ok()) return fail(absl::UnavailableError("ubepd did not start: " + ubepd));
    absl::StatusOr<std::pair<double, double>> attach = AttachLatency(dir + "/attach.sock", iters);
    if (!attach.ok()) return fail(attach.status());
    result["attach_ms_p50"] = attach->first;
    result["attach_ms_p99"] = attach->second;
  }
  result["cases"] = nlohmann::json::array();
  for (int ranks : rank_counts) {
    for (int hidden : {7168, 2048}) {
      for (const char* routing : {"uniform", "skewed"}) {
        const Case c{"decode", ranks, 128, hidden, routing};
        Skew skew;
        if (c.routing == "skewed") {
          absl::StatusOr<Skew> drawn = SkewedDistribution(UBEP_SOURCE_DIR, c.name, ranks);
          if (!drawn.ok()) return fail(drawn.status());
          skew = *std::move(drawn);
        }
        // A daemon per case: a group's shape is fixed while it is attached.
        DaemonProcess daemon(ubepd, dir + "/step.sock");
        if (!daemon.ok()) return fail(absl::UnavailableError("ubepd did not start: " + ubepd));
        absl::StatusOr<nlohmann::json> row = RunCase(c, dir + "/step.sock", iters, skew);
        if (!row.ok()) return fail(row.status());
        result["cases"].push_back(*row);
      }
    }
  }
  std::filesystem::remove_all(dir);
  double log_sum = 0;
  for (const auto& row : result["cases"]) log_sum += std::log(row["overhead_ratio"].get<double>());
  result["overhead_ratio_geomean"] = std::exp(log_sum / static_cast<double>(result["cases"].size()));
  if (json) {
    std::cout << result.dump(1) << "\n";
    return 0;
  }
  std::cout << absl::StrFormat("attach latency: p50 %.2f ms, p99 %.2f ms\n",
                               result["attach_ms_p50"].get<double>(),
                               result["attach_ms_p99"].get<double>());
  std::cout << "ranks tokens hidden routing   libubep p50/p99 us   direct p50/p99 us   overhead\n";
  for (const auto& row : result["cases"]) {
    std::cout << absl::StrFormat("%5d %6d %6d %-8s %8.0f / %-8.0f %8.0f / %-8.0f %8.3f\n",
                                 row["ranks"].get<int>(), row["tokens"].get<int>(),
                                 row["hidden"].get<int>(), row["routing"].get<std::string>(),
                                 row["libubep_p50_us"].get<double>(),
                                 row["libubep_p99_us"].get<double>(),
                                 row["direct_p50_us"].get<double>(),
                                 row["direct_p99_us"].get<double>(),
                                 row["overhead_ratio"].get<double>());
  }
  std::cout << absl::StrFormat("overhead, geometric mean over the cases: %.3f\n",
                               result["overhead_ratio_geomean"].get<double>());
  return 0;
}
