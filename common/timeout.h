// Timeouts given as absl::Duration that are waited out on std::chrono clocks.
#ifndef UBEP_COMMON_TIMEOUT_H_
#define UBEP_COMMON_TIMEOUT_H_

#include "absl/time/time.h"

namespace ubep {

// A timeout of a million hours or more (absl::InfiniteDuration among them) never ends: as a
// std::chrono span added to now it would overflow the deadline, which libstdc++ takes for one
// already past, so a wait on it would return at once.
inline bool NeverEnds(absl::Duration timeout) { return timeout >= absl::Hours(1000000); }

}  // namespace ubep

#endif  // UBEP_COMMON_TIMEOUT_H_
