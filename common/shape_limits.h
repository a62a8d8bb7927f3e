// The largest model shape ubepd and ubep-balancer take, checked where a shape first arrives
// (ubepd's Attach, the balancer's Register), so that no size computed from it overflows or
// asks for more memory than a node has.
#ifndef UBEP_COMMON_SHAPE_LIMITS_H_
#define UBEP_COMMON_SHAPE_LIMITS_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ubep {

inline constexpr uint32_t kMaxWorld = 1024;        // Ranks of an EP group.
inline constexpr uint32_t kMaxExperts = 1024;      // Logical experts per layer.
inline constexpr uint32_t kMaxLayers = 4096;       // MoE layers.
inline constexpr uint32_t kMaxSlotsPerRank = 4096;
inline constexpr uint32_t kMaxTokens = 1u << 20;     // A rank's tokens per call.
inline constexpr uint32_t kMaxHidden = 1u << 16;     // Elements of a token's row.

// The highest plan version: a balancer numbers its plans one above the highest it knows, which
// past this would wrap to 0 (a version below every daemon's) and never commit again.
inline constexpr uint64_t kMaxPlanVersion = (uint64_t{1} << 63) - 1;
// The highest step (libubep's BeginStep refuses one above: a negative one passed as unsigned).
inline constexpr uint64_t kMaxStep = (uint64_t{1} << 63) - 1;

// A node's name (ubepd --node, the balancer's Register) goes into every daemon's view of the
// group, metric labels and log lines: a host or Kubernetes node name, at most this long, of
// letters, digits, '.', '-' and '_'.
inline constexpr size_t kMaxNodeName = 253;
inline bool ValidNodeName(std::string_view name) {
  if (name.empty() || name.size() > kMaxNodeName) return false;
  for (const char c : name) {
    const bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
    if (!alnum && c != '.' && c != '-' && c != '_') return false;
  }
  return true;
}

// The largest control-plane message every gRPC peer of the project takes (a plan carries
// about 10 bytes per slot and layer: 1024 ranks x 8 slots x 58 layers is 4.7 MB, past gRPC's
// default of 4 MiB).
inline constexpr int kMaxControlMessageBytes = 64 << 20;

}  // namespace ubep

#endif  // UBEP_COMMON_SHAPE_LIMITS_H_
