#include "kernels/host/arena_layout.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/common/routing.h"
#include "kernels/host/signal.h"

namespace ubep::kernels {
namespace {

constexpr size_t kLine = 64;  // Regions start on cache lines.
static_assert(kRefusalBytes % kLine == 0);

size_t AlignUp(size_t n) { return (n + kLine - 1) / kLine * kLine; }

}  // namespace

absl::Status ValidateConfig(const EpConfig& c) {
  if (c.num_ranks <= 0 || c.max_tokens <= 0 || c.hidden <= 0 || c.top_k <= 0 ||
      c.num_experts <= 0 || c.slots_per_rank <= 0 || c.num_layers <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ep config: every size must be positive (ranks ", c.num_ranks, ", max_tokens ",
        c.max_tokens, ", hidden ", c.hidden, ", top_k ", c.top_k, ", experts ", c.num_experts,
        ", slots per rank ", c.slots_per_rank, ", layers ", c.num_layers, ")"));
  }
  // Enumerations arrive as integers (a C caller, a header): a value of none of their members
  // would run no protocol to its end (the dispatch taken as bsp, the combine waiting as ubep).
  if (c.protocol != Protocol::kBsp && c.protocol != Protocol::kUbep) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: protocol ",
                                                   static_cast<int>(c.protocol),
                                                   " is neither bsp (0) nor ubep (1)"));
  }
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: dtype ",
                                                   static_cast<uint32_t>(c.dtype),
                                                   " is neither float32 (0) nor bfloat16 (1)"));
  }
  if (c.sender_thread != EpConfig::SenderThread::kAuto &&
      c.sender_thread != EpConfig::SenderThread::kOn &&
      c.sender_thread != EpConfig::SenderThread::kOff) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep config: sender_thread ", static_cast<int>(c.sender_thread),
                     " is none of auto (0), on (1), off (2)"));
  }
  // Bounds under which no size the layout computes wraps (rows of R x T <= 2^31 tokens, each
  // at most 2^26 bytes, twice over with their flagged copies: under 2^61), and a dispatch's
  // token batches stay ints (send_split.h).
  if (c.hidden > kMaxConfigHidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep config: hidden ", c.hidden, " exceeds ", kMaxConfigHidden));
  }
  if (c.max_tokens > kMaxConfigTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep config: max_tokens ", c.max_tokens, " exceeds ", kMaxConfigTokens));
  }
  if (c.top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("ep config: top_k ", c.top_k, " exceeds ", kMaxTopK));
  }
  if (static_cast<int64_t>(c.num_ranks) * c.slots_per_rank < c.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: ", c.num_ranks, " ranks x ",
                                                   c.slots_per_rank, " slots cannot hold ",
                                                   c.num_experts, " experts"));
  }
  // Every slot of the group is one of a plan table's (kMaxPlanSlots at most): a group with
  // more could take no plan (and R x S is an int product where slots are numbered).
  if (const int64_t slots = static_cast<int64_t>(c.num_ranks) * c.slots_per_rank;
      slots > kMaxPlanSlots) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: ", c.num_ranks, " ranks x ",
                                                   c.slots_per_rank, " slots = ", slots,
                                                   " slots, over a plan's ", kMaxPlanSlots));
  }
  // The rows one call may bring a rank are counted in 32 bits (the receive layout's offsets):
  // at most min(top_k, slots per rank) per token and source (MaxPairsPerToken); the tokens'
  // pairs are numbered in 32 bits too.
  if (const int64_t rows = static_cast<int64_t>(c.num_ranks) * c.max_tokens *
                           MaxPairsPerToken(c.top_k, c.slots_per_rank);
      rows > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ep config: ", c.num_ranks, " ranks x ", c.max_tokens, " max_tokens x ",
        MaxPairsPerToken(c.top_k, c.slots_per_rank),
        " pairs per token and rank (min of top_k and slots per rank) = ", rows,
        " rows could reach one rank in one call, over 2^31 - 1"));
  }
  if (const int64_t pairs = static_cast<int64_t>(c.max_tokens) * c.top_k;
      pairs > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: ", c.max_tokens,
                                                   " max_tokens x top_k ", c.top_k, " = ", pairs,
                                                   " pairs of one call, over 2^31 - 1"));
  }
  if (c.sender_threads < 1 || c.sender_threads > kMaxSenderThreads) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: sender_threads ",
                                                   c.sender_threads, " is outside [1, ",
                                                   kMaxSenderThreads, "]"));
  }
  if (c.flagged_tokens < 0 || c.flagged_tokens > c.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: flagged_tokens ",
                                                   c.flagged_tokens, " is outside [0, ",
                                                   c.max_tokens, "] (max_tokens)"));
  }
  if (c.flagged_tokens > 0 && !FlaggedRowsFit(c.hidden * DTypeBytes(c.dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ep config: flagged_tokens needs rows of a multiple of 8 bytes; hidden ", c.hidden,
        " makes ", c.hidden * DTypeBytes(c.dtype)));
  }
  if (c.near_ranks < 0 || c.near_ranks > c.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("ep config: near_ranks ", c.near_ranks,
                                                   " is outside [0, ", c.num_ranks,
                                                   "] (num_ranks)"));
  }
  if (c.max_recv_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ep config: max_recv_rows ", c.max_recv_rows, " is negative (0: as many as can come)"));
  }
  if (c.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ep config: timeout must be positive");
  }
  return absl::OkStatus();
}

int32_t ReceiveCapacity(const EpConfig& c) {
  const int64_t most = static_cast<int64_t>(c.num_ranks) * c.max_tokens *
                       MaxPairsPerToken(c.top_k, c.slots_per_rank);
  const int64_t capacity = c.max_recv_rows > 0 ? std::min<int64_t>(c.max_recv_rows, most) : most;
  return static_cast<int32_t>(std::min<int64_t>(capacity, std::numeric_limits<int32_t>::max()));
}

ArenaLayout::ArenaLayout(const EpConfig& c) {
  const size_t R = c.num_ranks, T = c.max_tokens;
  record_bytes = RecordBytes(c.top_k);
  row_bytes = c.hidden * DTypeBytes(c.dtype);
  flagged_tokens = c.flagged_tokens;
  num_ranks = c.num_ranks;
  max_tokens = c.max_tokens;
  flagged_offset = T * row_bytes;
  row_stride = flagged_offset +
               static_cast<size_t>(std::max(0, c.flagged_tokens)) * FlaggedRowBytes(row_bytes);
  size_t offset = kLine;  // Header.
  auto carve = [&](size_t bytes) {
    const size_t at = offset;
    offset = AlignUp(offset + bytes);
    return at;
  };
  dispatch_flag = carve(R * kFlagStride);
  combine_flag = carve(R * kFlagStride);
  count_flag = carve(R * kFlagStride);
  barrier_flag = carve(R * kFlagStride);
  abort = carve(kLine);
  dispatch_completed = abort + sizeof(uint32_t);
  combine_completed = abort + 2 * sizeof(uint32_t);
  published_call = abort + 2 * sizeof(uint64_t);
  sleepers = carve(kLine);
  // One line: a signaller moves the bell, then reads the counts.
  bell = sleepers + sizeof(uint32_t);
  bell_sleepers = bell + sizeof(uint32_t);
  refusal = carve(kRefusalBytes);
  notices = carve(R * kFlagStride);  // Before counts: ResetSignals zeroes them.
  counts = carve(R * sizeof(uint32_t));
  call_tags = carve(R * sizeof(uint64_t));
  load_counters = carve(static_cast<size_t>(c.num_layers) * c.slots_per_rank * sizeof(uint64_t));
  load_seq = carve(static_cast<size_t>(c.num_layers) * sizeof(uint64_t));
  records = carve(R * T * record_bytes);
  rows = carve(R * row_stride);
  partials = carve(R * row_stride);
  total_bytes = offset;
}

AbortReason ReadAbortCode(uint32_t code) {
  if (code == 0) return {AbortReason::kNone, -1};
  if (code == kAbortDraining) return {AbortReason::kDraining, -1};
  if (code == kAbortMembership) return {AbortReason::kMembership, -1};
  if (const int left = RankThatLeft(code); left >= 0) return {AbortReason::kRankGone, left};
  return {AbortReason::kTimedOut, static_cast<int>(code - kAbortTimedOutBase)};
}

absl::Status DaemonAbortStatus(uint32_t code, int rank, const char* what, uint32_t call) {
  const AbortReason reason = ReadAbortCode(code);
  if (reason.kind == AbortReason::kDraining) {
    return absl::UnavailableError(absl::StrCat("rank ", rank, ": ubepd is draining; ", what,
                                               " of call ", call,
                                               " abandoned; attach again when it is back"));
  }
  if (reason.kind == AbortReason::kMembership) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", rank, ": the group's membership changed (a committed plan excludes or includes "
        "ranks) during ", what, " of call ", call, "; join again"));
  }
  if (reason.kind == AbortReason::kRankGone) {
    const int gone = reason.rank;
    return absl::UnavailableError(absl::StrCat(
        "rank ", rank, ": rank ", gone, " left the group (it detached, rejoined or ended, or its ubepd exited) ",
        "during ", what, " of call ", call, "; join again once rank ", gone, " is back"));
  }
  return absl::OkStatus();
}

absl::Status DispatchAfterGiveUpStatus(uint32_t code, int rank, Protocol protocol,
                                       uint32_t call) {
  UBEP_RETURN_IF_ERROR(DaemonAbortStatus(
      code, rank, protocol == Protocol::kUbep ? "dispatch counts" : "count exchange", call));
  // The abort word does not say in which call: the peers may have given up on the rank in
  // the call it comes to now, late.
  const int given_up_on = RankGivenUpOn(code, rank);
  // The group's state, not the caller's mistake: Unavailable, as a group stopped (the rank
  // must Rejoin), not FailedPrecondition (a call out of order).
  return absl::UnavailableError(absl::StrCat(
      "rank ", rank, ": dispatch call ", call, " refused: the group gave up on ",
      given_up_on == rank ? std::string("this rank") : absl::StrCat("rank ", given_up_on),
      " in this call or an earlier one; it must be re-formed"));
}

int RankGivenUpOn(uint32_t code, int peer) {
  const AbortReason reason = ReadAbortCode(code);
  return reason.kind == AbortReason::kTimedOut ? reason.rank : peer;
}

absl::Status TimedOutStatus(uint32_t code, int rank, int peer, absl::Duration timeout,
                            const char* what, uint32_t call, absl::string_view refusal,
                            std::optional<GivenPatience> patience) {
  const int dead_rank = RankGivenUpOn(code, peer);
  if (dead_rank == rank) {
    // The group gave up on this rank (a peer's wait for it timed out, a peer found its records
    // corrupt, or its own senders or launch failed): asking whether it is alive, or naming the
    // peer it waited on as the one that gave up, would mislead.
    return absl::DeadlineExceededError(absl::StrCat(
        "rank ", rank, ": the group gave up on this rank while it was in ", what, " of call ",
        call, " (its peers' errors say why: a wait for it that timed out, say); the group must "
        "be re-formed"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", rank, ": timed out after ", absl::FormatDuration(timeout), " waiting for rank ",
      dead_rank, " (", what, ", call ", call,
      dead_rank == peer ? "" : absl::StrCat(", waiting on rank ", peer, " which gave up"),
      patience.has_value() ? absl::StrCat("; given up to ", absl::FormatDuration(patience->up_to),
                                          " more as rank ", patience->peer, " was in a call")
                           : "",
      "); ",
      refusal.empty() ? absl::StrCat("is rank ", dead_rank, " alive?")
                      : absl::StrCat("rank ", dead_rank, " refused this call: ", refusal)));
}

absl::Status CombineAfterFailedDispatchStatus(int rank, uint32_t call) {
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, ": combine after dispatch call ", call, " failed; the group must be re-formed"));
}

void FormatRefusal(CallPhase phase, absl::string_view why, std::byte (&body)[kRefusalBody]) {
  std::memset(body, 0, sizeof(body));
  const uint32_t words[2] = {phase.combine ? 1u : 0u, phase.call};
  std::memcpy(body, words, sizeof(words));
  std::memcpy(body + sizeof(words), why.data(), std::min(why.size(), kRefusalChars));
}

void FormatWithdrawnRefusal(std::byte (&body)[kRefusalBody]) {
  // Phase words are 0 (dispatch) or 1 (combine): 2 matches neither.
  FormatRefusal({false, 0}, "", body);
  const uint32_t withdrawn = 2;
  std::memcpy(body, &withdrawn, sizeof(withdrawn));
}

std::string ParseRefusal(const std::byte (&body)[kRefusalBody], CallPhase phase) {
  uint32_t words[2];
  std::memcpy(words, body, sizeof(words));
  if (words[0] != (phase.combine ? 1u : 0u) || words[1] != phase.call) return "";
  const char* why = reinterpret_cast<const char*>(body + sizeof(words));
  return std::string(why, strnlen(why, kRefusalChars));
}

namespace {

// The refusal region's sequence word and body, read and written atomically (the owner may
// rewrite it while a peer reads).
std::atomic_ref<uint32_t> RefusalSeq(const std::byte* arena, const ArenaLayout& layout) {
  return std::atomic_ref<uint32_t>(
      *const_cast<uint32_t*>(reinterpret_cast<const uint32_t*>(arena + layout.refusal)));
}

std::atomic_ref<std::byte> RefusalByte(const std::byte* arena, const ArenaLayout& layout,
                                       size_t i) {
  return std::atomic_ref<std::byte>(
      *const_cast<std::byte*>(arena + layout.refusal + sizeof(uint32_t) + i));
}

// The owner's side of the seqlock.
void WriteRefusal(std::byte* arena, const ArenaLayout& layout,
                  const std::byte (&body)[kRefusalBody]) {
  std::atomic_ref<uint32_t> seq = RefusalSeq(arena, layout);
  // Only the owner writes; odd from here (even if a process of this rank died writing).
  const uint32_t odd = SeqWhileWriting(seq.load(std::memory_order_relaxed));
  seq.store(odd, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < kRefusalBody; ++i) {
    RefusalByte(arena, layout, i).store(body[i], std::memory_order_relaxed);
  }
  seq.store(odd + 1, std::memory_order_release);
}

}  // namespace

void RecordRefusal(std::byte* arena, const ArenaLayout& layout, CallPhase phase,
                   absl::string_view why) {
  std::byte body[kRefusalBody];
  FormatRefusal(phase, why, body);
  WriteRefusal(arena, layout, body);
}

void WithdrawRefusal(std::byte* arena, const ArenaLayout& layout) {
  std::byte body[kRefusalBody];
  FormatWithdrawnRefusal(body);
  WriteRefusal(arena, layout, body);
}

std::string ReadRefusal(const std::byte* arena, const ArenaLayout& layout, CallPhase phase) {
  std::atomic_ref<uint32_t> seq = RefusalSeq(arena, layout);
  // The owner rewrites it only when it refuses a call, or takes part after refusing: a few
  // tries see it still.
  for (int attempt = 0; attempt < 16; ++attempt) {
    const uint32_t before = seq.load(std::memory_order_acquire);
    if (before == 0) return "";
    if (before % 2 != 0) {
      std::this_thread::yield();
      continue;
    }
    std::byte body[kRefusalBody];
    for (size_t i = 0; i < kRefusalBody; ++i) {
      body[i] = RefusalByte(arena, layout, i).load(std::memory_order_relaxed);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (seq.load(std::memory_order_relaxed) == before) return ParseRefusal(body, phase);
  }
  return "";
}

namespace {

std::atomic_ref<uint32_t> NoticeWord(const std::byte* arena, const ArenaLayout& layout, int from,
                                     int i) {
  return std::atomic_ref<uint32_t>(reinterpret_cast<uint32_t*>(
      const_cast<std::byte*>(arena) + layout.notices + from * kFlagStride)[i]);
}

}  // namespace

void PostReceiveNotice(std::byte* arena, const ArenaLayout& layout, int from,
                       const ReceiveNotice& notice) {
  NoticeWord(arena, layout, from, 1).store(notice.rows, std::memory_order_relaxed);
  NoticeWord(arena, layout, from, 2).store(notice.capacity, std::memory_order_relaxed);
  NoticeWord(arena, layout, from, 0).store(notice.call, std::memory_order_release);
}

ReceiveNotice ReadReceiveNotice(const std::byte* arena, const ArenaLayout& layout, int from) {
  const uint32_t call = NoticeWord(arena, layout, from, 0).load(std::memory_order_acquire);
  return {call, NoticeWord(arena, layout, from, 1).load(std::memory_order_relaxed),
          NoticeWord(arena, layout, from, 2).load(std::memory_order_relaxed)};
}

absl::Status OverCapacityStatus(int rank, uint32_t call, const ReceiveNotice& notice) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "rank ", rank, ", dispatch call ", call, ": ", notice.rows,
      " rows routed here, more than its receive capacity of ", notice.capacity,
      " (max_recv_rows); the first ", notice.capacity,
      " are laid out, and this call's combine fails on every rank of the group"));
}

absl::Status PeerOverCapacityStatus(int rank, uint32_t call, int peer,
                                    const ReceiveNotice& notice) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "rank ", rank, ", combine call ", call, ": rank ", peer, " was routed ", notice.rows,
      " rows in this call, more than its receive capacity of ", notice.capacity,
      " (max_recv_rows), so the call fails on every rank of the group: the sums of the tokens "
      "sent there are incomplete"));
}

absl::Status CallsOutOfStepStatus(int rank, uint32_t call, uint64_t own, int peer,
                                  uint64_t theirs, bool combine) {
  return absl::AbortedError(absl::StrCat(
      "rank ", rank, ", ", combine ? "combine" : "dispatch", " call ", call,
      combine ? ": its dispatch paired" : ": pairs", " layer ", CallTagLayer(own), " of step ",
      CallTagStep(own), " here with layer ", CallTagLayer(theirs), " of step ",
      CallTagStep(theirs), " on rank ", peer,
      ": the ranks' calls are out of step (a rank's caller went on to another call after one "
      "that failed, rather than calling it again); the call fails on every rank of the group, "
      "its dispatch complete but for the combine, which every rank still calls"));
}

void MarkCompleted(std::byte* arena, const ArenaLayout& layout, bool combine, uint32_t epoch) {
  const size_t at = combine ? layout.combine_completed : layout.dispatch_completed;
  std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(arena + at))
      .store(epoch, std::memory_order_release);
}

namespace {

std::atomic_ref<uint64_t> InCallWord(const std::byte* arena, const ArenaLayout& layout) {
  return std::atomic_ref<uint64_t>(
      *const_cast<uint64_t*>(reinterpret_cast<const uint64_t*>(arena + layout.published_call)));
}

// The word: the depth in the top 4 bits, the deadline's ticks (nanoseconds of the monotonic
// clock, 36 years of uptime) below, all ones for no timeout; 0 is "between calls" (the clock
// is never at 0 once a host is up).
constexpr int kDepthShift = 60;
constexpr uint64_t kTicksMask = (uint64_t{1} << kDepthShift) - 1;

}  // namespace

void PublishInCall(std::byte* arena, const ArenaLayout& layout, std::optional<PublishedCall> call) {
  uint64_t word = 0;
  if (call.has_value()) {
    const int64_t ticks = call->until.time_since_epoch().count();
    const uint64_t low =
        call->until == Deadline::max() || static_cast<uint64_t>(ticks) >= kTicksMask
            ? kTicksMask
            : static_cast<uint64_t>(std::max<int64_t>(1, ticks));
    const uint64_t depth = static_cast<uint64_t>(std::clamp(call->depth, 0, kMaxPublishedDepth));
    word = depth << kDepthShift | low;
  }
  // Relaxed: advice to peers that have already timed out, ordered with nothing else.
  InCallWord(arena, layout).store(word, std::memory_order_relaxed);
}

std::optional<PublishedCall> ReadInCall(const std::byte* arena, const ArenaLayout& layout) {
  const uint64_t word = InCallWord(arena, layout).load(std::memory_order_relaxed);
  if (word == 0) return std::nullopt;
  const uint64_t low = word & kTicksMask;
  const Deadline until =
      low == kTicksMask ? Deadline::max() : Deadline(Deadline::duration(static_cast<int64_t>(low)));
  return PublishedCall{until, static_cast<int>(word >> kDepthShift)};
}

bool LeftAfter(uint32_t code, std::span<std::byte* const> arenas, const ArenaLayout& layout,
               bool combine, uint32_t epoch) {
  const int left = RankThatLeft(code);
  if (left < 0 || left >= static_cast<int>(arenas.size()) || arenas[left] == nullptr) {
    return false;
  }
  const size_t at = combine ? layout.combine_completed : layout.dispatch_completed;
  return EpochReached(LoadAcquire(reinterpret_cast<const uint32_t*>(arenas[left] + at)), epoch);
}

void RaiseAbort(std::byte* arena, const ArenaLayout& layout, uint32_t code) {
  uint32_t expected = 0;
  std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(arena + layout.abort))
      .compare_exchange_strong(expected, code, std::memory_order_acq_rel);
  Ring(ArenaDoor(arena, layout));
}

Doorbell ArenaDoor(std::byte* arena, const ArenaLayout& layout) {
  return {reinterpret_cast<uint32_t*>(arena + layout.bell),
          reinterpret_cast<uint32_t*>(arena + layout.sleepers),
          reinterpret_cast<uint32_t*>(arena + layout.bell_sleepers)};
}

std::vector<std::pair<size_t, size_t>> ResetRanges(const ArenaLayout& layout) {
  // The signal regions, the abort word, the sleepers and bell words and the counts are contiguous,
  // from dispatch_flag to load_counters.
  std::vector<std::pair<size_t, size_t>> ranges = {
      {layout.dispatch_flag, layout.load_counters - layout.dispatch_flag}};
  if (layout.flagged_tokens > 0) {
    for (size_t region : {layout.rows, layout.partials}) {
      for (int s = 0; s < layout.num_ranks; ++s) {
        ranges.emplace_back(region + s * layout.row_stride + layout.flagged_offset,
                            layout.row_stride - layout.flagged_offset);
      }
    }
  }
  return ranges;
}

void ResetSignals(std::byte* arena, const ArenaLayout& layout) {
  for (const auto& [offset, bytes] : ResetRanges(layout)) std::memset(arena + offset, 0, bytes);
}

void AddLayerLoad(std::byte* arena, const ArenaLayout& layout, int slots_per_rank, int layer,
                  const int32_t* added) {
  auto* seq_word = reinterpret_cast<uint64_t*>(arena + layout.load_seq) + layer;
  auto* counters = reinterpret_cast<uint64_t*>(arena + layout.load_counters) +
                   static_cast<size_t>(layer) * slots_per_rank;
  std::atomic_ref<uint64_t> seq(*seq_word);
  // Only the owner writes; odd only if an owner before it was killed mid-update.
  const uint64_t odd = SeqWhileWriting(seq.load(std::memory_order_relaxed));
  seq.store(odd, std::memory_order_relaxed);
  // Release on each counter (no fence): a reader that sees a new count sees the odd word too.
  for (int i = 0; i < slots_per_rank; ++i) {
    std::atomic_ref<uint64_t> counter(counters[i]);
    counter.store(counter.load(std::memory_order_relaxed) + static_cast<uint64_t>(added[i]),
                  std::memory_order_release);
  }
  seq.store(odd + 1, std::memory_order_release);
}

absl::StatusOr<uint64_t> ReadLayerLoad(const std::byte* arena, const ArenaLayout& layout,
                                       int slots_per_rank, int layer, uint64_t* out,
                                       absl::Duration timeout) {
  auto* seq_word = const_cast<uint64_t*>(reinterpret_cast<const uint64_t*>(arena + layout.load_seq) + layer);
  auto* counters = const_cast<uint64_t*>(reinterpret_cast<const uint64_t*>(arena + layout.load_counters) +
                                         static_cast<size_t>(layer) * slots_per_rank);
  std::atomic_ref<uint64_t> seq(*seq_word);
  const Deadline deadline = DeadlineAfter(timeout);
  for (int attempt = 0;; ++attempt) {
    const uint64_t before = seq.load(std::memory_order_acquire);
    if (before % 2 == 0) {
      // Acquire loads: the check below cannot move above them (no fence needed).
      for (int i = 0; i < slots_per_rank; ++i) {
        out[i] = std::atomic_ref<uint64_t>(counters[i]).load(std::memory_order_acquire);
      }
      if (seq.load(std::memory_order_relaxed) == before) return before / 2;
    }
    // The owner adds S numbers: a few tries see it done; past that, check the clock.
    if (attempt >= 64) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "load counters of layer ", layer, " kept changing for ", absl::FormatDuration(timeout),
            " (sequence ", seq.load(std::memory_order_relaxed), "): their owner stopped mid-update"));
      }
      std::this_thread::yield();
    }
  }
}

uint64_t SettleLayerLoad(std::byte* arena, const ArenaLayout& layout, int slots_per_rank,
                         int layer, uint64_t* out) {
  auto* seq_word = reinterpret_cast<uint64_t*>(arena + layout.load_seq) + layer;
  const auto* counters = reinterpret_cast<const uint64_t*>(arena + layout.load_counters) +
                         static_cast<size_t>(layer) * slots_per_rank;
  std::atomic_ref<uint64_t> seq(*seq_word);
  uint64_t word = seq.load(std::memory_order_acquire);
  if (word % 2 != 0) {
    ++word;
    seq.store(word, std::memory_order_release);
  }
  for (int i = 0; i < slots_per_rank; ++i) {
    out[i] = std::atomic_ref<const uint64_t>(counters[i]).load(std::memory_order_acquire);
  }
  return word / 2;
}

}  // namespace ubep::kernels
