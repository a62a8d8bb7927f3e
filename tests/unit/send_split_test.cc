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
