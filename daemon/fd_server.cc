#include "daemon/fd_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "common/logging.h"

namespace ubep::daemon {
namespace {

constexpr size_t kMaxTokenBytes = 256;

}  // namespace

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(const std::string& path, mode_t mode,
                                                          Node* node) {
  absl::StatusOr<UniqueFd> listener = ListenUnix(path, mode);
  if (!listener.ok()) return listener.status();
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return absl::ErrnoToStatus(errno, "eventfd");
  return std::unique_ptr<FdServer>(
      new FdServer(*std::move(listener), std::move(wake), path, node));
}

FdServer::FdServer(UniqueFd listener, UniqueFd wake, std::string path, Node* node)
    : listener_(std::move(listener)),
      wake_(std::move(wake)),
      path_(std::move(path)),
      node_(node),
      thread_([this] { Loop(); }) {}

FdServer::~FdServer() {
  const uint64_t one = 1;
  if (write(wake_.get(), &one, sizeof(one)) < 0) UBEP_LOG(ERROR) << "fd server: wake failed";
  thread_.join();
  unlink(path_.c_str());
}

bool FdServer::Serve(int64_t id, int fd) {
  absl::StatusOr<ReceivedMessage> message = ReceiveMessage(fd, kMaxTokenBytes, absl::ZeroDuration());
  if (!message.ok() || message->closed) {
    node_->ConnectionClosed(id);
    return false;
  }
  absl::StatusOr<std::vector<int>> fds = node_->ClaimArenas(message->bytes, id);
  if (!fds.ok()) {
    // One message: a status line the client turns into its error.
    const std::string reply = "ERR " + std::string(fds.status().message());
    (void)SendMessage(fd, reply, {});
    return false;
  }
  if (absl::Status sent = SendMessage(fd, "OK", *fds); !sent.ok()) {
    UBEP_LOG(WARNING) << "fd server: sending arenas failed: " << sent;
    node_->ConnectionClosed(id);
    return false;
  }
  return true;
}

void FdServer::Loop() {
  while (true) {
    std::vector<pollfd> polls{{wake_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}};
    std::vector<int64_t> ids;
    for (const auto& [id, fd] : connections_) {
      polls.push_back({fd.get(), POLLIN, 0});
      ids.push_back(id);
    }
    if (poll(polls.data(), polls.size(), -1) < 0) {
      if (errno == EINTR) continue;
      UBEP_LOG(ERROR) << "fd server: poll failed: " << strerror(errno);
      return;
    }
    if (polls[0].revents != 0) return;
    if (polls[1].revents & POLLIN) {
      UniqueFd conn(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.valid()) connections_.emplace(next_id_++, std::move(conn));
    }
    for (size_t i = 2; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      const int64_t id = ids[i - 2];
      if (!Serve(id, polls[i].fd)) connections_.erase(id);
    }
  }
}

}  // namespace ubep::daemon
