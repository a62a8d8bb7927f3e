// How UBEP's servers mark the errors they answer themselves, so that a client tells them
// ("not yet: attach again", refusals, "still being recovered") from failures of the transport
// (the server not there), which gRPC reports with the same codes (UNAVAILABLE above all).
#ifndef UBEP_COMMON_RPC_ORIGIN_H_
#define UBEP_COMMON_RPC_ORIGIN_H_

#include <memory>
#include <string>

#include "grpcpp/client_context.h"
#include "grpcpp/support/server_interceptor.h"

namespace ubep {

// The trailing metadata key of a server's own error; its value names the server.
inline constexpr char kUbepOrigin[] = "ubep-origin";

// A server interceptor that adds kUbepOrigin = `origin` to every error status the server's
// handlers return (an OK answer carries nothing more).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MarkOwnErrorsAs(
    std::string origin);

// Whether a failed call's error came from a UBEP server's handler (marked), not the transport.
inline bool AnsweredByServer(const grpc::ClientContext& context) {
  return context.GetServerTrailingMetadata().count(kUbepOrigin) > 0;
}

}  // namespace ubep

#endif  // UBEP_COMMON_RPC_ORIGIN_H_
