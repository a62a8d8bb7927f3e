#include "balancer/formats/json_formats.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <span>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace ubep::balancer {
namespace {

// What a file that is not a regular one is, for the messages that refuse it.
const char* NotRegularKind(mode_t mode) {
  return S_ISDIR(mode) ? "a directory" : S_ISLNK(mode) ? "a symbolic link" : "a device, FIFO or socket";
}

using Json = nlohmann::json;


// A file that cannot be made at `path` (errno `error`), as the writers and ReadyFile say it.
absl::Status CannotWrite(const std::string& path, int error) {
  return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write: ", std::strerror(error)));
}

absl::Status Bad(const std::string& name, const std::string& field, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", field, ": ", problem));
}

// One pass over a document's events: where it is malformed, and the first key given twice in
// one object (the parse keeps the last, and drops the first without a word: a plan's phy2log
// or a load's rows).
struct SaxCheck : nlohmann::json_sax<Json> {
  std::string error;     // "byte N: ..." where the document is malformed; empty if it is not.
  std::string repeated;  // The first key given twice in one object; empty if none.
  std::vector<std::set<std::string>> objects;  // The keys of each open object.
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    objects.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    if (!objects.back().insert(key).second && repeated.empty()) repeated = key;
    return true;
  }
  bool end_object() override {
    objects.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    error = absl::StrCat("byte ", position, ": ", ex.what());
    return false;
  }
};

absl::StatusOr<Json> ParseJson(const std::string& text, const std::string& name) {
  Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  SaxCheck check;
  Json::sax_parse(text, &check, Json::input_format_t::json, /*strict=*/true);
  if (json.is_discarded()) {
    return Bad(name, "(document)", absl::StrCat("malformed JSON at ", check.error));
  }
  if (!check.repeated.empty()) {
    return Bad(name, check.repeated, "given twice in one object (which one is meant?)");
  }
  return json;
}

// A value as an error shows it: a scalar as written, an array or an object by its kind alone
// (it may be large, or nested deeper than a recursive dump's stack allows).
std::string Shown(const Json& v) {
  return v.is_structured() ? absl::StrCat("an ", v.type_name()) : v.dump();
}

// Reads a finite, non-negative number.
absl::StatusOr<double> NonNegative(const Json& v, const std::string& name,
                                   const std::string& field) {
  if (!v.is_number()) return Bad(name, field, absl::StrCat("expected a number, got ", Shown(v)));
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < 0) {
    return Bad(name, field, absl::StrCat("is ", v.dump(), "; must be finite and non-negative"));
  }
  return d;
}

absl::StatusOr<int> Integer(const Json& v, const std::string& name, const std::string& field,
                            int64_t min, int64_t max) {
  if (!v.is_number_integer()) {
    return Bad(name, field, absl::StrCat("expected an integer, got ", Shown(v)));
  }
  // An unsigned one past 2^63 - 1 would read back negative (-1 for 2^64 - 1, which is
  // padding in some fields): refused as written.
  if (v.is_number_unsigned() &&
      v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Bad(name, field, absl::StrCat("is ", v.dump(), ", outside [", min, ", ", max, "]"));
  }
  const int64_t i = v.get<int64_t>();
  if (i < min || i > max) {
    return Bad(name, field, absl::StrCat("is ", i, ", outside [", min, ", ", max, "]"));
  }
  return static_cast<int>(i);
}

// A rectangular [rows][cols] array of integers in [min, max]; cols = -1 takes the first row's.
absl::StatusOr<std::vector<std::vector<int>>> IntMatrix(const Json& v, const std::string& name,
                                                        const std::string& field, int rows,
                                                        int cols, int64_t min, int64_t max) {
  if (!v.is_array()) return Bad(name, field, "expected an array of arrays");
  if (rows >= 0 && static_cast<int>(v.size()) != rows) {
    return Bad(name, field, absl::StrCat("has ", v.size(), " rows, expected ", rows));
  }
  std::vector<std::vector<int>> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string row_field = absl::StrCat(field, "[", i, "]");
    if (!v[i].is_array()) return Bad(name, row_field, "expected an array");
    if (cols < 0) cols = static_cast<int>(v[i].size());
    if (static_cast<int>(v[i].size()) != cols) {
      return Bad(name, row_field, absl::StrCat("has ", v[i].size(), " entries, expected ", cols));
    }
    std::vector<int> row;
    for (size_t j = 0; j < v[i].size(); ++j) {
      UBEP_ASSIGN_OR_RETURN(int x, Integer(v[i][j], name, absl::StrCat(row_field, "[", j, "]"),
                                           min, max));
      row.push_back(x);
    }
    out.push_back(std::move(row));
  }
  return out;
}

absl::StatusOr<Topology> ParseTopology(const Json& v, const std::string& name) {
  if (!v.is_object()) return Bad(name, "topology", "expected an object");
  Topology t;
  const std::pair<const char*, int*> fields[] = {{"ranks", &t.num_ranks},
                                                 {"nodes", &t.num_nodes},
                                                 {"slots_per_rank", &t.slots_per_rank},
                                                 {"groups", &t.num_groups}};
  for (const auto& [key, out] : fields) {
    if (!v.contains(key)) {
      if (std::string(key) == "groups") continue;
      return Bad(name, absl::StrCat("topology.", key), "missing");
    }
    UBEP_ASSIGN_OR_RETURN(*out, Integer(v[key], name, absl::StrCat("topology.", key), 1,
                                        kMaxPlanIndex));
  }
  return t;
}

// A topology from the command line (or another caller) must agree with the file's in every
// field it gives: ranks always; nodes, slots per rank and groups unless 0.
absl::Status CheckAgrees(const Topology& file, const Topology& given, const std::string& name) {
  const std::tuple<const char*, int, int, bool> fields[] = {
      {"ranks", file.num_ranks, given.num_ranks, true},
      {"nodes", file.num_nodes, given.num_nodes, given.num_nodes != 0},
      {"slots_per_rank", file.slots_per_rank, given.slots_per_rank, given.slots_per_rank != 0},
      {"groups", file.num_groups, given.num_groups, given.num_groups != 0}};
  for (const auto& [key, in_file, in_given, compared] : fields) {
    if (compared && in_file != in_given) {
      return Bad(name, absl::StrCat("topology.", key),
                 absl::StrCat("is ", in_file, ", but ", in_given, " is expected"));
    }
  }
  return absl::OkStatus();
}

// Where each expert's replicas sit in one layer, in slot order: O(experts + slots), where
// EPLB's padded arrays take experts x the largest replica count.
struct ReplicaIndex {
  std::vector<int> begin;  // [num_experts + 1]: expert e's slots are slots[begin[e], begin[e+1]).
  std::vector<int> slots;  // [num_slots]

  int count(int e) const { return begin[e + 1] - begin[e]; }
  std::span<const int> of(int e) const {
    return std::span<const int>(slots).subspan(begin[e], count(e));
  }
};

// `slot_expert` holds experts in [0, num_experts).
ReplicaIndex IndexReplicas(const std::vector<int>& slot_expert, int num_experts) {
  ReplicaIndex index;
  index.begin.assign(num_experts + 1, 0);
  for (int e : slot_expert) ++index.begin[e + 1];
  for (int e = 0; e < num_experts; ++e) index.begin[e + 1] += index.begin[e];
  index.slots.resize(slot_expert.size());
  std::vector<int> next(index.begin.begin(), index.begin.end() - 1);
  for (size_t p = 0; p < slot_expert.size(); ++p) {
    index.slots[next[slot_expert[p]]++] = static_cast<int>(p);
  }
  return index;
}

}  // namespace

absl::Status CheckPlanFile(const std::string& path) {
  UBEP_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(path));
  UBEP_ASSIGN_OR_RETURN(const Json json, ParseJson(text, path));
  if (!json.is_object() || !json.contains("phy2log")) {
    return Bad(path, "phy2log", "missing: not a plan (EPLB's arrays, docs/formats.md)");
  }
  // With its own topology it is read whole now; without, it takes the group's when one forms.
  if (json.contains("topology")) return ParsePlanJson(text, path).status();
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  // Non-blocking open: a FIFO named by mistake is refused below rather than waited on.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    std::string message = absl::StrCat(path, ": cannot read: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(message) : absl::InvalidArgumentError(message);
  }
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not a regular file (", NotRegularKind(st.st_mode), ")"));
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxTextFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", st.st_size, " bytes, over the ",
                                                   kMaxTextFileBytes, " a file read here may be"));
  }
  // To the end, whatever the size said (a file still growing, or one of /proc's, which says
  // 0), within the limit.
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
    }
    if (n == 0) break;
    if (text.size() + static_cast<size_t>(n) > kMaxTextFileBytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": over the ", kMaxTextFileBytes,
                                                     " bytes a file read here may be"));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  return text;
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": is a directory, not a file"));
  }
  // A temporary name of this writer's own beside the file (two writers of one path each
  // write whole, and the last rename wins; a file the user named PATH.tmp is not touched),
  // created as the file would be (0666 less the umask). One a killed writer left (a process
  // restarted in a container has its pid again) is passed over for the next name.
  static std::atomic<uint64_t> serial{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = absl::StrCat(path, ".tmp.", getpid(), ".", absl::ToUnixNanos(absl::Now()), ".",
                       serial.fetch_add(1, std::memory_order_relaxed));
    fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    return CannotWrite(path, errno);
  }
  auto fail = [&](const char* what) {
    const int error = errno;
    close(fd);
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": ", what, ": ", std::strerror(error)));
  };
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write failed");
    done += static_cast<size_t>(n);
  }
  // On the disk before it takes the name: after a crash the file is the old one or the new
  // one, not an empty one.
  if (fsync(fd) != 0) return fail("write failed");
  if (close(fd) != 0) {
    const int error = errno;
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": write failed: ", std::strerror(error)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": rename failed: ", std::strerror(error)));
  }
  return absl::OkStatus();
}

absl::Status ReadyFile::ClearStale(Holder holder) const {
  if (path_.empty()) return absl::OkStatus();
  struct stat st {};
  if (lstat(path_.c_str(), &st) != 0) {
    if (errno == ENOENT) return CheckWritable();
    return absl::ErrnoToStatus(errno, absl::StrCat(path_, ": cannot look at it"));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path_, " exists and is not a regular file (", NotRegularKind(st.st_mode),
        "); not replacing it: is the ready file's path right?"));
  }
  if (holder == Holder::kWhoeverItNames) {
    // Left to the process it names while that runs (another server given the same path); a
    // file that names none, or one that has exited, is stale.
    const absl::StatusOr<std::string> text = ReadTextFile(path_);
    const Json json = text.ok() ? Json::parse(*text, nullptr, /*allow_exceptions=*/false) : Json();
    const auto pid = json.is_object() && json.contains("pid") && json["pid"].is_number_integer()
                         ? json["pid"].get<int64_t>()
                         : int64_t{0};
    if (pid > 0 && pid != getpid() && pid <= std::numeric_limits<pid_t>::max() &&
        (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) {
      return absl::FailedPreconditionError(absl::StrCat(
          path_, " is the ready file of process ", pid, ", which is running: is another server "
          "using this path?"));
    }
  }
  if (unlink(path_.c_str()) != 0 && errno != ENOENT) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path_, ": cannot remove the last run's"));
  }
  return CheckWritable();
}

absl::Status ReadyFile::CheckWritable() const {
  // A file of this run's own name beside it, made and removed, as Publish makes its own.
  const std::string probe = absl::StrCat(path_, ".tmp.", getpid(), ".probe");
  const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 && errno != EEXIST) {
    return CannotWrite(path_, errno);
  }
  if (fd >= 0) {
    close(fd);
    unlink(probe.c_str());
  }
  return absl::OkStatus();
}

absl::Status ReadyFile::Publish(const std::string& text) {
  if (path_.empty()) return absl::OkStatus();
  UBEP_RETURN_IF_ERROR(WriteTextFile(path_, text));
  struct stat st {};
  if (lstat(path_.c_str(), &st) == 0) {
    published_ = {st.st_dev, st.st_ino};
  }
  return absl::OkStatus();
}

void ReadyFile::Withdraw() {
  if (!published_.has_value()) return;
  // Only the file this object wrote: one another process has written there since is its own.
  struct stat st {};
  if (lstat(path_.c_str(), &st) == 0 && st.st_dev == published_->first &&
      st.st_ino == published_->second) {
    unlink(path_.c_str());
  }
  published_.reset();
}

absl::StatusOr<LoadMatrix> ParseSglangLoad(const std::string& text, const std::string& name) {
  UBEP_ASSIGN_OR_RETURN(Json json, ParseJson(text, name));
  if (!json.is_object() || !json.contains("logical_count")) {
    return Bad(name, "logical_count", "missing; expected {\"logical_count\": [[...], ...]}");
  }
  const Json* given = &json["logical_count"];
  if (!given->is_array() || given->empty()) {
    return Bad(name, "logical_count", "expected a non-empty array of per-layer arrays");
  }
  // [dumps][layers][experts], as SGLang's loader also takes (a recorder's dumps one after the
  // other): summed over the dumps, as that loader does.
  Json summed;
  if ((*given)[0].is_array() && !(*given)[0].empty() && (*given)[0][0].is_array()) {
    const Json& first = (*given)[0];
    summed = Json::array();
    for (size_t l = 0; l < first.size(); ++l) {
      if (!first[l].is_array()) {
        return Bad(name, absl::StrCat("logical_count[0][", l, "]"), "expected an array");
      }
      summed.push_back(Json::array());
      for (size_t e = 0; e < first[l].size(); ++e) summed[l].push_back(0.0);
    }
    for (size_t d = 0; d < given->size(); ++d) {
      const Json& dump = (*given)[d];
      const std::string dump_field = absl::StrCat("logical_count[", d, "]");
      if (!dump.is_array() || dump.size() != first.size()) {
        return Bad(name, dump_field, absl::StrCat("expected ", first.size(), " per-layer arrays, as logical_count[0]"));
      }
      for (size_t l = 0; l < dump.size(); ++l) {
        const std::string layer_field = absl::StrCat(dump_field, "[", l, "]");
        if (!dump[l].is_array() || dump[l].size() != first[l].size()) {
          return Bad(name, layer_field, absl::StrCat("expected ", first[l].size(), " counts, as logical_count[0][", l, "]"));
        }
        for (size_t e = 0; e < dump[l].size(); ++e) {
          UBEP_ASSIGN_OR_RETURN(double v, NonNegative(dump[l][e], name, absl::StrCat(layer_field, "[", e, "]")));
          const double sum = summed[l][e].get<double>() + v;
          if (!std::isfinite(sum)) {  // Finite counts may still overflow: 1e308 + 1e308.
            return Bad(name, absl::StrCat("logical_count[0..", d, "][", l, "][", e, "]"),
                       "sums to inf over the dumps; the counts must have a finite sum");
          }
          summed[l][e] = sum;
        }
      }
    }
    given = &summed;
  }
  const Json& rows = *given;
  if (rows.size() > static_cast<size_t>(kMaxPlanIndex) + 1) {
    // A row's index is its layer's id in the plans made from it.
    return Bad(name, "logical_count",
               absl::StrCat("has ", rows.size(), " layers; a plan's layer ids go up to 2^20 (",
                            kMaxPlanIndex, ")"));
  }
  std::vector<std::vector<double>> values;
  std::vector<int> layer_ids;
  size_t num_experts = 0;
  for (size_t l = 0; l < rows.size(); ++l) {
    const std::string field = absl::StrCat("logical_count[", l, "]");
    if (!rows[l].is_array() || rows[l].empty()) {
      return Bad(name, field, "expected a non-empty array of per-expert counts");
    }
    if (l == 0) {
      num_experts = rows[l].size();
      if (num_experts > static_cast<size_t>(kMaxPlanIndex)) {
        return Bad(name, field,
                   absl::StrCat("has ", num_experts, " experts, more than the 2^20 (",
                                kMaxPlanIndex, ") a plan holds"));
      }
    }
    if (rows[l].size() != num_experts) {
      return Bad(name, field,
                 absl::StrCat("has ", rows[l].size(), " experts, logical_count[0] has ",
                              num_experts, " (ragged rows)"));
    }
    std::vector<double> row;
    double sum = 0;
    for (size_t e = 0; e < num_experts; ++e) {
      UBEP_ASSIGN_OR_RETURN(double v,
                            NonNegative(rows[l][e], name, absl::StrCat(field, "[", e, "]")));
      row.push_back(v);
      sum += v;
    }
    if (!std::isfinite(sum)) {  // Finite counts may still overflow: 1e308 + 1e308.
      return Bad(name, field, "sums to inf; a layer's counts must have a finite sum");
    }
    if (sum == 0) continue;  // A dense layer.
    values.push_back(std::move(row));
    layer_ids.push_back(static_cast<int>(l));
  }
  if (values.empty()) {
    return Bad(name, "logical_count", "every layer sums to zero; no MoE layer to plan");
  }
  LoadMatrix load(static_cast<int>(values.size()), static_cast<int>(num_experts));
  for (int l = 0; l < load.num_layers(); ++l) {
    std::copy(values[l].begin(), values[l].end(), load.row(l).begin());
  }
  load.set_layer_ids(std::move(layer_ids));
  return load;
}

absl::StatusOr<LoadMatrix> ReadSglangLoadFile(const std::string& path) {
  UBEP_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return ParseSglangLoad(text, path);
}

std::string SglangLoadToJson(const LoadMatrix& load) {
  const int num_model_layers = load.layer_ids().empty() ? 0 : load.layer_ids().back() + 1;
  Json rows = Json::array();
  for (int i = 0, l = 0; i < num_model_layers; ++i) {
    Json row = Json::array();
    const bool moe = l < load.num_layers() && load.layer_ids()[l] == i;
    for (int e = 0; e < load.num_experts(); ++e) row.push_back(moe ? load.at(l, e) : 0.0);
    if (moe) ++l;
    rows.push_back(std::move(row));
  }
  return Json{{"logical_count", std::move(rows)}}.dump();
}

std::string PlanToSglangJson(const Plan& plan) {
  int num_model_layers = 0;
  for (int id : plan.layer_ids) num_model_layers = std::max(num_model_layers, id + 1);
  const int num_slots = plan.layers.empty() ? 0 : static_cast<int>(plan.layers[0].slot_expert.size());
  Json rows = Json::array();
  for (int i = 0; i < num_model_layers; ++i) {
    const auto at = std::find(plan.layer_ids.begin(), plan.layer_ids.end(), i);
    if (at != plan.layer_ids.end() && static_cast<size_t>(at - plan.layer_ids.begin()) < plan.layers.size()) {
      rows.push_back(plan.layers[at - plan.layer_ids.begin()].slot_expert);
      continue;
    }
    Json row = Json::array();
    for (int p = 0; p < num_slots; ++p) row.push_back(plan.num_experts > 0 ? p % plan.num_experts : 0);
    rows.push_back(std::move(row));
  }
  return Json{{"physical_to_logical_map", std::move(rows)}}.dump();
}

absl::StatusOr<Plan> ParsePlanJson(const std::string& text, const std::string& name,
                                   const std::optional<Topology>& topology_override) {
  UBEP_ASSIGN_OR_RETURN(Json json, ParseJson(text, name));
  if (!json.is_object()) return Bad(name, "(document)", "expected a JSON object");
  Plan plan;
  if (json.contains("version")) {
    if (!json["version"].is_number_unsigned()) {
      return Bad(name, "version", "expected a non-negative integer");
    }
    plan.version = json["version"].get<uint64_t>();
  }
  if (!json.contains("phy2log")) return Bad(name, "phy2log", "missing");
  if (!json["phy2log"].is_array() || json["phy2log"].empty()) {
    return Bad(name, "phy2log", "expected a non-empty array of per-layer arrays");
  }
  UBEP_ASSIGN_OR_RETURN(
      std::vector<std::vector<int>> phy2log,
      IntMatrix(json["phy2log"], name, "phy2log", -1, -1, 0, kMaxPlanIndex - 1));
  const int width = static_cast<int>(phy2log[0].size());
  if (json.contains("topology")) {
    UBEP_ASSIGN_OR_RETURN(plan.topology, ParseTopology(json["topology"], name));
    if (topology_override.has_value()) {
      UBEP_RETURN_IF_ERROR(CheckAgrees(plan.topology, *topology_override, name));
    }
  } else if (topology_override.has_value()) {
    plan.topology = *topology_override;
    if (plan.topology.num_nodes == 0) plan.topology.num_nodes = 1;
    if (plan.topology.num_groups == 0) plan.topology.num_groups = 1;
    if (plan.topology.slots_per_rank == 0) {  // A plain EPLB plan: from phy2log's width.
      if (plan.topology.num_ranks <= 0 || width % plan.topology.num_ranks != 0) {
        return Bad(name, "phy2log[0]", absl::StrCat(width, " slots do not divide by ",
                                                    plan.topology.num_ranks, " ranks"));
      }
      plan.topology.slots_per_rank = width / plan.topology.num_ranks;
    }
  } else {
    return Bad(name, "topology", "missing; pass --ranks (and --nodes) for a plain EPLB plan");
  }
  const Topology& t = plan.topology;
  const int num_layers = static_cast<int>(phy2log.size());
  int num_experts = 0;
  for (const auto& row : phy2log) {
    for (int e : row) num_experts = std::max(num_experts, e + 1);
  }
  if (json.contains("num_experts")) {
    UBEP_ASSIGN_OR_RETURN(int declared, Integer(json["num_experts"], name, "num_experts",
                                                num_experts, kMaxPlanIndex));
    num_experts = declared;
  } else if (json.contains("logcnt") && json["logcnt"].is_array() && !json["logcnt"].empty() &&
             json["logcnt"][0].is_array()) {
    num_experts = std::max(num_experts, static_cast<int>(json["logcnt"][0].size()));
  }
  plan.num_experts = num_experts;
  // Before anything is sized by the expert count: the slots (counted without overflow) can
  // hold every expert, so what follows takes memory in proportion to the file.
  if (absl::Status s = ValidateTopology(t, num_experts); !s.ok()) {
    return Bad(name, "topology", std::string(s.message()));
  }
  if (width != t.num_slots()) {
    return Bad(name, "phy2log[0]",
               absl::StrCat("has ", width, " slots, topology has ", t.num_ranks, " ranks x ",
                            t.slots_per_rank, " = ", t.num_slots()));
  }
  std::vector<ReplicaIndex> replicas;
  for (int l = 0; l < num_layers; ++l) {
    replicas.push_back(IndexReplicas(phy2log[l], num_experts));
    for (int e = 0; e < num_experts; ++e) {
      if (replicas[l].count(e) == 0) {
        return Bad(name, absl::StrCat("phy2log[", l, "]"),
                   absl::StrCat("no slot holds expert ", e, " (of ", num_experts, ")"));
      }
    }
    LayerPlan layer;
    layer.slot_expert = std::move(phy2log[l]);
    SetEqualShares(num_experts, layer);
    plan.layers.push_back(std::move(layer));
  }
  if (json.contains("logcnt")) {
    UBEP_ASSIGN_OR_RETURN(auto logcnt, IntMatrix(json["logcnt"], name, "logcnt", num_layers,
                                                 num_experts, 0, t.num_slots()));
    for (int l = 0; l < num_layers; ++l) {
      for (int e = 0; e < num_experts; ++e) {
        if (logcnt[l][e] != replicas[l].count(e)) {
          return Bad(name, absl::StrCat("logcnt[", l, "][", e, "]"),
                     absl::StrCat("is ", logcnt[l][e], " but phy2log holds ",
                                  replicas[l].count(e), " replicas of expert ", e));
        }
      }
    }
  }
  // The file's own log2phy, when it has one: shares are aligned with it, in its order.
  std::vector<std::vector<std::vector<int>>> log2phy;
  if (json.contains("log2phy")) {
    const Json& v = json["log2phy"];
    if (!v.is_array() || static_cast<int>(v.size()) != num_layers) {
      return Bad(name, "log2phy", absl::StrCat("expected ", num_layers, " layers"));
    }
    for (int l = 0; l < num_layers; ++l) {
      UBEP_ASSIGN_OR_RETURN(auto rows, IntMatrix(v[l], name, absl::StrCat("log2phy[", l, "]"),
                                                 num_experts, -1, -1, t.num_slots() - 1));
      for (int e = 0; e < num_experts; ++e) {
        std::vector<int> listed;
        for (int p : rows[e]) {
          if (p >= 0) listed.push_back(p);
        }
        std::sort(listed.begin(), listed.end());
        const std::span<const int> expected = replicas[l].of(e);
        if (!std::equal(listed.begin(), listed.end(), expected.begin(), expected.end())) {
          return Bad(name, absl::StrCat("log2phy[", l, "][", e, "]"),
                     "does not list the slots phy2log assigns to this expert");
        }
      }
      log2phy.push_back(std::move(rows));
    }
  }
  if (json.contains("shares")) {
    const Json& v = json["shares"];
    if (!v.is_array() || static_cast<int>(v.size()) != num_layers) {
      return Bad(name, "shares", absl::StrCat("expected ", num_layers, " layers"));
    }
    for (int l = 0; l < num_layers; ++l) {
      const std::string field = absl::StrCat("shares[", l, "]");
      if (!v[l].is_array() || static_cast<int>(v[l].size()) != num_experts) {
        return Bad(name, field, absl::StrCat("expected ", num_experts, " experts"));
      }
      for (int e = 0; e < num_experts; ++e) {
        // Entry j is the share of the replica at log2phy[l][e][j]: the file's, or ours (slot
        // order) without one. Entries with no replica (-1, or past the row) are padding.
        const std::span<const int> slots =
            log2phy.empty() ? replicas[l].of(e) : std::span<const int>(log2phy[l][e]);
        size_t needed = 0;
        for (size_t j = 0; j < slots.size(); ++j) {
          if (slots[j] >= 0) needed = j + 1;
        }
        const Json& row = v[l][e];
        const std::string row_field = absl::StrCat(field, "[", e, "]");
        if (!row.is_array() || row.size() < needed) {
          return Bad(name, row_field, absl::StrCat("expected at least ", needed, " shares"));
        }
        for (size_t j = 0; j < row.size(); ++j) {
          const std::string share_field = absl::StrCat(row_field, "[", j, "]");
          UBEP_ASSIGN_OR_RETURN(double s, NonNegative(row[j], name, share_field));
          if (j < slots.size() && slots[j] >= 0) {
            plan.layers[l].slot_share[slots[j]] = s;
          } else if (s != 0) {
            return Bad(name, share_field,
                       absl::StrCat("is padding (no replica there) and must be 0, got ",
                                    row[j].dump()));
          }
        }
      }
    }
  }
  if (json.contains("layer_ids")) {
    const Json& v = json["layer_ids"];
    if (!v.is_array() || static_cast<int>(v.size()) != num_layers) {
      return Bad(name, "layer_ids", absl::StrCat("expected ", num_layers, " entries"));
    }
    for (int l = 0; l < num_layers; ++l) {
      UBEP_ASSIGN_OR_RETURN(int id, Integer(v[l], name, absl::StrCat("layer_ids[", l, "]"), 0,
                                            kMaxPlanIndex));
      plan.layer_ids.push_back(id);
    }
  } else {
    for (int l = 0; l < num_layers; ++l) plan.layer_ids.push_back(l);
  }
  if (json.contains("excluded_ranks")) {
    const Json& v = json["excluded_ranks"];
    if (!v.is_array()) return Bad(name, "excluded_ranks", "expected an array of ranks");
    for (size_t i = 0; i < v.size(); ++i) {
      UBEP_ASSIGN_OR_RETURN(int r, Integer(v[i], name, absl::StrCat("excluded_ranks[", i, "]"),
                                           0, t.num_ranks - 1));
      plan.excluded_ranks.push_back(r);
    }
  }
  if (absl::Status s = ValidatePlan(plan); !s.ok()) {
    return Bad(name, "plan", std::string(s.message()));
  }
  return plan;
}

absl::StatusOr<Plan> ReadPlanFile(const std::string& path,
                                  const std::optional<Topology>& topology_override) {
  UBEP_ASSIGN_OR_RETURN(std::string text, ReadTextFile(path));
  return ParsePlanJson(text, path, topology_override);
}

std::string PlanToJson(const Plan& plan) {
  const EplbArrays arrays = ToEplbArrays(plan);
  Json json;
  json["version"] = plan.version;
  json["topology"] = {{"ranks", plan.topology.num_ranks},
                      {"nodes", plan.topology.num_nodes},
                      {"slots_per_rank", plan.topology.slots_per_rank},
                      {"groups", plan.topology.num_groups}};
  json["num_experts"] = plan.num_experts;
  json["layer_ids"] = plan.layer_ids;
  json["phy2log"] = arrays.phy2log;
  json["log2phy"] = arrays.log2phy;
  json["logcnt"] = arrays.logcnt;
  json["shares"] = arrays.shares;
  if (!plan.excluded_ranks.empty()) json["excluded_ranks"] = plan.excluded_ranks;
  return json.dump();
}

}  // namespace ubep::balancer
