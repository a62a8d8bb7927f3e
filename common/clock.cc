#include "common/clock.h"

#include "absl/time/clock.h"

#include <time.h>

namespace ubep {

int64_t SystemClock::NowNanos() const {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

void SystemClock::SleepFor(absl::Duration duration) { absl::SleepFor(duration); }

absl::Time MonotonicNow() { return absl::FromUnixNanos(SystemClock().NowNanos()); }

int64_t FakeClock::NowNanos() const {
  MutexLock lock(&mu_);
  return now_nanos_;
}

void FakeClock::SleepFor(absl::Duration duration) {
  MutexLock lock(&mu_);
  const int64_t deadline = now_nanos_ + absl::ToInt64Nanoseconds(duration);
  ++sleepers_;
  mu_.Await([this, deadline]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return now_nanos_ >= deadline; });
  --sleepers_;
}

void FakeClock::AwaitSleepers(int count) {
  MutexLock lock(&mu_);
  mu_.Await([this, count]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return sleepers_ >= count; });
}

void FakeClock::Advance(absl::Duration duration) {
  MutexLock lock(&mu_);
  now_nanos_ += absl::ToInt64Nanoseconds(duration);
}

void FakeClock::SetNanos(int64_t now_nanos) {
  MutexLock lock(&mu_);
  now_nanos_ = now_nanos;
}

}  // namespace ubep
