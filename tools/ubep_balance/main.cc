// ubep-balance: offline expert placement (see balance_cli.h).
#include <iostream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "tools/ubep_balance/balance_cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  ubep::SystemClock clock;
  const int status = ubep::balancer::RunBalanceCli(args, std::cout, std::cerr, clock);
  // Output cut short (a full disk, an I/O error) is a failure, not a plan written.
  std::cout.flush();
  if (!std::cout) {
    std::cerr << "ubep-balance: cannot write the output\n";
    return status != 0 ? status : 1;
  }
  return status;
}
