// Bounded polling for tests: what a test waits for that no signal announces (a server's
// handler finishing after its caller gave up, a process writing a file).
#ifndef UBEP_TESTS_WAIT_FOR_H_
#define UBEP_TESTS_WAIT_FOR_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ubep::test {

// Polls `ready()` every 10 ms until it holds or `timeout` passes; returns whether it held.
template <typename Predicate>
bool WaitFor(Predicate ready, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!ready()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

}  // namespace ubep::test

#endif  // UBEP_TESTS_WAIT_FOR_H_
