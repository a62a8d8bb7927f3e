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

void Signal(uint32_t* word, uint32_t epoch) {
  std::atomic_ref<uint32_t>(*word).store(epoch, std::memory_order_release);
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

absl::Status WaitEpoch(const uint32_t* word, uint32_t epoch, absl::Time deadline,
                       const uint32_t* abort_word) {
  for (int i = 0; i < kSpins; ++i) {
    if (EpochReached(LoadAcquire(word), epoch)) return absl::OkStatus();
  }
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
    // Returns at once if the word moved since `seen`; spurious wakeups loop.
    syscall(SYS_futex, const_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
}

}  // namespace ubep::kernels
