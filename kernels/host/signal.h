// Epoch-tagged signal words in shared memory: the point-to-point synchronization of the host
// backend. A writer publishes data, then Signal(word, epoch) (release store + futex wake); a
// reader WaitEpoch(word, epoch, ...) (acquire load; spins briefly, then sleeps in the futex)
// and then reads the data. Words only move forward, so nothing is cleared between calls.
// Epochs compare modulo 2^32. Works across processes (shared futexes). Thread-safe.
#ifndef UBEP_KERNELS_HOST_SIGNAL_H_
#define UBEP_KERNELS_HOST_SIGNAL_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace ubep::kernels {

inline bool EpochReached(uint32_t value, uint32_t epoch) {
  return static_cast<int32_t>(value - epoch) >= 0;
}

inline uint32_t LoadAcquire(const uint32_t* word) {
  return std::atomic_ref<const uint32_t>(*word).load(std::memory_order_acquire);
}

void Signal(uint32_t* word, uint32_t epoch);

// OK once *word has reached `epoch`; DeadlineExceeded at `deadline`; Aborted as soon as
// `abort_word` (optional) is non-zero (checked at least every 50 ms).
absl::Status WaitEpoch(const uint32_t* word, uint32_t epoch, absl::Time deadline,
                       const uint32_t* abort_word = nullptr);

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_SIGNAL_H_
