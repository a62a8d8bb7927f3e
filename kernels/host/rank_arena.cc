#include "kernels/host/rank_arena.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/common/plan_area.h"
#include "kernels/common/plan_table.h"

namespace ubep::kernels {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kDeviceAlignment = size_t{2} << 20;  // VMM granularity on current GPUs.

size_t AlignUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

int LatencyBucket(double seconds) {
  double bound = kLatencyBucketBase;
  for (int b = 0; b < kLatencyBuckets; ++b) {
    if (seconds <= bound) return b;
    bound *= kLatencyBucketFactor;
  }
  return kLatencyBuckets;
}

size_t MaxPlanTableBytes(const EpConfig& config) {
  const uint32_t slots = static_cast<uint32_t>(config.num_ranks * config.slots_per_rank);
  const uint32_t max_replicas = slots - static_cast<uint32_t>(config.num_experts) + 1;
  return PlanTableBytes(config.num_layers, config.num_experts, max_replicas,
                        static_cast<uint32_t>(config.num_ranks));
}

std::optional<size_t> RankArenaLayout::WeightBytes(const EpConfig& config,
                                                   size_t bytes_per_expert, int free_buffers) {
  const size_t buffers = static_cast<size_t>(config.slots_per_rank) +
                         static_cast<size_t>(std::max(free_buffers, 0));
  size_t stride = 0, per_layer = 0, total = 0;
  if (__builtin_add_overflow(bytes_per_expert, size_t{63}, &stride) ||
      __builtin_mul_overflow(stride / 64 * 64, buffers, &per_layer) ||
      __builtin_mul_overflow(per_layer, static_cast<size_t>(config.num_layers), &total)) {
    return std::nullopt;
  }
  return total;
}

RankArenaLayout RankArenaLayout::Compute(const EpConfig& config, size_t bytes_per_expert,
                                         int free_buffers, bool on_device) {
  RankArenaLayout l;
  l.on_device = on_device;
  size_t offset = 0;
  auto carve = [&](size_t bytes) {
    const size_t at = offset;
    offset = AlignUp(offset + bytes, kPage);
    return at;
  };
  l.buffers_per_layer = static_cast<uint32_t>(config.slots_per_rank + std::max(free_buffers, 0));
  l.weight_stride = AlignUp(bytes_per_expert, 64);
  const size_t weight_bytes = WeightBytes(config, bytes_per_expert, free_buffers).value_or(SIZE_MAX);
  l.ep_bytes = ArenaLayout(config).total_bytes;
  l.control = carve(sizeof(RankControl));
  if (!on_device) l.ep = carve(l.ep_bytes);
  l.plan_capacity = AlignUp(MaxPlanTableBytes(config), 64);
  l.plan = carve(PlanAreaBytes(l.plan_capacity));
  l.slot_map =
      carve(2 * sizeof(uint32_t) * static_cast<size_t>(config.num_layers) * config.slots_per_rank);
  if (!on_device) l.weights = carve(weight_bytes);
  l.total_bytes = offset;
  if (on_device) {
    l.device_weights = AlignUp(l.ep_bytes, kDeviceAlignment);
    l.device_bytes = l.device_weights + weight_bytes;
  }
  return l;
}

void FormatRankArena(std::byte* base, const RankArenaLayout& layout, const EpConfig& config,
                     int rank) {
  RankControl* control = ControlOf(base, layout);
  control->magic = kRankControlMagic;
  control->version = kRankArenaVersion;
  control->rank = static_cast<uint32_t>(rank);
  control->world_size = static_cast<uint32_t>(config.num_ranks);
  control->protocol = static_cast<uint16_t>(config.protocol);
  control->on_device = layout.on_device ? 1 : 0;
  control->flagged_tokens = static_cast<uint32_t>(config.flagged_tokens);
  control->buffers_per_layer = layout.buffers_per_layer;
  InitPlanArea(base + layout.plan, layout.plan_capacity);
  for (int b = 0; b < 2; ++b) {
    uint32_t* map = SlotMap(base, layout, config, b);
    for (int l = 0; l < config.num_layers; ++l) {
      for (int i = 0; i < config.slots_per_rank; ++i) map[l * config.slots_per_rank + i] = i;
    }
  }
}

namespace {

std::string DescribeSettings(uint32_t protocol, bool on_device, uint32_t flagged_tokens,
                             uint32_t buffers_per_layer) {
  return absl::StrCat("protocol ",
                      ProtocolName(static_cast<Protocol>(protocol)),
                      ", flagged_tokens ", flagged_tokens, ", ", buffers_per_layer,
                      " weight buffers per layer, ", on_device ? "device" : "host", " memory");
}

}  // namespace

std::string DataPlaneSettingsDiffer(const RankControl& peer, const RankArenaLayout& layout,
                                    const EpConfig& config) {
  const std::string theirs = DescribeSettings(peer.protocol, peer.on_device != 0,
                                              peer.flagged_tokens, peer.buffers_per_layer);
  const std::string ours =
      DescribeSettings(static_cast<uint32_t>(config.protocol), layout.on_device,
                       static_cast<uint32_t>(config.flagged_tokens), layout.buffers_per_layer);
  if (theirs == ours) return "";
  return absl::StrCat(theirs, "; this daemon's for ", ours);
}

}  // namespace ubep::kernels
