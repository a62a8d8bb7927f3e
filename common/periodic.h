// PeriodicThread: runs a function every interval on its own thread until destroyed; the
// destructor wakes it at once and joins. The interval is read before every wait, so the
// function may change it through the getter's state.
//
//   PeriodicThread harvester([&] { return interval; }, [&] { Harvest(); });
//
// Thread-safe; the function runs on one thread, never concurrently with itself.
#ifndef UBEP_COMMON_PERIODIC_H_
#define UBEP_COMMON_PERIODIC_H_

#include <functional>
#include <thread>
#include <utility>

#include "absl/time/time.h"
#include "common/mutex.h"

namespace ubep {

class PeriodicThread {
 public:
  PeriodicThread(std::function<absl::Duration()> interval, std::function<void()> fn)
      : interval_(std::move(interval)), fn_(std::move(fn)), thread_([this] { Loop(); }) {}
  ~PeriodicThread() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;

 private:
  void Loop() {
    while (true) {
      const absl::Duration wait = interval_();
      MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; },
                               wait)) {
        return;
      }
      mu_.Unlock();
      fn_();
      mu_.Lock();
    }
  }

  const std::function<absl::Duration()> interval_;
  const std::function<void()> fn_;
  Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // Last: starts after the members it uses.
};

}  // namespace ubep

#endif  // UBEP_COMMON_PERIODIC_H_
