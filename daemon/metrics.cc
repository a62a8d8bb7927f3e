#include "daemon/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/host/rank_arena.h"

namespace ubep::daemon {
namespace {

// Harvests in a row that see nothing arrive in a layer before its imbalance goes unmeasured.
constexpr int kIdleHarvests = 10;

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

uint64_t Load(const uint64_t& word) {
  return std::atomic_ref<const uint64_t>(word).load(std::memory_order_relaxed);
}

MetricFamily Family(const char* name, const char* help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

ClientMetric GaugeValue(double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  return m;
}

ClientMetric CounterValue(double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.counter.value = value;
  return m;
}

ClientMetric HistogramValue(const kernels::LatencyHistogram& h,
                            std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  uint64_t cumulative = 0;
  double bound = kernels::kLatencyBucketBase;
  for (int b = 0; b < kernels::kLatencyBuckets; ++b) {
    cumulative += Load(h.bucket[b]);
    m.histogram.bucket.push_back({cumulative, bound});
    bound *= kernels::kLatencyBucketFactor;
  }
  cumulative += Load(h.bucket[kernels::kLatencyBuckets]);
  m.histogram.bucket.push_back({cumulative, std::numeric_limits<double>::infinity()});
  m.histogram.sample_count = cumulative;
  m.histogram.sample_sum = static_cast<double>(Load(h.sum_ns)) * 1e-9;
  return m;
}

// gRPC's name of a status code ("FAILED_PRECONDITION"): Abseil's codes are gRPC's.
std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace

DaemonMetrics::DaemonMetrics(const Node* node, absl::Duration interval)
    : node_(node), interval_(interval), thread_([this] { return interval_; }, [this] { Harvest(); }) {}

DaemonMetrics::~DaemonMetrics() = default;

void DaemonMetrics::CountRpcError(absl::StatusCode code) {
  const int c = static_cast<int>(code);
  if (c > 0 && c < 17) rpc_errors_[c].fetch_add(1, std::memory_order_relaxed);
}

void DaemonMetrics::Harvest() {
  uint64_t arenas_created = 0;
  // The hosted ranks of the group the counters were read from (one read: a group formed again
  // in between, hosting other ranks, would have its zeros summed as this one's counts).
  std::optional<std::pair<int, int>> hosted;
  absl::StatusOr<std::vector<std::vector<uint64_t>>> loads =
      node_->ReadLoads(&arenas_created, &hosted);
  MutexLock lock(&mu_);
  if (!loads.ok()) {
    // Said, once a minute while the same reason lasts (the balancer link says it only with
    // --balancer): else the load metrics stand still without a word. The next harvest tries
    // again.
    const absl::Time now = absl::Now();
    if (loads.status().message() != read_failure_ || now - read_failure_said_ >= absl::Minutes(1)) {
      UBEP_LOG(WARNING) << "metrics: cannot read the load counters (the load metrics stand "
                           "still until they can): "
                        << loads.status().message();
      read_failure_ = std::string(loads.status().message());
      read_failure_said_ = now;
    }
    return;
  }
  read_failure_.clear();
  const std::vector<std::vector<uint64_t>>& rank_load = *loads;  // [layer][rank]
  Harvested& h = harvested_;
  if (arenas_created != h.arenas_created || rank_load.size() != h.last_rank_load.size() ||
      (!rank_load.empty() && rank_load[0].size() != h.last_rank_load[0].size())) {
    // Arenas created since (a new group, of any shape, the same size or not): their counters
    // start from zero. Start over, keeping what the groups before received.
    std::vector<uint64_t> before = std::move(h.received_before);
    before.resize(std::max(before.size(), h.received.size()), 0);
    for (size_t l = 0; l < h.received.size(); ++l) before[l] += h.received[l];
    h = Harvested{};
    h.arenas_created = arenas_created;
    h.received_before = std::move(before);
    h.last_rank_load.assign(rank_load.size(),
                            std::vector<uint64_t>(rank_load.empty() ? 0 : rank_load[0].size(), 0));
    h.imbalance.assign(rank_load.size(), std::numeric_limits<double>::quiet_NaN());
    h.idle_harvests.assign(rank_load.size(), 0);
  }
  h.received.assign(rank_load.size(), 0);
  // Of this daemon's ranks only: the others' counters are their daemons' (read as 0 here).
  const size_t first = hosted.has_value() ? static_cast<size_t>(hosted->first) : 0;
  for (size_t l = 0; l < rank_load.size(); ++l) {
    const size_t end = hosted.has_value()
                           ? std::min(rank_load[l].size(), first + static_cast<size_t>(hosted->second))
                           : rank_load[l].size();
    uint64_t total = 0, top = 0;
    for (size_t r = first; r < end; ++r) {
      const uint64_t delta = rank_load[l][r] - std::min(rank_load[l][r], h.last_rank_load[l][r]);
      total += delta;
      top = std::max(top, delta);
      h.received[l] += rank_load[l][r];
    }
    if (total > 0 && end > first) {
      h.imbalance[l] = static_cast<double>(top) * static_cast<double>(end - first) /
                       static_cast<double>(total);
      h.idle_harvests[l] = 0;
    } else if (++h.idle_harvests[l] >= kIdleHarvests) {
      // Nothing arrived for kIdleHarvests harvests: nothing measured (no series), rather than
      // the last measure held for as long as the layer is idle. (Not at the first: a layer
      // a slow step reaches once in a few harvests would come and go.)
      h.imbalance[l] = std::numeric_limits<double>::quiet_NaN();
    }
    h.last_rank_load[l] = rank_load[l];
  }
}

std::vector<MetricFamily> DaemonMetrics::Collect() const {
  const NodeSnapshot node = node_->Snapshot();
  std::vector<MetricFamily> out;
  auto rank_label = [](int r) { return std::vector<ClientMetric::Label>{{"rank", std::to_string(r)}}; };

  MetricFamily attached = Family("ubep_daemon_attached_clients",
                                 "Serving processes attached to this daemon (one whose Attach was answered counts from "
                                 "then, until it detaches or its unclaimed arenas expire).", MetricType::Gauge);
  attached.metric.push_back(GaugeValue(node.attached));
  out.push_back(std::move(attached));

  MetricFamily bytes = Family("ubep_daemon_arena_bytes",
                              "Bytes of the arenas: memory=\"host\", shared memory (memfd); "
                              "memory=\"device\", GPU memory (CUDA backend, else 0).",
                              MetricType::Gauge);
  for (const auto& [memory, value] : {std::pair<const char*, uint64_t>{"host", node.arena_bytes},
                                      {"device", node.device_arena_bytes}}) {
    bytes.metric.push_back(GaugeValue(static_cast<double>(value), {{"memory", memory}}));
  }
  out.push_back(std::move(bytes));

  MetricFamily version = Family("ubep_daemon_plan_version",
                                "Version of the newest plan committed here (the ranks follow "
                                "it from its effective step).",
                                MetricType::Gauge);
  version.metric.push_back(GaugeValue(static_cast<double>(node.plan_version)));
  out.push_back(std::move(version));

  MetricFamily generation = Family("ubep_daemon_group_generation",
                                   "Times the EP group has formed (it re-forms after a rank "
                                   "leaves and comes back).", MetricType::Gauge);
  generation.metric.push_back(GaugeValue(static_cast<double>(node.generation)));
  out.push_back(std::move(generation));

  MetricFamily draining = Family("ubep_daemon_draining", "1 while the daemon is shutting down.",
                                 MetricType::Gauge);
  draining.metric.push_back(GaugeValue(node.draining ? 1 : 0));
  out.push_back(std::move(draining));

  MetricFamily up = Family("ubep_daemon_rank_up", "1 when the rank's client is attached.",
                           MetricType::Gauge);
  for (const auto& [rank, is_up] : node.rank_up) {
    up.metric.push_back(GaugeValue(is_up ? 1 : 0, rank_label(rank)));
  }
  out.push_back(std::move(up));

  MetricFamily step = Family("ubep_daemon_step", "Last step each rank began.", MetricType::Gauge);
  MetricFamily dispatched = Family("ubep_daemon_dispatched_tokens_total",
                                   "Tokens each rank gave to dispatch.", MetricType::Counter);
  MetricFamily timeouts = Family("ubep_daemon_wait_timeouts_total",
                                 "Data-plane waits that gave up, per rank.", MetricType::Counter);
  MetricFamily over_capacity = Family(
      "ubep_daemon_over_capacity_calls_total",
      "Dispatch and combine calls per rank that failed because a rank of the group was routed "
      "more rows than its receive capacity (--max_recv_rows); one per rank and dropped call.",
      MetricType::Counter);
  MetricFamily dispatch_latency = Family("ubep_daemon_dispatch_seconds",
                                         "Dispatch call latency per rank.", MetricType::Histogram);
  MetricFamily combine_latency = Family("ubep_daemon_combine_seconds",
                                        "Combine call latency per rank.", MetricType::Histogram);
  MetricFamily decision_waits = Family("ubep_daemon_effective_step_waits_total",
                                       "Steps a rank began waiting at a new plan's effective "
                                       "step for the commit decision.", MetricType::Counter);
  MetricFamily decision_seconds = Family("ubep_daemon_effective_step_wait_seconds_total",
                                         "Time ranks waited for commit decisions.",
                                         MetricType::Counter);
  std::array<uint64_t, 17> client_errors{};
  node_->ForEachArena([&](int rank, std::byte* base, const kernels::RankArenaLayout& layout,
                          const kernels::EpConfig&) {
    const kernels::RankControl* c = kernels::ControlOf(base, layout);
    step.metric.push_back(GaugeValue(static_cast<double>(Load(c->step)), rank_label(rank)));
    dispatched.metric.push_back(
        CounterValue(static_cast<double>(Load(c->dispatched_tokens)), rank_label(rank)));
    timeouts.metric.push_back(
        CounterValue(static_cast<double>(Load(c->wait_timeouts)), rank_label(rank)));
    over_capacity.metric.push_back(
        CounterValue(static_cast<double>(Load(c->over_capacity_calls)), rank_label(rank)));
    dispatch_latency.metric.push_back(HistogramValue(c->dispatch_latency, rank_label(rank)));
    combine_latency.metric.push_back(HistogramValue(c->combine_latency, rank_label(rank)));
    for (int code = 1; code < 17; ++code) client_errors[code] += Load(c->errors[code]);
    decision_waits.metric.push_back(
        CounterValue(static_cast<double>(Load(c->decision_waits)), rank_label(rank)));
    decision_seconds.metric.push_back(
        CounterValue(static_cast<double>(Load(c->decision_wait_ns)) * 1e-9, rank_label(rank)));
  });
  out.push_back(std::move(decision_waits));
  out.push_back(std::move(decision_seconds));
  out.push_back(std::move(step));
  out.push_back(std::move(dispatched));
  out.push_back(std::move(timeouts));
  out.push_back(std::move(over_capacity));
  out.push_back(std::move(dispatch_latency));
  out.push_back(std::move(combine_latency));

  MetricFamily errors = Family("ubep_daemon_errors_total",
                               "Errors by gRPC code: returned by the daemon's RPCs (source=rpc) "
                               "and by the clients' data-plane calls (source=client).",
                               MetricType::Counter);
  for (int code = 1; code < 17; ++code) {
    errors.metric.push_back(CounterValue(
        static_cast<double>(rpc_errors_[code].load(std::memory_order_relaxed)),
        {{"code", CodeName(code)}, {"source", "rpc"}}));
    errors.metric.push_back(CounterValue(static_cast<double>(client_errors[code]),
                                         {{"code", CodeName(code)}, {"source", "client"}}));
  }
  out.push_back(std::move(errors));

  MetricFamily received = Family("ubep_daemon_received_tokens_total",
                                 "Routed (token, k) pairs received by this node's ranks, per "
                                 "MoE layer.", MetricType::Counter);
  MetricFamily imbalance = Family("ubep_daemon_imbalance_ratio",
                                  "Per MoE layer, of this node's ranks: the busiest one's "
                                  "received pairs over their mean, over the last harvest "
                                  "interval (1 = balanced; no series for a layer that "
                                  "received nothing in 10 harvests).",
                                  MetricType::Gauge);
  {
    MutexLock lock(&mu_);
    const Harvested& h = harvested_;
    for (size_t l = 0; l < std::max(h.received.size(), h.received_before.size()); ++l) {
      const std::vector<ClientMetric::Label> layer{{"layer", std::to_string(l)}};
      const uint64_t total = (l < h.received.size() ? h.received[l] : 0) +
                             (l < h.received_before.size() ? h.received_before[l] : 0);
      received.metric.push_back(CounterValue(static_cast<double>(total), layer));
      if (l < h.imbalance.size() && !std::isnan(h.imbalance[l])) {
        imbalance.metric.push_back(GaugeValue(h.imbalance[l], layer));
      }
    }
  }
  out.push_back(std::move(received));
  out.push_back(std::move(imbalance));

  MetricFamily rank_received = Family("ubep_daemon_rank_received_total",
                                      "Routed (token, k) pairs received per hosted rank and MoE "
                                      "layer (the load counters summed over the rank's slots).",
                                      MetricType::Counter);
  if (absl::StatusOr<std::vector<std::vector<uint64_t>>> loads = node_->ReadLoads(); loads.ok()) {
    for (size_t l = 0; l < loads->size(); ++l) {
      for (const auto& [rank, is_up] : node.rank_up) {
        if (rank >= static_cast<int>((*loads)[l].size())) continue;
        rank_received.metric.push_back(CounterValue(
            static_cast<double>((*loads)[l][rank]),
            {{"rank", std::to_string(rank)}, {"layer", std::to_string(l)}}));
      }
    }
  }
  out.push_back(std::move(rank_received));

  if (const BalancerLinkStats* link = link_stats_.load(); link != nullptr) {
    MetricFamily registered = Family("ubep_daemon_balancer_registered",
                                     "1 while ubep-balancer holds this daemon's registration "
                                     "(--balancer); until then it counts its ranks as down.",
                                     MetricType::Gauge);
    registered.metric.push_back(GaugeValue(link->registered.load()));
    out.push_back(std::move(registered));
    MetricFamily reports = Family(
        "ubep_daemon_load_reports_total",
        "Load reports sent to ubep-balancer, by its answer: taken; refused (one it cannot use, "
        "dropped: of a plan it moved past, or malformed); dropped (an answer the same report "
        "would get again: too large, not a balancer); unanswered (sent again).",
        MetricType::Counter);
    for (const auto& [result, counter] :
         {std::pair{"taken", &link->reports_taken}, std::pair{"refused", &link->reports_refused},
          std::pair{"dropped", &link->reports_dropped},
          std::pair{"unanswered", &link->reports_unanswered}}) {
      reports.metric.push_back(
          CounterValue(static_cast<double>(counter->load()), {{"result", result}}));
    }
    out.push_back(std::move(reports));
  }
  return out;
}

}  // namespace ubep::daemon
