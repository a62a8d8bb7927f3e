// ubepctl: the operator's command for a UBEP cluster. It talks gRPC to ubep-balancer:
//
//   ubepctl [--balancer=HOST:PORT] [--json] [--timeout=30s] status
//   ubepctl plan show
//   ubepctl plan export --format=eplb|sglang [--first_moe_layer=N] [--out=FILE]
//   ubepctl rebalance
//   ubepctl drain NODE | undrain NODE
//   ubepctl forget NODE      (a node that is down for good, its ranks out of the plan)
//
// Tables for people by default, --json for scripts. Exit codes: 0 done, 1 the balancer said
// no or could not be reached (the message says which), 2 usage (a missing or unknown command,
// a flag value or a flag out of place; Abseil's own refusal of an unknown flag, and --help,
// exit 1).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "balancer/core/metrics.h"
#include "balancer/formats/json_formats.h"
#include "balancer/formats/proto_convert.h"
#include "common/flags_usage.h"
#include "common/rpc_origin.h"
#include "common/shape_limits.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "ubep/v1/control.grpc.pb.h"

ABSL_FLAG(std::string, balancer, "localhost:7070", "HOST:PORT of ubep-balancer.");
ABSL_FLAG(bool, json, false, "Print JSON instead of tables.");
ABSL_FLAG(std::string, format, "eplb", "plan export: eplb or sglang.");
ABSL_FLAG(std::string, out, "", "plan export: write here instead of stdout.");
ABSL_FLAG(int, first_moe_layer, -1,
          "plan export --format=sglang: the model layer of the plan's first layer, for a plan "
          "whose layers are numbered 0, 1, ... (daemons are not told the model's layer ids; "
          "DeepSeek-V3's MoE layers start at 3). -1: the plan's own layer ids.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call.");

namespace {

constexpr char kUsage[] =
    "usage: ubepctl [--balancer=HOST:PORT] [--json] [--timeout=30s] "
    "status | plan show | plan export --format=eplb|sglang [--first_moe_layer=N] [--out=FILE] | "
    "rebalance | drain NODE | undrain NODE | forget NODE";

using ubep::v1::Control;

int Usage(const std::string& problem) {
  std::cerr << "ubepctl: " << problem << "\n" << kUsage << "\n";
  return 2;
}

// One line for a failed call: unreachable is said as such, and so is an answer that did not
// come in time (the balancer may be busy with a plan change, and a change asked for may still
// be made). `answered`: the error is the balancer's own (marked, rpc_origin.h), whatever its
// code ("node-b is still being recovered" is UNAVAILABLE too).
int Failed(const std::string& what, const grpc::Status& status, bool answered) {
  if (!answered && status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    std::cerr << "ubepctl: cannot reach ubep-balancer at " << absl::GetFlag(FLAGS_balancer)
              << ": " << status.error_message() << "\n";
  } else if (!answered && status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    std::cerr << "ubepctl: " << what << ": no answer from ubep-balancer at "
              << absl::GetFlag(FLAGS_balancer) << " within --timeout "
              << absl::FormatDuration(absl::GetFlag(FLAGS_timeout))
              << " (unreachable, or busy: a change asked for may still be made; see ubepctl "
                 "status)\n";
  } else if (!answered && status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    // Another server (ubepd's gRPC port, beside the balancer's in its pod) has no such method.
    std::cerr << "ubepctl: " << what << ": the server at " << absl::GetFlag(FLAGS_balancer)
              << " does not serve ubep.v1.Control (UNIMPLEMENTED"
              << (status.error_message().empty() ? "" : ": " + status.error_message())
              << "): is --balancer ubep-balancer's address?\n";
  } else {
    // The message; its code where it has none (an empty line says nothing).
    std::cerr << "ubepctl: " << what << ": "
              << (status.error_message().empty()
                      ? absl::StrCat(absl::StatusCodeToString(
                                         static_cast<absl::StatusCode>(status.error_code())),
                                     " (no message)")
                      : status.error_message())
              << "\n";
  }
  return 1;
}

// protobuf's JSON writes 64-bit integers as strings (JavaScript's numbers hold 53 bits) and a
// NaN double as "NaN": in a script, "10" > 9 is not a comparison of numbers. They are written
// as numbers here, a NaN (or an infinity) as null. Walks `json` by `descriptor`'s fields.
void NumbersAsNumbers(const google::protobuf::Descriptor& descriptor, nlohmann::ordered_json& json) {
  using google::protobuf::FieldDescriptor;
  for (int i = 0; i < descriptor.field_count(); ++i) {
    const FieldDescriptor& field = *descriptor.field(i);
    const auto at = json.find(field.name());
    if (at == json.end()) continue;
    auto fix = [&](nlohmann::ordered_json& value) {
      if (field.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        if (value.is_object() && !field.is_map()) NumbersAsNumbers(*field.message_type(), value);
        return;
      }
      if (!value.is_string()) return;
      const std::string text = value.get<std::string>();
      if (field.cpp_type() == FieldDescriptor::CPPTYPE_UINT64) {
        value = std::stoull(text);
      } else if (field.cpp_type() == FieldDescriptor::CPPTYPE_INT64) {
        value = std::stoll(text);
      } else if (field.cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE ||
                 field.cpp_type() == FieldDescriptor::CPPTYPE_FLOAT) {
        value = nullptr;
      }
    };
    if (at->is_array()) {
      for (nlohmann::ordered_json& value : *at) fix(value);
    } else {
      fix(*at);
    }
  }
}

// Prints the message as JSON, its fields by their proto names, in the proto's order, all of
// them; the exit code (1, saying why, where protobuf could not print it).
int PrintJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  if (const auto printed = google::protobuf::util::MessageToJsonString(message, &out, options);
      !printed.ok()) {
    std::cerr << "ubepctl: the answer could not be printed as JSON: " << printed.ToString()
              << "\n";
    return 1;
  }
  nlohmann::ordered_json json = nlohmann::ordered_json::parse(out, nullptr, false);
  if (!json.is_discarded()) {
    NumbersAsNumbers(*message.GetDescriptor(), json);
    out = json.dump(1);
  }
  std::cout << out << "\n";
  return 0;
}

// "0-3" for contiguous ranks, else "0, 2, 5".
std::string Ranks(const google::protobuf::RepeatedField<uint32_t>& ranks) {
  if (ranks.empty()) return "-";
  std::vector<uint32_t> r(ranks.begin(), ranks.end());
  std::sort(r.begin(), r.end());
  if (r.back() - r.front() + 1 == r.size() && r.size() > 1) {
    return absl::StrCat(r.front(), "-", r.back());
  }
  return absl::StrJoin(r, ",");
}

void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()));
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

std::string Ago(double seconds) {
  if (seconds < 0) return "never";
  return absl::StrFormat("%.1fs ago", seconds);
}

int Status(Control::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  ubep::v1::ClusterStatus status;
  const grpc::Status s = stub.GetStatus(&context, ubep::v1::GetStatusRequest(), &status);
  if (!s.ok()) return Failed("status", s, ubep::AnsweredByServer(context));
  if (absl::GetFlag(FLAGS_json)) return PrintJson(status);
  std::vector<std::vector<std::string>> rows = {
      {"NODE", "ADDRESS", "RANKS", "HEALTH", "STATE", "STEP", "LAST REPORT"}};
  for (const ubep::v1::NodeStatus& n : status.nodes()) {
    std::string state = n.drained() ? "drained" : (n.healthy() ? "serving" : "excluded");
    if (!n.new_model().empty()) state = n.drained() ? "drained, new model" : "new model";
    if (!n.refused().empty()) state = n.drained() ? "drained, refused" : "refused";
    rows.push_back({n.node(), n.address(), Ranks(n.ranks()), n.healthy() ? "healthy" : "DOWN",
                    state, std::to_string(n.max_step()), Ago(n.seconds_since_report())});
  }
  PrintTable(rows);
  for (const ubep::v1::NodeStatus& n : status.nodes()) {
    if (n.refused().empty()) continue;
    std::cout << "\n" << n.node() << ": " << n.refused()
              << "; it is sent no plan and its ranks are excluded until it registers again "
                 "(restart its ubepd)";
  }
  for (const ubep::v1::NodeStatus& n : status.nodes()) {
    if (n.new_model().empty()) continue;
    std::cout << "\n" << n.node() << ": its group's model is not the cluster's (" << n.new_model()
              << "); the cluster takes it once every node holding ranks of its model registers it";
  }
  std::cout << "\nplan v" << status.plan_version() << " over " << status.world_size()
            << " ranks; excluded: "
            << (status.excluded_ranks().empty() ? "none" : Ranks(status.excluded_ranks()))
            << "; last commit " << Ago(status.seconds_since_commit()) << " ("
            << status.plans_committed() << " committed, " << status.plans_aborted()
            << " aborted since the balancer started)\n";
  if (status.imbalance().empty()) {
    std::cout << "imbalance: not measured yet\n";
  } else {
    const ubep::balancer::BalanceSummary summary = ubep::balancer::SummarizeLayers(
        std::vector<double>(status.imbalance().begin(), status.imbalance().end()));
    std::vector<std::string> layers;
    for (int l = 0; l < status.imbalance_size(); ++l) {
      const double b = status.imbalance(l);
      layers.push_back(std::isnan(b) ? absl::StrFormat("%d:-", l)
                                     : absl::StrFormat("%d:%.3f", l, b));
    }
    const int idle = status.imbalance_size() - summary.measured;
    if (summary.measured == 0) {
      std::cout << "imbalance: no call reached any layer in the last interval\n";
    } else {
      std::cout << absl::StrFormat("imbalance (max/mean rank load): mean %.3f, worst %.3f",
                                   summary.mean, summary.worst)
                << (idle > 0 ? absl::StrFormat(" (%d layers no call reached left out: -)", idle)
                             : "")
                << "\n";
    }
    std::cout << "per layer: " << absl::StrJoin(layers, " ") << "\n";
  }
  return 0;
}

// The cluster's plan into *plan; on failure, the exit code after saying why (Failed), as `what`.
std::optional<int> FetchPlan(Control::Stub& stub, const std::string& what,
                             ubep::balancer::Plan* plan) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  ubep::v1::Plan proto;
  const grpc::Status status = stub.GetClusterPlan(&context, ubep::v1::GetClusterPlanRequest(), &proto);
  if (!status.ok()) return Failed(what, status, ubep::AnsweredByServer(context));
  absl::StatusOr<ubep::balancer::Plan> read = ubep::balancer::FromProto(proto);
  if (!read.ok()) {
    return Failed(what,
                  grpc::Status(grpc::StatusCode::INTERNAL, std::string(read.status().message())),
                  true);
  }
  *plan = *std::move(read);
  return std::nullopt;
}

int PlanShow(Control::Stub& stub) {
  ubep::balancer::Plan plan;
  if (const std::optional<int> failed = FetchPlan(stub, "plan show", &plan)) return *failed;
  if (absl::GetFlag(FLAGS_json)) return PrintJson(ubep::balancer::ToProto(plan));
  const ubep::balancer::Topology& t = plan.topology;
  std::cout << "plan v" << plan.version << ": " << plan.num_layers() << " layers x "
            << plan.num_experts << " experts on " << t.num_ranks << " ranks x "
            << t.slots_per_rank << " slots; excluded ranks: "
            << (plan.excluded_ranks.empty() ? "none" : absl::StrJoin(plan.excluded_ranks, ","))
            << "\n\n";
  std::vector<std::vector<std::string>> rows = {
      {"LAYER", "MODEL LAYER", "REPLICATED EXPERTS", "MOST REPLICAS", "HOTTEST SLOT SHARE"}};
  for (int l = 0; l < plan.num_layers(); ++l) {
    std::map<int, int> replicas;
    double top_share = 0;
    for (int p = 0; p < t.num_slots(); ++p) {
      if (plan.layers[l].slot_share[p] > 0) ++replicas[plan.layers[l].slot_expert[p]];
      top_share = std::max(top_share, plan.layers[l].slot_share[p]);
    }
    int replicated = 0, most = 0;
    for (const auto& [expert, n] : replicas) {
      replicated += n > 1;
      most = std::max(most, n);
    }
    rows.push_back({std::to_string(l), std::to_string(plan.layer_ids[l]),
                    std::to_string(replicated), std::to_string(most),
                    absl::StrFormat("%.3f", top_share)});
  }
  PrintTable(rows);
  return 0;
}

int PlanExport(Control::Stub& stub) {
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format != "eplb" && format != "sglang") {
    return Usage(absl::StrCat("--format ", format, ": expected eplb or sglang"));
  }
  ubep::balancer::Plan plan;
  if (const std::optional<int> failed = FetchPlan(stub, "plan export", &plan)) return *failed;
  std::string text;
  if (format == "eplb") {
    text = ubep::balancer::PlanToJson(plan);
    if (!plan.excluded_ranks.empty()) {
      // Written (its shares say which slots serve), and said: EPLB's own arrays list the
      // excluded ranks' slots among their experts' replicas.
      std::cerr << "ubepctl: plan export: plan v" << plan.version << " excludes ranks "
                << absl::StrJoin(plan.excluded_ranks, ",")
                << ": their slots are listed with share 0; a reader that takes log2phy and "
                   "logcnt without the shares would send them traffic\n";
    }
  } else {
    // SGLang's expert location (--init-expert-location): the physical -> logical map per layer.
    // It has no shares: every slot listed serves its expert, so the slots of ranks the plan
    // excludes (share 0, their node drained or down) would take traffic. Not written.
    if (!plan.excluded_ranks.empty()) {
      std::cerr << "ubepctl: plan export: plan v" << plan.version << " excludes ranks "
                << absl::StrJoin(plan.excluded_ranks, ",")
                << "; SGLang's map has no shares, so their slots would serve their experts: "
                   "export it once every rank is back (or use --format=eplb, with a reader "
                   "that honours its shares)\n";
      return 1;
    }
    if (const int first = absl::GetFlag(FLAGS_first_moe_layer); first >= 0) {
      if (first + plan.num_layers() - 1 > (1 << 20)) {
        return Usage(absl::StrCat("--first_moe_layer ", first, ": plan v", plan.version, "'s ",
                                  plan.num_layers(), " layers would end past model layer 2^20"));
      }
      for (int l = 0; l < plan.num_layers(); ++l) {
        if (plan.layer_ids[l] != l) {
          return Usage(absl::StrCat("--first_moe_layer: plan v", plan.version,
                                    " names its model layers already (its layer ", l, " is ",
                                    plan.layer_ids[l], ")"));
        }
        plan.layer_ids[l] = first + l;
      }
    }
    text = ubep::balancer::PlanToSglangJson(plan) + "\n";
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::cout << text;
    return 0;
  }
  if (absl::Status s = ubep::balancer::WriteTextFile(out, text); !s.ok()) {
    std::cerr << "ubepctl: plan export: " << s.message() << "\n";
    return 1;
  }
  std::cerr << "plan v" << plan.version << " written to " << out << " (" << format << ")\n";
  return 0;
}

int PrintRebalance(const std::string& what, const ubep::v1::RebalanceResponse& r) {
  if (absl::GetFlag(FLAGS_json)) return PrintJson(r);
  if (!r.changed()) {
    // The placement would not change, or the members asked for are already those of the
    // plan in force.
    std::cout << what << ": plan v" << r.version() << " is in force; nothing new to commit\n";
  } else {
    std::cout << absl::StrFormat(
        "%s: plan v%d committed: %d slots migrated, planned in %.1f ms, committed in %.1f ms\n",
        what, r.version(), r.migrated_slots(), r.plan_seconds() * 1e3, r.commit_seconds() * 1e3);
    if (r.commit_unacknowledged_size() > 0) {
      std::cout << "  not yet acknowledged by "
                << absl::StrJoin(r.commit_unacknowledged(), ", ")
                << " (the balancer delivers the commit at its next ticks)\n";
    }
  }
  return 0;
}

int Run(int argc, char** argv) {
  ubep::SetFlagsUsage("ubepctl", kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> words(args.begin() + 1, args.end());
  if (words.empty()) return Usage("no command");
  if (absl::GetFlag(FLAGS_timeout) <= absl::ZeroDuration()) {
    return Usage(absl::StrCat("--timeout ", absl::FormatDuration(absl::GetFlag(FLAGS_timeout)),
                              " is not positive"));
  }
  if (absl::GetFlag(FLAGS_balancer).find(':') == std::string::npos) {
    // gRPC would take a host alone for port 443, and say it cannot reach it.
    return Usage(absl::StrCat("--balancer ", absl::GetFlag(FLAGS_balancer),
                              ": expected HOST:PORT"));
  }
  // The flags of plan export alone: refused elsewhere, and where they cannot apply, before
  // any call (a flag that does nothing would let a script believe it did).
  const bool export_command = words.size() == 2 && words[0] == "plan" && words[1] == "export";
  // (A flag given its default value is not told from one not given.)
  for (const absl::CommandLineFlag* flag :
       {&absl::GetFlagReflectionHandle(FLAGS_format), &absl::GetFlagReflectionHandle(FLAGS_out),
        &absl::GetFlagReflectionHandle(FLAGS_first_moe_layer)}) {
    if (!export_command && flag->CurrentValue() != flag->DefaultValue()) {
      return Usage(absl::StrCat("--", flag->Name(), " applies to plan export only"));
    }
  }
  // Model layer ids are read up to 2^20 (as in a plan's JSON form): SGLang's map has a row for
  // every model layer up to the last, so a larger one would be gigabytes of rows, or overflow.
  if (const int first = absl::GetFlag(FLAGS_first_moe_layer); first < -1 || first > (1 << 20)) {
    return Usage(absl::StrCat("--first_moe_layer ", first, " is outside [0, 2^20] (or -1: the "
                              "plan's own layer ids)"));
  }
  if (absl::GetFlag(FLAGS_first_moe_layer) >= 0 && absl::GetFlag(FLAGS_format) != "sglang") {
    return Usage("--first_moe_layer applies to --format=sglang only (the EPLB form has no "
                 "model layers)");
  }
  grpc::ChannelArguments channel_args;  // The cluster's plan may be larger than gRPC's default.
  channel_args.SetMaxReceiveMessageSize(ubep::kMaxControlMessageBytes);
  auto stub = Control::NewStub(grpc::CreateCustomChannel(
      absl::GetFlag(FLAGS_balancer), grpc::InsecureChannelCredentials(), channel_args));
  const std::string& command = words[0];
  if (command == "status" && words.size() == 1) return Status(*stub);
  if (command == "plan" && words.size() == 2 && words[1] == "show") return PlanShow(*stub);
  if (command == "plan" && words.size() == 2 && words[1] == "export") return PlanExport(*stub);
  if (command == "rebalance" && words.size() == 1) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
    ubep::v1::RebalanceResponse response;
    const grpc::Status s = stub->Rebalance(&context, ubep::v1::RebalanceRequest(), &response);
    if (!s.ok()) return Failed("rebalance", s, ubep::AnsweredByServer(context));
    return PrintRebalance("rebalance", response);
  }
  if ((command == "drain" || command == "undrain") && words.size() == 2) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
    ubep::v1::DrainRequest request;
    request.set_node(words[1]);
    ubep::v1::RebalanceResponse response;
    const grpc::Status s = command == "drain" ? stub->Drain(&context, request, &response)
                                              : stub->Undrain(&context, request, &response);
    if (!s.ok()) {
      return Failed(absl::StrCat(command, " ", words[1]), s, ubep::AnsweredByServer(context));
    }
    return PrintRebalance(absl::StrCat(command, " ", words[1]), response);
  }
  if (command == "forget" && words.size() == 2) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
    ubep::v1::ForgetRequest request;
    request.set_node(words[1]);
    ubep::v1::ForgetResponse response;
    const grpc::Status s = stub->Forget(&context, request, &response);
    if (!s.ok()) {
      return Failed(absl::StrCat("forget ", words[1]), s, ubep::AnsweredByServer(context));
    }
    if (absl::GetFlag(FLAGS_json)) return PrintJson(response);
    if (response.ranks().empty()) {
      std::cout << "forget " << words[1] << ": forgotten (it hosted no rank)\n";
    } else {
      std::cout << "forget " << words[1] << ": forgotten; its ranks "
                << absl::StrJoin(response.ranks(), ", ") << " stay excluded (plan v"
                << response.plan_version() << ") until a daemon registers for them\n";
    }
    return 0;
  }
  return Usage(absl::StrCat("unknown command \"", absl::StrJoin(words, " "), "\""));
}

}  // namespace

// An answer cut short (a full disk under `> plan.json`) is a failure: a script must not take
// a truncated plan for the plan.
int main(int argc, char** argv) {
  const int code = Run(argc, argv);
  std::cout.flush();
  if (!std::cout) {
    std::cerr << "ubepctl: standard output could not be written in full\n";
    return 1;
  }
  return code;
}
