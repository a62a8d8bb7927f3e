// ubep-balancer: the UBEP control plane. Flags are parsed here into BalancerOptions.
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "balancer/formats/json_formats.h"
#include "balancer/server/balancer.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/timeout.h"
#include "common/rpc_origin.h"
#include "common/shape_limits.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "nlohmann/json.hpp"
#include "prometheus/exposer.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070", "HOST:PORT of the Control service (port 0 picks one).");
ABSL_FLAG(std::string, metrics, "127.0.0.1:9465", "HOST:PORT of /metrics; empty = off.");
ABSL_FLAG(std::string, policy, "ubep", "Placement policy: ubep, eplb or eplb-global.");
ABSL_FLAG(double, threshold, 1.10,
          "Per-layer imbalance (max/mean rank load) that calls for a new plan: the mean over the "
          "layers calls reached, or, while calls go over a receive capacity, the worst layer.");
ABSL_FLAG(int, trigger_windows, 3, "Intervals in a row above the threshold before re-planning.");
ABSL_FLAG(int, window, 10, "Intervals in the sliding load window.");
ABSL_FLAG(double, ewma, 0, "When in (0, 1]: an EWMA of the intervals with this weight instead.");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(1), "Loop tick and window interval.");
ABSL_FLAG(absl::Duration, report_interval, absl::Seconds(1), "How often daemons report load.");
ABSL_FLAG(absl::Duration, health_interval, absl::Seconds(1), "Daemon health check period.");
ABSL_FLAG(int, health_failures, 3, "Failed health checks in a row that mark a daemon down.");
ABSL_FLAG(absl::Duration, rpc_timeout, absl::Seconds(5), "Deadline of Prepare, Commit, Abort, GetState.");
ABSL_FLAG(absl::Duration, effective_margin, absl::Seconds(1),
          "A new plan takes effect this far ahead of the ranks' estimated step.");
ABSL_FLAG(int64_t, min_margin_steps, 10, "... and at least this many steps ahead.");
ABSL_FLAG(int, migration_budget, -1,
          "Changed slots per rank and layer per plan, at most the daemons' free weight buffers "
          "(-1: as many as those).");
ABSL_FLAG(absl::Duration, recovery_grace, absl::Seconds(3),
          "After a restart, wait this long for daemons before aborting an undecided plan.");
ABSL_FLAG(absl::Duration, registration_grace, absl::Seconds(30),
          "Ranks of the plan no daemon registers for this long (while none is registered "
          "without a group) are excluded as down.");
ABSL_FLAG(bool, auto_rebalance, true, "Re-plan when the imbalance stays above the threshold.");
ABSL_FLAG(absl::Duration, pause_before_commit, absl::ZeroDuration(),
          "Fault injection for tests: sleep between Prepare and Commit.");
ABSL_FLAG(int, planner_threads, 0, "Threads planning chunks of layers at once; 0 = the CPUs this process may run on.");
ABSL_FLAG(std::string, ready_file, "", "Written once serving: JSON with the bound ports.");

int main(int argc, char** argv) {
  ubep::SetFlagsUsage("ubep-balancer",
      "gathers expert load from every ubepd, re-plans expert placement and "
      "commits plans at a step boundary.\nUsage: ubep-balancer --listen HOST:PORT [--metrics HOST:PORT]");
  absl::ParseCommandLine(argc, argv);
  ubep::balancer::BalancerOptions o;
  absl::StatusOr<ubep::balancer::Policy> policy = ubep::balancer::ParsePolicy(absl::GetFlag(FLAGS_policy));
  if (!policy.ok()) {
    std::cerr << "ubep-balancer: --policy: " << policy.status().message() << "\n";
    return 2;
  }
  o.policy = *policy;
  o.threshold = absl::GetFlag(FLAGS_threshold);
  o.trigger_windows = absl::GetFlag(FLAGS_trigger_windows);
  o.window_intervals = absl::GetFlag(FLAGS_window);
  o.ewma_alpha = absl::GetFlag(FLAGS_ewma);
  o.interval = absl::GetFlag(FLAGS_interval);
  o.report_interval = absl::GetFlag(FLAGS_report_interval);
  o.health_interval = absl::GetFlag(FLAGS_health_interval);
  o.health_failures = absl::GetFlag(FLAGS_health_failures);
  o.rpc_timeout = absl::GetFlag(FLAGS_rpc_timeout);
  o.effective_margin = absl::GetFlag(FLAGS_effective_margin);
  o.min_margin_steps = absl::GetFlag(FLAGS_min_margin_steps);
  o.migration_budget = absl::GetFlag(FLAGS_migration_budget);
  o.recovery_grace = absl::GetFlag(FLAGS_recovery_grace);
  o.registration_grace = absl::GetFlag(FLAGS_registration_grace);
  o.auto_rebalance = absl::GetFlag(FLAGS_auto_rebalance);
  o.pause_before_commit = absl::GetFlag(FLAGS_pause_before_commit);
  o.planner_threads = absl::GetFlag(FLAGS_planner_threads);
  for (const auto& [name, value] : {std::pair{"interval", o.interval},
                                    std::pair{"report_interval", o.report_interval},
                                    std::pair{"health_interval", o.health_interval},
                                    std::pair{"rpc_timeout", o.rpc_timeout}}) {
    if (value <= absl::ZeroDuration()) {
      std::cerr << "ubep-balancer: --" << name << " " << absl::FormatDuration(value)
                << " is not positive\n";
      return 2;
    }
  }
  for (const auto& [name, value] : {std::pair{"effective_margin", o.effective_margin},
                                    std::pair{"recovery_grace", o.recovery_grace},
                                    std::pair{"registration_grace", o.registration_grace},
                                    std::pair{"pause_before_commit", o.pause_before_commit}}) {
    if (value < absl::ZeroDuration()) {
      std::cerr << "ubep-balancer: --" << name << " " << absl::FormatDuration(value)
                << " is negative\n";
      return 2;
    }
  }
  // A wait without end (absl takes "inf"): every RPC, tick and grace is bounded.
  for (const auto& [name, value] : {std::pair{"interval", o.interval},
                                    std::pair{"report_interval", o.report_interval},
                                    std::pair{"health_interval", o.health_interval},
                                    std::pair{"rpc_timeout", o.rpc_timeout},
                                    std::pair{"effective_margin", o.effective_margin},
                                    std::pair{"recovery_grace", o.recovery_grace},
                                    std::pair{"registration_grace", o.registration_grace},
                                    std::pair{"pause_before_commit", o.pause_before_commit}}) {
    // absl takes "inf", and a million hours is as long (NeverEnds): every wait has an end.
    if (ubep::NeverEnds(value)) {
      std::cerr << "ubep-balancer: --" << name << " " << absl::FormatDuration(value)
                << " is not a time (every wait has an end: under " << ubep::kTimeoutBound
                << ")\n";
      return 2;
    }
  }
  if (o.migration_budget < -1) {
    std::cerr << "ubep-balancer: --migration_budget " << o.migration_budget
              << " is below -1 (-1: the daemons' free weight buffers)\n";
    return 2;
  }
  if (o.min_margin_steps < 0) {
    std::cerr << "ubep-balancer: --min_margin_steps " << o.min_margin_steps << " is negative\n";
    return 2;
  }
  // Written so that NaN fails too (--threshold=nan would turn the trigger off unseen).
  if (!(o.ewma_alpha >= 0 && o.ewma_alpha <= 1) || o.window_intervals < 1 ||
      o.trigger_windows < 1 || o.health_failures < 1 || !(o.threshold >= 1)) {
    std::cerr << "ubep-balancer: --ewma in [0, 1], --window, --trigger_windows and "
                 "--health_failures >= 1, --threshold >= 1\n";
    return 2;
  }

  // A ready file a balancer before this one left (killed, it removed nothing) goes before
  // anything starts: whoever waits for this balancer's must not take that one's port. (One
  // whose process still runs is left: the balancer holds no lock that says the path is its.)
  ubep::balancer::ReadyFile ready(absl::GetFlag(FLAGS_ready_file));
  if (absl::Status cleared = ready.ClearStale(ubep::balancer::ReadyFile::Holder::kWhoeverItNames);
      !cleared.ok()) {
    std::cerr << "ubep-balancer: --ready_file: " << cleared.message() << "\n";
    return 1;
  }

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto registry = std::make_shared<prometheus::Registry>();
  ubep::balancer::Balancer balancer(o, registry);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  // gRPC binds with SO_REUSEPORT by default: a second balancer on a port in use would share it
  // (each daemon and ubepctl then reaching either one) rather than fail to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(ubep::kMaxControlMessageBytes);
  builder.RegisterService(&balancer);
  // Its own errors are marked, so that a client tells "node-b is still being recovered"
  // (UNAVAILABLE, from the balancer) from a balancer it cannot reach.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> marks;
  marks.push_back(ubep::MarkOwnErrorsAs("ubep-balancer"));
  builder.experimental().SetInterceptorCreators(std::move(marks));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "ubep-balancer: cannot listen on " << listen << "\n";
    return 1;
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = 0;
  if (const std::string metrics = absl::GetFlag(FLAGS_metrics); !metrics.empty()) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(metrics);
    } catch (const std::exception& e) {
      std::cerr << "ubep-balancer: --metrics " << metrics << ": " << e.what() << "\n";
      return 1;
    }
    exposer->RegisterCollectable(registry);
    metrics_port = exposer->GetListeningPorts().front();
  }
  balancer.Start();
  UBEP_LOG(INFO) << "ubep-balancer serving on port " << port << ", metrics port " << metrics_port;
  if (absl::Status published =
          ready.Publish(nlohmann::json{{"pid", getpid()}, {"port", port}, {"metrics_port", metrics_port}}
                            .dump() +
                        "\n");
      !published.ok()) {
    // Whoever waits for it would wait in vain: said, and the balancer stops.
    std::cerr << "ubep-balancer: --ready_file: " << published.message() << "\n";
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    return 1;
  }
  int received = 0;
  sigwait(&signals, &received);
  ready.Withdraw();  // Gone with the balancer: a script must not read this one's port for the next's.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
