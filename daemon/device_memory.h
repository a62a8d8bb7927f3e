// DeviceMemory: one rank's device arena on the CUDA backend, owned by ubepd (VMM memory,
// exported to the rank's client as a POSIX fd). The daemon touches it only through these
// copies (signal reset, abort word, load counters); kernels in the clients do the rest.
// Built without CUDA, CreateDeviceMemory fails with FailedPrecondition.
// Thread-compatible.
#ifndef UBEP_DAEMON_DEVICE_MEMORY_H_
#define UBEP_DAEMON_DEVICE_MEMORY_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace ubep::daemon {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual int device() const = 0;
  virtual size_t size() const = 0;
  virtual int fd() const = 0;  // Owned by this object; dup'ed when passed.
  virtual absl::Status Read(size_t offset, void* out, size_t bytes) const = 0;
  virtual absl::Status Write(size_t offset, const void* in, size_t bytes) = 0;
  virtual absl::Status Zero(size_t offset, size_t bytes) = 0;
  // Device to device, possibly across the domain's GPUs (peer copy).
  virtual absl::Status CopyFrom(const DeviceMemory& source, size_t source_offset, size_t offset,
                                size_t bytes) = 0;
  virtual void* data() const = 0;  // Device address of the arena in this process.
};

// Devices visible to this process (0 without CUDA or a driver).
int DeviceCount();
// The same, or why none can be counted (no driver, one too old for this CUDA runtime, built
// without CUDA): the runtime's own words.
absl::StatusOr<int> CountDevices();

absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateDeviceMemory(int device, size_t bytes);

// A peer daemon's arena of `bytes` on this machine, from the fd it exported (the caller keeps
// `fd`; the memory keeps a duplicate, passed on to clients), mapped here for `device`.
absl::StatusOr<std::unique_ptr<DeviceMemory>> ImportDeviceMemory(int device, int fd, size_t bytes);

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_DEVICE_MEMORY_H_
