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

class VmmDeviceMemory : public DeviceMemory {
 public:
  VmmDeviceMemory(int device, std::unique_ptr<kernels::VmmArena> arena, int fd)
      : device_(device), arena_(std::move(arena)), fd_(fd) {}
  ~VmmDeviceMemory() override {
    if (fd_ >= 0) close(fd_);
  }
  int device() const override { return device_; }
  size_t size() const override { return arena_->size(); }
  int fd() const override { return fd_; }
  absl::Status Read(size_t offset, void* out, size_t bytes) const override {
    cudaSetDevice(device_);
    return Check(cudaMemcpy(out, arena_->data() + offset, bytes, cudaMemcpyDeviceToHost),
                 "reading device arena");
  }
  absl::Status Write(size_t offset, const void* in, size_t bytes) override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemcpy(arena_->data() + offset, in, bytes, cudaMemcpyHostToDevice),
                               "writing device arena");
        !s.ok()) {
      return s;
    }
    // cudaMemcpy from pageable memory may return before the DMA lands: wait, so that what
    // the daemon publishes next (a plan table, an abort word) never precedes it.
    return Check(cudaDeviceSynchronize(), "writing device arena");
  }
  absl::Status Zero(size_t offset, size_t bytes) override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemset(arena_->data() + offset, 0, bytes), "clearing device arena");
        !s.ok()) {
      return s;
    }
    return Check(cudaDeviceSynchronize(), "clearing device arena");
  }
  absl::Status CopyFrom(const DeviceMemory& source, size_t source_offset, size_t offset,
                        size_t bytes) override {
    cudaSetDevice(device_);
    if (absl::Status s = Check(cudaMemcpyPeer(arena_->data() + offset, device_,
                                              static_cast<const std::byte*>(source.data()) + source_offset,
                                              source.device(), bytes),
                               "copying expert weights");
        !s.ok()) {
      return s;
    }
    // cudaMemcpyPeer is asynchronous with respect to the host: the copy must have landed
    // before Prepare publishes the plan table that makes ranks read it.
    return Check(cudaDeviceSynchronize(), "copying expert weights");
  }
  void* data() const override { return arena_->data(); }

 private:
  int device_;
  std::unique_ptr<kernels::VmmArena> arena_;
  int fd_;
};

}  // namespace

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateDeviceMemory(int device, size_t bytes) {
  absl::StatusOr<std::unique_ptr<kernels::VmmArena>> arena =
      kernels::VmmArena::Create(device, bytes, kernels::VmmArena::Sharing::kPosixFd);
  if (!arena.ok()) return arena.status();
  absl::StatusOr<int> fd = (*arena)->ExportFd();
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<DeviceMemory>(new VmmDeviceMemory(device, *std::move(arena), *fd));
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> ImportDeviceMemory(int device, int fd, size_t bytes) {
  absl::StatusOr<std::unique_ptr<kernels::VmmArena>> arena = kernels::VmmArena::ImportFd(device, fd, bytes);
  if (!arena.ok()) return arena.status();
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return absl::ErrnoToStatus(errno, "duplicating a peer's arena fd");
  return std::unique_ptr<DeviceMemory>(new VmmDeviceMemory(device, *std::move(arena), own));
}

}  // namespace ubep::daemon
