#include "kernels/cuda/cuda_ep.h"
#include "kernels/cuda/copy_now.h"
#include "kernels/cuda/scoped_device.h"

#include <cuda_runtime.h>

#include <algorithm>

#include <cub/block/block_scan.cuh>
#include <cuda/atomic>

#include "absl/strings/str_cat.h"
#include "kernels/common/bad_input.h"
#include "kernels/common/bf16.h"
#include "kernels/common/corrupt_records.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/common/routing.h"
#include "kernels/common/send_split.h"

namespace ubep::kernels {
namespace {

constexpr int kThreads = 256;
// Words of Params::status.
constexpr int kStatusBadPair = 0;    // 0, or ~(t * K + k) of the first bad pair (FlagBadPair).
constexpr int kStatusWaitEnded = 1;  // 0, or 1 + the peer a wait gave up on (abort word set).
constexpr int kStatusStalled = 2;    // 1: a SendKernel block waited past the timeout for another.
constexpr int kStatusWaitPhase = 3;  // The phase of the wait that ended: kPhase*.
constexpr int kStatusRowsOver = 4;   // 0, or the rows routed here when more than max_rows.
constexpr int kStatusWaitLate = 5;   // 1: the wait that ended passed the deadline.
// Combine: 0, or R - d for the lowest rank d of the group that overflowed its receive
// capacity in this call (OverflowKernel).
constexpr int kStatusPeerOver = 6;
// Dispatch: the abort word as GateKernel found it before the call's first store; not 0: the
// group gave up in an earlier call, and no kernel of this call does anything.
constexpr int kStatusRefused = 7;
// Dispatch: 0, or R - s for the lowest source s whose records in this rank's landing are
// corrupt (CountKernel: a count, an entry count or a slot out of range); ScanKernel raises the
// abort word naming s, and no later kernel of the call reads a byte of any source.
constexpr int kStatusCorrupt = 8;
constexpr int kStatusWords = 9;
constexpr uint32_t kPhaseAsCalled = 1;  // Named by the call (CheckStatus's `what`).
constexpr uint32_t kPhaseCounts = 2;    // ubep's wait for the sources' counts: "dispatch counts".
constexpr uint32_t kPhaseCountExchange = 3;  // bsp's count exchange: "count exchange".
constexpr uint32_t kPhaseBarrier = 4;        // bsp's barriers: "barrier".
// The phase of a wait as the host backend names it.
const char* PhaseName(uint32_t phase, const char* as_called) {
  switch (phase) {
    case kPhaseCounts: return "dispatch counts";
    case kPhaseCountExchange: return "count exchange";
    case kPhaseBarrier: return "barrier";
    default: return as_called;
  }
}
// Sender blocks of a dispatch (send_split.h). A few dozen SMs saturate NVLink stores, as in
// DeepEP's normal kernels; a block with an empty share exits at once.
constexpr int kSenderBlocks = 32;
// SendKernel's counting blocks, at most: each takes every C-th destination.
constexpr int kCountBlocks = 32;
// Blocks per SM of the kernels that spread over every received row or record.
constexpr int kWideBlocksPerSm = 4;
// Blocks per SM that the kernels polling flag-in-granule rows or partials (CopyKernel over
// flagged sources, TokenKernel of a flagged call) may hold, summed over the ranks that share
// this GPU. A polling block keeps its SM slot until its peer's stores land, and ranks sharing
// a GPU (MPS, or contexts of one process) share its slots: were the pollers to take every
// slot, the peer's kernels that make those stores could not start. At most 2 of the 4 or more
// blocks an SM holds of any kernel here (56 registers x 256 threads at the most) leaves room
// for the rest, SendKernel's co-resident grid included.
constexpr int kPollBlocksPerSm = 2;

#define UBEP_CUDA_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                   \
    cudaError_t ubep_cuda_error_ = (expr);                                               \
    if (ubep_cuda_error_ != cudaSuccess) {                                               \
      return absl::InternalError(absl::StrCat(__FILE__, ":", __LINE__, ": " #expr ": ",  \
                                              cudaGetErrorString(ubep_cuda_error_)));    \
    }                                                                                    \
  } while (0)

// As UBEP_CUDA_RETURN_IF_ERROR, in a CudaEp call that took its epoch (the peers wait for this
// rank in it): the error goes through FailedAfterTakingPart, which tells them.
#define UBEP_CUDA_FAIL_CALL_IF_ERROR(expr)                                               \
  do {                                                                                   \
    cudaError_t ubep_cuda_error_ = (expr);                                               \
    if (ubep_cuda_error_ != cudaSuccess) {                                               \
      return FailedAfterTakingPart(absl::InternalError(                                  \
          absl::StrCat(__FILE__, ":", __LINE__, ": " #expr ": ",                         \
                       cudaGetErrorString(ubep_cuda_error_))));                          \
    }                                                                                    \
  } while (0)

// Everything a kernel needs, passed by value.
struct Params {
  int rank, num_ranks, max_tokens, hidden, top_k, slots_per_rank, num_experts, num_tokens, layer;
  int max_rows;  // Receive rows the scratch holds: ReceiveCapacity (EpConfig::max_recv_rows).
  int flagged_tokens;  // EpConfig::flagged_tokens: the records a flagged source may store.
  VisitOrder visit;  // The order this rank visits destinations in (send_split.h).
  size_t record_bytes, row_bytes;
  size_t row_stride;  // Bytes per source (destination) of rows (partials): ArenaLayout.
  size_t flagged_offset;  // Where the flagged rows start in a source's part: ArenaLayout.
  size_t off_abort;
  size_t off_notices;  // ArenaLayout::notices: each rank's ReceiveNotice (arena_layout.h).
  // The word where a rank marks the last call of this kind (dispatch or combine) it completed
  // (ArenaLayout::dispatch_completed or combine_completed; arena_layout.h MarkCompleted).
  size_t off_completed;
  bool bsp;  // Protocol::kBsp: count exchange and barriers, no per-destination flags.
  // This rank's call stores its rows, and gets its partials back, as flag-in-granule rows
  // (flagged_rows.h): no dispatch or combine flags for it, the receivers poll the rows.
  bool flagged;
  size_t off_count_flag, off_barrier_flag;
  size_t off_dispatch_flag, off_combine_flag, off_counts, off_load_counters, off_load_seq, off_records,
      off_rows, off_partials;
  std::byte* const* arenas;  // Device array of num_ranks arena pointers.
  const PlanTableHeader* plan;
  const uint16_t* x;
  const int32_t* topk_idx;
  const float* topk_weights;
  uint32_t epoch;
  uint64_t timeout_ns;
  // Tests only (CudaEp::set_row_delay_for_testing, set_partial_delay_for_testing): the sender
  // role waits this long before its first row store, PartialKernel before its first partial
  // (with partial_delay_source >= 0, before that source's partials only).
  uint64_t row_delay_ns, partial_delay_ns;
  int partial_delay_source;
  // Scratch (device).
  int32_t* token_route;   // [max_tokens x R]: record index of token t at destination d, or -1.
  int32_t* unit_begin;    // [max_tokens + 1]: first unit (send_split.h) of each token.
  int32_t* dest_records;  // [R]: records for each destination.
  // Zeroed per dispatch, together: units stored into each destination (plus kCountedBias once
  // counted, send_split.h); SendKernel's counting blocks done with each batch; batches numbered.
  long long* published;    // [R]
  unsigned long long* deadline;  // The call's deadline (%globaltimer ns), set by its first wait.
  int32_t* batch_counted;  // [kMaxSendBatches]
  int32_t* batch_scanned;  // [1]
  int32_t* pair_counts;   // [R x S]: entries from source s for local slot i.
  int32_t* pair_offsets;  // [R x S]: first row of (s, i).
  int32_t* record_begin;  // [R x (max_tokens + 1)]: first entry of each record.
  int32_t* record_token;  // [R x max_tokens]: each record's token, as CountKernel checked it.
  int32_t* entry_row;     // [R x max_tokens x K]: row of each entry, by record_begin.
  int32_t* slot_offsets;  // [S + 1]
  int32_t* record_base;   // [R + 1]: records received before source s's, sources in order.
  int32_t* entry_base;    // [R + 1]: entries (rows) likewise.
  int32_t* combine_done;  // [R]: records of source s whose partials are stored (per combine).
  // [R]: each source's count word as CountKernel read and checked it. Later kernels of the
  // call, and its combine, take the count and the flagged bit from here, not from the arena
  // again (as the host backend keeps what it checked), and PlaceKernel takes each record's
  // checked token from record_token and each entry's checked slot from entry_row, where
  // CountKernel leaves it.
  uint32_t* source_word;
  int32_t* rows_routed;   // [1]: rows the last dispatch routed here (ScanKernel).
  uint32_t* status;       // [kStatusWords]: bad input and ended waits, kept apart so that
                          // a timeout after bad input still stops the rank.
  uint16_t* recv_x;
  int32_t* src_rank;
  int32_t* src_token;
  float* weight;
};

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every thread of the caller waits `ns` nanoseconds (0: not at all); tests only.
__device__ void DelayForTesting(uint64_t ns) {
  if (ns == 0) return;
  const uint64_t until = GlobalTimerNs() + ns;
  while (GlobalTimerNs() < until) __nanosleep(1000);
}

__device__ void ReleaseFlag(uint32_t* flag, uint32_t epoch) {
  cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(*flag).store(epoch,
                                                                     cuda::memory_order_release);
}

__device__ bool FlagReached(uint32_t* flag, uint32_t epoch) {
  const uint32_t v = cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(*flag).load(
      cuda::memory_order_acquire);
  return static_cast<int32_t>(v - epoch) >= 0;
}

// Flag-in-granule rows (flagged_rows.h): 16 bytes of a row go out as two granules, each one
// 64-bit element of a relaxed system-scope vector store. PTX treats the vector as two scalar
// strong accesses, each single-copy atomic, which is all the format needs: a granule's tag
// vouches for its own 4 data bytes and nothing else.
__device__ void StoreGranules(std::byte* to, uint4 v, uint32_t tag) {
  const uint64_t lo0 = Granule(v.x, tag), hi0 = Granule(v.y, tag);
  const uint64_t lo1 = Granule(v.z, tag), hi1 = Granule(v.w, tag);
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(to), "l"(lo0), "l"(hi0)
               : "memory");
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(to + 16), "l"(lo1),
               "l"(hi1)
               : "memory");
}

// The 16 bytes two granule pairs at `from` carry, if all four carry `tag`.
__device__ bool LoadGranules(const std::byte* from, uint32_t tag, uint4* v) {
  uint64_t g0, g1, g2, g3;
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(g0), "=l"(g1)
               : "l"(from)
               : "memory");
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(g2), "=l"(g3)
               : "l"(from + 16)
               : "memory");
  if (GranuleTag(g0) != tag || GranuleTag(g1) != tag || GranuleTag(g2) != tag ||
      GranuleTag(g3) != tag) {
    return false;
  }
  *v = make_uint4(GranuleData(g0), GranuleData(g1), GranuleData(g2), GranuleData(g3));
  return true;
}

using BlockScanInt = cub::BlockScan<int, kThreads>;

// Records (routing.h) as 8-byte words, a record 8-byte aligned in its arena: a header, then its
// entries. (A memcpy of them would go byte by byte, not knowing the alignment.)
static_assert(sizeof(RecordHeader) == 8 && sizeof(RecordEntry) == 8);
__device__ RecordHeader LoadHeader(const std::byte* record) {
  const int2 v = *reinterpret_cast<const int2*>(record);
  return {v.x, v.y};
}
__device__ RecordEntry LoadEntry(const std::byte* record, int q) {
  const int2 v = reinterpret_cast<const int2*>(record)[1 + q];
  return {v.x, __int_as_float(v.y)};
}

// A wait before timed out or saw an abort, or a block of SendKernel stalled (its rows' flags
// stay down: the call fails, and waiting for this rank's own flags would only run out the
// timeout first). Bad input is only flagged: the rank still takes part (its bad pairs were
// left out of the records), so its receive side still lays out what the peers sent and its
// combine can answer them.
// Whether the call stopped before the records are counted (CountKernel reads only these: the
// corrupt word changes while it runs, and a block must not stop half-way on it).
__device__ inline bool StoppedBeforeCount(const Params& p) {
  return p.status[kStatusWaitEnded] != 0 || p.status[kStatusStalled] != 0 ||
         p.status[kStatusRefused] != 0;
}
__device__ inline bool Stopped(const Params& p) {
  return StoppedBeforeCount(p) || p.status[kStatusCorrupt] != 0;
}

// Whether this call raises its flag (dispatch or combine) in `peer`'s arena. Plain calls
// always do; flagged ones only into this rank's own arena (a restarted rank resumes its epochs
// from its own flags) and, every kTagScrubPeriod calls, everywhere: flags compare by signed
// difference modulo 2^32, so a flag left more than 2^31 calls behind by a long run of flagged
// calls would read as reached by the next plain call.
__device__ bool RaisesFlag(const Params& p, int peer, bool flagged) {
  return !flagged || peer == p.rank || TagScrubDue(p.epoch);
}

// Raises d's dispatch flag (ubep): this rank's rows for d are all stored. Called by one thread
// once every row for d is stored and ordered before it (see the callers).
__device__ void PublishDest(const Params& p, int d) {
  __threadfence_system();
  ReleaseFlag(reinterpret_cast<uint32_t*>(p.arenas[d] + p.off_dispatch_flag + p.rank * kFlagStride),
              p.epoch);
}

// Bad input, pair (t, k). Every bad pair of a call is flagged, and the first in (t, k) order
// is the one reported, as the host backend reports it: the word keeps the largest ~(t K + k)
// (0 while none is flagged); CheckStatus words the error from the token's input.
__device__ void FlagBadPair(const Params& p, int t, int k) {
  atomicMax(&p.status[kStatusBadPair], ~static_cast<uint32_t>(t * p.top_k + k));
}

// Counting role, destination d, tokens [first, last), called by every thread of a block:
// each token with a pair routed to d gets its record there (stored into d's arena, in token
// order from record *base on; thread 0 advances *base, in shared memory) and its record index
// in token_route; the others get -1. A rank the plan excludes holds no slot, gets nothing and
// is not touched: its arena may be gone. An expert id out of range is flagged and skipped, and
// so is a pair with a weight that is not finite or an expert the token listed before (by the
// block of the destination it routes to, so each such pair once); skipping repeats keeps every
// token's pairs at one rank within MaxPairsPerToken, the bound the receive scratch is sized by.
__device__ void CountDest(const Params& p, int d, int first, int last, int* base,
                          BlockScanInt::TempStorage& storage) {
  if (RankExcluded(p.plan, static_cast<uint32_t>(d))) {
    for (int t = first + threadIdx.x; t < last; t += blockDim.x) {
      p.token_route[static_cast<size_t>(t) * p.num_ranks + d] = -1;
    }
    __syncthreads();
    return;
  }
  const int S = p.slots_per_rank;
  std::byte* records =
      p.arenas[d] + p.off_records + static_cast<size_t>(p.rank) * p.max_tokens * p.record_bytes;
  for (int chunk = first; chunk < last; chunk += kThreads) {
    const int t = chunk + threadIdx.x;
    RecordEntry entries[kMaxTopK];
    int n = 0;
    if (t < last) {
      for (int k = 0; k < p.top_k; ++k) {
        const int32_t e = p.topk_idx[t * p.top_k + k];
        if (e < -1 || e >= p.num_experts) {
          // Flagged and skipped: no read outside the plan table, no write outside a region.
          FlagBadPair(p, t, k);
          continue;
        }
        if (e < 0) continue;
        const uint32_t slot = RouteSlot(p.plan, p.layer, p.rank, t, k, e);
        if (static_cast<int>(slot) / S == d) {
          const float w = p.topk_weights[t * p.top_k + k];
          if (!isfinite(w)) {
            FlagBadPair(p, t, k);
            continue;
          }
          if (const int j = RepeatedEntry(p.topk_idx + t * p.top_k, k); j >= 0) {
            FlagBadPair(p, t, k);
            continue;
          }
          entries[n++] = {static_cast<int32_t>(slot % S), w};
        }
      }
    }
    int position = 0, total = 0;
    BlockScanInt(storage).ExclusiveSum(n > 0 ? 1 : 0, position, total);
    const int j = *base + position;
    if (n > 0) {
      auto* record = reinterpret_cast<int2*>(records + static_cast<size_t>(j) * p.record_bytes);
      record[0] = make_int2(t, n);
      for (int q = 0; q < n; ++q) {
        record[1 + q] = make_int2(entries[q].local_slot, __float_as_int(entries[q].weight));
      }
    }
    if (t < last) p.token_route[static_cast<size_t>(t) * p.num_ranks + d] = n > 0 ? j : -1;
    __syncthreads();
    if (threadIdx.x == 0) *base += total;
    __syncthreads();
  }
}

// Counting role, one thread, once d's records are stored and the block has synchronized:
// d's record total, stored into d's arena with its count flag (the offsets: bsp's count
// exchange; ubep's receivers lay out their rows from it while the rows are on their way).
// ubep: a destination with no record is published at once; the others get kCountedBias
// (send_split.h), and are published here if the senders were done with them first.
__device__ void FinishDest(const Params& p, int d, int total) {
  if (RankExcluded(p.plan, static_cast<uint32_t>(d))) {
    p.dest_records[d] = 0;
    return;
  }
  p.dest_records[d] = total;
  std::byte* arena = p.arenas[d];
  reinterpret_cast<uint32_t*>(arena + p.off_counts)[p.rank] =
      static_cast<uint32_t>(total) | (p.flagged ? kFlaggedCount : 0u);
  __threadfence_system();  // The records and count precede the flags, the total the bias.
  ReleaseFlag(reinterpret_cast<uint32_t*>(arena + p.off_count_flag + p.rank * kFlagStride),
              p.epoch);
  // bsp publishes with a barrier; flagged rows publish themselves (RaisesFlag).
  if (p.bsp || !RaisesFlag(p, d, p.flagged)) return;
  if (total == 0) {
    PublishDest(p, d);
    return;
  }
  const long long before =
      cuda::atomic_ref<long long, cuda::thread_scope_system>(p.published[d])
          .fetch_add(kCountedBias, cuda::memory_order_acq_rel);
  if (before == total) PublishDest(p, d);
}

// Units of tokens [first, last): unit_begin[t] for each, from *base on, and unit_begin[last]
// (thread 0 advances *base). Called by every thread of one block.
__device__ void ScanUnits(const Params& p, int first, int last, int* base,
                          BlockScanInt::TempStorage& storage) {
  for (int chunk = first; chunk < last; chunk += kThreads) {
    const int t = chunk + threadIdx.x;
    int n = 0;
    if (t < last) {
      const int32_t* route = p.token_route + static_cast<size_t>(t) * p.num_ranks;
      for (int d = 0; d < p.num_ranks; ++d) n += route[d] >= 0;
    }
    int position = 0, total = 0;
    BlockScanInt(storage).ExclusiveSum(n, position, total);
    // unit_begin[first] of a later batch was written as the previous batch's end, which
    // senders may be reading: left as it is.
    if (t < last && (t > first || first == 0)) p.unit_begin[t] = *base + position;
    __syncthreads();
    if (threadIdx.x == 0) *base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.unit_begin[last] = *base;
}

// Sender role, every thread of a block: units [begin, end), all of tokens below last_token,
// a warp per unit, 16 bytes per lane; stored[d] counts the block's units per destination.
__device__ void StoreUnits(const Params& p, int64_t begin, int64_t end, int last_token,
                           int32_t* stored) {
  const int R = p.num_ranks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int64_t u = begin + warp; u < end; u += warps) {
    const int t = TokenOfUnit(p.unit_begin, last_token, u);
    // The unit is the token's q-th destination in visiting order: find it 32 at a time.
    int q = static_cast<int>(u - p.unit_begin[t]);
    int d = -1;
    for (int first = 0; first < R && d < 0; first += 32) {
      const int position = first + lane;
      const bool has =
          position < R && p.token_route[static_cast<size_t>(t) * R + p.visit.Dest(position)] >= 0;
      unsigned mask = __ballot_sync(0xffffffffu, has);
      const int here = __popc(mask);
      if (q < here) {
        for (int skip = 0; skip < q; ++skip) mask &= mask - 1;
        d = p.visit.Dest(first + __ffs(mask) - 1);
      } else {
        q -= here;
      }
    }
    const int j = p.token_route[t * R + d];
    const auto* from = reinterpret_cast<const uint4*>(reinterpret_cast<const std::byte*>(p.x) +
                                                      static_cast<size_t>(t) * p.row_bytes);
    std::byte* rows = p.arenas[d] + p.off_rows + static_cast<size_t>(p.rank) * p.row_stride;
    if (p.flagged) {
      std::byte* to = rows + LandingRowOffset(p.row_bytes, p.max_tokens, true, j);
      for (size_t i = lane; i < p.row_bytes / 16; i += 32) StoreGranules(to + 32 * i, from[i], p.epoch);
    } else {
      auto* to = reinterpret_cast<uint4*>(rows + static_cast<size_t>(j) * p.row_bytes);
      for (size_t i = lane; i < p.row_bytes / 16; i += 32) to[i] = from[i];
    }
    if (lane == 0) atomicAdd(&stored[d], 1);
  }
}

// Sender role, every thread of a block, after its last unit: per destination it stored into,
// the block adds its count to published[d]; whoever brings it to kCountedBias plus d's
// record total (send_split.h) publishes d.
__device__ void PublishStored(const Params& p, const int32_t* stored) {
  __syncthreads();
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) {
    const int32_t mine = stored[d];
    // bsp publishes with a barrier; flagged rows publish themselves (RaisesFlag).
    if (mine == 0 || p.bsp || !RaisesFlag(p, d, p.flagged)) continue;
    // Every thread's stores precede the barrier above; the system fence orders them before
    // this addition, and the acq_rel addition orders every earlier block's (and the counting
    // role's total) before the flag.
    __threadfence_system();
    const long long total = cuda::atomic_ref<long long, cuda::thread_scope_system>(p.published[d])
                                .fetch_add(mine, cuda::memory_order_acq_rel) +
                            mine;
    if (total >= kCountedBias && total - kCountedBias == p.dest_records[d]) PublishDest(p, d);
  }
}

// Sender block `index` of kSenderBlocks over batch b: its SplitBegin share (send_split.h).
__device__ void BatchShare(const Params& p, int b, int index, int64_t* batch_begin,
                           int64_t* begin, int64_t* end, int* last_token) {
  const int num_batches = NumBatches(p.num_tokens);
  *last_token = min(p.num_tokens, (b + 1) * BatchTokens(p.num_tokens));
  const int64_t batch_end = BatchEnd(p.unit_begin[*last_token], b + 1 == num_batches,
                                     kSenderBlocks);
  *begin = ShareBegin(*batch_begin, batch_end, kSenderBlocks, index);
  *end = ShareBegin(*batch_begin, batch_end, kSenderBlocks, index + 1);
  *batch_begin = batch_end;
}

// Counting role as its own kernel (bsp, and ubep when the fused kernel cannot keep every
// block resident): block b counts destination p.visit.Dest(b) over every token.
__global__ void RouteKernel(Params p) {
  if (Stopped(p)) return;  // Refused at the gate: no record goes out.
  __shared__ BlockScanInt::TempStorage storage;
  __shared__ int base;
  const int d = p.visit.Dest(blockIdx.x);
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  CountDest(p, d, 0, p.num_tokens, &base, storage);
  if (threadIdx.x == 0) FinishDest(p, d, base);
}

// unit_begin[t]: the first unit (send_split.h) of token t, i.e. how many (token, destination)
// row stores come before it; unit_begin[num_tokens] is the total. One block.
__global__ void UnitScanKernel(Params p) {
  if (Stopped(p)) return;  // bsp's count exchange or barrier ended: no row goes out.
  __shared__ BlockScanInt::TempStorage storage;
  __shared__ int base;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  ScanUnits(p, 0, p.num_tokens, &base, storage);
}

// Sender role as its own kernel, after RouteKernel and UnitScanKernel: block b stores its
// share of every batch (send_split.h: any two blocks within one row of each other, every
// block's share spread over destinations), then publishes what it completes.
__global__ void RowKernel(Params p) {
  if (Stopped(p)) return;  // bsp's count exchange or barrier ended: no row goes out.
  extern __shared__ int32_t stored[];  // [num_ranks]
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) stored[d] = 0;
  __syncthreads();
  DelayForTesting(p.row_delay_ns);
  int64_t batch_begin = 0, begin = 0, end = 0;
  int last_token = 0;
  for (int b = 0; b < NumBatches(p.num_tokens); ++b) {
    BatchShare(p, b, blockIdx.x, &batch_begin, &begin, &end, &last_token);
    StoreUnits(p, begin, end, last_token, stored);
  }
  PublishStored(p, stored);
}

// Thread 0 waits until *word reaches `target` (acquire), then the block goes on; false, with
// kStatusStalled set, if the deadline passes first. Called by every thread of a block.
__device__ bool BlockWaitCount(const Params& p, int32_t* word, int32_t target,
                               uint64_t deadline) {
  __shared__ int reached;
  if (threadIdx.x == 0) {
    reached = 1;
    while (cuda::atomic_ref<int32_t, cuda::thread_scope_device>(*word).load(
               cuda::memory_order_acquire) < target) {
      if (GlobalTimerNs() > deadline) {
        atomicCAS(&p.status[kStatusStalled], 0u, 1u);
        reached = 0;
        break;
      }
      __nanosleep(64);
    }
  }
  __syncthreads();
  const bool result = reached != 0;
  __syncthreads();  // `reached` is reused by the next wait.
  return result;
}

// ubep's counting and sending at once, one cooperative launch (every block resident):
// blocks [0, C) are the counting role (block c counts destinations p.visit.Dest(c),
// p.visit.Dest(c + C), ... batch by batch, send_split.h), block C numbers each batch's
// units once every counting block has counted it, and the kSenderBlocks blocks after it store
// each batch as soon as it is numbered, as the host's sender threads do while the caller
// counts. Counting never waits on a peer, so the only waits here are for this rank's own
// blocks; each is bounded by the timeout all the same.
__global__ void SendKernel(Params p, int count_blocks) {
  // Refused at the gate (GateKernel, before this launch: every block reads the same word).
  if (p.status[kStatusRefused] != 0) return;
  extern __shared__ int32_t shared[];  // Counting: records per destination; senders: stored.
  __shared__ BlockScanInt::TempStorage storage;
  const int R = p.num_ranks, C = count_blocks;
  const int num_batches = NumBatches(p.num_tokens), per_batch = BatchTokens(p.num_tokens);
  const uint64_t deadline = GlobalTimerNs() + p.timeout_ns;
  if (static_cast<int>(blockIdx.x) < C) {
    const int c = blockIdx.x;
    const int mine = (R - c + C - 1) / C;  // Visiting positions c, c + C, ... below R.
    for (int i = threadIdx.x; i < mine; i += blockDim.x) shared[i] = 0;
    __syncthreads();
    for (int b = 0; b < num_batches; ++b) {
      const int first = b * per_batch, last = min(p.num_tokens, first + per_batch);
      for (int i = 0; i < mine; ++i) {
        CountDest(p, p.visit.Dest(c + i * C), first, last, &shared[i], storage);
      }
      // CountDest ended with a barrier: the block's token_route and records precede this.
      if (threadIdx.x == 0) {
        cuda::atomic_ref<int32_t, cuda::thread_scope_device>(p.batch_counted[b])
            .fetch_add(1, cuda::memory_order_release);
      }
    }
    for (int i = threadIdx.x; i < mine; i += blockDim.x) {
      FinishDest(p, p.visit.Dest(c + i * C), shared[i]);
    }
  } else if (static_cast<int>(blockIdx.x) == C) {
    __shared__ int base;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int b = 0; b < num_batches; ++b) {
      if (!BlockWaitCount(p, &p.batch_counted[b], C, deadline)) return;
      const int first = b * per_batch, last = min(p.num_tokens, first + per_batch);
      ScanUnits(p, first, last, &base, storage);
      __syncthreads();
      if (threadIdx.x == 0) {
        cuda::atomic_ref<int32_t, cuda::thread_scope_device>(*p.batch_scanned)
            .store(b + 1, cuda::memory_order_release);
      }
    }
  } else {
    const int index = blockIdx.x - C - 1;
    for (int d = threadIdx.x; d < R; d += blockDim.x) shared[d] = 0;
    __syncthreads();
    DelayForTesting(p.row_delay_ns);
    const uint64_t senders_deadline = deadline + p.row_delay_ns;  // The delay is not a stall.
    int64_t batch_begin = 0, begin = 0, end = 0;
    int last_token = 0;
    for (int b = 0; b < num_batches; ++b) {
      // Stalled: stop storing; the flags of what is left stay down, and the peers time out.
      if (!BlockWaitCount(p, p.batch_scanned, b + 1, senders_deadline)) return;
      BatchShare(p, b, index, &batch_begin, &begin, &end, &last_token);
      StoreUnits(p, begin, end, last_token, shared);
    }
    PublishStored(p, shared);
  }
}

// Records received from source s this call, as CountKernel checked them (after it only): none
// from a rank the plan excludes (its count word is stale, and CountKernel keeps 0 for it).
__device__ int SourceCount(const Params& p, int s) {
  return static_cast<int>(RecordCount(p.source_word[s]));
}

// Whether source s stored flagged rows this call (and gets flagged partials back); after
// CountKernel only.
__device__ bool SourceFlagged(const Params& p, int s) { return CountIsFlagged(p.source_word[s]); }

// Sets every member rank's abort word to `code` unless it is already set (the first reason
// wins), as the host backend's GiveUp does. Ranks the plan excludes are left alone: their
// arenas may belong to a new process by now.
__device__ void RaiseAbortEverywhere(const Params& p, uint32_t code) {
  for (int d = 0; d < p.num_ranks; ++d) {
    if (RankExcluded(p.plan, static_cast<uint32_t>(d))) continue;
    uint32_t expected = 0;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(
        *reinterpret_cast<uint32_t*>(p.arenas[d] + p.off_abort))
        .compare_exchange_strong(expected, code, cuda::memory_order_acq_rel);
  }
}

// The call's deadline: one per call, as on the host, set by its first wait (a load first: the
// row-by-row waits of flagged rows ask often, and the count wait has set it by then).
__device__ uint64_t CallDeadline(const Params& p) {
  const unsigned long long set =
      cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>(*p.deadline)
          .load(cuda::memory_order_relaxed);
  if (set != 0) return set;
  const unsigned long long mine = GlobalTimerNs() + p.timeout_ns;
  const unsigned long long first = atomicCAS(p.deadline, 0ull, mine);
  return first == 0 ? mine : first;
}

// A wait on peer s that is still waiting: true if it must end now. Past the deadline it
// raises the abort word in every arena (naming s), so that ranks stuck behind a survivor name
// the dead rank; it also ends when the abort word is set (a peer gave up, or the daemon
// stopped the group) or another wait of this call has ended. The first to end records 1 + s
// and `phase` in status; the host reads the reason from the abort word.
// `name_peer()` names the peer a wait that ends (late, or on the abort word) gives up on: the
// lowest one still awaited, as the host names it (by default s). Not the waiting thread's
// own s: of two threads of a warp whose waits end on the same abort word, either may record
// first.
template <typename NamePeer>
__device__ bool WaitMustEnd(const Params& p, int s, uint64_t deadline, uint32_t phase,
                            NamePeer name_peer) {
  if (cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(p.status[kStatusWaitEnded])
          .load(cuda::memory_order_relaxed) != 0) {
    return true;
  }
  const bool late = GlobalTimerNs() > deadline;
  if (!late) {
    // Acquire: a departed rank's completed word, read next, is read after its code (as the
    // host reads them, docs/dataplane.md, memory ordering item 8).
    const uint32_t code = cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(
                              *reinterpret_cast<uint32_t*>(p.arenas[p.rank] + p.off_abort))
                              .load(cuda::memory_order_acquire);
    // A rank that left after it completed this call owes it nothing more (LeftAfter).
    const int left = RankThatLeft(code);
    if (code == 0 || (left >= 0 && left < p.num_ranks &&
                      FlagReached(reinterpret_cast<uint32_t*>(p.arenas[left] + p.off_completed),
                                  p.epoch))) {
      return false;
    }
  }
  // One thread of the call records why it ended and, if late, tells every rank.
  s = name_peer();
  if (atomicCAS(&p.status[kStatusWaitEnded], 0u, 1u + s) == 0) {
    p.status[kStatusWaitPhase] = phase;
    p.status[kStatusWaitLate] = late ? 1 : 0;
    if (late) RaiseAbortEverywhere(p, kAbortTimedOutBase + static_cast<uint32_t>(s));
  }
  return true;
}

__device__ bool WaitMustEnd(const Params& p, int s, uint64_t deadline, uint32_t phase) {
  return WaitMustEnd(p, s, deadline, phase, [s] { return s; });
}

// Which peers a wait leaves to the flag-in-granule rows: none; the sources of flagged rows
// (dispatch); the destinations that send this rank flagged partials, i.e. every one it sent a
// record to in a flagged call (combine). Seeing a flagged partial from d says what d's combine
// flag says (d is done reading this rank's landing), so only the destinations this rank sent
// nothing to are waited for by their flags.
enum class Skip { kNone, kFlaggedSources, kFlaggedDestinations };

// Waits for flag[s] (s < R, not excluded by the plan nor skipped) of region `offset` in this
// rank's arena to reach `epoch`, or until the wait must end (WaitMustEnd). The block's threads
// share the sources.
__device__ void WaitFlags(const Params& p, size_t offset, uint32_t epoch,
                          uint32_t phase = kPhaseAsCalled, Skip skip = Skip::kNone) {
  std::byte* own = p.arenas[p.rank];
  const uint64_t deadline = CallDeadline(p);
  auto awaited = [&](int s) {
    return !RankExcluded(p.plan, static_cast<uint32_t>(s)) &&
           !(skip == Skip::kFlaggedSources && SourceFlagged(p, s)) &&
           !(skip == Skip::kFlaggedDestinations && p.flagged && p.dest_records[s] > 0);
  };
  auto flag_of = [&](int s) { return reinterpret_cast<uint32_t*>(own + offset + s * kFlagStride); };
  for (int s = threadIdx.x; s < p.num_ranks; s += blockDim.x) {
    if (!awaited(s)) continue;
    while (!FlagReached(flag_of(s), epoch)) {
      // The lowest source still awaited is the one named, whichever thread is first to see
      // the deadline pass or the abort word set (the host names the first source pending).
      const bool end = WaitMustEnd(p, s, deadline, phase, [&] {
        for (int r = 0; r < s; ++r) {
          if (awaited(r) && !FlagReached(flag_of(r), epoch)) return r;
        }
        return s;
      });
      if (end) return;
      __nanosleep(256);
    }
  }
}

// 16 bytes of a flagged row (or partial) from peer s at `from`, once their granules carry
// this call's tag; false if the wait must end first (WaitMustEnd, phase as called).
__device__ bool TakeGranules(const Params& p, int s, const std::byte* from, uint64_t* deadline,
                             uint4* v) {
  while (!LoadGranules(from, p.epoch, v)) {
    if (*deadline == 0) *deadline = CallDeadline(p);
    if (WaitMustEnd(p, s, *deadline, kPhaseAsCalled)) return false;
    __nanosleep(64);
  }
  return true;
}

// This rank has stored everything the call in flight owes its peers (every kernel of the call
// that stores into them ran before, in stream order): it marks the call completed in its own
// arena (arena_layout.h MarkCompleted), unless one of its waits ended.
__device__ void MarkCallCompleted(const Params& p) {
  if (Stopped(p)) return;
  cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(
      *reinterpret_cast<uint32_t*>(p.arenas[p.rank] + p.off_completed))
      .store(p.epoch, cuda::memory_order_release);
}

__global__ void CompletedKernel(Params p) { MarkCallCompleted(p); }

// A dispatch's first kernel: clears the call's status words, then takes the abort word as it
// stands (acquire) into kStatusRefused. Set, the group gave up in an earlier call (a wait
// timed out, or the daemon stopped it): every later kernel of the call sees it (stream order)
// and returns before it stores a byte, into a peer above all, which may still be taking the
// rows of the call that failed (the host backend's check at the start of Dispatch).
__global__ void GateKernel(Params p) {
  if (threadIdx.x < kStatusWords) p.status[threadIdx.x] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    p.status[kStatusRefused] =
        cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(
            *reinterpret_cast<uint32_t*>(p.arenas[p.rank] + p.off_abort))
            .load(cuda::memory_order_acquire);
  }
}

__global__ void WaitKernel(Params p, size_t offset, uint32_t phase, Skip skip) {
  if (Stopped(p)) return;  // An earlier wait of this call ended: do not wait again.
  WaitFlags(p, offset, p.epoch, phase, skip);
}

// Rewrites the tag of every granule in the flagged parts of this rank's landing `offset`
// (rows or partials: the periodic scrub of flagged_rows.h), once this call has read them all
// (stream order), and fences, so that the scrub precedes what this rank stores next.
__global__ void ScrubKernel(Params p, size_t offset, uint32_t tag) {
  if (Stopped(p)) return;  // The group re-forms, and its reset zeroes the landing.
  const size_t per_part = (p.row_stride - p.flagged_offset) / kGranuleBytes;
  std::byte* landing = p.arenas[p.rank] + offset;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < per_part * p.num_ranks; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    auto* granule = reinterpret_cast<unsigned long long*>(
        landing + (i / per_part) * p.row_stride + p.flagged_offset + (i % per_part) * kGranuleBytes);
    *granule = Granule(0, tag);
  }
  __threadfence_system();
}

// bsp's barrier: every stream-ordered store before this kernel is made visible, every member
// rank's barrier flag here is raised to `epoch`, then this rank waits for all of theirs.
__global__ void BarrierKernel(Params p, uint32_t epoch) {
  if (Stopped(p)) return;  // Do not let the peers pass either.
  __threadfence_system();
  for (int d = threadIdx.x; d < p.num_ranks; d += blockDim.x) {
    if (RankExcluded(p.plan, static_cast<uint32_t>(d))) continue;
    ReleaseFlag(
        reinterpret_cast<uint32_t*>(p.arenas[d] + p.off_barrier_flag + p.rank * kFlagStride),
        epoch);
  }
  WaitFlags(p, p.off_barrier_flag, epoch, kPhaseBarrier);
}

// Per source (block): entries per local slot, and where each record's entries start.
// Source s's records in this rank's landing are corrupt (one thread): kStatusCorrupt keeps
// the lowest such source, whom ScanKernel gives up on once every block has checked its own
// (CheckStatus words the error from the records), as the host backend's LayOut gives up on
// the first it finds in rank order.
__device__ void MarkCorruptSource(const Params& p, int s) {
  atomicMax(&p.status[kStatusCorrupt], static_cast<uint32_t>(p.num_ranks - s));
}

// Block s: source s's records, checked as the host backend checks them (corrupt_records.h)
// before anything is indexed by them; then its pairs per local slot and where each record's
// entries start.
__global__ void CountKernel(Params p) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int base;
  __shared__ int corrupt;
  __shared__ uint32_t shared_word;
  const int s = blockIdx.x, S = p.slots_per_rank;
  if (StoppedBeforeCount(p)) return;  // Every source is checked, whatever another block found.
  std::byte* own = p.arenas[p.rank];
  // The count word, read once, by one thread for the block: the count and the bound its
  // format sets are of one value, and every thread loops over the same count (source s writes
  // the word; a rank that wrote it again meanwhile cannot split the block's barriers). None
  // from a rank the plan excludes: its word is stale.
  if (threadIdx.x == 0) {
    shared_word = RankExcluded(p.plan, static_cast<uint32_t>(s))
                      ? 0
                      : reinterpret_cast<const volatile uint32_t*>(own + p.off_counts)[s];
    p.source_word[s] = shared_word;  // Read by the later kernels, not the arena.
  }
  __syncthreads();
  const uint32_t word = shared_word;
  const int n = static_cast<int>(RecordCount(word));
  if (RecordCount(word) > MostRecords(word, p.max_tokens, p.flagged_tokens)) {
    // Every thread read the same word: the block returns as one.
    if (threadIdx.x == 0) MarkCorruptSource(p, s);
    return;
  }
  const int max_entries = MaxPairsPerToken(p.top_k, S);
  const std::byte* records =
      own + p.off_records + static_cast<size_t>(s) * p.max_tokens * p.record_bytes;
  int32_t* counts = p.pair_counts + s * S;
  int32_t* begin = p.record_begin + static_cast<size_t>(s) * (p.max_tokens + 1);
  int32_t* entry_slot = p.entry_row + static_cast<size_t>(s) * p.max_tokens * p.top_k;
  int32_t* token_of = p.record_token + static_cast<size_t>(s) * p.max_tokens;
  for (int i = threadIdx.x; i < S; i += blockDim.x) counts[i] = 0;
  if (threadIdx.x == 0) base = corrupt = 0;
  __syncthreads();
  for (int chunk = 0; chunk < n; chunk += kThreads) {
    const int j = chunk + threadIdx.x;
    RecordHeader header{0, 0};
    if (j < n) header = LoadHeader(records + static_cast<size_t>(j) * p.record_bytes);
    if (j < n && !RecordHeaderInRange(header, p.max_tokens, max_entries)) {
      corrupt = 1;
      header.num_entries = 0;  // Counted as none: nothing is indexed by it.
    }
    if (j < n) token_of[j] = header.token;  // For PlaceKernel.
    int position = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(header.num_entries, position, total);
    if (j < n) {
      begin[j] = base + position;
      for (int q = 0; q < header.num_entries; ++q) {
        const RecordEntry entry = LoadEntry(records + static_cast<size_t>(j) * p.record_bytes, q);
        // The checked slot, for PlaceKernel (which replaces it with the entry's row).
        if (entry.local_slot < 0 || entry.local_slot >= S) {
          corrupt = 1;
          entry_slot[base + position + q] = -1;
        } else {
          atomicAdd(&counts[entry.local_slot], 1);
          entry_slot[base + position + q] = entry.local_slot;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    begin[n] = base;
    if (corrupt != 0) MarkCorruptSource(p, s);
  }
}

// Row offsets in (slot, source) order, and where each source's records and entries start in
// the numbering CopyKernel and PartialKernel use (record_base, entry_base: source by source).
// One block.
__global__ void ScanKernel(Params p) {
  __shared__ BlockScanInt::TempStorage storage;
  __shared__ int base;
  if (const uint32_t corrupt = p.status[kStatusCorrupt]; corrupt != 0) {
    // Final now (CountKernel is done): the group gives up on the lowest corrupt source, once.
    if (threadIdx.x == 0) {
      RaiseAbortEverywhere(p, kAbortTimedOutBase + static_cast<uint32_t>(p.num_ranks) - corrupt);
    }
    return;
  }
  if (Stopped(p)) return;
  const int S = p.slots_per_rank, R = p.num_ranks;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  // (slot i, source s) slot-major: f = i * R + s.
  for (int chunk = 0; chunk < S * R; chunk += kThreads) {
    const int f = chunk + threadIdx.x;
    const int i = f / R, s = f % R;
    const int n = f < S * R ? p.pair_counts[s * S + i] : 0;
    int position = 0, total = 0;
    BlockScanInt(storage).ExclusiveSum(n, position, total);
    if (f < S * R) {
      p.pair_offsets[s * S + i] = base + position;
      if (s == 0) p.slot_offsets[i] = base + position;
    }
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.slot_offsets[S] = base;
    // More rows than the receive capacity (EpConfig::max_recv_rows; the most that can come
    // when it is 0): said, and PlaceKernel and CopyKernel write none of the rows past it;
    // LoadKernel tells every rank of the group (ReceiveNotice).
    *p.rows_routed = base;
    if (base > p.max_rows) p.status[kStatusRowsOver] = static_cast<uint32_t>(base);
    int records = 0, entries = 0;
    for (int s = 0; s < R; ++s) {
      const int n = SourceCount(p, s);
      p.record_base[s] = records;
      p.entry_base[s] = entries;
      records += n;
      entries += p.record_begin[static_cast<size_t>(s) * (p.max_tokens + 1) + n];
    }
    p.record_base[R] = records;
    p.entry_base[R] = entries;
  }
}

// The load counters, once every row is in (a call whose wait ended counts nothing), under
// the load seqlock (arena_layout.h: odd while the counters move; the daemon reads the arena
// from the host). One block.
__global__ void LoadKernel(Params p) {
  if (Stopped(p)) return;
  const int S = p.slots_per_rank;
  auto* counters = reinterpret_cast<unsigned long long*>(p.arenas[p.rank] + p.off_load_counters) +
                   p.layer * S;
  auto* seq = reinterpret_cast<unsigned long long*>(p.arenas[p.rank] + p.off_load_seq) + p.layer;
  // The word's only writer (arena_layout.h SeqWhileWriting: odd while the counters move).
  cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> word(*seq);
  if (threadIdx.x == 0) {
    word.store(SeqWhileWriting(word.load(cuda::memory_order_relaxed)), cuda::memory_order_relaxed);
    __threadfence_system();
  }
  __syncthreads();
  // A call over the receive capacity counts every pair too (they reached the arena; the
  // balancer is to see the load that overflowed), as the host backend does.
  for (int i = threadIdx.x; i < S; i += blockDim.x) {
    counters[i] += p.slot_offsets[i + 1] - p.slot_offsets[i];
  }
  // The rows routed here, to every rank of the group, before this rank's combine stores a
  // byte (arena_layout.h ReceiveNotice; the call word last).
  for (int r = threadIdx.x; r < p.num_ranks; r += blockDim.x) {
    if (RankExcluded(p.plan, static_cast<uint32_t>(r))) continue;
    auto* notice = reinterpret_cast<uint32_t*>(p.arenas[r] + p.off_notices +
                                               static_cast<size_t>(p.rank) * kFlagStride);
    notice[1] = static_cast<uint32_t>(*p.rows_routed);
    notice[2] = static_cast<uint32_t>(p.max_rows);
    __threadfence_system();
    ReleaseFlag(notice, p.epoch);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    word.store(word.load(cuda::memory_order_relaxed) + 1, cuda::memory_order_relaxed);
    MarkCallCompleted(p);  // The dispatch's last kernel (but for a due tag scrub).
  }
}

// Per source (block): every entry, in record order and k order, gets its row, the next one of
// its (slot, source) range, with its source rank, token and weight. 256 entries at a time:
// a warp ranks each lane among the lanes holding the same slot (__match_any_sync) and the
// warps take their rows in turn, so rows follow the serial order of the host backend
// (records in order; a record's slots are distinct, CountDest).
__global__ void PlaceKernel(Params p) {
  extern __shared__ int cursor[];  // [S]
  const int s = blockIdx.x, S = p.slots_per_rank;
  if (Stopped(p)) return;
  std::byte* own = p.arenas[p.rank];
  const int n = SourceCount(p, s);
  const std::byte* records =
      own + p.off_records + static_cast<size_t>(s) * p.max_tokens * p.record_bytes;
  const int32_t* begin = p.record_begin + static_cast<size_t>(s) * (p.max_tokens + 1);
  // Each entry's slot as CountKernel checked it, replaced here by the entry's row.
  int32_t* entry_row = p.entry_row + static_cast<size_t>(s) * p.max_tokens * p.top_k;
  for (int i = threadIdx.x; i < S; i += blockDim.x) cursor[i] = p.pair_offsets[s * S + i];
  __syncthreads();
  const int entries = n > 0 ? begin[n] : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // (64-bit: entries may come within a chunk of 2^31 - 1, which ValidateConfig allows.)
  for (int64_t chunk = 0; chunk < entries; chunk += kThreads) {
    const int64_t e64 = chunk + threadIdx.x;
    const int e = static_cast<int>(e64 < entries ? e64 : 0);
    int slot = -1, token = 0;
    float weight = 0.0f;
    if (e64 < entries) {
      const int j = TokenOfUnit(begin, n, e);  // The record holding entry e.
      const std::byte* record = records + static_cast<size_t>(j) * p.record_bytes;
      slot = entry_row[e];  // In [0, S): a source with a bad slot stopped the call.
      token = p.record_token[static_cast<size_t>(s) * p.max_tokens + j];
      weight = LoadEntry(record, e - begin[j]).weight;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, slot);
    const int ahead = __popc(peers & ((1u << lane) - 1));  // Same-slot lanes before this one.
    for (int w = 0; w < kThreads / 32; ++w) {
      if (warp == w) {
        const int row = slot >= 0 ? cursor[slot] + ahead : -1;
        __syncwarp();
        if (slot >= 0 && ahead == 0) cursor[slot] += __popc(peers);
        if (slot >= 0) entry_row[e] = row;
        if (slot >= 0 && row < p.max_rows) {
          p.src_rank[row] = s;
          p.src_token[row] = token;
          p.weight[row] = weight;
        }
      }
      __syncthreads();
    }
  }
}

// Every received row of the plain sources (flagged_sources false) or of the flagged ones
// (true: taken granule by granule as they land, on the bounded grid of kPollBlocksPerSm)
// copied to its place, a warp per entry over those sources' entries.
__global__ void CopyKernel(Params p, bool flagged_sources) {
  if (Stopped(p)) return;
  const int lane = threadIdx.x % 32, warps_per_block = blockDim.x / 32;
  const int total = p.entry_base[p.num_ranks];
  const std::byte* own = p.arenas[p.rank];
  uint64_t deadline = 0;  // The call's, read once a flagged row is not all in.
  // (64-bit: a stride past the last of up to 2^31 - 1 entries would wrap an int.)
  for (int64_t g64 = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
       g64 < total; g64 += static_cast<int64_t>(gridDim.x) * warps_per_block) {
    const int g = static_cast<int>(g64);
    const int s = TokenOfUnit(p.entry_base, p.num_ranks, g);  // A source with entries.
    if (SourceFlagged(p, s) != flagged_sources) continue;
    const int e = g - p.entry_base[s];
    const int n = p.record_base[s + 1] - p.record_base[s];
    const int j = TokenOfUnit(p.record_begin + static_cast<size_t>(s) * (p.max_tokens + 1), n, e);
    const int row = p.entry_row[static_cast<size_t>(s) * p.max_tokens * p.top_k + e];
    // A row past the receive capacity (ScanKernel said so) is dropped; a flagged one is still
    // waited for, so that no store of this call lands after the call (a tag scrub).
    const bool kept = row < p.max_rows;
    if (!kept && !flagged_sources) continue;
    const std::byte* rows = own + p.off_rows + static_cast<size_t>(s) * p.row_stride;
    auto* to = reinterpret_cast<uint4*>(reinterpret_cast<std::byte*>(p.recv_x) +
                                        static_cast<size_t>(kept ? row : 0) * p.row_bytes);
    if (flagged_sources) {  // Each lane takes its granules as they land.
      const std::byte* from = rows + LandingRowOffset(p.row_bytes, p.max_tokens, true, j);
      for (size_t i = lane; i < p.row_bytes / 16; i += 32) {
        uint4 v;
        if (!TakeGranules(p, s, from + 32 * i, &deadline, &v)) return;
        if (kept) to[i] = v;
      }
    } else {
      const auto* from = reinterpret_cast<const uint4*>(rows + static_cast<size_t>(j) * p.row_bytes);
      for (size_t i = lane; i < p.row_bytes / 16; i += 32) to[i] = from[i];
    }
  }
}

__device__ void UnpackBf16x8(uint4 v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = Bf16ToFloat(static_cast<uint16_t>(words[i] & 0xffffu));
    f[2 * i + 1] = Bf16ToFloat(static_cast<uint16_t>(words[i] >> 16));
  }
}

__device__ uint4 PackBf16x8(const float (&f)[8]) {
  uint32_t words[4];
  for (int i = 0; i < 4; ++i) {
    words[i] = FloatToBf16(f[2 * i]) | (static_cast<uint32_t>(FloatToBf16(f[2 * i + 1])) << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Expert side of combine. Records are numbered source by source (record_base); block b takes
// the contiguous [b * N / G, (b + 1) * N / G) of the N records (send_split.h's split), sums
// each record's rows (entries in k order) in fp32, 8 elements per thread, and stores the
// bf16 partial into the source's arena. When a block is done with its part of a source, it
// adds the records to that source's tally; whoever completes it raises the source's combine
// flag (the dispatch's publication, here per source). A source that sent nothing gets its
// flag at once; a source the plan excludes sent nothing and gets nothing, not even a flag.
__global__ void PartialKernel(Params p, const uint16_t* y) {
  const int R = p.num_ranks, H8 = p.hidden / 8;
  if (p.partial_delay_source < 0) DelayForTesting(p.partial_delay_ns);
  if (blockIdx.x == 0 && !p.bsp) {  // bsp publishes with a barrier.
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
      if (RankExcluded(p.plan, static_cast<uint32_t>(s))) continue;
      if (p.record_base[s + 1] != p.record_base[s]) continue;
      ReleaseFlag(
          reinterpret_cast<uint32_t*>(p.arenas[s] + p.off_combine_flag + p.rank * kFlagStride),
          p.epoch);
    }
  }
  const int64_t last = SplitBegin(p.record_base[R], gridDim.x, blockIdx.x + 1);
  for (int64_t g = SplitBegin(p.record_base[R], gridDim.x, blockIdx.x); g < last;) {
    const int s = TokenOfUnit(p.record_base, R, g);  // A source with records.
    if (s == p.partial_delay_source) DelayForTesting(p.partial_delay_ns);
    const int64_t part_end = min(last, static_cast<int64_t>(p.record_base[s + 1]));
    const int32_t* begin = p.record_begin + static_cast<size_t>(s) * (p.max_tokens + 1);
    const int32_t* entry_row = p.entry_row + static_cast<size_t>(s) * p.max_tokens * p.top_k;
    std::byte* arena = p.arenas[s];
    std::byte* partials = arena + p.off_partials + static_cast<size_t>(p.rank) * p.row_stride;
    const bool flagged = SourceFlagged(p, s);  // s gets its partials as it sent its rows.
    for (int j = static_cast<int>(g - p.record_base[s]);
         j < static_cast<int>(part_end - p.record_base[s]); ++j) {
      for (int h8 = threadIdx.x; h8 < H8; h8 += blockDim.x) {
        float sum[8];
        for (int e = begin[j]; e < begin[j + 1]; ++e) {
          const int row = entry_row[e];
          // A row past the receive capacity (ScanKernel: the call fails) adds zeros.
          const float w = row < p.max_rows ? p.weight[row] : 0.0f;
          float v[8] = {};
          if (row < p.max_rows) {
            UnpackBf16x8(
                reinterpret_cast<const uint4*>(y + static_cast<size_t>(row) * p.hidden)[h8], v);
          }
          for (int i = 0; i < 8; ++i) {
            const float term = __fmul_rn(w, v[i]);
            sum[i] = e == begin[j] ? term : __fadd_rn(sum[i], term);
          }
        }
        if (flagged) {
          StoreGranules(partials + LandingRowOffset(p.row_bytes, p.max_tokens, true, j) + 32 * h8,
                        PackBf16x8(sum), p.epoch);
        } else {
          reinterpret_cast<uint4*>(partials + static_cast<size_t>(j) * p.row_bytes)[h8] =
              PackBf16x8(sum);
        }
      }
    }
    __syncthreads();
    // Flagged partials publish themselves (RaisesFlag).
    if (threadIdx.x == 0 && !p.bsp && RaisesFlag(p, s, flagged)) {
      // Every thread's partials precede the barrier above; the system fence orders them
      // before the addition, and the acq_rel addition every earlier block's before the flag.
      __threadfence_system();
      const int32_t records = static_cast<int32_t>(part_end - g);
      const int32_t done = cuda::atomic_ref<int32_t, cuda::thread_scope_system>(p.combine_done[s])
                               .fetch_add(records, cuda::memory_order_acq_rel) +
                           records;
      if (done == p.record_base[s + 1] - p.record_base[s]) {
        __threadfence_system();
        ReleaseFlag(reinterpret_cast<uint32_t*>(arena + p.off_combine_flag + p.rank * kFlagStride),
                    p.epoch);
      }
    }
    g = part_end;
  }
}

// Token side of combine: a block per token (a flagged call: tokens in turn on the bounded grid
// of kPollBlocksPerSm) sums its partials over destinations in rank order, 8 elements per
// thread.
__global__ void TokenKernel(Params p, uint16_t* out, int num_tokens) {
  if (Stopped(p)) return;
  const int H8 = p.hidden / 8;
  const std::byte* partials = p.arenas[p.rank] + p.off_partials;
  uint64_t deadline = 0;
  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    for (int h8 = threadIdx.x; h8 < H8; h8 += blockDim.x) {
      float sum[8];
      bool first = true;
      for (int d = 0; d < p.num_ranks; ++d) {
        const int j = p.token_route[static_cast<size_t>(t) * p.num_ranks + d];
        if (j < 0) continue;
        const std::byte* partial = partials + d * p.row_stride +
                                   LandingRowOffset(p.row_bytes, p.max_tokens, p.flagged, j);
        uint4 packed;
        if (p.flagged) {  // Taken as it lands.
          if (!TakeGranules(p, d, partial + 32 * h8, &deadline, &packed)) return;
        } else {
          packed = reinterpret_cast<const uint4*>(partial)[h8];
        }
        float v[8];
        UnpackBf16x8(packed, v);
        for (int i = 0; i < 8; ++i) sum[i] = first ? v[i] : __fadd_rn(sum[i], v[i]);
        first = false;
      }
      if (first) {
        for (int i = 0; i < 8; ++i) sum[i] = 0.0f;
      }
      reinterpret_cast<uint4*>(out + static_cast<size_t>(t) * p.hidden)[h8] = PackBf16x8(sum);
    }
  }
  // Flagged partials were taken with relaxed loads: a fence, so that whatever this rank stores
  // into the destinations next (its next dispatch) comes after it read them (flagged_rows.h).
  if (p.flagged) __threadfence_system();
}

// After the token side (every partial, flag or barrier of the call taken): the lowest rank
// of the group whose notice in this rank's arena (posted before its partials, arena_layout.h
// ReceiveNotice) says it overflowed its receive capacity in this call, as kStatusPeerOver:
// the call fails on every rank.
__global__ void OverflowKernel(Params p) {
  if (Stopped(p)) return;
  const int R = p.num_ranks;
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    if (RankExcluded(p.plan, static_cast<uint32_t>(d))) continue;
    auto* notice = reinterpret_cast<uint32_t*>(p.arenas[p.rank] + p.off_notices +
                                               static_cast<size_t>(d) * kFlagStride);
    const uint32_t call =
        cuda::atomic_ref<uint32_t, cuda::thread_scope_system>(notice[0]).load(
            cuda::memory_order_acquire);
    if (call == p.epoch && notice[1] > notice[2]) {
      atomicMax(&p.status[kStatusPeerOver], static_cast<uint32_t>(R - d));
    }
  }
}

}  // namespace

absl::Status CudaDeviceStatus() {
  int count = 0;
  if (const cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorName(error), ": ", cudaGetErrorString(error)));
  }
  if (count == 0) return absl::FailedPreconditionError("cudaGetDeviceCount found no device");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(size_t bytes) {
  void* data = nullptr;
  UBEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes));
  // Owned from here on: a failure below frees it.
  std::unique_ptr<DeviceArena> arena(new DeviceArena(static_cast<std::byte*>(data), true));
  UBEP_CUDA_RETURN_IF_ERROR(cudaMemset(data, 0, bytes));
  UBEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return arena;
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::OpenPeer(
    const std::byte (&handle)[64]) {
  cudaIpcMemHandle_t ipc;
  static_assert(sizeof(ipc) == 64);
  memcpy(&ipc, handle, sizeof(ipc));
  void* data = nullptr;
  UBEP_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&data, ipc, cudaIpcMemLazyEnablePeerAccess));
  return std::unique_ptr<DeviceArena>(new DeviceArena(static_cast<std::byte*>(data), false));
}

DeviceArena::~DeviceArena() {
  if (owned_) {
    cudaFree(data_);
  } else {
    cudaIpcCloseMemHandle(data_);
  }
}

absl::Status DeviceArena::IpcHandle(std::byte (&handle)[64]) const {
  cudaIpcMemHandle_t ipc;
  UBEP_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&ipc, data_));
  memcpy(handle, &ipc, sizeof(ipc));
  return absl::OkStatus();
}

struct CudaEp::Scratch {
  Params params{};
  size_t zeroed_bytes = 0;  // Of the scratch block, from published on.
  int count_blocks = 0;     // SendKernel's counting blocks.
  int wide_blocks = 0;      // CopyKernel's and PartialKernel's grid.
  int poll_blocks = 0;      // The grid of kernels that poll granules (kPollBlocksPerSm).
  bool fused = false;       // ubep runs SendKernel (counting and sending at once).
  std::byte** arenas = nullptr;
  void* block = nullptr;  // One allocation for every scratch array.
  // Pinned host memory the end of each call is copied into, in stream order: the status words,
  // then (a dispatch) the slot offsets. One synchronization of the stream then reads both,
  // where a synchronous copy of each would wait for the device once more.
  uint32_t* host_status = nullptr;
  int32_t* host_slot_offsets = nullptr;
  // Non-blocking too: a blocking one would make the caller's legacy-stream work (a cudaMemcpy
  // of its next input) wait for this rank's kernels, which, with ranks as threads of one
  // process on one device, may wait for that very caller's next call: a deadlock until the
  // call's timeout. Each call instead waits for `legacy`, recorded on the legacy default
  // stream as it begins: still after the caller's uploads there, never the reverse.
  cudaStream_t stream = nullptr;
  cudaEvent_t legacy = nullptr;
  // Non-blocking: copies that must not wait for the kernels of a call in flight on `stream`
  // (FailedAfterTakingPart's refusal record and abort words; the legacy default stream
  // would wait for them).
  cudaStream_t side = nullptr;
};

CudaEp::CudaEp(const EpConfig& config, int rank)
    : config_(config), layout_(config), rank_(rank), scratch_(std::make_unique<Scratch>()) {}

CudaEp::~CudaEp() {
  const ScopedDevice on_device(device_);
  if (scratch_->block != nullptr) cudaFree(scratch_->block);
  if (scratch_->arenas != nullptr) cudaFree(scratch_->arenas);
  if (scratch_->host_status != nullptr) cudaFreeHost(scratch_->host_status);
  if (scratch_->stream != nullptr) cudaStreamDestroy(scratch_->stream);
  if (scratch_->legacy != nullptr) cudaEventDestroy(scratch_->legacy);
  if (scratch_->side != nullptr) cudaStreamDestroy(scratch_->side);
}

absl::StatusOr<std::unique_ptr<CudaEp>> CudaEp::Create(const EpConfig& config, int rank,
                                                       std::vector<std::byte*> arenas) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  if (config.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError("cuda backend: activations must be bf16");
  }
  if (config.hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: hidden ", config.hidden, " is not a multiple of 8"));
  }
  if (static_cast<int>(arenas.size()) != config.num_ranks || rank < 0 ||
      rank >= config.num_ranks) {
    return absl::InvalidArgumentError("cuda backend: one arena per rank, and a rank in range");
  }
  // PlaceKernel keeps an int per local slot in dynamic shared memory, the senders an int per
  // rank: within what any launch may take without opting in (48 KiB), or every launch fails.
  constexpr size_t kMaxDynamicShared = 48 * 1024;
  for (const auto& [what, count] : {std::pair{"slots_per_rank", config.slots_per_rank},
                                    std::pair{"ranks", config.num_ranks}}) {
    if (sizeof(int32_t) * static_cast<size_t>(count) > kMaxDynamicShared) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda backend: ", count, " ", what, " need ", sizeof(int32_t) * count,
          " bytes of shared memory per block, over the ", kMaxDynamicShared, " a launch takes"));
    }
  }
  std::unique_ptr<CudaEp> ep(new CudaEp(config, rank));
  UBEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&ep->device_));
  ep->own_arena_ = arenas[rank];
  ep->arenas_ = arenas;
  Scratch& s = *ep->scratch_;
  // Ordered after the caller's uploads on the legacy default stream by `legacy` (Scratch).
  UBEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
  UBEP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s.legacy, cudaEventDisableTiming));
  UBEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.side, cudaStreamNonBlocking));
  UBEP_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&s.arenas), sizeof(std::byte*) * arenas.size()));
  UBEP_CUDA_RETURN_IF_ERROR(cudaMallocHost(
      reinterpret_cast<void**>(&s.host_status),
      sizeof(uint32_t) * kStatusWords + sizeof(int32_t) * (config.slots_per_rank + 1)));
  s.host_slot_offsets = reinterpret_cast<int32_t*>(s.host_status + kStatusWords);
  UBEP_CUDA_RETURN_IF_ERROR(CopyNow(s.arenas, arenas.data(),
                                         sizeof(std::byte*) * arenas.size(),
                                         cudaMemcpyHostToDevice, s.side));
  const size_t R = config.num_ranks, T = config.max_tokens, K = config.top_k,
               S = config.slots_per_rank, H = config.hidden;
  // The receive capacity: every pair of every source's tokens here (at most MaxPairsPerToken
  // per token, routing.h) unless EpConfig::max_recv_rows bounds it.
  const size_t max_rows = static_cast<size_t>(ReceiveCapacity(config));
  // First (8-byte aligned): what each dispatch zeroes, published counts as long long.
  const size_t zeroed = 2 * R + 2 + kMaxSendBatches + 1;
  const size_t ints = zeroed + T * R + (T + 1) + R + R * S + R * S + R * (T + 1) + R * T +
                      R * T * K + (S + 1) + 4 * R + 2 + 1 + kStatusWords + max_rows * 2;
  // recv_x is copied 16 bytes at a time: start it on a 256-byte boundary.
  const size_t head = ints * sizeof(int32_t) + max_rows * sizeof(float);
  const size_t recv_offset = (head + 255) / 256 * 256;
  const size_t bytes = recv_offset + max_rows * H * 2;
  if (const cudaError_t error = cudaMalloc(&s.block, bytes); error != cudaSuccess) {
    (void)cudaGetLastError();
    const bool bounded =
        config.max_recv_rows > 0 && max_rows == static_cast<size_t>(config.max_recv_rows);
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda backend: rank ", rank, " needs ", bytes, " bytes of device scratch for ", max_rows,
        " receive rows (",
        bounded ? std::string("max_recv_rows")
                : absl::StrCat(R, " ranks x max_tokens ", T, " x min(top_k ", K,
                               ", slots_per_rank ", S, ")"),
        ") of hidden ", H, ": ", cudaGetErrorString(error),
        bounded ? "; lower max_recv_rows" : "; lower max_tokens, or bound max_recv_rows"));
  }
  UBEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s.block, 0, bytes, s.side));
  auto* next = static_cast<int32_t*>(s.block);
  auto take = [&](size_t n) {
    int32_t* at = next;
    next += n;
    return at;
  };
  Params& p = s.params;
  p.published = reinterpret_cast<long long*>(take(2 * R));
  p.deadline = reinterpret_cast<unsigned long long*>(take(2));
  p.batch_counted = take(kMaxSendBatches);
  p.batch_scanned = take(1);
  s.zeroed_bytes = zeroed * sizeof(int32_t);
  p.token_route = take(T * R);
  p.unit_begin = take(T + 1);
  p.dest_records = take(R);
  p.pair_counts = take(R * S);
  p.pair_offsets = take(R * S);
  p.record_begin = take(R * (T + 1));
  p.record_token = take(R * T);
  p.entry_row = take(R * T * K);
  p.slot_offsets = take(S + 1);
  p.record_base = take(R + 1);
  p.entry_base = take(R + 1);
  p.combine_done = take(R);
  p.source_word = reinterpret_cast<uint32_t*>(take(R));
  p.rows_routed = take(1);
  p.status = reinterpret_cast<uint32_t*>(take(kStatusWords));
  p.src_rank = take(max_rows);
  p.src_token = take(max_rows);
  p.weight = reinterpret_cast<float*>(take(max_rows));
  p.recv_x = reinterpret_cast<uint16_t*>(static_cast<std::byte*>(s.block) + recv_offset);
  p.rank = rank;
  p.num_ranks = config.num_ranks;
  p.visit = VisitOrder(rank, config.num_ranks, config.near_ranks);
  p.max_tokens = config.max_tokens;
  p.flagged_tokens = config.flagged_tokens;
  p.hidden = config.hidden;
  p.top_k = config.top_k;
  p.slots_per_rank = config.slots_per_rank;
  const ArenaLayout& l = ep->layout_;
  p.record_bytes = l.record_bytes;
  p.row_bytes = l.row_bytes;
  p.row_stride = l.row_stride;
  p.flagged_offset = l.flagged_offset;
  p.off_abort = l.abort;
  p.off_notices = l.notices;
  p.partial_delay_source = -1;
  p.bsp = config.protocol == Protocol::kBsp;
  p.off_count_flag = l.count_flag;
  p.off_barrier_flag = l.barrier_flag;
  p.off_dispatch_flag = l.dispatch_flag;
  p.off_combine_flag = l.combine_flag;
  p.off_counts = l.counts;
  p.off_load_counters = l.load_counters;
  p.off_load_seq = l.load_seq;
  p.off_records = l.records;
  p.off_rows = l.rows;
  p.off_partials = l.partials;
  p.arenas = s.arenas;
  p.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(config.timeout));
  p.num_experts = config.num_experts;
  p.max_rows = static_cast<int>(max_rows);
  // Resume the epochs this arena has seen (a restarted rank continues its peers' count):
  // own flags and completed calls (ResumedEpoch), dispatch then combine.
  uint32_t words[4] = {0, 0, 0, 0};
  const size_t offsets[4] = {l.dispatch_flag + rank * kFlagStride, l.dispatch_completed,
                             l.combine_flag + rank * kFlagStride, l.combine_completed};
  for (int i = 0; i < 4; ++i) {
    UBEP_CUDA_RETURN_IF_ERROR(CopyNow(&words[i], arenas[rank] + offsets[i],
                                           sizeof(uint32_t), cudaMemcpyDeviceToHost, s.side));
  }
  ep->dispatch_epoch_ = ResumedEpoch(words[0], words[1]);
  ep->combine_epoch_ = ResumedEpoch(words[2], words[3]);
  UBEP_CUDA_RETURN_IF_ERROR(CopyNow(&ep->barrier_epoch_,
                                         arenas[rank] + l.barrier_flag + rank * kFlagStride,
                                         sizeof(uint32_t), cudaMemcpyDeviceToHost, s.side));
  // ubep counts and sends in one cooperative launch when the device can keep every block of
  // it resident (always, on a GPU of this class: at most 65 blocks); sender_thread kOff asks
  // for the counting kernel first, then the senders, as bsp runs.
  const int device = ep->device_;
  int sms = 0;
  UBEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  s.wide_blocks = kWideBlocksPerSm * sms;
  // The ranks whose arenas are on this GPU: they share its SM slots (kPollBlocksPerSm). A
  // pointer the runtime cannot place counts as sharing.
  int sharing = 0;
  for (std::byte* arena : arenas) {
    cudaPointerAttributes where{};
    const bool placed = cudaPointerGetAttributes(&where, arena) == cudaSuccess;
    if (!placed) (void)cudaGetLastError();
    if (!placed || where.device == device) ++sharing;
  }
  s.poll_blocks = std::max(1, kPollBlocksPerSm * sms / std::max(1, sharing));
  s.count_blocks = std::min(config.num_ranks, kCountBlocks);
  if (!p.bsp && config.sender_thread != EpConfig::SenderThread::kOff) {
    int cooperative = 0, per_sm = 0;
    UBEP_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
    UBEP_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, SendKernel, kThreads, sizeof(int32_t) * config.num_ranks));
    s.fused = cooperative != 0 && per_sm * sms >= s.count_blocks + 1 + kSenderBlocks;
  }
  // The scratch zeroed (on the side stream) before any kernel of the rank's stream reads it.
  UBEP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s.side));
  return ep;
}

bool CudaEp::counts_while_sending() const { return scratch_->fused; }

void CudaEp::set_row_delay_for_testing(absl::Duration delay) {
  scratch_->params.row_delay_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(delay));
}

void CudaEp::set_partial_delay_for_testing(absl::Duration delay, int source) {
  scratch_->params.partial_delay_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(delay));
  scratch_->params.partial_delay_source = source;
}

absl::Status CudaEp::CheckStatus(const char* what, uint32_t call,
                                 const CudaDispatchInput* input) {
  Scratch& s = *scratch_;
  // Called within a call (its epoch taken): a failure here is the call's, told to the peers.
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaMemcpyAsync(s.host_status, s.params.status,
                                               sizeof(uint32_t) * kStatusWords,
                                               cudaMemcpyDeviceToHost, s.stream));
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaStreamSynchronize(s.stream));
  const uint32_t* status = s.host_status;
  if (status[kStatusStalled] != 0) {
    // Its rows' flags stay down: the peers are told, as for a launch that failed.
    return FailedAfterTakingPart(absl::InternalError(absl::StrCat(
        "rank ", rank_, ": ", what, ", call ", call, ": a block of SendKernel waited ",
        absl::FormatDuration(config_.timeout),
        " for another block of the same launch; the cooperative launch should have kept every "
        "block resident")));
  }
  if (status[kStatusCorrupt] != 0) {
    // Worded from the source's count word and records as they lie in this rank's landing
    // (the source rewrites them only after this rank's combine, which does not come).
    const int source = config_.num_ranks - static_cast<int>(status[kStatusCorrupt]);
    const std::byte* landing = own_arena_ + layout_.records +
                               static_cast<size_t>(source) * config_.max_tokens *
                                   layout_.record_bytes;
    uint32_t word = 0;
    UBEP_CUDA_FAIL_CALL_IF_ERROR(Copy(&word, own_arena_ + layout_.counts +
                                                 sizeof(uint32_t) * source,
                                      sizeof(word), cudaMemcpyDeviceToHost));
    std::vector<std::byte> records(
        std::min(RecordCount(word), MostRecords(word, config_.max_tokens, config_.flagged_tokens)) *
        layout_.record_bytes);
    if (!records.empty()) {
      UBEP_CUDA_FAIL_CALL_IF_ERROR(
          Copy(records.data(), landing, records.size(), cudaMemcpyDeviceToHost));
    }
    return CorruptRecordsStatus(
        rank_, source, call,
        CorruptRecordsWhat(word, records.data(), layout_.record_bytes, config_.max_tokens,
                           config_.flagged_tokens,
                           MaxPairsPerToken(config_.top_k, config_.slots_per_rank),
                           config_.slots_per_rank));
  }
  if (status[kStatusWaitEnded] != 0) {
    what = PhaseName(status[kStatusWaitPhase], what);
    // The abort word holds why: a daemon's code, or the rank the group gave up on.
    uint32_t code = 0;
    UBEP_CUDA_FAIL_CALL_IF_ERROR(
        Copy(&code, own_arena_ + layout_.abort, sizeof(code), cudaMemcpyDeviceToHost));
    // A wait that ran late was not ended by the code (a rank that left after this call,
    // which the waits went on past, or a code set after the deadline).
    if (absl::Status daemon = DaemonAbortStatus(code, rank_, what, call);
        status[kStatusWaitLate] == 0 && !daemon.ok()) {
      return daemon;
    }
    const int peer = static_cast<int>(status[kStatusWaitEnded]) - 1;
    return TimedOutStatus(code, rank_, peer, config_.timeout, what, call,
                          Refusal(RankGivenUpOn(code, peer),
                                  PhaseInFlight(dispatch_epoch_, combine_epoch_)));
  }
  // Bad input (found on the device, after the peers may have begun) worded from the token's
  // input with the host backend's checks, so the two say the same; "" if none.
  auto bad_pair = [&]() -> std::string {
    if (status[kStatusBadPair] == 0) return "";
    const uint32_t pair = ~status[kStatusBadPair];
    const int K = config_.top_k;
    const int t = static_cast<int>(pair / K), k = static_cast<int>(pair % K);
    int32_t idx[kMaxTopK];
    float w[kMaxTopK];
    if (input != nullptr &&
        Copy(idx, input->topk_idx + static_cast<size_t>(t) * K, sizeof(int32_t) * K,
             cudaMemcpyDefault) == cudaSuccess &&
        Copy(w, input->topk_weights + static_cast<size_t>(t) * K, sizeof(float) * K,
             cudaMemcpyDefault) == cudaSuccess) {
      if (std::string bad = BadPairMessage(idx, w, t, k, config_.num_experts); !bad.empty()) {
        return bad;
      }
    }
    return absl::StrCat("topk_idx[", t, "][", k, "]: flagged as bad input on the device");
  };
  if (status[kStatusRowsOver] != 0) {
    const absl::Status over = OverCapacityStatus(
        rank_, call,
        {call, status[kStatusRowsOver], static_cast<uint32_t>(scratch_->params.max_rows)});
    // The call fails over the capacity either way (and libubep combines for it, as for any
    // overflowed rank); bad input of the same call is told with it rather than lost.
    const std::string bad = bad_pair();
    if (bad.empty()) return over;
    return absl::ResourceExhaustedError(absl::StrCat(over.message(), "; and bad input: ", bad));
  }
  if (status[kStatusPeerOver] != 0) {
    const int peer = config_.num_ranks - static_cast<int>(status[kStatusPeerOver]);
    ReceiveNotice notice{};
    UBEP_CUDA_FAIL_CALL_IF_ERROR(Copy(&notice, own_arena_ + layout_.notices + peer * kFlagStride,
                                      sizeof(notice), cudaMemcpyDeviceToHost));
    return PeerOverCapacityStatus(rank_, call, peer, notice);
  }
  if (const std::string bad = bad_pair(); !bad.empty()) return absl::InvalidArgumentError(bad);
  return absl::OkStatus();
}

absl::Status CudaEp::GaveUpStatus() const {
  const ScopedDevice on_device(device_);
  if (!on_device.status().ok()) return on_device.status();
  uint32_t code = 0;
  UBEP_CUDA_RETURN_IF_ERROR(
      Copy(&code, own_arena_ + layout_.abort, sizeof(code), cudaMemcpyDeviceToHost));
  if (code == 0) return absl::OkStatus();
  return DispatchAfterGiveUpStatus(code, rank_, config_.protocol, dispatch_epoch_ + 1);
}

absl::Status CudaEp::Refuse(absl::Status refused, bool keep_earlier) {
  const ScopedDevice on_device(device_);
  if (!on_device.status().ok()) return on_device.status();
  const CallPhase phase = AwaitedPhase(dispatch_epoch_, combine_epoch_);
  if (keep_earlier && !Refusal(rank_, phase).empty()) return refused;
  std::byte body[kRefusalBody];
  FormatRefusal(phase, refused.message(), body);
  WriteRefusal(body);
  refusal_recorded_ = true;
  return refused;
}

void CudaEp::TakePart() {
  if (!refusal_recorded_) return;
  std::byte body[kRefusalBody];
  FormatWithdrawnRefusal(body);
  WriteRefusal(body);
  refusal_recorded_ = false;
}

cudaError_t CudaEp::Copy(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) const {
  return CopyNow(to, from, bytes, kind, scratch_->side);
}

void CudaEp::WriteRefusal(const std::byte (&body)[kRefusalBody]) {
  // Copies each done before the next begins: the sequence word odd, the body, the word even.
  // A copy that fails leaves the record as it was, or odd (read as none). On the side stream:
  // within a call, its kernels in flight wait for peers, and for this very record.
  auto* seq = reinterpret_cast<uint32_t*>(own_arena_ + layout_.refusal);
  uint32_t before = 0;
  if (Copy(&before, seq, sizeof(before), cudaMemcpyDeviceToHost) != cudaSuccess) return;
  const uint32_t odd = SeqWhileWriting(before), even = odd + 1;
  if (Copy(seq, &odd, sizeof(odd), cudaMemcpyHostToDevice) == cudaSuccess &&
      Copy(seq + 1, body, sizeof(body), cudaMemcpyHostToDevice) == cudaSuccess) {
    (void)Copy(seq, &even, sizeof(even), cudaMemcpyHostToDevice);
  }
}

absl::Status CudaEp::FailedAfterTakingPart(absl::Status error) {
  // The refusal record first, then the abort word, as the host backend's SendersStopped: a
  // peer that sees the word reads why. On the side stream: the call's kernels still in
  // flight wait for peers, and for this very word.
  std::byte body[kRefusalBody];
  FormatRefusal(PhaseInFlight(dispatch_epoch_, combine_epoch_), error.message(), body);
  WriteRefusal(body);
  refusal_recorded_ = true;
  // Read, then set where still 0 (the first reason wins): a peer's kernel that raises it in
  // between loses its reason to this one, which names a rank that failed all the same (that
  // arena then names another rank than the others may). Copies, not a kernel's compare-and-
  // swap: a kernel may find no SM free while the call's kernels (a stalled SendKernel's whole
  // grid) hold them until their deadline; the copy engines are free.
  const uint32_t code = kAbortTimedOutBase + static_cast<uint32_t>(rank_);
  for (size_t r = 0; r < arenas_.size(); ++r) {
    if (r >= member_.size() || !member_[r] || arenas_[r] == nullptr) continue;
    uint32_t word = 0;
    if (Copy(&word, arenas_[r] + layout_.abort, sizeof(word), cudaMemcpyDeviceToHost) ==
            cudaSuccess &&
        word == 0) {
      (void)Copy(arenas_[r] + layout_.abort, &code, sizeof(code), cudaMemcpyHostToDevice);
    }
  }
  // The call's kernels launched so far end on the word (or at their deadline): none may
  // still read the caller's buffers once this returns.
  (void)cudaStreamSynchronize(scratch_->stream);
  (void)cudaGetLastError();
  return error;
}

std::string CudaEp::Refusal(int rank, CallPhase phase) const {
  const ScopedDevice on_device(device_);
  if (rank < 0 || rank >= static_cast<int>(arenas_.size()) || arenas_[rank] == nullptr) return "";
  const auto* region = reinterpret_cast<const uint32_t*>(arenas_[rank] + layout_.refusal);
  // A read torn by the rank writing its record meanwhile is tried again, as the host backend
  // does (ReadRefusal): 16 tries.
  for (int attempt = 0; attempt < 16; ++attempt) {
    uint32_t before = 0, after = 0;
    std::byte body[kRefusalBody];
    if (Copy(&before, region, sizeof(before), cudaMemcpyDeviceToHost) != cudaSuccess ||
        before == 0) {
      return "";
    }
    if (before % 2 != 0) continue;  // Being written.
    if (Copy(body, region + 1, sizeof(body), cudaMemcpyDeviceToHost) != cudaSuccess ||
        Copy(&after, region, sizeof(after), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return "";
    }
    if (after == before) return ParseRefusal(body, phase);
  }
  return "";
}

absl::Status CudaEp::Dispatch(const CudaDispatchInput& in, CudaDispatchOutput& out) {
  const ScopedDevice on_device(device_);
  if (!on_device.status().ok()) return on_device.status();
  // The abort word is looked at by GateKernel, with no synchronous copy, except where that
  // look would come too late and it is taken here first (as the host takes it, before any
  // check): after a dispatch that failed (its combine refused, this call would read as a
  // second dispatch) and after a refusal of its own (which TakePart would withdraw, while a
  // call refused because the group gave up keeps it for the peers to read).
  const bool looked = refusal_recorded_ || (combine_epoch_ != dispatch_epoch_ && !dispatch_completed_);
  if (looked) {
    if (absl::Status gave_up = GaveUpStatus(); !gave_up.ok()) return gave_up;
  }
  // A call refused below says first that the group gave up, where it did (the host backend
  // looks at the abort word before any check): a caller told Unavailable re-forms the group.
  auto refuse = [&](absl::Status refused, bool keep_earlier = false) {
    if (!looked) {
      if (absl::Status gave_up = GaveUpStatus(); !gave_up.ok()) return gave_up;
    }
    return Refuse(std::move(refused), keep_earlier);
  };
  if (combine_epoch_ != dispatch_epoch_) {
    // The peers wait for this rank's partials: a refusal of that combine recorded for them
    // is the reason they are to read, not this one (the host backend's order).
    return refuse(absl::FailedPreconditionError(kDispatchTwice), /*keep_earlier=*/true);
  }
  // The host backend's checks, in its words (bad_input.h); the device table must come with
  // the host copy it was uploaded from.
  if (std::string bad = BadCallMessage(in.num_tokens, in.layer,
                                       in.plan != nullptr ? in.host_plan : nullptr,
                                       config_.max_tokens, config_.num_layers,
                                       config_.num_experts, config_.num_ranks,
                                       config_.slots_per_rank);
      !bad.empty()) {
    return refuse(absl::InvalidArgumentError(std::move(bad)));
  }
  if (RankExcluded(in.host_plan, static_cast<uint32_t>(rank_))) {
    if (!looked) {
      if (absl::Status gave_up = GaveUpStatus(); !gave_up.ok()) return gave_up;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank_, " is excluded from the EP group by plan v", in.host_plan->version));
  }
  if (in.num_tokens > 0 &&
      (in.x == nullptr || in.topk_idx == nullptr || in.topk_weights == nullptr)) {
    return refuse(absl::InvalidArgumentError(kNullDispatchInput));
  }
  if (reinterpret_cast<uintptr_t>(in.x) % 16 != 0) {
    return refuse(absl::InvalidArgumentError("cuda backend: x must be 16-byte aligned"));
  }
  TakePart();
  dispatch_completed_ = false;
  // The ranks this call, and its combine, wait for and may tell (FailedAfterTakingPart).
  member_.resize(config_.num_ranks);
  for (int r = 0; r < config_.num_ranks; ++r) {
    member_[r] = !RankExcluded(in.host_plan, static_cast<uint32_t>(r));
  }
  Scratch& s = *scratch_;
  Params p = s.params;
  p.num_tokens = in.num_tokens;
  p.layer = in.layer;
  p.plan = in.plan;
  p.x = static_cast<const uint16_t*>(in.x);
  p.topk_idx = in.topk_idx;
  p.topk_weights = in.topk_weights;
  p.epoch = ++dispatch_epoch_;
  p.off_completed = layout_.dispatch_completed;
  p.flagged = FlaggedRows(!p.bsp, in.num_tokens, config_.flagged_tokens, layout_.row_bytes);
  last_tokens_ = in.num_tokens;
  // Combine takes these from this call, whatever its outcome: the caller calls it after any
  // error but a timeout or an abort (the peers wait for this rank's partials).
  s.params.flagged = p.flagged;  // Combine takes its partials as its rows went.
  s.params.num_tokens = p.num_tokens;
  s.params.layer = p.layer;
  s.params.plan = p.plan;  // Combine waits for the same ranks as its dispatch.
  const uint32_t barrier_before = barrier_epoch_;
  // An earlier unchecked error of this thread (a refusal record's copy, which may fail
  // harmlessly) is not this call's: the launches below are checked by cudaGetLastError. A
  // sticky error (a broken context) comes back at that check.
  (void)cudaGetLastError();
  // After the caller's work on the legacy default stream (its uploads of the input).
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaEventRecord(s.legacy, cudaStreamLegacy));
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaStreamWaitEvent(s.stream, s.legacy, 0));
  GateKernel<<<1, 32, 0, s.stream>>>(p);  // Clears the status words; the abort word's look.
  if (fail_after_taking_part_for_testing_) {
    return FailedAfterTakingPart(
        absl::InternalError("cuda backend: a launch failed (for the test)"));
  }
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaMemsetAsync(p.published, 0, s.zeroed_bytes, s.stream));
  const size_t per_rank_shared = sizeof(int32_t) * config_.num_ranks;
  bool launched = false;
  if (s.fused) {
    int count_blocks = s.count_blocks;
    void* args[] = {&p, &count_blocks};
    const cudaError_t error = cudaLaunchCooperativeKernel(
        reinterpret_cast<const void*>(SendKernel), dim3(count_blocks + 1 + kSenderBlocks),
        dim3(kThreads), args, per_rank_shared, s.stream);
    launched = error == cudaSuccess;
    // Create checked the grid against the device's occupancy, so the driver should take it;
    // if it still finds the grid too large to keep resident, this call counts first, then sends.
    if (error == cudaErrorCooperativeLaunchTooLarge) (void)cudaGetLastError();
    if (!launched && error != cudaErrorCooperativeLaunchTooLarge) {
      UBEP_CUDA_FAIL_CALL_IF_ERROR(error);
    }
  }
  if (!launched) {
    RouteKernel<<<config_.num_ranks, kThreads, 0, s.stream>>>(p);
    if (p.bsp) {  // Count exchange, barrier.
      WaitKernel<<<1, 128, 0, s.stream>>>(p, p.off_count_flag, kPhaseCountExchange, Skip::kNone);
      BarrierKernel<<<1, 128, 0, s.stream>>>(p, ++barrier_epoch_);
    }
    UnitScanKernel<<<1, kThreads, 0, s.stream>>>(p);
    RowKernel<<<kSenderBlocks, kThreads, per_rank_shared, s.stream>>>(p);
  }
  // bsp: a barrier, then the receive side. ubep: the receive side is laid out from the
  // sources' records as soon as their counts are in (the records come with the counts), and
  // the rows are copied once each source's rows are complete.
  if (p.bsp) {
    BarrierKernel<<<1, 128, 0, s.stream>>>(p, ++barrier_epoch_);
  } else {
    WaitKernel<<<1, 128, 0, s.stream>>>(p, p.off_count_flag, kPhaseCounts, Skip::kNone);
  }
  CountKernel<<<config_.num_ranks, kThreads, 0, s.stream>>>(p);
  ScanKernel<<<1, kThreads, 0, s.stream>>>(p);
  PlaceKernel<<<config_.num_ranks, kThreads, sizeof(int) * config_.slots_per_rank, s.stream>>>(p);
  // Flagged sources are waited for row by row, in CopyKernel.
  if (!p.bsp) {
    WaitKernel<<<1, 128, 0, s.stream>>>(p, p.off_dispatch_flag, kPhaseAsCalled,
                                        Skip::kFlaggedSources);
  }
  CopyKernel<<<s.wide_blocks, kThreads, 0, s.stream>>>(p, /*flagged_sources=*/false);
  if (config_.flagged_tokens > 0 && !p.bsp) {
    CopyKernel<<<s.poll_blocks, kThreads, 0, s.stream>>>(p, /*flagged_sources=*/true);
  }
  LoadKernel<<<1, kThreads, 0, s.stream>>>(p);
  if (config_.flagged_tokens > 0 && TagScrubDue(p.epoch)) {
    ScrubKernel<<<s.wide_blocks, kThreads, 0, s.stream>>>(p, p.off_rows, ScrubTag(p.epoch));
  }
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaGetLastError());
  // Read with the status (CheckStatus synchronizes the stream once for both).
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaMemcpyAsync(s.host_slot_offsets, p.slot_offsets,
                                               sizeof(int32_t) * (config_.slots_per_rank + 1),
                                               cudaMemcpyDeviceToHost, s.stream));
  // bsp's waits are named by their phases (count exchange, barrier), as on the host.
  // (The refusal word cleared first: a CheckStatus whose copy failed leaves the host words
  // as an earlier call left them, which must not read as this call's refusal.)
  s.host_status[kStatusRefused] = 0;
  const absl::Status st = CheckStatus("dispatch data", p.epoch, &in);
  if (const uint32_t code = s.host_status[kStatusRefused]; code != 0) {
    // Refused before any byte moved: the call did not happen (as on the host, where the look
    // comes before the call takes its epoch).
    --dispatch_epoch_;
    barrier_epoch_ = barrier_before;
    return DispatchAfterGiveUpStatus(code, rank_, config_.protocol, p.epoch);
  }
  // Bad input and an overflow of the receive capacity leave the call to complete (below).
  if (!st.ok() && !absl::IsInvalidArgument(st) && !absl::IsResourceExhausted(st)) return st;
  out.slot_offsets.assign(s.host_slot_offsets,
                          s.host_slot_offsets + config_.slots_per_rank + 1);
  // Over the receive capacity, recv_x holds the first max_rows rows of the layout.
  out.num_rows = std::min(out.slot_offsets.back(), s.params.max_rows);
  last_rows_ = out.num_rows;
  dispatch_completed_ = true;
  out.recv_x = p.recv_x;
  out.src_rank = p.src_rank;
  out.src_token = p.src_token;
  out.weight = p.weight;
  // Bad input (an expert id out of range) or more rows than the receive capacity: the error,
  // with the rest dispatched; the peers wait for this rank's partials, so the caller still
  // calls Combine.
  return st;
}

absl::Status CudaEp::Combine(const void* y, void* out) {
  const ScopedDevice on_device(device_);
  if (!on_device.status().ok()) return on_device.status();
  if (combine_epoch_ + 1 != dispatch_epoch_) {
    return Refuse(absl::FailedPreconditionError("combine without a dispatch before it"),
                  /*keep_earlier=*/true);
  }
  if (!dispatch_completed_) {
    // Its scratch may hold an earlier call's layout: nothing of it is read, nothing is stored.
    return CombineAfterFailedDispatchStatus(rank_, dispatch_epoch_);
  }
  if ((y == nullptr && last_rows_ > 0) || (out == nullptr && last_tokens_ > 0)) {
    return Refuse(absl::InvalidArgumentError(kNullCombineBuffers));
  }
  if (reinterpret_cast<uintptr_t>(y) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    return Refuse(absl::InvalidArgumentError("cuda backend: y and out must be 16-byte aligned"));
  }
  TakePart();
  Scratch& s = *scratch_;
  Params p = s.params;
  p.epoch = ++combine_epoch_;
  p.off_completed = layout_.combine_completed;
  // After the caller's work on the legacy default stream (its expert outputs, y).
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaEventRecord(s.legacy, cudaStreamLegacy));
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaStreamWaitEvent(s.stream, s.legacy, 0));
  UBEP_CUDA_FAIL_CALL_IF_ERROR(
      cudaMemsetAsync(p.status, 0, kStatusWords * sizeof(uint32_t), s.stream));
  UBEP_CUDA_FAIL_CALL_IF_ERROR(
      cudaMemsetAsync(p.combine_done, 0, sizeof(int32_t) * config_.num_ranks, s.stream));
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaMemsetAsync(p.deadline, 0, sizeof(*p.deadline), s.stream));
  (void)cudaGetLastError();  // Not this call's (as in Dispatch).
  PartialKernel<<<s.wide_blocks, kThreads, 0, s.stream>>>(p, static_cast<const uint16_t*>(y));
  if (p.bsp) {
    BarrierKernel<<<1, 128, 0, s.stream>>>(p, ++barrier_epoch_);
  } else {  // Flagged partials are waited for one by one, in TokenKernel.
    WaitKernel<<<1, 128, 0, s.stream>>>(p, p.off_combine_flag, kPhaseAsCalled,
                                        Skip::kFlaggedDestinations);
  }
  CompletedKernel<<<1, 1, 0, s.stream>>>(p);  // Its partials and flags are all stored.
  if (last_tokens_ > 0) {
    const int grid = p.flagged ? std::min(last_tokens_, s.poll_blocks) : last_tokens_;
    TokenKernel<<<grid, kThreads, 0, s.stream>>>(p, static_cast<uint16_t*>(out), last_tokens_);
  }
  OverflowKernel<<<1, kThreads, 0, s.stream>>>(p);
  if (config_.flagged_tokens > 0 && TagScrubDue(p.epoch)) {
    ScrubKernel<<<s.wide_blocks, kThreads, 0, s.stream>>>(p, p.off_partials, ScrubTag(p.epoch));
  }
  UBEP_CUDA_FAIL_CALL_IF_ERROR(cudaGetLastError());
  return CheckStatus("combine partials", p.epoch);
}

}  // namespace ubep::kernels
