#include "common/flags_usage.h"

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ubep {
namespace {

// The flags a UBEP binary defines itself, not Abseil's own (--flagfile, --fromenv, ...,
// which --helpfull still lists).
bool OwnFlag(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

std::string* Program() {
  static std::string* program = new std::string;
  return program;
}

}  // namespace

void SetFlagsUsage(absl::string_view program, absl::string_view usage) {
  *Program() = std::string(program);
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = OwnFlag;
  config.contains_help_flags = OwnFlag;
  config.version_string = [] { return absl::StrCat(*Program(), " ", UBEP_VERSION, "\n"); };
  absl::SetFlagsUsageConfig(config);
}

}  // namespace ubep
