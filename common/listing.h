// Lists in messages: a status travels in a gRPC trailer (16 KiB at most, past which the caller
// gets another error than the one sent) and a log line should stay one screen.
#ifndef UBEP_COMMON_LISTING_H_
#define UBEP_COMMON_LISTING_H_

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ubep {

// The first `most` of `items`, each cut to `item_bytes` ("..." marks a cut), joined by
// `separator`, then "<separator>and N more" where more were left out.
inline std::string JoinFirst(const std::vector<std::string>& items, size_t most,
                             const std::string& separator, size_t item_bytes = 1024) {
  std::string out;
  const size_t listed = std::min(most, items.size());
  for (size_t i = 0; i < listed; ++i) {
    if (i > 0) out += separator;
    if (items[i].size() > item_bytes) {
      absl::StrAppend(&out, items[i].substr(0, item_bytes), "...");
    } else {
      out += items[i];
    }
  }
  if (items.size() > listed) absl::StrAppend(&out, separator, "and ", items.size() - listed, " more");
  return out;
}

}  // namespace ubep

#endif  // UBEP_COMMON_LISTING_H_
