#include "kernels/common/host_cpu.h"

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"

#ifndef UBEP_HOST_MARCH
#define UBEP_HOST_MARCH ""
#endif

namespace ubep::kernels {
namespace {

// Whether this CPU has the features of an x86-64 level (the psABI's levels, by the feature
// names GCC and Clang both know).
bool CpuRuns(std::string_view level) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool v2 = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("ssse3") &&
                  __builtin_cpu_supports("popcnt");
  const bool v3 = v2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
  if (level == "x86-64-v2") return v2;
  if (level == "x86-64-v3") return v3;
  if (level == "x86-64-v4") return v4;
#endif
  return true;  // The baseline, or a level CMake does not let through.
}

}  // namespace

std::string_view HostKernelLevel() { return UBEP_HOST_MARCH; }

absl::Status HostCpuSupported() {
  return HostCpuStatus(HostKernelLevel(), CpuRuns(HostKernelLevel()));
}

void RequireHostCpu(std::string_view program) {
  const absl::Status status = HostCpuSupported();
  if (status.ok()) return;
  std::cerr << program << ": " << status.message() << "\n";
  std::exit(1);
}

absl::Status HostCpuStatus(std::string_view level, bool supported) {
  if (supported) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the host kernels of this build need an ", std::string(level),
      " CPU, and this one lacks some of its features (see /proc/cpuinfo); rebuild with "
      "-DUBEP_HOST_MARCH=x86-64 (or the level this CPU has) to run here"));
}

}  // namespace ubep::kernels
