// Scenario: a seeded, synthetic time series of per-step expert loads drawn from real expert
// distributions (e.g. the DeepSeek-V3 traces recorded by SGLang). The distributions are real;
// the time axis is synthetic, and every report built on a Scenario must say so.
//
// Each source is normalized per layer into a probability over experts. At step s the mix
// weight of source k is 1 + cos(2*pi*(s/period - k/K)), so dominance rotates smoothly through
// the sources once per period (a prefill/decode mix that shifts). Bursts are laid out up front
// from the seed: a burst makes one source 80% of the mix for burst_steps steps. A step's load
// is a multinomial draw of `pairs_per_step` routed (token, k) pairs per layer from the mix.
//
//   Scenario scenario(std::move(sources), options);   // sources share one shape
//   LoadMatrix step_load = scenario.Step(17);          // same seed, same step, same load
//
// Pure; Step is const and thread-safe.
#ifndef UBEP_BALANCER_CORE_SCENARIO_H_
#define UBEP_BALANCER_CORE_SCENARIO_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "balancer/core/load_matrix.h"

namespace ubep::balancer {

struct ScenarioOptions {
  uint64_t seed = 1;
  int64_t pairs_per_step = 4096 * 8;  // Routed (token, k) pairs per layer per step.
  double period_steps = 400;          // One full rotation of the mix.
  double burst_probability = 0.01;    // Chance that a burst starts at a given step.
  int burst_steps = 25;
  int max_steps = 100000;             // Bursts are laid out for steps [0, max_steps).
};

class Scenario {
 public:
  // Sources must be non-empty, of one shape and the same model layers, with every layer
  // summing above zero; options finite, period_steps at least 1.
  static absl::StatusOr<Scenario> Create(std::vector<LoadMatrix> sources,
                                         const ScenarioOptions& options);

  // Mix weights at `step` (sum to 1), one per source.
  std::vector<double> MixWeights(int64_t step) const;
  // Expected load at `step` (pairs_per_step * mix), no sampling noise.
  LoadMatrix ExpectedStep(int64_t step) const;
  // Sampled load at `step`.
  LoadMatrix Step(int64_t step) const;

  int num_layers() const { return probabilities_.front().num_layers(); }
  int num_experts() const { return probabilities_.front().num_experts(); }
  const std::vector<int>& layer_ids() const { return probabilities_.front().layer_ids(); }

 private:
  Scenario(std::vector<LoadMatrix> probabilities, const ScenarioOptions& options);

  std::vector<LoadMatrix> probabilities_;
  ScenarioOptions options_;
  std::vector<int> burst_source_;  // Per step: source in burst, or -1.
};

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_CORE_SCENARIO_H_
