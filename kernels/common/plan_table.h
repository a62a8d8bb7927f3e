// PlanTable: the byte layout of one plan's routing table, as the data plane reads it (host
// threads and CUDA kernels alike), and the host-side writer.
//
// Layout (native endianness, all fields 4-byte aligned), for L layers x E experts, at most M
// replicas per expert:
//
//   offset 0   PlanTableHeader (32 bytes): magic, num_layers, num_experts, num_slots,
//              max_replicas, num_ranks, version (u64)
//   offset 32  ExpertRoute[L][E], each 8 + 8 * M bytes:
//                u32 count; u32 reserved; ReplicaRoute replicas[M]
//              ReplicaRoute = { u32 slot; u32 cumulative share upper bound in 1/2^32 }
//   then       u32 excluded[(num_ranks + 31) / 32]: bit r set = rank r is out of the group
//              (num_ranks 0: no mask, every rank takes part)
//
// A replica j of expert e is chosen by a 32-bit hash u when u < cum[j] and u >= cum[j - 1];
// the last replica's bound is 2^32 - 1 and takes every u above the others (so shares are
// honoured to 2^-32). Zero-share replicas are left out of the routes, so they are never chosen. Tables are immutable once written:
// a new plan goes to the inactive buffer of a double-buffered pair (the daemon's job).
// Thread-compatible; the read functions are usable from device code.
#ifndef UBEP_KERNELS_COMMON_PLAN_TABLE_H_
#define UBEP_KERNELS_COMMON_PLAN_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/common/host_device.h"

namespace ubep::kernels {

inline constexpr uint32_t kPlanTableMagic = 0x50424555;  // "UEBP"

struct PlanTableHeader {
  uint32_t magic;
  uint32_t num_layers;
  uint32_t num_experts;
  uint32_t num_slots;
  uint32_t max_replicas;
  uint32_t num_ranks;  // Of the exclusion mask; 0 = no mask.
  uint64_t version;
};
static_assert(sizeof(PlanTableHeader) == 32);

struct ReplicaRoute {
  uint32_t slot;
  uint32_t cum_share;  // Upper bound of this replica's hash range, exclusive; last = 2^32 - 1.
};

struct ExpertRoute {
  uint32_t count;
  uint32_t reserved;
  // ReplicaRoute replicas[max_replicas] follow.
};

UBEP_HD inline size_t ExpertRouteBytes(uint32_t max_replicas) {
  return sizeof(ExpertRoute) + sizeof(ReplicaRoute) * max_replicas;
}

UBEP_HD inline size_t PlanMaskWords(uint32_t num_ranks) { return (size_t{num_ranks} + 31) / 32; }

UBEP_HD inline size_t PlanRoutesEnd(uint32_t num_layers, uint32_t num_experts,
                                    uint32_t max_replicas) {
  return sizeof(PlanTableHeader) +
         static_cast<size_t>(num_layers) * num_experts * ExpertRouteBytes(max_replicas);
}

UBEP_HD inline size_t PlanTableBytes(uint32_t num_layers, uint32_t num_experts,
                                     uint32_t max_replicas, uint32_t num_ranks) {
  return PlanRoutesEnd(num_layers, num_experts, max_replicas) +
         sizeof(uint32_t) * PlanMaskWords(num_ranks);
}

// The size of a table from its header.
UBEP_HD inline size_t PlanTableBytes(const PlanTableHeader* table) {
  return PlanTableBytes(table->num_layers, table->num_experts, table->max_replicas,
                        table->num_ranks);
}

// Whether `rank` is out of the group under this plan.
UBEP_HD inline bool RankExcluded(const PlanTableHeader* table, uint32_t rank) {
  if (rank >= table->num_ranks) return false;
  const auto* mask = reinterpret_cast<const uint32_t*>(
      reinterpret_cast<const unsigned char*>(table) +
      PlanRoutesEnd(table->num_layers, table->num_experts, table->max_replicas));
  return (mask[rank / 32] >> (rank % 32)) & 1u;
}

UBEP_HD inline const ExpertRoute* FindRoute(const PlanTableHeader* table, uint32_t layer,
                                            uint32_t expert) {
  const auto* base = reinterpret_cast<const unsigned char*>(table) + sizeof(PlanTableHeader);
  return reinterpret_cast<const ExpertRoute*>(
      base + (static_cast<size_t>(layer) * table->num_experts + expert) *
                 ExpertRouteBytes(table->max_replicas));
}

UBEP_HD inline const ReplicaRoute* Replicas(const ExpertRoute* route) {
  return reinterpret_cast<const ReplicaRoute*>(route + 1);
}

// The slot that serves hash `u` of this expert.
UBEP_HD inline uint32_t ChooseSlot(const ExpertRoute* route, uint32_t u) {
  const ReplicaRoute* replicas = Replicas(route);
  for (uint32_t j = 0; j + 1 < route->count; ++j) {
    if (u < replicas[j].cum_share) return replicas[j].slot;
  }
  return replicas[route->count - 1].slot;
}

// One layer of a plan as the balancer produces it: the expert of each slot and that slot's
// share of its expert's traffic.
struct LayerRouting {
  std::span<const int> slot_expert;
  std::span<const double> slot_share;
};

// Writes a table. Errors (InvalidArgument): layers of different slot counts, an expert id
// outside [0, num_experts), an expert with no replica of positive share, shares not summing
// to 1 within 1e-6, an excluded rank outside [0, num_ranks), slots that do not divide among
// num_ranks, a positive share on a slot of an excluded rank. `num_ranks` 0 writes no mask.
absl::StatusOr<std::vector<std::byte>> BuildPlanTable(uint64_t version, uint32_t num_experts,
                                                      std::span<const LayerRouting> layers,
                                                      uint32_t num_ranks = 0,
                                                      std::span<const int> excluded = {});

// The most slots a table may have (1024 ranks of 4096 slots): what validation sizes from it.
inline constexpr uint32_t kMaxPlanSlots = 1u << 22;

// Checks a table read from shared memory before use: magic, sizes (computed without
// wrapping), counts and slots in range, and no route to a slot of an excluded rank.
absl::Status ValidatePlanTable(std::span<const std::byte> bytes);

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_PLAN_TABLE_H_
