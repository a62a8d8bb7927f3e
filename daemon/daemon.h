// Daemon: ubepd assembled: the Node, its fd socket, the gRPC servers (Unix socket for the
// node's serving processes, TCP for peers and the balancer; grpc.health.v1 and server
// reflection on both) and the Prometheus exposition.
//
//   Daemon daemon = *Daemon::Start(options);
//   ... SIGTERM ...
//   daemon->Drain(absl::Seconds(10));   // clients told, NOT_SERVING, bounded wait
//
// Thread-safe.
#ifndef UBEP_DAEMON_DAEMON_H_
#define UBEP_DAEMON_DAEMON_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "balancer/formats/json_formats.h"
#include "common/shape_limits.h"
#include "daemon/balancer_link.h"
#include "daemon/node.h"

namespace grpc {
class Server;
}
namespace prometheus {
class Exposer;
}

namespace ubep::daemon {

class BalancerLink;
class DaemonControlService;
class DaemonMetrics;
class DaemonService;
class FdServer;

struct DaemonOptions {
  std::string backend = "host";          // "host"; "cuda" where built with CUDA.
  std::string socket_path;               // gRPC for local clients; fd socket at PATH.fds.
  mode_t socket_mode = 0660;
  std::string listen;                    // HOST:PORT for peers and the balancer; "" = none.
  std::string metrics;                   // HOST:PORT of the Prometheus exposition; "" = none.
  absl::Duration harvest_interval = absl::Seconds(1);
  int max_message_bytes = kMaxControlMessageBytes;  // Larger requests are refused by gRPC.
  NodeOptions node;                      // fd_socket_path is filled in from socket_path.
  // Control plane: ubep-balancer's HOST:PORT ("" = standalone), this node's name, and the
  // address the balancer reaches this daemon's DaemonControl at ("" = from --listen).
  std::string balancer;
  std::string node_name;
  std::string advertise;
  uint32_t domain = 0;
  absl::Duration report_interval = absl::Seconds(1);
  // Written once serving: {"pid", "socket", "listen_port", "metrics_port"} ("" = none). One a
  // run before left is removed once this daemon holds the socket's lock; this one's, when it
  // is destroyed.
  std::string ready_file;
};

class Daemon {
 public:
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonOptions options);
  ~Daemon();

  // No new attaches and every client's waits fail with "draining", then health NOT_SERVING
  // (so that no attach is taken once it says so); then waits up to `timeout` for the clients
  // to detach. Returns whether all did.
  bool Drain(absl::Duration timeout);
  // Removes its ready file (if it is still the one it wrote), as destruction does: for a
  // process about to exit without destroying the daemon. Not concurrent with destruction.
  void WithdrawReadyFile() { ready_.Withdraw(); }

  // Ports actually bound (useful with port 0); 0 when not listening.
  int listen_port() const { return listen_port_; }
  int metrics_port() const { return metrics_port_; }
  Node& node() { return *node_; }

 private:
  explicit Daemon(DaemonOptions options);

  DaemonOptions options_;
  // flock on SOCKET.lock: one daemon per socket path. First: let go of last, once the Node
  // (its arenas, device memory included) is gone, so that a daemon started next on the path
  // does not find them still held.
  UniqueFd socket_lock_;
  balancer::ReadyFile ready_;  // Withdrawn first thing in ~Daemon, the lock still held.
  std::unique_ptr<Node> node_;
  BalancerLinkStats link_stats_;  // The link's, read by the metrics (which outlive the link).
  std::shared_ptr<DaemonMetrics> metrics_;  // The exposer holds a weak_ptr.
  std::unique_ptr<DaemonService> service_;
  std::unique_ptr<DaemonControlService> control_;
  std::unique_ptr<BalancerLink> link_;
  std::unique_ptr<FdServer> fd_server_;
  std::unique_ptr<grpc::Server> local_server_;  // unix:--socket: Daemon (this node's clients).
  std::unique_ptr<grpc::Server> server_;        // --listen: DaemonControl; null without it.
  std::unique_ptr<prometheus::Exposer> exposer_;
  int listen_port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_DAEMON_H_
