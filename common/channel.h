// The channels UBEP's processes open to each other's control services (ubepd to the balancer,
// the balancer to each ubepd, a daemon to a peer's weights).
#ifndef UBEP_COMMON_CHANNEL_H_
#define UBEP_COMMON_CHANNEL_H_

#include <memory>
#include <string>

#include "grpcpp/channel.h"

namespace ubep {

// gRPC's reconnect backoff grows to 120 s by default, and a call on a channel in backoff fails
// at once (UNAVAILABLE) without trying: a balancer restarted after a minute's outage was not
// seen by its daemons for tens of seconds more, past its recovery and registration graces.
// Here it is capped at this: one connection attempt a second at most, on loopback or a
// cluster's network.
inline constexpr int kMaxReconnectBackoffMs = 1000;

// An insecure channel to `target` (HOST:PORT, unix:PATH) that takes answers of up to
// `max_receive_bytes` (gRPC's default, 4 MiB, when 0), reconnecting as above.
std::shared_ptr<grpc::Channel> ControlChannel(const std::string& target, int max_receive_bytes = 0);

}  // namespace ubep

#endif  // UBEP_COMMON_CHANNEL_H_
