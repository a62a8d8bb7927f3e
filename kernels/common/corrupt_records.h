// The check of the records a source stored in a destination's dispatch landing, worded once
// for both backends: the host backend finds a bad record while it lays the rows out, the CUDA
// backend on the device (CountKernel), and each words what it found from the records as they
// lie (host memory, or a copy of the device's), so the two say the same.
#ifndef UBEP_KERNELS_COMMON_CORRUPT_RECORDS_H_
#define UBEP_KERNELS_COMMON_CORRUPT_RECORDS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/common/routing.h"

namespace ubep::kernels {

// Record j of a source's records (record_bytes apart), and entry q of it.
inline RecordHeader RecordHeaderAt(const std::byte* records, size_t record_bytes, size_t j) {
  RecordHeader header;
  std::memcpy(&header, records + j * record_bytes, sizeof(header));
  return header;
}
inline RecordEntry RecordEntryAt(const std::byte* records, size_t record_bytes, size_t j, int q) {
  RecordEntry entry;
  std::memcpy(&entry,
              records + j * record_bytes + sizeof(RecordHeader) + q * sizeof(RecordEntry),
              sizeof(entry));
  return entry;
}

// What is first wrong with a source's records under its count word, or "" if nothing: the
// count within MostRecords, each record's token within [0, max_tokens) and its entries within
// [1, max_entries] (MaxPairsPerToken), each entry's slot within [0, slots_per_rank). `records` is read only as far as the count
// allows (at most MostRecords records).
inline std::string CorruptRecordsWhat(uint32_t count_word, const std::byte* records,
                                      size_t record_bytes, int max_tokens, int flagged_tokens,
                                      int max_entries, int slots_per_rank) {
  const uint32_t count = RecordCount(count_word);
  const uint32_t most = MostRecords(count_word, max_tokens, flagged_tokens);
  if (count > most) {
    return absl::StrCat(count, " records, over ",
                        CountIsFlagged(count_word) ? "flagged_tokens " : "max_tokens ", most);
  }
  for (uint32_t j = 0; j < count; ++j) {
    const RecordHeader header = RecordHeaderAt(records, record_bytes, j);
    if (header.token < 0 || header.token >= max_tokens) {
      return absl::StrCat("record ", j, " names token ", header.token, " of max_tokens ",
                          max_tokens);
    }
    if (header.num_entries < 1 || header.num_entries > max_entries) {
      return absl::StrCat("record ", j, " has ", header.num_entries, " entries, outside [1, ",
                          max_entries, "]");
    }
    for (int q = 0; q < header.num_entries; ++q) {
      const int32_t slot = RecordEntryAt(records, record_bytes, j, q).local_slot;
      if (slot < 0 || slot >= slots_per_rank) {
        return absl::StrCat("record ", j, " entry ", q, " names local slot ", slot, " of ",
                            slots_per_rank);
      }
    }
  }
  return "";
}

// The error of a dispatch call whose records from `source` are corrupt (`what`:
// CorruptRecordsWhat): the call gives up on the source, on every rank of the group. To this
// rank it is the group stopped (Unavailable: Rejoin), as after a timeout, not memory of its
// own or its daemon's gone bad (DataLoss, which a Rejoin would read again).
inline absl::Status CorruptRecordsStatus(int rank, int source, uint32_t call,
                                         absl::string_view what) {
  return absl::UnavailableError(absl::StrCat("rank ", rank, ": rank ", source,
                                          "'s records of dispatch call ", call, " are corrupt (",
                                          what.empty() ? "found so, and whole when read again"
                                                       : what,
                                          "); the group gave up on rank ", source));
}

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_CORRUPT_RECORDS_H_
