// The trailing metadata key by which ubepd marks the errors it answers itself, so that a
// client tells them ("not yet: attach again", refusals) from failures of the transport (ubepd
// not there), which gRPC reports with the same codes.
#ifndef UBEP_COMMON_RPC_ORIGIN_H_
#define UBEP_COMMON_RPC_ORIGIN_H_

namespace ubep {

inline constexpr char kUbepdOrigin[] = "ubep-origin";

}  // namespace ubep

#endif  // UBEP_COMMON_RPC_ORIGIN_H_
