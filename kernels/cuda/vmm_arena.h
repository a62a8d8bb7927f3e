// VmmArena: device memory from the CUDA driver's virtual memory API (cuMemCreate,
// cuMemAddressReserve, cuMemMap, cuMemSetAccess), shareable with other processes as a POSIX
// file descriptor (processes of one node: ubepd passes it over its fd socket) or as a fabric
// handle (multi-node NVLink, where the device supports it). This is how ubepd owns the CUDA
// backend's arenas while serving processes map them.
//
// The driver entry points are resolved at run time through the CUDA runtime
// (cudaGetDriverEntryPointByVersion), so binaries load on machines without a driver; every
// call then fails with FailedPrecondition naming what is missing.
// Thread-compatible.
#ifndef UBEP_KERNELS_CUDA_VMM_ARENA_H_
#define UBEP_KERNELS_CUDA_VMM_ARENA_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace ubep::kernels {

using FabricHandle = std::array<unsigned char, 64>;

class VmmArena {
 public:
  enum class Sharing { kPosixFd, kFabric };

  // A new zero-filled allocation of at least `bytes` on `device`, mapped here with read/write
  // access for `device` and every device in `peers` (the domain's GPUs with peer access).
  static absl::StatusOr<std::unique_ptr<VmmArena>> Create(int device, size_t bytes,
                                                          Sharing sharing,
                                                          const std::vector<int>& peers = {});
  // Maps another process's allocation of `bytes` from its exported fd (dup'ed by the driver;
  // the caller keeps its fd) or fabric handle, accessible from `device`.
  static absl::StatusOr<std::unique_ptr<VmmArena>> ImportFd(int device, int fd, size_t bytes);
  static absl::StatusOr<std::unique_ptr<VmmArena>> ImportFabric(int device,
                                                                const FabricHandle& handle,
                                                                size_t bytes);
  ~VmmArena();
  VmmArena(const VmmArena&) = delete;
  VmmArena& operator=(const VmmArena&) = delete;

  std::byte* data() const { return reinterpret_cast<std::byte*>(address_); }
  size_t size() const { return size_; }  // Rounded up to the allocation granularity.

  // A new fd for the allocation (the caller closes it); only for kPosixFd allocations.
  absl::StatusOr<int> ExportFd() const;
  absl::StatusOr<FabricHandle> ExportFabric() const;

  // Whether this machine's driver and `device` support fabric handles.
  static bool FabricSupported(int device);

 private:
  VmmArena() = default;
  // `os_handle`: the fd (as a pointer-sized integer) or a CUmemFabricHandle*.
  static absl::StatusOr<std::unique_ptr<VmmArena>> Import(int device, size_t bytes,
                                                          Sharing sharing, void* os_handle);
  absl::Status MapHere(int device, const std::vector<int>& peers);

  unsigned long long handle_ = 0;  // CUmemGenericAllocationHandle.
  unsigned long long address_ = 0; // CUdeviceptr.
  size_t size_ = 0;
  Sharing sharing_ = Sharing::kPosixFd;
};

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_CUDA_VMM_ARENA_H_
