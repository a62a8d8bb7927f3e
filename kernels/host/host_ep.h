// HostEp: dispatch and combine for one rank on the host backend. Ranks are threads or
// processes of one machine that map each other's arenas (SharedArena); every byte a rank
// receives is stored into its arena by the sending rank, with no copy through a third party.
//
//   HostEp ep = *HostEp::Create(config, rank, arena_pointers);   // every rank, same config
//   DispatchOutput out;
//   UBEP_RETURN_IF_ERROR(ep.Dispatch({x, topk_idx, topk_w, num_tokens, hidden, layer, plan},
//                                    out));
//   ... experts compute y for out.recv_x (rows grouped by local slot) ...
//   UBEP_RETURN_IF_ERROR(ep.Combine(out, y, combined));
//
// Protocols (EpConfig::protocol), identical bytes out:
//  - kBsp: count exchange, barrier, send, barrier (the phase-by-phase baseline);
//  - kUbep: the calling thread counts (routes the pairs and stores the records) batch by batch
//    while the sender role (EpConfig::sender_threads threads) stores the rows of the batches
//    counted, split evenly (send_split.h). Each destination gets two epoch-tagged flags from
//    this rank: its count (raised when counting is done) and its completion (raised by
//    whoever completes its rows). The calling thread, done counting, lays out its receive
//    side once every source's count is in and places each source's rows as they complete;
//    no global barrier and no clearing between calls. With no core to spare for the
//    senders, the calling thread counts, sends, then receives.
// Every wait has EpConfig::timeout; a peer that does not arrive becomes a DeadlineExceeded
// error naming it. Bad input is rejected before any byte moves.
// Thread-compatible: one HostEp per rank, called by one thread at a time; all ranks call
// Dispatch and Combine in the same order (dispatch is collective).
#ifndef UBEP_KERNELS_HOST_HOST_EP_H_
#define UBEP_KERNELS_HOST_HOST_EP_H_

#include <atomic>
#include <exception>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/common/plan_area.h"
#include "kernels/common/plan_table.h"
#include "kernels/common/routing.h"
#include "kernels/host/arena_layout.h"

namespace ubep::kernels {

struct DispatchInput {
  const void* x = nullptr;             // [num_tokens, hidden] of config.dtype.
  const int32_t* topk_idx = nullptr;   // [num_tokens, top_k]: logical expert, or -1 (masked).
  const float* topk_weights = nullptr; // [num_tokens, top_k].
  int num_tokens = 0;
  int hidden = 0;                      // Must equal config.hidden.
  int layer = 0;
  const PlanTableHeader* plan = nullptr;  // Validated table (ValidatePlanTable), or:
  // A PlanArea (plan_area.h) whose buffers hold `plan_capacity` bytes: the plan in force at
  // `step` is used, checked the first time (SelectCheckedPlan; a corrupt one is refused with
  // DataLoss before any byte moves).
  void* plan_area = nullptr;
  size_t plan_capacity = 0;
  // The caller's step. With `layer`, it must be the same on every rank of a call (CallTag):
  // a call whose ranks differ in either fails on every rank (Aborted).
  uint64_t step = 0;
};

// What one rank received, rows grouped by local slot (slot i's rows are
// [slot_offsets[i], slot_offsets[i + 1])), in (source rank, source token, k) order.
struct DispatchOutput {
  uint64_t plan_version = 0;           // Version of the plan table that routed this call.
  std::vector<std::byte> recv_x;       // [num_rows, hidden] of config.dtype.
  std::vector<int32_t> slot_offsets;   // [slots_per_rank + 1].
  std::vector<int32_t> src_rank;       // [num_rows]
  std::vector<int32_t> src_token;      // [num_rows]
  std::vector<float> weight;           // [num_rows]
  // Rows in recv_x: slot_offsets[S], or fewer when the call overflowed this rank's receive
  // capacity (Dispatch's ResourceExhausted; the first rows of the layout, in its order).
  int num_rows() const { return static_cast<int>(src_rank.size()); }

  // Combine needs these; filled by Dispatch.
  struct Handle {
    int num_tokens = 0;
    std::vector<int32_t> records_from;              // Per source: records received.
    // Rows of record j from source s: record_rows[record_begin[s][j] .. record_begin[s][j+1]).
    std::vector<std::vector<int32_t>> record_begin;
    std::vector<int32_t> record_rows;
    // Per token of this rank: (destination, record index there), destinations ascending, in
    // token_routes[token_begin[t] .. token_begin[t + 1]).
    std::vector<int32_t> token_begin;
    std::vector<std::pair<int32_t, int32_t>> token_routes;
    std::vector<char> active;  // Per rank: in the group under the dispatch's plan.
    // Per source: its rows came, and its partials go back, as flag-in-granule rows.
    std::vector<char> flagged_from;
    bool flagged = false;  // This rank's rows went, and its partials come, flagged.
    // Rows of the layout (slot_offsets) that recv_x holds: all of them (rows_routed), or the
    // receive capacity's worth when the call routed this rank more (ReceiveCapacity). Combine
    // takes the rows past it as zeros (the call fails on every rank).
    int32_t rows_routed = 0, rows_kept = 0;
    // The HostEp and the dispatch call that laid it out: Combine takes only its own last.
    const void* owner = nullptr;
    uint32_t epoch = 0;
  } handle;
};

class HostEp {
 public:
  // `arenas[r]` is rank r's arena of ArenaLayout(config).total_bytes, mapped in this process;
  // this rank's own arena must be zero-filled or left by an earlier HostEp of the same config.
  // ResourceExhausted where its sender threads cannot start (the process's thread limit).
  static absl::StatusOr<std::unique_ptr<HostEp>> Create(const EpConfig& config, int rank,
                                                        std::vector<std::byte*> arenas);
  ~HostEp();
  HostEp(const HostEp&) = delete;
  HostEp& operator=(const HostEp&) = delete;

  // Bad input is refused before any byte moves (InvalidArgument, recorded for the peers that
  // wait for this rank: RecordRefusal). A call that routes this rank more rows than its
  // receive capacity (EpConfig::max_recv_rows) completes with the first rows of the layout and
  // returns ResourceExhausted; the caller still calls Combine, which fails on every rank. So
  // does a call whose ranks are not all in the same layer and step (CallTag), with Aborted.
  absl::Status Dispatch(DispatchInput input, DispatchOutput& output);

  // out[t] = sum over k of w[t, k] * y(t, k), for this rank's tokens of the last dispatch.
  // `dispatched` must be as Dispatch left it: a caller that hands its vectors to its expert
  // kernel copies them, not moves them out (an output whose weight or src_rank is not the
  // size Dispatch made it is refused, InvalidArgument).
  // `y` is [output.num_rows(), hidden] of config.dtype; `out` is [num_tokens, hidden] of
  // config.dtype. Sums in fp32: each destination's rows of a token, then (rounded to the
  // dtype once) the destinations' partials in rank order. After a Dispatch that took part and
  // failed (a timeout, an abort: the group is to be re-formed) it refuses, before it reads
  // `dispatched` or stores a byte.
  absl::Status Combine(const DispatchOutput& dispatched, const void* y, void* out);

  // Routed (token, k) pairs this rank received per (layer, local slot) since the arena was
  // created; monotonic.
  uint64_t LoadCounter(int layer, int local_slot) const;

  // Returns `refused`, the error of a call this rank refuses before taking part, after
  // recording it in its arena for the peers that wait for it in that call (RecordRefusal),
  // in place of an earlier refusal of the call unless `keep_earlier` (a Combine refused for
  // want of the Dispatch that was refused: the Dispatch's reason is the one that matters).
  absl::Status Refuse(absl::Status refused, bool keep_earlier = false);
  // The error of dispatch `epoch` whose sender threads stopped at its deadline, recorded as
  // this rank's refusal of the call, with the abort word raised so that the peers stop
  // waiting for its rows and name it.
  absl::Status SendersStopped(uint32_t epoch);
  // The calling thread leaves the dispatch in flight by an exception: the senders are stopped
  // and joined before the call's input and state go (they read both), and the group gives up
  // on this rank (its rows are not all stored) with its reason recorded, so that its peers
  // stop waiting for it and say why, and this rank's next call is refused until the group is
  // re-formed.
  void AbandonCall(uint32_t batches_before, int num_batches);
  // Records `why` as this rank's refusal of `phase`, then raises the group's give-up on this
  // rank: its peers' waits end at once, naming it with the reason.
  void GiveUpOnSelf(CallPhase phase, absl::string_view why);
  // AbandonCall, when destroyed by an exception's unwinding (not on a return).
  class AbandonOnThrow {
   public:
    AbandonOnThrow(HostEp* ep, uint32_t batches_before, int num_batches)
        : ep_(ep), batches_before_(batches_before), num_batches_(num_batches) {}
    ~AbandonOnThrow() {
      if (std::uncaught_exceptions() > exceptions_) ep_->AbandonCall(batches_before_, num_batches_);
    }
    AbandonOnThrow(const AbandonOnThrow&) = delete;
    AbandonOnThrow& operator=(const AbandonOnThrow&) = delete;

   private:
    HostEp* const ep_;
    const uint32_t batches_before_;
    const int num_batches_;
    const int exceptions_ = std::uncaught_exceptions();
  };

  // The calling thread leaves a combine it took part in by an exception (out of memory): its
  // partials and flags are not all stored, nor its output summed. Recorded as this rank's
  // refusal of the call (allocating nothing), and the group gives up on this rank, so that its
  // peers stop waiting for it, naming why, and its next call is refused until the group is
  // re-formed. Public for a caller whose combine failed so before it began (its buffers).
  void GiveUpOnCombine();
  // GiveUpOnCombine, when destroyed by an exception's unwinding (not on a return).
  class GiveUpOnThrow {
   public:
    explicit GiveUpOnThrow(HostEp* ep) : ep_(ep) {}
    ~GiveUpOnThrow() {
      if (std::uncaught_exceptions() > exceptions_) ep_->GiveUpOnCombine();
    }
    GiveUpOnThrow(const GiveUpOnThrow&) = delete;
    GiveUpOnThrow& operator=(const GiveUpOnThrow&) = delete;

   private:
    HostEp* const ep_;
    const int exceptions_ = std::uncaught_exceptions();
  };

  const EpConfig& config() const { return config_; }
  int rank() const { return rank_; }
  // Threads a call of this rank runs on: the caller's, and the sender role's own where it has
  // them (ubep, EpConfig::sender_thread).
  int threads_per_call() const;

  // Tests only: the sender role waits this long before its first row store of each dispatch
  // (the counts still go out at once), so that a test can make one source's rows arrive last.
  void set_row_delay_for_testing(absl::Duration delay) { row_delay_for_testing_ = delay; }
  // Tests only: the calling thread waits this long before it counts a dispatch's first batch
  // (the sender role already waiting for it), as when the process is stopped or starved.
  void set_count_delay_for_testing(absl::Duration delay) { count_delay_for_testing_ = delay; }
  // Tests only: Combine waits this long before it stores its first partial (with `source`,
  // before the partials of that source only).
  void set_partial_delay_for_testing(absl::Duration delay, int source = -1) {
    partial_delay_for_testing_ = delay;
    partial_delay_source_ = source;
  }
  // Tests only: as the delay, but Combine runs `gate` (until it returns) before the partials of
  // `source`, so that a test orders them after an event rather than after a time.
  void set_partial_gate_for_testing(std::function<void()> gate, int source) {
    partial_gate_for_testing_ = std::move(gate);
    partial_delay_source_ = source;
  }
  // Tests only: runs on the calling thread once a dispatch has laid out its receive rows from
  // the sources' records and before it places any, as a peer writing its records again then
  // would (nothing following the protocol does).
  void set_after_layout_for_testing(std::function<void()> hook) {
    after_layout_for_testing_ = std::move(hook);
  }

 private:
  class Senders;
  HostEp(const EpConfig& config, int rank, std::vector<std::byte*> arenas);

  absl::Status Validate(const DispatchInput& input) const;
  // This rank takes part in a call: a refusal it recorded no longer explains a wait for it.
  void TakePart();
  // One row store (send_split.h): token `token`'s row as record `record` of destination `dest`.
  struct Unit {
    int32_t dest, record, token;
  };
  // Counting role: routes the pairs of batch `batch` (send_split.h), stores each (token,
  // destination) record into the destination's arena, appends the tokens' units and hands
  // them to the senders (batch_end_, then the batches_ word).
  void CountBatch(const DispatchInput& input, int batch, int num_batches, int senders);
  // Counting role, after the last batch: every destination's record total is final, and is
  // stored with its count flag (the offsets). With `publish` (ubep), a destination with no
  // record is published, and the others get kCountedBias (published here if every sender is
  // already done with them).
  void FinishCounting(uint32_t epoch, bool publish, bool flagged);
  // One sender's scratch: per destination, its units in this batch; the batch's units grouped
  // by destination.
  struct Share {
    std::vector<int32_t> count, start;  // count is zero between batches.
    std::vector<int32_t> grouped;
  };
  // Sender role: sender `index` of `senders` stores its share of every batch's rows, as the
  // counting role hands the batches over. With `publish` (ubep), whoever completes a
  // destination publishes it (its dispatch flag).
  void SendShare(int index, int senders, const DispatchInput& input, uint32_t epoch,
                 uint32_t batches_before, bool publish, bool flagged, Deadline deadline);
  // Raises `dest`'s dispatch flag for this rank: its rows are all stored.
  void Publish(int dest, uint32_t epoch);
  // Waits for `word` to reach `epoch`; the error names call `call` (none: `epoch` is the
  // call's, as for every flag but the barrier's, which counts barriers; call 0 is a call, the
  // one where the count wraps).
  absl::Status Wait(const uint32_t* word, uint32_t epoch, int peer, const char* what,
                    Deadline deadline, std::optional<uint32_t> call = std::nullopt);
  // The error for a wait on `peer` that ended: names the rank the group gave up on (setting
  // every arena's abort word if this rank is the first to give up), and why it refused this
  // call if it did.
  absl::Status GiveUp(int peer, const char* what, uint32_t epoch) const;
  // Writes "the group gave up on `peer`" into every active rank's abort word (the first reason
  // raised there stays) and rings its bell.
  void RaiseGiveUp(int peer) const;
  uint32_t* AbortWord() const;
  // What this call's waits watch: the abort word, past a code they were found to be spared.
  AbortWatch Watch() const { return {AbortWord(), spared_}; }
  // Every wait of a call on its peers goes through here: runs wait(Watch(), deadline), and
  // again, watching past the code, for as long as it ends on an abort code that spares the
  // call in flight (the rank that left had completed it: LeftAfter). When it reaches its
  // deadline while peer() (the rank it waits on then) is in a call whose deadline is at most
  // a grace ago or still to come (PublishInCall), it goes on until that deadline and the
  // grace (Patience): that peer is stuck behind another rank and will name it to the group,
  // or is slow and will deliver.
  absl::Status WaitForPeer(Deadline deadline, absl::FunctionRef<int()> peer,
                           absl::FunctionRef<absl::Status(AbortWatch, Deadline)> wait);
  // A call of this rank in flight, with its deadline published to its peers (PublishInCall)
  // for as long as it lives; then that the rank is between calls.
  class InCall {
   public:
    InCall(std::byte* arena, const ArenaLayout& layout, Deadline deadline);
    ~InCall();
    InCall(const InCall&) = delete;
    InCall& operator=(const InCall&) = delete;

   private:
    std::byte* arena_;
    const ArenaLayout& layout_;
  };
  // The start of a call (Dispatch, Combine) that ends at `deadline`.
  InCall EnterCall(Deadline deadline);
  // How long a wait that reached `deadline` on `peer` goes on (WaitForPeer), and the depth
  // it publishes, or nullopt: until the peer's published deadline and a grace (the timeout,
  // 1 s at most), one deeper than the peer's. Never past the call's deadline, the timeout and
  // a grace per depth past the first; a peer at kMaxWaitDepth or deeper gets none.
  std::optional<PublishedCall> Patience(int peer, Deadline deadline) const;
  absl::Duration Grace() const;
  // How far past the call's deadline a wait on a peer published depth - 1 deep may go on.
  absl::Duration PatienceLimit(int depth) const;
  // Raises this rank's flag in `region` of rank d's arena to `epoch` (Signal, with d's
  // doorbell: d is the one that waits on it).
  void Raise(int d, size_t region, uint32_t epoch);
  // The doorbell of this rank's arena, for its waits on its own flags.
  Doorbell OwnDoor() const;
  // bsp's barrier of call `call` (its waits' errors name the call, not the barrier's count).
  absl::Status Barrier(uint32_t call, Deadline deadline);
  // What a look at a source found: nothing new, some of its data (flagged rows), or all of it.
  enum class Take { kNothing, kSome, kDone };
  // Calls take(s) for every s in `sources` until each has returned kDone, in whatever order
  // the sources get there; when a round finds nothing new, sleeps on this rank's bell, which
  // any source's flag rings (a millisecond at most with `poll`, for flagged rows, which ring
  // nothing as they land). The error of the first source still pending at the deadline or on
  // an abort (GiveUp, naming `what`, call `epoch`).
  absl::Status TakeAsTheyArrive(uint32_t epoch, std::span<const int> sources, const char* what,
                                Deadline deadline, bool poll,
                                const std::function<Take(int)>& take);
  // From every source's records (their count flags seen): the receive layout (slot offsets,
  // each source's first row in each slot, sizes), the first capacity_ rows of it kept. A
  // source's count or record out of range (a corrupt or foreign peer: nothing this protocol
  // writes) is refused before anything is sized or stored from it, and the group gives up on
  // that source (DataLoss, naming it).
  absl::Status LayOut(DispatchOutput& output);
  // Source s's rows copied to their places (its dispatch flag seen); any order of sources
  // gives the same bytes.
  void Place(int source, DispatchOutput& output);
  // Source s's flagged rows from placed_[s] on, as far as they have landed (every granule
  // tagged `tag`).
  Take PlaceArrived(int source, uint32_t tag, DispatchOutput& output);
  // Record j of source s (records: its records here) gets its rows, the next ones of its
  // slots, each a copy of `data` (which may already be the first of them).
  void PlaceRecord(int source, int32_t j, const std::byte* records, const std::byte* data,
                   DispatchOutput& output);
  // A flagged partial into row_scratch_, once it has landed; `peer()`: the destination a wait
  // gone late names (the lowest one still awaited).
  absl::Status TakeFlaggedPartial(const std::byte* partial, absl::FunctionRef<int()> peer,
                                  uint32_t epoch, Deadline deadline);

  EpConfig config_;
  ArenaLayout layout_;
  int rank_;
  std::vector<std::byte*> arenas_;
  uint32_t dispatch_epoch_ = 0;
  uint32_t combine_epoch_ = 0;
  uint32_t barrier_epoch_ = 0;
  // A refusal record of this rank's may be in its arena (one of this process's, or of one
  // before it that ran this rank): the next call it takes part in withdraws it.
  bool refusal_recorded_ = true;
  // The dispatch whose combine GiveUpOnCombine gave up (none yet: call 0 is a call too).
  std::optional<uint32_t> gave_up_on_combine_;
  CheckedPlan checked_plan_;  // The plan area's table this rank checked last.
  uint32_t spared_ = 0;  // The abort code the call in flight may wait past (WaitForPeer), or 0.
  // The deadline of the call in flight, and what is published of it (PublishInCall), which
  // its waits on stuck peers move on (WaitForPeer).
  Deadline call_deadline_{};
  PublishedCall published_call_;
  // How far past the call's deadline the last wait that ended (WaitForPeer) could go on (the
  // limit of its depth) because a peer was in a call of its own (Patience), which its error
  // says (GiveUp).
  std::optional<GivenPatience> patience_given_;
  // The last Dispatch this rank took part in completed: its output describes the rows.
  bool dispatch_completed_ = false;
  // The CallTag of the dispatch in flight (or last), and where a source's differed (LayOut):
  // the lowest such source and its tag. That call fails, its dispatch and its combine.
  uint64_t call_tag_ = 0;
  std::optional<std::pair<int, uint64_t>> out_of_step_;
  // Set by a sender that stopped waiting for a batch at the call's deadline (the counting
  // thread held past it): rows it owed its peers were not stored, and the call fails.
  std::atomic<bool> senders_stopped_{false};
  // Set when the calling thread leaves a dispatch by an exception (out of memory) after the
  // senders started: they stop at their next batch rather than wait for it (AbandonCall).
  std::atomic<bool> abandoned_{false};
  // Written by the counting role, read by the senders once a batch is handed over.
  std::vector<Unit> units_;           // Token-major; max_tokens x min(top_k, ranks).
  int64_t num_units_ = 0;
  std::vector<int64_t> batch_end_;    // Per batch: units handed over (send_split.h BatchEnd).
  std::vector<int32_t> dest_records_;  // Per destination: records so far.
  // send_split.h's VisitOrder of this rank, as tables: visit_dest_[position] and its inverse.
  std::vector<int> visit_dest_, visit_position_;
  uint32_t batches_ = 0;  // Batches counted, over every call (a Signal word).
  uint32_t batch_sleepers_ = 0;  // Sender threads asleep on batches_ (its own bell).
  std::vector<Share> shares_;  // Per sender.
  // Per destination: units stored, plus kCountedBias once counting is done.
  std::unique_ptr<std::atomic<int64_t>[]> published_;
  std::vector<float> scratch_;    // One fp32 row for combine sums.
  std::vector<std::byte> row_scratch_;  // One row of dtype: a flagged partial, packed or not.
  // One row of dtype: a flagged row whose first place is past the receive capacity.
  std::vector<std::byte> landing_scratch_;
  const int32_t capacity_;  // ReceiveCapacity(config_).
  std::vector<int32_t> placed_;   // Per source: flagged records placed so far.
  std::vector<char> sent_to_;     // Per destination: a flagged combine takes partials from it.
  std::vector<int> sources_;      // Ranks a wait of this call takes from (kept across calls).
  std::vector<int> pending_;      // Those of sources_ TakeAsTheyArrive still waits for.
  std::vector<int32_t> received_per_slot_;  // Rows per local slot (the load counters' addition).
  std::vector<int32_t> source_slot_rows_;  // [R x S]: next row of (source, slot) while placing.
  // [entries of the call, handle.record_begin's order]: each record entry's local slot as
  // LayOut checked it. Placing reads these, not the peer-written records again: a peer that
  // rewrote them after the check cannot steer a store.
  std::vector<int32_t> entry_slots_;
  // The token of each record as LayOut checked it, source by source (source s's first at
  // record_token_base_[s]): placed from here, not read again from the peer's records.
  std::vector<int32_t> record_tokens_;
  std::vector<size_t> record_token_base_;
  // Per rank: in the group under the plan of the call in flight (excluded ranks are neither
  // sent to nor waited for).
  std::vector<char> active_;
  std::unique_ptr<Senders> senders_;  // The sender role's threads, when it has its own.
  absl::Duration row_delay_for_testing_ = absl::ZeroDuration();
  absl::Duration count_delay_for_testing_ = absl::ZeroDuration();
  absl::Duration partial_delay_for_testing_ = absl::ZeroDuration();
  std::function<void()> partial_gate_for_testing_;
  std::function<void()> after_layout_for_testing_;
  int partial_delay_source_ = -1;
};

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_HOST_EP_H_
