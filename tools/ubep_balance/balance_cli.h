// The `ubep-balance` command: plan, eval and replay expert placements offline, on SGLang
// expert-distribution files. main.cc only forwards argv here, so tests run it in-process.
//
//   ubep-balance plan --load FILE --ranks R --nodes N --slots-per-rank S [--groups G]
//                     [--policy eplb|eplb-global|ubep] [--previous PLAN] [--migration-budget B]
//                     [--seed X] --out PLAN.json
//   ubep-balance eval --plan PLAN.json --load FILE [--ranks R --nodes N]
//   ubep-balance replay --load FILE... --ranks R --nodes N --slots-per-rank S --policy P
//                       --steps N --rebalance-every K --window W --seed X [--baseline P]
//
// Exit codes: 0 success, 2 bad input or usage (one line on stderr naming the file, field and
// problem), 1 internal error. Thread-compatible.
#ifndef UBEP_TOOLS_UBEP_BALANCE_BALANCE_CLI_H_
#define UBEP_TOOLS_UBEP_BALANCE_BALANCE_CLI_H_

#include <ostream>
#include <string>
#include <vector>

#include "common/clock.h"

namespace ubep::balancer {

// `args` excludes the program name.
int RunBalanceCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                  ClockInterface& clock);

}  // namespace ubep::balancer

#endif  // UBEP_TOOLS_UBEP_BALANCE_BALANCE_CLI_H_
