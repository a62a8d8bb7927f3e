// Real processes for the integration tests: spawn a binary with its output in a file, wait
// for it with a timeout, signal it; a Process still running at destruction is killed.
#ifndef UBEP_TESTS_INTEGRATION_PROCESS_H_
#define UBEP_TESTS_INTEGRATION_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

extern char** environ;

namespace ubep::test {

inline std::string BinaryPath(const std::string& name) {
  return std::string(UBEP_BINARY_DIR) + "/bin/" + name;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Polls `ready()` every 10 ms until it holds or `timeout` passes; returns whether it held.
template <typename Predicate>
bool WaitFor(Predicate ready, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!ready()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

class Process {
 public:
  // Starts argv[0] with stdout and stderr appended to `output` (when not empty).
  explicit Process(std::vector<std::string> argv, const std::string& output = "") {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (!output.empty()) {
      posix_spawn_file_actions_addopen(&actions, 1, output.c_str(),
                                       O_WRONLY | O_CREAT | O_APPEND, 0644);
      posix_spawn_file_actions_adddup2(&actions, 1, 2);
    }
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  ~Process() {
    if (running()) {
      kill(pid_, SIGKILL);
      Wait(absl::Seconds(10));
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !status_.has_value(); }
  void Signal(int sig) const {
    if (running()) kill(pid_, sig);
  }

  // The exit code (128 + signal when killed by one), or nullopt at the timeout.
  std::optional<int> Wait(absl::Duration timeout) {
    if (status_.has_value() || pid_ <= 0) return status_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int raw = 0;
      const pid_t r = waitpid(pid_, &raw, WNOHANG);
      if (r == pid_) {
        status_ = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
        return status_;
      }
      if (absl::Now() > deadline) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

}  // namespace ubep::test

#endif  // UBEP_TESTS_INTEGRATION_PROCESS_H_
