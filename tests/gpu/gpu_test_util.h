// Helpers of the GPU tests, whose ranks are forked processes.
#ifndef UBEP_TESTS_GPU_GPU_TEST_UTIL_H_
#define UBEP_TESTS_GPU_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "kernels/cuda/cuda_ep.h"

namespace ubep::test {

// Why no CUDA device is usable here ("" when one is), asked once per test binary and in a
// child: the parent must not initialize CUDA before it forks the rank processes. A test skips
// with "no CUDA device here: " and the reason (ctest's skip pattern; bench/gpu/run.sh fails a
// machine that lists a GPU and still skips).
inline const std::string& NoDeviceReason() {
  static const std::string reason = [] {
    int fds[2];
    if (pipe(fds) != 0) return absl::StrCat("pipe for the device probe: ", std::strerror(errno));
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      const absl::Status status = kernels::CudaDeviceStatus();
      const std::string message(status.message());
      if (!message.empty()) (void)!write(fds[1], message.data(), message.size());
      _exit(status.ok() ? 0 : 1);
    }
    close(fds[1]);
    std::string why;
    char buffer[256];
    for (ssize_t n; (n = read(fds[0], buffer, sizeof(buffer))) > 0;) why.append(buffer, n);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return std::string();
    return why.empty() ? absl::StrCat("the probe ended with wait status ", status) : why;
  }();
  return reason;
}

#define UBEP_SKIP_WITHOUT_DEVICE()                                                     \
  do {                                                                                 \
    if (const std::string& why = ::ubep::test::NoDeviceReason(); !why.empty()) {       \
      GTEST_SKIP() << "no CUDA device here: " << why;                                  \
    }                                                                                  \
  } while (false)

// In a rank process: a CUDA call that fails ends the process (exit status 4) with the call and
// the error on stderr; the parent reports the abnormal exit.
inline void CheckCuda(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", call, cudaGetErrorString(error));
  std::fflush(stderr);
  _exit(4);
}

// Reaps the rank processes `pids` within `limit` (a rank hung on a dead peer's kernel must
// not hold the test, or the device, past it): their wait statuses, those still running then
// killed (SIGKILL) and reaped, their status saying so.
inline std::vector<int> WaitForRanks(const std::vector<pid_t>& pids, absl::Duration limit) {
  std::vector<int> statuses(pids.size(), 0);
  std::vector<bool> reaped(pids.size(), false);
  size_t left = pids.size();
  for (size_t r = 0; r < pids.size(); ++r) {
    if (pids[r] <= 0) {  // No such process (a fork that failed): nothing to wait for or kill.
      reaped[r] = true;
      --left;
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(limit);
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (!reaped[r] && waitpid(pids[r], &statuses[r], WNOHANG) == pids[r]) {
        reaped[r] = true;
        --left;
      }
    }
    if (left > 0) absl::SleepFor(absl::Milliseconds(10));
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    if (reaped[r]) continue;
    kill(pids[r], SIGKILL);
    waitpid(pids[r], &statuses[r], 0);  // Killed: WIFSIGNALED, SIGKILL.
  }
  return statuses;
}

}  // namespace ubep::test

#define UBEP_CHECK_CUDA(call) ::ubep::test::CheckCuda((call), #call)

#endif  // UBEP_TESTS_GPU_GPU_TEST_UTIL_H_
