// Epoch-tagged signal words in shared memory: the point-to-point synchronization of the host
// backend. A writer publishes data, then Signal(word, epoch, sleepers) (store, and a futex wake
// if anyone sleeps); a reader WaitEpoch(word, epoch, sleepers, ...) (spins briefly, then sleeps
// in the futex) and then reads the data. Words only move forward, so nothing is cleared
// between calls. Epochs compare modulo 2^32. Works across processes (shared futexes).
// Thread-safe.
//
// `sleepers` counts the threads asleep (or about to be) on any of a group of words, e.g. the
// flags of one arena, whose owner is the only one to wait on them. A waiter adds itself before
// it looks at the word one last time and sleeps; a signaller stores the word and then looks at
// the count. All four accesses are sequentially consistent, so either the waiter sees the new
// epoch or the signaller sees the waiter, and a Signal nobody waits for costs no syscall. A
// count left above zero (a process that died asleep) only brings back the wake syscalls, until
// the group's reset (ResetSignals) zeroes it with the flags.
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

void Signal(uint32_t* word, uint32_t epoch, uint32_t* sleepers);

// OK once *word has reached `epoch`; DeadlineExceeded at `deadline`; Aborted as soon as
// `abort_word` (optional) is non-zero (checked at least every 50 ms).
absl::Status WaitEpoch(const uint32_t* word, uint32_t epoch, uint32_t* sleepers,
                       absl::Time deadline, const uint32_t* abort_word = nullptr);

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_SIGNAL_H_
