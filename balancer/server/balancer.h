// Balancer: ubep-balancer's state and loops. Daemons register and report per-slot load
// deltas (the Control service); a loop thread checks their health, recovers the cluster's
// plan from them, keeps a window of per-expert load, and when the imbalance under the plan in
// force stays above a threshold, when its ranks drop calls over a receive capacity (or on
// demand) plans with balancer/core and runs the two-phase commit with every daemon
// (ARCHITECTURE section 5).
//
// The balancer keeps no state the daemons cannot give back: after a restart it learns the
// committed plan and any undecided prepare from GetState (a version committed anywhere is
// committed everywhere; one committed nowhere is aborted after a grace period).
// Thread-safe.
#ifndef UBEP_BALANCER_SERVER_BALANCER_H_
#define UBEP_BALANCER_SERVER_BALANCER_H_

#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "balancer/core/plan.h"
#include "balancer/core/planner.h"
#include "balancer/server/load_window.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "common/periodic.h"
#include "common/recent_versions.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "ubep/v1/control.grpc.pb.h"

namespace ubep::balancer {

struct BalancerOptions {
  Policy policy = Policy::kUbep;
  double threshold = 1.10;          // Imbalance that calls for a plan (Tick: mean or worst).
  int trigger_windows = 3;          // ... for this many intervals in a row.
  int window_intervals = 10;        // Sliding window length.
  double ewma_alpha = 0;            // > 0: an EWMA instead of the sliding window.
  int min_intervals = 2;            // Never plan on less.
  absl::Duration interval = absl::Seconds(1);         // Loop tick = one window interval.
  absl::Duration report_interval = absl::Seconds(1);  // Asked of the daemons.
  absl::Duration health_interval = absl::Seconds(1);
  int health_failures = 3;          // Consecutive failed checks that mark a daemon down.
  absl::Duration rpc_timeout = absl::Seconds(5);      // Prepare, Commit, Abort, GetState.
  absl::Duration effective_margin = absl::Seconds(1); // Effective step = now + this much.
  int64_t min_margin_steps = 10;
  int migration_budget = -1;        // Per rank per layer; -1 = the daemons' free buffers.
  absl::Duration recovery_grace = absl::Seconds(3);   // Before aborting an orphan prepare.
  // Ranks of the plan that no daemon registers for this long (none registered without a group
  // meanwhile) are excluded as down.
  absl::Duration registration_grace = absl::Seconds(30);
  absl::Duration pause_before_commit = absl::ZeroDuration();  // Fault injection (tests).
  bool auto_rebalance = true;
  // Layers are planned independently: this many threads plan contiguous chunks of layers at
  // once (balancer/core itself stays single-threaded). 0 = the machine's cores.
  int planner_threads = 0;
  // What the ranks' steps are timed by (their rates, and the effective step extrapolated from
  // them); null: the monotonic clock. Tests give a FakeClock, so that a rate is what they
  // make it; it must outlive the Balancer.
  ClockInterface* step_clock = nullptr;
};

// What ubepctl and the metrics show.
struct BalancerStatus {
  struct Node {
    std::string name, address;
    std::vector<int> ranks;
    bool healthy = true;
    uint64_t max_step = 0;
    absl::Time last_report = absl::InfinitePast();  // Monotonic: for differences only.
  };
  std::vector<Node> nodes;
  uint64_t plan_version = 0;
  std::vector<double> measured_imbalance;  // Per layer, last closed interval; NaN: no call.
  absl::Time last_commit = absl::InfinitePast();  // Monotonic: for differences only.
};

// The plan for the members that are not `excluded`, from `previous` (their experts whose
// only replicas were on excluded ranks placed on the members first, within the migration
// budget of each layer, and the rest planned by `planner` with what each layer's repairs
// leave of it); FailedPrecondition where the members cannot hold every expert or a layer's
// repairs exceed the budget. Exposed for tests.
absl::StatusOr<Plan> PlanForMembers(const LoadMatrix& load, const Plan& previous,
                                    const std::vector<int>& excluded, PlannerOptions planner,
                                    int threads);

class Balancer final : public v1::Control::Service {
 public:
  Balancer(BalancerOptions options, std::shared_ptr<prometheus::Registry> registry);
  ~Balancer() override;

  void Start();  // The loop thread.

  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status GetGroup(grpc::ServerContext* context, const v1::GetGroupRequest* request,
                        v1::GetGroupResponse* response) override;
  grpc::Status ReportLoad(grpc::ServerContext* context, const v1::ReportLoadRequest* request,
                          v1::ReportLoadResponse* response) override;
  grpc::Status Rebalance(grpc::ServerContext* context, const v1::RebalanceRequest* request,
                         v1::RebalanceResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::ClusterStatus* response) override;
  grpc::Status GetClusterPlan(grpc::ServerContext* context,
                              const v1::GetClusterPlanRequest* request, v1::Plan* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::RebalanceResponse* response) override;
  grpc::Status Undrain(grpc::ServerContext* context, const v1::DrainRequest* request,
                       v1::RebalanceResponse* response) override;
  grpc::Status Forget(grpc::ServerContext* context, const v1::ForgetRequest* request,
                      v1::ForgetResponse* response) override;

  void RequestRebalance();
  BalancerStatus Status() const;
  std::optional<Plan> CurrentPlan() const;
  // The load window's counts, layers x experts (LoadWindow::Current): what the next plan is
  // computed from.
  LoadMatrix WindowLoad() const;

  // One loop iteration (the thread calls it every interval; tests may call it directly).
  void Tick();

  // Tests only, set before the balancer is served: runs once a plan that changes the
  // placement is made and before it is checked against the caller's deadline and prepared,
  // as a planner slower than the caller's margin would take that time.
  void set_after_planning_for_testing(std::function<void()> hook) {
    after_planning_for_testing_ = std::move(hook);
  }

 private:
  // A group's model, as its daemon registers it: the world size and the model shape. Plans
  // need the first four (copied out of them); the rest tell one model from another (a daemon
  // creates a new group when any of them changes).
  struct Shape {
    Shape(uint32_t world_size, const v1::ModelShape& shape);
    int world = 0, layers = 0, experts = 0, slots = 0;
    v1::ModelShape model;
    bool operator==(const Shape& other) const;
    // "4 ranks x 72 slots, 3 layers x 256 experts, hidden 32, top-8, 32 tokens, 0 bytes per
    // expert, DTYPE_FLOAT32"
    std::string Describe() const;
    // Where this one differs from `cluster`: "num_layers is 3, the cluster's 4; ...".
    std::string Differences(const Shape& cluster) const;
  };
  struct Daemon {
    v1::RegisterRequest info;
    // Its DaemonControl (FanOut calls it by method name). Shared with the RPCs made outside
    // mu_: a registration from a new address replaces it while they run.
    std::shared_ptr<grpc::Channel> channel;
    uint64_t last_seq = 0;
    // The process whose ranks were kept out (drained) as a restarted or new one's: a peer's
    // word that it restarted (RegisterRequest.restarted_ranks) is not taken again for it.
    std::string restart_handled;
    // The process such a word could not keep out (no rank would have been left serving), said
    // once.
    std::string restart_left_in;
    uint64_t last_fingerprint = 0;  // ReportFingerprint of the report taken under last_seq.
    bool healthy = true;
    int failures = 0;
    // It answers its health checks again, but another node registered some of its ranks
    // while it was down: it stays out (unhealthy) until forgotten; said once.
    bool taken_over_logged = false;
    absl::Time down_since = absl::InfiniteFuture();  // Monotonic; while not healthy.
    bool needs_state = true;
    uint64_t max_step = 0, prev_step = 0;
    absl::Time step_time = absl::InfinitePast(), prev_step_time = absl::InfinitePast();
    absl::Time last_report = absl::InfinitePast();
    uint64_t committed = 0, pending = 0;
    uint64_t pending_fingerprint = 0;  // DaemonState.pending_fingerprint (0: not known).
    uint64_t in_force = 0;  // Newest plan the daemon reported in force on all its ranks.
    // The interval being collected: logical-expert counts, per-rank counts (of its ranks,
    // from first_rank) and the steps they cover; where the reports say, the dispatches each
    // rank's counts cover. At the interval's close they become the node's per-step rates; a
    // node with no report in an interval keeps its last rates, so that reports arriving out
    // of phase with the intervals weigh no node twice, for a window of intervals or three
    // report intervals at most, whichever is longer (a member none of whose steps was counted
    // for that long, its reports failing or all stale, has no load known); a rate is of
    // the placement it was measured under, so a new plan ends every rate (ForgetInterval),
    // and a node the plan in force leaves out (drained, behind) has none.
    LoadMatrix interval_load;
    std::vector<std::vector<double>> interval_rank;             // [layer][rank - first_rank]
    std::vector<std::vector<double>> interval_rank_dispatches;  // Same; empty: not reported.
    double interval_steps = 0;
    uint64_t interval_over_capacity = 0;  // ReportLoadRequest.over_capacity_calls.
    LoadMatrix rate;
    std::vector<std::vector<double>> rank_rate;
    bool has_rate = false;
    absl::Time rate_time = absl::InfinitePast();  // When `rate` was last measured.
    int first_rank = 0;
    // The model of a group it registered that was refused as not the cluster's (its clients
    // moved to another model). A model change: the cluster starts over with it once every
    // other node that holds ranks of the cluster's model (HoldsOldModel) asked for it too.
    std::optional<Shape> wanted_shape;
    // It held ranks before it registered again without a group (its daemon restarted and its
    // clients are not back yet): until it registers a group or is forgotten, they hold a model
    // change back as the ranks it holds do.
    bool held_ranks_before_restart = false;
    // Why it refused a decision for good (DATA_LOSS: a client wrote into a plan area of its
    // ranks, so none of them can take the plan; a Commit so refused leaves the plan pending
    // there); empty: it did not. It is sent no plan and its ranks are excluded, as a down
    // node's, until it registers again as another incarnation (its ubepd restarted, or its
    // group formed again).
    std::string refused;

    // Whether it holds ranks of the cluster's model, or held them before its daemon restarted.
    bool HoldsOldModel() const { return !info.ranks().empty() || held_ranks_before_restart; }
    // Healthy and of the cluster's model: one whose group moved to another model (refused,
    // wanted_shape) serves none of the cluster's ranks, reports none of its load, holds none
    // of its plans and is sent none, though it answers its health checks.
    bool HoldsClusterRanks() const { return healthy && !wanted_shape.has_value(); }
    // ... and able to take its plans: not one that refused a Commit for good (it still holds
    // its ranks, and their arenas, but is sent no plan and its ranks are excluded).
    bool Serving() const { return HoldsClusterRanks() && refused.empty(); }
    // Still the registration an RPC outside mu_ was sent to (its channel and process): one
    // registered again meanwhile is a new process, not credited with the old one's answers.
    bool SameRegistration(const std::shared_ptr<grpc::Channel>& sent_to,
                          const std::string& incarnation) const {
      return channel == sent_to && info.incarnation() == incarnation;
    }

    // Its ranks count steps anew (a new process, a new group): from where they resume.
    void ForgetSteps() {
      max_step = prev_step = 0;
      in_force = 0;
      step_time = prev_step_time = absl::InfinitePast();
    }
    // The interval being collected starts again, and the last rates no longer stand.
    void ForgetInterval() {
      interval_load = LoadMatrix();
      interval_rank.clear();
      interval_rank_dispatches.clear();
      interval_steps = 0;
      has_rate = false;
    }
  };

  grpc::Status Reject(const char* reason, grpc::StatusCode code, std::string message);
  // Register: `node` registers a group of another model, and every other node holding ranks
  // of the cluster's model asked for the same one (a model change). Everything known of the
  // old group goes (its plan, window, versions, drains, the ranks each node registered, the
  // daemons down that served it); the registrant's model becomes the cluster's.
  void ForgetGroupLocked(const std::string& node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether every node but `node` that holds ranks of the cluster's model asked for `model`
  // (any other model, when nullopt, as long as one node asked for one).
  bool OthersLeftTheModel(const std::string& node, const std::optional<Shape>& model) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The healthy daemons that host ranks, with their domains and addresses: where a daemon
  // staging a plan reads the weights of holders in other domains.
  void AddGroupDaemons(v1::PrepareRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // For a request listing CUDA daemons of several domains: the channel of the first, which
  // makes the plan's NCCL link (CreateLink); else null.
  std::shared_ptr<grpc::Channel> LinkRoot(const v1::PrepareRequest& request) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A registrant's restarted_ranks: their node, if this balancer did not see it restart, is
  // drained as a restarted one.
  void KeepOutRestartedPeers(const v1::RegisterRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckHealth();
  // ubep_balancer_registered_daemons, _registered_ranks and _healthy_daemons.
  void UpdateRegistryGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Recover();
  // Gives the cluster's plan to drained daemons behind it (Recover calls it).
  void CatchUp();
  // A daemon's answer to the decision (Commit or Abort) on plan `version`: DATA_LOSS (a rank's
  // plan area did not take it: a client wrote there) marks it refused (Daemon::refused), said
  // once. An Abort so answered left the plan undecided on no rank, but the area is the same,
  // and a balancer restarted after a refused Commit aborts that plan as superseded.
  void NoteDecisionAnswer(const std::string& name, Daemon& d, uint64_t version, bool commit,
                          const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plans and commits; serialized with Recover by commit_mu_.
  // `members_only`: for a change of members (a drain, an undrain, a node lost or back); when
  // the plan in force already has the members wanted (another caller committed it first),
  // nothing is planned and the answer names that plan.
  absl::StatusOr<v1::RebalanceResponse> PlanAndCommit(const char* why, bool members_only = false);
  // PlanAndCommit with commit_mu_ held by the caller. `answer_by` (MonotonicNow; an
  // operator's deadline less a margin, AnswerBy): a plan not prepared everywhere by then is
  // aborted (ABORTED, naming why), so that nothing is committed after the caller was answered.
  absl::StatusOr<v1::RebalanceResponse> PlanAndCommitSerialized(const char* why, bool members_only,
                                                                absl::Time answer_by);
  // For an operator's request: takes commit_mu_ into `serial`, waiting for a change in flight
  // only until `answer_by` (AnswerBy: shortly before the caller's deadline; InfiniteFuture
  // without one); ABORTED, naming `what` was not done, if it is still in flight then.
  grpc::Status Serialize(std::unique_lock<std::mutex>& serial, absl::Time answer_by,
                         const std::string& what);
  // The step a plan made now takes effect at: the serving daemons' steps extrapolated past the
  // effective margin, and min_margin_steps more. FailedPrecondition where that is past
  // 2^64 - 1 (a serving job numbering its steps near 2^64: no plan, rather than one at a step
  // wrapped past 0, which every daemon would refuse, or one never in force).
  absl::StatusOr<uint64_t> EffectiveStep() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Now on BalancerOptions::step_clock.
  absl::Time StepNow() const {
    return options_.step_clock != nullptr ? options_.step_clock->Now() : MonotonicNow();
  }
  // The daemon hosts a rank plan_ keeps.
  bool Member(const Daemon& d) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ranks of registered node `node` that another serving node lists (took over while it was
  // down).
  std::set<uint32_t> TakenOver(const std::string& node) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A daemon of a group over several daemons whose committed plan (known from GetState) is
  // older than the cluster's: it has not caught up yet (CatchUp).
  bool Behind(const Daemon& d) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ranks in [0, world) that plan_ (if any) keeps, or every rank with `all`, and no registered
  // daemon lists.
  std::set<int> UnlistedMembers(bool all = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tick: keeps missing_, the ranks taken to be down for want of a registered daemon.
  void UpdateMissing() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ranks out of the group: those of daemons failing their health checks, drained, or behind
  // the cluster's plan, and ranks missing for the registration grace.
  std::vector<int> DesiredExcluded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every healthy daemon with ranks plan_ keeps (drained ones aside) reported it in force on
  // all its ranks: its predecessor's buffers are no longer read, so the next plan may reuse them.
  bool PlanInForceEverywhere() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every serving daemon has reported twice, so EffectiveStep has a step rate for it where its
  // ranks' steps moved between the two, and can place a plan's effective step ahead of them
  // (from one report it falls behind by up to a report interval of steps, and the daemons
  // refuse the plan). The automatic triggers wait for it.
  bool StepRatesKnown() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status SetDrained(const grpc::ServerContext* context, const std::string& node, bool drained,
                          v1::RebalanceResponse* response);
  void CloseInterval() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ubep_balancer_imbalance_ratio{layer, when}; NaN (no load) removes the series.
  void SetImbalance(int layer, const char* when, double value) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Logs once per plan version that calls go over a receive capacity which no plan can fix.
  void WarnCapacityBelowBalance(const char* because) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const BalancerOptions options_;
  const absl::Time started_;  // MonotonicNow().
  // One plan change (or recovery) at a time. An operator's request (Drain, Undrain, Rebalance,
  // Forget) waits for a change in flight only until shortly before its own deadline
  // (Serialize).
  std::mutex commit_mu_;
  mutable Mutex mu_;
  std::map<std::string, Daemon> daemons_ ABSL_GUARDED_BY(mu_);
  std::optional<Shape> shape_ ABSL_GUARDED_BY(mu_);
  std::optional<Plan> plan_ ABSL_GUARDED_BY(mu_);
  uint64_t plan_effective_step_ ABSL_GUARDED_BY(mu_) = 0;
  // From a member's GetState, or (after a change of members) its first report.
  bool effective_step_learned_ ABSL_GUARDED_BY(mu_) = false;
  std::set<int> missing_ ABSL_GUARDED_BY(mu_);
  absl::Time missing_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  uint64_t highest_version_ ABSL_GUARDED_BY(mu_) = 0;  // Committed or prepared anywhere.
  // Versions this process aborted: one still pending on a daemon whose Abort did not arrive
  // is aborted there too, however far the cluster's plan has gone past it since. The newest
  // kMaxAbortedVersions: a daemon refusing every plan makes one a tick, and
  // an older one still pending somewhere is aborted by recovery all the same, after its grace.
  static constexpr size_t kMaxAbortedVersions = 1024;
  RecentVersions aborted_versions_ ABSL_GUARDED_BY(mu_){kMaxAbortedVersions};
  std::set<uint64_t> held_logged_ ABSL_GUARDED_BY(mu_);  // Orphans held (Recover), logged once.
  std::unique_ptr<LoadWindow> window_ ABSL_GUARDED_BY(mu_);
  std::vector<double> measured_ ABSL_GUARDED_BY(mu_);  // NaN: a layer no call reached.
  // Intervals closed in a row with nothing measured (no report, or not every member's): a
  // window of them, and the measured series go (CloseInterval).
  int unmeasured_intervals_ ABSL_GUARDED_BY(mu_) = 0;
  int above_threshold_ ABSL_GUARDED_BY(mu_) = 0;
  // Calls over a receive capacity in the last closed interval, from reports sent with the plan
  // in force on all their daemon's ranks; the last plan that had such calls, and the closed
  // intervals since; the plan the balancer last said a new plan would not help.
  uint64_t over_capacity_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t drops_version_ ABSL_GUARDED_BY(mu_) = 0;
  int quiet_intervals_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t capacity_warned_version_ ABSL_GUARDED_BY(mu_) = 0;
  bool rebalance_requested_ ABSL_GUARDED_BY(mu_) = false;
  // Drained nodes, and why: an operator asked (ubepctl drain); the node restarted (a new
  // process, its peers must map its new arenas: kept out until undrained); or a plan this
  // balancer held excluded all its ranks (it registered so, or recovery learned such a plan),
  // which a newer plan recovery learns may take back.
  enum class DrainCause { kOperator, kRestart, kExcludedByPlan };
  std::map<std::string, DrainCause> drained_ ABSL_GUARDED_BY(mu_);
  uint64_t committed_count_ ABSL_GUARDED_BY(mu_) = 0, aborted_count_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_commit_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time next_health_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();

  // Metrics (ubep_balancer_*).
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge* plan_version_;
  prometheus::Counter* plans_committed_;
  prometheus::Counter* plans_aborted_;
  prometheus::Histogram* plan_seconds_;
  prometheus::Histogram* commit_seconds_;
  prometheus::Counter* migrated_slots_;
  prometheus::Counter* migrated_bytes_;
  prometheus::Counter* cross_domain_bytes_;
  prometheus::Family<prometheus::Gauge>* imbalance_;
  prometheus::Gauge* registered_daemons_;
  prometheus::Gauge* registered_ranks_;
  prometheus::Gauge* healthy_daemons_;
  prometheus::Gauge* awaiting_model_;  // Daemons with a wanted_shape.
  prometheus::Gauge* refused_daemons_;  // Daemons with a refused Commit.
  prometheus::Counter* reports_;
  prometheus::Family<prometheus::Counter>* rejected_;
  prometheus::Counter* stale_reports_;
  prometheus::Counter* over_capacity_calls_;
  std::function<void()> after_planning_for_testing_;
  std::unique_ptr<PeriodicThread> thread_;  // Started by Start(); stopped first on destruction.
};

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_SERVER_BALANCER_H_
