// ubep-bench-mpi: the MPI baseline of ubep-bench-dataplane. Run under mpirun, one process per
// rank; moves the same bytes as the host backend (same routing, same plan, bf16 rows): count
// exchange (MPI_Alltoall), rows with their records (each row followed by its K slots, one
// MPI_Alltoallv of bytes), the same per-slot grouping on the receiver, partial sums back with
// MPI_Alltoallv and the same fp32 reduction at the source. Inputs and the check of every
// iteration's output as ubep-bench-dataplane's (bench::CheckedInput).
// Rank 0 prints one JSON line: p50_us, p99_us (the slowest rank per iteration), bytes_moved,
// latency_us (each timed iteration's, the slowest rank's), span_us (each timed iteration's,
// the first rank's start to the last rank's end).
//
//   mpirun -np R ubep-bench-mpi --phase decode|prefill --tokens T --hidden H
//       --routing uniform|skewed --iters N
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/dataplane_inputs.h"
#include "common/percentile.h"
#include "kernels/common/bf16.h"
#include "kernels/common/prefetch.h"
#include "kernels/common/routing.h"

namespace {

using ubep::bench::kTopK;
using ubep::kernels::Bf16ToFloat;
using ubep::kernels::FloatToBf16;
using ubep::kernels::PrefetchRow;
using ubep::kernels::PrefetchRowForWrite;


}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, R = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  ubep::bench::Case c{"decode", R, 128, 7168, "uniform"};
  int iters = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--phase") c.name = argv[i + 1];  // The traces a skewed routing is drawn from.
    if (flag == "--tokens") c.tokens = std::atoi(argv[i + 1]);
    if (flag == "--hidden") c.hidden = std::atoi(argv[i + 1]);
    if (flag == "--routing") c.routing = argv[i + 1];
    if (flag == "--iters") iters = std::atoi(argv[i + 1]);
  }
  const int H = c.hidden, T = c.tokens, S = ubep::bench::kExperts / R;
  ubep::bench::Skew skew;
  if (c.routing == "skewed") {
    absl::StatusOr<ubep::bench::Skew> drawn =
        ubep::bench::SkewedDistribution(UBEP_SOURCE_DIR, c.name, R);
    if (!drawn.ok()) {
      if (rank == 0) std::fprintf(stderr, "ubep-bench-mpi: %s\n", std::string(drawn.status().message()).c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    skew = *std::move(drawn);
  }
  const std::vector<int32_t> idx = ubep::bench::RouteTokens(c, rank, skew);
  const std::vector<std::byte> table = ubep::bench::ExpertParallelPlan();
  const auto* plan = reinterpret_cast<const ubep::kernels::PlanTableHeader*>(table.data());
  const std::vector<uint16_t> inputs[2] = {ubep::bench::CheckedInput(c, rank, 0),
                                           ubep::bench::CheckedInput(c, rank, 1)};
  const float weight = 1.0f / kTopK;
  std::vector<uint16_t> out(inputs[0].size());
  // A row on the wire: its H bf16 values, then its K local slots (-1 ends them).
  const size_t RB = static_cast<size_t>(H) * 2 + kTopK * sizeof(int32_t);

  constexpr int kWarmup = 5;
  std::vector<double> us, span_us;
  uint64_t bytes = 0;
  std::vector<std::vector<int32_t>> tokens(R), entries(R);  // entries: slot per pair, -1 ends
  // Buffers live across iterations (as the host backend's arenas do): no page faults timed.
  std::vector<std::byte> send_rows_buf, recv_rows_buf;
  std::vector<uint16_t> grouped, partial, back;
  std::vector<int32_t> recv_e;
  std::vector<int> row_of, token_begin, token_rows, at;
  std::vector<float> sum(H);
  for (int it = 0; it < kWarmup + iters; ++it) {
    const std::vector<uint16_t>& x = inputs[it % 2];
    MPI_Barrier(MPI_COMM_WORLD);
    const int64_t start = ubep::bench::NowNs();
    // Route and de-duplicate: one row per (token, destination); records carry K slots.
    for (int d = 0; d < R; ++d) {
      tokens[d].clear();
      entries[d].clear();
    }
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < kTopK; ++k) {
        const int e = idx[t * kTopK + k];
        const uint32_t p = ubep::kernels::RouteSlot(plan, 0, rank, t, k, e);
        const int d = p / S;
        if (tokens[d].empty() || tokens[d].back() != t) {
          tokens[d].push_back(t);
          entries[d].resize(entries[d].size() + kTopK, -1);
        }
        auto it_slot = entries[d].end() - kTopK;
        while (*it_slot != -1) ++it_slot;
        *it_slot = static_cast<int32_t>(p % S);
      }
    }
    std::vector<int> send_n(R), recv_n(R);
    for (int d = 0; d < R; ++d) send_n[d] = static_cast<int>(tokens[d].size());
    MPI_Alltoall(send_n.data(), 1, MPI_INT, recv_n.data(), 1, MPI_INT, MPI_COMM_WORLD);
    // MPI counts are ints: rows with their records, in bytes, must fit one (checked before
    // anything is sized or counted from them).
    int64_t send_total = 0, recv_total = 0;
    for (int d = 0; d < R; ++d) {
      send_total += send_n[d];
      recv_total += recv_n[d];
    }
    if (static_cast<uint64_t>(std::max(send_total, recv_total)) * RB > INT32_MAX) {
      std::fprintf(stderr, "ubep-bench-mpi: rank %d: %ld rows of %zu bytes exceed MPI's int counts\n",
                   rank, static_cast<long>(std::max(send_total, recv_total)), RB);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    // Counts and displacements: of rows with their records (bytes), and of partials (bf16).
    std::vector<int> bc(R), bd(R), brc(R), brd(R), sc(R), sd(R), rc(R), rd(R);
    int send_rows = 0, recv_rows = 0;
    for (int d = 0; d < R; ++d) {
      bc[d] = static_cast<int>(send_n[d] * RB);
      bd[d] = static_cast<int>(send_rows * RB);
      sc[d] = send_n[d] * H;
      sd[d] = send_rows * H;
      send_rows += send_n[d];
      brc[d] = static_cast<int>(recv_n[d] * RB);
      brd[d] = static_cast<int>(recv_rows * RB);
      rc[d] = recv_n[d] * H;
      rd[d] = recv_rows * H;
      recv_rows += recv_n[d];
    }
    send_rows_buf.resize(static_cast<size_t>(send_rows) * RB);
    for (int d = 0, row = 0; d < R; ++d) {
      for (size_t j = 0; j < tokens[d].size(); ++j, ++row) {
        if (j + 1 < tokens[d].size()) PrefetchRow(&x[tokens[d][j + 1] * H], H * 2);
        std::byte* to = &send_rows_buf[static_cast<size_t>(row) * RB];
        std::memcpy(to, &x[tokens[d][j] * H], H * 2);
        std::memcpy(to + H * 2, &entries[d][j * kTopK], kTopK * sizeof(int32_t));
      }
    }
    recv_rows_buf.resize(static_cast<size_t>(recv_rows) * RB);
    MPI_Alltoallv(send_rows_buf.data(), bc.data(), bd.data(), MPI_BYTE, recv_rows_buf.data(),
                  brc.data(), brd.data(), MPI_BYTE, MPI_COMM_WORLD);
    recv_e.resize(static_cast<size_t>(recv_rows) * kTopK);
    for (int r = 0; r < recv_rows; ++r) {
      std::memcpy(&recv_e[static_cast<size_t>(r) * kTopK],
                  &recv_rows_buf[static_cast<size_t>(r) * RB + H * 2], kTopK * sizeof(int32_t));
    }
    auto recv_row = [&](int r) {
      return reinterpret_cast<const uint16_t*>(&recv_rows_buf[static_cast<size_t>(r) * RB]);
    };
    // Group by local slot (what the experts need), as the host backend does.
    std::vector<int> offsets(S + 1, 0);
    for (int32_t s : recv_e) {
      if (s >= 0) ++offsets[s + 1];
    }
    for (int i = 0; i < S; ++i) offsets[i + 1] += offsets[i];
    std::vector<int> cursor(offsets.begin(), offsets.end() - 1);
    grouped.resize(static_cast<size_t>(offsets[S]) * H);
    row_of.assign(recv_e.size(), -1);
    for (int r = 0; r < recv_rows; ++r) {
      for (int q = 0; q < kTopK; ++q) {
        const int32_t s = recv_e[r * kTopK + q];
        if (s < 0) continue;
        const int row = cursor[s]++;
        row_of[r * kTopK + q] = row;
        if (q == 0 && r + 1 < recv_rows) {  // The same prefetching as the host backend's.
          PrefetchRow(recv_row(r + 1), H * 2);
        }
        if (q + 1 < kTopK && recv_e[r * kTopK + q + 1] >= 0) {
          PrefetchRowForWrite(&grouped[static_cast<size_t>(cursor[recv_e[r * kTopK + q + 1]]) * H],
                              H * 2);
        }
        std::memcpy(&grouped[static_cast<size_t>(row) * H], recv_row(r), H * 2);
      }
    }
    // Combine: y = grouped rows; one bf16 partial per received record, back to its source.
    // The sums as the host backend's: whole rows into an fp32 row in turn (the first product
    // assigned), the next row prefetched meanwhile, rounded once.
    partial.resize(static_cast<size_t>(recv_rows) * H);
    auto add_row = [&](float w, const uint16_t* row, bool first) {
      if (first) {
        for (int h = 0; h < H; ++h) sum[h] = w * Bf16ToFloat(row[h]);
      } else {
        for (int h = 0; h < H; ++h) sum[h] += w * Bf16ToFloat(row[h]);
      }
    };
    auto store_sum = [&](uint16_t* to) {
      for (int h = 0; h < H; ++h) to[h] = FloatToBf16(sum[h]);
    };
    for (int r = 0; r < recv_rows; ++r) {
      bool first = true;
      for (int q = 0; q < kTopK; ++q) {
        const int row = row_of[r * kTopK + q];
        if (row < 0) continue;
        const int next = q + 1 < kTopK ? row_of[r * kTopK + q + 1]
                         : r + 1 < recv_rows ? row_of[(r + 1) * kTopK] : -1;
        if (next >= 0) PrefetchRow(&grouped[static_cast<size_t>(next) * H], H * 2);
        add_row(weight, &grouped[static_cast<size_t>(row) * H], first);
        first = false;
      }
      store_sum(&partial[static_cast<size_t>(r) * H]);
    }
    back.resize(static_cast<size_t>(send_rows) * H);
    MPI_Alltoallv(partial.data(), rc.data(), rd.data(), MPI_UINT16_T, back.data(), sc.data(),
                  sd.data(), MPI_UINT16_T, MPI_COMM_WORLD);
    // Each token's partials, destinations in rank order, summed per token as the host backend
    // does (not into a [T, H] fp32 array, which moves twice the bytes).
    token_begin.assign(T + 1, 0);
    for (int d = 0; d < R; ++d) {
      for (int32_t t : tokens[d]) ++token_begin[t + 1];
    }
    for (int t = 0; t < T; ++t) token_begin[t + 1] += token_begin[t];
    token_rows.resize(token_begin[T]);
    at.assign(token_begin.begin(), token_begin.end() - 1);
    for (int d = 0, row = 0; d < R; ++d) {
      for (int32_t t : tokens[d]) token_rows[at[t]++] = row++;
    }
    for (int t = 0; t < T; ++t) {
      if (token_begin[t] == token_begin[t + 1]) std::fill(sum.begin(), sum.end(), 0.0f);
      for (int q = token_begin[t]; q < token_begin[t + 1]; ++q) {
        if (q + 1 < token_begin[T]) {
          PrefetchRow(&back[static_cast<size_t>(token_rows[q + 1]) * H], H * 2);
        }
        add_row(1.0f, &back[static_cast<size_t>(token_rows[q]) * H], q == token_begin[t]);
      }
      store_sum(&out[static_cast<size_t>(t) * H]);
    }
    const int64_t end = ubep::bench::NowNs();
    // The slowest rank's time, and the span from the first start to the last end (one steady
    // clock for every process of the machine): the largest of each of {end - start, -start,
    // end} over the ranks.
    const int64_t mine[3] = {end - start, -start, end};
    int64_t most[3] = {0, 0, 0};
    MPI_Reduce(mine, most, 3, MPI_INT64_T, MPI_MAX, 0, MPI_COMM_WORLD);
    if (it >= kWarmup) {
      us.push_back(most[0] / 1e3);
      span_us.push_back((most[2] + most[1]) / 1e3);
    }
    // Rows and partials, not the records that travel with the rows (as the host backend's).
    bytes = static_cast<uint64_t>(send_rows) * H * 2 + static_cast<uint64_t>(recv_rows) * H * 2;
    // Every iteration's output is its input (CheckedInput), checked outside the timing.
    if (const int64_t wrong = ubep::bench::FirstDifference(out, x); wrong >= 0) {
      std::fprintf(stderr,
                   "ubep-bench-mpi: rank %d, iteration %d: out[%ld] = 0x%04x, not x[%ld] = "
                   "0x%04x\n",
                   rank, it + 1, static_cast<long>(wrong), out[wrong], static_cast<long>(wrong),
                   x[wrong]);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  uint64_t total = 0;
  MPI_Reduce(&bytes, &total, 1, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    std::string line = "{\"p50_us\": " + std::to_string(ubep::Percentile(us, 0.5)) +
                       ", \"p99_us\": " + std::to_string(ubep::Percentile(us, 0.99)) +
                       ", \"bytes_moved\": " + std::to_string(total) + ", \"latency_us\": [";
    for (size_t i = 0; i < us.size(); ++i) line += (i > 0 ? ", " : "") + std::to_string(us[i]);
    line += "], \"span_us\": [";
    for (size_t i = 0; i < span_us.size(); ++i) {
      line += (i > 0 ? ", " : "") + std::to_string(span_us[i]);
    }
    std::printf("%s]}\n", line.c_str());
  }
  MPI_Finalize();
  return 0;
}
