// libubep's implementation: the proto API to ubepd, fd passing, and the host data plane over
// the mapped arenas. Never includes daemon/ code.
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/rpc_origin.h"
#include "common/status_macros.h"
#include "common/timeout.h"
#include "common/unix_socket.h"
#include "grpcpp/grpcpp.h"
#include "kernels/common/host_cpu.h"
#include "kernels/common/plan_area.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/rank_arena.h"
#include "kernels/host/shared_arena.h"
#include "kernels/host/signal.h"
#include "ubep/ubep.h"
#include "ubep/v1/daemon.grpc.pb.h"

#ifdef UBEP_CLIENT_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/copy_now.h"
#include "kernels/cuda/cuda_ep.h"
#include "kernels/cuda/scoped_device.h"
#include "kernels/cuda/vmm_arena.h"
#endif

namespace ubep {
namespace internal {

struct DispatchedState {
  kernels::DispatchOutput output;  // Host backend.
#ifdef UBEP_CLIENT_CUDA
  kernels::CudaDispatchOutput cuda;  // CUDA backend: device pointers.
#endif
  bool on_device = false;
  // The views show a dispatch the caller is to combine: false until one is kept, and from the
  // start of each Dispatch into this output until it is (a failed one leaves empty views,
  // not a partial layout whose offsets count rows that are not there; the CUDA backend's bad
  // input found on the device is kept, as the caller combines it).
  bool filled = false;
  uint64_t plan_version = 0;
  int layer = -1;
  // Which dispatch of which rank this is the output of (Combine takes only the rank's last).
  // The rank is told by its address and its attach (an address may be reused after Detach).
  const RankState* rank = nullptr;
  uint64_t attach = 0;
  uint64_t serial = 0;
};

// Numbers each Attach of the process: a Dispatched of a rank detached since is not taken for
// the output of a rank attached later at the same address.
static std::atomic<uint64_t> attaches{0};

// ubepd takes the closing of a rank's fd connection for the end of the rank's process. The fd
// is CLOEXEC, but a child forked without exec (a data-loader worker, a Python multiprocessing
// pool) holds it too, and would keep a rank whose process died alive in ubepd's eyes, and its
// peers waiting on it, until the child exits. Every open fd connection of the process is
// listed here and closed in each child as it is forked. (Slots hold fd + 1; 0 is free.)
static std::array<std::atomic<int>, 1024> fork_closed{};
// Forks this process (or an ancestor since it was forked) went through, as the child: a rank
// attached before the last one is its parent's (RankState::fork_count).
static std::atomic<uint64_t> fork_count{0};

static void CloseFdConnectionsInChild() {  // Async-signal-safe: atomics and close only.
  fork_count.fetch_add(1, std::memory_order_relaxed);
  for (std::atomic<int>& slot : fork_closed) {
    if (const int fd = slot.exchange(0, std::memory_order_relaxed); fd != 0) close(fd - 1);
  }
}

// A rank's fd connection: listed in fork_closed while open (from the first one, the child
// handler is installed). Closed, it is taken off the list first, so that a child forked
// meanwhile does not close a number the parent may have reused.
class FdConnection {
 public:
  FdConnection() = default;
  FdConnection(const FdConnection&) = delete;
  FdConnection& operator=(const FdConnection&) = delete;
  FdConnection& operator=(FdConnection&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::move(other.fd_);
      slot_ = std::exchange(other.slot_, -1);
    }
    return *this;
  }
  ~FdConnection() { reset(); }

  void Adopt(UniqueFd fd) {
    reset();
    static std::once_flag installed;
    std::call_once(installed, [] { pthread_atfork(nullptr, nullptr, CloseFdConnectionsInChild); });
    for (size_t i = 0; i < fork_closed.size() && slot_ < 0; ++i) {
      int free = 0;
      if (fork_closed[i].compare_exchange_strong(free, fd.get() + 1)) slot_ = static_cast<int>(i);
    }
    fd_ = std::move(fd);
  }
  void reset() {
    if (slot_ >= 0) fork_closed[static_cast<size_t>(slot_)].store(0);
    slot_ = -1;
    fd_.reset();
  }
  int get() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }

 private:
  UniqueFd fd_;
  int slot_ = -1;  // In fork_closed; -1: not listed (more than 1024 open: not closed in a child).
};

struct RankState {
  ClientOptions options;
  int rank = 0;
  int world_size = 0;
  ModelShape shape;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Daemon::Stub> stub;
  std::string token;
  FdConnection fd_connection;  // Open while attached: ubepd notices its closing.
  pid_t pid = getpid();        // The process that attached; a child forked since has a copy,
  // in which the count of forks is ahead of this one's.
  uint64_t fork_count = internal::fork_count.load(std::memory_order_relaxed);
  bool InForkedChild() const {
    return fork_count != internal::fork_count.load(std::memory_order_relaxed);
  }
  // Arena refreshes sent on fd_connection whose replies were not read (one gave up at
  // rpc_timeout): ubepd answers each in order, so as many replies come before the next one's.
  int refresh_replies_owed = 0;
  std::vector<kernels::SharedArena> arenas;
  uint64_t arena_epoch = 0;  // Of the daemon, when the arenas were taken.
  kernels::RankArenaLayout layout;
  kernels::EpConfig config;
  std::unique_ptr<kernels::HostEp> ep;
  bool on_device = false;   // CUDA backend: data plane and weights in device arenas.
  int device = 0;
#ifdef UBEP_CLIENT_CUDA
  std::vector<std::unique_ptr<kernels::VmmArena>> device_arenas;
  std::unique_ptr<kernels::CudaEp> cuda_ep;
  void* device_plan = nullptr;       // The plan table in force, uploaded.
  uint64_t device_plan_version = 0;
  // max_tokens rows: where the combine of a call over the receive capacity, which libubep
  // runs for the caller, writes its (unused) output. Allocated at the first such call.
  void* overflow_sink = nullptr;
  ~RankState() {
    // (A host-backend rank of a CUDA build touches no CUDA state: a process that forks ranks
    // after must still be able to use the device in them.)
    std::optional<kernels::ScopedDevice> on_rank_device;
    if (on_device) on_rank_device.emplace(device);
    cuda_ep.reset();
    if (device_plan != nullptr) cudaFree(device_plan);
    if (overflow_sink != nullptr) cudaFree(overflow_sink);
  }
#endif
  uint64_t generation = 0;
  uint64_t resume_step = 0;
  uint64_t step = 0;  // The step begun last; the resume step after Attach or Rejoin.
  uint64_t dispatches = 0;  // Successful dispatches: the serial of the last one.
  const uint64_t attach = attaches.fetch_add(1, std::memory_order_relaxed) + 1;
  bool step_begun = false;
  absl::Status stopped;    // Set by a data-plane error: the group must re-form.
  // When BeginStep looks next whether ubepd is still there (MonotonicNow).
  absl::Time next_daemon_check = absl::InfinitePast();
  uint64_t last_plan_version = 0;
  RankStats detached_counts;  // stats() once the arenas are let go (Detach).
  // The plan tables this rank checked (kernels::SelectCheckedPlan; PlanAt). Written by the
  // const queries too (excluded(), SlotExpert()): a Rank is thread-compatible, one call at a
  // time, as ubep.h says.
  mutable kernels::CheckedPlan checked_plan;
  bool attached = false;
  bool daemon_exited = false;  // Its fd connection closed.
  // The ranks its daemon hosts (AttachResponse.hosted_first, hosted_count; all if unsaid).
  int hosted_first = 0;
  int hosted_count = 0;
  bool HostedByOwnDaemon(int r) const {
    return hosted_count == 0 || (r >= hosted_first && r < hosted_first + hosted_count);
  }

  std::byte* own() const { return arenas[rank].data(); }
  kernels::RankControl* control() const { return kernels::ControlOf(own(), layout); }
};

}  // namespace internal
namespace {

using internal::RankState;

#ifdef UBEP_CLIENT_CUDA
// kernels::CopyNow on the calling thread's default stream (cudaStreamPerThread).
bool CopyNow(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) {
  return kernels::CopyNow(to, from, bytes, kind, cudaStreamPerThread) == cudaSuccess;
}
#endif

// On the CUDA backend, the rank's device is the calling thread's current one for the scope
// (kernels::ScopedDevice: the caller's is put back), whichever thread calls; nothing on the
// host backend.
class RankDevice {
 public:
  explicit RankDevice([[maybe_unused]] const RankState& s) {
#ifdef UBEP_CLIENT_CUDA
    if (s.on_device) guard_.emplace(s.device);
#endif
  }

 private:
#ifdef UBEP_CLIENT_CUDA
  std::optional<kernels::ScopedDevice> guard_;
#endif
};

// `context` tells the daemon's own answers (ubepd marks them, kUbepOrigin) from failures of
// the transport, which alone are "not reachable". `timeout` (named `timeout_name`) is the
// call's deadline; `waits_for_group`: the call waits for the rest of the group (Join).
absl::Status FromGrpc(const grpc::Status& status, const grpc::ClientContext& context,
                      const std::string& what, absl::Duration timeout, const char* timeout_name,
                      bool waits_for_group = false) {
  if (status.ok()) return absl::OkStatus();
  const bool from_ubepd = AnsweredByServer(context);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !from_ubepd) {
    // Silence to the deadline. For an RPC ubepd answers at once (Attach, Detach) that is
    // ubepd not answering (stopped, wedged): Unavailable as on its fd socket, not
    // DeadlineExceeded, which says a peer of the group did not come. A Join's own answer may
    // be that (ubepd answers it before the deadline, naming whom the group waits for; on a
    // loaded host it may come late): it stays DeadlineExceeded, saying both.
    if (waits_for_group) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": no answer from ubepd within ", absl::FormatDuration(timeout), " (",
          timeout_name, "): the group did not form in time, or ubepd is stopped or hung"));
    }
    return absl::UnavailableError(absl::StrCat(what, ": ubepd did not answer within ",
                                               absl::FormatDuration(timeout), " (",
                                               timeout_name, "); is it stopped or hung?"));
  }
  if (status.error_code() == grpc::StatusCode::CANCELLED && !from_ubepd) {
    // This library never cancels its calls: the daemon cancelled it while shutting down.
    return absl::UnavailableError(absl::StrCat(what, ": ubepd is shutting down (", status.error_message(),
                                               "); attach again when it is back"));
  }
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE && !from_ubepd) {
    message = absl::StrCat("ubepd is not reachable (", message, "); is it running?");
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", message));
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

void Bump(uint64_t& word, uint64_t by = 1) {
  std::atomic_ref<uint64_t>(word).fetch_add(by, std::memory_order_relaxed);
}

void Observe(kernels::LatencyHistogram& h, absl::Duration d) {
  Bump(h.bucket[kernels::LatencyBucket(absl::ToDoubleSeconds(d))]);
  Bump(h.sum_ns, static_cast<uint64_t>(absl::ToInt64Nanoseconds(d)));
  Bump(h.count);
}

// Every call but Detach on a rank that detached (Detach released what the calls use).
absl::Status Detached(const RankState& s) {
  return absl::FailedPreconditionError(
      absl::StrCat("rank ", s.rank, " is detached (Detach, or a failed Attach): attach again"));
}

// What a forked child gets from its copy of its parent's rank: nothing of it is the child's
// (the fd connection was closed at the fork, and the arenas are the parent's group's).
absl::Status ForkedChild(const RankState& s, const char* what) {
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", s.rank, " was attached by process ", s.pid, "; process ", getpid(),
      ", forked from it, cannot ", what, " it"));
}

// The abort word of this rank's data plane: in its host arena, or on the CUDA backend in its
// device arena (the data plane at its offset 0).
uint32_t AbortCode(const RankState& s) {
  const kernels::ArenaLayout ep(s.config);
  uint32_t code = 0;
#ifdef UBEP_CLIENT_CUDA
  if (s.on_device) {
    const kernels::ScopedDevice on_device(s.device);
    if (static_cast<size_t>(s.rank) < s.device_arenas.size()) {
      (void)CopyNow(&code, s.device_arenas[s.rank]->data() + ep.abort, sizeof(code),
                    cudaMemcpyDeviceToHost);
    }
    return code;
  }
#endif
  return kernels::LoadAcquire(reinterpret_cast<const uint32_t*>(s.own() + s.layout.ep + ep.abort));
}

// Why the group is not ready, from this rank's control block and abort word.
absl::Status GroupStopped(const RankState& s) {
  const uint32_t code = AbortCode(s);
  const uint32_t state =
      std::atomic_ref<uint32_t>(s.control()->group_state).load(std::memory_order_acquire);
  const kernels::AbortReason reason = kernels::ReadAbortCode(code);
  if (state == kernels::kGroupDraining || reason.kind == kernels::AbortReason::kDraining) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", s.rank, ": ubepd is draining (shutting down); attach again when it is back"));
  }
  switch (reason.kind) {
    case kernels::AbortReason::kMembership:
      return absl::UnavailableError(
          absl::StrCat("rank ", s.rank,
                       ": the group's membership changed (a committed plan excludes or "
                       "includes ranks); call Rejoin"));
    case kernels::AbortReason::kRankGone:
      return absl::UnavailableError(absl::StrCat("rank ", s.rank, ": rank ", reason.rank,
                                                 " left the group; call Rejoin to continue once "
                                                 "rank ",
                                                 reason.rank, " is back"));
    case kernels::AbortReason::kTimedOut:
      return absl::UnavailableError(absl::StrCat("rank ", s.rank,
                                                 ": the group stopped after a wait on rank ",
                                                 reason.rank, " timed out; call Rejoin"));
    case kernels::AbortReason::kNone:
    case kernels::AbortReason::kDraining:
      break;
  }
  return absl::UnavailableError(
      absl::StrCat("rank ", s.rank, ": the group has re-formed or is forming without this "
                                    "rank; call Rejoin"));
}

// The plan in force at `step` in this rank's arena (null if none), checked the first time it
// is read (kernels::SelectCheckedPlan): the arena is shared memory every rank's process maps
// writable, and the table sizes what is read from it.
absl::StatusOr<const kernels::PlanTableHeader*> PlanAt(const RankState& s, uint64_t step,
                                                       uint64_t* version = nullptr,
                                                       int* buffer = nullptr) {
  absl::StatusOr<const kernels::PlanTableHeader*> table =
      kernels::SelectCheckedPlan(s.own() + s.layout.plan, s.layout.plan_capacity, step,
                                 s.checked_plan, version, buffer);
  if (!table.ok()) {
    return absl::DataLossError(absl::StrCat("rank ", s.rank, ": ", table.status().message()));
  }
  // A table consistent in itself may still be of another shape than this group's: what
  // reads it by the group's layers, experts and slots (SlotExpert, the exclusion mask) would
  // read past it.
  const kernels::PlanTableHeader* t = *table;
  const uint64_t slots = static_cast<uint64_t>(s.world_size) * s.shape.slots_per_rank;
  if (t != nullptr &&
      (t->num_layers != static_cast<uint32_t>(s.shape.num_layers) ||
       t->num_experts != static_cast<uint32_t>(s.shape.num_experts) || t->num_slots != slots ||
       (t->num_ranks != 0 && t->num_ranks != static_cast<uint32_t>(s.world_size)))) {
    return absl::DataLossError(absl::StrCat(
        "rank ", s.rank, ": plan v", t->version, " in force at step ", step, " is for ",
        t->num_layers, " layers x ", t->num_experts, " experts x ", t->num_slots, " slots (",
        t->num_ranks, " ranks), not this group's ", s.shape.num_layers, " x ",
        s.shape.num_experts, " x ", slots, " (", s.world_size,
        "): something other than ubepd wrote over it"));
  }
  return table;
}

// Whether the plan committed in this rank's arena for `step` (the newest: ~0) leaves it out
// of the group (not if its table is corrupt: BeginStep refuses the step for it, and the
// peers are told).
bool ExcludedByPlanAt(const RankState& s, uint64_t step) {
  absl::StatusOr<const kernels::PlanTableHeader*> table = PlanAt(s, step);
  return table.ok() && *table != nullptr &&
         kernels::RankExcluded(*table, static_cast<uint32_t>(s.rank));
}

bool GroupReady(const RankState& s) {
  const kernels::RankControl* c = s.control();
  return std::atomic_ref<const uint32_t>(c->group_state).load(std::memory_order_acquire) ==
             kernels::kGroupReady &&
         std::atomic_ref<const uint64_t>(c->generation).load(std::memory_order_acquire) ==
             s.generation;
}

// Whether ubepd closed this rank's fd connection: it exited (a crash, or killed). Polled by
// BeginStep every daemon_check_interval (one syscall): the data plane does not need the
// daemon, but nothing would collect this rank's statistics or apply plans any more.
bool DaemonExited(const RankState& s) {
  if (!s.fd_connection.valid()) return false;
  pollfd p{s.fd_connection.get(), POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) return true;
  char byte;
  return recv(s.fd_connection.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// Counts an error in the control block (the daemon exports it) and returns it.
absl::Status Record(RankState& s, absl::Status status) {
  if (!status.ok() && !s.arenas.empty()) {
    Bump(s.control()->errors[static_cast<int>(status.code()) % 17]);
    if (absl::IsDeadlineExceeded(status)) Bump(s.control()->wait_timeouts);
  }
  return status;
}

absl::Status RefreshArenas(RankState& s, uint64_t epoch);

// A refusal of this rank's own that leaves its peers waiting for it in the call they are in
// (no Dispatch comes until a BeginStep succeeds): recorded in its arena, so that a peer that
// gives up on it says why rather than asking whether it is alive (a refusal of a combine
// still owed is kept).
absl::Status TellPeers(RankState& s, absl::Status refused) {
  if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
    if (s.cuda_ep != nullptr) refused = s.cuda_ep->Refuse(refused, /*keep_earlier=*/true);
#endif
  } else if (s.ep != nullptr) {
    refused = s.ep->Refuse(refused, /*keep_earlier=*/true);
  }
  return refused;
}

// ubepd closed this rank's fd connection (DaemonExited): stops the group, once, and returns
// (and keeps) the error every later call of this rank returns.
absl::Status StopForDaemonExit(RankState& s) {
  if (s.daemon_exited && !s.stopped.ok()) return s.stopped;
  // Stop the group. The ranks of this daemon as a draining daemon would: their waits end
  // with "draining", and each attaches again, to the daemon that takes over. The ranks of
  // peer daemons, which are alive, learn that this rank left (they Rejoin where they are),
  // if they are in this rank's generation: a plan that excludes this rank, or a group formed
  // without it, leaves them running undisturbed.
  // The exit is noted (daemon_exited) only once the group is stopped: a stop cut short (out
  // of memory for the message) is tried again by the next call that looks (BeginStep,
  // must_attach_again, Detach), rather than leave the peers to their timeouts.
  absl::Status exited = absl::UnavailableError(
      absl::StrCat("rank ", s.rank, ": ubepd exited (it closed this rank's fd connection); "
                   "detach, and attach again when it is back"));
  // Without arenas (ubepd died between giving them and their mapping) no group is to stop.
  if (s.arenas.empty()) {
    s.daemon_exited = true;
    return s.stopped = std::move(exited);
  }
  const kernels::ArenaLayout ep(s.config);
  const bool member = !ExcludedByPlanAt(s, s.step);  // The plan in force.
  auto code_for = [&](int r) -> uint32_t {
    if (s.HostedByOwnDaemon(r)) return kernels::kAbortDraining;
    const uint64_t generation = std::atomic_ref<const uint64_t>(
        kernels::ControlOf(s.arenas[r].data(), s.layout)->generation).load(std::memory_order_acquire);
    return member && generation == s.generation
               ? kernels::kAbortRankGone | static_cast<uint32_t>(s.rank)
               : 0;
  };
  if (!s.on_device) {
    for (int r = 0; r < static_cast<int>(s.arenas.size()); ++r) {
      if (const uint32_t code = code_for(r); code != 0) {
        kernels::RaiseAbort(s.arenas[r].data() + s.layout.ep, ep, code);
      }
    }
  }
#ifdef UBEP_CLIENT_CUDA
  if (s.on_device) {
    const kernels::ScopedDevice on_device(s.device);
    // The data plane is at offset 0 of each device arena; a set abort word is kept. A copy
    // that fails leaves the exit unnoted, so that the next call that looks tries again.
    bool stopped = true;
    for (int r = 0; r < static_cast<int>(s.device_arenas.size()); ++r) {
      const uint32_t raise = code_for(r);
      if (raise == 0) continue;
      uint32_t code = 0;
      if (!CopyNow(&code, s.device_arenas[r]->data() + ep.abort, sizeof(code),
                   cudaMemcpyDeviceToHost)) {
        stopped = false;
      } else if (code == 0) {
        code = raise;
        stopped &= CopyNow(s.device_arenas[r]->data() + ep.abort, &code, sizeof(code),
                           cudaMemcpyHostToDevice);
      }
    }
    if (!stopped) return Record(s, exited);
  }
#endif
  s.daemon_exited = true;
  return Record(s, s.stopped = std::move(exited));
}

absl::Status UseJoin(RankState& s, const v1::JoinResponse& response);

// ubepd exited while this rank waited in its Join. The rank's join ticket stays in its arena
// (which the peers' daemons map, and which outlives ubepd): the group's lead would take it as
// a live rank's and form a generation the peers would wait in for this rank until their
// timeout. The ticket is withdrawn, then the rank's generation read (both sequentially
// consistent), as ubepd withdraws a leaving rank's (BreakGroup): paired with the lead's
// publishing a generation and reading the tickets again (TryFormGroup), either the lead sees
// the ticket gone and stops what it formed, or this rank sees a generation formed with it
// and stops it (StopForDaemonExit, as of that generation).
absl::Status LeaveJoinOfExitedDaemon(RankState& s) {
  kernels::RankControl* own = s.control();
  const uint64_t ticket =
      std::atomic_ref<uint64_t>(own->join_ticket).exchange(0, std::memory_order_seq_cst);
  const uint64_t generation =
      std::atomic_ref<uint64_t>(own->generation).load(std::memory_order_seq_cst);
  if (ticket != 0 && generation == (ticket & ~kernels::kTicketClaimed)) s.generation = generation;
  return StopForDaemonExit(s);
}

absl::Status JoinGroup(RankState& s, std::optional<uint64_t> next_step) {
  v1::JoinRequest request;
  request.set_rank(static_cast<uint32_t>(s.rank));
  request.set_token(s.token);
  if (next_step.has_value()) request.set_next_step(*next_step);
  v1::JoinResponse response;
  grpc::ClientContext context;
  SetDeadline(context, s.options.join_timeout);
  // The Join's own errors are ubepd's answers, which ubepd counts (a rank the plan excludes
  // gets DeadlineExceeded at every join timeout, and is to call Rejoin again): not counted
  // here as the client's. What follows, taking the arenas and the data plane, is.
  const grpc::Status joined = s.stub->Join(&context, request, &response);
  if (!joined.ok() && !s.arenas.empty() && DaemonExited(s)) {
    absl::Status exited = LeaveJoinOfExitedDaemon(s);
    // A Join ubepd answered before it exited (its drain ends the joins that wait, then it
    // closes the fd connections) says why in ubepd's words: which of the two the rank sees
    // first is a race, the answer is not.
    if (!AnsweredByServer(context)) return exited;
  }
  UBEP_RETURN_IF_ERROR(FromGrpc(joined, context, absl::StrCat("rank ", s.rank, ": join"),
                                s.options.join_timeout, "join_timeout", /*waits_for_group=*/true));
  return Record(s, UseJoin(s, response));
}

// The group a Join answered: the arenas it names (refreshed where a peer daemon restarted)
// and the data plane over them.
absl::Status UseJoin(RankState& s, const v1::JoinResponse& response) {
  if (response.arena_epoch() != 0 && response.arena_epoch() != s.arena_epoch) {
    UBEP_RETURN_IF_ERROR(RefreshArenas(s, response.arena_epoch()));
  }
  s.ep.reset();
  if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
    s.cuda_ep.reset();
    std::vector<std::byte*> eps;
    for (const auto& a : s.device_arenas) eps.push_back(a->data());
    // The data plane's stream and scratch are made on the rank's device, whichever is the
    // calling thread's (a Rejoin from another thread than the Attach's), which is put back.
    const kernels::ScopedDevice on_device(s.device);
    if (!on_device.status().ok()) {
      return absl::InternalError(absl::StrCat("rank ", s.rank, ": ", on_device.status().message()));
    }
    absl::StatusOr<std::unique_ptr<kernels::CudaEp>> made =
        kernels::CudaEp::Create(s.config, s.rank, std::move(eps));
    if (!made.ok()) return made.status();
    s.cuda_ep = *std::move(made);
    s.device_plan_version = 0;
#endif
  } else {
    std::vector<std::byte*> eps;
    for (const kernels::SharedArena& a : s.arenas) eps.push_back(a.data() + s.layout.ep);
    UBEP_ASSIGN_OR_RETURN(s.ep, kernels::HostEp::Create(s.config, s.rank, std::move(eps)));
  }
  s.generation = response.generation();
  s.resume_step = response.resume_step();
  s.step = s.resume_step;  // Plan lookups before the first BeginStep use the resume step.
  s.stopped = absl::OkStatus();
  s.step_begun = false;
  return absl::OkStatus();
}

// Maps the first `count` fds as host arenas and checks each is the arena of its rank; where
// `skip[i]`, leaves arena i empty (the caller keeps a mapping of it).
absl::StatusOr<std::vector<kernels::SharedArena>> MapArenas(const RankState& s,
                                                            const std::vector<UniqueFd>& fds,
                                                            size_t count,
                                                            const std::vector<bool>& skip = {}) {
  if (fds.size() < count || count != static_cast<size_t>(s.world_size)) {
    return absl::DataLossError(absl::StrCat("rank ", s.rank, ": expected ", s.world_size,
                                            " arena fds, got ", fds.size()));
  }
  std::vector<kernels::SharedArena> arenas(count);
  for (size_t i = 0; i < count; ++i) {
    if (i < skip.size() && skip[i]) continue;
    // No fd kept per arena (the mapping is enough): a rank of a large group would otherwise
    // hold one per rank, and run into the fd limit.
    UBEP_ASSIGN_OR_RETURN(kernels::SharedArena arena,
                          kernels::SharedArena::Map(fds[i].get(),
                                                    kernels::SharedArena::KeepFd::kNo));
    if (arena.size() < s.layout.total_bytes) {
      return absl::DataLossError(absl::StrCat("rank ", s.rank, ": an arena has ", arena.size(),
                                              " bytes; the layout needs ", s.layout.total_bytes));
    }
    const kernels::RankControl* c = kernels::ControlOf(arena.data(), s.layout);
    if (c->magic != kernels::kRankControlMagic || c->version != kernels::kRankArenaVersion ||
        c->rank != static_cast<uint32_t>(i)) {
      return absl::DataLossError(absl::StrCat("rank ", s.rank, ": arena ", i,
                                              " is not a version ", kernels::kRankArenaVersion,
                                              " arena of rank ", i));
    }
    arenas[i] = std::move(arena);
  }
  return arenas;
}

// The daemon's fd socket lies next to its gRPC socket (AttachResponse.fd_socket): its name,
// in the directory this process reached the gRPC socket through. The daemon's own path may
// be relative to its working directory, or the directory mounted elsewhere in this process's
// container.
std::string FdSocketPath(const std::string& socket_path, const std::string& fd_socket) {
  const size_t name = fd_socket.rfind('/');
  const std::string base = name == std::string::npos ? fd_socket : fd_socket.substr(name + 1);
  const size_t dir = socket_path.rfind('/');
  return dir == std::string::npos ? base : socket_path.substr(0, dir + 1) + base;
}

absl::Status TakeArenas(RankState& s, const v1::AttachResponse& response) {
  const std::string fd_socket = FdSocketPath(s.options.socket_path, response.fd_socket());
  // The rank and the socket said. Silent for rpc_timeout is ubepd not there to answer:
  // Unavailable (as a refresh's, RefreshArenas), not DeadlineExceeded, which says that a peer
  // of the group did not come.
  auto said = [&](const absl::Status& status) {
    const std::string where = absl::StrCat("rank ", s.rank, ": ubepd's fd socket ", fd_socket, ": ");
    if (absl::IsDeadlineExceeded(status)) {
      return absl::UnavailableError(absl::StrCat(where, "no answer within ",
                                                 absl::FormatDuration(s.options.rpc_timeout),
                                                 " (rpc_timeout)"));
    }
    return absl::Status(status.code(), absl::StrCat(where, status.message()));
  };
  // The connection becomes the rank's (the one whose closing says ubepd exited) only once ubepd
  // gave the arenas: ubepd closes it after a refusal, and a refused rank is detached (~Rank)
  // by RPC, not stopped as if its daemon had gone. After an "OK" it is held as ubepd holds it
  // (its closing would tell ubepd that the rank's process died).
  absl::StatusOr<UniqueFd> connected = ConnectUnix(fd_socket, s.options.rpc_timeout);
  if (!connected.ok()) return said(connected.status());
  // Listed at once: ubepd holds the rank on it from the claim on, and a child forked meanwhile
  // must not keep it open either.
  internal::FdConnection connection;
  connection.Adopt(*std::move(connected));
  absl::StatusOr<ReceivedMessage> exchanged =
      Exchange(connection.get(), response.token(), 4096, s.options.rpc_timeout);
  if (!exchanged.ok()) return said(exchanged.status());
  if (const std::string& answer = exchanged->bytes; answer != "OK") {
    // Every refusal of a claim is for a while (the token expired or was used, the group's
    // arenas changed): Unavailable, which callers retry, as the message says to.
    return absl::UnavailableError(absl::StrCat(
        "rank ", s.rank, ": ubepd refused the arenas: ",
        answer.size() > 4 ? answer.substr(4) : std::string("connection closed")));
  }
  ReceivedMessage reply = *std::move(exchanged);
  s.fd_connection = std::move(connection);
  const size_t host_fds = static_cast<size_t>(response.arena_ranks_size());
  const size_t expected = host_fds * (s.on_device ? 2 : 1);
  if (reply.fds.size() != expected) {
    return absl::DataLossError(absl::StrCat("rank ", s.rank, ": expected ", expected,
                                            " arena fds, got ", reply.fds.size()));
  }
  if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
    for (size_t i = host_fds; i < expected; ++i) {
      UBEP_ASSIGN_OR_RETURN(std::unique_ptr<kernels::VmmArena> arena,
                            kernels::VmmArena::ImportFd(s.device, reply.fds[i].get(),
                                                        s.layout.device_bytes));
      s.device_arenas.push_back(std::move(arena));
    }
    const kernels::ScopedDevice on_device(s.device);
    if (cudaMalloc(&s.device_plan, s.layout.plan_capacity) != cudaSuccess) {
      return absl::ResourceExhaustedError(
          absl::StrCat("rank ", s.rank, ": no device memory for the plan table"));
    }
#endif
  }
  UBEP_ASSIGN_OR_RETURN(s.arenas, MapArenas(s, reply.fds, host_fds));
  s.arena_epoch = response.arena_epoch();
  return absl::OkStatus();
}

// A peer daemon restarted and this rank's daemon mapped its new arenas (arena epoch `epoch`
// or later): map them too, keeping the others where they are (on the CUDA backend the device
// arenas' fds follow the host arenas').
absl::Status RefreshArenas(RankState& s, uint64_t epoch) {
  // The fd socket failing (closed, or silent for rpc_timeout) is ubepd not there to answer:
  // Unavailable, saying what was asked of it (not a DeadlineExceeded, which says a peer of
  // the group did not come).
  // A reply whose fds do not fit this process's descriptor table is this process's limit,
  // not ubepd's absence: ResourceExhausted, as an Attach's (retried, each Join would break the
  // group again and fail alike).
  auto unanswered = [&](const absl::Status& status) {
    return absl::Status(
        absl::IsResourceExhausted(status) ? absl::StatusCode::kResourceExhausted
                                          : absl::StatusCode::kUnavailable,
        absl::StrCat("rank ", s.rank, ": asking ubepd for the new arenas over its fd socket: ",
                     absl::IsDeadlineExceeded(status)
                         ? absl::StrCat("no answer within ",
                                        absl::FormatDuration(s.options.rpc_timeout),
                                        " (rpc_timeout)")
                         : std::string(status.message())));
  };
  if (absl::Status sent = SendMessage(s.fd_connection.get(), kArenaRefreshRequest, {},
                                      s.options.rpc_timeout);
      !sent.ok()) {
    return unanswered(sent);
  }
  ++s.refresh_replies_owed;
  const absl::Time deadline = MonotonicNow() + s.options.rpc_timeout;
  ReceivedMessage reply;
  uint64_t got = 0;
  bool earlier = false;
  do {
    // The replies of earlier refreshes that gave up come first, whatever they say (a refusal
    // that was true then, or arenas older than the group's `epoch`, from the Join): they are
    // passed over. So is an OK of an older epoch however it came.
    absl::StatusOr<ReceivedMessage> received = ReceiveMessage(
        s.fd_connection.get(), 4096, std::max(deadline - MonotonicNow(), absl::ZeroDuration()));
    if (!received.ok()) {
      // Past a timeout the reply is still owed; any other failure took a reply off the socket
      // (all its parts, its fds over the descriptor limit, say): owed no more.
      if (!absl::IsDeadlineExceeded(received.status())) {
        s.refresh_replies_owed = std::max(s.refresh_replies_owed - 1, 0);
      }
      return unanswered(received.status());
    }
    reply = *std::move(received);
    if (reply.closed) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", s.rank, ": ubepd did not give the new arenas: connection closed"));
    }
    earlier = s.refresh_replies_owed > 1;
    s.refresh_replies_owed = std::max(s.refresh_replies_owed - 1, 0);
    got = 0;
    if (!absl::StartsWith(reply.bytes, "OK ") || !absl::SimpleAtoi(reply.bytes.substr(3), &got)) {
      if (earlier) continue;
      return absl::UnavailableError(absl::StrCat(
          "rank ", s.rank, ": ubepd did not give the new arenas: ",
          absl::StartsWith(reply.bytes, "ERR ") ? reply.bytes.substr(4) : reply.bytes));
    }
  } while (earlier || got < epoch);
  const size_t world = static_cast<size_t>(s.world_size);
  if (reply.fds.size() != world * (s.on_device ? 2 : 1)) {
    return absl::DataLossError(absl::StrCat("rank ", s.rank, ": expected ", world * (s.on_device ? 2 : 1),
                                            " arena fds in the refresh, got ", reply.fds.size()));
  }
  // A peer daemon restarted: its ranks' arenas are new memory. The others, this rank's own
  // above all, are the memory already mapped (the same memfd): their mappings stay, so that
  // addresses the caller holds (ExpertWeights) stay valid across the Rejoin.
  std::vector<bool> keep(world, false);
  for (size_t i = 0; i < world; ++i) keep[i] = s.arenas[i].SameFile(reply.fds[i].get());
  if (!keep[s.rank]) {
    // Only another daemon's arenas change under a refresh: this rank's own is its daemon's,
    // and the weight addresses the caller holds must stay valid until Detach.
    return absl::DataLossError(absl::StrCat(
        "rank ", s.rank, ": ubepd's arena refresh gave this rank an arena other than its own; "
        "detach and attach again"));
  }
  UBEP_ASSIGN_OR_RETURN(std::vector<kernels::SharedArena> arenas,
                        MapArenas(s, reply.fds, world, keep));
  if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
    // This rank's own device arena is its daemon's, which did not restart (else this rank
    // would attach again): kept. Device fds are exported anew for every reply, so they do not
    // tell which memory is whose; every other one is imported again.
    std::vector<std::unique_ptr<kernels::VmmArena>> device_arenas(world);
    for (size_t i = 0; i < world; ++i) {
      if (i == static_cast<size_t>(s.rank)) continue;
      UBEP_ASSIGN_OR_RETURN(device_arenas[i],
                            kernels::VmmArena::ImportFd(s.device, reply.fds[world + i].get(),
                                                        s.layout.device_bytes));
    }
    s.cuda_ep.reset();  // It points into the old mappings.
    device_arenas[s.rank] = std::move(s.device_arenas[s.rank]);
    s.device_arenas = std::move(device_arenas);
    s.device_plan_version = 0;
#else
    return absl::FailedPreconditionError(absl::StrCat("rank ", s.rank, ": libubep was built without CUDA"));
#endif
  }
  s.ep.reset();  // It points into the old mappings.
  for (size_t i = 0; i < world; ++i) {
    if (keep[i]) arenas[i] = std::move(s.arenas[i]);
  }
  s.arenas = std::move(arenas);
  s.arena_epoch = got;
  return absl::OkStatus();
}

// Out of memory inside a data-plane call that had begun (`what` says so): the rank's peers
// will not all get its rows or partials, and every later call of the rank says so until
// Rejoin re-forms the group. The caller rethrows (the C ABI turns it into code 8).
void StopForOutOfMemory(RankState& s, absl::string_view what) {
  s.stopped = absl::InternalError(
      absl::StrCat("rank ", s.rank, ": ", what, "; the group must be re-formed: call Rejoin"));
}

// A host-backend combine, `combine()`, out of memory included (its buffers here, or HostEp's
// own once it took part, which records it and gives up on this rank so that the peers stop
// waiting).
template <typename Combine>
absl::Status HostCombine(RankState& s, Combine combine) {
  try {
    return combine();
  } catch (...) {
    s.ep->GiveUpOnCombine();
    StopForOutOfMemory(s, "a combine ran out of memory");
    throw;
  }
}

absl::StatusOr<v1::AttachResponse> AttachRpc(RankState& s, int device) {
  v1::AttachRequest request;
  request.set_rank(static_cast<uint32_t>(s.rank));
  request.set_world_size(static_cast<uint32_t>(s.world_size));
  request.set_device(static_cast<uint32_t>(device));
  request.set_pid(static_cast<uint32_t>(getpid()));
  v1::ModelShape* shape = request.mutable_shape();
  const ModelShape& m = s.shape;
  shape->set_num_layers(static_cast<uint32_t>(m.num_layers));
  shape->set_num_experts(static_cast<uint32_t>(m.num_experts));
  shape->set_hidden(static_cast<uint32_t>(m.hidden));
  shape->set_top_k(static_cast<uint32_t>(m.top_k));
  shape->set_max_tokens(static_cast<uint32_t>(m.max_tokens));
  shape->set_slots_per_rank(static_cast<uint32_t>(m.slots_per_rank));
  shape->set_bytes_per_expert(m.bytes_per_expert);
  shape->set_dtype(m.dtype == DType::kBFloat16 ? v1::DTYPE_BFLOAT16 : v1::DTYPE_FLOAT32);
  v1::AttachResponse response;
  grpc::ClientContext context;
  SetDeadline(context, s.options.rpc_timeout);
  UBEP_RETURN_IF_ERROR(FromGrpc(s.stub->Attach(&context, request, &response), context,
                                absl::StrCat("rank ", s.rank, ": attach"), s.options.rpc_timeout,
                                "rpc_timeout"));
  return response;
}

}  // namespace

Dispatched::Dispatched() : state_(std::make_unique<internal::DispatchedState>()) {}
Dispatched::~Dispatched() = default;
// A moved-from Dispatched holds an empty output, reusable as any other.
Dispatched::Dispatched(Dispatched&& other) noexcept : Dispatched() {
  std::swap(state_, other.state_);
}
Dispatched& Dispatched::operator=(Dispatched&& other) noexcept {
  if (this == &other) return *this;
  std::swap(state_, other.state_);
  other.state_->filled = false;  // This one's old buffers, emptied: no output is in two places.
  return *this;
}
#ifdef UBEP_CLIENT_CUDA
#define UBEP_ON_DEVICE(host, device) (state_->on_device ? (device) : (host))
#else
#define UBEP_ON_DEVICE(host, device) (host)
#endif
int Dispatched::num_rows() const {
  if (!state_->filled) return 0;
  return UBEP_ON_DEVICE(state_->output.num_rows(), state_->cuda.num_rows);
}
const std::byte* Dispatched::rows() const {
  if (!state_->filled) return nullptr;
  return UBEP_ON_DEVICE(state_->output.recv_x.data(),
                        static_cast<const std::byte*>(state_->cuda.recv_x));
}
std::span<const int32_t> Dispatched::slot_offsets() const {
  if (!state_->filled) return {};
  return UBEP_ON_DEVICE(std::span<const int32_t>(state_->output.slot_offsets),
                        std::span<const int32_t>(state_->cuda.slot_offsets));
}
std::span<const int32_t> Dispatched::src_rank() const {
  if (!state_->filled) return {};
  return UBEP_ON_DEVICE(std::span<const int32_t>(state_->output.src_rank),
                        std::span<const int32_t>(state_->cuda.src_rank, state_->cuda.num_rows));
}
std::span<const int32_t> Dispatched::src_token() const {
  if (!state_->filled) return {};
  return UBEP_ON_DEVICE(std::span<const int32_t>(state_->output.src_token),
                        std::span<const int32_t>(state_->cuda.src_token, state_->cuda.num_rows));
}
std::span<const float> Dispatched::weights() const {
  if (!state_->filled) return {};
  return UBEP_ON_DEVICE(std::span<const float>(state_->output.weight),
                        std::span<const float>(state_->cuda.weight, state_->cuda.num_rows));
}
#undef UBEP_ON_DEVICE
uint64_t Dispatched::plan_version() const { return state_->filled ? state_->plan_version : 0; }
int Dispatched::layer() const { return state_->filled ? state_->layer : -1; }

Rank::Rank(std::unique_ptr<internal::RankState> state) : state_(std::move(state)) {}

Rank::~Rank() {
  if (state_ != nullptr && state_->InForkedChild()) {
    // A child's copy of its parent's rank (forked after Attach): the parent's, not this
    // process's to detach, and nothing of it (channels, mappings, the fd connection, closed at
    // the fork) is let go here.
    (void)state_.release();
    return;
  }
  if (state_ != nullptr && state_->attached) {
    // A destructor throws nothing: out of memory here (the RPC, the message), the rank's fd
    // connection still closes with its state below, which tells ubepd the rank is gone.
    try {
      absl::Status s = Detach();
      if (!s.ok()) UBEP_LOG(WARNING) << s;
    } catch (...) {
    }
  }
}

absl::StatusOr<std::unique_ptr<Rank>> Rank::Attach(const ClientOptions& options, int rank,
                                                   int world_size, int device,
                                                   const ModelShape& shape,
                                                   std::optional<uint64_t> next_step) {
  if (rank < 0 || world_size <= 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside [0, world_size ", world_size, ")"));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, absl::Duration>{"rpc_timeout", options.rpc_timeout},
        {"join_timeout", options.join_timeout},
        {"daemon_check_interval", options.daemon_check_interval},
        {"decision_timeout", options.decision_timeout}}) {
    // Every wait has an end: a timeout that never ends (a million hours, infinite) would
    // leave a call to a hung ubepd, or a decision a dead balancer never makes, waiting for good.
    if (value <= absl::ZeroDuration() || NeverEnds(value)) {
      return absl::InvalidArgumentError(absl::StrCat("ClientOptions::", name,
                                                     " must be positive and under ", kTimeoutBound,
                                                     ", not ", absl::FormatDuration(value)));
    }
  }
  // Sent as unsigned fields, which ubepd checks: a negative one would read as a huge one.
  for (const auto& [name, value] : {std::pair<const char*, int>{"num_layers", shape.num_layers},
                                    {"num_experts", shape.num_experts},
                                    {"hidden", shape.hidden},
                                    {"top_k", shape.top_k},
                                    {"max_tokens", shape.max_tokens},
                                    {"slots_per_rank", shape.slots_per_rank}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ModelShape::", name, " is ", value, "; it must not be negative"));
    }
  }
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device ", device, " is negative"));
  }
  // The host kernels' code runs from here on (arenas, signals, the host backend).
  UBEP_RETURN_IF_ERROR(kernels::HostCpuSupported());
  auto s = std::make_unique<RankState>();
  s->options = options;
  s->rank = rank;
  s->world_size = world_size;
  s->shape = shape;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  s->channel = grpc::CreateCustomChannel("unix:" + options.socket_path,
                                         grpc::InsecureChannelCredentials(), args);
  s->stub = v1::Daemon::NewStub(s->channel);
  UBEP_ASSIGN_OR_RETURN(v1::AttachResponse response, AttachRpc(*s, device));
  s->token = response.token();
  s->on_device = response.backend() == "cuda";
  s->device = static_cast<int>(response.device());
  // Attached: from here on every error detaches (~Rank), so that the daemon frees the rank at
  // once rather than after its ticket times out, and a corrected process can attach it.
  s->attached = true;
  std::unique_ptr<Rank> handle(new Rank(std::move(s)));
  RankState& st = *handle->state_;
#ifndef UBEP_CLIENT_CUDA
  if (st.on_device) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, ": ubepd serves the cuda backend, and this libubep was built without "
        "CUDA"));
  }
#endif
  const v1::ArenaLayout& l = response.layout();
  st.layout.total_bytes = l.total_bytes();
  st.layout.control = l.control_offset();
  st.layout.ep = l.ep_offset();
  st.layout.ep_bytes = l.ep_bytes();
  st.layout.plan = l.plan_offset();
  st.layout.plan_capacity = l.plan_capacity();
  st.layout.slot_map = l.slot_map_offset();
  st.layout.weights = l.weights_offset();
  st.layout.weight_stride = l.weight_stride();
  st.layout.buffers_per_layer = l.buffers_per_layer();
  st.layout.on_device = st.on_device;
  st.layout.device_bytes = l.device_bytes();
  st.layout.device_weights = l.device_weights_offset();
  kernels::EpConfig& c = st.config;
  c.num_ranks = world_size;
  c.max_tokens = shape.max_tokens;
  c.hidden = shape.hidden;
  c.top_k = shape.top_k;
  c.num_experts = shape.num_experts;
  c.slots_per_rank = shape.slots_per_rank;
  c.num_layers = shape.num_layers;
  c.dtype = shape.dtype == DType::kBFloat16 ? kernels::DType::kBFloat16 : kernels::DType::kFloat32;
  c.protocol = response.protocol() == "bsp" ? kernels::Protocol::kBsp : kernels::Protocol::kUbep;
  c.timeout = absl::Milliseconds(response.wait_timeout_ms());
  c.flagged_tokens = static_cast<int>(response.flagged_tokens());
  c.near_ranks = static_cast<int>(response.near_ranks());
  c.max_recv_rows = static_cast<int>(response.max_recv_rows());
  st.hosted_first = static_cast<int>(response.hosted_first());
  st.hosted_count = static_cast<int>(response.hosted_count());
  if (response.wait_timeout_ms() <= 0) {
    // Every wait of the data plane would give up at once.
    return absl::DataLossError(absl::StrCat("rank ", rank, ": ubepd's wait timeout, ",
                                            response.wait_timeout_ms(),
                                            " ms, is not positive"));
  }
  if (kernels::ArenaLayout(c).total_bytes != st.layout.ep_bytes) {
    return absl::DataLossError(absl::StrCat(
        "rank ", rank, ": ubepd's data-plane layout (", st.layout.ep_bytes,
        " bytes) differs from this library's (", kernels::ArenaLayout(c).total_bytes,
        "); ubepd and libubep versions differ"));
  }
  // Every offset and size the calls go by, as this library lays the arena out for the shape
  // and the daemon's free buffers: an answer that disagrees is refused before any is used.
  if (st.layout.buffers_per_layer < static_cast<uint32_t>(shape.slots_per_rank) ||
      kernels::RankArenaLayout::Compute(
          c, shape.bytes_per_expert,
          static_cast<int>(st.layout.buffers_per_layer) - shape.slots_per_rank,
          st.on_device) != st.layout) {
    return absl::DataLossError(absl::StrCat(
        "rank ", rank, ": ubepd's arena layout (", st.layout.total_bytes, " bytes, ",
        st.layout.buffers_per_layer, " weight buffers per layer) differs from this library's "
        "for the shape; ubepd and libubep versions differ"));
  }
  UBEP_RETURN_IF_ERROR(TakeArenas(st, response));
  UBEP_RETURN_IF_ERROR(JoinGroup(st, next_step));
  return handle;
}

uint64_t Rank::resume_step() const { return state_->resume_step; }
int Rank::rank() const { return state_->rank; }
int Rank::world_size() const { return state_->world_size; }
const ModelShape& Rank::shape() const { return state_->shape; }

bool Rank::must_attach_again() const {
  const RankState& s = *state_;
  if (!s.attached) return true;  // Detached: only an Attach serves again.
  if (s.InForkedChild()) return true;  // The parent's rank: the child attaches its own.
  // Asked after an error: look at the connection now (BeginStep looks only every
  // daemon_check_interval, and another reason may have stopped the group first). Found
  // closed here, it stops the group as BeginStep would (the rank's state is not the handle's).
  if (s.daemon_exited) return true;
  if (DaemonExited(s)) {
    (void)StopForDaemonExit(*state_);
    return true;
  }
  const uint32_t code = AbortCode(s);
  return code == kernels::kAbortDraining ||
         std::atomic_ref<uint32_t>(s.control()->group_state).load(std::memory_order_acquire) ==
             kernels::kGroupDraining;
}

bool Rank::excluded() const {
  const RankState& s = *state_;
  return s.attached && ExcludedByPlanAt(s, ~uint64_t{0});
}

absl::Status Rank::BeginStep(uint64_t step) {
  RankState& s = *state_;
  if (!s.attached) return Detached(s);
  if (s.InForkedChild()) return ForkedChild(s, "use");
  if (!s.stopped.ok()) return s.stopped;
  // Until this step has begun, no step has: a BeginStep that fails leaves no step open whose
  // plan a Dispatch could still use while the peers run the next.
  s.step_begun = false;
  // Every daemon_check_interval (not every step): whether ubepd is still there, by a
  // non-blocking poll of the fd connection. No RPC on this path: ubepd reads the step from
  // the control block.
  const absl::Time now = MonotonicNow();
  const bool check_daemon = now >= s.next_daemon_check;
  if (check_daemon) s.next_daemon_check = now + s.options.daemon_check_interval;
  if (check_daemon && DaemonExited(s)) return StopForDaemonExit(s);
  if (!GroupReady(s)) return Record(s, s.stopped = GroupStopped(s));
  if (step > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    // Taken, every later step would be "before" it until a Rejoin: a negative step passed as
    // unsigned (-1 from an FFI caller is 2^64 - 1) is refused, as the balancer refuses counts
    // that are negative as int64.
    return Record(s, TellPeers(s, absl::InvalidArgumentError(absl::StrCat(
                                      "rank ", s.rank, ": step ", step, " is above 2^63 - 1 (a "
                                      "negative step passed as unsigned?)"))));
  }
  if (step < s.step) {
    // The plan in force at an earlier step may route to slots that now hold other experts
    // (or no longer be kept at all): refused, so that no call runs under a plan its peers left.
    return Record(s, TellPeers(s, absl::InvalidArgumentError(absl::StrCat(
                                      "rank ", s.rank, ": step ", step, " is before step ",
                                      s.step, ", where this rank is (steps only go forward; "
                                      "after Rejoin, from the step it returns)"))));
  }
  // Sequentially consistent, and before the look for an undecided plan below: ubepd prepares a
  // plan and then reads every rank's step, so either it sees this step (and withdraws a plan
  // whose effective step this rank began under the plan before) or this rank sees the plan.
  std::atomic_ref<uint64_t>(s.control()->step).store(step, std::memory_order_seq_cst);
  // Every rank switches plans at the same step: wait for the decision on one prepared for it.
  void* area = s.own() + s.layout.plan;
  uint64_t undecided = 0;
  if (kernels::UndecidedAt(area, step, &undecided)) {
    const absl::Time start = MonotonicNow();
    Bump(s.control()->decision_waits);
    while (kernels::UndecidedAt(area, step) &&
           MonotonicNow() - start < s.options.decision_timeout) {
      if (!GroupReady(s)) break;
      // ubepd itself may be gone (then no decision comes to this arena): looked at as often
      // as BeginStep looks.
      if (const absl::Time now = MonotonicNow(); now >= s.next_daemon_check) {
        s.next_daemon_check = now + s.options.daemon_check_interval;
        if (DaemonExited(s)) {
          Bump(s.control()->decision_wait_ns,
               static_cast<uint64_t>(absl::ToInt64Nanoseconds(MonotonicNow() - start)));
          return StopForDaemonExit(s);
        }
      }
      absl::SleepFor(absl::Microseconds(200));
    }
    Bump(s.control()->decision_wait_ns,
         static_cast<uint64_t>(absl::ToInt64Nanoseconds(MonotonicNow() - start)));
    // The daemon stopped the group while the plan was pending (a membership plan stops it at
    // its prepare): that, not the balancer, is why the wait ended.
    if (!GroupReady(s)) return Record(s, s.stopped = GroupStopped(s));
    if (kernels::UndecidedAt(area, step)) {
      return Record(s, absl::UnavailableError(absl::StrCat(
                           "rank ", s.rank, ": plan v", undecided, " is prepared for step ", step,
                           " and still undecided after ",
                           absl::FormatDuration(s.options.decision_timeout),
                           "; is ubep-balancer alive? (restarted, it commits or aborts v",
                           undecided, " from the daemons' state)")));
    }
  }
  uint64_t version = 0;
  absl::StatusOr<const kernels::PlanTableHeader*> table = PlanAt(s, step, &version);
  if (!table.ok()) return Record(s, TellPeers(s, table.status()));
  if (*table != nullptr) {
    if (kernels::RankExcluded(*table, static_cast<uint32_t>(s.rank))) {
      return Record(s, absl::UnavailableError(absl::StrCat(
                           "rank ", s.rank, " is excluded from the EP group by plan v", version,
                           " (its node failed or was drained); Rejoin waits for a plan that "
                           "includes it")));
    }
  }
  s.step = step;
  s.step_begun = true;
  Bump(s.control()->steps);
  return absl::OkStatus();
}

absl::Status Rank::Dispatch(int layer, const void* x, const int32_t* topk_idx,
                            const float* topk_weights, int num_tokens, Dispatched& out) {
  RankState& s = *state_;
  out.state_->filled = false;
  if (s.attached && s.InForkedChild()) return ForkedChild(s, "use");
  const RankDevice on_device(s);
  if (!s.attached) return Detached(s);
  if (!s.stopped.ok()) return s.stopped;
  if (!s.step_begun) {
    // (Not counted: the BeginStep that failed, if any, was.)
    return TellPeers(s, absl::FailedPreconditionError(
                            absl::StrCat("rank ", s.rank, ": call BeginStep before Dispatch")));
  }
  const absl::Time start = MonotonicNow();  // Latencies on the monotonic clock.
  absl::Status status;
  [[maybe_unused]] uint32_t dispatch_epoch_before = 0;
  if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
    uint64_t version = 0;
    absl::StatusOr<const kernels::PlanTableHeader*> checked = PlanAt(s, s.step, &version);
    if (!checked.ok()) return Record(s, s.cuda_ep->Refuse(checked.status(), /*keep_earlier=*/true));
    const kernels::PlanTableHeader* table = *checked;
    if (table == nullptr) {
      // A group that gave up says so first, and keeps the refusal recorded before (as the
      // host backend looks at its abort word before any other check).
      if (absl::Status gave_up = s.cuda_ep->GaveUpStatus(); !gave_up.ok()) {
        // Stops the rank as a failed Dispatch does (BeginStep then asks for Rejoin).
        if (absl::IsUnavailable(gave_up) || absl::IsDeadlineExceeded(gave_up)) s.stopped = gave_up;
        return Record(s, gave_up);
      }
      // Refused before the rank takes part, as the host backend does it: its peers, waiting
      // for it in this call, say why when they time out.
      return Record(s, s.cuda_ep->Refuse(absl::FailedPreconditionError(absl::StrCat(
                           "rank ", s.rank, ": no committed plan is in force at step ", s.step))));
    }
    if (version != s.device_plan_version) {
      const size_t bytes = kernels::PlanTableBytes(table);
      if (!CopyNow(s.device_plan, table, bytes, cudaMemcpyHostToDevice)) {
        // Refused before the rank takes part: its peers, waiting for it, say why.
        return Record(s, s.cuda_ep->Refuse(
                             absl::InternalError(absl::StrCat("rank ", s.rank, ": uploading plan v",
                                                              version, "'s table to the device failed")),
                             /*keep_earlier=*/true));
      }
      s.device_plan_version = version;
    }
    kernels::CudaDispatchInput in;
    in.x = x;
    in.topk_idx = topk_idx;
    in.topk_weights = topk_weights;
    in.num_tokens = num_tokens;
    in.layer = layer;
    in.plan = static_cast<const kernels::PlanTableHeader*>(s.device_plan);
    in.host_plan = table;
    dispatch_epoch_before = s.cuda_ep->dispatch_epoch();
    try {
      status = s.cuda_ep->Dispatch(in, out.state_->cuda);
    } catch (...) {
      // Its output's vectors, after its rows went out (its next Dispatch would be taken for a
      // second one, its peers waiting for this call's combine).
      StopForOutOfMemory(s, "a dispatch ran out of memory after it began");
      throw;
    }
    out.state_->on_device = true;
    out.state_->plan_version = version;
#endif
  } else {
    kernels::DispatchInput in;
    in.x = x;
    in.topk_idx = topk_idx;
    in.topk_weights = topk_weights;
    in.num_tokens = num_tokens;
    in.hidden = s.shape.hidden;
    in.layer = layer;
    in.plan_area = s.own() + s.layout.plan;
    in.plan_capacity = s.layout.plan_capacity;
    in.step = s.step;
    try {
      status = s.ep->Dispatch(in, out.state_->output);
    } catch (...) {
      // The layout's buffers, say: the data plane stopped the call's senders and gave up on
      // this rank.
      StopForOutOfMemory(s, "a dispatch ran out of memory after it began");
      throw;
    }
    out.state_->on_device = false;
    out.state_->plan_version = out.state_->output.plan_version;
  }
  // Aborted: the ranks' calls were out of step (host backend; every rank finds it).
  if (absl::IsResourceExhausted(status) || (!s.on_device && absl::IsAborted(status))) {
    // More rows routed here than the receive capacity, or the ranks' calls out of step: the
    // call is complete but for this rank's combine, which its peers wait for. It runs here and
    // fails as every rank's combine of the call does, so that an engine that abandons the
    // step on an error keeps its ranks' calls paired. Its expert outputs are the received rows
    // themselves (the sums are thrown away), so that the error path allocates nothing on the
    // device.
    absl::Status combined;
    if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
      const size_t sink_bytes = static_cast<size_t>(s.shape.max_tokens) * s.shape.hidden *
                                kernels::DTypeBytes(s.config.dtype);
      if (s.overflow_sink == nullptr && cudaMalloc(&s.overflow_sink, sink_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        s.overflow_sink = nullptr;
        combined = absl::InternalError(absl::StrCat(
            "rank ", s.rank, ": no device memory (", sink_bytes,
            " bytes) for the combine of a call over the receive capacity; the group must be "
            "re-formed (Rejoin)"));
      } else {
        combined = s.cuda_ep->Combine(out.state_->cuda.recv_x, s.overflow_sink);
      }
#endif
    } else {
      combined = HostCombine(s, [&] {
        std::vector<std::byte> sink(static_cast<size_t>(num_tokens) * s.shape.hidden *
                                    kernels::DTypeBytes(s.config.dtype));
        return s.ep->Combine(out.state_->output, out.state_->output.recv_x.data(), sink.data());
      });
    }
    // Any other outcome (a wait that ended, a device error) is the call's: this rank did not
    // combine, so the group is out of step until it re-forms.
    if (combined.code() != status.code()) {
      status = combined.ok() ? absl::InternalError(absl::StrCat(
                                   "rank ", s.rank, ": the combine of a failed call passed (",
                                   status.message(), ")"))
                             : combined;
      s.stopped = status;
    } else if (absl::IsResourceExhausted(status)) {
      Bump(s.control()->over_capacity_calls);
    }
  }
  // The output is this rank's last dispatch, which Combine takes.
  auto keep = [&] {
    out.state_->filled = true;
    out.state_->layer = layer;
    out.state_->rank = &s;
    out.state_->attach = s.attach;
    out.state_->serial = ++s.dispatches;
    s.last_plan_version = out.state_->plan_version;
  };
  if (!status.ok()) {
    if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) s.stopped = status;
#ifdef UBEP_CLIENT_CUDA
    // Bad input the device found after the peers began: the rest was dispatched, and the
    // caller combines it as after a good call (the peers wait for this rank's partials).
    // Not bad input refused before this call took part (a layer out of range, say), after
    // which the last call's completion still stands: that output holds nothing of this call.
    if (s.on_device && absl::IsInvalidArgument(status) &&
        s.cuda_ep->dispatch_epoch() != dispatch_epoch_before && s.cuda_ep->dispatch_completed()) {
      keep();
    }
#endif
    return Record(s, status);
  }
  keep();
  kernels::RankControl* c = s.control();
  Bump(c->dispatch_calls);
  Bump(c->dispatched_tokens, static_cast<uint64_t>(num_tokens));
  Observe(c->dispatch_latency, MonotonicNow() - start);
  return absl::OkStatus();
}

absl::Status Rank::Combine(const Dispatched& dispatched, const void* expert_out, void* out) {
  RankState& s = *state_;
  if (s.attached && s.InForkedChild()) return ForkedChild(s, "use");
  const RankDevice on_device(s);
  if (!s.attached) return Detached(s);
  if (!s.stopped.ok()) return s.stopped;
  const bool of_this_rank = dispatched.state_->rank == &s && dispatched.state_->attach == s.attach;
  if (!dispatched.state_->filled || !of_this_rank || dispatched.state_->serial != s.dispatches) {
    // Another dispatch's output (one kept from an earlier layer, or another rank's): the
    // backends combine the rank's last dispatch, whose rows this is not. Refused before any
    // byte moves; the peers, waiting for this rank's partials, are told why.
    // An output no Dispatch filled (a new one, or one whose Dispatch failed) is a combine
    // without a dispatch, out of order; one of another dispatch is the wrong argument.
    absl::Status refused =
        !dispatched.state_->filled
            ? absl::FailedPreconditionError(absl::StrCat(
                  "rank ", s.rank, ": combine without a dispatch (this output holds none: "
                  "no Dispatch filled it, or its Dispatch failed)"))
            : absl::InvalidArgumentError(absl::StrCat(
                  "rank ", s.rank, ": combine takes the output of this rank's last dispatch (",
                  s.dispatches, " so far); this one is ",
                  !of_this_rank ? "not of this rank"
                                : absl::StrCat("of dispatch ", dispatched.state_->serial)));
#ifdef UBEP_CLIENT_CUDA
    // (A Dispatch refused before it keeps its reason: that is why this rank has no output.)
    if (s.on_device && s.cuda_ep != nullptr) refused = s.cuda_ep->Refuse(refused, true);
#endif
    if (!s.on_device && s.ep != nullptr) refused = s.ep->Refuse(refused, true);
    return Record(s, refused);
  }
  const absl::Time start = MonotonicNow();  // Latencies on the monotonic clock.
  absl::Status status;
  if (s.on_device) {
#ifdef UBEP_CLIENT_CUDA
    status = s.cuda_ep->Combine(expert_out, out);
#endif
  } else {
    status = HostCombine(s, [&] { return s.ep->Combine(dispatched.state_->output, expert_out, out); });
  }
  if (!status.ok()) {
    if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) s.stopped = status;
    // A peer overflowed its receive capacity in this call: the call fails on every rank.
    if (absl::IsResourceExhausted(status)) Bump(s.control()->over_capacity_calls);
    return Record(s, status);
  }
  Bump(s.control()->combine_calls);
  Observe(s.control()->combine_latency, MonotonicNow() - start);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Rank::Rejoin(std::optional<uint64_t> next_step) {
  RankState& s = *state_;
  if (!s.attached) return Detached(s);
  if (s.InForkedChild()) return ForkedChild(s, "use");
  const absl::Status joined = JoinGroup(s, next_step);
#ifdef UBEP_CLIENT_CUDA
  const bool has_data_plane = s.on_device ? s.cuda_ep != nullptr : s.ep != nullptr;
#else
  const bool has_data_plane = s.ep != nullptr;
#endif
  if (!joined.ok() && !has_data_plane) {
    // The data plane was let go of on the way (its backend over new arenas failed): no call
    // runs until a Rejoin completes.
    s.stopped = absl::FailedPreconditionError(absl::StrCat(
        "rank ", s.rank, ": the last Rejoin did not complete (", joined.message(),
        "); call Rejoin again"));
  }
  UBEP_RETURN_IF_ERROR(joined);  // Counted by JoinGroup where it is the client's.
  return s.resume_step;
}

absl::StatusOr<std::span<std::byte>> Rank::ExpertWeights(int layer, int local_slot) {
  RankState& s = *state_;
  if (!s.attached) return Detached(s);
  // A forked child writing into the parent's weights would change what the parent serves.
  if (s.InForkedChild()) return ForkedChild(s, "use");
  if (layer < 0 || layer >= s.shape.num_layers || local_slot < 0 ||
      local_slot >= s.shape.slots_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat("(layer ", layer, ", slot ", local_slot,
                                                   ") is outside the shape"));
  }
  if (s.shape.bytes_per_expert == 0) {
    return absl::FailedPreconditionError("the shape has bytes_per_expert 0: no weight buffers");
  }
  int buffer = 0;
  absl::StatusOr<const kernels::PlanTableHeader*> checked = PlanAt(s, s.step, nullptr, &buffer);
  if (!checked.ok()) return checked.status();
  const kernels::PlanTableHeader* table = *checked;
  if (table == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("no plan is in force at step ", s.step));
  }
  const uint32_t index =
      kernels::SlotMap(s.own(), s.layout, s.config, buffer)[layer * s.shape.slots_per_rank + local_slot];
  // The slot map is shared memory every rank's process maps writable: a word outside the
  // buffers is refused, as ubepd refuses it, rather than handed out as a span past the arena.
  if (index >= static_cast<uint32_t>(s.layout.buffers_per_layer)) {
    return absl::DataLossError(absl::StrCat(
        "rank ", s.rank, "'s slot map says layer ", layer, " slot ", local_slot,
        " is in weight buffer ", index, ", outside [0, ", s.layout.buffers_per_layer,
        "): its arena was written outside ubepd"));
  }
  std::byte* base = s.own();
#ifdef UBEP_CLIENT_CUDA
  if (s.on_device) base = s.device_arenas[s.rank]->data();
#endif
  return std::span<std::byte>(kernels::WeightBuffer(base, s.layout, layer, index),
                              s.shape.bytes_per_expert);
}

absl::Status Rank::WeightsLoaded() {
  RankState& s = *state_;
  if (!s.attached) return Detached(s);
  if (s.InForkedChild()) return ForkedChild(s, "use");
  // Release: a daemon that reads the word with acquire reads the weights stored before it
  // (host memory; on the CUDA backend the caller's copies into device memory have completed
  // before it says so).
  std::atomic_ref<uint64_t>(s.control()->weights_loaded).store(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<int> Rank::SlotExpert(int layer, int local_slot) const {
  const RankState& s = *state_;
  if (!s.attached) return Detached(s);
  if (s.InForkedChild()) return ForkedChild(s, "use");
  if (layer < 0 || layer >= s.shape.num_layers || local_slot < 0 ||
      local_slot >= s.shape.slots_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat("(layer ", layer, ", slot ", local_slot,
                                                   ") is outside the shape"));
  }
  absl::StatusOr<const kernels::PlanTableHeader*> checked = PlanAt(s, s.step);
  if (!checked.ok()) return checked.status();
  const kernels::PlanTableHeader* table = *checked;
  if (table == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("no plan is in force at step ", s.step));
  }
  const uint32_t slot = static_cast<uint32_t>(s.rank * s.shape.slots_per_rank + local_slot);
  for (uint32_t e = 0; e < table->num_experts; ++e) {
    const kernels::ExpertRoute* route = kernels::FindRoute(table, layer, e);
    for (uint32_t j = 0; j < route->count; ++j) {
      if (kernels::Replicas(route)[j].slot == slot) return static_cast<int>(e);
    }
  }
  return absl::NotFoundError(absl::StrCat("slot ", local_slot, " of layer ", layer,
                                          " holds no expert in the plan in force"));
}

RankStats Rank::stats() const {
  const RankState& s = *state_;
  RankStats out;
  out.generation = s.generation;
  out.step = s.step;
  out.plan_version = s.last_plan_version;
  if (s.arenas.empty()) {
    // Detached: the counters as they stood when the arenas were let go.
    out.dispatched_tokens = s.detached_counts.dispatched_tokens;
    out.dispatch_calls = s.detached_counts.dispatch_calls;
    out.combine_calls = s.detached_counts.combine_calls;
    out.wait_timeouts = s.detached_counts.wait_timeouts;
    out.errors = s.detached_counts.errors;
    return out;
  }
  const kernels::RankControl* c = s.control();
  auto load = [](const uint64_t& w) {
    return std::atomic_ref<const uint64_t>(w).load(std::memory_order_relaxed);
  };
  out.dispatched_tokens = load(c->dispatched_tokens);
  out.dispatch_calls = load(c->dispatch_calls);
  out.combine_calls = load(c->combine_calls);
  out.wait_timeouts = load(c->wait_timeouts);
  for (const uint64_t& e : c->errors) out.errors += load(e);
  return out;
}

absl::Status Rank::Detach() {
  RankState& s = *state_;
  if (!s.attached) return absl::OkStatus();
  if (s.InForkedChild()) return ForkedChild(s, "detach");
  const RankDevice on_device(s);
  // ubepd gone: no daemon tells the peers that this rank leaves, so the rank stops the group
  // itself (as BeginStep would), and there is nothing to detach from.
  // (Gone whether or not the stop completed: a CUDA stop whose copies failed is not noted.)
  const bool daemon_gone = s.daemon_exited || DaemonExited(s);
  if (daemon_gone && !s.daemon_exited) (void)StopForDaemonExit(s);
  s.detached_counts = stats();  // The arena holding the counters is let go below.
  s.attached = false;
  s.step_begun = false;
  s.ep.reset();
#ifdef UBEP_CLIENT_CUDA
  s.cuda_ep.reset();
  s.device_arenas.clear();
  // The device memory of the plan table and the overflow sink goes with the arenas, not with
  // the Rank object.
  if (s.device_plan != nullptr) (void)cudaFree(s.device_plan);
  if (s.overflow_sink != nullptr) (void)cudaFree(s.overflow_sink);
  s.device_plan = nullptr;
  s.overflow_sink = nullptr;
  s.device_plan_version = 0;
#endif
  if (daemon_gone) {
    s.fd_connection.reset();
    s.arenas.clear();
    return absl::OkStatus();
  }
  v1::DetachRequest request;
  request.set_rank(static_cast<uint32_t>(s.rank));
  request.set_token(s.token);
  v1::DetachResponse response;
  grpc::ClientContext context;
  SetDeadline(context, s.options.rpc_timeout);
  const grpc::Status status = s.stub->Detach(&context, request, &response);
  s.fd_connection.reset();
  s.arenas.clear();
  return FromGrpc(status, context, absl::StrCat("rank ", s.rank, ": detach"),
                  s.options.rpc_timeout, "rpc_timeout");
}

}  // namespace ubep
