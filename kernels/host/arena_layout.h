// The host backend's per-rank arena: configuration and byte layout.
//
// Each rank owns one arena; peers store into it. Offsets from the arena base, every region
// 64-byte aligned (R ranks, T = max_tokens, K = top_k, H = hidden, S = slots_per_rank,
// L = num_layers, B = bytes of one row of config.dtype):
//
//   header          64 B       magic, rank, config echo (checked when a peer attaches)
//   dispatch_flag   R x 64 B   [s]: epoch of the last dispatch whose data source s stored here
//   combine_flag    R x 64 B   [d]: epoch of the last combine whose partials rank d stored here
//   count_flag      R x 64 B   [s]: epoch of the last dispatch whose records and count source s
//                              stored here (ubep's offsets, bsp's count exchange)
//   barrier_flag    R x 64 B   [s]: last barrier epoch rank s reached
//   abort           64 B       [0] 0 while healthy, else why the group stopped (AbortCode):
//                              set by the first rank whose wait timed out, so that every rank
//                              reports the dead peer rather than a survivor stuck behind it,
//                              or by the daemon (a rank left, or the daemon is draining);
//                              [4], [8] the epochs of the last dispatch and combine the owner
//                              completed (MarkCompleted), which its peers read if it leaves;
//                              [16] 8 B: the deadline of the call the owner is in and its
//                              depth, 0 between calls (PublishInCall), which its peers read
//                              when they time out
//   sleepers        64 B       signal.h's Doorbell of this arena's flags: [0] threads of the
//                              owner asleep (or about to be) on one flag, [4] the bell, moved
//                              by every Signal into this arena and by RaiseAbort, [8] threads
//                              of the owner asleep on the bell; a Signal makes a wake syscall
//                              only for a count that is not zero
//   refusal         256 B      the last call the owner refused before taking part (bad input,
//                              RecordRefusal): [0] a sequence word (odd while written), [4]
//                              the phase (0 dispatch, 1 combine), [8] the call, [12..] why,
//                              NUL-terminated; peers that time out waiting for the owner in
//                              that call report why instead of asking whether it is alive
//   notices         R x 64 B   [d]: ReceiveNotice of rank d's last dispatch (PostReceiveNotice):
//                              [0] the call, [4] the rows routed to d, [8] d's receive
//                              capacity (EpConfig::max_recv_rows); more rows than capacity
//                              fail the call's combine on every rank
//   counts          R x 4 B    [s]: records source s stored in the current dispatch
//   call_tags       R x 8 B    [s]: CallTag of source s's current dispatch (its layer and
//                              step), stored before its count flag: a receiver whose own
//                              call is of another layer or step fails the call (a rank that
//                              went on to its next call after one it refused)
//   load_counters   L x S x 8  [l][i]: routed pairs received, monotonic (owner only writes)
//   load_seq        L x 8      [l]: 2 x the dispatches of layer l counted in load_counters;
//                              odd while the owner adds one (a seqlock: a reader takes a
//                              layer's counters and the dispatches they cover together)
//   records         R x T x (8 + 8K)   [s][j]: record j from source s (routing.h)
//   rows            R x W              [s][j]: hidden row of record j from source s
//   partials        R x W              [d][j]: partial sum rank d computed for this rank's
//                                      j-th token sent to d (fp32 sum, stored in dtype)
//
// W = row_stride = T x B + F x 2B, F = flagged_tokens: a call of up to F tokens stores its rows
// and gets its partials back in the flag-in-granule format (flagged_rows.h), 2B per row, in
// the F x 2B after the T plain rows of each part.
//
// Senders own the slots [s][*] of every peer's arena, receivers only read them: no two ranks
// write the same byte. One flag per cache line, so polling does not false-share.
#ifndef UBEP_KERNELS_HOST_ARENA_LAYOUT_H_
#define UBEP_KERNELS_HOST_ARENA_LAYOUT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/host/signal.h"

namespace ubep::kernels {

// One flag per cache line: flag [s] of a flag region lies at region + s x kFlagStride.
inline constexpr size_t kFlagStride = 64;

enum class DType : uint32_t { kFloat32 = 0, kBFloat16 = 1 };

inline size_t DTypeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// kBsp: count exchange, barrier, send, barrier. kUbep: point-to-point epoch flags (host_ep.h).
enum class Protocol { kBsp, kUbep };

// "bsp" or "ubep": the protocol's name in flags, messages and RPCs.
inline const char* ProtocolName(Protocol protocol) {
  return protocol == Protocol::kBsp ? "bsp" : "ubep";
}

struct EpConfig {
  int num_ranks = 0;
  int max_tokens = 0;       // Per rank per call.
  int hidden = 0;
  int top_k = 0;            // At most kMaxTopK.
  int num_experts = 0;
  int slots_per_rank = 0;
  int num_layers = 1;
  DType dtype = DType::kFloat32;
  Protocol protocol{};
  // A call's waits give up this long after it began, naming the peer they wait for; on the
  // host backend, while that peer is in a call (stuck behind another rank, or killed in it),
  // until its deadline and a grace, at most twice this and 3 s (HostEp::WaitForPeer).
  absl::Duration timeout = absl::Seconds(10);
  // kUbep: run the sender role on its own thread while the caller receives. Worth it only
  // with a core to spare for every rank's second thread; kAuto decides from the core count.
  enum class SenderThread { kAuto, kOn, kOff } sender_thread = SenderThread::kAuto;
  // Threads of the sender role when it has its own (send_split.h splits the row stores among
  // them, any two within one row of each other). At most kMaxSenderThreads.
  int sender_threads = 1;
  // kUbep: a call of at most this many tokens (on the calling rank) stores its rows, and gets
  // its combine partials back, as flag-in-granule rows (kernels/common/flagged_rows.h): the
  // receiver takes each row as it lands, without waiting for the source's flag. Twice the
  // bytes per row, so meant for decode-sized calls; the landing grows to hold that many
  // flagged rows when that is more than max_tokens plain ones. 0: never. At most max_tokens.
  int flagged_tokens = 0;
  // Ranks per one-hop neighbourhood (a node of a load/store domain that spans several:
  // consecutive ranks, send_split.h's VisitOrder); 0 = every rank is one hop away. Only the
  // order in which a rank's senders visit destinations depends on it, never a byte.
  int near_ranks = 0;
  // Rows (routed pairs) a dispatch lays out on this rank, at most; 0: as many as can come,
  // ranks x max_tokens x min(top_k, slots_per_rank) (ReceiveCapacity), which is what the
  // CUDA backend's receive buffers are sized for. A dispatch that routes this rank more keeps
  // the first max_recv_rows rows of its layout and fails with ResourceExhausted, and so does
  // the combine of every rank of the group (OverCapacityStatus, PeerOverCapacityStatus): no
  // rank takes partial sums for whole ones, and the call fails everywhere, as a collective's
  // error does. Each rank may set its own.
  int max_recv_rows = 0;
};

// The rows a dispatch may lay out on a rank of `config`: EpConfig::max_recv_rows, or the most
// that can come when it is 0 (at most INT32_MAX).
int32_t ReceiveCapacity(const EpConfig& config);

inline constexpr int kMaxSenderThreads = 64;

inline constexpr int kMaxTopK = 32;
// The largest row and call any backend takes (ubepd takes less: common/shape_limits.h); with
// the rows a call may bring a rank bounded by 2^31 - 1, no size of the arena's layout wraps.
inline constexpr int kMaxConfigHidden = 1 << 24;
inline constexpr int kMaxConfigTokens = 1 << 30;

// OK when every size is positive and within its bound (hidden, max_tokens, top_k, the rows
// and pairs of one call), slots cover the experts and the options are in range.
absl::Status ValidateConfig(const EpConfig& config);

// Values of the abort word. Every wait checks it (signal.h) and fails with an error naming
// the rank or the reason; only a reset of the whole group (ResetSignals) clears it.
inline constexpr uint32_t kAbortTimedOutBase = 1;         // + rank a wait timed out on.
inline constexpr uint32_t kAbortRankGone = 0x80000000u;   // | rank that left (daemon, or
                                                          // the rank on losing its daemon).
inline constexpr uint32_t kAbortDraining = 0xFFFFFFFFu;   // The daemon is shutting down.
inline constexpr uint32_t kAbortMembership = 0xFFFFFFFEu; // A plan excluded or included ranks.

// What an abort word says, read in one place: the daemon's two codes above also have
// kAbortRankGone's bit set, so they are told apart before it.
struct AbortReason {
  enum Kind { kNone, kTimedOut, kRankGone, kDraining, kMembership } kind;
  int rank;  // kTimedOut: the rank a wait gave up on; kRankGone: the rank that left; else -1.
};
AbortReason ReadAbortCode(uint32_t code);

// The rank an abort code says left the group (ubepd saw it detach or disconnect, or the rank
// found its ubepd gone), or -1.
// Kernels read it too.
constexpr int RankThatLeft(uint32_t code) {
  return (code & kAbortRankGone) != 0 && code != kAbortDraining && code != kAbortMembership
             ? static_cast<int>(code & ~kAbortRankGone)
             : -1;
}

// The error for a wait of `rank` that found the abort word set to a daemon's code (rank gone
// or draining); OK for 0 or a peer's timeout code (the caller reports timeouts itself).
// `what` names the phase, `call` the epoch.
absl::Status DaemonAbortStatus(uint32_t code, int rank, const char* what, uint32_t call);

// The refusal of `rank`'s dispatch call `call` found, before any byte moved, with the abort
// word at `code` (not 0): the group gave up in an earlier call, or in this one before `rank`
// came (or its daemon stopped it), and must be re-formed. The daemon's words for its codes,
// as the call's first wait would say them; else Unavailable naming the rank the group
// gave up on ("this rank" where it is `rank`). Both backends.
absl::Status DispatchAfterGiveUpStatus(uint32_t code, int rank, Protocol protocol, uint32_t call);

// How much longer than its call's deadline a wait was given at most because `peer`, the rank
// it waited on then, was in a call of its own (HostEp::WaitForPeer).
struct GivenPatience {
  int peer;
  absl::Duration up_to;
};

// The error for `rank`'s wait on `peer` (in `what` of call `call`) that gave up after
// `timeout`, given the abort word as it stands after this rank raised it: the rank the group
// gave up on (kAbortTimedOutBase + that rank) is named, and `peer` too if it differs (a
// survivor stuck behind the dead rank). Both backends report timeouts in these words. A
// non-empty `refusal` is why the rank the group gave up on refused this call (ReadRefusal),
// said in place of asking whether it is alive. A `patience` is said with it.
absl::Status TimedOutStatus(uint32_t code, int rank, int peer, absl::Duration timeout,
                            const char* what, uint32_t call, absl::string_view refusal = {},
                            std::optional<GivenPatience> patience = std::nullopt);

// A Combine after a Dispatch of `call` that did not complete (a wait that ended, an abort):
// refused before it reads the output or stores a byte, by both backends.
absl::Status CombineAfterFailedDispatchStatus(int rank, uint32_t call);

// The rank a timeout code names as the one the group gave up on, else `peer` (the rank this
// rank waited for): the rank TimedOutStatus reports.
int RankGivenUpOn(uint32_t code, int peer);

struct ArenaLayout {
  size_t dispatch_flag, combine_flag, count_flag, barrier_flag, abort, dispatch_completed,
      combine_completed, published_call, sleepers, bell, bell_sleepers, refusal, notices, counts,
      call_tags, load_counters, load_seq, records, rows, partials, total_bytes;
  size_t record_bytes, row_bytes;
  size_t row_stride;  // Bytes per source (or destination) in rows and partials.
  size_t flagged_offset;  // Where the flagged rows start in a source's part: T x B.
  int num_ranks, max_tokens, flagged_tokens;

  explicit ArenaLayout(const EpConfig& config);
  ArenaLayout() = default;
};

// A rank that refuses a call before taking part (bad input: a clear error before any byte
// moves) leaves its peers waiting for it in that call until their timeout, in case its caller
// calls again with good input. So that they then say why, the rank records the refusal in its
// own arena: the phase its peers wait for it in (AwaitedPhase) and the error's message
// (the first kRefusalChars bytes). The owner writes, any rank reads: a sequence word, odd
// while the owner writes the body after it (a seqlock).
inline constexpr size_t kRefusalBytes = 256;  // The region: sequence word, then the body.
inline constexpr size_t kRefusalBody = kRefusalBytes - sizeof(uint32_t);
inline constexpr size_t kRefusalChars = kRefusalBody - 2 * sizeof(uint32_t) - 1;

// A phase (dispatch or combine) of a call, as a refusal record names it.
struct CallPhase {
  bool combine;
  uint32_t call;
  bool operator==(const CallPhase&) const = default;
};

// What a rank's peers wait for it in while it is between calls, given its last dispatch and
// combine epochs: its partials of the call it dispatched and has not combined, else its
// dispatch of the next call. The phase a refusal of its next call names.
constexpr CallPhase AwaitedPhase(uint32_t dispatch_epoch, uint32_t combine_epoch) {
  return combine_epoch != dispatch_epoch ? CallPhase{true, dispatch_epoch}
                                         : CallPhase{false, dispatch_epoch + 1};
}

// The phase a rank is in while it waits inside a call, its epoch already advanced: within a
// dispatch its epoch is one past the last combine's, within a combine they are equal.
constexpr CallPhase PhaseInFlight(uint32_t dispatch_epoch, uint32_t combine_epoch) {
  return {combine_epoch == dispatch_epoch, dispatch_epoch};
}

void RecordRefusal(std::byte* arena, const ArenaLayout& layout, CallPhase phase,
                   absl::string_view why);

// A seqlock's word while its owner rewrites what it guards (the refusal record, a layer's
// load counters), given the word before: odd, and past it; the rewrite done, it becomes one
// more. An owner killed mid-rewrite leaves the word odd: the next one goes on from the next
// odd value, so the parity holds again rather than staying inverted.
template <typename Word>
constexpr Word SeqWhileWriting(Word before) {
  return (before + 1) | 1u;
}

// Overwrites the record with one that matches no phase and call: its rank takes part in a
// call after it refused one (its caller called again), so the refusal no longer explains a
// wait for it.
void WithdrawRefusal(std::byte* arena, const ArenaLayout& layout);

// What RecordRefusal recorded in `arena` for the phase and call, or "" if its last refusal was
// of another one (or none, or withdrawn, or it is being rewritten).
std::string ReadRefusal(const std::byte* arena, const ArenaLayout& layout, CallPhase phase);

// The body of a refusal record, for a backend that copies it whole (device memory):
// FormatRefusal writes one (FormatWithdrawnRefusal one that matches nothing), ParseRefusal
// reads one back for the phase and call, or "".
void FormatRefusal(CallPhase phase, absl::string_view why, std::byte (&body)[kRefusalBody]);
void FormatWithdrawnRefusal(std::byte (&body)[kRefusalBody]);
std::string ParseRefusal(const std::byte (&body)[kRefusalBody], CallPhase phase);

// What a rank's dispatch laid out: the rows routed to it and its receive capacity
// (ReceiveCapacity). Every dispatch that completes posts one into the arena of every rank of
// the group (the call word last, with release), before its combine stores any partial, flag
// or barrier word, all of which every peer's combine acquires before it reads the notices; a
// rank's combine reads every active rank's notice and fails if one of this call overflowed,
// so that the call fails on every rank of the group, as a collective's error does (an engine
// that abandons the step on an error keeps its ranks' calls paired). Posted in every call, so
// that a notice of an earlier call never passes for this one's, whatever the epoch's wrap; and
// into the reader's own arena, in the slot of the rank that posts it, so that no peer
// overwrites it while its reader may still read it: the poster posts its next one only once it
// has the reader's counts of the next call, which the reader sends after its combine (an
// excluded rank is posted nothing).
struct ReceiveNotice {
  uint32_t call;
  uint32_t rows;      // Rows routed to the posting rank in that call.
  uint32_t capacity;  // Its receive capacity.
  bool OverflowedIn(uint32_t c) const { return call == c && rows > capacity; }
};
// The CUDA backend copies a notice out of device memory whole: words [0], [4], [8].
static_assert(sizeof(ReceiveNotice) == 3 * sizeof(uint32_t));
// Rank `from`'s notice into `arena` (a peer's, or its own).
void PostReceiveNotice(std::byte* arena, const ArenaLayout& layout, int from,
                       const ReceiveNotice& notice);
// The notice rank `from` last posted into `arena`.
ReceiveNotice ReadReceiveNotice(const std::byte* arena, const ArenaLayout& layout, int from);

// The error of the dispatch (call `call`) that routed `rank` more rows than its capacity.
absl::Status OverCapacityStatus(int rank, uint32_t call, const ReceiveNotice& notice);
// The error of `rank`'s combine of call `call` in which `peer` overflowed (the lowest such
// rank): the sums of the tokens sent there are incomplete, and the call fails everywhere.
absl::Status PeerOverCapacityStatus(int rank, uint32_t call, int peer,
                                    const ReceiveNotice& notice);

// Which call of the caller's a dispatch is: its layer and the low 32 bits of its step. Every
// rank of a call must be in the same one; a rank whose caller went on to its next call after
// a call it refused (rather than calling it again) would otherwise be paired with its peers'
// call of another layer, its tokens routed by one layer's plan and summed by another's
// experts, with every call returning OK.
inline uint64_t CallTag(int layer, uint64_t step) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(step)) << 32) | static_cast<uint32_t>(layer);
}
inline int CallTagLayer(uint64_t tag) { return static_cast<int>(static_cast<uint32_t>(tag)); }
inline uint32_t CallTagStep(uint64_t tag) { return static_cast<uint32_t>(tag >> 32); }

// The error of a dispatch whose sources were not all in this rank's call (`own`), naming the
// lowest source `peer` that was not (its tag `theirs`); and of that call's combine.
absl::Status CallsOutOfStepStatus(int rank, uint32_t call, uint64_t own, int peer,
                                  uint64_t theirs, bool combine);

// A rank that left the group after completing a call owes that call nothing more. At the
// end of each successful dispatch (combine) a rank stores the call's epoch into its own
// arena; by then every flag and byte the call owes its peers is stored (both protocols, both
// backends). A peer whose wait in that call finds the abort word naming the rank that left
// (RankThatLeft) reads these words and goes on waiting for its other sources if the rank had
// completed the call (LeftAfter); ubepd need not know who is in which call. Without this, a
// rank that finished its last step and exited would stop peers whose last call still had data
// on its way from the others.
void MarkCompleted(std::byte* arena, const ArenaLayout& layout, bool combine, uint32_t epoch);

// A wait that times out on a peer names that peer, unless another rank gave up first and
// named the rank it gave up on (RaiseAbort). Deadlines are per call, so a survivor stuck
// behind a rank that is itself stuck behind the dead one (a peer in an earlier phase, waiting
// on it) can reach its deadline first, on a busy host, and name the survivor. So each rank
// publishes the call it is in, or nothing between calls: a waiter whose deadline passes while
// the peer it waits on is in a call whose deadline is near or still to come waits that long,
// and a grace, more (HostEp::WaitForPeer): the peer gives up on the rank it waits on and names
// it to every rank, or delivers. A waiter that waits longer so publishes the later deadline,
// one deeper, so that ranks behind it wait longer still; the depth bounds each wait.
struct PublishedCall {
  // A point of the monotonic clock, which every process of a host shares; Deadline::max():
  // no timeout.
  Deadline until;
  // 0: the call's own deadline; d: stretched for a peer that published depth d - 1.
  int depth = 0;
  bool operator==(const PublishedCall&) const = default;
};
inline constexpr int kMaxPublishedDepth = 15;  // 4 bits of the word; deeper is stored as 15.
// A chain of waits this deep (each rank waiting for one stuck behind the next) is followed: a
// wait gets patience for a peer published at most kMaxWaitDepth - 1 deep. Deeper is a cycle,
// which a live group cannot form, or two failures at once.
inline constexpr int kMaxWaitDepth = 4;
// nullopt: between calls.
void PublishInCall(std::byte* arena, const ArenaLayout& layout, std::optional<PublishedCall> call);
std::optional<PublishedCall> ReadInCall(const std::byte* arena, const ArenaLayout& layout);

// The dispatch (or combine) epoch a rank created over an arena that has seen calls resumes
// from, so that it continues its peers' count: the later of its own flag in its own arena
// (ubep raises it every call, even one it did not complete) and the last call it completed
// (MarkCompleted, both protocols; bsp raises no dispatch or combine flag).
inline uint32_t ResumedEpoch(uint32_t own_flag, uint32_t completed) {
  return EpochReached(own_flag, completed) ? own_flag : completed;
}

// Whether abort code `code` names a rank that left after it had completed the dispatch (or
// combine, `combine`) of call `epoch`; `arenas` are every rank's arenas.
bool LeftAfter(uint32_t code, std::span<std::byte* const> arenas, const ArenaLayout& layout,
               bool combine, uint32_t epoch);

// Sets an arena's abort word to `code` unless it is already set (the first reason wins), and
// rings its bell, so that its owner, if asleep, sees it at once.
void RaiseAbort(std::byte* arena, const ArenaLayout& layout, uint32_t code);

// The doorbell of an arena's flags (signal.h): its bell and sleepers words.
Doorbell ArenaDoor(std::byte* arena, const ArenaLayout& layout);

// Zeroes the signal words, the abort word, the sleepers and bell words and the per-source counts of
// an arena, keeping its header and load counters: a group that re-forms (every rank parked, none
// inside a dispatch or combine, so none asleep) starts its epochs from zero. When the group uses
// flag-in-granule rows (flagged_tokens > 0), their parts of the rows and partials are zeroed too,
// so that no tag of the old epochs can pass for a new one (flagged_rows.h). Not safe while any rank
// is in a call.
void ResetSignals(std::byte* arena, const ArenaLayout& layout);

// The byte ranges ResetSignals zeroes, as (offset from the arena base, bytes), for arenas in
// device memory: the signal words and counts, then each flagged part of rows and partials.
std::vector<std::pair<size_t, size_t>> ResetRanges(const ArenaLayout& layout);

// The owner's side of the load seqlock: adds one dispatch's received pairs per local slot
// (`added`, S values) to layer `layer`'s counters.
void AddLayerLoad(std::byte* arena, const ArenaLayout& layout, int slots_per_rank, int layer,
                  const int32_t* added);

// A reader's side (any process mapping the arena): copies layer `layer`'s S counters into
// `out` and returns the number of dispatches they count, consistent with each other.
// Retries while the owner is adding; DeadlineExceeded if it never sees the layer still for
// `timeout` (an owner stopped inside AddLayerLoad).
absl::StatusOr<uint64_t> ReadLayerLoad(const std::byte* arena, const ArenaLayout& layout,
                                       int slots_per_rank, int layer, uint64_t* out,
                                       absl::Duration timeout = absl::Milliseconds(100));

// The owner's side after its death: when no process holds the rank any more and the layer's
// sequence word is odd (its owner was killed inside AddLayerLoad), copies the counters as
// they stand into `out` (each is one word: the killed update's counts are in some of them,
// and counted as its dispatch), makes the word even again so that readers read the layer
// again, and returns the dispatches it counts. The caller makes sure no process writes the
// layer meanwhile (ubepd: the rank has no client).
uint64_t SettleLayerLoad(std::byte* arena, const ArenaLayout& layout, int slots_per_rank,
                         int layer, uint64_t* out);

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_ARENA_LAYOUT_H_
