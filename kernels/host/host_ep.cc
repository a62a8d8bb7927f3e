#include "kernels/host/host_ep.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cpus.h"
#include "common/status_macros.h"
#include "kernels/common/bad_input.h"
#include "kernels/common/bf16.h"
#include "kernels/common/corrupt_records.h"
#include "kernels/common/flagged_rows.h"
#include "kernels/common/plan_area.h"
#include "kernels/common/prefetch.h"
#include "kernels/common/routing.h"
#include "kernels/common/send_split.h"
#include "kernels/host/signal.h"

namespace ubep::kernels {
namespace {

constexpr uint32_t kArenaMagic = 0x41504555;  // "UEPA"

struct ArenaHeader {
  uint32_t magic, num_ranks, max_tokens, hidden, top_k, num_experts, slots_per_rank, num_layers,
      dtype, flagged_tokens, protocol;
  uint32_t rank;  // Whose arena it is: arenas given in another order are refused.
};
static_assert(sizeof(ArenaHeader) <= 64, "the arena's header line (ArenaLayout)");

// sum[h] (+)= w * row[h] for a row of `dtype`.
void Axpy(float w, const std::byte* row, DType dtype, int hidden, bool first, float* sum) {
  if (dtype == DType::kFloat32) {
    const auto* y = reinterpret_cast<const float*>(row);
    if (first) {
      for (int h = 0; h < hidden; ++h) sum[h] = w * y[h];
    } else {
      for (int h = 0; h < hidden; ++h) sum[h] += w * y[h];
    }
    return;
  }
  const auto* y = reinterpret_cast<const uint16_t*>(row);
  if (first) {
    for (int h = 0; h < hidden; ++h) sum[h] = w * Bf16ToFloat(y[h]);
  } else {
    for (int h = 0; h < hidden; ++h) sum[h] += w * Bf16ToFloat(y[h]);
  }
}

void StoreRow(const float* sum, int hidden, DType dtype, std::byte* row) {
  if (dtype == DType::kFloat32) {
    std::memcpy(row, sum, sizeof(float) * hidden);
    return;
  }
  auto* out = reinterpret_cast<uint16_t*>(row);
  for (int h = 0; h < hidden; ++h) out[h] = FloatToBf16(sum[h]);
}

// A row in the flag-in-granule format (flagged_rows.h): each 4 bytes of `from` go out with
// `tag` as one 64-bit atomic store. Release (a plain store on x86), so that whatever this rank
// did before, a tag scrub above all, happens before what a peer does after seeing the granule.
void StoreFlaggedRow(std::byte* to, const std::byte* from, size_t row_bytes, uint32_t tag) {
  auto* granules = reinterpret_cast<uint64_t*>(to);
  for (size_t i = 0; i < row_bytes / kGranuleDataBytes; ++i) {
    uint32_t data;
    std::memcpy(&data, from + i * kGranuleDataBytes, sizeof(data));
    std::atomic_ref<uint64_t>(granules[i]).store(Granule(data, tag), std::memory_order_release);
  }
}

// The data of a flagged row into `to`; false as soon as a granule does not carry `tag` yet
// (the row has not fully landed: `to` holds a prefix, and the caller tries again later).
// A granule's data and tag are one single-copy-atomic access; acquire pairs with the store.
bool LoadFlaggedRow(const std::byte* from, size_t row_bytes, uint32_t tag, std::byte* to) {
  auto* granules = reinterpret_cast<uint64_t*>(const_cast<std::byte*>(from));
  for (size_t i = 0; i < row_bytes / kGranuleDataBytes; ++i) {
    const uint64_t granule = std::atomic_ref<uint64_t>(granules[i]).load(std::memory_order_acquire);
    if (GranuleTag(granule) != tag) return false;
    const uint32_t data = GranuleData(granule);
    std::memcpy(to + i * kGranuleDataBytes, &data, sizeof(data));
  }
  return true;
}

// Rewrites the tag of every granule in the flagged parts of a landing (rows or partials,
// from `landing`, flagged_rows.h's periodic scrub).
void ScrubTags(std::byte* landing, const ArenaLayout& layout, uint32_t tag) {
  for (int s = 0; s < layout.num_ranks; ++s) {
    auto* granules =
        reinterpret_cast<uint64_t*>(landing + s * layout.row_stride + layout.flagged_offset);
    for (size_t i = 0; i < (layout.row_stride - layout.flagged_offset) / kGranuleBytes; ++i) {
      std::atomic_ref<uint64_t>(granules[i]).store(Granule(0, tag), std::memory_order_relaxed);
    }
  }
}

}  // namespace

// The sender role's threads: Start(job) runs job(0) .. job(size() - 1), one per thread,
// while the calling thread receives; Join waits for all of them.
class HostEp::Senders {
 public:
  // Throws std::system_error where a thread cannot start (a process or pids limit), once the
  // threads started are stopped and joined (destroyed running, they ended the process).
  explicit Senders(int count) {
    threads_.reserve(count);
    try {
      for (int i = 0; i < count; ++i) threads_.emplace_back([this, i] { Loop(i); });
    } catch (...) {
      Stop();
      throw;
    }
  }
  ~Senders() { Stop(); }

  int size() const { return static_cast<int>(threads_.size()); }

  void Start(std::function<void(int)> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      running_ = size();
      ++generation_;
    }
    cv_.notify_all();
  }

  void Join() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return running_ == 0; });
  }

 private:
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  void Loop(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<void(int)>* job = &job_;
      lock.unlock();
      (*job)(index);  // job_ changes only in Start, after every thread is done with it.
      lock.lock();
      if (--running_ == 0) cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void(int)> job_;
  uint64_t generation_ = 0;
  int running_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // Last: start after the members they use.
};

absl::StatusOr<std::unique_ptr<HostEp>> HostEp::Create(const EpConfig& config, int rank,
                                                       std::vector<std::byte*> arenas) {
  UBEP_RETURN_IF_ERROR(ValidateConfig(config));
  if (rank < 0 || rank >= config.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside [0, ", config.num_ranks, ")"));
  }
  if (static_cast<int>(arenas.size()) != config.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("got ", arenas.size(), " arenas for ",
                                                   config.num_ranks, " ranks"));
  }
  const ArenaHeader expected{kArenaMagic,
                             static_cast<uint32_t>(config.num_ranks),
                             static_cast<uint32_t>(config.max_tokens),
                             static_cast<uint32_t>(config.hidden),
                             static_cast<uint32_t>(config.top_k),
                             static_cast<uint32_t>(config.num_experts),
                             static_cast<uint32_t>(config.slots_per_rank),
                             static_cast<uint32_t>(config.num_layers),
                             static_cast<uint32_t>(config.dtype),
                             static_cast<uint32_t>(config.flagged_tokens),
                             static_cast<uint32_t>(config.protocol),
                             0};
  // The magic word last, read first (sequentially consistent): a peer laying out its arena at
  // the same time is seen either not yet laid out or whole; and of two ranks laying out at
  // once, at least one sees the other's (each stores its own, then looks at the other's).
  auto magic = [](ArenaHeader* h) { return std::atomic_ref<uint32_t>(h->magic); };
  // Every arena laid out so far, this rank's and its peers', is of this configuration (a peer
  // of another, with more tokens or another top-k, would be stored into past its regions) and
  // is the rank's it is given as; this rank's is laid out, if it was not; then the peers are
  // looked at again, for one laid out meanwhile.
  auto check = [&]() -> absl::Status {
    for (int r = 0; r < config.num_ranks; ++r) {
      if (arenas[r] == nullptr) continue;
      auto* header = reinterpret_cast<ArenaHeader*>(arenas[r]);
      if (magic(header).load(std::memory_order_seq_cst) == 0) continue;  // Not laid out yet.
      ArenaHeader of_r = expected;
      of_r.rank = static_cast<uint32_t>(r);
      const uint32_t laid_out_as = header->rank;
      if (std::memcmp(header, &of_r, offsetof(ArenaHeader, rank)) == 0 &&
          laid_out_as != of_r.rank) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rank ", rank, ": the arena given as rank ", r, "'s was laid out as rank ",
            laid_out_as, "'s (arenas in another order?)"));
      }
      if (std::memcmp(header, &of_r, sizeof(of_r)) == 0) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", rank, ": ", r == rank ? std::string("the") : absl::StrCat("rank ", r, "'s"),
          " arena was laid out for another configuration (ranks ", header->num_ranks,
          ", max_tokens ", header->max_tokens, ", hidden ", header->hidden, ", top_k ",
          header->top_k, ", experts ", header->num_experts, ", slots ", header->slots_per_rank,
          ", layers ", header->num_layers, ", dtype ",
          header->dtype == static_cast<uint32_t>(DType::kFloat32)    ? std::string("float32")
          : header->dtype == static_cast<uint32_t>(DType::kBFloat16) ? std::string("bfloat16")
                                                                     : absl::StrCat(header->dtype),
          ", flagged_tokens ", header->flagged_tokens, ", protocol ",
          header->protocol <= static_cast<uint32_t>(Protocol::kUbep)
              ? std::string(ProtocolName(static_cast<Protocol>(header->protocol)))
              : absl::StrCat(header->protocol),
          ")"));
    }
    return absl::OkStatus();
  };
  UBEP_RETURN_IF_ERROR(check());
  auto* own = reinterpret_cast<ArenaHeader*>(arenas[rank]);
  if (magic(own).load(std::memory_order_seq_cst) == 0) {
    ArenaHeader fields = expected;
    fields.magic = 0;
    fields.rank = static_cast<uint32_t>(rank);
    std::memcpy(own, &fields, sizeof(fields));
    magic(own).store(kArenaMagic, std::memory_order_seq_cst);
    UBEP_RETURN_IF_ERROR(check());
  }
  try {
    return std::unique_ptr<HostEp>(new HostEp(config, rank, std::move(arenas)));
  } catch (const std::system_error& e) {
    // Its sender threads could not all start (the ones that did are stopped).
    return absl::ResourceExhaustedError(absl::StrCat(
        "rank ", rank, ": could not start its sender threads (", e.what(),
        "): the process is at its thread limit (ulimit -u, a container's pids limit)"));
  }
}

HostEp::HostEp(const EpConfig& config, int rank, std::vector<std::byte*> arenas)
    : config_(config),
      layout_(config),
      rank_(rank),
      arenas_(std::move(arenas)),
      units_(static_cast<size_t>(config.max_tokens) * std::min(config.top_k, config.num_ranks)),
      batch_end_(kMaxSendBatches),
      dest_records_(config.num_ranks),
      visit_dest_(config.num_ranks),
      visit_position_(config.num_ranks),
      landing_scratch_(layout_.row_bytes),
      capacity_(ReceiveCapacity(config)) {
  const VisitOrder order(rank, config.num_ranks, config.near_ranks);
  for (int position = 0; position < config.num_ranks; ++position) {
    visit_dest_[position] = order.Dest(position);
    visit_position_[visit_dest_[position]] = position;
  }
  // Resume the epochs this arena has seen, so a restarted rank continues its peers' count.
  auto* own = arenas_[rank_];
  auto word = [own](size_t offset) { return LoadAcquire(reinterpret_cast<uint32_t*>(own + offset)); };
  dispatch_epoch_ = ResumedEpoch(word(layout_.dispatch_flag + rank_ * kFlagStride),
                                 word(layout_.dispatch_completed));
  combine_epoch_ = ResumedEpoch(word(layout_.combine_flag + rank_ * kFlagStride),
                                word(layout_.combine_completed));
  barrier_epoch_ = word(layout_.barrier_flag + rank_ * kFlagStride);
  // A process killed in a call left that call's deadline published: this rank is between
  // calls, and peers waiting for it name it at their deadline.
  PublishInCall(own, layout_, std::nullopt);
  // The CPUs this process may use (a container's pinned set), not the machine's.
  const bool spare_cores = UsableCpus() >= 2 * config.num_ranks;
  if (config.protocol == Protocol::kUbep &&
      (config.sender_thread == EpConfig::SenderThread::kOn ||
       (config.sender_thread == EpConfig::SenderThread::kAuto && spare_cores))) {
    senders_ = std::make_unique<Senders>(config.sender_threads);
  }
  const int senders = senders_ != nullptr ? senders_->size() : 1;
  shares_.assign(senders, Share{std::vector<int32_t>(config.num_ranks, 0),
                               std::vector<int32_t>(config.num_ranks, 0),
                               std::vector<int32_t>(units_.size())});
  published_ = std::make_unique<std::atomic<int64_t>[]>(config.num_ranks);
}

HostEp::~HostEp() = default;

namespace {

uint32_t* FlagAt(std::byte* arena, size_t region, int index) {
  return reinterpret_cast<uint32_t*>(arena + region + index * kFlagStride);
}

}  // namespace

absl::Status HostEp::Validate(const DispatchInput& in) const {
  if (in.hidden != config_.hidden) {
    return absl::InvalidArgumentError(absl::StrCat("hidden size ", in.hidden,
                                                   " does not match the configured ",
                                                   config_.hidden));
  }
  if (std::string bad = BadCallMessage(in.num_tokens, in.layer, in.plan, config_.max_tokens,
                                       config_.num_layers, config_.num_experts,
                                       config_.num_ranks, config_.slots_per_rank);
      !bad.empty()) {
    return absl::InvalidArgumentError(std::move(bad));
  }
  if (in.num_tokens > 0 && (in.x == nullptr || in.topk_idx == nullptr ||
                            in.topk_weights == nullptr)) {
    return absl::InvalidArgumentError(kNullDispatchInput);
  }
  for (int t = 0; t < in.num_tokens; ++t) {
    for (int k = 0; k < config_.top_k; ++k) {
      std::string bad = BadPairMessage(in.topk_idx + t * config_.top_k,
                                       in.topk_weights + t * config_.top_k, t, k,
                                       config_.num_experts);
      if (!bad.empty()) return absl::InvalidArgumentError(std::move(bad));
    }
  }
  return absl::OkStatus();
}

void HostEp::CountBatch(const DispatchInput& in, int batch, int num_batches, int senders) {
  const int K = config_.top_k, S = config_.slots_per_rank;
  const int per_batch = BatchTokens(in.num_tokens);
  const int first = batch * per_batch, last = std::min(in.num_tokens, first + per_batch);
  int64_t u = num_units_;
  int32_t pair_dest[kMaxTopK], pair_slot[kMaxTopK];
  int dests[kMaxTopK];
  for (int t = first; t < last; ++t) {
    int num_dests = 0;
    for (int k = 0; k < K; ++k) {
      pair_dest[k] = -1;
      const int32_t e = in.topk_idx[t * K + k];
      if (e < 0) continue;
      const uint32_t p = RouteSlot(in.plan, in.layer, rank_, t, k, e);
      const int d = static_cast<int>(p) / S;
      // A plan routes nothing to a rank it excludes; should one, the pair is dropped (as on
      // the GPU), since that rank's arena may belong to a new process by now.
      if (!active_[d]) continue;
      pair_dest[k] = d;
      pair_slot[k] = static_cast<int32_t>(p % S);
      // De-duplication: one record (and one row on the bus) per (token, destination).
      if (std::find(dests, dests + num_dests, d) == dests + num_dests) dests[num_dests++] = d;
    }
    // The token's units, destinations in visiting order (insertion sort: at most top_k).
    for (int i = 1; i < num_dests; ++i) {
      for (int j = i; j > 0 && visit_position_[dests[j]] < visit_position_[dests[j - 1]]; --j) {
        std::swap(dests[j], dests[j - 1]);
      }
    }
    // Each destination's record (stored into its arena now: the receivers lay out their rows
    // from the records before the rows arrive), then the token's units.
    for (int i = 0; i < num_dests; ++i) {
      const int d = dests[i];
      const int32_t j = dest_records_[d]++;
      std::byte* record = arenas_[d] + layout_.records +
                          (rank_ * static_cast<size_t>(config_.max_tokens) + j) *
                              layout_.record_bytes;
      RecordEntry entries[kMaxTopK];
      int n = 0;
      for (int k = 0; k < K; ++k) {
        if (pair_dest[k] == d) entries[n++] = {pair_slot[k], in.topk_weights[t * K + k]};
      }
      const RecordHeader header{t, n};
      std::memcpy(record, &header, sizeof(header));
      std::memcpy(record + sizeof(header), entries, sizeof(RecordEntry) * n);
      units_[u++] = {d, j, t};
    }
  }
  num_units_ = u;
  batch_end_[batch] = BatchEnd(u, batch + 1 == num_batches, senders);
  // Hand the batch over: a release store (and a wake when the senders are threads).
  if (senders_ != nullptr) {
    Signal(&batches_, batches_ + 1, Doorbell::Own(&batches_, &batch_sleepers_));
  } else {
    ++batches_;
  }
}

void HostEp::FinishCounting(uint32_t epoch, bool publish, bool flagged) {
  // The offsets: every destination's record count, then its count flag (bsp's count exchange;
  // ubep's receivers lay out their rows from it while the rows are on their way).
  for (int d = 0; d < config_.num_ranks; ++d) {
    if (!active_[d]) continue;
    reinterpret_cast<uint64_t*>(arenas_[d] + layout_.call_tags)[rank_] = call_tag_;
    reinterpret_cast<uint32_t*>(arenas_[d] + layout_.counts)[rank_] =
        static_cast<uint32_t>(dest_records_[d]) | (flagged ? kFlaggedCount : 0u);
    Raise(d, layout_.count_flag, epoch);
  }
  if (!publish) return;  // bsp publishes the rows with its barrier.
  for (int d = 0; d < config_.num_ranks; ++d) {
    if (!active_[d]) continue;
    if (dest_records_[d] == 0) {
      Publish(d, epoch);  // A destination this rank sends nothing is complete at once.
      continue;
    }
    // acq_rel: this rank's record total happens before whichever addition completes d.
    if (published_[d].fetch_add(kCountedBias, std::memory_order_acq_rel) == dest_records_[d]) {
      Publish(d, epoch);  // The senders were done with d before counting was.
    }
  }
}

void HostEp::SendShare(int index, int senders, const DispatchInput& in, uint32_t epoch,
                       uint32_t batches_before, bool publish, bool flagged, Deadline deadline) {
  const int R = config_.num_ranks;
  const size_t B = layout_.row_bytes;
  const int T = config_.max_tokens;
  const auto* x = static_cast<const std::byte*>(in.x);
  Share& share = shares_[index];
  const int num_batches = NumBatches(in.num_tokens);
  int64_t batch_begin = 0;
  if (row_delay_for_testing_ > absl::ZeroDuration()) absl::SleepFor(row_delay_for_testing_);
  for (int b = 0; b < num_batches; ++b) {
    // Counting never blocks (the input was validated before it began), so this wait ends
    // within a batch's routing; the deadline only bounds it.
    if (!WaitEpoch(&batches_, batches_before + b + 1, Doorbell::Own(&batches_, &batch_sleepers_),
                   deadline)
             .ok() ||
        abandoned_.load(std::memory_order_seq_cst)) {
      senders_stopped_.store(true, std::memory_order_seq_cst);
      return;
    }
    const int64_t begin = ShareBegin(batch_begin, batch_end_[b], senders, index);
    const int64_t end = ShareBegin(batch_begin, batch_end_[b], senders, index + 1);
    batch_begin = batch_end_[b];
    // A destination's units in this share are consecutive records there (record indices grow
    // with the token), so the share is stored destination by destination, each one's rows in
    // order, which the hardware prefetcher follows: group the units (counting sort).
    for (int64_t u = begin; u < end; ++u) ++share.count[units_[u].dest];
    int32_t at = 0;
    for (int position = 0; position < R; ++position) {
      const int d = visit_dest_[position];
      share.start[d] = at;
      at += share.count[d];
    }
    for (int64_t u = begin; u < end; ++u) {
      share.grouped[share.start[units_[u].dest]++] = static_cast<int32_t>(u);
    }
    at = 0;
    for (int position = 0; position < R; ++position) {
      const int d = visit_dest_[position];
      const int32_t n = share.count[d];
      if (n == 0) continue;
      std::byte* rows = arenas_[d] + layout_.rows + rank_ * layout_.row_stride;
      for (int32_t i = at; i < at + n; ++i) {
        const Unit& unit = units_[share.grouped[i]];
        if (i + 1 < at + n) {
          PrefetchRow(x + units_[share.grouped[i + 1]].token * B, B);
          PrefetchRowForWrite(rows + LandingRowOffset(B, T, flagged, unit.record + 1),
                              flagged ? FlaggedRowBytes(B) : B);
        }
        std::byte* to = rows + LandingRowOffset(B, T, flagged, unit.record);
        if (flagged) {
          StoreFlaggedRow(to, x + unit.token * B, B, epoch);
        } else {
          std::memcpy(to, x + unit.token * B, B);
        }
      }
      at += n;
      share.count[d] = 0;
      if (!publish) continue;  // bsp publishes with its barrier.
      // acq_rel: the stores of every sender that added before, and the counting role's record
      // total once it added kCountedBias, happen before the publication.
      const int64_t total = published_[d].fetch_add(n, std::memory_order_acq_rel) + n;
      if (total >= kCountedBias && total - kCountedBias == dest_records_[d]) Publish(d, epoch);
    }
  }
}

void HostEp::Publish(int d, uint32_t epoch) { Raise(d, layout_.dispatch_flag, epoch); }

absl::Status HostEp::Wait(const uint32_t* word, uint32_t epoch, int peer, const char* what,
                          Deadline deadline, std::optional<uint32_t> call) {
  const absl::Status s = WaitForPeer(
      deadline, [peer] { return peer; },
      [&](AbortWatch watch, Deadline until) {
        return WaitEpoch(word, epoch, OwnDoor(), until, watch);
      });
  return s.ok() ? s : GiveUp(peer, what, call.value_or(epoch));
}

void HostEp::Raise(int d, size_t region, uint32_t epoch) {
  Signal(FlagAt(arenas_[d], region, rank_), epoch, ArenaDoor(arenas_[d], layout_));
}

Doorbell HostEp::OwnDoor() const { return ArenaDoor(arenas_[rank_], layout_); }

uint32_t* HostEp::AbortWord() const {
  return reinterpret_cast<uint32_t*>(arenas_[rank_] + layout_.abort);
}

HostEp::InCall::InCall(std::byte* arena, const ArenaLayout& layout, Deadline deadline)
    : arena_(arena), layout_(layout) {
  PublishInCall(arena_, layout_, PublishedCall{deadline, 0});
}

HostEp::InCall::~InCall() { PublishInCall(arena_, layout_, std::nullopt); }

HostEp::InCall HostEp::EnterCall(Deadline deadline) {
  call_deadline_ = deadline;
  published_call_ = {deadline, 0};
  return InCall(arenas_[rank_], layout_, deadline);
}

absl::Status HostEp::WaitForPeer(Deadline deadline, absl::FunctionRef<int()> peer,
                                 absl::FunctionRef<absl::Status(AbortWatch, Deadline)> wait) {
  const CallPhase phase = PhaseInFlight(dispatch_epoch_, combine_epoch_);
  patience_given_.reset();
  while (true) {
    const absl::Status s = wait(Watch(), deadline);
    if (absl::IsDeadlineExceeded(s)) {
      const int waited_on = peer();
      const std::optional<PublishedCall> later = Patience(waited_on, deadline);
      if (!later.has_value()) return s;
      deadline = later->until;
      patience_given_ = GivenPatience{waited_on, PatienceLimit(later->depth)};
      if (deadline > published_call_.until) {
        // Ranks stuck behind this one wait longer in turn.
        published_call_ = *later;
        PublishInCall(arenas_[rank_], layout_, published_call_);
      }
      continue;
    }
    if (!absl::IsAborted(s)) return s;
    const uint32_t code = LoadAcquire(AbortWord());
    if (!LeftAfter(code, arenas_, layout_, phase.combine, phase.call)) return s;
    spared_ = code;
  }
}

std::optional<PublishedCall> HostEp::Patience(int peer, Deadline deadline) const {
  // With a spared code in the abort word, no rank's give-up can land (RaiseAbort keeps the
  // first code): waiting for one would only delay naming the peer.
  if (peer == rank_ || arenas_[peer] == nullptr || deadline == Deadline::max() || spared_ != 0) {
    return std::nullopt;
  }
  const std::optional<PublishedCall> call = ReadInCall(arenas_[peer], layout_);
  if (!call.has_value()) return std::nullopt;  // Between calls: stuck behind no one.
  const int depth = call->depth + 1;
  if (depth > kMaxWaitDepth) return std::nullopt;
  const auto grace = absl::ToChronoNanoseconds(Grace());
  const Deadline limit = call_deadline_ + absl::ToChronoNanoseconds(PatienceLimit(depth));
  const Deadline later = call->until >= limit - grace ? limit : call->until + grace;
  if (later <= deadline || std::chrono::steady_clock::now() >= later) return std::nullopt;
  return PublishedCall{later, depth};
}

absl::Duration HostEp::Grace() const {
  // Long enough for a rank past its deadline to be scheduled and give up, on a busy host;
  // short enough that a peer killed in a call is named soon after its deadline.
  return std::min(config_.timeout, absl::Seconds(1));
}

absl::Duration HostEp::PatienceLimit(int depth) const {
  // A grace more per depth: the peer's own wait may have gone on to its own limit, and this
  // wait outlasts it by a grace.
  return config_.timeout + (depth - 1) * Grace();
}

absl::Status HostEp::GiveUp(int peer, const char* what, uint32_t epoch) const {
  uint32_t code = LoadAcquire(AbortWord());
  // A spared code (a rank that left after this call) did not end the wait: its deadline did.
  if (code == 0 || code == spared_) {
    // This rank gives up first: tell every rank which peer it gave up on, so that ranks
    // stuck behind a survivor report the dead peer, not the survivor. The first reason
    // raised wins; read back which one that was. Ranks the plan excludes are left alone:
    // their arenas may belong to a new process by now.
    RaiseGiveUp(peer);
    code = LoadAcquire(AbortWord());
  }
  if (code != spared_) UBEP_RETURN_IF_ERROR(DaemonAbortStatus(code, rank_, what, epoch));
  const int given_up_on = RankGivenUpOn(code, peer);
  std::string refusal;
  if (given_up_on >= 0 && given_up_on < config_.num_ranks && arenas_[given_up_on] != nullptr) {
    const CallPhase phase = PhaseInFlight(dispatch_epoch_, combine_epoch_);
    refusal = ReadRefusal(arenas_[given_up_on], layout_, phase);
    // This rank still in the call's dispatch (waiting on another), the rank given up on may
    // have gone on to the call's combine and failed there; this rank in the combine, the one
    // given up on may have failed late in its dispatch (its rows all stored): its reason is
    // as much this call's.
    if (refusal.empty()) {
      refusal = ReadRefusal(arenas_[given_up_on], layout_, CallPhase{!phase.combine, phase.call});
    }
  }
  return TimedOutStatus(code, rank_, peer, config_.timeout, what, epoch, refusal,
                        patience_given_);
}

void HostEp::RaiseGiveUp(int peer) const {
  for (size_t r = 0; r < arenas_.size(); ++r) {
    if (active_[r]) RaiseAbort(arenas_[r], layout_, kAbortTimedOutBase + static_cast<uint32_t>(peer));
  }
}

absl::Status HostEp::SendersStopped(uint32_t epoch) {
  // The rows the senders owed are lost: the call fails, and the peers stop waiting at once,
  // naming this rank with the reason (its refusal record, written before the abort word).
  const std::string why = absl::StrCat(
      "its senders stopped at the call's deadline (", absl::FormatDuration(config_.timeout),
      ") before its calling thread had routed every token (was the process stopped or "
      "starved?); rows to its peers were not all stored");
  GiveUpOnSelf(PhaseInFlight(dispatch_epoch_, combine_epoch_), why);
  return absl::DeadlineExceededError(
      absl::StrCat("rank ", rank_, ": dispatch call ", epoch, ": ", why));
}

void HostEp::GiveUpOnCombine() {
  // Once per call (HostEp's own guard, then its caller's, may both come here).
  if (gave_up_on_combine_ == dispatch_epoch_) return;
  gave_up_on_combine_ = dispatch_epoch_;
  // The phase the peers wait for it in, whether the combine had begun (its epoch taken) or
  // not: the combine of the last dispatch.
  GiveUpOnSelf(CallPhase{true, dispatch_epoch_},
               "it ran out of memory in its combine; its partials were not all stored");
}

void HostEp::AbandonCall(uint32_t batches_before, int num_batches) {
  if (senders_ != nullptr) {
    abandoned_.store(true, std::memory_order_seq_cst);
    // Senders waiting for a batch that will not come are woken past every batch of the call,
    // and stop on seeing abandoned_; those copying finish their batch first.
    Signal(&batches_, batches_before + static_cast<uint32_t>(num_batches),
           Doorbell::Own(&batches_, &batch_sleepers_));
    senders_->Join();
    abandoned_.store(false, std::memory_order_seq_cst);
  }
  // (An exception here is out of memory: every size the call allocates is bounded by the
  // configuration.)
  GiveUpOnSelf(PhaseInFlight(dispatch_epoch_, combine_epoch_),
               "it ran out of memory in its dispatch; its rows were not all stored");
}

void HostEp::GiveUpOnSelf(CallPhase phase, absl::string_view why) {
  // The reason first, then the abort word: the peers stop at once and say why, rather than
  // ask whether this rank is alive.
  RecordRefusal(arenas_[rank_], layout_, phase, why);
  refusal_recorded_ = true;
  RaiseGiveUp(rank_);
}

absl::Status HostEp::Refuse(absl::Status refused, bool keep_earlier) {
  const CallPhase phase = AwaitedPhase(dispatch_epoch_, combine_epoch_);
  if (!keep_earlier || ReadRefusal(arenas_[rank_], layout_, phase).empty()) {
    RecordRefusal(arenas_[rank_], layout_, phase, refused.message());
    refusal_recorded_ = true;
  }
  return refused;
}

void HostEp::TakePart() {
  if (!refusal_recorded_) return;
  WithdrawRefusal(arenas_[rank_], layout_);
  refusal_recorded_ = false;
}

absl::Status HostEp::TakeAsTheyArrive(uint32_t epoch, std::span<const int> sources,
                                      const char* what, Deadline deadline, bool poll,
                                      const std::function<Take(int)>& take) {
  std::vector<int>& pending = pending_;
  pending.assign(sources.begin(), sources.end());
  while (!pending.empty()) {
    // One round: whatever arrived is taken; with nothing new, sleep until a flag rings the
    // bell. The deadline is checked whenever a round finds nothing: a flag that is up while
    // its flagged rows never come (which the protocol rules out) still ends in an error.
    const absl::Status round = WaitForPeer(
        deadline, [&] { return pending.front(); },
        [&](AbortWatch watch, Deadline until) {
          return WaitUntil(
              OwnDoor(), until, watch,
              [&] {
                bool moved = false;
                std::erase_if(pending, [&](int s) {
                  const Take taken = take(s);
                  moved |= taken != Take::kNothing;
                  return taken == Take::kDone;
                });
                return moved || pending.empty();
              },
              poll ? absl::Milliseconds(1) : kMaxSleep,
              std::max<int>(1, kSpins / static_cast<int>(pending.size())));
        });
    if (!round.ok()) return GiveUp(pending.front(), what, epoch);
  }
  return absl::OkStatus();
}

absl::Status HostEp::Barrier(uint32_t call, Deadline deadline) {
  const uint32_t b = ++barrier_epoch_;
  for (int s = 0; s < config_.num_ranks; ++s) {
    if (active_[s]) Raise(s, layout_.barrier_flag, b);
  }
  for (int s = 0; s < config_.num_ranks; ++s) {
    if (!active_[s]) continue;
    UBEP_RETURN_IF_ERROR(
        Wait(FlagAt(arenas_[rank_], layout_.barrier_flag, s), b, s, "barrier", deadline, call));
  }
  return absl::OkStatus();
}

absl::Status HostEp::Dispatch(DispatchInput in, DispatchOutput& out) {
  // A group that gave up (a wait timed out, or its daemon raised the abort word) stays given
  // up until it is re-formed (ResetSignals): the call is refused before it stores a byte into
  // a peer, which may still be taking the rows of the call that failed; and before any other
  // check, so that it says why (after a dispatch that failed, its combine refused, it would
  // otherwise read as a second dispatch) and leaves the refusal it recorded for the peers.
  if (const uint32_t code = LoadAcquire(AbortWord()); code != 0) {
    return DispatchAfterGiveUpStatus(code, rank_, config_.protocol, dispatch_epoch_ + 1);
  }
  if (combine_epoch_ != dispatch_epoch_) {
    // The peers wait for this rank's partials: a refusal of that combine recorded for them
    // (its output's vectors moved out, say) is the reason they are to read, not this one.
    return Refuse(absl::FailedPreconditionError(kDispatchTwice), /*keep_earlier=*/true);
  }
  if (in.plan_area != nullptr) {
    absl::StatusOr<const PlanTableHeader*> checked =
        SelectCheckedPlan(in.plan_area, in.plan_capacity, in.step, checked_plan_);
    if (!checked.ok()) {
      return Refuse(
          absl::DataLossError(absl::StrCat("rank ", rank_, ": ", checked.status().message())));
    }
    in.plan = *checked;
    if (in.plan == nullptr) {
      return Refuse(absl::FailedPreconditionError(
          absl::StrCat("rank ", rank_, ": no committed plan is in force at step ", in.step)));
    }
  }
  if (absl::Status valid = Validate(in); !valid.ok()) return Refuse(std::move(valid));
  const int R = config_.num_ranks;
  active_.resize(R);
  for (int r = 0; r < R; ++r) active_[r] = !RankExcluded(in.plan, static_cast<uint32_t>(r));
  if (!active_[rank_]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank_, " is excluded from the EP group by plan v", in.plan->version));
  }
  TakePart();
  const Deadline deadline = DeadlineAfter(config_.timeout);
  const InCall in_call = EnterCall(deadline);
  const uint32_t epoch = ++dispatch_epoch_;
  dispatch_completed_ = false;
  call_tag_ = CallTag(in.layer, in.step);
  out_of_step_.reset();
  spared_ = 0;
  const bool ubep = config_.protocol == Protocol::kUbep;
  const int senders = senders_ != nullptr ? senders_->size() : 1;
  const int num_batches = NumBatches(in.num_tokens);
  const uint32_t batches_before = batches_;
  const bool flagged = FlaggedRows(ubep, in.num_tokens, config_.flagged_tokens, layout_.row_bytes);
  num_units_ = 0;
  std::fill(dest_records_.begin(), dest_records_.end(), 0);
  for (int d = 0; d < R; ++d) published_[d].store(0, std::memory_order_relaxed);
  // ubep with sender threads: they store each batch as this thread counts the next one.
  auto send_share = [this, &in, epoch, batches_before, ubep, flagged, senders, deadline](int i) {
    SendShare(i, senders, in, epoch, batches_before, /*publish=*/ubep, flagged, deadline);
  };
  senders_stopped_.store(false, std::memory_order_relaxed);
  // An exception from the senders' start to their join (out of memory in the layout, say)
  // must not leave them reading `in` and this call's state after they are gone.
  const AbandonOnThrow abandon_on_throw(this, batches_before, num_batches);
  if (senders_ != nullptr) senders_->Start(send_share);
  if (count_delay_for_testing_ > absl::ZeroDuration()) absl::SleepFor(count_delay_for_testing_);
  for (int b = 0; b < num_batches; ++b) CountBatch(in, b, num_batches, senders);
  if (senders_ != nullptr && senders_stopped_.load(std::memory_order_seq_cst)) {
    senders_->Join();
    return SendersStopped(epoch);  // Before the counts go out: the peers wait for them.
  }
  FinishCounting(epoch, /*publish=*/ubep, flagged);
  std::byte* own = arenas_[rank_];
  std::vector<int>& sources = sources_;
  sources.clear();
  for (int r = 0; r < R; ++r) {
    if (active_[r]) sources.push_back(r);
  }
  if (!ubep) {
    for (int s : sources) {
      UBEP_RETURN_IF_ERROR(
          Wait(FlagAt(own, layout_.count_flag, s), epoch, s, "count exchange", deadline));
    }
    UBEP_RETURN_IF_ERROR(Barrier(epoch, deadline));
    send_share(0);
    UBEP_RETURN_IF_ERROR(Barrier(epoch, deadline));
    UBEP_RETURN_IF_ERROR(LayOut(out));
    for (int s : sources) Place(s, out);
  } else {
    if (senders_ == nullptr) send_share(0);  // No core to spare: send, then receive.
    // The offsets first (every source's records, as its count flag arrives), then each
    // source's rows placed as its data flag arrives, in whatever order the sources finish;
    // flagged rows (flagged_rows.h) one by one as they land, without waiting for the flag.
    absl::Status status =
        TakeAsTheyArrive(epoch, sources, "dispatch counts", deadline, /*poll=*/false, [&](int s) {
          return EpochReached(LoadAcquire(FlagAt(own, layout_.count_flag, s)), epoch)
                     ? Take::kDone
                     : Take::kNothing;
        });
    if (status.ok()) status = LayOut(out);
    if (status.ok()) {
      std::erase_if(sources, [&](int s) { return out.handle.records_from[s] == 0; });
      const bool poll = std::any_of(sources.begin(), sources.end(),
                                    [&](int s) { return out.handle.flagged_from[s] != 0; });
      status = TakeAsTheyArrive(epoch, sources, "dispatch data", deadline, poll, [&](int s) {
        if (out.handle.flagged_from[s]) return PlaceArrived(s, epoch, out);
        if (!EpochReached(LoadAcquire(FlagAt(own, layout_.dispatch_flag, s)), epoch)) {
          return Take::kNothing;
        }
        Place(s, out);
        return Take::kDone;
      });
    }
    if (senders_ != nullptr) senders_->Join();
    // A sender that decided to stop just before the last batch came (its look, then its flag)
    // is seen here, whatever this rank's own waits found.
    if (senders_stopped_.load(std::memory_order_seq_cst)) return SendersStopped(epoch);
    UBEP_RETURN_IF_ERROR(status);
  }
  // Every row of this call is placed, and no peer stores the next call's before this rank's
  // combine: the time to rewrite the landing's tags when they are due (flagged_rows.h).
  if (config_.flagged_tokens > 0 && TagScrubDue(epoch)) {
    ScrubTags(own + layout_.rows, layout_, ScrubTag(epoch));
  }
  out.plan_version = in.plan->version;
  // Each token's (destination, record) pairs, destinations ascending, for the combine: the
  // units are token-major, each token's in visiting order.
  DispatchOutput::Handle& handle = out.handle;
  handle.owner = this;
  handle.epoch = epoch;
  handle.num_tokens = in.num_tokens;
  handle.flagged = flagged;
  handle.active = active_;
  handle.token_begin.assign(in.num_tokens + 1, 0);
  handle.token_routes.resize(num_units_);
  for (int64_t u = 0; u < num_units_; ++u) {
    const Unit& unit = units_[u];
    ++handle.token_begin[unit.token + 1];
    handle.token_routes[u] = {unit.dest, unit.record};
  }
  for (int t = 0; t < in.num_tokens; ++t) {
    handle.token_begin[t + 1] += handle.token_begin[t];
    std::sort(handle.token_routes.begin() + handle.token_begin[t],
              handle.token_routes.begin() + handle.token_begin[t + 1]);
  }
  // The load counters, once every row is in and the call allocates no more (a call whose
  // wait failed, or that ran out of memory, counts nothing; one over the receive capacity
  // counts every pair, which reached the arena; one out of step counts nothing: its pairs
  // are of more than one layer).
  const int S = config_.slots_per_rank;
  if (!out_of_step_.has_value()) {
    received_per_slot_.resize(S);
    for (int i = 0; i < S; ++i) {
      received_per_slot_[i] = out.slot_offsets[i + 1] - out.slot_offsets[i];
    }
    AddLayerLoad(own, layout_, S, in.layer, received_per_slot_.data());
  }
  // The rows this call routed here, to every rank of the group, before this rank's combine
  // stores a byte (arena_layout.h ReceiveNotice).
  const ReceiveNotice notice{epoch, static_cast<uint32_t>(handle.rows_routed),
                             static_cast<uint32_t>(capacity_)};
  for (int r = 0; r < R; ++r) {
    if (active_[r]) PostReceiveNotice(arenas_[r], layout_, rank_, notice);
  }
  MarkCompleted(own, layout_, /*combine=*/false, epoch);
  dispatch_completed_ = true;
  // Out of step, or over the receive capacity: the call is complete (its peers need this
  // rank's partials), and it fails, here and in every rank's combine. Out of step is found by
  // every rank (each takes every source's tag), so every rank fails alike.
  if (out_of_step_.has_value()) {
    return CallsOutOfStepStatus(rank_, epoch, call_tag_, out_of_step_->first,
                                out_of_step_->second, /*combine=*/false);
  }
  if (handle.rows_kept < handle.rows_routed) return OverCapacityStatus(rank_, epoch, notice);
  return absl::OkStatus();
}

absl::Status HostEp::LayOut(DispatchOutput& out) {
  const int R = config_.num_ranks, S = config_.slots_per_rank;
  const size_t T = config_.max_tokens;
  std::byte* own = arenas_[rank_];
  const auto* counts = reinterpret_cast<const uint32_t*>(own + layout_.counts);
  // Counting sort by local slot; within a slot sources in rank order, records and entries in
  // order, so the layout does not depend on the order in which sources arrive.
  DispatchOutput::Handle& handle = out.handle;
  handle.records_from.assign(R, 0);
  handle.flagged_from.assign(R, 0);
  handle.record_begin.resize(R);
  placed_.assign(R, 0);
  out.slot_offsets.assign(S + 1, 0);
  source_slot_rows_.assign(static_cast<size_t>(R) * S, 0);
  entry_slots_.clear();
  record_tokens_.clear();
  record_token_base_.assign(R, 0);
  // What a source wrote is checked before anything is sized or indexed from it: its record
  // count within the tokens it may send (fewer for flagged rows), each record's token within
  // max_tokens (it indexes nothing here; the caller may index by it) and its entries within a
  // token's pairs at one rank, each entry's slot within this rank's.
  // The checks here are the ones CorruptRecordsWhat words (corrupt_records.h), which the CUDA
  // backend's words too.
  const int max_entries = MaxPairsPerToken(config_.top_k, S);
  auto corrupt = [&](int s) {
    RaiseGiveUp(s);
    return CorruptRecordsStatus(
        rank_, s, dispatch_epoch_,
        CorruptRecordsWhat(counts[s], own + layout_.records + s * T * layout_.record_bytes,
                           layout_.record_bytes, config_.max_tokens, config_.flagged_tokens,
                           max_entries, S));
  };
  // Every source's call must be this rank's (CallTag); the lowest that is not is named. Its
  // records are still laid out and placed (their slots are checked as any source's), so that
  // the call completes on every rank and fails alike.
  const auto* tags = reinterpret_cast<const uint64_t*>(own + layout_.call_tags);
  for (int s = 0; s < R && !out_of_step_.has_value(); ++s) {
    if (active_[s] && tags[s] != call_tag_) out_of_step_.emplace(s, tags[s]);
  }
  int32_t entries = 0;
  for (int s = 0; s < R; ++s) {
    // An excluded rank sent nothing (its count word is stale). The word is read once: the
    // count, its format and its bound are of one value.
    const uint32_t word = active_[s] ? counts[s] : 0;
    const uint32_t from_s = RecordCount(word);
    const bool flagged = CountIsFlagged(word);
    if (from_s > MostRecords(word, config_.max_tokens, config_.flagged_tokens)) {
      return corrupt(s);
    }
    handle.flagged_from[s] = flagged;
    const std::byte* records = own + layout_.records + s * T * layout_.record_bytes;
    int32_t* rows = &source_slot_rows_[static_cast<size_t>(s) * S];
    handle.records_from[s] = static_cast<int32_t>(from_s);
    handle.record_begin[s].resize(from_s + 1);
    record_token_base_[s] = record_tokens_.size();
    for (uint32_t j = 0; j < from_s; ++j) {
      const RecordHeader header = RecordHeaderAt(records, layout_.record_bytes, j);
      if (!RecordHeaderInRange(header, config_.max_tokens, max_entries)) return corrupt(s);
      record_tokens_.push_back(header.token);
      handle.record_begin[s][j] = entries;
      entries += header.num_entries;
      for (int q = 0; q < header.num_entries; ++q) {
        const int32_t slot = RecordEntryAt(records, layout_.record_bytes, j, q).local_slot;
        if (slot < 0 || slot >= S) return corrupt(s);
        ++rows[slot];
        entry_slots_.push_back(slot);
      }
    }
    handle.record_begin[s][from_s] = entries;
  }
  // Slot i's rows: source 0's, then source 1's, ...; source_slot_rows_ becomes each source's
  // first row in each slot.
  for (int i = 0; i < S; ++i) {
    int32_t row = out.slot_offsets[i];
    for (int s = 0; s < R; ++s) {
      const int32_t n = source_slot_rows_[static_cast<size_t>(s) * S + i];
      source_slot_rows_[static_cast<size_t>(s) * S + i] = row;
      row += n;
    }
    out.slot_offsets[i + 1] = row;
  }
  const int32_t num_rows = out.slot_offsets[S];
  const int32_t kept = std::min(num_rows, capacity_);
  handle.rows_routed = num_rows;
  handle.rows_kept = kept;
  out.recv_x.resize(static_cast<size_t>(kept) * layout_.row_bytes);
  out.src_rank.resize(kept);
  out.src_token.resize(kept);
  out.weight.resize(kept);
  handle.record_rows.resize(entries);
  if (after_layout_for_testing_) after_layout_for_testing_();
  return absl::OkStatus();
}

void HostEp::PlaceRecord(int s, int32_t j, const std::byte* records, const std::byte* data,
                         DispatchOutput& out) {
  const size_t B = layout_.row_bytes;
  int32_t* cursor = &source_slot_rows_[static_cast<size_t>(s) * config_.slots_per_rank];
  DispatchOutput::Handle& handle = out.handle;
  // The token, the entries and their slots as LayOut checked them; the weights, which index
  // nothing and are not range checked, as they are.
  const int32_t token = record_tokens_[record_token_base_[s] + j];
  const int32_t begin = handle.record_begin[s][j];
  const int num_entries = handle.record_begin[s][j + 1] - begin;
  const int32_t* slots = entry_slots_.data() + begin;
  const int32_t kept = handle.rows_kept;
  for (int q = 0; q < num_entries; ++q) {
    const RecordEntry entry = RecordEntryAt(records, layout_.record_bytes, j, q);
    const int32_t row = cursor[slots[q]]++;
    handle.record_rows[begin + q] = row;
    if (row >= kept) continue;  // Past the receive capacity: dropped (the call fails).
    if (q + 1 < num_entries) {  // The row the next entry's copy lands on.
      const int32_t next = cursor[slots[q + 1]];
      if (next < kept) PrefetchRowForWrite(out.recv_x.data() + static_cast<size_t>(next) * B, B);
    }
    std::byte* to = out.recv_x.data() + static_cast<size_t>(row) * B;
    if (to != data) std::memcpy(to, data, B);
    out.src_rank[row] = s;
    out.src_token[row] = token;
    out.weight[row] = entry.weight;
  }
}

void HostEp::Place(int s, DispatchOutput& out) {
  const size_t T = config_.max_tokens, B = layout_.row_bytes;
  const std::byte* own = arenas_[rank_];
  const std::byte* records = own + layout_.records + s * T * layout_.record_bytes;
  const std::byte* rows = own + layout_.rows + s * layout_.row_stride;
  const int32_t n = out.handle.records_from[s];
  for (int32_t j = 0; j < n; ++j) {
    if (j + 1 < n) PrefetchRow(rows + (j + 1) * B, B);
    PlaceRecord(s, j, records, rows + j * B, out);
  }
}

HostEp::Take HostEp::PlaceArrived(int s, uint32_t tag, DispatchOutput& out) {
  const size_t T = config_.max_tokens, B = layout_.row_bytes;
  const std::byte* own = arenas_[rank_];
  const std::byte* records = own + layout_.records + s * T * layout_.record_bytes;
  const std::byte* rows = own + layout_.rows + s * layout_.row_stride;
  const int32_t* cursor = &source_slot_rows_[static_cast<size_t>(s) * config_.slots_per_rank];
  const int32_t n = out.handle.records_from[s], first = placed_[s];
  int32_t j = first;
  for (; j < n; ++j) {
    // The record's first row (the next one of its first entry's slot) takes the data as it
    // lands; PlaceRecord copies it from there into the record's other rows.
    const int32_t row = cursor[entry_slots_[out.handle.record_begin[s][j]]];
    std::byte* data = row < out.handle.rows_kept
                          ? out.recv_x.data() + static_cast<size_t>(row) * B
                          : landing_scratch_.data();
    if (!LoadFlaggedRow(rows + LandingRowOffset(B, T, true, j), B, tag, data)) break;
    PlaceRecord(s, j, records, data, out);
  }
  placed_[s] = j;
  return j == n ? Take::kDone : j > first ? Take::kSome : Take::kNothing;
}

int HostEp::threads_per_call() const { return 1 + (senders_ != nullptr ? senders_->size() : 0); }

absl::Status HostEp::Combine(const DispatchOutput& dispatched, const void* y_ptr, void* out_ptr) {
  if (combine_epoch_ + 1 != dispatch_epoch_) {
    return Refuse(absl::FailedPreconditionError("combine without a dispatch before it"),
                  /*keep_earlier=*/true);
  }
  if (!dispatch_completed_) {
    // Its output may be half laid out: nothing of it is read, and nothing is stored.
    return CombineAfterFailedDispatchStatus(rank_, dispatch_epoch_);
  }
  const int R = config_.num_ranks, H = config_.hidden;
  const DispatchOutput::Handle& handle = dispatched.handle;
  if (handle.owner != this || handle.epoch != dispatch_epoch_) {
    // Another call's output (an earlier one kept by the caller), or another rank's: its
    // records and rows are not this call's.
    return Refuse(absl::InvalidArgumentError(absl::StrCat(
        "combine: the dispatch output is not of this rank's last dispatch (call ",
        dispatch_epoch_, ")")));
  }
  if (static_cast<int>(handle.record_begin.size()) != R ||
      static_cast<int>(handle.records_from.size()) != R ||
      static_cast<int>(handle.token_begin.size()) != handle.num_tokens + 1 ||
      static_cast<int>(handle.active.size()) != R ||
      static_cast<int>(handle.flagged_from.size()) != R) {
    return Refuse(
        absl::InvalidArgumentError("combine: the dispatch output is not from this group"));
  }
  // The vectors Combine reads (weight) or sizes `y` by (src_rank), as Dispatch made them: one
  // moved out to the expert kernel, or resized, is refused, not read past its end.
  if (static_cast<int32_t>(dispatched.weight.size()) != handle.rows_kept ||
      static_cast<int32_t>(dispatched.src_rank.size()) != handle.rows_kept) {
    return Refuse(absl::InvalidArgumentError(absl::StrCat(
        "combine: the dispatch output has ", dispatched.weight.size(), " weights and ",
        dispatched.src_rank.size(), " source ranks, not the ", handle.rows_kept,
        " rows its dispatch made (were they moved out or resized?)")));
  }
  if ((y_ptr == nullptr && dispatched.num_rows() > 0) ||
      (out_ptr == nullptr && handle.num_tokens > 0)) {
    return Refuse(absl::InvalidArgumentError(kNullCombineBuffers));
  }
  active_ = handle.active;
  TakePart();
  const Deadline deadline = DeadlineAfter(config_.timeout);
  const InCall in_call = EnterCall(deadline);
  const uint32_t epoch = ++combine_epoch_;
  // Its allocations (the sums' scratch, a wait's bookkeeping) may throw from here on.
  const GiveUpOnThrow give_up_on_throw(this);
  spared_ = 0;
  const auto* y = static_cast<const std::byte*>(y_ptr);
  const bool delay = partial_delay_for_testing_ > absl::ZeroDuration();
  if (delay && partial_delay_source_ < 0) absl::SleepFor(partial_delay_for_testing_);
  scratch_.resize(H);
  float* sum = scratch_.data();
  const size_t B = layout_.row_bytes;
  row_scratch_.resize(B);
  // Expert side: one partial per (source, record), summed in fp32 over the record's rows in
  // k order and stored once, in the activation dtype, into the source's arena.
  for (int i = 1; i <= R; ++i) {
    const int s = (rank_ + i) % R;
    if (!active_[s]) continue;
    if (delay && s == partial_delay_source_) absl::SleepFor(partial_delay_for_testing_);
    if (partial_gate_for_testing_ && s == partial_delay_source_) partial_gate_for_testing_();
    std::byte* partials = arenas_[s] + layout_.partials + rank_ * layout_.row_stride;
    const bool flagged = handle.flagged_from[s];  // s gets its partials as it sent its rows.
    const std::vector<int32_t>& begin = handle.record_begin[s];
    const int32_t end = begin[handle.records_from[s]];
    const int32_t kept = handle.rows_kept;
    for (int32_t j = 0; j < handle.records_from[s]; ++j) {
      for (int32_t q = begin[j]; q < begin[j + 1]; ++q) {
        const int32_t row = handle.record_rows[q];
        if (q + 1 < end && handle.record_rows[q + 1] < kept) {
          PrefetchRow(y + static_cast<size_t>(handle.record_rows[q + 1]) * layout_.row_bytes,
                      layout_.row_bytes);
        }
        if (row >= kept) {  // Past the receive capacity (the call fails): a zero term, added
          // as the CUDA backend adds it (+0, which turns a -0 sum into +0).
          if (q == begin[j]) {
            std::fill(sum, sum + H, 0.0f);
          } else {
            for (int h = 0; h < H; ++h) sum[h] += 0.0f;
          }
          continue;
        }
        Axpy(dispatched.weight[row], y + static_cast<size_t>(row) * layout_.row_bytes,
             config_.dtype, H, q == begin[j], sum);
      }
      std::byte* to = partials + LandingRowOffset(B, config_.max_tokens, flagged, j);
      if (flagged) {
        StoreRow(sum, H, config_.dtype, row_scratch_.data());
        StoreFlaggedRow(to, row_scratch_.data(), B, epoch);
      } else {
        StoreRow(sum, H, config_.dtype, to);
      }
    }
    if (config_.protocol == Protocol::kUbep) {
      Raise(s, layout_.combine_flag, epoch);
    }
  }
  std::byte* own = arenas_[rank_];
  if (config_.protocol == Protocol::kBsp) {
    UBEP_RETURN_IF_ERROR(Barrier(epoch, deadline));
  } else {
    // Every destination's flag: its partials are all stored, and it is done reading this
    // rank's landing of this call, so this rank may store its next call's there. Flagged
    // partials are taken one by one as they land (and their arrival says the same), so a
    // flagged call waits only for the flags of destinations it sent nothing to.
    sent_to_.assign(R, 0);
    if (handle.flagged) {
      for (const auto& [d, j] : handle.token_routes) sent_to_[d] = 1;
    }
    sources_.clear();
    for (int d = 0; d < R; ++d) {
      if (active_[d] && !sent_to_[d]) sources_.push_back(d);
    }
    UBEP_RETURN_IF_ERROR(
        TakeAsTheyArrive(epoch, sources_, "combine partials", deadline, /*poll=*/false, [&](int d) {
          return EpochReached(LoadAcquire(FlagAt(own, layout_.combine_flag, d)), epoch)
                     ? Take::kDone
                     : Take::kNothing;
        }));
  }
  // Token side: out[t] = sum of its partials, destinations in rank order (the same order for
  // every protocol, so results are identical bit for bit).
  const std::byte* partials = own + layout_.partials;
  const size_t landed = handle.flagged ? FlaggedRowBytes(B) : B;
  auto partial_at = [&](int d, int32_t j) {
    return partials + d * layout_.row_stride +
           LandingRowOffset(B, config_.max_tokens, handle.flagged, j);
  };
  auto* out = static_cast<std::byte*>(out_ptr);
  const int32_t routes = handle.token_begin[handle.num_tokens];
  for (int t = 0; t < handle.num_tokens; ++t) {
    if (handle.token_begin[t] == handle.token_begin[t + 1]) std::fill(sum, sum + H, 0.0f);
    for (int32_t q = handle.token_begin[t]; q < handle.token_begin[t + 1]; ++q) {
      const auto [d, j] = handle.token_routes[q];
      if (q + 1 < routes) {
        const auto [next_d, next_j] = handle.token_routes[q + 1];
        PrefetchRow(partial_at(next_d, next_j), landed);
      }
      const std::byte* partial = partial_at(d, j);
      if (handle.flagged) {
        // Late, the lowest destination whose partial of this call has not landed is named
        // (as every other wait names the lowest source still awaited), not this route's.
        auto lowest_awaited = [&, q = q] {
          int lowest = d;
          std::vector<std::byte> probe(B);
          for (int32_t r = q + 1; r < routes; ++r) {
            const auto [other, k] = handle.token_routes[r];
            if (other < lowest &&
                !LoadFlaggedRow(partial_at(other, k), B, epoch, probe.data())) {
              lowest = other;
            }
          }
          return lowest;
        };
        UBEP_RETURN_IF_ERROR(TakeFlaggedPartial(partial, lowest_awaited, epoch, deadline));
        partial = row_scratch_.data();
      }
      Axpy(1.0f, partial, config_.dtype, H, q == handle.token_begin[t], sum);
    }
    StoreRow(sum, H, config_.dtype, out + static_cast<size_t>(t) * layout_.row_bytes);
  }
  // Every partial of this call is summed, and no peer stores the next call's before this
  // rank's next dispatch: the time to rewrite the tags when they are due (flagged_rows.h).
  if (config_.flagged_tokens > 0 && TagScrubDue(epoch)) {
    ScrubTags(own + layout_.partials, layout_, ScrubTag(epoch));
  }
  MarkCompleted(own, layout_, /*combine=*/true, epoch);
  if (out_of_step_.has_value()) {
    return CallsOutOfStepStatus(rank_, epoch, call_tag_, out_of_step_->first,
                                out_of_step_->second, /*combine=*/true);
  }
  // A rank that overflowed its receive capacity in this call (its notice precedes its
  // partials, flag or barrier, which this rank has all taken): the call fails on every rank
  // (arena_layout.h ReceiveNotice), naming the lowest such rank.
  for (int d = 0; d < R; ++d) {
    if (!active_[d]) continue;
    if (const ReceiveNotice notice = ReadReceiveNotice(own, layout_, d);
        notice.OverflowedIn(epoch)) {
      return PeerOverCapacityStatus(rank_, epoch, d, notice);
    }
  }
  return absl::OkStatus();
}

absl::Status HostEp::TakeFlaggedPartial(const std::byte* partial, absl::FunctionRef<int()> peer,
                                        uint32_t epoch, Deadline deadline) {
  // Granules ring no bell as they land: a millisecond's sleep at most between looks (the
  // peer's combine flag, raised once every partial it sends here is stored, rings it).
  // The peer named is the one the last deadline was judged on (a partial landing after it
  // does not change whom the error names).
  int judged = -1;
  const absl::Status s = WaitForPeer(
      deadline, [&] { return judged = peer(); },
      [&](AbortWatch watch, Deadline until) {
        return WaitUntil(
            OwnDoor(), until, watch,
            [&] { return LoadFlaggedRow(partial, layout_.row_bytes, epoch, row_scratch_.data()); },
            absl::Milliseconds(1));
      });
  return s.ok() ? s : GiveUp(judged >= 0 ? judged : peer(), "combine partials", epoch);
}

uint64_t HostEp::LoadCounter(int layer, int local_slot) const {
  const auto* counters =
      reinterpret_cast<const uint64_t*>(arenas_[rank_] + layout_.load_counters);
  return std::atomic_ref<const uint64_t>(counters[layer * config_.slots_per_rank + local_slot])
      .load(std::memory_order_relaxed);
}

}  // namespace ubep::kernels
