// WeightLink over NCCL point-to-point (ncclSend / ncclRecv), non-blocking communicators so
// that every wait is bounded by a deadline.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/weight_link.h"

namespace ubep::daemon {
namespace {

constexpr absl::Duration kPoll = absl::Microseconds(200);

absl::Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

std::string NcclError(ncclResult_t result, ncclComm_t comm) {
  std::string message = ncclGetErrorString(result);
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  if (last != nullptr && *last != '\0') absl::StrAppend(&message, " (", last, ")");
  return message;
}

// What a wait that was told to stop answers.
absl::Status Stopped(const std::string& what) {
  return absl::CancelledError(
      absl::StrCat(what, ": stopped (the plan was aborted, or ubepd is draining)"));
}

// Waits until the communicator's pending operation leaves ncclInProgress, the deadline, or
// `stopped()`.
absl::Status AwaitComm(ncclComm_t comm, absl::Time deadline, const std::string& what,
                       const std::function<bool()>& stopped) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
    if (got != ncclSuccess) return absl::InternalError(absl::StrCat(what, ": ", NcclError(got, comm)));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return absl::InternalError(absl::StrCat(what, ": ", NcclError(state, comm)));
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    if (stopped && stopped()) return Stopped(what);
    absl::SleepFor(kPoll);
  }
}

// Waits until the stream's work is done, the deadline, or `stopped()`; with `comm`, also until
// the communicator reports an error (a peer that died mid-transfer: NCCL's kernels would spin
// on it until the communicator is aborted, so the stream alone would wait out the deadline).
absl::Status AwaitStream(cudaStream_t stream, absl::Time deadline, const char* what,
                         const std::function<bool()>& stopped, ncclComm_t comm = nullptr) {
  while (true) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return absl::OkStatus();
    if (done != cudaErrorNotReady) return CudaCheck(done, what);
    if (comm != nullptr) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
      if (got != ncclSuccess) return absl::InternalError(absl::StrCat(what, ": ", NcclError(got, comm)));
      if (state != ncclSuccess && state != ncclInProgress) {
        return absl::InternalError(absl::StrCat(what, ": ", NcclError(state, comm)));
      }
    }
    if (absl::Now() >= deadline) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    if (stopped && stopped()) return Stopped(what);
    absl::SleepFor(kPoll);
  }
}

class NcclWeightLink final : public WeightLink {
 public:
  NcclWeightLink(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream)
      : WeightLink(rank, size), device_(device), comm_(comm), stream_(stream) {}
  ~NcclWeightLink() override {
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      // A send complete here may still be on its way to the peer: flush (bounded), then free.
      const ncclResult_t finalized = ncclCommFinalize(comm_);
      if ((finalized == ncclSuccess || finalized == ncclInProgress) &&
          AwaitComm(comm_, absl::Now() + absl::Seconds(10), "closing the NCCL link", nullptr).ok()) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    cudaStreamDestroy(stream_);
  }

  absl::Status Exchange(const std::vector<Transfer>& transfers, absl::Time deadline,
                        const std::function<bool()>& stopped) override {
    if (broken_) return absl::FailedPreconditionError("the NCCL link timed out before and was aborted");
    if (transfers.empty()) return absl::OkStatus();
    cudaSetDevice(device_);
    // Buffers on another device of this node go through a staging buffer on the link's device.
    std::vector<void*> staged(transfers.size(), nullptr);
    auto release = [&] {
      for (void* p : staged) {
        if (p != nullptr) cudaFree(p);
      }
    };
    // A peer died or never joined, the staging was stopped, or this side cannot take its part
    // (a staging buffer it cannot allocate): abort so that nothing waits on the link any
    // longer (the peers' copies fail, as their own staging is stopped too).
    auto give_up = [&](const absl::Status& status) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      broken_ = true;
      release();
      return absl::Status(status.code(), absl::StrCat(status.message(), " (", transfers.size(),
                                                      " transfers with the group's daemons)"));
    };
    absl::Status status;
    for (size_t i = 0; i < transfers.size() && status.ok(); ++i) {
      const Transfer& t = transfers[i];
      if (t.memory->device() == device_) continue;
      status = CudaCheck(cudaMalloc(&staged[i], t.bytes), "allocating a staging buffer");
      if (status.ok() && t.send) {
        status = CudaCheck(cudaMemcpyPeerAsync(staged[i], device_,
                                               static_cast<std::byte*>(t.memory->data()) + t.offset,
                                               t.memory->device(), t.bytes, stream_),
                           "staging expert weights to send");
      }
    }
    if (!status.ok()) return give_up(status);
    auto buffer = [&](size_t i) {
      return staged[i] != nullptr ? staged[i]
                                  : static_cast<void*>(static_cast<std::byte*>(transfers[i].memory->data()) +
                                                       transfers[i].offset);
    };
    ncclResult_t result = ncclGroupStart();
    for (size_t i = 0; i < transfers.size() && (result == ncclSuccess || result == ncclInProgress); ++i) {
      const Transfer& t = transfers[i];
      result = t.send ? ncclSend(buffer(i), t.bytes, ncclUint8, t.peer, comm_, stream_)
                      : ncclRecv(buffer(i), t.bytes, ncclUint8, t.peer, comm_, stream_);
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (result == ncclSuccess || result == ncclInProgress) result = ended;
    if (result != ncclSuccess && result != ncclInProgress) {
      status = absl::InternalError(absl::StrCat("NCCL weight copies: ", NcclError(result, comm_)));
    }
    if (status.ok()) status = AwaitComm(comm_, deadline, "NCCL weight copies", stopped);
    if (status.ok()) status = AwaitStream(stream_, deadline, "NCCL weight copies", stopped, comm_);
    if (!status.ok()) return give_up(status);
    // Received weights staged on the link's device go to their arenas; done before returning
    // (the plan table that makes them read is written after).
    bool placing = false;
    for (size_t i = 0; i < transfers.size() && status.ok(); ++i) {
      const Transfer& t = transfers[i];
      if (staged[i] == nullptr || t.send) continue;
      placing = true;
      status = CudaCheck(cudaMemcpyPeerAsync(static_cast<std::byte*>(t.memory->data()) + t.offset,
                                             t.memory->device(), staged[i], device_, t.bytes, stream_),
                         "placing received expert weights");
    }
    if (status.ok() && placing) {
      // Not stopped halfway: these copies are local, and the staging buffers are freed next.
      status = AwaitStream(stream_, deadline, "placing received expert weights", nullptr);
    }
    release();
    return status;
  }

 private:
  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  bool broken_ = false;
};

}  // namespace

absl::StatusOr<std::string> NewWeightLinkId() {
  ncclUniqueId id;
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", NcclError(r, nullptr)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<WeightLink>> ConnectWeightLink(
    const std::string& id_bytes, int size, int rank, int device, absl::Time deadline,
    const std::function<bool()>& stopped) {
  ncclUniqueId id;
  if (id_bytes.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("an NCCL unique id has ", sizeof(id.internal),
                                                   " bytes, not ", id_bytes.size()));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL link rank ", rank, " of ", size));
  }
  std::memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
  if (absl::Status s = CudaCheck(cudaSetDevice(device), "selecting the link's device"); !s.ok()) return s;
  cudaStream_t stream = nullptr;
  if (absl::Status s = CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                 "creating the link's stream");
      !s.ok()) {
    return s;
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Every wait below is ours, bounded by the deadline.
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  absl::Status status;
  if (r != ncclSuccess && r != ncclInProgress) {
    status = absl::InternalError(absl::StrCat("ncclCommInitRankConfig: ", NcclError(r, comm)));
  } else {
    status = AwaitComm(comm, deadline,
                       absl::StrCat("joining the NCCL link as rank ", rank, " of ", size), stopped);
  }
  if (!status.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    if (absl::IsDeadlineExceeded(status)) {
      return absl::DeadlineExceededError(absl::StrCat(status.message(), "; is every daemon of the group staging this plan?"));
    }
    return status;
  }
  return std::unique_ptr<WeightLink>(new NcclWeightLink(rank, size, device, comm, stream));
}

}  // namespace ubep::daemon
