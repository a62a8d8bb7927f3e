#include "balancer/server/balancer.h"

#include <algorithm>
#include <tuple>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <set>
#include <thread>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "balancer/core/metrics.h"
#include "balancer/formats/proto_convert.h"
#include "common/channel.h"
#include "common/clock.h"
#include "common/cpus.h"
#include "common/listing.h"
#include "common/logging.h"
#include "common/model_shape.h"
#include "common/shape_limits.h"
#include "common/timeout.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace ubep::balancer {
namespace {

// The most a report's seq may be ahead of the last one taken of its daemon (ReportLoad).
constexpr uint64_t kMaxReportSeqLead = uint64_t{1} << 32;

// What a report says besides its seq and the step its daemon is at, which a report sent again
// refreshes (daemon/balancer_link.cc): a report sent again under a seq must say the same.
uint64_t ReportFingerprint(const v1::ReportLoadRequest& request) {
  std::string load;
  request.load().SerializeToString(&load);
  return absl::HashOf(load, request.over_capacity_calls(), request.over_capacity_calls_before(),
                      request.plan_in_force());
}

// gRPC takes deadlines as wall-clock times (it converts them to its own monotonic clock at
// once): the one use of the wall clock here, both ways (a caller's deadline is read once, as
// the time left: TimeLeft). Every interval the balancer measures or waits out itself (health
// checks, the recovery grace, plan and commit times, LockBefore) is on MonotonicNow(), and
// step rates on BalancerOptions::step_clock (the same clock unless a test gives a FakeClock),
// so that a wall-clock step neither moves an effective step nor ends the grace early nor
// stretches a wait.
void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

// The time left before a caller's deadline, read the same way (none: no deadline).
std::optional<absl::Duration> TimeLeft(const grpc::ServerContext* context) {
  if (context == nullptr ||
      context->deadline() == std::chrono::system_clock::time_point::max()) {
    return std::nullopt;
  }
  return absl::FromChrono(context->deadline()) - absl::Now();
}

// On a PlanAndCommit error whose plan was decided nonetheless (committed, not yet
// acknowledged anywhere): the change asked for is made, not left for a later interval.
constexpr absl::string_view kDecidedPayload = "type.ubep.dev/plan-decided";

// When (on MonotonicNow) a caller's request must be answered: AnswerMargin (at least 100 ms)
// before its deadline; InfiniteFuture without a deadline.
absl::Time AnswerBy(const grpc::ServerContext* context) {
  const std::optional<absl::Duration> left = TimeLeft(context);
  if (!left.has_value()) return absl::InfiniteFuture();
  return MonotonicNow() + *left - AnswerMargin(*left, absl::Milliseconds(100));
}

// Takes `lock` unless another thread holds it for `patience` more. Polled every 5 ms rather
// than timed: ThreadSanitizer here does not intercept std::timed_mutex's timed lock
// (pthread_mutex_clocklock), and takes its unlock for the unlock of a mutex never locked.
bool LockBefore(std::unique_lock<std::mutex>& lock, absl::Duration patience) {
  const absl::Time until = MonotonicNow() + patience;
  while (!lock.try_lock()) {
    if (MonotonicNow() >= until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

std::vector<double> Buckets(double first, double factor, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i, first *= factor) b.push_back(first);
  return b;
}

struct CallResult {
  grpc::Status status;
  grpc::ByteBuffer response;
};

// Sends one request, serialized once, to every channel at once from this thread through one
// completion queue (no thread per daemon); returns each call's status and response bytes.
std::vector<CallResult> FanOut(const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                               const std::string& method, const google::protobuf::Message& request,
                               absl::Duration timeout) {
  grpc::ByteBuffer payload;
  bool own = false;
  std::vector<CallResult> results(channels.size());
  if (!grpc::SerializationTraits<google::protobuf::Message>::Serialize(request, &payload, &own).ok()) {
    for (CallResult& r : results) r.status = grpc::Status(grpc::StatusCode::INTERNAL, "serialize");
    return results;
  }
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::vector<std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::ByteBuffer>>> readers;
  for (size_t i = 0; i < channels.size(); ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    SetDeadline(*contexts.back(), timeout);
    stubs.push_back(std::make_unique<grpc::GenericStub>(channels[i]));
    readers.push_back(stubs.back()->PrepareUnaryCall(contexts.back().get(), method, payload, &cq));
    readers.back()->StartCall();
    readers.back()->Finish(&results[i].response, &results[i].status, reinterpret_cast<void*>(i));
  }
  for (size_t done = 0; done < channels.size(); ++done) {
    void* tag = nullptr;
    bool ok = false;
    if (!cq.Next(&tag, &ok)) break;
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  return results;
}

template <typename T>
bool Parse(grpc::ByteBuffer& buffer, T* message) {
  return grpc::SerializationTraits<T>::Deserialize(&buffer, message).ok();
}

// A report of no step run and nothing counted (an idle group's).
bool NothingRun(const v1::LoadReport& load, const v1::ReportLoadRequest& request) {
  if (load.last_step() != load.first_step() || request.over_capacity_calls() != 0 ||
      request.over_capacity_calls_before() != 0) {
    return false;
  }
  for (const v1::LayerLoad& layer : load.layers()) {
    for (const uint64_t n : layer.slot()) {
      if (n != 0) return false;
    }
    for (const uint64_t n : layer.dispatches()) {
      if (n != 0) return false;
    }
  }
  return true;
}

// The rows of `load` and the layers of `previous` at `layers` (ascending), as a load and a
// plan of their own.
std::pair<LoadMatrix, Plan> LayersOf(const LoadMatrix& load, const Plan& previous,
                                     const std::vector<int>& layers) {
  LoadMatrix part(static_cast<int>(layers.size()), load.num_experts());
  std::vector<int> ids;
  // The header alone, then the chunk's layers (a copy of every layer, by each planner
  // thread, was the whole plan times the thread count).
  Plan part_previous;
  part_previous.version = previous.version;
  part_previous.topology = previous.topology;
  part_previous.num_experts = previous.num_experts;
  part_previous.excluded_ranks = previous.excluded_ranks;
  part_previous.layers.reserve(layers.size());
  part_previous.layer_ids.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const int l = layers[i];
    for (int e = 0; e < load.num_experts(); ++e) part.at(static_cast<int>(i), e) = load.at(l, e);
    ids.push_back(load.layer_ids()[l]);
    part_previous.layers.push_back(previous.layers[l]);
    part_previous.layer_ids.push_back(previous.layer_ids[l]);
  }
  part.set_layer_ids(std::move(ids));
  return {std::move(part), std::move(part_previous)};
}

// ComputePlan over contiguous chunks of layers, one thread per chunk, merged in order.
absl::StatusOr<Plan> PlanInParallel(const LoadMatrix& load, const Topology& topology,
                                    const Plan& previous, const PlannerOptions& options,
                                    int threads) {
  const int L = load.num_layers();
  threads = std::clamp(threads, 1, std::max(L, 1));
  if (threads == 1) return ComputePlan(load, topology, &previous, options);
  std::vector<absl::StatusOr<Plan>> parts(threads, absl::UnknownError("not run"));
  std::vector<std::thread> workers;
  for (int c = 0; c < threads; ++c) {
    workers.emplace_back([&, c] {
      std::vector<int> layers;
      for (int l = L * c / threads; l < L * (c + 1) / threads; ++l) layers.push_back(l);
      const auto [chunk, chunk_previous] = LayersOf(load, previous, layers);
      parts[c] = ComputePlan(chunk, topology, &chunk_previous, options);
    });
  }
  for (std::thread& w : workers) w.join();
  Plan merged = previous;
  merged.layers.clear();
  merged.layer_ids.clear();
  for (absl::StatusOr<Plan>& part : parts) {
    if (!part.ok()) return part.status();
    merged.version = part->version;
    merged.layers.insert(merged.layers.end(), part->layers.begin(), part->layers.end());
    merged.layer_ids.insert(merged.layer_ids.end(), part->layer_ids.begin(), part->layer_ids.end());
  }
  return merged;
}

// PlanInParallel with a migration budget per layer (`budgets`, options' budget where empty):
// the layers of each budget planned together. A layer's plan does not depend on the layers
// planned with it when the budget is not negative (both policies plan layer by layer then).
absl::StatusOr<Plan> PlanWithLayerBudgets(const LoadMatrix& load, const Topology& topology,
                                          const Plan& previous, PlannerOptions options,
                                          const std::vector<int>& budgets, int threads) {
  std::map<int, std::vector<int>> layers_of;  // budget -> its layers, ascending.
  for (int l = 0; l < load.num_layers(); ++l) {
    layers_of[budgets.empty() ? options.migration_budget : budgets[l]].push_back(l);
  }
  if (layers_of.size() <= 1) {
    if (!layers_of.empty()) options.migration_budget = layers_of.begin()->first;
    return PlanInParallel(load, topology, previous, options, threads);
  }
  Plan merged = previous;
  for (const auto& [budget, layers] : layers_of) {
    const auto [part, part_previous] = LayersOf(load, previous, layers);
    options.migration_budget = budget;
    absl::StatusOr<Plan> planned = PlanInParallel(part, topology, part_previous, options, threads);
    if (!planned.ok()) return planned.status();
    merged.version = planned->version;  // The planner's versioning, as PlanInParallel's merge.
    for (size_t i = 0; i < layers.size(); ++i) merged.layers[layers[i]] = planned->layers[i];
  }
  return merged;
}

bool SamePlacement(const Plan& a, const Plan& b) {
  if (a.num_layers() != b.num_layers() || a.excluded_ranks != b.excluded_ranks) return false;
  for (int l = 0; l < a.num_layers(); ++l) {
    if (a.layers[l].slot_expert != b.layers[l].slot_expert) return false;
    for (size_t p = 0; p < a.layers[l].slot_share.size(); ++p) {
      if (std::abs(a.layers[l].slot_share[p] - b.layers[l].slot_share[p]) > 1e-9) return false;
    }
  }
  return true;
}

// A plan for the ranks not in `excluded`, planned on them alone and spread back over the full
// topology: excluded ranks keep their experts at share 0 (nothing to copy; they are not sent
// tokens). When the members change, the previous placement may lack experts (their only
// replicas were on a lost node): RepairMembers places them first, with as few changes as it
// can, and the planner then moves no more than the daemons' free weight buffers allow.

// Places every expert `layer` (the members' slots, S per member) lacks into a slot of a
// replicated expert (never the last replica): a slot of a returning member (`returning`: one
// the plan in force excludes, staged whole anyway) first, else on the staying member with the
// fewest such changes so far, the slot of the expert with the most replicas. Returns the most
// slots it changed on one staying member.
int RepairMembers(LayerPlan& layer, int S, const std::vector<bool>& returning, int num_experts) {
  std::vector<int> count(num_experts, 0);
  for (int e : layer.slot_expert) ++count[e];
  std::vector<int> changes(returning.size(), 0);
  for (int missing = 0; missing < num_experts; ++missing) {
    if (count[missing] > 0) continue;
    int best = -1;
    std::tuple<int, int, int> best_key;
    for (int p = 0; p < static_cast<int>(layer.slot_expert.size()); ++p) {
      const int e = layer.slot_expert[p], m = p / S;
      if (count[e] < 2) continue;
      const std::tuple<int, int, int> key{returning[m] ? 0 : 1 + changes[m], -count[e], p};
      if (best < 0 || key < best_key) best = p, best_key = key;
    }
    if (best < 0) break;  // Fewer slots than experts: refused by the caller before.
    --count[layer.slot_expert[best]];
    ++count[missing];
    layer.slot_expert[best] = missing;
    if (!returning[best / S]) ++changes[best / S];
  }
  return changes.empty() ? 0 : *std::max_element(changes.begin(), changes.end());
}

}  // namespace

absl::StatusOr<Plan> PlanForMembers(const LoadMatrix& load, const Plan& previous,
                                    const std::vector<int>& excluded, PlannerOptions planner,
                                    int threads) {
  const Topology& full = previous.topology;
  const int S = full.slots_per_rank;
  std::vector<int> members;
  for (int r = 0; r < full.num_ranks; ++r) {
    if (!std::binary_search(excluded.begin(), excluded.end(), r)) members.push_back(r);
  }
  if (members.empty()) return absl::FailedPreconditionError("every rank is excluded");
  Topology sub = full;
  sub.num_ranks = static_cast<int>(members.size());
  sub.num_nodes = 1;
  sub.num_groups = 1;
  if (static_cast<int64_t>(sub.num_slots()) < previous.num_experts) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the ", members.size(), " ranks left hold ", sub.num_slots(), " slots, fewer than the ",
        previous.num_experts, " experts"));
  }
  Plan sub_previous = previous;
  sub_previous.topology = sub;
  sub_previous.excluded_ranks.clear();
  for (LayerPlan& layer : sub_previous.layers) {
    LayerPlan kept;
    for (int r : members) {
      for (int i = 0; i < S; ++i) {
        kept.slot_expert.push_back(layer.slot_expert[r * S + i]);
        kept.slot_share.push_back(layer.slot_share[r * S + i]);
      }
    }
    layer = std::move(kept);
  }
  std::vector<int> budgets;  // Per layer; empty: the planner's for every layer.
  if (excluded != previous.excluded_ranks || !ValidatePlan(sub_previous).ok()) {
    std::vector<bool> returning(members.size());
    for (size_t m = 0; m < members.size(); ++m) {
      returning[m] = std::binary_search(previous.excluded_ranks.begin(),
                                        previous.excluded_ranks.end(), members[m]);
    }
    // The slots repaired on a rank count against its budget in that layer (the daemons
    // count slots changed from the plan in force): each layer is planned with the budget its
    // repairs leave, not the smallest any layer's leave.
    budgets.assign(sub_previous.layers.size(), planner.migration_budget);
    for (size_t l = 0; l < sub_previous.layers.size(); ++l) {
      LayerPlan& layer = sub_previous.layers[l];
      const int repaired = RepairMembers(layer, S, returning, previous.num_experts);
      SetEqualShares(previous.num_experts, layer);
      if (planner.migration_budget < 0) continue;
      if (repaired > planner.migration_budget) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the ranks left need ", repaired, " new experts on one rank in layer ", l,
            " (their only replicas were on the excluded ranks), but the daemons take ",
            planner.migration_budget, " per rank and layer: restart them with ubepd "
            "--free_buffers ", repaired, " or more"));
      }
      budgets[l] -= repaired;
    }
  }
  absl::StatusOr<Plan> sub_plan =
      PlanWithLayerBudgets(load, sub, sub_previous, planner, budgets, threads);
  if (!sub_plan.ok()) return sub_plan.status();
  Plan plan = previous;
  plan.excluded_ranks = excluded;
  for (int l = 0; l < plan.num_layers(); ++l) {
    LayerPlan& layer = plan.layers[l];
    for (int r : excluded) {
      for (int i = 0; i < S; ++i) layer.slot_share[r * S + i] = 0;
    }
    for (size_t m = 0; m < members.size(); ++m) {
      for (int i = 0; i < S; ++i) {
        layer.slot_expert[members[m] * S + i] = sub_plan->layers[l].slot_expert[m * S + i];
        layer.slot_share[members[m] * S + i] = sub_plan->layers[l].slot_share[m * S + i];
      }
    }
  }
  if (absl::Status valid = ValidatePlan(plan); !valid.ok()) return valid;
  return plan;
}

Balancer::Balancer(BalancerOptions options, std::shared_ptr<prometheus::Registry> registry)
    : options_(std::move(options)), started_(MonotonicNow()), registry_(std::move(registry)) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  prometheus::Registry& r = *registry_;
  plan_version_ = &BuildGauge().Name("ubep_balancer_plan_version")
                       .Help("Version of the newest committed plan.").Register(r).Add({});
  plans_committed_ = &BuildCounter().Name("ubep_balancer_plans_committed_total")
                          .Help("Plans committed on every daemon.").Register(r).Add({});
  plans_aborted_ = &BuildCounter().Name("ubep_balancer_plans_aborted_total")
                        .Help("Plans aborted (a daemon failed to prepare, or a prepare was orphaned).")
                        .Register(r).Add({});
  plan_seconds_ = &BuildHistogram().Name("ubep_balancer_plan_compute_seconds")
                       .Help("Time to compute a plan.").Register(r)
                       .Add({}, prometheus::Histogram::BucketBoundaries(Buckets(0.001, 2, 14)));
  commit_seconds_ = &BuildHistogram().Name("ubep_balancer_commit_seconds")
                         .Help("Prepare sent to all daemons committed (weight copies included).")
                         .Register(r)
                         // 1 ms to 131 s: a commit's Prepare and Commit may each take up to
                         // --rpc_timeout, which weight copies may need raised well past 8 s.
                         .Add({}, prometheus::Histogram::BucketBoundaries(Buckets(0.001, 2, 18)));
  migrated_slots_ = &BuildCounter().Name("ubep_balancer_migrated_slots_total")
                         .Help("Slots whose expert changed in committed plans.").Register(r).Add({});
  migrated_bytes_ = &BuildCounter().Name("ubep_balancer_migrated_bytes_total")
                         .Help("Expert weight bytes the daemons staged for committed plans.")
                         .Register(r).Add({});
  cross_domain_bytes_ = &BuildCounter().Name("ubep_balancer_migrated_cross_domain_bytes_total")
                             .Help("Of the migrated bytes: read from daemons of another load/store "
                                   "domain (the rest were copies between mapped arenas).")
                             .Register(r).Add({});
  imbalance_ = &BuildGauge().Name("ubep_balancer_imbalance_ratio")
                    .Help("Per MoE layer, busiest rank over mean: measured from the daemons' "
                          "counters over the last interval (when=measured), and predicted on "
                          "the load window before and after the last plan change.")
                    .Register(r);
  registered_daemons_ = &BuildGauge().Name("ubep_balancer_registered_daemons")
                             .Help("Daemons registered.").Register(r).Add({});
  registered_ranks_ = &BuildGauge().Name("ubep_balancer_registered_ranks")
                           .Help("Ranks of the registered daemons.").Register(r).Add({});
  healthy_daemons_ = &BuildGauge().Name("ubep_balancer_healthy_daemons")
                          .Help("Registered daemons passing their health checks.").Register(r).Add({});
  awaiting_model_ = &BuildGauge().Name("ubep_balancer_daemons_awaiting_model")
                         .Help("Registered daemons whose group of another model than the "
                               "cluster's waits for the nodes still holding ranks of the "
                               "cluster's model (a model change under way).")
                         .Register(r).Add({});
  refused_daemons_ = &BuildGauge().Name("ubep_balancer_refused_daemons")
                          .Help("Registered daemons that refused a decided Commit for good (a "
                                "client wrote into their plan area): they are sent no plan and "
                                "their ranks are excluded until they register again.")
                          .Register(r).Add({});
  reports_ = &BuildCounter().Name("ubep_balancer_reports_total")
                  .Help("Load reports accepted.").Register(r).Add({});
  rejected_ = &BuildCounter().Name("ubep_balancer_rejected_reports_total")
                   .Help("Load reports rejected, by reason.").Register(r);
  stale_reports_ = &BuildCounter().Name("ubep_balancer_stale_reports_total")
                        .Help("Load reports refused as another plan's counts: counted under "
                              "a plan not in force for every step they span.")
                        .Register(r).Add({});
  over_capacity_calls_ =
      &BuildCounter()
           .Name("ubep_balancer_over_capacity_calls_total")
           .Help(
               "Data-plane calls the daemons reported failed because a rank was routed more "
               "rows than its receive capacity (one per rank and dropped call).")
           .Register(r)
           .Add({});
}

Balancer::~Balancer() { thread_.reset(); }

void Balancer::Start() {
  thread_ = std::make_unique<PeriodicThread>([this] { return options_.interval; },
                                             [this] { Tick(); });
}

Balancer::Shape::Shape(uint32_t world_size, const v1::ModelShape& shape)
    : world(static_cast<int>(world_size)),
      layers(static_cast<int>(shape.num_layers())),
      experts(static_cast<int>(shape.num_experts())),
      slots(static_cast<int>(shape.slots_per_rank())),
      model(shape) {}

bool Balancer::Shape::operator==(const Shape& other) const {
  return ModelDifferences(world, model, other.world, other.model).empty();
}

std::string Balancer::Shape::Describe() const {
  return absl::StrCat(world, " ranks x ", slots, " slots, ", layers, " layers x ", experts,
                      " experts, hidden ", model.hidden(), ", top-", model.top_k(), ", ",
                      model.max_tokens(), " tokens, ", model.bytes_per_expert(),
                      " bytes per expert, ", v1::DType_Name(model.dtype()));
}

std::string Balancer::Shape::Differences(const Shape& cluster) const {
  std::vector<std::string> differences;
  for (const ModelFieldDifference& d :
       ModelDifferences(world, model, cluster.world, cluster.model)) {
    differences.push_back(absl::StrCat(d.field, " is ", d.value, ", the cluster's ", d.other));
  }
  return absl::StrJoin(differences, "; ");
}

grpc::Status Balancer::Reject(const char* reason, grpc::StatusCode code, std::string message) {
  rejected_->Add({{"reason", reason}}).Increment();
  return grpc::Status(code, std::move(message));
}

grpc::Status Balancer::Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                                v1::RegisterResponse* response) {
  if (request->node().empty() || request->address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "node and address are required");
  }
  // A node's name goes into every daemon's GetGroup answer, metric labels and log lines: a
  // host or Kubernetes node name (at most 253 of letters, digits, '.', '-' and '_'), not
  // megabytes that no daemon's answer could hold, nor a line break forging a log line.
  if (!ValidNodeName(request->node())) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("node: a name of at most ", kMaxNodeName,
                     " letters, digits, '.', '-' and '_' is expected (a host or node name); ",
                     request->node().size() > kMaxNodeName
                         ? absl::StrCat("this one has ", request->node().size(), " bytes")
                         : std::string("this one has other characters")));
  }
  // The other strings go into every daemon's GetGroup answer and into log lines too: of the
  // sizes they have (a host:port, a Unix socket path, ubepd's own tag), printable.
  const std::tuple<const char*, const std::string&, size_t> fields[] = {
      {"address", request->address(), 1024},
      {"arena_socket", request->arena_socket(), 4096},  // A path (PATH_MAX).
      {"incarnation", request->incarnation(), 256},
      {"backend", request->backend(), 16}};
  for (const auto& [field, value, max] : fields) {
    if (value.size() > max) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(field, ": ", value.size(), " bytes, over the ", max,
                                       " it may have"));
    }
    if (const auto bad = std::find_if(value.begin(), value.end(),
                                      [](unsigned char c) { return c < 0x20 || c == 0x7f; });
        bad != value.end()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(field, ": a control character at byte ",
                                       static_cast<int64_t>(bad - value.begin())));
    }
  }
  if (request->free_buffers() > kMaxSlotsPerRank) {
    // The migration budget, per rank and layer: more than a rank's slots changes nothing, and
    // as an int it would wrap to a negative budget, read as none.
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("free_buffers ", request->free_buffers(), " is over ",
                                     kMaxSlotsPerRank, ", the most slots a rank has"));
  }
  const v1::ModelShape& s = request->shape();
  std::optional<Shape> shape;
  if (s.num_layers() > 0) {
    // The shape a daemon's group attached with (ubepd checked it); a daemon of another build
    // or a bad caller may send anything, and a window is sized from it.
    const std::pair<const char*, std::pair<uint32_t, uint32_t>> limits[] = {
        {"world_size", {request->world_size(), kMaxWorld}},
        {"shape.num_layers", {s.num_layers(), kMaxLayers}},
        {"shape.num_experts", {s.num_experts(), kMaxExperts}},
        {"shape.slots_per_rank", {s.slots_per_rank(), kMaxSlotsPerRank}}};
    for (const auto& [name, value_and_max] : limits) {
      const auto [value, max] = value_and_max;
      if (value == 0 || value > max) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat(name, " ", value, " is outside [1, ", max, "]"));
      }
    }
    if (static_cast<uint64_t>(s.slots_per_rank()) * request->world_size() < s.num_experts()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("shape.slots_per_rank ", s.slots_per_rank(), " x world_size ",
                                       request->world_size(), " cannot hold ", s.num_experts(),
                                       " experts"));
    }
    shape = Shape(request->world_size(), s);
    if (request->ranks_size() > static_cast<int>(request->world_size())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(request->ranks_size(), " ranks for a group of ",
                                       request->world_size()));
    }
    for (uint32_t r : request->ranks()) {
      if (r >= request->world_size()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("rank ", r, " is outside [0, ", request->world_size(), ")"));
      }
    }
    // A daemon hosts a block of consecutive ranks (ranks are node-major); its reports cover
    // the slots of that block, and a plan excludes each rank once.
    std::vector<uint32_t> ranks(request->ranks().begin(), request->ranks().end());
    std::sort(ranks.begin(), ranks.end());
    for (size_t i = 1; i < ranks.size(); ++i) {
      if (ranks[i] != ranks[i - 1] + 1) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("ranks ", absl::StrJoin(request->ranks(), ", "),
                                         " are not one block of consecutive ranks, each once"));
      }
    }
  } else if (request->ranks_size() > 0) {
    // Ranks are checked against the group's shape, which comes with them.
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(request->ranks_size(), " ranks (from rank ",
                                     request->ranks(0), ") come without the group's shape (a "
                                     "daemon with no group attached registers no ranks)"));
  }
  // Peers' ranks a daemon saw restart (it maps their arenas: it has a group), within it: each
  // keeps a healthy node out, so a registration without a group names none.
  if (request->restarted_ranks_size() > 0 && !shape.has_value()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(request->restarted_ranks_size(),
                                     " restarted_ranks (from rank ", request->restarted_ranks(0),
                                     ") come without the group's shape (a daemon with no group "
                                     "maps no peer)"));
  }
  if (request->restarted_ranks_size() > static_cast<int>(request->world_size())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(request->restarted_ranks_size(),
                                     " restarted_ranks for a group of ", request->world_size()));
  }
  for (uint32_t r : request->restarted_ranks()) {
    if (r >= request->world_size()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("restarted_ranks: rank ", r, " is outside [0, ",
                                       request->world_size(), ")"));
    }
  }
  auto other_shape = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shape.has_value() && shape_.has_value() && *shape_ != *shape;
  };
  // A model change (the clients of every node attached again with another model, and each
  // daemon made a new group) starts the cluster over once every other node holding ranks of
  // the cluster's model asked for the same one: up or down, or restarted and not attached
  // yet, a node still on the old model holds it back (a node down is forgotten with ubepctl,
  // or registers the new model when it is back). Ranks no node holds (a node forgotten, nodes
  // a restarted balancer has not heard from) hold nothing back.
  auto may_start_over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return OthersLeftTheModel(request->node(), shape);
  };
  // Starting over must not straddle a plan change or recovery: serialized with them, as
  // Forget is (commit_mu_ before mu_); only when it may happen.
  std::unique_lock<std::mutex> serial;
  bool starting_over = false;
  {
    MutexLock lock(&mu_);
    starting_over = other_shape() && may_start_over();
  }
  if (starting_over) {
    if (grpc::Status s = Serialize(serial, AnswerBy(context),
                                   absl::StrCat("node ", request->node(), " was not registered"));
        !s.ok()) {
      return s;
    }
  }
  MutexLock lock(&mu_);
  if (other_shape()) {  // Again, under the lock held from here on.
    if (!may_start_over()) {
      if (auto known = daemons_.find(request->node()); known != daemons_.end()) {
        known->second.wanted_shape = shape;
        UpdateRegistryGauges();
      }
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("node ", request->node(), " serves another model than the cluster's: ",
                       shape->Differences(*shape_),
                       " (the cluster takes it once every node holding ranks of its model "
                       "registers it)"));
    }
    if (!serial.owns_lock()) {
      // The cluster changed since it was looked at: the next registration starts over.
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the cluster's model changed meanwhile; register again");
    }
    UBEP_LOG(WARNING) << "node " << request->node() << " registers a group of "
                      << shape->Describe() << "; no node serves the cluster's "
                      << shape_->Describe() << " any more: starting over with the new group";
    ForgetGroupLocked(request->node());
  }
  // Another ubepd answering under this name: two daemons given the same --node (a copied
  // configuration) would each take the other's registration for a restart, neither's ranks
  // mapped by anyone. The same process registers from the same address (a
  // group of another model may host other ranks), and a restart hosts the ranks it hosted;
  // another address with other ranks is refused until the process registered under the name
  // fails its health checks. So is one from another address naming no ranks yet (a ubepd's
  // first registration, before its clients attach): a second ubepd, or a restart at a new
  // address, which is taken once the process before it fails its health checks (seconds:
  // --health_failures x --health_interval), as a restart there must anyway.
  if (const auto same = daemons_.find(request->node());
      same != daemons_.end() && same->second.healthy && same->second.info.ranks_size() > 0 &&
      same->second.info.address() != request->address()) {
    const auto block = [](const auto& ranks) {
      const auto [lo, hi] = std::minmax_element(ranks.begin(), ranks.end());
      return absl::StrCat(*lo, "-", *hi);
    };
    if (request->ranks_size() == 0) {
      return grpc::Status(
          grpc::StatusCode::ALREADY_EXISTS,
          absl::StrCat("node ", request->node(), " is registered by another ubepd (at ",
                       same->second.info.address(), ", ranks ", block(same->second.info.ranks()),
                       ") that answers its health checks; this one (at ", request->address(),
                       ", no ranks yet) is taken once that one fails them (a restart at a new "
                       "address), or needs a --node of its own"));
    }
    if (const std::string theirs = block(same->second.info.ranks()), ours = block(request->ranks());
        theirs != ours) {
      return grpc::Status(
          grpc::StatusCode::ALREADY_EXISTS,
          absl::StrCat("node ", request->node(), " is registered by another ubepd (at ",
                       same->second.info.address(), ", ranks ", theirs,
                       ") that answers its health checks; this one (at ", request->address(),
                       ", ranks ", ours, ") needs a --node of its own"));
    }
  }
  for (const auto& [name, other] : daemons_) {
    if (name == request->node() || !other.healthy) continue;
    for (uint32_t r : request->ranks()) {
      if (std::find(other.info.ranks().begin(), other.info.ranks().end(), r) != other.info.ranks().end()) {
        return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                            absl::StrCat("rank ", r, " of node ", request->node(),
                                         " is already served by node ", name));
      }
    }
  }
  // The cluster's shape is the first registered one that passed every check.
  if (shape.has_value() && !shape_.has_value()) {
    shape_ = shape;
    window_ = std::make_unique<LoadWindow>(shape->layers, shape->experts, options_.window_intervals,
                                           options_.ewma_alpha);
  }
  // Nodes failing their health checks whose ranks this registration takes over: replaced (a
  // new daemon under another name). Such a node is forgotten once other nodes hold all its
  // ranks (one node or several); its entry would keep them excluded.
  std::set<uint32_t> held(request->ranks().begin(), request->ranks().end());
  for (const auto& [name, other] : daemons_) {
    if (name != request->node() && other.healthy) held.insert(other.info.ranks().begin(), other.info.ranks().end());
  }
  std::vector<std::string> replaced;
  for (auto it = daemons_.begin(); it != daemons_.end();) {
    const auto& ranks = it->second.info.ranks();
    const bool overlaps = std::any_of(ranks.begin(), ranks.end(), [&](uint32_t r) {
      return std::find(request->ranks().begin(), request->ranks().end(), r) != request->ranks().end();
    });
    if (it->first == request->node() || it->second.healthy || !overlaps) {
      ++it;
      continue;
    }
    replaced.push_back(it->first);
    if (std::all_of(ranks.begin(), ranks.end(), [&](uint32_t r) { return held.contains(r); })) {
      UBEP_LOG(INFO) << "node " << it->first << " is forgotten: other nodes serve its ranks";
      drained_.erase(it->first);
      it = daemons_.erase(it);
    } else {
      ++it;
    }
  }
  // A new ubepd process of a group over several nodes has new, empty arenas (its clients
  // attach again and load their weights). Its ranks stay excluded, as if drained, until the
  // operator undrains the node; meanwhile its peers map its new arenas (they may while the
  // plan excludes those ranks) and it catches up on the cluster's plan (CatchUp), so that the
  // plan taking its ranks back stages their weights correctly. That is when it:
  // - replaces the process registered under its name (a restart);
  // - takes over a down node's ranks (replaced, above);
  // - has every rank excluded by the plan in force: a drained node registering again after a
  //   restart of the balancer that learned the plan first (Recover takes the nodes registered
  //   by then to be drained by the same rule); else an undrain nobody asked for would follow.
  // (New: none registered under its name, one registered without a group, or another
  // incarnation. The same process registering again is not drained again.)
  const auto known = daemons_.find(request->node());
  const bool restarted = known != daemons_.end() && known->second.info.ranks_size() > 0 &&
                         !known->second.info.incarnation().empty() &&
                         known->second.info.incarnation() != request->incarnation();
  const bool new_process = known == daemons_.end() || known->second.info.ranks().empty() ||
                           known->second.info.incarnation() != request->incarnation();
  std::string why;
  if (restarted) {
    why = "restarted (a new ubepd process)";
  } else if (new_process && !replaced.empty()) {
    why = absl::StrCat("takes over ranks of node", replaced.size() > 1 ? "s " : " ",
                       absl::StrJoin(replaced, ", "), ", which failed ",
                       replaced.size() > 1 ? "their" : "its", " health checks");
  } else if (new_process && plan_.has_value() && request->ranks_size() > 0 &&
             std::all_of(request->ranks().begin(), request->ranks().end(),
                         [&](uint32_t r) { return plan_->excluded(static_cast<int>(r)); })) {
    why = absl::StrCat("registered with every rank excluded by plan v", plan_->version);
  }
  Daemon& d = daemons_[request->node()];
  // A new channel for a new address or a new process (the old one's may be in reconnect
  // backoff from the process before, and fail its first calls without trying). GetState
  // carries the committed plan: as large as a Prepare.
  if (d.info.address() != request->address() || d.channel == nullptr || new_process) {
    d.channel = ControlChannel(request->address(), kMaxControlMessageBytes);
  }
  // The process registered under this name already (it registers again when its group's
  // shape changes, or after this balancer forgot it): its reports go on numbering from there.
  const bool same_process =
      !request->incarnation().empty() && d.info.incarnation() == request->incarnation();
  if (d.info.incarnation() != request->incarnation()) {
    // A new process: its ranks count steps from where its clients resume, not from the old
    // process's steps.
    d.ForgetSteps();
  }
  // Registered again without a group: the ranks it held keep holding a model change back.
  d.held_ranks_before_restart = request->ranks().empty() && d.HoldsOldModel();
  d.info = *request;
  d.wanted_shape.reset();
  // A Commit it refused for good is asked about again (its state is read anew) once a new
  // process, or a group formed again (another incarnation), registers: neither holds the plan
  // area its clients wrote into. (The same process registers again when a peer restarted.)
  if (!same_process) d.refused.clear();
  d.ForgetInterval();
  d.first_rank = request->ranks().empty()
                     ? 0
                     : static_cast<int>(*std::min_element(request->ranks().begin(), request->ranks().end()));
  d.needs_state = true;
  d.healthy = true;
  d.failures = 0;
  d.taken_over_logged = false;
  d.down_since = absl::InfiniteFuture();
  if (!same_process) d.last_seq = 0;
  if (!why.empty() && shape_.has_value() && request->ranks_size() < shape_->world &&
      !drained_.contains(request->node())) {
    // Drained as registered (healthy, its ranks as it says), unless that would leave no rank
    // serving, as an operator's drain would (the other nodes drained or down, say): its
    // ranks then stay in.
    drained_.emplace(request->node(), restarted || !replaced.empty() ? DrainCause::kRestart
                                                                     : DrainCause::kExcludedByPlan);
    if (static_cast<int>(DesiredExcluded().size()) >= shape_->world) {
      drained_.erase(request->node());
      // (Not drained later either: its peers map its new arenas as they learn of them.)
      UBEP_LOG(WARNING) << "node " << request->node() << " " << why
                        << ", but keeping its ranks out would leave no rank serving: they stay in";
    } else {
      UBEP_LOG(WARNING) << "node " << request->node() << " " << why
                        << ": its ranks stay excluded until it is undrained";
    }
  }
  if (!why.empty()) d.restart_handled = request->incarnation();
  KeepOutRestartedPeers(*request);
  UBEP_LOG(INFO) << "registered node " << request->node() << " at " << request->address() << " ("
                 << request->ranks_size() << " ranks)";
  response->set_report_interval_ms(absl::ToInt64Milliseconds(options_.report_interval));
  return grpc::Status::OK;
}

void Balancer::ForgetGroupLocked(const std::string& node) {
  for (auto it = daemons_.begin(); it != daemons_.end();) {
    // Down daemons of the old group: their ranks were of its shape.
    if (it->first != node && !it->second.healthy && !it->second.info.ranks().empty()) {
      drained_.erase(it->first);
      it = daemons_.erase(it);
      continue;
    }
    Daemon& d = it->second;
    // Its ranks were the old group's: it registers its new group's (the registrant now, the
    // others that moved when they register again), as a node new to the group.
    d.info.clear_ranks();
    d.info.clear_restarted_ranks();  // Peers' ranks of the old group.
    d.held_ranks_before_restart = false;
    d.wanted_shape.reset();
    d.committed = d.pending = 0;
    d.needs_state = true;
    d.ForgetSteps();  // The new group's ranks count their own steps.
    d.ForgetInterval();
    d.interval_over_capacity = 0;
    d.rate = LoadMatrix();
    d.rank_rate.clear();
    ++it;
  }
  for (int l = 0; shape_.has_value() && l < shape_->layers; ++l) {
    for (const char* when : {"measured", "before", "after"}) SetImbalance(l, when, NAN);
  }
  drained_.clear();  // The old group's members.
  shape_.reset();
  window_.reset();
  plan_.reset();
  plan_effective_step_ = 0;
  effective_step_learned_ = false;
  missing_.clear();
  missing_since_ = absl::InfiniteFuture();
  highest_version_ = 0;  // The new group numbers its plans from its own first one.
  aborted_versions_.clear();
  held_logged_.clear();
  measured_.clear();
  above_threshold_ = 0;
  over_capacity_ = 0;
  drops_version_ = 0;
  quiet_intervals_ = 0;
  capacity_warned_version_ = 0;
  rebalance_requested_ = false;
  plan_version_->Set(0);
}

bool Balancer::OthersLeftTheModel(const std::string& node,
                                  const std::optional<Shape>& model) const {
  bool asked = false;
  for (const auto& [name, d] : daemons_) {
    if (name == node || !d.HoldsOldModel()) continue;
    if (!d.wanted_shape.has_value() || (model.has_value() && d.wanted_shape != model)) return false;
    asked = true;
  }
  return model.has_value() || asked;
}

void Balancer::KeepOutRestartedPeers(const v1::RegisterRequest& request) {
  if (request.restarted_ranks().empty() || !plan_.has_value()) return;
  const std::set<uint32_t> restarted(request.restarted_ranks().begin(),
                                     request.restarted_ranks().end());
  for (auto& [name, other] : daemons_) {
    if (name == request.node() || !other.healthy || drained_.contains(name) ||
        other.info.incarnation().empty() || other.restart_handled == other.info.incarnation()) {
      continue;
    }
    std::vector<uint32_t> kept;  // Its ranks the registrant saw restart that the plan keeps.
    for (uint32_t r : other.info.ranks()) {
      if (restarted.contains(r) && !plan_->excluded(static_cast<int>(r))) kept.push_back(r);
    }
    if (kept.empty()) continue;
    // This balancer did not see the node restart (it registered as new after a restart of
    // the balancer): as a restart it did see, its ranks are kept out until it is undrained,
    // so that its peers may map its new arenas.
    const std::string why = absl::StrCat(
        "node ", name, " restarted (node ", request.node(),
        " maps an older ubepd process's arenas for its rank", kept.size() > 1 ? "s " : " ",
        absl::StrJoin(kept, ", "), ")");
    drained_.emplace(name, DrainCause::kRestart);
    if (shape_.has_value() && static_cast<int>(DesiredExcluded().size()) >= shape_->world) {
      // Refused where it would leave no rank serving, as an operator's drain is (the
      // registrant's own ranks are drained too, say); taken again at each tick, so it holds
      // once another node serves.
      drained_.erase(name);
      if (other.restart_left_in != other.info.incarnation()) {
        other.restart_left_in = other.info.incarnation();
        UBEP_LOG(WARNING) << why << ", but keeping its ranks out would leave no rank serving: "
                          << "they stay in for now";
      }
      continue;
    }
    other.restart_handled = other.info.incarnation();
    UBEP_LOG(WARNING) << why << ": its ranks stay excluded until it is undrained";
  }
}

grpc::Status Balancer::GetGroup(grpc::ServerContext*, const v1::GetGroupRequest* request,
                                v1::GetGroupResponse* response) {
  MutexLock lock(&mu_);
  if (daemons_.find(request->node()) == daemons_.end()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("node \"", request->node(), "\" is not registered; register first"));
  }
  if (shape_.has_value()) response->set_world_size(static_cast<uint32_t>(shape_->world));
  for (const auto& [name, d] : daemons_) {
    v1::GroupMember* member = response->add_members();
    member->set_node(name);
    *member->mutable_ranks() = d.info.ranks();
    member->set_domain(d.info.domain());
    member->set_arena_socket(d.info.arena_socket());
    member->set_incarnation(d.info.incarnation());
    member->set_healthy(d.healthy);
  }
  return grpc::Status::OK;
}

grpc::Status Balancer::ReportLoad(grpc::ServerContext*, const v1::ReportLoadRequest* request,
                                  v1::ReportLoadResponse*) {
  MutexLock lock(&mu_);
  auto it = daemons_.find(request->node());
  if (it == daemons_.end()) {
    return Reject("unknown_node", grpc::StatusCode::NOT_FOUND,
                  absl::StrCat("node \"", request->node(), "\" is not registered; register first"));
  }
  Daemon& d = it->second;
  if (request->seq() == 0) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report of node ", request->node(),
                               " has seq 0; a daemon numbers its reports from 1"));
  }
  if (request->seq() < d.last_seq) {
    return Reject("out_of_order", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report seq ", request->seq(), " of node ", request->node(),
                               " is before ", d.last_seq, ", the last one taken (reordered)"));
  }
  // A daemon numbers its reports one after another (about one a second): a seq further ahead
  // of the last one taken is not one of its reports, and taken, it would have every later one
  // refused as reordered. (The first report after a registration, or after this balancer
  // started, goes on from wherever its daemon's numbering is.)
  if (d.last_seq > 0 && request->seq() - d.last_seq > kMaxReportSeqLead) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report seq ", request->seq(), " of node ", request->node(),
                               " is more than 2^32 ahead of ", d.last_seq,
                               ", the last one taken (a daemon numbers its reports one after "
                               "another)"));
  }
  // What no report can be, whatever plan it counts under, refused before anything of it is
  // kept (its seq, its step: a refused report sent again is refused again, and a step past
  // the steps' range would leave no step for a plan).
  const v1::LoadReport& load = request->load();
  if (request->max_step() > kMaxStep || load.last_step() > kMaxStep) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report of node ", request->node(), " says step ",
                               std::max(request->max_step(), load.last_step()),
                               ", above 2^63 - 1 (libubep refuses such a step)"));
  }
  // Its steps run forwards: a span backwards is no report of steps run, and its step count
  // would scale every node's. (It may end past the step its ranks are at now: a report sent
  // again tells the step they are at, lower where the group formed again at an earlier one.)
  if (load.first_step() > load.last_step()) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report of node ", request->node(), " counts steps ",
                               load.first_step(), "-", load.last_step(), ", backwards"));
  }
  for (int i = 0; i < load.layers_size(); ++i) {
    // Counts are deltas of monotonic counters: one past int64's range wrapped below zero.
    auto counts = [&](const char* field, const auto& values) -> std::optional<grpc::Status> {
      for (int k = 0; k < values.size(); ++k) {
        if (values[k] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          return Reject("negative", grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("load.layers[", i, "].", field, "[", k, "]: count ",
                                     static_cast<int64_t>(values[k]), " is negative"));
        }
      }
      return std::nullopt;
    };
    if (auto bad = counts("slot", load.layers(i).slot())) return *bad;
    if (auto bad = counts("dispatches", load.layers(i).dispatches())) return *bad;
  }
  // Deltas too (calls over the receive capacity since the last report), wrapped alike.
  for (const auto& [field, calls] :
       {std::pair<const char*, uint64_t>{"over_capacity_calls", request->over_capacity_calls()},
        {"over_capacity_calls_before", request->over_capacity_calls_before()}}) {
    if (calls > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Reject("negative", grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat(field, ": count ", static_cast<int64_t>(calls), " is negative"));
    }
  }
  // The last report, sent again because its answer did not reach the daemon, which cannot
  // tell whether it was taken: its counts are taken once. Only the step it carries, the
  // daemon's now, is new.
  const bool sent_again = request->seq() == d.last_seq;
  const uint64_t fingerprint = ReportFingerprint(*request);
  if (sent_again && fingerprint != d.last_fingerprint) {
    // Taking it would add counts the seq says were taken; dropping it silently would lose them.
    return Reject("seq_reused", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report seq ", request->seq(), " of node ", request->node(),
                               " differs from the report taken under that seq (a report sent "
                               "again must be the same; a new one takes the next seq)"));
  }
  d.last_seq = request->seq();
  d.last_fingerprint = fingerprint;
  // The calls its ranks dropped are counted whatever else the report holds: a report the
  // balancer cannot use (no plan yet, another plan's counts, a bad shape) still tells them.
  if (!sent_again) {
    // (Both counts below 2^63: their sum fits.)
    over_capacity_calls_->Increment(static_cast<double>(request->over_capacity_calls() +
                                                        request->over_capacity_calls_before()));
  }
  d.prev_step = d.max_step;
  d.prev_step_time = d.step_time;
  // Its ranks' steps now: lower than before where its group formed again at an earlier step
  // (clients attached anew count from the resume step), and plans are placed after them.
  d.max_step = request->max_step();
  d.step_time = StepNow();
  d.last_report = MonotonicNow();
  if (sent_again) return grpc::Status::OK;
  if (!d.refused.empty()) {
    // Its plan is undecided there for good and its ranks are excluded: its counts are no
    // plan's load (and not a stale report's, which a commit that did not reach it makes).
    return Reject("refused_node", grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("node ", request->node(), " ", d.refused,
                               "; its reports are not taken until it registers again"));
  }
  if (!shape_.has_value() || !plan_.has_value()) {
    return Reject("no_plan", grpc::StatusCode::FAILED_PRECONDITION,
                  "the balancer has not learned the cluster's plan yet");
  }
  // Its counts cannot be told apart from the other plan's (its failed calls are counted).
  auto stale = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stale_reports_->Increment();
    return Reject("stale_plan", grpc::StatusCode::FAILED_PRECONDITION,
                  absl::StrCat("report counted under plan v", load.plan_version(), " (steps ",
                               load.first_step(), "-", load.last_step(), "); plan v",
                               plan_->version, " is in force from step ", plan_effective_step_));
  };
  if (d.info.ranks().empty()) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("node ", request->node(),
                               " registered no rank: it has no slots to report the load of"));
  }
  // A daemon tags its counts with the plan it has committed, which its ranks follow only from
  // the plan's effective step: another plan's counts are stale, whatever their shape (a
  // daemon still under another model's plan). Those of this plan's steps before its
  // effective step, which a report may move (below), are stale too.
  if (load.plan_version() != plan_->version) return stale();
  if (load.layers_size() != shape_->layers) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report has ", load.layers_size(), " layers; the model has ",
                               shape_->layers));
  }
  // A node reports exactly the slots of its ranks (contiguous: ranks are node-major).
  uint32_t lo = UINT32_MAX, hi = 0;
  for (uint32_t r : d.info.ranks()) {
    lo = std::min(lo, r);
    hi = std::max(hi, r + 1);
  }
  const uint64_t first = static_cast<uint64_t>(lo) * shape_->slots;
  const uint64_t count = static_cast<uint64_t>(hi - lo) * shape_->slots;
  for (int i = 0; i < load.layers_size(); ++i) {
    // Rows are kept by position: the report lists the plan's layers in the plan's order.
    if (static_cast<size_t>(i) < plan_->layer_ids.size() &&
        static_cast<int64_t>(load.layers(i).layer()) != plan_->layer_ids[i]) {
      return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("load.layers[", i, "] is layer ", load.layers(i).layer(),
                                 "; plan v", plan_->version, " has layer ", plan_->layer_ids[i],
                                 " there"));
    }
    if (load.layers(i).first_slot() != first || static_cast<uint64_t>(load.layers(i).slot_size()) != count) {
      return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("load.layers[", i, "] covers slots [", load.layers(i).first_slot(),
                                 ", ", load.layers(i).first_slot() + load.layers(i).slot_size(),
                                 "); node ", request->node(), " hosts slots [", first, ", ",
                                 first + count, ")"));
    }
    const int dispatches = load.layers(i).dispatches_size();
    if (dispatches != 0 && dispatches != static_cast<int>(hi - lo)) {
      return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("load.layers[", i, "] has dispatch counts for ", dispatches,
                                 " ranks; node ", request->node(), " hosts ", hi - lo));
    }
  }
  // Counts no data plane can make: a rank receives at most world x max_tokens x min(top_k,
  // slots per rank) pairs in one dispatch call (each source's tokens, each with its pairs at
  // that rank). More is a counter word stored by something other than the data plane (every
  // serving process maps its arenas writable), which would pass one expert for the hottest of
  // the cluster for a whole window. (A shape registered without top_k or max_tokens bounds
  // nothing; ubepd registers its clients'.)
  const v1::ModelShape& model = shape_->model;
  if (model.top_k() > 0 && model.max_tokens() > 0) {
    const uint64_t per_call = static_cast<uint64_t>(shape_->world) * model.max_tokens() *
                              std::min<uint32_t>(model.top_k(), static_cast<uint32_t>(shape_->slots));
    for (int i = 0; i < load.layers_size(); ++i) {
      const v1::LayerLoad& layer = load.layers(i);
      for (int r = 0; r < layer.dispatches_size(); ++r) {
        if (layer.dispatches(r) == 0) continue;  // Counts without a call: LoadFromProto's.
        uint64_t pairs = 0;  // Saturating: each count is below 2^63, their sum need not be.
        for (int p = r * shape_->slots; p < (r + 1) * shape_->slots; ++p) {
          pairs = layer.slot(p) > UINT64_MAX - pairs ? UINT64_MAX : pairs + layer.slot(p);
        }
        const uint64_t calls_needed = pairs / per_call + (pairs % per_call != 0 ? 1 : 0);
        if (calls_needed > layer.dispatches(r)) {
          return Reject("implausible", grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("load.layers[", i, "]: rank ", lo + r, " received ",
                                     pairs == UINT64_MAX ? "2^64 or more" : absl::StrCat(pairs),
                                     " pairs in ", layer.dispatches(r), " dispatch calls, over the ",
                                     per_call, " a call can bring it (world ", shape_->world,
                                     " x max_tokens ", model.max_tokens(), " x min(top_k ",
                                     model.top_k(), ", slots_per_rank ", shape_->slots, "))"));
        }
      }
    }
  }
  absl::StatusOr<LoadMatrix> logical = LoadFromProto(load, &*plan_);
  if (!logical.ok()) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  std::string(logical.status().message()));
  }
  if (logical->num_layers() != shape_->layers || logical->num_experts() != shape_->experts) {
    return Reject("malformed", grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat("report has ", logical->num_layers(), " layers x ",
                               logical->num_experts(), " experts; the model has ", shape_->layers,
                               " x ", shape_->experts));
  }
  // A group that formed again at a step before the plan's effective step (its clients
  // attached anew) follows the plan from the step it resumed at (the daemons moved the plan's
  // start there): its reports from then on hold that plan's counts. A change of members is in
  // force from the step the group resumes at, which the balancer learns here, from the first
  // report of a daemon with member ranks (one whose ranks the plan excludes may have caught up
  // on it at a step of its own), and only from a report found well formed above (a malformed
  // one, refused, must not move it).
  if (request->has_plan_effective_step() && load.plan_version() == plan_->version && Member(d) &&
      (!effective_step_learned_ || request->plan_effective_step() < plan_effective_step_)) {
    UBEP_LOG(INFO) << "plan v" << plan_->version << " is in force from step "
                   << request->plan_effective_step()
                   << (effective_step_learned_ ? absl::StrCat(", not ", plan_effective_step_)
                                               : std::string())
                   << ": node " << request->node() << "'s group resumed there";
    plan_effective_step_ = request->plan_effective_step();
    effective_step_learned_ = true;
  }
  // Counts of steps before the plan's effective step (the whole report, or part of it) are
  // the previous plan's, whose slots held other experts (`stale`). A report of no step and
  // no count is no plan's: a group idle since before the effective step (serving stopped
  // just after a commit) sends one each interval, which is taken (it adds nothing), not
  // counted stale until traffic comes back.
  if (load.first_step() < plan_effective_step_ && !NothingRun(load, *request)) return stale();
  const std::optional<double> dispatches = MeanDispatches(load);
  if (d.interval_load.num_layers() != shape_->layers) {
    d.interval_load = LoadMatrix(shape_->layers, shape_->experts);
    d.interval_rank.assign(shape_->layers, std::vector<double>(hi - lo, 0.0));
    d.interval_rank_dispatches.clear();
  }
  // Reports with and without dispatch counts (a daemon upgraded in place) are not mixed in
  // one interval: the dispatches are kept only while every report has them.
  if (dispatches.has_value() && d.interval_rank_dispatches.empty() && d.interval_steps == 0) {
    d.interval_rank_dispatches.assign(shape_->layers, std::vector<double>(hi - lo, 0.0));
  } else if (!dispatches.has_value()) {
    d.interval_rank_dispatches.clear();
  }
  d.interval_load.AddScaled(*logical, 1.0);
  for (int l = 0; l < shape_->layers; ++l) {
    for (int p = 0; p < load.layers(l).slot_size(); ++p) {
      d.interval_rank[l][p / shape_->slots] += static_cast<double>(load.layers(l).slot(p));
    }
    if (d.interval_rank_dispatches.empty()) continue;
    for (int r = 0; r < load.layers(l).dispatches_size(); ++r) {
      d.interval_rank_dispatches[l][r] += static_cast<double>(load.layers(l).dispatches(r));
    }
  }
  if (dispatches.has_value()) {
    d.interval_steps += *dispatches;
  } else if (load.last_step() > load.first_step()) {
    d.interval_steps += static_cast<double>(load.last_step() - load.first_step());
  }
  // Calls of steps under the plan in force only: a report sent before the daemon's ranks
  // reached its effective step may be counted under it but holds the old plan's.
  if (request->plan_in_force()) {
    d.interval_over_capacity += request->over_capacity_calls();
    // Taken only from a report taken: a refused one (of a version not the cluster's, say)
    // says nothing of which plan its ranks follow.
    d.in_force = std::max(d.in_force, load.plan_version());
  }
  reports_->Increment();
  return grpc::Status::OK;
}

void Balancer::RequestRebalance() {
  MutexLock lock(&mu_);
  rebalance_requested_ = true;
}

absl::StatusOr<uint64_t> Balancer::EffectiveStep() const {
  // In whole steps, saturating: a serving job's steps are its own numbering (past 2^53 a
  // double would round them, and the step rate's few steps with them). They end at kMaxStep
  // (libubep's BeginStep takes none past it): a plan placed after it would never be in force,
  // and every plan after it would wait for it (ubepd refuses one).
  constexpr uint64_t kLast = kMaxStep;
  auto add = [](uint64_t a, uint64_t b) { return a > kLast - b ? kLast : a + b; };
  uint64_t at = 0;
  const absl::Time now = StepNow();
  for (const auto& [name, d] : daemons_) {
    // A daemon failing its health checks reports no more: its last rate would be extrapolated
    // for as long as it is down, and its ranks are not in the plans made meanwhile.
    if (!d.Serving()) continue;
    uint64_t estimate = d.max_step;
    if (d.prev_step_time != absl::InfinitePast() && d.step_time > d.prev_step_time &&
        d.max_step > d.prev_step) {
      const double rate = static_cast<double>(d.max_step - d.prev_step) /
                          absl::ToDoubleSeconds(d.step_time - d.prev_step_time);
      const double ahead =
          std::ceil(rate * absl::ToDoubleSeconds(now - d.step_time + options_.effective_margin));
      if (ahead >= 0x1p63) {
        estimate = kLast;  // (Past the last step; 2^64 and past it do not convert.)
      } else if (ahead > 0) {
        estimate = add(estimate, static_cast<uint64_t>(ahead));
      }
    }
    at = std::max(at, estimate);
  }
  const uint64_t margin = static_cast<uint64_t>(options_.min_margin_steps);
  if (at > kLast - margin) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the serving job is at step ", at, " (estimated): no step is left after it for a plan "
        "to take effect at (steps end at 2^63 - 1)"));
  }
  return at + margin;
}

void Balancer::CloseInterval() {
  if (!shape_.has_value()) return;
  const int L = shape_->layers;
  // Per node: this interval's counts per step (or, without a report, its last rates).
  LoadMatrix total(L, shape_->experts);
  std::vector<std::vector<double>> rank_rate(L, std::vector<double>(shape_->world, 0.0));
  double steps = 0;
  int reporting = 0;
  // The ranks whose rates are known: those of daemons counted with a rate.
  std::vector<bool> known(shape_->world, false);
  over_capacity_ = 0;
  for (auto& [name, d] : daemons_) {
    over_capacity_ += std::exchange(d.interval_over_capacity, 0);
    // A daemon down (or hosting no rank) counts for nothing, and what it reported meanwhile
    // is let go of with the interval: kept, an outage's steps would come back as one
    // interval's when it is healthy again, weighing its counts (of the plan before, maybe)
    // many intervals' worth. Its ranks' load is then unknown, not none. A node whose every
    // rank the plan in force leaves out serves nothing: its last rate (from before it was
    // drained, say) is not its load, and kept, its experts' load would count twice.
    const bool counted = d.Serving() && !d.info.ranks().empty() && Member(d);
    if (!counted) d.has_rate = false;
    const absl::Time now = MonotonicNow();
    if (counted && d.has_rate && d.interval_steps == 0 &&
        now - d.rate_time > std::max(options_.window_intervals * options_.interval,
                                     3 * options_.report_interval)) {
      d.has_rate = false;
    }
    if (counted && d.interval_steps > 0) {
      d.rate_time = now;
      const double per_step = 1.0 / d.interval_steps;
      d.rate = LoadMatrix(L, shape_->experts);
      d.rate.AddScaled(d.interval_load, per_step);
      d.rank_rate = d.interval_rank;
      for (size_t l = 0; l < d.rank_rate.size(); ++l) {
        for (size_t i = 0; i < d.rank_rate[l].size(); ++i) {
          // Per dispatch where counted (exact), else per step of the node.
          const double n = d.interval_rank_dispatches.empty() ? d.interval_steps
                                                              : d.interval_rank_dispatches[l][i];
          d.rank_rate[l][i] = n > 0 ? d.rank_rate[l][i] / n : 0.0;
        }
      }
      d.has_rate = true;
      steps += d.interval_steps;
      ++reporting;
    }
    d.interval_steps = 0;
    d.interval_rank_dispatches.clear();
    if (d.interval_load.num_layers() == L) {
      d.interval_load = LoadMatrix(L, shape_->experts);
      for (auto& layer : d.interval_rank) std::fill(layer.begin(), layer.end(), 0.0);
    }
    if (!counted || !d.has_rate) continue;
    for (uint32_t r : d.info.ranks()) {
      if (r < known.size()) known[r] = true;
    }
    total.AddScaled(d.rate, 1.0);
    for (int l = 0; l < L; ++l) {
      for (size_t i = 0; i < d.rank_rate[l].size(); ++i) rank_rate[l][d.first_rank + i] = d.rank_rate[l][i];
    }
  }
  // Every rank of the plan has a rate from a daemon counted now, or no imbalance is measured:
  // not a member's down (no plan without its ranks made yet; a node that took over some of
  // its ranks covers those), nor one no daemon registered for (yet), nor one without a report.
  bool all_known = true;
  for (int r = 0; r < shape_->world; ++r) {
    all_known &= known[r] || (plan_.has_value() && plan_->excluded(r));
  }
  if (reporting > 0 && all_known) {
    // Back to counts (the policy's noise model reads counts): the mean steps of an interval.
    // Only with every member's rate: without a node's, the experts only it hosts would read
    // as cold, and the next plan would take their replicas away.
    LoadMatrix counts(L, shape_->experts);
    counts.AddScaled(total, steps / reporting);
    window_->Add(counts);
  }
  window_->Close();
  unmeasured_intervals_ = reporting == 0 || !all_known ? unmeasured_intervals_ + 1 : 0;
  if (unmeasured_intervals_ >= options_.window_intervals) {
    // A whole window without a measurement (the cluster idle, or a member's load unknown: its
    // node down and no plan without it made, or its reports not reaching us): no series,
    // rather than the last value held for as long as that lasts (an alert on it would fire,
    // or stay quiet, all night). Not at the first such interval: a report and the interval's
    // close drift in phase, and a series that came and went would reset an alert's `for`.
    for (int l = 0; l < L; ++l) SetImbalance(l, "measured", std::nan(""));
  }
  if (reporting == 0 || !all_known) {
    measured_.clear();  // Nothing new, or not every node yet: the gauges keep the last value.
    return;
  }
  measured_.assign(L, 1.0);
  for (int l = 0; l < L; ++l) {
    std::vector<double> members;  // Excluded ranks carry nothing and do not count.
    for (int r = 0; r < shape_->world; ++r) {
      if (!plan_.has_value() || !plan_->excluded(r)) members.push_back(rank_rate[l][r]);
    }
    measured_[l] = MeasuredBalancedness(members);
    SetImbalance(l, "measured", measured_[l]);
  }
}

void Balancer::SetImbalance(int layer, const char* when, double value) {
  const prometheus::Labels labels = {{"layer", std::to_string(layer)}, {"when", when}};
  if (!std::isnan(value)) {
    imbalance_->Add(labels).Set(value);
  } else if (imbalance_->Has(labels)) {
    // A layer without load is unmeasured: no series, rather than a value that reads as
    // balanced. (Only an existing series is removed: Add would show a scrape a 0 first.)
    imbalance_->Remove(&imbalance_->Add(labels));
  }
}

void Balancer::CheckHealth() {
  std::vector<std::pair<std::string, std::shared_ptr<grpc::Channel>>> targets;
  {
    MutexLock lock(&mu_);
    const absl::Time now = MonotonicNow();
    if (now < next_health_) return;
    next_health_ = now + options_.health_interval;
    for (const auto& [name, d] : daemons_) targets.emplace_back(name, d.channel);
  }
  // All at once: one daemon that does not answer costs the tick one timeout, not one each.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const auto& target : targets) channels.push_back(target.second);
  std::vector<CallResult> results =
      FanOut(channels, "/grpc.health.v1.Health/Check", grpc::health::v1::HealthCheckRequest(),
             std::min(options_.health_interval, options_.rpc_timeout));
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& [name, channel] = targets[i];
    grpc::health::v1::HealthCheckResponse response;
    const bool ok = results[i].status.ok() && Parse(results[i].response, &response) &&
                    response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    MutexLock lock(&mu_);
    auto it = daemons_.find(name);
    if (it == daemons_.end() || it->second.channel != channel) continue;  // Registered again.
    Daemon& d = it->second;
    d.failures = ok ? 0 : d.failures + 1;
    bool healthy = d.failures < options_.health_failures;
    if (healthy && !d.healthy) {
      // Ranks another node registered while this one was down (a partial take-over keeps
      // the entry) are that node's: two healthy owners of a rank would both get its plan, and
      // peers two arenas for it. It stays out until forgotten.
      if (const std::set<uint32_t> taken = TakenOver(name); !taken.empty()) {
        if (!d.taken_over_logged) {
          UBEP_LOG(WARNING) << "node " << name << " answers its health checks again, but other "
                            << "nodes serve its ranks " << absl::StrJoin(taken, ", ")
                            << " now: it stays out (forget it: ubepctl forget " << name << ")";
          d.taken_over_logged = true;
        }
        healthy = false;
      }
    }
    if (healthy) {
      d.down_since = absl::InfiniteFuture();
    } else if (d.down_since == absl::InfiniteFuture()) {
      d.down_since = MonotonicNow();
    }
    if (!healthy && !d.HoldsOldModel() &&
        MonotonicNow() - d.down_since >= options_.registration_grace) {
      // Down for the registration grace, hosting no rank and holding none from before a
      // restart: nothing of the cluster waits on it, and an entry kept would be
      // health-checked forever (a pod that died before its clients attached). Forgotten; a
      // daemon that was only slow registers again with its group.
      UBEP_LOG(WARNING) << "node " << name << " is down and hosts no rank: forgotten";
      drained_.erase(name);
      daemons_.erase(it);
      continue;
    }
    if (d.healthy && !healthy) {
      UBEP_LOG(WARNING) << "node " << name << " failed " << d.failures
                        << " health checks: its ranks are excluded";
    } else if (!d.healthy && healthy) {
      UBEP_LOG(INFO) << "node " << name << " is healthy again";
      d.needs_state = true;
    }
    d.healthy = healthy;
  }
}

void Balancer::Recover() {
  std::lock_guard<std::mutex> serial(commit_mu_);
  // Learn what every (re)registered daemon holds, asking them all at once: a daemon that does
  // not answer costs recovery one timeout, not one per daemon.
  struct Ask {
    std::string name;
    std::shared_ptr<grpc::Channel> channel;
    std::string incarnation;  // Of the registration asked.
  };
  std::vector<Ask> ask;
  std::vector<std::shared_ptr<grpc::Channel>> ask_channels;
  {
    MutexLock lock(&mu_);
    for (auto& [name, d] : daemons_) {
      if (d.needs_state && d.Serving()) {
        ask.push_back({name, d.channel, d.info.incarnation()});
        ask_channels.push_back(d.channel);
      }
    }
  }
  std::vector<CallResult> answers;
  // When the daemons were asked: each read its step after this, so a rate counted from here
  // is not too low, nor a step extrapolated from here too late (FanOut waits for the slowest).
  const absl::Time asked = StepNow();
  if (!ask.empty()) {
    answers = FanOut(ask_channels, "/ubep.v1.DaemonControl/GetState", v1::GetStateRequest(),
                     options_.rpc_timeout);
  }
  for (size_t i = 0; i < ask.size(); ++i) {
    const auto& [name, channel, incarnation] = ask[i];
    v1::DaemonState state;
    const bool answered = answers[i].status.ok() && Parse(answers[i].response, &state);
    MutexLock lock(&mu_);
    auto it = daemons_.find(name);
    // The answer is of the registration asked: a node registered again meanwhile (a new
    // process, at the same address or another) is asked again.
    if (it == daemons_.end() || !it->second.SameRegistration(channel, incarnation) ||
        !answered) {
      continue;
    }
    Daemon& d = it->second;
    d.needs_state = false;
    // A group of another model than the cluster's (its clients moved, and it has not
    // registered it yet): none of its versions are the cluster's, and its plan's sizes would
    // index the cluster's load out of bounds.
    const v1::Plan& held = state.committed_plan();
    if (shape_.has_value() && state.committed_version() > 0 &&
        (held.topology().num_ranks() != static_cast<uint32_t>(shape_->world) ||
         held.topology().slots_per_rank() != static_cast<uint32_t>(shape_->slots) ||
         held.layers_size() != shape_->layers ||
         held.num_experts() != static_cast<uint32_t>(shape_->experts))) {
      UBEP_LOG(WARNING) << "recovery: node " << name << " holds plan v" << state.committed_version()
                        << " of another shape (" << held.topology().num_ranks() << " ranks x "
                        << held.topology().slots_per_rank() << " slots, " << held.layers_size()
                        << " layers x " << held.num_experts() << " experts) than the cluster's "
                        << shape_->Describe() << ": its state is not taken";
      continue;
    }
    d.committed = state.committed_version();
    d.pending = state.pending_version();
    d.pending_fingerprint = state.pending_fingerprint();
    if (state.max_step() > d.max_step) {
      // A step known now, as a report's: the next report's rate counts from it and from this
      // time (from an earlier report's time, its steps would spread over time they did not
      // take, and the plans placed by the rate would land at steps the ranks have reached).
      d.prev_step = d.max_step;
      d.prev_step_time = d.step_time;
      d.max_step = state.max_step();
      d.step_time = std::max(asked, d.step_time);
    }
    if (state.plan_in_force()) d.in_force = std::max(d.in_force, state.committed_version());
    // (A version past the highest a plan takes, which ubepd refuses, is not a plan's: counted,
    // the next plan's number would wrap to 0.)
    for (const uint64_t v : {d.committed, d.pending}) {
      if (v <= kMaxPlanVersion) highest_version_ = std::max(highest_version_, v);
    }
    if (state.committed_version() > 0 &&
        (!plan_.has_value() || plan_->version < state.committed_version())) {
      absl::StatusOr<Plan> plan = FromProto(state.committed_plan());
      if (plan.ok()) {
        plan_ = *std::move(plan);
        plan_effective_step_ = 0;
        effective_step_learned_ = false;
        for (auto& [other, od] : daemons_) od.ForgetInterval();  // Rates of another placement.
        // A node whose every rank the plan excludes while it is healthy was drained; one
        // taken to be drained for an older plan's exclusion that this one takes back was
        // undrained (a drain an operator asked for, or a restart's, stays).
        for (const auto& [other, od] : daemons_) {
          bool all = od.info.ranks_size() > 0;
          for (uint32_t r : od.info.ranks()) all &= plan_->excluded(static_cast<int>(r));
          const auto drained = drained_.find(other);
          if (all && od.Serving()) {
            drained_.emplace(other, DrainCause::kExcludedByPlan);
          } else if (!all && drained != drained_.end() &&
                     drained->second == DrainCause::kExcludedByPlan) {
            drained_.erase(drained);
            UBEP_LOG(INFO) << "node " << other << ": plan v" << plan_->version
                           << " takes its ranks back: no longer drained";
          }
        }
        plan_version_->Set(static_cast<double>(plan_->version));
        UBEP_LOG(INFO) << "learned plan v" << plan_->version << " from node " << name;
      } else {
        // Kept from, and said: the balancer plans from the older plan it holds meanwhile.
        UBEP_LOG(WARNING) << "node " << name << " holds plan v" << state.committed_version()
                          << ", which cannot be read (" << plan.status().message()
                          << "): not learned from it";
      }
    }
    // The step the plan is in force from, as a daemon with member ranks holds it (one whose
    // ranks the plan excludes may have caught up on it at a step of its own).
    if (plan_.has_value() && !effective_step_learned_ &&
        state.committed_version() == plan_->version && Member(d)) {
      plan_effective_step_ = state.committed_effective_step();
      effective_step_learned_ = true;
    }
  }
  // Resolve undecided prepares: aborted by this process -> abort; committed anywhere ->
  // commit; else abort after the grace, once no daemon that may have committed it is unknown.
  // Each decision (version, commit?) goes to its daemons at once.
  std::map<std::pair<uint64_t, bool>, std::vector<std::shared_ptr<grpc::Channel>>> decide;
  uint64_t held_when_decided = 0;
  {
    MutexLock lock(&mu_);
    // The plan this balancer holds was committed (it takes one only once committed), though
    // the daemons that committed it may be gone (forgotten, replaced) and the others' Commit
    // lost: it is committed wherever it is pending.
    uint64_t committed_max = plan_.has_value() ? plan_->version : 0;
    for (const auto& [name, d] : daemons_) committed_max = std::max(committed_max, d.committed);
    const absl::Duration up = MonotonicNow() - started_;
    // A version above every commit known may still have been committed by a daemon whose
    // state is not known: one whose GetState failed or that is down, or the daemon of a
    // member rank that has not registered again (the previous balancer died between two
    // Commits). Aborting it elsewhere would run the two halves of the group under two plans;
    // it waits for them, until the registration grace, after which such ranks are down. Any
    // rank, not only those the plan held keeps: the pending plan may take back ranks it
    // excludes (an undrain), and their daemon may hold it committed.
    const bool unknown =
        (shape_.has_value() && !UnlistedMembers(/*all=*/true).empty()) ||
        std::any_of(daemons_.begin(), daemons_.end(), [](const auto& entry) {
          // (One that refused a Commit holds that plan pending: known, not asked again.)
          return entry.second.needs_state && entry.second.refused.empty() &&
                 !entry.second.info.ranks().empty();
        });
    const bool may_abort = up >= options_.recovery_grace &&
                           (!unknown || up >= options_.registration_grace);
    const uint64_t held = plan_.has_value() ? plan_->version : 0;
    held_when_decided = held;
    // The plan held, fingerprinted once and only where a daemon holds its version pending (a
    // large plan is megabytes to encode; Recover runs every tick).
    std::optional<uint64_t> fingerprint;
    auto held_fingerprint = [&] {
      if (!fingerprint.has_value()) fingerprint = PlanFingerprint(*plan_);
      return *fingerprint;
    };
    for (auto& [name, d] : daemons_) {
      if (d.pending == 0 || !d.Serving()) continue;
      if (aborted_versions_.contains(d.pending)) {
        decide[{d.pending, false}].push_back(d.channel);
      } else if (d.pending < held) {
        // Older than the plan in force: superseded, whatever became of it elsewhere (a daemon
        // that held it undecided took part in no later plan, so its ranks were left out).
        decide[{d.pending, false}].push_back(d.channel);
      } else if (d.pending == held && d.pending_fingerprint != 0 &&
                 d.pending_fingerprint != held_fingerprint()) {
        // Another plan under the version committed elsewhere (prepared by an earlier balancer
        // that reused the number): committed, it would run other placements under v.
        UBEP_LOG(WARNING) << "recovery: node " << name << " holds another plan than v" << held
                          << " under that version: aborted there";
        decide[{d.pending, false}].push_back(d.channel);
      } else if (d.pending <= committed_max) {
        decide[{d.pending, true}].push_back(d.channel);
      } else if (may_abort) {
        decide[{d.pending, false}].push_back(d.channel);
      } else if (!held_logged_.contains(d.pending)) {
        held_logged_.insert(d.pending);
        UBEP_LOG(WARNING) << "recovery: plan v" << d.pending << " is pending on node " << name
                          << " and committed on no daemon known; it is not aborted while a "
                             "daemon that may have committed it is unknown (at most "
                          << options_.registration_grace << " from the start)";
      }
    }
  }
  for (const auto& [decision, channels] : decide) {
    const auto [version, commit] = decision;
    std::vector<CallResult> results;
    if (commit) {
      v1::CommitRequest request;
      request.set_version(version);
      results = FanOut(channels, "/ubep.v1.DaemonControl/Commit", request, options_.rpc_timeout);
    } else {
      v1::AbortRequest request;
      request.set_version(version);
      results = FanOut(channels, "/ubep.v1.DaemonControl/Abort", request, options_.rpc_timeout);
    }
    MutexLock lock(&mu_);
    // A version above the plan held, aborted: remembered as this process's decision (a
    // daemon that missed it is aborted too) and counted once. Not one at or below the plan
    // held: aborted as superseded, or as another plan under the held version, where the
    // version itself (the plan held, committed) must still be committed where it is pending.
    if (!commit && version > held_when_decided && aborted_versions_.Insert(version)) {
      plans_aborted_->Increment();
      ++aborted_count_;
    }
    for (size_t i = 0; i < channels.size(); ++i) {
      std::string node;
      for (auto& [name, d] : daemons_) {
        if (d.channel != channels[i]) continue;
        d.needs_state = true;
        node = name;
        NoteDecisionAnswer(name, d, version, commit, results[i].status);
      }
      UBEP_LOG(INFO) << "recovery: " << (commit ? "committed" : "aborted") << " orphan plan v"
                     << version << " on node " << (node.empty() ? "(gone)" : node)
                     << (results[i].status.ok() ? ""
                                                : " (failed: " + results[i].status.error_message() + ")");
    }
  }
  CatchUp();
}

void Balancer::NoteDecisionAnswer(const std::string& name, Daemon& d, uint64_t version,
                                  bool commit, const grpc::Status& status) {
  if (status.error_code() != grpc::StatusCode::DATA_LOSS || !d.refused.empty()) return;
  d.refused = absl::StrCat("refused the ", commit ? "Commit" : "Abort", " of plan v", version,
                           ": ", status.error_message());
  UBEP_LOG(ERROR) << "node " << name << " " << d.refused << "; it is sent no plan and its ranks "
                  << "are excluded until it registers again (restart its ubepd)";
}

void Balancer::AddGroupDaemons(v1::PrepareRequest& request) const {
  for (const auto& [name, d] : daemons_) {
    if (d.info.ranks().empty()) continue;
    // A daemon down still tells where its ranks' weights lie: its arenas stay mapped in its
    // domain's daemons.
    v1::PeerDaemon* peer = d.Serving() ? request.add_daemons() : request.add_down_daemons();
    peer->set_node(name);
    peer->set_address(d.info.address());
    *peer->mutable_ranks() = d.info.ranks();
    peer->set_domain(d.info.domain());
    // A new process's arenas hold the plan's weights only once its clients have loaded them:
    // kept out as restarted, its ranks are other domains' holders of last resort.
    const auto drained = drained_.find(name);
    peer->set_restarted(drained != drained_.end() && drained->second == DrainCause::kRestart);
  }
}

std::shared_ptr<grpc::Channel> Balancer::LinkRoot(const v1::PrepareRequest& request) const {
  if (request.daemons_size() < 2) return nullptr;
  bool domains = false;
  for (const v1::PeerDaemon& peer : request.daemons()) {
    auto it = daemons_.find(peer.node());
    if (it == daemons_.end() || it->second.info.backend() != "cuda") return nullptr;
    domains |= peer.domain() != request.daemons(0).domain();
  }
  return domains ? daemons_.at(request.daemons(0).node()).channel : nullptr;
}

void Balancer::CatchUp() {
  // A daemon that restarted has a fresh group under its own first plan, behind the cluster's.
  // - In a group over several daemons, the cluster's plan excludes its ranks (it is drained):
  //   it gets that plan, so that when a later plan takes its ranks back it stages their
  //   weights from the slots that really hold each expert; it stops no peer.
  // - A daemon hosting the whole group: its ranks switch to the cluster's plan at a step
  //   ahead of theirs, as with any plan (no peer to agree with), and its reports count again
  //   (they are stale until then).
  // (A daemon with member ranks in a group over several daemons is not caught up alone: the
  // switch needs every daemon of the group; the next plan's commit decides for it.)
  std::vector<std::string> behind;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::string> incarnations;  // Of the registrations sent to.
  v1::PrepareRequest request;
  bool whole_group = false;
  {
    MutexLock lock(&mu_);
    if (!plan_.has_value() || !shape_.has_value()) return;
    for (auto& [name, d] : daemons_) {
      if (!d.Serving() || d.needs_state || d.pending != 0 || d.committed == 0 ||
          d.committed >= plan_->version || d.info.ranks().empty()) {
        continue;
      }
      bool all_excluded = true;
      for (uint32_t r : d.info.ranks()) all_excluded &= plan_->excluded(static_cast<int>(r));
      const bool whole = d.info.ranks_size() == shape_->world;
      if (all_excluded || whole) {
        behind.push_back(name);
        channels.push_back(d.channel);
        incarnations.push_back(d.info.incarnation());
      }
      whole_group |= whole;
    }
    if (behind.empty()) return;
    *request.mutable_plan() = ToProto(*plan_, PlanEncoding::kCompact);
    const absl::StatusOr<uint64_t> effective = EffectiveStep();
    if (!effective.ok()) {
      UBEP_LOG(WARNING) << "catch-up of nodes behind plan v" << plan_->version
                        << " not tried: " << effective.status().message();
      return;
    }
    request.set_effective_step(*effective);
    AddGroupDaemons(request);
  }
  // The daemons behind take the plan at once: Prepare to all, then Commit to those prepared.
  // Whether a daemon may hold the plan prepared and undecided (a Prepare or a Commit that got
  // no answer): then GetState tells, and recovery decides it. A Prepare it refused left
  // nothing behind, and the next Tick tries again; meanwhile other plans go on.
  std::vector<std::string> outcome(behind.size());
  std::vector<bool> unknown(behind.size(), false);
  std::vector<CallResult> prepared =
      FanOut(channels, "/ubep.v1.DaemonControl/Prepare", request, options_.rpc_timeout);
  std::vector<std::shared_ptr<grpc::Channel>> to_commit;
  std::vector<size_t> committing;
  std::vector<grpc::Status> commit_answers(behind.size());
  for (size_t i = 0; i < behind.size(); ++i) {
    v1::PrepareResponse response;
    if (!prepared[i].status.ok()) {
      outcome[i] = prepared[i].status.error_message();
      unknown[i] = true;
    } else if (!Parse(prepared[i].response, &response)) {
      outcome[i] = "its answer to Prepare could not be read";
      unknown[i] = true;
    } else if (!response.prepared()) {
      outcome[i] = response.reason();
    } else {
      to_commit.push_back(channels[i]);
      committing.push_back(i);
    }
  }
  if (!to_commit.empty()) {
    v1::CommitRequest commit;
    commit.set_version(request.plan().version());
    std::vector<CallResult> committed =
        FanOut(to_commit, "/ubep.v1.DaemonControl/Commit", commit, options_.rpc_timeout);
    for (size_t j = 0; j < committing.size(); ++j) {
      commit_answers[committing[j]] = committed[j].status;
      if (committed[j].status.ok()) continue;
      outcome[committing[j]] = committed[j].status.error_message();
      unknown[committing[j]] = true;
    }
  }
  MutexLock lock(&mu_);
  for (size_t i = 0; i < behind.size(); ++i) {
    const std::string& name = behind[i];
    auto it = daemons_.find(name);
    // Applied to the registration sent to only (a node registered again meanwhile is a new
    // process, asked again by recovery).
    if (it != daemons_.end() && !it->second.SameRegistration(channels[i], incarnations[i])) {
      it = daemons_.end();
    }
    if (it != daemons_.end()) {
      NoteDecisionAnswer(name, it->second, request.plan().version(), true, commit_answers[i]);
    }
    if (outcome[i].empty()) {
      UBEP_LOG(INFO) << "node " << name << " caught up on plan v" << request.plan().version()
                     << " (effective at step " << request.effective_step() << ")";
      if (whole_group) plan_effective_step_ = request.effective_step();
      if (it != daemons_.end()) it->second.committed = request.plan().version();
    } else {
      UBEP_LOG(INFO) << "node " << name << " did not take plan v" << request.plan().version()
                     << " yet: " << outcome[i];
      if (it != daemons_.end() && unknown[i]) it->second.needs_state = true;
    }
  }
}

absl::StatusOr<v1::RebalanceResponse> Balancer::PlanAndCommit(const char* why, bool members_only) {
  std::lock_guard<std::mutex> serial(commit_mu_);
  return PlanAndCommitSerialized(why, members_only, absl::InfiniteFuture());
}

grpc::Status Balancer::Serialize(std::unique_lock<std::mutex>& serial, absl::Time answer_by,
                                 const std::string& what) {
  // A change in flight lasts as long as its daemons' RPCs (rpc_timeout each), longer than an
  // operator's deadline may be: the caller is answered before that deadline, with nothing
  // done, rather than left to time out while it is done after all.
  serial = std::unique_lock<std::mutex>(commit_mu_, std::defer_lock);
  if (answer_by == absl::InfiniteFuture()) {
    serial.lock();
  } else if (!LockBefore(serial, answer_by - MonotonicNow())) {
    return grpc::Status(grpc::StatusCode::ABORTED,
                        absl::StrCat("a plan change or recovery is in flight; ", what,
                                     ": try again once it is done"));
  }
  return grpc::Status::OK;
}

absl::StatusOr<v1::RebalanceResponse> Balancer::PlanAndCommitSerialized(const char* why,
                                                                        bool members_only,
                                                                        absl::Time answer_by) {
  v1::RebalanceResponse result;
  Plan previous;
  LoadMatrix load;
  Topology topology;
  int budget = options_.migration_budget;
  std::vector<std::string> targets;  // Node names, aligned with `channels`.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::string> incarnations;  // The registrations planned for, aligned too.
  v1::PrepareRequest request;        // The plan and effective step are set below.
  std::shared_ptr<grpc::Channel> link_root;  // Makes the NCCL link of a group over domains.
  uint64_t effective_step = 0;
  std::vector<double> before;
  std::vector<int> excluded;
  {
    MutexLock lock(&mu_);
    if (!shape_.has_value() || !plan_.has_value()) {
      return absl::FailedPreconditionError("no plan known yet");
    }
    excluded = DesiredExcluded();
    if (members_only && excluded == plan_->excluded_ranks) {
      result.set_version(plan_->version);
      return result;
    }
    // Daemons failing their health checks get no plan: their ranks are excluded. A daemon
    // with no group has no arenas to prepare (its group starts under the cluster's plan).
    // Nor does a daemon whose group moved to another model (its ranks are excluded).
    for (const auto& [name, d] : daemons_) {
      if (!d.Serving()) continue;
      if (d.needs_state || d.pending != 0) {
        return absl::UnavailableError(absl::StrCat("node ", name, " is still being recovered"));
      }
      if (d.info.ranks().empty()) continue;
      targets.push_back(name);
      channels.push_back(d.channel);
      incarnations.push_back(d.info.incarnation());
    }
    // Every rank the plan keeps must have its daemon here: one that has not registered (yet,
    // after a restart of the balancer; or no client attached to it) would not get the plan.
    std::set<int> unserved;
    for (int r = 0; r < shape_->world; ++r) {
      if (!std::binary_search(excluded.begin(), excluded.end(), r)) unserved.insert(r);
    }
    for (const std::string& name : targets) {
      for (uint32_t r : daemons_.at(name).info.ranks()) unserved.erase(static_cast<int>(r));
    }
    if (!unserved.empty()) {
      return absl::UnavailableError(absl::StrCat(
          "rank", unserved.size() > 1 ? "s " : " ", absl::StrJoin(unserved, ", "),
          " of the group ", unserved.size() > 1 ? "have" : "has",
          " no registered daemon; a plan waits for every daemon of the group to register"));
    }
    AddGroupDaemons(request);
    link_root = LinkRoot(request);
    previous = *plan_;
    load = window_->Current();
    load.set_layer_ids(previous.layer_ids);
    topology = previous.topology;
    // At most as many changed slots per rank and layer as the daemons have free weight
    // buffers (a daemon refuses a plan that changes more), and at most --migration_budget.
    int free_buffers = std::numeric_limits<int>::max();
    for (const auto& [name, d] : daemons_) {
      if (d.Serving() && !d.info.ranks().empty()) {
        free_buffers = std::min(free_buffers, static_cast<int>(d.info.free_buffers()));
      }
    }
    budget = budget < 0 ? free_buffers : std::min(budget, free_buffers);
    const absl::StatusOr<uint64_t> effective = EffectiveStep();
    if (!effective.ok()) return effective.status();
    effective_step = *effective;
    before = SummarizeBalance(previous, load).per_layer;
  }
  if (excluded == previous.excluded_ranks) {
    // The daemons refuse a plan while the one in force is not in force on every rank yet (its
    // predecessor's buffer may still be read): wait for that, bounded. A change of members
    // does not wait; the daemons stop the group for it.
    const absl::Time until = MonotonicNow() + options_.rpc_timeout * 2;
    while (MonotonicNow() < until) {
      {
        MutexLock lock(&mu_);
        if (PlanInForceEverywhere()) break;
      }
      const absl::Time now = MonotonicNow();
      if (now >= answer_by) {
        return absl::AbortedError(absl::StrCat("plan v", previous.version,
                                               " is not in force on every rank yet; no plan "
                                               "was made before the caller's deadline"));
      }
      absl::SleepFor(std::min(absl::Milliseconds(50), answer_by - now));  // Not past it.
    }
    MutexLock lock(&mu_);
    if (!PlanInForceEverywhere()) {
      // The daemons would refuse the plan ("not in force on rank r yet"): none is made, and
      // no version is spent on it; the next interval tries again.
      return absl::UnavailableError(absl::StrCat(
          "plan v", previous.version, " is not in force on every rank after ",
          absl::FormatDuration(options_.rpc_timeout * 2), "; no plan was made"));
    }
    const absl::StatusOr<uint64_t> effective = EffectiveStep();
    if (!effective.ok()) return effective.status();
    effective_step = *effective;
  }
  const absl::Time plan_start = MonotonicNow();
  PlannerOptions planner;
  planner.policy = options_.policy;
  planner.migration_budget = budget;
  const int threads = options_.planner_threads > 0
                          ? options_.planner_threads
                          : UsableCpus();  // The affinity's CPUs, not the machine's.
  absl::StatusOr<Plan> plan =
      excluded.empty() && previous.excluded_ranks.empty()
          ? PlanInParallel(load, topology, previous, planner, threads)
          : PlanForMembers(load, previous, excluded, planner, threads);
  result.set_plan_seconds(absl::ToDoubleSeconds(MonotonicNow() - plan_start));
  plan_seconds_->Observe(result.plan_seconds());
  if (!plan.ok()) return plan.status();
  if (SamePlacement(*plan, previous)) {
    result.set_version(previous.version);
    return result;
  }
  if (after_planning_for_testing_) after_planning_for_testing_();
  // What is prepared after the caller's deadline is aborted (below): nothing is prepared
  // when that time has come already.
  if (MonotonicNow() >= answer_by) {
    return absl::AbortedError(absl::StrCat("a plan was made in ",
                                           absl::FormatDuration(MonotonicNow() - plan_start),
                                           "; none was prepared before the caller's deadline"));
  }
  {
    MutexLock lock(&mu_);
    plan->version = std::max(highest_version_, previous.version) + 1;
    highest_version_ = plan->version;
  }
  const std::vector<double> after = SummarizeBalance(*plan, load).per_layer;
  const v1::Plan proto = ToProto(*plan, PlanEncoding::kCompact);

  // Phase 1: Prepare everywhere, in parallel. For a caller with a deadline, each RPC until
  // the time that leaves to answer; a plan not prepared everywhere by then is aborted, and so
  // is one prepared everywhere after it: what the caller is told is what was done.
  const absl::Time commit_start = MonotonicNow();
  const bool caller_bound = answer_by - commit_start < options_.rpc_timeout;
  // An RPC's timeout: --rpc_timeout, or the time left to the caller's answer if less.
  auto rpc_timeout = [&] { return std::min(options_.rpc_timeout, answer_by - MonotonicNow()); };
  std::vector<v1::PrepareResponse> answers(targets.size());
  std::vector<grpc::Status> statuses(targets.size());
  if (link_root != nullptr) {
    // CUDA daemons in several domains copy weights between domains over NCCL: the first
    // daemon makes the communicator's unique id and every Prepare carries it. Without one
    // they read those weights with ReadWeights.
    grpc::ClientContext context;
    SetDeadline(context, rpc_timeout());
    v1::CreateLinkResponse link;
    const grpc::Status status =
        v1::DaemonControl::NewStub(link_root)->CreateLink(&context, v1::CreateLinkRequest(), &link);
    if (status.ok()) {
      request.set_nccl_unique_id(link.nccl_unique_id());
    } else {
      UBEP_LOG(WARNING) << "no NCCL link for plan v" << plan->version << " (node "
                        << request.daemons(0).node() << ": " << status.error_message()
                        << "): weights of other domains are read with ReadWeights";
    }
  }
  if (MonotonicNow() >= answer_by) {  // CreateLink took the time that was left.
    return absl::AbortedError(absl::StrCat("plan v", plan->version,
                                           " was not prepared: the NCCL link took the time left "
                                           "before the caller's deadline"));
  }
  {
    // The step estimated again now: planning (seconds for a large model) and the NCCL link
    // took time in which the ranks went on, and a step estimated before them would reach the
    // daemons with less than the margin it was given, or already passed (refused).
    MutexLock lock(&mu_);
    // The daemons planned for are still the ones registered, serving and recovered, and the
    // ranks to exclude are the same: a node that registered again meanwhile (a new ubepd at
    // its address) must not get a Prepare meant for the process before, before recovery has
    // read its state (or its restart's drain, taken in the plan).
    std::string changed;
    for (size_t i = 0; i < targets.size() && changed.empty(); ++i) {
      auto it = daemons_.find(targets[i]);
      if (it == daemons_.end() || !it->second.SameRegistration(channels[i], incarnations[i]) ||
          !it->second.Serving() ||
          it->second.needs_state || it->second.pending != 0) {
        changed = absl::StrCat("node ", targets[i], " registered again or changed while plan v",
                               plan->version, " was made");
      }
    }
    if (changed.empty() && DesiredExcluded() != excluded) {
      changed = absl::StrCat("the ranks to exclude changed while plan v", plan->version,
                             " was made");
    }
    if (!changed.empty()) {
      if (highest_version_ == plan->version) highest_version_ = plan->version - 1;
      return absl::UnavailableError(
          absl::StrCat(changed, ": nothing was prepared; the next interval plans again"));
    }
    const absl::StatusOr<uint64_t> effective = EffectiveStep();
    if (!effective.ok()) {
      // Nothing was prepared: the version is not spent (plan changes are one at a time).
      if (highest_version_ == plan->version) highest_version_ = plan->version - 1;
      return effective.status();
    }
    effective_step = std::max(effective_step, *effective);
  }
  UBEP_LOG(INFO) << "rebalance (" << why << "): plan v" << plan->version << " at step "
                 << effective_step << ", predicted imbalance "
                 << SummarizeBalance(previous, load).mean << " -> "
                 << SummarizeBalance(*plan, load).mean;
  {
    *request.mutable_plan() = proto;
    request.set_effective_step(effective_step);
    request.set_base_version(previous.version);
    std::vector<CallResult> results =
        FanOut(channels, "/ubep.v1.DaemonControl/Prepare", request, rpc_timeout());
    for (size_t i = 0; i < results.size(); ++i) {
      statuses[i] = results[i].status;
      if (statuses[i].ok() && !Parse(results[i].response, &answers[i])) {
        statuses[i] = grpc::Status(grpc::StatusCode::INTERNAL, "unparsable PrepareResponse");
      }
    }
  }
  const absl::Duration prepare_time = MonotonicNow() - commit_start;
  std::vector<std::string> failed;
  uint64_t copied_bytes = 0, remote_bytes = 0;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (statuses[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && caller_bound) {
      failed.push_back(absl::StrCat(targets[i], ": no answer to Prepare before the caller's deadline"));
    } else if (statuses[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      // Most likely the plan's weight copies, which Prepare makes before it answers.
      failed.push_back(absl::StrCat(
          targets[i], ": no answer to Prepare within --rpc_timeout (",
          absl::FormatDuration(options_.rpc_timeout),
          "); if its weight copies take longer, raise --rpc_timeout and --effective_margin "
          "(docs/operations.md, \"Large experts\")"));
    } else if (!statuses[i].ok()) {
      failed.push_back(absl::StrCat(targets[i], ": ", statuses[i].error_message()));
    } else if (!answers[i].prepared()) {
      failed.push_back(absl::StrCat(targets[i], ": ", answers[i].reason()));
    }
    copied_bytes += answers[i].copied_bytes();
    remote_bytes += answers[i].remote_bytes();
  }
  if (options_.pause_before_commit > absl::ZeroDuration()) {
    UBEP_LOG(INFO) << "pausing " << options_.pause_before_commit << " before deciding plan v"
                   << plan->version;
    absl::SleepFor(options_.pause_before_commit);
  }
  if (failed.empty() && MonotonicNow() > answer_by) {
    failed.push_back("every node prepared it, after the caller's deadline left time to commit it");
  }
  // Phase 2: Commit if every daemon prepared, else Abort everywhere.
  const bool commit = failed.empty();
  std::vector<grpc::Status> decided(targets.size());
  {
    // For a caller with a deadline, the decision too is sent only until its answer is due
    // (and 50 ms more, inside the margin): a node that missed its Prepare (hung, cut off)
    // misses the Abort too, and waiting for it would leave the caller without the answer.
    // A decision that does not arrive is delivered by recovery (below).
    const absl::Duration decision_timeout = std::min(
        options_.rpc_timeout,
        std::max(answer_by - MonotonicNow(), absl::ZeroDuration()) + absl::Milliseconds(50));
    std::vector<CallResult> results;
    if (commit) {
      v1::CommitRequest request;
      request.set_version(plan->version);
      results = FanOut(channels, "/ubep.v1.DaemonControl/Commit", request, decision_timeout);
    } else {
      v1::AbortRequest request;
      request.set_version(plan->version);
      results = FanOut(channels, "/ubep.v1.DaemonControl/Abort", request, decision_timeout);
    }
    for (size_t i = 0; i < results.size(); ++i) decided[i] = results[i].status;
  }
  MutexLock lock(&mu_);
  // The registration sent to, if it is still the one registered: a node registered again
  // meanwhile (a new process) is not credited with what the one before answered; recovery
  // reads its state (Register asked for that).
  auto registration = [&](size_t i) {
    auto it = daemons_.find(targets[i]);
    if (it != daemons_.end() && !it->second.SameRegistration(channels[i], incarnations[i])) {
      it = daemons_.end();
    }
    return it;
  };
  for (size_t i = 0; i < targets.size(); ++i) {
    // A decision that did not arrive is delivered by recovery (GetState, then Commit/Abort).
    // (A target replaced meanwhile, Register, is gone: nothing to deliver to it.)
    auto it = registration(i);
    // A Prepare that got no answer, or was refused, may still land, or has left a plan
    // pending (one that landed after its Abort, which then found nothing to abort): the
    // daemon's state is read again, and recovery aborts what is left.
    if (it != daemons_.end() &&
        (!statuses[i].ok() || !answers[i].prepared() || !decided[i].ok())) {
      it->second.needs_state = true;
    }
    if (!decided[i].ok()) {
      UBEP_LOG(WARNING) << "plan v" << plan->version << ": node " << targets[i]
                        << " did not take the " << (commit ? "Commit" : "Abort") << ": "
                        << decided[i].error_message();
      if (commit) result.add_commit_unacknowledged(targets[i]);
    }
    if (it != daemons_.end()) {
      NoteDecisionAnswer(targets[i], it->second, plan->version, commit, decided[i]);
    }
  }
  if (!commit) {
    plans_aborted_->Increment();
    ++aborted_count_;
    aborted_versions_.Insert(plan->version);
    // The first nodes' reasons (the answer travels in a gRPC trailer); every one in the log.
    constexpr size_t kListed = 8;
    if (failed.size() > kListed) {
      UBEP_LOG(WARNING) << "plan v" << plan->version << " aborted: " << failed.size()
                        << " nodes did not prepare it: " << absl::StrJoin(failed, "; ");
    }
    return absl::AbortedError(absl::StrCat(
        "plan v", plan->version, " aborted: ", JoinFirst(failed, kListed, "; "),
        failed.size() > kListed ? " nodes (the balancer's log names each)" : ""));
  }
  result.set_commit_seconds(absl::ToDoubleSeconds(MonotonicNow() - commit_start));
  commit_seconds_->Observe(result.commit_seconds());
  plans_committed_->Increment();
  result.set_migrated_slots(static_cast<uint64_t>(ChangedSlots(previous, *plan, nullptr)));
  migrated_slots_->Increment(static_cast<double>(result.migrated_slots()));
  result.set_version(plan->version);
  result.set_changed(true);
  migrated_bytes_->Increment(static_cast<double>(copied_bytes));
  cross_domain_bytes_->Increment(static_cast<double>(remote_bytes));
  for (size_t l = 0; l < before.size(); ++l) {
    SetImbalance(static_cast<int>(l), "before", before[l]);
    SetImbalance(static_cast<int>(l), "after", after[l]);
  }
  const bool membership = plan->excluded_ranks != previous.excluded_ranks;
  plan_ = *std::move(plan);
  // The nodes' rates and intervals so far are of the previous placement (a node's share of an
  // expert's load moves with its replicas): each starts again with its reports under this
  // plan, and the window takes an interval again once every member has one.
  for (auto& [name, d] : daemons_) d.ForgetInterval();
  // Aborted versions at or below the plan in force are aborted by recovery anyway (older
  // than the plan held): the set keeps only those above it.
  aborted_versions_.EraseUpTo(plan_->version);
  // A change of members is in force from the step the group resumes at (the daemons move
  // its effective step there and say so in their reports), which is not later than the
  // estimate: until a report says it, no report is held stale by its steps.
  plan_effective_step_ = membership ? 0 : effective_step;
  effective_step_learned_ = !membership;
  ++committed_count_;
  for (size_t i = 0; i < targets.size(); ++i) {
    // Where it was acknowledged (recovery reads the others' state again).
    auto it = registration(i);
    if (it != daemons_.end() && decided[i].ok()) it->second.committed = plan_->version;
  }
  plan_version_->Set(static_cast<double>(plan_->version));
  last_commit_ = MonotonicNow();
  above_threshold_ = 0;
  UBEP_LOG(INFO) << "committed plan v" << plan_->version << " on " << targets.size()
                 << " nodes (" << proto.ByteSizeLong() << "-byte plan): plan "
                 << result.plan_seconds() * 1e3 << " ms, prepare "
                 << absl::ToDoubleMilliseconds(prepare_time) << " ms, prepare+commit "
                 << result.commit_seconds() * 1e3 << " ms";
  if (result.commit_unacknowledged_size() == static_cast<int>(targets.size())) {
    // Committed on no node yet: a balancer restarted before one acknowledges finds it
    // undecided everywhere and aborts it (ARCHITECTURE section 5, point 4). Not said to be
    // committed, which the caller would take as final.
    absl::Status undurable = absl::UnavailableError(absl::StrCat(
        "plan v", plan_->version, " was decided (every node prepared it), but no node "
        "acknowledged its Commit before the answer was due: until one does, a balancer "
        "restarted would abort it; this one delivers it at its next ticks (ubepctl status "
        "shows the plan in force)"));
    undurable.SetPayload(kDecidedPayload, absl::Cord(absl::StrCat(plan_->version)));
    return undurable;
  }
  return result;
}

void Balancer::UpdateMissing() {
  // Ranks the plan keeps that no registered daemon lists. While a healthy daemon has
  // registered without a group, they may be its (its clients are still attaching): no rank is
  // taken to be down then. Else, missing for the registration grace, they are down: e.g. a
  // node that died while the balancer was down never registers again, and its ranks would
  // hold back every plan (PlanAndCommit waits for every kept rank's daemon).
  std::set<int> unregistered = UnlistedMembers();
  const bool groupless = std::any_of(daemons_.begin(), daemons_.end(), [](const auto& entry) {
    return entry.second.healthy && entry.second.info.ranks().empty();
  });
  const absl::Time now = MonotonicNow();
  if (unregistered.empty() || groupless) {
    missing_since_ = absl::InfiniteFuture();
    missing_.clear();
    return;
  }
  if (missing_since_ == absl::InfiniteFuture()) missing_since_ = now;
  if (now - missing_since_ < options_.registration_grace || missing_ == unregistered) return;
  missing_ = std::move(unregistered);
  UBEP_LOG(WARNING) << "rank" << (missing_.size() > 1 ? "s " : " ") << absl::StrJoin(missing_, ", ")
                    << " of plan v" << plan_->version << (missing_.size() > 1 ? " have" : " has")
                    << " had no registered daemon for "
                    << options_.registration_grace << ": excluded as down";
}

bool Balancer::StepRatesKnown() const {
  for (const auto& [name, d] : daemons_) {
    if (!d.Serving() || drained_.contains(name) || d.info.ranks().empty()) continue;
    if (d.prev_step_time == absl::InfinitePast()) return false;
  }
  return true;
}

std::set<int> Balancer::UnlistedMembers(bool all) const {
  std::set<int> unlisted;
  for (int r = 0; r < shape_->world; ++r) {
    if (all || !plan_.has_value() || !plan_->excluded(r)) unlisted.insert(r);
  }
  for (const auto& [name, d] : daemons_) {
    for (uint32_t r : d.info.ranks()) unlisted.erase(static_cast<int>(r));
  }
  return unlisted;
}

std::set<uint32_t> Balancer::TakenOver(const std::string& node) const {
  std::set<uint32_t> taken;
  const auto& mine = daemons_.at(node).info.ranks();
  for (const auto& [other_name, other] : daemons_) {
    if (other_name == node || !other.HoldsClusterRanks()) continue;
    for (uint32_t r : other.info.ranks()) {
      if (std::find(mine.begin(), mine.end(), r) != mine.end()) taken.insert(r);
    }
  }
  return taken;
}

bool Balancer::Member(const Daemon& d) const {
  return plan_.has_value() &&
         std::any_of(d.info.ranks().begin(), d.info.ranks().end(),
                     [&](uint32_t r) { return !plan_->excluded(static_cast<int>(r)); });
}

bool Balancer::PlanInForceEverywhere() const {
  if (!plan_.has_value()) return false;
  for (const auto& [name, d] : daemons_) {
    // A daemon hosting no rank (none attached yet), or only ranks the plan excludes (drained,
    // or behind the plan until it catches up), has no plan in force to report.
    if (d.Serving() && !drained_.contains(name) && Member(d) && d.in_force < plan_->version) {
      return false;
    }
  }
  return true;
}

bool Balancer::Behind(const Daemon& d) const {
  return plan_.has_value() && shape_.has_value() && !d.needs_state && d.committed != 0 &&
         d.committed < plan_->version && d.info.ranks_size() > 0 &&
         d.info.ranks_size() < shape_->world;
}

std::vector<int> Balancer::DesiredExcluded() const {
  // Served: by a healthy daemon that is not drained, and holds the cluster's plan (one behind
  // it, which has not caught up yet, would stage its ranks' return from a plan it lacks), and
  // whose group is of the cluster's model (one whose clients moved to another model, refused
  // as not the cluster's, has no arenas of this one left: it would refuse every plan).
  std::set<int> served, unserved;
  for (const auto& [name, d] : daemons_) {
    const bool serving = d.Serving() && !drained_.contains(name) && !Behind(d);
    for (uint32_t r : d.info.ranks()) (serving ? served : unserved).insert(static_cast<int>(r));
  }
  // An excluded rank comes back only with a daemon serving it (not one that registered
  // without a group yet); a down daemon's rank that another daemon took over is served.
  if (plan_.has_value()) unserved.insert(plan_->excluded_ranks.begin(), plan_->excluded_ranks.end());
  // Ranks no daemon registered within the registration grace are down (Tick).
  unserved.insert(missing_.begin(), missing_.end());
  std::vector<int> excluded;
  std::set_difference(unserved.begin(), unserved.end(), served.begin(), served.end(),
                      std::back_inserter(excluded));
  return excluded;
}

grpc::Status Balancer::SetDrained(const grpc::ServerContext* context, const std::string& node,
                                  bool drained, v1::RebalanceResponse* response) {
  // The node is marked under commit_mu_, taken first: a drain answered "not done" is not
  // done by the next Tick either.
  // The caller's deadline read once, for the commit lock and the plan change alike.
  const absl::Time answer_by = AnswerBy(context);
  std::unique_lock<std::mutex> serial;
  if (grpc::Status s = Serialize(serial, answer_by,
                                 absl::StrCat("node ", node, " was not ",
                                              drained ? "drained" : "undrained"));
      !s.ok()) {
    return s;
  }
  bool was_drained = false;
  {
    MutexLock lock(&mu_);
    if (!daemons_.contains(node)) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("node \"", node, "\" is not registered"));
    }
    was_drained = drained_.contains(node);
    if (drained) {
      drained_[node] = DrainCause::kOperator;
      // (A node drained already stays drained, now at its operator's word: its drain changes
      // no rank's state, and refusing it must not undo the drain it had.)
      if (!was_drained && shape_.has_value() &&
          static_cast<int>(DesiredExcluded().size()) >= shape_->world) {
        drained_.erase(node);
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("draining node ", node, " would leave no rank serving"));
      }
    } else {
      drained_.erase(node);
    }
  }
  UBEP_LOG(INFO) << (drained ? "draining" : "undraining") << " node " << node;
  absl::StatusOr<v1::RebalanceResponse> result =
      PlanAndCommitSerialized(drained ? "node drained" : "node undrained", /*members_only=*/true,
                              answer_by);
  if (!drained && result.ok()) {
    MutexLock lock(&mu_);
    auto it = daemons_.find(node);
    if (it != daemons_.end() && !it->second.refused.empty()) {
      // Before this undrain, or at its own plan's Commit: no plan takes its ranks back.
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("node ", node, " is undrained, but it ", it->second.refused,
                                       ": its ranks come back once it registers again (restart "
                                       "its ubepd)"));
    }
    if (it != daemons_.end() && Behind(it->second)) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("node ", node, " is undrained, but it holds plan v",
                                       it->second.committed, ", not the cluster's v",
                                       plan_->version, " yet: its ranks come back once it has "
                                       "caught up"));
    }
  }
  if (absl::IsFailedPrecondition(result.status()) && drained && !was_drained) {
    // No plan can serve without the node (too few slots left): the drain is refused and
    // undone, or every later Tick would try it again and no other plan would be made.
    MutexLock lock(&mu_);
    drained_.erase(node);
  }
  if (!result.ok()) {
    std::string message(result.status().message());
    const bool decided = result.status().GetPayload(kDecidedPayload).has_value();
    if (!decided && (absl::IsAborted(result.status()) || absl::IsUnavailable(result.status()))) {
      // The daemons refused the plan, or one is not there yet: the node's state stays as
      // asked, and the next interval that can plan commits it (this call changed it).
      absl::StrAppend(&message, "; the ", drained ? "drain" : "undrain",
                      " stays asked for: each interval tries it again (",
                      drained ? "undrain" : "drain", " cancels it)");
    }
    return grpc::Status(static_cast<grpc::StatusCode>(result.status().code()), message);
  }
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status Balancer::Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                             v1::RebalanceResponse* response) {
  return SetDrained(context, request->node(), true, response);
}

grpc::Status Balancer::Undrain(grpc::ServerContext* context, const v1::DrainRequest* request,
                               v1::RebalanceResponse* response) {
  return SetDrained(context, request->node(), false, response);
}

grpc::Status Balancer::Forget(grpc::ServerContext* context, const v1::ForgetRequest* request,
                              v1::ForgetResponse* response) {
  const std::string& node = request->node();
  // Serialized with plan changes and recovery, which look daemons up again after their RPCs.
  std::unique_lock<std::mutex> serial;
  if (grpc::Status s =
          Serialize(serial, AnswerBy(context), absl::StrCat("node ", node, " was not forgotten"));
      !s.ok()) {
    return s;
  }
  MutexLock lock(&mu_);
  auto it = daemons_.find(node);
  if (it == daemons_.end()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("node \"", node, "\" is not registered"));
  }
  const Daemon& d = it->second;
  if (d.healthy) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", node, " passes its health checks; only a node that "
                                     "is down can be forgotten (stop its daemon first)"));
  }
  // During a model change (every other node holding ranks of the cluster's model asked for
  // another one) no plan of the old model is committed again: a node down that held ranks of it
  // is forgotten as it is, so that it no longer holds the change back.
  const bool model_change = OthersLeftTheModel(node, std::nullopt);
  if (!model_change && !plan_.has_value() && !d.info.ranks().empty()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("node ", node, " is down, but the balancer has not learned "
                                     "the cluster's plan yet; try again once it has"));
  }
  // Ranks another node took over while it was down are that node's: they do not keep it.
  const std::set<uint32_t> taken = TakenOver(node);
  std::vector<uint32_t> kept;
  for (uint32_t r : d.info.ranks()) {
    if (!model_change && !plan_->excluded(static_cast<int>(r)) && !taken.contains(r)) {
      kept.push_back(r);
    }
  }
  if (!kept.empty()) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("node ", node, " is down, but plan v", plan_->version, " still has its rank",
                     kept.size() > 1 ? "s " : " ", absl::StrJoin(kept, ", "),
                     "; it can be forgotten once a plan without them is committed"));
  }
  *response->mutable_ranks() = d.info.ranks();
  response->set_plan_version(plan_.has_value() ? plan_->version : 0);
  UBEP_LOG(INFO) << "node " << node << " is forgotten on request; "
                 << (model_change ? "a model change is under way (every other node holding "
                                    "ranks registered another model)"
                                  : "its ranks stay excluded");
  drained_.erase(node);
  daemons_.erase(it);
  UpdateRegistryGauges();
  return grpc::Status::OK;
}

grpc::Status Balancer::GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                                 v1::ClusterStatus* response) {
  MutexLock lock(&mu_);
  const absl::Time now = MonotonicNow();
  if (shape_.has_value()) response->set_world_size(static_cast<uint32_t>(shape_->world));
  for (const auto& [name, d] : daemons_) {
    v1::NodeStatus* n = response->add_nodes();
    n->set_node(name);
    n->set_address(d.info.address());
    *n->mutable_ranks() = d.info.ranks();
    n->set_domain(d.info.domain());
    n->set_healthy(d.healthy);
    n->set_drained(drained_.contains(name));
    if (d.wanted_shape.has_value()) n->set_new_model(d.wanted_shape->Describe());
    n->set_refused(d.refused);
    n->set_max_step(d.max_step);
    n->set_seconds_since_report(d.last_report == absl::InfinitePast()
                                    ? -1
                                    : absl::ToDoubleSeconds(now - d.last_report));
  }
  if (plan_.has_value()) {
    response->set_plan_version(plan_->version);
    for (int r : plan_->excluded_ranks) response->add_excluded_ranks(static_cast<uint32_t>(r));
  }
  for (double m : measured_) response->add_imbalance(m);
  response->set_seconds_since_commit(
      last_commit_ == absl::InfinitePast() ? -1 : absl::ToDoubleSeconds(now - last_commit_));
  response->set_plans_committed(committed_count_);
  response->set_plans_aborted(aborted_count_);
  return grpc::Status::OK;
}

grpc::Status Balancer::GetClusterPlan(grpc::ServerContext*, const v1::GetClusterPlanRequest*,
                                      v1::Plan* response) {
  MutexLock lock(&mu_);
  if (!plan_.has_value()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "no plan yet: no daemon with an attached group has registered");
  }
  *response = ToProto(*plan_);
  return grpc::Status::OK;
}

grpc::Status Balancer::Rebalance(grpc::ServerContext* context, const v1::RebalanceRequest*,
                                 v1::RebalanceResponse* response) {
  // The caller's deadline read once, for the commit lock and the plan change alike.
  const absl::Time answer_by = AnswerBy(context);
  std::unique_lock<std::mutex> serial;
  if (grpc::Status s = Serialize(serial, answer_by, "no rebalance was made"); !s.ok()) return s;
  absl::StatusOr<v1::RebalanceResponse> result =
      PlanAndCommitSerialized("requested", /*members_only=*/false, answer_by);
  if (!result.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(result.status().code()),
                        std::string(result.status().message()));
  }
  *response = *std::move(result);
  return grpc::Status::OK;
}

void Balancer::UpdateRegistryGauges() {
  registered_daemons_->Set(static_cast<double>(daemons_.size()));
  double ranks = 0, healthy = 0, awaiting = 0, refused = 0;
  for (const auto& [name, d] : daemons_) {
    ranks += d.info.ranks_size();
    healthy += d.healthy ? 1 : 0;
    awaiting += d.wanted_shape.has_value() ? 1 : 0;
    refused += d.refused.empty() ? 0 : 1;
  }
  registered_ranks_->Set(ranks);
  healthy_daemons_->Set(healthy);
  awaiting_model_->Set(awaiting);
  refused_daemons_->Set(refused);
}

void Balancer::Tick() {
  CheckHealth();
  Recover();
  bool rebalance = false, members = false, for_capacity = false;
  const char* why = "";
  {
    MutexLock lock(&mu_);
    UpdateRegistryGauges();
    CloseInterval();
    if (!shape_.has_value() || !plan_.has_value()) return;
    // A word of a restarted peer that came before the plan was learned (or while its node
    // failed its health checks) is taken now.
    for (const auto& [name, d] : daemons_) KeepOutRestartedPeers(d.info);
    UpdateMissing();
    if (DesiredExcluded() != plan_->excluded_ranks) {
      // A node failed, came back, or was drained or undrained: plan for the ranks left.
      rebalance = true;
      members = true;
      why = "membership changed";
    } else if (rebalance_requested_) {
      rebalance = true;
      why = "requested";
      rebalance_requested_ = false;
    } else if (options_.auto_rebalance && !measured_.empty() &&
               window_->closed_intervals() >= options_.min_intervals && StepRatesKnown()) {
      // Judge a plan only by what it did: no trigger before it is in force on every rank.
      const bool in_force = PlanInForceEverywhere();
      if (!in_force) above_threshold_ = -1;
      // Layers no call reached are left out (metrics.h): they would pull the mean towards 1.
      const BalanceSummary measured = SummarizeLayers(measured_);
      // Calls over a receive capacity drop every step that reaches the layer that overflowed,
      // and hide the layers after it; in steady state one hot layer of many barely moves the
      // mean. While the plan in force has such calls (in the last trigger_windows intervals),
      // its worst measured layer is judged instead. over_capacity_ holds only calls reported
      // once their daemon had the plan in force on all its ranks, so they are its own.
      if (in_force && over_capacity_ > 0) {
        drops_version_ = plan_->version;
        quiet_intervals_ = 0;
      } else if (quiet_intervals_ < options_.trigger_windows) {
        ++quiet_intervals_;
      }
      const bool dropping = drops_version_ == plan_->version &&
                            quiet_intervals_ < options_.trigger_windows &&
                            measured.measured > 0 && measured.worst > options_.threshold;
      const bool high = measured.measured > 0 && measured.mean > options_.threshold;
      above_threshold_ = high || dropping ? above_threshold_ + 1 : 0;
      if (above_threshold_ >= options_.trigger_windows) {
        rebalance = true;
        for_capacity = dropping;
        why = dropping ? "calls over the receive capacity" : "imbalance above threshold";
      } else if (in_force && over_capacity_ > 0 && !dropping && measured.measured > 0) {
        WarnCapacityBelowBalance("every layer they reached is within the threshold");
      }
    }
  }
  if (rebalance) {
    const absl::StatusOr<v1::RebalanceResponse> result =
        PlanAndCommit(why, /*members_only=*/members);
    if (!result.ok()) UBEP_LOG(WARNING) << "rebalance: " << result.status();
    MutexLock lock(&mu_);
    above_threshold_ = 0;
    if (result.ok() && !result->changed() && for_capacity) {
      WarnCapacityBelowBalance("the planner finds no other placement");
    }
  }
}

void Balancer::WarnCapacityBelowBalance(const char* because) {
  if (!plan_.has_value() || capacity_warned_version_ == plan_->version) return;
  capacity_warned_version_ = plan_->version;
  UBEP_LOG(WARNING) << "plan v" << plan_->version << ": ranks' calls failed over a receive "
                    << "capacity, and " << because << " (threshold " << options_.threshold
                    << "): a new plan would not help; the capacity is below the load the plans "
                       "reach (ubepd --max_recv_rows)";
}

BalancerStatus Balancer::Status() const {
  MutexLock lock(&mu_);
  BalancerStatus s;
  for (const auto& [name, d] : daemons_) {
    BalancerStatus::Node n;
    n.name = name;
    n.address = d.info.address();
    for (uint32_t r : d.info.ranks()) n.ranks.push_back(static_cast<int>(r));
    n.healthy = d.healthy;
    n.max_step = d.max_step;
    n.last_report = d.last_report;
    s.nodes.push_back(std::move(n));
  }
  s.plan_version = plan_.has_value() ? plan_->version : 0;
  s.measured_imbalance = measured_;
  s.last_commit = last_commit_;
  return s;
}

std::optional<Plan> Balancer::CurrentPlan() const {
  MutexLock lock(&mu_);
  return plan_;
}

LoadMatrix Balancer::WindowLoad() const {
  MutexLock lock(&mu_);
  return window_ != nullptr ? window_->Current() : LoadMatrix();
}

}  // namespace ubep::balancer
