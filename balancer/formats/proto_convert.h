// Conversion between the shared protos (proto/ubep/v1) and balancer domain types, used at the
// edges (RPC servers, clients). Conversions from protos validate, since protos arrive from
// other processes: every error is InvalidArgument naming the field. Thread-compatible.
#ifndef UBEP_BALANCER_FORMATS_PROTO_CONVERT_H_
#define UBEP_BALANCER_FORMATS_PROTO_CONVERT_H_

#include <optional>

#include "absl/status/statusor.h"
#include "balancer/core/load_matrix.h"
#include "balancer/core/plan.h"
#include "ubep/v1/load.pb.h"
#include "ubep/v1/plan.pb.h"
#include "ubep/v1/topology.pb.h"

namespace ubep::balancer {

v1::Topology ToProto(const Topology& topology);
absl::StatusOr<Topology> FromProto(const v1::Topology& proto);

// kFull lists each expert's replicas; kCompact sends per-slot shares instead (plan.proto).
enum class PlanEncoding { kFull, kCompact };
v1::Plan ToProto(const Plan& plan, PlanEncoding encoding = PlanEncoding::kFull);

// A fingerprint of every field of `plan` (its compact encoding, serialized deterministically),
// the same in every process: what a daemon holding a plan prepared under a version and the
// balancer holding the plan committed under it compare (DaemonState.pending_fingerprint).
// Never 0, which stands for "not known".
uint64_t PlanFingerprint(const Plan& plan);
// Accepts either form.
absl::StatusOr<Plan> FromProto(const v1::Plan& proto);

// Per-logical-expert counts of a report as a load matrix with one row per reported layer
// (layer ids from the report). Slot-level layers are folded onto logical experts with `plan`,
// which must be the plan that was in force (null when the report has no slot-level layers;
// given, the report's experts must be the plan's). At most kMaxLayers x kMaxExperts.
// Where slot-level layers carry `dispatches` (per rank), each slot's count is scaled to the
// report's mean dispatches (MeanDispatches): count x mean / its rank's dispatches, so that a
// rank read one layer ahead of another weighs the same.
absl::StatusOr<LoadMatrix> LoadFromProto(const v1::LoadReport& report, const Plan* plan);

// The mean, over layers and ranks, of a report's per-rank dispatches: the steps its counts
// cover once scaled by LoadFromProto. nullopt unless every layer has slot counts and
// dispatches.
std::optional<double> MeanDispatches(const v1::LoadReport& report);

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_FORMATS_PROTO_CONVERT_H_
