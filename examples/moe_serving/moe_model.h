// A small MoE layer stack for the example serving program and its tests: every value is a
// pure function of a seed, so each rank can check its distributed result against a float64
// reference computed alone.
//
// Per step s, rank r: tokens x0[t] (uniform in [-1, 1), fp32). Per MoE layer l: a router picks
// top_k distinct experts per token from the scenario's expert distribution of layer l at step
// s (seeded Gumbel top-k, weights = the chosen experts' probabilities renormalized); expert e
// of layer l is a dense H x H matrix W[l][e] (entries uniform, variance 1/H); the layer output
// is out[t] = sum_k w[t,k] * W[l][e_k] x[t], and it feeds the next layer.
// Thread-compatible; the const methods are thread-safe.
#ifndef UBEP_EXAMPLES_MOE_SERVING_MOE_MODEL_H_
#define UBEP_EXAMPLES_MOE_SERVING_MOE_MODEL_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "balancer/core/scenario.h"

namespace ubep::example {

struct MoeModelOptions {
  uint64_t seed = 1;
  int num_layers = 4;
  int num_experts = 256;
  int hidden = 32;
  int top_k = 8;
  int tokens = 32;  // Per rank per step.
  // SGLang expert-distribution files the router draws from (a drifting mix, balancer/core
  // scenario.h); empty = a fixed Zipf(1) popularity, shuffled per layer.
  std::vector<std::string> traces;
  double drift_period_steps = 200;  // Steps per full rotation of the traces' mix.
};

class MoeModel {
 public:
  static absl::StatusOr<MoeModel> Create(const MoeModelOptions& options);

  const MoeModelOptions& options() const { return options_; }

  // x0: [tokens, hidden].
  std::vector<float> Input(uint64_t step, int rank) const;
  // Routing of rank `rank`'s tokens at (step, layer): topk_idx and weights, [tokens, top_k].
  void Route(uint64_t step, int rank, int layer, std::vector<int32_t>& topk_idx,
             std::vector<float>& topk_weights) const;
  // W[layer][expert], [hidden, hidden] row-major fp32.
  std::vector<float> ExpertWeights(int layer, int expert) const;
  // y = W x, accumulated in double, rounded to fp32 (what an expert computes).
  static void Apply(const float* w, const float* x, int hidden, float* y);
  // Layer `layer` of rank `rank` at `step` in float64, on input `x` ([tokens, hidden]): what
  // the distributed layer must give on that input. A step is checked layer by layer, each
  // layer on the fp32 input the rank actually had, so that the bound does not grow with the
  // depth of the stack (fp32 rounding adds up layer by layer).
  std::vector<double> ReferenceLayer(uint64_t step, int rank, int layer,
                                     const std::vector<float>& x) const;

 private:
  MoeModel(const MoeModelOptions& options, std::optional<balancer::Scenario> scenario);
  std::vector<double> Probabilities(uint64_t step, int layer) const;

  MoeModelOptions options_;
  std::optional<balancer::Scenario> scenario_;
  std::vector<std::vector<float>> weights_;  // [layer * experts + expert]
};

// Norm-wise relative error of each token row, the largest: max_t |a_t - b_t| / |b_t|.
double MaxRelativeError(const std::vector<float>& got, const std::vector<double>& want, int hidden);

// The worse of two errors: NaN where either is (a NaN output is the worst of all, and stays
// so whatever comes after it), else the larger.
inline double WorseError(double a, double b) {
  if (a != a || b != b) return std::numeric_limits<double>::quiet_NaN();
  return a > b ? a : b;
}

}  // namespace ubep::example

#endif  // UBEP_EXAMPLES_MOE_SERVING_MOE_MODEL_H_
