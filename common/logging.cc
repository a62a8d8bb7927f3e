#include "common/logging.h"

#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace ubep::internal {
namespace {

int LevelFloor() {
  static const int floor = [] {
    const char* env = std::getenv("UBEP_LOG_LEVEL");
    return env == nullptr ? 0 : std::atoi(env);
  }();
  return floor;
}

char SeverityLetter(LogSeverity severity) {
  switch (severity) {
    case LogSeverity::kInfo: return 'I';
    case LogSeverity::kWarning: return 'W';
    case LogSeverity::kError: return 'E';
    case LogSeverity::kFatal: return 'F';
  }
  return '?';
}

}  // namespace

bool ShouldLog(LogSeverity severity) {
  return static_cast<int>(severity) >= LevelFloor() || severity == LogSeverity::kFatal;
}

LogMessage::LogMessage(const char* file, int line, LogSeverity severity)
    : severity_(severity) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm local;
  localtime_r(&tv.tv_sec, &local);
  char prefix[64];
  std::snprintf(prefix, sizeof(prefix), "%c%02d%02d %02d:%02d:%02d.%06ld ", SeverityLetter(severity),
                local.tm_mon + 1, local.tm_mday, local.tm_hour, local.tm_min, local.tm_sec,
                static_cast<long>(tv.tv_usec));
  const char* base = std::strrchr(file, '/');
  stream_ << prefix << (base ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string line = stream_.str();
  // One write so lines from concurrent threads and processes do not interleave.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace ubep::internal
