#include "common/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/clock.h"

namespace ubep {
namespace {

// The most fds one message carries (Linux's SCM_MAX_FD); more go in several messages, all
// but the last carrying kMoreFds in place of bytes.
constexpr size_t kFdsPerMessage = 253;
// The most one message and its continuations carry: two per rank of the largest group.
constexpr size_t kMaxFds = 2048;
// Bytes no message of the callers' starts with (theirs are text).
constexpr std::string_view kMoreFds = "\x01more fds";
// The most parts one message has (SendMessage's continuations, then its last part): a reader
// takes no more, so that a sender's endless continuations cannot hold it (the fd server's one
// thread, whose reads end at the first part that is not ready, not at a deadline).
constexpr int kMaxParts = static_cast<int>(kMaxFds / kFdsPerMessage) + 1;

absl::Status Errno(const std::string& what) {
  const int e = errno;
  return absl::ErrnoToStatus(e, what);
}

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("unix socket path \"", path, "\" must have 1 to ",
                                                   sizeof(addr.sun_path) - 1, " characters"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) close(fd_);
  fd_ = fd;
}

absl::Status RemoveStaleSocket(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : Errno(absl::StrCat("lstat ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " exists and is not a socket (",
        S_ISREG(st.st_mode) ? "a regular file" : S_ISDIR(st.st_mode) ? "a directory" : "another kind of file",
        "); not replacing it: is the socket path right?"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return Errno(absl::StrCat("unlink ", path));
  return absl::OkStatus();
}

absl::Status RefuseLiveSocket(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return absl::OkStatus();
  absl::StatusOr<sockaddr_un> addr = Address(path);
  if (!addr.ok()) return addr.status();
  UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return Errno("socket");
  // Refused (nobody listens): stale. Taken, pending (a full backlog), or a listener of another
  // socket type: someone is there. Anything else (no write permission on it, say, which the
  // kernel checks before it looks for a listener): it cannot be told, and it is not replaced.
  if (connect(probe.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) == 0 ||
      errno == EAGAIN || errno == EINPROGRESS || errno == EPROTOTYPE) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is a socket another process listens on; not replacing it: is the socket path "
        "right? (another ubepd, started without its lock file, or another program)"));
  }
  if (errno != ECONNREFUSED && errno != ENOENT) {
    const int error = errno;
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is a socket whose listener, if any, cannot be told (connect: ",
        std::strerror(error), "); not replacing it: remove it if no process serves it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, mode_t mode) {
  absl::StatusOr<sockaddr_un> addr = Address(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  if (absl::Status removed = RemoveStaleSocket(path); !removed.ok()) return removed;
  if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return Errno(absl::StrCat("bind ", path));
  }
  if (chmod(path.c_str(), mode) != 0) return Errno(absl::StrCat("chmod ", path));
  if (listen(fd.get(), 128) != 0) return Errno(absl::StrCat("listen ", path));
  return fd;
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path, absl::Duration timeout) {
  absl::StatusOr<sockaddr_un> addr = Address(path);
  if (!addr.ok()) return addr.status();
  // Non-blocking, so that a full queue is EAGAIN (a blocking connect would wait for a slot).
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Errno("socket");
  const absl::Time start = MonotonicNow();
  while (connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    if (errno != EAGAIN) return Errno(absl::StrCat("connect ", path));
    if (MonotonicNow() - start >= timeout) {
      return absl::DeadlineExceededError(absl::StrCat(
          "connect ", path, ": the listener accepted no connection for ",
          absl::FormatDuration(timeout), " (its queue is full; is the server stuck?)"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  // Blocking from here on, as the callers' sends and receives expect.
  const int flags = fcntl(fd.get(), F_GETFL);
  if (flags < 0 || fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) return Errno("fcntl");
  return fd;
}

int PollTimeoutMs(absl::Duration left) {
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
      std::numeric_limits<int>::max()));
}

namespace {

// Waits until `socket` is ready for `events`, until `timeout` from `start` has passed
// (DeadlineExceeded naming `what`); on the monotonic clock (a wall-clock step neither ends nor
// stretches the wait), each poll at most INT_MAX ms, so that any timeout, infinite included,
// is kept.
absl::Status AwaitReady(int socket, short events, absl::Time start, absl::Duration timeout,
                        const char* what) {
  pollfd p{socket, events, 0};
  while (true) {
    const absl::Duration left = timeout - (MonotonicNow() - start);
    const int wait_ms = PollTimeoutMs(left);
    const int r = poll(&p, 1, wait_ms);
    if (r > 0) return absl::OkStatus();
    if (r == 0 && left <= absl::Milliseconds(wait_ms)) {
      return absl::DeadlineExceededError(absl::StrCat(what, absl::FormatDuration(timeout)));
    }
    if (r < 0 && errno != EINTR) return Errno("poll");
  }
}

// One sendmsg of `bytes` and at most kFdsPerMessage `fds`, within `timeout` from `start`.
absl::Status SendOne(int socket, std::string_view bytes, std::span<const int> fds,
                     absl::Time start, absl::Duration timeout) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  // Without waiting (MSG_DONTWAIT), whatever the socket's mode: a full queue is waited out
  // here, bounded.
  while (true) {
    const ssize_t n = sendmsg(socket, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      if (static_cast<size_t>(n) != bytes.size()) return absl::DataLossError("short send");
      return absl::OkStatus();
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (absl::Status ready =
              AwaitReady(socket, POLLOUT, start, timeout, "the receiver took no message for ");
          !ready.ok()) {
        return ready;
      }
    } else if (errno != EINTR) {
      return Errno("sendmsg");
    }
  }
}

// One recvmsg of at most `max_bytes` and kFdsPerMessage fds, appended to `out`, within
// `timeout` from `start`.
absl::Status ReceiveOne(int socket, size_t max_bytes, absl::Time start, absl::Duration timeout,
                        ReceivedMessage& out) {
  if (absl::Status ready = AwaitReady(socket, POLLIN, start, timeout, "no message within ");
      !ready.ok()) {
    return ready;
  }
  out.bytes.resize(std::max(max_bytes, kMoreFds.size()));
  iovec iov{out.bytes.data(), out.bytes.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kFdsPerMessage));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Errno("recvmsg");
  const size_t fds_before = out.fds.size();
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out.fds.emplace_back(fd);
      }
    }
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == MSG_CTRUNC &&
      out.fds.size() - fds_before < kFdsPerMessage) {
    // Room for every fd of the message, yet fewer came: they did not fit this process's
    // descriptor table (RLIMIT_NOFILE), and the kernel dropped the rest. Those received are
    // closed with `out`.
    rlimit limit{};
    getrlimit(RLIMIT_NOFILE, &limit);
    out.bytes.resize(static_cast<size_t>(n));  // Whether more parts follow (ReceiveMessage).
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of file descriptors: ", out.fds.size() - fds_before,
        " of a message's fds fit this process's table (its open-files limit is ",
        limit.rlim_cur, "; raise it, ulimit -n)"));
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || out.fds.size() > kMaxFds ||
      (static_cast<size_t>(n) > max_bytes &&
       std::string_view(out.bytes.data(), static_cast<size_t>(n)) != kMoreFds)) {
    return absl::DataLossError(absl::StrCat("message over ", max_bytes, " bytes or ", kMaxFds, " fds"));
  }
  out.bytes.resize(static_cast<size_t>(n));
  return absl::OkStatus();
}

}  // namespace

absl::Status SendMessage(int socket, std::string_view bytes, std::span<const int> fds,
                         absl::Duration timeout) {
  if (fds.size() > kMaxFds) {
    return absl::InvalidArgumentError(absl::StrCat("cannot pass ", fds.size(), " fds (max ", kMaxFds, ")"));
  }
  const absl::Time start = MonotonicNow();
  while (fds.size() > kFdsPerMessage) {
    if (absl::Status s = SendOne(socket, kMoreFds, fds.first(kFdsPerMessage), start, timeout);
        !s.ok()) {
      return s;
    }
    fds = fds.subspan(kFdsPerMessage);
  }
  return SendOne(socket, bytes, fds, start, timeout);
}

absl::StatusOr<ReceivedMessage> ReceiveMessage(int socket, size_t max_bytes,
                                               absl::Duration timeout) {
  const absl::Time start = MonotonicNow();
  ReceivedMessage out;
  bool continued = false;
  size_t fds_before = 0;
  int parts = 0;
  const absl::Status too_many_parts = absl::DataLossError(absl::StrCat(
      "message of more than ", kMaxParts, " parts (", kMaxFds, " fds at most, ", kFdsPerMessage,
      " a part)"));
  do {
    if (parts++ == kMaxParts) return too_many_parts;
    // The fds of the messages before (continuations) are kept in `out`.
    continued = continued || out.bytes == kMoreFds;
    fds_before = out.fds.size();
    if (absl::Status s = ReceiveOne(socket, max_bytes, start, timeout, out); !s.ok()) {
      if (absl::IsResourceExhausted(s)) {
        // Out of descriptors part-way: the message's other parts are read and dropped, so
        // that the next message read is the next one sent, not this one's rest.
        while (out.bytes == kMoreFds && parts++ < kMaxParts) {
          out.fds.clear();
          if (absl::Status rest = ReceiveOne(socket, max_bytes, start, timeout, out);
              !rest.ok() && !absl::IsResourceExhausted(rest)) {
            break;
          }
        }
      }
      return s;
    }
  } while (out.bytes == kMoreFds);
  if (continued && out.bytes.empty() && out.fds.size() == fds_before) {
    // The end of the stream where the message's last part should be: the sender went away
    // part-way (its fds, received so far, are closed with `out`).
    return absl::DataLossError(absl::StrCat("the connection closed part-way through a message, after ",
                                            fds_before, " of its fds"));
  }
  out.closed = out.bytes.empty() && out.fds.empty();
  return out;
}

namespace {

// A reply left queued on a connection whose other end is gone. A Unix socket closed with a
// message unread resets its peer, and the reset reads as an error once, ahead of what was
// queued: hence two tries.
std::optional<ReceivedMessage> QueuedReply(int socket, size_t max_bytes) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<ReceivedMessage> queued =
        ReceiveMessage(socket, max_bytes, absl::ZeroDuration());
    if (queued.ok()) {
      if (queued->closed) break;
      return *std::move(queued);
    }
    if (absl::IsDeadlineExceeded(queued.status()) || absl::IsDataLoss(queued.status())) break;
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<ReceivedMessage> Exchange(int socket, std::string_view bytes, size_t max_bytes,
                                         absl::Duration timeout) {
  const absl::Status sent = SendMessage(socket, bytes, {}, timeout);
  absl::StatusOr<ReceivedMessage> reply = sent.ok()
                                              ? ReceiveMessage(socket, max_bytes, timeout)
                                              : absl::StatusOr<ReceivedMessage>(sent);
  // A send that failed, or a reset (the server closed the connection with the request
  // unread); not a reply that was too long or carried more fds than fit (DataLoss) or than
  // this process's table holds (ResourceExhausted), nor a receive that waited out its timeout.
  const bool reset = !sent.ok() || (!reply.ok() && !absl::IsDeadlineExceeded(reply.status()) &&
                                    !absl::IsDataLoss(reply.status()) &&
                                    !absl::IsResourceExhausted(reply.status()));
  if (reset) {
    if (std::optional<ReceivedMessage> queued = QueuedReply(socket, max_bytes)) {
      return *std::move(queued);
    }
  }
  return reply;
}

absl::StatusOr<pid_t> PeerPid(int socket) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return Errno("SO_PEERCRED");
  return cred.pid;
}

}  // namespace ubep
