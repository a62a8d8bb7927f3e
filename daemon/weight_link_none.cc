// WeightLink in a build without NCCL: no links; other domains' weights go through ReadWeights.
#include "daemon/weight_link.h"

namespace ubep::daemon {

absl::StatusOr<std::string> NewWeightLinkId() {
  return absl::FailedPreconditionError("ubepd was built without NCCL");
}

absl::StatusOr<std::unique_ptr<WeightLink>> ConnectWeightLink(const std::string&, int, int, int,
                                                              absl::Time,
                                                              const std::function<bool()>&) {
  return absl::FailedPreconditionError("ubepd was built without NCCL");
}

}  // namespace ubep::daemon
