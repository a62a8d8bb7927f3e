/* ubep-c-example: libubep through its C ABI (what a Python or Rust binding calls).
 * Attaches a one-rank group (1 layer, 4 experts in 4 slots; options from
 * ubep_client_options_init), dispatches 4 tokens to 2 experts each, lets expert e scale its
 * rows by e + 1, combines, and checks every value and the rank's counters; then shows the
 * error a bad expert id gets.
 * Host backend only: it passes host buffers and reads the received rows on the host (with a
 * CUDA ubepd both are device memory).
 * Usage: ubep-c-example SOCKET
 * Prints "c api ok" and exits 0 on success. */
#include <stdio.h>
#include <string.h>

#include "ubep/ubep_c.h"

enum { kTokens = 4, kHidden = 8, kTopK = 2, kExperts = 4 };

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: ubep-c-example SOCKET\n");
    return 2;
  }
  ubep_model_shape shape = {sizeof(ubep_model_shape), 1, kExperts, kHidden, kTopK, kTokens, kExperts, 0, UBEP_DTYPE_FLOAT32, 0};
  ubep_client_options options;
  ubep_client_options_init(&options, sizeof(options));
  options.socket_path = argv[1];
  options.join_timeout_ms = 30000;
  ubep_rank* rank = NULL;
  if (ubep_attach_with(&options, 0, 1, 0, &shape, -1, &rank) != 0) {
    fprintf(stderr, "attach: %s\n", ubep_last_error());
    return 1;
  }
  /* From here on every exit goes through `done`: the rank is detached (its ubepd frees it at
   * once) and the dispatch output freed, whatever failed. */
  int failed = 1;
  int32_t rows = 0;
  int bad_expert_code = 0;
  ubep_dispatched* d = NULL;
  if (ubep_begin_step(rank, ubep_resume_step(rank)) != 0) {
    fprintf(stderr, "begin_step: %s\n", ubep_last_error());
    goto done;
  }
  if (ubep_excluded(rank) != 0 || ubep_must_attach_again(rank) != 0) {
    fprintf(stderr, "a rank of a healthy group reads as excluded (%d) or cut off (%d)\n",
            ubep_excluded(rank), ubep_must_attach_again(rank));
    goto done;
  }
  float x[kTokens][kHidden];
  int32_t idx[kTokens][kTopK];
  float w[kTokens][kTopK];
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) x[t][h] = (float)(t * kHidden + h);
    idx[t][0] = t % kExperts;
    idx[t][1] = (t + 1) % kExperts;
    w[t][0] = 0.25f;
    w[t][1] = 0.75f;
  }
  d = ubep_dispatched_new();
  if (d == NULL) {
    fprintf(stderr, "dispatched_new: %s\n", ubep_last_error());
    goto done;
  }
  if (ubep_dispatch(rank, 0, x, &idx[0][0], &w[0][0], kTokens, d) != 0) {
    fprintf(stderr, "dispatch: %s\n", ubep_last_error());
    goto done;
  }
  const void* recv = NULL;
  const int32_t* offsets = NULL;
  ubep_dispatched_view(d, &rows, &recv, &offsets, NULL, NULL, NULL);
  float y[kTokens * kTopK][kHidden];
  for (int slot = 0; slot < kExperts; ++slot) {
    /* The expert this slot holds under the step's plan (round-robin or not, a balancer's). */
    int32_t expert = -1;
    if (ubep_slot_expert(rank, 0, slot, &expert) != 0) {
      fprintf(stderr, "slot_expert: %s\n", ubep_last_error());
      goto done;
    }
    for (int r = offsets[slot]; r < offsets[slot + 1]; ++r) {
      for (int h = 0; h < kHidden; ++h) y[r][h] = (float)(expert + 1) * ((const float*)recv)[r * kHidden + h];
    }
  }
  float out[kTokens][kHidden];
  if (ubep_combine(rank, d, y, out) != 0) {
    fprintf(stderr, "combine: %s\n", ubep_last_error());
    goto done;
  }
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) {
      const float want = 0.25f * (float)(idx[t][0] + 1) * x[t][h] + 0.75f * (float)(idx[t][1] + 1) * x[t][h];
      if (out[t][h] != want) {
        fprintf(stderr, "out[%d][%d] = %g, want %g\n", t, h, out[t][h], want);
        goto done;
      }
    }
  }
  ubep_rank_stats stats;
  memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  if (ubep_stats(rank, &stats) != 0) {
    fprintf(stderr, "stats: %s\n", ubep_last_error());
    goto done;
  }
  if (stats.dispatch_calls != 1 || stats.combine_calls != 1 || stats.dispatched_tokens != kTokens) {
    fprintf(stderr, "stats: %llu dispatches, %llu combines, %llu tokens\n",
            (unsigned long long)stats.dispatch_calls, (unsigned long long)stats.combine_calls,
            (unsigned long long)stats.dispatched_tokens);
    goto done;
  }
  idx[2][1] = 7;
  bad_expert_code = ubep_dispatch(rank, 0, x, &idx[0][0], &w[0][0], kTokens, d);
  if (bad_expert_code == 0) {
    fprintf(stderr, "a bad expert id was accepted\n");
    goto done;
  }
  printf("bad expert: code %d: %s\n", bad_expert_code, ubep_last_error());
  failed = bad_expert_code != 3;  /* INVALID_ARGUMENT, before any byte moved. */
done:
  ubep_dispatched_free(d);
  if (ubep_detach(rank) != 0) {
    fprintf(stderr, "detach: %s\n", ubep_last_error());
    failed = 1;
  }
  if (failed) return 1;
  printf("c api ok: %d rows\n", rows);
  return 0;
}
