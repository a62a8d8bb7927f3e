// CudaEp: dispatch and combine for one rank on the CUDA backend, same contract and the same
// byte layout as the host backend (kernels/host/arena_layout.h, kernels/common/routing.h):
// the arena of each rank lives in device memory and peers store into it directly (CUDA IPC
// within a node; peer access between GPUs of one NVLink domain). Protocols: ubep (per-source
// epoch-tagged count and completion flags, no barrier) and bsp (count exchange and
// barriers). bf16 activations, fp32 weights and sums.
//
// Kernels per ubep Dispatch: SendKernel, one cooperative launch whose counting blocks store
// the records and raise each destination's count flag while its sender blocks store the rows
// of each batch counted (send_split.h); a wait for every source's count flag (with a timeout
// that reports the missing peer); count, scan and placement kernels that lay rows out by
// local slot exactly as the host backend does, while the rows are still arriving; a wait for
// every source's completion flag; a copy of the rows. Combine: blocks over all records store
// the partial sums into their sources' arenas, whoever completes a source raises its flag;
// after a wait, one block per token sums partials in destination order. Compiled without
// fused multiply-add so that the sums match the host backend bit for bit. Every wait of a
// call shares one deadline, the configured timeout from the call's first wait.
//
// The API takes raw device pointers and sizes and runs on its own stream, which it
// synchronizes at the end of each call (v1: the host reads the row count to size outputs).
// Bad expert ids are flagged on the device (InvalidArgument) and never read or write out of
// bounds.
// Thread-compatible: one CudaEp per rank and process.
#ifndef UBEP_KERNELS_CUDA_CUDA_EP_H_
#define UBEP_KERNELS_CUDA_CUDA_EP_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/common/plan_table.h"
#include "kernels/host/arena_layout.h"

namespace ubep::kernels {

// OK when a CUDA device is usable here; else why not (FailedPrecondition): no device, or
// the runtime's error (no driver, a driver older than the runtime, a device it may not use).
absl::Status CudaDeviceStatus();

// Device memory of one rank's arena, shareable with other processes by an IPC handle.
class DeviceArena {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceArena>> Create(size_t bytes);
  // Maps a peer's arena from its 64-byte IPC handle.
  static absl::StatusOr<std::unique_ptr<DeviceArena>> OpenPeer(const std::byte (&handle)[64]);
  ~DeviceArena();

  std::byte* data() const { return data_; }
  absl::Status IpcHandle(std::byte (&handle)[64]) const;

 private:
  DeviceArena(std::byte* data, bool owned) : data_(data), owned_(owned) {}
  std::byte* data_;
  bool owned_;
};

struct CudaDispatchInput {
  const void* x = nullptr;               // Device [num_tokens, hidden] bf16.
  const int32_t* topk_idx = nullptr;     // Device [num_tokens, top_k].
  const float* topk_weights = nullptr;   // Device [num_tokens, top_k].
  int num_tokens = 0;
  int layer = 0;
  const PlanTableHeader* plan = nullptr;  // Device copy of a validated table.
  const PlanTableHeader* host_plan = nullptr;  // The same table on the host, for checks.
};

// Device outputs owned by the CudaEp, valid until the next Dispatch.
struct CudaDispatchOutput {
  const void* recv_x = nullptr;          // [num_rows, hidden] bf16, grouped by local slot.
  const int32_t* src_rank = nullptr;     // [num_rows]
  const int32_t* src_token = nullptr;    // [num_rows]
  const float* weight = nullptr;         // [num_rows]
  std::vector<int32_t> slot_offsets;     // Host copy, [slots_per_rank + 1].
  int num_rows = 0;
};

class CudaEp {
 public:
  // `arenas[r]`: rank r's arena, mapped in this process (own one zero-filled at creation).
  static absl::StatusOr<std::unique_ptr<CudaEp>> Create(const EpConfig& config, int rank,
                                                        std::vector<std::byte*> arenas);
  ~CudaEp();

  // An expert id out of range is found on the device, after the peers may have begun: the
  // call returns InvalidArgument naming it, having dispatched every other pair, and the caller
  // still calls Combine (the peers wait for this rank's partials). So with more rows routed
  // here than the receive capacity (EpConfig::max_recv_rows, which sizes the receive buffers):
  // ResourceExhausted (OverCapacityStatus), the first rows of the layout in recv_x
  // (num_rows of them), and a Combine that fails on every rank of the group.
  //
  // Both calls run on the CudaEp's own stream: they are ordered after work of the legacy
  // default stream issued before the call (an event recorded there as the call begins), and
  // both return once their kernels are done; the legacy default stream does not wait for
  // them in turn (the stream is non-blocking: a caller's cudaMemcpy does not wait for another
  // rank's call in flight on the same device). Inputs written on another stream must be
  // complete before the call (synchronize that stream or an event of it first).
  absl::Status Dispatch(const CudaDispatchInput& input, CudaDispatchOutput& output);
  // y: device [num_rows, hidden] bf16 in the dispatch's row order; out: device [num_tokens,
  // hidden] bf16; both 16-byte aligned.
  absl::Status Combine(const void* y, void* out);

  // ubep: whether a dispatch counts and sends in one cooperative launch (SendKernel), rather
  // than the counting kernel first (EpConfig::sender_thread kOff, bsp, or a device that cannot
  // keep its blocks resident).
  bool counts_while_sending() const;

  // Returns `refused`, the error of a call this rank refuses before taking part (here, or
  // in its caller: libubep when no plan is in force), after recording it in its arena for
  // the peers that wait for it in that call (RecordRefusal), in place of an earlier refusal
  // of the call unless `keep_earlier` (a Combine refused for want of the Dispatch that was
  // refused: the Dispatch's reason is the one that matters).
  absl::Status Refuse(absl::Status refused, bool keep_earlier = false);
  // The refusal of the next Dispatch if the group gave up (its abort word set: a wait timed
  // out, or the daemon raised it), read with a synchronous copy; OK if it did not. For a
  // caller about to refuse a call itself (libubep, no plan in force), which first says why
  // the group cannot run, as the host backend does.
  absl::Status GaveUpStatus() const;
  // Whether the last Dispatch completed (with or without an error: bad input found on the
  // device leaves the rest dispatched, and its Combine to be called).
  bool dispatch_completed() const { return dispatch_completed_; }
  // The epoch of the last Dispatch that took part (0 before the first): a Dispatch refused
  // before it took part leaves it, and dispatch_completed() with it, as they were.
  uint32_t dispatch_epoch() const { return dispatch_epoch_; }

  // Tests only, as HostEp's: the sender blocks wait this long before their first row store of
  // each dispatch (the counts still go out at once), so that a test can make one source's rows
  // arrive last; Combine's blocks wait this long before their first partial (with `source`,
  // before that source's partials only).
  void set_row_delay_for_testing(absl::Duration delay);
  void set_partial_delay_for_testing(absl::Duration delay, int source = -1);
  // Tests only: Dispatch fails once it took its epoch, as when a launch fails there
  // (FailedAfterTakingPart), with "cuda backend: a launch failed (for the test)".
  void set_fail_after_taking_part_for_testing(bool fail) {
    fail_after_taking_part_for_testing_ = fail;
  }

 private:
  struct Scratch;
  CudaEp(const EpConfig& config, int rank);
  // After the stream: the error a wait (timeout or abort, see TimedOutStatus) or bad input
  // left, for phase `what` of call `call`; `input`, a dispatch's, words a bad pair's error.
  absl::Status CheckStatus(const char* what, uint32_t call,
                           const CudaDispatchInput* input = nullptr);
  // Writes a refusal record's body into this rank's arena (sequence word odd, body, even).
  void WriteRefusal(const std::byte (&body)[kRefusalBody]);
  // A copy done before it returns (kernels::CopyNow) on the side stream (non-blocking: it
  // waits for no call in flight, this rank's or another's of the process). The CudaEp's
  // host-side copies (its arena's words, the scratch's set-up) go here.
  cudaError_t Copy(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) const;
  // The error of a call that failed on this rank after it took the call's epoch (a launch or
  // an asynchronous copy the driver refused): recorded as this rank's refusal of the call,
  // with the abort word raised naming this rank in every member's arena, as the host
  // backend's SendersStopped does, so that the peers stop waiting for it at once and say
  // why, and this rank's next call is refused as after any give-up (not as a second
  // dispatch). Returns `error` once the call's kernels launched so far are done (they end on
  // the word).
  absl::Status FailedAfterTakingPart(absl::Status error);
  // This rank takes part in a call: a refusal it recorded no longer explains a wait for it.
  void TakePart();
  // Why rank `rank` refused `phase`, if its arena records that it did (ReadRefusal), else "".
  std::string Refusal(int rank, CallPhase phase) const;

  EpConfig config_;
  ArenaLayout layout_;
  int rank_;
  // The device current at Create, where its streams and scratch are: every public call
  // selects it (ScopedDevice), whichever thread makes the call.
  int device_ = 0;
  std::byte* own_arena_ = nullptr;  // Device pointer to this rank's arena.
  std::vector<std::byte*> arenas_;  // Device pointers to every rank's arena.
  uint32_t dispatch_epoch_ = 0;
  uint32_t combine_epoch_ = 0;
  uint32_t barrier_epoch_ = 0;  // bsp.
  // A refusal record of this rank's may be in its arena (one of this process's, or of one
  // before it that ran this rank): the next call it takes part in withdraws it.
  bool refusal_recorded_ = true;
  int last_tokens_ = 0;
  int last_rows_ = 0;  // Rows of recv_x the last dispatch left (its num_rows).
  // The last Dispatch completed (OK, bad input found on the device, or over the receive
  // capacity): its scratch describes the call, and Combine may run on it.
  bool dispatch_completed_ = false;
  std::vector<char> member_;  // Per rank: in the group under the last dispatch's plan.
  bool fail_after_taking_part_for_testing_ = false;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_CUDA_CUDA_EP_H_
