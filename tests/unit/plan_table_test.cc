#include "kernels/common/plan_table.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/common/routing.h"

namespace ubep::kernels {
namespace {

TEST(PlanTableTest, WritesCumulativeSharesAndChoosesByHash) {
  const std::vector<int> experts = {0, 1, 0, 2};
  const std::vector<double> shares = {0.25, 1.0, 0.75, 1.0};
  const LayerRouting layer{experts, shares};
  absl::StatusOr<std::vector<std::byte>> table = BuildPlanTable(9, 3, {&layer, 1});
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_TRUE(ValidatePlanTable(*table).ok());
  const auto* header = reinterpret_cast<const PlanTableHeader*>(table->data());
  EXPECT_EQ(header->version, 9u);
  EXPECT_EQ(header->max_replicas, 2u);
  const ExpertRoute* route = FindRoute(header, 0, 0);
  ASSERT_EQ(route->count, 2u);
  EXPECT_EQ(Replicas(route)[0].slot, 0u);
  EXPECT_EQ(Replicas(route)[0].cum_share, 1u << 30);
  EXPECT_EQ(Replicas(route)[1].cum_share, 0xFFFFFFFFu);
  EXPECT_EQ(ChooseSlot(route, (1u << 30) - 1), 0u);
  EXPECT_EQ(ChooseSlot(route, 1u << 30), 2u);
  EXPECT_EQ(ChooseSlot(FindRoute(header, 0, 2), 12345), 3u);
}

TEST(PlanTableTest, RejectsBadRoutings) {
  const std::vector<int> experts = {0, 1, 0, 5};
  const std::vector<double> shares = {0.5, 1.0, 0.5, 1.0};
  const LayerRouting layer{experts, shares};
  EXPECT_EQ(BuildPlanTable(1, 3, {&layer, 1}).status(),
            absl::InvalidArgumentError("plan table: layer 0 slot 3 holds expert 5, outside [0, 3)"));
  const std::vector<int> no_two = {0, 1, 0, 1};
  const std::vector<double> halves = {0.5, 0.5, 0.5, 0.5};
  const LayerRouting missing{no_two, halves};
  EXPECT_EQ(BuildPlanTable(1, 3, {&missing, 1}).status(),
            absl::InvalidArgumentError("plan table: layer 0 expert 2 has no replica"));
  std::vector<std::byte> garbage(64);
  EXPECT_EQ(ValidatePlanTable(garbage),
            absl::InvalidArgumentError("plan table: bad magic (not a plan table)"));
}

// The data plane neither sends to nor waits for an excluded rank, so a share on one of its
// slots would be pairs silently dropped: refused when the table is built, and when a table
// read from shared memory routes there.
TEST(PlanTableTest, RefusesSharesOnTheSlotsOfAnExcludedRank) {
  const std::vector<int> experts = {0, 1, 2, 0};  // Two ranks of two slots.
  const std::vector<double> shares = {0.5, 1.0, 1.0, 0.5};
  const LayerRouting layer{experts, shares};
  const int excluded[] = {1};
  EXPECT_EQ(BuildPlanTable(1, 3, {&layer, 1}, 2, excluded).status(),
            absl::InvalidArgumentError(
                "plan table: layer 0 slot 2 has share 1 but its rank 1 is excluded from the group"));
  EXPECT_EQ(BuildPlanTable(1, 3, {&layer, 1}, 3).status(),
            absl::InvalidArgumentError("plan table: 4 slots do not divide among 3 ranks"));
  // The same table built with rank 1 in the group, then marked excluded in its mask.
  std::vector<std::byte> table = *BuildPlanTable(1, 3, {&layer, 1}, 2);
  ASSERT_EQ(ValidatePlanTable(table), absl::OkStatus());
  auto* mask = reinterpret_cast<uint32_t*>(table.data() + table.size() - sizeof(uint32_t));
  *mask |= 1u << 1;
  EXPECT_EQ(ValidatePlanTable(table),
            absl::InvalidArgumentError(
                "plan table: layer 0 expert 0 routes to slot 3 of rank 1, which is excluded"));
}

// A slot serves one expert, so a token's distinct experts take distinct slots and its pairs at
// a rank never outnumber the rank's slots (the receive side is sized by that): a table read
// from shared memory that routes two experts to one slot is refused.
TEST(PlanTableTest, RefusesASlotThatServesTwoExperts) {
  const std::vector<int> experts = {0, 1, 2, 0};
  const std::vector<double> shares = {0.5, 1.0, 1.0, 0.5};
  const LayerRouting layer{experts, shares};
  std::vector<std::byte> table = *BuildPlanTable(1, 3, {&layer, 1}, 2);
  ASSERT_EQ(ValidatePlanTable(table), absl::OkStatus());
  const auto* header = reinterpret_cast<const PlanTableHeader*>(table.data());
  // Expert 2's only replica moves onto slot 1, expert 1's.
  auto* route = const_cast<ExpertRoute*>(FindRoute(header, 0, 2));
  const_cast<ReplicaRoute*>(Replicas(route))[0].slot = 1;
  EXPECT_EQ(ValidatePlanTable(table),
            absl::InvalidArgumentError("plan table: layer 0 slot 1 serves experts 1 and 2"));
}

// An expert's replicas split the hash range in order and cover all of it: a bound that goes
// back, or a last one short of 2^32 - 1, is refused naming the replica.
TEST(PlanTableTest, RefusesHashRangesThatGoBackOrEndShort) {
  const std::vector<int> experts = {0, 1, 0, 2};
  const std::vector<double> shares = {0.25, 1.0, 0.75, 1.0};
  const LayerRouting layer{experts, shares};
  std::vector<std::byte> table = *BuildPlanTable(1, 3, {&layer, 1});
  ASSERT_EQ(ValidatePlanTable(table), absl::OkStatus());
  const auto* header = reinterpret_cast<const PlanTableHeader*>(table.data());
  auto* replicas = const_cast<ReplicaRoute*>(Replicas(FindRoute(header, 0, 0)));
  replicas[1].cum_share = 0xFFFFFFFEu;
  EXPECT_EQ(ValidatePlanTable(table),
            absl::InvalidArgumentError("plan table: layer 0 expert 0 replica 1 ends its hash "
                                       "range at 4294967294, not at 2^32 - 1"));
  replicas[1].cum_share = 0xFFFFFFFFu;
  replicas[0].cum_share = 0xFFFFFFFFu;  // Still in order: replica 1 takes no hash.
  EXPECT_EQ(ValidatePlanTable(table), absl::OkStatus());
  // Three replicas, the middle one's bound below the first's.
  const std::vector<int> three = {0, 0, 0, 1};
  const std::vector<double> thirds = {0.25, 0.25, 0.5, 1.0};
  const LayerRouting layer3{three, thirds};
  std::vector<std::byte> table3 = *BuildPlanTable(1, 2, {&layer3, 1});
  const auto* header3 = reinterpret_cast<const PlanTableHeader*>(table3.data());
  auto* replicas3 = const_cast<ReplicaRoute*>(Replicas(FindRoute(header3, 0, 0)));
  replicas3[1].cum_share = replicas3[0].cum_share - 1;
  EXPECT_EQ(ValidatePlanTable(table3),
            absl::InvalidArgumentError(absl::StrCat(
                "plan table: layer 0 expert 0 replica 1 ends its hash range at ",
                replicas3[1].cum_share, ", before the one before it")));
}

// A header read from shared memory is checked before anything is sized or read from it: sizes
// whose product wraps 64 bits do not pass for a short table, a rank count near 2^32 does not
// wrap the mask to nothing, and a slot count is bounded before validation allocates for it.
TEST(PlanTableTest, AHeaderWhoseSizesWrapOrOverreachIsRefused) {
  const std::string disagree = "plan table: sizes in the header disagree with its length";
  auto table_of = [](PlanTableHeader header, size_t bytes) {
    header.magic = kPlanTableMagic;
    std::vector<std::byte> table(bytes);
    std::memcpy(table.data(), &header, sizeof(header));
    return table;
  };
  // 2^15 layers x 2^14 experts x (8 + 8 x (2^32 - 1)) bytes is 2^64: 32 bytes, wrapped.
  EXPECT_EQ(ValidatePlanTable(table_of({0, 1u << 15, 1u << 14, 1, 0xFFFFFFFFu, 0, 1}, 32)),
            absl::InvalidArgumentError(disagree));
  // 2^32 - 1 ranks: 2^27 mask words, not (2^32 - 1 + 31) / 32 wrapped to 0.
  EXPECT_EQ(ValidatePlanTable(table_of({0, 1, 1, 1, 1, 0xFFFFFFFFu, 1}, 48)),
            absl::InvalidArgumentError(disagree));
  EXPECT_EQ(ValidatePlanTable(table_of({0, 1, 1, 0xFFFFFFFFu, 1, 0, 1}, 48)),
            absl::InvalidArgumentError("plan table: 4294967295 slots, over 4194304"));
  EXPECT_EQ(ValidatePlanTable(table_of({0, 1, 1, 2, 3, 0, 1}, 32 + 8 + 3 * 8)),
            absl::InvalidArgumentError("plan table: up to 3 replicas of an expert in 2 slots"));
  // No experts: a header alone has any number of layers (it was checked, layer by layer, over
  // every slot: 2^32 layers x 2^22 slots, a hang).
  EXPECT_EQ(ValidatePlanTable(table_of({0, 0xFFFFFFFFu, 0, 1u << 22, 1, 0, 1}, 32)),
            absl::InvalidArgumentError("plan table: 4294967295 layers of 0 experts"));
  EXPECT_EQ(ValidatePlanTable(table_of({0, 0, 4, 4, 1, 0, 1}, 32)),
            absl::InvalidArgumentError("plan table: 0 layers of 4 experts"));
}

// The check's work is the table's length: 2^16 layers of one expert over 2^22 slots (a 1 MiB
// table) is checked without a pass over every slot per layer (2^38 writes: it did not end).
TEST(PlanTableTest, CheckingATableOfManyLayersAndSlotsIsBoundedByItsLength) {
  constexpr uint32_t kLayers = 1u << 16;
  const PlanTableHeader header = {kPlanTableMagic, kLayers, 1, kMaxPlanSlots, 1, 0, 1};
  std::vector<std::byte> table(sizeof(header) + kLayers * ExpertRouteBytes(1));
  std::memcpy(table.data(), &header, sizeof(header));
  for (uint32_t l = 0; l < kLayers; ++l) {
    const uint32_t route[4] = {1, 0, l % kMaxPlanSlots, 0xFFFFFFFFu};  // count, -, slot, bound
    std::memcpy(table.data() + sizeof(header) + l * ExpertRouteBytes(1), route, sizeof(route));
  }
  EXPECT_EQ(ValidatePlanTable(table), absl::OkStatus());
  // And a slot serving two experts is still found within a layer, not across layers.
  const PlanTableHeader two = {kPlanTableMagic, 2, 2, 4, 1, 0, 1};
  std::vector<std::byte> clash(sizeof(two) + 4 * ExpertRouteBytes(1));
  std::memcpy(clash.data(), &two, sizeof(two));
  auto put = [&](uint32_t l, uint32_t e, uint32_t slot) {
    const uint32_t route[4] = {1, 0, slot, 0xFFFFFFFFu};
    std::memcpy(clash.data() + sizeof(two) + (l * 2 + e) * ExpertRouteBytes(1), route,
                sizeof(route));
  };
  put(0, 0, 0);
  put(0, 1, 1);
  put(1, 0, 1);  // Slot 1 serves expert 1 in layer 0, expert 0 in layer 1: allowed.
  put(1, 1, 0);
  EXPECT_EQ(ValidatePlanTable(clash), absl::OkStatus());
  put(1, 1, 1);
  EXPECT_EQ(ValidatePlanTable(clash),
            absl::InvalidArgumentError("plan table: layer 1 slot 1 serves experts 0 and 1"));
}

TEST(RoutingTest, ATokenListsEachExpertOnce) {
  const int32_t experts[] = {4, -1, 7, -1, 4, 9, 7, 9};
  const int expected[] = {-1, -1, -1, -1, 0, -1, 2, 5};  // Masked entries may repeat.
  for (int k = 0; k < 8; ++k) EXPECT_EQ(RepeatedEntry(experts, k), expected[k]) << "k " << k;
  EXPECT_EQ(MaxPairsPerToken(8, 32), 8);
  EXPECT_EQ(MaxPairsPerToken(8, 2), 2);
}

TEST(RoutingTest, HashIsStableAcrossBuilds) {
  // Pinned values: host and device must agree on every route, today and after refactors;
  // a change here reroutes every token of a running deployment.
  EXPECT_EQ(RouteHash(0, 0, 0, 0), 205331723u);
  EXPECT_EQ(RouteHash(1, 2, 3, 4), 3577583207u);
  EXPECT_EQ(RouteHash(7, 4095, 7, 255), 4205541575u);
  EXPECT_NE(RouteHash(1, 2, 3, 4), RouteHash(1, 2, 4, 3));
  EXPECT_EQ(RecordBytes(8), 72u);
}

}  // namespace
}  // namespace ubep::kernels
