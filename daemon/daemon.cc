#include "daemon/daemon.h"

#include <fcntl.h>
#include <sys/file.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/channel.h"
#include "common/logging.h"
#include "common/shape_limits.h"
#include "common/rpc_origin.h"
#include "common/timeout.h"
#include "balancer/formats/proto_convert.h"
#include "daemon/balancer_link.h"
#include "daemon/device_memory.h"
#include "daemon/fd_server.h"
#include "daemon/metrics.h"
#include "daemon/weight_link.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "nlohmann/json.hpp"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "ubep/v1/control.grpc.pb.h"
#include "ubep/v1/daemon.grpc.pb.h"

namespace ubep::daemon {


// An answer of ubepd's RPCs: an error is counted (ubep_daemon_errors_total{source="rpc"}) and
// marked as ubepd's own (rpc_origin.h), so that clients call only the transport's failures
// "not reachable".
grpc::Status Answered(grpc::ServerContext* context, DaemonMetrics* metrics,
                      const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  metrics->CountRpcError(status.code());
  context->AddTrailingMetadata(kUbepOrigin, "ubepd");
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

class DaemonService final : public v1::Daemon::Service {
 public:
  DaemonService(Node* node, DaemonMetrics* metrics) : node_(node), metrics_(metrics) {}

  grpc::Status Attach(grpc::ServerContext* context, const v1::AttachRequest* request,
                      v1::AttachResponse* response) override {
    return Answer(context, node_->Attach(*request, absl::FromChrono(context->deadline())),
                  response);
  }
  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override {
    const absl::Time deadline = absl::FromChrono(context->deadline());
    return Answer(context, node_->Join(*request, deadline), response);
  }
  grpc::Status Detach(grpc::ServerContext* context, const v1::DetachRequest* request,
                      v1::DetachResponse*) override {
    return Answered(context, metrics_, node_->Detach(*request));
  }
  grpc::Status GetPlan(grpc::ServerContext* context, const v1::GetPlanRequest*,
                       v1::GetPlanResponse* response) override {
    return Answer(context, node_->GetPlan(), response);
  }
  grpc::Status ReportStep(grpc::ServerContext* context, const v1::ReportStepRequest* request,
                          v1::ReportStepResponse* response) override {
    return Answer(context, node_->ReportStep(*request), response);
  }

 private:
  template <typename T>
  grpc::Status Answer(grpc::ServerContext* context, absl::StatusOr<T> result, T* response) {
    if (!result.ok()) return Answered(context, metrics_, result.status());
    *response = *std::move(result);
    return grpc::Status::OK;
  }

  Node* node_;
  DaemonMetrics* metrics_;
};

namespace {

// Where Prepare reads the weights of holders in other domains: their daemons' ReadWeights,
// from the group's daemons the balancer lists in the request. Called by one thread (the
// Prepare's), so the stubs need no lock.
constexpr absl::Duration kChunkTimeout = absl::Seconds(10);

Node::RemoteWeights RemoteWeightsOf(const v1::PrepareRequest& request, const std::string& self,
                                    int world, absl::Time deadline) {
  Node::RemoteWeights remote;
  remote.caller_deadline = deadline;
  if (request.daemons().empty() || world <= 0) return remote;
  constexpr uint32_t kNoDomain = ~uint32_t{0};  // A rank no healthy daemon hosts.
  remote.rank_domain.assign(world, kNoDomain);
  remote.rank_link.assign(world, -1);
  remote.rank_restarted.assign(world, false);
  struct Host {
    std::string node, address;
    bool down = false;       // Its daemon fails its health checks.
    bool restarted = false;  // Read only as the last resort: its clients must have loaded.
  };
  auto hosts = std::make_shared<std::vector<Host>>(world);
  // First the daemons down, so that a rank also listed by a healthy one (which took it over)
  // is that one's.
  for (const v1::PeerDaemon& d : request.down_daemons()) {
    for (uint32_t r : d.ranks()) {
      if (r >= static_cast<uint32_t>(world)) continue;
      remote.rank_domain[r] = d.domain();
      (*hosts)[r] = {d.node(), "", true};
    }
  }
  for (int i = 0; i < request.daemons_size(); ++i) {
    const v1::PeerDaemon& d = request.daemons(i);
    if (d.node() == self) remote.link_rank = i;  // Link ranks are places in the list.
    for (uint32_t r : d.ranks()) {
      if (r >= static_cast<uint32_t>(world)) continue;
      remote.rank_domain[r] = d.domain();
      remote.rank_link[r] = i;
      remote.rank_restarted[r] = d.restarted();
      (*hosts)[r] = {d.node(), d.address(), false, d.restarted()};
    }
  }
  if (!request.nccl_unique_id().empty()) {
    remote.nccl_id = request.nccl_unique_id();
    remote.base_version = request.base_version();
    remote.link_size = request.daemons_size();
  }
  auto stubs = std::make_shared<absl::flat_hash_map<std::string, std::unique_ptr<v1::DaemonControl::Stub>>>();
  // The balancer's deadline for the Prepare bounds every wait (with a moment to answer).
  deadline -= AnswerMargin(deadline - absl::Now(), absl::Milliseconds(200));
  remote.deadline = deadline;
  remote.fetch = [hosts, stubs, deadline](int rank, uint64_t version, int layer, int slot,
                                         std::byte* out, size_t bytes,
                                         const std::function<bool()>& stopped) -> absl::Status {
    const Host& host = (*hosts)[rank];
    if (host.down) {
      return absl::UnavailableError(absl::StrCat(
          "rank ", rank, "'s daemon ", host.node, " is down and in another domain: its weights "
          "cannot be read (load the expert again, or bring ", host.node, " back)"));
    }
    if (host.address.empty()) {
      return absl::UnavailableError(absl::StrCat("no healthy daemon of the group hosts rank ", rank));
    }
    std::unique_ptr<v1::DaemonControl::Stub>& stub = (*stubs)[host.address];
    if (stub == nullptr) {
      stub = v1::DaemonControl::NewStub(
          ControlChannel(host.address, static_cast<int>(2 * Node::kMaxReadWeightsBytes)));
    }
    for (size_t offset = 0; offset < bytes;) {
      if (stopped()) return absl::CancelledError("the staging stopped");
      const size_t length = std::min<size_t>(Node::kMaxReadWeightsBytes, bytes - offset);
      v1::ReadWeightsRequest read;
      read.set_plan_version(version);
      read.set_layer(static_cast<uint32_t>(layer));
      read.set_slot(static_cast<uint32_t>(slot));
      read.set_offset(offset);
      read.set_length(length);
      read.set_require_loaded(host.restarted);
      grpc::ClientContext context;
      // A read is one chunk (kMaxReadWeightsBytes): one that takes longer than kChunkTimeout
      // is a peer that hangs, and a drain waits for at most one read.
      context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + kChunkTimeout)));
      v1::ReadWeightsResponse response;
      const grpc::Status status = stub->ReadWeights(&context, read, &response);
      if (!status.ok()) {
        return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                            absl::StrCat("node ", host.node, " (", host.address, "): ", status.error_message()));
      }
      if (response.bytes_per_expert() != bytes || response.data().size() != length) {
        return absl::DataLossError(absl::StrCat(
            "node ", host.node, " (", host.address, ") sent ", response.data().size(), " of ",
            length, " bytes of a ", response.bytes_per_expert(), "-byte expert; this group's experts have ", bytes));
      }
      std::memcpy(out + offset, response.data().data(), length);
      offset += length;
    }
    return absl::OkStatus();
  };
  return remote;
}

}  // namespace

// The daemon side of the two-phase plan commit, for ubep-balancer and peer daemons.
class DaemonControlService final : public v1::DaemonControl::Service {
 public:
  DaemonControlService(Node* node, DaemonMetrics* metrics, std::string name, std::string backend)
      : node_(node), metrics_(metrics), name_(std::move(name)), backend_(std::move(backend)) {}

  grpc::Status Prepare(grpc::ServerContext* context, const v1::PrepareRequest* request,
                       v1::PrepareResponse* response) override {
    absl::StatusOr<balancer::Plan> plan = balancer::FromProto(request->plan());
    if (!plan.ok()) return Answered(context, metrics_, plan.status());
    const std::optional<v1::AttachRequest> shape = node_->GroupShape();
    *response = node_->Prepare(
        *plan, request->effective_step(),
        RemoteWeightsOf(*request, name_, shape.has_value() ? static_cast<int>(shape->world_size()) : 0,
                        std::min(absl::Now() + absl::Minutes(5), absl::FromChrono(context->deadline()))));
    return grpc::Status::OK;
  }
  grpc::Status CreateLink(grpc::ServerContext* context, const v1::CreateLinkRequest*,
                          v1::CreateLinkResponse* response) override {
    if (backend_ != "cuda") {
      return Answered(context, metrics_,
                      absl::FailedPreconditionError(
                          "the host backend copies weights without NCCL links"));
    }
    absl::StatusOr<std::string> id = NewWeightLinkId();
    if (!id.ok()) return Answered(context, metrics_, id.status());
    response->set_nccl_unique_id(*std::move(id));
    return grpc::Status::OK;
  }
  grpc::Status ReadWeights(grpc::ServerContext* context, const v1::ReadWeightsRequest* request,
                           v1::ReadWeightsResponse* response) override {
    absl::StatusOr<v1::ReadWeightsResponse> read = node_->ReadWeights(*request);
    if (!read.ok()) return Answered(context, metrics_, read.status());
    *response = *std::move(read);
    return grpc::Status::OK;
  }
  grpc::Status Commit(grpc::ServerContext* context, const v1::CommitRequest* request,
                      v1::CommitResponse*) override {
    return Answered(context, metrics_, node_->Commit(request->version()));
  }
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse*) override {
    return Answered(context, metrics_, node_->Abort(request->version()));
  }
  grpc::Status GetState(grpc::ServerContext*, const v1::GetStateRequest*,
                        v1::DaemonState* response) override {
    *response = node_->State();
    response->set_node(name_);
    return grpc::Status::OK;
  }

 private:
  Node* node_;
  DaemonMetrics* metrics_;
  std::string name_;
  std::string backend_;
};

Daemon::Daemon(DaemonOptions options)
    : options_(std::move(options)), ready_(options_.ready_file) {}

Daemon::~Daemon() {
  // Gone with the daemon: a script waiting for the next one's must not read this one's ports.
  // (Removed while the socket's lock is held: the next daemon on it writes its own only once
  // it holds the lock.)
  ready_.Withdraw();
  link_.reset();
  // Going away, drained or not: the waits in Attach and Join end now (they heed draining,
  // not the server's cancellation), so that the servers' shutdown below does not wait for
  // them up to the join timeout.
  if (node_ != nullptr) node_->Drain();
  // In-flight calls (a client detaching as the drain ends) get a moment to answer.
  // The clients' server first, each with its own 2 s: a slow DaemonControl call does not eat
  // the time of a client detaching.
  if (local_server_ != nullptr) {
    local_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server_.reset();
  local_server_.reset();
  exposer_.reset();
  fd_server_.reset();
  metrics_.reset();
  // The socket files are this daemon's only while it holds the lock (another daemon's, if it
  // failed to take it).
  // (A socket only: a start refused because the path names something else leaves it be.)
  if (socket_lock_.valid()) (void)RemoveStaleSocket(options_.socket_path);
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions options) {
  if (options.backend != "host" && options.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend ", options.backend, ": expected host or cuda"));
  }
  if (options.backend == "cuda") {
    const absl::StatusOr<int> devices = CountDevices();
    if (!devices.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend cuda: ", devices.status().message()));
    }
    if (*devices == 0) {
      return absl::FailedPreconditionError("--backend cuda: no CUDA device is visible to ubepd");
    }
  }
  options.node.backend = options.backend;
  options.node.domain = options.domain;
  if (options.socket_path.empty()) return absl::InvalidArgumentError("--socket is required");
  options.node.fd_socket_path = options.socket_path + ".fds";
  // The ready file is written by a rename over its path (from PATH.tmp.*), and removed: on one
  // of the daemon's own files it would replace a socket, or the lock.
  for (const std::string& own : {options.socket_path, options.node.fd_socket_path,
                                 options.socket_path + ".lock"}) {
    if (options.ready_file.empty()) break;
    if (options.ready_file == own || absl::StartsWith(own, options.ready_file + ".tmp.")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ready_file ", options.ready_file, " would be written over ", own,
          ", one of ubepd's own files (its sockets and its lock): give it a path of its own"));
    }
  }
  if (!options.advertise.empty()) {
    // The balancer calls this daemon back there: a host and a port it can dial.
    const size_t colon = options.advertise.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(absl::string_view(options.advertise).substr(colon + 1), &port) ||
        port < 1 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--advertise \"", absl::CHexEscape(options.advertise),
          "\": HOST:PORT is expected, with a port in [1, 65535] (the balancer calls this daemon "
          "back there)"));
    }
  }
  if (options.domain == std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        "--domain 4294967295 stands for \"no domain\" in the group's view (a rank no healthy "
        "daemon hosts): give another");
  }
  if (!options.balancer.empty() && options.listen.empty()) {
    return absl::InvalidArgumentError("--balancer needs --listen: the balancer calls this "
                                      "daemon back there (--advertise only names that address "
                                      "to the balancer)");
  }
  if (options.node.num_ranks > 0 && options.balancer.empty()) {
    return absl::InvalidArgumentError(
        "--ranks needs --balancer: the daemons of the group's other ranks are found through it");
  }
  if (!options.node_name.empty() && !ValidNodeName(options.node_name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--node \"", absl::CHexEscape(options.node_name), "\": a name of at most ", kMaxNodeName,
        " letters, digits, '.', '-' and '_' is expected (a host or node name)"));
  }
  if (options.node.num_ranks > 0 && options.node_name.empty()) {
    // The default, the host name, is the same for every daemon of the machine: each would
    // take the others for itself (and the balancer, for one node restarting).
    return absl::InvalidArgumentError(
        "--ranks needs --node: the daemons of one machine's group are told apart by their "
        "names (the host name, the default, is theirs alike)");
  }
  if (!options.balancer.empty() && options.node.plan_path.empty()) {
    // A group starts under the cluster's plan when the balancer has one (a restarted node).
    // The plan in full form: as large as the balancer sends one, the largest control message
    // or a Prepare's bound if larger (--max_message_bytes bounds what ubepd's own servers
    // take; a lower one here made a large plan fail, and the group start round-robin).
    std::shared_ptr<v1::Control::Stub> stub =
        v1::Control::NewStub(ControlChannel(
            options.balancer, std::max(kMaxControlMessageBytes, options.max_message_bytes)));
    options.node.cluster_plan = [stub](absl::Time deadline) {
      return FetchClusterPlan(*stub, deadline);
    };
  }
  std::unique_ptr<Daemon> d(new Daemon(options));
  // One daemon per socket path: a second one started by mistake must not replace (and, as it
  // exits, remove) the sockets of the one serving there.
  const std::string lock_path = options.socket_path + ".lock";
  // Read-only (flock needs no more), and the owner's alone: a lock others could open, they
  // could hold, and keep every ubepd from starting. One another user's ubepd left (run by
  // hand as root, say) is said to be removed.
  UniqueFd lock(open(lock_path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0600));
  if (!lock.valid()) {
    const int error = errno;
    return absl::ErrnoToStatus(
        error, absl::StrCat("open ", lock_path,
                            error == EACCES ? " (another user's, not readable: remove it if no "
                                              "ubepd serves there)"
                                            : ""));
  }
  if (flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    return errno == EWOULDBLOCK
               ? absl::AlreadyExistsError(absl::StrCat("another ubepd serves ", options.socket_path,
                                                       " (it holds ", lock_path, ")"))
               : absl::ErrnoToStatus(errno, absl::StrCat("flock ", lock_path));
  }
  // Both socket paths are free, or hold a socket of a daemon gone, before either is made:
  // anything else there (a mistyped path naming a file) is left alone, and nothing started.
  // A socket someone listens on is not stale, lock or no lock (the lock file removed under
  // a running daemon, or a path that names another program's socket).
  for (const std::string& path : {options.socket_path, options.node.fd_socket_path}) {
    if (absl::Status live = RefuseLiveSocket(path); !live.ok()) return live;
  }
  for (const std::string& path : {options.socket_path, options.node.fd_socket_path}) {
    if (absl::Status removed = RemoveStaleSocket(path); !removed.ok()) return removed;
  }
  // Held by the daemon from here on, whose end removes the socket at its path: not before, or
  // a start refused above would remove the live socket it refused to replace.
  d->socket_lock_ = std::move(lock);
  // A ready file a daemon before this one left (killed, it removed nothing) goes now: whoever
  // waits for this daemon's must not take that one's ports for its own.
  if (absl::Status cleared = d->ready_.ClearStale(balancer::ReadyFile::Holder::kThisRun);
      !cleared.ok()) {
    return absl::Status(cleared.code(), absl::StrCat("--ready_file: ", cleared.message()));
  }
  d->node_ = std::make_unique<Node>(options.node);
  d->metrics_ = std::make_shared<DaemonMetrics>(d->node_.get(), options.harvest_interval);
  d->service_ = std::make_unique<DaemonService>(d->node_.get(), d->metrics_.get());
  absl::StatusOr<std::unique_ptr<FdServer>> fd_server =
      FdServer::Start(options.node.fd_socket_path, options.socket_mode, d->node_.get());
  if (!fd_server.ok()) return fd_server.status();
  d->fd_server_ = *std::move(fd_server);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // What can fail for want of a port is bound before the clients' socket is served: a daemon
  // that cannot start has had no client attach.
  if (!options.metrics.empty()) {
    try {
      d->exposer_ = std::make_unique<prometheus::Exposer>(options.metrics);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("--metrics ", options.metrics, ": ", e.what()));
    }
    d->exposer_->RegisterCollectable(d->metrics_);
    d->metrics_port_ = d->exposer_->GetListeningPorts().front();
  }
  if (options.node_name.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    options.node_name = host;
  }
  d->control_ = std::make_unique<DaemonControlService>(d->node_.get(), d->metrics_.get(),
                                                     options.node_name, options.backend);
  if (!options.listen.empty()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &d->listen_port_);
    // Not shared with a process already there (gRPC's default, SO_REUSEPORT): the balancer
    // would call either daemon at random.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.SetMaxReceiveMessageSize(options.max_message_bytes);
    builder.RegisterService(d->control_.get());
    d->server_ = builder.BuildAndStart();
    if (d->server_ == nullptr || d->listen_port_ == 0) {
      return absl::UnavailableError(absl::StrCat("cannot serve gRPC on ", options.listen));
    }
    d->server_->GetHealthCheckService()->SetServingStatus(false);  // Until all has started.
  }

  // Two servers: the Unix socket serves the clients of this node (Daemon), TCP the balancer
  // and the peer daemons (DaemonControl). Neither serves the other's service: a client's
  // Attach from the network would hold a rank's ticket from its real client, and a local
  // client has no business preparing plans.
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + options.socket_path, grpc::InsecureServerCredentials());
    builder.SetMaxReceiveMessageSize(options.max_message_bytes);
    builder.RegisterService(d->service_.get());
    // The socket is made (bind) with no more than --socket_mode's permissions, not opened
    // wider until the chmod below: a umask of 0 or 002 would otherwise let other users
    // connect, and stay connected, in between. (The process's umask, put back at once; no
    // other thread of ubepd makes files meanwhile.)
    const mode_t umask_before = umask(0777 & ~options.socket_mode);
    d->local_server_ = builder.BuildAndStart();
    umask(umask_before);
    if (d->local_server_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot serve gRPC on unix:", options.socket_path));
    }
    d->local_server_->GetHealthCheckService()->SetServingStatus(false);  // Until all has started.
  }
  if (chmod(options.socket_path.c_str(), options.socket_mode) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("chmod ", options.socket_path));
  }
  if (!options.balancer.empty()) {
    if (options.advertise.empty()) {
      std::string host = options.listen.substr(0, options.listen.rfind(':'));
      if (host == "0.0.0.0" || host == "[::]" || host.empty()) {
        char name[256] = {};
        gethostname(name, sizeof(name) - 1);
        host = name;
      }
      options.advertise = absl::StrCat(host, ":", d->listen_port_);
    }
    BalancerLinkOptions link;
    link.balancer = options.balancer;
    link.node = options.node_name;
    link.address = options.advertise;
    link.domain = options.domain;
    link.backend = options.backend;
    link.arena_socket = options.node.fd_socket_path;
    if (!link.arena_socket.starts_with("/")) {
      char cwd[4096] = {};
      if (getcwd(cwd, sizeof(cwd) - 1) != nullptr) link.arena_socket = absl::StrCat(cwd, "/", link.arena_socket);
    }
    link.report_interval = options.report_interval;
    link.stats = &d->link_stats_;
    d->metrics_->ExposeLink(&d->link_stats_);
    d->link_ = std::make_unique<BalancerLink>(link, d->node_.get());
  }
  // Serving, said once everything has started.
  for (grpc::Server* server : {d->local_server_.get(), d->server_.get()}) {
    if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(true);
  }
  // For the scripts and tests that wait for it: where it serves. One that cannot be written
  // stops the daemon (whoever waits for the file would wait in vain; no client can have been
  // told where it is).
  const std::string ready = nlohmann::json{{"pid", getpid()},
                                           {"socket", options.socket_path},
                                           {"listen_port", d->listen_port_},
                                           {"metrics_port", d->metrics_port_}}
                                .dump() +
                            "\n";
  if (absl::Status published = d->ready_.Publish(ready); !published.ok()) {
    return absl::Status(published.code(), absl::StrCat("--ready_file: ", published.message()));
  }
  UBEP_LOG(INFO) << "ubepd serving: unix:" << options.socket_path
                 << (options.listen.empty() ? "" : absl::StrCat(", ", options.listen, " (port ",
                                                                d->listen_port_, ")"))
                 << (options.metrics.empty()
                         ? ""
                         : absl::StrCat(", metrics port ", d->metrics_port_));
  return d;
}

bool Daemon::Drain(absl::Duration timeout) {
  // Attaches are refused first: once the health service says NOT_SERVING, no attach is taken.
  node_->Drain();
  for (grpc::Server* server : {local_server_.get(), server_.get()}) {
    if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(false);
  }
  const bool all = node_->AwaitDetached(timeout);
  UBEP_LOG(INFO) << (all ? "drained: every client detached"
                         : "drain timed out with clients still attached");
  return all;
}

}  // namespace ubep::daemon
