// LoadMatrix: routed (token, top-k) pairs per MoE layer and logical expert, as counted by the
// data plane or read from SGLang's expert-distribution files. Values are non-negative and
// finite once ValidateLoad passes. `layer_ids` keeps each row's layer index in the model (dense
// layers have no row). A value type; thread-compatible.
#ifndef UBEP_BALANCER_CORE_LOAD_MATRIX_H_
#define UBEP_BALANCER_CORE_LOAD_MATRIX_H_

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ubep::balancer {

class LoadMatrix {
 public:
  LoadMatrix() = default;
  // All-zero matrix with layer ids 0..num_layers-1.
  LoadMatrix(int num_layers, int num_experts);

  int num_layers() const { return num_layers_; }
  int num_experts() const { return num_experts_; }

  double at(int layer, int expert) const { return values_[Index(layer, expert)]; }
  double& at(int layer, int expert) { return values_[Index(layer, expert)]; }
  std::span<const double> row(int layer) const {
    return {values_.data() + Index(layer, 0), static_cast<size_t>(num_experts_)};
  }
  std::span<double> row(int layer) {
    return {values_.data() + Index(layer, 0), static_cast<size_t>(num_experts_)};
  }
  double RowSum(int layer) const;

  const std::vector<int>& layer_ids() const { return layer_ids_; }
  void set_layer_ids(std::vector<int> ids) { layer_ids_ = std::move(ids); }

  // this += scale * other (same shape).
  void AddScaled(const LoadMatrix& other, double scale);

 private:
  size_t Index(int layer, int expert) const {
    return static_cast<size_t>(layer) * static_cast<size_t>(num_experts_) + static_cast<size_t>(expert);
  }

  int num_layers_ = 0;
  int num_experts_ = 0;
  std::vector<double> values_;
  std::vector<int> layer_ids_;
};

// OK when there is at least one layer and expert, one distinct layer id per layer, every
// value is finite and non-negative and every layer's sum is finite.
absl::Status ValidateLoad(const LoadMatrix& load);

// OK when no id repeats; else names the first repeat: "<what> 0 and 2 both have layer id 3".
absl::Status CheckDistinctLayerIds(std::span<const int> layer_ids, absl::string_view what);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_LOAD_MATRIX_H_
