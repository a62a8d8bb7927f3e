// libubep: what a serving process links to run expert-parallel dispatch and combine through
// the node's ubepd. One Rank per serving process (one per GPU, or per host device).
//
//   ubep::ModelShape shape{.num_layers = 58, .num_experts = 256, .hidden = 7168, .top_k = 8,
//                          .max_tokens = 128, .slots_per_rank = 9};
//   auto rank = ubep::Rank::Attach({.socket_path = "/run/ubep/ubepd.sock"}, my_rank, world,
//                                  /*device=*/0, shape);     // waits for the whole group
//   for (uint64_t step = (*rank)->resume_step(); ...; ++step) {
//     UBEP_RETURN_IF_ERROR((*rank)->BeginStep(step));
//     for each MoE layer l:
//       ubep::Dispatched d;
//       UBEP_RETURN_IF_ERROR((*rank)->Dispatch(l, x, topk_idx, topk_w, num_tokens, d));
//       ... each local slot i runs its expert on rows [slot_offsets[i], slot_offsets[i+1]) ...
//       UBEP_RETURN_IF_ERROR((*rank)->Combine(d, expert_out, out));
//   }
//
// Errors are absl::Status with messages that name the rank and what to do:
//  - Unavailable: the group stopped (a rank left, a plan changed the members, ubepd is
//    draining or exited; BeginStep of a rank the plan excludes; a Dispatch of a rank its peers
//    gave up on, which came after their wait timed out). When must_attach_again(),
//    Detach and Attach again once a daemon is back; otherwise call Rejoin (it waits for the
//    group to re-form and says at which step to continue).
//  - DeadlineExceeded: a peer did not arrive within the wait timeout; the message names it.
//    The rank is stopped: BeginStep, Dispatch and Combine repeat it until a Rejoin completes.
//    Rejoin of a rank the plan excludes (excluded()) ends so too: call it again to keep waiting.
//  - InvalidArgument: bad input (expert id out of range or listed twice by a token, too many
//    tokens; BeginStep of a step before the rank's, or above 2^63 - 1: a negative one passed
//    as unsigned), before any byte moved. On the CUDA backend the kernels find a bad pair after
//    the peers may have begun: they skip it, dispatch the rest, and the error names the first
//    bad pair; call Combine as after a good Dispatch (the peers wait for this rank's partials).
//  - ResourceExhausted: the call routed some rank more rows than its receive capacity
//    (ubepd --max_recv_rows): the call fails on every rank of the group, at that rank's
//    Dispatch (libubep completes its combine for it: do not call Combine after that Dispatch)
//    and at every other rank's Combine. The
//    call is over everywhere; abandon the step (or run it again) on every rank and go on with
//    the next. The load counters count the rows, so the balancer sees the load that overflowed.
//  - Aborted: the ranks' calls were out of step (host backend): a rank's caller went on to
//    another layer or step after a call that failed, rather than calling it again, so ranks
//    met in one call with different layers. The call fails on every rank, at its Dispatch
//    (libubep completes its combine: do not call Combine after that Dispatch), naming the
//    lowest rank whose call differed; nothing is counted. Abandon the step on every rank and
//    go on with the next.
//  - FailedPrecondition: a call out of order (Dispatch before BeginStep, Combine without a
//    Dispatch, a rank that detached). A Dispatch that fails leaves its output empty (no rows,
//    empty views; combining it is a Combine without a Dispatch), but for the CUDA backend's
//    bad input found on the device (InvalidArgument above), whose output holds the rest
//    (slot_offsets() not empty). A Rejoin that did not complete: call Rejoin again.
//  - Internal: the combine libubep runs for this rank's overflowed (or out-of-step) call did
//    not complete (the message says why): the group is out of step; call Rejoin.
//  - DataLoss: shared memory or an answer of ubepd's holds what the protocol does not allow (a
//    plan table, a weight buffer's place, the arenas given at Attach); the message names it.
//    A Rejoin would read the same memory again: stop, and tell the operator. (A peer's
//    corrupt records, which the group gives up on as on a peer that timed out, are
//    Unavailable: "rank 0: rank 2's records of dispatch call 7 are corrupt (...); the group
//    gave up on rank 2".)
//  - NotFound: SlotExpert of a slot the plan leaves unused.
// The hot path makes no RPC: dispatch and combine store into the peers' arenas directly.
// A process may fork after Attach (data-loader workers, a multiprocessing pool): the child
// holds no part of the rank (its fd connection, whose closing tells ubepd that the rank's
// process ended, is closed in the child at the fork), and its copy of the Rank is inert there
// (its calls fail FailedPrecondition, must_attach_again() is true, and destroying it detaches
// nothing). Use a rank only in the process that attached it.
// Thread-compatible: one thread drives a Rank. No two calls on one Rank may overlap, the const
// ones included: excluded() and SlotExpert() check and cache the plan table on their
// first look at a version, and must_attach_again() stops the group when it finds ubepd gone.
#ifndef UBEP_CLIENT_INCLUDE_UBEP_UBEP_H_
#define UBEP_CLIENT_INCLUDE_UBEP_UBEP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ubep {

enum class DType { kFloat32 = 0, kBFloat16 = 1 };

struct ModelShape {
  int num_layers = 0;           // MoE layers.
  int num_experts = 0;          // Logical experts per layer.
  int hidden = 0;
  int top_k = 0;                // At most 32.
  int max_tokens = 0;           // Per rank per dispatch.
  int slots_per_rank = 0;       // Physical expert slots per rank per layer.
  size_t bytes_per_expert = 0;  // Weights of one expert kept in the arena; 0 = none.
  DType dtype = DType::kFloat32;
};

// Every duration is positive and under a million hours (Attach refuses others: every wait has
// an end).
struct ClientOptions {
  std::string socket_path = "/run/ubep/ubepd.sock";
  // Each RPC to ubepd but Join (Attach, Detach, the arena claim and refresh over its fd
  // socket, and connecting to that socket).
  absl::Duration rpc_timeout = absl::Seconds(10);
  absl::Duration join_timeout = absl::Seconds(60);  // Waiting for the rest of the group.
  // How often BeginStep looks whether ubepd is still there (a non-blocking poll of the fd
  // connection; the steps themselves make no RPC). The first rank to find it gone stops the
  // group as a drain would (must_attach_again()).
  absl::Duration daemon_check_interval = absl::Seconds(1);
  // A rank reaching the effective step of a prepared plan whose commit or abort has not
  // arrived waits at most this long in BeginStep (then Unavailable).
  absl::Duration decision_timeout = absl::Seconds(30);
};

struct RankStats {
  uint64_t generation = 0;       // Of the group this rank joined last.
  uint64_t step = 0;
  uint64_t dispatched_tokens = 0;
  uint64_t dispatch_calls = 0;
  uint64_t combine_calls = 0;
  uint64_t wait_timeouts = 0;    // Waits of this rank's calls that gave up (DeadlineExceeded).
  // Errors found by this rank's calls: of the data plane (dispatch, combine, the plan in force
  // at BeginStep, the group stopping), of taking the arenas after a Join, and the misuse that
  // fails the group's call, its peers waiting for this rank (a Combine of another output or
  // with none, a second Dispatch without a Combine, BeginStep with an earlier step). Not
  // counted: a call on a detached rank, a Dispatch before BeginStep, the queries
  // (ExpertWeights, SlotExpert), the stop a call repeats, and ubepd's own answers to Join (a
  // Rejoin of a rank the plan excludes ends DeadlineExceeded at every join timeout), which
  // ubepd counts as its RPC errors.
  uint64_t errors = 0;
  uint64_t plan_version = 0;     // Of the last dispatch.
};

namespace internal {
struct DispatchedState;
struct RankState;
}  // namespace internal

// What one rank received from a dispatch: rows grouped by local slot (slot i's rows are
// [slot_offsets()[i], slot_offsets()[i + 1])), with each row's source rank, source token and
// routing weight. Reusable across calls (buffers are kept); a moved-from one too. On the host
// backend the views are the Dispatched's own memory; on the CUDA backend rows(), src_rank(),
// src_token() and weights() are device memory of the rank's data plane, valid until the
// rank's next Dispatch (of any Dispatched), Rejoin or Detach: keep one Dispatched per layer
// in flight, not several (slot_offsets() is a host copy, kept).
class Dispatched {
 public:
  Dispatched();
  ~Dispatched();
  Dispatched(Dispatched&&) noexcept;
  Dispatched& operator=(Dispatched&&) noexcept;

  int num_rows() const;
  const std::byte* rows() const;                  // [num_rows, hidden] of the shape's dtype.
  std::span<const int32_t> slot_offsets() const;  // [slots_per_rank + 1]
  std::span<const int32_t> src_rank() const;
  std::span<const int32_t> src_token() const;
  std::span<const float> weights() const;
  uint64_t plan_version() const;                  // Plan that routed this dispatch.
  int layer() const;

 private:
  friend class Rank;
  std::unique_ptr<internal::DispatchedState> state_;
};

class Rank {
 public:
  // Connects to ubepd, attaches `rank` of a group of `world_size` ranks, maps the arenas and
  // waits until every rank of the group has attached (Join). `next_step`: the step this
  // process runs next when it knows it (re-attaching after a daemon restart); the group
  // resumes at the least one given. Errors: FailedPrecondition when
  // the shape conflicts with the group (the field is named), AlreadyExists when another
  // process holds the rank, Unavailable when ubepd is not there, draining, or does not answer
  // (its RPC, or its fd socket) within rpc_timeout, DeadlineExceeded when the group does not form
  // within join_timeout (it names the ranks missing), ResourceExhausted
  // when this process cannot map the arenas or start the data plane (memory, address space,
  // file descriptors, threads; on CUDA, device memory for the plan table): not a receive
  // capacity here, and nothing to retry at once.
  // `device`: the CUDA device of the rank's arenas when ubepd runs the CUDA backend; on the
  // host backend it is not used, but must not be negative either (pass 0). Each call selects it for its own device work, from whatever thread,
  // and puts back the calling thread's current device: the caller selects it itself
  // (cudaSetDevice) for the buffers it allocates and passes.
  static absl::StatusOr<std::unique_ptr<Rank>> Attach(const ClientOptions& options, int rank,
                                                      int world_size, int device,
                                                      const ModelShape& shape,
                                                      std::optional<uint64_t> next_step = {});
  ~Rank();  // Detaches (errors are logged).
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  // The step every rank continues at, from the last Attach or Rejoin.
  uint64_t resume_step() const;

  // Begins `step` (ranks run the same steps in order): the plan in force at `step` routes this
  // step's dispatches. When a new plan is prepared for `step` or earlier and not yet
  // decided, waits for the decision (ClientOptions::decision_timeout). Unavailable when the
  // group has stopped.
  absl::Status BeginStep(uint64_t step);

  // Sends this rank's tokens to the experts' ranks and receives the rows routed here.
  // x: [num_tokens, hidden] of the dtype; topk_idx: [num_tokens, top_k] logical experts or -1
  // (masked), each expert at most once per token; topk_weights: [num_tokens, top_k]. On the CUDA
  // backend these are device pointers and x is 16-byte aligned (as cudaMalloc gives).
  absl::Status Dispatch(int layer, const void* x, const int32_t* topk_idx,
                        const float* topk_weights, int num_tokens, Dispatched& out);
  // out[t] = sum over k of topk_weights[t, k] * expert output of (t, k). `expert_out` is
  // [dispatched.num_rows(), hidden], aligned with dispatched.rows(); `out` [num_tokens, hidden];
  // on the CUDA backend both device pointers, 16-byte aligned.
  absl::Status Combine(const Dispatched& dispatched, const void* expert_out, void* out);

  // After an error that stopped the group: waits until every rank is back and the group has
  // re-formed; returns the step to continue at (the least `next_step` any rank gave). A group
  // formed with new arenas maps them: its errors are then Attach's.
  absl::StatusOr<uint64_t> Rejoin(std::optional<uint64_t> next_step);

  // Whether the newest committed plan leaves this rank out of the EP group (its node failed or
  // an operator drained it). Such a rank serves no tokens; Rejoin waits (at most the join
  // timeout at a time) until a plan includes it again.
  bool excluded() const;

  // Whether this rank's ubepd is draining (shutting down) or has exited, or the rank is
  // detached: Rejoin cannot help. Detach, and Attach again (with the step to continue at) once
  // a daemon is back; a rank that notices its daemon exited stops the group so that every
  // rank does the same.
  bool must_attach_again() const;

  // This rank's weight buffer for (layer, local slot) under the plan of the current step, and
  // the logical expert that slot holds. The memory stays mapped until Detach (a Rejoin
  // keeps this rank's arena where it is); the slot's buffer changes with the plan, so take the
  // span again at a step with a new plan. On the CUDA backend (a device given at Attach) the
  // span is device memory: fill it with cudaMemcpy, not from the host.
  absl::StatusOr<std::span<std::byte>> ExpertWeights(int layer, int local_slot);
  absl::StatusOr<int> SlotExpert(int layer, int local_slot) const;
  // Says that the weights of every slot SlotExpert names are in ExpertWeights: call it once
  // they are loaded after an Attach (a Rejoin keeps them; ubepd keeps them across plans). A
  // restarted ubepd's arenas are new and empty until then, and a plan that must copy an
  // expert from them to another domain (its only holder) is refused until it is said, rather
  // than made with what they hold. On the CUDA backend, call it once the copies into the
  // spans completed. FailedPrecondition on a detached rank.
  absl::Status WeightsLoaded();

  // After Detach: the counts as they stood at Detach (the arena that holds them is let go).
  RankStats stats() const;
  int rank() const;
  int world_size() const;
  const ModelShape& shape() const;

  // Leaves the group: the other ranks' waits that still need this rank fail with an error
  // naming it; a call this rank completed, they complete.
  absl::Status Detach();

 private:
  explicit Rank(std::unique_ptr<internal::RankState> state);
  std::unique_ptr<internal::RankState> state_;
};

}  // namespace ubep

#endif  // UBEP_CLIENT_INCLUDE_UBEP_UBEP_H_
