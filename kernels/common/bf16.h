// bfloat16 <-> float conversion shared by every backend, benchmarks and tests: round to
// nearest even; every NaN becomes the one quiet NaN 0x7fc0. Bit-level, so host and device
// round identically: a GPU's float arithmetic gives its canonical NaN where x86 keeps the
// operand's sign and payload (or gives 0xffc00000 for inf - inf), so a NaN kept as it came
// would make the backends' bytes differ for the same non-finite expert output.
#ifndef UBEP_KERNELS_COMMON_BF16_H_
#define UBEP_KERNELS_COMMON_BF16_H_

#include <cstdint>
#include <cstring>

#include "kernels/common/host_device.h"

namespace ubep::kernels {

UBEP_HD inline float Bf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

UBEP_HD inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_BF16_H_
