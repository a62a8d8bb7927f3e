// Fixtures shared by the data-plane tests (host and CUDA backends): self-checking payloads,
// inputs, plans, and a group of host ranks as threads over real memfd arenas.
#ifndef UBEP_TESTS_UNIT_DATAPLANE_FIXTURES_H_
#define UBEP_TESTS_UNIT_DATAPLANE_FIXTURES_H_

#include <algorithm>
#include <cstring>
#include <latch>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/common/bf16.h"
#include "kernels/common/plan_table.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/shared_arena.h"

namespace ubep::kernels {

// Element h of token t on rank r: every received row proves where it came from.
inline float Payload(int rank, int token, int h) {
  return static_cast<float>(rank * 4096 + token) + static_cast<float>(h % 64) / 64.0f;
}

struct RankInput {
  std::vector<float> x;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_w;
  int num_tokens = 0;
};

// Per-layer routing tables as vectors (the balancer's form).
struct TestPlan {
  std::vector<std::vector<int>> slot_expert;
  std::vector<std::vector<double>> slot_share;
  std::vector<std::byte> table;

  static TestPlan RoundRobin(int num_slots, int num_experts, int num_layers) {
    TestPlan plan;
    for (int l = 0; l < num_layers; ++l) {
      std::vector<int> experts(num_slots);
      std::vector<int> count(num_experts, 0);
      for (int p = 0; p < num_slots; ++p) ++count[experts[p] = (p + l) % num_experts];
      std::vector<double> shares(num_slots);
      for (int p = 0; p < num_slots; ++p) shares[p] = 1.0 / count[experts[p]];
      plan.slot_expert.push_back(experts);
      plan.slot_share.push_back(shares);
    }
    plan.Build(num_experts);
    return plan;
  }

  // Slot p of num_ranks x slots_per_rank holds expert p % num_experts; `excluded_rank` is out
  // of the group (its slots have share 0) and each expert's traffic is split evenly over its
  // other slots, which must exist.
  static TestPlan Excluding(int num_ranks, int slots_per_rank, int num_experts, int num_layers,
                            int excluded_rank) {
    TestPlan plan;
    const int num_slots = num_ranks * slots_per_rank;
    for (int l = 0; l < num_layers; ++l) {
      std::vector<int> experts(num_slots), in_group(num_experts, 0);
      for (int p = 0; p < num_slots; ++p) {
        experts[p] = p % num_experts;
        in_group[experts[p]] += p / slots_per_rank != excluded_rank;
      }
      std::vector<double> shares(num_slots);
      for (int p = 0; p < num_slots; ++p) {
        shares[p] = p / slots_per_rank == excluded_rank ? 0.0 : 1.0 / in_group[experts[p]];
      }
      plan.slot_expert.push_back(experts);
      plan.slot_share.push_back(shares);
    }
    const int excluded[] = {excluded_rank};
    plan.Build(num_experts, 1, num_ranks, excluded);
    return plan;
  }

  // `excluded` ranks (of `num_ranks`) are out of the group; their slots need share 0.
  void Build(int num_experts, uint64_t version = 1, int num_ranks = 0,
             std::span<const int> excluded = {}) {
    std::vector<LayerRouting> layers;
    for (size_t l = 0; l < slot_expert.size(); ++l) layers.push_back({slot_expert[l], slot_share[l]});
    absl::StatusOr<std::vector<std::byte>> built =
        BuildPlanTable(version, num_experts, layers, num_ranks, excluded);
    EXPECT_TRUE(built.ok()) << built.status();
    table = *built;
  }
  const PlanTableHeader* header() const {
    return reinterpret_cast<const PlanTableHeader*>(table.data());
  }
};

class Group {
 public:
  explicit Group(EpConfig config) : config_(config) {
    const ArenaLayout layout(config);
    for (int r = 0; r < config.num_ranks; ++r) {
      arenas_.push_back(*SharedArena::Create(absl::StrCat("ubep-test-", r), layout.total_bytes));
    }
    Restart();
  }

  // Runs fn(rank) on one thread per rank. The threads start `fn` together (a latch), so that
  // the time one thread takes to be created does not count against the others' short timeouts.
  template <typename Fn>
  void RunAll(Fn fn) {
    std::latch start(config_.num_ranks);  // Outlives the threads that wait on it.
    std::vector<std::thread> threads;
    for (int r = 0; r < config_.num_ranks; ++r) {
      threads.emplace_back([&, r] {
        start.arrive_and_wait();
        fn(r);
      });
    }
    for (auto& t : threads) t.join();
  }

  // Every rank (again), or rank `only`, on the group's arenas: a restarted rank resumes the
  // epochs its arena has seen.
  // With `config`, rank `only` gets the group's config but for what each rank may set for
  // itself (its timeout, its receive capacity).
  void Restart(int only = -1, const EpConfig* config = nullptr) {
    std::vector<std::byte*> pointers;
    for (SharedArena& arena : arenas_) pointers.push_back(arena.data());
    eps_.resize(config_.num_ranks);
    for (int r = 0; r < config_.num_ranks; ++r) {
      if (only >= 0 && r != only) continue;
      eps_[r].reset();
      absl::StatusOr<std::unique_ptr<HostEp>> ep =
          HostEp::Create(config != nullptr ? *config : config_, r, pointers);
      EXPECT_TRUE(ep.ok()) << ep.status();
      eps_[r] = std::move(*ep);
    }
  }

  HostEp& ep(int r) { return *eps_[r]; }
  std::byte* arena(int r) { return arenas_[r].data(); }
  const EpConfig& config() const { return config_; }

 private:
  EpConfig config_;
  std::vector<SharedArena> arenas_;
  std::vector<std::unique_ptr<HostEp>> eps_;
};

inline EpConfig SmallConfig(Protocol protocol) {
  return EpConfig{.num_ranks = 4,
                  .max_tokens = 48,
                  .hidden = 72,
                  .top_k = 4,
                  .num_experts = 16,
                  .slots_per_rank = 5,
                  .num_layers = 2,
                  .dtype = DType::kFloat32,
                  .protocol = protocol,
                  .timeout = absl::Seconds(20)};
}

inline RankInput MakeInput(const EpConfig& c, int rank, int num_tokens, uint64_t seed,
                    int only_expert = -1) {
  RankInput in;
  in.num_tokens = num_tokens;
  std::mt19937_64 rng(seed * 1000 + rank);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::bernoulli_distribution masked(0.1);
  for (int t = 0; t < num_tokens; ++t) {
    for (int h = 0; h < c.hidden; ++h) in.x.push_back(Payload(rank, t, h));
    std::vector<int> experts(c.num_experts);
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < c.top_k; ++k) {
      int e = only_expert >= 0 ? (k == 0 ? only_expert : -1) : experts[k];
      if (only_expert < 0 && masked(rng)) e = -1;
      in.topk_idx.push_back(e);
      in.topk_w.push_back(weight(rng));
    }
  }
  return in;
}

inline uint16_t ToBf16(float f) { return FloatToBf16(f); }
inline float FromBf16(uint16_t v) { return Bf16ToFloat(v); }

}  // namespace ubep::kernels

#endif  // UBEP_TESTS_UNIT_DATAPLANE_FIXTURES_H_
