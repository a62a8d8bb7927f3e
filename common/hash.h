// SplitMix64: a fast 64-bit mixer for seeding and deterministic tie-breaks, and Fingerprint64
// of a byte string (not for cryptography). Same input, same output, on every platform.
#ifndef UBEP_COMMON_HASH_H_
#define UBEP_COMMON_HASH_H_

#include <cstdint>
#include <string_view>

namespace ubep {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A 64-bit fingerprint of `bytes`, the same in every process and on every platform (unlike
// absl::Hash, which is seeded per process): FNV-1a, then SplitMix64 to spread it.
inline uint64_t Fingerprint64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return SplitMix64(h);
}

}  // namespace ubep

#endif  // UBEP_COMMON_HASH_H_
