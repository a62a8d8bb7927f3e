#include "common/model_shape.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace ubep {

std::vector<ModelFieldDifference> ModelDifferences(uint32_t world, const v1::ModelShape& shape,
                                                   uint32_t other_world,
                                                   const v1::ModelShape& other_shape) {
  const v1::ModelShape& a = shape;
  const v1::ModelShape& b = other_shape;
  const std::pair<const char*, std::pair<uint64_t, uint64_t>> numbers[] = {
      {"world_size", {world, other_world}},
      {"num_layers", {a.num_layers(), b.num_layers()}},
      {"num_experts", {a.num_experts(), b.num_experts()}},
      {"hidden", {a.hidden(), b.hidden()}},
      {"top_k", {a.top_k(), b.top_k()}},
      {"max_tokens", {a.max_tokens(), b.max_tokens()}},
      {"slots_per_rank", {a.slots_per_rank(), b.slots_per_rank()}},
      {"bytes_per_expert", {a.bytes_per_expert(), b.bytes_per_expert()}},
  };
  std::vector<ModelFieldDifference> differences;
  for (const auto& [field, values] : numbers) {
    if (values.first != values.second) {
      differences.push_back({field, absl::StrCat(values.first), absl::StrCat(values.second)});
    }
  }
  if (a.dtype() != b.dtype()) {
    // A value of no enumerator (a newer or bad peer) has no name: its number stands in.
    auto name = [](v1::DType d) {
      const std::string& n = v1::DType_Name(d);
      return n.empty() ? absl::StrCat(static_cast<int>(d)) : n;
    };
    differences.push_back({"dtype", name(a.dtype()), name(b.dtype())});
  }
  return differences;
}

}  // namespace ubep
