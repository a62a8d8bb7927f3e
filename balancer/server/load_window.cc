#include "balancer/server/load_window.h"

#include <algorithm>

namespace ubep::balancer {

LoadWindow::LoadWindow(int num_layers, int num_experts, int intervals, double ewma_alpha)
    : num_layers_(num_layers),
      num_experts_(num_experts),
      intervals_(std::max(intervals, 1)),
      alpha_(ewma_alpha),
      open_(num_layers, num_experts),
      ewma_(num_layers, num_experts) {}

void LoadWindow::Add(const LoadMatrix& load) {
  for (int l = 0; l < num_layers_; ++l) {
    for (int e = 0; e < num_experts_; ++e) open_.at(l, e) += load.at(l, e);
  }
}

void LoadWindow::Close() {
  if (alpha_ > 0) {
    for (int l = 0; l < num_layers_; ++l) {
      for (int e = 0; e < num_experts_; ++e) {
        ewma_.at(l, e) = closed_ == 0 ? open_.at(l, e)
                                      : alpha_ * open_.at(l, e) + (1 - alpha_) * ewma_.at(l, e);
      }
    }
  } else {
    kept_.push_back(open_);
    if (static_cast<int>(kept_.size()) > intervals_) kept_.pop_front();
  }
  open_ = LoadMatrix(num_layers_, num_experts_);
  ++closed_;
}

LoadMatrix LoadWindow::Current() const {
  if (alpha_ > 0) return ewma_;
  LoadMatrix sum(num_layers_, num_experts_);
  for (const LoadMatrix& m : kept_) {
    for (int l = 0; l < num_layers_; ++l) {
      for (int e = 0; e < num_experts_; ++e) sum.at(l, e) += m.at(l, e);
    }
  }
  return sum;
}

}  // namespace ubep::balancer
