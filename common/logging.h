// Minimal leveled logging and CHECKs (Debian's Abseil 20220623 ships no absl/log).
//
//   UBEP_LOG(INFO) << "attached rank " << rank;
//   UBEP_CHECK(slots > 0) << "topology was validated";   // programmer errors crash
//
// A line is written to stderr in one write(2): "I1130 08:55:05.123456 file.cc:42] message".
// Thread-safe. UBEP_LOG_LEVEL (0=INFO, 1=WARNING, 2=ERROR) in the environment raises the floor.
#ifndef UBEP_COMMON_LOGGING_H_
#define UBEP_COMMON_LOGGING_H_

#include <sstream>

namespace ubep::internal {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Collects one log line and emits it when destroyed; kFatal aborts after writing.
class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;

  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Swallows the stream of a log statement below the level floor.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

bool ShouldLog(LogSeverity severity);

}  // namespace ubep::internal

#define UBEP_LOG_SEVERITY_INFO ::ubep::internal::LogSeverity::kInfo
#define UBEP_LOG_SEVERITY_WARNING ::ubep::internal::LogSeverity::kWarning
#define UBEP_LOG_SEVERITY_ERROR ::ubep::internal::LogSeverity::kError
#define UBEP_LOG_SEVERITY_FATAL ::ubep::internal::LogSeverity::kFatal

#define UBEP_LOG(severity)                                                  \
  !::ubep::internal::ShouldLog(UBEP_LOG_SEVERITY_##severity)                \
      ? (void)0                                                             \
      : ::ubep::internal::LogVoidify() &                                    \
            ::ubep::internal::LogMessage(__FILE__, __LINE__,                \
                                         UBEP_LOG_SEVERITY_##severity)      \
                .stream()

#define UBEP_CHECK(condition)                                                 \
  (condition) ? (void)0                                                       \
              : ::ubep::internal::LogVoidify() &                              \
                    ::ubep::internal::LogMessage(__FILE__, __LINE__,          \
                                                 UBEP_LOG_SEVERITY_FATAL)     \
                            .stream()                                         \
                        << "Check failed: " #condition " "

#endif  // UBEP_COMMON_LOGGING_H_
