// BalancerLink: ubepd's side of the control plane's reporting. A thread registers the node
// with ubep-balancer (again whenever the group's shape changes or the balancer forgot it) and
// every report interval sends the slot counters' deltas of its ranks (ReportLoad). When the
// group has ranks on peer daemons, it asks the balancer who hosts them (GetGroup) and maps
// their arenas from the peers' fd sockets, polling every 100 ms until all are mapped.
// The data plane never waits for it: a balancer that is down only stops the reports.
// Thread-safe.
#ifndef UBEP_DAEMON_BALANCER_LINK_H_
#define UBEP_DAEMON_BALANCER_LINK_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "balancer/core/plan.h"
#include "common/periodic.h"
#include "daemon/node.h"
#include "grpcpp/client_context.h"
#include "ubep/v1/control.grpc.pb.h"

namespace ubep::daemon {

// What a link has done, for ubepd's metrics (ubep_daemon_balancer_registered,
// ubep_daemon_load_reports_total); owned by the daemon, which outlives the link.
struct BalancerLinkStats {
  std::atomic<int> registered{0};  // 1 while the balancer holds this daemon's registration.
  // Load reports by the balancer's answer: taken; refused (a report it cannot use, dropped);
  // dropped (an answer the same report would get again: too large, not a balancer);
  // unanswered (no answer: sent again).
  std::atomic<uint64_t> reports_taken{0}, reports_refused{0}, reports_dropped{0},
      reports_unanswered{0};
};

struct BalancerLinkOptions {
  std::string balancer;   // HOST:PORT of ubep-balancer.
  std::string node;       // This node's name.
  std::string address;    // HOST:PORT where this daemon serves DaemonControl.
  uint32_t domain = 0;
  std::string backend = "host";
  std::string arena_socket;  // This daemon's fd socket, where peers take its arenas.
  absl::Duration report_interval = absl::Seconds(1);
  // Each RPC to the balancer, and each fetch of a peer's arenas, gives up after this long.
  // A link being destroyed cancels the RPC in flight and starts no other call; a fetch of a
  // peer's arenas in flight (a Unix-socket exchange) runs to its end or to this timeout.
  absl::Duration rpc_timeout = absl::Seconds(2);
  BalancerLinkStats* stats = nullptr;  // Kept up to date where given.
};

// The cluster's plan in force, asked of the balancer when ubepd creates a group
// (NodeOptions::cluster_plan): nullopt when it has none, or does not answer within `patience`
// (taken for down: the group starts under v1 rather than wait on it; logged), or answers with
// a plan that cannot be read (logged). DeadlineExceeded when `deadline`, the Attach's, comes
// first: the caller gave up, and the balancer may well have a plan.
absl::StatusOr<std::optional<balancer::Plan>> FetchClusterPlan(
    v1::Control::Stub& stub, absl::Time deadline, absl::Duration patience = absl::Seconds(2));

// The wait before the link asks the balancer for the group again while peers' arenas are not
// mapped, after `unchanged` ticks that found the same peers missing: 100 ms, doubled each time
// up to 1 s (a node that never comes up would otherwise have every other daemon ask ten times
// a second for as long as it is away).
absl::Duration PeerPollInterval(int unchanged);

class BalancerLink {
 public:
  BalancerLink(BalancerLinkOptions options, Node* node);
  ~BalancerLink();

 private:
  // The wait before the next tick (PeriodicThread's interval, asked on the link's thread).
  absl::Duration NextTick();
  // registered_, and the stats' gauge of it.
  void SetRegistered(bool registered);
  void Count(std::atomic<uint64_t> BalancerLinkStats::*counter);
  void Tick();
  bool Register();
  // A report, with the counters it was made from.
  struct Pending {
    v1::ReportLoadRequest request;
    Node::SlotLoads loads;
  };
  void Report();
  std::optional<Pending> MakeReport();
  // Whether a report's failure `why` is to be logged now: once per kind and 10 s.
  bool SayReportFailure(const std::string& why);  // Of the counters now, against last_.
  void MapPeers();
  // An RPC's context, set to the link's deadline and registered while the call runs, so that
  // the destructor can cancel it. (Made on the link's thread, one at a time.)
  class Call;

  // Set by the destructor: the tick in flight ends at its next RPC, or at once if in one.
  std::atomic<bool> stopping_{false};
  std::mutex call_mu_;
  grpc::ClientContext* call_ = nullptr;  // The RPC in flight, if any; guarded by call_mu_.

  const BalancerLinkOptions options_;
  Node* node_;
  std::unique_ptr<v1::Control::Stub> stub_;
  bool registered_ = false;  // Link thread only, as ticked_.
  bool ticked_ = false;      // NextTick gave the first tick.
  // The peers whose arenas were not mapped at the last tick, and for how many ticks in a row
  // they were the same: the link asks for the group less often the longer nothing changes.
  std::vector<int> missing_;
  int missing_ticks_ = 0;
  std::string registered_shape_;          // Serialized shape at the last registration.
  uint64_t registered_arenas_ = 0;        // Groups created, at the last registration.
  std::vector<int> registered_restarted_;  // RestartedMembers told at the last registration.
  // Counters at the last report answered; kept across registrations, so that nothing
  // counted is reported twice or lost.
  Node::SlotLoads last_;
  uint64_t last_step_ = 0;
  // Calls over a receive capacity of intervals not reported (the plan before's), for the next
  // report's over_capacity_calls_before.
  uint64_t over_capacity_unreported_ = 0;
  uint64_t seq_ = 0;
  // The report sent last whose answer did not come (the balancer away, or the answer lost):
  // sent again as it was, under its seq, until one comes. The balancer takes a seq once, so
  // its counts are neither lost nor counted twice.
  std::optional<Pending> pending_;
  absl::Time next_report_ = absl::InfinitePast();
  absl::Time next_peer_log_ = absl::InfinitePast();
  std::string last_refusal_;  // The last registration's error, logged until next_refusal_log_.
  absl::Time next_refusal_log_ = absl::InfinitePast();
  // The last failure of a report, logged until next_report_failure_log_.
  std::string last_report_failure_;
  absl::Time next_report_failure_log_ = absl::InfinitePast();
  // The process: "<pid>-<start ns>". It registers "<process>.<groups created>": a group
  // created again has new arenas, which peers map anew as a restarted daemon's.
  const std::string incarnation_;
  std::atomic<int64_t> interval_ms_;  // The balancer may ask for another interval.
  PeriodicThread thread_;              // Last: starts after the members it uses.
};

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_BALANCER_LINK_H_
