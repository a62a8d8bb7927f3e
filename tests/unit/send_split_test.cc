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
  EXPECT_EQ(VisitDest(2, 0, 4), 3);
  EXPECT_EQ(VisitDest(2, 1, 4), 0);
  EXPECT_EQ(VisitDest(2, 3, 4), 2);
  for (int rank = 0; rank < 5; ++rank) {
    for (int d = 0; d < 5; ++d) EXPECT_EQ(VisitDest(rank, VisitPosition(rank, d, 5), 5), d);
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
