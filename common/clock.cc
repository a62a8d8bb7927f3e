#include "common/clock.h"

#include <time.h>

namespace ubep {

int64_t SystemClock::NowNanos() const {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

void SystemClock::SleepFor(absl::Duration duration) { absl::SleepFor(duration); }

int64_t FakeClock::NowNanos() const {
  absl::MutexLock lock(&mu_);
  return now_nanos_;
}

void FakeClock::SleepFor(absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  const int64_t deadline = now_nanos_ + absl::ToInt64Nanoseconds(duration);
  auto reached = [this, deadline]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return now_nanos_ >= deadline;
  };
  ++sleepers_;
  mu_.Await(absl::Condition(&reached));
  --sleepers_;
}

void FakeClock::AwaitSleepers(int count) {
  absl::MutexLock lock(&mu_);
  auto enough = [this, count]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return sleepers_ >= count; };
  mu_.Await(absl::Condition(&enough));
}

void FakeClock::Advance(absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  now_nanos_ += absl::ToInt64Nanoseconds(duration);
}

void FakeClock::SetNanos(int64_t now_nanos) {
  absl::MutexLock lock(&mu_);
  now_nanos_ = now_nanos;
}

}  // namespace ubep
