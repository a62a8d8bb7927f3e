// What tells one model from another: an EP group's world size and the fields of its
// v1::ModelShape. ubepd makes a new group when any of them changes, and ubep-balancer takes
// a daemon's group into the cluster only when all of them equal the cluster's; both name the
// fields that differ with this one list.
#ifndef UBEP_COMMON_MODEL_SHAPE_H_
#define UBEP_COMMON_MODEL_SHAPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ubep/v1/daemon.pb.h"

namespace ubep {

// One field where two models differ, named as in the protos (world_size, num_layers, ...),
// its values as text (a dtype by its enum name).
struct ModelFieldDifference {
  const char* field;
  std::string value;  // the model compared
  std::string other;  // the model compared against
};

// Every field where (world, shape) differs from (other_world, other_shape): world_size first,
// then ModelShape's fields in their proto order. Empty when the models are the same.
std::vector<ModelFieldDifference> ModelDifferences(uint32_t world, const v1::ModelShape& shape,
                                                   uint32_t other_world,
                                                   const v1::ModelShape& other_shape);

}  // namespace ubep

#endif  // UBEP_COMMON_MODEL_SHAPE_H_
