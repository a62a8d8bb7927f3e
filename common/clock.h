// Clock: the seam through which every component reads time and sleeps, so tests can drive time
// with FakeClock instead of waiting. Units: nanoseconds since an arbitrary epoch (monotonic).
//
//   SystemClock clock;
//   int64_t t0 = clock.NowNanos();
//
// Thread safety: all implementations are safe to call from any thread.
#ifndef UBEP_COMMON_CLOCK_H_
#define UBEP_COMMON_CLOCK_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace ubep {

class ClockInterface {
 public:
  virtual ~ClockInterface() = default;
  // Monotonic time.
  virtual int64_t NowNanos() const = 0;
  // Blocks the caller for `duration` of this clock's time.
  virtual void SleepFor(absl::Duration duration) = 0;

  absl::Time Now() const { return absl::FromUnixNanos(NowNanos()); }
};

// The real monotonic clock (CLOCK_MONOTONIC).
class SystemClock final : public ClockInterface {
 public:
  int64_t NowNanos() const override;
  void SleepFor(absl::Duration duration) override;
};

// Now on the real monotonic clock, as an absl::Time on that clock's epoch: for intervals and
// deadlines that a wall-clock step (NTP, a VM resume) must not move; never shown as a date.
absl::Time MonotonicNow();

// A clock that moves only when told to. SleepFor blocks until another thread advances the
// clock past the sleeper's deadline.
class FakeClock final : public ClockInterface {
 public:
  explicit FakeClock(int64_t start_nanos = 0) : now_nanos_(start_nanos) {}

  int64_t NowNanos() const override;
  void SleepFor(absl::Duration duration) override;

  void Advance(absl::Duration duration);
  void SetNanos(int64_t now_nanos);
  // Blocks until at least `count` threads are inside SleepFor, so a test advances time only
  // once the sleepers it means to wake have computed their deadlines.
  void AwaitSleepers(int count);

 private:
  mutable Mutex mu_;
  int64_t now_nanos_ ABSL_GUARDED_BY(mu_);
  int sleepers_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ubep

#endif  // UBEP_COMMON_CLOCK_H_
