// ubep-bench-balancer: plan quality and planning time of ubep against DeepSeek's EPLB
// (hierarchical and global) on the same real traces, side by side in one run. Prints one JSON
// object: per (trace, topology, policy) balancedness mean/worst, cross-node share and planning
// milliseconds (median of --repeats single-threaded runs, after one untimed run per policy,
// the policies interleaved), plus ubep/eplb-global ratios.
//
//   ubep-bench-balancer [--traces DIR] [--repeats N] [--table]
//
// --table prints a Markdown table instead of JSON.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "balancer/core/metrics.h"
#include "balancer/core/planner.h"
#include "balancer/formats/json_formats.h"
#include "common/percentile.h"
#include "nlohmann/json.hpp"

namespace {

using ubep::balancer::LoadMatrix;
using ubep::balancer::Plan;
using ubep::balancer::Policy;
using ubep::balancer::Topology;

struct Setup {
  const char* name;
  Topology topology;
};


void PrintTable(const nlohmann::json& results) {
  std::printf("| trace | topology | eplb mean/worst | eplb-global mean/worst | ubep mean/worst | "
              "ubep ms | eplb-global ms |\n|---|---|---|---|---|---|---|\n");
  for (const auto& row : results) {
    auto cell = [&](const char* policy) {
      char buffer[64];
      std::snprintf(buffer, sizeof(buffer), "%.4f / %.4f",
                    row[policy]["balancedness_mean"].get<double>(),
                    row[policy]["balancedness_worst"].get<double>());
      return std::string(buffer);
    };
    std::printf("| %s | %s | %s | %s | %s | %.1f | %.1f |\n",
                row["trace"].get<std::string>().c_str(),
                row["topology"].get<std::string>().substr(0, 4).c_str(), cell("eplb").c_str(),
                cell("eplb-global").c_str(), cell("ubep").c_str(),
                row["ubep"]["plan_ms"].get<double>(), row["eplb-global"]["plan_ms"].get<double>());
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string traces = UBEP_SOURCE_DIR "/data/traces/deepseek-v3";
  int repeats = 5;
  bool table = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--table") {
      table = true;
    } else if (flag == "--traces" && i + 1 < argc) {
      traces = argv[++i];
    } else if (flag == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else {
      std::cerr << "usage: ubep-bench-balancer [--traces DIR] [--repeats N] [--table]\n";
      return 2;
    }
  }
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(traces)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  const Setup setups[] = {
      {"EP32 (4 nodes x 8, 288 slots, 8 groups)", {32, 4, 9, 8}},
      {"EP64 (8 nodes x 8, 320 slots, 8 groups)", {64, 8, 5, 8}},
  };
  const Policy policies[] = {Policy::kEplb, Policy::kEplbGlobal, Policy::kUbep};
  nlohmann::json results = nlohmann::json::array();
  for (const std::string& file : files) {
    absl::StatusOr<LoadMatrix> load = ubep::balancer::ReadSglangLoadFile(file);
    if (!load.ok()) {
      std::cerr << load.status().message() << "\n";
      return 2;
    }
    for (const Setup& setup : setups) {
      nlohmann::json row = {{"trace", std::filesystem::path(file).filename().string()},
                            {"topology", setup.name}};
      // One untimed plan per policy first (the allocator, the caches), then the timed repeats
      // interleaved, the order reversed every other round: a slow spell of a shared machine
      // falls on every policy alike, not on the last.
      constexpr int kPolicies = std::size(policies);
      std::vector<absl::StatusOr<Plan>> plans;
      for (Policy policy : policies) {
        plans.push_back(ubep::balancer::ComputePlan(*load, setup.topology, nullptr,
                                                    {.policy = policy}));
        if (!plans.back().ok()) {
          std::cerr << plans.back().status().message() << "\n";
          return 1;
        }
      }
      std::vector<std::vector<double>> ms(kPolicies);
      for (int r = 0; r < repeats; ++r) {
        for (int j = 0; j < kPolicies; ++j) {
          const int i = r % 2 == 0 ? j : kPolicies - 1 - j;
          const auto start = std::chrono::steady_clock::now();
          absl::StatusOr<Plan> plan = ubep::balancer::ComputePlan(
              *load, setup.topology, nullptr, {.policy = policies[i]});
          ms[i].push_back(std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - start)
                              .count());
          if (!plan.ok()) {
            std::cerr << plan.status().message() << "\n";
            return 1;
          }
        }
      }
      for (int i = 0; i < kPolicies; ++i) {
        const Plan& plan = *plans[i];
        const auto summary = ubep::balancer::SummarizeBalance(plan, *load);
        row[std::string(ubep::balancer::PolicyName(policies[i]))] = {
            {"balancedness_mean", summary.mean},
            {"balancedness_worst", summary.worst},
            {"cross_node_share", ubep::balancer::CrossNodeShare(plan, *load)},
            {"plan_ms", ubep::Percentile(ms[i], 0.5)}};
      }
      const auto& ours = row["ubep"];
      const auto& theirs = row["eplb-global"];
      row["ubep_vs_eplb_global"] = {
          {"balancedness_mean_ratio", ours["balancedness_mean"].get<double>() /
                                          theirs["balancedness_mean"].get<double>()},
          {"plan_ms_ratio", ours["plan_ms"].get<double>() / theirs["plan_ms"].get<double>()}};
      results.push_back(row);
    }
  }
  if (table) {
    PrintTable(results);
  } else {
    std::cout << nlohmann::json{{"bench", "balancer"}, {"repeats", repeats}, {"results", results}}
                     .dump(1)
              << "\n";
  }
  return 0;
}
