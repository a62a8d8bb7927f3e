// A local UBEP cluster for the integration tests: ubep-balancer, ubepd and client processes
// (ubep-moe-example) on loopback, with helpers to read their logs and metrics.
#ifndef UBEP_TESTS_INTEGRATION_CLUSTER_H_
#define UBEP_TESTS_INTEGRATION_CLUSTER_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "common/http_get.h"
#include "tests/integration/process.h"
#include "tests/unit/test_util.h"

namespace ubep::test {

using ::ubep::HttpGet;

// Mean of every sample of `name` whose labels contain `label` (e.g. "when=\"measured\"").
inline double MeanOf(const std::string& exposition, const std::string& name,
                     const std::string& label = "") {
  double sum = 0;
  int n = 0;
  for (const absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (!absl::StartsWith(line, name + "{") || !absl::StrContains(line, label)) continue;
    const size_t space = line.rfind(' ');
    sum += std::stod(std::string(line.substr(space + 1)));
    ++n;
  }
  return n == 0 ? -1 : sum / n;
}

struct StepLine {
  uint64_t step, generation, plan;
  bool ok;
};

// Calls `parse` with the match of every line of `log` that `pattern` matches whole.
template <typename Parse>
void ForEachLine(const std::string& log, const std::regex& pattern, Parse parse) {
  for (const absl::string_view line : absl::StrSplit(log, '\n')) {
    const std::string s(line);
    std::smatch m;
    if (std::regex_match(s, m, pattern)) parse(m);
  }
}

// "step S generation G plan V max_rel_err E ok|MISMATCH" lines of a client log.
inline std::vector<StepLine> StepLines(const std::string& log) {
  static const std::regex kStep(
      R"(^step (\d+) generation (\d+) plan (\d+) max_rel_err (\S+) (ok|MISMATCH)$)");
  std::vector<StepLine> out;
  ForEachLine(log, kStep, [&](const std::smatch& m) {
    out.push_back({std::stoull(m[1]), std::stoull(m[2]), std::stoull(m[3]), m[5] == "ok"});
  });
  return out;
}

struct DroppedLine {
  uint64_t step;
  int rank;
  std::string phase;  // "dispatch" or "combine".
  uint32_t call;
  std::string error;  // The status message, whole.
};

// "dropped step S: <status message>" lines of a client log: a step whose call went over some
// rank's receive capacity (ubepd --max_recv_rows); the message starts "rank R, PHASE call C: ".
inline std::vector<DroppedLine> DroppedLines(const std::string& log) {
  static const std::regex kDropped(
      R"(^dropped step (\d+): (rank (\d+), (dispatch|combine) call (\d+): .*)$)");
  std::vector<DroppedLine> out;
  ForEachLine(log, kDropped, [&](const std::smatch& m) {
    out.push_back({std::stoull(m[1]), std::stoi(m[3]), m[4],
                   static_cast<uint32_t>(std::stoul(m[5])), m[2]});
  });
  return out;
}

// Waits for a --ready_file and returns its JSON.
inline nlohmann::json ReadyFile(const std::string& path, const std::string& log) {
  if (!WaitFor([&] { return std::filesystem::exists(path); }, absl::Seconds(30))) {
    ADD_FAILURE() << "no ready file " << path << "\n" << ReadFile(log);
    return nlohmann::json::object();
  }
  return nlohmann::json::parse(ReadFile(path));
}

}  // namespace ubep::test

#endif  // UBEP_TESTS_INTEGRATION_CLUSTER_H_
