// The step lines ubep-moe-example logs and ubep-local reads, written and read here so that the
// two agree:
//   step 12 generation 1 plan 1 max_rel_err 1.9e-07 ok
//   dropped step 14: rank 1, combine call 57: rank 3 was routed 300 rows ...
//   dropped step 15 (out of step): rank 0, dispatch call 60: pairs layer 0 of step 15 ...
// A step is served (its result compared with the reference: ok or MISMATCH), dropped over a
// receive capacity (ResourceExhausted: some rank was routed more rows than it takes), or
// dropped out of step (Aborted: the ranks' calls were of different layers or steps, which a
// group whose ranks run the same steps never sees unless something is wrong).
#ifndef UBEP_EXAMPLES_MOE_SERVING_STEP_LOG_H_
#define UBEP_EXAMPLES_MOE_SERVING_STEP_LOG_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ubep::example {

enum class StepOutcome { kServed, kDroppedOverCapacity, kDroppedOutOfStep };

struct StepLine {
  uint64_t step = 0;
  StepOutcome outcome = StepOutcome::kServed;
  bool mismatch = false;  // Served, and its result differs from the reference.
};

std::string ServedStepLine(uint64_t step, uint64_t generation, uint64_t plan_version,
                           double max_rel_err, bool ok);
std::string DroppedStepLine(uint64_t step, StepOutcome outcome, absl::string_view why);

// What the example does after a step failed (docs/serving-integration.md, section 5).
enum class AfterFailure {
  kDropStep,  // Every rank's call failed alike (ResourceExhausted, Aborted): the group is in step.
  kRejoin,    // The group stopped (Unavailable, among them a peer's corrupt records, which the
              // group gave up on; DeadlineExceeded; Internal): Rejoin, or attach again when
              // ubepd is going.
  kStop,      // This process's fault, or memory ubepd wrote that is not as it left it
              // (DataLoss: a plan table, a slot map), which a Rejoin would read again.
};
AfterFailure AfterFailedStep(const absl::Status& status);

// The step line `line` is, or nullopt for any other line (errors, "done ...", a torn last
// line of a log being written).
std::optional<StepLine> ParseStepLine(absl::string_view line);

}  // namespace ubep::example

#endif  // UBEP_EXAMPLES_MOE_SERVING_STEP_LOG_H_
