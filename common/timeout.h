// Timeouts given as absl::Duration that are waited out on std::chrono clocks.
#ifndef UBEP_COMMON_TIMEOUT_H_
#define UBEP_COMMON_TIMEOUT_H_

#include "absl/time/time.h"

namespace ubep {

// A timeout of a million hours or more (absl::InfiniteDuration among them) never ends: as a
// std::chrono span added to now it would overflow the deadline, which libstdc++ takes for one
// already past, so a wait on it would return at once.
inline bool NeverEnds(absl::Duration timeout) { return timeout >= absl::Hours(1000000); }
// The bound NeverEnds draws, as messages refusing a timeout past it say it.
inline constexpr char kTimeoutBound[] = "1000000h";

// How long before a caller's deadline, `left` away, a wait bounded by it ends, so that the
// answer (why the wait ended) reaches the caller before its own DEADLINE_EXCEEDED does: a
// tenth of the time left, at least `floor` (a loaded machine delays an answer more than an
// idle one sends it).
inline absl::Duration AnswerMargin(absl::Duration left, absl::Duration floor) {
  return left / 10 > floor ? left / 10 : floor;
}

}  // namespace ubep

#endif  // UBEP_COMMON_TIMEOUT_H_
