// DeviceMemory on VMM arenas (kernels/cuda/vmm_arena.h).
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "daemon/device_memory.h"
#include "kernels/cuda/vmm_arena.h"

namespace ubep::daemon {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// Each arena's copies go through a stream of its own and wait for that stream alone: a
// device-wide wait (cudaDeviceSynchronize, or the legacy default stream) would also wait for
// every other stream of the process on that device, the NCCL link's staging among them, and
// the daemon makes these copies under its node's lock.
class VmmDeviceMemory : public DeviceMemory {
 public:
  VmmDeviceMemory(int device, std::unique_ptr<kernels::VmmArena> arena, int fd,
                  cudaStream_t stream)
      : device_(device), arena_(std::move(arena)), fd_(fd), stream_(stream) {}
  ~VmmDeviceMemory() override {
    cudaSetDevice(device_);
    cudaStreamDestroy(stream_);
    if (fd_ >= 0) close(fd_);
  }
  int device() const override { return device_; }
  size_t size() const override { return arena_->size(); }
  int fd() const override { return fd_; }
  absl::Status Read(size_t offset, void* out, size_t bytes) const override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemcpyAsync(out, arena_->data() + offset, bytes,
                                               cudaMemcpyDeviceToHost, stream_),
                               "reading device arena");
        !s.ok()) {
      return s;
    }
    return Check(cudaStreamSynchronize(stream_), "reading device arena");
  }
  absl::Status Write(size_t offset, const void* in, size_t bytes) override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemcpyAsync(arena_->data() + offset, in, bytes,
                                               cudaMemcpyHostToDevice, stream_),
                               "writing device arena");
        !s.ok()) {
      return s;
    }
    // Landed before what the daemon publishes next (a plan table, an abort word).
    return Check(cudaStreamSynchronize(stream_), "writing device arena");
  }
  absl::Status Zero(size_t offset, size_t bytes) override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemsetAsync(arena_->data() + offset, 0, bytes, stream_),
                               "clearing device arena");
        !s.ok()) {
      return s;
    }
    return Check(cudaStreamSynchronize(stream_), "clearing device arena");
  }
  absl::Status CopyFrom(const DeviceMemory& source, size_t source_offset, size_t offset,
                        size_t bytes) override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemcpyPeerAsync(arena_->data() + offset, device_,
                                                   static_cast<const std::byte*>(source.data()) +
                                                       source_offset,
                                                   source.device(), bytes, stream_),
                               "copying expert weights");
        !s.ok()) {
      return s;
    }
    // Landed before Prepare publishes the plan table that makes ranks read it.
    return Check(cudaStreamSynchronize(stream_), "copying expert weights");
  }
  void* data() const override { return arena_->data(); }

 private:
  int device_;
  std::unique_ptr<kernels::VmmArena> arena_;
  int fd_;
  cudaStream_t stream_;
};

absl::StatusOr<cudaStream_t> StreamOn(int device) {
  if (absl::Status s = Check(cudaSetDevice(device), "selecting the arena's device"); !s.ok()) {
    return s;
  }
  cudaStream_t stream = nullptr;
  if (absl::Status s = Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                             "creating the arena's copy stream");
      !s.ok()) {
    return s;
  }
  return stream;
}

}  // namespace

int DeviceCount() { return CountDevices().value_or(0); }

absl::StatusOr<int> CountDevices() {
  int n = 0;
  const cudaError_t error = cudaGetDeviceCount(&n);
  if (error == cudaErrorNoDevice) return 0;
  if (error != cudaSuccess) {
    int runtime = 0;
    (void)cudaRuntimeGetVersion(&runtime);
    return absl::FailedPreconditionError(absl::StrCat(
        "cudaGetDeviceCount: ", cudaGetErrorString(error), " (ubepd's CUDA runtime is ",
        runtime / 1000, ".", runtime % 1000 / 10,
        error == cudaErrorInsufficientDriver ? "; the NVIDIA driver must support it)" : ")"));
  }
  return n;
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateDeviceMemory(int device, size_t bytes) {
  absl::StatusOr<std::unique_ptr<kernels::VmmArena>> arena =
      kernels::VmmArena::Create(device, bytes, kernels::VmmArena::Sharing::kPosixFd);
  if (!arena.ok()) return arena.status();
  absl::StatusOr<int> fd = (*arena)->ExportFd();
  if (!fd.ok()) return fd.status();
  absl::StatusOr<cudaStream_t> stream = StreamOn(device);
  if (!stream.ok()) {
    close(*fd);
    return stream.status();
  }
  return std::unique_ptr<DeviceMemory>(
      new VmmDeviceMemory(device, *std::move(arena), *fd, *stream));
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> ImportDeviceMemory(int device, int fd, size_t bytes) {
  absl::StatusOr<std::unique_ptr<kernels::VmmArena>> arena = kernels::VmmArena::ImportFd(device, fd, bytes);
  if (!arena.ok()) return arena.status();
  absl::StatusOr<cudaStream_t> stream = StreamOn(device);
  if (!stream.ok()) return stream.status();
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) {
    cudaStreamDestroy(*stream);
    return absl::ErrnoToStatus(errno, "duplicating a peer's arena fd");
  }
  return std::unique_ptr<DeviceMemory>(
      new VmmDeviceMemory(device, *std::move(arena), own, *stream));
}

}  // namespace ubep::daemon
