#include "tools/ubep_balance/balance_cli.h"

#include <charconv>
#include <filesystem>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "balancer/core/metrics.h"
#include "balancer/core/planner.h"
#include "balancer/core/scenario.h"
#include "balancer/formats/json_formats.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/ubep_balance/replay.h"

namespace ubep::balancer {
namespace {

using Json = nlohmann::json;

// One line of JSON; bytes of a path that are not UTF-8 (a file name is any bytes) become
// U+FFFD rather than an exception after the work is done.
std::string Printed(const Json& json) {
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

constexpr char kUsage[] =
    "usage: ubep-balance plan|eval|replay [flags]; see docs/ubep-balance.md";

// Flags as written: --name value, --name=value, or --name v1 v2 ... for list flags.
class Flags {
 public:
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args, size_t first,
                                     const std::set<std::string>& known,
                                     const std::set<std::string>& lists) {
    Flags flags;
    for (size_t i = first; i < args.size();) {
      const std::string& arg = args[i];
      if (arg.rfind("--", 0) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
      }
      std::string name = arg.substr(2);
      std::vector<std::string> values;
      if (const size_t eq = name.find('='); eq != std::string::npos) {
        values.push_back(name.substr(eq + 1));
        name = name.substr(0, eq);
        ++i;
      } else {
        ++i;
        while (i < args.size() && args[i].rfind("--", 0) != 0) {
          values.push_back(args[i++]);
          if (!lists.contains(name)) break;
        }
      }
      if (!known.contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
      }
      if (values.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
      auto& slot = flags.values_[name];
      slot.insert(slot.end(), values.begin(), values.end());
    }
    return flags;
  }

  bool Has(const std::string& name) const { return values_.contains(name); }

  absl::StatusOr<std::string> String(const std::string& name) const {
    auto it = values_.find(name);
    if (it == values_.end()) return absl::InvalidArgumentError(absl::StrCat("missing --", name));
    if (it->second.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " takes one value"));
    }
    return it->second[0];
  }

  std::vector<std::string> List(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }

  absl::StatusOr<int64_t> Int(const std::string& name, int64_t min, int64_t max) const {
    UBEP_ASSIGN_OR_RETURN(std::string text, String(name));
    int64_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || ptr != text.data() + text.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", text, "' is not an integer"));
    }
    if (value < min || value > max) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": ", value, " is outside [", min, ", ", max, "]"));
    }
    return value;
  }

  absl::StatusOr<int64_t> Int(const std::string& name, int64_t min, int64_t max,
                              int64_t fallback) const {
    return Has(name) ? Int(name, min, max) : absl::StatusOr<int64_t>(fallback);
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
};

constexpr int64_t kMaxCount = 1 << 20;

absl::StatusOr<Topology> TopologyFromFlags(const Flags& flags) {
  Topology t;
  UBEP_ASSIGN_OR_RETURN(t.num_ranks, flags.Int("ranks", 1, kMaxCount));
  UBEP_ASSIGN_OR_RETURN(t.num_nodes, flags.Int("nodes", 1, kMaxCount, 1));
  UBEP_ASSIGN_OR_RETURN(t.slots_per_rank, flags.Int("slots-per-rank", 1, kMaxCount));
  UBEP_ASSIGN_OR_RETURN(t.num_groups, flags.Int("groups", 1, kMaxCount, 1));
  return t;
}

absl::StatusOr<PlannerOptions> PlannerFromFlags(const Flags& flags, const std::string& name) {
  PlannerOptions options;
  if (flags.Has(name)) {
    UBEP_ASSIGN_OR_RETURN(std::string policy, flags.String(name));
    UBEP_ASSIGN_OR_RETURN(options.policy, ParsePolicy(policy));
  }
  UBEP_ASSIGN_OR_RETURN(int64_t seed, flags.Int("seed", 0, INT64_MAX, 0));
  options.seed = static_cast<uint64_t>(seed);
  UBEP_ASSIGN_OR_RETURN(options.migration_budget,
                        flags.Int("migration-budget", -1, kMaxCount, -1));
  if (flags.Has("balance-slack")) {
    UBEP_ASSIGN_OR_RETURN(std::string text, flags.String("balance-slack"));
    char* end = nullptr;
    options.balance_slack = std::strtod(text.c_str(), &end);
    // strtod reads "" as 0 with nothing consumed: an empty value is no number.
    if (text.empty() || end != text.c_str() + text.size() || !(options.balance_slack >= 0) ||
        options.balance_slack > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--balance-slack: '", text, "' is not a number in [0, 1]"));
    }
  }
  return options;
}

Json SummaryJson(const BalanceSummary& summary) {
  return Json{{"balancedness_mean", summary.mean}, {"balancedness_worst", summary.worst}};
}

absl::Status CheckTopologyFits(const Topology& t, const std::string& load_path,
                               const LoadMatrix& load) {
  absl::Status s = ValidateTopology(t, load.num_experts());
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(load_path, ": ", s.message()));
  return absl::OkStatus();
}

absl::Status RunPlan(const Flags& flags, std::ostream& out, ClockInterface& clock) {
  UBEP_ASSIGN_OR_RETURN(std::string load_path, flags.String("load"));
  UBEP_ASSIGN_OR_RETURN(std::string out_path, flags.String("out"));
  if (out_path.empty()) return absl::InvalidArgumentError("--out: empty; name the plan's file");
  if (std::error_code ignored; std::filesystem::is_directory(out_path, ignored)) {
    // Said before the plan is computed (WriteTextFile would say it after).
    return absl::InvalidArgumentError(absl::StrCat(out_path, ": is a directory, not a file"));
  }
  UBEP_ASSIGN_OR_RETURN(Topology topology, TopologyFromFlags(flags));
  UBEP_ASSIGN_OR_RETURN(PlannerOptions options, PlannerFromFlags(flags, "policy"));
  UBEP_ASSIGN_OR_RETURN(LoadMatrix load, ReadSglangLoadFile(load_path));
  UBEP_RETURN_IF_ERROR(CheckTopologyFits(topology, load_path, load));
  std::optional<Plan> previous;
  std::string previous_path;
  if (flags.Has("previous")) {
    UBEP_ASSIGN_OR_RETURN(previous_path, flags.String("previous"));
    // A plain EPLB plan (phy2log alone) takes the topology of the flags, as the new plan does;
    // one with its own is checked against them below (CheckPrevious says how they differ).
    UBEP_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(previous_path));
    const Json parsed = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    const bool own_topology = parsed.is_object() && parsed.contains("topology");
    UBEP_ASSIGN_OR_RETURN(previous,
                          ParsePlanJson(text, previous_path,
                                        own_topology ? std::nullopt
                                                     : std::optional<Topology>(topology)));
    absl::Status s = CheckPrevious(*previous, topology, load);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(previous_path, ": ", s.message()));
    }
  }
  const int64_t start = clock.NowNanos();
  absl::StatusOr<Plan> plan =
      ComputePlan(load, topology, previous ? &*previous : nullptr, options);
  const double plan_ms = static_cast<double>(clock.NowNanos() - start) / 1e6;
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat(load_path, ": ", plan.status().message()));
  }
  UBEP_RETURN_IF_ERROR(WriteTextFile(out_path, PlanToJson(*plan)));
  Json summary = SummaryJson(SummarizeBalance(*plan, load));
  summary["policy"] = PolicyName(options.policy);
  summary["version"] = plan->version;
  summary["layers"] = plan->num_layers();
  summary["slots"] = topology.num_slots();
  summary["cross_node_share"] = CrossNodeShare(*plan, load);
  summary["changed_slots"] = previous ? ChangedSlots(*previous, *plan, nullptr) : 0;
  summary["plan_ms"] = plan_ms;
  summary["out"] = out_path;
  out << Printed(summary) << "\n";
  return absl::OkStatus();
}

absl::Status RunEval(const Flags& flags, std::ostream& out) {
  UBEP_ASSIGN_OR_RETURN(std::string plan_path, flags.String("plan"));
  UBEP_ASSIGN_OR_RETURN(std::string load_path, flags.String("load"));
  std::optional<Topology> override_topology;
  if (flags.Has("nodes") && !flags.Has("ranks")) {
    // Not dropped silently: a topology given is one to check the plan's against.
    return absl::InvalidArgumentError("--nodes needs --ranks (the ranks the nodes divide)");
  }
  if (flags.Has("ranks")) {
    // 0: the plan file's, or (a plain EPLB plan) 1 node and slots from phy2log's width.
    Topology t{.num_ranks = 0, .num_nodes = 0, .slots_per_rank = 0, .num_groups = 0};
    UBEP_ASSIGN_OR_RETURN(t.num_ranks, flags.Int("ranks", 1, kMaxCount));
    UBEP_ASSIGN_OR_RETURN(t.num_nodes, flags.Int("nodes", 1, kMaxCount, 0));
    override_topology = t;
  }
  UBEP_ASSIGN_OR_RETURN(const std::string plan_text, ReadTextFile(plan_path));
  UBEP_ASSIGN_OR_RETURN(Plan plan, ParsePlanJson(plan_text, plan_path, override_topology));
  // Whether the file names its layers (a plain EPLB plan does not; it is read as 0, 1, ...).
  const bool names_layers =
      Json::parse(plan_text, nullptr, /*allow_exceptions=*/false).contains("layer_ids");
  UBEP_ASSIGN_OR_RETURN(LoadMatrix load, ReadSglangLoadFile(load_path));
  if (plan.num_experts > load.num_experts()) {
    return absl::InvalidArgumentError(absl::StrCat(plan_path, ": plan: places experts up to ",
                                                   plan.num_experts - 1, " but ", load_path,
                                                   " has ", load.num_experts()));
  }
  if (plan.num_experts < load.num_experts()) plan.num_experts = load.num_experts();
  if (absl::Status s = ValidatePlan(plan); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(plan_path, ": plan: ", s.message(),
                                                   " (for the experts of ", load_path, ")"));
  }
  if (plan.num_layers() != load.num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat(plan_path, ": phy2log: plan has ", plan.num_layers(), " layers but ",
                     load_path, " has ", load.num_layers(), " MoE layers"));
  }
  // Layers pair by model layer. A plan without layer ids (a plain EPLB plan) takes the
  // load's; one that names others is for other layers.
  for (int l = 0; l < plan.num_layers() && names_layers; ++l) {
    if (plan.layer_ids[l] != load.layer_ids()[l]) {
      return absl::InvalidArgumentError(absl::StrCat(
          plan_path, ": layer_ids[", l, "]: is ", plan.layer_ids[l], " but ", load_path,
          "'s MoE layer ", l, " is model layer ", load.layer_ids()[l]));
    }
  }
  Json result = SummaryJson(SummarizeBalance(plan, load));
  result["layers"] = plan.num_layers();
  result["slots"] = plan.topology.num_slots();
  result["experts"] = plan.num_experts;
  result["ranks"] = plan.topology.num_ranks;
  result["cross_node_share"] = CrossNodeShare(plan, load);
  result["per_layer"] = SummarizeBalance(plan, load).per_layer;
  out << Printed(result) << "\n";
  return absl::OkStatus();
}

Json ReplayJson(const ReplayResult& r, Policy policy) {
  return Json{{"policy", PolicyName(policy)},
              {"imbalance_mean", r.imbalance_mean},
              {"imbalance_p99", r.imbalance_p99},
              {"migrated_slots_total", r.migrated_slots_total},
              {"plan_ms_p50", r.plan_ms_p50},
              {"plan_ms_max", r.plan_ms_max},
              {"plans", r.plans},
              {"scored_steps", r.scored_steps}};
}

absl::Status RunReplay(const Flags& flags, std::ostream& out, ClockInterface& clock) {
  const std::vector<std::string> load_paths = flags.List("load");
  if (load_paths.empty()) return absl::InvalidArgumentError("missing --load");
  UBEP_ASSIGN_OR_RETURN(Topology topology, TopologyFromFlags(flags));
  UBEP_ASSIGN_OR_RETURN(PlannerOptions planner, PlannerFromFlags(flags, "policy"));
  if (!flags.Has("policy")) return absl::InvalidArgumentError("missing --policy");
  ReplayOptions replay;
  UBEP_ASSIGN_OR_RETURN(replay.steps, flags.Int("steps", 2, 100000));
  UBEP_ASSIGN_OR_RETURN(replay.rebalance_every, flags.Int("rebalance-every", 1, 100000));
  UBEP_ASSIGN_OR_RETURN(replay.window, flags.Int("window", 1, 100000));
  UBEP_ASSIGN_OR_RETURN(int64_t pairs_per_step,
                        flags.Int("pairs-per-step", 1, int64_t{1} << 40,
                                  ScenarioOptions{}.pairs_per_step));
  UBEP_ASSIGN_OR_RETURN(int seeds, flags.Int("seeds", 1, 1000, 1));
  std::optional<PlannerOptions> baseline;
  if (flags.Has("baseline")) {
    UBEP_ASSIGN_OR_RETURN(baseline, PlannerFromFlags(flags, "baseline"));
    baseline->migration_budget = -1;
  }

  std::vector<LoadMatrix> sources;
  for (const std::string& path : load_paths) {
    UBEP_ASSIGN_OR_RETURN(LoadMatrix load, ReadSglangLoadFile(path));
    if (!sources.empty() && (load.num_layers() != sources[0].num_layers() ||
                             load.num_experts() != sources[0].num_experts())) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": logical_count: ", load.num_layers(), " MoE layers x ", load.num_experts(),
          " experts, but ", load_paths[0], " has ", sources[0].num_layers(), " x ",
          sources[0].num_experts()));
    }
    if (!sources.empty() && load.layer_ids() != sources[0].layer_ids()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": its MoE layers are model layers ", absl::StrJoin(load.layer_ids(), ", "),
          "; ", load_paths[0], "'s are ", absl::StrJoin(sources[0].layer_ids(), ", ")));
    }
    UBEP_RETURN_IF_ERROR(CheckTopologyFits(topology, path, load));
    sources.push_back(std::move(load));
  }
  // Every step's loads are drawn before the replay: bounded, so that a long replay of a big
  // model is refused rather than killed for want of memory.
  constexpr uint64_t kMaxLoadBytes = uint64_t{2} << 30;
  const uint64_t load_bytes = static_cast<uint64_t>(replay.steps) * sources[0].num_layers() *
                              sources[0].num_experts() * sizeof(double);
  if (load_bytes > kMaxLoadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps ", replay.steps, " of ", sources[0].num_layers(), " layers x ",
        sources[0].num_experts(), " experts are ", load_bytes >> 20,
        " MiB of loads, over the 2048 MiB a replay holds; take at most ",
        kMaxLoadBytes / (static_cast<uint64_t>(sources[0].num_layers()) *
                         sources[0].num_experts() * sizeof(double)),
        " steps"));
  }
  // Before drawing a step: a replay the options cannot make is said at once (drawing 18078
  // steps takes a minute and 2 GiB).
  UBEP_RETURN_IF_ERROR(CheckReplayOptions(replay));
  // Each seed is one scenario (its own bursts and sampling); every policy replays the same
  // sampled loads of every seed.
  ReplayResult ours, theirs;
  for (int i = 0; i < seeds; ++i) {
    ScenarioOptions scenario_options{.seed = planner.seed + static_cast<uint64_t>(i),
                                     .pairs_per_step = pairs_per_step,
                                     .max_steps = replay.steps};
    UBEP_ASSIGN_OR_RETURN(Scenario scenario, Scenario::Create(sources, scenario_options));
    std::vector<LoadMatrix> step_loads;
    step_loads.reserve(replay.steps);
    for (int s = 0; s < replay.steps; ++s) step_loads.push_back(scenario.Step(s));
    UBEP_ASSIGN_OR_RETURN(ReplayResult run, Replay(step_loads, topology, planner, replay, clock));
    ours.Merge(run);
    if (baseline) {
      UBEP_ASSIGN_OR_RETURN(ReplayResult base,
                            Replay(step_loads, topology, *baseline, replay, clock));
      theirs.Merge(base);
    }
  }
  Json result = ReplayJson(ours, planner.policy);
  result["time_axis"] = "synthetic (real DeepSeek-V3 distributions, drifting mix; seeded)";
  result["seed"] = planner.seed;
  result["seeds"] = seeds;
  result["sources"] = load_paths;
  if (baseline) {
    result["baseline"] = ReplayJson(theirs, baseline->policy);
    result["imbalance_mean_ratio"] = ours.imbalance_mean / theirs.imbalance_mean;
    // null where the baseline moved no slot: no ratio, rather than a 0 that reads as "ours
    // moved none".
    result["migrated_slots_ratio"] =
        theirs.migrated_slots_total > 0
            ? Json(static_cast<double>(ours.migrated_slots_total) / theirs.migrated_slots_total)
            : Json(nullptr);
  }
  out << Printed(result) << "\n";
  return absl::OkStatus();
}

}  // namespace

int RunBalanceCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                  ClockInterface& clock) {
  if (args.empty() || args[0] == "--help" || args[0] == "help") {
    (args.empty() ? err : out) << kUsage << "\n";
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {  // As the binaries that take Abseil flags print it.
    out << "ubep-balance " << UBEP_VERSION << "\n";
    return 0;
  }
  const std::string& command = args[0];
  const std::set<std::string> topology_flags = {"ranks", "nodes", "slots-per-rank", "groups"};
  std::set<std::string> known;
  absl::Status status;
  auto parse = [&](std::set<std::string> flags_known, std::set<std::string> lists) {
    return Flags::Parse(args, 1, flags_known, lists);
  };
  absl::StatusOr<Flags> flags;
  if (command == "plan") {
    known = {"load", "out", "policy", "previous", "migration-budget", "seed", "balance-slack"};
    known.insert(topology_flags.begin(), topology_flags.end());
    flags = parse(known, {});
    status = flags.ok() ? RunPlan(*flags, out, clock) : flags.status();
  } else if (command == "eval") {
    flags = parse({"plan", "load", "ranks", "nodes"}, {});
    status = flags.ok() ? RunEval(*flags, out) : flags.status();
  } else if (command == "replay") {
    known = {"load",   "policy", "baseline", "steps",          "rebalance-every",
             "window", "seed",   "migration-budget", "pairs-per-step", "balance-slack",
             "seeds"};
    known.insert(topology_flags.begin(), topology_flags.end());
    flags = parse(known, {"load"});
    status = flags.ok() ? RunReplay(*flags, out, clock) : flags.status();
  } else {
    err << "ubep-balance: unknown command '" << command << "'; " << kUsage << "\n";
    return 2;
  }
  if (status.ok()) return 0;
  err << "ubep-balance " << command << ": " << status.message() << "\n";
  return status.code() == absl::StatusCode::kInternal ? 1 : 2;
}

}  // namespace ubep::balancer
