// Fixtures of the tests of ubepd's Node (node_test, node_fuzz_test): a rank of a group of a
// small model, and plan v2 of a group of two ranks of it.
#ifndef UBEP_TESTS_UNIT_NODE_FIXTURES_H_
#define UBEP_TESTS_UNIT_NODE_FIXTURES_H_

#include <cstdint>

#include "balancer/core/plan.h"
#include "ubep/v1/daemon.pb.h"

namespace ubep::daemon {

// Rank `rank` of a group of `world`: 2 layers x 8 experts, hidden 16, top-2, 8 tokens, 4 slots
// per rank, 256 bytes per expert.
inline v1::AttachRequest Request(uint32_t rank, uint32_t world) {
  v1::AttachRequest q;
  q.set_rank(rank);
  q.set_world_size(world);
  q.set_pid(100 + rank);
  v1::ModelShape* s = q.mutable_shape();
  s->set_num_layers(2);
  s->set_num_experts(8);
  s->set_hidden(16);
  s->set_top_k(2);
  s->set_max_tokens(8);
  s->set_slots_per_rank(4);
  s->set_bytes_per_expert(256);
  return q;
}

// Rank 0's slot 0 (expert 0) becomes expert 5 and rank 1's slot 1 (expert 5) becomes expert 0:
// both need weights from the other rank.
inline balancer::Plan SwappedPlan() {
  balancer::Plan plan;
  plan.version = 2;
  plan.topology = {2, 1, 4, 1};
  plan.num_experts = 8;
  for (int l = 0; l < 2; ++l) {
    balancer::LayerPlan layer;
    layer.slot_expert = {5, 1, 2, 3, 4, 0, 6, 7};
    balancer::SetEqualShares(8, layer);
    plan.layer_ids.push_back(l);
    plan.layers.push_back(layer);
  }
  return plan;
}

}  // namespace ubep::daemon

#endif  // UBEP_TESTS_UNIT_NODE_FIXTURES_H_
