// The shared rules of flag-in-granule rows (kernels/common/flagged_rows.h): which calls use
// them, where their rows lie, and that a scrub tag stays clear of the epochs that follow it.
#include "kernels/common/flagged_rows.h"

#include "gtest/gtest.h"

namespace ubep::kernels {
namespace {

TEST(FlaggedRowsTest, OnlyUbepCallsWithinTheLimitAndWholeGranulesAreFlagged) {
  EXPECT_TRUE(FlaggedRows(/*ubep=*/true, 128, 128, 14336));
  EXPECT_FALSE(FlaggedRows(/*ubep=*/false, 128, 128, 14336));  // bsp
  EXPECT_FALSE(FlaggedRows(true, 129, 128, 14336));             // Over the limit.
  EXPECT_FALSE(FlaggedRows(true, 0, 128, 14336));               // Nothing to send.
  EXPECT_FALSE(FlaggedRows(true, 8, 128, 12));                  // Not whole granules.
  EXPECT_FALSE(FlaggedRows(true, 8, 0, 14336));                 // Off.
}

TEST(FlaggedRowsTest, FlaggedRowsLieAfterThePlainOnesAtTwiceTheirSize) {
  // 48 plain rows of 288 bytes, then the flagged ones, 576 bytes each.
  EXPECT_EQ(LandingRowOffset(288, 48, /*flagged=*/false, 5), 5u * 288);
  EXPECT_EQ(LandingRowOffset(288, 48, /*flagged=*/true, 0), 48u * 288);
  EXPECT_EQ(LandingRowOffset(288, 48, /*flagged=*/true, 5), 48u * 288 + 5u * 576);
}

TEST(FlaggedRowsTest, TheCountWordCarriesTheFormatApartFromTheCount) {
  EXPECT_EQ(RecordCount(37u | kFlaggedCount), 37u);
  EXPECT_TRUE(CountIsFlagged(37u | kFlaggedCount));
  EXPECT_FALSE(CountIsFlagged(37u));
  EXPECT_EQ(GranuleTag(Granule(0xDEADBEEF, 7)), 7u);
  EXPECT_EQ(GranuleData(Granule(0xDEADBEEF, 7)), 0xDEADBEEFu);
}

// A scrub at epoch e writes ScrubTag(e); the next scrub comes kTagScrubPeriod calls later, and
// no epoch in between (nor the next scrub's) equals the tag, across the wrap of 2^32 too.
TEST(FlaggedRowsTest, AScrubTagIsNoEpochBeforeTheNextScrub) {
  for (const uint32_t e : {kTagScrubPeriod, 2 * kTagScrubPeriod, 3 * kTagScrubPeriod, 0u}) {
    ASSERT_TRUE(TagScrubDue(e)) << e;
    const uint32_t tag = ScrubTag(e);
    EXPECT_NE(tag, e);
    for (const uint32_t k : {1u, 2u, kTagScrubPeriod / 2, kTagScrubPeriod - 1, kTagScrubPeriod}) {
      EXPECT_NE(static_cast<uint32_t>(e + k), tag) << "scrub at " << e << ", epoch +" << k;
    }
    // The distance is half the epoch space, the farthest any value can be.
    EXPECT_EQ(static_cast<uint32_t>(tag - e), 0x80000000u);
  }
  EXPECT_FALSE(TagScrubDue(kTagScrubPeriod + 1));
  EXPECT_FALSE(TagScrubDue(1));
}

}  // namespace
}  // namespace ubep::kernels
