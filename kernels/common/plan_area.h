// PlanArea: the double-buffered, versioned home of plan tables in an arena, shared by the
// daemon that writes plans and the kernels that read them.
//
// Byte layout (from the area's base, 64-byte aligned parts):
//   PlanAreaHeader (64 B): magic, buffer capacity in bytes
//   PlanSlotHeader[2] (64 B each): table bytes, effective step, state, version
//   buffer 0, buffer 1 (capacity bytes each): a plan table (plan_table.h)
//
// Commit protocol (ARCHITECTURE section 5) on one area:
//   Prepare(v, S): the table goes into the slot holding the older version, stamped with
//     version v and effective step S, state kPrepared; the version word is stored last, with
//     release, so a reader that sees v sees its table.
//   Commit(v): state kCommitted (release).  Abort(v): state kAborted.
// A reader at step s uses the committed slot with the highest version whose effective step
// is <= s (SelectPlan). Versions only grow, but an aborted one may be prepared again. The writer never touches the slot a reader may
// be using as long as the daemon prepares v + 1 only after every rank reported a step at or
// past v's effective step (then the older slot is out of use); Prepare checks what it can:
// it overwrites the slot that is not the newest committed plan, and never a pending prepare.
// Thread-compatible writer; readers (SelectPlan) are lock-free and may run concurrently.
#ifndef UBEP_KERNELS_COMMON_PLAN_AREA_H_
#define UBEP_KERNELS_COMMON_PLAN_AREA_H_

#include <cstddef>
#include <functional>
#include <vector>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/host_device.h"
#include "kernels/common/plan_table.h"

namespace ubep::kernels {

inline constexpr uint32_t kPlanAreaMagic = 0x41504255;  // "UBPA"

enum PlanState : uint32_t { kEmpty = 0, kPrepared = 1, kCommitted = 2, kAborted = 3 };

struct PlanAreaHeader {
  uint32_t magic;
  uint32_t reserved;
  uint64_t capacity_bytes;  // Of each buffer.
  unsigned char pad[48];
};
static_assert(sizeof(PlanAreaHeader) == 64);

struct PlanSlotHeader {
  uint64_t table_bytes;
  uint64_t effective_step;
  uint32_t state;    // PlanState.
  uint32_t reserved;
  uint64_t version;  // Written last when preparing.
  unsigned char pad[32];
};
static_assert(sizeof(PlanSlotHeader) == 64);

UBEP_HD inline size_t PlanAreaBytes(size_t capacity_bytes) {
  return sizeof(PlanAreaHeader) + 2 * sizeof(PlanSlotHeader) + 2 * capacity_bytes;
}

UBEP_HD inline PlanSlotHeader* PlanSlot(void* area, int index) {
  return reinterpret_cast<PlanSlotHeader*>(static_cast<unsigned char*>(area) +
                                           sizeof(PlanAreaHeader)) +
         index;
}

// Buffer `index` of an area whose buffers hold `capacity` bytes each.
UBEP_HD inline unsigned char* PlanBufferAt(void* area, int index, size_t capacity) {
  return static_cast<unsigned char*>(area) + sizeof(PlanAreaHeader) + 2 * sizeof(PlanSlotHeader) +
         index * capacity;
}

// Buffer `index`, placed by the area's header (trusted: an area only this process writes).
UBEP_HD inline const PlanTableHeader* PlanBuffer(const void* area, int index) {
  const auto* header = static_cast<const PlanAreaHeader*>(area);
  return reinterpret_cast<const PlanTableHeader*>(
      PlanBufferAt(const_cast<void*>(area), index, header->capacity_bytes));
}

// Formats an area of PlanAreaBytes(capacity_bytes) bytes: both slots empty.
void InitPlanArea(void* area, size_t capacity_bytes);

// The table in force at `step`: the committed slot with the highest version whose effective
// step is <= step; null when none is. `version` (optional) receives its version.
const PlanTableHeader* SelectPlan(void* area, uint64_t step, uint64_t* version = nullptr);

// What a reader checked (SelectCheckedPlan): per slot of the area, the table of a committed
// version that passed, and the private copy of it that passed.
struct CheckedPlan {
  const PlanTableHeader* table[2] = {nullptr, nullptr};
  uint64_t version[2] = {0, 0};
  std::vector<std::byte> copy[2];
};

// SelectPlan for a reader of an area that every process mapping it can write (a daemon's
// arena, mapped read-write by its clients). The area's buffers are placed by `capacity`, the
// reader's own knowledge of the area (its layout), which the area's header must repeat; the
// first time this reader selects a slot's committed version, a private copy of its table is
// checked as PreparePlan checked it (ValidatePlanTable, within `capacity`, and the version the
// table says is its slot's), so that a table written over by anything but ubepd is refused
// rather than followed. A committed slot is
// rewritten only under a newer version, so one check per slot and version serves, and what is
// returned is that checked copy (kept in `checked` until the slot's next version), not the
// shared buffer: a table written over after its check is not followed either. OK with null
// when no plan is in force at `step`; DataLoss naming the version and what is wrong when the
// table fails. `buffer`: which of the area's two buffers the table was copied from.
absl::StatusOr<const PlanTableHeader*> SelectCheckedPlan(void* area, size_t capacity,
                                                         uint64_t step, CheckedPlan& checked,
                                                         uint64_t* version = nullptr,
                                                         int* buffer = nullptr);

// Whether a prepared, undecided plan (state kPrepared) would be in force at `step`: a rank
// reaching its effective step must wait for the decision (ARCHITECTURE section 5). `version`
// (optional) receives its version.
bool UndecidedAt(void* area, uint64_t step, uint64_t* version = nullptr);

// Writer side. An aborted plan holds no version back: any version above the committed ones
// may be prepared after it (its own again, a retry, included). Errors: FailedPrecondition
// (version not above every prepared or committed one, or another version awaits its commit
// or abort), InvalidArgument (table larger than the
// capacity, not a valid plan table, or one of another version), NotFound (Commit/Abort of a version not prepared),
// DataLoss (the area's header is not that of an area of `capacity`-byte buffers: the table is
// placed and bounded by `capacity`, the writer's own knowledge of the area, never by a word
// any process mapping the arena could have written).
absl::Status PreparePlan(void* area, size_t capacity, std::span<const std::byte> table,
                         uint64_t version, uint64_t effective_step);
// OK when CommitPlan(area, version) would commit: the version is prepared (or committed)
// there, not aborted.
absl::Status CheckCommittable(void* area, uint64_t version);
absl::Status CommitPlan(void* area, uint64_t version);
// Moves a committed plan's effective step earlier to `step` (no-op when it is not later).
// Only while no reader runs: the daemon does it when a group forms, every rank in Join.
absl::Status RetargetPlan(void* area, uint64_t version, uint64_t step);
absl::Status AbortPlan(void* area, uint64_t version);

// Tests only: `pause` (null: none) runs when a reader's selection finds a slot committed,
// between its look at the slot's state and at its version, with the slot's index; it must
// outlive its use.
void SetSelectPauseForTesting(const std::function<void(int)>* pause);
// Tests only: `pause` (null: none) runs when SelectCheckedPlan has copied a selected table,
// before it checks the copy against the slot; it must outlive its use.
void SetCopyPauseForTesting(const std::function<void()>* pause);

}  // namespace ubep::kernels

#endif  // UBEP_KERNELS_COMMON_PLAN_AREA_H_
