// SharedArena: a block of shared memory (memfd) mapped into this process. Child processes
// forked after Create share the mapping; other processes map it from the fd (passed over a
// Unix socket) with Map. Move-only; the mapping and fd (if kept) close on destruction.
// Thread-compatible.
#ifndef UBEP_KERNELS_HOST_SHARED_ARENA_H_
#define UBEP_KERNELS_HOST_SHARED_ARENA_H_

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace ubep::kernels {

class SharedArena {
 public:
  // A new zero-filled arena of `bytes`; `name` shows in /proc/<pid>/fd.
  static absl::StatusOr<SharedArena> Create(const std::string& name, size_t bytes);
  // Maps an arena from its fd. kYes: keeps a duplicate of it (fd(), to pass the arena on);
  // kNo: keeps none (fd() is -1; the mapping stays valid), so that a process mapping every
  // rank's arena does not hold an fd per rank. The caller keeps its own either way.
  enum class KeepFd { kYes, kNo };
  static absl::StatusOr<SharedArena> Map(int fd, KeepFd keep = KeepFd::kYes);

  SharedArena() = default;  // Empty: no mapping (valid() is false).

  SharedArena(SharedArena&& other) noexcept;
  SharedArena& operator=(SharedArena&& other) noexcept;
  SharedArena(const SharedArena&) = delete;
  SharedArena& operator=(const SharedArena&) = delete;
  ~SharedArena();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  bool valid() const { return data_ != nullptr; }
  // Whether `fd` is this arena's memory (the same memfd), kept fd or not.
  bool SameFile(int fd) const;

 private:
  SharedArena(int fd, std::byte* data, size_t size, dev_t device, ino_t inode)
      : fd_(fd), data_(data), size_(size), device_(device), inode_(inode) {}
  void Reset();

  int fd_ = -1;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  dev_t device_ = 0;  // The memfd's identity (fstat).
  ino_t inode_ = 0;
};

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_SHARED_ARENA_H_
