#include "common/clock.h"

#include <limits>

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

namespace {

// a + b, held at int64's ends (an infinite duration is int64's largest count of ns).
int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) {
    return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
  }
  return sum;
}

}  // namespace

void FakeClock::SleepFor(absl::Duration duration) {
  MutexLock lock(&mu_);
  const int64_t deadline = SaturatingAdd(now_nanos_, absl::ToInt64Nanoseconds(duration));
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
  now_nanos_ = SaturatingAdd(now_nanos_, absl::ToInt64Nanoseconds(duration));
}

void FakeClock::SetNanos(int64_t now_nanos) {
  MutexLock lock(&mu_);
  now_nanos_ = now_nanos;
}

}  // namespace ubep
