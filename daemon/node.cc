#include "daemon/node.h"

#include <fcntl.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "balancer/formats/json_formats.h"
#include "balancer/formats/proto_convert.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/model_shape.h"
#include "common/shape_limits.h"
#include "common/status_macros.h"
#include "common/timeout.h"
#include "daemon/weight_link.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/common/plan_area.h"
#include "kernels/common/plan_table.h"

namespace ubep::daemon {
namespace {

// What Attach and Join answer while the daemon drains.
constexpr char kDraining[] = "ubepd is draining (shutting down); attach again when it is back";

uint64_t LoadWord(const uint64_t& word) {
  return std::atomic_ref<const uint64_t>(word).load(std::memory_order_acquire);
}
void StoreWord(uint64_t& word, uint64_t value) {
  std::atomic_ref<uint64_t>(word).store(value, std::memory_order_release);
}

// What a read of rank r's weights that requires them loaded (the copy of last resort of a
// restarted daemon) is told before its client said so (Node::WeightsLoadedLocked).
absl::Status NotLoadedStatus(int r) {
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", r, "'s weights are not loaded: its daemon restarted, and no client of its new "
      "arenas has said their weights are in place (Rank::WeightsLoaded), so the copy of last "
      "resort is not taken from them"));
}

// A wait bounded by its caller's gRPC deadline ends before it (AnswerMargin, at least this
// much), so that the answer (why the wait ended) reaches the caller before its own
// DeadlineExceeded.
constexpr absl::Duration kMinAnswerMargin = absl::Milliseconds(200);

// The time a wait bounded by the caller's (wall-clock) `deadline` has, its answer's margin
// taken off.
absl::Duration WaitBefore(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  return left - AnswerMargin(left, kMinAnswerMargin);
}

// 128 random bits, hex; an error where the kernel gives none (a seccomp profile refusing
// getrandom, say), rather than a retry forever under the node's lock.
absl::StatusOr<std::string> NewToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      return absl::ErrnoToStatus(errno, "getrandom (the rank's token)");
    }
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

// The first field where a request's model differs from the group's, named.
absl::Status CompareShapes(const v1::AttachRequest& group, const v1::AttachRequest& request) {
  const std::vector<ModelFieldDifference> differences = ModelDifferences(
      request.world_size(), request.shape(), group.world_size(), group.shape());
  if (differences.empty()) return absl::OkStatus();
  const ModelFieldDifference& d = differences.front();
  return absl::FailedPreconditionError(absl::StrCat(
      "shape conflicts with the attached group: ", d.field, " is ", d.value, ", the group has ",
      d.other));
}

// Duplicates of the arenas' fds, taken under the node's lock: the fd thread sends them after
// it lets go, while a group created again or a restarted peer's arenas may close the originals.
absl::StatusOr<std::vector<UniqueFd>> HoldFds(const std::vector<int>& fds) {
  std::vector<UniqueFd> held;
  held.reserve(fds.size());
  for (int fd : fds) {
    held.emplace_back(fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (held.back().get() < 0) {
      return absl::ResourceExhaustedError(absl::StrCat("duplicating an arena fd: ", std::strerror(errno)));
    }
  }
  return held;
}

absl::Status ValidateRequest(const v1::AttachRequest& q) {
  const v1::ModelShape& s = q.shape();
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (q.world_size() == 0 || q.world_size() > kMaxWorld) {
    return bad("world_size ", q.world_size(), " is outside [1, ", kMaxWorld, "]");
  }
  if (q.rank() >= q.world_size()) {
    return bad("rank ", q.rank(), " is outside [0, ", q.world_size(), ")");
  }
  const std::pair<const char*, uint64_t> positive[] = {
      {"num_layers", s.num_layers()}, {"num_experts", s.num_experts()}, {"hidden", s.hidden()},
      {"top_k", s.top_k()},           {"max_tokens", s.max_tokens()},
      {"slots_per_rank", s.slots_per_rank()}};
  for (const auto& [name, value] : positive) {
    if (value == 0) return bad("shape.", name, " must be positive");
  }
  if (s.top_k() > static_cast<uint32_t>(kernels::kMaxTopK)) {
    return bad("shape.top_k ", s.top_k(), " exceeds ", kernels::kMaxTopK);
  }
  if (s.top_k() > s.num_experts()) {
    return bad("shape.top_k ", s.top_k(), " exceeds num_experts ", s.num_experts());
  }
  if (s.num_experts() > kMaxExperts) {
    return bad("shape.num_experts ", s.num_experts(), " exceeds ", kMaxExperts);
  }
  if (s.num_layers() > kMaxLayers) {
    return bad("shape.num_layers ", s.num_layers(), " exceeds ", kMaxLayers);
  }
  if (s.max_tokens() > kMaxTokens) return bad("shape.max_tokens ", s.max_tokens(), " exceeds ", kMaxTokens);
  if (s.hidden() > kMaxHidden) return bad("shape.hidden ", s.hidden(), " exceeds ", kMaxHidden);
  if (static_cast<uint64_t>(s.slots_per_rank()) * q.world_size() < s.num_experts()) {
    return bad("shape.slots_per_rank ", s.slots_per_rank(), " x world_size ", q.world_size(),
               " cannot hold ", s.num_experts(), " experts");
  }
  if (s.slots_per_rank() > kMaxSlotsPerRank) {
    return bad("shape.slots_per_rank ", s.slots_per_rank(), " exceeds ", kMaxSlotsPerRank);
  }
  if (!v1::DType_IsValid(s.dtype())) return bad("shape.dtype ", s.dtype(), " is not a DType");
  return absl::OkStatus();
}

balancer::Plan RoundRobinPlan(const balancer::Topology& topology, int num_experts, int num_layers) {
  balancer::Plan plan;
  plan.version = 1;
  plan.topology = topology;
  plan.num_experts = num_experts;
  for (int l = 0; l < num_layers; ++l) {
    balancer::LayerPlan layer;
    layer.slot_expert.resize(topology.num_slots());
    for (int p = 0; p < topology.num_slots(); ++p) layer.slot_expert[p] = p % num_experts;
    balancer::SetEqualShares(num_experts, layer);
    plan.layer_ids.push_back(l);
    plan.layers.push_back(std::move(layer));
  }
  return plan;
}

// The data plane's routing table for a plan (kernels/common/plan_table.h).
absl::StatusOr<std::vector<std::byte>> PlanTableOf(const balancer::Plan& plan) {
  std::vector<kernels::LayerRouting> routing;
  for (const balancer::LayerPlan& layer : plan.layers) {
    routing.push_back({layer.slot_expert, layer.slot_share});
  }
  return kernels::BuildPlanTable(plan.version, static_cast<uint32_t>(plan.num_experts), routing,
                                 static_cast<uint32_t>(plan.topology.num_ranks), plan.excluded_ranks);
}

// The version plan buffer `b` of the area at `area` holds committed (0: none, or one being
// rewritten as it is read).
uint64_t CommittedVersionIn(void* area, int b) {
  const kernels::PlanSlotHeader* slot = kernels::PlanSlot(area, b);
  const uint64_t version = LoadWord(slot->version);
  const bool committed = std::atomic_ref<const uint32_t>(slot->state).load(std::memory_order_acquire) ==
                         kernels::kCommitted;
  return committed && LoadWord(slot->version) == version ? version : 0;
}

// Whether the plan area at `area` holds `version`, committed.
bool CommittedIn(void* area, uint64_t version) {
  return version != 0 && (CommittedVersionIn(area, 0) == version || CommittedVersionIn(area, 1) == version);
}

// The newest version the plan area at `area` holds committed (0: none).
uint64_t NewestCommittedIn(void* area) {
  return std::max(CommittedVersionIn(area, 0), CommittedVersionIn(area, 1));
}

}  // namespace

Node::Node(NodeOptions options) : options_(std::move(options)) {}

Node::~Node() = default;

absl::Status Node::CheckRankHostedHere(const v1::AttachRequest& q) const {
  const int world = static_cast<int>(q.world_size());
  const int first = options_.num_ranks > 0 ? options_.first_rank : 0;
  const int hosted = options_.num_ranks > 0 ? options_.num_ranks : world;
  const int rank = static_cast<int>(q.rank());
  if (rank < first || rank >= first + hosted || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", q.rank(), " is not hosted by this daemon (it hosts ranks ", first, "-",
        first + hosted - 1, "); attach to the daemon of its node"));
  }
  if (options_.backend == "cuda") {
    const int devices = DeviceCount();
    if (devices > 0 && static_cast<int>(q.device()) != rank % devices) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", q.rank(), " runs on device ", rank % devices, " of this node (rank r uses "
          "device r modulo the visible devices); the request says device ", q.device()));
    }
  }
  return absl::OkStatus();
}

absl::Status Node::CreateGroup(const v1::AttachRequest& q,
                               const std::optional<balancer::Plan>& cluster_plan) {
  const v1::ModelShape& s = q.shape();
  kernels::EpConfig config;
  config.num_ranks = static_cast<int>(q.world_size());
  config.max_tokens = static_cast<int>(s.max_tokens());
  config.hidden = static_cast<int>(s.hidden());
  config.top_k = static_cast<int>(s.top_k());
  config.num_experts = static_cast<int>(s.num_experts());
  config.slots_per_rank = static_cast<int>(s.slots_per_rank());
  config.num_layers = static_cast<int>(s.num_layers());
  config.dtype = s.dtype() == v1::DTYPE_BFLOAT16 ? kernels::DType::kBFloat16
                                                 : kernels::DType::kFloat32;
  config.protocol = options_.protocol;
  // Capped at the shape's calls; none for rows that are not whole granules (flagged_rows.h).
  config.flagged_tokens =
      kernels::FlaggedRowsFit(static_cast<size_t>(config.hidden) * kernels::DTypeBytes(config.dtype))
          ? std::min(options_.flagged_tokens, config.max_tokens)
          : 0;
  config.max_recv_rows = options_.max_recv_rows;
  config.timeout = options_.wait_timeout;
  UBEP_RETURN_IF_ERROR(kernels::ValidateConfig(config));
  const int first = options_.num_ranks > 0 ? options_.first_rank : 0;
  const int hosted = options_.num_ranks > 0 ? options_.num_ranks : config.num_ranks;
  if (first + hosted > config.num_ranks) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon hosts ranks ", first, "-", first + hosted - 1, " (--ranks) but the group has ",
        config.num_ranks, " ranks"));
  }
  // This node's ranks are one hop from each other; the other daemons' ranks of the group, in
  // the same load/store domain, a hop further. Nodes of equal size, each starting at a
  // multiple of it (consecutive ranks per node); otherwise every rank counts as near.
  if (hosted < config.num_ranks && first % hosted == 0) config.near_ranks = hosted;
  const bool cuda = options_.backend == "cuda";
  if (cuda && (config.dtype != kernels::DType::kBFloat16 || config.hidden % 8 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the cuda backend needs shape.dtype DTYPE_BFLOAT16 and shape.hidden a multiple of 8 "
        "(got ", s.dtype() == v1::DTYPE_BFLOAT16 ? "DTYPE_BFLOAT16" : "DTYPE_FLOAT32",
        ", hidden ", s.hidden(), ")"));
  }
  // Checked first: a bytes_per_expert near 2^64 would wrap the layout to a small arena.
  if (const std::optional<size_t> weights = kernels::RankArenaLayout::WeightBytes(
          config, s.bytes_per_expert(), options_.free_buffers);
      !weights.has_value() || *weights > options_.max_arena_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape.bytes_per_expert ", s.bytes_per_expert(), " in ",
        config.slots_per_rank + std::max(options_.free_buffers, 0), " buffers per layer x ",
        config.num_layers, " layers is over the ", options_.max_arena_bytes,
        " bytes per rank ubepd allows (--max_arena_bytes)"));
  }
  const kernels::RankArenaLayout layout = kernels::RankArenaLayout::Compute(
      config, s.bytes_per_expert(), options_.free_buffers, cuda);
  if (layout.total_bytes + layout.device_bytes > options_.max_arena_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this shape needs an arena of ", layout.total_bytes + layout.device_bytes,
        " bytes per rank, over the ",
        options_.max_arena_bytes, " bytes ubepd allows (--max_arena_bytes)"));
  }

  balancer::Topology topology;
  topology.num_ranks = config.num_ranks;
  topology.num_nodes = 1;
  topology.slots_per_rank = config.slots_per_rank;
  balancer::Plan plan;
  std::string origin = " (round-robin)";
  if (options_.plan_path.empty()) {
    plan = RoundRobinPlan(topology, config.num_experts, config.num_layers);
    if (cluster_plan.has_value()) {
      const balancer::Plan& c = *cluster_plan;
      if (c.topology.num_ranks == config.num_ranks &&
          c.topology.slots_per_rank == config.slots_per_rank &&
          c.num_experts == config.num_experts && c.num_layers() == config.num_layers &&
          balancer::ValidatePlan(c).ok()) {
        plan = c;
        origin = " (the cluster's, from ubep-balancer)";
      } else {
        UBEP_LOG(WARNING) << "the cluster's plan v" << c.version << " does not fit this group ("
                          << c.topology.num_ranks << " ranks x " << c.topology.slots_per_rank
                          << " slots, " << c.num_layers() << " layers x " << c.num_experts
                          << " experts): starting round-robin";
      }
    }
  } else {
    origin = " from " + options_.plan_path;
    // The file's nodes and groups are its own (0: whatever the file says); ranks and slots
    // must be this group's.
    absl::StatusOr<balancer::Plan> loaded = balancer::ReadPlanFile(
        options_.plan_path,
        balancer::Topology{.num_ranks = config.num_ranks, .num_nodes = 0,
                           .slots_per_rank = config.slots_per_rank, .num_groups = 0});
    if (!loaded.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the static plan does not fit this group: ", loaded.status().message()));
    }
    plan = *std::move(loaded);
    if (plan.num_experts != config.num_experts || plan.num_layers() != config.num_layers) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the static plan ", options_.plan_path, " has ", plan.num_layers(), " layers x ",
          plan.num_experts, " experts; the model has ", config.num_layers, " x ",
          config.num_experts));
    }
    if (plan.version == 0) plan.version = 1;
  }
  UBEP_ASSIGN_OR_RETURN(std::vector<std::byte> table, PlanTableOf(plan));

  std::vector<std::unique_ptr<DeviceMemory>> device_arenas;
  if (cuda) {
    const int devices = DeviceCount();
    if (devices == 0) {
      return absl::FailedPreconditionError("--backend cuda: no CUDA device is visible to ubepd");
    }
    // Per rank of the group: the hosted ranks' now, the peers' once imported (AddPeerArenas).
    // Rank r's device is r modulo the devices, the same on every daemon of the machine.
    device_arenas.resize(config.num_ranks);
    for (int r = first; r < first + hosted; ++r) {
      UBEP_ASSIGN_OR_RETURN(device_arenas[r], CreateDeviceMemory(r % devices, layout.device_bytes));
    }
  }
  std::vector<kernels::SharedArena> arenas(config.num_ranks);
  for (int r = first; r < first + hosted; ++r) {
    UBEP_ASSIGN_OR_RETURN(kernels::SharedArena arena,
                          kernels::SharedArena::Create(absl::StrCat("ubep-rank-", r),
                                                       layout.total_bytes));
    kernels::FormatRankArena(arena.data(), layout, config, r);
    void* area = arena.data() + layout.plan;
    UBEP_RETURN_IF_ERROR(kernels::PreparePlan(area, layout.plan_capacity, table, plan.version, 0));
    UBEP_RETURN_IF_ERROR(kernels::CommitPlan(area, plan.version));
    std::atomic_ref<uint64_t>(kernels::ControlOf(arena.data(), layout)->next_step)
        .store(kernels::kNoNextStep, std::memory_order_relaxed);
    arenas[r] = std::move(arena);
  }
  arenas_ = std::move(arenas);
  device_arenas_ = std::move(device_arenas);
  config_ = config;
  layout_ = layout;
  plan_ = std::move(plan);
  committed_versions_.clear();  // Of the group before, whose plans this one never had.
  committed_versions_.Insert(plan_.version);
  group_request_ = q;
  ranks_.assign(config.num_ranks, RankEntry{});
  incarnation_.assign(config.num_ranks, "");
  stale_.assign(config.num_ranks, false);
  ++arena_epoch_;
  ++arenas_created_;
  if (pending_.has_value()) {
    // Prepared in the arenas just replaced: the new group starts under its first plan, and the
    // balancer's Commit or Abort of it finds nothing undecided here.
    UBEP_LOG(WARNING) << "plan v" << pending_->version
                      << " was prepared and undecided in the group replaced; it is dropped";
  }
  pending_.reset();
  pending_effective_step_ = 0;
  membership_pending_ = false;
  first_ = first;
  hosted_ = hosted;
  has_group_ = true;
  UBEP_LOG(INFO) << "group created (" << options_.backend << "): " << config.num_ranks
                 << " ranks (hosting " << first << "-" << first + hosted - 1 << "), "
                 << config.num_layers
                 << " layers x " << config.num_experts << " experts, hidden " << config.hidden
                 << ", arena " << layout.total_bytes + layout.device_bytes
                 << " bytes per rank, plan v" << plan_.version << origin;
  return absl::OkStatus();
}

int Node::AttachedLocked() const {
  // A token past its deadline that was never claimed holds nothing: its client is gone (it
  // would have attached again), and neither a drain nor a new group waits for it.
  const absl::Time now = TicketNow();
  return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(), [&](const RankEntry& e) {
    return e.state == RankState::kConnected ||
           (e.state == RankState::kAttached && now <= e.ticket_deadline);
  }));
}

bool Node::AllArenasMapped() const {
  return std::all_of(arenas_.begin(), arenas_.end(),
                     [](const kernels::SharedArena& a) { return a.valid(); }) &&
         std::all_of(device_arenas_.begin(), device_arenas_.end(),
                     [](const std::unique_ptr<DeviceMemory>& m) { return m != nullptr; });
}

absl::StatusOr<v1::AttachResponse> Node::Attach(const v1::AttachRequest& request,
                                                absl::Time deadline) {
  UBEP_RETURN_IF_ERROR(ValidateRequest(request));
  // A new group starts under the cluster's plan: ask for it before taking the lock (it is an
  // RPC); only when this attach may create the group.
  std::optional<balancer::Plan> cluster_plan;
  const bool ask_balancer = options_.cluster_plan && options_.plan_path.empty();
  bool asked = false;
  if (ask_balancer) {
    {
      MutexLock lock(&mu_);
      asked = !has_group_ ||
              (AttachedLocked() == 0 && !CompareShapes(group_request_, request).ok());
    }
    if (asked) {
      // Ended before the caller's deadline, as the Attach's other waits are, so that the
      // answer saying why reaches it before its own DeadlineExceeded.
      absl::StatusOr<std::optional<balancer::Plan>> fetched =
          options_.cluster_plan(absl::Now() + WaitBefore(deadline));
      if (!fetched.ok()) return fetched.status();
      cluster_plan = *std::move(fetched);
    }
  }
  MutexLock lock(&mu_);
  if (draining_) {
    return absl::UnavailableError(kDraining);
  }
  const absl::Time now = TicketNow();
  for (RankEntry& e : ranks_) {
    if (e.state == RankState::kAttached && now > e.ticket_deadline) e = RankEntry{};
  }
  // A rank this daemon does not host, or on a device the rank does not run on, is refused
  // before anything else, and before it could replace the group (a new group is a restart for
  // the peers and the balancer).
  UBEP_RETURN_IF_ERROR(CheckRankHostedHere(request));
  if (has_group_ && AttachedLocked() > 0) {
    UBEP_RETURN_IF_ERROR(CompareShapes(group_request_, request));
  } else if (!has_group_ || !CompareShapes(group_request_, request).ok()) {
    if (staging_) {
      return absl::UnavailableError(absl::StrCat("the weights of plan v", staging_version_,
                                                 " are being staged into this group's arenas; "
                                                 "attach again"));
    }
    if (ask_balancer && !asked) {
      // The group's last client left (detached, or its token expired) after the look above,
      // which found a group to join and asked the balancer nothing: the group must not start
      // round-robin where the cluster has a plan.
      return absl::UnavailableError(
          "the group's last client left while this attach looked at it; attach again");
    }
    UBEP_RETURN_IF_ERROR(CreateGroup(request, cluster_plan));
  }
  if (!AllArenasMapped()) {
    // The peers' arenas come from their daemons (the balancer link maps them).
    // Time left before the caller's (wall-clock) deadline, waited out as a duration.
    mu_.AwaitWithTimeout([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return draining_ || !has_group_ || AllArenasMapped();
    }, std::min(WaitBefore(deadline), options_.join_timeout));
    if (draining_) {
      return absl::UnavailableError(kDraining);
    }
    if (!has_group_ || !AllArenasMapped()) {
      std::vector<int> missing;
      for (int r = 0; r < static_cast<int>(arenas_.size()); ++r) {
        if (!arenas_[r].valid()) missing.push_back(r);
      }
      return absl::UnavailableError(absl::StrCat(
          "the arenas of rank", missing.size() == 1 ? " " : "s ", absl::StrJoin(missing, ", "),
          " are not mapped yet: their daemons have not attached a client or not registered with "
          "the balancer; attach again"));
    }
    UBEP_RETURN_IF_ERROR(CompareShapes(group_request_, request));
  }
  // On a device arena, the device CheckRankHostedHere checked the request against.
  const int device = on_device() ? device_arenas_[request.rank()]->device()
                                  : static_cast<int>(request.device());
  RankEntry& entry = ranks_[request.rank()];
  if (entry.state != RankState::kFree) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", request.rank(),
                                                 " is already attached (pid ", entry.pid,
                                                 "); detach it or stop that process first"));
  }
  UBEP_ASSIGN_OR_RETURN(std::string token, NewToken());
  entry = RankEntry{};
  entry.state = RankState::kAttached;
  entry.token = std::move(token);
  entry.pid = request.pid();
  // From now: the wait for the peers' arenas above may have taken longer than the ticket.
  entry.ticket_deadline = TicketNow() + options_.ticket_timeout;

  v1::AttachResponse response;
  response.set_token(entry.token);
  response.set_fd_socket(options_.fd_socket_path);
  response.set_backend(on_device() ? "cuda" : "host");
  response.set_device(static_cast<uint32_t>(device));
  response.set_protocol(kernels::ProtocolName(config_.protocol));
  // In whole milliseconds, rounded up: a timeout under one is not told as none.
  response.set_wait_timeout_ms(
      absl::ToInt64Milliseconds(absl::Ceil(config_.timeout, absl::Milliseconds(1))));
  response.set_flagged_tokens(static_cast<uint32_t>(config_.flagged_tokens));
  response.set_near_ranks(static_cast<uint32_t>(config_.near_ranks));
  response.set_max_recv_rows(static_cast<uint32_t>(config_.max_recv_rows));
  response.set_hosted_first(static_cast<uint32_t>(first_));
  response.set_hosted_count(static_cast<uint32_t>(hosted_));
  v1::ArenaLayout* l = response.mutable_layout();
  l->set_total_bytes(layout_.total_bytes);
  l->set_control_offset(layout_.control);
  l->set_ep_offset(layout_.ep);
  l->set_ep_bytes(layout_.ep_bytes);
  l->set_plan_offset(layout_.plan);
  l->set_plan_capacity(layout_.plan_capacity);
  l->set_slot_map_offset(layout_.slot_map);
  l->set_weights_offset(layout_.weights);
  l->set_weight_stride(layout_.weight_stride);
  l->set_buffers_per_layer(layout_.buffers_per_layer);
  l->set_device_bytes(layout_.device_bytes);
  l->set_device_weights_offset(layout_.device_weights);
  for (int r = 0; r < config_.num_ranks; ++r) response.add_arena_ranks(r);
  response.set_arena_epoch(arena_epoch_);
  UBEP_LOG(INFO) << "rank " << request.rank() << " attached (pid " << request.pid() << ")";
  return response;
}

absl::StatusOr<std::vector<UniqueFd>> Node::ClaimArenas(const std::string& token, int64_t connection) {
  MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError(kDraining);  // Its token went with the drain.
  for (RankEntry& e : ranks_) {
    if (e.state != RankState::kAttached || e.token != token) continue;
    if (TicketNow() > e.ticket_deadline) {
      e = RankEntry{};
      return absl::DeadlineExceededError("attach token expired; attach again");
    }
    if (!AllArenasMapped()) return absl::UnavailableError("the group's arenas changed; attach again");
    // Its closing says that the rank's process ended: of one rank only.
    if (const std::optional<int> held = RankOfConnectionLocked(connection)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this connection holds rank ", *held, " already; each rank claims its arenas on a "
          "connection of its own"));
    }
    std::vector<int> fds;
    for (const kernels::SharedArena& arena : arenas_) fds.push_back(arena.fd());
    for (const auto& memory : device_arenas_) fds.push_back(memory->fd());
    UBEP_ASSIGN_OR_RETURN(std::vector<UniqueFd> held, HoldFds(fds));
    e.state = RankState::kConnected;
    e.connection = connection;
    return held;
  }
  return absl::NotFoundError("unknown or already used attach token; attach again");
}

absl::Status Node::CheckToken(uint32_t rank, const std::string& token, bool need_connected) const {
  if (!has_group_ || rank >= ranks_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " is not attached"));
  }
  const RankEntry& e = ranks_[rank];
  if (e.state == RankState::kFree || e.token != token) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " is not attached with this token; attach again"));
  }
  if (need_connected && e.state != RankState::kConnected) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " has not taken its arenas from the fd socket ", options_.fd_socket_path));
  }
  return absl::OkStatus();
}

void Node::StopGroup(uint32_t code, absl::FunctionRef<bool(int)> stops) {
  StopGroup([&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stops(r) ? code : 0u; });
}

void Node::StopGroup(absl::FunctionRef<uint32_t(int)> code_of) {
  const int R = static_cast<int>(arenas_.size());
  std::vector<uint32_t> codes(R);  // Evaluated once: 0, the rank is not stopped.
  for (int r = 0; r < R; ++r) codes[r] = code_of(r);
  for (int r = 0; r < R; ++r) {
    if (codes[r] != 0) SetAbortCode(r, codes[r], /*only_if_clear=*/true);
  }
  if (options_.stopping_hook) options_.stopping_hook();
  // Only the ranks stopped here: a rank this daemon does not stop is stopped by its own daemon,
  // or not at all, and may be in a group that formed already (a peer daemon that committed a
  // change of members first forms the new group at once; this daemon's Commit comes after).
  for (int r = 0; r < R; ++r) {
    if (codes[r] == 0 || !arenas_[r].valid()) continue;
    std::atomic_ref<uint32_t>(Ctl(r)->group_state).store(kernels::kGroupBroken, std::memory_order_release);
  }
}

uint32_t Node::AbortCode(int r) const {
  const size_t offset = kernels::ArenaLayout(config_).abort;
  uint32_t code = 0;
  if (on_device()) {
    if (device_arenas_[r] == nullptr) return code;  // A peer's, not imported yet.
    if (absl::Status s = device_arenas_[r]->Read(offset, &code, sizeof(code)); !s.ok()) {
      UBEP_LOG(ERROR) << "rank " << r << ": " << s;
    }
    return code;
  }
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(arenas_[r].data() + layout_.ep + offset))
      .load(std::memory_order_acquire);
}

void Node::SetAbortCode(int r, uint32_t code, bool only_if_clear) {
  const kernels::ArenaLayout ep_layout(config_);
  if (on_device()) {
    if (device_arenas_[r] == nullptr) return;  // A peer's, not imported yet.
    // Read, then written: not one compare-and-swap, as the host backend's RaiseAbort is. A
    // kernel's own give-up (RaiseAbortEverywhere, an atomicCAS) landing between the two is
    // overwritten: the ranks may then name this code's rank rather than the one the kernel
    // gave up on, and a wait this code spares (its rank completed the call) runs on to its
    // own deadline. Left as is: it needs a compare-and-swap on the device from ubepd.
    if (only_if_clear && AbortCode(r) != 0) return;
    if (absl::Status s = device_arenas_[r]->Write(ep_layout.abort, &code, sizeof(code)); !s.ok()) {
      UBEP_LOG(ERROR) << "rank " << r << ": " << s;
    }
    return;
  }
  if (!arenas_[r].valid()) return;
  // Either way the arena's bell rings: a rank asleep in a wait sees the code at once.
  std::byte* ep = arenas_[r].data() + layout_.ep;
  if (only_if_clear) {
    kernels::RaiseAbort(ep, ep_layout, code);
    return;
  }
  std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(ep + ep_layout.abort))
      .store(code, std::memory_order_release);
  kernels::Ring(kernels::ArenaDoor(ep, ep_layout));
}

void Node::WithdrawTicket(int rank) {
  std::atomic_ref<uint64_t>(Ctl(rank)->join_ticket).store(0, std::memory_order_seq_cst);
}

void Node::BreakGroup(int rank, bool rejoining) {
  // A rank that leaves while joining must not be counted in the next generation. The lead
  // daemon of a group across daemons may have read its ticket already: the ticket's clearing
  // and the look at the group state below pair (sequentially consistent) with the lead's
  // publishing the state and its look at the tickets again (TryFormGroup), so that either
  // this daemon sees the group formed and stops it, or the lead sees the ticket gone.
  if (arenas_[rank].valid()) WithdrawTicket(rank);
  auto ready = [&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::atomic_ref<uint32_t>(Ctl(r)->group_state).load(std::memory_order_seq_cst) ==
           kernels::kGroupReady;
  };
  // The reason given to the others: for a rank that joins again, the rank it was told left,
  // if it was (a rank that found its daemon gone wrote that into this rank's word, and this
  // Join answers it), so that every rank names the rank that actually left rather than the
  // first of them to come back; else (and for a rank that is gone) this rank. The rank that
  // left is itself told that this one did.
  const int told = rejoining ? kernels::RankThatLeft(AbortCode(rank)) : -1;
  const int left = told >= 0 && told != rank && told < static_cast<int>(arenas_.size()) ? told : rank;
  const uint32_t code = kernels::kAbortRankGone | static_cast<uint32_t>(left);
  const uint32_t to_left = kernels::kAbortRankGone | static_cast<uint32_t>(rank);
  if (ready(rank)) {
    StopGroup([&](int r) { return r == left && left != rank ? to_left : code; });
    return;
  }
  // The rank was stopped already, but maybe not every rank of its generation: a daemon stops
  // only the ranks it is to stop (StopGroup), and a change of members that another daemon
  // never prepared (it failed or was aborted first) leaves that daemon's ranks running the
  // generation, waiting for this rank until their wait timeout. Stop those, naming the rank
  // (read once: their daemons may change their words meanwhile). A rank running a generation
  // holds its ticket for it; one the lead is forming the next generation of reads ready and
  // the generation before until the lead publishes it, and holds the next one's ticket.
  const uint64_t generation = LoadWord(Ctl(rank)->generation);
  std::vector<bool> running(arenas_.size());
  for (int r = 0; r < static_cast<int>(arenas_.size()); ++r) {
    running[r] = r != rank && arenas_[r].valid() && ready(r) &&
                 LoadWord(Ctl(r)->generation) == generation &&
                 (LoadWord(Ctl(r)->join_ticket) & ~kernels::kTicketClaimed) == generation;
  }
  StopGroup([&](int r) { return !running[r] ? 0u : r == left ? to_left : code; });
}

int Node::LowestActive() const {
  for (int r = 0; r < config_.num_ranks; ++r) {
    if (!plan_.excluded(r)) return r;
  }
  return 0;
}

uint64_t Node::GroupGeneration() const {
  uint64_t generation = 0;
  for (const kernels::SharedArena& arena : arenas_) {
    if (arena.valid()) {
      generation = std::max(generation, LoadWord(kernels::ControlOf(arena.data(), layout_)->generation));
    }
  }
  return generation;
}

uint64_t Node::EffectiveStepOf(uint64_t version) const {
  if (hosted_ == 0) return 0;
  void* area = arenas_[first_].data() + layout_.plan;
  for (int b = 0; b < 2; ++b) {
    const kernels::PlanSlotHeader* slot = kernels::PlanSlot(area, b);
    if (LoadWord(slot->version) == version) return LoadWord(slot->effective_step);
  }
  return 0;
}

std::vector<std::pair<int, uint64_t>> Node::MembersBehindOrAhead() const {
  std::vector<std::pair<int, uint64_t>> others;
  for (int r = 0; r < config_.num_ranks; ++r) {
    if (plan_.excluded(r)) continue;
    void* area = arenas_[r].data() + layout_.plan;
    const uint64_t newest = NewestCommittedIn(area);
    if (newest > plan_.version || !CommittedIn(area, plan_.version)) others.emplace_back(r, newest);
  }
  std::stable_sort(others.begin(), others.end(),
                   [](const auto& x, const auto& y) { return x.second > y.second; });
  return others;
}

void Node::TryFormGroup() {
  const int lead = LowestActive();
  if (!Hosted(lead) || !AllArenasMapped()) return;
  // A change of members is being prepared or decided: the group forms under the decision.
  if (membership_pending_) return;
  // A member whose daemon restarted: its mapped arenas are the dead process's.
  if (!StaleMembers(plan_).empty()) return;
  const int R = config_.num_ranks;
  const uint64_t next = GroupGeneration() + 1;
  uint64_t resume = kernels::kNoNextStep;
  for (int r = 0; r < R; ++r) {
    if (plan_.excluded(r)) continue;
    if (LoadWord(Ctl(r)->join_ticket) != next) return;
    resume = std::min(resume, LoadWord(Ctl(r)->next_step));
  }
  // Every member runs the plan this daemon has committed: its peers must have committed it
  // too, and none a newer one (this daemon is behind: the balancer could not reach it as it
  // committed a plan that may take this lead's ranks out, whose own lead forms the group).
  if (!MembersBehindOrAhead().empty()) return;
  if (resume == kernels::kNoNextStep) resume = 0;
  if (options_.forming_hook) options_.forming_hook();
  // Every member is in Join: nobody runs the data plane while its words are reset, and the
  // plan in force may start at the resume step (a plan that changed the membership does).
  const kernels::ArenaLayout ep_layout(config_);
  for (int r = 0; r < R; ++r) {
    if (plan_.excluded(r)) continue;
    if (on_device()) {
      // The same bytes ResetSignals clears, in device memory.
      for (const auto& [offset, bytes] : kernels::ResetRanges(ep_layout)) {
        if (absl::Status s = device_arenas_[r]->Zero(offset, bytes); !s.ok()) {
          UBEP_LOG(ERROR) << "rank " << r << ": " << s;
        }
      }
    } else {
      kernels::ResetSignals(arenas_[r].data() + layout_.ep, ep_layout);
    }
    (void)kernels::RetargetPlan(arenas_[r].data() + layout_.plan, plan_.version, resume);
    StoreWord(Ctl(r)->resume_step, resume);
    std::atomic_ref<uint32_t>(Ctl(r)->group_state).store(kernels::kGroupReady, std::memory_order_seq_cst);
  }
  // The lowest member's word first: a rank that joins again from now on asks for the
  // generation after. Sequentially consistent, as the tickets' reading below: a rank whose
  // daemon exited mid-Join withdraws its ticket and then reads its generation word
  // (libubep's LeaveJoinOfExitedDaemon), so either it sees the generation or this sees the
  // ticket gone.
  auto publish = [&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::atomic_ref<uint64_t>(Ctl(r)->generation).store(next, std::memory_order_seq_cst);
  };
  publish(lead);
  for (int r = 0; r < R; ++r) {
    if (!plan_.excluded(r)) publish(r);
  }
  if (options_.published_hook) options_.published_hook();
  // A member of a peer daemon may have left (detached, died, its daemon draining) since its
  // ticket was read, its daemon finding no group formed to stop (BreakGroup, Drain), or its
  // Join run out of time: now that the group is published, each ticket is claimed (a
  // compare-and-swap, as a Join's withdrawal is: the rank is in the group or it withdrew, not
  // both), and the group stopped, naming the lowest rank whose ticket is gone, rather than
  // left running until its peers' waits time out.
  for (int r = 0; r < R; ++r) {
    uint64_t ticket = next;
    if (plan_.excluded(r) || std::atomic_ref<uint64_t>(Ctl(r)->join_ticket)
                                 .compare_exchange_strong(ticket, next | kernels::kTicketClaimed,
                                                          std::memory_order_seq_cst)) {
      continue;
    }
    UBEP_LOG(WARNING) << "group generation " << next << " formed as rank " << r
                      << " left it: stopped";
    const uint32_t code = kernels::kAbortRankGone | static_cast<uint32_t>(r);
    StopGroup(code, [&](int q) { return !plan_.excluded(q); });
    return;
  }
  UBEP_LOG(INFO) << "group formed: generation " << next << ", " << R - plan_.excluded_ranks.size()
                 << " ranks"
                 << (plan_.excluded_ranks.empty()
                         ? ""
                         : absl::StrCat(" (excluded: ", absl::StrJoin(plan_.excluded_ranks, ", "), ")"))
                 << ", resuming at step " << resume;
}

absl::StatusOr<v1::JoinResponse> Node::Join(const v1::JoinRequest& request, absl::Time deadline) {
  MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError(kDraining);
  UBEP_RETURN_IF_ERROR(CheckToken(request.rank(), request.token(), /*need_connected=*/true));
  const int rank = static_cast<int>(request.rank());
  const std::string token = request.token();
  ranks_[rank].joining = true;
  // A member joining a running group means it stopped (an error, or a restart): stop the
  // rest. A rank the plan excludes is not in the group: it waits for a plan that includes it.
  if (!plan_.excluded(rank)) BreakGroup(rank, /*rejoining=*/true);
  kernels::RankControl* own = Ctl(rank);
  uint64_t ticket = GroupGeneration() + 1;
  // An excluded rank's step is stale (it was out of the group): it does not hold the group
  // back when a plan takes it in again.
  StoreWord(own->next_step, request.has_next_step() && !plan_.excluded(rank) ? request.next_step()
                                                                             : kernels::kNoNextStep);
  StoreWord(own->join_ticket, ticket);
  // Ends before the caller's deadline (as Attach's wait), so that the caller gets this daemon's
  // answer (who the group still waits for) rather than its own DeadlineExceeded.
  // The caller's deadline is a wall-clock time (gRPC's); from here on the wait counts the time
  // it had left on the monotonic clock, so that a clock step neither ends it nor stretches it.
  const absl::Time until =
      MonotonicNow() + std::min(WaitBefore(deadline), options_.join_timeout);
  // (The group may have been created again meanwhile, of fewer ranks.)
  auto still_mine = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return has_group_ && static_cast<size_t>(rank) < ranks_.size() &&
           ranks_[rank].state == RankState::kConnected && ranks_[rank].token == token;
  };
  // The rendezvous is in shared memory, across daemons: poll it (joins are rare). A join that
  // gives up withdraws its ticket, so that no later generation counts a rank not joining.
  auto give_up = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ranks_[rank].joining = false;
    WithdrawTicket(rank);
  };
  auto joined = [&](uint64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ranks_[rank].joining = false;
    v1::JoinResponse response;
    response.set_generation(generation);
    response.set_resume_step(LoadWord(own->resume_step));
    response.set_arena_epoch(arena_epoch_);
    return response;
  };
  while (true) {
    if (!still_mine()) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " detached while joining"));
    }
    TryFormGroup();
    if (draining_) {  // (Before a group formed meanwhile: its daemon is going away.)
      give_up();
      return absl::UnavailableError(kDraining);
    }
    const uint64_t generation = LoadWord(own->generation);
    if (generation >= ticket && !plan_.excluded(rank)) return joined(generation);
    if (plan_.excluded(rank) && GroupGeneration() >= ticket) {
      // The group formed without this rank: ask for the generation after.
      ticket = GroupGeneration() + 1;
      StoreWord(own->join_ticket, ticket);
    }
    const absl::Time now = MonotonicNow();
    if (now >= until) break;
    mu_.AwaitWithTimeout([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return draining_ || !still_mine();
    }, std::min(absl::Milliseconds(1), until - now));
  }
  if (options_.join_expiring_hook) options_.join_expiring_hook(rank);
  ranks_[rank].joining = false;
  // The lead daemon of a group across daemons may have formed it on this ticket just now:
  // the ticket is withdrawn only if the lead has not claimed it (TryFormGroup), so that the
  // rank is told it joined where it is in the group, rather than that the group did not form
  // while its peers wait for it in the data plane until their own waits time out; and where
  // the withdrawal wins, the lead stops the group it published.
  if (uint64_t held = ticket; !std::atomic_ref<uint64_t>(own->join_ticket)
                                   .compare_exchange_strong(held, 0, std::memory_order_seq_cst)) {
    if (held == (ticket | kernels::kTicketClaimed) && !plan_.excluded(rank)) {
      return joined(std::atomic_ref<uint64_t>(own->generation).load(std::memory_order_seq_cst));
    }
    WithdrawTicket(rank);
  } else if (const uint64_t generation = LoadWord(own->generation);
             generation >= ticket && !plan_.excluded(rank)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the group of ", ranks_.size(), " ranks formed (generation ", generation, ") as rank ",
        rank, "'s join ran out of time, and stops for it: join again"));
  }
  if (plan_.excluded(rank)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "rank ", rank, " is excluded from the EP group by plan v", plan_.version,
        " (its node failed or was drained); join again to wait for a plan that includes it"));
  }
  const std::string did_not_form =
      absl::StrCat("the group of ", ranks_.size(), " ranks did not form in time");
  if (membership_pending_) {
    // Held back here, whoever joined: say by what.
    if (!pending_.has_value()) {
      return absl::DeadlineExceededError(absl::StrCat(
          did_not_form, ": plan v", staging_version_, ", a change of members, is being "
          "prepared here (its ranks stopping or its weights staging; the group forms once the "
          "balancer commits or aborts it)"));
    }
    return absl::DeadlineExceededError(absl::StrCat(
        did_not_form, ": plan v", pending_->version, ", a change of members, is prepared here "
        "and undecided (the group forms once the balancer commits or aborts it)"));
  }
  // Members on another plan: ahead (this daemon missed a commit) or behind.
  const std::vector<std::pair<int, uint64_t>> others = MembersBehindOrAhead();
  if (!others.empty() && others.front().second > plan_.version) {
    std::vector<int> ahead;
    for (const auto& [r, version] : others) {
      if (version == others.front().second) ahead.push_back(r);
    }
    const bool prepared_here = pending_.has_value() && pending_->version == others.front().second;
    return absl::DeadlineExceededError(absl::StrCat(
        did_not_form, ": the daemon of rank", ahead.size() == 1 ? " " : "s ",
        absl::StrJoin(ahead, ", "), " committed plan v", others.front().second,
        ", and this daemon is on v", plan_.version,
        prepared_here ? ", the plan prepared here and its Commit not come yet"
                      : " (ubep-balancer has not given it the plan: is its link to the "
                        "balancer down?)"));
  }
  // A restarted daemon's ranks: their tickets here are in its old arenas, whatever they say.
  if (const std::string stale = StaleMembers(plan_); !stale.empty()) {
    return absl::DeadlineExceededError(absl::StrCat(
        did_not_form, ": the daemon of rank", stale, " restarted and its new arenas are not "
        "mapped here yet (they are once a committed plan excludes them, which the balancer "
        "makes)"));
  }
  std::vector<std::string> missing;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (r == rank || plan_.excluded(r) ||
        (LoadWord(Ctl(r)->join_ticket) & ~kernels::kTicketClaimed) == ticket) {
      continue;
    }
    missing.push_back(absl::StrCat(r, !Hosted(r)                             ? " (on a peer daemon)"
                                      : ranks_[r].state == RankState::kFree ? " (not attached)"
                                                                            : ""));
  }
  if (!missing.empty()) {
    return absl::DeadlineExceededError(absl::StrCat(did_not_form, "; waiting for rank",
                                                    missing.size() == 1 ? " " : "s ",
                                                    absl::StrJoin(missing, ", ")));
  }
  // Every member asks for this generation: the group's lead daemon has not formed it (behind
  // members, if any: `others` holds none ahead here).
  std::vector<int> uncommitted;
  for (const auto& [r, version] : others) uncommitted.push_back(r);
  if (!uncommitted.empty()) {
    return absl::DeadlineExceededError(absl::StrCat(
        did_not_form, ": every member joined, and the daemon of rank",
        uncommitted.size() == 1 ? " " : "s ", absl::StrJoin(uncommitted, ", "),
        " has not committed plan v", plan_.version, " (the group forms once every member runs "
        "it)"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      did_not_form, ": every member joined, and the daemon of rank ", LowestActive(),
      ", which forms the group, has not formed it (is it up, and has it mapped every rank's "
      "arenas?)"));
}

absl::Status Node::Detach(const v1::DetachRequest& request) {
  MutexLock lock(&mu_);
  UBEP_RETURN_IF_ERROR(CheckToken(request.rank(), request.token(), /*need_connected=*/false));
  ranks_[request.rank()] = RankEntry{};
  BreakGroup(static_cast<int>(request.rank()));
  UBEP_LOG(INFO) << "rank " << request.rank() << " detached";
  return absl::OkStatus();
}

std::optional<int> Node::RankOfConnectionLocked(int64_t connection) const {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].state == RankState::kConnected && ranks_[r].connection == connection) {
      return static_cast<int>(r);
    }
  }
  return std::nullopt;
}

bool Node::HoldsConnection(int64_t connection) const {
  MutexLock lock(&mu_);
  return RankOfConnectionLocked(connection).has_value();
}

bool Node::ConnectionClosed(int64_t connection, std::string_view why) {
  MutexLock lock(&mu_);
  // One rank at most: a second claim on a connection is refused (ClaimArenas).
  const std::optional<int> held = RankOfConnectionLocked(connection);
  if (!held.has_value()) return false;
  RankEntry& e = ranks_[*held];
  if (why.empty()) {
    UBEP_LOG(WARNING) << "rank " << *held << " (pid " << e.pid
                      << ") disconnected without detaching: marking it gone";
  } else {
    UBEP_LOG(WARNING) << "rank " << *held << " (pid " << e.pid << "): ubepd closed its fd "
                      << "connection (" << why << "): marking it gone";
  }
  e = RankEntry{};
  BreakGroup(*held);
  return true;
}

absl::StatusOr<v1::GetPlanResponse> Node::GetPlan() const {
  MutexLock lock(&mu_);
  if (!has_group_) {
    return absl::FailedPreconditionError("no plan yet: it is made when the first rank attaches");
  }
  v1::GetPlanResponse response;
  *response.mutable_plan() = balancer::ToProto(plan_);
  response.set_effective_step(EffectiveStepOf(plan_.version));
  return response;
}

absl::StatusOr<v1::ReportStepResponse> Node::ReportStep(const v1::ReportStepRequest& request) {
  MutexLock lock(&mu_);
  UBEP_RETURN_IF_ERROR(CheckToken(request.rank(), request.token(), /*need_connected=*/false));
  v1::ReportStepResponse response;
  response.set_plan_version(plan_.version);
  response.set_draining(draining_);
  return response;
}

uint64_t Node::StepOf(int rank) const {
  // Sequentially consistent, as BeginStep's store: Prepare's second look at the steps, after
  // the plan is in the arenas, is one side of a Dekker pair (plan_area.cc StoreState).
  return std::atomic_ref<uint64_t>(Ctl(rank)->step).load(std::memory_order_seq_cst);
}

uint64_t Node::MaxStepLocked() const {
  uint64_t step = 0;
  for (int r = first_; r < first_ + hosted_; ++r) step = std::max(step, StepOf(r));
  return step;
}

std::optional<int> Node::RankBeforePlanLocked() const {
  const uint64_t in_force = EffectiveStepOf(plan_.version);
  if (in_force == 0) return std::nullopt;
  for (int r = first_; r < first_ + hosted_; ++r) {
    if (plan_.excluded(r) || ranks_[r].state != RankState::kConnected) continue;
    if (StepOf(r) < in_force) return r;
  }
  return std::nullopt;
}

Node::PlanIdentity Node::CommittedPlanIdentity() const {
  MutexLock lock(&mu_);
  return CommittedPlanIdentityLocked();
}

Node::PlanIdentity Node::CommittedPlanIdentityLocked() const {
  PlanIdentity identity{plan_.version, plan_.num_experts, plan_.layer_ids,
                        has_group_ && !RankBeforePlanLocked().has_value(), std::nullopt};
  if (PlanBufferOf(plan_.version) >= 0) identity.effective_step = EffectiveStepOf(plan_.version);
  return identity;
}

uint64_t Node::MaxStep() const {
  MutexLock lock(&mu_);
  return MaxStepLocked();
}

Node::GroupIdentity Node::Identity() const {
  MutexLock lock(&mu_);
  return IdentityLocked();
}

Node::GroupIdentity Node::IdentityLocked() const {
  GroupIdentity identity;
  identity.arenas_created = arenas_created_;
  identity.generation = GroupGeneration();
  if (has_group_) {
    identity.shape = group_request_;
    identity.hosted = std::make_pair(first_, hosted_);
  }
  return identity;
}

std::optional<v1::AttachRequest> Node::GroupShape() const {
  MutexLock lock(&mu_);
  if (!has_group_) return std::nullopt;
  return group_request_;
}

int Node::PlanBufferOf(uint64_t version, int rank) const {
  if (hosted_ == 0) return -1;
  if (rank < 0) rank = first_;
  void* area = arenas_[rank].data() + layout_.plan;
  for (int b = 0; b < 2; ++b) {
    const kernels::PlanSlotHeader* slot = kernels::PlanSlot(area, b);
    if (std::atomic_ref<const uint64_t>(slot->version).load(std::memory_order_acquire) == version &&
        slot->state != kernels::kEmpty) {
      return b;
    }
  }
  return -1;
}

size_t Node::DeviceWeightOffset(int layer, uint32_t buffer) const {
  return layout_.device_weights +
         (static_cast<size_t>(layer) * layout_.buffers_per_layer + buffer) * layout_.weight_stride;
}

absl::Status Node::CopyWeights(const WeightCopy& c) const {
  const size_t bytes = group_request_.shape().bytes_per_expert();
  if (bytes == 0) return absl::OkStatus();
  if (!device_arenas_.empty()) {
    return device_arenas_[c.to_rank]->CopyFrom(*device_arenas_[c.from_rank],
                                               DeviceWeightOffset(c.layer, c.from_buffer),
                                               DeviceWeightOffset(c.layer, c.to_buffer), bytes);
  }
  std::memcpy(kernels::WeightBuffer(arenas_[c.to_rank].data(), layout_, c.layer, c.to_buffer),
              kernels::WeightBuffer(arenas_[c.from_rank].data(), layout_, c.layer, c.from_buffer),
              bytes);
  return absl::OkStatus();
}

bool Node::StagingStopped() const {
  MutexLock lock(&mu_);
  return staging_aborted_ || draining_;
}

absl::Status Node::FetchWeights(const WeightCopy& c, uint64_t version,
                                const RemoteWeights& remote) const {
  const size_t bytes = group_request_.shape().bytes_per_expert();
  if (bytes == 0) return absl::OkStatus();
  if (!remote.fetch) {
    return absl::FailedPreconditionError(
        "the holder is in another domain and the Prepare named no daemons to read it from");
  }
  const std::function<bool()> stopped = [this] { return StagingStopped(); };
  if (device_arenas_.empty()) {
    return remote.fetch(c.from_rank, version, c.layer, c.remote_slot,
                        kernels::WeightBuffer(arenas_[c.to_rank].data(), layout_, c.layer, c.to_buffer),
                        bytes, stopped);
  }
  // Device arenas: through host memory.
  std::vector<std::byte> staged(bytes);
  UBEP_RETURN_IF_ERROR(remote.fetch(c.from_rank, version, c.layer, c.remote_slot, staged.data(),
                                    bytes, stopped));
  return device_arenas_[c.to_rank]->Write(DeviceWeightOffset(c.layer, c.to_buffer), staged.data(), bytes);
}

absl::StatusOr<std::vector<uint32_t>> Node::CheckedSlotMap(int r, int buffer) const {
  // Each entry read once and checked as it is copied: the copy is what the caller uses,
  // whatever the arena says later.
  const uint32_t* in_arena = kernels::SlotMap(arenas_[r].data(), layout_, config_, buffer);
  const int S = config_.slots_per_rank;
  std::vector<uint32_t> map(static_cast<size_t>(config_.num_layers) * S);
  for (int i = 0; i < config_.num_layers * S; ++i) {
    map[i] = std::atomic_ref<const uint32_t>(in_arena[i]).load(std::memory_order_relaxed);
    if (map[i] >= layout_.buffers_per_layer) {
      return absl::DataLossError(absl::StrCat(
          "rank ", r, "'s slot map says layer ", i / S, " slot ", i % S, " is in weight buffer ",
          map[i], ", outside [0, ", layout_.buffers_per_layer,
          "): its arena was written outside ubepd"));
    }
  }
  return map;
}

bool Node::WeightsLoadedLocked(int r) const { return LoadWord(Ctl(r)->weights_loaded) != 0; }

absl::StatusOr<v1::ReadWeightsResponse> Node::ReadWeights(const v1::ReadWeightsRequest& request) const {
  MutexLock lock(&mu_);
  if (!has_group_) return absl::FailedPreconditionError("no group is attached to this daemon");
  const int L = config_.num_layers, S = config_.slots_per_rank, R = config_.num_ranks;
  if (request.layer() >= static_cast<uint32_t>(L)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", request.layer(), " is outside [0, ", L, ")"));
  }
  if (request.slot() >= static_cast<uint32_t>(R * S)) {
    return absl::InvalidArgumentError(absl::StrCat("slot ", request.slot(), " is outside [0, ", R * S, ")"));
  }
  const int r = static_cast<int>(request.slot()) / S;
  if (!Hosted(r)) {
    return absl::InvalidArgumentError(absl::StrCat("slot ", request.slot(), " is on rank ", r,
                                                   ", which this daemon does not host (ranks ",
                                                   first_, "-", first_ + hosted_ - 1, ")"));
  }
  if (request.plan_version() != plan_.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this daemon is on plan v", plan_.version, ", not v", request.plan_version()));
  }
  if (plan_.excluded(r)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", r, " is excluded under plan v", plan_.version, ": its weights are not kept"));
  }
  if (request.require_loaded() && !WeightsLoadedLocked(r)) return NotLoadedStatus(r);
  const uint64_t bytes = group_request_.shape().bytes_per_expert();
  if (request.offset() > bytes) {
    return absl::OutOfRangeError(absl::StrCat("offset ", request.offset(), " is past the expert's ",
                                              bytes, " bytes"));
  }
  uint64_t length = request.length() == 0 ? kMaxReadWeightsBytes : request.length();
  if (length > kMaxReadWeightsBytes) {
    return absl::InvalidArgumentError(absl::StrCat("length ", length, " is over the ",
                                                   kMaxReadWeightsBytes, " bytes of one read"));
  }
  length = std::min(length, bytes - request.offset());
  const int current = PlanBufferOf(plan_.version, r);
  if (current < 0) return absl::InternalError(absl::StrCat("plan v", plan_.version, " is not in the plan area of rank ", r));
  // The plan in force maps this buffer, so no staging writes it while we read.
  UBEP_ASSIGN_OR_RETURN(const std::vector<uint32_t> map, CheckedSlotMap(r, current));
  const uint32_t buffer = map[request.layer() * S + request.slot() % S];
  v1::ReadWeightsResponse response;
  response.set_bytes_per_expert(bytes);
  std::string* data = response.mutable_data();
  data->resize(length);
  if (on_device()) {
    UBEP_RETURN_IF_ERROR(device_arenas_[r]->Read(
        DeviceWeightOffset(static_cast<int>(request.layer()), buffer) + request.offset(), data->data(), length));
  } else {
    std::memcpy(data->data(),
                kernels::WeightBuffer(arenas_[r].data(), layout_, static_cast<int>(request.layer()), buffer) +
                    request.offset(),
                length);
  }
  return response;
}

absl::StatusOr<std::vector<Node::SlotCopy>> Node::SlotCopies(
    const balancer::Plan& in_force, const balancer::Plan& next,
    const std::function<uint32_t(int)>& domain_of, const std::function<bool(int)>& readable,
    const std::function<bool(int)>& last_resort) {
  const int R = next.topology.num_ranks, S = next.topology.slots_per_rank;
  std::vector<SlotCopy> copies;
  for (size_t l = 0; l < next.layers.size(); ++l) {
    const std::vector<int>& old_experts = in_force.layers[l].slot_expert;
    const std::vector<int>& new_experts = next.layers[l].slot_expert;
    for (int r = 0; r < R; ++r) {
      if (next.excluded(r)) continue;
      const bool returning = in_force.excluded(r);
      for (int i = 0; i < S; ++i) {
        const int expert = new_experts[r * S + i];
        if (!returning && old_experts[r * S + i] == expert) continue;
        // The nearest holder of `expert` under the plan in force: this rank, then the ranks
        // of its domain, then the others (ranks after r first, so holders share the load),
        // of those the ones whose daemon can be read (a copy on a daemon that is down is
        // passed over for one that is not, however near).
        int holder = -1, holder_distance = 3, unreadable = -1, resort = -1;
        for (int step = 0; step < R && holder_distance > 0; ++step) {
          const int q = (r + step) % R;
          const int distance = q == r ? 0 : domain_of(q) == domain_of(r) ? 1 : 2;
          if (in_force.excluded(q) || distance >= holder_distance) continue;
          for (int j = 0; j < S; ++j) {
            if (old_experts[q * S + j] != expert) continue;
            if (distance == 2 && readable && !readable(q)) {
              if (unreadable < 0) unreadable = q;
              break;
            }
            if (distance == 2 && last_resort && last_resort(q)) {
              if (resort < 0) resort = q * S + j;
              break;
            }
            holder = q * S + j;
            holder_distance = distance;
            break;
          }
        }
        if (holder < 0 && resort >= 0) {
          holder = resort;
          holder_distance = 2;
        }
        if (holder < 0 && unreadable >= 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              "layer ", l, ": expert ", expert, " is held only in other domains by ranks whose "
              "daemons are down (rank ", unreadable, ")"));
        }
        if (holder < 0) {
          return absl::FailedPreconditionError(absl::StrCat("layer ", l, ": expert ", expert, " has no holder"));
        }
        copies.push_back({static_cast<int>(l), r, i, holder, holder_distance});
      }
    }
  }
  return copies;
}

absl::StatusOr<std::vector<Node::LinkOp>> Node::LinkOps(const std::vector<SlotCopy>& schedule, int first,
                                                       int hosted, const std::vector<int>& rank_link,
                                                       int slots_per_rank, size_t per_batch) {
  const auto hosted_here = [&](int r) { return r >= first && r < first + hosted; };
  std::vector<LinkOp> ops;
  size_t position = 0;  // Every cross-domain copy counts: batches hold the same positions everywhere.
  for (size_t i = 0; i < schedule.size(); ++i) {
    const SlotCopy& c = schedule[i];
    if (c.distance != 2) continue;
    const int batch = static_cast<int>(position++ / per_batch);
    const int holder_rank = c.holder / slots_per_rank;
    if (!hosted_here(c.rank) && !hosted_here(holder_rank)) continue;  // Between two other daemons.
    const int other = hosted_here(c.rank) ? holder_rank : c.rank;
    const int peer = other < static_cast<int>(rank_link.size()) ? rank_link[other] : -1;
    if (peer < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", c.layer, ": rank ", other, " is on no daemon of the NCCL link"));
    }
    ops.push_back({batch, peer, /*send=*/!hosted_here(c.rank), static_cast<int>(i)});
  }
  return ops;
}

v1::PrepareResponse Node::Prepare(const balancer::Plan& plan, uint64_t effective_step,
                                 const RemoteWeights& remote) {
  MutexLock lock(&mu_);
  v1::PrepareResponse response;
  // Whether this call stopped the group for a change of members (membership_pending_): only
  // then is the flag its to put back. A Prepare refused at once (another one staging) must not
  // clear the flag of the one in flight, or the old group could form meanwhile.
  bool stopped_for_members = false;
  auto fail = [&](std::string reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    UBEP_LOG(WARNING) << "prepare of plan v" << plan.version << " failed: " << reason;
    if (stopped_for_members) {
      membership_pending_ =
          pending_.has_value() && pending_->excluded_ranks != plan_.excluded_ranks;
    }
    response.set_prepared(false);
    response.set_reason(std::move(reason));
    return response;
  };
  // A Prepare taken up after its caller gave up on it (it waited for the lock, or its request
  // was slow to come) is not carried out: the balancer may have sent its Abort already, which
  // found nothing here to abort, and a plan prepared now would stay pending (ranks waiting at
  // its effective step, or a group stopped for members) for a change nobody will decide.
  const auto past_deadline = [&](const char* when) {
    return absl::StrCat("the caller's deadline for this Prepare passed ", when,
                        " (the balancer has given up on it, and may have sent its Abort "
                        "already)");
  };
  if (absl::Now() >= remote.caller_deadline) return fail(past_deadline("before ubepd took it up"));
  if (!has_group_) return fail("no group is attached to this daemon");
  if (draining_) return fail("ubepd is draining");
  if (plan.version > kMaxPlanVersion) {
    return fail(absl::StrCat("plan version ", plan.version, " is above 2^63 - 1 (no plan after "
                             "it could be numbered)"));
  }
  // Whatever --max_plan_lead_steps says: no rank reaches such a step (libubep's BeginStep
  // takes none past 2^63 - 1), so the plan would never be in force, and every plan after it
  // would be refused for waiting on it.
  if (effective_step > kMaxStep) {
    return fail(absl::StrCat("effective step ", effective_step, " is above 2^63 - 1 (no rank "
                             "reaches it)"));
  }
  if (staging_) return fail(absl::StrCat("the weights of plan v", staging_version_, " are being staged"));
  if (!AllArenasMapped()) return fail("the arenas of the peer daemons' ranks are not mapped yet");
  if (const std::string stale = StaleMembers(plan); !stale.empty()) {
    return fail(absl::StrCat("the daemon of rank", stale, " restarted and its new arenas are not "
                             "mapped here yet (they are, once a committed plan excludes them)"));
  }
  const int R = config_.num_ranks, S = config_.slots_per_rank, L = config_.num_layers;
  if (plan.topology.num_ranks != R || plan.topology.slots_per_rank != S ||
      plan.num_experts != config_.num_experts || plan.num_layers() != L) {
    return fail(absl::StrCat("plan shape ", plan.topology.num_ranks, " ranks x ",
                             plan.topology.slots_per_rank, " slots, ", plan.num_layers(),
                             " layers x ", plan.num_experts, " experts does not match the group's ",
                             R, " x ", S, ", ", L, " x ", config_.num_experts));
  }
  if (absl::Status valid = balancer::ValidatePlan(plan); !valid.ok()) {
    return fail(std::string(valid.message()));
  }
  if (pending_.has_value()) {
    if (pending_->version == plan.version && pending_effective_step_ == effective_step) {
      // A retried Prepare: already staged, if it is the same plan. A version names one plan:
      // another one under it would be committed as the staged one.
      if (!(*pending_ == plan)) {
        return fail(absl::StrCat("plan v", plan.version,
                                 " is prepared here with other contents; a version names one "
                                 "plan"));
      }
      response.set_prepared(true);
      return response;
    }
    return fail(absl::StrCat("plan v", pending_->version, " is prepared and undecided"));
  }
  if (plan.version <= plan_.version) {
    return fail(absl::StrCat("version ", plan.version, " is not above the committed v",
                             plan_.version));
  }
  const bool membership = plan.excluded_ranks != plan_.excluded_ranks;
  int furthest = -1;  // The member rank furthest ahead, at furthest_step.
  uint64_t furthest_step = 0;
  for (int r = 0; r < R; ++r) {
    const uint64_t step = StepOf(r);
    if (plan.excluded(r)) continue;
    // (A change of members stops the group, and the plan is in force from the step it resumes
    // at, whatever its effective step.)
    if (!membership && step >= effective_step) {
      return fail(absl::StrCat("effective step ", effective_step, " is not ahead of rank ", r,
                               "'s step ", step));
    }
    if (furthest < 0 || step > furthest_step) {
      furthest = r;
      furthest_step = step;
    }
  }
  // A step estimated far ahead (a balancer extrapolating a wrong step rate) would leave the
  // plan committed but not in force for that long, and every later plan waiting on it.
  if (const uint64_t lead = options_.max_plan_lead_steps;
      !membership && lead > 0 && furthest >= 0 && effective_step - furthest_step > lead) {
    return fail(absl::StrCat("effective step ", effective_step, " is more than ", lead,
                             " steps ahead of rank ", furthest, "'s step ", furthest_step,
                             " (--max_plan_lead_steps)"));
  }
  // The plan in force must be in force on every hosted rank: its predecessor's buffer, which
  // this plan would overwrite, may still be read before that. (Not for a change of members:
  // the group is stopped, and forms again under the new plan.)
  if (const std::optional<int> r = RankBeforePlanLocked(); !membership && r.has_value()) {
    return fail(absl::StrCat("plan v", plan_.version, " is not in force on rank ", *r,
                             " yet (step ", StepOf(*r), " < ", EffectiveStepOf(plan_.version),
                             ")"));
  }
  // Per rank, the plan buffer holding the plan in force in its own arena (a daemon that
  // caught up on the cluster's plan may have another parity than its peers).
  // A daemon whose ranks the plan all excludes stages nothing, and reads no peer's slot map:
  // the peers' areas need not hold its plan (they keep the last two of theirs, and a daemon cut
  // off from the balancer while the others committed two plans or more is behind by as many;
  // the plan that catches it up excludes its ranks).
  bool stages = false;
  for (int r = first_; r < first_ + hosted_; ++r) stages |= !plan.excluded(r);
  std::vector<int> current(R, -1);
  for (int r = 0; r < R; ++r) {
    if (!Hosted(r) && (plan_.excluded(r) || !stages)) continue;  // Never a holder: see below.
    current[r] = PlanBufferOf(plan_.version, r);
    if (current[r] < 0) {
      return fail(absl::StrCat("plan v", plan_.version, " is not in the plan area of rank ", r));
    }
  }
  // New slot -> weight buffer maps: unchanged slots keep their buffer; a slot whose expert
  // changes takes a buffer the plan in force does not use, and gets the expert's weights
  // from a slot that holds it now (same rank first).
  // Each daemon stages its hosted ranks' slots; a holder may be any rank of the group (the
  // peers' arenas are mapped: same domain, a copy between arenas) that the plan in force
  // does not exclude: an excluded rank's weights are not kept to its plan (its daemon may
  // have died, or restarted with empty arenas), so it is never a holder. A rank the new plan
  // excludes is not staged; a rank it includes again is staged whole, in place: the plan in
  // force sends it nothing, so no reader sees its buffers change.
  // Holders in another domain are read through their daemon (remote.fetch).
  if (!remote.rank_domain.empty() && static_cast<int>(remote.rank_domain.size()) != R) {
    return fail(absl::StrCat("the domains of ", remote.rank_domain.size(), " ranks were given for a group of ", R));
  }
  const auto domain_of = [&](int q) {
    return remote.rank_domain.empty() ? options_.domain : remote.rank_domain[q];
  };
  for (int r = first_; r < first_ + hosted_; ++r) {
    if (domain_of(r) != options_.domain) {
      return fail(absl::StrCat("rank ", r, " is in domain ", domain_of(r), " for the balancer but this daemon's is ",
                               options_.domain));
    }
  }
  // The group's staging, as every daemon computes it: which slots get which holder's expert.
  // A holder in another domain is read through its daemon: not one the balancer lists as
  // down (every daemon is given the same lists, so the schedule stays the group's).
  const auto readable = [&](int q) {
    return static_cast<int>(remote.rank_link.size()) != R || remote.rank_link[q] >= 0;
  };
  const auto last_resort = [&](int q) {
    return static_cast<int>(remote.rank_restarted.size()) == R && remote.rank_restarted[q];
  };
  // A daemon whose ranks the plan all excludes stages nothing, so it needs the schedule only
  // to send its holders' weights over an NCCL link, and only when it is on the plan the link's
  // schedule is computed over. One behind (cut off, or restarted) computes none: over its own
  // stale plan a holder that is down now could fail the plan that catches it up, at every try;
  // its ranks, out of the cluster's plan in force since it fell behind, hold nothing the link
  // sends, and it joins the link (a collective to form) to send and receive nothing.
  const bool over_link = on_device() && !remote.nccl_id.empty();
  const bool schedules = stages || (over_link && remote.base_version == plan_.version);
  absl::StatusOr<std::vector<SlotCopy>> schedule =
      schedules ? SlotCopies(plan_, plan, domain_of, readable, last_resort)
                : std::vector<SlotCopy>();
  if (!schedule.ok()) return fail(std::string(schedule.status().message()));
  std::vector<std::vector<uint32_t>> maps(R);
  std::vector<std::vector<uint32_t>> checked(R);  // The slot maps in force, copied and checked.
  std::vector<WeightCopy> copies;
  std::vector<uint32_t> buffer_of(schedule->size(), 0);  // Hosted copies' new buffers.
  uint32_t copied_slots = 0, remote_slots = 0;
  uint64_t copied_bytes = 0, remote_bytes = 0;
  const uint64_t bytes_per_expert = group_request_.shape().bytes_per_expert();
  // Every map a copy reads (the hosted ranks' and the holders'), checked once.
  for (int r = 0; r < R; ++r) {
    if (!arenas_[r].valid() || current[r] < 0) continue;
    absl::StatusOr<std::vector<uint32_t>> cur = CheckedSlotMap(r, current[r]);
    if (!cur.ok()) return fail(std::string(cur.status().message()));
    checked[r] = *std::move(cur);
    if (Hosted(r)) maps[r] = checked[r];
  }
  // The schedule is in (layer, rank, slot) order: each hosted (layer, rank)'s copies in turn.
  size_t k = 0;
  for (int l = 0; l < L; ++l) {
    for (int r = first_; r < first_ + hosted_; ++r) {
      while (k < schedule->size() && std::make_pair((*schedule)[k].layer, (*schedule)[k].rank) < std::make_pair(l, r)) ++k;
      size_t end = k;
      while (end < schedule->size() && (*schedule)[end].layer == l && (*schedule)[end].rank == r) ++end;
      if (plan.excluded(r)) continue;
      const bool returning = plan_.excluded(r);
      const std::vector<uint32_t>& cur = checked[r];
      std::vector<bool> used(layout_.buffers_per_layer, false);
      for (int i = 0; i < S; ++i) used[cur[l * S + i]] = true;
      std::vector<uint32_t> free;
      for (uint32_t b = 0; b < layout_.buffers_per_layer; ++b) {
        if (!used[b]) free.push_back(b);
      }
      const size_t changed = end - k;
      if (!returning && changed > free.size()) {
        return fail(absl::StrCat("rank ", r, " layer ", l, ": ", changed,
                                 " slots change but only ", free.size(),
                                 " weight buffers are free (--free_buffers ",
                                 options_.free_buffers, ")"));
      }
      for (; k < end; ++k) {
        const SlotCopy& c = (*schedule)[k];
        uint32_t buffer = cur[l * S + c.slot];
        if (!returning) {
          buffer = free.back();
          free.pop_back();
        }
        buffer_of[k] = buffer;
        const int hr = c.holder / S, hj = c.holder % S;
        if (c.distance == 2) {
          copies.push_back({hr, 0, r, buffer, l, /*remote_slot=*/c.holder});
          ++remote_slots;
          remote_bytes += bytes_per_expert;
        } else {
          if (checked[hr].empty()) {
            return fail(absl::StrCat("rank ", r, " layer ", l, " slot ", c.slot, ": its expert's holder, rank ",
                                     hr, ", has no arenas mapped here"));
          }
          const uint32_t source = checked[hr][l * S + hj];
          copies.push_back({hr, source, r, buffer, l});
        }
        maps[r][l * S + c.slot] = buffer;
        ++copied_slots;
        copied_bytes += bytes_per_expert;
      }
    }
  }
  // Over an NCCL link (CUDA backend), the copies between domains run in the schedule's
  // order, in batches of the same schedule positions on every daemon: each daemon receives
  // its ranks' copies and sends its ranks' holders' weights.
  std::vector<std::vector<WeightLink::Transfer>> batches;
  int link_device = -1;
  if (over_link) {
    if (remote.link_rank < 0) {
      // The Prepare lists the group's daemons by node name, and this one's is not among them.
      return fail("this daemon is not among the daemons the Prepare lists for the NCCL link "
                  "(none of them has its --node name)");
    }
    if (static_cast<int>(remote.rank_link.size()) != R || remote.link_rank >= remote.link_size) {
      return fail(absl::StrCat("the NCCL link names rank ", remote.link_rank, " of ", remote.link_size,
                               " and the daemons of ", remote.rank_link.size(), " ranks, for a group of ", R));
    }
    if (schedules && remote.base_version != plan_.version) {
      // Every daemon walks one schedule, computed over the plan in force: it must be the same.
      return fail(absl::StrCat("the NCCL link's copies are scheduled over plan v", remote.base_version,
                               " but this daemon is on plan v", plan_.version));
    }
    // One GPU per daemon of the link: daemons sharing a machine take different ones.
    link_device = remote.link_rank % std::max(1, DeviceCount());
    const size_t per_batch = std::max<size_t>(1, kLinkBatchBytes / std::max<uint64_t>(1, bytes_per_expert));
    absl::StatusOr<std::vector<LinkOp>> ops = LinkOps(*schedule, first_, hosted_, remote.rank_link, S, per_batch);
    if (!ops.ok()) return fail(std::string(ops.status().message()));
    for (const LinkOp& op : *ops) {
      const SlotCopy& c = (*schedule)[op.copy];
      batches.resize(std::max<size_t>(batches.size(), op.batch + 1));
      if (op.send) {
        const int hr = c.holder / S;
        // Its new arenas are sent only once its client said they hold the weights, as
        // ReadWeights reads them (the peers' link fails with this Prepare).
        if (last_resort(hr) && !WeightsLoadedLocked(hr)) return fail(std::string(NotLoadedStatus(hr).message()));
        const uint32_t source = checked[hr][c.layer * S + c.holder % S];
        batches[op.batch].push_back({op.peer, /*send=*/true, device_arenas_[hr].get(),
                                     DeviceWeightOffset(c.layer, source), bytes_per_expert});
      } else {
        batches[op.batch].push_back({op.peer, /*send=*/false, device_arenas_[c.rank].get(),
                                     DeviceWeightOffset(c.layer, buffer_of[op.copy]), bytes_per_expert});
      }
    }
  }
  if (membership) {
    // Ranks leave or join: stop the group now, once every check that could refuse the plan
    // has passed (a refused plan stops nothing), and before any byte is staged, so that no
    // hosted rank reads a plan buffer while this plan overwrites one. Its members join
    // again; the group forms once the plan is decided (TryFormGroup waits for it), under the
    // plan then committed.
    membership_pending_ = true;
    stopped_for_members = true;
    StopGroup(kernels::kAbortMembership, [&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return MembershipStops(plan, r);
    });
    const absl::Duration wait = std::min(options_.wait_timeout, absl::Seconds(3));
    // The lock is let go while the ranks stop: staging_ keeps other Prepares and new groups
    // out meanwhile, and an Abort of this plan is kept for it (Abort), not lost.
    staging_ = true;
    staging_version_ = plan.version;
    staging_aborted_ = false;
    const bool stopped = mu_.AwaitWithTimeout([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (staging_aborted_ || draining_) return true;
      for (int r = first_; r < first_ + hosted_; ++r) {
        if (ranks_[r].state == RankState::kConnected && !ranks_[r].joining) return false;
      }
      return true;
    }, wait);
    staging_ = false;
    if (staging_aborted_) {
      return fail(absl::StrCat("plan v", plan.version,
                               " was aborted while the hosted ranks stopped for it"));
    }
    // A drain ends the wait at once (the wait's condition): told after a wait that ran out, it
    // came too late to end it.
    if (!stopped) {
      std::vector<int> running;
      for (int r = first_; r < first_ + hosted_; ++r) {
        if (ranks_[r].state == RankState::kConnected && !ranks_[r].joining) running.push_back(r);
      }
      return fail(absl::StrCat(
          "the hosted ranks did not stop within ", absl::FormatDuration(wait),
          " for the change of members",
          running.empty() ? std::string()
                          : absl::StrCat(" (rank", running.size() > 1 ? "s " : " ",
                                         absl::StrJoin(running, ", "),
                                         " still in a step: a serving loop that calls no "
                                         "BeginStep, Dispatch or Combine for that long?)"),
          "; the balancer tries again"));
    }
    if (draining_) return fail("ubepd is draining");
  }
  // The copies run without the lock (they may take seconds on the host backend): joins,
  // the daemon's RPCs and metrics go on meanwhile. Nothing they touch moves: sources are buffers
  // the plan in force reads, destinations buffers it does not; staging_ keeps the arenas
  // mapped (no new group, no peer's arenas replaced) and any other Prepare out. A daemon on a
  // link joins it even with nothing to copy: joining is collective.
  if (!copies.empty() || over_link) {
    staging_ = true;
    staging_version_ = plan.version;
    staging_aborted_ = false;
    const uint64_t in_force = plan_.version;
    mu_.Unlock();
    absl::Status copied = absl::OkStatus();
    for (const WeightCopy& c : copies) {
      const bool from_remote = c.remote_slot >= 0;
      if (from_remote && over_link) continue;
      copied = from_remote ? FetchWeights(c, in_force, remote) : CopyWeights(c);
      if (!copied.ok()) {
        copied = absl::Status(copied.code(), absl::StrCat(
            "layer ", c.layer, ": staging rank ", c.to_rank, "'s weights from rank ", c.from_rank,
            from_remote ? absl::StrCat(" (domain ", domain_of(c.from_rank), ")") : "", ": ",
            copied.message()));
        break;
      }
      // An Abort or a drain meanwhile: the rest need not be copied (reads from other domains
      // are slow, and a drain waits for this Prepare's RPC to end).
      if (StagingStopped()) break;
    }
    // Stopped meanwhile: the link is not joined (the others' joins are stopped as theirs is).
    if (copied.ok() && over_link && !StagingStopped()) {
      const absl::Time deadline = remote.deadline;
      const std::function<bool()> stopped = [this] { return StagingStopped(); };
      absl::StatusOr<std::unique_ptr<WeightLink>> link =
          ConnectWeightLink(remote.nccl_id, remote.link_size, remote.link_rank, link_device,
                            deadline, stopped);
      copied = link.status();
      for (size_t b = 0; b < batches.size() && copied.ok() && !StagingStopped(); ++b) {
        copied = (*link)->Exchange(batches[b], deadline, stopped);
      }
      if (!copied.ok()) {
        copied = absl::Status(copied.code(), absl::StrCat("staging over the NCCL link: ", copied.message()));
      }
    }
    if (options_.staging_hook) options_.staging_hook();
    mu_.Lock();
    staging_ = false;
    // Why it stopped first: a copy that gave up for an Abort or a drain failed for it.
    if (staging_aborted_) return fail(absl::StrCat("plan v", plan.version, " was aborted while its weights were staged"));
    if (draining_) return fail("ubepd is draining");
    if (!copied.ok()) return fail(std::string(copied.message()));
  }
  // Under the lock from here to pending_: an Abort either came before this look (after the
  // deadline, which the balancer's own is not before) or finds the plan pending.
  if (absl::Now() >= remote.caller_deadline) return fail(past_deadline("while it was carried out"));
  absl::StatusOr<std::vector<std::byte>> table = PlanTableOf(plan);
  if (!table.ok()) return fail(std::string(table.status().message()));
  for (int r = first_; r < first_ + hosted_; ++r) {
    uint32_t* map = kernels::SlotMap(arenas_[r].data(), layout_, config_, 1 - current[r]);
    std::copy(maps[r].begin(), maps[r].end(), map);
    // The map is in place before the table's version word is published (PreparePlan stores
    // it last, with release).
    if (absl::Status s = kernels::PreparePlan(arenas_[r].data() + layout_.plan,
                                              layout_.plan_capacity, *table, plan.version,
                                              effective_step);
        !s.ok()) {
      for (int q = first_; q < r; ++q) {
        (void)kernels::AbortPlan(arenas_[q].data() + layout_.plan, plan.version);
      }
      return fail(std::string(s.message()));
    }
  }
  // The steps were checked before the weights were staged, which may take seconds: a rank may
  // have begun the effective step since, under the plan in force, without the chance to see
  // this one. Every hosted rank's step is read again now that the plan is prepared in its
  // arena (BeginStep stores the step and then looks for an undecided plan; both sides are
  // sequentially consistent), and the plan is withdrawn if a rank got there first.
  for (int r = first_; r < first_ + hosted_; ++r) {
    if (membership || plan.excluded(r)) continue;
    if (const uint64_t step = StepOf(r); step >= effective_step) {
      for (int q = first_; q < first_ + hosted_; ++q) {
        (void)kernels::AbortPlan(arenas_[q].data() + layout_.plan, plan.version);
      }
      return fail(absl::StrCat("rank ", r, " reached step ", step, " while plan v", plan.version,
                               " was staged; effective step ", effective_step,
                               " is no longer ahead of it"));
    }
  }
  pending_ = plan;
  pending_effective_step_ = effective_step;
  response.set_prepared(true);
  response.set_copied_slots(copied_slots);
  response.set_copied_bytes(copied_bytes);
  response.set_remote_slots(remote_slots);
  response.set_remote_bytes(remote_bytes);
  UBEP_LOG(INFO) << "prepared plan v" << plan.version << " for step " << effective_step << ": "
                 << copied_slots << " slots staged (" << copied_bytes << " bytes), "
                 << remote_slots << " of them from other domains (" << remote_bytes << " bytes)";
  return response;
}

bool Node::CommittedLocked(uint64_t version) const {
  return version == plan_.version || committed_versions_.contains(version);
}

absl::Status Node::Commit(uint64_t version) {
  MutexLock lock(&mu_);
  if (CommittedLocked(version)) return absl::OkStatus();  // Already committed.
  if (!pending_.has_value() || pending_->version != version) {
    return absl::NotFoundError(absl::StrCat("plan v", version, " is not prepared here"));
  }
  // Every hosted rank's area can take the commit, or none is committed (a rank's area may be
  // written by its client: one it aborted there would leave the ranks of this daemon on two
  // plans from the effective step).
  for (int r = first_; r < first_ + hosted_; ++r) {
    if (absl::Status s = kernels::CheckCommittable(arenas_[r].data() + layout_.plan, version);
        !s.ok()) {
      return absl::DataLossError(absl::StrCat(
          "rank ", r, "'s plan area lost plan v", version, " (", s.message(),
          "): committed on no rank of this daemon (did its client write into its plan "
          "area?)"));
    }
  }
  const bool membership = pending_->excluded_ranks != plan_.excluded_ranks;
  if (membership) {
    // Ranks leave or join: stop every wait of the running group (and of clients of excluded
    // ranks); the members join again and the group forms under this plan, from the least step
    // they resume at. Before the plan is committed in this daemon's arenas: a peer daemon that
    // committed first forms the new group as soon as it sees the plan committed here, and
    // stopping the group after that would stop the new one, whose members joined already.
    StopGroup(kernels::kAbortMembership, [&](int r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return MembershipStops(*pending_, r);
    });
  }
  for (int r = first_; r < first_ + hosted_; ++r) {
    UBEP_RETURN_IF_ERROR(kernels::CommitPlan(arenas_[r].data() + layout_.plan, version));
  }
  plan_ = *std::move(pending_);
  pending_.reset();
  membership_pending_ = false;
  committed_versions_.Insert(version);
  if (membership) {
    UBEP_LOG(INFO) << "plan v" << version << " changes the group's members (excluded: "
                   << (plan_.excluded_ranks.empty() ? "none" : absl::StrJoin(plan_.excluded_ranks, ", "))
                   << "): the group forms again";
  }
  UBEP_LOG(INFO) << "committed plan v" << version << " (effective at step "
                 << pending_effective_step_ << ")";
  return absl::OkStatus();
}

absl::Status Node::Abort(uint64_t version) {
  MutexLock lock(&mu_);
  if (staging_ && staging_version_ == version) staging_aborted_ = true;  // Prepare fails.
  if (has_group_ && CommittedLocked(version)) {
    // Committed here: an Abort of it means that the balancer and this daemon disagree on
    // the decision, which must not pass as done (the others may have aborted it).
    return absl::FailedPreconditionError(absl::StrCat(
        "plan v", version, " is committed here; a committed plan is never aborted"));
  }
  if (!pending_.has_value() || pending_->version != version) return absl::OkStatus();
  // Aborted on every hosted rank whose area holds it, and undecided here no more whatever
  // became of it in an area a client wrote into (no rank can commit it there either): one
  // broken area must not leave the others undecided and refuse every later Prepare.
  std::vector<std::string> lost;
  for (int r = first_; r < first_ + hosted_; ++r) {
    if (absl::Status s = kernels::AbortPlan(arenas_[r].data() + layout_.plan, version); !s.ok()) {
      lost.push_back(absl::StrCat("rank ", r, " (", s.message(), ")"));
    }
  }
  pending_.reset();
  membership_pending_ = false;
  UBEP_LOG(INFO) << "aborted plan v" << version;
  if (!lost.empty()) {
    return absl::DataLossError(absl::StrCat(
        "plan v", version, " is aborted here, but the plan area of ", absl::StrJoin(lost, ", "),
        " did not take the abort (did its client write into its plan area?)"));
  }
  return absl::OkStatus();
}

v1::DaemonState Node::State() const {
  MutexLock lock(&mu_);
  v1::DaemonState state;
  for (int r = first_; r < first_ + hosted_; ++r) state.add_ranks(static_cast<uint32_t>(r));
  if (!has_group_) return state;
  state.set_committed_version(plan_.version);
  if (pending_.has_value()) {
    state.set_pending_version(pending_->version);
    state.set_pending_effective_step(pending_effective_step_);
    state.set_pending_fingerprint(balancer::PlanFingerprint(*pending_));
  }
  state.set_max_step(MaxStepLocked());
  state.set_plan_in_force(!RankBeforePlanLocked().has_value());
  state.set_committed_effective_step(EffectiveStepOf(plan_.version));
  *state.mutable_committed_plan() = balancer::ToProto(plan_, balancer::PlanEncoding::kCompact);
  return state;
}

absl::StatusOr<Node::SlotLoads> Node::ReadSlotLoads() const {
  MutexLock lock(&mu_);
  SlotLoads loads;
  loads.plan = CommittedPlanIdentityLocked();
  loads.group = IdentityLocked();
  if (!has_group_) return loads;
  loads.max_step = MaxStepLocked();  // Before the counters (its loads acquire).
  const int L = config_.num_layers, S = config_.slots_per_rank, R = config_.num_ranks;
  loads.slots.assign(L, std::vector<uint64_t>(static_cast<size_t>(R) * S, 0));
  loads.dispatches.assign(L, std::vector<uint64_t>(R, 0));
  const kernels::ArenaLayout ep(config_);
  std::vector<uint64_t> counters(static_cast<size_t>(L) * S);
  std::vector<uint64_t> dispatches(L);
  for (int r = first_; r < first_ + hosted_; ++r) {
    // A rank no process holds has no writer: an update its killed owner left half done is
    // settled rather than waited for (it would be, by every read until the rank is back, and
    // hold back every report and harvest of this daemon).
    const bool ownerless = ranks_[r].state != RankState::kConnected;
    if (on_device()) {
      // The device arena is read by copies: the sequence words before and after the
      // counters; if any layer's word moved or was odd (a scan kernel inside), all again.
      std::vector<uint64_t> before(L), after(L), first;
      const absl::Time deadline = absl::Now() + absl::Milliseconds(100);
      for (;;) {
        UBEP_RETURN_IF_ERROR(device_arenas_[r]->Read(ep.load_seq, before.data(), L * sizeof(uint64_t)));
        UBEP_RETURN_IF_ERROR(device_arenas_[r]->Read(ep.load_counters, counters.data(),
                                                     counters.size() * sizeof(uint64_t)));
        UBEP_RETURN_IF_ERROR(device_arenas_[r]->Read(ep.load_seq, after.data(), L * sizeof(uint64_t)));
        if (first.empty()) first = before;
        // still: no update inside; odd_only: no word moved since the first read (odd words
        // left by a writer that stopped, not one still adding).
        bool still = true, odd_only = true;
        for (int l = 0; l < L; ++l) {
          still &= before[l] == after[l] && before[l] % 2 == 0;
          odd_only &= before[l] == after[l] && before[l] == first[l];
        }
        if (still) break;
        if (absl::Now() > deadline) {
          if (!ownerless || !odd_only) {
            return absl::DeadlineExceededError(
                absl::StrCat("rank ", r, ": load counters kept changing for 100ms"));
          }
          // Still for 100 ms (time for a dying client's context to end its kernels), odd
          // words and no client: as SettleLayerLoad on the host, the counts as they stand,
          // the killed update counted as its dispatch, the word even again.
          for (int l = 0; l < L; ++l) {
            if (before[l] % 2 == 0) continue;
            ++before[l];
            UBEP_RETURN_IF_ERROR(device_arenas_[r]->Write(ep.load_seq + l * sizeof(uint64_t),
                                                          &before[l], sizeof(uint64_t)));
            UBEP_LOG(WARNING) << "rank " << r << ": layer " << l << "'s load counters were left "
                              << "mid-update by a client that is gone; taken as they stand";
          }
          break;
        }
      }
      for (int l = 0; l < L; ++l) dispatches[l] = before[l] / 2;
    } else {
      std::byte* arena = arenas_[r].data() + layout_.ep;
      for (int l = 0; l < L; ++l) {
        absl::StatusOr<uint64_t> n =
            kernels::ReadLayerLoad(arena, ep, S, l, counters.data() + l * S,
                                   ownerless ? absl::ZeroDuration() : absl::Milliseconds(100));
        if (!n.ok() && ownerless) {
          UBEP_LOG(WARNING) << "rank " << r << ": layer " << l << "'s load counters were left "
                            << "mid-update by a client that is gone; taken as they stand";
          n = kernels::SettleLayerLoad(arena, ep, S, l, counters.data() + l * S);
        }
        if (!n.ok()) return absl::Status(n.status().code(), absl::StrCat("rank ", r, ": ", n.status().message()));
        dispatches[l] = *n;
      }
    }
    for (int l = 0; l < L; ++l) {
      for (int i = 0; i < S; ++i) loads.slots[l][r * S + i] = counters[l * S + i];
      loads.dispatches[l][r] = dispatches[l];
    }
    loads.over_capacity_calls += LoadWord(Ctl(r)->over_capacity_calls);
  }
  return loads;
}

std::string Node::PeerKey() const {
  MutexLock lock(&mu_);
  if (!has_group_) return "";
  v1::AttachRequest key;
  key.set_world_size(group_request_.world_size());
  *key.mutable_shape() = group_request_.shape();
  return absl::StrCat(options_.backend, ":", key.SerializeAsString());
}

absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> Node::ArenasForPeer(const std::string& key) const {
  // "BACKEND:" and the group's shape (PeerKey).
  const size_t colon = key.find(':');
  v1::AttachRequest peer;
  if (colon == std::string::npos || !peer.ParseFromString(key.substr(colon + 1))) {
    return absl::InvalidArgumentError("malformed peer request");
  }
  if (const std::string backend = key.substr(0, colon); backend != options_.backend) {
    return absl::FailedPreconditionError(
        absl::StrCat("the peer daemon runs the ", backend, " backend, this one ", options_.backend));
  }
  MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("ubepd is draining");
  if (!has_group_) return absl::UnavailableError("no group yet: no client has attached here");
  UBEP_RETURN_IF_ERROR(CompareShapes(group_request_, peer));
  // The hosted ranks' host arenas, then (CUDA backend) their device arenas.
  std::vector<int> fds;
  for (int r = first_; r < first_ + hosted_; ++r) fds.push_back(arenas_[r].fd());
  if (on_device()) {
    for (int r = first_; r < first_ + hosted_; ++r) fds.push_back(device_arenas_[r]->fd());
  }
  UBEP_ASSIGN_OR_RETURN(std::vector<UniqueFd> held, HoldFds(fds));
  return std::make_pair(first_, std::move(held));
}

std::vector<int> Node::MissingRanks() const {
  MutexLock lock(&mu_);
  std::vector<int> missing;
  for (int r = 0; r < static_cast<int>(arenas_.size()); ++r) {
    if (!arenas_[r].valid()) missing.push_back(r);
  }
  return missing;
}

std::vector<int> Node::StaleMembersOf(const balancer::Plan& plan) const {
  std::vector<int> stale;
  for (int r = 0; r < static_cast<int>(stale_.size()); ++r) {
    if (stale_[r] && !plan.excluded(r)) stale.push_back(r);
  }
  return stale;
}

std::vector<int> Node::RestartedMembers() const {
  MutexLock lock(&mu_);
  if (!has_group_) return {};
  return StaleMembersOf(plan_);
}

std::string Node::StaleMembers(const balancer::Plan& plan) const {
  const std::vector<int> stale = StaleMembersOf(plan);
  if (stale.empty()) return "";
  return absl::StrCat(stale.size() == 1 ? " " : "s ", absl::StrJoin(stale, ", "));
}

bool Node::PeerArenasWanted(int first_rank, int count, const std::string& incarnation) {
  MutexLock lock(&mu_);
  if (!has_group_ || first_rank < 0 || count <= 0 || first_rank + count > config_.num_ranks) return false;
  // A member list naming a rank hosted here is wrong as a whole: it marks nothing (as
  // AddPeerArenas), rather than the ranks before the hosted one stale.
  for (int r = first_rank; r < first_rank + count; ++r) {
    if (Hosted(r)) return false;
  }
  bool wanted = false;
  std::string was;  // The dead process, when this call found the ranks' daemon restarted.
  for (int r = first_rank; r < first_rank + count; ++r) {
    if (!arenas_[r].valid()) {
      wanted = true;
    } else if (!incarnation.empty() && !incarnation_[r].empty() && incarnation_[r] != incarnation) {
      if (!stale_[r]) was = incarnation_[r];
      stale_[r] = true;
      wanted = true;
    }
  }
  if (!was.empty()) {
    UBEP_LOG(WARNING) << "the daemon of ranks " << first_rank << "-" << first_rank + count - 1
                      << " restarted (was " << was << ", now " << incarnation
                      << "): its old arenas are stale";
  }
  return wanted;
}

absl::StatusOr<std::pair<uint64_t, std::vector<UniqueFd>>> Node::RefreshArenas(int64_t connection) const {
  MutexLock lock(&mu_);
  for (const RankEntry& e : ranks_) {
    if (e.state != RankState::kConnected || e.connection != connection) continue;
    if (!AllArenasMapped()) return absl::UnavailableError("the group's arenas are not all mapped");
    std::vector<int> fds;
    for (const kernels::SharedArena& arena : arenas_) fds.push_back(arena.fd());
    for (const auto& memory : device_arenas_) fds.push_back(memory->fd());
    UBEP_ASSIGN_OR_RETURN(std::vector<UniqueFd> held, HoldFds(fds));
    return std::make_pair(arena_epoch_, std::move(held));
  }
  return absl::FailedPreconditionError("this connection holds no rank");
}

absl::Status Node::AddPeerArenas(int first_rank, const std::vector<int>& fds,
                                 const std::string& incarnation) {
  MutexLock lock(&mu_);
  if (!has_group_) return absl::FailedPreconditionError("no group");
  // CUDA backend: the ranks' host arenas, then their device arenas.
  if (on_device() && fds.size() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a peer on the cuda backend sent ", fds.size(),
                                                   " fds: expected a host and a device arena per rank"));
  }
  const int count = static_cast<int>(on_device() ? fds.size() / 2 : fds.size());
  // (count > num_ranks - first_rank: first_rank is the peer's word, and near INT_MAX the sum
  // would wrap past the check.)
  if (first_rank < 0 || first_rank > config_.num_ranks || count > config_.num_ranks - first_rank) {
    return absl::InvalidArgumentError(absl::StrCat("peer ranks ", first_rank, "+", count,
                                                   " are outside the group of ", config_.num_ranks));
  }
  for (int r = first_rank; r < first_rank + count; ++r) {
    // Before anything is marked: a peer that names this daemon's ranks (a misconfigured
    // --ranks, a stale record) must not make them read as restarted.
    if (Hosted(r)) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", r, " is hosted here, not by the peer"));
    }
  }
  bool replacing = false;
  for (int r = first_rank; r < first_rank + count; ++r) replacing |= arenas_[r].valid();
  if (replacing && staging_) {
    return absl::UnavailableError(absl::StrCat("the weights of plan v", staging_version_,
                                               " are being staged; the arenas stay until then"));
  }
  if (replacing) {
    // The ranks' daemon restarted. Its old arenas are still read by this daemon and by the
    // clients while the ranks are members; new ones may take their place only while no plan
    // that could be in force routes anything to them or forms a group with them.
    for (int r = first_rank; r < first_rank + count; ++r) {
      if (!plan_.excluded(r) || (pending_.has_value() && !pending_->excluded(r)) || membership_pending_) {
        if (!incarnation.empty() && incarnation != incarnation_[r]) stale_[r] = true;
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", r, " is a member under plan v",
            pending_.has_value() ? pending_->version : plan_.version,
            ": its daemon's new arenas are mapped once a committed plan excludes it"));
      }
    }
  }
  std::vector<kernels::SharedArena> mapped;
  for (int i = 0; i < count; ++i) {
    const int r = first_rank + i;
    UBEP_ASSIGN_OR_RETURN(kernels::SharedArena arena, kernels::SharedArena::Map(fds[i]));
    const auto wrong_size = [&] {
      return absl::FailedPreconditionError(absl::StrCat("the peer's arena for rank ", r, " has ",
                                                        arena.size(), " bytes; this group's have ",
                                                        layout_.total_bytes));
    };
    if (arena.size() < layout_.control + sizeof(kernels::RankControl)) return wrong_size();
    const kernels::RankControl* c = kernels::ControlOf(arena.data(), layout_);
    if (c->magic != kernels::kRankControlMagic ||
        c->version != kernels::kRankArenaVersion || static_cast<int>(c->rank) != r ||
        static_cast<int>(c->world_size) != config_.num_ranks) {
      return absl::FailedPreconditionError(
          absl::StrCat("the peer's arena for rank ", r, " does not match this group (rank ",
                       c->rank, " of ", c->world_size, ", arena version ", c->version, ")"));
    }
    // Settings from the daemons' flags, which the clients' shape does not carry.
    if (const std::string differ = kernels::DataPlaneSettingsDiffer(*c, layout_, config_);
        !differ.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the peer's arena for rank ", r, " is laid out for ", differ,
          ": start every daemon of a group with the same --protocol, --flagged_tokens, "
          "--free_buffers and --backend"));
    }
    if (arena.size() != layout_.total_bytes) return wrong_size();
    mapped.push_back(std::move(arena));
  }
  std::vector<std::unique_ptr<DeviceMemory>> imported;
  if (on_device()) {
    const int devices = DeviceCount();
    for (int i = 0; i < count; ++i) {
      const int r = first_rank + i;
      UBEP_ASSIGN_OR_RETURN(std::unique_ptr<DeviceMemory> memory,
                            ImportDeviceMemory(r % std::max(devices, 1), fds[count + i], layout_.device_bytes));
      imported.push_back(std::move(memory));
    }
  }
  for (int i = 0; i < count; ++i) {
    arenas_[first_rank + i] = std::move(mapped[i]);
    if (on_device()) device_arenas_[first_rank + i] = std::move(imported[i]);
    incarnation_[first_rank + i] = incarnation;
    stale_[first_rank + i] = false;
  }
  if (replacing) {
    // Clients take the new arenas when they next join (JoinResponse.arena_epoch).
    ++arena_epoch_;
    UBEP_LOG(INFO) << "re-mapped the arenas of ranks " << first_rank << "-" << first_rank + count - 1
                   << " (their daemon restarted; arena epoch " << arena_epoch_ << ")";
  } else {
    UBEP_LOG(INFO) << "mapped the arenas of ranks " << first_rank << "-" << first_rank + count - 1
                   << " from a peer daemon";
  }
  return absl::OkStatus();
}

std::optional<std::pair<int, int>> Node::HostedRanks() const {
  MutexLock lock(&mu_);
  if (!has_group_) return std::nullopt;
  return std::make_pair(first_, hosted_);
}

void Node::Drain() {
  MutexLock lock(&mu_);
  if (draining_) return;
  draining_ = true;
  // Tokens not claimed yet hold no client this daemon could wait for (one that died between
  // its Attach and its claim would hold the drain up to the ticket timeout): let go of, and
  // their claims refused.
  for (RankEntry& e : ranks_) {
    if (e.state == RankState::kAttached) e = RankEntry{};
  }
  if (has_group_) {
    // The hosted ranks detach; the peers' ranks see them gone (unless the plan excludes them
    // already: then the peers run on undisturbed).
    bool member = false;
    for (int q = first_; q < first_ + hosted_; ++q) member |= !plan_.excluded(q);
    for (int r = 0; r < static_cast<int>(arenas_.size()); ++r) {
      if (!arenas_[r].valid()) continue;
      const bool hosted = Hosted(r);
      if (!hosted && !member) continue;
      if (hosted) WithdrawTicket(r);  // (Paired with the lead's look again: BreakGroup.)
      // The abort word first, then the state (as StopGroup): a rank that reads the state
      // changed finds the reason there.
      SetAbortCode(r, hosted ? kernels::kAbortDraining
                             : kernels::kAbortRankGone | static_cast<uint32_t>(first_),
                   /*only_if_clear=*/!hosted);
      std::atomic_ref<uint32_t>(Ctl(r)->group_state)
          .store(hosted ? kernels::kGroupDraining : kernels::kGroupBroken,
                 std::memory_order_release);
    }
  }
  UBEP_LOG(INFO) << "draining: " << AttachedLocked() << " ranks attached";
}

void Node::MarkHostedDraining() {
  if (!has_group_) return;
  for (int r = first_; r < first_ + hosted_; ++r) {
    if (!arenas_[r].valid()) continue;
    if (AbortCode(r) != kernels::kAbortDraining) SetAbortCode(r, kernels::kAbortDraining, false);
    std::atomic_ref<uint32_t>(Ctl(r)->group_state)
        .store(kernels::kGroupDraining, std::memory_order_release);
  }
}

bool Node::AwaitDetached(absl::Duration timeout) {
  MutexLock lock(&mu_);
  // In slices: an unclaimed token stops counting when its deadline passes, which nothing
  // signals. Each slice says again that the hosted ranks drain: a lead daemon forming a
  // group across daemons may have read their tickets before the drain withdrew them, and
  // then reset their words (TryFormGroup, which stops such a group once it is published).
  const absl::Time deadline = MonotonicNow() + timeout;
  while (true) {
    if (draining_) MarkHostedDraining();
    const absl::Duration left = deadline - MonotonicNow();
    if (mu_.AwaitWithTimeout([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return AttachedLocked() == 0; },
                             std::min(left, absl::Milliseconds(100)))) {
      return true;
    }
    if (left <= absl::Milliseconds(100)) return AttachedLocked() == 0;
  }
}

absl::StatusOr<std::vector<std::vector<uint64_t>>> Node::ReadLoads(
    uint64_t* arenas_created, std::optional<std::pair<int, int>>* hosted) const {
  UBEP_ASSIGN_OR_RETURN(SlotLoads read, ReadSlotLoads());
  if (arenas_created != nullptr) *arenas_created = read.group.arenas_created;
  if (hosted != nullptr) *hosted = read.group.hosted;
  const std::vector<std::vector<uint64_t>>& slots = read.slots;
  if (!read.group.shape.has_value()) return std::vector<std::vector<uint64_t>>(slots.size());
  // The group the counters were read with (one lock): sizes that match them.
  const size_t world = read.group.shape->world_size();
  const size_t per_rank = read.group.shape->shape().slots_per_rank();
  std::vector<std::vector<uint64_t>> loads(slots.size(), std::vector<uint64_t>(world, 0));
  for (size_t l = 0; l < slots.size(); ++l) {
    for (size_t p = 0; p < slots[l].size(); ++p) loads[l][p / per_rank] += slots[l][p];
  }
  return loads;
}

NodeSnapshot Node::Snapshot() const {
  MutexLock lock(&mu_);
  NodeSnapshot s;
  s.has_group = has_group_;
  s.draining = draining_;
  if (!has_group_) return s;
  s.generation = GroupGeneration();  // (A rank the plan excludes keeps an older one.)
  s.world_size = config_.num_ranks;
  s.attached = AttachedLocked();
  s.arena_bytes = static_cast<uint64_t>(layout_.total_bytes) * hosted_;
  s.device_arena_bytes = static_cast<uint64_t>(layout_.device_bytes) * hosted_;
  s.plan_version = plan_.version;
  s.num_layers = config_.num_layers;
  s.slots_per_rank = config_.slots_per_rank;
  for (int r = first_; r < first_ + hosted_; ++r) {
    s.rank_up.emplace_back(r, ranks_[r].state == RankState::kConnected);
    s.joining += ranks_[r].joining ? 1 : 0;
  }
  return s;
}

}  // namespace ubep::daemon
