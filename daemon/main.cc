// ubepd: the UBEP node daemon. Flags are parsed here into DaemonOptions; an operator may keep
// them in a file and pass --flagfile=FILE (one --flag=value per line).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/timeout.h"
#include "common/shape_limits.h"
#include "balancer/formats/json_formats.h"
#include "daemon/daemon.h"
#include "kernels/common/host_cpu.h"

ABSL_FLAG(std::string, backend, "host", "Arena backend: host (memfd shared memory) or cuda.");
ABSL_FLAG(std::string, socket, "/run/ubep/ubepd.sock",
          "Unix socket for the node's serving processes (the fd socket is PATH.fds).");
ABSL_FLAG(std::string, socket_mode, "0660", "File mode of the Unix sockets (octal).");
ABSL_FLAG(std::string, listen, "", "HOST:PORT for gRPC from peers and the balancer; empty = off.");
ABSL_FLAG(std::string, metrics, "127.0.0.1:9464",
          "HOST:PORT of the Prometheus exposition (/metrics); empty = off.");
ABSL_FLAG(std::string, plan, "",
          "Static plan (EPLB or ubep-balance plan JSON); empty = round-robin placement.");
ABSL_FLAG(std::string, protocol, "ubep", "Data-plane protocol: ubep or bsp.");
ABSL_FLAG(int, flagged_tokens, 0,
          "ubep: calls of at most this many tokens per rank store their rows (and get their "
          "partials back) as flag-in-granule rows; capped at the shape's max_tokens; 0 = never.");
ABSL_FLAG(int, max_recv_rows, 0,
          "Rows (routed token-expert pairs) one dispatch may lay out on a rank, which sizes the "
          "CUDA backend's receive buffers; a call that routes a rank more fails on every rank "
          "(ResourceExhausted) and the group goes on; 0 = as many as can come.");
ABSL_FLAG(absl::Duration, wait_timeout, absl::Seconds(10),
          "Every data-plane wait gives up after this and names the peer it waited for.");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(60),
          "Longest a rank waits in Join for the rest of its group.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(10),
          "On SIGTERM, how long to wait for clients to detach before exiting.");
ABSL_FLAG(absl::Duration, harvest_interval, absl::Seconds(1),
          "How often the load counters are read.");
ABSL_FLAG(int, free_buffers, 2, "Expert weight buffers per layer beyond the slots (migration).");
ABSL_FLAG(uint64_t, max_plan_lead_steps, 1'000'000,
          "A plan whose effective step is further ahead of the group's furthest rank is refused "
          "(a balancer's step estimate gone wrong); 0 = no bound.");
ABSL_FLAG(uint64_t, max_arena_bytes, uint64_t{16} << 30, "Largest arena per rank, in bytes.");
ABSL_FLAG(std::string, balancer, "", "HOST:PORT of ubep-balancer; empty = standalone (static plan).");
ABSL_FLAG(std::string, node, "", "This node's name for the balancer; empty = the hostname.");
ABSL_FLAG(std::string, advertise, "",
          "HOST:PORT the balancer reaches this daemon at; empty = --listen's host and port.");
ABSL_FLAG(std::string, ranks, "",
          "The EP ranks this daemon hosts, FIRST-LAST (e.g. 4-7); empty = every rank of the "
          "group. The other ranks' daemons (same machine) are found through --balancer.");
ABSL_FLAG(uint32_t, domain, 0, "Load/store domain of this node's ranks.");
ABSL_FLAG(int32_t, max_message_bytes, ubep::kMaxControlMessageBytes,
          "Larger gRPC requests are refused (RESOURCE_EXHAUSTED); a plan's Prepare grows with "
          "layers x slots.");
ABSL_FLAG(absl::Duration, report_interval, absl::Seconds(1),
          "How often load is reported to the balancer (the balancer may ask otherwise).");
ABSL_FLAG(std::string, ready_file, "",
          "When set, written once serving: JSON with the bound ports (for scripts and tests).");

namespace {

// ubepd keeps an fd for every arena of its group (every rank's, which it hands to its
// clients; two per rank on CUDA) beside its sockets and connections: past about a thousand
// ranks the usual soft open-files limit, 1024, runs out. It raises its soft limit to the hard
// one, which is what the operator allows (capped at 2^20, the kernel's usual most).
void RaiseOpenFilesLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t wanted = std::min<rlim_t>(limit.rlim_max, rlim_t{1} << 20);
  if (limit.rlim_cur >= wanted) return;
  const rlim_t was = limit.rlim_cur;
  limit.rlim_cur = wanted;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    UBEP_LOG(WARNING) << "the open-files limit stays " << was << " (raising it to " << wanted
                      << " failed: " << std::strerror(errno) << ")";
    return;
  }
  UBEP_LOG(INFO) << "open-files limit raised from " << was << " to " << wanted;
}

}  // namespace

int main(int argc, char** argv) {
  ubep::SetFlagsUsage("ubepd",
      "the UBEP node daemon. Owns the arenas of its node's ranks and serves them to "
      "serving processes (libubep).\nUsage: ubepd --socket PATH [--listen HOST:PORT] "
      "[--metrics HOST:PORT] [--plan FILE] [--backend host|cuda]");
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    // (`ubepd /tmp/u.sock` would otherwise serve the default socket.)
    std::cerr << "ubepd: unexpected argument \"" << rest[1]
              << "\" (every setting is a flag: --socket=PATH)\n";
    return 2;
  }
  ubep::kernels::RequireHostCpu("ubepd");

  ubep::daemon::DaemonOptions options;
  options.backend = absl::GetFlag(FLAGS_backend);
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics = absl::GetFlag(FLAGS_metrics);
  for (const auto& [name, address] :
       {std::pair{"listen", options.listen}, std::pair{"metrics", options.metrics}}) {
    // HOST:PORT, the port all digits: a bare port would be every interface to the metrics
    // server (it takes "9464" so), and the HTTP server takes lists and suffixes too.
    const size_t colon = address.rfind(':');
    const std::string port = colon == std::string::npos ? "" : address.substr(colon + 1);
    int number = 0;
    if (!address.empty() &&
        (colon == 0 || colon == std::string::npos || port.empty() ||
         port.find_first_not_of("0123456789") != std::string::npos ||
         !absl::SimpleAtoi(port, &number) || number > 65535)) {
      std::cerr << "ubepd: --" << name << " " << address
                << " is not HOST:PORT (e.g. 127.0.0.1:9464; 0.0.0.0:PORT for every interface)\n";
      return 2;
    }
  }
  options.harvest_interval = absl::GetFlag(FLAGS_harvest_interval);
  options.balancer = absl::GetFlag(FLAGS_balancer);
  options.node_name = absl::GetFlag(FLAGS_node);
  options.advertise = absl::GetFlag(FLAGS_advertise);
  options.domain = absl::GetFlag(FLAGS_domain);
  options.report_interval = absl::GetFlag(FLAGS_report_interval);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  for (const auto& [name, value] : {std::pair{"harvest_interval", options.harvest_interval},
                                    std::pair{"report_interval", options.report_interval},
                                    std::pair{"wait_timeout", absl::GetFlag(FLAGS_wait_timeout)},
                                    std::pair{"join_timeout", absl::GetFlag(FLAGS_join_timeout)}}) {
    if (value <= absl::ZeroDuration()) {
      std::cerr << "ubepd: --" << name << " " << absl::FormatDuration(value)
                << " is not positive\n";
      return 2;
    }
  }
  for (const auto& [name, value] :
       {std::pair{"harvest_interval", options.harvest_interval},
        std::pair{"report_interval", options.report_interval},
        std::pair{"wait_timeout", absl::GetFlag(FLAGS_wait_timeout)},
        std::pair{"join_timeout", absl::GetFlag(FLAGS_join_timeout)},
        std::pair{"drain_timeout", absl::GetFlag(FLAGS_drain_timeout)}}) {
    // absl takes "inf", and a million hours is as long (NeverEnds): every wait has an end.
    if (ubep::NeverEnds(value)) {
      std::cerr << "ubepd: --" << name << " " << absl::FormatDuration(value)
                << " is not a time (every wait has an end: under " << ubep::kTimeoutBound
                << ")\n";
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_wait_timeout) < absl::Milliseconds(1)) {
    // Ranks are told it in whole milliseconds: less would reach them as no time at all.
    std::cerr << "ubepd: --wait_timeout "
              << absl::FormatDuration(absl::GetFlag(FLAGS_wait_timeout)) << " is under 1ms\n";
    return 2;
  }
  if (options.report_interval < absl::Milliseconds(10)) {
    // The link counts in milliseconds, and takes no less from the balancer either.
    std::cerr << "ubepd: --report_interval " << absl::FormatDuration(options.report_interval)
              << " is under 10ms\n";
    return 2;
  }
  if (options.report_interval > absl::Hours(1)) {
    // Nor more: the balancer's interval, which replaces it once registered, is taken within
    // [10ms, 1h] too.
    std::cerr << "ubepd: --report_interval " << absl::FormatDuration(options.report_interval)
              << " is over 1h\n";
    return 2;
  }
  if (options.harvest_interval < absl::Milliseconds(10)) {
    // Each harvest reads every rank's counters under the node's lock.
    std::cerr << "ubepd: --harvest_interval " << absl::FormatDuration(options.harvest_interval)
              << " is under 10ms\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_drain_timeout) < absl::ZeroDuration()) {
    std::cerr << "ubepd: --drain_timeout "
              << absl::FormatDuration(absl::GetFlag(FLAGS_drain_timeout)) << " is negative\n";
    return 2;
  }
  if (options.max_message_bytes < 4096) {
    std::cerr << "ubepd: --max_message_bytes " << options.max_message_bytes
              << " is under 4096\n";
    return 2;
  }
  const std::string mode = absl::GetFlag(FLAGS_socket_mode);
  // Octal digits alone, at most 0777 (strtoul would take a sign, and wrap a long one);
  // leading zeros as many as given.
  const size_t significant = std::min(mode.find_first_not_of('0'), mode.size());
  const bool octal = !mode.empty() && mode.size() - significant <= 3 &&
                     mode.find_first_not_of("01234567") == std::string::npos;
  options.socket_mode = octal ? static_cast<mode_t>(std::stoul(mode, nullptr, 8)) : 0;
  if (!octal || options.socket_mode > 0777) {
    std::cerr << "ubepd: --socket_mode " << mode << " is not an octal file mode\n";
    return 2;
  }
  if ((options.socket_mode & 0200) == 0) {
    // Connecting takes write permission: a daemon nobody, its own user included, could reach.
    std::cerr << "ubepd: --socket_mode " << mode
              << " does not let its owner connect (write permission, 0200)\n";
    return 2;
  }
  const std::string protocol = absl::GetFlag(FLAGS_protocol);
  if (protocol != "ubep" && protocol != "bsp") {
    std::cerr << "ubepd: --protocol " << protocol << ": expected ubep or bsp\n";
    return 2;
  }
  options.node.protocol =
      protocol == "bsp" ? ubep::kernels::Protocol::kBsp : ubep::kernels::Protocol::kUbep;
  options.node.flagged_tokens = absl::GetFlag(FLAGS_flagged_tokens);
  if (options.node.flagged_tokens < 0) {
    std::cerr << "ubepd: --flagged_tokens " << options.node.flagged_tokens
              << " is negative\n";
    return 2;
  }
  options.node.max_recv_rows = absl::GetFlag(FLAGS_max_recv_rows);
  if (options.node.max_recv_rows < 0) {
    std::cerr << "ubepd: --max_recv_rows " << options.node.max_recv_rows << " is negative\n";
    return 2;
  }
  options.node.wait_timeout = absl::GetFlag(FLAGS_wait_timeout);
  options.node.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  options.node.free_buffers = absl::GetFlag(FLAGS_free_buffers);
  options.node.max_arena_bytes = absl::GetFlag(FLAGS_max_arena_bytes);
  if (options.node.max_arena_bytes == 0) {
    std::cerr << "ubepd: --max_arena_bytes 0 is not positive\n";
    return 2;
  }
  options.node.max_plan_lead_steps = absl::GetFlag(FLAGS_max_plan_lead_steps);
  options.node.plan_path = absl::GetFlag(FLAGS_plan);
  if (!options.node.plan_path.empty()) {
    // Read now, not first at the first attach (which would fail every group's creation of a
    // daemon that said it was serving); its fit to the group is checked then.
    if (absl::Status s = ubep::balancer::CheckPlanFile(options.node.plan_path); !s.ok()) {
      std::cerr << "ubepd: --plan: " << s.message() << "\n";
      return 2;
    }
  }
  if (const std::string ranks = absl::GetFlag(FLAGS_ranks); !ranks.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(ranks, '-');
    int first = 0, last = 0;
    if (parts.size() > 2 || !absl::SimpleAtoi(parts[0], &first) ||
        !absl::SimpleAtoi(parts.back(), &last) || first < 0 || last < first) {
      std::cerr << "ubepd: --ranks \"" << ranks << "\" is not FIRST-LAST (e.g. 4-7)\n";
      return 2;
    }
    if (static_cast<uint32_t>(last) >= ubep::kMaxWorld) {
      std::cerr << "ubepd: --ranks \"" << ranks << "\": rank " << last << " is past "
                << ubep::kMaxWorld - 1 << " (an EP group has at most " << ubep::kMaxWorld
                << " ranks)\n";
      return 2;
    }
    options.node.first_rank = first;
    options.node.num_ranks = last - first + 1;
  }
  if (options.node.free_buffers < 0) {
    std::cerr << "ubepd: --free_buffers must be >= 0\n";
    return 2;
  }
  if (static_cast<uint32_t>(options.node.free_buffers) > ubep::kMaxSlotsPerRank) {
    std::cerr << "ubepd: --free_buffers " << options.node.free_buffers << " is over "
              << ubep::kMaxSlotsPerRank << ", the most slots a rank has\n";
    return 2;
  }

  // Signals go to this thread only (sigwait below), never to a server thread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // A hangup (the terminal that started it closed) is no reason to stop: ubepd runs on, as a
  // daemon. SIGTERM drains it.
  signal(SIGHUP, SIG_IGN);

  options.ready_file = absl::GetFlag(FLAGS_ready_file);
  RaiseOpenFilesLimit();
  absl::StatusOr<std::unique_ptr<ubep::daemon::Daemon>> daemon =
      ubep::daemon::Daemon::Start(options);
  if (!daemon.ok()) {
    std::cerr << "ubepd: " << daemon.status().message() << "\n";
    // A flag value it refuses (an unknown backend, --ranks without --balancer or --node): 2,
    // as those refused above; 1 when it cannot start.
    return absl::IsInvalidArgument(daemon.status()) ? 2 : 1;
  }
  int received = 0;
  sigwait(&signals, &received);
  const auto first_signal = std::chrono::steady_clock::now();
  // The other signal, pending already, came with the first (a SIGTERM right after a Ctrl-C):
  // taken now, before anything else runs, not later as a second signal by the clock (a
  // loaded machine may not run this thread again for a second). The same signal again stays
  // pending: that is a second signal, whenever it came.
  sigset_t other = signals;
  sigdelset(&other, received);
  const timespec now{0, 0};
  while (sigtimedwait(&other, nullptr, &now) > 0) {
  }
  // The drain on a thread of its own: a second signal (an operator who will not wait for the
  // clients) ends it, and the daemon, at once. A second is the same signal again, or either
  // of the two a second or more after the first: a Ctrl-C reaches every process of the
  // terminal's group, and a parent that stops its children with SIGTERM right after (as
  // ubep-local does) must not turn the drain it asked for into an abrupt exit.
  // The daemon is destroyed on that thread too (its servers' shutdown and its link may take
  // seconds), and a second signal still ends it at once meanwhile.
  std::atomic<bool> drained{false};
  bool clean = false;
  std::mutex stage_mu;
  bool destroying = false;  // Under stage_mu: the daemon is (being) destroyed.
  bool destroyed = false;   // Under stage_mu: and its sockets and lock are gone.
  std::thread drain([&] {
    clean = (*daemon)->Drain(absl::GetFlag(FLAGS_drain_timeout));
    {
      std::lock_guard<std::mutex> lock(stage_mu);
      destroying = true;
    }
    daemon->reset();  // Its ready file goes first.
    {
      std::lock_guard<std::mutex> lock(stage_mu);
      destroyed = true;
    }
    drained = true;
  });
  const timespec tick{0, 50'000'000};
  while (!drained.load()) {
    const int again = sigtimedwait(&signals, nullptr, &tick);
    if (again > 0 && (again == received ||
                      std::chrono::steady_clock::now() - first_signal >= std::chrono::seconds(1))) {
      std::cerr << "ubepd: a second signal: stopping now, without waiting for clients to "
                   "detach\n";
      // The sockets and the ready file go as at a clean exit; the arenas go with the process
      // (the clients find their fd connection closed: ubepd exited).
      // (Held to the exit: the drain thread does not begin destroying the daemon meanwhile.
      // Once it has, the ready file is gone already.)
      std::lock_guard<std::mutex> lock(stage_mu);
      // Once destroyed, the daemon is gone as at a clean exit; its socket paths (its lock
      // released) may be another ubepd's by now.
      if (destroyed) std::_Exit(clean ? 0 : 3);
      for (const std::string& path : {options.socket_path, options.socket_path + ".fds"}) {
        unlink(path.c_str());
      }
      if (!destroying) (*daemon)->WithdrawReadyFile();
      std::_Exit(3);
    }
  }
  drain.join();
  return clean ? 0 : 3;
}
