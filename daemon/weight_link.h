// WeightLink: the daemons' NCCL communicator for expert-weight copies between load/store
// domains on the CUDA backend (ARCHITECTURE section 5: "from the nearest holder: same rank,
// same domain by peer copy, else NCCL").
//
// One communicator per plan's staging, over the group's daemons (one communicator rank per
// daemon, on device link rank modulo the devices it sees: the daemons of a link share one
// machine, so each takes another GPU). The first daemon makes the unique id
// (NewWeightLinkId, for the balancer's CreateLink), the balancer relays it in Prepare, every
// daemon joins (Connect) while it stages, runs its share of the copies (Exchange) and closes
// the communicator. Every call is bounded: NCCL runs non-blocking and a deadline aborts the
// communicator, so a daemon dying mid-staging fails the Prepare instead of hanging it.
//
// Built without NCCL (or without CUDA), NewWeightLinkId and Connect fail with
// FailedPrecondition; the daemons then read other domains' weights with ReadWeights.
// Thread-compatible.
#ifndef UBEP_DAEMON_WEIGHT_LINK_H_
#define UBEP_DAEMON_WEIGHT_LINK_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/device_memory.h"

namespace ubep::daemon {

class WeightLink {
 public:
  virtual ~WeightLink() = default;

  // One expert's weights to or from the daemon of communicator rank `peer`: `bytes` at
  // `offset` of a device arena of this daemon.
  struct Transfer {
    int peer = -1;
    bool send = false;
    DeviceMemory* memory = nullptr;
    size_t offset = 0;
    size_t bytes = 0;
  };
  // Runs the transfers as one NCCL group and waits for them, until `deadline` or until
  // `stopped()` says so (the plan aborted, ubepd draining: Cancelled, the link aborted). Per
  // peer, the sends and receives are matched in order with the peer's own list (both sides
  // walk one global schedule).
  virtual absl::Status Exchange(const std::vector<Transfer>& transfers, absl::Time deadline,
                                const std::function<bool()>& stopped) = 0;

  int rank() const { return rank_; }
  int size() const { return size_; }

 protected:
  WeightLink(int rank, int size) : rank_(rank), size_(size) {}

 private:
  int rank_, size_;
};

// A new unique id (ncclUniqueId bytes); this process is the communicator's bootstrap root
// until every rank has joined.
absl::StatusOr<std::string> NewWeightLinkId();

// Joins the communicator `id` as rank `rank` of `size` on `device`, waiting for every rank
// until `deadline`, or until `stopped()` says so (Cancelled).
absl::StatusOr<std::unique_ptr<WeightLink>> ConnectWeightLink(
    const std::string& id, int size, int rank, int device, absl::Time deadline,
    const std::function<bool()>& stopped);

}  // namespace ubep::daemon

#endif  // UBEP_DAEMON_WEIGHT_LINK_H_
