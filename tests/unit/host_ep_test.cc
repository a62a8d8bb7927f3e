// Conformance of the host data plane, ranks as threads over real shared memory (memfd).
// Payloads are self-checking: element h of token t on rank r is Payload(r, t, h), so every
// received row proves where it came from.
#include "kernels/host/host_ep.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/common/host_cpu.h"
#include "kernels/common/plan_area.h"
#include "kernels/common/routing.h"
#include "kernels/common/send_split.h"
#include "kernels/host/shared_arena.h"
#include "kernels/host/signal.h"
#include "tests/unit/dataplane_fixtures.h"
#include "tests/wait_for.h"

namespace ubep::kernels {
namespace {

struct Expected {
  // Per destination rank, per local slot: (source rank, token, weight) in contract order.
  std::vector<std::vector<std::vector<std::tuple<int, int, float>>>> rows;
};

Expected Route(const EpConfig& c, const std::vector<RankInput>& inputs, const TestPlan& plan,
               int layer) {
  Expected expected;
  expected.rows.assign(c.num_ranks, std::vector<std::vector<std::tuple<int, int, float>>>(
                                        c.slots_per_rank));
  for (int s = 0; s < c.num_ranks; ++s) {
    for (int t = 0; t < inputs[s].num_tokens; ++t) {
      for (int k = 0; k < c.top_k; ++k) {
        const int e = inputs[s].topk_idx[t * c.top_k + k];
        if (e < 0) continue;
        const uint32_t p = RouteSlot(plan.header(), layer, s, t, k, e);
        expected.rows[p / c.slots_per_rank][p % c.slots_per_rank].emplace_back(
            s, t, inputs[s].topk_w[t * c.top_k + k]);
      }
    }
  }
  return expected;
}

// Dispatches, checks every received row, then combines with y = x * (1 + expert / 64) and
// checks against a float64 reference. Returns each rank's (recv_x bytes, combined bytes).
// With `stagger`, rank r starts (R - 1 - r) x stagger late, so that sources reach each
// receiver out of rank order; `after_combine` (optional) runs on rank r's thread as soon as
// its combine returned, `before_dispatch` (optional) just before its dispatch.
std::vector<std::pair<std::vector<std::byte>, std::vector<float>>> RunStep(
    Group& group, const std::vector<RankInput>& inputs, const TestPlan& plan, int layer,
    absl::Duration stagger = absl::ZeroDuration(),
    const std::function<void(int)>& after_combine = nullptr,
    const std::function<void(int)>& before_dispatch = nullptr) {
  const EpConfig& c = group.config();
  const Expected expected = Route(c, inputs, plan, layer);
  std::vector<std::pair<std::vector<std::byte>, std::vector<float>>> results(c.num_ranks);
  group.RunAll([&](int r) {
    absl::SleepFor(stagger * (c.num_ranks - 1 - r));
    if (before_dispatch) before_dispatch(r);
    DispatchOutput out;
    const RankInput& in = inputs[r];
    absl::Status s = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(),
                                           in.num_tokens, c.hidden, layer, plan.header()},
                                          out);
    ASSERT_TRUE(s.ok()) << s;
    int row = 0;
    for (int i = 0; i < c.slots_per_rank; ++i) {
      const auto& want = expected.rows[r][i];
      ASSERT_EQ(out.slot_offsets[i + 1] - out.slot_offsets[i], static_cast<int>(want.size()))
          << "rank " << r << " slot " << i;
      for (const auto& [src, token, w] : want) {
        EXPECT_EQ(out.src_rank[row], src);
        EXPECT_EQ(out.src_token[row], token);
        EXPECT_EQ(out.weight[row], w);
        const auto* x = reinterpret_cast<const float*>(out.recv_x.data()) + row * c.hidden;
        for (int h = 0; h < c.hidden; ++h) {
          ASSERT_EQ(x[h], Payload(src, token, h)) << "rank " << r << " row " << row;
        }
        ++row;
      }
    }
    // Expert outputs: y = x * (1 + e / 64), e the slot's expert.
    std::vector<float> y(out.recv_x.size() / sizeof(float));
    const auto* x = reinterpret_cast<const float*>(out.recv_x.data());
    for (int i = 0; i < c.slots_per_rank; ++i) {
      const int e = plan.slot_expert[layer][r * c.slots_per_rank + i];
      for (int q = out.slot_offsets[i] * c.hidden; q < out.slot_offsets[i + 1] * c.hidden; ++q) {
        y[q] = x[q] * (1.0f + e / 64.0f);
      }
    }
    std::vector<float> combined(static_cast<size_t>(in.num_tokens) * c.hidden, -1.0f);
    s = group.ep(r).Combine(out, y.data(), combined.data());
    if (after_combine) after_combine(r);
    ASSERT_TRUE(s.ok()) << s;
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int h = 0; h < c.hidden; ++h) {
        double ref = 0;
        for (int k = 0; k < c.top_k; ++k) {
          const int e = in.topk_idx[t * c.top_k + k];
          if (e >= 0) ref += double{in.topk_w[t * c.top_k + k]} * Payload(r, t, h) * (1 + e / 64.0);
        }
        const double got = combined[static_cast<size_t>(t) * c.hidden + h];
        ASSERT_LE(std::abs(got - ref), 1e-6 * std::max(1.0, std::abs(ref)))
            << "rank " << r << " token " << t << " h " << h;
      }
    }
    results[r] = {out.recv_x, combined};
  });
  return results;
}

// The protocols, and ubep's sender role on its own thread or split among three threads
// (send_split.h), which the core count alone would not choose on a small machine; ubep with
// every call's rows and partials as flag-in-granule rows (flagged_rows.h).
struct Variant {
  const char* name;
  Protocol protocol;
  int sender_threads;  // 0: the calling thread sends.
  bool flagged = false;
  int near_ranks = 0;  // EpConfig::near_ranks: the order of the row stores, not the bytes.
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

EpConfig VariantConfig(const Variant& v) {
  EpConfig c = SmallConfig(v.protocol);
  c.sender_thread = v.sender_threads > 0 ? EpConfig::SenderThread::kOn
                                         : EpConfig::SenderThread::kOff;
  c.sender_threads = std::max(1, v.sender_threads);
  if (v.flagged) c.flagged_tokens = c.max_tokens;
  c.near_ranks = v.near_ranks;
  return c;
}

class HostEpTest : public ::testing::TestWithParam<Variant> {};

TEST_P(HostEpTest, EveryRowArrivesOnceAndCombineMatchesTheReference) {
  Group group(VariantConfig(GetParam()));
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  for (int step = 0; step < 3; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 40 + r, step));
    RunStep(group, inputs, plan, step % 2);
  }
}

TEST_P(HostEpTest, ZeroTokensAndWorstSkew) {
  Group group(VariantConfig(GetParam()));
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) {
    // Rank 1 sends nothing; everyone else sends every token to expert 3 only.
    inputs.push_back(MakeInput(c, r, r == 1 ? 0 : c.max_tokens, 7, /*only_expert=*/3));
  }
  RunStep(group, inputs, plan, 0);
}

// Ranks 0, 1 and 3 send every token to experts 6 (k = 0) and 5 (k = 1), rank 2 to 12.
std::vector<RankInput> OverflowingInputs(const EpConfig& c) {
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) {
    inputs.push_back(MakeInput(c, r, c.max_tokens, 11, /*only_expert=*/r == 2 ? 12 : 6));
    if (r == 2) continue;
    for (int t = 0; t < c.max_tokens; ++t) inputs[r].topk_idx[t * c.top_k + 1] = 5;
  }
  return inputs;
}

// Every rank dispatches its input of layer 0 and combines whatever came back (y = x), whatever
// its Dispatch returned, as a caller whose peers wait for its partials must. `inspect`
// (optional) sees each rank's output between the two.
struct CallOutcome {
  std::vector<absl::Status> dispatched, combined;
  std::vector<std::vector<float>> sums;
};
CallOutcome DispatchAndCombine(
    Group& group, const std::vector<RankInput>& inputs, const TestPlan& plan,
    const std::function<void(int, const DispatchOutput&)>& inspect = nullptr) {
  const EpConfig& c = group.config();
  CallOutcome o{std::vector<absl::Status>(c.num_ranks), std::vector<absl::Status>(c.num_ranks),
                std::vector<std::vector<float>>(c.num_ranks)};
  group.RunAll([&](int r) {
    const RankInput& in = inputs[r];
    DispatchOutput out;
    o.dispatched[r] = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(),
                                            in.num_tokens, c.hidden, 0, plan.header()},
                                           out);
    o.sums[r].assign(static_cast<size_t>(in.num_tokens) * c.hidden, -1.0f);
    o.combined[r] = group.ep(r).Combine(out, out.recv_x.data(), o.sums[r].data());
    if (inspect) inspect(r, out);
  });
  return o;
}

// Ranks 0, 1 and 3 send every token to experts 6 (k = 0, rank 1's slot 1) and 5 (k = 1, its
// slot 0), rank 2 to expert 12 (its own): 288 rows for rank 1, whose receive capacity is 100.
// Rank 1 keeps the first 100 rows of its layout (slot 0's), exactly, counts all 288 and fails
// the call; every record's first row (slot 1) is past the capacity and its second kept or not.
// Every rank's combine fails too, naming rank 1 (rank 2's, whose sums are exact, as well), as
// a collective fails everywhere; the sums take the dropped rows as zeros. The group is still
// in step: the next call, within the capacity, is exact.
TEST_P(HostEpTest, ARankOverItsReceiveCapacityFailsTheCallOnEveryRank) {
  EpConfig config = VariantConfig(GetParam());
  config.max_recv_rows = 100;
  Group group(config);
  const EpConfig& c = group.config();
  const int K = c.top_k;
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  ASSERT_EQ(plan.slot_expert[0][5], 5);
  ASSERT_EQ(plan.slot_expert[0][6], 6);
  ASSERT_EQ(plan.slot_expert[0][12], 12);
  std::vector<RankInput> inputs = OverflowingInputs(c);
  const ReceiveNotice overflow{1, 288, 100};
  const uint64_t counted_before = group.ep(1).LoadCounter(0, 0) + group.ep(1).LoadCounter(0, 1);
  const auto [dispatched, combined, sums] =
      DispatchAndCombine(group, inputs, plan, [&](int r, const DispatchOutput& out) {
        if (r != 1) return;
        // Slot 0 holds source 0's 48 rows, then source 1's 48, then the first 4 of source 3's.
        EXPECT_EQ(out.slot_offsets[1], 144);
        EXPECT_EQ(out.slot_offsets[2], 288);
        ASSERT_EQ(out.num_rows(), 100);
        ASSERT_EQ(out.recv_x.size(), 100 * c.hidden * sizeof(float));
        for (int row = 0; row < 100; ++row) {
          const int src = row < 48 ? 0 : row < 96 ? 1 : 3, token = row < 96 ? row % 48 : row - 96;
          EXPECT_EQ(out.src_rank[row], src) << row;
          EXPECT_EQ(out.src_token[row], token) << row;
          EXPECT_EQ(out.weight[row], inputs[src].topk_w[token * K + 1]) << row;
          const auto* x = reinterpret_cast<const float*>(out.recv_x.data()) + row * c.hidden;
          for (int h = 0; h < c.hidden; ++h) EXPECT_EQ(x[h], Payload(src, token, h)) << row;
        }
      });
  EXPECT_EQ(dispatched[1], OverCapacityStatus(1, 1, overflow));
  EXPECT_EQ(dispatched[1],
            absl::ResourceExhaustedError(
                "rank 1, dispatch call 1: 288 rows routed here, more than its receive capacity "
                "of 100 (max_recv_rows); the first 100 are laid out, and this call's combine "
                "fails on every rank of the group"));
  for (int r : {0, 2, 3}) EXPECT_TRUE(dispatched[r].ok()) << r << ": " << dispatched[r];
  for (int r = 0; r < c.num_ranks; ++r) {
    EXPECT_EQ(combined[r], PeerOverCapacityStatus(r, 1, 1, overflow));
  }
  EXPECT_EQ(combined[2],
            absl::ResourceExhaustedError(
                "rank 2, combine call 1: rank 1 was routed 288 rows in this call, more than its "
                "receive capacity of 100 (max_recv_rows), so the call fails on every rank of the "
                "group: the sums of the tokens sent there are incomplete"));
  // The sums: the kept row's term (k = 1) where it was kept, else zero; rank 2's exact.
  for (int r = 0; r < c.num_ranks; ++r) {
    for (int t = 0; t < c.max_tokens; ++t) {
      const bool kept = r == 0 || r == 1 || (r == 3 && t < 4);
      const float w = inputs[r].topk_w[t * K + (r == 2 ? 0 : 1)];
      for (int h = 0; h < c.hidden; ++h) {
        const float want = r == 2 || kept ? w * Payload(r, t, h) : 0.0f;
        ASSERT_EQ(sums[r][static_cast<size_t>(t) * c.hidden + h], want)
            << "rank " << r << " token " << t << " h " << h;
      }
    }
  }
  // The pairs reached rank 1's arena: the load counters count them, for the balancer.
  EXPECT_EQ(group.ep(1).LoadCounter(0, 0) + group.ep(1).LoadCounter(0, 1) - counted_before, 288u);
  inputs.clear();
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 12, 4));
  RunStep(group, inputs, plan, 0);
}

// The same inputs (288 rows for rank 1) with a receive capacity of exactly 288: every row is
// kept, the call is exact (checked row by row and against the float64 reference); one row
// less of capacity fails it, at 287.
TEST_P(HostEpTest, ARankFilledToExactlyItsReceiveCapacityIsExactAndOneRowLessFails) {
  for (const int capacity : {288, 287}) {
    SCOPED_TRACE(capacity);
    EpConfig config = VariantConfig(GetParam());
    config.max_recv_rows = capacity;
    Group group(config);
    const EpConfig& c = group.config();
    const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
    const std::vector<RankInput> inputs = OverflowingInputs(c);
    if (capacity == 288) {
      RunStep(group, inputs, plan, 0);
      continue;
    }
    const auto [dispatched, combined, sums] = DispatchAndCombine(group, inputs, plan);
    EXPECT_EQ(dispatched[1], OverCapacityStatus(1, 1, ReceiveNotice{1, 288, 287}));
    for (int r : {0, 2, 3}) EXPECT_TRUE(dispatched[r].ok()) << r << ": " << dispatched[r];
  }
}

// Every flag and completion count of every arena at 2^32 - 1, so that the group's next call
// (after Restart) is call 0, where the counts wrap.
void PresetEveryCountToWrap(Group& group) {
  const EpConfig& c = group.config();
  const ArenaLayout layout(c);
  for (int a = 0; a < c.num_ranks; ++a) {
    std::byte* arena = group.arena(a);
    for (size_t region :
         {layout.dispatch_flag, layout.combine_flag, layout.count_flag, layout.barrier_flag}) {
      for (int s = 0; s < c.num_ranks; ++s) {
        *reinterpret_cast<uint32_t*>(arena + region + s * kFlagStride) = 0xFFFFFFFFu;
      }
    }
    *reinterpret_cast<uint32_t*>(arena + layout.dispatch_completed) = 0xFFFFFFFFu;
    *reinterpret_cast<uint32_t*>(arena + layout.combine_completed) = 0xFFFFFFFFu;
  }
}

// Epochs are 32-bit and wrap: every flag of every arena stands at 2^32 - 1, so the next call
// is call 0, and every arena holds a stale notice of call 0 saying that each rank overflowed.
// Rank 1 overflows in call 0: its dispatch says so and every combine names rank 1, not the
// stale notice of rank 0 (every dispatch posts its notice anew); call 1 is then exact.
TEST(HostEpErrorTest, AnOverflowIsToldInTheCallWhereEpochsWrapAndNoStaleNoticePasses) {
  for (Protocol protocol : {Protocol::kUbep, Protocol::kBsp}) {
    SCOPED_TRACE(protocol == Protocol::kBsp ? "bsp" : "ubep");
    EpConfig config = SmallConfig(protocol);
    config.max_recv_rows = 100;
    Group group(config);
    const EpConfig& c = group.config();
    const ArenaLayout layout(c);
    PresetEveryCountToWrap(group);
    for (int a = 0; a < c.num_ranks; ++a) {
      for (int d = 0; d < c.num_ranks; ++d) PostReceiveNotice(group.arena(a), layout, d, {0, 999, 1});
    }
    group.Restart();
    const TestPlan plan =
        TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
    const std::vector<RankInput> inputs = OverflowingInputs(c);
    const auto [dispatched, combined, sums] = DispatchAndCombine(group, inputs, plan);
    const ReceiveNotice overflow{0, 288, 100};
    EXPECT_EQ(dispatched[1], OverCapacityStatus(1, 0, overflow));
    for (int r : {0, 2, 3}) EXPECT_TRUE(dispatched[r].ok()) << r << ": " << dispatched[r];
    for (int r = 0; r < c.num_ranks; ++r) {
      EXPECT_EQ(combined[r], PeerOverCapacityStatus(r, 0, 1, overflow));
    }
    std::vector<RankInput> next;
    for (int r = 0; r < c.num_ranks; ++r) next.push_back(MakeInput(c, r, 12, 4));
    RunStep(group, next, plan, 0);
  }
}

TEST(HostEpErrorTest, AReceiveCapacityIsNeverNegativeNorMoreThanCanCome) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  EXPECT_EQ(ReceiveCapacity(config), 4 * 48 * 4);  // Ranks x max_tokens x min(top_k, slots).
  config.max_recv_rows = 100;
  EXPECT_EQ(ReceiveCapacity(config), 100);
  config.max_recv_rows = 1 << 30;
  EXPECT_EQ(ReceiveCapacity(config), 4 * 48 * 4);
  config.max_recv_rows = -1;
  EXPECT_EQ(HostEp::Create(config, 0, {}).status(),
            absl::InvalidArgumentError(
                "ep config: max_recv_rows -1 is negative (0: as many as can come)"));
}

TEST_P(HostEpTest, ManyReplicasSplitByShareAndPlansChangeBetweenCalls) {
  Group group(VariantConfig(GetParam()));
  const EpConfig& c = group.config();
  TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  // Layer 0: expert 3 gets four replicas, one on each rank, shares 0.4/0.3/0.2/0.1; expert 2
  // two replicas; every expert keeps at least one.
  plan.slot_expert[0] = {0, 1, 2, 3, 4, 5, 6, 7, 3, 9, 10, 11, 12, 3, 14, 15, 8, 13, 3, 2};
  const int replica_slots[] = {3, 8, 13, 18};
  const double shares[] = {0.4, 0.3, 0.2, 0.1};
  plan.slot_share[0].assign(20, 1.0);
  plan.slot_share[0][2] = plan.slot_share[0][19] = 0.5;
  for (int j = 0; j < 4; ++j) plan.slot_share[0][replica_slots[j]] = shares[j];
  plan.Build(c.num_experts, 2);

  auto counters = [&] {
    std::vector<uint64_t> now(4);
    for (int j = 0; j < 4; ++j) {
      now[j] = group.ep(replica_slots[j] / c.slots_per_rank)
                   .LoadCounter(0, replica_slots[j] % c.slots_per_rank);
    }
    return now;
  };
  // Four steps of other tokens: the replica of a pair is a hash of (source rank, token index,
  // k, expert), not of the step (routing.h), so each step splits alike, a draw of R x T pairs
  // (expert 3 is every token's first).
  std::vector<std::vector<uint64_t>> per_step;
  for (int step = 0; step < 4; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < c.num_ranks; ++r) {
      inputs.push_back(MakeInput(c, r, c.max_tokens, 100 + step, /*only_expert=*/3));
    }
    const std::vector<uint64_t> before = counters();
    RunStep(group, inputs, plan, 0);
    const std::vector<uint64_t> after = counters();
    per_step.emplace_back(4);
    for (int j = 0; j < 4; ++j) per_step.back()[j] = after[j] - before[j];
  }
  for (int step = 1; step < 4; ++step) EXPECT_EQ(per_step[step], per_step[0]) << "step " << step;
  // Each replica's received pairs (from the load counters) match its share within 5 standard
  // deviations of that one binomial draw.
  const int pairs = c.num_ranks * c.max_tokens;
  for (int j = 0; j < 4; ++j) {
    const double mean = pairs * shares[j];
    EXPECT_NEAR(static_cast<double>(per_step[0][j]), mean, 5 * std::sqrt(mean * (1 - shares[j])))
        << "replica " << j;
  }
  // A different plan (v2) on the next call of the same layer: expert 3 on one slot, not four.
  // RunStep checks every row's slot and every slot's count against this plan's routing, which
  // a call routed by the plan before would not match.
  TestPlan other = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  other.Build(c.num_experts, /*version=*/2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 20, 9, /*only_expert=*/3));
  RunStep(group, inputs, other, 0);
}

// Enough tokens for every batch of send_split.h (16 batches of 38 tokens at 600), ranks with
// different token counts (so their batches differ), masked pairs included: the senders store
// each batch as the caller counts the next one, and every byte still lands as routed.
// The flagged variants flag calls of up to 550 tokens: rank 0's rows and partials go plain,
// the other ranks' flagged, in the same calls.
TEST_P(HostEpTest, SendersStoreBatchesAsTheyAreCounted) {
  EpConfig config = VariantConfig(GetParam());
  config.max_tokens = 600;
  config.hidden = 8;
  if (GetParam().flagged) config.flagged_tokens = 550;
  Group group(config);
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  for (int step = 0; step < 2; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < c.num_ranks; ++r) {
      inputs.push_back(MakeInput(c, r, c.max_tokens - 37 * r, 11 + step));
    }
    RunStep(group, inputs, plan, step);
  }
}

// Rank 0's rows go out 200 ms after its counts, rank 1's 100 ms after: every receiver has the
// other ranks' rows first and places rank 0's last, yet rank 0's rows still come first in
// each slot (the layout fixes every row before any row is placed). Then the ranks start in
// reverse order (rank 3 first) without the delays.
TEST_P(HostEpTest, SourcesArrivingOutOfRankOrderLandInTheSameRows) {
  Group group(VariantConfig(GetParam()));
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 30 + r, 21));
  group.ep(0).set_row_delay_for_testing(absl::Milliseconds(200));
  group.ep(1).set_row_delay_for_testing(absl::Milliseconds(100));
  RunStep(group, inputs, plan, 0);
  group.ep(0).set_row_delay_for_testing(absl::ZeroDuration());
  group.ep(1).set_row_delay_for_testing(absl::ZeroDuration());
  RunStep(group, inputs, plan, 1, absl::Milliseconds(30));
}

// ubepd stops the group when a rank leaves, and a rank may leave as soon as its last call
// returned (the end of a job, a rolling restart). Rank 1 completes its combine and leaves
// (ubepd's code in every abort word) while rank 3 still waits for rank 0's partials, which
// rank 0 stores only once rank 1 has left: rank 1 owes that call nothing, so every rank still
// completes it exactly; the next call needs rank 1 and fails at once, naming it. (bsp ends its
// combine at a barrier, so there no rank completes it before the others' partials are in.)
TEST_P(HostEpTest, ARankThatLeftAfterItsLastCallSparesThatCallNotTheNext) {
  Group group(VariantConfig(GetParam()));
  const EpConfig& c = group.config();
  const ArenaLayout layout(c);
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 40, 31));
  std::atomic<bool> left{false};
  if (c.protocol != Protocol::kBsp) {  // (bsp's rank 1 waits at the barrier for rank 3.)
    group.ep(0).set_partial_gate_for_testing(
        [&] { ASSERT_TRUE(test::WaitFor([&] { return left.load(); }, absl::Seconds(60))); },
        /*source=*/3);
  } else {
    group.ep(0).set_partial_delay_for_testing(absl::Milliseconds(300), /*source=*/3);
  }
  RunStep(group, inputs, plan, 0, absl::ZeroDuration(), [&](int r) {
    if (r != 1) return;
    for (int d = 0; d < c.num_ranks; ++d) {
      RaiseAbort(group.arena(d), layout, kAbortRankGone | 1u);
    }
    left = true;
  });
  std::vector<absl::Status> next(c.num_ranks);
  group.RunAll([&](int r) {
    if (r == 1) return;
    const RankInput& in = inputs[r];
    DispatchOutput out;
    next[r] = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(),
                                    in.num_tokens, c.hidden, 1, plan.header()},
                                   out);
  });
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(next[r], absl::UnavailableError(absl::StrCat(
                           "rank ", r, ": rank 1 left the group (it detached, rejoined or "
                           "ended, or its ubepd exited) during ",
                           c.protocol == Protocol::kBsp ? "count exchange" : "dispatch counts",
                           " of call 2; join again once rank 1 is back")));
  }
}

INSTANTIATE_TEST_SUITE_P(Protocols, HostEpTest,
                         ::testing::Values(Variant{"bsp", Protocol::kBsp, 0},
                                           Variant{"ubep", Protocol::kUbep, 0},
                                           Variant{"ubep_sender_thread", Protocol::kUbep, 1},
                                           Variant{"ubep_3_sender_threads", Protocol::kUbep, 3},
                                           Variant{"ubep_flagged", Protocol::kUbep, 0, true},
                                           Variant{"ubep_flagged_3_sender_threads",
                                                   Protocol::kUbep, 3, true}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(HostEpTest, EveryRankUsesThePlanInForceAtItsStep) {
  Group group(VariantConfig(GetParam()));
  const EpConfig& c = group.config();
  const int slots = c.num_ranks * c.slots_per_rank;
  TestPlan first = TestPlan::RoundRobin(slots, c.num_experts, 2);
  first.Build(c.num_experts, 1);
  TestPlan second = TestPlan::RoundRobin(slots, c.num_experts, 2);
  for (int p = 0; p < slots; ++p) second.slot_expert[0][p] = (p + 5) % c.num_experts;
  std::vector<int> count(c.num_experts, 0);
  for (int e : second.slot_expert[0]) ++count[e];
  for (int p = 0; p < slots; ++p) second.slot_share[0][p] = 1.0 / count[second.slot_expert[0][p]];
  second.Build(c.num_experts, 2);
  // One plan area that every rank maps, as the daemon's arena provides it.
  SharedArena area_arena = *SharedArena::Create("plan-area", PlanAreaBytes(4096));
  void* area = area_arena.data();
  InitPlanArea(area, 4096);
  ASSERT_TRUE(PreparePlan(area, 4096, first.table, 1, 0).ok());
  ASSERT_TRUE(CommitPlan(area, 1).ok());
  ASSERT_TRUE(PreparePlan(area, 4096, second.table, 2, 3).ok());
  ASSERT_TRUE(CommitPlan(area, 2).ok());
  for (uint64_t step = 0; step < 6; ++step) {
    std::vector<RankInput> inputs;
    for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 24, step));
    const TestPlan& in_force = step < 3 ? first : second;
    const Expected expected = Route(c, inputs, in_force, 0);
    group.RunAll([&](int r) {
      DispatchInput args{inputs[r].x.data(), inputs[r].topk_idx.data(),
                         inputs[r].topk_w.data(), inputs[r].num_tokens, c.hidden, 0};
      args.plan_area = area;
      args.plan_capacity = 4096;
      args.step = step;
      DispatchOutput out;
      ASSERT_TRUE(group.ep(r).Dispatch(args, out).ok());
      EXPECT_EQ(out.plan_version, step < 3 ? 1u : 2u) << "rank " << r << " step " << step;
      for (int i = 0; i < c.slots_per_rank; ++i) {
        EXPECT_EQ(out.slot_offsets[i + 1] - out.slot_offsets[i],
                  static_cast<int>(expected.rows[r][i].size()));
      }
      std::vector<float> combined(inputs[r].x.size());
      ASSERT_TRUE(group.ep(r).Combine(out, out.recv_x.data(), combined.data()).ok());
    });
  }
}

// One step of top-k 32 over 1024 experts: `ranks` ranks of `slots` slots each, rank r
// dispatching r % `token_mod` of its `max_tokens` tokens.
void RunTopK32Step(int ranks, int slots, int max_tokens, int hidden, int token_mod,
                   absl::Duration timeout) {
  EpConfig config = VariantConfig({"ubep", Protocol::kUbep, 0});
  config.num_ranks = ranks;
  config.max_tokens = max_tokens;
  config.hidden = hidden;
  config.top_k = kMaxTopK;
  config.num_experts = 1024;
  config.slots_per_rank = slots;
  config.num_layers = 1;
  config.timeout = timeout;
  Group group(config);
  const TestPlan plan = TestPlan::RoundRobin(ranks * slots, 1024, 1);
  std::vector<RankInput> inputs;
  for (int r = 0; r < ranks; ++r) inputs.push_back(MakeInput(config, r, r % token_mod, 9));
  RunStep(group, inputs, plan, 0);
}

// No fixed list of shapes: top-k 32, 1024 experts, 128 ranks, a hidden size that is a
// multiple of 8 but not of 16.
TEST(HostEpShapeTest, TopK32With1024ExpertsOver128Ranks) {
  RunTopK32Step(128, 8, 4, 24, 5, absl::Seconds(20));
}

// The largest group the data plane takes: 1024 ranks (as threads, on however few cores),
// one slot each, every token of top-k 32. Each rank waits on 1024 sources at once, asleep on
// its arena's bell between arrivals (signal.h). The release build only: 1024 threads of a
// sanitized debug build would take minutes on two cores.
TEST(HostEpShapeTest, TopK32Over1024RanksOfOneSlot) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "1024 rank threads run in the release build";
#endif
  // One memfd per arena stays open: raise the soft limit on open files to the hard one.
  rlimit files{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  if (files.rlim_cur < 1100 && files.rlim_max >= 1100) {
    files.rlim_cur = files.rlim_max;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &files), 0);
  }
  if (files.rlim_cur < 1100) {
    GTEST_SKIP() << "1024 arenas need 1100 open files; the limit is " << files.rlim_cur;
  }
  RunTopK32Step(1024, 1, 2, 8, 3, absl::Minutes(5));
}

TEST(HostEpProtocolTest, BspAndUbepGiveIdenticalBytes) {
  Group bsp(VariantConfig({"bsp", Protocol::kBsp, 0}));
  const EpConfig& c = bsp.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 33 + 3 * r, 5));
  const auto a = RunStep(bsp, inputs, plan, 1);
  for (const Variant& v : {Variant{"ubep", Protocol::kUbep, 0},
                           Variant{"ubep_3_sender_threads", Protocol::kUbep, 3},
                           Variant{"ubep_flagged", Protocol::kUbep, 0, true},
                           Variant{"ubep_flagged_3_sender_threads", Protocol::kUbep, 3, true},
                           Variant{"ubep_nodes_of_2", Protocol::kUbep, 0, false, 2},
                           Variant{"ubep_3_sender_threads_nodes_of_3", Protocol::kUbep, 3, false, 3},
                           Variant{"bsp_nodes_of_2", Protocol::kBsp, 0, false, 2}}) {
    Group ubep(VariantConfig(v));
    const auto b = RunStep(ubep, inputs, plan, 1);
    for (int r = 0; r < c.num_ranks; ++r) {
      EXPECT_EQ(a[r].first, b[r].first) << v.name << ": recv_x of rank " << r;
      EXPECT_EQ(0, std::memcmp(a[r].second.data(), b[r].second.data(),
                               a[r].second.size() * sizeof(float)))
          << v.name << ": combined output of rank " << r;
    }
  }
}

// DeepEP's calc_diff: 1 - 2 sum(x y) / sum(x^2 + y^2), in float64.
double CalcDiff(const std::vector<double>& x, const std::vector<double>& y) {
  double xy = 0, sq = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    xy += x[i] * y[i];
    sq += x[i] * x[i] + y[i] * y[i];
  }
  return 1 - 2 * xy / sq;
}

// Every NaN rounds to the one quiet NaN (the CUDA backend's float arithmetic keeps no payload
// or sign of a NaN; x86's does); the rest rounds to nearest even.
TEST(Bf16Test, EveryNaNBecomesTheOneQuietNaN) {
  const auto from_bits = [](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  };
  for (const uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u, 0x7fffffffu}) {
    EXPECT_EQ(FloatToBf16(from_bits(nan)), 0x7fc0) << std::hex << nan;
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBf16(inf - inf), 0x7fc0);
  EXPECT_EQ(FloatToBf16(inf), 0x7f80);
  EXPECT_EQ(FloatToBf16(-inf), 0xff80);
  EXPECT_EQ(FloatToBf16(from_bits(0x3f808000u)), 0x3f80);  // A tie: to even.
  EXPECT_EQ(FloatToBf16(from_bits(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBf16(from_bits(0x7f7fffffu)), 0x7f80);  // The largest float rounds to inf.
}

TEST_P(HostEpTest, Bf16ActivationsWithFp32Accumulation) {
  EpConfig config = VariantConfig(GetParam());
  config.dtype = DType::kBFloat16;
  Group group(config);
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<double> diffs(c.num_ranks);
  group.RunAll([&](int r) {
    std::mt19937 rng(r);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    RankInput in = MakeInput(c, r, c.max_tokens, 11);
    std::vector<uint16_t> x(in.x.size());
    for (auto& v : x) v = ToBf16(normal(rng));
    DispatchOutput out;
    absl::Status s = group.ep(r).Dispatch({x.data(), in.topk_idx.data(), in.topk_w.data(),
                                           in.num_tokens, c.hidden, 0, plan.header()},
                                          out);
    ASSERT_TRUE(s.ok()) << s;
    const auto* rx = reinterpret_cast<const uint16_t*>(out.recv_x.data());
    for (int row = 0; row < out.num_rows(); ++row) {
      if (out.src_rank[row] == r) {  // Rows from this rank are bit-exact copies.
        ASSERT_EQ(0, std::memcmp(rx + row * c.hidden, x.data() + out.src_token[row] * c.hidden,
                                 c.hidden * 2));
      }
    }
    std::vector<uint16_t> y(out.recv_x.size() / 2);
    for (int i = 0; i < c.slots_per_rank; ++i) {
      const int e = plan.slot_expert[0][r * c.slots_per_rank + i];
      for (int q = out.slot_offsets[i] * c.hidden; q < out.slot_offsets[i + 1] * c.hidden; ++q) {
        y[q] = ToBf16(FromBf16(rx[q]) * (1.0f + e / 64.0f));
      }
    }
    std::vector<uint16_t> combined(x.size());
    ASSERT_TRUE(group.ep(r).Combine(out, y.data(), combined.data()).ok());
    std::vector<double> got, ref;
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int h = 0; h < c.hidden; ++h) {
        double sum = 0;
        for (int k = 0; k < c.top_k; ++k) {
          const int e = in.topk_idx[t * c.top_k + k];
          if (e >= 0) {
            sum += double{in.topk_w[t * c.top_k + k]} * FromBf16(x[t * c.hidden + h]) *
                   (1 + e / 64.0);
          }
        }
        ref.push_back(sum);
        got.push_back(FromBf16(combined[t * c.hidden + h]));
      }
    }
    diffs[r] = CalcDiff(got, ref);
  });
  for (int r = 0; r < c.num_ranks; ++r) EXPECT_LT(diffs[r], 5e-6) << "rank " << r;
}

TEST(HostEpErrorTest, ASenderThreadCountOutsideItsRangeIsRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.sender_threads = 0;
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: sender_threads 0 is outside [1, 64]"));
  config.sender_threads = 65;
  EXPECT_EQ(HostEp::Create(config, 0, {}).status(),
            absl::InvalidArgumentError("ep config: sender_threads 65 is outside [1, 64]"));
}

// An enumeration's value that is none of its members is refused by name: a protocol of 2 ran
// the dispatch as bsp and the combine as ubep, and every combine timed out.
TEST(HostEpErrorTest, AnEnumerationOutsideItsMembersIsRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.protocol = static_cast<Protocol>(2);
  EXPECT_EQ(HostEp::Create(config, 0, {}).status(),
            absl::InvalidArgumentError("ep config: protocol 2 is neither bsp (0) nor ubep (1)"));
  config.protocol = Protocol::kBsp;
  config.dtype = static_cast<DType>(7);
  EXPECT_EQ(ValidateConfig(config), absl::InvalidArgumentError(
                                        "ep config: dtype 7 is neither float32 (0) nor bfloat16 (1)"));
  config.dtype = DType::kBFloat16;
  config.sender_thread = static_cast<EpConfig::SenderThread>(3);
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError(
                "ep config: sender_thread 3 is none of auto (0), on (1), off (2)"));
  config.sender_thread = EpConfig::SenderThread::kOff;
  EXPECT_EQ(ValidateConfig(config), absl::OkStatus());
}

// A group of more slots than a plan table numbers (2^22) could take no plan: refused when
// the rank is made.
TEST(HostEpErrorTest, AGroupOfMoreSlotsThanAPlanNumbersIsRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.num_ranks = 1024;
  config.slots_per_rank = 4097;
  config.top_k = 1;
  config.max_tokens = 1;
  EXPECT_EQ(HostEp::Create(config, 0, {}).status(),
            absl::InvalidArgumentError(
                "ep config: 1024 ranks x 4097 slots = 4195328 slots, over a plan's 4194304"));
  config.slots_per_rank = 4096;
  EXPECT_EQ(ValidateConfig(config), absl::OkStatus());
}

// The rows one call may bring a rank are counted in 32 bits: a shape that could bring more is
// refused when the rank is made, not overflowed in a call.
TEST(HostEpErrorTest, AShapeWhoseRowsPerCallOverflowThirtyTwoBitsIsRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.num_ranks = 1024;
  config.slots_per_rank = 32;
  config.max_tokens = 65536;
  config.top_k = 32;
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: 1024 ranks x 65536 max_tokens x 32 pairs per "
                                       "token and rank (min of top_k and slots per rank) = "
                                       "2147483648 rows could reach one rank in one call, over "
                                       "2^31 - 1"));
  config.max_tokens = 65535;
  EXPECT_EQ(ValidateConfig(config), absl::OkStatus());
  // With one slot per rank, a token brings a rank one row at most.
  config.max_tokens = 65536;
  config.slots_per_rank = 1;
  EXPECT_EQ(ValidateConfig(config), absl::OkStatus());
  // The pairs of one call are numbered in 32 bits too.
  config.num_ranks = 1;
  config.num_experts = 1;
  config.max_tokens = 1 << 26;
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: 67108864 max_tokens x top_k 32 = 2147483648 "
                                       "pairs of one call, over 2^31 - 1"));
}

// Rows so wide that the arena's size wrapped (4 ranks of 2^29 - 1 tokens of 2^30 fp32
// elements: the layout came to 1920 bytes, and every store went past the mapping), and tokens
// so many that a dispatch's batches overflowed an int (1 rank, top-1: 2^31 - 1 tokens gave no
// batch, and an OK dispatch of zero rows), are refused by name.
TEST(HostEpErrorTest, ShapesWhoseSizesWouldWrapAreRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.dtype = DType::kFloat32;
  config.num_ranks = 4;
  config.num_experts = 4;
  config.slots_per_rank = 1;
  config.top_k = 1;
  config.max_tokens = (1 << 29) - 1;
  config.hidden = 1 << 30;
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: hidden 1073741824 exceeds 16777216"));
  config.hidden = 1 << 24;
  EXPECT_EQ(ValidateConfig(config), absl::OkStatus());
  // At the largest rows and tokens taken, the layout's regions still fit in what it adds up.
  const ArenaLayout layout(config);
  EXPECT_GE(layout.total_bytes, layout.partials + config.num_ranks * layout.row_stride);
  EXPECT_EQ(layout.row_stride, size_t{(1 << 29) - 1} << 26);
  config.num_ranks = 1;
  config.num_experts = 1;
  config.hidden = 8;
  config.max_tokens = std::numeric_limits<int32_t>::max();
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: max_tokens 2147483647 exceeds 1073741824"));
  config.max_tokens = 1 << 30;
  EXPECT_EQ(ValidateConfig(config), absl::OkStatus());
  EXPECT_EQ(NumBatches(config.max_tokens), kMaxSendBatches);
}

// `ranks` fresh zero-filled arenas of `bytes` each, not laid out by any rank yet.
class ZeroArenas {
 public:
  ZeroArenas(int ranks, size_t bytes) {
    for (int r = 0; r < ranks; ++r) {
      arenas_.push_back(*SharedArena::Create(absl::StrCat("ubep-test-", r), bytes));
    }
  }
  std::vector<std::byte*> pointers() {
    std::vector<std::byte*> out;
    for (SharedArena& a : arenas_) out.push_back(a.data());
    return out;
  }

 private:
  std::vector<SharedArena> arenas_;
};

// A uid no other process runs as, for a child to take (see CreateAtTheThreadLimit).
uid_t LoneUser() { return 60000 + getpid() % 5000; }

// Whether a child of this process can take `uid` (root, with CAP_SETUID, the uid mapped).
bool CanBecome(uid_t uid) {
  const pid_t child = fork();
  if (child == 0) _exit(setgid(uid) == 0 && setuid(uid) == 0 ? 0 : 1);
  int status = 0;
  return child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

// In a child (EXPECT_EXIT), as a user of no other process allowed one task more than the
// child runs (a sanitizer's runtime may run threads of its own): creates rank 0, whose second
// sender thread cannot start, and exits 0 where its status says so, else 1 (3: not set up).
[[noreturn]] void CreateAtTheThreadLimit(const EpConfig& config, std::vector<std::byte*> arenas) {
  const uid_t uid = LoneUser();
  if (setgid(uid) != 0 || setuid(uid) != 0) _exit(3);
  rlim_t tasks = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    ++tasks;
  }
  const rlimit one_more = {tasks + 1, tasks + 1};
  if (setrlimit(RLIMIT_NPROC, &one_more) != 0) _exit(3);
  const absl::Status status = HostEp::Create(config, 0, std::move(arenas)).status();
  fprintf(stderr, "%s\n", status.ToString().c_str());
  // (The middle is the C++ library's words for EAGAIN.)
  const std::string said = status.ToString();
  _exit(absl::StartsWith(said, "RESOURCE_EXHAUSTED: rank 0: could not start its sender threads (") &&
                absl::EndsWith(said, "): the process is at its thread limit (ulimit -u, a "
                                     "container's pids limit)")
            ? 0
            : 1);
}

// A process at its thread limit: a rank whose sender threads cannot all start (here the second
// of two) gets ResourceExhausted from Create, the one started stopped and joined (destroyed
// running, it ended the process).
TEST(HostEpErrorTest, SenderThreadsThatCannotStartAreResourceExhausted) {
  if (!CanBecome(LoneUser())) GTEST_SKIP() << "a child cannot take another user's uid here";
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.sender_thread = EpConfig::SenderThread::kOn;
  config.sender_threads = 2;
  const ArenaLayout layout(config);
  ZeroArenas arenas(config.num_ranks, layout.total_bytes);
  EXPECT_EXIT(CreateAtTheThreadLimit(config, arenas.pointers()), ::testing::ExitedWithCode(0),
              "RESOURCE_EXHAUSTED: rank 0: could not start its sender threads");
}

// A rank of another configuration than the peers whose arenas are laid out already is refused
// before it lays out its own: it would store past their regions.
TEST(HostEpErrorTest, APeersArenaOfAnotherConfigurationIsRefused) {
  const EpConfig config = SmallConfig(Protocol::kUbep);
  EpConfig other = config;
  other.max_tokens = 96;
  const ArenaLayout layout(other);
  ZeroArenas arenas(config.num_ranks, layout.total_bytes);
  std::vector<std::byte*> pointers = arenas.pointers();
  ASSERT_TRUE(HostEp::Create(config, 0, pointers).ok());
  EXPECT_EQ(HostEp::Create(other, 1, pointers).status(),
            absl::FailedPreconditionError(
                "rank 1: rank 0's arena was laid out for another configuration (ranks 4, "
                "max_tokens 48, hidden 72, top_k 4, experts 16, slots 5, layers 2, dtype float32, "
                "flagged_tokens 0, protocol ubep)"));
  // So is one of the other protocol: its waits would never meet the peers' signals.
  EpConfig bsp = config;
  bsp.protocol = Protocol::kBsp;
  EXPECT_EQ(HostEp::Create(bsp, 1, pointers).status(),
            absl::FailedPreconditionError(
                "rank 1: rank 0's arena was laid out for another configuration (ranks 4, "
                "max_tokens 48, hidden 72, top_k 4, experts 16, slots 5, layers 2, dtype float32, "
                "flagged_tokens 0, protocol ubep)"));
  // Rank 1's own arena was left as it was: a rank of the group's configuration takes it.
  EXPECT_TRUE(HostEp::Create(config, 1, pointers).ok());
}

// Arenas given in another order than their ranks' (rank 1's and 2's swapped): refused, rather
// than every store meant for rank 1 landing in rank 2's arena.
TEST(HostEpErrorTest, ArenasGivenInAnotherOrderThanTheirRanksAreRefused) {
  const EpConfig config = SmallConfig(Protocol::kUbep);
  const ArenaLayout layout(config);
  ZeroArenas arenas(config.num_ranks, layout.total_bytes);
  std::vector<std::byte*> pointers = arenas.pointers();
  for (int r = 0; r < config.num_ranks; ++r) ASSERT_TRUE(HostEp::Create(config, r, pointers).ok());
  std::swap(pointers[1], pointers[2]);
  EXPECT_EQ(HostEp::Create(config, 0, pointers).status(),
            absl::FailedPreconditionError("rank 0: the arena given as rank 1's was laid out as "
                                          "rank 2's (arenas in another order?)"));
}

// Two ranks of different configurations laying out their arenas at the same moment: each
// looks at the other's again once its own is laid out, so they do not both pass (one would
// store past the other's regions).
TEST(HostEpErrorTest, TwoRanksOfDifferentConfigurationsLayingOutAtOnceDoNotBothPass) {
  const EpConfig config = SmallConfig(Protocol::kUbep);
  EpConfig other = config;
  other.max_tokens = 96;
  const ArenaLayout layout(other);
  // Each one's refusal, if it is refused: the other's arena is of the other configuration.
  const absl::Status refused[2] = {
      absl::FailedPreconditionError(
          "rank 0: rank 1's arena was laid out for another configuration (ranks 4, max_tokens "
          "96, hidden 72, top_k 4, experts 16, slots 5, layers 2, dtype float32, flagged_tokens "
          "0, protocol ubep)"),
      absl::FailedPreconditionError(
          "rank 1: rank 0's arena was laid out for another configuration (ranks 4, max_tokens "
          "48, hidden 72, top_k 4, experts 16, slots 5, layers 2, dtype float32, flagged_tokens "
          "0, protocol ubep)")};
  for (int round = 0; round < 200; ++round) {
    ZeroArenas arenas(config.num_ranks, layout.total_bytes);
    std::vector<std::byte*> pointers = arenas.pointers();
    std::barrier start(2);
    absl::Status status[2];
    std::thread rank1([&] {
      start.arrive_and_wait();
      status[1] = HostEp::Create(other, 1, pointers).status();
    });
    start.arrive_and_wait();
    status[0] = HostEp::Create(config, 0, pointers).status();
    rank1.join();
    ASSERT_FALSE(status[0].ok() && status[1].ok()) << "round " << round;
    for (int r : {0, 1}) {
      if (!status[r].ok()) {
        ASSERT_EQ(status[r], refused[r]) << "round " << round;
      }
    }
  }
}

TEST(HostEpErrorTest, ANeighbourhoodOutsideTheGroupIsRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.near_ranks = -1;
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: near_ranks -1 is outside [0, 4] (num_ranks)"));
  config.near_ranks = 5;
  EXPECT_EQ(HostEp::Create(config, 0, {}).status(),
            absl::InvalidArgumentError("ep config: near_ranks 5 is outside [0, 4] (num_ranks)"));
}

// The bytes of every arena of `group` but rank 0's (whose refusals are recorded in its own).
std::vector<std::vector<std::byte>> PeerArenaBytes(Group& group) {
  const ArenaLayout layout(group.config());
  std::vector<std::vector<std::byte>> bytes;
  for (int r = 1; r < group.config().num_ranks; ++r) {
    bytes.emplace_back(group.arena(r), group.arena(r) + layout.total_bytes);
  }
  return bytes;
}

TEST(HostEpErrorTest, BadInputIsRejectedBeforeAnyByteMoves) {
  Group group(SmallConfig(Protocol::kUbep));
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  const std::vector<std::vector<std::byte>> before = PeerArenaBytes(group);
  RankInput in = MakeInput(c, 0, 8, 1);
  DispatchOutput out;
  in.topk_idx[2 * c.top_k + 1] = 16;
  EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                  c.hidden, 0, plan.header()},
                                 out),
            absl::InvalidArgumentError("topk_idx[2][1] = 16 is outside [-1, 16)"));
  in.topk_idx[2 * c.top_k + 1] = -1;
  // A token that lists an expert twice (masked entries may repeat).
  const std::vector<int32_t> token5(in.topk_idx.begin() + 5 * c.top_k,
                                    in.topk_idx.begin() + 6 * c.top_k);
  std::fill(in.topk_idx.begin() + 5 * c.top_k, in.topk_idx.begin() + 6 * c.top_k, -1);
  in.topk_idx[5 * c.top_k + 1] = in.topk_idx[5 * c.top_k + c.top_k - 1] = 3;
  EXPECT_EQ(
      group.ep(0).Dispatch(
          {in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, c.hidden, 0, plan.header()}, out),
      absl::InvalidArgumentError(
          absl::StrCat("topk_idx[5][", c.top_k - 1,
                       "] = 3 repeats topk_idx[5][1]: a token lists each expert at most once")));
  std::copy(token5.begin(), token5.end(), in.topk_idx.begin() + 5 * c.top_k);
  // A routed pair whose weight is not finite; a masked one's weight is not read.
  const std::vector<int32_t> token4(in.topk_idx.begin() + 4 * c.top_k,
                                    in.topk_idx.begin() + 5 * c.top_k);
  std::fill(in.topk_idx.begin() + 4 * c.top_k, in.topk_idx.begin() + 5 * c.top_k, -1);
  in.topk_w[4 * c.top_k + 0] = std::numeric_limits<float>::quiet_NaN();
  in.topk_idx[4 * c.top_k + 2] = 6;
  in.topk_w[4 * c.top_k + 2] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(
      group.ep(0).Dispatch(
          {in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, c.hidden, 0, plan.header()}, out),
      absl::InvalidArgumentError("topk_weights[4][2] = inf is not finite"));
  std::copy(token4.begin(), token4.end(), in.topk_idx.begin() + 4 * c.top_k);
  in.topk_w[4 * c.top_k + 0] = in.topk_w[4 * c.top_k + 2] = 0.5f;
  EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 49,
                                  c.hidden, 0, plan.header()},
                                 out),
            absl::InvalidArgumentError("49 tokens exceed max_tokens 48 of this rank's buffers"));
  EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), -1,
                                  c.hidden, 0, plan.header()},
                                 out),
            absl::InvalidArgumentError("token count -1 is negative"));
  EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, 64, 0,
                                  plan.header()},
                                 out),
            absl::InvalidArgumentError("hidden size 64 does not match the configured 72"));
  // A plan whose exclusion mask is of another group size (here 2 ranks x 10 slots).
  TestPlan two_ranks = plan;
  two_ranks.Build(c.num_experts, 1, 2);
  EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                  c.hidden, 0, two_ranks.header()},
                                 out),
            absl::InvalidArgumentError("plan table's exclusion mask is for 2 ranks; this group "
                                       "has 4"));
  // A plan of fewer layers than the call's (the group has 2): the message names the layer.
  const TestPlan one_layer = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 1);
  EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                  c.hidden, 1, one_layer.header()},
                                 out),
            absl::InvalidArgumentError("plan table is for 1 layers x 16 experts x 20 slots; this "
                                       "group has 16 experts and 20 slots, and this call is of "
                                       "layer 1"));
  // Nothing moved: no peer's arena changed, and the group still runs a clean step.
  EXPECT_TRUE(PeerArenaBytes(group) == before);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 8, 2));
  RunStep(group, inputs, plan, 0);
}

// Every rank that `takes_part` dispatches 8 tokens of layer 0 at once; each one's status.
// `then` (optional) gets each such rank's output after its Dispatch returned.
std::vector<absl::Status> DispatchOnce(
    Group& group, const TestPlan& plan, const std::function<bool(int)>& takes_part,
    const std::function<void(int, const DispatchOutput&)>& then = nullptr) {
  const EpConfig& c = group.config();
  std::vector<absl::Status> status(c.num_ranks);
  group.RunAll([&](int r) {
    if (!takes_part(r)) return;
    RankInput in = MakeInput(c, r, 8, 3);
    DispatchOutput out;
    status[r] = group.ep(r).Dispatch(
        {in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, c.hidden, 0, plan.header()}, out);
    if (then) then(r, out);
  });
  return status;
}

// Rank r's dispatch of `in` under `plan` and, if it went through, its combine (the rows it
// received sent back as they came): the first error, or OK.
absl::Status DispatchThenCombine(Group& group, int r, const RankInput& in, const TestPlan& plan) {
  const EpConfig& c = group.config();
  DispatchOutput out;
  const absl::Status dispatched = group.ep(r).Dispatch(
      {in.x.data(), in.topk_idx.data(), in.topk_w.data(), in.num_tokens, c.hidden, 0,
       plan.header()},
      out);
  if (!dispatched.ok()) return dispatched;
  std::vector<float> combined(static_cast<size_t>(in.num_tokens) * c.hidden);
  return group.ep(r).Combine(out, out.recv_x.data(), combined.data());
}

// What rank r reports when the group gave up on rank 2 in `phase` of the first call; with
// `refused`, rank 2's refusal of that call.
// `given`: the patience the wait was given as rank 2 was in a call, if any.
absl::Status GaveUpOnRank2(int r, const char* phase, absl::string_view refused = "",
                           absl::string_view given = "", uint32_t call = 1) {
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", r, ": timed out after 300ms waiting for rank 2 (", phase, ", call ", call,
      given.empty() ? "" : absl::StrCat("; given up to ", given, " more as rank 2 was in a call"), "); ",
      refused.empty() ? "is rank 2 alive?" : absl::StrCat("rank 2 refused this call: ", refused)));
}

// Ranks 0, 1 and 3 gave up on rank 2 while it was in the call, after the patience that
// gave them (`given`, GaveUpOnRank2): the first to give up says it, and so do the others but
// any that the first one's give-up reached before their own deadline.
void ExpectGaveUpOnRank2InACall(const std::vector<absl::Status>& status, const char* phase,
                                absl::string_view given) {
  int said_given = 0;
  for (int r : {0, 1, 3}) {
    if (status[r] == GaveUpOnRank2(r, phase, "", given)) {
      ++said_given;
    } else {
      EXPECT_EQ(status[r], GaveUpOnRank2(r, phase));
    }
  }
  EXPECT_GE(said_given, 1);
}

// ubep with the 300 ms timeout GaveUpOnRank2 names.
EpConfig ShortTimeoutConfig() {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.timeout = absl::Milliseconds(300);
  return config;
}

TestPlan RoundRobinPlan(const EpConfig& c) {
  return TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
}

TEST(HostEpErrorTest, AMissingPeerTimesOutWithItsName) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  // Rank 2 never shows up.
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int r) { return r != 2; });
  for (int r : {0, 1, 3}) EXPECT_EQ(status[r], GaveUpOnRank2(r, "dispatch counts"));
}

// Every arena of the group, byte for byte.
std::vector<std::vector<std::byte>> ArenaBytes(Group& group) {
  const ArenaLayout layout(group.config());
  std::vector<std::vector<std::byte>> bytes;
  for (int r = 0; r < group.config().num_ranks; ++r) {
    bytes.emplace_back(group.arena(r), group.arena(r) + layout.total_bytes);
  }
  return bytes;
}

// One dispatch of 8 tokens a rank; every rank but 2 then combines (rank 2 never comes): the
// dispatches' statuses, and the combines' in `combined` (OK for rank 2, which made none).
std::vector<absl::Status> DispatchOnceRank2NeverCombines(Group& group, const TestPlan& plan,
                                                         std::vector<absl::Status>* combined) {
  const EpConfig& config = group.config();
  combined->assign(config.num_ranks, absl::OkStatus());
  return DispatchOnce(
      group, plan, [](int) { return true; },
      [&](int r, const DispatchOutput& out) {
        if (r == 2) return;
        std::vector<uint16_t> y(out.recv_x.size() / 2), result(8 * config.hidden);
        (*combined)[r] = group.ep(r).Combine(out, y.data(), result.data());
      });
}

// The group gave up in call 1 (rank 2 never came to its combine): rank 0 called again stores
// nothing into any arena (a peer may still be taking call 1's rows) and says why. So with a daemon's code
// in the abort word (ubepd draining): the wording of a wait that found it.
TEST(HostEpErrorTest, ADispatchAfterTheGroupGaveUpIsRefusedBeforeAnyByteMoves) {
  const EpConfig config = ShortTimeoutConfig();
  const TestPlan plan = RoundRobinPlan(config);
  RankInput in = MakeInput(config, 0, 8, 3);
  const DispatchInput input{in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, config.hidden,
                            0, plan.header()};
  // Rank 0 called again after the group gave up on rank 2 in call 1: refused, and no byte of
  // any arena moves.
  auto expect_call_2_refused_untouched = [&](Group& group) {
    const std::vector<std::vector<std::byte>> before = ArenaBytes(group);
    DispatchOutput out;
    EXPECT_EQ(group.ep(0).Dispatch(input, out),
              absl::UnavailableError("rank 0: dispatch call 2 refused: the group gave up "
                                     "on rank 2 in this call or an earlier one; it must be "
                                     "re-formed"));
    EXPECT_TRUE(ArenaBytes(group) == before);
  };
  {
    Group group(config);
    std::vector<absl::Status> combined;
    const std::vector<absl::Status> status = DispatchOnceRank2NeverCombines(group, plan, &combined);
    ASSERT_EQ(status[0], absl::OkStatus());
    ASSERT_EQ(combined[0], GaveUpOnRank2(0, "combine partials"));
    expect_call_2_refused_untouched(group);
  }
  {
    // The group gave up in call 1's dispatch (rank 2 never came): rank 0's combine is refused
    // for want of a completed dispatch, and its next call says the group gave up, not that
    // the caller dispatched twice.
    Group group(config);
    std::vector<absl::Status> combined(config.num_ranks);
    const std::vector<absl::Status> status = DispatchOnce(
        group, plan, [](int r) { return r != 2; },
        [&](int r, const DispatchOutput& out) {
          std::vector<uint16_t> y(8 * config.hidden), result(8 * config.hidden);
          combined[r] = group.ep(r).Combine(out, y.data(), result.data());
        });
    ASSERT_EQ(status[0], GaveUpOnRank2(0, "dispatch counts"));
    ASSERT_EQ(combined[0], CombineAfterFailedDispatchStatus(0, 1));
    expect_call_2_refused_untouched(group);
  }
  Group group(config);
  const ArenaLayout layout(config);
  // Rank 0 refused call 1 first: the refusal it recorded for its peers stays, byte for byte,
  // through the call refused below (CudaEpTest asks the same of the CUDA backend).
  DispatchInput too_many = input;
  too_many.num_tokens = config.max_tokens + 1;
  DispatchOutput refused;
  EXPECT_EQ(group.ep(0).Dispatch(too_many, refused),
            absl::InvalidArgumentError(absl::StrCat(config.max_tokens + 1, " tokens exceed max_tokens ",
                                                    config.max_tokens, " of this rank's buffers")));
  for (int r = 0; r < config.num_ranks; ++r) RaiseAbort(group.arena(r), layout, kAbortDraining);
  const std::vector<std::vector<std::byte>> before = ArenaBytes(group);
  DispatchOutput out;
  EXPECT_EQ(group.ep(0).Dispatch(input, out),
            absl::UnavailableError("rank 0: ubepd is draining; dispatch counts of call 1 "
                                   "abandoned; attach again when it is back"));
  EXPECT_TRUE(ArenaBytes(group) == before);
}

// A source's count or record out of range (a corrupt or foreign peer; nothing the protocol
// writes) is refused before rank 0 sizes or stores anything from it, naming that source, and
// the group gives up on it. The test plays rank 1: it writes rank 0's arena as rank 1 would,
// with one value out of range, and raises its count flag; ranks 2 and 3 send nothing.
TEST(HostEpErrorTest, ACorruptSourceIsNamedBeforeAnythingIsSizedFromIt) {
  const EpConfig config = ShortTimeoutConfig();
  const ArenaLayout layout(config);
  const TestPlan plan = RoundRobinPlan(config);
  const int S = config.slots_per_rank;
  struct Case {
    uint32_t records;
    int32_t entries, slot;
    std::string why;
    int32_t token = 0;
  };
  const std::vector<Case> cases = {
      {static_cast<uint32_t>(config.max_tokens) + 1, 1, 0,
       absl::StrCat(config.max_tokens + 1, " records, over max_tokens ", config.max_tokens)},
      {1, 0, 0, absl::StrCat("record 0 has 0 entries, outside [1, ",
                             MaxPairsPerToken(config.top_k, S), "]")},
      {1, 1, S + 5, absl::StrCat("record 0 entry 0 names local slot ", S + 5, " of ", S)},
      {1, 1, -1, absl::StrCat("record 0 entry 0 names local slot -1 of ", S)},
      {1, 1, 0, absl::StrCat("record 0 names token -1 of max_tokens ", config.max_tokens), -1},
      {1, 1, 0,
       absl::StrCat("record 0 names token ", config.max_tokens, " of max_tokens ", config.max_tokens),
       config.max_tokens}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    Group group(config);
    std::byte* arena = group.arena(0);
    auto* counts = reinterpret_cast<uint32_t*>(arena + layout.counts);
    counts[1] = c.records;
    std::byte* records = arena + layout.records + 1 * config.max_tokens * layout.record_bytes;
    const RecordHeader header{c.token, c.entries};
    const RecordEntry entry{c.slot, 1.0f};
    std::memcpy(records, &header, sizeof(header));
    std::memcpy(records + sizeof(header), &entry, sizeof(entry));
    const Doorbell door = ArenaDoor(arena, layout);
    for (int s : {1, 2, 3}) {
      Signal(reinterpret_cast<uint32_t*>(arena + layout.count_flag + s * kFlagStride), 1, door);
    }
    RankInput in = MakeInput(config, 0, 8, 3);
    DispatchOutput out;
    EXPECT_EQ(group.ep(0).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                    config.hidden, 0, plan.header()},
                                   out),
              absl::UnavailableError(absl::StrCat("rank 0: rank 1's records of dispatch call 1 are "
                                                  "corrupt (", c.why,
                                                  "); the group gave up on rank 1")));
    for (int r = 0; r < config.num_ranks; ++r) {
      EXPECT_EQ(*reinterpret_cast<const uint32_t*>(group.arena(r) + layout.abort),
                kAbortTimedOutBase + 1)
          << "rank " << r;
    }
  }
}

// A plan area in shared memory (4096 bytes a buffer) with `plan` prepared and committed as v1.
SharedArena CommittedPlanArea(const TestPlan& plan) {
  SharedArena arena = *SharedArena::Create("plan-area", PlanAreaBytes(4096));
  InitPlanArea(arena.data(), 4096);
  EXPECT_TRUE(PreparePlan(arena.data(), 4096, plan.table, 1, 0).ok());
  EXPECT_TRUE(CommitPlan(arena.data(), 1).ok());
  return arena;
}

// The plan area is in shared memory that every rank's process maps writable: a committed
// table written over outside ubepd (an expert left with no replica, whose route would index
// replica 2^32 - 1) is refused before any byte moves, not followed.
TEST(HostEpErrorTest, ACommittedPlanWrittenOverInTheAreaIsRefusedNotFollowed) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  SharedArena area_arena = CommittedPlanArea(plan);
  void* area = area_arena.data();
  ASSERT_EQ(SelectPlan(area, 0), PlanBuffer(area, 0));
  ExpertRoute* route = const_cast<ExpertRoute*>(FindRoute(PlanBuffer(area, 0), 0, 3));
  const uint32_t replicas = route->count;
  route->count = 0;
  RankInput in = MakeInput(config, 0, 8, 3);
  DispatchInput args{in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, config.hidden, 0};
  args.plan_area = area;
  args.plan_capacity = 4096;
  DispatchOutput out;
  // An area whose header disagrees with the reader's layout is refused before its buffers are
  // placed from it.
  args.plan_capacity = 8192;
  EXPECT_EQ(group.ep(0).Dispatch(args, out),
            absl::DataLossError("rank 0: the plan area's header says its buffers hold 4096 "
                                "bytes, not 8192: something other than ubepd wrote over it"));
  args.plan_capacity = 4096;
  const std::string corrupt =
      "rank 0: plan v1 in force at step 0 is corrupt (plan table: layer 0 expert 3 has 0 "
      "replicas): something other than ubepd wrote over it";
  EXPECT_EQ(group.ep(0).Dispatch(args, out), absl::DataLossError(corrupt));
  // Refused before the rank took part: nothing was sent, and the refusal is recorded for the
  // peers (as any refused input is).
  EXPECT_EQ(out.num_rows(), 0);
  for (int r = 1; r < config.num_ranks; ++r) {
    EXPECT_EQ(reinterpret_cast<const uint32_t*>(group.arena(r) + ArenaLayout(config).counts)[0],
              0u)
        << "rank " << r;
  }
  EXPECT_EQ(ReadRefusal(group.arena(0), ArenaLayout(config), CallPhase{false, 1}), corrupt);
  // Mended, the same table is taken.
  route->count = replicas;
  group.RunAll([&](int r) {
    RankInput mine = MakeInput(config, r, 8, 3);
    DispatchInput a{mine.x.data(), mine.topk_idx.data(), mine.topk_w.data(), 8, config.hidden, 0};
    a.plan_area = area;
    a.plan_capacity = 4096;
    DispatchOutput o;
    ASSERT_EQ(group.ep(r).Dispatch(a, o), absl::OkStatus()) << "rank " << r;
    std::vector<float> sums(8 * config.hidden);
    ASSERT_EQ(group.ep(r).Combine(o, o.recv_x.data(), sums.data()), absl::OkStatus());
  });
}

// Written over after the ranks checked it (and dispatched under it): the table each rank
// follows is its checked copy, not the shared buffer, so the next call routes as before
// rather than read replica 2^32 - 1 of expert 3 (count 0) or store to a slot past the group.
TEST(HostEpErrorTest, ACommittedPlanWrittenOverAfterItsCheckIsNotFollowed) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  SharedArena area_arena = CommittedPlanArea(plan);
  void* area = area_arena.data();
  std::vector<std::vector<float>> first(config.num_ranks);
  std::vector<std::vector<std::byte>> rows(config.num_ranks);
  auto step = [&](uint64_t at, std::vector<std::vector<float>>& sums) {
    group.RunAll([&](int r) {
      RankInput mine = MakeInput(config, r, 8, 3);
      DispatchInput a{mine.x.data(), mine.topk_idx.data(), mine.topk_w.data(), 8, config.hidden,
                      0};
      a.plan_area = area;
      a.plan_capacity = 4096;
      a.step = at;
      DispatchOutput o;
      ASSERT_EQ(group.ep(r).Dispatch(a, o), absl::OkStatus()) << "rank " << r;
      rows[r].assign(o.recv_x.begin(), o.recv_x.end());
      sums[r].assign(8 * config.hidden, 0.0f);
      ASSERT_EQ(group.ep(r).Combine(o, o.recv_x.data(), sums[r].data()), absl::OkStatus());
    });
  };
  step(0, first);
  const std::vector<std::vector<std::byte>> first_rows = rows;
  auto* route = const_cast<ExpertRoute*>(FindRoute(PlanBuffer(area, 0), 0, 3));
  route->count = 0;
  const_cast<ReplicaRoute*>(Replicas(route))[0].slot = 1u << 20;
  std::vector<std::vector<float>> second(config.num_ranks);
  step(1, second);
  EXPECT_EQ(second, first);
  EXPECT_EQ(rows, first_rows);
}

// A caller that moved a vector of the dispatch output out (to its expert kernel, say) before
// Combine: refused, not read past the vector's end.
TEST(HostEpErrorTest, ACombineOfAnOutputWhoseVectorsWereMovedOutIsRefused) {
  const EpConfig config = ShortTimeoutConfig();
  const TestPlan plan = RoundRobinPlan(config);
  Group group(config);
  absl::Status combined;
  size_t rows = 0;
  DispatchOnce(
      group, plan, [](int) { return true; },
      [&](int r, const DispatchOutput& out) {
        if (r != 0) return;
        DispatchOutput changed = out;
        std::vector<float> taken = std::move(changed.weight);
        rows = taken.size();
        std::vector<uint16_t> y(out.recv_x.size() / 2), result(8 * config.hidden);
        combined = group.ep(0).Combine(changed, y.data(), result.data());
      });
  ASSERT_GT(rows, 0u);
  EXPECT_EQ(combined, absl::InvalidArgumentError(absl::StrCat(
                          "combine: the dispatch output has 0 weights and ", rows,
                          " source ranks, not the ", rows,
                          " rows its dispatch made (were they moved out or resized?)")));
}

// bsp's combine ends at a barrier; rank 2 never comes to it: the others' error names call 1,
// the call they waited in, not the barrier's count (the third barrier of the group).
TEST(HostEpErrorTest, ABspBarrierThatTimesOutNamesTheCall) {
  EpConfig config = ShortTimeoutConfig();
  config.protocol = Protocol::kBsp;
  const TestPlan plan = RoundRobinPlan(config);
  Group group(config);
  std::vector<absl::Status> combined;
  const std::vector<absl::Status> status = DispatchOnceRank2NeverCombines(group, plan, &combined);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r], absl::OkStatus()) << "rank " << r;
    EXPECT_EQ(combined[r], GaveUpOnRank2(r, "barrier")) << "rank " << r;
  }
}

// ... and so at call 0, where the call count wraps (every flag and count preset to 2^32 - 1):
// call 0, not the barriers' count.
TEST(HostEpErrorTest, ABspBarrierThatTimesOutWhereTheCallsWrapNamesCallZero) {
  EpConfig config = ShortTimeoutConfig();
  config.protocol = Protocol::kBsp;
  const TestPlan plan = RoundRobinPlan(config);
  Group group(config);
  PresetEveryCountToWrap(group);
  group.Restart();
  std::vector<absl::Status> combined;
  const std::vector<absl::Status> status = DispatchOnceRank2NeverCombines(group, plan, &combined);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r], absl::OkStatus()) << "rank " << r;
    EXPECT_EQ(combined[r], GaveUpOnRank2(r, "barrier", "", "", 0)) << "rank " << r;
  }
}

// A peer that writes its records again once they were checked (nothing following the
// protocol does) cannot steer the placement: rank 0 places from the slots and tokens it
// checked. The test plays rank 1 (one record: token 0 to local slot 0, its row and both flags
// raised), and rewrites that record's slot to 1 and its token to one far past max_tokens after
// rank 0 laid out its rows and before it places them.
TEST(HostEpErrorTest, RecordsRewrittenAfterTheirCheckDoNotSteerThePlacement) {
  for (const Protocol protocol : {Protocol::kUbep, Protocol::kBsp}) {
    SCOPED_TRACE(ProtocolName(protocol));
    EpConfig config = ShortTimeoutConfig();
    config.protocol = protocol;
    const ArenaLayout layout(config);
    const TestPlan plan = RoundRobinPlan(config);
    Group group(config);
    std::byte* arena = group.arena(0);
    reinterpret_cast<uint32_t*>(arena + layout.counts)[1] = 1;
    std::byte* records = arena + layout.records + 1 * config.max_tokens * layout.record_bytes;
    const RecordHeader header{0, 1};
    RecordEntry entry{0, 0.5f};
    std::memcpy(records, &header, sizeof(header));
    std::memcpy(records + sizeof(header), &entry, sizeof(entry));
    const Doorbell door = ArenaDoor(arena, layout);
    for (int s : {1, 2, 3}) {
      Signal(reinterpret_cast<uint32_t*>(arena + layout.count_flag + s * kFlagStride), 1, door);
      Signal(reinterpret_cast<uint32_t*>(arena + layout.dispatch_flag + s * kFlagStride), 1, door);
    }
    if (protocol == Protocol::kBsp) {  // Ranks 1-3 at both of the dispatch's barriers.
      for (int s : {1, 2, 3}) {
        Signal(reinterpret_cast<uint32_t*>(arena + layout.barrier_flag + s * kFlagStride), 2,
               door);
      }
    }
    int rewrites = 0;
    group.ep(0).set_after_layout_for_testing([&] {
      ++rewrites;
      entry.local_slot = 1;
      std::memcpy(records + sizeof(header), &entry, sizeof(entry));
      const RecordHeader rewritten{999999, 1};  // A token past max_tokens.
      std::memcpy(records, &rewritten, sizeof(rewritten));
    });
    RankInput in = MakeInput(config, 0, 8, 3);
    DispatchOutput out;
    ASSERT_TRUE(group.ep(0)
                    .Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                               config.hidden, 0, plan.header()},
                              out)
                    .ok());
    EXPECT_EQ(rewrites, 1);  // The records were rewritten between the check and the placing.
    std::vector<int32_t> from_rank1;
    for (int32_t row = 0; row < static_cast<int32_t>(out.src_rank.size()); ++row) {
      if (out.src_rank[row] == 1) from_rank1.push_back(row);
    }
    ASSERT_EQ(from_rank1.size(), 1u);
    EXPECT_GE(from_rank1[0], out.slot_offsets[0]);  // In slot 0's rows, as checked.
    EXPECT_LT(from_rank1[0], out.slot_offsets[1]);
    EXPECT_EQ(out.weight[from_rank1[0]], 0.5f);
    EXPECT_EQ(out.src_token[from_rank1[0]], 0);
  }
}

// Rank 2's calling thread is held past the call's deadline before it routes a token (the
// process stopped, or starved): its sender thread stops waiting for the batches at the
// deadline, and the rows it owed are never stored. Rank 2's call fails saying so before its
// counts go out, and its peers, which would wait longer, stop at once naming rank 2 with that
// reason. (The calling thread is held 2 s, time enough on a loaded machine for the senders to
// run at their 300 ms deadline; the peers wait up to 6 s, and stop at the refusal.)
TEST(HostEpErrorTest, SendersThatStoppedAtTheDeadlineFailTheCallAndSayWhy) {
  EpConfig config = ShortTimeoutConfig();
  config.sender_thread = EpConfig::SenderThread::kOn;
  config.sender_threads = 2;
  EpConfig patient = config;
  patient.timeout = absl::Seconds(6);
  Group group(patient);
  group.Restart(2, &config);
  group.ep(2).set_count_delay_for_testing(absl::Seconds(2));
  const TestPlan plan = RoundRobinPlan(config);
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int) { return true; });
  const std::string why =
      "its senders stopped at the call's deadline (300ms) before its calling thread had routed "
      "every token (was the process stopped or starved?); rows to its peers were not all stored";
  EXPECT_EQ(status[2], absl::DeadlineExceededError(absl::StrCat("rank 2: dispatch call 1: ", why)));
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r], absl::DeadlineExceededError(absl::StrCat(
                             "rank ", r, ": timed out after 6s waiting for rank 2 (dispatch "
                             "counts, call 1); rank 2 refused this call: ", why)));
  }
}

// Rank 2 refuses its input (an expert id out of range) and its caller does not call again:
// the others time out waiting for it and say why it did not come, in place of asking whether
// it is alive.
TEST(HostEpErrorTest, PeersOfARankThatRefusedItsInputSayWhy) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  std::vector<absl::Status> status(config.num_ranks);
  absl::Status combined;
  group.RunAll([&](int r) {
    RankInput in = MakeInput(config, r, 8, 3);
    if (r == 2) in.topk_idx[3 * config.top_k + 1] = 99;
    DispatchOutput out;
    status[r] = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                      config.hidden, 0, plan.header()},
                                     out);
    // Rank 2's caller goes on to Combine regardless, which is refused too; the peers still
    // hear of the first refusal, the one that matters.
    if (r != 2) return;
    std::vector<float> sums(8 * config.hidden);
    combined = group.ep(r).Combine(out, out.recv_x.data(), sums.data());
  });
  EXPECT_EQ(status[2], absl::InvalidArgumentError("topk_idx[3][1] = 99 is outside [-1, 16)"));
  EXPECT_EQ(combined, absl::FailedPreconditionError("combine without a dispatch before it"));
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r],
              GaveUpOnRank2(r, "dispatch counts", "topk_idx[3][1] = 99 is outside [-1, 16)"));
  }
}

// Every rank dispatches 8 tokens of layer 0; then rank 2 does what `rank2` does with its
// input and output (where a Combine belongs), and the others combine. Each rank's status:
// its dispatch's if that failed, else rank 2's `rank2`'s and the others' combine's.
std::vector<absl::Status> DispatchThenRank2Instead(
    Group& group, const TestPlan& plan,
    const std::function<absl::Status(const DispatchInput&, DispatchOutput&)>& rank2) {
  const EpConfig& config = group.config();
  std::vector<absl::Status> status(config.num_ranks);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(config, r, 8, 3);
    DispatchOutput out;
    const DispatchInput input{in.x.data(),   in.topk_idx.data(), in.topk_w.data(), 8,
                              config.hidden, 0,                  plan.header()};
    status[r] = group.ep(r).Dispatch(input, out);
    if (!status[r].ok()) return;
    if (r == 2) {
      status[r] = rank2(input, out);
      return;
    }
    std::vector<float> combined(8 * config.hidden);
    status[r] = group.ep(r).Combine(out, out.recv_x.data(), combined.data());
  });
  return status;
}

constexpr char kDispatchedTwice[] =
    "dispatch called twice without a combine in between: the combine of one call frees the "
    "peers' receive buffers for the next";

// Rank 2 dispatches, then calls Dispatch again where a Combine belongs: the others, waiting
// for its partials, say so.
TEST(HostEpErrorTest, PeersWaitingForPartialsSayTheRankDispatchedTwice) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const std::vector<absl::Status> status = DispatchThenRank2Instead(
      group, plan,
      [&](const DispatchInput& input, DispatchOutput& out) { return group.ep(2).Dispatch(input, out); });
  EXPECT_EQ(status[2], absl::FailedPreconditionError(kDispatchedTwice));
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r], GaveUpOnRank2(r, "combine partials", kDispatchedTwice));
  }
}

constexpr char kCombineOutOfMemory[] =
    "it ran out of memory in its combine; its partials were not all stored";

// Rank r's call stopped on the group's give-up naming rank 2, while it waited `waiting` (the
// phase, and the call where it has one), with rank 2's reason `why`; one still waiting on
// another survivor when the give-up reached it says so too (", waiting on rank 1 which gave
// up").
void ExpectGaveUpOnRank2Saying(const absl::Status& status, int r, absl::string_view timeout,
                               absl::string_view waiting, absl::string_view why) {
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_TRUE(absl::StartsWith(status.message(),
                               absl::StrCat("rank ", r, ": timed out after ", timeout,
                                            " waiting for rank 2 (", waiting)))
      << status;
  EXPECT_TRUE(absl::EndsWith(status.message(), absl::StrCat("); rank 2 refused this call: ", why)))
      << status;
}

// Rank 2 runs out of memory where its Combine belongs (libubep's sink for an overflowed
// call, say) and gives up: the others, waiting for its partials, stop at once and say why,
// though its combine never began (the reason is recorded for the phase they wait in). (Rank
// 2 gives up once the others' dispatches are complete; one still in its dispatch is the next
// test's case.)
TEST(HostEpErrorTest, PeersWaitingForPartialsHearARankGaveUpOnItsCombine) {
  // Also at call 0, where the calls wrap (every flag and count preset to 2^32 - 1): the give-up
  // took 0 for "no call given up yet", and did nothing there.
  for (const bool wrapped : {false, true}) {
    SCOPED_TRACE(wrapped ? "call 0" : "call 1");
    const EpConfig config = ShortTimeoutConfig();
    Group group(config);
    if (wrapped) {
      PresetEveryCountToWrap(group);
      group.Restart();
    }
    const uint32_t call = wrapped ? 0 : 1;
    const TestPlan plan = RoundRobinPlan(config);
    const ArenaLayout layout(config);
    auto dispatched = [&](int r) {
      return std::atomic_ref<uint32_t>(
                 *reinterpret_cast<uint32_t*>(group.arena(r) + layout.dispatch_completed))
                 .load() == call;
    };
    const std::vector<absl::Status> status = DispatchThenRank2Instead(
        group, plan, [&](const DispatchInput&, DispatchOutput&) {
          const absl::Time until = absl::Now() + absl::Seconds(10);
          while (!(dispatched(0) && dispatched(1) && dispatched(3)) && absl::Now() < until) {
            absl::SleepFor(absl::Microseconds(100));
          }
          group.ep(2).GiveUpOnCombine();
          group.ep(2).GiveUpOnCombine();  // Its caller's guard too: once is what counts.
          return absl::OkStatus();
        });
    for (int r : {0, 1, 3}) {
      ExpectGaveUpOnRank2Saying(status[r], r, "300ms", absl::StrCat("combine partials, call ", call),
                                kCombineOutOfMemory);
    }
  }
}

// Rank 2 runs out of memory late in its dispatch (as it lays out its receive rows, its own rows
// all stored): the others, through their dispatch and waiting in the combine for its
// partials, stop at once and say why (the record was of the dispatch, which a rank in the
// combine did not read: they asked whether rank 2 was alive).
TEST(HostEpErrorTest, PeersHearARankRanOutOfMemoryInItsDispatch) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.timeout = absl::Seconds(5);  // Rank 2's give-up ends the waits, not their deadline.
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const ArenaLayout layout(config);
  group.ep(2).set_after_layout_for_testing([&] {
    auto dispatched = [&](int r) {
      return std::atomic_ref<uint32_t>(
                 *reinterpret_cast<uint32_t*>(group.arena(r) + layout.dispatch_completed))
                 .load() >= 1;
    };
    const absl::Time until = absl::Now() + absl::Seconds(4);
    while (!(dispatched(0) && dispatched(1) && dispatched(3)) && absl::Now() < until) {
      absl::SleepFor(absl::Microseconds(100));
    }
    throw std::bad_alloc();
  });
  std::vector<absl::Status> status(config.num_ranks);
  bool threw = false;
  group.RunAll([&](int r) {
    RankInput in = MakeInput(config, r, 8, 3);
    DispatchOutput out;
    const DispatchInput input{in.x.data(),   in.topk_idx.data(), in.topk_w.data(), 8,
                              config.hidden, 0,                  plan.header()};
    if (r == 2) {
      try {
        status[r] = group.ep(r).Dispatch(input, out);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      return;
    }
    status[r] = group.ep(r).Dispatch(input, out);
    if (!status[r].ok()) return;
    std::vector<float> combined(8 * config.hidden);
    status[r] = group.ep(r).Combine(out, out.recv_x.data(), combined.data());
  });
  EXPECT_TRUE(threw);
  for (int r : {0, 1, 3}) {
    ExpectGaveUpOnRank2Saying(status[r], r, "5s", "combine partials, call 1",
                              "it ran out of memory in its dispatch; its rows were not all stored");
  }
}

// A rank still in its dispatch, waiting for another's rows, when the group gives up on a rank
// that went on to the call's combine and failed there, hears that reason too (it read only
// its own phase's record, and asked whether the rank was alive). Ranks 0 and 1 dispatch; rank
// 3 never comes; rank 2, once they wait, does what GiveUpOnCombine does after a dispatch of
// its own: its refusal of call 1's combine recorded, the group's abort word raised naming it.
TEST(HostEpErrorTest, ARankStillInItsDispatchHearsWhyAPeerGaveUpInTheCombine) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.timeout = absl::Seconds(5);  // Rank 2's give-up ends the waits, not their deadline.
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const ArenaLayout layout(config);
  std::vector<absl::Status> status(config.num_ranks);
  group.RunAll([&](int r) {
    if (r == 3) return;
    if (r == 2) {
      const absl::Time until = absl::Now() + absl::Seconds(4);
      while (!(ReadInCall(group.arena(0), layout).has_value() &&
               ReadInCall(group.arena(1), layout).has_value()) &&
             absl::Now() < until) {
        absl::SleepFor(absl::Microseconds(100));
      }
      RecordRefusal(group.arena(2), layout, CallPhase{true, 1}, kCombineOutOfMemory);
      for (int a = 0; a < config.num_ranks; ++a) {
        RaiseAbort(group.arena(a), layout, kAbortTimedOutBase + 2);
      }
      return;
    }
    RankInput in = MakeInput(config, r, 8, 3);
    DispatchOutput out;
    status[r] = group.ep(r).Dispatch(
        {in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, config.hidden, 0, plan.header()},
        out);
  });
  for (int r : {0, 1}) {
    ExpectGaveUpOnRank2Saying(status[r], r, "5s", "dispatch ", kCombineOutOfMemory);
  }
}

// Rank 2's Combine is refused (its output's weights were moved out), and its caller, dropping
// the step, dispatches again, which is refused too: the others, waiting for its partials, say
// why its combine was refused, not that it dispatched twice.
TEST(HostEpErrorTest, PeersWaitingForPartialsHearTheCombinesRefusalNotTheDispatchAfterIt) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  absl::Status combined;
  size_t rows = 0;
  const std::vector<absl::Status> status = DispatchThenRank2Instead(
      group, plan, [&](const DispatchInput& input, DispatchOutput& out) {
        std::vector<float> taken = std::move(out.weight);
        rows = taken.size();
        std::vector<float> sums(8 * config.hidden);
        combined = group.ep(2).Combine(out, out.recv_x.data(), sums.data());
        return group.ep(2).Dispatch(input, out);
      });
  ASSERT_GT(rows, 0u);
  const std::string refused = absl::StrCat(
      "combine: the dispatch output has 0 weights and ", rows, " source ranks, not the ", rows,
      " rows its dispatch made (were they moved out or resized?)");
  EXPECT_EQ(combined, absl::InvalidArgumentError(refused));
  EXPECT_EQ(status[2], absl::FailedPreconditionError(kDispatchedTwice));
  for (int r : {0, 1, 3}) EXPECT_EQ(status[r], GaveUpOnRank2(r, "combine partials", refused));
}

// A refusal loses nothing: rank 2's caller calls again with good input while the others wait,
// and the step completes exactly. A later call that rank 2 misses is then reported as before:
// the refusal was of another call.
TEST(HostEpErrorTest, ARankThatRefusedAndCalledAgainServesTheStep) {
  // Long enough for the whole step on a busy machine: nobody is meant to time out in it.
  EpConfig config = ShortTimeoutConfig();
  config.timeout = absl::Seconds(2);
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  std::vector<RankInput> inputs;
  for (int r = 0; r < config.num_ranks; ++r) inputs.push_back(MakeInput(config, r, 8, 3));
  absl::Status refused;
  RunStep(group, inputs, plan, 0, absl::ZeroDuration(), nullptr, [&](int r) {
    if (r != 2) return;
    absl::SleepFor(absl::Milliseconds(50));  // The others are waiting for rank 2 by now.
    const RankInput& in = inputs[r];
    DispatchOutput out;
    refused = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                    config.hidden + 8, 0, plan.header()},
                                   out);
  });
  EXPECT_EQ(refused, absl::InvalidArgumentError("hidden size 80 does not match the configured 72"));
  const std::vector<absl::Status> later = DispatchOnce(group, plan, [](int r) { return r != 2; });
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(later[r], absl::DeadlineExceededError(absl::StrCat(
                            "rank ", r,
                            ": timed out after 2s waiting for rank 2 (dispatch counts, call 2); "
                            "is rank 2 alive?")));
  }
}

// Rank 2 refuses its dispatch of layer 0, and its caller goes on to layer 1 rather than
// calling layer 0 again. That dispatch is rank 2's call 1, which its peers are in for layer 0:
// paired, rank 2's tokens would be routed by layer 1's plan into the peers' layer-0 experts,
// the load counted under the wrong layer, and every call return OK. Instead the call fails on
// every rank, each naming the lowest rank whose call differs, its dispatch complete (the
// rows placed) and its combine failing too; nothing is counted, and the next step runs exact.
TEST(HostEpErrorTest, ARankThatWentOnToAnotherLayerAfterARefusalFailsTheCallOnEveryRank) {
  for (const Protocol protocol : {Protocol::kUbep, Protocol::kBsp}) {
    SCOPED_TRACE(protocol == Protocol::kUbep ? "ubep" : "bsp");
    EpConfig config = SmallConfig(protocol);
    config.timeout = absl::Seconds(5);
    Group group(config);
    const TestPlan plan = RoundRobinPlan(config);
    std::vector<absl::Status> dispatched(config.num_ranks), combined(config.num_ranks);
    group.RunAll([&](int r) {
      const RankInput in = MakeInput(config, r, 8, 3);
      if (r == 2) {
        DispatchOutput refused;
        EXPECT_EQ(group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                        config.hidden + 8, 0, plan.header()},
                                       refused),
                  absl::InvalidArgumentError("hidden size 80 does not match the configured 72"));
      }
      DispatchOutput out;
      dispatched[r] = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                            config.hidden, r == 2 ? 1 : 0, plan.header()},
                                           out);
      std::vector<float> sums(static_cast<size_t>(8) * config.hidden);
      combined[r] = group.ep(r).Combine(out, out.recv_x.data(), sums.data());
    });
    auto out_of_step = [](int r, const char* phase, int layer, int peer, int peer_layer) {
      return absl::AbortedError(absl::StrCat(
          "rank ", r, ", ", phase, " call 1: ",
          std::string(phase) == "combine" ? "its dispatch paired" : "pairs", " layer ", layer,
          " of step 0 here with layer ", peer_layer, " of step 0 on rank ", peer,
          ": the ranks' calls are out of step (a rank's caller went on to another call after "
          "one that failed, rather than calling it again); the call fails on every rank of the "
          "group, its dispatch complete but for the combine, which every rank still calls"));
    };
    for (int r : {0, 1, 3}) {
      EXPECT_EQ(dispatched[r], out_of_step(r, "dispatch", 0, 2, 1));
      EXPECT_EQ(combined[r], out_of_step(r, "combine", 0, 2, 1));
    }
    EXPECT_EQ(dispatched[2], out_of_step(2, "dispatch", 1, 0, 0));
    EXPECT_EQ(combined[2], out_of_step(2, "combine", 1, 0, 0));
    for (int r = 0; r < config.num_ranks; ++r) {
      for (int l = 0; l < config.num_layers; ++l) {
        for (int i = 0; i < config.slots_per_rank; ++i) {
          EXPECT_EQ(group.ep(r).LoadCounter(l, i), 0u) << r << " " << l << " " << i;
        }
      }
    }
    // Every rank failed the call alike: the group is in step, and the next call is exact.
    std::vector<RankInput> inputs;
    for (int r = 0; r < config.num_ranks; ++r) inputs.push_back(MakeInput(config, r, 8, 4));
    RunStep(group, inputs, plan, 1);
  }
}

// Rank 2 refuses call 1 twice, for different reasons, and stops: the others give the later
// reason.
TEST(HostEpErrorTest, ALaterRefusalOfACallReplacesTheEarlierOne) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [&](int r) {
    if (r != 2) return true;
    RankInput in = MakeInput(config, r, 8, 3);
    DispatchOutput out;
    EXPECT_EQ(group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                    config.hidden + 8, 0, plan.header()},
                                   out),
              absl::InvalidArgumentError("hidden size 80 does not match the configured 72"));
    in.topk_idx[3 * config.top_k + 1] = 99;
    EXPECT_EQ(group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                    config.hidden, 0, plan.header()},
                                   out),
              absl::InvalidArgumentError("topk_idx[3][1] = 99 is outside [-1, 16)"));
    return false;
  });
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r],
              GaveUpOnRank2(r, "dispatch counts", "topk_idx[3][1] = 99 is outside [-1, 16)"));
  }
}

// Rank 2 refuses call 1, is called again with good input and takes part, but its rows come
// late: the refusal no longer explains the wait, and the others ask whether it is alive.
TEST(HostEpErrorTest, ARankThatTookPartAfterRefusingIsNotSaidToHaveRefused) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  group.ep(2).set_row_delay_for_testing(absl::Seconds(2));
  std::vector<absl::Status> status(config.num_ranks);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(config, r, 8, 3);
    DispatchOutput out;
    if (r == 2) {
      EXPECT_EQ(group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                      config.hidden + 8, 0, plan.header()},
                                     out),
                absl::InvalidArgumentError("hidden size 80 does not match the configured 72"));
    }
    status[r] = group.ep(r).Dispatch(
        {in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, config.hidden, 0, plan.header()},
        out);
  });
  ExpectGaveUpOnRank2InACall(status, "dispatch data", "300ms");
}

// Rank 2's counts arrive and its rows do not (they go out 2 s after them, past the
// timeout): the others name rank 2 in the phase where they gave up, the rows.
TEST(HostEpErrorTest, RowsThatNeverArriveAreNamedAfterTheCounts) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  group.ep(2).set_row_delay_for_testing(absl::Seconds(2));
  // A Combine after the failed call is refused before it reads the output (which the call may
  // have laid out in part, over a serving loop's output of the call before) or stores a byte.
  std::vector<absl::Status> combined(config.num_ranks);
  const std::vector<absl::Status> status = DispatchOnce(
      group, plan, [](int) { return true; },
      [&](int r, const DispatchOutput& out) {
        std::vector<uint16_t> y(out.recv_x.size() / 2), result(8 * config.hidden);
        combined[r] = group.ep(r).Combine(out, y.data(), result.data());
      });
  ExpectGaveUpOnRank2InACall(status, "dispatch data", "300ms");
  // Rank 2 itself, whose rows came late: its combine waits for the peers' partials, which
  // never come, and it is told that the group gave up on it (not asked whether rank 2 is
  // alive, naming a peer as the one that gave up).
  EXPECT_EQ(combined[2], absl::DeadlineExceededError(
                             "rank 2: the group gave up on this rank while it was in combine "
                             "partials of call 1 (its peers' errors say why: a wait for it that "
                             "timed out, say); the group must be re-formed"));
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(combined[r],
              absl::FailedPreconditionError(absl::StrCat(
                  "rank ", r, ": combine after dispatch call 1 failed; the group must be re-formed")));
    // A call that failed adds nothing to the load counters the balancer reads.
    for (int i = 0; i < config.slots_per_rank; ++i) {
      EXPECT_EQ(group.ep(r).LoadCounter(0, i), 0u) << "rank " << r << " slot " << i;
    }
  }
}

// Rank 2 comes to call 1 after its peers gave up on it there: its Dispatch is refused as any
// after a give-up, and says that the group gave up on it, in this call or an earlier one (the
// abort word does not say which).
TEST(HostEpErrorTest, ARankThatComesAfterThePeersGaveUpOnItIsToldSo) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int r) { return r != 2; });
  for (int r : {0, 1, 3}) EXPECT_EQ(status[r], GaveUpOnRank2(r, "dispatch counts"));
  RankInput in = MakeInput(config, 2, 8, 3);
  DispatchOutput out;
  EXPECT_EQ(group.ep(2).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8,
                                  config.hidden, 0, plan.header()},
                                 out),
            absl::UnavailableError(
                "rank 2: dispatch call 1 refused: the group gave up on this rank in this call or "
                "an earlier one; it must be re-formed"));
}

// The same with flag-in-granule rows: the receivers wait for rank 2's rows themselves, and
// still name rank 2 and the phase.
TEST(HostEpErrorTest, FlaggedRowsThatNeverArriveAreNamedAfterTheCounts) {
  EpConfig config = ShortTimeoutConfig();
  config.flagged_tokens = 8;
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  group.ep(2).set_row_delay_for_testing(absl::Seconds(2));
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int) { return true; });
  ExpectGaveUpOnRank2InACall(status, "dispatch data", "300ms");
}

// Every rank dispatches 8 flagged tokens; rank 2's partials go out a second late: the others'
// combines give up on rank 2 while summing its partials.
TEST(HostEpErrorTest, FlaggedPartialsThatNeverArriveAreNamed) {
  EpConfig config = ShortTimeoutConfig();
  config.flagged_tokens = 8;
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const EpConfig& c = group.config();
  group.ep(2).set_partial_delay_for_testing(absl::Seconds(2));
  std::vector<absl::Status> status(c.num_ranks);
  group.RunAll(
      [&](int r) { status[r] = DispatchThenCombine(group, r, MakeInput(c, r, 8, 3), plan); });
  ExpectGaveUpOnRank2InACall(status, "combine partials", "300ms");
}

// The daemon stops the group (draining) while the ranks wait for rank 2's flagged rows, which
// come 2 s late: the waits end on the abort word with the daemon's reason, rather than going
// on to take rank 2's rows.
TEST(HostEpErrorTest, ADaemonStopEndsAWaitForFlaggedRows) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.flagged_tokens = 8;
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  const ArenaLayout layout(config);
  group.ep(2).set_row_delay_for_testing(absl::Seconds(2));
  std::thread daemon([&] {
    // Once every count of call 1 is in every arena (rank 2's counts go out on time, its rows
    // late): ranks 0, 1 and 3 are past the counts, waiting for rank 2's rows.
    auto counts_in = [&] {
      for (int r = 0; r < config.num_ranks; ++r) {
        for (int s = 0; s < config.num_ranks; ++s) {
          const auto* flag = reinterpret_cast<const uint32_t*>(group.arena(r) + layout.count_flag +
                                                               s * kFlagStride);
          if (!EpochReached(LoadAcquire(flag), 1)) return false;
        }
      }
      return true;
    };
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (!counts_in() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    for (int r = 0; r < config.num_ranks; ++r) RaiseAbort(group.arena(r), layout, kAbortDraining);
  });
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int) { return true; });
  daemon.join();
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(status[r], absl::UnavailableError(absl::StrCat(
                             "rank ", r, ": ubepd is draining; dispatch data of call 1 abandoned; "
                             "attach again when it is back")));
  }
}

// A flagged combine takes its partials token by token; late, it names the lowest destination
// still awaited, as every other wait does, not the one of the token it was at. Rank 0's token 0
// went to rank 3 alone (expert 15), token 1 to rank 2 alone (expert 10); ranks 2 and 3 both
// store rank 0's partials 2 s late.
TEST(HostEpErrorTest, AFlaggedCombineLateNamesTheLowestDestinationStillAwaited) {
  EpConfig config = ShortTimeoutConfig();
  config.flagged_tokens = 8;
  Group group(config);
  const TestPlan plan = RoundRobinPlan(config);
  for (int r : {2, 3}) group.ep(r).set_partial_delay_for_testing(absl::Seconds(2), /*source=*/0);
  std::vector<absl::Status> status(config.num_ranks);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(config, r, 2, 3);
    if (r == 0) in.topk_idx = {15, -1, -1, -1, 10, -1, -1, -1};
    status[r] = DispatchThenCombine(group, r, in, plan);
  });
  EXPECT_EQ(status[0], GaveUpOnRank2(0, "combine partials", "", "300ms"));
}

// A wait that goes on past a rank that left after its call still has its deadline, and its
// timeout names the peer it waited for, not the rank that left (nor any patience: a spared
// wait gets none). Rank 3 waits 2 s, time enough on a loaded machine for rank 1 to finish its
// call and leave before that deadline (checked: else the test would show nothing), and rank
// 0's partials for it come once it has given up.
TEST(HostEpErrorTest, AWaitSparedByARankThatLeftStillTimesOutNamingItsPeer) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  EpConfig waiting = config;
  waiting.timeout = absl::Seconds(2);
  group.Restart(3, &waiting);
  const TestPlan plan = RoundRobinPlan(config);
  const ArenaLayout layout(config);
  std::atomic<bool> rank3_returned{false};
  group.ep(0).set_partial_gate_for_testing(
      [&] { ASSERT_TRUE(test::WaitFor([&] { return rank3_returned.load(); }, absl::Seconds(60))); },
      /*source=*/3);
  std::vector<absl::Status> status(config.num_ranks);
  bool left_while_rank3_waited = false;
  group.RunAll([&](int r) {
    status[r] = DispatchThenCombine(group, r, MakeInput(config, r, 8, 3), plan);
    if (r == 3) rank3_returned = true;
    if (r == 1 && status[r].ok()) {
      left_while_rank3_waited = ReadInCall(group.arena(3), layout).has_value();
      for (int d = 0; d < config.num_ranks; ++d) {
        RaiseAbort(group.arena(d), layout, kAbortRankGone | 1u);
      }
    }
  });
  EXPECT_EQ(status[1], absl::OkStatus());
  EXPECT_TRUE(left_while_rank3_waited) << "rank 1 left after rank 3's wait had ended";
  EXPECT_EQ(status[3], absl::DeadlineExceededError(
                           "rank 3: timed out after 2s waiting for rank 0 (combine partials, "
                           "call 1); is rank 0 alive?"));
}

// Rank 1 dispatches call 1, stores its partials for ranks 2 and 3 (which routed nothing in
// it) and dies before rank 0's: between calls, or inside its combine with a deadline far
// ahead (it ran with a longer timeout), which holds rank 0 until its limit (twice its
// timeout, 2.5 s from its combine's start). Rank 0
// waits for the partials; ranks 2 and 3 finish call 1 and wait in call 2 for rank 0's counts.
// Their deadline comes before rank 0's (rank 0's timeout is longer here; on a busy host, rank
// 0 is not scheduled in time): rank 0 is in a call, so they wait on, past rank 0's limit,
// until it gives up and names rank 1, and they name rank 1 too, not the survivor.
class StuckBehindASurvivorTest : public ::testing::TestWithParam<bool> {};

TEST_P(StuckBehindASurvivorTest, RanksStuckBehindASurvivorWaitForItToNameTheDeadRank) {
  const bool died_in_a_call = GetParam();
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.timeout = absl::Seconds(1);
  Group group(config);
  EpConfig patient = config;
  patient.timeout = absl::Milliseconds(1250);
  group.Restart(0, &patient);
  const ArenaLayout layout(config);
  const TestPlan plan = RoundRobinPlan(config);
  std::vector<absl::Status> status(config.num_ranks);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(config, r, 8, 3);
    DispatchOutput out;
    status[r] = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(),
                                      r < 2 ? 8 : 0, config.hidden, 0, plan.header()},
                                     out);
    if (!status[r].ok()) return;
    if (r == 1) {
      if (died_in_a_call) {
        PublishInCall(group.arena(1), layout,
                      PublishedCall{std::chrono::steady_clock::now() + std::chrono::seconds(10)});
      }
      for (int d : {2, 3}) {
        std::byte* arena = group.arena(d);
        Signal(reinterpret_cast<uint32_t*>(arena + layout.combine_flag + 1 * kFlagStride), 1,
               ArenaDoor(arena, layout));
      }
      return;
    }
    std::vector<float> combined(8 * config.hidden);
    status[r] = group.ep(r).Combine(out, out.recv_x.data(), combined.data());
    if (!status[r].ok() || r == 0) return;
    status[r] = group.ep(r).Dispatch(
        {in.x.data(), in.topk_idx.data(), in.topk_w.data(), 8, config.hidden, 1, plan.header()},
        out);
  });
  // Each says how much longer than its deadline it was given on a rank in a call. Rank 0
  // gets its timeout more on a rank 1 in a call (depth 1). Ranks 2 and 3 get a grace on rank
  // 0 at their deadline (rank 0 is in its call till then); when rank 1 died in a call, rank 0
  // is one deeper by their extended deadline, so they get a grace more, till rank 0 gives up.
  EXPECT_EQ(status[1], absl::OkStatus());
  EXPECT_EQ(status[0], absl::DeadlineExceededError(absl::StrCat(
                           "rank 0: timed out after 1.25s waiting for rank 1 (combine partials, "
                           "call 1",
                           died_in_a_call ? "; given up to 1.25s more as rank 1 was in a call" : "",
                           "); is rank 1 alive?")));
  for (int r : {2, 3}) {
    EXPECT_EQ(status[r], absl::DeadlineExceededError(absl::StrCat(
                             "rank ", r,
                             ": timed out after 1s waiting for rank 1 (dispatch "
                             "counts, call 2, waiting on rank 0 which gave up; given up to ",
                             died_in_a_call ? "2s" : "1s",
                             " more as rank 0 was in a call); is rank 1 alive?")));
  }
}

INSTANTIATE_TEST_SUITE_P(DeadRank, StuckBehindASurvivorTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "InACall" : "BetweenCalls";
                         });

TEST(PublishedCallTest, TheWordHoldsTheDeadlineAndTheDepthAndZeroIsBetweenCalls) {
  const EpConfig config = ShortTimeoutConfig();
  Group group(config);
  const ArenaLayout layout(config);
  for (int r = 0; r < config.num_ranks; ++r) {
    EXPECT_EQ(ReadInCall(group.arena(r), layout), std::nullopt) << "rank " << r;
  }
  const Deadline soon = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  PublishInCall(group.arena(2), layout, PublishedCall{soon, 3});
  EXPECT_EQ(ReadInCall(group.arena(2), layout), (PublishedCall{soon, 3}));
  PublishInCall(group.arena(2), layout, PublishedCall{soon, 99});
  EXPECT_EQ(ReadInCall(group.arena(2), layout), (PublishedCall{soon, kMaxPublishedDepth}));
  PublishInCall(group.arena(2), layout, PublishedCall{Deadline::max(), 0});
  EXPECT_EQ(ReadInCall(group.arena(2), layout), (PublishedCall{Deadline::max(), 0}));
  PublishInCall(group.arena(2), layout, std::nullopt);
  EXPECT_EQ(ReadInCall(group.arena(2), layout), std::nullopt);
  // A rank created again over its arena is between calls, whatever the process before left.
  PublishInCall(group.arena(2), layout, PublishedCall{soon, 1});
  group.Restart(2);
  EXPECT_EQ(ReadInCall(group.arena(2), layout), std::nullopt);
}

// Rank 2 never calls, and its word says it is in a call for ever (a process killed in a call
// with no timeout, or a corrupt word), published `depth` deep. Its peers wait on until their
// limit, the timeout and a grace per depth past their deadline, publishing one deeper while
// they do; at kMaxWaitDepth they get no patience. Either way they name rank 2. The waits are
// asserted by what the ranks publish while they wait (watched from another thread): the
// deeper call's deadline is their own one's and the limit of its depth, to the nanosecond;
// a wait without end would hang.
class PatienceDepthTest : public ::testing::TestWithParam<int> {};

TEST_P(PatienceDepthTest, APeerInACallForEverIsNamedAtTheLimitOfItsDepth) {
  const int depth = GetParam();
  const EpConfig config = ShortTimeoutConfig();  // Grace: the 300 ms timeout.
  Group group(config);
  const ArenaLayout layout(config);
  PublishInCall(group.arena(2), layout, PublishedCall{Deadline::max(), depth});
  const TestPlan plan = RoundRobinPlan(config);
  std::atomic<bool> done{false};
  int deepest = -1;  // The deepest call ranks 0, 1 and 3 published while in it.
  // Per rank: the deadline it published for its own call (depth 0), and for the wait on rank 2
  // stretched one deeper than rank 2's call.
  std::vector<std::optional<Deadline>> own(config.num_ranks), stretched(config.num_ranks);
  std::thread watch([&] {
    while (!done.load()) {
      for (int r : {0, 1, 3}) {
        if (const std::optional<PublishedCall> call = ReadInCall(group.arena(r), layout)) {
          deepest = std::max(deepest, call->depth);
          if (call->depth == 0) own[r] = call->until;
          if (call->depth == depth + 1) stretched[r] = call->until;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int r) { return r != 2; });
  done = true;
  watch.join();
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(ReadInCall(group.arena(r), layout), std::nullopt) << "rank " << r;
  }
  if (depth < kMaxWaitDepth) {
    // The timeout and a grace per depth past the first.
    ExpectGaveUpOnRank2InACall(status, "dispatch counts",
                               absl::FormatDuration((1 + depth) * absl::Milliseconds(300)));
    EXPECT_EQ(deepest, depth + 1);
    for (int r : {0, 1, 3}) {
      ASSERT_TRUE(own[r].has_value() && stretched[r].has_value()) << "rank " << r;
      EXPECT_EQ(std::chrono::nanoseconds(*stretched[r] - *own[r]).count(),
                std::chrono::nanoseconds((1 + depth) * std::chrono::milliseconds(300)).count())
          << "rank " << r;
    }
  } else {
    for (int r : {0, 1, 3}) EXPECT_EQ(status[r], GaveUpOnRank2(r, "dispatch counts"));
    EXPECT_EQ(deepest, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Depth, PatienceDepthTest,
                         ::testing::Values(0, kMaxWaitDepth - 1, kMaxWaitDepth));

TEST(HostEpErrorTest, FlaggedTokensOutsideTheBuffersAreRefused) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.flagged_tokens = 49;
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: flagged_tokens 49 is outside [0, 48] "
                                       "(max_tokens)"));
  config.flagged_tokens = 8;
  config.hidden = 3;  // fp32: 12-byte rows, not whole granules.
  EXPECT_EQ(ValidateConfig(config),
            absl::InvalidArgumentError("ep config: flagged_tokens needs rows of a multiple of 8 "
                                       "bytes; hidden 3 makes 12"));
}

// A flagged combine takes its partials as they land, so it learns that a destination is done
// with this rank's landing from those partials; from a destination it sent nothing to it has
// none, and must still wait for that one's combine flag. Two ranks, each routing call 1 to its
// own experts only, then rank 0 routing call 2 to rank 1's: rank 1 is slow to lay out call 1
// (its rows go out 300 ms after its counts), and rank 0 must not store call 2's records and
// count into rank 1's arena before that, or rank 1 lays out call 1 from call 2's count.
TEST(HostEpFlaggedTest, ACombineWaitsForDestinationsItSentNothing) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.num_ranks = 2;
  config.slots_per_rank = 10;  // Rank 0: experts 0-9; rank 1: 10-15 and 0-3.
  config.flagged_tokens = config.max_tokens;
  config.timeout = absl::Seconds(2);
  config.sender_thread = EpConfig::SenderThread::kOff;
  Group group(config);
  const EpConfig& c = group.config();
  const TestPlan plan = RoundRobinPlan(c);
  group.ep(1).set_row_delay_for_testing(absl::Milliseconds(300));
  std::vector<absl::Status> status(2);
  std::vector<std::vector<int>> rows(2);
  group.RunAll([&](int r) {
    for (int call = 1; call <= 2; ++call) {
      const int expert = r == 0 ? (call == 1 ? 5 : 12) : 12;
      const RankInput in = MakeInput(c, r, 10, call, /*only_expert=*/expert);
      DispatchOutput out;
      status[r] = group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 10,
                                        c.hidden, 0, plan.header()},
                                       out);
      if (!status[r].ok()) return;
      rows[r].push_back(out.num_rows());
      std::vector<float> combined(10 * c.hidden);
      status[r] = group.ep(r).Combine(out, out.recv_x.data(), combined.data());
      if (!status[r].ok()) return;
    }
  });
  EXPECT_EQ(status[0], absl::OkStatus());
  EXPECT_EQ(status[1], absl::OkStatus());
  // Every token carries one pair (only_expert) into the rank that serves it.
  EXPECT_EQ(rows[0], (std::vector<int>{10, 0}));
  EXPECT_EQ(rows[1], (std::vector<int>{10, 20}));
}

// Flagged rows have their own bytes in a landing (flagged_rows.h): a plain call's rows, read
// as granules, could carry any tag. Call 1 goes plain (20 tokens, above flagged_tokens 8) with
// every odd float of its rows the bit pattern 2, the tag of call 2; call 2 goes flagged with
// rank 0's rows and partials late. Were flagged rows stored where plain ones are, the
// receivers would take call 1's bytes for rank 0's rows of call 2.
TEST(HostEpFlaggedTest, APlainCallsBytesNeverPassForFlaggedRows) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.flagged_tokens = 8;
  config.sender_thread = EpConfig::SenderThread::kOn;
  Group group(config);
  const EpConfig& c = group.config();
  const TestPlan plan = RoundRobinPlan(c);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(c, r, 20, 1);
    const uint32_t tag_of_call_2 = 2;
    for (size_t i = 1; i < in.x.size(); i += 2) {
      std::memcpy(&in.x[i], &tag_of_call_2, sizeof(float));
    }
    DispatchOutput out;
    ASSERT_EQ(group.ep(r).Dispatch({in.x.data(), in.topk_idx.data(), in.topk_w.data(), 20,
                                    c.hidden, 0, plan.header()},
                                   out),
              absl::OkStatus());
    std::vector<float> combined(20 * c.hidden);
    ASSERT_EQ(group.ep(r).Combine(out, out.recv_x.data(), combined.data()), absl::OkStatus());
  });
  group.ep(0).set_row_delay_for_testing(absl::Milliseconds(100));
  group.ep(0).set_partial_delay_for_testing(absl::Milliseconds(100));
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 8, 2));
  RunStep(group, inputs, plan, 1);
}

// Tags are compared for equality, so a stale tag must never equal a coming epoch
// (flagged_rows.h). Every rank's landing holds garbage tagged 2^30 + 1 and the group resumes
// at epoch 2^30 - 1: call 2^30 (no tokens) rewrites the tags at its end, so in call 2^30 + 1,
// whose rank 0 stores its rows and partials late, nobody takes the garbage for rank 0's data.
// Call 2^30 carries tokens too, rank 0's late, so a scrub that ran before the receive would
// hang it.
TEST(HostEpFlaggedTest, TagsOfEarlierEpochsAreScrubbedBeforeTheyComeAgain) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.sender_thread = EpConfig::SenderThread::kOn;
  config.flagged_tokens = config.max_tokens;
  Group group(config);
  const EpConfig& c = group.config();
  const ArenaLayout layout(c);
  const uint32_t resume = kTagScrubPeriod - 1, stale = kTagScrubPeriod + 1;
  for (int r = 0; r < c.num_ranks; ++r) {
    std::byte* arena = group.arena(r);
    for (size_t region : {layout.dispatch_flag, layout.combine_flag, layout.count_flag,
                          layout.barrier_flag}) {
      for (int s = 0; s < c.num_ranks; ++s) {
        *reinterpret_cast<uint32_t*>(arena + region + s * kFlagStride) = resume;
      }
    }
    auto* granules = reinterpret_cast<uint64_t*>(arena + layout.rows);
    for (size_t i = 0; i < 2 * c.num_ranks * layout.row_stride / 8; ++i) {
      granules[i] = Granule(0xDEADBEEF, stale);  // Rows, then partials.
    }
  }
  group.Restart();
  const TestPlan plan = RoundRobinPlan(c);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 12, 1));
  group.ep(0).set_row_delay_for_testing(absl::Milliseconds(50));
  RunStep(group, inputs, plan, 0);
  // Every flagged part of every landing (rows and partials, each source's) carries the scrub
  // tag; the plain parts keep what they held.
  for (int r = 0; r < c.num_ranks; ++r) {
    for (size_t region : {layout.rows, layout.partials}) {
      for (int s = 0; s < c.num_ranks; ++s) {
        const std::byte* part = group.arena(r) + region + s * layout.row_stride;
        const auto* granules = reinterpret_cast<const uint64_t*>(part + layout.flagged_offset);
        for (size_t i = 0; i < (layout.row_stride - layout.flagged_offset) / 8; ++i) {
          ASSERT_EQ(granules[i], Granule(0, ScrubTag(kTagScrubPeriod)))
              << "rank " << r << " part " << s << " granule " << i;
        }
        ASSERT_EQ(reinterpret_cast<const uint64_t*>(part)[0], Granule(0xDEADBEEF, stale));
      }
    }
  }
  group.ep(0).set_row_delay_for_testing(absl::Milliseconds(100));
  group.ep(0).set_partial_delay_for_testing(absl::Milliseconds(100));
  inputs.clear();
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 20 + r, 2));
  RunStep(group, inputs, plan, 1);
}

// A rank created again over its arena without a reset (its serving process restarted between
// steps) continues its peers' count of calls, under either protocol: a bsp rank raises no
// dispatch or combine flag of its own and resumes from the calls it completed (before, it
// started again at call 1 and its peers, at call 3, timed out on it). The inputs change
// every step, so stale rows would not pass.
TEST(HostEpRestartTest, ARankCreatedAgainOverItsArenaContinuesItsPeersCount) {
  for (Protocol protocol : {Protocol::kUbep, Protocol::kBsp}) {
    SCOPED_TRACE(protocol == Protocol::kBsp ? "bsp" : "ubep");
    EpConfig config = SmallConfig(protocol);
    config.timeout = absl::Seconds(2);
    Group group(config);
    const TestPlan plan = RoundRobinPlan(config);
    for (int step = 0; step < 3; ++step) {
      if (step == 2) group.Restart(/*only=*/1);
      std::vector<RankInput> inputs;
      for (int r = 0; r < config.num_ranks; ++r) {
        inputs.push_back(MakeInput(config, r, 10 + r, 50 + step));
      }
      RunStep(group, inputs, plan, step % 2);
    }
  }
}

// A group that re-forms starts its epochs again from 1 (ResetSignals), so the old
// generation's flagged rows and partials carry the tags the new one uses next: the reset
// zeroes them. One flagged call, a reset of every arena, the ranks created again, then call 1
// of the new generation with other routing and rank 0's rows and partials late: a receiver
// that took the old call's rows would read other tokens' data, and a combine that took the old
// partials would miss the reference.
TEST(HostEpFlaggedTest, AReformedGroupNeverTakesTheOldGenerationsRows) {
  EpConfig config = SmallConfig(Protocol::kUbep);
  config.flagged_tokens = config.max_tokens;
  config.sender_thread = EpConfig::SenderThread::kOn;
  Group group(config);
  const EpConfig& c = group.config();
  const TestPlan plan = RoundRobinPlan(c);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 30, 40));
  RunStep(group, inputs, plan, 0);
  const ArenaLayout layout(c);
  for (int r = 0; r < c.num_ranks; ++r) ResetSignals(group.arena(r), layout);
  group.Restart();
  group.ep(0).set_row_delay_for_testing(absl::Milliseconds(100));
  group.ep(0).set_partial_delay_for_testing(absl::Milliseconds(100));
  inputs.clear();
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 30, 77));
  RunStep(group, inputs, plan, 0);
}

// Rank 2 never shows up and the plan excludes rank 3: ranks 0 and 1 time out naming rank 2,
// raise the abort word in each other's arenas, and leave rank 3's arena as it was.
TEST(HostEpErrorTest, ATimeoutLeavesTheArenaOfARankThePlanExcludesAlone) {
  EpConfig config = ShortTimeoutConfig();
  config.slots_per_rank = 8;
  Group group(config);
  const TestPlan plan = TestPlan::Excluding(4, 8, config.num_experts, 2, 3);
  const ArenaLayout layout(config);
  const std::vector<std::byte> before(group.arena(3), group.arena(3) + layout.total_bytes);
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int r) { return r < 2; });
  for (int r : {0, 1}) EXPECT_EQ(status[r], GaveUpOnRank2(r, "dispatch counts"));
  for (int r : {0, 1, 2}) {
    EXPECT_EQ(*reinterpret_cast<const uint32_t*>(group.arena(r) + layout.abort),
              kAbortTimedOutBase + 2)
        << "rank " << r;
  }
  EXPECT_TRUE(std::equal(before.begin(), before.end(), group.arena(3)));
}

// A rank the plan excludes that dispatches anyway is refused, naming the plan, before any
// byte moves into any arena.
TEST(HostEpErrorTest, ADispatchByARankThePlanExcludesIsRefusedBeforeAnyByteMoves) {
  EpConfig config = ShortTimeoutConfig();
  config.slots_per_rank = 8;
  Group group(config);
  const TestPlan plan = TestPlan::Excluding(4, 8, config.num_experts, 2, 3);
  const ArenaLayout layout(config);
  std::vector<std::vector<std::byte>> before;
  for (int r = 0; r < 4; ++r) before.emplace_back(group.arena(r), group.arena(r) + layout.total_bytes);
  const std::vector<absl::Status> status = DispatchOnce(group, plan, [](int r) { return r == 3; });
  EXPECT_EQ(status[3], absl::FailedPreconditionError(absl::StrCat(
                           "rank 3 is excluded from the EP group by plan v",
                           plan.header()->version)));
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(std::equal(before[r].begin(), before[r].end(), group.arena(r))) << "arena " << r;
  }
}

// host_cpu.h: the machine that built and runs these tests runs the level the host kernels were
// built for (were it below it, this binary would have died of SIGILL in the tests before), and
// a CPU below a level gets an error that says what to rebuild with.
TEST(HostCpuTest, TheBuildsLevelRunsHereAndACpuBelowItIsToldWhatToRebuild) {
  EXPECT_EQ(HostCpuSupported(), absl::OkStatus()) << HostKernelLevel();
#if defined(__x86_64__)
  EXPECT_NE(HostKernelLevel(), "");  // kernels/CMakeLists.txt passes UBEP_HOST_MARCH on.
#endif
  EXPECT_EQ(HostCpuStatus("x86-64-v4", false),
            absl::FailedPreconditionError(
                "the host kernels of this build need an x86-64-v4 CPU, and this one lacks some "
                "of its features (see /proc/cpuinfo); rebuild with -DUBEP_HOST_MARCH=x86-64 (or "
                "the level this CPU has) to run here"));
  EXPECT_EQ(HostCpuStatus("x86-64-v3", true), absl::OkStatus());
}

// Until `sleepers` reads 1 (a waiter is asleep, or about to be), 30 s at most.
void AwaitSleeper(const uint32_t& sleepers) {
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (std::atomic_ref<const uint32_t>(sleepers).load() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Microseconds(100));
  }
  EXPECT_EQ(std::atomic_ref<const uint32_t>(sleepers).load(), 1u);
}

// signal.h: a waiter that goes to sleep counts itself in the sleepers word while it sleeps
// (so that a Signal wakes it), and every way out of WaitEpoch takes it off again.
TEST(SignalTest, ASleeperCountsItselfUntilItIsSignalled) {
  uint32_t word = 0, sleepers = 0;
  absl::Status waited;
  std::thread waiter([&] {
    waited = WaitEpoch(&word, 1, Doorbell::Own(&word, &sleepers), DeadlineAfter(absl::Seconds(60)));
  });
  AwaitSleeper(sleepers);
  Signal(&word, 1, Doorbell::Own(&word, &sleepers));
  waiter.join();
  EXPECT_EQ(waited, absl::OkStatus());
  EXPECT_EQ(sleepers, 0u);
}

// The owner of an arena waits on all of its sources at once: asleep on the arena's bell, it
// wakes for whichever flag is raised, and for an abort. Its slices are an hour long here, so
// a Signal or an abort that did not ring the bell would leave it asleep (and the test would
// time out) rather than pass.
TEST(SignalTest, AnArenasBellWakesItsOwnerForAnyFlagAndForAnAbort) {
  const EpConfig config = SmallConfig(Protocol::kUbep);
  const ArenaLayout layout(config);
  std::vector<uint64_t> words(layout.total_bytes / sizeof(uint64_t) + 1, 0);
  auto* arena = reinterpret_cast<std::byte*>(words.data());
  auto flag = [&](int s) {
    return reinterpret_cast<uint32_t*>(arena + layout.count_flag + s * kFlagStride);
  };
  const uint32_t* abort_word = reinterpret_cast<uint32_t*>(arena + layout.abort);
  const Doorbell door = ArenaDoor(arena, layout);
  auto wait_for_any = [&](uint32_t epoch, int* which) {
    return WaitUntil(
        door, DeadlineAfter(absl::Hours(1)), {abort_word},
        [&] {
          for (int s = 0; s < config.num_ranks; ++s) {
            if (EpochReached(LoadAcquire(flag(s)), epoch)) {
              *which = s;
              return true;
            }
          }
          return false;
        },
        absl::Hours(1));
  };
  absl::Status waited;
  int which = -1;
  std::thread waiter([&] { waited = wait_for_any(1, &which); });
  AwaitSleeper(*door.bell_sleepers);
  Signal(flag(3), 1, door);
  waiter.join();
  EXPECT_EQ(waited, absl::OkStatus());
  EXPECT_EQ(which, 3);
  EXPECT_EQ(*door.bell, 1u);
  // A wait on one flag sleeps on that flag, counted apart: the bell's sleepers are not woken
  // in vain by every flag, nor the flag's by the bell.
  std::thread one_flag(
      [&] { waited = WaitEpoch(flag(2), 1, door, DeadlineAfter(absl::Hours(1)), {abort_word}); });
  AwaitSleeper(*door.word_sleepers);
  EXPECT_EQ(*door.bell_sleepers, 0u);
  Signal(flag(2), 1, door);
  one_flag.join();
  EXPECT_EQ(waited, absl::OkStatus());
  EXPECT_EQ(*door.bell, 2u);
  std::thread aborted([&] { waited = wait_for_any(2, &which); });
  AwaitSleeper(*door.bell_sleepers);
  RaiseAbort(arena, layout, kAbortDraining);
  aborted.join();
  EXPECT_EQ(waited, absl::AbortedError("the group gave up"));
  EXPECT_EQ(*door.bell, 3u);
  EXPECT_EQ(*door.word_sleepers, 0u);
  EXPECT_EQ(*door.bell_sleepers, 0u);
}

// A process that died asleep leaves the sleepers word of its arena above zero (every Signal
// into the arena then wakes); the reset of a re-forming group zeroes it with the flags, and
// keeps the load counters.
TEST(SignalTest, AResetClearsTheSleepersADeadProcessLeft) {
  const EpConfig config = SmallConfig(Protocol::kUbep);
  const ArenaLayout layout(config);
  std::vector<std::byte> arena(layout.total_bytes);
  const uint32_t dead_sleeper = 1, epoch = 7;
  const uint64_t load = 42;
  std::memcpy(arena.data() + layout.sleepers, &dead_sleeper, sizeof(dead_sleeper));
  std::memcpy(arena.data() + layout.dispatch_flag, &epoch, sizeof(epoch));
  std::memcpy(arena.data() + layout.load_counters, &load, sizeof(load));
  ResetSignals(arena.data(), layout);
  uint32_t sleepers = 1, flag = 1;
  uint64_t counter = 0;
  std::memcpy(&sleepers, arena.data() + layout.sleepers, sizeof(sleepers));
  std::memcpy(&flag, arena.data() + layout.dispatch_flag, sizeof(flag));
  std::memcpy(&counter, arena.data() + layout.load_counters, sizeof(counter));
  EXPECT_EQ(sleepers, 0u);
  EXPECT_EQ(flag, 0u);
  EXPECT_EQ(counter, load);
}

TEST(SignalTest, TimeoutsAndAbortsLeaveNoSleeperBehind) {
  uint32_t word = 5, sleepers = 0, abort_word = 0;
  const Doorbell door = Doorbell::Own(&word, &sleepers);
  EXPECT_EQ(WaitEpoch(&word, 5, door, Deadline::min()), absl::OkStatus());
  EXPECT_EQ(WaitEpoch(&word, 6, door, DeadlineAfter(absl::Milliseconds(20))),
            absl::DeadlineExceededError("timed out"));
  EXPECT_EQ(sleepers, 0u);
  absl::Status waited;
  std::thread waiter(
      [&] { waited = WaitEpoch(&word, 6, door, DeadlineAfter(absl::Seconds(60)), {&abort_word}); });
  std::atomic_ref<uint32_t>(abort_word).store(1);
  waiter.join();
  EXPECT_EQ(waited, absl::AbortedError("the group gave up"));
  EXPECT_EQ(sleepers, 0u);
  // A wait spared code 1 (its waiter found that it may wait past it) goes on to its word, and
  // ends on any other code.
  std::thread spared([&] {
    waited = WaitEpoch(&word, 6, door, DeadlineAfter(absl::Seconds(60)), {&abort_word, 1});
  });
  AwaitSleeper(sleepers);
  Signal(&word, 6, door);
  spared.join();
  EXPECT_EQ(waited, absl::OkStatus());
  std::thread other_code([&] {
    waited = WaitEpoch(&word, 7, door, DeadlineAfter(absl::Seconds(60)), {&abort_word, 1});
  });
  AwaitSleeper(sleepers);
  std::atomic_ref<uint32_t>(abort_word).store(2);
  Signal(&word, 6, door);  // Wakes the sleeper (the word does not reach 7).
  other_code.join();
  EXPECT_EQ(waited, absl::AbortedError("the group gave up"));
  EXPECT_EQ(sleepers, 0u);
  // A word past the epoch has reached it.
  EXPECT_EQ(WaitEpoch(&word, 4, door, Deadline::min()), absl::OkStatus());
  // A timeout without end (a config's absl::InfiniteDuration()) sleeps, slice by slice, until
  // the word moves: its deadline saturates rather than wrapping into the past.
  EXPECT_EQ(DeadlineAfter(absl::InfiniteDuration()), Deadline::max());
  std::thread endless(
      [&] { waited = WaitEpoch(&word, 7, door, DeadlineAfter(absl::InfiniteDuration())); });
  AwaitSleeper(sleepers);
  Signal(&word, 7, door);
  endless.join();
  EXPECT_EQ(waited, absl::OkStatus());
  EXPECT_EQ(sleepers, 0u);
}

// The daemon's codes share kAbortRankGone's bit: each is read as itself, once, for every
// message (a membership change was once reported as "rank 2147483646 left the group").
TEST(AbortCodeTest, EachCodeIsReadAsItself) {
  auto read = [](uint32_t code) {
    const AbortReason r = ReadAbortCode(code);
    return std::pair<int, int>(r.kind, r.rank);
  };
  EXPECT_EQ(read(0), std::pair(int{AbortReason::kNone}, -1));
  EXPECT_EQ(read(kAbortTimedOutBase + 3), std::pair(int{AbortReason::kTimedOut}, 3));
  EXPECT_EQ(read(kAbortRankGone | 5), std::pair(int{AbortReason::kRankGone}, 5));
  EXPECT_EQ(read(kAbortDraining), std::pair(int{AbortReason::kDraining}, -1));
  EXPECT_EQ(read(kAbortMembership), std::pair(int{AbortReason::kMembership}, -1));
  EXPECT_EQ(RankThatLeft(kAbortRankGone | 5), 5);
  for (uint32_t code : {0u, kAbortTimedOutBase + 5, kAbortDraining, kAbortMembership}) {
    EXPECT_EQ(RankThatLeft(code), -1) << code;
  }
  EXPECT_EQ(DaemonAbortStatus(kAbortMembership, 1, "dispatch data", 7),
            absl::UnavailableError("rank 1: the group's membership changed (a committed plan "
                                   "excludes or includes ranks) during dispatch data of call 7; "
                                   "join again"));
  EXPECT_EQ(DaemonAbortStatus(kAbortTimedOutBase + 3, 1, "dispatch data", 7), absl::OkStatus());
}

// A refusal is read back for its own phase and call only, cut to kRefusalChars, gone once
// withdrawn or after a reset of the group.
TEST(AbortCodeTest, ARefusalIsReadForItsPhaseAndCallOnly) {
  const EpConfig config = SmallConfig(Protocol::kUbep);
  const ArenaLayout layout(config);
  std::vector<std::byte> arena(layout.total_bytes);
  // What a rank refusing between calls records is what a peer waiting for it in that call
  // reads: after call 3's combine, call 4's dispatch; after call 4's dispatch, its combine.
  EXPECT_EQ(AwaitedPhase(3, 3), PhaseInFlight(4, 3));
  EXPECT_EQ(AwaitedPhase(3, 3), (CallPhase{/*combine=*/false, 4}));
  EXPECT_EQ(AwaitedPhase(4, 3), PhaseInFlight(4, 4));
  EXPECT_EQ(AwaitedPhase(4, 3), (CallPhase{/*combine=*/true, 4}));
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {false, 0}), "");
  RecordRefusal(arena.data(), layout, {/*combine=*/false, 7}, "hidden size 80 does not match");
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {false, 7}), "hidden size 80 does not match");
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {true, 7}), "");
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {false, 8}), "");
  const std::string long_why(300, 'x');
  RecordRefusal(arena.data(), layout, {/*combine=*/true, 8}, long_why);
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {true, 8}), long_why.substr(0, kRefusalChars));
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {false, 7}), "");
  WithdrawRefusal(arena.data(), layout);
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {true, 8}), "");
  RecordRefusal(arena.data(), layout, {/*combine=*/false, 9}, "short");
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {false, 9}), "short");
  ResetSignals(arena.data(), layout);
  EXPECT_EQ(ReadRefusal(arena.data(), layout, {false, 9}), "");
  EXPECT_EQ(TimedOutStatus(kAbortTimedOutBase + 2, 0, 1, absl::Seconds(10), "dispatch data", 9,
                           "short"),
            absl::DeadlineExceededError("rank 0: timed out after 10s waiting for rank 2 "
                                        "(dispatch data, call 9, waiting on rank 1 which gave "
                                        "up); rank 2 refused this call: short"));
}

TEST(HostEpErrorTest, NoPlanInForceIsAClearError) {
  Group group(SmallConfig(Protocol::kBsp));
  const EpConfig& c = group.config();
  std::vector<std::byte> area(PlanAreaBytes(1024));
  InitPlanArea(area.data(), 1024);
  RankInput in = MakeInput(c, 0, 4, 1);
  DispatchInput args{in.x.data(), in.topk_idx.data(), in.topk_w.data(), 4, c.hidden, 0};
  args.plan_area = area.data();
  args.plan_capacity = 1024;
  args.step = 7;
  DispatchOutput out;
  EXPECT_EQ(group.ep(0).Dispatch(args, out),
            absl::FailedPreconditionError("rank 0: no committed plan is in force at step 7"));
}

TEST(HostEpErrorTest, DispatchTwiceWithoutCombineIsRefused) {
  Group group(SmallConfig(Protocol::kBsp));
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<absl::Status> second(c.num_ranks);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(c, r, 4, 3);
    DispatchOutput out;
    const DispatchInput args{in.x.data(), in.topk_idx.data(), in.topk_w.data(), 4,
                             c.hidden,    0,                 plan.header()};
    ASSERT_TRUE(group.ep(r).Dispatch(args, out).ok());
    second[r] = group.ep(r).Dispatch(args, out);
  });
  for (const absl::Status& s : second) {
    EXPECT_EQ(s, absl::FailedPreconditionError(
                     "dispatch called twice without a combine in between: the combine of one "
                     "call frees the peers' receive buffers for the next"));
  }
}

// A dispatch of tokens without x, topk_idx or topk_weights is refused before any byte moves:
// no peer's arena changes.
TEST(HostEpErrorTest, ADispatchWithoutItsInputIsRefusedBeforeAnyByteMoves) {
  Group group(SmallConfig(Protocol::kUbep));
  const EpConfig& c = group.config();
  const TestPlan plan = RoundRobinPlan(c);
  const std::vector<std::vector<std::byte>> before = PeerArenaBytes(group);
  RankInput in = MakeInput(c, 0, 8, 3);
  DispatchOutput out;
  const absl::Status refused =
      absl::InvalidArgumentError("x, topk_idx and topk_weights must be non-null");
  EXPECT_EQ(group.ep(0).Dispatch({nullptr, in.topk_idx.data(), in.topk_w.data(), 8, c.hidden, 0,
                                  plan.header()},
                                 out),
            refused);
  EXPECT_EQ(group.ep(0).Dispatch(
                {in.x.data(), nullptr, in.topk_w.data(), 8, c.hidden, 0, plan.header()}, out),
            refused);
  EXPECT_EQ(group.ep(0).Dispatch(
                {in.x.data(), in.topk_idx.data(), nullptr, 8, c.hidden, 0, plan.header()}, out),
            refused);
  EXPECT_TRUE(PeerArenaBytes(group) == before);
}

// Combine takes the output of this rank's last dispatch only: an earlier call's output (a
// caller that kept two) or another rank's is refused, as are missing buffers (no y for the
// rows received, no out for the tokens sent), and the right call then serves the step.
TEST(HostEpErrorTest, CombineRefusesAnOutputOtherThanTheLastDispatchsOrNoBuffers) {
  Group group(SmallConfig(Protocol::kUbep));
  const EpConfig& c = group.config();
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<DispatchOutput> outs(c.num_ranks);
  std::vector<absl::Status> stale(c.num_ranks), foreign(c.num_ranks), no_y(c.num_ranks),
      no_out(c.num_ranks), right(c.num_ranks);
  std::vector<int> rows(c.num_ranks);
  std::barrier dispatched(c.num_ranks);
  group.RunAll([&](int r) {
    RankInput in = MakeInput(c, r, 4, 3);
    const DispatchInput args{in.x.data(), in.topk_idx.data(), in.topk_w.data(), 4,
                             c.hidden,    0,                 plan.header()};
    std::vector<float> out(4 * c.hidden);
    DispatchOutput first;
    ASSERT_TRUE(group.ep(r).Dispatch(args, first).ok());
    std::vector<float> y(first.recv_x.size() / sizeof(float), 1.0f);
    ASSERT_TRUE(group.ep(r).Combine(first, y.data(), out.data()).ok());
    const bool ok = group.ep(r).Dispatch(args, outs[r]).ok();
    dispatched.arrive_and_wait();  // Every rank's output is written before any reads another's.
    ASSERT_TRUE(ok);
    stale[r] = group.ep(r).Combine(first, y.data(), out.data());
    foreign[r] = group.ep(r).Combine(outs[(r + 1) % c.num_ranks], y.data(), out.data());
    std::vector<float> y2(outs[r].recv_x.size() / sizeof(float), 1.0f);
    rows[r] = outs[r].num_rows();
    no_y[r] = group.ep(r).Combine(outs[r], nullptr, out.data());
    no_out[r] = group.ep(r).Combine(outs[r], y2.data(), nullptr);
    right[r] = group.ep(r).Combine(outs[r], y2.data(), out.data());
  });
  for (int r = 0; r < c.num_ranks; ++r) {
    const absl::Status refused = absl::InvalidArgumentError(
        "combine: the dispatch output is not of this rank's last dispatch (call 2)");
    EXPECT_EQ(stale[r], refused) << "rank " << r;
    EXPECT_EQ(foreign[r], refused) << "rank " << r;
    EXPECT_GT(rows[r], 0) << "rank " << r;
    const absl::Status no_buffers = absl::InvalidArgumentError(
        "combine: y (with rows received) and out (with tokens sent) must be non-null");
    EXPECT_EQ(no_y[r], no_buffers) << "rank " << r;
    EXPECT_EQ(no_out[r], no_buffers) << "rank " << r;
    EXPECT_EQ(right[r], absl::OkStatus()) << "rank " << r;
  }
}

// The load seqlock: a reader racing the owner always sees counters that are exactly the
// dispatches it is told they cover (each dispatch adds i + 1 to slot i).
TEST(LoadCountersTest, AReaderSeesCountersWithExactlyTheDispatchesTheyCover) {
  const EpConfig c = SmallConfig(Protocol::kUbep);
  const ArenaLayout layout(c);
  std::vector<uint64_t> words(layout.total_bytes / sizeof(uint64_t) + 1, 0);
  auto* arena = reinterpret_cast<std::byte*>(words.data());
  const int S = c.slots_per_rank, layer = c.num_layers - 1;
  std::vector<int32_t> added(S);
  for (int i = 0; i < S; ++i) added[i] = i + 1;
  constexpr uint64_t kDispatches = 20000;
  std::thread owner([&] {
    for (uint64_t n = 0; n < kDispatches; ++n) AddLayerLoad(arena, layout, S, layer, added.data());
  });
  std::vector<uint64_t> counters(S);
  uint64_t last = 0;
  while (last < kDispatches) {
    absl::StatusOr<uint64_t> n = ReadLayerLoad(arena, layout, S, layer, counters.data(), absl::Seconds(10));
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_GE(*n, last);
    for (int i = 0; i < S; ++i) ASSERT_EQ(counters[i], *n * (i + 1)) << "slot " << i << " after " << *n;
    last = *n;
  }
  owner.join();
  // An owner stopped half-way (odd sequence): the reader gives up with the reason.
  reinterpret_cast<uint64_t*>(arena + layout.load_seq)[layer] += 1;
  EXPECT_EQ(ReadLayerLoad(arena, layout, S, layer, counters.data(), absl::Milliseconds(5)).status(),
            absl::DeadlineExceededError(absl::StrCat(
                "load counters of layer ", layer, " kept changing for 5ms (sequence ",
                2 * kDispatches + 1, "): their owner stopped mid-update")));
  // The rank's next process adds on: the word is even again, and readable, with the stopped
  // update counted as one dispatch (it may have added part of its counts).
  AddLayerLoad(arena, layout, S, layer, added.data());
  EXPECT_EQ(reinterpret_cast<uint64_t*>(arena + layout.load_seq)[layer], 2 * kDispatches + 4);
  absl::StatusOr<uint64_t> n = ReadLayerLoad(arena, layout, S, layer, counters.data(), absl::Milliseconds(5));
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, kDispatches + 2);
  for (int i = 0; i < S; ++i) EXPECT_EQ(counters[i], (kDispatches + 1) * (i + 1)) << "slot " << i;
}

}  // namespace
}  // namespace ubep::kernels
