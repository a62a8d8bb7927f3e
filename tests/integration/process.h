// Real processes for the integration tests: spawn a binary with its output in a file, wait
// for it with a timeout, signal it; a Process still running at destruction is killed.
#ifndef UBEP_TESTS_INTEGRATION_PROCESS_H_
#define UBEP_TESTS_INTEGRATION_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/process.h"
#include "tests/wait_for.h"

namespace ubep::test {

// The project's binaries: those of this build, or of UBEP_BIN_DIR when set (test binaries
// run away from their build tree, as bench/gpu/run.sh does with a pack from pack.sh).
inline std::string BinaryPath(const std::string& name) {
  const char* dir = std::getenv("UBEP_BIN_DIR");
  if (dir != nullptr && *dir != '\0') return std::string(dir) + "/" + name;
  return std::string(UBEP_BINARY_DIR) + "/bin/" + name;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

using ::ubep::Process;

}  // namespace ubep::test

#endif  // UBEP_TESTS_INTEGRATION_PROCESS_H_
