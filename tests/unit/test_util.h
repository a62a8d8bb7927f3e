// Helpers shared by the tests: a temporary directory that cleans up after itself and the
// bundled trace files.
#ifndef UBEP_TESTS_UNIT_TEST_UTIL_H_
#define UBEP_TESTS_UNIT_TEST_UTIL_H_

#include <filesystem>
#include <fstream>
#include <string>

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

}  // namespace ubep::test

#endif  // UBEP_TESTS_UNIT_TEST_UTIL_H_
