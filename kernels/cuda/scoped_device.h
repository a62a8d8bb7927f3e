// ScopedDevice: makes a CUDA device the calling thread's current one for the guard's lifetime
// and puts back the one that was current before. The runtime's current device is per thread:
// a call made on a rank's memory or streams from a thread whose current device is another
// (a new thread starts on device 0) launches into a stream of another device, which the
// runtime refuses, or allocates on the wrong GPU. Every entry point that touches a rank's
// device state selects the rank's device this way; the caller's choice is left as it was.
#ifndef UBEP_KERNELS_CUDA_SCOPED_DEVICE_H_
#define UBEP_KERNELS_CUDA_SCOPED_DEVICE_H_

#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ubep::kernels {

class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (const cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess) {
      error_ = absl::StrCat("cudaGetDevice: ", cudaGetErrorString(e));
      return;
    }
    if (previous_ == device) return;
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      error_ = absl::StrCat("cannot select CUDA device ", device, ": ", cudaGetErrorString(e));
      return;
    }
    switched_ = true;
  }
  ~ScopedDevice() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  // Whether the device was selected (else the calls under the guard must not run).
  absl::Status status() const {
    return error_.empty() ? absl::OkStatus() : absl::FailedPreconditionError(error_);
  }

 private:
  int previous_ = -1;
  bool switched_ = false;
  std::string error_;  // Why the device was not selected; empty if it was.
};

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_CUDA_SCOPED_DEVICE_H_
