// How the ubep sender role splits a dispatch among its senders (the host backend's sender
// threads, the CUDA backend's sender blocks), shared so that both split the same way.
//
// A unit is one row store: (token, destination). Units are numbered token-major: token 0's
// destinations, then token 1's, and so on, each token's destinations in visiting order
// (VisitPosition). Sender i of n takes the contiguous units [SplitBegin(i), SplitBegin(i + 1))
// of each batch (below), so any two senders differ by at most one unit, and since a token of
// a top-k router goes to several ranks, every sender's share mixes destinations instead of
// one sender owning one peer (on a single machine, or a single NVLink domain, every
// destination is one hop away; the visiting order is where a topology with hops would put
// near and far destinations in turn).
//
// A destination's data is complete when counting is done and every sender that stored into it
// is done. Each sender adds the units it stored for destination d to a per-destination count,
// and the counting role, when it has counted every token, adds kCountedBias; whoever's
// addition brings the count to kCountedBias plus d's record total publishes d (its dispatch
// flag; the record count went out before the rows, with its count flag). The additions are
// acquire-release read-modify-writes, so the counting role's record total and every earlier
// sender's stores happen before the publishing flag (docs/dataplane.md, "Memory ordering").
// A destination with no record is published by the counting role at once.
#ifndef UBEP_KERNELS_COMMON_SEND_SPLIT_H_
#define UBEP_KERNELS_COMMON_SEND_SPLIT_H_

#include <cstdint>

#include "kernels/common/host_device.h"

namespace ubep::kernels {

// First unit of sender i when `units` units are split among `senders` (i == senders gives
// `units`). Shares are floor or ceiling of units / senders, the larger ones last.
UBEP_HD inline int64_t SplitBegin(int64_t units, int senders, int i) {
  return units * i / senders;
}

// Counting runs ahead of sending in batches of tokens: batch b holds tokens
// [b * BatchTokens(T), (b + 1) * BatchTokens(T)) of a dispatch of T tokens. After counting
// batch b, the counting role hands the senders the units up to BatchEnd: every unit of the
// batch's tokens and the earlier ones, rounded down to a multiple of the senders except after
// the last batch. Each sender takes its SplitBegin share of every batch's units, so the shares
// are equal in every batch but the last, and any two senders still differ by at most one unit
// over the whole dispatch.
constexpr int kMaxSendBatches = 16;
constexpr int64_t kCountedBias = int64_t{1} << 40;  // Above any unit count.
constexpr int kMinBatchTokens = 32;
UBEP_HD inline int BatchTokens(int num_tokens) {
  const int even = (num_tokens + kMaxSendBatches - 1) / kMaxSendBatches;
  return even < kMinBatchTokens ? kMinBatchTokens : even;
}
UBEP_HD inline int NumBatches(int num_tokens) {
  return (num_tokens + BatchTokens(num_tokens) - 1) / BatchTokens(num_tokens);
}
// `units_so_far`: the units of the tokens of batches 0 .. b.
UBEP_HD inline int64_t BatchEnd(int64_t units_so_far, bool last_batch, int senders) {
  return last_batch ? units_so_far : units_so_far / senders * senders;
}
// First unit of sender i's share of the batch [batch_begin, batch_end) (i == senders gives
// batch_end).
UBEP_HD inline int64_t ShareBegin(int64_t batch_begin, int64_t batch_end, int senders, int i) {
  return batch_begin + SplitBegin(batch_end - batch_begin, senders, i);
}

// A source rank visits destinations starting after itself (rank + 1, rank + 2, ..., rank), so
// that ranks do not all store into the same peer at the same moment.
UBEP_HD inline int VisitPosition(int rank, int dest, int num_ranks) {
  return (dest - rank - 1 + 2 * num_ranks) % num_ranks;
}
UBEP_HD inline int VisitDest(int rank, int position, int num_ranks) {
  return (rank + 1 + position) % num_ranks;
}

// The token holding unit u, given unit_begin[t] = first unit of token t (non-decreasing,
// unit_begin[0] = 0, unit_begin[num_tokens] = all units, u below that): the largest t with
// unit_begin[t] <= u and a unit of its own.
UBEP_HD inline int TokenOfUnit(const int32_t* unit_begin, int num_tokens, int64_t u) {
  int lo = 0, hi = num_tokens - 1;  // unit_begin[lo] <= u < unit_begin[hi + 1].
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (unit_begin[mid] <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_SEND_SPLIT_H_
