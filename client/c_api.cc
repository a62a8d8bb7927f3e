// The C ABI (ubep/ubep_c.h) over the C++ API.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "ubep/ubep.h"
#include "ubep/ubep_c.h"

struct ubep_rank {
  std::unique_ptr<ubep::Rank> rank;
};
struct ubep_dispatched {
  ubep::Dispatched dispatched;
};

namespace {

// The message of the calling thread's last error. It lives in last_error when that could be
// allocated, else in a fixed buffer: recording an error never throws.
thread_local std::string last_error;
thread_local std::array<char, 256> fixed_error{};
thread_local const char* last_error_text = "";

int FailFixed(absl::StatusCode code, const char* function, const char* what) noexcept {
  std::snprintf(fixed_error.data(), fixed_error.size(), "%s: %s", function, what);
  last_error_text = fixed_error.data();
  return static_cast<int>(code);
}

int Fail(const absl::Status& status) {
  try {
    last_error.assign(status.message().data(), status.message().size());
    last_error_text = last_error.c_str();
  } catch (...) {
    std::snprintf(fixed_error.data(), fixed_error.size(),
                  "out of memory: the message of error %d could not be kept",
                  static_cast<int>(status.code()));
    last_error_text = fixed_error.data();
  }
  return static_cast<int>(status.code());
}

int Check(const absl::Status& status) { return status.ok() ? 0 : Fail(status); }

// A null handle is the caller's bug: an error naming the function, not a crash.
int NullHandle(const char* function) {
  return Fail(absl::InvalidArgumentError(absl::StrCat(function, ": null handle")));
}

// Runs a C function's body so that no C++ exception unwinds into its C caller (undefined
// behaviour there): running out of memory is RESOURCE_EXHAUSTED "<function>: out of memory",
// anything else INTERNAL naming what was thrown. The body's own effects on the caller's
// handles are its to keep consistent (RAII does it).
template <typename Body>
int Guard(const char* function, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return FailFixed(absl::StatusCode::kResourceExhausted, function, "out of memory");
  } catch (const std::exception& e) {
    std::array<char, 200> what{};
    std::snprintf(what.data(), what.size(), "internal error: %s", e.what());
    return FailFixed(absl::StatusCode::kInternal, function, what.data());
  } catch (...) {
    return FailFixed(absl::StatusCode::kInternal, function, "internal error: unknown exception");
  }
}

// The caller's struct may be an older, smaller one (size is the smaller of the two): nothing
// is written past its size.
void FillDefaultOptions(ubep_client_options* options, size_t size) {
  static const std::string default_socket = ubep::ClientOptions().socket_path;
  const ubep::ClientOptions d;
  const ubep_client_options defaults{
      .struct_size = size,
      .socket_path = default_socket.c_str(),
      .rpc_timeout_ms = absl::ToInt64Milliseconds(d.rpc_timeout),
      .join_timeout_ms = absl::ToInt64Milliseconds(d.join_timeout),
      .decision_timeout_ms = absl::ToInt64Milliseconds(d.decision_timeout),
      .daemon_check_interval_ms = absl::ToInt64Milliseconds(d.daemon_check_interval),
  };
  std::memcpy(options, &defaults, size);
}

}  // namespace

extern "C" {

const char* ubep_last_error(void) { return last_error_text; }

void ubep_client_options_init(ubep_client_options* options, size_t struct_size) {
  if (options == nullptr) return;
  const size_t size = std::min(struct_size, sizeof(ubep_client_options));
  const int failed = Guard("ubep_client_options_init", [&] {
    FillDefaultOptions(options, size);
    // A newer caller's larger struct keeps its own size, so that ubep_attach_with refuses
    // it (its fields past this library's would be ignored) rather than taking it as this
    // library's.
    if (struct_size > size) options->struct_size = struct_size;
    return 0;
  });
  // Out of memory for the defaults: a zero struct_size, which ubep_attach_with refuses saying
  // how to fill the options, rather than fields left as they were.
  if (failed != 0) std::memset(options, 0, size);
}

namespace {

// No padding in the structures a caller sizes: a field added later must change sizeof for
// struct_size to tell the versions apart.
static_assert(sizeof(ubep_model_shape) == offsetof(ubep_model_shape, reserved) + sizeof(int32_t));
static_assert(sizeof(ubep_client_options) ==
              offsetof(ubep_client_options, daemon_check_interval_ms) + sizeof(int64_t));
static_assert(sizeof(ubep_rank_stats) == offsetof(ubep_rank_stats, plan_version) + sizeof(uint64_t));

// The attach of ubep_attach, ubep_attach_at and ubep_attach_with, naming `function` in its
// errors; inside the caller's Guard.
int AttachWith(const char* function, const ubep_client_options* c_options, int32_t rank,
               int32_t world_size, int32_t device, const ubep_model_shape* shape,
               int64_t next_step, ubep_rank** out) {
  if (out != nullptr) *out = nullptr;
  if (shape == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(function, ": null argument")));
  }
  if (shape->struct_size != sizeof(ubep_model_shape)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        function, ": shape->struct_size is ", shape->struct_size,
        ", not this library's sizeof(ubep_model_shape) ", sizeof(ubep_model_shape),
        shape->struct_size > sizeof(ubep_model_shape)
            ? " (the caller was built with a newer ubep_c.h than this libubep)"
            : " (set it to sizeof(ubep_model_shape))")));
  }
  ubep::ClientOptions options;
  if (c_options != nullptr) {
    // Only the v1 fields exist so far: a smaller struct is not a ubep_client_options, a
    // larger one comes from a newer header whose fields this library would ignore.
    if (c_options->struct_size != sizeof(ubep_client_options)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "ubep_attach_with: options->struct_size is ", c_options->struct_size,
          ", not this library's sizeof(ubep_client_options) ", sizeof(ubep_client_options),
          c_options->struct_size > sizeof(ubep_client_options)
              ? " (the caller was built with a newer ubep_c.h than this libubep)"
              : " (fill the options with ubep_client_options_init)")));
    }
    if (c_options->socket_path == nullptr) {
      return Fail(absl::InvalidArgumentError("ubep_attach_with: options->socket_path is null"));
    }
    options.socket_path = c_options->socket_path;
    options.rpc_timeout = absl::Milliseconds(c_options->rpc_timeout_ms);
    options.join_timeout = absl::Milliseconds(c_options->join_timeout_ms);
    options.decision_timeout = absl::Milliseconds(c_options->decision_timeout_ms);
    options.daemon_check_interval = absl::Milliseconds(c_options->daemon_check_interval_ms);
  }
  ubep::ModelShape s;
  s.num_layers = shape->num_layers;
  s.num_experts = shape->num_experts;
  s.hidden = shape->hidden;
  s.top_k = shape->top_k;
  s.max_tokens = shape->max_tokens;
  s.slots_per_rank = shape->slots_per_rank;
  s.bytes_per_expert = shape->bytes_per_expert;
  if (shape->dtype != UBEP_DTYPE_FLOAT32 && shape->dtype != UBEP_DTYPE_BFLOAT16) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        function, ": dtype ", shape->dtype, " is neither UBEP_DTYPE_FLOAT32 (0) nor "
        "UBEP_DTYPE_BFLOAT16 (1)")));
  }
  s.dtype = shape->dtype == UBEP_DTYPE_BFLOAT16 ? ubep::DType::kBFloat16 : ubep::DType::kFloat32;
  // The handle first: out of memory for it after the attach would detach the rank again on
  // the way out, in the middle of an exception.
  auto handle = std::make_unique<ubep_rank>();
  absl::StatusOr<std::unique_ptr<ubep::Rank>> r = ubep::Rank::Attach(
      options, rank, world_size, device, s,
      next_step < 0 ? std::nullopt : std::optional<uint64_t>(static_cast<uint64_t>(next_step)));
  if (!r.ok()) return Fail(r.status());
  handle->rank = *std::move(r);
  *out = handle.release();
  return 0;
}

// ubep_attach and ubep_attach_at, each naming itself in its errors.
int AttachAt(const char* function, const char* socket_path, int32_t rank, int32_t world_size,
             int32_t device, const ubep_model_shape* shape, int64_t next_step, ubep_rank** out) {
  return Guard(function, [&] {
    if (out != nullptr) *out = nullptr;  // On every error.
    if (socket_path == nullptr || shape == nullptr || out == nullptr) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(function, ": null argument")));
    }
    ubep_client_options options;
    ubep_client_options_init(&options, sizeof(options));
    if (options.struct_size == 0) {  // Out of memory for the defaults: not the caller's fault.
      return FailFixed(absl::StatusCode::kResourceExhausted, function, "out of memory");
    }
    options.socket_path = socket_path;
    return AttachWith(function, &options, rank, world_size, device, shape, next_step, out);
  });
}

}  // namespace

int ubep_attach(const char* socket_path, int32_t rank, int32_t world_size, int32_t device,
                const ubep_model_shape* shape, ubep_rank** out) {
  return AttachAt("ubep_attach", socket_path, rank, world_size, device, shape, -1, out);
}

int ubep_attach_at(const char* socket_path, int32_t rank, int32_t world_size, int32_t device,
                   const ubep_model_shape* shape, int64_t next_step, ubep_rank** out) {
  return AttachAt("ubep_attach_at", socket_path, rank, world_size, device, shape, next_step,
                  out);
}

int ubep_attach_with(const ubep_client_options* c_options, int32_t rank, int32_t world_size,
                     int32_t device, const ubep_model_shape* shape, int64_t next_step,
                     ubep_rank** out) {
  return Guard("ubep_attach_with", [&] {
    return AttachWith("ubep_attach_with", c_options, rank, world_size, device, shape, next_step,
                      out);
  });
}

int ubep_detach(ubep_rank* rank) {
  if (rank == nullptr) return 0;
  // The handle is freed whatever happens.
  return Guard("ubep_detach", [owned = std::unique_ptr<ubep_rank>(rank)] {
    return Check(owned->rank->Detach());
  });
}

uint64_t ubep_resume_step(const ubep_rank* rank) {
  return rank != nullptr ? rank->rank->resume_step() : 0;
}

int ubep_begin_step(ubep_rank* rank, uint64_t step) {
  return Guard("ubep_begin_step", [&] {
    if (rank == nullptr) return NullHandle("ubep_begin_step");
    return Check(rank->rank->BeginStep(step));
  });
}

int ubep_weights_loaded(ubep_rank* rank) {
  return Guard("ubep_weights_loaded", [&] {
    if (rank == nullptr) return NullHandle("ubep_weights_loaded");
    return Check(rank->rank->WeightsLoaded());
  });
}

int ubep_excluded(const ubep_rank* rank) {
  if (rank == nullptr) return 0;
  // The first look at a plan copies and checks its table: out of memory there is a no (the
  // call that needs the plan, BeginStep, fails with the reason).
  return Guard("ubep_excluded", [&] { return rank->rank->excluded() ? 1 : 0; }) == 1 ? 1 : 0;
}

int ubep_must_attach_again(const ubep_rank* rank) {
  if (rank == nullptr) return 0;
  // Finding the daemon gone stops the group, which builds the error later calls return: out
  // of memory there is still a yes (the rank noted the exit first; ubep_last_error says why).
  return Guard("ubep_must_attach_again",
               [&] { return rank->rank->must_attach_again() ? 1 : 0; }) != 0
             ? 1
             : 0;
}

int ubep_stats(const ubep_rank* rank, ubep_rank_stats* out) {
  return Guard("ubep_stats", [&] {
    if (rank == nullptr) return NullHandle("ubep_stats");
    if (out == nullptr) return Fail(absl::InvalidArgumentError("ubep_stats: out is null"));
    if (out->struct_size != sizeof(ubep_rank_stats)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "ubep_stats: out->struct_size is ", out->struct_size,
          ", not this library's sizeof(ubep_rank_stats) ", sizeof(ubep_rank_stats))));
    }
    const ubep::RankStats s = rank->rank->stats();
    *out = ubep_rank_stats{.struct_size = sizeof(ubep_rank_stats),
                           .generation = s.generation,
                           .step = s.step,
                           .dispatched_tokens = s.dispatched_tokens,
                           .dispatch_calls = s.dispatch_calls,
                           .combine_calls = s.combine_calls,
                           .wait_timeouts = s.wait_timeouts,
                           .errors = s.errors,
                           .plan_version = s.plan_version};
    return 0;
  });
}

int ubep_rejoin(ubep_rank* rank, int64_t next_step, uint64_t* resume_step) {
  return Guard("ubep_rejoin", [&] {
    if (rank == nullptr) return NullHandle("ubep_rejoin");
    absl::StatusOr<uint64_t> r = rank->rank->Rejoin(
        next_step < 0 ? std::nullopt : std::optional<uint64_t>(static_cast<uint64_t>(next_step)));
    if (!r.ok()) return Fail(r.status());
    if (resume_step != nullptr) *resume_step = *r;
    return 0;
  });
}

ubep_dispatched* ubep_dispatched_new(void) {
  ubep_dispatched* d = nullptr;
  Guard("ubep_dispatched_new", [&] {
    d = new ubep_dispatched;
    return 0;
  });
  return d;
}
void ubep_dispatched_free(ubep_dispatched* dispatched) { delete dispatched; }

int ubep_dispatch(ubep_rank* rank, int32_t layer, const void* x, const int32_t* topk_idx,
                  const float* topk_weights, int32_t num_tokens, ubep_dispatched* out) {
  return Guard("ubep_dispatch", [&] {
    if (rank == nullptr || out == nullptr) return NullHandle("ubep_dispatch");
    return Check(rank->rank->Dispatch(layer, x, topk_idx, topk_weights, num_tokens, out->dispatched));
  });
}

void ubep_dispatched_view(const ubep_dispatched* d, int32_t* num_rows, const void** rows,
                          const int32_t** slot_offsets, const int32_t** src_rank,
                          const int32_t** src_token, const float** weights) {
  if (d == nullptr) {
    // Nothing to view: every output says so (a caller's loop bound is never left unset).
    if (num_rows != nullptr) *num_rows = 0;
    if (rows != nullptr) *rows = nullptr;
    if (slot_offsets != nullptr) *slot_offsets = nullptr;
    if (src_rank != nullptr) *src_rank = nullptr;
    if (src_token != nullptr) *src_token = nullptr;
    if (weights != nullptr) *weights = nullptr;
    return;
  }
  if (num_rows != nullptr) *num_rows = d->dispatched.num_rows();
  if (rows != nullptr) *rows = d->dispatched.rows();
  if (slot_offsets != nullptr) *slot_offsets = d->dispatched.slot_offsets().data();
  if (src_rank != nullptr) *src_rank = d->dispatched.src_rank().data();
  if (src_token != nullptr) *src_token = d->dispatched.src_token().data();
  if (weights != nullptr) *weights = d->dispatched.weights().data();
}

int ubep_dispatched_plan(const ubep_dispatched* d, uint64_t* plan_version, int32_t* layer) {
  return Guard("ubep_dispatched_plan", [&] {
    if (d == nullptr) return NullHandle("ubep_dispatched_plan");
    if (plan_version != nullptr) *plan_version = d->dispatched.plan_version();
    if (layer != nullptr) *layer = d->dispatched.layer();
    return 0;
  });
}

int ubep_combine(ubep_rank* rank, const ubep_dispatched* dispatched, const void* expert_out,
                 void* out) {
  return Guard("ubep_combine", [&] {
    if (rank == nullptr || dispatched == nullptr) return NullHandle("ubep_combine");
    return Check(rank->rank->Combine(dispatched->dispatched, expert_out, out));
  });
}

int ubep_expert_weights(ubep_rank* rank, int32_t layer, int32_t local_slot, void** data,
                        uint64_t* bytes) {
  return Guard("ubep_expert_weights", [&] {
    if (rank == nullptr) return NullHandle("ubep_expert_weights");
    absl::StatusOr<std::span<std::byte>> w = rank->rank->ExpertWeights(layer, local_slot);
    if (!w.ok()) return Fail(w.status());
    if (data != nullptr) *data = w->data();
    if (bytes != nullptr) *bytes = w->size();
    return 0;
  });
}

int ubep_slot_expert(const ubep_rank* rank, int32_t layer, int32_t local_slot, int32_t* expert) {
  return Guard("ubep_slot_expert", [&] {
    if (rank == nullptr) return NullHandle("ubep_slot_expert");
    if (expert == nullptr) {
      return Fail(absl::InvalidArgumentError("ubep_slot_expert: expert is null"));
    }
    absl::StatusOr<int> e = rank->rank->SlotExpert(layer, local_slot);
    if (!e.ok()) return Fail(e.status());
    *expert = *e;
    return 0;
  });
}

}  // extern "C"
