// Helpers shared by the tests: a temporary directory that cleans up after itself and the
// bundled trace files.
#ifndef UBEP_TESTS_UNIT_TEST_UTIL_H_
#define UBEP_TESTS_UNIT_TEST_UTIL_H_

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "balancer/core/planner.h"
#include "gtest/gtest.h"

namespace ubep::test {

// A fresh directory under TEST_TMPDIR or /tmp, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(base ? base : "/tmp") + "/ubep-test-XXXXXX";
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Write(const std::string& name, const std::string& contents) const {
    const std::string file = path_ + "/" + name;
    std::ofstream(file) << contents;
    return file;
  }

 private:
  std::string path_;
};

// The value of one sample line "name{labels} value" in a Prometheus exposition; -1 when
// absent.
inline double Sample(const std::string& exposition, const std::string& series) {
  for (const absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      return std::stod(std::string(line.substr(series.size() + 1)));
    }
  }
  return -1;
}

inline std::string TracePath(const std::string& name) {
  return std::string(UBEP_SOURCE_DIR) + "/data/traces/deepseek-v3/" + name;
}

// A valid ubep plan of 2 layers (model layers 3 and 4) x 6 experts on 4 ranks x 2 slots.
inline balancer::Plan SmallPlan() {
  balancer::LoadMatrix load(2, 6);
  for (int e = 0; e < 6; ++e) {
    load.at(0, e) = 1 + e * e;
    load.at(1, e) = 30 - e;
  }
  load.set_layer_ids({3, 4});
  return *balancer::ComputePlan(load, balancer::Topology{4, 2, 2, 1}, nullptr,
                                {.policy = balancer::Policy::kUbep});
}

// 2 ranks x 2 slots, 2 experts each on both ranks, rank 0 excluded (its slots at share 0):
// one layer, model layer `layer_id`, plan version `version`.
inline balancer::Plan PlanExcludingRank0(uint64_t version, int layer_id) {
  balancer::Plan plan;
  plan.version = version;
  plan.topology = balancer::Topology{2, 1, 2, 1};
  plan.num_experts = 2;
  plan.layer_ids = {layer_id};
  plan.layers.push_back({{0, 1, 0, 1}, {0, 0, 1, 1}});
  plan.excluded_ranks = {0};
  return plan;
}

}  // namespace ubep::test

#endif  // UBEP_TESTS_UNIT_TEST_UTIL_H_
