// Structured random mutation of protobuf messages for the fuzz tests of inputs from the wire:
// a field picked at random through reflection takes a value at the edges (0, -1, 2^31 - 1,
// 2^32 - 1, NaN, inf, ...), a repeated field grows or shrinks, a message field is cleared or
// mutated within. Deterministic for a seeded generator.
#ifndef UBEP_TESTS_UNIT_PROTO_MUTATE_H_
#define UBEP_TESTS_UNIT_PROTO_MUTATE_H_

#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"

namespace ubep::test {
namespace proto_mutate_internal {
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

inline int64_t Extreme(std::mt19937_64& rng) {
  static const int64_t values[] = {0, 1, -1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 1023, 1024, 1025,
                                   65535, 65536, 1 << 22, (1 << 22) + 1, INT32_MAX, INT32_MIN,
                                   int64_t{UINT32_MAX}, INT64_MAX, INT64_MIN};
  if (rng() % 3 == 0) return static_cast<int64_t>(rng() % 100);
  return values[rng() % (sizeof(values) / sizeof(values[0]))];
}
inline double ExtremeDouble(std::mt19937_64& rng) {
  static const double values[] = {0, 1, -1, 0.5, 1e-300, 1e300, -0.0,
                                  std::numeric_limits<double>::infinity(),
                                  -std::numeric_limits<double>::infinity(),
                                  std::numeric_limits<double>::quiet_NaN(), 0.25, 2, 1 - 1e-7};
  return values[rng() % (sizeof(values) / sizeof(values[0]))];
}

inline void SetScalar(Message* m, const FieldDescriptor* f, std::mt19937_64& rng, int index) {
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

inline void AddScalar(Message* m, const FieldDescriptor* f, std::mt19937_64& rng) {
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

}  // namespace proto_mutate_internal

// Mutates one field of `m` (recursively, within a message field).
inline void Mutate(google::protobuf::Message* m, std::mt19937_64& rng) {
  using google::protobuf::FieldDescriptor;
  using proto_mutate_internal::AddScalar;
  using proto_mutate_internal::SetScalar;
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

}  // namespace ubep::test

#endif  // UBEP_TESTS_UNIT_PROTO_MUTATE_H_
