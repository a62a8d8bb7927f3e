// DeviceMemory where ubepd is built without CUDA.
#include "daemon/device_memory.h"

namespace ubep::daemon {

int DeviceCount() { return 0; }

absl::StatusOr<int> CountDevices() {
  return absl::FailedPreconditionError("ubepd was built without CUDA");
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateDeviceMemory(int, size_t) {
  return absl::FailedPreconditionError(
      "this ubepd was built without CUDA (UBEP_ENABLE_CUDA=OFF): --backend cuda is unavailable");
}

absl::StatusOr<std::unique_ptr<DeviceMemory>> ImportDeviceMemory(int, int, size_t) {
  return absl::FailedPreconditionError(
      "this ubepd was built without CUDA (UBEP_ENABLE_CUDA=OFF): --backend cuda is unavailable");
}

}  // namespace ubep::daemon
