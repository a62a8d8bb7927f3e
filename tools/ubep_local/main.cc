// ubep-local: the main job on one machine, on the host backend, no GPU needed. It starts
// ubep-balancer, K ubepd daemons acting as nodes (each hosting a contiguous range of ranks)
// and R serving processes running the example MoE stack (ubep-moe-example) on a drifting mix
// of the bundled DeepSeek-V3 expert-load traces; shows a live progress line; and writes a
// report (report.json, report.md, report.png) when the run ends or on Ctrl-C.
//
//   ubep-local [--ranks R] [--daemons K] [--steps N] [--policy ubep|eplb|none] [--report DIR]
//              [--max_recv_rows N]
//
// With --max_recv_rows, a step some rank is routed more rows than that in is dropped by every
// rank (ubepd --max_recv_rows); the report counts the dropped steps before and after the
// balancer's first plan, which spreads the hot experts that overflow.
//
// Every process it starts is stopped on exit (SIGTERM, then SIGKILL after 10 s); arenas are
// memfd shared memory, so nothing is left in /dev/shm; the working directory (sockets and
// logs) is removed unless --keep_workdir.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "balancer/core/metrics.h"
#include "balancer/formats/json_formats.h"
#include "common/flags_usage.h"
#include "common/clock.h"
#include "common/http_get.h"
#include "common/process.h"
#include "common/shape_limits.h"
#include "examples/moe_serving/step_log.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, ranks, 8, "Serving ranks (processes) in the EP group.");
ABSL_FLAG(int, daemons, 2, "ubepd daemons acting as nodes; ranks are split evenly between them.");
ABSL_FLAG(int, steps, 600, "Steps each rank runs.");
ABSL_FLAG(std::string, policy, "ubep", "Placement policy: ubep, eplb, or none (no rebalancing).");
ABSL_FLAG(std::string, report, "ubep-local-report", "Directory for report.json, .md and .png.");
ABSL_FLAG(std::string, traces, "",
          "Comma-separated SGLang expert-distribution files the router draws from; empty = the "
          "bundled DeepSeek-V3 decode and prefill traces.");
ABSL_FLAG(double, drift_period, 2000, "Steps per full rotation of the traces' mix.");
ABSL_FLAG(int, experts, 256, "Logical experts per MoE layer.");
ABSL_FLAG(int, layers, 4, "MoE layers.");
ABSL_FLAG(int, hidden, 32, "Hidden size.");
ABSL_FLAG(int, tokens, 128, "Tokens per rank per step.");
ABSL_FLAG(int, slots_per_rank, 0, "Expert slots per rank; 0 = experts / ranks (no spare slot).");
ABSL_FLAG(absl::Duration, step_delay, absl::Milliseconds(5), "Pause after each step.");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(1), "The balancer's load interval.");
ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "The balancer's Control address (ubepctl's default); port 0 picks one.");
ABSL_FLAG(int, metrics_port, 9465,
          "The balancer's /metrics port on 127.0.0.1; daemon i serves at metrics_port + 1 + i; "
          "0 = any free ports (see DIR/cluster.json and DIR/prometheus-targets.json).");
ABSL_FLAG(bool, keep_workdir, false, "Keep the working directory (sockets and logs).");
ABSL_FLAG(int, max_recv_rows, 0,
          "ubepd --max_recv_rows: rows one dispatch may lay out on a rank; a step that routes a "
          "rank more is dropped by every rank; 0 = unbounded.");

namespace {

// Experts per token in the serving processes (ubep-moe-example's --top_k, left at its default).
constexpr int kTopK = 8;

std::atomic<bool> interrupted{false};

void OnSignal(int) { interrupted.store(true); }

std::string SelfDir() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? "." : self.parent_path().string();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The last `bytes` of a file (a client's log grows by a line a step; the progress line needs
// only its last step).
std::string ReadTail(const std::string& path, std::streamoff bytes);

// The last line with text of a process's output, quoted after a colon (why it exited), or "".
std::string LastLineOf(const std::string& path) {
  std::vector<std::string> lines = absl::StrSplit(ReadTail(path, 4096), '\n', absl::SkipWhitespace());
  return lines.empty() ? std::string() : absl::StrCat(": \"", lines.back(), "\"");
}

std::string ReadTail(const std::string& path, std::streamoff bytes) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "";
  const std::streamoff size = in.tellg();
  in.seekg(std::max<std::streamoff>(0, size - bytes));
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A --ready_file's JSON, once it exists (at most 30 s); or why there is none: the process did
// not start, exited, or gave no ready file in time.
absl::StatusOr<nlohmann::json> AwaitReady(const std::string& path, ubep::Process& process) {
  if (process.spawn_error() != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot start it: ", strerror(process.spawn_error())));
  }
  const absl::Time deadline = ubep::MonotonicNow() + absl::Seconds(30);
  while (ubep::MonotonicNow() < deadline && !interrupted.load()) {
    if (std::filesystem::exists(path)) {
      try {
        const nlohmann::json ready = nlohmann::json::parse(ReadFile(path));
        if (ready.is_object()) return ready;
      } catch (const std::exception&) {
        // Half written: read again.
      }
    }
    if (const std::optional<int> code = process.Wait(absl::ZeroDuration()); code.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat("it exited with status ", *code));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError("no ready file within 30s");
}

// Where the daemons and ubepctl reach a balancer listening at `listen` (HOST:PORT): the host
// it names, loopback where that is a wildcard (or missing).
std::string DialHost(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "[::]") return "[::1]";
  return host;
}

// A port from a ready file (0 when absent or not a port).
int ReadyPort(const nlohmann::json& ready, const char* key) {
  const auto it = ready.find(key);
  if (it == ready.end() || !it->is_number_integer()) return 0;
  const int64_t port = it->get<int64_t>();
  return port > 0 && port < 65536 ? static_cast<int>(port) : 0;
}

// One sample of a Prometheus text exposition.
struct Series {
  std::string name;
  std::map<std::string, std::string> labels;
  double value;
};

std::vector<Series> ParseExposition(const std::string& text) {
  static const std::regex kLine(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$)");
  static const std::regex kLabel(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)")re");
  std::vector<Series> out;
  for (const absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const std::string s(line);
    std::smatch m;
    if (!std::regex_match(s, m, kLine)) continue;
    Series series{m[1], {}, 0};
    if (!absl::SimpleAtod(std::string(m[4]), &series.value)) continue;
    const std::string labels = m[3];
    for (auto it = std::sregex_iterator(labels.begin(), labels.end(), kLabel);
         it != std::sregex_iterator(); ++it) {
      series.labels[(*it)[1]] = (*it)[2];
    }
    out.push_back(std::move(series));
  }
  return out;
}

// The values of every series of `name` whose labels include `match`.
std::vector<double> Values(const std::vector<Series>& all, const std::string& name,
                           const std::map<std::string, std::string>& match = {}) {
  std::vector<double> values;
  for (const Series& s : all) {
    if (s.name != name) continue;
    bool ok = true;
    for (const auto& [k, v] : match) {
      const auto it = s.labels.find(k);
      ok &= it != s.labels.end() && it->second == v;
    }
    if (ok) values.push_back(s.value);
  }
  return values;
}

double Sum(const std::vector<Series>& all, const std::string& name) {
  double sum = 0;
  for (double v : Values(all, name)) sum += v;
  return sum;
}

double Mean(const std::vector<Series>& all, const std::string& name,
            const std::map<std::string, std::string>& match) {
  const std::vector<double> values = Values(all, name, match);
  double sum = 0;
  for (double v : values) sum += v;
  return values.empty() ? std::nan("") : sum / values.size();
}

// The median of a Prometheus histogram summed over every series of `name` (cumulative
// buckets by le), interpolated inside the bucket; NaN without observations.
double HistogramMedian(const std::vector<Series>& all, const std::string& name) {
  std::map<double, double> buckets;
  for (const Series& s : all) {
    const auto le = s.labels.find("le");
    double bound = INFINITY;
    if (s.name != name + "_bucket" || le == s.labels.end() ||
        (le->second != "+Inf" && !absl::SimpleAtod(le->second, &bound))) {
      continue;
    }
    buckets[bound] += s.value;
  }
  if (buckets.empty() || buckets.rbegin()->second <= 0) return std::nan("");
  const double half = buckets.rbegin()->second / 2;
  double lower = 0, below = 0;
  for (const auto& [bound, count] : buckets) {
    if (count >= half) {
      if (std::isinf(bound)) return lower;
      return lower + (bound - lower) * (half - below) / std::max(count - below, 1e-9);
    }
    lower = bound;
    below = count;
  }
  return lower;
}

struct Node {
  std::string name;
  int first_rank = 0, num_ranks = 0;
  int metrics_port = 0;
  std::unique_ptr<ubep::Process> process;
};

struct Sample {
  double seconds;
  uint64_t step;
  double version, measured;
};

// Balancedness (max / mean) per layer of per-rank counts, NaN for a layer no call reached;
// the mean over the others (NaN if none).
double MeanImbalance(const std::vector<std::vector<double>>& counts, std::vector<double>* per_layer) {
  std::vector<double> layers;
  for (const std::vector<double>& layer : counts) {
    layers.push_back(ubep::balancer::MeasuredBalancedness(layer));
  }
  const ubep::balancer::BalanceSummary summary = ubep::balancer::SummarizeLayers(layers);
  if (per_layer != nullptr) *per_layer = std::move(layers);
  return summary.measured > 0 ? summary.mean : std::nan("");
}

std::vector<std::vector<double>> Minus(const std::vector<std::vector<double>>& a,
                                       const std::vector<std::vector<double>>& b) {
  std::vector<std::vector<double>> out = a;
  for (size_t l = 0; l < out.size() && l < b.size(); ++l) {
    for (size_t r = 0; r < out[l].size() && r < b[l].size(); ++r) out[l][r] -= b[l][r];
  }
  return out;
}

nlohmann::json JsonNumber(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

// Per-rank loads over the mean, [layer][rank], for the heatmap.
void WriteHeat(const std::string& path, const std::vector<std::vector<double>>& counts) {
  std::ofstream out(path);
  for (const std::vector<double>& layer : counts) {
    double mean = 0;
    for (double v : layer) mean += v;
    mean /= std::max<size_t>(layer.size(), 1);
    std::vector<std::string> row;
    for (double v : layer) row.push_back(absl::StrFormat("%.4f", mean > 0 ? v / mean : 0));
    out << absl::StrJoin(row, " ") << "\n";
  }
}

int Run(int argc, char** argv) {
  ubep::SetFlagsUsage("ubep-local",
      "a local UBEP cluster on the host backend, with a report.\nUsage: ubep-local [--ranks R] "
      "[--daemons K] [--steps N] [--policy ubep|eplb|none] [--report DIR]");
  absl::ParseCommandLine(argc, argv);
  const int R = absl::GetFlag(FLAGS_ranks), K = absl::GetFlag(FLAGS_daemons);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string policy = absl::GetFlag(FLAGS_policy);
  const int experts = absl::GetFlag(FLAGS_experts);
  int slots = absl::GetFlag(FLAGS_slots_per_rank);
  if (R < 1 || K < 1 || K > R || steps < 1 || (policy != "ubep" && policy != "eplb" && policy != "none")) {
    std::cerr << "ubep-local: need 1 <= --daemons <= --ranks, --steps >= 1 and --policy ubep, eplb "
                 "or none\n";
    return 2;
  }
  for (const auto& [name, value] : {std::pair<const char*, int>{"experts", experts},
                                    {"layers", absl::GetFlag(FLAGS_layers)},
                                    {"hidden", absl::GetFlag(FLAGS_hidden)},
                                    {"tokens", absl::GetFlag(FLAGS_tokens)}}) {
    if (value < 1) {
      std::cerr << "ubep-local: --" << name << " " << value << " is not positive\n";
      return 2;
    }
  }
  if (slots < 0) {
    std::cerr << "ubep-local: --slots_per_rank " << slots << " is negative\n";
    return 2;
  }
  for (const auto& [name, value, most] :
       {std::tuple<const char*, int, uint32_t>{"ranks", R, ubep::kMaxWorld},
        {"experts", experts, ubep::kMaxExperts},
        {"layers", absl::GetFlag(FLAGS_layers), ubep::kMaxLayers},
        {"slots_per_rank", slots, ubep::kMaxSlotsPerRank},
        {"tokens", absl::GetFlag(FLAGS_tokens), ubep::kMaxTokens},
        {"hidden", absl::GetFlag(FLAGS_hidden), ubep::kMaxHidden}}) {
    if (static_cast<uint32_t>(value) > most) {
      std::cerr << "ubep-local: --" << name << " " << value << " is over " << most
                << ", the most ubepd takes\n";
      return 2;
    }
  }
  // What the processes it starts would refuse, refused here, before anything starts.
  if (const int rows = absl::GetFlag(FLAGS_max_recv_rows); rows < 0) {
    std::cerr << "ubep-local: --max_recv_rows " << rows << " is negative (0: unbounded)\n";
    return 2;
  }
  if (const absl::Duration delay = absl::GetFlag(FLAGS_step_delay); delay < absl::ZeroDuration()) {
    std::cerr << "ubep-local: --step_delay " << absl::FormatDuration(delay) << " is negative\n";
    return 2;
  }
  if (const double period = absl::GetFlag(FLAGS_drift_period); !(period > 0)) {
    std::cerr << "ubep-local: --drift_period " << period << " is not positive\n";
    return 2;
  }
  if (const absl::Duration interval = absl::GetFlag(FLAGS_interval);
      interval < absl::Milliseconds(10) || interval > absl::Hours(1)) {
    std::cerr << "ubep-local: --interval " << absl::FormatDuration(interval)
              << (interval > absl::Hours(1) ? " is over 1h" : " is under 10ms")
              << " (ubepd's --report_interval takes it)\n";
    return 2;
  }
  if (const int port = absl::GetFlag(FLAGS_metrics_port); port < 0) {
    std::cerr << "ubep-local: --metrics_port " << port << " is negative (0 = any free ones)\n";
    return 2;
  } else if (port >= 65536 - K) {
    std::cerr << "ubep-local: --metrics_port " << port << " leaves no port for daemon " << K - 1
              << " (ports metrics_port to metrics_port + daemons; 0 = any free ones)\n";
    return 2;
  }
  if (slots == 0) slots = (experts + R - 1) / R;
  // The serving processes route top-8 (ubep-moe-example's default) over the experts, which
  // the group's slots must hold, drawn from traces of that many experts and enough layers.
  if (experts < kTopK) {
    std::cerr << "ubep-local: --experts " << experts << " is under the top-" << kTopK
              << " the serving processes route to\n";
    return 2;
  }
  if (static_cast<int64_t>(slots) * R < experts) {
    std::cerr << "ubep-local: --slots_per_rank " << slots << " x --ranks " << R << " holds "
              << static_cast<int64_t>(slots) * R << " slots, fewer than --experts " << experts
              << "\n";
    return 2;
  }
  const std::string bin = SelfDir();
  std::string traces = absl::GetFlag(FLAGS_traces);
  if (traces.empty()) {
    const std::string dir = std::string(UBEP_DATA_DIR) + "/traces/deepseek-v3/";
    traces = dir + "decode_in1000out1000.json," + dir + "prefill_in1024.json";
  }
  for (const std::string& trace : std::vector<std::string>(absl::StrSplit(traces, ',', absl::SkipEmpty()))) {
    absl::StatusOr<ubep::balancer::LoadMatrix> load = ubep::balancer::ReadSglangLoadFile(trace);
    if (!load.ok()) {
      std::cerr << "ubep-local: --traces: " << load.status().message() << "\n";
      return 2;
    }
    if (load->num_experts() != experts || load->num_layers() < absl::GetFlag(FLAGS_layers)) {
      std::cerr << "ubep-local: " << trace << " has " << load->num_layers() << " MoE layers x "
                << load->num_experts() << " experts; --layers " << absl::GetFlag(FLAGS_layers)
                << " and --experts " << experts << " need at least " << absl::GetFlag(FLAGS_layers)
                << " x exactly " << experts << "\n";
      return 2;
    }
  }
  const std::string report_dir = absl::GetFlag(FLAGS_report);
  std::error_code made;
  std::filesystem::create_directories(report_dir, made);
  if (made) {
    std::cerr << "ubep-local: cannot create --report " << report_dir << ": " << made.message() << "\n";
    return 1;
  }
  // What an earlier run wrote there goes first: a run that fails to start must not leave a
  // passing report, or ports nobody serves, in the directory as its own.
  for (const char* earlier : {"report.json", "report.md", "report.png", "cluster.json",
                              "prometheus-targets.json"}) {
    std::error_code ignored;
    std::filesystem::remove(report_dir + "/" + earlier, ignored);
  }
  char workdir_template[] = "/tmp/ubep-local.XXXXXX";
  if (mkdtemp(workdir_template) == nullptr) {
    std::cerr << "ubep-local: cannot create a working directory under /tmp: " << strerror(errno)
              << "\n";
    return 1;
  }
  const std::string workdir = workdir_template;
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  // Inherited ignored (it survives exec), the kernel would reap the children: their exit codes,
  // which say whether the run was correct, would be lost.
  signal(SIGCHLD, SIG_DFL);
  // The terminal closed: stopped as by Ctrl-C, with its report; not where SIGHUP is ignored
  // already (started under nohup, to outlive the terminal).
  struct sigaction hangup {};
  if (sigaction(SIGHUP, nullptr, &hangup) == 0 && hangup.sa_handler != SIG_IGN) {
    signal(SIGHUP, OnSignal);
  }
  const int metrics_base = absl::GetFlag(FLAGS_metrics_port);
  auto metrics_address = [&](int offset) {
    return absl::StrCat("127.0.0.1:", metrics_base == 0 ? 0 : metrics_base + offset);
  };
  auto path = [&](const std::string& name) { return workdir + "/" + name; };

  // The balancer.
  std::vector<std::string> balancer_argv = {
      bin + "/ubep-balancer", "--listen=" + absl::GetFlag(FLAGS_listen),
      "--metrics=" + metrics_address(0), "--ready_file=" + path("balancer.ready"),
      "--interval=" + absl::FormatDuration(absl::GetFlag(FLAGS_interval)),
      "--report_interval=" + absl::FormatDuration(absl::GetFlag(FLAGS_interval)),
      "--health_interval=500ms", "--window=8", "--trigger_windows=2", "--threshold=1.1",
      "--policy=" + (policy == "none" ? std::string("ubep") : policy),
      absl::StrCat("--auto_rebalance=", policy == "none" ? "false" : "true")};
  auto balancer = std::make_unique<ubep::Process>(balancer_argv, path("balancer.log"));
  std::vector<Node> nodes(K);
  std::vector<std::unique_ptr<ubep::Process>> clients;
  int exit_code = 0;
  // SIGTERM to all, then, in the order they were asked (ranks, daemons, balancer), each waited
  // for until 10 s after the signal, the rest killed: 10 s in all, however many are stuck.
  auto stop_all = [&] {
    std::vector<ubep::Process*> all;
    for (auto& c : clients) all.push_back(c.get());
    for (Node& n : nodes) {
      if (n.process) all.push_back(n.process.get());
    }
    all.push_back(balancer.get());
    for (ubep::Process* p : all) p->Signal(SIGTERM);
    const absl::Time deadline = ubep::MonotonicNow() + absl::Seconds(10);
    for (ubep::Process* p : all) {
      if (!p->Wait(std::max(absl::ZeroDuration(), deadline - ubep::MonotonicNow())).has_value()) {
        p->Signal(SIGKILL);
        p->Wait(absl::Seconds(10));
      }
    }
  };
  auto fail = [&](const std::string& what, const std::string& log) {
    if (interrupted.load()) {  // Ctrl-C while starting up: as once running, less the report.
      std::cout << "ubep-local: interrupted; stopping everything\n";
      stop_all();
      if (!absl::GetFlag(FLAGS_keep_workdir)) std::filesystem::remove_all(workdir);
      return 130;
    }
    std::cerr << "ubep-local: " << what << "\n" << ReadFile(log) << "\n";
    stop_all();
    std::cerr << "logs kept in " << workdir << "\n";
    return 1;
  };
  const absl::StatusOr<nlohmann::json> balancer_ready =
      AwaitReady(path("balancer.ready"), *balancer);
  if (!balancer_ready.ok()) {
    return fail(absl::StrCat("ubep-balancer did not start (", balancer_ready.status().message(),
                             "); its log:"),
                path("balancer.log"));
  }
  const int balancer_port = ReadyPort(*balancer_ready, "port");
  const std::string balancer_address =
      absl::StrCat(DialHost(absl::GetFlag(FLAGS_listen)), ":", balancer_port);
  const int balancer_metrics = ReadyPort(*balancer_ready, "metrics_port");

  // The daemons, then the serving ranks.
  for (int i = 0; i < K; ++i) {
    Node& n = nodes[i];
    n.name = absl::StrCat("node-", i);
    n.first_rank = R * i / K;
    n.num_ranks = R * (i + 1) / K - n.first_rank;
    n.process = std::make_unique<ubep::Process>(
        std::vector<std::string>{
            bin + "/ubepd", "--socket=" + path(n.name + ".sock"), "--listen=127.0.0.1:0",
            "--metrics=" + metrics_address(1 + i), "--ready_file=" + path(n.name + ".ready"),
            "--balancer=" + balancer_address, "--node=" + n.name,
            absl::StrCat("--ranks=", n.first_rank, "-", n.first_rank + n.num_ranks - 1),
            absl::StrCat("--free_buffers=", slots), "--harvest_interval=500ms",
            absl::StrCat("--max_recv_rows=", absl::GetFlag(FLAGS_max_recv_rows)),
            "--wait_timeout=30s"},
        path(n.name + ".log"));
  }
  for (Node& n : nodes) {
    const absl::StatusOr<nlohmann::json> ready = AwaitReady(path(n.name + ".ready"), *n.process);
    if (!ready.ok()) {
      return fail(absl::StrCat(n.name, "'s ubepd did not start (", ready.status().message(),
                               "); its log:"),
                  path(n.name + ".log"));
    }
    n.metrics_port = ReadyPort(*ready, "metrics_port");
  }
  {
    nlohmann::json cluster = {{"balancer", balancer_address},
                              {"balancer_metrics_port", balancer_metrics},
                              {"workdir", workdir}};
    nlohmann::json targets = nlohmann::json::array();
    targets.push_back({{"targets", {absl::StrCat("127.0.0.1:", balancer_metrics)}},
                       {"labels", {{"job", "ubep-balancer"}}}});
    for (const Node& n : nodes) {
      cluster["daemons"].push_back({{"node", n.name},
                                    {"metrics_port", n.metrics_port},
                                    {"ranks", {n.first_rank, n.first_rank + n.num_ranks - 1}}});
      targets.push_back({{"targets", {absl::StrCat("127.0.0.1:", n.metrics_port)}},
                         {"labels", {{"job", "ubepd"}, {"node", n.name}}}});
    }
    // Read while the cluster runs (by Prometheus's file discovery, by tests): each appears
    // whole (written aside, then renamed), never empty or half written.
    for (const auto& [name, json] :
         {std::pair{"cluster.json", &cluster}, std::pair{"prometheus-targets.json", &targets}}) {
      if (absl::Status st =
              ubep::balancer::WriteTextFile(report_dir + "/" + name, json->dump(2) + "\n");
          !st.ok()) {
        std::cerr << "ubep-local: " << st.message() << "\n";
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const Node& n = nodes[std::min(K - 1, r * K / R)];
    const Node& host = (r >= n.first_rank && r < n.first_rank + n.num_ranks)
                           ? n
                           : *std::find_if(nodes.begin(), nodes.end(), [&](const Node& m) {
                               return r >= m.first_rank && r < m.first_rank + m.num_ranks;
                             });
    clients.push_back(std::make_unique<ubep::Process>(
        std::vector<std::string>{
            bin + "/ubep-moe-example", "--socket=" + path(host.name + ".sock"),
            absl::StrCat("--rank=", r), absl::StrCat("--world=", R),
            absl::StrCat("--steps=", steps), absl::StrCat("--layers=", absl::GetFlag(FLAGS_layers)),
            absl::StrCat("--experts=", experts), absl::StrCat("--hidden=", absl::GetFlag(FLAGS_hidden)),
            absl::StrCat("--tokens=", absl::GetFlag(FLAGS_tokens)),
            absl::StrCat("--slots_per_rank=", slots),
            "--step_delay=" + absl::FormatDuration(absl::GetFlag(FLAGS_step_delay)),
            absl::StrCat("--drift_period=", absl::GetFlag(FLAGS_drift_period)),
            "--traces=" + traces, "--log=" + path(absl::StrCat("client-", r, ".log"))},
        path(absl::StrCat("client-", r, ".out"))));
  }
  std::cout << "ubep-local: " << R << " ranks on " << K << " daemons, " << steps
            << " steps, policy " << policy << "\n"
            << "  ubep-balancer: " << balancer_address << " (ubepctl --balancer="
            << balancer_address << "), metrics http://127.0.0.1:" << balancer_metrics << "/metrics\n";
  for (const Node& n : nodes) {
    std::cout << "  " << n.name << " ranks " << n.first_rank << "-" << n.first_rank + n.num_ranks - 1
              << ": metrics http://127.0.0.1:" << n.metrics_port << "/metrics\n";
  }
  std::cout << "  logs in " << workdir << "; Ctrl-C stops everything\n" << std::flush;

  // Watch: counters, the plan, progress.
  const bool tty = isatty(STDOUT_FILENO);
  const absl::Time start = ubep::MonotonicNow();
  const int layers = absl::GetFlag(FLAGS_layers);
  std::vector<std::vector<double>> counts(layers, std::vector<double>(R, 0));
  std::optional<std::vector<std::vector<double>>> before_end, after_start;
  std::optional<double> first_commit;
  std::vector<Sample> samples;
  double version = 1, migrated = 0, committed = 0, last_before = NAN, last_after = NAN;
  double dispatch_p50 = NAN, combine_p50 = NAN;
  std::vector<uint64_t> last_step(R, 0);
  // The steps bounding the report's before and after windows (where it has them).
  uint64_t before_end_step = 0, after_start_step = 0;
  absl::Time next_print = absl::InfinitePast();
  // The balancer or a daemon that exits while the ranks run: named, and the run ends (the
  // ranks would go on without the balancer, its figures frozen; a daemon's ranks fail later).
  std::vector<std::string> service_problems;
  auto exited = [&](ubep::Process& p, const std::string& name, const std::string& log) {
    const std::optional<int> code = p.Wait(absl::ZeroDuration());
    if (code.has_value()) {
      service_problems.push_back(
          absl::StrCat(name, " exited with status ", *code, " while the ranks ran (", log, ")"));
    }
    return code.has_value();
  };
  while (!interrupted.load()) {
    bool all_done = true;
    for (auto& c : clients) all_done &= !c->running() || c->Wait(absl::ZeroDuration()).has_value();
    // (A Ctrl-C at a terminal reaches the children too: not a service that failed.)
    bool service_gone = false;
    if (!all_done && !interrupted.load()) {
      service_gone = exited(*balancer, "ubep-balancer", path("balancer.log"));
      for (const Node& n : nodes) {
        service_gone |= exited(*n.process, "ubepd " + n.name, path(n.name + ".log"));
      }
    }
    if (service_gone && interrupted.load()) service_problems.clear();
    if (service_gone && !interrupted.load()) break;  // Named in the summary, below.
    const double t = absl::ToDoubleSeconds(ubep::MonotonicNow() - start);
    // Counters and latencies from the daemons; the plan from the balancer.
    std::vector<Series> daemon_series;
    for (const Node& n : nodes) {
      std::vector<Series> s = ParseExposition(ubep::HttpGet(n.metrics_port, "/metrics"));
      daemon_series.insert(daemon_series.end(), s.begin(), s.end());
    }
    for (const Series& s : daemon_series) {
      if (s.name != "ubep_daemon_rank_received_total") continue;
      const auto layer = s.labels.find("layer"), rank = s.labels.find("rank");
      int l = -1, r = -1;
      if (layer == s.labels.end() || rank == s.labels.end() ||
          !absl::SimpleAtoi(layer->second, &l) || !absl::SimpleAtoi(rank->second, &r)) {
        continue;  // Not the series ubepd writes: ignored, not trusted.
      }
      if (l >= 0 && l < layers && r >= 0 && r < R) counts[l][r] = s.value;
    }
    dispatch_p50 = HistogramMedian(daemon_series, "ubep_daemon_dispatch_seconds");
    combine_p50 = HistogramMedian(daemon_series, "ubep_daemon_combine_seconds");
    const std::vector<Series> b = ParseExposition(ubep::HttpGet(balancer_metrics, "/metrics"));
    if (!b.empty()) {
      version = Sum(b, "ubep_balancer_plan_version");
      migrated = Sum(b, "ubep_balancer_migrated_slots_total");
      committed = Sum(b, "ubep_balancer_plans_committed_total");
      last_before = Mean(b, "ubep_balancer_imbalance_ratio", {{"when", "before"}});
      last_after = Mean(b, "ubep_balancer_imbalance_ratio", {{"when", "after"}});
    }
    const double measured = Mean(b, "ubep_balancer_imbalance_ratio", {{"when", "measured"}});
    for (int r = 0; r < R; ++r) {
      // The last step line, served or dropped (the tail's first line may be cut: no step
      // line then).
      const std::string log = ReadTail(path(absl::StrCat("client-", r, ".log")), 4096);
      const std::vector<absl::string_view> lines = absl::StrSplit(log, '\n', absl::SkipEmpty());
      for (auto line = lines.rbegin(); line != lines.rend(); ++line) {
        if (const auto parsed = ubep::example::ParseStepLine(*line)) {
          last_step[r] = parsed->step + 1;
          break;
        }
      }
    }
    const uint64_t step = *std::min_element(last_step.begin(), last_step.end());
    samples.push_back({t, step, version, measured});
    // Before: the counts under plan v1 (to the first commit; for --policy none the first
    // third of the run). After: from a few intervals past the first commit (the plan is in
    // force and the counters show it), or the last third.
    const double settle = 3 * absl::ToDoubleSeconds(absl::GetFlag(FLAGS_interval));
    if (policy == "none") {
      if (!before_end && step * 3 >= static_cast<uint64_t>(steps)) {
        before_end = counts;
        before_end_step = step;
      }
      if (!after_start && step * 3 >= 2 * static_cast<uint64_t>(steps)) {
        after_start = counts;
        after_start_step = step;
      }
    } else {
      if (!first_commit && version > 1) {
        first_commit = t;
        before_end = counts;
        before_end_step = step;
      }
      if (first_commit && !after_start && t >= *first_commit + settle) {
        after_start = counts;
        after_start_step = step;
      }
    }
    if (ubep::MonotonicNow() >= next_print || all_done) {
      next_print = ubep::MonotonicNow() + (tty ? absl::Milliseconds(500) : absl::Seconds(5));
      const std::string line = absl::StrFormat(
          "step %d/%d  plan v%.0f  imbalance %s (last rebalance %s -> %s)  migrated %.0f slots  "
          "dispatch+combine p50 %s",
          step, steps, version, std::isfinite(measured) ? absl::StrFormat("%.3f", measured) : "-",
          std::isfinite(last_before) ? absl::StrFormat("%.3f", last_before) : "-",
          std::isfinite(last_after) ? absl::StrFormat("%.3f", last_after) : "-", migrated,
          std::isfinite(dispatch_p50) && std::isfinite(combine_p50)
              ? absl::StrFormat("%.0f us", (dispatch_p50 + combine_p50) * 1e6)
              : "-");
      if (tty) {
        std::cout << "\r" << line << "\033[K" << std::flush;
      } else {
        std::cout << line << "\n" << std::flush;
      }
    }
    if (all_done) break;
    absl::SleepFor(absl::Milliseconds(500));
  }
  if (tty) std::cout << "\n";
  if (interrupted.load()) std::cout << "ubep-local: interrupted; stopping everything\n";
  stop_all();
  // Under --policy ubep or eplb, a run that committed nothing ran under plan v1 to its end:
  // all of it is the before window.
  if (policy != "none" && !first_commit && !samples.empty()) {
    before_end = counts;
    before_end_step = samples.back().step;
  }

  // Correctness: every rank ran every step, each equal to its float64 reference, with the
  // balancer and every daemon there to the end.
  bool correct = !interrupted.load() && service_problems.empty();
  std::vector<std::string> problems = service_problems;
  // (Ranks stopped because a service exited, or by the interruption, are not each named:
  // that is the cause.)
  for (int r = 0; r < R && service_problems.empty() && !interrupted.load(); ++r) {
    const std::string log = ReadFile(path(absl::StrCat("client-", r, ".log")));
    const std::optional<int> code = clients[r]->Wait(absl::ZeroDuration());
    // Exit 4: every step the rank ran was dropped over the receive capacity, which this run
    // counts and reports itself (below); no served step was wrong.
    if ((code != 0 && code != 4) ||
        !absl::StrContains(log, absl::StrCat("done steps ", steps, " failed 0")) ||
        absl::StrContains(log, "MISMATCH")) {
      correct = false;
      problems.push_back(clients[r]->spawn_error() != 0
                             ? absl::StrCat("rank ", r, " did not start: ",
                                            strerror(clients[r]->spawn_error()))
                             : absl::StrCat("rank ", r, " exit ", code.value_or(-1),
                                            LastLineOf(path(absl::StrCat("client-", r, ".out")))));
      continue;
    }
    // A step dropped out of step was not served, and the ranks here run the same steps: a
    // fault, not a load the run asked for.
    int out_of_step = 0;
    std::string first;
    for (const absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
      const auto parsed = ubep::example::ParseStepLine(line);
      if (!parsed || parsed->outcome != ubep::example::StepOutcome::kDroppedOutOfStep) continue;
      if (out_of_step++ == 0) first = std::string(line);
    }
    if (out_of_step > 0) {
      correct = false;
      problems.push_back(absl::StrCat("rank ", r, " dropped ", out_of_step,
                                      " steps out of step, the first: \"", first, "\""));
    }
  }
  // Steps dropped over the receive capacity: the same on every rank (the call fails on all of
  // them), read from rank 0's log; in the before and after windows.
  int dropped = 0, dropped_before = 0, dropped_after = 0;
  int64_t last_dropped = -1;
  for (const absl::string_view line :
       absl::StrSplit(ReadFile(path("client-0.log")), '\n', absl::SkipEmpty())) {
    const auto parsed = ubep::example::ParseStepLine(line);
    if (!parsed || parsed->outcome != ubep::example::StepOutcome::kDroppedOverCapacity) continue;
    const uint64_t at = parsed->step;
    ++dropped;
    last_dropped = static_cast<int64_t>(at);
    if (before_end.has_value() && at < before_end_step) ++dropped_before;
    if (after_start.has_value() && at >= after_start_step) ++dropped_after;
  }
  // Of a correct run: the steps served were each equal to their reference; where some or all
  // were dropped over the receive capacity the summary says so, not "every step".
  const int served = steps - dropped;
  const std::string verdict = !correct        ? "NOT CORRECT"
                              : dropped == 0  ? "every step correct"
                              : served <= 0   ? "no step served"
                                              : "every served step correct";
  const double duration = absl::ToDoubleSeconds(ubep::MonotonicNow() - start);
  std::vector<double> before_layers, after_layers;
  const double imbalance_before =
      before_end ? MeanImbalance(*before_end, &before_layers) : std::nan("");
  const std::vector<std::vector<double>> after_counts =
      after_start ? Minus(counts, *after_start) : std::vector<std::vector<double>>{};
  const double imbalance_after =
      after_start ? MeanImbalance(after_counts, &after_layers) : std::nan("");

  nlohmann::json report = {
      {"ranks", R},
      {"daemons", K},
      {"steps", steps},
      {"policy", policy},
      {"imbalance_before", JsonNumber(imbalance_before)},
      {"imbalance_after", JsonNumber(imbalance_after)},
      {"imbalance_before_per_layer", before_layers},
      {"imbalance_after_per_layer", after_layers},
      // Counters read from the exposition as doubles; they are counts.
      {"rebalances", std::llround(committed)},
      {"migrated_slots", std::llround(migrated)},
      {"plan_version", std::llround(version)},
      {"correct", correct},
      {"interrupted", interrupted.load()},
      {"dispatch_p50_us", JsonNumber(dispatch_p50 * 1e6)},
      {"combine_p50_us", JsonNumber(combine_p50 * 1e6)},
      {"duration_seconds", duration},
      {"max_recv_rows", absl::GetFlag(FLAGS_max_recv_rows)},
      // Steps dropped because a rank was routed more rows than max_recv_rows: in all, and
      // in the before window (steps [0, before_end_step)) and the after window (from
      // after_start_step on); null where the run has no such window.
      {"dropped_steps", dropped},
      // Steps every rank ran and checked: null where the run was interrupted.
      {"served_steps", interrupted.load() ? nlohmann::json() : nlohmann::json(served)},
      {"dropped_steps_before", before_end ? nlohmann::json(dropped_before) : nlohmann::json()},
      {"dropped_steps_after", after_start ? nlohmann::json(dropped_after) : nlohmann::json()},
      {"last_dropped_step", last_dropped},  // -1: none.
      {"before_end_step", before_end ? nlohmann::json(before_end_step) : nlohmann::json()},
      {"after_start_step", after_start ? nlohmann::json(after_start_step) : nlohmann::json()},
  };
  nlohmann::json series = nlohmann::json::array();
  for (const Sample& s : samples) {
    series.push_back({{"seconds", s.seconds}, {"step", s.step}, {"plan_version", std::llround(s.version)},
                      {"imbalance", JsonNumber(s.measured)}});
  }
  report["samples"] = series;
  if (!problems.empty()) report["problems"] = problems;
  auto fmt = [](double v) { return std::isfinite(v) ? absl::StrFormat("%.3f", v) : std::string("-"); };
  // The picture: per-rank load over the mean before and after, and imbalance over time; made
  // first, as the report names it only when this run made it (a picture an earlier run left in
  // the directory is removed, not shown as this run's).
  bool report_written = true;
  const std::string picture = report_dir + "/report.png";
  std::error_code not_there;
  std::filesystem::remove(picture, not_there);
  std::string no_picture;
  if (!before_end || !after_start) {
    no_picture = policy == "none" ? "the run ended before its last third"
                 : !first_commit  ? "no plan was committed, so there is no after window"
                                  : "the run ended within three intervals (--interval) of the "
                                    "first commit, so there is no after window";
  } else {
    WriteHeat(path("heat_before.dat"), *before_end);
    WriteHeat(path("heat_after.dat"), after_counts);
    // The balancer's measured imbalance over time, where it measured any (a short run may
    // end before its first interval closes): else two panels, not an empty third.
    bool measured_any = false;
    {
      std::ofstream ts(path("imbalance.dat"));
      for (const Sample& s : samples) {
        if (!std::isfinite(s.measured)) continue;
        ts << s.seconds << " " << s.measured << " " << s.version << "\n";
        measured_any = true;
      }
    }
    std::ofstream gp(path("report.gp"));
    gp << "set terminal png size " << (measured_any ? 1400 : 940) << ",500 font ',10'\n"
       << "set output '" << picture << "'\n"
       << "set multiplot layout 1," << (measured_any ? 3 : 2) << " title 'ubep-local: " << R
       << " ranks, " << K << " daemons, policy " << policy << "'\n"
       << "set palette defined (0 'white', 1 'orange', 2 'red', 3 'dark-red')\n"
       << "set cbrange [0:3]\nset xlabel 'rank'\nset ylabel 'MoE layer'\n"
       << "set xtics 1\nset ytics 1\nset xrange [-0.5:" << R - 0.5 << "]\nset yrange [-0.5:"
       << layers - 0.5 << "]\n"
       << "set title 'load / mean, before (imbalance " << fmt(imbalance_before) << ")'\n"
       << "plot '" << path("heat_before.dat") << "' matrix with image notitle\n"
       << "set title 'load / mean, after (imbalance " << fmt(imbalance_after) << ")'\n"
       << "plot '" << path("heat_after.dat") << "' matrix with image notitle\n";
    if (measured_any) {
      gp << "unset cbrange\nset xtics autofreq\nset ytics autofreq\nset xrange [*:*]\n"
         << "set xlabel 'seconds'\nset ylabel 'imbalance (max/mean)'\n"
         << "set title 'measured imbalance over time'\nset yrange [1:*]\n"
         << "plot '" << path("imbalance.dat") << "' using 1:2 with lines lw 2 title 'imbalance'\n";
    }
    gp << "unset multiplot\n";
    gp.close();
    // A child like the others (not system(), under which a Ctrl-C would reach gnuplot alone and
    // the run would report gnuplot failed), found on PATH by the shell, bounded in time.
    // (A run Ctrl-C stopped is plotted all the same; a Ctrl-C while plotting stops gnuplot.)
    const bool interrupted_before = interrupted.load();
    auto stop_asked = [&] { return interrupted.load() && !interrupted_before; };
    ubep::Process gnuplot({"/bin/sh", "-c", "exec gnuplot \"$0\"", path("report.gp")},
                          path("gnuplot.log"));
    const absl::Time plot_deadline = ubep::MonotonicNow() + absl::Seconds(60);
    std::optional<int> plotted = gnuplot.Wait(absl::ZeroDuration());
    while (!plotted.has_value() && !stop_asked() && ubep::MonotonicNow() < plot_deadline) {
      plotted = gnuplot.Wait(absl::Milliseconds(50));
    }
    if (!plotted.has_value()) {
      gnuplot.Signal(SIGKILL);
      gnuplot.Wait(absl::Seconds(10));
    }
    if (plotted != 0 || !std::filesystem::exists(picture)) {
      std::filesystem::remove(picture, not_there);
      if (stop_asked()) {
        no_picture = "interrupted while plotting";  // Said, and not a failure of the report.
      } else {
        no_picture = plotted.has_value() ? "gnuplot failed" : "gnuplot did not finish within 60s";
        std::cerr << "ubep-local: " << no_picture
                  << (plotted.has_value() ? " (is gnuplot installed?): " : ": ")
                  << ReadFile(path("gnuplot.log")) << "\n";
        report_written = false;
      }
    }
  }
  report["picture"] = no_picture.empty() ? nlohmann::json("report.png") : nlohmann::json(nullptr);
  report["interrupted"] = interrupted.load();  // A Ctrl-C while plotting too.

  std::ostringstream md;
  md << "# ubep-local report\n\n"
     << R << " ranks on " << K << " daemons (host backend), " << steps << " steps, policy `"
     << policy << "`, " << absl::StrFormat("%.1f", duration) << " s.\n\n"
     << "| what | value |\n|---|---|\n"
     << "| imbalance before (max/mean rank load, mean over the layers calls reached, from the "
        "daemons' counters) | "
     << fmt(imbalance_before) << " |\n"
     << "| imbalance after | " << fmt(imbalance_after) << " |\n"
     << "| rebalances committed | " << std::llround(committed) << " |\n"
     << "| slots migrated | " << std::llround(migrated) << " |\n"
     << "| dispatch p50 / combine p50 (per layer call, from the daemons' histograms) | "
     << (std::isfinite(dispatch_p50) && std::isfinite(combine_p50)
             ? absl::StrFormat("%.0f us / %.0f us", dispatch_p50 * 1e6, combine_p50 * 1e6)
             : std::string("-"))
     << " |\n"
     << "| every step equal to its float64 reference | "
     << (correct ? (dropped == 0   ? std::string("yes")
                    : served <= 0  ? std::string("no step served (each was dropped over the "
                                                 "receive capacity)")
                                   : absl::StrCat("yes, the ", served, " served"))
                 : problems.empty() ? std::string("NO")
                                    : absl::StrCat("NO: ", absl::StrJoin(problems, "; ")))
     << " |\n"
     << "| steps dropped over the receive capacity (--max_recv_rows "
     << absl::GetFlag(FLAGS_max_recv_rows) << "), all / before ("
     << (before_end ? absl::StrCat("steps < ", before_end_step) : "no window") << ") / after ("
     << (after_start ? absl::StrCat("steps >= ", after_start_step) : "no window") << ") | "
     << dropped << " / " << (before_end ? absl::StrCat(dropped_before) : "-") << " / "
     << (after_start ? absl::StrCat(dropped_after) : "-") << " |\n"
     << "| last step dropped | "
     << (last_dropped < 0 ? std::string("-") : absl::StrCat(last_dropped)) << " |\n\n"
     << "Before: "
     << (policy == "none" ? "the first third of the run"
         : first_commit   ? "under plan v1, up to the first commit"
                          : "under plan v1, the whole run (no plan was committed)")
     << ". After: "
     << (policy == "none"  ? "the last third"
         : after_start     ? "from three intervals after the first commit to the end"
         : !first_commit   ? "none"
                           : "none (the run ended within three intervals of the first commit)")
     << ".\n\n"
     << (no_picture.empty() ? std::string("![per-rank load and imbalance](report.png)")
                            : absl::StrCat("No picture: ", no_picture, "."))
     << "\n";
  for (const auto& [name, text] : {std::pair<const char*, std::string>{"report.json", report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"},
                                   {"report.md", md.str()}}) {
    if (absl::Status st = ubep::balancer::WriteTextFile(report_dir + "/" + name, text); !st.ok()) {
      std::cerr << "ubep-local: " << st.message() << "\n";
      report_written = false;
    }
  }
  std::cout << absl::StrFormat(
      "ubep-local: imbalance %s -> %s, %.0f rebalances, %.0f slots migrated, dispatch+combine "
      "p50 %s us, %s%s\n  report: %s/report.md, report.json%s\n",
      fmt(imbalance_before), fmt(imbalance_after), committed, migrated,
      std::isfinite(dispatch_p50 + combine_p50)
          ? absl::StrFormat("%.0f", (dispatch_p50 + combine_p50) * 1e6)
          : std::string("-"), verdict,
      dropped == 0 ? std::string()
                   : absl::StrFormat(", %d steps dropped over the receive capacity (%s before, "
                                     "%s after, the last at step %d)",
                                     dropped, before_end ? absl::StrCat(dropped_before) : "-",
                                     after_start ? absl::StrCat(dropped_after) : "-",
                                     last_dropped),
      report_dir, no_picture.empty() ? ", report.png" : absl::StrCat(" (no picture: ", no_picture, ")"));
  if (!correct && !interrupted.load()) {
    exit_code = 1;
    std::cerr << "ubep-local: " << absl::StrJoin(problems, "; ") << "; logs kept in " << workdir << "\n";
  } else if (!report_written) {
    exit_code = 1;
    std::cerr << "ubep-local: the report is incomplete; logs kept in " << workdir << "\n";
  } else if (!absl::GetFlag(FLAGS_keep_workdir)) {
    std::filesystem::remove_all(workdir);
  }
  return interrupted.load() ? 130 : exit_code;
}

}  // namespace

// An exception past the start (out of memory, a file it cannot read) unwinds Run, whose
// Processes kill what they started: nothing is left running.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "ubep-local: " << e.what() << "\n";
    return 1;
  }
}
