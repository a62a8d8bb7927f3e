// The MoE example's check of a step against its float64 reference (examples/moe_serving).
#include "examples/moe_serving/moe_model.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace ubep::example {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A NaN output row is the worst error wherever it is among the rows: the first of two, whose
// second is exact, as much as the last.
TEST(MoeModelTest, ANaNRowAnywhereIsTheWorstError) {
  const std::vector<double> want = {1, 2, 3, 4};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(MaxRelativeError({nan, 2, 3, 4}, want, 2)));
  EXPECT_TRUE(std::isnan(MaxRelativeError({1, 2, 3, nan}, want, 2)));
  EXPECT_EQ(MaxRelativeError({1, 2, 3, 4}, want, 2), 0.0);
  // Row 1 off by 5 in 3, 4: sqrt(25 / 25) = 1.
  EXPECT_DOUBLE_EQ(MaxRelativeError({1, 2, 3, 9}, want, 2), 1.0);
}

// Across the layers of a step: once a layer's error is NaN, a later finite one keeps it NaN.
TEST(MoeModelTest, TheWorseOfTwoErrorsKeepsANaN) {
  EXPECT_TRUE(std::isnan(WorseError(kNaN, 0.5)));
  EXPECT_TRUE(std::isnan(WorseError(0.5, kNaN)));
  EXPECT_EQ(WorseError(0.25, 0.5), 0.5);
  EXPECT_EQ(WorseError(0.5, 0.25), 0.5);
}

}  // namespace
}  // namespace ubep::example
