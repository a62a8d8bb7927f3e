#include "examples/moe_serving/step_log.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace ubep::example {
namespace {

constexpr absl::string_view kOutOfStep = " (out of step): ";

}  // namespace

std::string ServedStepLine(uint64_t step, uint64_t generation, uint64_t plan_version,
                           double max_rel_err, bool ok) {
  return absl::StrFormat("step %d generation %d plan %d max_rel_err %.3g %s", step, generation,
                         plan_version, max_rel_err, ok ? "ok" : "MISMATCH");
}

std::string DroppedStepLine(uint64_t step, StepOutcome outcome, absl::string_view why) {
  return absl::StrCat("dropped step ", step,
                      outcome == StepOutcome::kDroppedOutOfStep ? kOutOfStep : ": ", why);
}

std::optional<StepLine> ParseStepLine(absl::string_view line) {
  StepLine out;
  const bool dropped = absl::ConsumePrefix(&line, "dropped ");
  if (!absl::ConsumePrefix(&line, "step ")) return std::nullopt;
  const size_t digits = line.find_first_not_of("0123456789");
  if (digits == 0 || digits == absl::string_view::npos ||
      !absl::SimpleAtoi(line.substr(0, digits), &out.step)) {
    return std::nullopt;
  }
  line.remove_prefix(digits);
  if (!dropped) {
    // "step N generation ... ok" or "... MISMATCH": a line cut short is neither.
    if (!absl::StartsWith(line, " generation ")) return std::nullopt;
    out.mismatch = absl::EndsWith(line, " MISMATCH");
    if (!out.mismatch && !absl::EndsWith(line, " ok")) return std::nullopt;
    return out;
  }
  if (absl::StartsWith(line, kOutOfStep)) {
    out.outcome = StepOutcome::kDroppedOutOfStep;
  } else if (absl::StartsWith(line, ": ")) {
    out.outcome = StepOutcome::kDroppedOverCapacity;
  } else {
    return std::nullopt;
  }
  return out;
}

AfterFailure AfterFailedStep(const absl::Status& status) {
  if (absl::IsResourceExhausted(status) || absl::IsAborted(status)) return AfterFailure::kDropStep;
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status) ||
      absl::IsInternal(status)) {
    return AfterFailure::kRejoin;
  }
  return AfterFailure::kStop;
}

}  // namespace ubep::example
