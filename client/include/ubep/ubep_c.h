/* libubep's C ABI, for FFI from Python (ctypes/cffi), Rust and others. Mirrors ubep/ubep.h.
 *
 * Every function returning int returns 0 on success, else the error's gRPC/absl status code
 * (3 = INVALID_ARGUMENT, 4 = DEADLINE_EXCEEDED, 8 = RESOURCE_EXHAUSTED, 9 =
 * FAILED_PRECONDITION, 10 = ABORTED, 14 = UNAVAILABLE, ...; their meaning is ubep/ubep.h's);
 * ubep_last_error() then gives the message (per thread, valid until the next call that fails;
 * a call that succeeds leaves it as it was: read it only after a nonzero return). Two ask
 * a question instead, 1 for yes and 0 for no (or a null handle): ubep_excluded and
 * ubep_must_attach_again.
 * No C++ exception leaves these functions: out of memory, one returns 8 (RESOURCE_EXHAUSTED)
 * with "<function>: out of memory" (ubep_dispatched_new returns NULL so;
 * ubep_client_options_init zeroes the struct, which ubep_attach_with refuses), and anything
 * else thrown inside is 13 (INTERNAL) naming it. ubep_detach frees its handle either way.
 * (Out of memory in ubep_dispatch or ubep_combine is not the receive-capacity overflow that 8
 * means there, told apart by its message: that rank's call did not complete and the group is
 * out of step: call ubep_rejoin. After a dispatch had begun, or in a combine (host backend:
 * ubep_combine, or the combine ubep_dispatch runs for an overflowed call), the rank's next
 * call returns 13 saying to call ubep_rejoin; on the host backend the group also gives up on
 * the rank (its peers stop waiting for it), on the CUDA backend they wait out their timeout.)
 * Handles are not thread-safe: one thread drives a rank, and no two calls on one handle may
 * overlap, those taking a const handle included (ubep_excluded and ubep_slot_expert check and
 * cache the plan, ubep_must_attach_again stops the group when it finds ubepd gone).
 */
#ifndef UBEP_CLIENT_INCLUDE_UBEP_UBEP_C_H_
#define UBEP_CLIENT_INCLUDE_UBEP_UBEP_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ubep_rank ubep_rank;
typedef struct ubep_dispatched ubep_dispatched;

enum { UBEP_DTYPE_FLOAT32 = 0, UBEP_DTYPE_BFLOAT16 = 1 };

/* The model's shape. struct_size lets later versions add fields at the end (as with
 * ubep_client_options): the caller sets it to sizeof(ubep_model_shape); this first version
 * takes its own size only. `reserved` fills what would be padding (so that a field added
 * later changes sizeof): set it to 0; this version ignores it (a caller built before it
 * existed left those bytes as they were). */
typedef struct {
  size_t struct_size; /* sizeof(ubep_model_shape) */
  int32_t num_layers;
  int32_t num_experts;
  int32_t hidden;
  int32_t top_k;
  int32_t max_tokens;
  int32_t slots_per_rank;
  uint64_t bytes_per_expert;
  int32_t dtype;    /* UBEP_DTYPE_* */
  int32_t reserved; /* 0; ignored */
} ubep_model_shape;

/* What ubep_attach_with takes besides the rank and shape; ubep_client_options_init fills in
 * the defaults (ubep::ClientOptions'), and the caller changes what it needs. Durations are in
 * milliseconds, each > 0 and under a million hours (every wait has an end). struct_size lets later versions add fields at the end: init is told
 * the size the caller was compiled with and writes no byte past it (nor past its own size,
 * leaving struct_size the caller's), and a later library will take an older caller's smaller
 * struct and fill in defaults for the rest; this first version takes its own size only, and
 * refuses a newer caller's larger struct rather than ignore its fields. */
typedef struct {
  size_t struct_size;               /* sizeof(ubep_client_options), as init sets it */
  const char* socket_path;          /* ubepd's socket; "/run/ubep/ubepd.sock" */
  int64_t rpc_timeout_ms;           /* each RPC to ubepd but Join (Attach, Detach, arena
                                       claim and refresh); 10000 */
  int64_t join_timeout_ms;          /* waiting for the rest of the group; 60000 */
  int64_t decision_timeout_ms;      /* begin_step waiting for a prepared plan's decision; 30000 */
  int64_t daemon_check_interval_ms; /* how often begin_step looks whether ubepd is there; 1000 */
} ubep_client_options;

/* Counters of a rank (ubep::RankStats). The caller sets struct_size to
 * sizeof(ubep_rank_stats) before ubep_stats, so that later versions can add fields at the end
 * (as with ubep_client_options). */
typedef struct {
  size_t struct_size;
  uint64_t generation;        /* of the group the rank joined last */
  uint64_t step;
  uint64_t dispatched_tokens;
  uint64_t dispatch_calls;
  uint64_t combine_calls;
  uint64_t wait_timeouts;
  uint64_t errors;
  uint64_t plan_version;      /* of the last dispatch */
} ubep_rank_stats;

const char* ubep_last_error(void);

/* Fills the first struct_size bytes of *options (pass sizeof(ubep_client_options)) with the
 * defaults, struct_size included. */
void ubep_client_options_init(ubep_client_options* options, size_t struct_size);

/* Attaches `rank` and waits for the group; *out owns the rank until ubep_detach. */
int ubep_attach(const char* socket_path, int32_t rank, int32_t world_size, int32_t device,
                const ubep_model_shape* shape, ubep_rank** out);
/* ubep_attach with the step this process runs next, when it knows it (attaching again after
 * its ubepd restarted); the group resumes at the least one given (next_step < 0: unknown). */
int ubep_attach_at(const char* socket_path, int32_t rank, int32_t world_size, int32_t device,
                   const ubep_model_shape* shape, int64_t next_step, ubep_rank** out);
/* ubep_attach_at with options (socket path, timeouts); options NULL: the defaults. */
int ubep_attach_with(const ubep_client_options* options, int32_t rank, int32_t world_size,
                     int32_t device, const ubep_model_shape* shape, int64_t next_step,
                     ubep_rank** out);
/* Detaches and frees the rank (also on error). */
int ubep_detach(ubep_rank* rank);
uint64_t ubep_resume_step(const ubep_rank* rank);
int ubep_begin_step(ubep_rank* rank, uint64_t step);
/* next_step < 0: unknown. */
int ubep_rejoin(ubep_rank* rank, int64_t next_step, uint64_t* resume_step);
/* 1 when the newest committed plan leaves the rank out of the group (Rank::excluded). */
int ubep_excluded(const ubep_rank* rank);
/* 1 when its ubepd is draining or exited: detach, and attach again (Rank::must_attach_again). A
 * rank ubep_detach has let go is freed with it: there is nothing left to ask. */
int ubep_must_attach_again(const ubep_rank* rank);
int ubep_stats(const ubep_rank* rank, ubep_rank_stats* out);

ubep_dispatched* ubep_dispatched_new(void);
void ubep_dispatched_free(ubep_dispatched* dispatched);
int ubep_dispatch(ubep_rank* rank, int32_t layer, const void* x, const int32_t* topk_idx,
                  const float* topk_weights, int32_t num_tokens, ubep_dispatched* out);
/* Views into `dispatched`, valid until its next dispatch. On the CUDA backend rows, src_rank,
 * src_token and weights are device pointers into the rank's scratch, valid until the rank's
 * next dispatch through any handle, its Rejoin or its Detach; num_rows and slot_offsets are
 * host memory. Any output pointer may be NULL; a NULL `dispatched`, or one whose last
 * dispatch failed (but for the CUDA backend's bad input found on the device, whose output
 * holds the rest), gives 0 rows and NULL views. */
void ubep_dispatched_view(const ubep_dispatched* dispatched, int32_t* num_rows,
                          const void** rows, const int32_t** slot_offsets,
                          const int32_t** src_rank, const int32_t** src_token,
                          const float** weights);
/* The plan that routed the dispatch and its layer (Dispatched::plan_version, layer); either
 * pointer may be NULL. */
int ubep_dispatched_plan(const ubep_dispatched* dispatched, uint64_t* plan_version,
                         int32_t* layer);
int ubep_combine(ubep_rank* rank, const ubep_dispatched* dispatched, const void* expert_out,
                 void* out);

/* The weight buffer of (layer, local_slot) under the plan of the current step
 * (Rank::ExpertWeights): on the CUDA backend *data is device memory (fill it with cudaMemcpy).
 * *data is valid until ubep_detach (a view kept past it, a NumPy array say, reads unmapped
 * memory), and is the buffer of that slot's expert under this plan only: fetch it again at a
 * step under a new plan (the slot may hold another expert, in another buffer). */
int ubep_expert_weights(ubep_rank* rank, int32_t layer, int32_t local_slot, void** data,
                        uint64_t* bytes);
/* The logical expert that (layer, local_slot) holds under the plan of the current step: the
 * one whose weights ubep_expert_weights' buffer is to hold (Rank::SlotExpert). */
int ubep_slot_expert(const ubep_rank* rank, int32_t layer, int32_t local_slot, int32_t* expert);
/* Says the weights of every slot ubep_slot_expert names are in their buffers
 * (Rank::WeightsLoaded): call it once they are loaded after an attach (on the CUDA backend,
 * once the copies completed). */
int ubep_weights_loaded(ubep_rank* rank);

#ifdef __cplusplus
}
#endif

#endif /* UBEP_CLIENT_INCLUDE_UBEP_UBEP_C_H_ */
