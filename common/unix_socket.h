// Unix-domain sockets with file-descriptor passing (SCM_RIGHTS), for handing shared-memory
// arenas from ubepd to the serving processes of its node. SOCK_SEQPACKET: messages keep their
// boundaries and a closed peer reads as end of file, which is how the daemon notices a
// client that died.
//
//   UniqueFd listener = *ListenUnix("/run/ubep/ubepd.sock.fds", 0660);
//   UniqueFd conn = *ConnectUnix("/run/ubep/ubepd.sock.fds");
//   UBEP_RETURN_IF_ERROR(SendMessage(conn.get(), bytes, fds));
//   ReceivedMessage m = *ReceiveMessage(conn.get(), 4096, absl::Seconds(5));
//
// Thread-compatible; the functions are thread-safe on distinct sockets.
#ifndef UBEP_COMMON_UNIX_SOCKET_H_
#define UBEP_COMMON_UNIX_SOCKET_H_

#include <sys/types.h>

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ubep {

// Owns a file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Removes a socket left at `path` by a process gone (bind needs the path free); refuses,
// FailedPrecondition, to remove anything that is not a socket (a mistyped path naming a file).
absl::Status RemoveStaleSocket(const std::string& path);
// FailedPrecondition when a process listens on the socket at `path` (a connect is taken), so
// that a live socket is not replaced as a stale one; OK when nothing or no socket is there, or
// nobody listens.
absl::Status RefuseLiveSocket(const std::string& path);

// Binds and listens on `path` (an existing socket file there is replaced), then sets the
// file's mode (e.g. 0660) so that only the owner and group may connect.
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, mode_t mode);
// Connects to `path`. A listener whose queue of connections not yet accepted is full (a
// wedged server) gets DeadlineExceeded after `timeout` rather than a connect that blocks.
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path,
                                     absl::Duration timeout = absl::Seconds(10));

// Sends one message carrying `bytes` and `fds` (duplicated into the receiver; at most 2048:
// more than a socket message takes, 253, go ahead of it in messages of their own, which
// ReceiveMessage gathers). A receiver that leaves its queue full for `timeout` (it takes no
// message) gets none: DeadlineExceeded, and a message of several parts may be cut short
// (close the connection then).
absl::Status SendMessage(int socket, std::string_view bytes, std::span<const int> fds,
                         absl::Duration timeout = absl::InfiniteDuration());

// The timeout to give poll(2) for a wait with `left` to go: rounded up to whole milliseconds,
// 0 when nothing is left, at most INT_MAX (a longer wait polls again).
int PollTimeoutMs(absl::Duration left);

struct ReceivedMessage {
  std::string bytes;          // Empty with `closed` when the peer closed the connection.
  std::vector<UniqueFd> fds;
  bool closed = false;
};

// Receives one message of at most `max_bytes`, waiting at most `timeout`
// (DeadlineExceeded). A message cut short, or carrying more than 2048 fds, is DataLoss.
absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket, size_t max_bytes,
                                               absl::Duration timeout);

// ubepd's fd socket: a client that holds a rank sends this on its open connection to take
// every arena again after a peer daemon restarted; the reply is "OK <arena epoch>" with the
// fds, or "ERR <reason>".
inline constexpr char kArenaRefreshRequest[] = "REFRESH";

// Sends `bytes` and receives the one reply, each within `timeout`. A server may answer a
// connection before reading it (a refusal, then the close): when the send or the receive
// fails on a connection the server closed, a reply queued on it is the answer.
absl::StatusOr<ReceivedMessage> Exchange(int socket, std::string_view bytes, size_t max_bytes,
                                         absl::Duration timeout);

// The pid of the process at the other end of a connected Unix socket (SO_PEERCRED).
absl::StatusOr<pid_t> PeerPid(int socket);

}  // namespace ubep

#endif  // UBEP_COMMON_UNIX_SOCKET_H_
