#include "kernels/host/signal.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>


namespace ubep::kernels {
namespace {

void WakeIfAsleep(uint32_t* word, uint32_t* sleepers) {
  if (std::atomic_ref<uint32_t>(*sleepers).load(std::memory_order_seq_cst) == 0) return;
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Spins on ready() (`spins` looks), then sleeps on `word` (counted in `sleepers`) in slices of at
// most `slice` until ready(), the abort word or the deadline. `word` is read before each look at
// ready(), so a change that the look misses moves it later and the futex does not sleep through it.
absl::Status SleepUntil(uint32_t* word, uint32_t* sleepers, Deadline deadline, AbortWatch abort,
                        absl::FunctionRef<bool()> ready, absl::Duration slice, int spins) {
  for (int i = 0; i < spins; ++i) {
    if (ready()) return absl::OkStatus();
  }
  std::atomic_ref<uint32_t> seen_word(*word), asleep(*sleepers);
  while (true) {
    const uint32_t seen = seen_word.load(std::memory_order_seq_cst);
    if (ready()) return absl::OkStatus();
    if (abort.word != nullptr) {
      const uint32_t code = LoadAcquire(abort.word);
      if (code != 0 && code != abort.spared) return absl::AbortedError("the group gave up");
    }
    const Deadline now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return absl::DeadlineExceededError("timed out");
    }
    // Relative, and FUTEX_WAIT measures it on the monotonic clock too.
    const timespec ts = absl::ToTimespec(std::min(absl::FromChrono(deadline - now), slice));
    asleep.fetch_add(1, std::memory_order_seq_cst);
    // After the count: a Signal that moves the word later sees this sleeper and wakes it (the
    // futex returns at once if the word moved after this look); spurious wakeups loop.
    if (seen_word.load(std::memory_order_seq_cst) == seen) {
      syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
    asleep.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace

void Signal(uint32_t* word, uint32_t epoch, Doorbell door) {
  std::atomic_ref<uint32_t>(*word).store(epoch, std::memory_order_seq_cst);
  if (door.bell == word) {
    WakeIfAsleep(word, door.word_sleepers);
    return;
  }
  std::atomic_ref<uint32_t>(*door.bell).fetch_add(1, std::memory_order_seq_cst);
  WakeIfAsleep(word, door.word_sleepers);
  WakeIfAsleep(door.bell, door.bell_sleepers);
}

void Ring(Doorbell door) {
  std::atomic_ref<uint32_t>(*door.bell).fetch_add(1, std::memory_order_seq_cst);
  WakeIfAsleep(door.bell, door.bell_sleepers);
}

absl::Status WaitUntil(Doorbell door, Deadline deadline, AbortWatch abort,
                       absl::FunctionRef<bool()> ready, absl::Duration slice, int spins) {
  return SleepUntil(door.bell, door.bell_sleepers, deadline, abort, ready, slice, spins);
}

absl::Status WaitEpoch(const uint32_t* word, uint32_t epoch, Doorbell door, Deadline deadline,
                       AbortWatch abort) {
  return SleepUntil(
      const_cast<uint32_t*>(word), door.word_sleepers, deadline, abort,
      [&] { return EpochReached(LoadAcquire(word), epoch); }, kMaxSleep, kSpins);
}

}  // namespace ubep::kernels
