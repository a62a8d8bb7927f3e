// RecentVersions: the newest `capacity` of a set of plan versions, for decisions remembered
// per version (committed here, aborted by this process) that must not grow without bound
// while versions go on being used; the oldest are dropped first. Thread-compatible.
#ifndef UBEP_COMMON_RECENT_VERSIONS_H_
#define UBEP_COMMON_RECENT_VERSIONS_H_

#include <cstddef>
#include <cstdint>
#include <set>

namespace ubep {

class RecentVersions {
 public:
  explicit RecentVersions(size_t capacity) : capacity_(capacity) {}

  // Adds `version`; whether it is new and kept (one older than every version kept, with the
  // set full, goes at once).
  bool Insert(uint64_t version) {
    const bool added = versions_.insert(version).second;
    while (versions_.size() > capacity_) versions_.erase(versions_.begin());
    return added && versions_.contains(version);
  }
  bool contains(uint64_t version) const { return versions_.contains(version); }
  // Drops every version at or below `version`.
  void EraseUpTo(uint64_t version) {
    versions_.erase(versions_.begin(), versions_.upper_bound(version));
  }
  void clear() { versions_.clear(); }

 private:
  size_t capacity_;
  std::set<uint64_t> versions_;
};

}  // namespace ubep

#endif  // UBEP_COMMON_RECENT_VERSIONS_H_
