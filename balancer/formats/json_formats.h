// JSON formats that meet other tools (docs/formats.md):
// - load: SGLang's expert-distribution file {"logical_count": [[...] x layers]}; rows summing
//   to zero are dense layers and are skipped (their model layer index is kept in layer_ids);
// - plan: EPLB's arrays (phy2log, log2phy padded with -1, logcnt) plus shares aligned with
//   log2phy, version, layer_ids, the topology and excluded_ranks (when there are some).
// Every error is InvalidArgument (NotFound for a missing file) with one line naming the file,
// the field and the problem. Thread-compatible.
#ifndef UBEP_BALANCER_FORMATS_JSON_FORMATS_H_
#define UBEP_BALANCER_FORMATS_JSON_FORMATS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "balancer/core/load_matrix.h"
#include "balancer/core/plan.h"

namespace ubep::balancer {

absl::StatusOr<LoadMatrix> ParseSglangLoad(const std::string& text, const std::string& name);
absl::StatusOr<LoadMatrix> ReadSglangLoadFile(const std::string& path);

std::string SglangLoadToJson(const LoadMatrix& load);

// `topology_override` fills in the topology of a plan file that has none (a plain EPLB
// output) and must agree with one that has, in every field it gives: its nodes, groups and
// slots_per_rank may be 0, meaning "the file's" (without a topology in the file: 1 node,
// 1 group, slots per rank from phy2log's width). Memory taken is in proportion to the text.
absl::StatusOr<Plan> ParsePlanJson(const std::string& text, const std::string& name,
                                   const std::optional<Topology>& topology_override = {});
absl::StatusOr<Plan> ReadPlanFile(const std::string& path,
                                  const std::optional<Topology>& topology_override = {});

std::string PlanToJson(const Plan& plan);
// SGLang's expert location (--init-expert-location): {"physical_to_logical_map": one row per
// model layer, 0 to the last of plan.layer_ids, as SGLang indexes it by model layer}. The
// plan's layers give their rows; a model layer the plan has none for (a dense layer) gets
// slot p -> expert p % num_experts, as SGLang's own trivial placement.
std::string PlanToSglangJson(const Plan& plan);

// A regular file's text, of kMaxTextFileBytes at most (a directory, a FIFO or a device is
// refused, naming what it is; a file over the limit too, rather than read until memory ends).
inline constexpr uint64_t kMaxTextFileBytes = uint64_t{1} << 30;
absl::StatusOr<std::string> ReadTextFile(const std::string& path);
// What a daemon checks of its plan file at start, before a group says its shape: a JSON
// object (well formed, no key given twice) with EPLB's phy2log; read whole (ReadPlanFile)
// when it carries its own topology.
absl::Status CheckPlanFile(const std::string& path);
// Writes `text` to `path` whole or not at all: to a temporary file of this call's own beside
// it, flushed to the disk, then renamed over it. InvalidArgument when `path` is a directory.
absl::Status WriteTextFile(const std::string& path, const std::string& text);

// A server's --ready_file: a JSON line with its pid and bound ports, written once it serves,
// for the scripts and tests that start it and wait for the file; removed when it stops, so
// that whoever waits for the next run's does not read this one's ports.
class ReadyFile {
 public:
  ReadyFile() = default;  // None: every call does nothing.
  explicit ReadyFile(std::string path) : path_(std::move(path)) {}
  ReadyFile(const ReadyFile&) = delete;
  ReadyFile& operator=(const ReadyFile&) = delete;
  ~ReadyFile() { Withdraw(); }

  // Who may hold the path: this run alone (ubepd, which holds its socket's lock), or whichever
  // running process the file names (the balancer, which holds no lock).
  enum class Holder { kThisRun, kWhoeverItNames };
  // Removes the file a run before this one left there (one killed or crashed, which removed
  // nothing), before this run starts: a script would otherwise take its ports for this run's.
  // Only a regular file is removed; anything else at the path is refused, naming what it is.
  // kWhoeverItNames: a file whose "pid" names a running process (not this one) is left, and
  // refused, naming it. Then a file is made and removed beside the path: one that cannot be
  // written is said here, before the server serves (a client attached, a balancer told of
  // this run), not once it does.
  absl::Status ClearStale(Holder holder) const;
  // Writes `text` (whole, by rename); Withdraw and the destructor remove it.
  absl::Status Publish(const std::string& text);
  // Removes the file this object published, if it is still the one there (none published, or
  // another process's written there since: nothing is removed).
  void Withdraw();

 private:
  absl::Status CheckWritable() const;

  std::string path_;
  std::optional<std::pair<dev_t, ino_t>> published_;  // The file written, by device and inode.
};

}  // namespace ubep::balancer

#endif  // UBEP_BALANCER_FORMATS_JSON_FORMATS_H_
