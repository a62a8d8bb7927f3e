// Process: a child process (fork and exec), its stdout and stderr appended to a file;
// wait with a timeout, signal it; a Process still running at destruction is killed (SIGKILL).
// Used by ubep-local and the integration tests. Thread-compatible.
#ifndef UBEP_COMMON_PROCESS_H_
#define UBEP_COMMON_PROCESS_H_

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
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
  // Starts argv[0] (a path: no PATH search) with stdout and stderr appended to `output` (when
  // not empty). The child is sent SIGKILL when the thread that started it ends (Linux's
  // PR_SET_PDEATHSIG), so nothing outlives a parent killed without a chance to clean up
  // (SIGKILL, a crash): start processes from a thread that outlives them (the main thread).
  explicit Process(std::vector<std::string> argv, const std::string& output = "") {
    // Everything the child needs is made before the fork: between fork and exec it makes only
    // system calls (the parent may have other threads, whose locks the child inherits held).
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    const pid_t parent = getpid();
    int report[2];  // The child's errno when it cannot exec; closed unwritten by the exec.
    if (pipe2(report, O_CLOEXEC) != 0) {
      spawn_error_ = errno;
      return;
    }
    // Every signal blocked across the fork: one that comes between fork and exec must not run
    // the parent's handler in the child (ubep-local's SIGINT handler would take a Ctrl-C meant
    // for the child). The child sets the handled ones back to their defaults, then unblocks:
    // a signal pending by then acts on it as on the program it becomes.
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    pid_ = fork();
    if (pid_ != 0) pthread_sigmask(SIG_SETMASK, &before, nullptr);
    if (pid_ < 0) {
      spawn_error_ = errno;
      close(report[0]);
      close(report[1]);
      return;
    }
    if (pid_ == 0) {
      for (int sig = 1; sig < NSIG; ++sig) {
        struct sigaction action;
        if (sigaction(sig, nullptr, &action) == 0 && action.sa_handler != SIG_DFL &&
            action.sa_handler != SIG_IGN) {
          action = {};
          action.sa_handler = SIG_DFL;
          sigaction(sig, &action, nullptr);
        }
      }
      sigprocmask(SIG_SETMASK, &before, nullptr);
      int error = 0;
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
        error = errno;
      } else if (getppid() != parent) {
        _exit(127);  // The parent died before the line above took effect.
      } else if (!output.empty()) {
        // Close-on-exec, so that it is open after the exec as stdout and stderr only (were fd
        // 0 closed in the parent, it would otherwise stay open as the child's stdin).
        const int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0) error = errno;
        for (int target = 1; error == 0 && target <= 2; ++target) {
          // dup2 onto itself would keep the close-on-exec flag: cleared instead.
          if ((fd == target ? fcntl(fd, F_SETFD, 0) : dup2(fd, target)) < 0) error = errno;
        }
      }
      if (error == 0) {
        execve(args[0], args.data(), environ);
        error = errno;
      }
      while (write(report[1], &error, sizeof(error)) < 0 && errno == EINTR) {
      }
      _exit(127);
    }
    close(report[1]);
    int error = 0;
    ssize_t n;
    while ((n = read(report[0], &error, sizeof(error))) < 0 && errno == EINTR) {
    }
    close(report[0]);
    if (n == static_cast<ssize_t>(sizeof(error))) {  // It did not exec: reap it.
      spawn_error_ = error;
      while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
    }
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

  // The exit code (128 + signal when killed by one), or nullopt at the timeout; -1 where the
  // process was reaped without this one (SIGCHLD ignored: the kernel reaps every child), its
  // code lost.
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
      if (r < 0 && errno == ECHILD) {  // Gone: its pid may be another process's by now.
        status_ = -1;
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
