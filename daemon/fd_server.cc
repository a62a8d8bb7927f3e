#include "daemon/fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace ubep::daemon {
namespace {

constexpr size_t kMaxTokenBytes = 1024;  // A token, or a peer request with the group's shape.
// How long the listener rests after an accept that failed for want of a resource (no spare
// file descriptor either, or no memory): its connection stays queued, and polling it again at
// once would spin.
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

UniqueFd OpenSpare() { return UniqueFd(open("/dev/null", O_RDONLY | O_CLOEXEC)); }

}  // namespace

absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> FetchPeerArenas(
    const std::string& socket_path, const std::string& key, absl::Duration timeout) {
  UBEP_ASSIGN_OR_RETURN(UniqueFd socket, ConnectUnix(socket_path, timeout));
  UBEP_ASSIGN_OR_RETURN(ReceivedMessage reply,
                        Exchange(socket.get(), absl::StrCat(kPeerRequest, key), 4096, timeout));
  int first = 0;
  if (!absl::StartsWith(reply.bytes, "OK ") ||
      !absl::SimpleAtoi(absl::string_view(reply.bytes).substr(3), &first)) {
    return absl::UnavailableError(absl::StrCat(
        "the daemon at ", socket_path, " did not give its arenas: ",
        reply.bytes.size() > 4 ? reply.bytes.substr(4) : std::string("connection closed")));
  }
  return std::make_pair(first, std::move(reply.fds));
}

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(const std::string& path, mode_t mode,
                                                          Node* node, FdServerOptions options) {
  absl::StatusOr<UniqueFd> listener = ListenUnix(path, mode);
  if (!listener.ok()) return listener.status();
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return absl::ErrnoToStatus(errno, "eventfd");
  return std::unique_ptr<FdServer>(
      new FdServer(*std::move(listener), std::move(wake), path, node, options));
}

FdServer::FdServer(UniqueFd listener, UniqueFd wake, std::string path, Node* node,
                   FdServerOptions options)
    : listener_(std::move(listener)),
      wake_(std::move(wake)),
      spare_(OpenSpare()),
      path_(std::move(path)),
      node_(node),
      options_(options),
      thread_([this] { Loop(); }) {}

FdServer::~FdServer() {
  const uint64_t one = 1;
  if (write(wake_.get(), &one, sizeof(one)) < 0) UBEP_LOG(ERROR) << "fd server: wake failed";
  thread_.join();
  unlink(path_.c_str());
}

namespace {

std::vector<int> Raw(const std::vector<UniqueFd>& fds) {
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  return raw;
}

template <typename T>
std::string StatusLine(const absl::StatusOr<T>& result, const std::string& ok) {
  return result.ok() ? ok : absl::StrCat("ERR ", result.status().message());
}

}  // namespace

absl::Status FdServer::Reply(const Connection& connection, const std::string& bytes,
                             const std::vector<UniqueFd>& fds) const {
  absl::Status sent = SendMessage(connection.fd.get(), bytes, Raw(fds), options_.send_timeout);
  if (!sent.ok()) {
    UBEP_LOG(WARNING) << "fd server: a reply to " << connection.who << " was not sent: " << sent;
  }
  return sent;
}

bool FdServer::Serve(int64_t id, const Connection& connection, std::string& why) {
  const int fd = connection.fd.get();
  absl::StatusOr<ReceivedMessage> message = ReceiveMessage(fd, kMaxTokenBytes, absl::ZeroDuration());
  if (!message.ok()) {
    // A reset is its client gone (it died with a reply unread); anything else, ubepd's doing.
    if (!absl::IsUnavailable(message.status())) {
      why = absl::StrCat("a message it could not take: ", message.status().ToString());
    }
    return false;
  }
  if (message->closed) return false;
  static const std::vector<UniqueFd> kNone;
  if (absl::StartsWith(message->bytes, kPeerRequest)) {
    absl::StatusOr<std::pair<int, std::vector<UniqueFd>>> arenas =
        node_->ArenasForPeer(message->bytes.substr(sizeof(kPeerRequest) - 1));
    (void)Reply(connection, StatusLine(arenas, arenas.ok() ? absl::StrCat("OK ", arenas->first) : ""),
                arenas.ok() ? arenas->second : kNone);
    return false;
  }
  if (message->bytes == kArenaRefreshRequest) {
    absl::StatusOr<std::pair<uint64_t, std::vector<UniqueFd>>> arenas = node_->RefreshArenas(id);
    if (absl::Status sent =
            Reply(connection, StatusLine(arenas, arenas.ok() ? absl::StrCat("OK ", arenas->first) : ""),
                  arenas.ok() ? arenas->second : kNone);
        !sent.ok()) {
      why = absl::StrCat("its client did not take a reply: ", sent.ToString());
      return false;
    }
    // The connection still holds its rank; one that holds none has nothing to keep open.
    return !absl::IsFailedPrecondition(arenas.status());
  }
  absl::StatusOr<std::vector<UniqueFd>> fds = node_->ClaimArenas(message->bytes, id);
  // On failure, one message: a status line the client turns into its error.
  const absl::Status sent = Reply(connection, StatusLine(fds, "OK"), fds.ok() ? *fds : kNone);
  if (!fds.ok()) why = absl::StrCat("a claim refused: ", fds.status().ToString());
  if (!sent.ok()) why = absl::StrCat("its client did not take a reply: ", sent.ToString());
  return sent.ok() && fds.ok();
}

int FdServer::Unclaimed(absl::Time now) const {
  int unclaimed = 0;
  for (const auto& [id, connection] : connections_) {
    unclaimed += connection.close_at != absl::InfiniteFuture() && connection.close_at > now;
  }
  return unclaimed;
}

void FdServer::Accept(absl::Time now) {
  // The spare descriptor goes back as soon as one is free (another thread may have taken the
  // one it gave up).
  if (!spare_.valid()) spare_ = OpenSpare();
  UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  std::string refusal;
  if (!conn.valid()) {
    const int error = errno;
    if (error == ECONNABORTED || error == EINTR || error == EAGAIN || error == EWOULDBLOCK) {
      return;  // Nothing is queued any more, or it is taken next.
    }
    // Anything else (out of file descriptors or memory, a security module refusing the
    // accept, EPROTO) may leave the connection queued: the listener rests below rather than
    // being polled, readable, and failed again at once.
    if ((error == EMFILE || error == ENFILE) && spare_.valid()) {
      // Out of file descriptors: the spare one makes room to tell the client so.
      spare_ = UniqueFd();
      conn = UniqueFd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    }
    if (!conn.valid()) {
      // Not even that: the connection stays queued, and the listener rests.
      if (!spare_.valid()) spare_ = OpenSpare();
      listen_again_ = now + kAcceptBackoff;
      if (now >= next_accept_error_log_) {
        next_accept_error_log_ = now + absl::Seconds(10);
        UBEP_LOG(ERROR) << "fd server: cannot accept a connection: " << strerror(error)
                        << "; trying again every "
                        << absl::FormatDuration(kAcceptBackoff);
      }
      return;
    }
    refusal = absl::StrCat("ERR the daemon is out of file descriptors (", strerror(error),
                           "); attach again later");
  } else if (const int unclaimed = Unclaimed(now); unclaimed >= options_.max_unclaimed) {
    const std::string held = absl::StrCat("the daemon holds ", unclaimed,
                                          " connections that claimed no rank yet (at most ",
                                          options_.max_unclaimed, ")");
    // The oldest that sent nothing makes room (ids grow with each accept).
    auto silent = std::find_if(connections_.begin(), connections_.end(), [&](const auto& entry) {
      const Connection& c = entry.second;
      return !c.spoke && c.close_at != absl::InfiniteFuture() && c.close_at > now;
    });
    if (silent != connections_.end()) {
      (void)SendMessage(silent->second.fd.get(),
                        absl::StrCat("ERR ", held, "; this one, the oldest that sent nothing, is "
                                     "closed to make room: attach again"),
                        {}, absl::ZeroDuration());
      if (now >= next_accept_log_) {
        next_accept_log_ = now + absl::Seconds(10);
        UBEP_LOG(WARNING) << "fd server: " << held << ": closed the connection of "
                          << silent->second.who << ", the oldest that sent nothing";
      }
      connections_.erase(silent);
    } else {
      refusal = absl::StrCat("ERR ", held, "; attach again later");
    }
  }
  if (refusal.empty()) {
    const absl::StatusOr<pid_t> pid = PeerPid(conn.get());
    std::string who = pid.ok() ? absl::StrCat("pid ", *pid) : "a process of unknown pid";
    connections_.emplace(next_id_++, Connection{std::move(conn), now + options_.unclaimed_timeout,
                                                std::move(who)});
    return;
  }
  if (now >= next_accept_log_) {
    next_accept_log_ = now + absl::Seconds(10);
    UBEP_LOG(WARNING) << "fd server: a connection was refused: " << refusal.substr(4);
  }
  // A fresh connection's queue is empty: the one message goes at once, or not at all.
  (void)SendMessage(conn.get(), refusal, {}, absl::ZeroDuration());
  conn = UniqueFd();
  if (!spare_.valid()) spare_ = OpenSpare();
}

void FdServer::Loop() {
  while (true) {
    // The listener rests after an accept that could not take its connection.
    const bool listening = MonotonicNow() >= listen_again_;
    std::vector<pollfd> polls{{wake_.get(), POLLIN, 0},
                              {listener_.get(), static_cast<short>(listening ? POLLIN : 0), 0}};
    std::vector<int64_t> ids;
    absl::Time next_close = listening ? absl::InfiniteFuture() : listen_again_;
    bool held = false;
    for (const auto& [id, connection] : connections_) {
      polls.push_back({connection.fd.get(), POLLIN, 0});
      ids.push_back(id);
      next_close = std::min(next_close, connection.close_at);
      held |= connection.close_at == absl::InfiniteFuture();
    }
    if (held) next_close = std::min(next_close, next_held_check_);
    const int timeout_ms =
        next_close == absl::InfiniteFuture() ? -1 : PollTimeoutMs(next_close - MonotonicNow());
    if (poll(polls.data(), polls.size(), timeout_ms) < 0) {
      const int error = errno;
      if (error == EINTR) continue;
      if (error == ENOMEM) {  // For a while: a moment, and again, unless told to stop.
        UBEP_LOG(WARNING) << "fd server: poll: " << strerror(error) << "; trying again";
        absl::SleepFor(absl::Milliseconds(100));
        // The wake (an eventfd, non-blocking) read here, as poll cannot: a stop under lasting
        // memory pressure ends the loop rather than hold ubepd's drain for good.
        if (uint64_t woken = 0; read(wake_.get(), &woken, sizeof(woken)) == sizeof(woken)) return;
        continue;
      }
      // Anything else does not pass (more fds than the open-files limit lets poll watch): a
      // daemon that says it serves but takes no claim and sees no client leave is worse than
      // one that stops, which its supervisor restarts and its clients see exit.
      UBEP_CHECK(false) << "fd server: poll failed: " << strerror(error)
                        << " (watching " << polls.size() << " fds)";
    }
    if (polls[0].revents != 0) return;
    const absl::Time now = MonotonicNow();
    for (size_t i = 2; i < polls.size(); ++i) {
      const int64_t id = ids[i - 2];
      Connection& connection = connections_.at(id);
      if (polls[i].revents != 0) {
        std::string why;  // Why ubepd closes it; empty: its client closed it.
        if (Serve(id, connection, why)) {
          connection.close_at = absl::InfiniteFuture();
          connection.spoke = true;
        } else {
          // Whatever ended it (the client closed it, a message out of place, a reply not
          // taken), a rank it held is gone: the client sees its connection closed. One that
          // held none, closed by ubepd, is logged here (a refused claim, a message it could
          // not take).
          if (!node_->ConnectionClosed(id, why) && !why.empty()) {
            UBEP_LOG(WARNING) << "fd server: closed the connection of " << connection.who
                              << ", which held no rank: " << why;
          }
          connections_.erase(id);
        }
      } else if (connection.close_at <= now) {
        UBEP_LOG(INFO) << "fd server: closed the connection of " << connection.who
                       << ", which held no rank for " << options_.unclaimed_timeout;
        connections_.erase(id);
      }
    }
    if (held && now >= next_held_check_) {
      next_held_check_ = now + options_.held_check_interval;
      for (auto& [id, connection] : connections_) {
        if (connection.close_at == absl::InfiniteFuture() && !node_->HoldsConnection(id)) {
          connection.close_at = now + options_.unclaimed_timeout;
        }
      }
    }
    // After the connections: one a client closed before it connected again makes room.
    if (polls[1].revents & POLLIN) Accept(now);
  }
}

}  // namespace ubep::daemon
