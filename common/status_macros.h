// Status propagation macros (Debian's Abseil 20220623 has none of its own).
//
//   UBEP_RETURN_IF_ERROR(WriteFile(path, bytes));
//   UBEP_ASSIGN_OR_RETURN(Plan plan, ParsePlan(json));
//
// Both return early from the enclosing function, which must return absl::Status or
// absl::StatusOr<T>. Thread-safe: they are plain expressions.
#ifndef UBEP_COMMON_STATUS_MACROS_H_
#define UBEP_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define UBEP_STATUS_CONCAT_INNER_(a, b) a##b
#define UBEP_STATUS_CONCAT_(a, b) UBEP_STATUS_CONCAT_INNER_(a, b)

#define UBEP_RETURN_IF_ERROR(expr)                          \
  do {                                                      \
    ::absl::Status ubep_status_ = ::ubep::internal::AsStatus(expr); \
    if (!ubep_status_.ok()) return ubep_status_;            \
  } while (0)

#define UBEP_ASSIGN_OR_RETURN(lhs, rexpr) \
  UBEP_ASSIGN_OR_RETURN_IMPL_(UBEP_STATUS_CONCAT_(ubep_statusor_, __LINE__), lhs, rexpr)

#define UBEP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace ubep::internal {

inline const ::absl::Status& AsStatus(const ::absl::Status& status) { return status; }

template <typename T>
const ::absl::Status& AsStatus(const ::absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace ubep::internal

#endif  // UBEP_COMMON_STATUS_MACROS_H_
