// The CPU level the host kernels were built for. kernels/host is compiled for an x86-64 level
// above the baseline (CMake's UBEP_HOST_MARCH, default x86-64-v3: AVX2 and FMA), and a CPU
// below that level would stop its code with SIGILL. ubepd and libubep ask HostCpuSupported()
// before they run any of it, and refuse to start with an error that says what to rebuild.
// This file is compiled for the baseline, so it runs on any x86-64 CPU.
#ifndef UBEP_KERNELS_COMMON_HOST_CPU_H_
#define UBEP_KERNELS_COMMON_HOST_CPU_H_

#include <string_view>

#include "absl/status/status.h"

namespace ubep::kernels {

// The level kernels/host was built for ("x86-64-v3"), or "" where the compiler's default
// was kept (a target other than x86-64).
std::string_view HostKernelLevel();

// OK if this CPU runs the host kernels; else FailedPrecondition naming the level.
absl::Status HostCpuSupported();

// For a program's main, before anything else runs: on a CPU below the level, prints
// "<program>: <the error>" to stderr and exits with status 1.
void RequireHostCpu(std::string_view program);

// The status for a CPU that does (`supported`) or does not run code built for `level`.
absl::Status HostCpuStatus(std::string_view level, bool supported);

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_HOST_CPU_H_
