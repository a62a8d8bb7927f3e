#include "kernels/host/signal.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>

#include "absl/time/clock.h"

namespace ubep::kernels {
namespace {

constexpr int kSpins = 256;
constexpr absl::Duration kMaxSleep = absl::Milliseconds(50);

}  // namespace

void Signal(uint32_t* word, uint32_t epoch, uint32_t* sleepers) {
  std::atomic_ref<uint32_t>(*word).store(epoch, std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(*sleepers).load(std::memory_order_seq_cst) == 0) return;
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

absl::Status WaitEpoch(const uint32_t* word, uint32_t epoch, uint32_t* sleepers,
                       absl::Time deadline, const uint32_t* abort_word) {
  for (int i = 0; i < kSpins; ++i) {
    if (EpochReached(LoadAcquire(word), epoch)) return absl::OkStatus();
  }
  std::atomic_ref<uint32_t> asleep(*sleepers);
  while (true) {
    const uint32_t seen = LoadAcquire(word);
    if (EpochReached(seen, epoch)) return absl::OkStatus();
    if (abort_word != nullptr && LoadAcquire(abort_word) != 0) {
      return absl::AbortedError("the group gave up");
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("timed out");
    }
    const timespec ts = absl::ToTimespec(std::min(left, kMaxSleep));
    asleep.fetch_add(1, std::memory_order_seq_cst);
    // After the count: a Signal that stored later sees this sleeper and wakes it (the futex
    // returns at once if the word moved after this look); spurious wakeups loop.
    if (std::atomic_ref<const uint32_t>(*word).load(std::memory_order_seq_cst) == seen) {
      syscall(SYS_futex, const_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
    asleep.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace ubep::kernels
