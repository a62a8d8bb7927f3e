// SharedArena: a block of shared memory (memfd) mapped into this process. Child processes
// forked after Create share the mapping; other processes map it from the fd (passed over a
// Unix socket) with Map. Move-only; the mapping and fd close on destruction.
// Thread-compatible.
#ifndef UBEP_KERNELS_HOST_SHARED_ARENA_H_
#define UBEP_KERNELS_HOST_SHARED_ARENA_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace ubep::kernels {

class SharedArena {
 public:
  // A new zero-filled arena of `bytes`; `name` shows in /proc/<pid>/fd.
  static absl::StatusOr<SharedArena> Create(const std::string& name, size_t bytes);
  // Maps an arena from its fd (duplicated; the caller keeps its own).
  static absl::StatusOr<SharedArena> Map(int fd);

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

 private:
  SharedArena(int fd, std::byte* data, size_t size) : fd_(fd), data_(data), size_(size) {}
  void Reset();

  int fd_ = -1;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_HOST_SHARED_ARENA_H_
