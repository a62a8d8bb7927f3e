// ubep-moe-example: a serving process running a small MoE layer stack through ubepd on the
// host backend. Each rank attaches, loads its slots' expert weights into the arena, and runs
// steps: dispatch, the local experts (weights read from the arena), combine, per layer. Every
// layer's output is checked against a float64 reference of that layer on the same input,
// computed alone (so the bound does not grow with the number of layers).
//
// Recovery: when the group stops (a rank died, or a wait timed out) it re-joins and repeats
// the step the group resumes at, waiting for a peer that is late for --reattach_timeout (and
// as long as the plan excludes this rank: it was drained); when ubepd drains it detaches and
// attaches again until the daemon is back (--reattach_timeout; and as long as the plan excludes
// this rank, the daemon back with its node still drained). A step whose call overflowed
// some rank's receive capacity (ResourceExhausted, on every rank at once) is dropped, as an
// engine drops a batch, and the next one runs; so is one whose ranks' calls were out of step
// (Aborted, on every rank: one rank was a layer or a step ahead). step_log.h has the lines.
//
// Log (stdout, and --log FILE appended line by line):
//   step 12 generation 1 plan 1 max_rel_err 1.9e-07 ok
//   error step 13: rank 1: rank 2 left the group ...
//   dropped step 14: rank 1, combine call 57: rank 3 was routed 300 rows ...
//   dropped step 15 (out of step): rank 0, dispatch call 60: pairs layer 0 of step 15 ...
//   done steps 100 failed 0 dropped 1
// Exit code: 0 when every step served matched the reference, 1 on a mismatch (or a flag
// Abseil cannot parse: unknown, or not of its type), 2 on flag values it cannot run with,
// 3 on an error it cannot recover from (the group could not be (re)joined in time, or a step
// failed otherwise than the recovery above covers; the log says which), 4 when every step it
// ran was dropped (nothing was checked: a receive capacity too small for any step, say).
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "common/flags_usage.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "examples/moe_serving/moe_model.h"
#include "examples/moe_serving/step_log.h"
#include "ubep/ubep.h"

ABSL_FLAG(std::string, socket, "/run/ubep/ubepd.sock", "ubepd's Unix socket.");
ABSL_FLAG(int, rank, 0, "This process's EP rank.");
ABSL_FLAG(int, world, 4, "Ranks in the EP group.");
ABSL_FLAG(int, steps, 100, "Steps to run (0 .. steps-1).");
ABSL_FLAG(int, layers, 4, "MoE layers.");
ABSL_FLAG(int, experts, 256, "Logical experts per layer.");
ABSL_FLAG(int, hidden, 32, "Hidden size.");
ABSL_FLAG(int, top_k, 8, "Experts per token.");
ABSL_FLAG(int, tokens, 32, "Tokens per rank per step.");
ABSL_FLAG(int, slots_per_rank, 0, "Expert slots per rank per layer; 0 = experts / world.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of inputs, router and weights.");
ABSL_FLAG(std::string, traces, "",
          "Comma-separated SGLang expert-distribution files the router draws from; empty = Zipf.");
ABSL_FLAG(double, drift_period, 200, "Steps per full rotation of the traces' mix (the drift).");
ABSL_FLAG(std::string, log, "", "Also append the log here, one flushed line at a time.");
ABSL_FLAG(double, tolerance, 1e-6,
          "Largest norm-wise relative error a layer's output may have against its float64 "
          "reference on the same input.");
ABSL_FLAG(absl::Duration, step_delay, absl::ZeroDuration(), "Sleep after each step.");
ABSL_FLAG(absl::Duration, join_timeout, absl::Seconds(60),
          "How long an Attach or a Rejoin waits for the rest of the group at a time "
          "(ClientOptions::join_timeout).");
ABSL_FLAG(absl::Duration, reattach_timeout, absl::Seconds(60),
          "How long to keep attaching while ubepd is away (draining, restarting), and "
          "rejoining while a peer is late; a rank the plan excludes waits for as long as it is "
          "excluded.");

namespace {

using ubep::example::MoeModel;

class Log {
 public:
  explicit Log(const std::string& path) {
    if (!path.empty()) file_.open(path, std::ios::app);
  }
  bool opened(const std::string& path) const { return path.empty() || file_.is_open(); }
  void Line(const std::string& line) {
    std::cout << line << std::endl;
    if (file_.is_open()) file_ << line << std::endl;
  }

 private:
  std::ofstream file_;
};

// Writes the expert weights of every (layer, local slot) into this rank's arena, and says so.
absl::Status LoadWeights(ubep::Rank& rank, const MoeModel& model) {
  const ubep::ModelShape& shape = rank.shape();
  for (int l = 0; l < shape.num_layers; ++l) {
    for (int i = 0; i < shape.slots_per_rank; ++i) {
      absl::StatusOr<int> expert = rank.SlotExpert(l, i);
      if (absl::IsNotFound(expert.status())) continue;  // An unused slot.
      if (!expert.ok()) return expert.status();
      absl::StatusOr<std::span<std::byte>> buffer = rank.ExpertWeights(l, i);
      if (!buffer.ok()) return buffer.status();
      const std::vector<float> w = model.ExpertWeights(l, *expert);
      std::memcpy(buffer->data(), w.data(), w.size() * sizeof(float));
    }
  }
  // Now ubepd may give them to another domain as the copy of last resort (after a restart).
  return rank.WeightsLoaded();
}

// One step through every layer; `max_rel_err`: the largest error of a layer's output against
// its float64 reference on the layer's own input (MoeModel::ReferenceLayer).
absl::Status RunStep(ubep::Rank& rank, const MoeModel& model, uint64_t step, std::vector<float>& x,
                     uint64_t& plan_version, double& max_rel_err) {
  const int H = rank.shape().hidden, S = rank.shape().slots_per_rank;
  x = model.Input(step, rank.rank());
  std::vector<int32_t> idx;
  std::vector<float> w, y, out(x.size());
  ubep::Dispatched d;
  if (absl::Status s = rank.BeginStep(step); !s.ok()) return s;
  for (int l = 0; l < rank.shape().num_layers; ++l) {
    model.Route(step, rank.rank(), l, idx, w);
    if (absl::Status s = rank.Dispatch(l, x.data(), idx.data(), w.data(), model.options().tokens, d);
        !s.ok()) {
      // (Host backend: nothing moved. An engine on the CUDA backend combines an
      // InvalidArgument's output that holds rows, d.slot_offsets() not empty: its peers wait
      // for that rank's partials; see ubep.h.)
      return s;
    }
    plan_version = d.plan_version();
    y.resize(static_cast<size_t>(d.num_rows()) * H);
    const auto* rows = reinterpret_cast<const float*>(d.rows());
    for (int i = 0; i < S; ++i) {
      const int begin = d.slot_offsets()[i], end = d.slot_offsets()[i + 1];
      if (begin == end) continue;
      absl::StatusOr<std::span<std::byte>> weights = rank.ExpertWeights(l, i);
      if (!weights.ok()) return weights.status();
      const auto* W = reinterpret_cast<const float*>(weights->data());
      for (int row = begin; row < end; ++row) {
        MoeModel::Apply(W, rows + static_cast<size_t>(row) * H, H, y.data() + static_cast<size_t>(row) * H);
      }
    }
    if (absl::Status s = rank.Combine(d, y.data(), out.data()); !s.ok()) return s;
    const double err =
        ubep::example::MaxRelativeError(out, model.ReferenceLayer(step, rank.rank(), l, x), H);
    max_rel_err = ubep::example::WorseError(max_rel_err, err);  // NaN sticks, and fails the step.
    std::swap(x, out);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  ubep::SetFlagsUsage("ubep-moe-example",
      "runs a small MoE layer stack through ubepd and checks every step "
      "against a float64 reference.\nUsage: ubep-moe-example --socket PATH --rank R --world W");
  absl::ParseCommandLine(argc, argv);
  ubep::example::MoeModelOptions mo;
  mo.seed = absl::GetFlag(FLAGS_seed);
  mo.drift_period_steps = absl::GetFlag(FLAGS_drift_period);
  mo.num_layers = absl::GetFlag(FLAGS_layers);
  mo.num_experts = absl::GetFlag(FLAGS_experts);
  mo.hidden = absl::GetFlag(FLAGS_hidden);
  mo.top_k = absl::GetFlag(FLAGS_top_k);
  mo.tokens = absl::GetFlag(FLAGS_tokens);
  if (const std::string t = absl::GetFlag(FLAGS_traces); !t.empty()) {
    mo.traces = absl::StrSplit(t, ',', absl::SkipEmpty());
  }
  absl::StatusOr<MoeModel> model = MoeModel::Create(mo);
  if (!model.ok()) {
    std::cerr << "ubep-moe-example: " << model.status().message() << "\n";
    return 2;
  }
  const int world = absl::GetFlag(FLAGS_world);
  const int rank_id = absl::GetFlag(FLAGS_rank);
  const absl::Duration reattach_timeout = absl::GetFlag(FLAGS_reattach_timeout);
  std::string bad;
  if (world <= 0) {
    bad = absl::StrCat("--world ", world, " is not positive");
  } else if (rank_id < 0 || rank_id >= world) {
    bad = absl::StrCat("--rank ", rank_id, " is not in [0, ", world, ")");
  } else if (absl::GetFlag(FLAGS_steps) < 0) {
    bad = absl::StrCat("--steps ", absl::GetFlag(FLAGS_steps), " is negative");
  } else if (absl::GetFlag(FLAGS_join_timeout) <= absl::ZeroDuration()) {
    bad = absl::StrCat("--join_timeout ", absl::FormatDuration(absl::GetFlag(FLAGS_join_timeout)),
                       " is not positive");
  } else if (reattach_timeout <= absl::ZeroDuration()) {
    bad = absl::StrCat("--reattach_timeout ", absl::FormatDuration(reattach_timeout),
                       " is not positive");
  } else if (absl::GetFlag(FLAGS_slots_per_rank) < 0) {
    bad = absl::StrCat("--slots_per_rank ", absl::GetFlag(FLAGS_slots_per_rank),
                       " is negative (0: experts / world)");
  }
  if (!bad.empty()) {
    std::cerr << "ubep-moe-example: " << bad << "\n";
    return 2;
  }
  int slots = absl::GetFlag(FLAGS_slots_per_rank);
  if (slots == 0 && world > 0) slots = (mo.num_experts + world - 1) / world;
  ubep::ModelShape shape;
  shape.num_layers = mo.num_layers;
  shape.num_experts = mo.num_experts;
  shape.hidden = mo.hidden;
  shape.top_k = mo.top_k;
  shape.max_tokens = std::max(mo.tokens, 1);
  shape.slots_per_rank = slots;
  shape.bytes_per_expert = sizeof(float) * mo.hidden * mo.hidden;
  ubep::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.join_timeout = absl::GetFlag(FLAGS_join_timeout);
  const int steps = absl::GetFlag(FLAGS_steps);
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  Log log(absl::GetFlag(FLAGS_log));
  if (!log.opened(absl::GetFlag(FLAGS_log))) {
    std::cerr << "ubep-moe-example: --log " << absl::GetFlag(FLAGS_log)
              << ": cannot open it: " << std::strerror(errno) << "\n";
    return 2;
  }
  const std::string me = absl::StrCat("rank ", rank_id);

  // Attaches, retrying while ubepd is away, for at most --reattach_timeout, and for as long as
  // the plan excludes this rank (its node drained: its Join ends DeadlineExceeded, "excluded",
  // at each join timeout; the rank serves nothing until a plan includes it).
  // Tried once at least, whatever the timeout; timed on the monotonic clock (a wall clock set
  // forward would end the wait before any try).
  auto attach = [&](std::optional<uint64_t> next_step) -> absl::StatusOr<std::unique_ptr<ubep::Rank>> {
    const auto now = [] { return std::chrono::steady_clock::now(); };
    // (An infinite flag value is a century: steady_clock's time point would wrap past it.)
    const auto timeout =
        absl::ToChronoNanoseconds(std::min(reattach_timeout, absl::Hours(24 * 365 * 100)));
    auto deadline = now() + timeout;
    bool said_excluded = false;
    absl::Status last;
    do {
      absl::StatusOr<std::unique_ptr<ubep::Rank>> r =
          ubep::Rank::Attach(options, rank_id, world, 0, shape, next_step);
      if (r.ok()) {
        if (absl::Status s = LoadWeights(**r, *model); !s.ok()) return s;
        return r;
      }
      last = r.status();
      // Retry what time can fix: ubepd away or draining, the rank's old client not yet noticed.
      if (!absl::IsUnavailable(last) && !absl::IsAlreadyExists(last) &&
          !absl::IsDeadlineExceeded(last)) {
        return last;
      }
      if (absl::IsDeadlineExceeded(last) &&
          absl::StrContains(last.message(), "is excluded from the EP group")) {
        if (!said_excluded) {
          log.Line(absl::StrCat("excluded at attach; waiting for a plan that includes rank ",
                                rank_id));
        }
        said_excluded = true;
        next_step = std::nullopt;  // Its step does not hold the group back when taken in.
        deadline = now() + timeout;
      }
      if (now() < deadline) absl::SleepFor(absl::Milliseconds(100));
    } while (now() < deadline);
    return last;
  };

  absl::StatusOr<std::unique_ptr<ubep::Rank>> rank = attach(std::nullopt);
  if (!rank.ok()) {
    log.Line(absl::StrCat("error attach: ", rank.status().message()));
    return 3;
  }
  // What a serving engine does with the weight memory: take it once and keep it (wrap it in a
  // tensor, register it with a DMA engine). It stays mapped until Detach, Rejoins included;
  // every Rejoin below reads it through the address taken here.
  absl::StatusOr<std::span<std::byte>> held = (*rank)->ExpertWeights(0, 0);
  if (!held.ok()) {
    log.Line(absl::StrCat("error weights: ", held.status().message()));
    return 3;
  }
  uint64_t step = (*rank)->resume_step();
  int failed = 0, dropped = 0, served = 0;
  std::vector<float> x;
  while (step < static_cast<uint64_t>(steps)) {
    uint64_t plan_version = 0;
    double err = 0;
    const absl::Status status = RunStep(**rank, *model, step, x, plan_version, err);
    if (status.ok()) {
      const bool ok = err <= tolerance;
      failed += ok ? 0 : 1;
      ++served;
      log.Line(ubep::example::ServedStepLine(step, (*rank)->stats().generation, plan_version,
                                             err, ok));
      ++step;
      absl::SleepFor(absl::GetFlag(FLAGS_step_delay));
      continue;
    }
    const ubep::example::AfterFailure after = ubep::example::AfterFailedStep(status);
    if (after == ubep::example::AfterFailure::kDropStep) {
      // Every rank's call failed (over a receive capacity, or out of step), so every rank
      // drops the step: the group stays in step.
      log.Line(ubep::example::DroppedStepLine(
          step,
          absl::IsAborted(status) ? ubep::example::StepOutcome::kDroppedOutOfStep
                                  : ubep::example::StepOutcome::kDroppedOverCapacity,
          status.message()));
      ++dropped;
      ++step;
      absl::SleepFor(absl::GetFlag(FLAGS_step_delay));
      continue;
    }
    log.Line(absl::StrCat("error step ", step, ": ", status.message()));
    // Unavailable and DeadlineExceeded: the group stopped (a peer's corrupt records among the
    // reasons); Internal: the combine libubep ran for a failed call did not complete, and the
    // group is out of step. Each: Rejoin (or attach again). Anything else is this process's
    // fault, or memory of ubepd's gone bad (DataLoss), which a Rejoin would read again.
    if (after == ubep::example::AfterFailure::kStop) return 3;
    // ubepd is going away or gone: detach now, attach to the next one (false: could not).
    auto attach_again = [&] {
      (void)(*rank)->Detach();
      rank->reset();
      // The new group resumes at the least step any rank asks for.
      rank = attach(step);
      if (!rank.ok()) {
        log.Line(absl::StrCat("error attach: ", rank.status().message()));
        return false;
      }
      step = (*rank)->resume_step();
      held = (*rank)->ExpertWeights(0, 0);  // A new attach maps a new arena.
      if (!held.ok()) {
        log.Line(absl::StrCat("error weights: ", held.status().message()));
        return false;
      }
      return true;
    };
    if ((*rank)->must_attach_again()) {
      if (!attach_again()) return 3;
      continue;
    }
    absl::StatusOr<uint64_t> resume = (*rank)->Rejoin(step);
    // A Rejoin ends DeadlineExceeded at each join timeout while a peer is missing, and
    // Unavailable where its ubepd did not hand over the new arenas in time: it is called again
    // for --reattach_timeout, and for as long as the plan excludes this rank
    // (node failed or drained: it serves nothing until a plan includes it; its step does not
    // hold the group back when it is taken in again, so it gives none). The time counts from
    // the last Rejoin that found it excluded: taken in again, it waits for the group as any.
    absl::Time give_up = absl::Now() + reattach_timeout;
    bool said_excluded = false;
    std::optional<uint64_t> next_step = step;
    while (!resume.ok() &&
           (absl::IsDeadlineExceeded(resume.status()) || absl::IsUnavailable(resume.status())) &&
           !(*rank)->must_attach_again()) {
      if ((*rank)->excluded() && absl::IsDeadlineExceeded(resume.status())) {
        if (!said_excluded) {
          log.Line(absl::StrCat("excluded at step ", step,
                                "; waiting for a plan that includes rank ", rank_id));
        }
        said_excluded = true;
        next_step = std::nullopt;
        give_up = absl::Now() + reattach_timeout;
      } else if (absl::Now() >= give_up) {
        break;
      } else {
        log.Line(absl::StrCat("waiting for the group to form again: ", resume.status().message()));
      }
      // An Unavailable may come back at once (a DeadlineExceeded comes after a join timeout).
      if (absl::IsUnavailable(resume.status())) absl::SleepFor(absl::Milliseconds(100));
      resume = (*rank)->Rejoin(next_step);
    }
    // Its daemon began draining, or exited, during a Rejoin: attach to the next one.
    if (!resume.ok() && (*rank)->must_attach_again()) {
      if (!attach_again()) return 3;
      continue;
    }
    if (!resume.ok()) {
      log.Line(absl::StrCat("error rejoin: ", resume.status().message()));
      return 3;
    }
    step = *resume;
    // Still mapped (a fault here would end the process): one read per page.
    uint64_t sum = 0;
    for (size_t at = 0; at < held->size(); at += 4096) {
      sum += static_cast<uint8_t>(*static_cast<volatile std::byte*>(held->data() + at));
    }
    log.Line(absl::StrCat("rejoined at step ", step, "; the weights taken at attach are mapped (",
                          held->size() / 4096 + (held->size() % 4096 != 0), " pages read, sum ", sum, ")"));
  }
  log.Line(absl::StrCat("done steps ", steps, " failed ", failed, " dropped ", dropped));
  if (failed != 0) return 1;
  if (served == 0 && dropped > 0) {
    log.Line(absl::StrCat("error: every step run (", dropped, ") was dropped; none was checked"));
    return 4;
  }
  return 0;
}
