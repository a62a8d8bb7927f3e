// DaemonMetrics: ubepd's Prometheus exposition (names ubep_daemon_*). A harvester thread reads
// the arenas' load counters about once a second and keeps per-layer received pairs and the
// imbalance of the last interval; everything else is read at scrape time from the Node and
// from the counters each rank's client keeps in its arena (RankControl).
// Thread-safe.
#ifndef UBEP_DAEMON_METRICS_H_
#define UBEP_DAEMON_METRICS_H_

#include <array>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/periodic.h"
#include "daemon/balancer_link.h"
#include "daemon/node.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace ubep::daemon {

class DaemonMetrics : public prometheus::Collectable {
 public:
  // Starts harvesting every `interval`.
  DaemonMetrics(const Node* node, absl::Duration interval);
  ~DaemonMetrics() override;

  // Errors the daemon's RPCs returned, by code.
  void CountRpcError(absl::StatusCode code);
  // The balancer link's registration and load reports, exposed from now on (a daemon with
  // --balancer); `stats` outlives this.
  void ExposeLink(const BalancerLinkStats* stats) { link_stats_.store(stats); }
  // Harvests now (the thread does it every interval; tests call it directly).
  void Harvest();

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct Harvested {
    uint64_t arenas_created = 0;           // Which arenas' counters (Node::SlotLoads).
    // Per layer: pairs received by the groups before this one (their counters are gone), so
    // that ubep_daemon_received_tokens_total only grows within the process.
    std::vector<uint64_t> received_before;
    std::vector<uint64_t> received;        // Per layer: pairs received, all ranks.
    std::vector<double> imbalance;         // Per layer: max/mean rank load, last interval.
    std::vector<int> idle_harvests;        // Per layer: harvests in a row that saw nothing.
    std::vector<std::vector<uint64_t>> last_rank_load;  // [layer][rank] at the last harvest.
  };
  const Node* node_;
  const absl::Duration interval_;
  std::array<std::atomic<uint64_t>, 17> rpc_errors_{};
  std::atomic<const BalancerLinkStats*> link_stats_{nullptr};
  mutable Mutex mu_;
  Harvested harvested_ ABSL_GUARDED_BY(mu_);
  std::string read_failure_ ABSL_GUARDED_BY(mu_);  // Why the last harvest's read failed.
  absl::Time read_failure_said_ ABSL_GUARDED_BY(mu_);
  PeriodicThread thread_;  // Last: starts after the members it uses.
};

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_METRICS_H_
