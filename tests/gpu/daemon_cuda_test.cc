// ubepd --backend cuda end to end: VMM device arenas exported as fds, imported by libubep in
// each rank, CUDA kernels through the library; every received row and every combined value
// compared byte for byte with the host backend run on the same input. Label gpu; skips
// cleanly without a CUDA device.
#include <cuda_runtime.h>

#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/common/bf16.h"
#include "kernels/cuda/cuda_ep.h"
#include "kernels/host/host_ep.h"
#include "kernels/host/shared_arena.h"
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

// One ubepd hosting both ranks, or (two_daemons) a balancer and two ubepd hosting one rank
// each: each daemon imports the other's device arenas (VMM fds over its fd socket) and the
// group forms across them.
void RunAndCompare(bool two_daemons) {
  if (!kernels::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
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
                                 "--wait_timeout=20s"},
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

  // CUDA through libubep, ranks as threads.
  std::vector<Result> gpu(kRanks);
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      ClientOptions options;
      options.socket_path = sockets[r];
      absl::StatusOr<std::unique_ptr<Rank>> rank = Rank::Attach(options, r, kRanks, r % devices, shape);
      if (!rank.ok()) {
        errors[r] = std::string(rank.status().message());
        return;
      }
      const Input& in = inputs[r];
      void *x, *idx, *w, *out;
      cudaMalloc(&x, in.x.size() * 2);
      cudaMalloc(&idx, in.idx.size() * 4);
      cudaMalloc(&w, in.w.size() * 4);
      cudaMalloc(&out, in.x.size() * 2);
      cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(idx, in.idx.data(), in.idx.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(w, in.w.data(), in.w.size() * 4, cudaMemcpyHostToDevice);
      Dispatched d;
      absl::Status s = (*rank)->BeginStep((*rank)->resume_step());
      if (s.ok()) s = (*rank)->Dispatch(0, x, static_cast<int32_t*>(idx), static_cast<float*>(w), kTokens, d);
      if (s.ok()) {
        gpu[r].slot_offsets.assign(d.slot_offsets().begin(), d.slot_offsets().end());
        gpu[r].rows.resize(static_cast<size_t>(d.num_rows()) * kHidden);
        cudaMemcpy(gpu[r].rows.data(), d.rows(), gpu[r].rows.size() * 2, cudaMemcpyDeviceToHost);
        s = (*rank)->Combine(d, d.rows(), out);  // Identity experts.
      }
      if (s.ok()) {
        gpu[r].combined.resize(in.x.size());
        cudaMemcpy(gpu[r].combined.data(), out, in.x.size() * 2, cudaMemcpyDeviceToHost);
        s = (*rank)->Detach();
      }
      if (!s.ok()) errors[r] = std::string(s.message());
      cudaFree(x);
      cudaFree(idx);
      cudaFree(w);
      cudaFree(out);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;

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
  threads.clear();
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto ep = *kernels::HostEp::Create(config, r, bases);
      kernels::DispatchInput d;
      d.x = inputs[r].x.data();
      d.topk_idx = inputs[r].idx.data();
      d.topk_weights = inputs[r].w.data();
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

}  // namespace
}  // namespace ubep
