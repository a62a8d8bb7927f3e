// Node: the state ubepd keeps for its node: the EP group its serving processes form, one
// arena per rank, the plan in force, and which rank is attached by whom.
//
// A rank's life: Attach (shape checked against the group; the first attach creates the group
// and its arenas) -> the client takes its arenas' fds from the fd socket with the attach token
// (ClaimArenas; the connection stays open) -> Join (waits until every rank of the group has
// joined; then the group forms: signal words reset, generation + 1) -> dispatch and combine
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
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "balancer/core/plan.h"
#include "common/mutex.h"
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
  absl::Duration wait_timeout = absl::Seconds(10);   // Data-plane waits.
  absl::Duration join_timeout = absl::Seconds(60);   // Longest Join wait.
  absl::Duration ticket_timeout = absl::Seconds(10); // Attach token unclaimed -> rank free.
  int free_buffers = 2;                       // Weight buffers per layer beyond the slots.
  uint64_t max_arena_bytes = uint64_t{16} << 30;  // Per rank.
  std::string plan_path;                      // Static plan JSON; empty = round-robin.
};

// What the metrics need, copied under the lock.
struct NodeSnapshot {
  bool has_group = false;
  int world_size = 0;
  int attached = 0;             // Ranks whose client holds its arenas.
  int joining = 0;              // Ranks waiting in Join for the group to form.
  uint64_t arena_bytes = 0;     // All arenas.
  uint64_t generation = 0;
  uint64_t plan_version = 0;
  bool draining = false;
  int num_layers = 0, slots_per_rank = 0;
  std::vector<bool> rank_up;    // Per rank: attached and connected.
};

class Node {
 public:
  explicit Node(NodeOptions options);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& request);
  // For the fd socket: the arenas' fds (in AttachResponse.arena_ranks order) for a valid,
  // unclaimed token; marks the rank connected. `connection` identifies the fd connection.
  absl::StatusOr<std::vector<int>> ClaimArenas(const std::string& token, int64_t connection);
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request, absl::Time deadline);
  absl::Status Detach(const v1::DetachRequest& request);
  absl::StatusOr<v1::GetPlanResponse> GetPlan() const;
  absl::StatusOr<v1::ReportStepResponse> ReportStep(const v1::ReportStepRequest& request);
  // The fd connection `connection` closed: if it still holds a rank, that rank is gone.
  void ConnectionClosed(int64_t connection);

  // The two-phase plan commit, daemon side (ARCHITECTURE section 5). Prepare stages the
  // weights of experts new to a slot into free weight buffers (copied from a slot of this
  // node that holds the expert under the plan in force, the same rank first), writes the
  // slot -> buffer map and the plan table into the inactive buffers, and answers Prepared
  // (or Failed with the reason). Commit and Abort decide; both are idempotent.
  v1::PrepareResponse Prepare(const balancer::Plan& plan, uint64_t effective_step);
  absl::Status Commit(uint64_t version);
  absl::Status Abort(uint64_t version);
  v1::DaemonState State() const;
  // Received pairs per [layer][global slot] since the group was created (all hosted ranks).
  absl::StatusOr<std::vector<std::vector<uint64_t>>> ReadSlotLoads() const;
  // What a load report names of the plan in force: version, experts, model layer ids
  // (without copying the plan itself).
  struct PlanIdentity {
    uint64_t version = 0;
    int num_experts = 0;
    std::vector<int> layer_ids;
  };
  PlanIdentity CommittedPlanIdentity() const;
  // Highest step any rank has begun; the group's shape (nullopt without a group).
  uint64_t MaxStep() const;
  std::optional<v1::AttachRequest> GroupShape() const;
  int free_buffers() const { return options_.free_buffers; }

  // Stops new attaches and joins and fails every data-plane wait with "draining".
  void Drain();
  // Waits until no rank is attached, at most `timeout`; returns whether none is.
  bool AwaitDetached(absl::Duration timeout);

  NodeSnapshot Snapshot() const;
  // Received pairs per [layer][rank] (the load counters summed over each rank's slots);
  // empty without a group.
  absl::StatusOr<std::vector<std::vector<uint64_t>>> ReadLoads() const;
  // Calls fn(rank, arena base, layout, config) for each arena, under the lock (the harvester
  // reads counters; arenas never move while the group exists).
  template <typename Fn>
  void ForEachArena(Fn fn) const;

 private:
  enum class RankState { kFree, kAttached, kConnected };
  struct RankEntry {
    RankState state = RankState::kFree;
    std::string token;
    uint32_t pid = 0;
    absl::Time ticket_deadline;
    int64_t connection = -1;
    bool joining = false;
    std::optional<uint64_t> next_step;
    uint64_t step = 0;
  };

  absl::Status CheckShape(const v1::AttachRequest& request) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CreateGroup(const v1::AttachRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckToken(uint32_t rank, const std::string& token, bool need_connected) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank left a group that may be running: stop every wait, naming it.
  void BreakGroup(int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FormGroup() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetGroupState(uint32_t state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int AttachedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MaxStepLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Index (0 or 1) of the plan buffer holding `version` in rank 0's plan area; -1 if none.
  int PlanBufferOf(uint64_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CopyWeights(int from_rank, uint32_t from_buffer, int to_rank, uint32_t to_buffer,
                           int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  std::vector<kernels::SharedArena> arenas_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<DeviceMemory>> device_arenas_ ABSL_GUARDED_BY(mu_);  // CUDA.
  std::vector<RankEntry> ranks_ ABSL_GUARDED_BY(mu_);
  balancer::Plan plan_ ABSL_GUARDED_BY(mu_);               // Newest committed.
  uint64_t plan_effective_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<balancer::Plan> pending_ ABSL_GUARDED_BY(mu_);  // Prepared, undecided.
  uint64_t pending_effective_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t resume_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool group_ready_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename Fn>
void Node::ForEachArena(Fn fn) const {
  MutexLock lock(&mu_);
  for (size_t r = 0; r < arenas_.size(); ++r) {
    fn(static_cast<int>(r), arenas_[r].data(), layout_, config_);
  }
}

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_NODE_H_
