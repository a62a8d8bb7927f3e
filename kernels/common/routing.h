// Routing decisions shared by both backends: which replica serves a (source rank, token, k)
// pair, and the byte layout of a dispatch record. Every function here is deterministic, so the
// host backend and the CUDA kernels place every byte the same way.
#ifndef UBEP_KERNELS_COMMON_ROUTING_H_
#define UBEP_KERNELS_COMMON_ROUTING_H_

#include <cstdint>

#include "kernels/common/host_device.h"
#include "kernels/common/plan_table.h"

namespace ubep::kernels {

// A 32-bit hash of the pair's identity (murmur3 finalizer over the four words), uniform enough
// that a replica with share s receives s of its expert's pairs up to sampling noise.
UBEP_HD inline uint32_t RouteHash(uint32_t src_rank, uint32_t token, uint32_t k,
                                  uint32_t expert) {
  uint32_t h = 0x9747b28cu;
  const uint32_t words[4] = {src_rank, token, k, expert};
  for (uint32_t w : words) {
    w *= 0xcc9e2d51u;
    w = (w << 15) | (w >> 17);
    w *= 0x1b873593u;
    h ^= w;
    h = (h << 13) | (h >> 19);
    h = h * 5 + 0xe6546b64u;
  }
  h ^= 16;
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The physical slot p = rank * slots_per_rank + i that receives pair (t, k) of expert e.
UBEP_HD inline uint32_t RouteSlot(const PlanTableHeader* plan, uint32_t layer, uint32_t src_rank,
                                  uint32_t token, uint32_t k, uint32_t expert) {
  return ChooseSlot(FindRoute(plan, layer, expert), RouteHash(src_rank, token, k, expert));
}

// A token lists each expert at most once (masked entries, -1, may repeat): the j < k whose
// expert is entry k's, or -1 when entry k is the first of its expert. Distinct experts take
// distinct slots (a plan table gives each slot one expert), so a token's pairs at one rank
// are at most min(top_k, slots_per_rank), which bounds the receive side (MaxPairsPerToken).
UBEP_HD inline int RepeatedEntry(const int32_t* token_experts, int k) {
  const int32_t e = token_experts[k];
  if (e < 0) return -1;
  for (int j = 0; j < k; ++j) {
    if (token_experts[j] == e) return j;
  }
  return -1;
}

// The most pairs one source token sends one rank: the receive side holds at most
// ranks x max_tokens x this many rows.
UBEP_HD inline int MaxPairsPerToken(int top_k, int slots_per_rank) {
  return top_k < slots_per_rank ? top_k : slots_per_rank;
}

// One token's record in a destination's dispatch landing: which source token it is and, for
// each of its pairs that this destination serves (in k order), the local slot and weight.
// Fixed size for a given top-k: 8 + 8 * top_k bytes.
struct RecordHeader {
  int32_t token;
  int32_t num_entries;
};
struct RecordEntry {
  int32_t local_slot;
  float weight;
};

// A record's header as a receiver takes it: its token within the source's max_tokens (it is
// handed to the caller as src_token) and its entries within [1, max_entries]
// (MaxPairsPerToken). Both backends check every record so (CorruptRecordsWhat words a miss).
UBEP_HD inline bool RecordHeaderInRange(const RecordHeader& header, int max_tokens,
                                        int max_entries) {
  return header.token >= 0 && header.token < max_tokens && header.num_entries >= 1 &&
         header.num_entries <= max_entries;
}

UBEP_HD inline uint32_t RecordBytes(uint32_t top_k) {
  return sizeof(RecordHeader) + sizeof(RecordEntry) * top_k;
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_ROUTING_H_
