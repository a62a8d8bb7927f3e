#include "kernels/common/plan_area.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/wait_for.h"

namespace ubep::kernels {
namespace {

// A valid table whose every slot holds expert (version % 2) pattern, so a reader can tell a
// table from its version: slot p holds expert (p + version) % 4.
std::vector<std::byte> Table(uint64_t version) {
  std::vector<int> experts(8);
  std::vector<double> shares(8, 0.5);
  for (int p = 0; p < 8; ++p) experts[p] = static_cast<int>((p + version) % 4);
  const LayerRouting layer{experts, shares};
  return *BuildPlanTable(version, 4, {&layer, 1});
}

class PlanAreaTest : public ::testing::Test {
 protected:
  static constexpr size_t kCapacity = 4096;
  PlanAreaTest() : bytes_(PlanAreaBytes(kCapacity)) { InitPlanArea(bytes_.data(), kCapacity); }
  void* area() { return bytes_.data(); }
  std::vector<std::byte> bytes_;
};

TEST_F(PlanAreaTest, PlansTakeEffectAtTheirStepOnceCommitted) {
  EXPECT_EQ(SelectPlan(area(), 100), nullptr);
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
  EXPECT_EQ(SelectPlan(area(), 100), nullptr);  // Prepared is not in force.
  ASSERT_TRUE(CommitPlan(area(), 1).ok());
  uint64_t version = 0;
  ASSERT_NE(SelectPlan(area(), 0, &version), nullptr);
  EXPECT_EQ(version, 1u);

  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(2), 2, 10).ok());
  ASSERT_TRUE(CommitPlan(area(), 2).ok());
  version = 0;
  ASSERT_NE(SelectPlan(area(), 9, &version), nullptr);
  EXPECT_EQ(version, 1u);  // Before the effective step, the old plan.
  const PlanTableHeader* table = SelectPlan(area(), 10, &version);
  EXPECT_EQ(version, 2u);
  EXPECT_EQ(table->version, 2u);

  // v3 overwrites v1's slot; v2 stays in force until step 20.
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(3), 3, 20).ok());
  version = 0;
  ASSERT_NE(SelectPlan(area(), 25, &version), nullptr);
  EXPECT_EQ(version, 2u);
  ASSERT_TRUE(AbortPlan(area(), 3).ok());
  version = 0;
  ASSERT_NE(SelectPlan(area(), 25, &version), nullptr);
  EXPECT_EQ(version, 2u);
  // After an abort the next version takes the aborted slot.
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(4), 4, 30).ok());
  ASSERT_TRUE(CommitPlan(area(), 4).ok());
  SelectPlan(area(), 30, &version);
  EXPECT_EQ(version, 4u);
}

// With no plan committed yet, a prepare that awaits its decision holds one slot and the other
// is empty: a second prepare is refused all the same.
TEST_F(PlanAreaTest, ASecondPrepareIsRefusedBeforeAnyCommit) {
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
  EXPECT_EQ(PreparePlan(area(), kCapacity, Table(2), 2, 0),
            absl::FailedPreconditionError(
                "plan v2 cannot be prepared while v1 awaits its commit or abort"));
  ASSERT_TRUE(AbortPlan(area(), 1).ok());
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(2), 2, 0).ok());
}

// With no plan committed, a plan aborted and prepared again under its version lands in the
// other slot, the aborted copy beside it: its commit and its abort find the live copy (once
// found the aborted one: the commit was refused, and an abort left the live copy awaiting a
// decision, which refused every later prepare).
TEST_F(PlanAreaTest, APlanAbortedAndPreparedAgainBeforeAnyCommitIsDecidedOnItsLiveCopy) {
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(5), 5, 0).ok());
  ASSERT_TRUE(AbortPlan(area(), 5).ok());
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(5), 5, 0).ok());
  EXPECT_EQ(PlanSlot(area(), 0)->state, kAborted);
  EXPECT_EQ(PlanSlot(area(), 1)->state, kPrepared);
  EXPECT_EQ(PlanSlot(area(), 1)->version, 5u);
  uint64_t undecided = 0;
  EXPECT_TRUE(UndecidedAt(area(), 0, &undecided));
  EXPECT_EQ(undecided, 5u);
  ASSERT_TRUE(AbortPlan(area(), 5).ok());
  EXPECT_EQ(PlanSlot(area(), 1)->state, kAborted);
  EXPECT_FALSE(UndecidedAt(area(), 0));
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(5), 5, 0).ok());
  EXPECT_EQ(CheckCommittable(area(), 5), absl::OkStatus());
  ASSERT_EQ(CommitPlan(area(), 5), absl::OkStatus());
  uint64_t version = 0;
  ASSERT_NE(SelectPlan(area(), 0, &version), nullptr);
  EXPECT_EQ(version, 5u);
  EXPECT_FALSE(UndecidedAt(area(), 0));
  ASSERT_EQ(PreparePlan(area(), kCapacity, Table(6), 6, 10), absl::OkStatus());
}

TEST_F(PlanAreaTest, RefusesWhatWouldBreakTheProtocol) {
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(5), 5, 0).ok());
  ASSERT_TRUE(CommitPlan(area(), 5).ok());
  EXPECT_EQ(PreparePlan(area(), kCapacity, Table(5), 5, 1),
            absl::FailedPreconditionError("plan v5 is not newer than v5 already in the plan area"));
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(6), 6, 10).ok());
  EXPECT_EQ(PreparePlan(area(), kCapacity, Table(7), 7, 20),
            absl::FailedPreconditionError(
                "plan v7 cannot be prepared while v6 awaits its commit or abort"));
  EXPECT_EQ(CommitPlan(area(), 9), absl::NotFoundError("plan v9 is not prepared here"));
  // An aborted plan is prepared again under its version (a retry), and then committed.
  ASSERT_TRUE(AbortPlan(area(), 6).ok());
  EXPECT_EQ(CommitPlan(area(), 6), absl::NotFoundError("plan v6 is not prepared here"));
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(6), 6, 12).ok());
  ASSERT_TRUE(CommitPlan(area(), 6).ok());
  EXPECT_EQ(AbortPlan(area(), 6),
            absl::FailedPreconditionError(
                "plan v6 is committed; a committed plan is never aborted"));
  // An aborted plan holds no version back: after one under the last version, aborted, the
  // next plan is prepared and committed (a Prepare gone wrong does not end all that follow).
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(UINT64_MAX), UINT64_MAX, 20).ok());
  ASSERT_TRUE(AbortPlan(area(), UINT64_MAX).ok());
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(7), 7, 20).ok());
  ASSERT_TRUE(CommitPlan(area(), 7).ok());
  uint64_t version = 0;
  ASSERT_NE(SelectPlan(area(), 20, &version), nullptr);
  EXPECT_EQ(version, 7u);
  std::vector<std::byte> big(5000);
  EXPECT_EQ(PreparePlan(area(), kCapacity, big, 8, 0),
            absl::InvalidArgumentError("plan v8 needs 5000 bytes; the plan area holds 4096"));
  // A table is prepared under its own version: the host backend reports the table's, the
  // CUDA backend the slot's, as the call's plan.
  EXPECT_EQ(PreparePlan(area(), kCapacity, Table(7), 8, 0),
            absl::InvalidArgumentError("plan v8: its table says v7"));
}

// A committed table whose version word was written over is corrupt to its readers: the plan
// a call reports is the one that selected it, whichever backend runs the call.
TEST_F(PlanAreaTest, ATableWhoseVersionDisagreesWithItsSlotIsCorrupt) {
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
  ASSERT_TRUE(CommitPlan(area(), 1).ok());
  uint64_t v = 0;
  int slot = -1;
  const PlanTableHeader* table = SelectPlan(area(), 0);
  ASSERT_NE(table, nullptr);
  const_cast<PlanTableHeader*>(table)->version = 99;
  CheckedPlan checked;
  EXPECT_EQ(SelectCheckedPlan(area(), kCapacity, 0, checked, &v, &slot).status(),
            absl::DataLossError("plan v1 in force at step 0 is corrupt (plan table: it says "
                                "v99, its slot v1): something other than ubepd wrote over it"));
  const_cast<PlanTableHeader*>(table)->version = 1;
  absl::StatusOr<const PlanTableHeader*> read =
      SelectCheckedPlan(area(), kCapacity, 0, checked, &v, &slot);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)->version, 1u);
  EXPECT_EQ(v, 1u);
}

// A reader that has seen a slot committed (v1, the older plan) and is paused before it reads
// the slot's version, while the writer empties the slot and prepares v3 in it (effective at
// once): the reader does not take the old state with the new version, v3 for committed. It
// takes v2, the plan in force.
TEST_F(PlanAreaTest, AReaderPausedWhileItsSlotIsRewrittenDoesNotTakeTheNewVersion) {
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
  ASSERT_TRUE(CommitPlan(area(), 1).ok());
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(2), 2, 0).ok());
  ASSERT_TRUE(CommitPlan(area(), 2).ok());
  int rewrites = 0;
  const std::function<void(int)> rewrite = [&](int slot) {
    if (slot != 0 || rewrites++ > 0) return;  // Slot 0 holds v1, the older plan.
    EXPECT_EQ(PreparePlan(area(), kCapacity, Table(3), 3, 0), absl::OkStatus());
  };
  SetSelectPauseForTesting(&rewrite);
  uint64_t version = 0;
  const PlanTableHeader* table = SelectPlan(area(), 100, &version);
  SetSelectPauseForTesting(nullptr);
  EXPECT_EQ(rewrites, 1);
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(version, 2u);
  EXPECT_EQ(table->version, 2u);
  EXPECT_TRUE(UndecidedAt(area(), 100));  // v3 awaits its decision.
}

// A checked reader that copied its table (v1, the older plan) while the writer prepares v3 in
// that slot (a plan prepared over one a rank still uses: the rule ubepd keeps, broken) is told
// that its slot was rewritten, whether its copy still checks out or not: the table changed
// under the check, and the message named a foreign writer (that, the next case).
TEST_F(PlanAreaTest, ACheckedReaderWhoseSlotIsRewrittenDuringItsCopySaysSo) {
  for (const bool torn : {false, true}) {
    SCOPED_TRACE(torn ? "the table changed under the check" : "the copy checks out");
    bytes_.assign(bytes_.size(), std::byte{0});
    InitPlanArea(area(), kCapacity);
    ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
    ASSERT_TRUE(CommitPlan(area(), 1).ok());
    ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(2), 2, 50).ok());
    ASSERT_TRUE(CommitPlan(area(), 2).ok());
    int rewrites = 0;
    const std::function<void()> rewrite = [&] {
      if (rewrites++ > 0) return;
      // Slot 0 (v1) is the older: v3 goes there. Not torn: only the slot's state and version
      // change (v3's table the same bytes as v1's but for its version word, put back).
      ASSERT_EQ(PreparePlan(area(), kCapacity, Table(3), 3, 0), absl::OkStatus());
      if (!torn) {
        const std::vector<std::byte> first = Table(1);
        std::memcpy(const_cast<PlanTableHeader*>(PlanBuffer(area(), 0)), first.data(), first.size());
      }
    };
    SetCopyPauseForTesting(&rewrite);
    CheckedPlan checked;
    uint64_t v = 0;
    int slot = -1;
    const absl::Status read = SelectCheckedPlan(area(), kCapacity, 10, checked, &v, &slot).status();
    SetCopyPauseForTesting(nullptr);
    EXPECT_EQ(rewrites, 1);
    EXPECT_EQ(read, absl::DataLossError("plan v1 in force at step 10: its slot was rewritten "
                                        "while it was read (a plan prepared over one a rank "
                                        "still used)"));
  }
}

// The writer places and bounds a table by the capacity it knows, not by the area's header,
// which every process mapping the arena can write: a header written over is refused, naming
// it, and nothing is written (an area whose header said 2^56 bytes a buffer had the table
// copied that far past the area).
TEST_F(PlanAreaTest, APrepareTrustsNoHeaderWordAnotherProcessCouldHaveWritten) {
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
  ASSERT_TRUE(CommitPlan(area(), 1).ok());
  auto* header = static_cast<PlanAreaHeader*>(area());
  const std::vector<std::byte> before = bytes_;
  header->capacity_bytes = ~uint64_t{0} >> 8;
  EXPECT_EQ(PreparePlan(area(), kCapacity, Table(2), 2, 0),
            absl::DataLossError("the plan area's header says its buffers hold 72057594037927935 "
                                "bytes, not 4096: something other than ubepd wrote over it"));
  header->capacity_bytes = kCapacity;
  EXPECT_EQ(bytes_, before);
  header->magic = 0;
  EXPECT_EQ(PreparePlan(area(), kCapacity, Table(2), 2, 0),
            absl::DataLossError("the plan area's header has magic 0x0, not 0x41504255: "
                                "something other than ubepd wrote over it"));
  header->magic = kPlanAreaMagic;
  EXPECT_EQ(bytes_, before);
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(2), 2, 0).ok());
}

TEST_F(PlanAreaTest, ReadersNeverSeeATornTable) {
  // Each reader (a rank) walks its own steps and reports each finished one; a step at or past
  // the effective step of a prepared, undecided plan waits for the decision, as BeginStep does.
  // The writer (the control plane) prepares the next plan with an effective step ahead of every
  // rank, and the one after only once every rank has finished that step. A reader may still
  // begin the effective step before it can see the prepare (the writer was descheduled between
  // choosing the step and preparing): it runs that step under the old plan, so the writer
  // aborts the plan and prepares it again further ahead. The writer reads each reader's step
  // with a read-modify-write, and each reader writes it with one, so either the writer sees
  // the reader's step or the reader sees the prepare.
  ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(1), 1, 0).ok());
  ASSERT_TRUE(CommitPlan(area(), 1).ok());
  constexpr int kReaders = 2;
  std::atomic<uint64_t> started[kReaders] = {}, finished[kReaders] = {};
  std::atomic<bool> stop{false};
  std::atomic<int> torn{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < kReaders; ++r) {
    readers.emplace_back([&, r] {
      for (uint64_t step = 0; !stop.load(); ++step) {
        started[r].exchange(step, std::memory_order_acq_rel);
        while (UndecidedAt(area(), step) && !stop.load()) std::this_thread::yield();
        uint64_t version = 0;
        const PlanTableHeader* table = SelectPlan(area(), step, &version);
        if (table == nullptr || table->version != version) {
          ++torn;
        } else {
          for (uint32_t p = 0; p < 8; ++p) {
            const ExpertRoute* route = FindRoute(table, 0, (p + version) % 4);
            bool found = false;
            for (uint32_t j = 0; j < route->count; ++j) found |= Replicas(route)[j].slot == p;
            if (!found) ++torn;
          }
        }
        finished[r] = step;
        // 2 cores, 3 threads (and sanitizers): sleep now and then so the writer runs.
        if (step % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    });
  }
  // However the writer's loop ends (an assertion that fails returns), the readers stop and are
  // joined.
  struct StopAndJoin {
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~StopAndJoin() {
      stop = true;
      for (std::thread& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } stop_and_join{stop, readers};
  auto furthest_started = [&] {
    uint64_t ahead = 0;
    for (auto& s : started) ahead = std::max(ahead, s.fetch_add(0, std::memory_order_acq_rel));
    return ahead;
  };
  uint64_t version = 2;
  int retried = 0;
  for (int committed = 0; committed < 38; ++committed, ++version) {
    uint64_t effective = furthest_started() + 50;
    ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(version), version, effective).ok());
    while (furthest_started() >= effective) {
      ASSERT_TRUE(AbortPlan(area(), version).ok());
      ++retried;
      ++version;
      effective = furthest_started() + 50;
      ASSERT_TRUE(PreparePlan(area(), kCapacity, Table(version), version, effective).ok());
    }
    ASSERT_TRUE(CommitPlan(area(), version).ok());
    for (auto& f : finished) {
      ASSERT_TRUE(test::WaitFor([&] { return f.load() >= effective; }, absl::Seconds(60)))
          << "a reader did not reach step " << effective;
    }
  }
  stop = true;
  for (auto& t : readers) t.join();
  EXPECT_EQ(torn.load(), 0) << retried << " plans were aborted and prepared again";
}

}  // namespace
}  // namespace ubep::kernels
