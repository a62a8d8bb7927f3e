// Flag-in-granule rows ("data as flag"): ubep's landing format for small dispatches, shared
// by both backends so that they decide it, lay it out and check it the same way.
//
// A row of B bytes (B a multiple of 8) is stored as B / 4 granules of 8 bytes: the low 4
// bytes carry 4 bytes of the row, the high 4 bytes the call's tag (its epoch). A granule is
// stored and loaded as one aligned 64-bit access, which both memory models make single-copy
// atomic (C++ std::atomic<uint64_t>, PTX's 64-bit strong accesses), so a receiver that loads
// a granule carrying this call's tag has this call's 4 data bytes with it: no fence and no
// flag between the data and the receiver, and a row can be used as soon as its granules are
// in (docs/dataplane.md, "Flag-in-granule rows"). The cost is twice the bytes per row, which
// is why only calls of up to EpConfig::flagged_tokens tokens use it (decode, where the fence
// and the flag round trip weigh more than the bytes).
//
// The format is per (source, call): source s uses it for a call when the call is ubep, its
// row size allows it and its token count is at most flagged_tokens (FlaggedRows below); it
// sets kFlaggedCount in the count word it stores at each destination, so the receiver reads
// the format with the count, before any row. The combine partials the destination sends back
// to s use the same format, decided by the same bit.
//
// Flagged rows have their own bytes in a landing: a source's part holds max_tokens plain rows,
// then flagged_tokens flagged ones (LandingRowOffset). Were they to share bytes, the data of an
// earlier plain row, read as granules, could carry any tag, the current one too.
//
// Tags are compared for equality, so a granule left from an earlier call must never carry the
// tag of the current one. Epochs count calls modulo 2^32; a granule is stale by exactly a
// multiple of 2^32 calls only if nobody wrote it for that long. Every kTagScrubPeriod calls,
// each rank rewrites the tags of its own landing (rows after it placed them, partials after
// it summed them; no peer stores into them in between, docs/dataplane.md) to ScrubTag, which
// the next kTagScrubPeriod epochs cannot equal; a reset of the group zeroes the landing
// (tag 0: epochs restart from 1 and are scrubbed before they wrap). So every tag in a landing
// is 0, a scrub tag, or from the last kTagScrubPeriod calls, and none equals the current
// epoch before this call stores it.
#ifndef UBEP_KERNELS_COMMON_FLAGGED_ROWS_H_
#define UBEP_KERNELS_COMMON_FLAGGED_ROWS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace ubep::kernels {

inline constexpr size_t kGranuleBytes = 8;      // 4 data bytes, then a 4-byte tag.
inline constexpr size_t kGranuleDataBytes = 4;
inline constexpr uint32_t kFlaggedCount = 0x80000000u;  // In a count word: flagged rows.
inline constexpr uint32_t kTagScrubPeriod = 1u << 30;

// Bytes of a row of `row_bytes` in the flagged format.
UBEP_HD inline size_t FlaggedRowBytes(size_t row_bytes) { return 2 * row_bytes; }

// Whether a source calling with `num_tokens` tokens stores flagged rows (and gets flagged
// partials back): ubep, rows a multiple of 8 bytes (granules stay aligned), and no more
// tokens than the landing holds in this format (flagged_tokens, ArenaLayout::row_stride).
// Whether rows of `row_bytes` can be flagged: whole granules, 8-byte aligned ones.
UBEP_HD inline bool FlaggedRowsFit(size_t row_bytes) { return row_bytes % 8 == 0; }

UBEP_HD inline bool FlaggedRows(bool ubep, int num_tokens, int flagged_tokens,
                                size_t row_bytes) {
  return ubep && num_tokens > 0 && num_tokens <= flagged_tokens && FlaggedRowsFit(row_bytes);
}

// Where row j of one source's part of a landing (rows or partials) starts, from that part's
// start: the plain rows first, then the flagged ones.
UBEP_HD inline size_t LandingRowOffset(size_t row_bytes, int max_tokens, bool flagged, int j) {
  return flagged ? static_cast<size_t>(max_tokens) * row_bytes +
                       static_cast<size_t>(j) * FlaggedRowBytes(row_bytes)
                 : static_cast<size_t>(j) * row_bytes;
}

UBEP_HD inline uint32_t RecordCount(uint32_t count_word) { return count_word & ~kFlaggedCount; }
UBEP_HD inline bool CountIsFlagged(uint32_t count_word) {
  return (count_word & kFlaggedCount) != 0;
}

// The records a source may store per call under its count word: flagged_tokens for flagged
// rows, else max_tokens (what the receiver checks the count against, on either backend).
UBEP_HD inline uint32_t MostRecords(uint32_t count_word, int max_tokens, int flagged_tokens) {
  return static_cast<uint32_t>(CountIsFlagged(count_word) ? flagged_tokens : max_tokens);
}

UBEP_HD inline uint64_t Granule(uint32_t data, uint32_t tag) {
  return static_cast<uint64_t>(tag) << 32 | data;
}
UBEP_HD inline uint32_t GranuleTag(uint64_t granule) {
  return static_cast<uint32_t>(granule >> 32);
}
UBEP_HD inline uint32_t GranuleData(uint64_t granule) { return static_cast<uint32_t>(granule); }

// Whether the landing's tags are rewritten at the end of call `epoch`, and with what.
UBEP_HD inline bool TagScrubDue(uint32_t epoch) { return epoch % kTagScrubPeriod == 0; }
UBEP_HD inline uint32_t ScrubTag(uint32_t epoch) { return epoch + 0x80000000u; }

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_FLAGGED_ROWS_H_
