// Structured random mutation of the control plane's inputs from the wire: plans
// (v1::Plan, as a balancer sends them in Prepare) through FromProto, and load reports
// (v1::LoadReport, as daemons send them) through LoadFromProto. Fields, picked at random
// through protobuf reflection, take values at the edges (0, -1, 2^31 - 1, 2^32 - 1, NaN, inf,
// ...), repeated fields grow and shrink. Nothing may crash or read out of bounds (the suite
// runs under AddressSanitizer and UBSan); every refusal is a Status; and a plan FromProto
// accepts is one the data plane can route: BuildPlanTable writes it and ValidatePlanTable
// passes it (but a plan of no layers, which the daemons refuse by their model's layer count).
// Fixed seeds: the same inputs every run.
#include <cstdint>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "balancer/formats/proto_convert.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "gtest/gtest.h"
#include "kernels/common/plan_table.h"
#include "tests/unit/test_util.h"

namespace ubep::balancer {
namespace {
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

int64_t Extreme(std::mt19937_64& rng) {
  static const int64_t values[] = {0, 1, -1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 1023, 1024, 1025,
                                   65535, 65536, 1 << 22, (1 << 22) + 1, INT32_MAX, INT32_MIN,
                                   int64_t{UINT32_MAX}, INT64_MAX, INT64_MIN};
  if (rng() % 3 == 0) return static_cast<int64_t>(rng() % 100);
  return values[rng() % (sizeof(values) / sizeof(values[0]))];
}
double ExtremeDouble(std::mt19937_64& rng) {
  static const double values[] = {0, 1, -1, 0.5, 1e-300, 1e300, -0.0,
                                  std::numeric_limits<double>::infinity(),
                                  -std::numeric_limits<double>::infinity(),
                                  std::numeric_limits<double>::quiet_NaN(), 0.25, 2, 1 - 1e-7};
  return values[rng() % (sizeof(values) / sizeof(values[0]))];
}

void SetScalar(Message* m, const FieldDescriptor* f, std::mt19937_64& rng, int index) {
  const auto* r = m->GetReflection();
  const int64_t v = Extreme(rng);
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      rep ? r->SetRepeatedInt32(m, f, index, static_cast<int32_t>(v)) : r->SetInt32(m, f, static_cast<int32_t>(v));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      rep ? r->SetRepeatedInt64(m, f, index, v) : r->SetInt64(m, f, v);
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      rep ? r->SetRepeatedUInt32(m, f, index, static_cast<uint32_t>(v)) : r->SetUInt32(m, f, static_cast<uint32_t>(v));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      rep ? r->SetRepeatedUInt64(m, f, index, static_cast<uint64_t>(v)) : r->SetUInt64(m, f, static_cast<uint64_t>(v));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      rep ? r->SetRepeatedDouble(m, f, index, ExtremeDouble(rng)) : r->SetDouble(m, f, ExtremeDouble(rng));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      rep ? r->SetRepeatedFloat(m, f, index, static_cast<float>(ExtremeDouble(rng))) : r->SetFloat(m, f, static_cast<float>(ExtremeDouble(rng)));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      rep ? r->SetRepeatedBool(m, f, index, rng() % 2) : r->SetBool(m, f, rng() % 2);
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      rep ? r->SetRepeatedString(m, f, index, std::string(rng() % 3, 'x')) : r->SetString(m, f, std::string(rng() % 3, 'x'));
      break;
    default:
      break;
  }
}

void AddScalar(Message* m, const FieldDescriptor* f, std::mt19937_64& rng) {
  const auto* r = m->GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: r->AddInt32(m, f, 0); break;
    case FieldDescriptor::CPPTYPE_INT64: r->AddInt64(m, f, 0); break;
    case FieldDescriptor::CPPTYPE_UINT32: r->AddUInt32(m, f, 0); break;
    case FieldDescriptor::CPPTYPE_UINT64: r->AddUInt64(m, f, 0); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: r->AddDouble(m, f, 0); break;
    case FieldDescriptor::CPPTYPE_FLOAT: r->AddFloat(m, f, 0); break;
    case FieldDescriptor::CPPTYPE_BOOL: r->AddBool(m, f, false); break;
    case FieldDescriptor::CPPTYPE_STRING: r->AddString(m, f, ""); break;
    case FieldDescriptor::CPPTYPE_MESSAGE: r->AddMessage(m, f); break;
    default: return;
  }
  SetScalar(m, f, rng, r->FieldSize(*m, f) - 1);
}

void Mutate(Message* m, std::mt19937_64& rng) {
  const auto* d = m->GetDescriptor();
  const auto* r = m->GetReflection();
  if (d->field_count() == 0) return;
  const FieldDescriptor* f = d->field(rng() % d->field_count());
  if (f->is_repeated()) {
    const int n = r->FieldSize(*m, f);
    const int op = rng() % 4;
    if (op == 0 || n == 0) {
      AddScalar(m, f, rng);
    } else if (op == 1) {
      r->RemoveLast(m, f);
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      Mutate(r->MutableRepeatedMessage(m, f, rng() % n), rng);
    } else {
      SetScalar(m, f, rng, rng() % n);
    }
  } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    if (rng() % 8 == 0) {
      r->ClearField(m, f);
    } else {
      Mutate(r->MutableMessage(m, f), rng);
    }
  } else {
    SetScalar(m, f, rng, 0);
  }
}

// The plan table the daemons would write for `plan`, which FromProto accepted.
void ExpectATable(const Plan& plan) {
  std::vector<kernels::LayerRouting> routing;
  for (const LayerPlan& l : plan.layers) routing.push_back({l.slot_expert, l.slot_share});
  absl::StatusOr<std::vector<std::byte>> table =
      kernels::BuildPlanTable(plan.version, static_cast<uint32_t>(plan.num_experts), routing,
                              static_cast<uint32_t>(plan.topology.num_ranks), plan.excluded_ranks);
  if (plan.layers.empty()) {
    EXPECT_EQ(table.status(), absl::InvalidArgumentError("plan table: no layers or no experts"));
    return;
  }
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE(kernels::ValidatePlanTable(*table).ok());
}

// A report of node `n` of SmallPlan (ranks 2n, 2n + 1: slots 4n to 4n + 3), both layers.
v1::LoadReport ReportOfNode(int n) {
  v1::LoadReport report;
  report.set_reporter(absl::StrCat("node-", n));
  report.set_first_step(10);
  report.set_last_step(20);
  report.set_plan_version(1);
  report.set_num_experts(6);
  for (int layer : {3, 4}) {
    v1::LayerLoad* l = report.add_layers();
    l->set_layer(layer);
    l->set_first_slot(4 * n);
    for (int p = 0; p < 4; ++p) l->add_slot(100 + p);
    l->add_dispatches(10);
    l->add_dispatches(10);
  }
  return report;
}

TEST(ProtoFuzzTest, PlansFromTheWireAreRefusedOrRoutable) {
  constexpr int kIterations = 20000;
  const v1::Plan bases[] = {ToProto(test::SmallPlan()),
                            ToProto(test::SmallPlan(), PlanEncoding::kCompact),
                            ToProto(test::PlanExcludingRank0(3, 1))};
  std::mt19937_64 rng(1);
  int accepted = 0;
  for (int i = 0; i < kIterations; ++i) {
    v1::Plan p = bases[i % 3];
    const int mutations = 1 + rng() % 4;
    for (int k = 0; k < mutations; ++k) Mutate(&p, rng);
    absl::StatusOr<Plan> plan = FromProto(p);
    if (!plan.ok()) continue;
    ++accepted;
    ASSERT_NO_FATAL_FAILURE(ExpectATable(*plan)) << "iteration " << i;
  }
  // Some mutations leave a valid plan (a share moved within its expert, another version):
  // the accepted path is exercised too.
  EXPECT_GT(accepted, kIterations / 50);
}

TEST(ProtoFuzzTest, LoadReportsFromTheWireAreRefusedOrRead) {
  constexpr int kIterations = 20000;
  const Plan plan = test::SmallPlan();
  const v1::LoadReport bases[] = {ReportOfNode(0), ReportOfNode(1)};
  ASSERT_TRUE(LoadFromProto(bases[0], &plan).ok()) << LoadFromProto(bases[0], &plan).status();
  std::mt19937_64 rng(2);
  int accepted = 0;
  for (int i = 0; i < kIterations; ++i) {
    v1::LoadReport report = bases[i % 2];
    const int mutations = 1 + rng() % 4;
    for (int k = 0; k < mutations; ++k) Mutate(&report, rng);
    absl::StatusOr<LoadMatrix> load = LoadFromProto(report, &plan);
    if (load.ok()) {
      ++accepted;
      EXPECT_EQ(load->num_experts(), 6);
    }
    (void)LoadFromProto(report, nullptr);
  }
  EXPECT_GT(accepted, kIterations / 50);
}

}  // namespace
}  // namespace ubep::balancer
