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

// Whether this CPU has every feature of an x86-64 level (the psABI's levels, as -march names
// them): asked of the compiler's runtime by the level's own name, so that no feature the
// level enables goes unchecked (v3 has LZCNT, MOVBE and BMI1 besides AVX2, FMA and BMI2; a
// guest CPU can lack one alone, and LZCNT runs there as BSR, giving wrong answers, not SIGILL).
bool CpuRuns(std::string_view level) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (level == "x86-64-v2") return __builtin_cpu_supports("x86-64-v2");
  if (level == "x86-64-v3") return __builtin_cpu_supports("x86-64-v3");
  if (level == "x86-64-v4") return __builtin_cpu_supports("x86-64-v4");
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
