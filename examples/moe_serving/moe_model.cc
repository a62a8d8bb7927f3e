#include "examples/moe_serving/moe_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "balancer/formats/json_formats.h"
#include "common/hash.h"

namespace ubep::example {
namespace {

// Uniform in [0, 1) from a hash of the parts.
double Uniform(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e) {
  uint64_t h = SplitMix64(a);
  h = SplitMix64(h ^ b);
  h = SplitMix64(h ^ c);
  h = SplitMix64(h ^ d);
  h = SplitMix64(h ^ e);
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

enum Stream : uint64_t { kInput = 1, kRouter = 2, kWeights = 3, kShuffle = 4 };

}  // namespace

absl::StatusOr<MoeModel> MoeModel::Create(const MoeModelOptions& o) {
  if (o.num_layers <= 0 || o.num_experts <= 0 || o.hidden <= 0 || o.top_k <= 0 ||
      o.top_k > o.num_experts || o.tokens < 0) {
    return absl::InvalidArgumentError("moe model: sizes must be positive and top_k <= experts");
  }
  std::optional<balancer::Scenario> scenario;
  if (!o.traces.empty()) {
    std::vector<balancer::LoadMatrix> sources;
    for (const std::string& path : o.traces) {
      absl::StatusOr<balancer::LoadMatrix> load = balancer::ReadSglangLoadFile(path);
      if (!load.ok()) return load.status();
      if (load->num_experts() != o.num_experts || load->num_layers() < o.num_layers) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": has ", load->num_layers(), " MoE layers x ", load->num_experts(),
            " experts; the model needs at least ", o.num_layers, " x exactly ", o.num_experts));
      }
      sources.push_back(*std::move(load));
    }
    balancer::ScenarioOptions so;
    so.seed = o.seed;
    so.period_steps = o.drift_period_steps;
    so.burst_probability = 0;
    absl::StatusOr<balancer::Scenario> s = balancer::Scenario::Create(std::move(sources), so);
    if (!s.ok()) return s.status();
    scenario = *std::move(s);
  }
  return MoeModel(o, std::move(scenario));
}

MoeModel::MoeModel(const MoeModelOptions& options, std::optional<balancer::Scenario> scenario)
    : options_(options), scenario_(std::move(scenario)) {
  const int H = options_.hidden;
  const double scale = std::sqrt(3.0 / H);  // Uniform(-a, a) has variance a^2 / 3 = 1 / H.
  weights_.resize(static_cast<size_t>(options_.num_layers) * options_.num_experts);
  for (int l = 0; l < options_.num_layers; ++l) {
    for (int e = 0; e < options_.num_experts; ++e) {
      std::vector<float>& w = weights_[l * options_.num_experts + e];
      w.resize(static_cast<size_t>(H) * H);
      for (int i = 0; i < H * H; ++i) {
        w[i] = static_cast<float>((2 * Uniform(options_.seed, kWeights, l, e, i) - 1) * scale);
      }
    }
  }
}

std::vector<float> MoeModel::Input(uint64_t step, int rank) const {
  std::vector<float> x(static_cast<size_t>(options_.tokens) * options_.hidden);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(2 * Uniform(options_.seed, kInput, step, rank, i) - 1);
  }
  return x;
}

std::vector<double> MoeModel::Probabilities(uint64_t step, int layer) const {
  const int E = options_.num_experts;
  std::vector<double> p(E);
  if (scenario_.has_value()) {
    const balancer::LoadMatrix expected = scenario_->ExpectedStep(static_cast<int64_t>(step));
    for (int e = 0; e < E; ++e) p[e] = expected.at(layer, e);
  } else {
    // Zipf(1) popularity over a per-layer permutation of the experts.
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    for (int i = E - 1; i > 0; --i) {
      const int j = static_cast<int>(Uniform(options_.seed, kShuffle, layer, i, 0) * (i + 1));
      std::swap(order[i], order[j]);
    }
    for (int i = 0; i < E; ++i) p[order[i]] = 1.0 / (i + 1);
  }
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& v : p) v = std::max(v / sum, 1e-12);
  return p;
}

void MoeModel::Route(uint64_t step, int rank, int layer, std::vector<int32_t>& topk_idx,
                     std::vector<float>& topk_weights) const {
  const int E = options_.num_experts, K = options_.top_k, T = options_.tokens;
  const std::vector<double> p = Probabilities(step, layer);
  topk_idx.resize(static_cast<size_t>(T) * K);
  topk_weights.resize(static_cast<size_t>(T) * K);
  std::vector<std::pair<double, int>> keys(E);
  for (int t = 0; t < T; ++t) {
    // Weighted sampling without replacement: the K smallest Exp(1) / p_e.
    for (int e = 0; e < E; ++e) {
      const double u = Uniform(options_.seed, kRouter, SplitMix64(SplitMix64(step) ^ rank) ^ layer, t, e);
      keys[e] = {-std::log1p(-u) / p[e], e};
    }
    std::partial_sort(keys.begin(), keys.begin() + K, keys.end());
    double sum = 0;
    for (int k = 0; k < K; ++k) sum += p[keys[k].second];
    for (int k = 0; k < K; ++k) {
      topk_idx[t * K + k] = keys[k].second;
      topk_weights[t * K + k] = static_cast<float>(p[keys[k].second] / sum);
    }
  }
}

std::vector<float> MoeModel::ExpertWeights(int layer, int expert) const {
  return weights_[layer * options_.num_experts + expert];
}

void MoeModel::Apply(const float* w, const float* x, int hidden, float* y) {
  for (int i = 0; i < hidden; ++i) {
    double acc = 0;
    for (int j = 0; j < hidden; ++j) acc += static_cast<double>(w[i * hidden + j]) * x[j];
    y[i] = static_cast<float>(acc);
  }
}

std::vector<double> MoeModel::ReferenceLayer(uint64_t step, int rank, int layer,
                                             const std::vector<float>& x) const {
  const int H = options_.hidden, K = options_.top_k, T = options_.tokens;
  std::vector<int32_t> idx;
  std::vector<float> w;
  Route(step, rank, layer, idx, w);
  std::vector<double> out(static_cast<size_t>(T) * H, 0.0);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const std::vector<float>& W = weights_[layer * options_.num_experts + idx[t * K + k]];
      for (int i = 0; i < H; ++i) {
        double acc = 0;
        for (int j = 0; j < H; ++j) acc += static_cast<double>(W[i * H + j]) * x[t * H + j];
        out[t * H + i] += static_cast<double>(w[t * K + k]) * acc;
      }
    }
  }
  return out;
}

double MaxRelativeError(const std::vector<float>& got, const std::vector<double>& want, int hidden) {
  double worst = 0;
  for (size_t t = 0; t * hidden < want.size(); ++t) {
    double diff = 0, norm = 0;
    for (int h = 0; h < hidden; ++h) {
      const double d = got[t * hidden + h] - want[t * hidden + h];
      diff += d * d;
      norm += want[t * hidden + h] * want[t * hidden + h];
    }
    const double error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    worst = WorseError(worst, error);
  }
  return worst;
}

}  // namespace ubep::example
