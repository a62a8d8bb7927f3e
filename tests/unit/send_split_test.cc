// The ubep sender role's work split (send_split.h), which the host sender threads and the CUDA
// sender blocks share.
#include "kernels/common/send_split.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace ubep::kernels {
namespace {

TEST(SendSplitTest, SharesCoverEveryUnitOnceAndDifferByAtMostOne) {
  for (int64_t units : {0, 1, 7, 64, 1000, 1025}) {
    for (int senders : {1, 2, 3, 8, 24, 132}) {
      int64_t smallest = units, largest = 0;
      EXPECT_EQ(SplitBegin(units, senders, 0), 0);
      EXPECT_EQ(SplitBegin(units, senders, senders), units);
      for (int i = 0; i < senders; ++i) {
        const int64_t share = SplitBegin(units, senders, i + 1) - SplitBegin(units, senders, i);
        smallest = std::min(smallest, share);
        largest = std::max(largest, share);
      }
      EXPECT_LE(largest - smallest, 1) << units << " units, " << senders << " senders";
    }
  }
  // 10 units over 4 senders: 2, 3, 2, 3.
  EXPECT_EQ(SplitBegin(10, 4, 1), 2);
  EXPECT_EQ(SplitBegin(10, 4, 2), 5);
  EXPECT_EQ(SplitBegin(10, 4, 3), 7);
}

// The senders' shares of every batch, as HostEp::SendShare and RowKernel take them: each
// unit exactly once, any two senders within one unit of each other over the whole dispatch,
// and a unit handed over only once its token is counted.
TEST(SendSplitTest, BatchSharesCoverEveryUnitOnceAndDifferByAtMostOne) {
  for (int num_tokens : {0, 1, 31, 32, 33, 128, 511, 4096, 5000}) {
    // Token t has (t * 7) % 9 units (0 to 8: masked tokens, tokens on one rank, top-8).
    std::vector<int32_t> unit_begin(num_tokens + 1, 0);
    for (int t = 0; t < num_tokens; ++t) unit_begin[t + 1] = unit_begin[t] + (t * 7) % 9;
    const int64_t units = unit_begin[num_tokens];
    const int batches = NumBatches(num_tokens);
    EXPECT_LE(batches, kMaxSendBatches) << num_tokens;
    for (int senders : {1, 2, 3, 8, 32}) {
      std::vector<int> seen(units, 0);
      std::vector<int64_t> share(senders, 0);
      int64_t batch_begin = 0;
      for (int b = 0; b < batches; ++b) {
        const int last_token = std::min(num_tokens, (b + 1) * BatchTokens(num_tokens));
        const int64_t batch_end = BatchEnd(unit_begin[last_token], b + 1 == batches, senders);
        ASSERT_LE(batch_end, unit_begin[last_token]);  // Only counted units are handed over.
        ASSERT_GE(batch_end, batch_begin);
        for (int i = 0; i < senders; ++i) {
          const int64_t begin = ShareBegin(batch_begin, batch_end, senders, i);
          const int64_t end = ShareBegin(batch_begin, batch_end, senders, i + 1);
          for (int64_t u = begin; u < end; ++u) ++seen[u];
          share[i] += end - begin;
        }
        batch_begin = batch_end;
      }
      EXPECT_EQ(batch_begin, units) << num_tokens << " tokens, " << senders << " senders";
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), units);
      const auto [smallest, largest] = std::minmax_element(share.begin(), share.end());
      EXPECT_LE(*largest - *smallest, 1) << num_tokens << " tokens, " << senders << " senders";
    }
  }
  // 128 tokens (decode): 4 batches of 32; 4096 (prefill): 16 of 256.
  EXPECT_EQ(BatchTokens(128), 32);
  EXPECT_EQ(NumBatches(128), 4);
  EXPECT_EQ(BatchTokens(4096), 256);
  EXPECT_EQ(NumBatches(4096), 16);
  EXPECT_EQ(NumBatches(0), 0);
  // 10 units counted over 4 senders: 8 handed over, the last batch hands over all 10.
  EXPECT_EQ(BatchEnd(10, false, 4), 8);
  EXPECT_EQ(BatchEnd(10, true, 4), 10);
}

TEST(SendSplitTest, DestinationsAreVisitedFromTheNextRankAndTheSenderLast) {
  // One hop to every rank (near_ranks 0, or all of them): rank + 1, rank + 2, ..., rank.
  for (int near_ranks : {0, 4}) {
    const VisitOrder order(2, 4, near_ranks);
    EXPECT_EQ(order.Dest(0), 3);
    EXPECT_EQ(order.Dest(1), 0);
    EXPECT_EQ(order.Dest(2), 1);
    EXPECT_EQ(order.Dest(3), 2);
  }
  EXPECT_EQ(VisitOrder(0, 1, 0).Dest(0), 0);
  EXPECT_EQ(VisitOrder(0, 1, 0).Position(0), 0);
}

// 8 ranks in nodes of 4: rank 1 visits its node's 2, 3, 0 (after itself, wrapping) between
// the other node's 4 ranks, 3 near among 7 spread evenly; the other node's ranks start where
// rank 1's place in its node puts them (1 x 4 / 4 = far rank 1, i.e. rank 5).
TEST(SendSplitTest, NearAndFarDestinationsTakeTurns) {
  const VisitOrder order(1, 8, 4);
  std::vector<int> visits;
  for (int p = 0; p < 8; ++p) visits.push_back(order.Dest(p));
  EXPECT_EQ(visits, (std::vector<int>{5, 6, 2, 7, 3, 4, 0, 1}));
  // Rank 4 (first of its node) starts the far ranks at rank 0; rank 6 at rank 2.
  EXPECT_EQ(VisitOrder(4, 8, 4).Dest(0), 0);
  EXPECT_EQ(VisitOrder(6, 8, 4).Dest(0), 2);
  // Ranks of one node each cross to a different rank first.
  std::vector<int> first;
  for (int r = 0; r < 4; ++r) first.push_back(VisitOrder(r, 8, 4).Dest(0));
  EXPECT_EQ(first, (std::vector<int>{4, 5, 6, 7}));
}

// The largest group a configuration allows (2^17 ranks, half of them near): the far ranks'
// starting point is computed past 2^31, and the order is a permutation all the same.
TEST(SendSplitTest, TheVisitOrderOfTheLargestGroupsIsAPermutation) {
  const int R = 1 << 17;
  for (const int rank : {0, 65535, 65536 + 40000, R - 1}) {
    const VisitOrder order(rank, R, R / 2);
    std::vector<char> seen(R, 0);
    for (int p = 0; p < R; ++p) {
      const int d = order.Dest(p);
      ASSERT_GE(d, 0) << "rank " << rank << ", position " << p;
      ASSERT_LT(d, R) << "rank " << rank << ", position " << p;
      ASSERT_EQ(seen[d]++, 0) << "rank " << rank << " visits " << d << " twice";
      ASSERT_EQ(order.Position(d), p) << "rank " << rank;
    }
    EXPECT_EQ(order.Dest(R - 1), rank);
  }
}

// Every shape: the order is a permutation ending with the source, Position inverts Dest, and
// the near destinations are spread in proportion: of the first p positions,
// floor(p x near / (R - 1)) are near.
TEST(SendSplitTest, EveryVisitOrderIsAPermutationWithNearOnesInProportion) {
  for (int R = 1; R <= 24; ++R) {
    for (int near_ranks = 0; near_ranks <= R; ++near_ranks) {
      for (int rank = 0; rank < R; ++rank) {
        const VisitOrder order(rank, R, near_ranks);
        const int g = near_ranks == 0 ? R : near_ranks;
        const int begin = rank / g * g, end = std::min(R, begin + g);
        const int near = end - begin - 1;
        std::vector<int> seen(R, 0);
        int near_so_far = 0;
        for (int p = 0; p < R; ++p) {
          const int d = order.Dest(p);
          ASSERT_GE(d, 0);
          ASSERT_LT(d, R);
          ASSERT_EQ(order.Position(d), p) << R << " ranks, near " << near_ranks << ", rank " << rank;
          ++seen[d];
          if (p + 1 < R) {
            ASSERT_NE(d, rank);
            near_so_far += d >= begin && d < end;
            ASSERT_EQ(near_so_far, (p + 1) * near / (R - 1))
                << R << " ranks, near " << near_ranks << ", rank " << rank << ", position " << p;
          } else {
            ASSERT_EQ(d, rank);
          }
        }
        ASSERT_EQ(std::count(seen.begin(), seen.end(), 1), R);
      }
    }
  }
}

TEST(SendSplitTest, TokenOfUnitSkipsTokensWithoutUnits) {
  // Tokens 0..5 with 2, 0, 3, 0, 0, 1 units.
  const std::vector<int32_t> unit_begin = {0, 2, 2, 5, 5, 5, 6};
  const std::vector<int> want = {0, 0, 2, 2, 2, 5};
  for (int u = 0; u < 6; ++u) EXPECT_EQ(TokenOfUnit(unit_begin.data(), 6, u), want[u]) << u;
}

}  // namespace
}  // namespace ubep::kernels
