// ubepd --backend cuda end to end: VMM device arenas exported as fds, imported by libubep in
// each rank process, CUDA kernels through the library; every received row and every combined
// value compared byte for byte with the host backend run on the same input. Label gpu; skips
// cleanly without a CUDA device.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/common/bf16.h"
#include "kernels/cuda/cuda_ep.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/shared_arena.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/integration/cluster.h"
#include "tests/integration/process.h"
#include "tests/unit/test_util.h"
#include "ubep/ubep.h"

namespace ubep {
namespace {

constexpr int kRanks = 2, kExperts = 16, kHidden = 64, kTopK = 4, kTokens = 32, kSlots = 8;

struct Input {
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  std::vector<float> w;
};

Input MakeInput(int rank) {
  std::mt19937 rng(77 + rank);
  Input in;
  for (int i = 0; i < kTokens * kHidden; ++i) {
    in.x.push_back(kernels::FloatToBf16(std::uniform_real_distribution<float>(-1, 1)(rng)));
  }
  for (int t = 0; t < kTokens; ++t) {
    std::vector<int32_t> experts(kExperts);
    for (int e = 0; e < kExperts; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < kTopK; ++k) {
      in.idx.push_back(t == 3 && k == 1 ? -1 : experts[k]);  // One masked entry.
      in.w.push_back(std::uniform_real_distribution<float>(0, 1)(rng));
    }
  }
  return in;
}

struct Result {
  std::vector<int32_t> slot_offsets;
  std::vector<uint16_t> rows, combined;
};

// What a rank process sends back.
struct RankBoard {
  int32_t slot_offsets[kSlots + 1];
  int32_t num_rows;
  uint16_t rows[kRanks * kTokens * kTopK * kHidden];  // At most every pair lands here.
  uint16_t combined[kTokens * kHidden];
};

struct Board {
  RankBoard result[kRanks];
  char error[kRanks][256];
};

// One rank process: attaches to its daemon, dispatches and combines (identity experts) on
// the GPU, fills `result`; returns "" or what went wrong.
// With `bad_pair`, one (token, k) of rank 1's input names an expert out of range: on CUDA its
// Dispatch returns the error with the rest dispatched, and it combines as after a good call.
constexpr int kBadToken = 5, kBadK = 2;

std::string RunRank(int r, const std::string& socket, const ModelShape& shape, const Input& in,
                    RankBoard& result, bool bad_pair = false) {
  int devices = 0;
  UBEP_CHECK_CUDA(cudaGetDeviceCount(&devices));
  ClientOptions options;
  options.socket_path = socket;
  absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, r, kRanks, r % devices, shape);
  if (!rank.ok()) return std::string(rank.status().message());
  // The rank's buffers on its device (libubep leaves the caller's current device as it was).
  UBEP_CHECK_CUDA(cudaSetDevice(r % devices));
  void *x, *idx, *w, *out;
  UBEP_CHECK_CUDA(cudaMalloc(&x, in.x.size() * 2));
  UBEP_CHECK_CUDA(cudaMalloc(&idx, in.idx.size() * 4));
  UBEP_CHECK_CUDA(cudaMalloc(&w, in.w.size() * 4));
  UBEP_CHECK_CUDA(cudaMalloc(&out, in.x.size() * 2));
  UBEP_CHECK_CUDA(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
  UBEP_CHECK_CUDA(cudaMemcpy(idx, in.idx.data(), in.idx.size() * 4, cudaMemcpyHostToDevice));
  UBEP_CHECK_CUDA(cudaMemcpy(w, in.w.data(), in.w.size() * 4, cudaMemcpyHostToDevice));
  Dispatched d;
  absl::Status s = (*rank)->BeginStep((*rank)->resume_step());
  if (s.ok()) s = (*rank)->Dispatch(0, x, static_cast<int32_t*>(idx), static_cast<float*>(w), kTokens, d);
  if (bad_pair && r == 1) {
    const std::string expected = absl::StrCat("topk_idx[", kBadToken, "][", kBadK, "] = ",
                                              kExperts, " is outside [-1, ", kExperts, ")");
    if (s != absl::InvalidArgumentError(expected)) {
      return absl::StrCat("expected INVALID_ARGUMENT: ", expected, ", got ", s.ToString());
    }
    s = absl::OkStatus();
  }
  if (!s.ok()) return std::string(s.message());
  if (d.slot_offsets().size() != kSlots + 1 ||
      d.num_rows() > kRanks * kTokens * kTopK) {
    return absl::StrCat(d.slot_offsets().size(), " slot offsets and ", d.num_rows(), " rows");
  }
  std::copy(d.slot_offsets().begin(), d.slot_offsets().end(), result.slot_offsets);
  result.num_rows = d.num_rows();
  UBEP_CHECK_CUDA(cudaMemcpy(result.rows, d.rows(),
                             static_cast<size_t>(d.num_rows()) * kHidden * 2,
                             cudaMemcpyDeviceToHost));
  s = (*rank)->Combine(d, d.rows(), out);  // Identity experts.
  if (!s.ok()) return std::string(s.message());
  UBEP_CHECK_CUDA(cudaMemcpy(result.combined, out, in.x.size() * 2, cudaMemcpyDeviceToHost));
  // A Dispatch refused before it takes part (a layer out of range) leaves its output empty,
  // also after a call that completed: the last call's rows are not handed out as this one's.
  s = (*rank)->Dispatch(/*layer=*/1, x, static_cast<int32_t*>(idx), static_cast<float*>(w), kTokens, d);
  if (s != absl::InvalidArgumentError("layer 1 is outside [0, 1)")) {
    return absl::StrCat("a dispatch of layer 1 (of 1): expected INVALID_ARGUMENT: layer 1 is "
                        "outside [0, 1), got ", s.ToString());
  }
  if (d.num_rows() != 0 || d.rows() != nullptr || !d.slot_offsets().empty()) {
    return absl::StrCat("a dispatch refused for its layer left ", d.num_rows(),
                        " rows in its output");
  }
  s = (*rank)->Detach();
  if (!s.ok()) return std::string(s.message());
  for (void* p : {x, idx, w, out}) UBEP_CHECK_CUDA(cudaFree(p));
  return "";
}

// One ubepd hosting both ranks, or (two_daemons) a balancer and two ubepd hosting one rank
// each: each daemon imports the other's device arenas (VMM fds over its fd socket) and the
// group forms across them. With `flagged`, the single ubepd runs with --flagged_tokens, so
// every call moves flag-in-granule rows (kernels/common/flagged_rows.h).
void RunAndCompare(bool two_daemons, bool flagged = false, bool bad_pair = false) {
  UBEP_SKIP_WITHOUT_DEVICE();
  test::TempDir dir;
  const auto wait_ready = [&](const std::string& name) {
    return test::ReadyFile(dir.path() + "/" + name + ".ready", dir.path() + "/" + name + ".log");
  };
  std::vector<std::unique_ptr<test::Process>> processes;
  std::vector<std::string> sockets;
  if (!two_daemons) {
    sockets.assign(kRanks, dir.path() + "/ubepd.sock");
    processes.push_back(std::make_unique<test::Process>(
        std::vector<std::string>{test::BinaryPath("ubepd"), "--backend=cuda", "--socket=" + sockets[0],
                                 "--metrics=", "--ready_file=" + dir.path() + "/ubepd.ready",
                                 "--wait_timeout=20s",
                                 absl::StrCat("--flagged_tokens=", flagged ? kTokens : 0)},
        dir.path() + "/ubepd.log"));
    wait_ready("ubepd");
  } else {
    processes.push_back(std::make_unique<test::Process>(
        std::vector<std::string>{test::BinaryPath("ubep-balancer"), "--listen=127.0.0.1:0", "--metrics=",
                                 "--ready_file=" + dir.path() + "/balancer.ready", "--auto_rebalance=false"},
        dir.path() + "/balancer.log"));
    const int port = wait_ready("balancer").value("port", 0);
    for (int r = 0; r < kRanks; ++r) {
      const std::string node = absl::StrCat("node-", r);
      sockets.push_back(dir.path() + "/" + node + ".sock");
      processes.push_back(std::make_unique<test::Process>(
          std::vector<std::string>{test::BinaryPath("ubepd"), "--backend=cuda", "--socket=" + sockets[r],
                                   "--metrics=", "--ready_file=" + dir.path() + "/" + node + ".ready",
                                   "--wait_timeout=20s", "--listen=127.0.0.1:0",
                                   absl::StrCat("--balancer=127.0.0.1:", port), "--node=" + node,
                                   absl::StrCat("--ranks=", r, "-", r)},
          dir.path() + "/" + node + ".log"));
      wait_ready(node);
    }
  }

  ModelShape shape;
  shape.num_layers = 1;
  shape.num_experts = kExperts;
  shape.hidden = kHidden;
  shape.top_k = kTopK;
  shape.max_tokens = kTokens;
  shape.slots_per_rank = kSlots;
  shape.dtype = DType::kBFloat16;
  std::vector<Input> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(MakeInput(r));
  std::vector<Input> reference = inputs;  // The host backend's: the bad pair masked.
  if (bad_pair) {
    inputs[1].idx[kBadToken * kTopK + kBadK] = kExperts;
    reference[1].idx[kBadToken * kTopK + kBadK] = -1;
  }

  // CUDA through libubep, each rank a process of its own, as a serving process would be;
  // results come back through a shared board.
  kernels::SharedArena board_arena = *kernels::SharedArena::Create("gpu-results", sizeof(Board));
  Board* board = new (board_arena.data()) Board{};
  std::vector<pid_t> pids;
  for (int r = 0; r < kRanks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << strerror(errno);
      break;
    }
    if (pid == 0) {
      const std::string error = RunRank(r, sockets[r], shape, inputs[r], board->result[r], bad_pair);
      std::snprintf(board->error[r], sizeof(board->error[r]), "%s", error.c_str());
      _exit(error.empty() ? 0 : 3);
    }
    pids.push_back(pid);
  }
  std::vector<Result> gpu(kRanks);
  // Every rank is reaped before any is judged: a failed one must not leave another running
  // (holding the device) into the next test.
  const std::vector<int> statuses = test::WaitForRanks(pids, absl::Minutes(3));
  for (int r = 0; r < kRanks; ++r) {
    const int status = statuses[r];
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " (wait status " << status << "): " << board->error[r];
    const RankBoard& from = board->result[r];
    gpu[r].slot_offsets.assign(from.slot_offsets, from.slot_offsets + kSlots + 1);
    gpu[r].rows.assign(from.rows, from.rows + static_cast<size_t>(from.num_rows) * kHidden);
    gpu[r].combined.assign(from.combined, from.combined + kTokens * kHidden);
  }

  // The host backend on the same input and the daemon's round-robin plan.
  kernels::EpConfig config;
  config.num_ranks = kRanks;
  config.max_tokens = kTokens;
  config.hidden = kHidden;
  config.top_k = kTopK;
  config.num_experts = kExperts;
  config.slots_per_rank = kSlots;
  config.dtype = kernels::DType::kBFloat16;
  config.protocol = kernels::Protocol::kUbep;
  std::vector<int> experts(kRanks * kSlots);
  for (int p = 0; p < kRanks * kSlots; ++p) experts[p] = p % kExperts;
  // Equal shares among an expert's replicas, as the daemon's round-robin plan has.
  std::vector<double> shares(kRanks * kSlots);
  for (int p = 0; p < kRanks * kSlots; ++p) {
    shares[p] = 1.0 / static_cast<double>(std::count(experts.begin(), experts.end(), experts[p]));
  }
  const kernels::LayerRouting layer{experts, shares};
  const std::vector<std::byte> table = *kernels::BuildPlanTable(1, kExperts, {&layer, 1});
  std::vector<kernels::SharedArena> arenas;
  std::vector<std::byte*> bases;
  for (int r = 0; r < kRanks; ++r) {
    arenas.push_back(*kernels::SharedArena::Create("ref", kernels::ArenaLayout(config).total_bytes));
    bases.push_back(arenas.back().data());
  }
  std::vector<Result> host(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto ep = *kernels::HostEp::Create(config, r, bases);
      kernels::DispatchInput d;
      d.x = reference[r].x.data();
      d.topk_idx = reference[r].idx.data();
      d.topk_weights = reference[r].w.data();
      d.num_tokens = kTokens;
      d.hidden = kHidden;
      d.plan = reinterpret_cast<const kernels::PlanTableHeader*>(table.data());
      kernels::DispatchOutput out;
      ASSERT_TRUE(ep->Dispatch(d, out).ok());
      host[r].slot_offsets = out.slot_offsets;
      host[r].rows.resize(out.recv_x.size() / 2);
      std::memcpy(host[r].rows.data(), out.recv_x.data(), out.recv_x.size());
      host[r].combined.resize(inputs[r].x.size());
      ASSERT_TRUE(ep->Combine(out, out.recv_x.data(), host[r].combined.data()).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(gpu[r].slot_offsets, host[r].slot_offsets) << "rank " << r;
    EXPECT_EQ(gpu[r].rows, host[r].rows) << "rank " << r;
    EXPECT_EQ(gpu[r].combined, host[r].combined) << "rank " << r;
  }
  for (auto it = processes.rbegin(); it != processes.rend(); ++it) {
    (*it)->Signal(SIGTERM);
    EXPECT_EQ((*it)->Wait(absl::Seconds(30)), 0);
  }
}

TEST(DaemonCudaTest, LibubepOnCudaArenasMatchesTheHostBackendByteForByte) { RunAndCompare(false); }

TEST(DaemonCudaTest, AGroupOverTwoDaemonsOnCudaMatchesTheHostBackendByteForByte) { RunAndCompare(true); }

// A rank whose input names an expert out of range: its Dispatch says so and dispatches the
// rest, and its Combine, called as after a good Dispatch, is taken (libubep once refused it as
// another dispatch's output, and the peers waited out their timeout); both ranks match the
// host backend with the pair masked.
TEST(DaemonCudaTest, ADispatchWithABadExpertIdIsCombinedAndMatchesTheHostBackendWithItMasked) {
  RunAndCompare(false, false, /*bad_pair=*/true);
}

TEST(DaemonCudaTest, FlaggedRowsOnCudaArenasMatchTheHostBackendByteForByte) {
  RunAndCompare(false, /*flagged=*/true);
}

}  // namespace
}  // namespace ubep
