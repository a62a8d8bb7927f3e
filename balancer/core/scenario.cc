#include "balancer/core/scenario.h"

#include <cmath>
#include <numbers>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/hash.h"
#include "common/status_macros.h"

namespace ubep::balancer {
namespace {

constexpr double kBurstWeight = 0.8;

// Seeds from (seed, stream): SplitMix64's finalizer over a mix of the two (the subtraction
// cancels SplitMix64's own increment).
uint64_t Mix(uint64_t a, uint64_t b) {
  return SplitMix64((a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e019ULL)) -
                    0x9e3779b97f4a7c15ULL);
}

}  // namespace

absl::StatusOr<Scenario> Scenario::Create(std::vector<LoadMatrix> sources,
                                          const ScenarioOptions& options) {
  if (sources.empty()) return absl::InvalidArgumentError("scenario needs at least one source");
  // Written so that NaN fails each test. A period under one step rotates the mix more than
  // once a step (a tiny one makes step / period infinite).
  if (options.pairs_per_step <= 0 || !(options.period_steps >= 1) ||
      !std::isfinite(options.period_steps) || options.burst_steps <= 0 || options.max_steps <= 0 ||
      !(options.burst_probability >= 0 && options.burst_probability <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scenario options: pairs_per_step (", options.pairs_per_step, "), burst_steps (",
        options.burst_steps, ") and max_steps (", options.max_steps,
        ") must be positive, period_steps (", options.period_steps,
        ") finite and at least 1, burst_probability (", options.burst_probability,
        ") in [0, 1]"));
  }
  for (size_t k = 0; k < sources.size(); ++k) {
    LoadMatrix& source = sources[k];
    UBEP_RETURN_IF_ERROR(ValidateLoad(source));
    if (source.num_layers() != sources[0].num_layers() ||
        source.num_experts() != sources[0].num_experts()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scenario source ", k, " is ", source.num_layers(), " layers x ",
          source.num_experts(), " experts; source 0 is ", sources[0].num_layers(), " x ",
          sources[0].num_experts()));
    }
    // Mixed row by row: each row must be the same model layer in every source.
    if (source.layer_ids() != sources[0].layer_ids()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scenario source ", k, " has model layers ", absl::StrJoin(source.layer_ids(), ", "),
          "; source 0 has ", absl::StrJoin(sources[0].layer_ids(), ", ")));
    }
    for (int l = 0; l < source.num_layers(); ++l) {
      const double sum = source.RowSum(l);
      if (sum <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("scenario source ", k, " layer ", l, " has no load"));
      }
      for (double& v : source.row(l)) v /= sum;
    }
  }
  return Scenario(std::move(sources), options);
}

Scenario::Scenario(std::vector<LoadMatrix> probabilities, const ScenarioOptions& options)
    : probabilities_(std::move(probabilities)),
      options_(options),
      burst_source_(options.max_steps, -1) {
  std::mt19937_64 rng(Mix(options.seed, 0xb0757));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(probabilities_.size()) - 1);
  for (int s = 0; s < options.max_steps; ++s) {
    if (burst_source_[s] >= 0 || uniform(rng) >= options.burst_probability) continue;
    const int source = pick(rng);
    for (int i = s; i < std::min(options.max_steps, s + options.burst_steps); ++i) {
      burst_source_[i] = source;
    }
  }
}

std::vector<double> Scenario::MixWeights(int64_t step) const {
  const int k_count = static_cast<int>(probabilities_.size());
  // One source is the whole mix at every step (its cosine alone would reach 0 at half a
  // period, and 0 / 0 would make every weight NaN).
  std::vector<double> weights(k_count, 1.0);
  if (k_count == 1) return weights;
  double sum = 0;
  for (int k = 0; k < k_count; ++k) {
    weights[k] = 1.0 + std::cos(2 * std::numbers::pi *
                                (static_cast<double>(step) / options_.period_steps -
                                 static_cast<double>(k) / k_count));
    sum += weights[k];
  }
  for (double& w : weights) w /= sum;
  const int burst = step >= 0 && step < options_.max_steps ? burst_source_[step] : -1;
  if (burst >= 0) {
    for (double& w : weights) w *= 1 - kBurstWeight;
    weights[burst] += kBurstWeight;
  }
  return weights;
}

LoadMatrix Scenario::ExpectedStep(int64_t step) const {
  const std::vector<double> weights = MixWeights(step);
  LoadMatrix load(num_layers(), num_experts());
  load.set_layer_ids(layer_ids());
  for (size_t k = 0; k < probabilities_.size(); ++k) {
    load.AddScaled(probabilities_[k], weights[k] * static_cast<double>(options_.pairs_per_step));
  }
  return load;
}

LoadMatrix Scenario::Step(int64_t step) const {
  LoadMatrix mean = ExpectedStep(step);
  LoadMatrix load(num_layers(), num_experts());
  load.set_layer_ids(layer_ids());
  std::mt19937_64 rng(Mix(options_.seed, static_cast<uint64_t>(step) + 1));
  const double n = static_cast<double>(options_.pairs_per_step);
  for (int l = 0; l < num_layers(); ++l) {
    // Multinomial by sequential conditional binomials.
    int64_t remaining = options_.pairs_per_step;
    double mass_left = 1.0;
    for (int e = 0; e < num_experts() && remaining > 0; ++e) {
      const double p = mean.at(l, e) / n;
      const double q = mass_left > 0 ? std::clamp(p / mass_left, 0.0, 1.0) : 1.0;
      std::binomial_distribution<int64_t> draw(remaining, q);
      const int64_t count = e + 1 == num_experts() ? remaining : draw(rng);
      load.at(l, e) = static_cast<double>(count);
      remaining -= count;
      mass_left -= p;
    }
  }
  return load;
}

}  // namespace ubep::balancer
