// The MoE example's check of a step against its float64 reference (examples/moe_serving).
#include "examples/moe_serving/moe_model.h"
#include "examples/moe_serving/step_log.h"

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
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


// The step lines ubep-moe-example writes are what ubep-local reads back: served (ok or
// MISMATCH), dropped over a capacity and dropped out of step told apart; other lines, and a
// line cut short as the last of a log being written, are none.
TEST(StepLogTest, TheLinesTheExampleWritesAreReadBackAsTheyWereMeant) {
  struct Case {
    std::string line;
    std::optional<uint64_t> step;
    StepOutcome outcome = StepOutcome::kServed;
    bool mismatch = false;
  };
  const std::vector<Case> cases = {
      {ServedStepLine(12, 1, 3, 1.9e-7, true), 12},
      {ServedStepLine(13, 2, 4, 0.5, false), 13, StepOutcome::kServed, true},
      {DroppedStepLine(14, StepOutcome::kDroppedOverCapacity,
                                      "rank 1, combine call 57: rank 3 was routed 300 rows"),
       14, StepOutcome::kDroppedOverCapacity},
      {DroppedStepLine(18446744073709551615u, StepOutcome::kDroppedOutOfStep,
                                      "rank 0, dispatch call 1: pairs layer 0 of step 0"),
       18446744073709551615u, StepOutcome::kDroppedOutOfStep},
      {"error step 13: rank 1: rank 2 left the group", std::nullopt},
      {"done steps 100 failed 0 dropped 1", std::nullopt},
      {"step 12 generation 1 plan 1 max_rel_er", std::nullopt},
      {"step 12", std::nullopt},
      {"dropped step 15", std::nullopt},
      {"dropped step 15 (out of", std::nullopt},
      {"step x generation 1 plan 1 max_rel_err 0 ok", std::nullopt},
      {"step 18446744073709551616 generation 1 plan 1 max_rel_err 0 ok", std::nullopt},
  };
  EXPECT_EQ(cases[0].line, "step 12 generation 1 plan 3 max_rel_err 1.9e-07 ok");
  EXPECT_EQ(cases[1].line, "step 13 generation 2 plan 4 max_rel_err 0.5 MISMATCH");
  EXPECT_EQ(cases[2].line,
            "dropped step 14: rank 1, combine call 57: rank 3 was routed 300 rows");
  EXPECT_EQ(cases[3].line,
            "dropped step 18446744073709551615 (out of step): rank 0, dispatch call 1: pairs "
            "layer 0 of step 0");
  for (const Case& c : cases) {
    const std::optional<StepLine> parsed = ParseStepLine(c.line);
    ASSERT_EQ(parsed.has_value(), c.step.has_value()) << c.line;
    if (!parsed) continue;
    EXPECT_EQ(parsed->step, *c.step) << c.line;
    EXPECT_EQ(parsed->outcome, c.outcome) << c.line;
    EXPECT_EQ(parsed->mismatch, c.mismatch) << c.line;
  }
}

// After a failed step: a call that failed on every rank alike drops the step; a stopped
// group (a peer's corrupt records among the reasons: Unavailable) is rejoined; memory of
// ubepd's gone bad (DataLoss: a plan table), which a Rejoin would read again, stops the
// process, as any other error does.
TEST(StepLogTest, WhatFollowsAFailedStep) {
  EXPECT_EQ(AfterFailedStep(absl::ResourceExhaustedError("over")), AfterFailure::kDropStep);
  EXPECT_EQ(AfterFailedStep(absl::AbortedError("out of step")), AfterFailure::kDropStep);
  EXPECT_EQ(AfterFailedStep(absl::UnavailableError("rank 1's records")), AfterFailure::kRejoin);
  EXPECT_EQ(AfterFailedStep(absl::DeadlineExceededError("late")), AfterFailure::kRejoin);
  EXPECT_EQ(AfterFailedStep(absl::InternalError("combine")), AfterFailure::kRejoin);
  EXPECT_EQ(AfterFailedStep(absl::DataLossError("plan v1 is corrupt")), AfterFailure::kStop);
  EXPECT_EQ(AfterFailedStep(absl::InvalidArgumentError("expert 300")), AfterFailure::kStop);
  EXPECT_EQ(AfterFailedStep(absl::FailedPreconditionError("no BeginStep")), AfterFailure::kStop);
}

}  // namespace
}  // namespace ubep::example
