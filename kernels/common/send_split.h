// How the ubep sender role splits a dispatch among its senders (the host backend's sender
// threads, the CUDA backend's sender blocks), shared so that both split the same way.
//
// A unit is one row store: (token, destination). Units are numbered token-major: token 0's
// destinations, then token 1's, and so on, each token's destinations in visiting order
// (VisitOrder). Sender i of n takes the contiguous units [SplitBegin(i), SplitBegin(i + 1))
// of each batch (below), so any two senders differ by at most one unit, and since a token of
// a top-k router goes to several ranks, every sender's share mixes destinations instead of
// one sender owning one peer; the visiting order puts near and far destinations in turn where
// the domain spans several nodes (EpConfig::near_ranks).
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
// `units`). Shares are floor or ceiling of units / senders, the larger ones spread among the
// smaller (10 units over 4 senders: 2, 3, 2, 3).
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

// The order in which a source rank visits its destinations: every other rank once, then
// itself (position num_ranks - 1). Ranks form one-hop neighbourhoods of `near_ranks`
// consecutive ranks (a node: ranks [g x near_ranks, (g + 1) x near_ranks), the last one
// possibly smaller); a destination outside the source's is a hop further (another node of the
// load/store domain). near_ranks 0, or the whole group, makes every destination near.
//  - Near and far destinations take turns in proportion to their numbers: of the first p
//    positions, floor(p x near / (num_ranks - 1)) are near, so a stretch of a sender's units
//    keeps both kinds of link busy instead of one after the other.
//  - Near destinations start after the source and wrap within its neighbourhood; far ones
//    start at a point spread by the source's place in its neighbourhood, so ranks neither all
//    store into the same peer nor all cross to the same node at once.
// With every destination near this is rank + 1, rank + 2, ..., rank (mod num_ranks).
class VisitOrder {
 public:
  VisitOrder() = default;
  UBEP_HD VisitOrder(int rank, int num_ranks, int near_ranks) : rank_(rank), ranks_(num_ranks) {
    const int g = near_ranks > 0 && near_ranks < num_ranks ? near_ranks : num_ranks;
    begin_ = rank / g * g;
    end_ = begin_ + g < num_ranks ? begin_ + g : num_ranks;
    near_ = end_ - begin_ - 1;
    far_ = num_ranks - (end_ - begin_);
    // In 64 bits: (R / 2)^2 passes 2^31 for the largest groups a configuration allows.
    far_start_ = far_ > 0 ? static_cast<int>(int64_t{rank - begin_} * far_ / (end_ - begin_)) : 0;
  }

  // The destination at `position`, in [0, num_ranks).
  UBEP_HD int Dest(int position) const {
    const int64_t m = ranks_ - 1;
    if (position >= m) return rank_;
    const int before = static_cast<int>(position * int64_t{near_} / m);  // Near ones before.
    if ((position + 1) * int64_t{near_} / m > before) {
      return begin_ + (rank_ - begin_ + 1 + before) % (near_ + 1);
    }
    const int q = (far_start_ + position - before) % far_;
    return q < ranks_ - end_ ? end_ + q : q - (ranks_ - end_);
  }

  // The position of `dest`: Dest(Position(d)) == d.
  UBEP_HD int Position(int dest) const {
    const int64_t m = ranks_ - 1;
    if (dest == rank_) return static_cast<int>(m);
    if (dest >= begin_ && dest < end_) {
      const int i = (dest - rank_ - 1 + 2 * (near_ + 1)) % (near_ + 1);
      return static_cast<int>(((i + 1) * m + near_ - 1) / near_) - 1;
    }
    const int q = dest >= end_ ? dest - end_ : dest + (ranks_ - end_);
    const int j = (q - far_start_ + far_) % far_;
    return static_cast<int>(j * m / far_);
  }

 private:
  int rank_ = 0, ranks_ = 1;
  int begin_ = 0, end_ = 1;      // The neighbourhood, the source included.
  int near_ = 0, far_ = 0;       // Destinations other than the source, near and far.
  int far_start_ = 0;            // Index in the far ranks (those after end_, wrapping) of the first.
};

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
