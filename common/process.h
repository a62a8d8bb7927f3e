// Process: a child process started with posix_spawn, its stdout and stderr appended to a file;
// wait with a timeout, signal it; a Process still running at destruction is killed (SIGKILL).
// Used by ubep-local and the integration tests. Thread-compatible.
#ifndef UBEP_COMMON_PROCESS_H_
#define UBEP_COMMON_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

extern char** environ;

namespace ubep {

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
    spawn_error_ = posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ);
    if (spawn_error_ != 0) pid_ = -1;
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
  // Why the process did not start (an errno: ENOENT for a missing binary), or 0.
  int spawn_error() const { return spawn_error_; }
  bool running() const { return pid_ > 0 && !status_.has_value(); }
  void Signal(int sig) const {
    if (running()) kill(pid_, sig);
  }

  // The exit code (128 + signal when killed by one), or nullopt at the timeout.
  std::optional<int> Wait(absl::Duration timeout) {
    if (status_.has_value() || pid_ <= 0) return status_;
    // On the steady clock: a step of the wall clock neither cuts the wait short nor stretches it.
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(
                              std::min(timeout, absl::Hours(24 * 365)));
    while (true) {
      int raw = 0;
      const pid_t r = waitpid(pid_, &raw, WNOHANG);
      if (r == pid_) {
        status_ = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
        return status_;
      }
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  pid_t pid_ = -1;
  int spawn_error_ = 0;
  std::optional<int> status_;
};

}  // namespace ubep

#endif  // UBEP_COMMON_PROCESS_H_
