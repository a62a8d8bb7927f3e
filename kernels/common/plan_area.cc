#include "kernels/common/plan_area.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ubep::kernels {
namespace {

std::atomic<const std::function<void(int)>*> select_pause_for_testing{nullptr};
std::atomic<const std::function<void()>*> copy_pause_for_testing{nullptr};

uint64_t LoadVersion(PlanSlotHeader* slot) {
  return std::atomic_ref<uint64_t>(slot->version).load(std::memory_order_acquire);
}

uint32_t LoadState(PlanSlotHeader* slot) {
  return std::atomic_ref<uint32_t>(slot->state).load(std::memory_order_acquire);
}

// Sequentially consistent, as UndecidedAt's loads: the daemon stores kPrepared and then reads
// every rank's step, a rank stores its step and then looks for an undecided plan (BeginStep);
// either the rank sees the prepare, or the daemon sees the rank's step (a Dekker pair).
void StoreState(PlanSlotHeader* slot, uint32_t state) {
  std::atomic_ref<uint32_t>(slot->state).store(state, std::memory_order_seq_cst);
}

// The slot holding `version`, -1 if none does. A version aborted and prepared again may be
// in both slots (with no plan committed, the retry goes to the other slot): the live one, not
// the aborted one, is found.
int FindVersion(void* area, uint64_t version) {
  int aborted = -1;
  for (int i = 0; i < 2; ++i) {
    if (LoadVersion(PlanSlot(area, i)) != version) continue;
    const uint32_t state = LoadState(PlanSlot(area, i));
    if (state == kAborted) {
      aborted = i;
    } else if (state != kEmpty) {
      return i;
    }
  }
  return aborted;
}

// Whether slot `i` still holds committed `version`: read again after its words were read (a
// seqlock's second look). PreparePlan empties a slot before it writes any header word of it,
// and fences, so a reader that read any of the new plan's header words (version, effective
// step) sees the slot's state no longer the old plan's kCommitted, or the new plan's version.
// (The table's bytes are copied plainly; a copy that raced the writer is caught by this look
// and by comparing the copy with the buffer again, not by the memory model's word.)
bool StillCommitted(void* area, int i, uint64_t version) {
  std::atomic_thread_fence(std::memory_order_acquire);
  PlanSlotHeader* slot = PlanSlot(area, i);
  return LoadState(slot) == kCommitted && LoadVersion(slot) == version;
}

// The slot SelectPlan takes, -1 if none; `version` receives its version.
int SelectSlot(void* area, uint64_t step, uint64_t* version) {
  int best = -1;
  uint64_t best_version = 0;
  for (int i = 0; i < 2; ++i) {
    PlanSlotHeader* slot = PlanSlot(area, i);
    // State is published after the version and the table, so committed implies both visible;
    // but the slot may be emptied and rewritten (a newer plan) between the loads below, so
    // its version and step are taken only if it is still committed under that version after
    // them (a reader paused there must not take the old state with the new version).
    if (LoadState(slot) != kCommitted) continue;
    if (const auto* pause = select_pause_for_testing.load(std::memory_order_acquire)) (*pause)(i);
    const uint64_t v = LoadVersion(slot);
    const uint64_t effective =
        std::atomic_ref<uint64_t>(slot->effective_step).load(std::memory_order_relaxed);
    if (!StillCommitted(area, i, v)) continue;
    if (effective <= step && (best < 0 || v > best_version)) {
      best = i;
      best_version = v;
    }
  }
  if (best >= 0) *version = best_version;
  return best;
}

// The area's header against what the caller knows of it: every process mapping an arena can
// write it, and a buffer placed or sized by a word written over would be read or written out
// of the area.
absl::Status CheckAreaHeader(void* area, size_t capacity) {
  auto* header = static_cast<PlanAreaHeader*>(area);
  const uint32_t magic = std::atomic_ref<uint32_t>(header->magic).load(std::memory_order_relaxed);
  if (magic != kPlanAreaMagic) {
    return absl::DataLossError(absl::StrCat("the plan area's header has magic 0x", absl::Hex(magic),
                                            ", not 0x", absl::Hex(kPlanAreaMagic),
                                            ": something other than ubepd wrote over it"));
  }
  const uint64_t said =
      std::atomic_ref<uint64_t>(header->capacity_bytes).load(std::memory_order_relaxed);
  if (said != capacity) {
    return absl::DataLossError(absl::StrCat("the plan area's header says its buffers hold ",
                                            said, " bytes, not ", capacity,
                                            ": something other than ubepd wrote over it"));
  }
  return absl::OkStatus();
}

}  // namespace

void SetSelectPauseForTesting(const std::function<void(int)>* pause) {
  select_pause_for_testing.store(pause, std::memory_order_release);
}

void SetCopyPauseForTesting(const std::function<void()>* pause) {
  copy_pause_for_testing.store(pause, std::memory_order_release);
}

void InitPlanArea(void* area, size_t capacity_bytes) {
  std::memset(area, 0, sizeof(PlanAreaHeader) + 2 * sizeof(PlanSlotHeader));
  auto* header = static_cast<PlanAreaHeader*>(area);
  header->capacity_bytes = capacity_bytes;
  std::atomic_ref<uint32_t>(header->magic).store(kPlanAreaMagic, std::memory_order_release);
}

const PlanTableHeader* SelectPlan(void* area, uint64_t step, uint64_t* version) {
  uint64_t v = 0;
  const int slot = SelectSlot(area, step, &v);
  if (slot < 0) return nullptr;
  if (version != nullptr) *version = v;
  return PlanBuffer(area, slot);
}

absl::StatusOr<const PlanTableHeader*> SelectCheckedPlan(void* area, size_t capacity,
                                                         uint64_t step, CheckedPlan& checked,
                                                         uint64_t* version, int* buffer) {
  UBEP_RETURN_IF_ERROR(CheckAreaHeader(area, capacity));
  uint64_t v = 0;
  const int slot = SelectSlot(area, step, &v);
  if (slot < 0) return nullptr;
  // Placed by the reader's capacity (PlanBuffer would read the header's again).
  const auto* table = reinterpret_cast<const PlanTableHeader*>(PlanBufferAt(area, slot, capacity));
  if (checked.table[slot] != table || checked.version[slot] != v) {
    const uint64_t bytes =
        std::atomic_ref<uint64_t>(PlanSlot(area, slot)->table_bytes).load(std::memory_order_relaxed);
    absl::Status valid;
    std::vector<std::byte> copy;
    if (bytes > capacity) {
      valid = absl::InvalidArgumentError(
          absl::StrCat("plan table: ", bytes, " bytes, more than the area's ", capacity));
    } else {
      // A private copy: the check reads each header field more than once, and sizes what it
      // writes from them; the reader follows the copy, which nothing else writes.
      copy.assign(reinterpret_cast<const std::byte*>(table),
                  reinterpret_cast<const std::byte*>(table) + bytes);
      if (const auto* pause = copy_pause_for_testing.load(std::memory_order_acquire)) (*pause)();
      valid = ValidatePlanTable(copy);
      // The table's own version is what the host backend reports as the call's plan; the
      // slot's is what selected it (and what the CUDA backend reports): one plan, one number.
      if (const auto* header = reinterpret_cast<const PlanTableHeader*>(copy.data());
          valid.ok() && header->version != v) {
        valid = absl::InvalidArgumentError(
            absl::StrCat("plan table: it says v", header->version, ", its slot v", v));
      }
      if (valid.ok() && std::memcmp(copy.data(), table, bytes) != 0) {
        valid = absl::AbortedError("plan table: changed while it was checked");
      }
    }
    // The slot rewritten since it was selected: its table would be another version's, however
    // well formed, and a copy torn by the rewrite fails the check for that, not for a foreign
    // write. ubepd prepares a plan only over a slot no rank's step still uses, so this is that
    // rule broken, not a client's write (whose message follows).
    if (!StillCommitted(area, slot, v)) {
      return absl::DataLossError(absl::StrCat(
          "plan v", v, " in force at step ", step, ": its slot was rewritten while it was read "
          "(a plan prepared over one a rank still used)"));
    }
    if (!valid.ok()) {
      return absl::DataLossError(absl::StrCat("plan v", v, " in force at step ", step,
                                              " is corrupt (", valid.message(),
                                              "): something other than ubepd wrote over it"));
    }
    checked.table[slot] = table;
    checked.version[slot] = v;
    checked.copy[slot] = std::move(copy);
  }
  if (version != nullptr) *version = v;
  if (buffer != nullptr) *buffer = slot;
  return reinterpret_cast<const PlanTableHeader*>(checked.copy[slot].data());
}

absl::Status PreparePlan(void* area, size_t capacity, std::span<const std::byte> table,
                         uint64_t version, uint64_t effective_step) {
  UBEP_RETURN_IF_ERROR(CheckAreaHeader(area, capacity));
  if (table.size() > capacity) {
    return absl::InvalidArgumentError(absl::StrCat("plan v", version, " needs ", table.size(),
                                                   " bytes; the plan area holds ", capacity));
  }
  if (absl::Status s = ValidatePlanTable(table); !s.ok()) return s;
  if (PlanTableHeader header; std::memcpy(&header, table.data(), sizeof(header)),
      header.version != version) {
    return absl::InvalidArgumentError(absl::StrCat("plan v", version, ": its table says v",
                                                   header.version));
  }
  int older = 0;
  uint64_t newest_committed = 0;
  int newest_committed_slot = -1;
  for (int i = 0; i < 2; ++i) {
    PlanSlotHeader* slot = PlanSlot(area, i);
    const uint32_t state = LoadState(slot);
    const uint64_t v = LoadVersion(slot);
    // An aborted plan holds no version back: it may be prepared again under its version (the
    // balancer catching a daemon up retries the cluster's plan), and an older one after it (a
    // Prepare under a version near 2^64, aborted, would otherwise leave none for the plans
    // after it; one delivered late is aborted by the balancer's recovery, as any plan left
    // pending is). What is committed, or awaits its decision, stays.
    if (state != kEmpty && state != kAborted && v >= version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "plan v", version, " is not newer than v", v, " already in the plan area"));
    }
    if (state == kCommitted && (newest_committed_slot < 0 || v > newest_committed)) {
      newest_committed = v;
      newest_committed_slot = i;
    }
  }
  // One decision at a time: never a second prepare while one awaits, in either slot.
  for (int i = 0; i < 2; ++i) {
    if (LoadState(PlanSlot(area, i)) == kPrepared) {
      return absl::FailedPreconditionError(
          absl::StrCat("plan v", version, " cannot be prepared while v",
                       LoadVersion(PlanSlot(area, i)), " awaits its commit or abort"));
    }
  }
  // Overwrite the slot that is not the newest committed plan.
  if (newest_committed_slot >= 0) {
    older = 1 - newest_committed_slot;
  } else {
    older = LoadVersion(PlanSlot(area, 0)) <= LoadVersion(PlanSlot(area, 1)) ? 0 : 1;
  }
  PlanSlotHeader* slot = PlanSlot(area, older);
  StoreState(slot, kEmpty);  // Readers skip it from here on.
  // Every word written below comes after the empty state for a reader that fences before it
  // looks at the state again (StillCommitted).
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(PlanBufferAt(area, older, capacity), table.data(), table.size());
  // Header words readers may load concurrently are atomics (readers skip this slot anyway:
  // its state is kEmpty until the version and step are in place).
  std::atomic_ref<uint64_t>(slot->table_bytes).store(table.size(), std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(slot->effective_step).store(effective_step, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(slot->version).store(version, std::memory_order_release);
  StoreState(slot, kPrepared);
  return absl::OkStatus();
}

absl::Status CheckCommittable(void* area, uint64_t version) {
  const int i = FindVersion(area, version);
  if (i < 0 || LoadState(PlanSlot(area, i)) == kAborted) {
    return absl::NotFoundError(absl::StrCat("plan v", version, " is not prepared here"));
  }
  return absl::OkStatus();
}

absl::Status CommitPlan(void* area, uint64_t version) {
  if (absl::Status s = CheckCommittable(area, version); !s.ok()) return s;
  StoreState(PlanSlot(area, FindVersion(area, version)), kCommitted);
  return absl::OkStatus();
}

absl::Status AbortPlan(void* area, uint64_t version) {
  const int i = FindVersion(area, version);
  if (i < 0) return absl::NotFoundError(absl::StrCat("plan v", version, " is not prepared here"));
  if (LoadState(PlanSlot(area, i)) == kCommitted) {
    return absl::FailedPreconditionError(
        absl::StrCat("plan v", version, " is committed; a committed plan is never aborted"));
  }
  StoreState(PlanSlot(area, i), kAborted);
  return absl::OkStatus();
}

bool UndecidedAt(void* area, uint64_t step, uint64_t* version) {
  for (int i = 0; i < 2; ++i) {
    PlanSlotHeader* slot = PlanSlot(area, i);
    // The state first, sequentially consistent (the Dekker pair with the daemon's StoreState
    // and its read of the steps); kPrepared is stored after the version, so it implies it.
    const uint32_t state = std::atomic_ref<uint32_t>(slot->state).load(std::memory_order_seq_cst);
    const uint64_t v = std::atomic_ref<uint64_t>(slot->version).load(std::memory_order_acquire);
    if (state == kPrepared &&
        std::atomic_ref<uint64_t>(slot->effective_step).load(std::memory_order_relaxed) <= step) {
      if (version != nullptr) *version = v;
      return true;
    }
  }
  return false;
}

absl::Status RetargetPlan(void* area, uint64_t version, uint64_t step) {
  for (int b = 0; b < 2; ++b) {
    PlanSlotHeader* slot = PlanSlot(area, b);
    if (std::atomic_ref<uint64_t>(slot->version).load(std::memory_order_acquire) != version ||
        std::atomic_ref<uint32_t>(slot->state).load(std::memory_order_acquire) != kCommitted) {
      continue;
    }
    std::atomic_ref<uint64_t> effective(slot->effective_step);
    if (effective.load(std::memory_order_relaxed) > step) {
      effective.store(step, std::memory_order_release);
    }
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("plan v", version, " is not committed in this area"));
}

}  // namespace ubep::kernels
