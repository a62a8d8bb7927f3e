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
  open_added_ = true;
  for (int l = 0; l < num_layers_; ++l) {
    for (int e = 0; e < num_experts_; ++e) open_.at(l, e) += load.at(l, e);
  }
}

void LoadWindow::Close() {
  if (alpha_ > 0) {
    // An interval nothing was added to has no data (no node reported), not zero load: the
    // average stays; the first interval with data seeds it.
    for (int l = 0; l < num_layers_ && open_added_; ++l) {
      for (int e = 0; e < num_experts_; ++e) {
        ewma_.at(l, e) = !ewma_seeded_ ? open_.at(l, e)
                                       : alpha_ * open_.at(l, e) + (1 - alpha_) * ewma_.at(l, e);
      }
    }
    ewma_seeded_ |= open_added_;
  } else {
    kept_.push_back(open_);
    if (static_cast<int>(kept_.size()) > intervals_) kept_.pop_front();
  }
  open_ = LoadMatrix(num_layers_, num_experts_);
  open_added_ = false;
  ++closed_;
}

LoadMatrix LoadWindow::Current() const {
  if (alpha_ > 0) {
    // The average is one interval's load with the noise of (2 - alpha) / alpha intervals
    // (its variance is alpha / (2 - alpha) of one interval's): scaled to that many, it reads
    // as counts, as a sliding window's sum does, for the policy's noise model (the slack it
    // allows is noise_z / sqrt(count)). With alpha = 2 / (N + 1) a steady load reads as a
    // window of N intervals.
    LoadMatrix counts(num_layers_, num_experts_);
    counts.AddScaled(ewma_, (2 - alpha_) / alpha_);
    return counts;
  }
  LoadMatrix sum(num_layers_, num_experts_);
  for (const LoadMatrix& m : kept_) {
    for (int l = 0; l < num_layers_; ++l) {
      for (int e = 0; e < num_experts_; ++e) sum.at(l, e) += m.at(l, e);
    }
  }
  return sum;
}

}  // namespace ubep::balancer
