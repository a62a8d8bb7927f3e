// FdServer: the daemon's fd socket. A client connects, sends its attach token, and receives
// its arenas' file descriptors (SCM_RIGHTS); the connection then stays open while the rank is
// attached, and its closing (the client exited, or was killed) tells the Node the rank is gone.
// A peer daemon of the same EP group (same machine) sends kPeerRequest followed by the group's
// key (Node::PeerKey) and receives "OK <first rank>" with the hosted arenas' fds; that
// connection then closes. A client may send kRefreshRequest on its open connection; anything
// else on a connection that holds a rank closes it, and the rank is gone as if the client had.
// One thread polls the listener and every connection; no connection can hold it: a reply the
// other side does not take within FdServerOptions::send_timeout closes its connection (and
// detaches its rank), and a connection that holds no rank is closed after
// FdServerOptions::unclaimed_timeout. Nor can connections exhaust it: past
// FdServerOptions::max_unclaimed connections that hold no rank, the oldest of them that sent
// nothing (a client sends its token at once) is answered "ERR <why>" and closed to make room,
// so that idle connections cannot keep clients out; where every one of them has spoken (ranks
// detached by RPC, their connections kept), and when the process is out of file descriptors
// (a spare one, kept open for this, takes the connection for its answer), the new connection
// is answered so and closed, so its client fails at once rather than waiting out its timeout,
// and the loop does not spin on a listener it cannot drain.
// Thread-safe.
#ifndef UBEP_DAEMON_FD_SERVER_H_
#define UBEP_DAEMON_FD_SERVER_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <thread>

#include "absl/status/statusor.h"
#include "common/unix_socket.h"
#include "daemon/node.h"

namespace ubep::daemon {

inline constexpr char kPeerRequest[] = "PEER ";


// A peer's side: the arenas a daemon at `socket_path` hosts, as (first rank, fds).
absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> FetchPeerArenas(
    const std::string& socket_path, const std::string& key, absl::Duration timeout);

struct FdServerOptions {
  absl::Duration send_timeout = absl::Seconds(2);
  // From its accept until it claims a rank (clients send their token at once).
  absl::Duration unclaimed_timeout = absl::Seconds(10);
  // Connections that hold no rank, at most (clients, and peers asking for arenas, hold one
  // for a moment each); those that hold a rank are bounded by the ranks the daemon hosts.
  int max_unclaimed = 64;
  // How often connections that claimed a rank are looked at: one whose rank was detached by
  // RPC (its client kept the connection) holds nothing any more, and is unclaimed again: it
  // counts against max_unclaimed and is closed after unclaimed_timeout.
  absl::Duration held_check_interval = absl::Seconds(1);
};

class FdServer {
 public:
  // Listens on `path` with `mode`; serves until destroyed.
  static absl::StatusOr<std::unique_ptr<FdServer>> Start(const std::string& path, mode_t mode,
                                                         Node* node, FdServerOptions options = {});
  ~FdServer();
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

 private:
  struct Connection {
    UniqueFd fd;
    absl::Time close_at;  // Monotonic; infinite once it holds a rank.
    std::string who;  // "pid <n>" of the process that connected (SO_PEERCRED), for the logs.
    bool spoke = false;  // It sent a message that was served (it held a rank, at least once).
  };

  FdServer(UniqueFd listener, UniqueFd wake, std::string path, Node* node, FdServerOptions options);
  void Loop();
  // Answers a connection's message; false when the connection should close, with `why` set
  // where ubepd closes it (empty: its client closed it). A connection kept open holds a rank.
  bool Serve(int64_t id, const Connection& connection, std::string& why);
  // Takes the listener's next connection: kept, or answered "ERR ..." and closed.
  void Accept(absl::Time now);
  int Unclaimed(absl::Time now) const;
  absl::Status Reply(const Connection& connection, const std::string& bytes,
                     const std::vector<UniqueFd>& fds) const;

  UniqueFd listener_;
  UniqueFd wake_;  // eventfd: written to stop the loop.
  UniqueFd spare_;  // /dev/null, closed to take a connection when out of file descriptors.
  absl::Time listen_again_ = absl::InfinitePast();  // Loop thread only: accept failed until.
  absl::Time next_held_check_ = absl::InfinitePast();  // Loop thread only.
  // Refusals, and accepts that failed, are logged once per 10 s each.
  absl::Time next_accept_log_ = absl::InfinitePast();
  absl::Time next_accept_error_log_ = absl::InfinitePast();
  std::string path_;
  Node* node_;
  const FdServerOptions options_;
  std::map<int64_t, Connection> connections_;  // Loop thread only.
  int64_t next_id_ = 1;
  std::thread thread_;
};

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_FD_SERVER_H_
