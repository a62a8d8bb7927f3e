// Node: the state ubepd keeps for its node: the EP group its serving processes form, one
// arena per rank, the plan in force, and which rank is attached by whom.
//
// A daemon hosts all ranks of its group (the default) or a contiguous range of them
// (NodeOptions::first_rank, num_ranks): the group's other ranks are hosted by peer daemons on
// the same machine, whose arenas this daemon maps (AddPeerArenas, from the peers' fd
// sockets; the balancer says who they are). Clients get every arena of the group from their
// own daemon.
//
// A rank's life: Attach (shape checked against the group; the first attach creates the group
// and its hosted arenas; Attach returns once the peers' arenas are mapped too) -> the client takes its arenas' fds from the fd socket with the attach token
// (ClaimArenas; the connection stays open) -> Join (waits until every rank of the group has
// joined, on any daemon; then the daemon of rank 0 forms the group: signal words reset,
// generation + 1; the rendezvous runs through words in every rank's RankControl) -> dispatch and combine
// through the mapped arenas, with no daemon involvement -> Detach, or the client dies and its
// fd connection closes (ConnectionClosed). A rank leaving a formed group breaks it: every
// arena's abort word names the rank, so every wait of the survivors fails at once with an
// error naming it; survivors Join again and continue when the rank is back.
// Drain (SIGTERM): no new attaches; every wait fails with "ubepd is draining".
//
// Thread-safe.
#ifndef UBEP_DAEMON_NODE_H_
#define UBEP_DAEMON_NODE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "balancer/core/plan.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "common/recent_versions.h"
#include "common/unix_socket.h"
#include "daemon/device_memory.h"
#include "kernels/host/arena_layout.h"
#include "kernels/host/rank_arena.h"
#include "kernels/host/shared_arena.h"
#include "ubep/v1/control.pb.h"
#include "ubep/v1/daemon.pb.h"

namespace ubep::daemon {

struct NodeOptions {
  std::string backend = "host";               // "host" (memfd) or "cuda" (VMM device arenas).
  std::string fd_socket_path;                 // Told to clients in AttachResponse.
  kernels::Protocol protocol = kernels::Protocol::kUbep;
  int flagged_tokens = 0;  // EpConfig::flagged_tokens, capped at the shape's max_tokens.
  int max_recv_rows = 0;   // EpConfig::max_recv_rows of every hosted rank; 0 = unbounded.
  absl::Duration wait_timeout = absl::Seconds(10);   // Data-plane waits.
  absl::Duration join_timeout = absl::Seconds(60);   // Longest Join wait.
  absl::Duration ticket_timeout = absl::Seconds(10); // Attach token unclaimed -> rank free.
  // The clock attach tokens expire on: null, the monotonic clock (MonotonicNow); a test's
  // FakeClock, which the Node does not own.
  const ClockInterface* ticket_clock = nullptr;
  int free_buffers = 2;                       // Weight buffers per layer beyond the slots.
  // A plan's effective step at most this far ahead of the furthest member rank; 0 = no bound.
  uint64_t max_plan_lead_steps = 1'000'000;
  uint64_t max_arena_bytes = uint64_t{16} << 30;  // Per rank.
  std::string plan_path;                      // Static plan JSON; empty = round-robin.
  // Hosted ranks: [first_rank, first_rank + num_ranks); num_ranks 0 = every rank of the group.
  int first_rank = 0;
  int num_ranks = 0;
  uint32_t domain = 0;                        // Load/store domain of the hosted ranks.
  // Tests only: called by Prepare after its weight copies, before it takes the lock again.
  std::function<void()> staging_hook;
  // Tests only: called by StopGroup, under the node's lock, once the abort codes are in the
  // arenas and before the group state reads broken.
  std::function<void()> stopping_hook;
  // Tests only: called by the lead's TryFormGroup, under the node's lock, once every member's
  // join ticket was read and before the group is published.
  std::function<void()> forming_hook;
  // Tests only: called by the lead's TryFormGroup, under the node's lock, once the group is
  // published and before the members' tickets are claimed.
  std::function<void()> published_hook;
  // Tests only: called by Join, under the node's lock, once its wait for the group has run
  // out and before the rank's join ticket is withdrawn.
  std::function<void(int rank)> join_expiring_hook;
  // Without plan_path: the cluster's plan in force, if there is one (ubepd asks the balancer,
  // bounded, and ending before the Attach's deadline by the margin its answer needs: the
  // `deadline` passed). A new group starts under it when its
  // shape fits, so that a restarted daemon serves the plan its node left, and versions only
  // grow; under round-robin v1 when there is none. An error fails the Attach and creates
  // nothing: an answer cut short by the caller's deadline is not taken for "no plan".
  std::function<absl::StatusOr<std::optional<balancer::Plan>>(absl::Time deadline)> cluster_plan;
};

// What the metrics need, copied under the lock.
struct NodeSnapshot {
  bool has_group = false;
  int world_size = 0;
  int attached = 0;             // Ranks whose client holds its arenas.
  int joining = 0;              // Ranks waiting in Join for the group to form.
  uint64_t arena_bytes = 0;         // All arenas' host memory (memfd shared memory).
  uint64_t device_arena_bytes = 0;  // All arenas' device memory (CUDA backend; else 0).
  uint64_t generation = 0;
  uint64_t plan_version = 0;
  bool draining = false;
  int num_layers = 0, slots_per_rank = 0;
  std::vector<std::pair<int, bool>> rank_up;  // Per hosted rank: attached and connected.
};

class Node {
 public:
  explicit Node(NodeOptions options);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // Waits (until `deadline`, at most the join timeout) for the peers' arenas to be mapped.
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& request,
                                            absl::Time deadline = absl::InfiniteFuture());
  // For the fd socket: the arenas' fds (in AttachResponse.arena_ranks order) for a valid,
  // unclaimed token; marks the rank connected. `connection` identifies the fd connection.
  absl::StatusOr<std::vector<UniqueFd>> ClaimArenas(const std::string& token, int64_t connection);
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request, absl::Time deadline);
  absl::Status Detach(const v1::DetachRequest& request);
  absl::StatusOr<v1::GetPlanResponse> GetPlan() const;
  absl::StatusOr<v1::ReportStepResponse> ReportStep(const v1::ReportStepRequest& request);
  // The fd connection `connection` closed: if it still holds a rank, that rank is gone.
  // `why`: why ubepd closed it; empty when its client did (the process exited or was killed).
  // True where it held a rank (and the rank is logged gone).
  bool ConnectionClosed(int64_t connection, std::string_view why = "");
  // Whether fd connection `connection` holds a rank (claimed it, and the rank has not been
  // detached or taken by another connection since).
  bool HoldsConnection(int64_t connection) const;

  // The two-phase plan commit, daemon side (ARCHITECTURE section 5). Prepare stages the
  // weights of experts new to a slot into free weight buffers (copied from a slot of this
  // node that holds the expert under the plan in force, the same rank first), writes the
  // slot -> buffer map and the plan table into the inactive buffers, and answers Prepared
  // (or Failed with the reason). Commit and Abort decide; both are idempotent.
  //
  // Holders are taken nearest first: the same rank, a rank of this daemon's domain (a copy
  // between mapped arenas), else a rank of another domain, whose weights `remote.fetch`
  // reads from its daemon (ReadWeights). Without remote.rank_domain every rank is in this
  // daemon's domain.
  struct RemoteWeights {
    std::vector<uint32_t> rank_domain;  // Per rank of the group, or empty.
    // CUDA backend: the NCCL link (WeightLink) this staging joins, where the balancer made
    // one: its unique id, this daemon's rank in it, its size, and per rank of the group the
    // link rank of the rank's daemon (-1: none). Copies between domains then go over it, in
    // the order of the group's schedule (SlotCopies), instead of through `fetch`.
    std::string nccl_id;
    int link_rank = -1, link_size = 0;
    std::vector<int> rank_link;
    // Per rank of the group, or empty: its daemon restarted since the plan in force took it
    // (PeerDaemon.restarted), so it is another domain's holder of last resort (SlotCopies).
    std::vector<bool> rank_restarted;
    uint64_t base_version = 0;  // The plan in force the schedule is computed over.
    // Bounds the link's waits (the balancer's deadline for the Prepare, less a moment).
    absl::Time deadline = absl::InfiniteFuture();
    // The balancer's deadline for the Prepare itself: past it, the Prepare is not carried out
    // (the balancer gave up on it, and may have sent its Abort already).
    absl::Time caller_deadline = absl::InfiniteFuture();
    // Copies the weights that global slot `slot` of layer index `layer` maps to on rank
    // `rank` (another domain's), under committed plan `version`, into out[0, bytes). It asks
    // `stopped()` between its reads and gives up once it says true (the plan was aborted or
    // ubepd is draining: a drain must not wait out a long copy).
    std::function<absl::Status(int rank, uint64_t version, int layer, int slot, std::byte* out,
                               size_t bytes, const std::function<bool()>& stopped)>
        fetch;
  };
  v1::PrepareResponse Prepare(const balancer::Plan& plan, uint64_t effective_step,
                              const RemoteWeights& remote);
  v1::PrepareResponse Prepare(const balancer::Plan& plan, uint64_t effective_step) {
    return Prepare(plan, effective_step, RemoteWeights());
  }
  // The group's staging of `next` over the plan `in_force`, as every daemon computes it: per
  // slot of a rank `next` includes that gets an expert it does not hold (every slot of a rank
  // it takes back), the nearest holder. In (layer, rank, slot) order. `readable(q)` false: rank
  // q's daemon is down, so q is no holder for another domain (null: every rank can be read).
  // `last_resort(q)` true: q's daemon restarted, and its new arenas may not hold the weights
  // yet (its clients load them after they attach), so another domain takes q's copy only
  // where no other rank holds the expert (null: none is).
  struct SlotCopy {
    int layer, rank, slot;  // The slot (local index) that gets the expert.
    int holder;             // Global slot holding it under `in_force`.
    int distance;           // 0: the same rank, 1: the same domain, 2: another domain.
  };
  static absl::StatusOr<std::vector<SlotCopy>> SlotCopies(
      const balancer::Plan& in_force, const balancer::Plan& next,
      const std::function<uint32_t(int)>& domain_of,
      const std::function<bool(int)>& readable = nullptr,
      const std::function<bool(int)>& last_resort = nullptr);
  // The NCCL link's copies run in batches of this many bytes of weights.
  static constexpr uint64_t kLinkBatchBytes = uint64_t{256} << 20;
  // A daemon's share of the schedule's cross-domain copies over the link (hosting ranks
  // [first, first + hosted)), in schedule order: receive a copy into a hosted rank, or send a
  // hosted holder's weights; `per_batch` copies of the schedule per batch, counted alike on
  // every daemon, so that each pair of daemons issues matching sends and receives in the same
  // order and batches. rank_link: per rank, the link rank of its daemon.
  struct LinkOp {
    int batch;
    int peer;   // Link rank of the other daemon.
    bool send;
    int copy;   // Index in the schedule.
  };
  static absl::StatusOr<std::vector<LinkOp>> LinkOps(const std::vector<SlotCopy>& schedule, int first,
                                                     int hosted, const std::vector<int>& rank_link,
                                                     int slots_per_rank, size_t per_batch);
  // A holder's side of a remote copy: `length` bytes (0: to the end; at most
  // kMaxReadWeightsBytes) from `offset` of the weights that global slot `slot` of layer
  // index `layer` maps to under the committed plan, which must be `version`. The slot's rank
  // must be hosted here and included in that plan.
  static constexpr uint64_t kMaxReadWeightsBytes = uint64_t{1} << 20;
  // With request.require_loaded (the holder's daemon restarted: the copy of last resort),
  // FailedPrecondition unless the rank's client said its weights are loaded.
  absl::StatusOr<v1::ReadWeightsResponse> ReadWeights(const v1::ReadWeightsRequest& request) const;
  absl::Status Commit(uint64_t version);
  absl::Status Abort(uint64_t version);
  v1::DaemonState State() const;
  // What a load report names of the plan in force: version, experts, model layer ids
  // (without copying the plan itself).
  struct PlanIdentity {
    uint64_t version = 0;
    int num_experts = 0;
    std::vector<int> layer_ids;
    // Every hosted member rank has reached the plan's effective step (the balancer prepares
    // the next plan only then; Prepare refuses it before).
    bool in_force = false;
    // The step from which the ranks follow it: its effective step, or the step the group
    // resumed at where it formed again at an earlier one (RetargetPlan); nullopt while no
    // arena of this daemon holds the plan.
    std::optional<uint64_t> effective_step;
  };
  PlanIdentity CommittedPlanIdentity() const;
  // Highest step any rank has begun; the group's shape (nullopt without a group).
  uint64_t MaxStep() const;
  std::optional<v1::AttachRequest> GroupShape() const;
  // What the daemon registers with the balancer, read at once: the groups created so far
  // (each with new arenas; 0 before the first), the group's shape and hosted ranks (first,
  // count) (nullopt without a group).
  struct GroupIdentity {
    uint64_t arenas_created = 0;
    uint64_t generation = 0;  // Of the group formed last on them: each re-form raises it.
    std::optional<v1::AttachRequest> shape;
    std::optional<std::pair<int, int>> hosted;
  };
  GroupIdentity Identity() const;
  // The hosted ranks' load counters since the group was created, each layer's taken with
  // the dispatches it counts (the arena's load seqlock), so that a rate per dispatch is exact
  // whatever step a rank was in when read. Other ranks' entries are 0.
  struct SlotLoads {
    std::vector<std::vector<uint64_t>> slots;       // [layer][global slot]: received pairs.
    std::vector<std::vector<uint64_t>> dispatches;  // [layer][rank]: dispatches counted.
    // The hosted ranks' data-plane calls that failed over a receive capacity (one per rank and
    // dropped call; RankControl::over_capacity_calls).
    uint64_t over_capacity_calls = 0;
    // The plan and the group of those arenas, read with the counters (under one lock): a
    // report names the plan and the ranks of what it counts, not those of a group formed
    // again between two reads. Counters of two reads are comparable only from the same
    // creation of the arenas (group.arenas_created: a group created again, even of the same
    // size, starts from zero).
    PlanIdentity plan;
    GroupIdentity group;
    // The highest step a hosted rank had begun, read before the counters: every count read is
    // of that step or a later one (MaxStep).
    uint64_t max_step = 0;
  };
  absl::StatusOr<SlotLoads> ReadSlotLoads() const;
  int free_buffers() const { return options_.free_buffers; }

  // Peer daemons. PeerKey: what a peer must match (world size and model shape, serialized;
  // empty without a group). ArenasForPeer: the first hosted rank and the hosted arenas' fds,
  // for a peer whose key matches. MissingRanks: the ranks whose arenas are not mapped yet.
  // AddPeerArenas: maps a peer's arenas (checked: size and control block).
  std::string PeerKey() const;
  absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> ArenasForPeer(const std::string& key) const;
  std::vector<int> MissingRanks() const;
  // Ranks the committed plan keeps whose daemon started anew: this daemon maps an older
  // process's arenas for them (stale), and forms no group nor prepares a plan with them until
  // a committed plan excludes them. The balancer is told (RegisterRequest.restarted_ranks).
  std::vector<int> RestartedMembers() const;
  // Maps a peer's arenas for its ranks [first_rank, first_rank + fds.size()), made by the
  // daemon process `incarnation`. Arenas of another incarnation already mapped there (the
  // peer restarted) are replaced only while the committed plan excludes those ranks and no
  // undecided plan includes them; else FailedPrecondition, and they stay stale: no plan that
  // includes them is prepared and no group forms with them. Replacing bumps the arena epoch.
  absl::Status AddPeerArenas(int first_rank, const std::vector<int>& fds,
                             const std::string& incarnation = "");
  // Whether the arenas of a peer's ranks [first_rank, first_rank + count) made by
  // `incarnation` are to be fetched: some are not mapped, or another incarnation's are (those
  // are marked stale until replaced).
  bool PeerArenasWanted(int first_rank, int count, const std::string& incarnation);
  // A claimed connection's refresh (JoinResponse.arena_epoch): the arena epoch and every
  // rank's arena fds, as ClaimArenas gives them.
  absl::StatusOr<std::pair<uint64_t, std::vector<UniqueFd>>> RefreshArenas(int64_t connection) const;
  // [first, first + count) of the group's hosted ranks (nullopt without a group).
  std::optional<std::pair<int, int>> HostedRanks() const;

  // Stops new attaches and joins and fails every data-plane wait with "draining".
  void Drain();
  // Waits until no rank is attached, at most `timeout`; returns whether none is.
  bool AwaitDetached(absl::Duration timeout);

  NodeSnapshot Snapshot() const;
  // Received pairs per [layer][rank] (the load counters summed over each rank's slots);
  // empty without a group.
  // `arenas_created` and `hosted`, when given, receive which creation of the arenas they are
  // from and the ranks this daemon hosts in that group (GroupIdentity::arenas_created and
  // ::hosted, read with the counters: HostedRanks, a read of its own, may be a group formed
  // again since).
  absl::StatusOr<std::vector<std::vector<uint64_t>>> ReadLoads(
      uint64_t* arenas_created = nullptr,
      std::optional<std::pair<int, int>>* hosted = nullptr) const;
  // Calls fn(rank, arena base, layout, config) for each hosted arena, under the lock (the harvester
  // reads counters; arenas never move while the group exists).
  template <typename Fn>
  void ForEachArena(Fn fn) const;

 private:
  enum class RankState { kFree, kAttached, kConnected };
  struct RankEntry {
    RankState state = RankState::kFree;
    std::string token;
    uint32_t pid = 0;
    absl::Time ticket_deadline;  // On TicketNow().
    int64_t connection = -1;
    bool joining = false;
  };

  absl::Status CheckShape(const v1::AttachRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CommittedLocked(uint64_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why an Attach is refused whatever the group: a rank this daemon does not host (--ranks,
  // else the request's whole group), or a device the rank does not run on (rank r on device
  // r modulo the visible devices, on the CUDA backend).
  absl::Status CheckRankHostedHere(const v1::AttachRequest& request) const;
  absl::Status CreateGroup(const v1::AttachRequest& request,
                           const std::optional<balancer::Plan>& cluster_plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckToken(uint32_t rank, const std::string& token, bool need_connected) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank left a group that may be running: stop every wait, naming it. If the rank was
  // stopped already, stop the ranks still running its generation (a partial stop).
  // `rejoining`: the rank is alive and joins again (Join); it then passes on the rank its own
  // abort word says left, if any, rather than naming itself.
  void BreakGroup(int rank, bool rejoining = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Clears `rank`'s join ticket, sequentially consistent (see BreakGroup).
  void WithdrawTicket(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While draining: the hosted ranks' abort words and states say so (Drain), again.
  void MarkHostedDraining() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The daemon of rank 0: forms the next generation if every rank's ticket asks for it.
  void TryFormGroup() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Hosted(int r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return r >= first_ && r < first_ + hosted_;
  }
  bool AllArenasMapped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under the newest committed plan: the lowest rank in the group (its daemon forms it).
  int LowestActive() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The members (under the plan in force here) whose plan area does not hold that plan
  // committed or holds a newer one committed, with the newest version each holds committed
  // (0: none), newest first.
  std::vector<std::pair<int, uint64_t>> MembersBehindOrAhead() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The newest generation any arena shows (excluded ranks' arenas lag).
  uint64_t GroupGeneration() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A plan's effective step as the plan area has it (formation may move it earlier).
  uint64_t EffectiveStepOf(uint64_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether hosted rank r's client said its weights are loaded (Rank::WeightsLoaded).
  bool WeightsLoadedLocked(int r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  kernels::RankControl* Ctl(int r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return kernels::ControlOf(arenas_[r].data(), layout_);
  }
  // Stops the running group: `code` into the abort word of every rank stops(r) names (the
  // first reason wins), then the group state broken in those ranks' control blocks. In that
  // order: a rank that finds the group broken in BeginStep reads why from its abort word. A
  // rank stops(r) does not name is left alone: its state is its own daemon's to change.
  void StopGroup(uint32_t code, absl::FunctionRef<bool(int)> stops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same with a code per rank, code_of(r) (0: r is not stopped), each read once.
  void StopGroup(absl::FunctionRef<uint32_t(int)> code_of) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int AttachedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Now on the clock attach tokens expire on (NodeOptions::ticket_clock).
  absl::Time TicketNow() const {
    return options_.ticket_clock != nullptr ? options_.ticket_clock->Now() : MonotonicNow();
  }
  uint64_t MaxStepLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank whose arenas fd connection `connection` claimed, if it still holds one.
  std::optional<int> RankOfConnectionLocked(int64_t connection) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PlanIdentity CommittedPlanIdentityLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  GroupIdentity IdentityLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The step rank `rank` has begun (its control block's word; the rank's arena is mapped).
  uint64_t StepOf(int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first hosted member rank, connected, that has not reached the committed plan's
  // effective step, or nullopt: the plan is in force on every hosted rank.
  std::optional<int> RankBeforePlanLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Index (0 or 1) of the plan buffer holding `version` in rank `rank`'s plan area (the
  // first hosted rank's for -1); -1 if none.
  int PlanBufferOf(uint64_t version, int rank = -1) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A copy of rank r's slot map in plan buffer `buffer`, every entry checked to be a weight
  // buffer of the layout: only ubepd writes it, but the rank's process maps the arena
  // writable, and a stray store there, before the check or after it, must not send a copy
  // outside the arena. DataLoss names the first entry that is not.
  absl::StatusOr<std::vector<uint32_t>> CheckedSlotMap(int r, int buffer) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a change of members to `next` stops rank r's waits: this daemon stops its own
  // ranks and the peers' that `next` drops (their daemons may be gone); the other members'
  // daemons stop theirs (each gets the plan). A rank `next` takes back is not stopped from
  // here: its own daemon stops it, and a daemon hosting no member of `next` may commit after
  // the new group formed with it (or catch up on the cluster's plan much later).
  bool MembershipStops(const balancer::Plan& next, int r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Hosted(r) || (next.excluded(r) && !plan_.excluded(r));
  }
  // One expert's weights from a holder's buffer to a new slot's buffer, in one layer.
  struct WeightCopy {
    int from_rank;
    uint32_t from_buffer;  // Same domain: the holder's buffer, copied between arenas.
    int to_rank;
    uint32_t to_buffer;
    int layer;
    int remote_slot = -1;  // Another domain: the holder's global slot, read through its daemon.
  };
  // Runs without mu_ while staging_ is set: staging_ keeps the arenas, layout and shape it
  // reads in place (no new group, no replaced peer arenas).
  absl::Status CopyWeights(const WeightCopy& copy) const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Where a layer's weight buffer starts in a device arena.
  size_t DeviceWeightOffset(int layer, uint32_t buffer) const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Whether a staging in progress is to stop: its plan was aborted, or ubepd is draining.
  bool StagingStopped() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FetchWeights(const WeightCopy& copy, uint64_t version, const RemoteWeights& remote)
      const ABSL_NO_THREAD_SAFETY_ANALYSIS;
  bool on_device() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !device_arenas_.empty(); }
  // The abort word of rank r's arena (host or device): read, and write.
  uint32_t AbortCode(int r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetAbortCode(int r, uint32_t code, bool only_if_clear) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const NodeOptions options_;
  mutable Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool has_group_ ABSL_GUARDED_BY(mu_) = false;
  v1::AttachRequest group_request_ ABSL_GUARDED_BY(mu_);  // Shape and world of the group.
  kernels::EpConfig config_ ABSL_GUARDED_BY(mu_);
  kernels::RankArenaLayout layout_ ABSL_GUARDED_BY(mu_);
  std::vector<kernels::SharedArena> arenas_ ABSL_GUARDED_BY(mu_);  // Every rank; peers' once mapped.
  int first_ ABSL_GUARDED_BY(mu_) = 0;   // Hosted ranks.
  int hosted_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<DeviceMemory>> device_arenas_ ABSL_GUARDED_BY(mu_);  // CUDA.
  std::vector<RankEntry> ranks_ ABSL_GUARDED_BY(mu_);
  balancer::Plan plan_ ABSL_GUARDED_BY(mu_);               // Newest committed.
  // The group's committed versions, the newest kMaxCommittedVersions: a Commit of one again
  // is done, an Abort of one refused. One older than those is answered as a version never
  // committed here (Commit: NotFound; Abort: OK); the balancer sends neither (it aborts only
  // undecided versions, above the ones committed).
  static constexpr size_t kMaxCommittedVersions = 1024;
  RecentVersions committed_versions_ ABSL_GUARDED_BY(mu_){kMaxCommittedVersions};
  std::optional<balancer::Plan> pending_ ABSL_GUARDED_BY(mu_);  // Prepared, undecided.
  uint64_t pending_effective_step_ ABSL_GUARDED_BY(mu_) = 0;
  // A plan changing the members is being prepared, or prepared and undecided.
  bool membership_pending_ ABSL_GUARDED_BY(mu_) = false;
  // Prepare is copying weights without the lock: which plan, and whether it was aborted
  // meanwhile.
  bool staging_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t staging_version_ ABSL_GUARDED_BY(mu_) = 0;
  bool staging_aborted_ ABSL_GUARDED_BY(mu_) = false;
  // Per rank: the peer daemon process whose arenas are mapped (empty for hosted ranks), and
  // whether its daemon has restarted since (stale: the mapped arenas are the dead process's).
  std::vector<std::string> incarnation_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> stale_ ABSL_GUARDED_BY(mu_);
  uint64_t arena_epoch_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t arenas_created_ ABSL_GUARDED_BY(mu_) = 0;  // CreateGroup calls that succeeded.
  // The stale ranks `plan` includes, for error messages (empty: none), and as they are.
  std::string StaleMembers(const balancer::Plan& plan) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<int> StaleMembersOf(const balancer::Plan& plan) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

template <typename Fn>
void Node::ForEachArena(Fn fn) const {
  MutexLock lock(&mu_);
  for (int r = first_; r < first_ + hosted_; ++r) fn(r, arenas_[r].data(), layout_, config_);
}

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_NODE_H_
