// The errors for bad routing input, worded once for every backend: the host backend finds
// them before any byte moves, the CUDA backend on the device (and skips the pair).
#ifndef UBEP_KERNELS_COMMON_BAD_INPUT_H_
#define UBEP_KERNELS_COMMON_BAD_INPUT_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace ubep::kernels {

// topk_idx[t][k] = e is neither -1 nor an expert of the group.
inline std::string ExpertOutOfRangeMessage(int t, int k, int32_t e, int num_experts) {
  return absl::StrCat("topk_idx[", t, "][", k, "] = ", e, " is outside [-1, ", num_experts, ")");
}

// topk_weights[t][k] = w, the weight of a routed pair, is NaN or infinite.
inline std::string WeightNotFiniteMessage(int t, int k, float w) {
  return absl::StrCat("topk_weights[", t, "][", k, "] = ", w, " is not finite");
}

// topk_idx[t][k] = e repeats topk_idx[t][j] (routing.h's RepeatedEntry).
inline std::string RepeatedExpertMessage(int t, int k, int j, int32_t e) {
  return absl::StrCat("topk_idx[", t, "][", k, "] = ", e, " repeats topk_idx[", t, "][", j,
                      "]: a token lists each expert at most once");
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_BAD_INPUT_H_
