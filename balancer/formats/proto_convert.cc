#include "balancer/formats/proto_convert.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "common/shape_limits.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace ubep::balancer {

v1::Topology ToProto(const Topology& t) {
  v1::Topology proto;
  proto.set_num_ranks(t.num_ranks);
  proto.set_num_nodes(t.num_nodes);
  proto.set_slots_per_rank(t.slots_per_rank);
  proto.set_num_groups(t.num_groups);
  for (int r = 0; r < t.num_ranks; ++r) {
    v1::Rank* rank = proto.add_ranks();
    rank->set_rank(r);
    rank->set_node(t.NodeOfRank(r));
    rank->set_domain(t.NodeOfRank(r));
    rank->set_device(r % t.ranks_per_node());
  }
  return proto;
}

absl::StatusOr<Topology> FromProto(const v1::Topology& proto) {
  constexpr uint32_t kMax = kMaxPlanIndex;
  if (proto.num_ranks() > kMax || proto.num_nodes() > kMax || proto.slots_per_rank() > kMax ||
      proto.num_groups() > kMax) {
    return absl::InvalidArgumentError("topology: a count is larger than 2^20");
  }
  Topology t{static_cast<int>(proto.num_ranks()), static_cast<int>(proto.num_nodes()),
             static_cast<int>(proto.slots_per_rank()),
             proto.num_groups() == 0 ? 1 : static_cast<int>(proto.num_groups())};
  if (t.num_ranks <= 0 || t.num_nodes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("topology: ", t.num_ranks, " ranks on ",
                                                   t.num_nodes, " nodes (missing?)"));
  }
  if (t.num_ranks % t.num_nodes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("topology: ", t.num_ranks,
                                                   " ranks do not divide over ", t.num_nodes,
                                                   " nodes"));
  }
  // Ranks are node-major in this version: rank r sits on node r / ranks_per_node.
  for (const v1::Rank& rank : proto.ranks()) {
    if (rank.rank() >= proto.num_ranks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("topology.ranks: rank ", rank.rank(), " is outside [0, ",
                       proto.num_ranks(), ")"));
    }
    if (static_cast<int>(rank.node()) != t.NodeOfRank(static_cast<int>(rank.rank()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "topology.ranks: rank ", rank.rank(), " is on node ", rank.node(), "; ranks must be "
          "numbered node-major (rank r on node r / ", t.ranks_per_node(), ")"));
    }
  }
  return t;
}

v1::Plan ToProto(const Plan& plan, PlanEncoding encoding) {
  v1::Plan proto;
  proto.set_version(plan.version);
  *proto.mutable_topology() = ToProto(plan.topology);
  proto.set_num_experts(plan.num_experts);
  for (int id : plan.layer_ids) proto.add_layer_ids(id);
  for (int r : plan.excluded_ranks) proto.add_excluded_ranks(static_cast<uint32_t>(r));
  for (const LayerPlan& layer : plan.layers) {
    v1::LayerPlan* out = proto.add_layers();
    out->mutable_slot_expert()->Reserve(static_cast<int>(layer.slot_expert.size()));
    for (int e : layer.slot_expert) out->add_slot_expert(static_cast<uint32_t>(e));
    if (encoding == PlanEncoding::kCompact) {
      out->mutable_slot_share()->Add(layer.slot_share.begin(), layer.slot_share.end());
      continue;
    }
    std::vector<v1::ExpertPlacement*> experts;
    for (int e = 0; e < plan.num_experts; ++e) experts.push_back(out->add_experts());
    for (size_t p = 0; p < layer.slot_expert.size(); ++p) {
      v1::Replica* replica = experts[layer.slot_expert[p]]->add_replicas();
      replica->set_slot(static_cast<uint32_t>(p));
      replica->set_share(layer.slot_share[p]);
    }
  }
  return proto;
}

uint64_t PlanFingerprint(const Plan& plan) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    ToProto(plan, PlanEncoding::kCompact).SerializeToCodedStream(&coded);
  }
  return std::max<uint64_t>(1, Fingerprint64(bytes));
}

absl::StatusOr<Plan> FromProto(const v1::Plan& proto) {
  Plan plan;
  plan.version = proto.version();
  UBEP_ASSIGN_OR_RETURN(plan.topology, FromProto(proto.topology()));
  for (uint32_t r : proto.excluded_ranks()) plan.excluded_ranks.push_back(static_cast<int>(r));
  if (proto.num_experts() == 0 || proto.num_experts() > uint32_t{kMaxPlanIndex}) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: num_experts ", proto.num_experts(), " is outside [1, 2^20]"));
  }
  plan.num_experts = static_cast<int>(proto.num_experts());
  // Before anything is sized by the slot count: ranks x slots within kMaxSlots, no overflow.
  if (absl::Status s = ValidateTopology(plan.topology, plan.num_experts); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("plan.topology: ", s.message()));
  }
  if (proto.layer_ids_size() != proto.layers_size()) {
    return absl::InvalidArgumentError(absl::StrCat("plan: ", proto.layers_size(),
                                                   " layers but ", proto.layer_ids_size(),
                                                   " layer ids"));
  }
  const int num_slots = plan.topology.num_slots();
  for (int l = 0; l < proto.layers_size(); ++l) {
    const v1::LayerPlan& in = proto.layers(l);
    if (proto.layer_ids(l) > uint32_t{kMaxPlanIndex}) {  // As the JSON form reads them.
      return absl::InvalidArgumentError(absl::StrCat("plan: layer_ids[", l, "] ",
                                                     proto.layer_ids(l), " is outside [0, 2^20]"));
    }
    plan.layer_ids.push_back(static_cast<int>(proto.layer_ids(l)));
    if (in.slot_share_size() > 0) {  // Compact form.
      if (in.slot_expert_size() != num_slots || in.slot_share_size() != num_slots ||
          in.experts_size() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan.layers[", l, "]: ", in.slot_expert_size(), " slots, ", in.slot_share_size(),
            " shares and ", in.experts_size(), " experts; the compact form needs ", num_slots,
            ", ", num_slots, " and 0"));
      }
      LayerPlan layer;
      layer.slot_expert.assign(in.slot_expert().begin(), in.slot_expert().end());
      layer.slot_share.assign(in.slot_share().begin(), in.slot_share().end());
      plan.layers.push_back(std::move(layer));
      continue;
    }
    if (in.slot_expert_size() != num_slots || in.experts_size() != plan.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan.layers[", l, "]: ", in.slot_expert_size(), " slots and ", in.experts_size(),
          " experts; expected ", num_slots, " and ", plan.num_experts));
    }
    LayerPlan layer;
    layer.slot_expert.assign(in.slot_expert().begin(), in.slot_expert().end());
    layer.slot_share.assign(num_slots, 0.0);
    std::vector<uint8_t> listed(num_slots, 0);
    for (int e = 0; e < plan.num_experts; ++e) {
      for (const v1::Replica& replica : in.experts(e).replicas()) {
        if (replica.slot() >= static_cast<uint32_t>(num_slots) ||
            layer.slot_expert[replica.slot()] != e) {
          return absl::InvalidArgumentError(
              absl::StrCat("plan.layers[", l, "].experts[", e, "]: replica slot ",
                           replica.slot(), " does not hold expert ", e));
        }
        if (listed[replica.slot()]) {  // Else the last listing would win.
          return absl::InvalidArgumentError(
              absl::StrCat("plan.layers[", l, "].experts[", e, "]: replica slot ",
                           replica.slot(), " is listed twice"));
        }
        listed[replica.slot()] = 1;
        layer.slot_share[replica.slot()] = replica.share();
      }
    }
    for (int p = 0; p < num_slots; ++p) {
      if (!listed[p]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan.layers[", l, "]: slot ", p, " is missing from its expert's replicas"));
      }
    }
    plan.layers.push_back(std::move(layer));
  }
  if (absl::Status s = ValidatePlan(plan); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("plan: ", s.message()));
  }
  return plan;
}

absl::StatusOr<LoadMatrix> LoadFromProto(const v1::LoadReport& report, const Plan* plan) {
  // Bounded before the matrix is allocated from them (a few bytes on the wire must not ask
  // for gigabytes).
  if (report.num_experts() > kMaxExperts ||
      static_cast<uint32_t>(report.layers_size()) > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "load report from '", report.reporter(), "': ", report.layers_size(), " layers x ",
        report.num_experts(), " experts, over the limits of ", kMaxLayers, " x ", kMaxExperts));
  }
  const int num_experts = static_cast<int>(report.num_experts());
  if (num_experts <= 0 || report.layers_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("load report from '", report.reporter(), "' is empty: ",
                     report.layers_size(), " layers x ", num_experts, " experts"));
  }
  if (report.first_step() > report.last_step()) {
    return absl::InvalidArgumentError(
        absl::StrCat("load report from '", report.reporter(), "': first_step ",
                     report.first_step(), " is after last_step ", report.last_step()));
  }
  if (plan != nullptr && plan->num_experts != num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("load report from '", report.reporter(), "': ",
                                                   num_experts, " experts; plan v", plan->version,
                                                   " has ", plan->num_experts));
  }
  LoadMatrix load(report.layers_size(), num_experts);
  const std::optional<double> mean = MeanDispatches(report);
  std::vector<int> ids;
  for (int i = 0; i < report.layers_size(); ++i) {
    const v1::LayerLoad& layer = report.layers(i);
    ids.push_back(static_cast<int>(layer.layer()));
    const std::string field = absl::StrCat("load report from '", report.reporter(), "' layers[",
                                           i, "]");
    if (layer.logical_size() > 0 && layer.slot_size() > 0) {
      return absl::InvalidArgumentError(field + ": has both logical and slot counts");
    }
    if (layer.logical_size() > 0) {
      if (layer.logical_size() != num_experts) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": ", layer.logical_size(),
                                                       " logical counts, expected ",
                                                       num_experts));
      }
      for (int e = 0; e < num_experts; ++e) load.at(i, e) = static_cast<double>(layer.logical(e));
      continue;
    }
    if (plan == nullptr) {
      return absl::InvalidArgumentError(field + ": slot counts need the plan that was in force");
    }
    const int plan_layer = static_cast<int>(
        std::find(plan->layer_ids.begin(), plan->layer_ids.end(), static_cast<int>(layer.layer())) -
        plan->layer_ids.begin());
    if (plan_layer == plan->num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": layer ", layer.layer(), " is not in plan v", plan->version));
    }
    const LayerPlan& placed = plan->layers[plan_layer];
    const size_t first = layer.first_slot();
    if (first + layer.slot_size() > placed.slot_expert.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": slot counts for slots [", first, ", ", first + layer.slot_size(),
          "), plan has ", placed.slot_expert.size(), " slots"));
    }
    if (layer.dispatches_size() == 0) {
      for (int p = 0; p < layer.slot_size(); ++p) {
        load.at(i, placed.slot_expert[first + p]) += static_cast<double>(layer.slot(p));
      }
      continue;
    }
    if (layer.slot_size() % layer.dispatches_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", layer.slot_size(),
                                                     " slot counts are not whole ranks of ",
                                                     layer.dispatches_size(), " dispatch counts"));
    }
    // A dispatch count is one rank's: its slots are that rank's, the plan's slots_per_rank
    // from a rank's first slot.
    const int slots_per_rank = plan->topology.slots_per_rank;
    if (layer.slot_size() / layer.dispatches_size() != slots_per_rank ||
        first % static_cast<size_t>(slots_per_rank) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": dispatch counts for ", layer.dispatches_size(),
          layer.dispatches_size() == 1 ? " rank" : " ranks", " over slots [", first,
          ", ", first + layer.slot_size(), "), which are not whole ranks of plan v",
          plan->version, " (", slots_per_rank, " slots each)"));
    }
    if (!mean.has_value()) {
      return absl::InvalidArgumentError(field + ": has dispatch counts, but not every layer has");
    }
    const int per_rank = layer.slot_size() / layer.dispatches_size();
    for (int p = 0; p < layer.slot_size(); ++p) {
      const uint64_t dispatches = layer.dispatches(p / per_rank);
      if (dispatches == 0) {
        if (layer.slot(p) == 0) continue;
        return absl::InvalidArgumentError(absl::StrCat(field, ": slot ", first + p, " counts ",
                                                       layer.slot(p), " pairs over 0 dispatches"));
      }
      load.at(i, placed.slot_expert[first + p]) +=
          static_cast<double>(layer.slot(p)) * *mean / static_cast<double>(dispatches);
    }
  }
  load.set_layer_ids(std::move(ids));
  return load;
}

std::optional<double> MeanDispatches(const v1::LoadReport& report) {
  double sum = 0;
  size_t n = 0;
  for (const v1::LayerLoad& layer : report.layers()) {
    if (layer.slot_size() == 0 || layer.dispatches_size() == 0) return std::nullopt;
    for (uint64_t d : layer.dispatches()) sum += static_cast<double>(d);
    n += static_cast<size_t>(layer.dispatches_size());
  }
  if (n == 0) return std::nullopt;
  return sum / static_cast<double>(n);
}

}  // namespace ubep::balancer
