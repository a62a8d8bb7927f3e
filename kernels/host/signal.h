// Epoch-tagged signal words in shared memory: the point-to-point synchronization of the host
// backend. A writer publishes data, then Signal(word, epoch, door) (store, ring the door's
// bell, and a futex wake if anyone sleeps); a reader WaitEpoch(word, epoch, door, ...) (spins
// briefly, then sleeps on the bell) and then reads the data. Words only move forward, so
// nothing is cleared between calls. Epochs compare modulo 2^32. Works across processes (shared
// futexes). Thread-safe.
//
// A Doorbell serves a group of words that one owner waits on, e.g. the flags of one arena.
// Every Signal to any of them also moves the bell (a counter), so that a waiter on many words
// (WaitUntil: a receiver waiting on R sources) sleeps once, on the bell, and wakes for whichever
// moves first; a waiter on one word (WaitEpoch: a barrier's flags, one by one) sleeps on the
// word itself and is not woken by the others. Each kind of sleeper is counted (`word_sleepers`,
// `bell_sleepers`: threads asleep, or about to be). A waiter reads the word (or the bell), looks
// at what it waits for, adds itself to its count, and sleeps unless the word (bell) moved; a
// signaller stores the word, moves the bell and then reads the counts. All of these accesses are
// sequentially consistent, so either the waiter sees the new epoch (the bell it read came after
// the store), or the word (bell) moved under it (the futex returns at once), or the signaller
// sees the waiter and wakes it; a Signal nobody waits for costs no syscall. A count left above
// zero (a process that died asleep) only brings back the wake syscalls, until the group's reset
// (ResetSignals) zeroes it with the flags. A word can be its own bell (Doorbell::Own).
#ifndef UBEP_KERNELS_HOST_SIGNAL_H_
#define UBEP_KERNELS_HOST_SIGNAL_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/timeout.h"

namespace ubep::kernels {

// When a wait gives up: a point of the monotonic clock (std::chrono::steady_clock, which is
// CLOCK_MONOTONIC, as FUTEX_WAIT's timeouts), so that a wall clock stepped by NTP or by a
// resumed VM neither ends the group's waits at once nor stretches them.
using Deadline = std::chrono::steady_clock::time_point;

// `timeout` from now; an infinite timeout (NeverEnds) never ends.
inline Deadline DeadlineAfter(absl::Duration timeout) {
  if (NeverEnds(timeout)) return Deadline::max();
  return std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
}

inline bool EpochReached(uint32_t value, uint32_t epoch) {
  return static_cast<int32_t>(value - epoch) >= 0;
}

inline uint32_t LoadAcquire(const uint32_t* word) {
  return std::atomic_ref<const uint32_t>(*word).load(std::memory_order_acquire);
}

struct Doorbell {
  uint32_t* bell;
  uint32_t* word_sleepers;  // Threads asleep on one of the words (WaitEpoch).
  uint32_t* bell_sleepers;  // Threads asleep on the bell (WaitUntil).
  // A single word that is its own bell, with one count of sleepers.
  static Doorbell Own(uint32_t* word, uint32_t* sleepers) { return {word, sleepers, sleepers}; }
};

// The longest a waiter sleeps before it looks at its deadline and abort word again; an abort
// that rings the bell (RaiseAbort) is seen at once.
inline constexpr absl::Duration kMaxSleep = absl::Milliseconds(50);

// What ends a wait besides its deadline: `word` (optional) holding a code other than 0 and
// `spared`, a code the waiter has read and found it may wait past (a rank that left after it
// had completed the call: arena_layout.h LeftAfter).
struct AbortWatch {
  const uint32_t* word = nullptr;
  uint32_t spared = 0;
};

void Signal(uint32_t* word, uint32_t epoch, Doorbell door);

// Moves the bell without a word of its own (an abort word set): every sleeper on the bell
// looks again at once (one on a single word within kMaxSleep).
void Ring(Doorbell door);

// Looks at what a waiter waits for before it goes to sleep, spinning.
inline constexpr int kSpins = 256;

// OK once ready() (which reads with acquire, or stronger, ordering) is true; DeadlineExceeded
// at `deadline`; Aborted once `abort` says so and ready() is still false (a Ring wakes a
// sleeper at once to look). Calls ready() `spins` times, then sleeps on the bell in slices of
// at most `slice`, so what rings no bell (flag-in-granule rows) is looked at that often. A
// ready() that looks at n words spins for kSpins / n rounds to spin as long as a wait on one
// word.
absl::Status WaitUntil(Doorbell door, Deadline deadline, AbortWatch abort,
                       absl::FunctionRef<bool()> ready, absl::Duration slice = kMaxSleep,
                       int spins = kSpins);

// As WaitUntil *word has reached `epoch`, asleep on the word itself (woken by its Signal only).
absl::Status WaitEpoch(const uint32_t* word, uint32_t epoch, Doorbell door, Deadline deadline,
                       AbortWatch abort = {});

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_SIGNAL_H_
