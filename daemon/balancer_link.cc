#include "daemon/balancer_link.h"

#include <unistd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "balancer/formats/proto_convert.h"
#include "common/channel.h"
#include "common/clock.h"
#include "common/logging.h"
#include "daemon/fd_server.h"
#include "grpcpp/grpcpp.h"

namespace ubep::daemon {

BalancerLink::BalancerLink(BalancerLinkOptions options, Node* node)
    : options_(std::move(options)),
      node_(node),
      stub_(v1::Control::NewStub(ControlChannel(options_.balancer))),
      incarnation_(absl::StrCat(getpid(), "-", absl::ToUnixNanos(absl::Now()))),
      interval_ms_(absl::ToInt64Milliseconds(options_.report_interval)),
      thread_([this] { return NextTick(); }, [this] { Tick(); }) {}

absl::StatusOr<std::optional<balancer::Plan>> FetchClusterPlan(v1::Control::Stub& stub,
                                                               absl::Time deadline,
                                                               absl::Duration patience) {
  const absl::Time own = absl::Now() + patience;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(std::min(own, deadline)));
  v1::Plan proto;
  const grpc::Status status = stub.GetClusterPlan(&context, v1::GetClusterPlanRequest(), &proto);
  if (!status.ok()) {
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && deadline < own) {
      return absl::DeadlineExceededError(
          "the Attach's deadline passed while the balancer was asked for the cluster's plan, "
          "which a new group starts under");
    }
    if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {  // No plan yet.
      UBEP_LOG(WARNING) << "the cluster's plan: " << status.error_message();
    }
    return std::nullopt;
  }
  absl::StatusOr<balancer::Plan> plan = balancer::FromProto(proto);
  if (!plan.ok()) {
    UBEP_LOG(WARNING) << "the cluster's plan: " << plan.status();
    return std::nullopt;
  }
  return *std::move(plan);
}

absl::Duration PeerPollInterval(int unchanged) {
  return std::min(absl::Milliseconds(100 << std::clamp(unchanged, 0, 4)), absl::Seconds(1));
}

absl::Duration BalancerLink::NextTick() {
  const absl::Duration interval = absl::Milliseconds(interval_ms_.load());
  std::vector<int> missing = node_->MissingRanks();
  missing_ticks_ = missing == missing_ ? std::min(missing_ticks_ + 1, 4) : 0;  // 4: 1 s.
  missing_ = std::move(missing);
  const bool peers_missing = !missing_.empty();
  const absl::Duration poll = std::min(interval, PeerPollInterval(missing_ticks_));
  if (!registered_) {
    // The first registration at once, then tried again every second at most (more often
    // while peers' arenas wait for it): until the balancer knows this daemon it counts its
    // ranks as down (after its registration grace), however long --report_interval is.
    if (!ticked_) {
      ticked_ = true;
      return absl::ZeroDuration();
    }
    return peers_missing ? poll : std::min(interval, absl::Seconds(1));
  }
  return peers_missing ? poll : interval;
}

// A registered ClientContext with the link's deadline; one whose link is stopping is
// cancelled before it is used (the call then fails at once, CANCELLED).
class BalancerLink::Call {
 public:
  explicit Call(BalancerLink& link) : link_(link) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + link.options_.rpc_timeout));
    std::lock_guard<std::mutex> lock(link_.call_mu_);
    link_.call_ = &context_;
    if (link_.stopping_.load()) context_.TryCancel();
  }
  ~Call() {
    std::lock_guard<std::mutex> lock(link_.call_mu_);
    link_.call_ = nullptr;
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  grpc::ClientContext* context() { return &context_; }

 private:
  BalancerLink& link_;
  grpc::ClientContext context_;
};

BalancerLink::~BalancerLink() {
  // The tick in flight may be in an RPC to a balancer (or a peer) that does not answer: it is
  // cancelled, and no other starts, so that the thread (joined with the members below) ends
  // now rather than after every RPC of the tick has waited out its timeout.
  std::lock_guard<std::mutex> lock(call_mu_);
  stopping_ = true;
  if (call_ != nullptr) call_->TryCancel();
}

void BalancerLink::Tick() {
  const Node::GroupIdentity group = node_->Identity();
  const std::string serialized = group.shape.has_value() ? group.shape->SerializeAsString() : "";
  if (!registered_ || serialized != registered_shape_ ||
      group.arenas_created != registered_arenas_) {
    SetRegistered(Register());
  }
  if (!registered_ || stopping_.load()) return;
  MapPeers();
  // A peer daemon seen to have started anew (MapPeers): the balancer may not have seen it
  // (it restarted too), and only a plan without its ranks lets this daemon map its new arenas.
  // (Once they are mapped the list is empty again: nothing to tell, and a registration resets
  // what the balancer collected of this daemon in the interval.)
  if (std::vector<int> restarted = node_->RestartedMembers(); restarted != registered_restarted_) {
    if (restarted.empty()) {
      registered_restarted_.clear();
    } else {
      SetRegistered(Register());
      if (!registered_) return;
    }
  }
  const absl::Time now = MonotonicNow();  // A wall clock stepped back would stop the reports.
  if (now >= next_report_ && !stopping_.load()) {
    next_report_ = now + absl::Milliseconds(interval_ms_.load()) - absl::Milliseconds(50);
    Report();
  }
}

void BalancerLink::MapPeers() {
  if (!node_->HostedRanks().has_value()) return;
  v1::GetGroupRequest request;
  request.set_node(options_.node);
  Call call(*this);
  v1::GetGroupResponse group;
  const grpc::Status status = stub_->GetGroup(call.context(), request, &group);
  if (!status.ok()) {
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) SetRegistered(false);
    return;
  }
  const std::string key = node_->PeerKey();
  for (const v1::GroupMember& member : group.members()) {
    if (stopping_.load()) return;
    if (member.node() == options_.node || member.arena_socket().empty() || !member.healthy() ||
        member.ranks().empty()) {
      continue;
    }
    // A member's ranks are contiguous (node-major numbering).
    const auto [lo, hi] = std::minmax_element(member.ranks().begin(), member.ranks().end());
    if (!node_->PeerArenasWanted(static_cast<int>(*lo), static_cast<int>(*hi - *lo + 1),
                                 member.incarnation())) {
      continue;
    }
    absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> arenas =
        FetchPeerArenas(member.arena_socket(), key, options_.rpc_timeout);
    absl::Status mapped = arenas.status();
    if (arenas.ok()) {
      std::vector<int> fds;
      for (const UniqueFd& fd : arenas->second) fds.push_back(fd.get());
      mapped = node_->AddPeerArenas(arenas->first, fds, member.incarnation());
    }
    if (!mapped.ok() && absl::Now() >= next_peer_log_) {
      next_peer_log_ = absl::Now() + absl::Seconds(5);
      UBEP_LOG(INFO) << "arenas of node " << member.node() << ": " << mapped.message();
    }
  }
}

bool BalancerLink::Register() {
  v1::RegisterRequest request;
  request.set_node(options_.node);
  request.set_address(options_.address);
  request.set_domain(options_.domain);
  request.set_backend(options_.backend);
  request.set_free_buffers(static_cast<uint32_t>(node_->free_buffers()));
  request.set_arena_socket(options_.arena_socket);
  // The group's incarnation, shape and ranks, read together.
  const Node::GroupIdentity group = node_->Identity();
  request.set_incarnation(absl::StrCat(incarnation_, ".", group.arenas_created));
  const std::vector<int> restarted = node_->RestartedMembers();
  for (int r : restarted) request.add_restarted_ranks(static_cast<uint32_t>(r));
  const std::optional<v1::AttachRequest>& shape = group.shape;
  if (shape.has_value() && group.hosted.has_value()) {
    *request.mutable_shape() = shape->shape();
    request.set_world_size(shape->world_size());
    for (int r = group.hosted->first; r < group.hosted->first + group.hosted->second; ++r) {
      request.add_ranks(r);
    }
  }
  Call call(*this);
  v1::RegisterResponse response;
  const grpc::Status status = stub_->Register(call.context(), request, &response);
  if (!status.ok() && stopping_.load()) return false;  // Cancelled: nothing to say.
  if (!status.ok()) {
    // Retried at every tick (10 per second while peers' arenas are missing): the same refusal
    // is logged once per 10 s.
    const absl::Time now = absl::Now();
    if (status.error_message() != last_refusal_ || now >= next_refusal_log_) {
      last_refusal_ = status.error_message();
      next_refusal_log_ = now + absl::Seconds(10);
      UBEP_LOG(WARNING) << "registering with ubep-balancer at " << options_.balancer
                        << " failed: " << status.error_message();
    }
    return false;
  }
  last_refusal_.clear();
  registered_shape_ = shape.has_value() ? shape->SerializeAsString() : "";
  registered_arenas_ = group.arenas_created;
  registered_restarted_ = restarted;
  if (pending_.has_value() && pending_->loads.group.arenas_created != group.arenas_created) {
    // An unanswered report of arenas gone: the balancer takes this registration (another
    // incarnation) as a new process's, whose reports' seqs start over, and would take it
    // again though it may have taken it already. Dropped, as the rest of what the old arenas
    // counted is (the balancer forgets what it collected of a registration before).
    pending_.reset();
  }
  if (response.report_interval_ms() > 0) {
    // Within [10 ms, 1 h], whatever the balancer says.
    interval_ms_.store(static_cast<int64_t>(
        std::clamp<uint64_t>(response.report_interval_ms(), 10, 3'600'000)));
  }
  UBEP_LOG(INFO) << "registered with ubep-balancer at " << options_.balancer;
  return true;
}

void BalancerLink::Report() {
  if (!pending_.has_value()) {
    std::optional<Pending> made = MakeReport();
    if (!made.has_value()) return;
    pending_ = *std::move(made);
  } else {
    // The same report again; only the step it tells is the daemon's now (the balancer
    // estimates step rates from it).
    pending_->request.set_max_step(node_->MaxStep());
  }
  Call call(*this);
  v1::ReportLoadResponse response;
  const grpc::Status status = stub_->ReportLoad(call.context(), pending_->request, &response);
  if (!status.ok() && stopping_.load()) return;  // Cancelled: kept, as any report unanswered.
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
      // The balancer's answers: taken, or refused for good (a report it cannot use is
      // dropped, and the balancer says why). One of a plan it moved past (FAILED_PRECONDITION)
      // is expected at a plan change; a malformed one is said, once per reason and 10 s.
      if (status.ok()) {
        Count(&BalancerLinkStats::reports_taken);
      } else {
        Count(&BalancerLinkStats::reports_refused);
        const std::string why = absl::StrCat(status.error_code(), ": ", status.error_message());
        if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT && SayReportFailure(why)) {
          UBEP_LOG(WARNING) << "load report " << pending_->request.seq() << " refused by "
                            << options_.balancer << " (code " << why << "); it is dropped";
        }
      }
      last_ = std::move(pending_->loads);
      last_step_ = pending_->request.load().last_step();
      pending_.reset();
      return;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED: {
      // Answers that the same report would get again (one larger than the balancer takes,
      // an endpoint that is not a balancer, credentials it refuses): sent again, it would
      // hold up every report after it for good. Dropped, its counts lost to the balancer,
      // and said (once per kind and 10 s).
      Count(&BalancerLinkStats::reports_dropped);
      const std::string why = absl::StrCat(status.error_code(), ": ", status.error_message());
      if (SayReportFailure(why)) {
        UBEP_LOG(WARNING) << "load report " << pending_->request.seq() << " refused by "
                          << options_.balancer << " (code " << why
                          << "); it is dropped, its counts lost to the balancer";
      }
      last_ = std::move(pending_->loads);
      last_step_ = pending_->request.load().last_step();
      pending_.reset();
      return;
    }
    case grpc::StatusCode::NOT_FOUND:
      // The balancer restarted or forgot this node: it took nothing of the report, which goes
      // again once this daemon has registered.
      SetRegistered(false);
      return;
    default: {
      // No answer of the balancer's (unreachable, timed out, or a transport or proxy that
      // cancelled or failed the call): taken or not, the same report goes again, and is taken
      // at most once. Said once per kind of failure and 10 s.
      Count(&BalancerLinkStats::reports_unanswered);
      const std::string why = absl::StrCat(status.error_code(), ": ", status.error_message());
      if (SayReportFailure(why)) {
        UBEP_LOG(WARNING) << "load report " << pending_->request.seq() << " got no answer from "
                          << "ubep-balancer (code " << why << "); it goes again";
      }
      return;
    }
  }
}

void BalancerLink::SetRegistered(bool registered) {
  registered_ = registered;
  if (options_.stats != nullptr) options_.stats->registered.store(registered ? 1 : 0);
}

void BalancerLink::Count(std::atomic<uint64_t> BalancerLinkStats::*counter) {
  if (options_.stats != nullptr) (options_.stats->*counter).fetch_add(1);
}

bool BalancerLink::SayReportFailure(const std::string& why) {
  const absl::Time now = MonotonicNow();
  if (why == last_report_failure_ && now < next_report_failure_log_) return false;
  last_report_failure_ = why;
  next_report_failure_log_ = now + absl::Seconds(10);
  return true;
}

std::optional<BalancerLink::Pending> BalancerLink::MakeReport() {
  // The step before the counters (ReadSlotLoads reads it first): it is the next report's
  // first step, and every count read after it is then of that step or a later one. Read
  // after them, a step begun between the two reads would be the next report's first while
  // that report still holds counts of the step before (at a plan's effective step, the old
  // plan's counts passing for the new).
  absl::StatusOr<Node::SlotLoads> loads = node_->ReadSlotLoads();
  if (!loads.ok()) {
    // Read again at the next interval; said, or reports would stop without a word.
    const std::string why = absl::StrCat("the load counters: ", loads.status().message());
    if (SayReportFailure(why)) UBEP_LOG(WARNING) << "no load report: " << why;
    return std::nullopt;
  }
  if (loads->slots.empty()) return std::nullopt;
  if (last_.group.arenas_created != loads->group.arenas_created) {
    // Arenas created since the last report (the first group, or one formed again, whatever
    // its size) started their counters at zero: all of it is new.
    last_ = *loads;
    for (std::vector<uint64_t>& layer : last_.slots) std::fill(layer.begin(), layer.end(), 0);
    for (std::vector<uint64_t>& layer : last_.dispatches) std::fill(layer.begin(), layer.end(), 0);
    last_.over_capacity_calls = 0;
    last_step_ = 0;  // Their ranks' steps go on from where their clients resumed.
  }
  // A group formed again may have moved its plan's start back to the step it resumed at
  // (RetargetPlan), at or before the step this report would start from: the counts since the
  // last report then hold steps run under the plan before (steps go back across a re-form),
  // which would pass for this plan's. They cannot be told apart: not reported, and the next
  // report starts here. Only across a re-form (a plan committed while the ranks waited at its
  // start, the last report read there, is this plan's alone, and reported); a plan whose
  // start is ahead of the last report's step is reported as ever (the balancer takes that
  // report as stale).
  if (loads->group.generation != last_.group.generation &&
      (loads->plan.version != last_.plan.version ||
       loads->plan.effective_step != last_.plan.effective_step) &&
      loads->plan.effective_step.has_value() &&
      *loads->plan.effective_step <= std::min(last_step_, loads->max_step)) {
    UBEP_LOG(INFO) << "the load of steps " << std::min(last_step_, loads->max_step) << "-"
                   << loads->max_step << " is not reported: plan v" << loads->plan.version
                   << " is in force from step " << *loads->plan.effective_step
                   << " (the group formed again there), and those counts hold the plan before's";
    // The calls dropped over a receive capacity are counted whatever plan they ran under:
    // the next report carries them apart (not the plan in force's to be judged by).
    if (loads->over_capacity_calls > last_.over_capacity_calls) {
      over_capacity_unreported_ += loads->over_capacity_calls - last_.over_capacity_calls;
    }
    last_ = *std::move(loads);
    last_step_ = last_.max_step;
    return std::nullopt;
  }
  // Of the arenas counted: read with the counters.
  const Node::PlanIdentity& plan = loads->plan;
  const Node::GroupIdentity& group = loads->group;
  const std::optional<std::pair<int, int>>& hosted = group.hosted;
  const std::optional<v1::AttachRequest>& shape = group.shape;
  if (!hosted.has_value() || !shape.has_value()) return std::nullopt;
  const uint64_t step = loads->max_step;
  // This daemon's ranks' slots only (ranks are contiguous, slots rank-major).
  const size_t slots_per_rank = shape->shape().slots_per_rank();
  const size_t first_rank = static_cast<size_t>(hosted->first);
  const size_t end_rank = first_rank + static_cast<size_t>(hosted->second);
  Pending made;
  v1::ReportLoadRequest& request = made.request;
  request.set_node(options_.node);
  request.set_seq(++seq_);
  request.set_max_step(step);
  request.set_plan_in_force(plan.in_force);
  if (plan.effective_step.has_value()) request.set_plan_effective_step(*plan.effective_step);
  // Counters only grow within one set of arenas (the data plane adds to them): one below its
  // last reading was stored by something else that maps the arena. Its delta would wrap, and
  // the balancer would refuse the whole report, every hosted rank's counts: it counts 0, said,
  // and the next report goes on from where it stands now.
  std::vector<std::string> went_back;  // The first 8 named.
  size_t went_back_count = 0;
  auto counted_0 = [&](auto&& what) -> uint64_t {
    if (++went_back_count <= 8) went_back.push_back(what());
    return 0;
  };
  auto delta = [&](uint64_t now, uint64_t before, auto&& what) -> uint64_t {
    return now >= before ? now - before : counted_0(what);
  };
  request.set_over_capacity_calls(delta(loads->over_capacity_calls, last_.over_capacity_calls,
                                        [] { return std::string("over_capacity_calls"); }));
  request.set_over_capacity_calls_before(std::exchange(over_capacity_unreported_, 0));
  v1::LoadReport* load = request.mutable_load();
  load->set_reporter(options_.node);
  // Steps do not go back within one set of arenas but for clients that attached again at an
  // earlier step: the report then covers the steps from there.
  load->set_first_step(std::min(last_step_, step));
  load->set_last_step(step);
  load->set_plan_version(plan.version);
  load->set_num_experts(static_cast<uint32_t>(plan.num_experts));
  for (size_t l = 0; l < loads->slots.size(); ++l) {
    v1::LayerLoad* layer = load->add_layers();
    // Layers are named by the plan's model layer ids (a plan file may number them 3..60).
    layer->set_layer(static_cast<uint32_t>(l < plan.layer_ids.size() ? plan.layer_ids[l] : l));
    layer->set_first_slot(first_rank * slots_per_rank);
    // Pairs of a rank that counted no dispatch (its count went back, or stood while its
    // pairs grew: every update of the data plane counts one) are not sent either: the
    // balancer refuses pairs over no dispatch as malformed, with the whole report.
    std::vector<uint64_t> dispatches;
    for (size_t r = first_rank; r < end_rank; ++r) {
      dispatches.push_back(delta(loads->dispatches[l][r], last_.dispatches[l][r], [&] {
        return absl::StrCat("layer ", l, " rank ", r, "'s dispatches (", last_.dispatches[l][r],
                            " -> ", loads->dispatches[l][r], ")");
      }));
    }
    for (size_t p = first_rank * slots_per_rank; p < end_rank * slots_per_rank; ++p) {
      uint64_t pairs = delta(loads->slots[l][p], last_.slots[l][p], [&] {
        return absl::StrCat("layer ", l, " slot ", p, " (", last_.slots[l][p], " -> ",
                            loads->slots[l][p], ")");
      });
      if (pairs > 0 && dispatches[p / slots_per_rank - first_rank] == 0) {
        pairs = counted_0([&] {
          return absl::StrCat("layer ", l, " slot ", p, " (", last_.slots[l][p], " -> ",
                              loads->slots[l][p], ", over no dispatch of rank ",
                              p / slots_per_rank, ")");
        });
      }
      layer->add_slot(pairs);
    }
    for (uint64_t d : dispatches) layer->add_dispatches(d);
  }
  if (!went_back.empty()) {
    UBEP_LOG(WARNING) << went_back_count << " load counters went back since the last report "
                      << "or grew over no dispatch, counted 0 this interval (something other "
                      << "than the data plane stores into the arenas): "
                      << absl::StrJoin(went_back, ", ")
                      << (went_back_count > went_back.size() ? ", ..." : "");
  }
  made.loads = *std::move(loads);
  return made;
}

}  // namespace ubep::daemon
