// The usage of UBEP's binaries that take Abseil flags: --help lists the program's own flags
// (Abseil's default lists those of a file named after the program only, and none of ours is),
// and --version prints the program's name and UBEP's version.
#ifndef UBEP_COMMON_FLAGS_USAGE_H_
#define UBEP_COMMON_FLAGS_USAGE_H_

#include "absl/strings/string_view.h"

namespace ubep {

// Call before absl::ParseCommandLine: `program` is the binary's name, `usage` what --help
// prints above the flags (absl::SetProgramUsageMessage, called here).
void SetFlagsUsage(absl::string_view program, absl::string_view usage);

}  // namespace ubep

#endif  // UBEP_COMMON_FLAGS_USAGE_H_
