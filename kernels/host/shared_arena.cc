#include "kernels/host/shared_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ubep::kernels {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::ResourceExhaustedError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<SharedArena> SharedArena::Create(const std::string& name, size_t bytes) {
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno(absl::StrCat("memfd_create(", name, ")"));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    absl::Status s = Errno(absl::StrCat("ftruncate(", name, ", ", bytes, " bytes)"));
    close(fd);
    return s;
  }
  // Its size is final: a process it is passed to (a client, a peer daemon) cannot shrink it
  // under the others' mappings, whose next access past the new end would raise SIGBUS.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    absl::Status s = Errno(absl::StrCat("sealing the size of ", name));
    close(fd);
    return s;
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    absl::Status s = Errno(absl::StrCat("mmap(", name, ", ", bytes, " bytes)"));
    close(fd);
    return s;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status s = Errno(absl::StrCat("fstat(", name, ")"));
    munmap(data, bytes);
    close(fd);
    return s;
  }
  return SharedArena(fd, static_cast<std::byte*>(data), bytes, st.st_dev, st.st_ino);
}

absl::StatusOr<SharedArena> SharedArena::Map(int fd, KeepFd keep) {
  struct stat st;
  if (fstat(fd, &st) != 0) return Errno(absl::StrCat("fstat(fd ", fd, ")"));
  int own = -1;
  if (keep == KeepFd::kYes) {
    own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return Errno(absl::StrCat("dup(fd ", fd, ")"));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    absl::Status s = Errno(absl::StrCat("mmap(fd ", fd, ", ", bytes, " bytes)"));
    if (own >= 0) close(own);
    return s;
  }
  return SharedArena(own, static_cast<std::byte*>(data), bytes, st.st_dev, st.st_ino);
}

bool SharedArena::SameFile(int fd) const {
  struct stat st;
  return valid() && fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == device_ &&
         st.st_ino == inode_;
}

SharedArena::SharedArena(SharedArena&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(std::exchange(other.device_, 0)),
      inode_(std::exchange(other.inode_, 0)) {}

SharedArena& SharedArena::operator=(SharedArena&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = std::exchange(other.device_, 0);
    inode_ = std::exchange(other.inode_, 0);
  }
  return *this;
}

SharedArena::~SharedArena() { Reset(); }

void SharedArena::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
  device_ = 0;
  inode_ = 0;
}

}  // namespace ubep::kernels
