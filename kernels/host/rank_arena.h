// RankArena: everything of one rank that lives in shared memory, as ubepd lays it out and a
// serving process (libubep) maps it. Offsets from the arena's base, each part 4096-aligned:
//
//   control    4096 B    RankControl: the group's state (daemon writes) and the rank's
//                        counters and latency histograms (its client writes)
//   ep         ArenaLayout(config).total_bytes: signals, counts, load counters, token rows
//   plan       PlanAreaBytes(plan_capacity): double-buffered, versioned plan tables
//   slot_map   2 x L x S x u32: per plan buffer, the weight buffer of each (layer, local slot)
//   weights    L x (S + F) x weight_stride: expert weights; F free buffers per layer take
//              the experts a new plan brings, so no weights are overwritten while the old
//              plan may still read them
//
// On the CUDA backend ep and weights live in a second, device arena (VMM memory exported as
// an fd), at device_ep = 0 and device_weights; the host arena keeps control, plan and
// slot_map (ep_bytes is still the data-plane region's size, ep and weights are 0 there).
//
// The daemon sends these offsets to clients (ubep.v1.ArenaLayout); both sides compute them
// here. Words shared between processes are accessed through std::atomic_ref.
#ifndef UBEP_KERNELS_HOST_RANK_ARENA_H_
#define UBEP_KERNELS_HOST_RANK_ARENA_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "kernels/host/arena_layout.h"

namespace ubep::kernels {

inline constexpr uint32_t kRankControlMagic = 0x43524255;  // "UBRC"
inline constexpr uint32_t kRankArenaVersion = 8;
inline constexpr uint64_t kNoNextStep = ~uint64_t{0};
// In RankControl::join_ticket: the lead daemon took the ticket into the generation it formed
// (a compare-and-swap, as is a Join's withdrawal of its ticket: one of the two wins).
inline constexpr uint64_t kTicketClaimed = uint64_t{1} << 63;

// RankControl::group_state.
enum GroupState : uint32_t {
  kGroupForming = 0,   // Waiting for every rank to join.
  kGroupReady = 1,     // Dispatch and combine may run.
  kGroupBroken = 2,    // A rank left; the survivors must join again.
  kGroupDraining = 3,  // The daemon is shutting down; detach.
};

// Latency histogram buckets (upper bounds, seconds): 10 us to ~9.3 s, x2.5 apart, plus +Inf.
inline constexpr int kLatencyBuckets = 16;
inline constexpr double kLatencyBucketBase = 10e-6;
inline constexpr double kLatencyBucketFactor = 2.5;

struct LatencyHistogram {
  uint64_t bucket[kLatencyBuckets + 1];  // Non-cumulative; the last is +Inf.
  uint64_t count;
  uint64_t sum_ns;
};

// Index of the bucket for a duration.
int LatencyBucket(double seconds);

struct alignas(64) RankControl {
  // Line 0: identity and the group, written by the daemon.
  uint32_t magic;
  uint32_t version;
  uint32_t rank;
  uint32_t world_size;
  uint64_t generation;    // Bumped each time the group forms.
  uint32_t group_state;   // GroupState.
  // The data-plane settings the arena is laid out and run for (FormatRankArena), which come
  // from the daemon's flags rather than from the clients' shape: a daemon maps a peer's arenas
  // only if they match its own (DataPlaneSettingsDiffer).
  uint16_t protocol;   // kernels::Protocol.
  uint16_t on_device;  // 1: the CUDA backend (ep and weights in the device arena).
  // Group formation, between the daemons of a group (every daemon maps every arena): the
  // rank's daemon writes next_step, then join_ticket = (rank 0's generation) + 1 when the
  // rank joins; the daemon of rank 0 forms generation g + 1 once every rank's ticket is
  // g + 1, writing resume_step (the least next_step) before the generation words, then
  // claims every ticket (kTicketClaimed).
  uint64_t join_ticket;
  uint64_t next_step;     // kNoNextStep: the rank did not say.
  uint64_t resume_step;
  uint32_t flagged_tokens;     // EpConfig::flagged_tokens.
  uint32_t buffers_per_layer;  // RankArenaLayout::buffers_per_layer.
  // From line 1: written only by the rank's client; monotonic counters.
  uint64_t step;                // Last step begun.
  uint64_t steps;               // Steps begun.
  uint64_t dispatched_tokens;   // Tokens given to dispatch.
  uint64_t dispatch_calls;
  uint64_t combine_calls;
  uint64_t wait_timeouts;       // Data-plane waits that gave up.
  uint64_t errors[17];          // Errors returned to the caller, by absl::StatusCode.
  uint64_t decision_waits;      // Steps that began waiting for an undecided plan.
  uint64_t decision_wait_ns;    // Time spent so.
  // Dispatch and combine calls that failed because a rank of the group was routed more rows
  // than its receive capacity (one per call: the overflowed rank's Dispatch, the others'
  // Combine). errors[RESOURCE_EXHAUSTED] also counts, say, a Rejoin out of device memory.
  uint64_t over_capacity_calls;
  // 1 once the client said the weights of every slot of its plan are in place
  // (Rank::WeightsLoaded); 0 in new arenas. ubepd reads a restarted daemon's weights for
  // another domain (the copy of last resort, ReadWeightsRequest.require_loaded) only then.
  uint64_t weights_loaded;
  LatencyHistogram dispatch_latency;
  LatencyHistogram combine_latency;
};
static_assert(sizeof(RankControl) <= 4096);
static_assert(offsetof(RankControl, step) == 64, "daemon-written words fill line 0");

struct RankArenaLayout {
  size_t control = 0;
  size_t ep = 0, ep_bytes = 0;
  size_t plan = 0, plan_capacity = 0;
  size_t slot_map = 0;
  size_t weights = 0, weight_stride = 0;
  uint32_t buffers_per_layer = 0;
  size_t total_bytes = 0;
  // CUDA backend: the device arena (0 bytes on the host backend).
  bool on_device = false;
  size_t device_weights = 0;
  size_t device_bytes = 0;

  // `bytes_per_expert` may be 0 (no weights); `free_buffers` per layer for migration;
  // `on_device`: data plane and weights in a device arena (CUDA backend).
  static RankArenaLayout Compute(const EpConfig& config, size_t bytes_per_expert,
                                 int free_buffers, bool on_device = false);
  // The expert weights' bytes of that layout (layers x buffers x the 64-byte aligned expert),
  // or nullopt where they do not fit in a size_t: a caller refuses that shape before Compute.
  static std::optional<size_t> WeightBytes(const EpConfig& config, size_t bytes_per_expert,
                                           int free_buffers);
  bool operator==(const RankArenaLayout&) const = default;
};

// The largest plan table for a config: an expert can have at most
// num_slots - num_experts + 1 replicas.
size_t MaxPlanTableBytes(const EpConfig& config);

// Formats a zero-filled arena: control identity, an empty plan area, slot map identity
// (slot i -> buffer i under both plan buffers).
void FormatRankArena(std::byte* base, const RankArenaLayout& layout, const EpConfig& config,
                     int rank);

// "" if a peer's arena `peer` (its RankControl) is laid out and run for the data-plane
// settings of `layout` and `config`; else what differs, both ways, for an error message.
std::string DataPlaneSettingsDiffer(const RankControl& peer, const RankArenaLayout& layout,
                                    const EpConfig& config);

inline RankControl* ControlOf(std::byte* base, const RankArenaLayout& layout) {
  return reinterpret_cast<RankControl*>(base + layout.control);
}

// slot_map[plan_buffer][layer][local_slot].
inline uint32_t* SlotMap(std::byte* base, const RankArenaLayout& layout, const EpConfig& config,
                         int plan_buffer) {
  return reinterpret_cast<uint32_t*>(base + layout.slot_map) +
         static_cast<size_t>(plan_buffer) * config.num_layers * config.slots_per_rank;
}

// `base`: the host arena, or on the CUDA backend the device arena.
inline std::byte* WeightBuffer(std::byte* base, const RankArenaLayout& layout, int layer,
                               uint32_t buffer) {
  return base + (layout.on_device ? layout.device_weights : layout.weights) +
         (static_cast<size_t>(layer) * layout.buffers_per_layer + buffer) * layout.weight_stride;
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_RANK_ARENA_H_
