// The errors for bad routing input, worded once for every backend: the host backend finds
// them before any byte moves, the CUDA backend on the device (and skips the pair).
#ifndef UBEP_KERNELS_COMMON_BAD_INPUT_H_
#define UBEP_KERNELS_COMMON_BAD_INPUT_H_

#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/common/routing.h"

namespace ubep::kernels {

// A dispatch of tokens, or a combine of rows or tokens, without the buffers to read or write
// them: refused before any byte moves, by every backend.
inline constexpr char kNullDispatchInput[] = "x, topk_idx and topk_weights must be non-null";
inline constexpr char kNullCombineBuffers[] =
    "combine: y (with rows received) and out (with tokens sent) must be non-null";

// A dispatch before the combine of the last one: refused before any byte moves.
inline constexpr char kDispatchTwice[] =
    "dispatch called twice without a combine in between: the combine of one call frees the "
    "peers' receive buffers for the next";

// What is wrong with a dispatch call's shape, or "" if nothing: the checks every backend makes
// before any byte moves, in this order: the token count against max_tokens, the layer, the
// plan table (there, of this group's experts and slots, with the layer), its exclusion mask.
inline std::string BadCallMessage(int num_tokens, int layer, const PlanTableHeader* plan,
                                  int max_tokens, int num_layers, int num_experts,
                                  int num_ranks, int slots_per_rank) {
  if (num_tokens < 0) return absl::StrCat("token count ", num_tokens, " is negative");
  if (num_tokens > max_tokens) {
    return absl::StrCat(num_tokens, " tokens exceed max_tokens ", max_tokens,
                        " of this rank's buffers");
  }
  if (layer < 0 || layer >= num_layers) {
    return absl::StrCat("layer ", layer, " is outside [0, ", num_layers, ")");
  }
  if (plan == nullptr) return "no plan table";
  if (plan->num_experts != static_cast<uint32_t>(num_experts) ||
      plan->num_slots != static_cast<uint32_t>(num_ranks * slots_per_rank) ||
      static_cast<uint32_t>(layer) >= plan->num_layers) {
    return absl::StrCat("plan table is for ", plan->num_layers, " layers x ", plan->num_experts,
                        " experts x ", plan->num_slots, " slots; this group has ", num_experts,
                        " experts and ", num_ranks * slots_per_rank, " slots",
                        static_cast<uint32_t>(layer) >= plan->num_layers
                            ? absl::StrCat(", and this call is of layer ", layer)
                            : "");
  }
  if (plan->num_ranks != 0 && plan->num_ranks != static_cast<uint32_t>(num_ranks)) {
    return absl::StrCat("plan table's exclusion mask is for ", plan->num_ranks,
                        " ranks; this group has ", num_ranks);
  }
  return "";
}

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

// Why pair k of token t is bad input, or "" if it is not: `idx` and `w` are the token's top_k
// expert ids and weights. The checks, in the order both backends apply them to each pair in
// (t, k) order: the expert id's range, then (a routed pair) its weight, then a repeat of an
// earlier expert of the token. The host backend calls it on every pair before any byte moves;
// the CUDA backend, whose kernels flag the first bad pair, words its error with it.
inline std::string BadPairMessage(const int32_t* idx, const float* w, int t, int k,
                                  int num_experts) {
  const int32_t e = idx[k];
  if (e < -1 || e >= num_experts) return ExpertOutOfRangeMessage(t, k, e, num_experts);
  if (e >= 0 && !std::isfinite(w[k])) return WeightNotFiniteMessage(t, k, w[k]);
  if (const int j = RepeatedEntry(idx, k); j >= 0) return RepeatedExpertMessage(t, k, j, e);
  return "";
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_BAD_INPUT_H_
