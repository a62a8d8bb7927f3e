// SplitMix64: a fast 64-bit mixer for seeding and deterministic tie-breaks (not for
// cryptography). Same input, same output, on every platform.
#ifndef UBEP_COMMON_HASH_H_
#define UBEP_COMMON_HASH_H_

#include <cstdint>

namespace ubep {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace ubep

#endif  // UBEP_COMMON_HASH_H_
