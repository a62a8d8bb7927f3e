// FdServer: the daemon's fd socket. A client connects, sends its attach token, and receives
// its arenas' file descriptors (SCM_RIGHTS); the connection then stays open while the rank is
// attached, and its closing (the client exited, or was killed) tells the Node the rank is gone.
// A peer daemon of the same EP group (same machine) sends kPeerRequest followed by the group's
// key (Node::PeerKey) and receives "OK <first rank>" with the hosted arenas' fds; that
// connection then closes. A client may send kRefreshRequest on its open connection.
// One thread polls the listener and every connection. Thread-safe.
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

class FdServer {
 public:
  // Listens on `path` with `mode`; serves until destroyed.
  static absl::StatusOr<std::unique_ptr<FdServer>> Start(const std::string& path, mode_t mode,
                                                         Node* node);
  ~FdServer();
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

 private:
  FdServer(UniqueFd listener, UniqueFd wake, std::string path, Node* node);
  void Loop();
  // Answers a connection's token message; false when the connection should close.
  bool Serve(int64_t id, int fd);

  UniqueFd listener_;
  UniqueFd wake_;  // eventfd: written to stop the loop.
  std::string path_;
  Node* node_;
  std::map<int64_t, UniqueFd> connections_;  // Loop thread only.
  int64_t next_id_ = 1;
  std::thread thread_;
};

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_FD_SERVER_H_
