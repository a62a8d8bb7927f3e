// Mutex: a std::mutex with absl::Mutex-style conditions (Await re-checks its predicate whenever
// the mutex is released) and Abseil's thread-safety annotations.
//
//   ubep::Mutex mu;
//   int value ABSL_GUARDED_BY(mu);
//   { ubep::MutexLock lock(&mu); value = 1; }
//   { ubep::MutexLock lock(&mu); mu.Await([&] { return value > 0; }); }
//
// Why not absl::Mutex: Debian's Abseil is built without ThreadSanitizer, so TSan cannot see its
// synchronization and reports false races; std::mutex is intercepted by TSan.
// Thread-safe.
#ifndef UBEP_COMMON_MUTEX_H_
#define UBEP_COMMON_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/timeout.h"

namespace ubep {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  // Wakes every Await so it re-checks its predicate.
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.unlock();
    cv_.notify_all();
  }

  // Blocks until `ready()` holds; the mutex is held when ready() runs and on return.
  template <typename Predicate>
  void Await(Predicate ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    // Waiting releases the mutex too: let other waiters re-check what this thread changed.
    cv_.notify_all();
    cv_.wait(lock, ready);
    lock.release();
  }

  // As Await, giving up after `timeout`; returns whether ready() holds. An infinite timeout
  // (NeverEnds) waits for ready() alone.
  template <typename Predicate>
  bool AwaitWithTimeout(Predicate ready, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    cv_.notify_all();
    bool ok = true;
    if (NeverEnds(timeout)) {
      cv_.wait(lock, ready);
    } else {
      ok = cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), ready);
    }
    lock.release();
    return ok;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace ubep

#endif  // UBEP_COMMON_MUTEX_H_
