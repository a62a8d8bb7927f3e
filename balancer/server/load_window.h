// LoadWindow: the balancer's view of expert load per MoE layer: per-logical-expert pairs
// aggregated over all ranks, over a sliding window of the last N intervals (or an
// exponentially weighted moving average). Logical-expert loads do not depend on the plan, so
// the window survives plan changes.
// Thread-compatible.
#ifndef UBEP_BALANCER_SERVER_LOAD_WINDOW_H_
#define UBEP_BALANCER_SERVER_LOAD_WINDOW_H_

#include <deque>

#include "balancer/core/load_matrix.h"

namespace ubep::balancer {

class LoadWindow {
 public:
  // `intervals` >= 1 closed intervals are kept; with `ewma_alpha` in (0, 1] the window is an
  // EWMA instead (each closed interval weighs alpha, the past 1 - alpha).
  LoadWindow(int num_layers, int num_experts, int intervals, double ewma_alpha = 0);

  // Adds counts to the interval being collected.
  void Add(const LoadMatrix& load);
  // Closes the interval being collected.
  void Close();
  // The window's load in counts, layers x experts: the sum of the kept intervals, or the EWMA
  // scaled by (2 - alpha) / alpha, the number of intervals whose sum has its sampling noise.
  // An EWMA is left as it is by an interval nothing was added to (no data, not zero load).
  LoadMatrix Current() const;
  int closed_intervals() const { return closed_; }

 private:
  int num_layers_, num_experts_, intervals_;
  double alpha_;
  LoadMatrix open_;
  std::deque<LoadMatrix> kept_;
  LoadMatrix ewma_;
  bool ewma_seeded_ = false;  // An interval with data has been closed.
  bool open_added_ = false;   // Something was added to the interval being collected.
  int closed_ = 0;
};

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_SERVER_LOAD_WINDOW_H_
