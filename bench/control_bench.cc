// ubep-bench-control: the control plane at CloudMatrix384 scale. A real ubep-balancer process
// on loopback; in this process, N simulated daemons (each a real gRPC server answering
// DaemonControl and health checks, registering and reporting per-slot load every second like
// ubepd, with loads drawn from a drifting mix of two bundled DeepSeek-V3 traces).
//
//   ubep-bench-control [--nodes 48] [--ranks-per-node 8] [--report-seconds 10]
//                      [--rebalances 20] [--json] [--ubep-balancer PATH]
//
// Phase 1 (reports only): the balancer's CPU time (utime + stime from /proc) over the
// reports it accepted = report_cpu_ms (health checks and its loop included). Phase 2
// (reports continue): --rebalances on-demand Rebalance calls; plan_ms = computing a plan for
// all ranks, commit_ms = Prepare sent to every daemon until every daemon committed (the
// simulated daemons copy no weights).
// JSON: {"nodes", "ranks_per_node", "ranks", "layers", "experts", "slots_per_rank",
//        "reports", "reports_rejected", "report_cpu_ms", "rebalances", "rebalance_errors",
//        "plan_samples", "commits", "commit_ms_p50", "commit_ms_p99", "plan_ms", "plan_ms_p99"}
// (reports and reports_rejected: phase 1's; plan_samples: the rebalances answered, which
// plan_ms is over.) Exit 1 when a figure would mislead: no report taken in phase 1, a report
// rejected there, a rebalance that failed, or no commit.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "balancer/core/plan.h"
#include "balancer/formats/json_formats.h"
#include "balancer/formats/proto_convert.h"
#include "common/percentile.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "ubep/v1/control.grpc.pb.h"

extern char** environ;

namespace ubep::bench {
namespace {

struct Config {
  int nodes = 48, ranks_per_node = 8, report_seconds = 10, rebalances = 20;
  std::string balancer = UBEP_BALANCER;
  bool json = false;
};

// One simulated ubepd: DaemonControl with no weights to copy, and its plan for reporting.
class SimulatedDaemon final : public v1::DaemonControl::Service {
 public:
  SimulatedDaemon(std::string name, std::vector<uint32_t> ranks, const v1::Plan& plan)
      : name_(std::move(name)), ranks_(std::move(ranks)), committed_(plan) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    // 48 servers share this process's 2 cores: one poller each, as one daemon per machine
    // would have the machine to itself.
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 2);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~SimulatedDaemon() override { server_->Shutdown(std::chrono::system_clock::now()); }

  grpc::Status Prepare(grpc::ServerContext*, const v1::PrepareRequest* request,
                       v1::PrepareResponse* response) override {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = request->plan();
    response->set_prepared(true);
    return grpc::Status::OK;
  }
  grpc::Status Commit(grpc::ServerContext*, const v1::CommitRequest* request,
                      v1::CommitResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.version() == request->version()) committed_ = pending_;
    return grpc::Status::OK;
  }
  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest*, v1::AbortResponse*) override {
    return grpc::Status::OK;
  }
  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::DaemonState* state) override {
    std::lock_guard<std::mutex> lock(mu_);
    state->set_node(name_);
    state->set_committed_version(committed_.version());
    state->set_plan_in_force(true);
    *state->mutable_committed_plan() = committed_;
    return grpc::Status::OK;
  }

  int port() const { return port_; }
  const std::string& name() const { return name_; }
  const std::vector<uint32_t>& ranks() const { return ranks_; }
  v1::Plan committed() {
    std::lock_guard<std::mutex> lock(mu_);
    return committed_;
  }

 private:
  std::string name_;
  std::vector<uint32_t> ranks_;
  std::mutex mu_;
  v1::Plan committed_, pending_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

uint64_t ProcessCpuTicks(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = content.rfind(')');
  std::istringstream fields(content.substr(close + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return utime + stime;
}

int Run(const Config& c) {
  const int R = c.nodes * c.ranks_per_node;
  absl::StatusOr<balancer::LoadMatrix> decode = balancer::ReadSglangLoadFile(
      std::string(UBEP_SOURCE_DIR) + "/data/traces/deepseek-v3/decode_in1000out1000.json");
  absl::StatusOr<balancer::LoadMatrix> prefill = balancer::ReadSglangLoadFile(
      std::string(UBEP_SOURCE_DIR) + "/data/traces/deepseek-v3/prefill_in1024.json");
  if (!decode.ok() || !prefill.ok()) {
    std::cerr << "ubep-bench-control: cannot read the bundled traces\n";
    return 1;
  }
  const int L = decode->num_layers(), E = decode->num_experts();
  // DeepSeek-V3 on 384 ranks: one slot per rank (256 experts, 128 redundant).
  const int S = std::max(1, static_cast<int>(std::ceil(E * 1.125 / R)));
  balancer::Plan initial;
  initial.version = 1;
  initial.topology = {R, c.nodes, S, 1};
  initial.num_experts = E;
  initial.layer_ids = decode->layer_ids();
  for (int l = 0; l < L; ++l) {
    balancer::LayerPlan layer;
    for (int p = 0; p < R * S; ++p) layer.slot_expert.push_back(p % E);
    balancer::SetEqualShares(E, layer);
    initial.layers.push_back(layer);
  }
  const v1::Plan initial_proto = balancer::ToProto(initial);

  // The balancer process.
  char dir_template[] = "/tmp/ubep-bench-control-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string ready = dir + "/ready.json", log = dir + "/balancer.log";
  std::vector<std::string> argv = {c.balancer, "--listen=127.0.0.1:0", "--metrics=",
                                   "--ready_file=" + ready, "--auto_rebalance=false",
                                   "--effective_margin=100ms", "--min_margin_steps=1",
                                   "--health_interval=1s", "--interval=1s"};
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  pid_t pid = -1;
  posix_spawn(&pid, c.balancer.c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  for (int i = 0; i < 3000 && !std::filesystem::exists(ready); ++i) absl::SleepFor(absl::Milliseconds(10));
  if (pid <= 0 || !std::filesystem::exists(ready)) {
    std::cerr << "ubep-bench-control: ubep-balancer did not start (" << c.balancer
              << "; its log: " << log << ")\n";
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    return 1;
  }
  std::ifstream ready_in(ready);
  const int port = nlohmann::json::parse(ready_in)["port"].get<int>();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto control = v1::Control::NewStub(channel);

  grpc::EnableDefaultHealthCheckService(true);
  std::vector<std::unique_ptr<SimulatedDaemon>> daemons;
  for (int n = 0; n < c.nodes; ++n) {
    std::vector<uint32_t> ranks;
    for (int r = 0; r < c.ranks_per_node; ++r) ranks.push_back(n * c.ranks_per_node + r);
    daemons.push_back(std::make_unique<SimulatedDaemon>(absl::StrCat("node-", n), ranks, initial_proto));
    v1::RegisterRequest reg;
    reg.set_node(daemons.back()->name());
    reg.set_address(absl::StrCat("127.0.0.1:", daemons.back()->port()));
    for (uint32_t r : ranks) reg.add_ranks(r);
    reg.set_world_size(R);
    reg.set_free_buffers(2);
    v1::ModelShape* shape = reg.mutable_shape();
    shape->set_num_layers(L);
    shape->set_num_experts(E);
    shape->set_hidden(7168);
    shape->set_top_k(8);
    shape->set_max_tokens(128);
    shape->set_slots_per_rank(S);
    grpc::ClientContext context;
    v1::RegisterResponse response;
    if (!control->Register(&context, reg, &response).ok()) {
      std::cerr << "ubep-bench-control: register failed\n";
      kill(pid, SIGKILL);
      return 1;
    }
  }

  // Reporters: every daemon reports once a second; the mix of the two traces drifts.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> accepted{0}, rejected{0}, step{0};
  int report_errors = 0;  // Printed: the first 3.
  std::thread reporter([&] {
    uint64_t seq = 0;
    const absl::Time start = absl::Now();
    while (!stop.load()) {
      const absl::Time round = absl::Now();
      ++seq;
      const double t = absl::ToDoubleSeconds(round - start);
      const double mix = 0.5 + 0.5 * std::cos(t / 20.0);
      step += 100;  // 100 steps per second.
      for (auto& d : daemons) {
        const v1::Plan plan = d->committed();
        v1::ReportLoadRequest q;
        q.set_node(d->name());
        q.set_seq(seq);
        q.set_max_step(step);
        q.set_plan_in_force(true);  // Simulated ranks run every committed plan at once.
        v1::LoadReport* load = q.mutable_load();
        load->set_reporter(d->name());
        load->set_plan_version(plan.version());
        load->set_num_experts(E);
        load->set_first_step(step - 100);
        load->set_last_step(step - 1);
        for (int l = 0; l < L; ++l) {
          v1::LayerLoad* layer = load->add_layers();
          layer->set_layer(static_cast<uint32_t>(decode->layer_ids()[l]));
          const v1::LayerPlan& lp = plan.layers(l);
          const int first = static_cast<int>(d->ranks().front()) * S;
          const int end = static_cast<int>(d->ranks().back() + 1) * S;
          layer->set_first_slot(static_cast<uint32_t>(first));
          for (int p = first; p < end; ++p) {
            const int e = static_cast<int>(lp.slot_expert(p));
            double share = 0;
            if (lp.slot_share_size() > p) {  // Compact form (what the balancer sends).
              share = lp.slot_share(p);
            } else {
              for (const v1::Replica& replica : lp.experts(e).replicas()) {
                if (replica.slot() == static_cast<uint32_t>(p)) share = replica.share();
              }
            }
            const double w = mix * decode->at(l, e) + (1 - mix) * prefill->at(l, e);
            layer->add_slot(static_cast<uint64_t>(w * share / 10.0));
          }
        }
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
        v1::ReportLoadResponse response;
        const grpc::Status status = control->ReportLoad(&context, q, &response);
        if (status.ok()) {
          ++accepted;
        } else {
          ++rejected;
          if (seq > 3 && ++report_errors <= 3) {
            std::cerr << "ubep-bench-control: report rejected: " << status.error_message() << "\n";
          }
        }
      }
      absl::SleepFor(absl::Seconds(1) - (absl::Now() - round));
    }
  });

  // Phase 1: reports only.
  absl::SleepFor(absl::Seconds(2));  // The balancer learns the plan (GetState) first.
  const uint64_t reports_before = accepted.load(), rejected_before = rejected.load();
  const uint64_t ticks_before = ProcessCpuTicks(pid);
  absl::SleepFor(absl::Seconds(c.report_seconds));
  const uint64_t ticks_after = ProcessCpuTicks(pid);
  const uint64_t reports = accepted.load() - reports_before;
  const uint64_t reports_rejected = rejected.load() - rejected_before;
  // Per report taken; none taken, no figure (the CPU of rejections is not a report's cost).
  const double report_cpu_ms = static_cast<double>(ticks_after - ticks_before) * 1000.0 /
                               static_cast<double>(sysconf(_SC_CLK_TCK)) /
                               static_cast<double>(std::max<uint64_t>(reports, 1));

  // Phase 2: rebalances on demand.
  std::vector<double> commit_ms, plan_ms;
  int commits = 0, rebalance_errors = 0;
  for (int i = 0; i < c.rebalances; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RebalanceResponse response;
    const grpc::Status status = control->Rebalance(&context, v1::RebalanceRequest(), &response);
    if (!status.ok()) {
      ++rebalance_errors;
      std::cerr << "ubep-bench-control: rebalance " << i << ": " << status.error_message() << "\n";
    } else {
      plan_ms.push_back(response.plan_seconds() * 1e3);
      if (response.changed()) {
        ++commits;
        commit_ms.push_back(response.commit_seconds() * 1e3);
      }
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
  stop = true;
  reporter.join();
  kill(pid, SIGTERM);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  if (std::getenv("UBEP_BENCH_KEEP_LOG") != nullptr) {
    std::cerr << ReadAll(log);
  }
  std::filesystem::remove_all(dir);

  nlohmann::json out = {{"nodes", c.nodes},
                        {"ranks_per_node", c.ranks_per_node},
                        {"ranks", R},
                        {"layers", L},
                        {"experts", E},
                        {"slots_per_rank", S},
                        {"reports", reports},
                        {"reports_rejected", reports_rejected},
                        {"report_cpu_ms",
                         reports > 0 ? nlohmann::json(report_cpu_ms) : nlohmann::json()},
                        {"rebalances", c.rebalances},
                        {"rebalance_errors", rebalance_errors},
                        {"plan_samples", plan_ms.size()},
                        {"commits", commits},
                        // No commit, no commit latency (null, not a 0 that reads as fast).
                        {"commit_ms_p50", commits > 0 ? nlohmann::json(Percentile(commit_ms, 0.5))
                                                      : nlohmann::json()},
                        {"commit_ms_p99", commits > 0 ? nlohmann::json(Percentile(commit_ms, 0.99))
                                                      : nlohmann::json()},
                        {"plan_ms", plan_ms.empty() ? nlohmann::json()
                                                    : nlohmann::json(Percentile(plan_ms, 0.5))},
                        {"plan_ms_p99", plan_ms.empty()
                                            ? nlohmann::json()
                                            : nlohmann::json(Percentile(plan_ms, 0.99))}};
  if (c.json) {
    std::cout << out.dump(1) << "\n";
  } else {
    // Latencies only where something was measured (a 0 would read as fast).
    auto latency = [](const std::vector<double>& ms) {
      return ms.empty() ? std::string("none measured")
                        : absl::StrFormat("p50 %.1f ms, p99 %.1f ms", Percentile(ms, 0.5),
                                          Percentile(ms, 0.99));
    };
    std::cout << absl::StrFormat(
        "%d nodes x %d ranks (%d layers x %d experts, %d slot(s) per rank)\n"
        "report cpu: %s per report (%d reports, %d rejected)\n"
        "plan: %s (%d of %d rebalances answered)\ncommit: %s (%d commits)\n",
        c.nodes, c.ranks_per_node, L, E, S,
        reports > 0 ? absl::StrFormat("%.3f ms", report_cpu_ms) : std::string("none measured"),
        static_cast<int>(reports), static_cast<int>(reports_rejected), latency(plan_ms),
        static_cast<int>(plan_ms.size()), c.rebalances, latency(commit_ms), commits);
  }
  if (reports == 0 || reports_rejected > 0) {
    std::cerr << "ubep-bench-control: " << reports << " reports taken and " << reports_rejected
              << " rejected while the report cost was measured; the figure would not be a "
                 "report's cost\n";
    return 1;
  }
  if (rebalance_errors > 0) {
    std::cerr << "ubep-bench-control: " << rebalance_errors << " of " << c.rebalances
              << " rebalances failed; the plan and commit figures are over the others only\n";
    return 1;
  }
  if (commits == 0) {
    std::cerr << "ubep-bench-control: no rebalance committed a new plan; the commit latency "
                 "was not measured\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace ubep::bench

int main(int argc, char** argv) {
  ubep::bench::Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&](int& out) {
      if (i + 1 >= argc) return false;
      out = std::atoi(argv[++i]);
      return out > 0;
    };
    bool ok = true;
    if (flag == "--json") {
      c.json = true;
    } else if (flag == "--nodes") {
      ok = value(c.nodes);
    } else if (flag == "--ranks-per-node") {
      ok = value(c.ranks_per_node);
    } else if (flag == "--report-seconds") {
      ok = value(c.report_seconds);
    } else if (flag == "--rebalances") {
      ok = value(c.rebalances);
    } else if (flag == "--ubep-balancer" && i + 1 < argc) {
      c.balancer = argv[++i];
    } else {
      ok = false;
    }
    if (!ok) {
      std::cerr << "usage: ubep-bench-control [--nodes N] [--ranks-per-node M] "
                   "[--report-seconds T] [--rebalances K] [--json] [--ubep-balancer PATH]\n";
      return 2;
    }
  }
  return ubep::bench::Run(c);
}
