#include "balancer/core/load_matrix.h"

#include <cmath>
#include <numeric>
#include <unordered_map>

#include "absl/strings/str_cat.h"

namespace ubep::balancer {

LoadMatrix::LoadMatrix(int num_layers, int num_experts)
    : num_layers_(num_layers),
      num_experts_(num_experts),
      values_(static_cast<size_t>(num_layers) * num_experts, 0.0),
      layer_ids_(num_layers) {
  std::iota(layer_ids_.begin(), layer_ids_.end(), 0);
}

double LoadMatrix::RowSum(int layer) const {
  std::span<const double> r = row(layer);
  return std::accumulate(r.begin(), r.end(), 0.0);
}

void LoadMatrix::AddScaled(const LoadMatrix& other, double scale) {
  for (size_t i = 0; i < values_.size(); ++i) values_[i] += scale * other.values_[i];
}

absl::Status ValidateLoad(const LoadMatrix& load) {
  if (load.num_layers() <= 0 || load.num_experts() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("load is empty: ", load.num_layers(),
                                                   " layers x ", load.num_experts(), " experts"));
  }
  if (static_cast<int>(load.layer_ids().size()) != load.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("load has ", load.num_layers(),
                                                   " layers but ", load.layer_ids().size(),
                                                   " layer ids"));
  }
  if (absl::Status s = CheckDistinctLayerIds(load.layer_ids(), "load rows"); !s.ok()) return s;
  for (int l = 0; l < load.num_layers(); ++l) {
    for (int e = 0; e < load.num_experts(); ++e) {
      const double v = load.at(l, e);
      if (!std::isfinite(v) || v < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("load of layer ", load.layer_ids()[l], " expert ", e, " is ", v,
                         "; loads must be finite and non-negative"));
      }
    }
    // Finite values may still sum to inf (2 x 1e308): rank loads and their mean would be inf.
    if (const double sum = load.RowSum(l); !std::isfinite(sum)) {
      return absl::InvalidArgumentError(absl::StrCat("loads of layer ", load.layer_ids()[l],
                                                     " sum to ", sum,
                                                     "; a layer's loads must have a finite sum"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDistinctLayerIds(std::span<const int> layer_ids, absl::string_view what) {
  std::unordered_map<int, int> first;  // Layer id -> its first index.
  for (int i = 0; i < static_cast<int>(layer_ids.size()); ++i) {
    const auto [it, inserted] = first.emplace(layer_ids[i], i);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", it->second, " and ", i,
                                                     " both have layer id ", layer_ids[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace ubep::balancer
