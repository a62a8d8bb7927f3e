// The CUDA backend against the host backend: ranks as processes sharing one GPU (CUDA IPC),
// every output compared byte for byte with what the host backend produced for the same input.
// Label gpu; skips cleanly where no CUDA device is present.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/cuda/cuda_ep.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/unit/dataplane_fixtures.h"

namespace ubep::kernels {
namespace {

constexpr int kMaxRanks = 8;

struct Board {
  std::atomic<int> ready, armed, done, reform[2], scrubbed[2];
  std::byte handles[kMaxRanks][64];
  char error[kMaxRanks][512];  // Room for a rank's longest joined errors (Faults::failing_rank).
};

// Every rank process adds itself to `met` and waits (up to 30 s) for the others.
void Meet(std::atomic<int>& met, int ranks) {
  met.fetch_add(1);
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (met.load() < ranks && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
}

// What goes wrong in a group, on purpose.
struct Faults {
  int dead_rank = -1;  // Never dispatches (a rank the plan excludes, or a dead one).
  int second_dead_rank = -1;  // Another one, dead.
  // Stores its rows and partials this late in every call (CudaEp::set_*_delay_for_testing).
  int late_rank = -1;
  absl::Duration row_delay = absl::ZeroDuration(), partial_delay = absl::ZeroDuration();
  // Before this call (counted from 0), the group re-forms as a daemon re-forms it: every rank
  // zeroes its arena's ResetRanges and creates its CudaEp again (epochs start over at 1).
  int reform_before_call = -1;
  // Not 0: before the ranks start, every flag of every arena stands at `resume_epoch` (the
  // ranks resume there) and every granule of the landings (rows and partials, plain and
  // flagged parts) holds 0xDEADBEEF tagged `stale_tag`.
  uint32_t resume_epoch = 0, stale_tag = 0;
  // Not -1: the late rank delays only the partials it stores for this source.
  int late_source = -1;
  // Not -1: this rank leaves once its first call's combine returned: it sets every arena's
  // abort word to ubepd's "rank left" code for itself, and runs no further call.
  int leaving_rank = -1;
  // Not -1: this rank's first Dispatch fails once it took its epoch, as when a launch fails
  // there (CudaEp::set_fail_after_taking_part_for_testing), 1 s after the others began
  // theirs; it then calls Combine and Dispatch once more. Its error is the three results'
  // messages joined by " | " (the group must have no reference: RunGroup's expected null).
  int failing_rank = -1;
};

struct RankResult {
  std::vector<int32_t> slot_offsets, src_rank, src_token;
  std::vector<float> weight;
  std::vector<uint16_t> recv_x, y, combined;
  // The error the CUDA backend's Dispatch must return (bad input it skips, the results then
  // those of the input without the bad pairs; more rows than the receive capacity), or "".
  std::string dispatch_error;
  // The error its Combine must return (a destination over its receive capacity), or "".
  std::string combine_error;
};

// How a group runs: bsp; ubep counting and sending at once (SendKernel, one cooperative
// launch); ubep with the counting kernel first (sender_thread kOff), as bsp's kernels run;
// ubep with flag-in-granule rows and partials (flagged_rows.h) for every call.
enum class Mode { kUbep, kUbepCountFirst, kBsp, kUbepFlagged };

EpConfig GpuConfig(int ranks, Mode mode) {
  EpConfig c = SmallConfig(mode == Mode::kBsp ? Protocol::kBsp : Protocol::kUbep);
  if (mode == Mode::kUbepCountFirst) c.sender_thread = EpConfig::SenderThread::kOff;
  if (mode == Mode::kUbepFlagged) c.flagged_tokens = c.max_tokens;
  c.num_ranks = ranks;
  c.slots_per_rank = 16 / ranks + 1;
  c.dtype = DType::kBFloat16;
  c.timeout = absl::Seconds(20);
  // 4 ranks as two nodes of 2: the senders visit near and far destinations in turn
  // (send_split.h VisitOrder); the bytes do not depend on it.
  if (ranks == 4) c.near_ranks = 2;
  return c;
}

std::vector<uint16_t> Bf16Input(const RankInput& in) {
  std::vector<uint16_t> x(in.x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = ToBf16(in.x[i]);
  return x;
}

// y = x * (1 + e / 64) for rows grouped by slot, in bf16.
std::vector<uint16_t> ExpertOutputs(const EpConfig& c, const TestPlan& plan, int rank,
                                    const std::vector<int32_t>& slot_offsets,
                                    const std::vector<uint16_t>& recv_x) {
  std::vector<uint16_t> y(recv_x.size());
  for (int i = 0; i < c.slots_per_rank; ++i) {
    const int e = plan.slot_expert[0][rank * c.slots_per_rank + i];
    // Over the receive capacity, recv_x holds only the first rows of the layout.
    const int end = std::min<int>(slot_offsets[i + 1] * c.hidden, recv_x.size());
    for (int q = slot_offsets[i] * c.hidden; q < end; ++q) {
      y[q] = ToBf16(FromBf16(recv_x[q]) * (1.0f + e / 64.0f));
    }
  }
  return y;
}

std::vector<RankResult> HostReference(const EpConfig& c, const TestPlan& plan,
                                      const std::vector<RankInput>& inputs) {
  EpConfig host_config = c;
  host_config.protocol = Protocol::kBsp;
  Group group(host_config);
  std::vector<RankResult> results(c.num_ranks);
  group.RunAll([&](int r) {
    if (RankExcluded(plan.header(), static_cast<uint32_t>(r))) return;
    const std::vector<uint16_t> x = Bf16Input(inputs[r]);
    DispatchOutput out;
    RankResult& res = results[r];
    // Only an overflow of the receive capacity leaves the call to complete (and its combine
    // to fail where its rows came from); the callers set any bad input's error themselves.
    const absl::Status dispatched =
        group.ep(r).Dispatch({x.data(), inputs[r].topk_idx.data(), inputs[r].topk_w.data(),
                              inputs[r].num_tokens, c.hidden, 0, plan.header()},
                             out);
    ASSERT_TRUE(dispatched.ok() || absl::IsResourceExhausted(dispatched)) << dispatched;
    if (!dispatched.ok()) res.dispatch_error = std::string(dispatched.message());
    res.slot_offsets = out.slot_offsets;
    res.src_rank = out.src_rank;
    res.src_token = out.src_token;
    res.weight = out.weight;
    res.recv_x.resize(out.recv_x.size() / 2);
    std::memcpy(res.recv_x.data(), out.recv_x.data(), out.recv_x.size());
    res.y = ExpertOutputs(c, plan, r, res.slot_offsets, res.recv_x);
    res.combined.resize(x.size());
    const absl::Status combined = group.ep(r).Combine(out, res.y.data(), res.combined.data());
    ASSERT_TRUE(combined.ok() || absl::IsResourceExhausted(combined)) << combined;
    if (!combined.ok()) res.combine_error = std::string(combined.message());
  });
  return results;
}

template <typename T>
T* Upload(const std::vector<T>& v) {
  T* d = nullptr;
  UBEP_CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
  UBEP_CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> v(n);
  UBEP_CHECK_CUDA(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Faults::resume_epoch and stale_tag, in an arena of layout l.
void FillStale(std::byte* arena, const ArenaLayout& l, int ranks, const Faults& f) {
  std::vector<std::byte> image(l.total_bytes);
  for (size_t region : {l.dispatch_flag, l.combine_flag, l.count_flag, l.barrier_flag}) {
    for (int s = 0; s < ranks; ++s) {
      std::memcpy(image.data() + region + s * kFlagStride, &f.resume_epoch, sizeof(uint32_t));
    }
  }
  for (size_t region : {l.rows, l.partials}) {
    for (size_t i = 0; i < ranks * l.row_stride / kGranuleBytes; ++i) {
      const uint64_t granule = Granule(0xDEADBEEF, f.stale_tag);
      std::memcpy(image.data() + region + i * kGranuleBytes, &granule, sizeof(granule));
    }
  }
  UBEP_CHECK_CUDA(cudaMemcpy(arena, image.data(), image.size(), cudaMemcpyHostToDevice));
}

// After a call at a scrub epoch (Faults::resume_epoch + 1, TagScrubDue) over FillStale's
// arena: "" if every flagged part of the rows and partials carries the scrub tag, the plain
// parts still hold the stale granules, and every peer raised its dispatch and combine flags
// here (RaisesFlag: all of them at a scrub epoch); else what is wrong.
std::string CheckScrubbed(const std::vector<std::byte>& arena, const ArenaLayout& l, int ranks,
                          const Faults& f) {
  const uint32_t epoch = f.resume_epoch + 1;
  auto granule_at = [&](size_t offset) {
    uint64_t g;
    std::memcpy(&g, arena.data() + offset, sizeof(g));
    return g;
  };
  for (size_t region : {l.dispatch_flag, l.combine_flag}) {
    for (int s = 0; s < ranks; ++s) {
      uint32_t flag;
      std::memcpy(&flag, arena.data() + region + s * kFlagStride, sizeof(flag));
      if (flag != epoch) {
        return absl::StrCat("the ", region == l.dispatch_flag ? "dispatch" : "combine",
                            " flag of rank ", s, " stands at ", flag, ", not ", epoch);
      }
    }
  }
  for (size_t region : {l.rows, l.partials}) {
    const char* name = region == l.rows ? "rows" : "partials";
    for (int s = 0; s < ranks; ++s) {
      const size_t part = region + s * l.row_stride;
      if (granule_at(part) != Granule(0xDEADBEEF, f.stale_tag)) {
        return absl::StrCat("the plain ", name, " of part ", s, " were written");
      }
      for (size_t at = part + l.flagged_offset; at < part + l.row_stride; at += kGranuleBytes) {
        if (granule_at(at) != Granule(0, ScrubTag(epoch))) {
          return absl::StrCat("flagged ", name, " of part ", s, ": granule ",
                              (at - part - l.flagged_offset) / kGranuleBytes, " not scrubbed");
        }
      }
    }
  }
  return "";
}

// One rank process: returns "" or what went wrong. Runs calls[0], calls[1], ... in turn,
// each against expected[k] (with no reference: calls[0] only, combining the received rows as
// they are).
std::string RunRank(const EpConfig& c, int rank, const TestPlan& plan,
                    const std::vector<RankInput>& calls, const std::vector<RankResult>* expected,
                    Board* board, const Faults& faults) {
  const RankInput& in = calls[0];
  const ArenaLayout layout(c);
  UBEP_CHECK_CUDA(cudaSetDevice(0));
  absl::StatusOr<std::unique_ptr<DeviceArena>> arena = DeviceArena::Create(layout.total_bytes);
  if (!arena.ok()) return std::string(arena.status().message());
  if (faults.resume_epoch != 0) FillStale((*arena)->data(), layout, c.num_ranks, faults);
  if (absl::Status s = (*arena)->IpcHandle(board->handles[rank]); !s.ok()) {
    return std::string(s.message());
  }
  Meet(board->ready, c.num_ranks);
  std::vector<std::unique_ptr<DeviceArena>> peers;
  std::vector<std::byte*> pointers(c.num_ranks);
  for (int s = 0; s < c.num_ranks; ++s) {
    if (s == rank) {
      pointers[s] = (*arena)->data();
      continue;
    }
    absl::StatusOr<std::unique_ptr<DeviceArena>> peer = DeviceArena::OpenPeer(board->handles[s]);
    if (!peer.ok()) return std::string(peer.status().message());
    pointers[s] = (*peer)->data();
    peers.push_back(std::move(*peer));
  }
  auto finish = [&](std::string message) {
    Meet(board->done, c.num_ranks);
    return message;
  };
  absl::StatusOr<std::unique_ptr<CudaEp>> ep = CudaEp::Create(c, rank, pointers);
  if (!ep.ok()) return finish(std::string(ep.status().message()));
  auto make_late = [&] {
    if (rank != faults.late_rank) return;
    (*ep)->set_row_delay_for_testing(faults.row_delay);
    (*ep)->set_partial_delay_for_testing(faults.partial_delay, faults.late_source);
  };
  make_late();
  // ubep runs SendKernel wherever the device can launch it cooperatively (every GPU this
  // project targets), so that the kUbep mode tests it rather than the kernels it replaces.
  int cooperative = 0;
  UBEP_CHECK_CUDA(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, 0));
  const bool want_fused = c.protocol == Protocol::kUbep &&
                          c.sender_thread != EpConfig::SenderThread::kOff && cooperative != 0;
  if ((*ep)->counts_while_sending() != want_fused) {
    return finish(absl::StrCat("counts_while_sending() is ", (*ep)->counts_while_sending(),
                               ", expected ", want_fused));
  }
  // Every call's input on the device before anyone's timeout starts.
  struct DeviceInput {
    uint16_t* x;
    int32_t* idx;
    float* w;
  };
  std::vector<DeviceInput> device_calls;
  for (const RankInput& call : calls) {
    device_calls.push_back({Upload(Bf16Input(call)), Upload(call.topk_idx), Upload(call.topk_w)});
  }
  std::byte* d_plan = Upload(plan.table);
  UBEP_CHECK_CUDA(cudaDeviceSynchronize());
  // Every rank is set up before anyone's timeout starts, so only the dead rank can be late.
  Meet(board->armed, c.num_ranks);
  if (rank == faults.dead_rank || rank == faults.second_dead_rank) {
    std::string error = finish("");
    // A rank the plan excludes: every peer is done, and none wrote a byte into its arena.
    if (RankExcluded(plan.header(), static_cast<uint32_t>(rank)) &&
        Download((*arena)->data(), layout.total_bytes) !=
            std::vector<std::byte>(layout.total_bytes)) {
      error = "a peer wrote into the arena of a rank the plan excludes";
    }
    return error;
  }
  const auto* d_table = reinterpret_cast<const PlanTableHeader*>(d_plan);
  auto dispatch = [&](size_t k, CudaDispatchOutput& out) {
    const DeviceInput& d = device_calls[k];
    return (*ep)->Dispatch({d.x, d.idx, d.w, calls[k].num_tokens, 0, d_table, plan.header()},
                           out);
  };
  if (rank == faults.failing_rank) {
    // The others' counts are out by then: they wait for this rank alone.
    absl::SleepFor(absl::Seconds(1));
    (*ep)->set_fail_after_taking_part_for_testing(true);
    CudaDispatchOutput out;
    const absl::Status failed = dispatch(0, out);
    (*ep)->set_fail_after_taking_part_for_testing(false);
    const absl::Status combined = (*ep)->Combine(nullptr, nullptr);
    const absl::Status again = dispatch(0, out);
    return finish(absl::StrCat(failed.ToString(), " | ", combined.ToString(), " | ",
                               again.ToString()));
  }
  if (expected == nullptr) {
    CudaDispatchOutput out;
    const absl::Status s = dispatch(0, out);
    // Bad input (InvalidArgument) still dispatches the other pairs and needs the combine.
    if (!s.ok() && !absl::IsInvalidArgument(s)) return finish(std::string(s.message()));
    // No reference: combine the received rows as they are (an identity expert); every rank,
    // the one with bad input too, must get through it.
    uint16_t* d_out = Upload(std::vector<uint16_t>(in.x.size(), 0));
    const absl::Status combined = (*ep)->Combine(out.recv_x, d_out);
    std::string error = s.ok() ? "" : std::string(s.message());
    if (!combined.ok()) absl::StrAppend(&error, error.empty() ? "" : "; ", "combine: ", combined.message());
    return finish(error);
  }
  for (size_t k = 0; k < calls.size(); ++k) {
    const RankInput& call = calls[k];
    const RankResult& want = (*expected)[k];
    const std::string at = absl::StrCat(" (call ", k + 1, ")");
    if (static_cast<int>(k) == faults.reform_before_call) {
      // Every rank is done with the calls before (its combine waited for every peer's
      // partials), then every arena is reset before any rank starts again.
      Meet(board->reform[0], c.num_ranks);
      ep->reset();
      for (const auto& [offset, bytes] : ResetRanges(layout)) {
        UBEP_CHECK_CUDA(cudaMemset((*arena)->data() + offset, 0, bytes));
      }
      UBEP_CHECK_CUDA(cudaDeviceSynchronize());
      Meet(board->reform[1], c.num_ranks);
      ep = CudaEp::Create(c, rank, pointers);
      if (!ep.ok()) return finish(std::string(ep.status().message()) + at);
      make_late();
    }
    CudaDispatchOutput out;
    absl::Status s = dispatch(k, out);
    if (want.dispatch_error.empty() && !s.ok()) return finish(std::string(s.message()) + at);
    if (!want.dispatch_error.empty() &&
        !((absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s)) &&
          s.message() == want.dispatch_error)) {
      return finish(absl::StrCat("dispatch returned \"", s.ToString(), "\", expected \"",
                                 want.dispatch_error, "\"", at));
    }
    if (out.slot_offsets != want.slot_offsets) return finish("slot offsets differ" + at);
    const size_t rows = out.num_rows;
    if (Download(out.src_rank, rows) != want.src_rank) return finish("src_rank differs" + at);
    if (Download(out.src_token, rows) != want.src_token) return finish("src_token differs" + at);
    if (Download(out.weight, rows) != want.weight) return finish("weights differ" + at);
    const std::vector<uint16_t> recv_x =
        Download(static_cast<const uint16_t*>(out.recv_x), rows * c.hidden);
    if (recv_x != want.recv_x) return finish("recv_x differs" + at);
    const size_t out_size = static_cast<size_t>(call.num_tokens) * c.hidden;
    uint16_t* d_y = Upload(want.y);
    uint16_t* d_out = Upload(std::vector<uint16_t>(out_size, 0));
    s = (*ep)->Combine(d_y, d_out);
    if (want.combine_error.empty() && !s.ok()) return finish(std::string(s.message()) + at);
    if (!want.combine_error.empty() &&
        !(absl::IsResourceExhausted(s) && s.message() == want.combine_error)) {
      return finish(absl::StrCat("combine returned \"", s.ToString(), "\", expected \"",
                                 want.combine_error, "\"", at));
    }
    if (rank == faults.leaving_rank) {
      const uint32_t code = kAbortRankGone | static_cast<uint32_t>(rank);
      for (std::byte* a : pointers) {
        UBEP_CHECK_CUDA(cudaMemcpy(a + layout.abort, &code, sizeof(code), cudaMemcpyHostToDevice));
      }
    }
    if (Download(d_out, out_size) != want.combined) return finish("combined output differs" + at);
    if (rank == faults.leaving_rank) return finish("");
    if (k == 0 && faults.resume_epoch != 0 && TagScrubDue(faults.resume_epoch + 1)) {
      // Every rank is done with the call (its scrubs ran before its Combine returned) before
      // any looks, and every rank has looked before any stores the next call's rows.
      Meet(board->scrubbed[0], c.num_ranks);
      const std::string wrong = CheckScrubbed(Download((*arena)->data(), layout.total_bytes),
                                              layout, c.num_ranks, faults);
      Meet(board->scrubbed[1], c.num_ranks);
      if (!wrong.empty()) return finish(wrong + at);
    }
  }
  return finish("");
}

struct RunOutcome {
  std::vector<std::string> errors;
};

// Set once this test process used the device itself (the one-process tests, defined after
// every test that forks rank processes, so that they run after them in gtest's order): a
// rank process forked after that cannot use CUDA (gpu_test_util.h).
bool cuda_in_test_process = false;

void UseCudaInTestProcess() {
  cuda_in_test_process = true;
  UBEP_CHECK_CUDA(cudaSetDevice(0));
}

// Every rank as a process, calls after each other: inputs[k][r] is rank r's input to call k,
// (*expected)[k][r] its reference.
RunOutcome RunGroupCalls(const EpConfig& c, const TestPlan& plan,
                         const std::vector<std::vector<RankInput>>& inputs,
                         const std::vector<std::vector<RankResult>>* expected,
                         const Faults& faults) {
  if (cuda_in_test_process) {
    const std::string why =
        "not run: a one-process test used CUDA in this process before (--gtest_shuffle or "
        "--gtest_repeat?), and a rank process forked now could not use the device";
    ADD_FAILURE() << why;
    return RunOutcome{std::vector<std::string>(c.num_ranks, why)};
  }
  SharedArena board_arena = *SharedArena::Create("gpu-board", sizeof(Board));
  auto* board = new (board_arena.data()) Board{};
  std::vector<pid_t> pids;
  for (int r = 0; r < c.num_ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << strerror(errno);
      break;
    }
    if (pid == 0) {
      std::vector<RankInput> calls;
      std::vector<RankResult> want;
      for (size_t k = 0; k < inputs.size(); ++k) {
        calls.push_back(inputs[k][r]);
        if (expected != nullptr) want.push_back((*expected)[k][r]);
      }
      const std::string error =
          RunRank(c, r, plan, calls, expected != nullptr ? &want : nullptr, board, faults);
      std::snprintf(board->error[r], sizeof(board->error[r]), "%s", error.c_str());
      _exit(error.empty() ? 0 : 3);
    }
    pids.push_back(pid);
  }
  RunOutcome outcome;
  const std::vector<int> statuses = test::WaitForRanks(pids, absl::Minutes(3));
  for (int r = 0; r < c.num_ranks; ++r) {
    const int status = statuses[r];
    std::string error = board->error[r];
    if (error.empty() && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      error = absl::StrCat("rank exited abnormally (wait status ", status, ")");
    }
    outcome.errors.push_back(error);
  }
  return outcome;
}

// One call: inputs[r] is rank r's input, (*expected)[r] its reference.
RunOutcome RunGroup(const EpConfig& c, const TestPlan& plan, const std::vector<RankInput>& inputs,
                    const std::vector<RankResult>* expected, const Faults& faults = {}) {
  const std::vector<std::vector<RankResult>> want =
      expected != nullptr ? std::vector<std::vector<RankResult>>{*expected}
                          : std::vector<std::vector<RankResult>>{};
  return RunGroupCalls(c, plan, {inputs}, expected != nullptr ? &want : nullptr, faults);
}

// Calls after each other on one group, call k's input for rank r from make(k, r), each
// checked byte for byte against the host backend: every rank's error ("" when all matched).
// `check` (optional) sees the host backend's results first, [call][rank].
std::vector<std::string> RunCallsAgainstHost(
    const EpConfig& c, const TestPlan& plan, int calls,
    const std::function<RankInput(int k, int r)>& make, const Faults& faults = {},
    const std::function<void(const std::vector<std::vector<RankResult>>&)>& check = nullptr) {
  std::vector<std::vector<RankInput>> inputs(calls);
  std::vector<std::vector<RankResult>> expected;
  for (int k = 0; k < calls; ++k) {
    for (int r = 0; r < c.num_ranks; ++r) inputs[k].push_back(make(k, r));
    expected.push_back(HostReference(c, plan, inputs[k]));
  }
  if (check) check(expected);
  return RunGroupCalls(c, plan, inputs, &expected, faults).errors;
}

void ExpectNoErrors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

class CudaEpTest : public ::testing::TestWithParam<std::tuple<int, Mode>> {
 protected:
  void SetUp() override {
    UBEP_SKIP_WITHOUT_DEVICE();
  }
};

// A group whose kernels could not launch (their per-block shared memory over what a launch
// takes) is refused at Create, before any device is touched (no device needed).
TEST(CudaEpLimitsTest, AConfigOverTheLaunchLimitsIsRefusedAtCreate) {
  EpConfig config;
  config.num_ranks = 1;
  config.max_tokens = 4;
  config.hidden = 8;
  config.top_k = 2;
  config.num_experts = 4;
  config.slots_per_rank = 16384;
  config.num_layers = 1;
  config.dtype = DType::kBFloat16;
  EXPECT_EQ(CudaEp::Create(config, 0, {nullptr}).status(),
            absl::InvalidArgumentError("cuda backend: 16384 slots_per_rank need 65536 bytes of "
                                       "shared memory per block, over the 49152 a launch takes"));
}

TEST_P(CudaEpTest, MatchesTheHostBackendByteForByte) {
  const EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 40 + r, 3));
  const std::vector<RankResult> expected = HostReference(c, plan, inputs);
  const RunOutcome outcome = RunGroup(c, plan, inputs, &expected);
  for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(outcome.errors[r], "") << "rank " << r;
}

// Every batch of send_split.h (16 of 38 tokens at 600), ranks with different token counts:
// SendKernel's sender blocks store each batch as its counting blocks finish it. Flagged:
// calls of up to 580 tokens, so rank 0's rows (600 tokens) go plain and the others' (563
// and fewer) flagged, at two ranks as at four.
TEST_P(CudaEpTest, EveryBatchMatchesTheHostBackend) {
  EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  c.max_tokens = 600;
  c.hidden = 16;
  if (std::get<1>(GetParam()) == Mode::kUbepFlagged) c.flagged_tokens = 580;
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) {
    inputs.push_back(MakeInput(c, r, c.max_tokens - 37 * r, 12));
  }
  const std::vector<RankResult> expected = HostReference(c, plan, inputs);
  const RunOutcome outcome = RunGroup(c, plan, inputs, &expected);
  for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(outcome.errors[r], "") << "rank " << r;
}

// Calls after each other on one group: decode-sized (20 tokens), then every token (48, above
// the flagged mode's flagged_tokens of 24), then decode-sized again: epochs move on and
// landings are reused, and in the flagged mode a plain call follows flagged ones and the
// other way round.
TEST_P(CudaEpTest, ConsecutiveCallsMatchTheHostBackend) {
  // Two ranks are enough for the sequence, and keep bench/gpu/run.sh within its time.
  if (std::get<0>(GetParam()) != 2) GTEST_SKIP() << "a two-rank case";
  EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  if (std::get<1>(GetParam()) == Mode::kUbepFlagged) c.flagged_tokens = 24;
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  ExpectNoErrors(RunCallsAgainstHost(c, plan, 3, [&](int k, int r) {
    return MakeInput(c, r, (k == 1 ? c.max_tokens : 20) - r, 30 + k);
  }));
}

// The phase a dispatch waits for its peers' counts in, as its errors name it.
const char* CountsPhase(const EpConfig& c) {
  return c.protocol == Protocol::kBsp ? "count exchange" : "dispatch counts";
}

// One call of 8 tokens per rank under a round-robin plan, with `faults`, no reference: every
// rank's error.
std::vector<std::string> RunEightTokensEach(const EpConfig& c, const Faults& faults) {
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 8, 4));
  return RunGroup(c, plan, inputs, nullptr, faults).errors;
}

TEST_P(CudaEpTest, AMissingPeerTimesOutWithItsName) {
  EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  c.timeout = absl::Milliseconds(500);
  const std::vector<std::string> errors = RunEightTokensEach(c, {.dead_rank = 1});
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == 1) continue;
    EXPECT_EQ(errors[r], absl::StrCat("rank ", r, ": timed out after 500ms waiting for rank 1 (",
                                      CountsPhase(c), ", call 1); is rank 1 alive?"));
  }
}

// Ranks 1 and 2 of four never come: every survivor names rank 1, the lowest one its waits
// still await, as the host backend does, whichever of the waiting threads sees the deadline
// first (a few runs: the race between them is the point).
TEST_P(CudaEpTest, OfSeveralMissingPeersTheLowestIsNamed) {
  if (std::get<0>(GetParam()) != 4) GTEST_SKIP() << "a four-rank case";
  EpConfig c = GpuConfig(4, std::get<1>(GetParam()));
  c.timeout = absl::Milliseconds(300);
  for (int run = 0; run < 3; ++run) {
    const std::vector<std::string> errors =
        RunEightTokensEach(c, {.dead_rank = 2, .second_dead_rank = 1});
    for (int r : {0, 3}) {
      EXPECT_EQ(errors[r], absl::StrCat("rank ", r, ": timed out after 300ms waiting for rank 1 (",
                                        CountsPhase(c), ", call 1); is rank 1 alive?"))
          << "run " << run;
    }
  }
}

// Rank 1 gives more tokens than its buffers hold: refused before it takes part (then its
// Combine, for want of the dispatch), and the others, timing out, say why it did not come.
TEST_P(CudaEpTest, PeersOfARankThatRefusedItsInputSayWhy) {
  EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  c.timeout = absl::Milliseconds(500);
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) {
    inputs.push_back(MakeInput(c, r, r == 1 ? c.max_tokens + 1 : 8, 4));
  }
  const RunOutcome outcome = RunGroup(c, plan, inputs, nullptr);
  const std::string why = absl::StrCat(c.max_tokens + 1, " tokens exceed max_tokens ",
                                       c.max_tokens, " of this rank's buffers");
  EXPECT_EQ(outcome.errors[1], why + "; combine: combine without a dispatch before it");
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == 1) continue;
    EXPECT_EQ(outcome.errors[r],
              absl::StrCat("rank ", r, ": timed out after 500ms waiting for rank 1 (",
                           CountsPhase(c), ", call 1); rank 1 refused this call: ", why));
  }
}

// Rank 1's dispatch fails after it took its epoch (a launch refused): its peers stop waiting
// and say why, and rank 1's combine and next dispatch are refused as after any give-up, not as
// a second dispatch. Rank 1's refusals show that it raised its own abort word; that the peers
// end at all shows that it raised theirs too: their timeout is an hour, and a rank still
// waiting when the group's processes are reaped (RunGroupCalls, 3 minutes) is killed and
// reported as such.
TEST_P(CudaEpTest, PeersOfARankWhoseLaunchFailedMidCallSayWhyAtOnce) {
  EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  c.timeout = absl::Hours(1);
  const std::vector<std::string> errors = RunEightTokensEach(c, {.failing_rank = 1});
  const std::string why = "cuda backend: a launch failed (for the test)";
  EXPECT_EQ(errors[1],
            absl::StrCat("INTERNAL: ", why,
                         " | FAILED_PRECONDITION: rank 1: combine after dispatch call 1 "
                         "failed; the group must be re-formed | UNAVAILABLE: rank 1: "
                         "dispatch call 2 refused: the group gave up on this rank in this call "
                         "or an earlier one; it must be re-formed"));
  for (int r = 0; r < c.num_ranks; ++r) {
    if (r == 1) continue;
    EXPECT_EQ(errors[r], absl::StrCat("rank ", r, ": timed out after 1h waiting for rank 1 (",
                                      CountsPhase(c), ", call 1); rank 1 refused this call: ",
                                      why));
  }
}

// Rank 3 of four is excluded (TestPlan::Excluding): the others match the host backend and
// neither wait for rank 3 nor write into its arena.
TEST_P(CudaEpTest, ARankThePlanExcludesIsNeitherWaitedForNorWritten) {
  if (std::get<0>(GetParam()) != 4) GTEST_SKIP() << "a four-rank case";
  EpConfig c = GpuConfig(4, std::get<1>(GetParam()));
  c.slots_per_rank = 8;
  c.timeout = absl::Seconds(5);
  const TestPlan plan = TestPlan::Excluding(4, 8, c.num_experts, c.num_layers, 3);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 24 + r, 6));
  const std::vector<RankResult> expected = HostReference(c, plan, inputs);
  const RunOutcome outcome = RunGroup(c, plan, inputs, &expected, {.dead_rank = 3});
  for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(outcome.errors[r], "") << "rank " << r;
}

// Pair (t, k) of a rank's input.
struct PairAt {
  int rank, t, k;
};

// The bad pairs masked (-1): what the CUDA backend, which skips them, must give every rank,
// byte for byte.
std::vector<RankResult> ReferenceWithout(const EpConfig& c, const TestPlan& plan,
                                         std::vector<RankInput> inputs,
                                         const std::vector<PairAt>& bad) {
  for (const PairAt& at : bad) inputs[at.rank].topk_idx[at.t * c.top_k + at.k] = -1;
  return HostReference(c, plan, inputs);
}

// Rank 0 lists three experts out of range, in tokens 6, 2 and 5: the first in (t, k) order is
// named, as the host backend names it, whichever block of the device finds which; the three
// pairs are skipped, and every rank's receive side and combine are those of the input without
// them, byte for byte (no stray row, record or partial).
TEST_P(CudaEpTest, AnExpertIdOutOfRangeIsFlaggedWithoutStrayWrites) {
  const EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 8, 5));
  inputs[0].topk_idx[6 * c.top_k + 0] = 16;
  inputs[0].topk_idx[2 * c.top_k + 1] = 99;
  inputs[0].topk_idx[5 * c.top_k + 3] = -7;
  std::vector<RankResult> expected =
      ReferenceWithout(c, plan, inputs, {{0, 6, 0}, {0, 2, 1}, {0, 5, 3}});
  expected[0].dispatch_error = "topk_idx[2][1] = 99 is outside [-1, 16)";
  ExpectNoErrors(RunGroup(c, plan, inputs, &expected).errors);
}

// Rank 0's token 3 lists an expert twice, rank 1's token 6 has a routed pair of infinite
// weight (and a masked one of NaN weight, which is not read): each pair is flagged and
// skipped, the rest goes out, and every rank (each waits for the others' partials) gets
// what the input without those pairs gives.
TEST_P(CudaEpTest, ARepeatedExpertOrAWeightNotFiniteIsFlaggedAndSkipped) {
  const EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 8, 5));
  auto clear = [&](RankInput& in, int t) {
    std::fill(in.topk_idx.begin() + t * c.top_k, in.topk_idx.begin() + (t + 1) * c.top_k, -1);
  };
  clear(inputs[0], 3);
  inputs[0].topk_idx[3 * c.top_k + 0] = inputs[0].topk_idx[3 * c.top_k + 2] = 5;
  clear(inputs[1], 6);
  inputs[1].topk_w[6 * c.top_k + 0] = std::numeric_limits<float>::quiet_NaN();
  inputs[1].topk_idx[6 * c.top_k + 1] = 9;
  inputs[1].topk_w[6 * c.top_k + 1] = -std::numeric_limits<float>::infinity();
  std::vector<RankResult> expected = ReferenceWithout(c, plan, inputs, {{0, 3, 2}, {1, 6, 1}});
  expected[0].dispatch_error =
      "topk_idx[3][2] = 5 repeats topk_idx[3][0]: a token lists each expert at most once";
  expected[1].dispatch_error = "topk_weights[6][1] = -inf is not finite";
  ExpectNoErrors(RunGroup(c, plan, inputs, &expected).errors);
}

// A receive capacity (EpConfig::max_recv_rows) 44 rows short: every rank but the last sends
// every token to the experts of rank 1's second slot (k = 0) and first slot (k = 1), the last
// to its own first slot's (rank 1 is the last at 2 ranks). Rank 1 keeps the first rows of its
// layout (some records' first row dropped and second kept) and fails the call, and so does
// every rank's combine, naming it, with the host backend's words and bytes (the dropped rows
// summed as zeros); the next call, within the capacity, matches too.
TEST_P(CudaEpTest, AReceiveCapacityOverflowFailsTheCallAsOnTheHost) {
  EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const int R = c.num_ranks, S = c.slots_per_rank, K = c.top_k;
  const int rows = R == 2 ? 144 : 288;
  c.max_recv_rows = rows - 44;
  const TestPlan plan = TestPlan::RoundRobin(R * S, c.num_experts, 2);
  const int first = plan.slot_expert[0][S], second = plan.slot_expert[0][S + 1],
            home = plan.slot_expert[0][(R - 1) * S];
  ExpectNoErrors(RunCallsAgainstHost(
      c, plan, 2,
      [&](int k, int r) {
        if (k == 1) return MakeInput(c, r, 12, 4);
        RankInput in = MakeInput(c, r, c.max_tokens, 11, r == R - 1 ? home : second);
        if (r != R - 1) {
          for (int t = 0; t < c.max_tokens; ++t) in.topk_idx[t * K + 1] = first;
        }
        return in;
      },
      {}, [&](const std::vector<std::vector<RankResult>>& host) {
        // The host backend's outcome, which the device must match.
        const ReceiveNotice overflow{1, static_cast<uint32_t>(rows),
                                     static_cast<uint32_t>(c.max_recv_rows)};
        EXPECT_EQ(host[0][1].dispatch_error, OverCapacityStatus(1, 1, overflow).message());
        EXPECT_EQ(host[0][1].src_rank.size(), static_cast<size_t>(c.max_recv_rows));
        for (int r = 0; r < R; ++r) {
          EXPECT_EQ(host[0][r].combine_error, PeerOverCapacityStatus(r, 1, 1, overflow).message())
              << r;
          EXPECT_EQ(host[1][r].dispatch_error, "") << r;
          EXPECT_EQ(host[1][r].combine_error, "") << r;
        }
      }));
}

// The receive scratch holds ranks x max_tokens x min(top_k, slots_per_rank) rows: with fewer
// slots per rank than top-k and every token listing every expert, both ranks receive exactly
// that many, and match the host backend.
TEST_P(CudaEpTest, FewerSlotsThanTopKFillTheReceiveScratchExactly) {
  if (std::get<0>(GetParam()) != 2) GTEST_SKIP() << "a two-rank case";
  EpConfig c = GpuConfig(2, std::get<1>(GetParam()));
  c.num_experts = 4;
  c.slots_per_rank = 2;
  ASSERT_EQ(c.top_k, 4);
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) {
    RankInput in = MakeInput(c, r, c.max_tokens, 9);
    for (int t = 0; t < c.max_tokens; ++t) {
      for (int k = 0; k < c.top_k; ++k) in.topk_idx[t * c.top_k + k] = (t + k) % c.num_experts;
    }
    inputs.push_back(std::move(in));
  }
  const std::vector<RankResult> expected = HostReference(c, plan, inputs);
  for (int r = 0; r < c.num_ranks; ++r) {
    ASSERT_EQ(expected[r].slot_offsets.back(), c.num_ranks * c.max_tokens * 2) << "rank " << r;
  }
  ExpectNoErrors(RunGroup(c, plan, inputs, &expected).errors);
}

// The host backend's error tests, on the GPU: four ranks of 8 tokens, a timeout of 500 ms,
// and rank 1's rows (`rows`) or partials 2 s late. Every other rank gets rows from rank 1, so
// each waits for them (flagged: row by row); the errors of every rank.
std::vector<std::string> ErrorsWithRankOneLate(Mode mode, bool rows) {
  EpConfig c = GpuConfig(4, mode);
  c.timeout = absl::Milliseconds(500);
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  std::vector<RankInput> inputs;
  for (int r = 0; r < c.num_ranks; ++r) inputs.push_back(MakeInput(c, r, 8, 7));
  const std::vector<RankResult> routed = HostReference(c, plan, inputs);
  for (int r : {0, 2, 3}) {
    if (std::count(routed[r].src_rank.begin(), routed[r].src_rank.end(), 1) == 0) {
      ADD_FAILURE() << "rank " << r << " gets no rows from rank 1";
      return {};
    }
  }
  Faults faults{.late_rank = 1};
  (rows ? faults.row_delay : faults.partial_delay) = absl::Seconds(2);
  return RunGroup(c, plan, inputs, nullptr, faults).errors;
}

// The others name rank 1 and the phase they waited in: rows waited for by their flags, or row
// by row when flagged, or behind bsp's barrier.
TEST_P(CudaEpTest, RowsThatNeverArriveAreNamedAfterTheCounts) {
  if (std::get<0>(GetParam()) != 4) GTEST_SKIP() << "a four-rank case";
  const Mode mode = std::get<1>(GetParam());
  const std::vector<std::string> errors = ErrorsWithRankOneLate(mode, /*rows=*/true);
  ASSERT_EQ(errors.size(), 4u);
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(errors[r], absl::StrCat("rank ", r, ": timed out after 500ms waiting for rank 1 (",
                                      mode == Mode::kBsp ? "barrier" : "dispatch data",
                                      ", call 1); is rank 1 alive?"));
  }
  // Rank 1's rows all go out in the end, so its dispatch passes; its combine then finds the
  // group given up on it (the abort word names rank 1), and is told so.
  EXPECT_EQ(errors[1], absl::StrCat("combine: rank 1: the group gave up on this rank while it "
                                    "was in ",
                                    mode == Mode::kBsp ? "barrier" : "combine partials",
                                    " of call 1 (its peers' errors say why: a wait for it that "
                                    "timed out, say); the group must be re-formed"));
}

TEST_P(CudaEpTest, PartialsThatNeverArriveAreNamed) {
  if (std::get<0>(GetParam()) != 4) GTEST_SKIP() << "a four-rank case";
  const std::vector<std::string> errors =
      ErrorsWithRankOneLate(std::get<1>(GetParam()), /*rows=*/false);
  ASSERT_EQ(errors.size(), 4u);
  // bsp's combine waits at its barrier, which the host names so.
  const char* phase = std::get<1>(GetParam()) == Mode::kBsp ? "barrier" : "combine partials";
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(errors[r], absl::StrCat("combine: rank ", r,
                                      ": timed out after 500ms waiting for rank 1 (", phase,
                                      ", call 1); is rank 1 alive?"));
  }
}

// HostEpTest.ARankThatLeftAfterItsLastCallSparesThatCallNotTheNext on the GPU: rank 1
// completes call 1 and leaves (ubepd's code in every abort word) while rank 3 waits 300 ms for
// rank 0's partials; every rank completes call 1 byte for byte, and call 2 fails at its first
// wait, naming rank 1. (bsp's combine ends at a barrier: no rank completes it early there.)
TEST_P(CudaEpTest, ARankThatLeftAfterItsLastCallSparesThatCallNotTheNext) {
  if (std::get<0>(GetParam()) != 4) GTEST_SKIP() << "a four-rank case";
  const EpConfig c = GpuConfig(4, std::get<1>(GetParam()));
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  const std::vector<std::string> errors = RunCallsAgainstHost(
      c, plan, 2, [&](int k, int r) { return MakeInput(c, r, 20, 40 + k); },
      {.late_rank = 0,
       .partial_delay = absl::Milliseconds(300),
       .late_source = 3,
       .leaving_rank = 1});
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_EQ(errors[1], "");
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(errors[r],
              absl::StrCat("rank ", r, ": rank 1 left the group (it detached, rejoined or ended, or "
                           "its ubepd exited) during ", CountsPhase(c),
                           " of call 2; join again once rank 1 is back (call 2)"));
  }
}

// HostEpFlaggedTest.ACombineWaitsForDestinationsItSentNothing on the GPU. Two ranks, each
// routing call 1 to its own experts only, then rank 0 routing call 2 to rank 1's. Rank 1's
// rows go out 300 ms late, and with them its receive side of call 1 (stream order); rank 0's
// combine must wait for rank 1's combine flag although it sent rank 1 nothing, or it stores
// call 2's records and count into rank 1's arena before rank 1 has laid out call 1.
TEST_P(CudaEpTest, ACombineWaitsForDestinationsItSentNothing) {
  if (std::get<0>(GetParam()) != 2) GTEST_SKIP() << "a two-rank case";
  EpConfig c = GpuConfig(2, std::get<1>(GetParam()));
  c.slots_per_rank = 10;  // Rank 0: experts 0-9; rank 1: 10-15 and 0-3.
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  ExpectNoErrors(RunCallsAgainstHost(
      c, plan, 2,
      [&](int k, int r) {
        const int expert = r == 0 && k == 0 ? 5 : 12;
        return MakeInput(c, r, 10, k + 1, /*only_expert=*/expert);
      },
      {.late_rank = 1, .row_delay = absl::Milliseconds(300)},
      [](const std::vector<std::vector<RankResult>>& expected) {
        // Every token carries one pair into the rank that serves it.
        EXPECT_EQ(expected[0][1].slot_offsets.back(), 10);
        EXPECT_EQ(expected[1][1].slot_offsets.back(), 20);
      }));
}

// HostEpFlaggedTest.TagsOfEarlierEpochsAreScrubbedBeforeTheyComeAgain on the GPU: every
// landing holds garbage tagged 2^30 + 1 and the group resumes at epoch 2^30 - 1, so call 2^30
// rewrites the tags (ScrubKernel) after it has read its rows and partials (CheckScrubbed reads
// every arena back after it, flags included: call 2^30 raises every flag, RaisesFlag), and in
// call 2^30 + 1, with rank 0's rows and partials late, nobody takes the garbage for them. The
// plain call after it must not pass the flags either.
TEST_P(CudaEpTest, TagsOfEarlierEpochsAreScrubbedBeforeTheyComeAgain) {
  if (std::get<0>(GetParam()) != 4 || std::get<1>(GetParam()) != Mode::kUbepFlagged) {
    GTEST_SKIP() << "a four-rank flagged case";
  }
  EpConfig c = GpuConfig(4, Mode::kUbepFlagged);
  c.flagged_tokens = 24;
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  ExpectNoErrors(RunCallsAgainstHost(
      c, plan, 3,
      [&](int k, int r) {
        // Flagged, flagged, then plain (above flagged_tokens).
        return MakeInput(c, r, k == 2 ? c.max_tokens - r : 12 + 4 * k + r, 50 + k);
      },
      {.late_rank = 0,
       .row_delay = absl::Milliseconds(100),
       .partial_delay = absl::Milliseconds(100),
       .resume_epoch = kTagScrubPeriod - 1,
       .stale_tag = kTagScrubPeriod + 1}));
}

// HostEpFlaggedTest.AReformedGroupNeverTakesTheOldGenerationsRows on the GPU, in every mode:
// one call, every arena reset as ubepd resets a re-forming group, the CudaEps created again
// (epochs start over at 1), then call 1 of the new generation with other routing and rank 0's
// rows and partials late. A receiver that took the old generation's rows (flagged: its tags;
// plain: its flags) would read other tokens' data.
TEST_P(CudaEpTest, AReformedGroupNeverTakesTheOldGenerationsRows) {
  if (std::get<0>(GetParam()) != 4) GTEST_SKIP() << "a four-rank case";
  const EpConfig c = GpuConfig(4, std::get<1>(GetParam()));
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  ExpectNoErrors(RunCallsAgainstHost(
      c, plan, 2, [&](int k, int r) { return MakeInput(c, r, 30, k == 0 ? 40 : 77); },
      {.late_rank = 0,
       .row_delay = absl::Milliseconds(100),
       .partial_delay = absl::Milliseconds(100),
       .reform_before_call = 1}));
}

// Every rank's arena in this process, and rank 0's CudaEp over them: a test that plays the
// peers itself, writing into the arenas as they would.
struct OneProcessGroup {
  std::vector<std::unique_ptr<DeviceArena>> arenas;
  std::vector<std::byte*> pointers;
  std::unique_ptr<CudaEp> ep;

  void Create(const EpConfig& c) {
    for (int r = 0; r < c.num_ranks; ++r) {
      absl::StatusOr<std::unique_ptr<DeviceArena>> arena =
          DeviceArena::Create(ArenaLayout(c).total_bytes);
      ASSERT_TRUE(arena.ok()) << arena.status();
      pointers.push_back((*arena)->data());
      arenas.push_back(*std::move(arena));
    }
    absl::StatusOr<std::unique_ptr<CudaEp>> created = CudaEp::Create(c, 0, pointers);
    ASSERT_TRUE(created.ok()) << created.status();
    ep = *std::move(created);
  }
};

// A dispatch after the group gave up (a wait of an earlier call timed out on rank 1, or the
// daemon set its code) is refused before any byte moves, in the host backend's words
// (HostEpErrorTest.ADispatchAfterTheGroupGaveUpIsRefusedBeforeAnyByteMoves): no kernel of the
// call stores into any arena, and an earlier refusal's record is not withdrawn. One process
// holds both arenas; rank 1 never runs (nothing of rank 0's refused call waits for it).
TEST_P(CudaEpTest, ADispatchAfterTheGroupGaveUpIsRefusedBeforeAnyByteMoves) {
  const EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const ArenaLayout layout(c);
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  UseCudaInTestProcess();
  OneProcessGroup group;
  ASSERT_NO_FATAL_FAILURE(group.Create(c));
  const std::vector<std::byte*>& pointers = group.pointers;
  CudaEp* ep = group.ep.get();
  const RankInput in = MakeInput(c, 0, 8, 3);
  uint16_t* x = Upload(Bf16Input(in));
  int32_t* idx = Upload(in.topk_idx);
  float* w = Upload(in.topk_w);
  const auto* table = reinterpret_cast<const PlanTableHeader*>(Upload(plan.table));
  UBEP_CHECK_CUDA(cudaDeviceSynchronize());
  // Rank 0 refused call 1 first (more tokens than its buffers hold): the refusal it recorded
  // for its peers stays, byte for byte, through the calls refused below (as on the host).
  CudaDispatchOutput too_many;
  EXPECT_EQ(ep->Dispatch({x, idx, w, c.max_tokens + 1, 0, table, plan.header()}, too_many),
            absl::InvalidArgumentError(absl::StrCat(c.max_tokens + 1, " tokens exceed max_tokens ",
                                                    c.max_tokens, " of this rank's buffers")));
  const std::string counts = CountsPhase(c);
  const std::vector<std::pair<uint32_t, absl::Status>> cases = {
      {kAbortTimedOutBase + 1,
       absl::UnavailableError("rank 0: dispatch call 1 refused: the group gave up on "
                              "rank 1 in this call or an earlier one; it must be "
                              "re-formed")},
      {kAbortDraining, absl::UnavailableError(absl::StrCat(
                           "rank 0: ubepd is draining; ", counts,
                           " of call 1 abandoned; attach again when it is back"))}};
  for (const auto& [code, refused] : cases) {
    for (std::byte* a : pointers) {
      UBEP_CHECK_CUDA(cudaMemcpy(a + layout.abort, &code, sizeof(code), cudaMemcpyHostToDevice));
    }
    std::vector<std::vector<std::byte>> before;
    for (std::byte* a : pointers) before.push_back(Download(a, layout.total_bytes));
    CudaDispatchOutput out;
    EXPECT_EQ(ep->Dispatch({x, idx, w, in.num_tokens, 0, table, plan.header()}, out), refused);
    for (int r = 0; r < c.num_ranks; ++r) {
      EXPECT_TRUE(Download(pointers[r], layout.total_bytes) == before[r]) << "arena " << r;
    }
  }
  // The calls did not happen (the second look said call 1 too): nothing to combine.
  EXPECT_EQ(ep->Combine(x, x),
            absl::FailedPreconditionError("combine without a dispatch before it"));
}

// A source's count or record out of range (a corrupt or foreign peer; nothing the protocol
// writes) is refused before rank 0 indexes anything by it, naming that source, in the host
// backend's words (HostEpErrorTest.ACorruptSourceIsNamedBeforeAnythingIsSizedFromIt), and the
// group gives up on it. One process holds every arena; the test plays rank 1 (its count and
// record in rank 0's landing, its count flag) and the ranks after it (no records; with 4
// ranks, once, rank 3 with too many: the lowest corrupt source is named, in the error and in
// the abort word alike, whichever block found its own first). ubep only: bsp's barrier before
// the count needs the peers running.
TEST_P(CudaEpTest, ACorruptSourceIsNamedBeforeAnythingIsIndexedByIt) {
  const EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  if (c.protocol == Protocol::kBsp) GTEST_SKIP() << "bsp's barrier needs the peers";
  const ArenaLayout layout(c);
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  const int S = c.slots_per_rank;
  struct Case {
    uint32_t records;
    int32_t entries, slot;
    std::string why;
    int32_t token = 0;
    bool last_over_too = false;  // The last rank's count is over max_tokens as well.
  };
  std::vector<Case> cases = {
      {static_cast<uint32_t>(c.max_tokens) + 1, 1, 0,
       absl::StrCat(c.max_tokens + 1, " records, over max_tokens ", c.max_tokens)},
      {1, 0, 0, absl::StrCat("record 0 has 0 entries, outside [1, ",
                             MaxPairsPerToken(c.top_k, S), "]")},
      {1, 1, S + 5, absl::StrCat("record 0 entry 0 names local slot ", S + 5, " of ", S)},
      {1, 1, -1, absl::StrCat("record 0 entry 0 names local slot -1 of ", S)},
      {1, 1, 0, absl::StrCat("record 0 names token -1 of max_tokens ", c.max_tokens), -1},
      {1, 1, 0,
       absl::StrCat("record 0 names token ", c.max_tokens, " of max_tokens ", c.max_tokens),
       c.max_tokens},
      // A flagged count from a rank whose calls are never flagged (flagged_tokens 0), or over
      // the flagged limit: as the host backend, by the limit of flagged rows.
      {(static_cast<uint32_t>(c.flagged_tokens) + 1) | kFlaggedCount, 1, 0,
       absl::StrCat(c.flagged_tokens + 1, " records, over flagged_tokens ", c.flagged_tokens)}};
  if (c.num_ranks >= 4) {
    cases.push_back({1, 1, S + 5,
                     absl::StrCat("record 0 entry 0 names local slot ", S + 5, " of ", S), 0,
                     true});
  }
  UseCudaInTestProcess();
  const RankInput in = MakeInput(c, 0, 8, 3);
  uint16_t* x = Upload(Bf16Input(in));
  int32_t* idx = Upload(in.topk_idx);
  float* w = Upload(in.topk_w);
  const auto* table = reinterpret_cast<const PlanTableHeader*>(Upload(plan.table));
  for (const Case& k : cases) {
    SCOPED_TRACE(k.why);
    OneProcessGroup group;
    ASSERT_NO_FATAL_FAILURE(group.Create(c));
    const std::vector<std::byte*>& pointers = group.pointers;
    CudaEp* ep = group.ep.get();
    std::byte* arena = pointers[0];
    UBEP_CHECK_CUDA(cudaMemcpy(arena + layout.counts + sizeof(uint32_t), &k.records,
                               sizeof(k.records), cudaMemcpyHostToDevice));
    if (k.last_over_too) {
      const uint32_t over = static_cast<uint32_t>(c.max_tokens) + 1;
      UBEP_CHECK_CUDA(cudaMemcpy(arena + layout.counts + sizeof(uint32_t) * (c.num_ranks - 1),
                                 &over, sizeof(over), cudaMemcpyHostToDevice));
    }
    const RecordHeader header{k.token, k.entries};
    const RecordEntry entry{k.slot, 1.0f};
    std::byte* records = arena + layout.records + 1 * c.max_tokens * layout.record_bytes;
    UBEP_CHECK_CUDA(cudaMemcpy(records, &header, sizeof(header), cudaMemcpyHostToDevice));
    UBEP_CHECK_CUDA(
        cudaMemcpy(records + sizeof(header), &entry, sizeof(entry), cudaMemcpyHostToDevice));
    const uint32_t epoch = 1;
    for (int s = 1; s < c.num_ranks; ++s) {
      UBEP_CHECK_CUDA(cudaMemcpy(arena + layout.count_flag + s * kFlagStride, &epoch,
                                 sizeof(epoch), cudaMemcpyHostToDevice));
    }
    UBEP_CHECK_CUDA(cudaDeviceSynchronize());
    CudaDispatchOutput out;
    EXPECT_EQ(ep->Dispatch({x, idx, w, in.num_tokens, 0, table, plan.header()}, out),
              absl::UnavailableError(absl::StrCat("rank 0: rank 1's records of dispatch call 1 are "
                                                  "corrupt (", k.why,
                                                  "); the group gave up on rank 1")));
    for (int r = 0; r < c.num_ranks; ++r) {
      uint32_t code = 0;
      UBEP_CHECK_CUDA(
          cudaMemcpy(&code, pointers[r] + layout.abort, sizeof(code), cudaMemcpyDeviceToHost));
      EXPECT_EQ(code, kAbortTimedOutBase + 1) << "rank " << r;
    }
  }
}

// Every rank of the group in this one process, on one device, each on a thread of its own,
// rank 0 first and the others a second later: no rank's host-side copy (its first look at
// the abort word, its refusal record withdrawn) waits behind the kernels of another rank's
// call, which wait for it in turn (the legacy default stream, which such copies took, waits
// for every blocking stream of the process's context: the call timed out). The threads start
// on the process's current device as new threads do, and each call selects its rank's.
TEST_P(CudaEpTest, RanksOfOneProcessOnOneDeviceDoNotWaitForEachOthersKernels) {
  const EpConfig c = GpuConfig(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const TestPlan plan = TestPlan::RoundRobin(c.num_ranks * c.slots_per_rank, c.num_experts, 2);
  UseCudaInTestProcess();
  OneProcessGroup group;  // Every rank's arena, and rank 0's CudaEp.
  ASSERT_NO_FATAL_FAILURE(group.Create(c));
  std::vector<CudaEp*> eps = {group.ep.get()};
  std::vector<std::unique_ptr<CudaEp>> others;
  for (int r = 1; r < c.num_ranks; ++r) {
    absl::StatusOr<std::unique_ptr<CudaEp>> ep = CudaEp::Create(c, r, group.pointers);
    ASSERT_TRUE(ep.ok()) << ep.status();
    others.push_back(*std::move(ep));
    eps.push_back(others.back().get());
  }
  const auto* table = reinterpret_cast<const PlanTableHeader*>(Upload(plan.table));
  struct Inputs {
    uint16_t* x;
    int32_t* idx;
    float* w;
    int tokens;
  };
  std::vector<Inputs> inputs;
  for (int r = 0; r < c.num_ranks; ++r) {
    const RankInput in = MakeInput(c, r, 8, 3);
    inputs.push_back({Upload(Bf16Input(in)), Upload(in.topk_idx), Upload(in.topk_w), in.num_tokens});
  }
  UBEP_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::string> errors(c.num_ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.num_ranks; ++r) {
    threads.emplace_back([&, r] {
      if (r > 0) absl::SleepFor(absl::Seconds(1));  // Rank 0's call is in flight by then.
      const Inputs& in = inputs[r];
      CudaDispatchOutput out;
      const absl::Status dispatched =
          eps[r]->Dispatch({in.x, in.idx, in.w, in.tokens, 0, table, plan.header()}, out);
      if (!dispatched.ok()) {
        errors[r] = absl::StrCat("dispatch: ", dispatched.ToString());
        return;
      }
      uint16_t* d_out = nullptr;
      const size_t out_bytes = sizeof(uint16_t) * std::max(1, in.tokens) * c.hidden;
      if (cudaMalloc(&d_out, out_bytes) != cudaSuccess) {
        errors[r] = "cudaMalloc";
        return;
      }
      const absl::Status combined = eps[r]->Combine(out.recv_x, d_out);  // An identity expert.
      cudaFree(d_out);
      if (!combined.ok()) errors[r] = absl::StrCat("combine: ", combined.ToString());
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors, std::vector<std::string>(c.num_ranks));
}

INSTANTIATE_TEST_SUITE_P(RanksAndProtocols, CudaEpTest,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values(Mode::kUbep, Mode::kUbepCountFirst,
                                                              Mode::kBsp, Mode::kUbepFlagged)),
                         [](const auto& info) {
                           const Mode mode = std::get<1>(info.param);
                           return absl::StrCat(std::get<0>(info.param), "_ranks_",
                                               mode == Mode::kBsp   ? "bsp"
                                               : mode == Mode::kUbep ? "ubep"
                                               : mode == Mode::kUbepFlagged
                                                   ? "ubep_flagged"
                                                   : "ubep_count_first");
                         });

}  // namespace
}  // namespace ubep::kernels
