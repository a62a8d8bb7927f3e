// Helpers of the GPU tests, whose ranks are forked processes.
#ifndef UBEP_TESTS_GPU_GPU_TEST_UTIL_H_
#define UBEP_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "kernels/cuda/cuda_ep.h"

namespace ubep::test {

// Whether a CUDA device is usable, asked in a child: the parent must not initialize CUDA
// before it forks the rank processes.
inline bool DeviceInChild() {
  const pid_t pid = fork();
  if (pid == 0) _exit(kernels::CudaDeviceAvailable() ? 0 : 1);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// In a rank process: a CUDA call that fails ends the process (exit status 4) with the call and
// the error on stderr; the parent reports the abnormal exit.
inline void CheckCuda(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", call, cudaGetErrorString(error));
  std::fflush(stderr);
  _exit(4);
}

}  // namespace ubep::test

#define UBEP_CHECK_CUDA(call) ::ubep::test::CheckCuda((call), #call)

#endif  // UBEP_TESTS_GPU_GPU_TEST_UTIL_H_
