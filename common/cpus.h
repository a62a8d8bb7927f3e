// The CPUs this process may run on.
#ifndef UBEP_COMMON_CPUS_H_
#define UBEP_COMMON_CPUS_H_

#include <sched.h>

#include <algorithm>
#include <thread>

namespace ubep {

// CPUs of this process's affinity mask (a cpuset, taskset, or a container's pinned CPUs),
// not the machine's count; at least 1.
inline int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace ubep

#endif  // UBEP_COMMON_CPUS_H_
