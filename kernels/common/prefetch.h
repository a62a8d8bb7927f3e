// Software prefetch of whole rows for the host backend's copy and sum loops (and the MPI
// baseline's, so both are measured with the same loops). Rows are a few KiB at addresses that
// jump from one row to the next; the hardware prefetcher does not follow such jumps across
// pages, so each loop asks for the row its next step touches while it works on this one.
#ifndef UBEP_KERNELS_COMMON_PREFETCH_H_
#define UBEP_KERNELS_COMMON_PREFETCH_H_

#include <cstddef>

namespace ubep::kernels {

inline constexpr size_t kCacheLine = 64;

// A row the next step reads.
inline void PrefetchRow(const void* row, size_t bytes) {
  const auto* p = static_cast<const char*>(row);
  for (size_t at = 0; at < bytes; at += kCacheLine) __builtin_prefetch(p + at, 0);
}

// A row the next step overwrites (its lines are fetched for writing).
inline void PrefetchRowForWrite(void* row, size_t bytes) {
  auto* p = static_cast<char*>(row);
  for (size_t at = 0; at < bytes; at += kCacheLine) __builtin_prefetch(p + at, 1);
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_PREFETCH_H_
