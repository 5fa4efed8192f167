#include "autotune/tune_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/random_id.h"
#include "nlohmann/json.hpp"

namespace flashserve {
namespace {

constexpr const char kFormat[] = "flashserve-tune-cache/1";

// An int field: nlohmann's get<int>() on a float such as 1e20 converts out of range (undefined
// behaviour), so integers are checked for type and range first.
int IntField(const nlohmann::json& object, const char* key) {
  const nlohmann::json& value = object.at(key);
  if (!value.is_number_integer()) {
    throw nlohmann::json::type_error::create(302, std::string(key) + " is not an integer", &value);
  }
  const int64_t v = value.get<int64_t>();
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    throw nlohmann::json::out_of_range::create(406, std::string(key) + " is out of range", &value);
  }
  return int(v);
}

// One entry; throws nlohmann's exceptions naming the field that is wrong.
TuneRecord RecordFromJson(const nlohmann::json& e) {
  TuneRecord r;
  r.config = e.at("config").get<std::string>();
  r.tflops = e.at("tflops").get<double>();
  r.runner_up = e.value("runner_up", "");
  r.runner_up_tflops = e.value("runner_up_tflops", 0.0);
  r.default_config = e.value("default", "");
  r.default_tflops = e.value("default_tflops", 0.0);
  r.candidates_timed = e.contains("candidates_timed") ? IntField(e, "candidates_timed") : 0;
  return r;
}

}  // namespace

std::string TuneCacheHeader::Mismatch(const TuneCacheHeader& other) const {
  if (device_name != other.device_name) {
    return absl::StrCat("measured on \"", other.device_name, "\", this is \"", device_name, "\"");
  }
  if (cc_major != other.cc_major || cc_minor != other.cc_minor) {
    return absl::StrCat("compute capability ", other.cc_major, ".", other.cc_minor,
                        " != ", cc_major, ".", cc_minor);
  }
  if (sm_count != other.sm_count) {
    return absl::StrCat(
        other.sm_count > 0 ? absl::StrCat(other.sm_count) : "an unrecorded number of",
        " SMs != this device's ", sm_count, " (a MIG slice or another SKU)");
  }
  if (build_id != other.build_id) {
    return absl::StrCat("kernel build ", other.build_id, " != this build ", build_id);
  }
  if (driver_version != other.driver_version || runtime_version != other.runtime_version) {
    return absl::StrCat("driver/runtime ", other.driver_version, "/", other.runtime_version,
                        " != ", driver_version, "/", runtime_version);
  }
  return "";
}

std::string TuneCache::LoadReport::Warning(const std::string& path) const {
  if (skipped == 0) return "";
  return absl::StrCat(path, ": ", skipped, " malformed entries skipped (the first: ", first_skipped,
                      "); the next save drops them");
}

std::optional<TuneRecord> TuneCache::Find(const std::string& key) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

void TuneCache::Put(const std::string& key, const TuneRecord& record) {
  absl::MutexLock lock(&mu_);
  entries_[key] = record;
}

size_t TuneCache::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return entries_.size();
}

std::string TuneCache::ToJson() const {
  nlohmann::json j;
  j["format"] = kFormat;
  j["device"] = {{"name", header_.device_name},
                 {"cc_major", header_.cc_major},
                 {"cc_minor", header_.cc_minor},
                 {"sm_count", header_.sm_count},
                 {"driver_version", header_.driver_version},
                 {"runtime_version", header_.runtime_version}};
  j["build_id"] = header_.build_id;
  nlohmann::json entries = nlohmann::json::object();
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [key, r] : entries_) {
      entries[key] = {{"config", r.config},
                      {"tflops", r.tflops},
                      {"runner_up", r.runner_up},
                      {"runner_up_tflops", r.runner_up_tflops},
                      {"default", r.default_config},
                      {"default_tflops", r.default_tflops},
                      {"candidates_timed", r.candidates_timed}};
    }
  }
  j["entries"] = std::move(entries);
  return j.dump(2) + "\n";
}

namespace {

// Takes `fd`'s exclusive lock within `wait`. True also when the file system has no locks (the save
// goes on unlocked, as before); false only while another writer holds it.
bool LockWithin(int fd, absl::Duration wait) {
  const absl::Time until = absl::Now() + wait;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) return true;
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

}  // namespace

absl::Status TuneCache::FromJson(const std::string& text, LoadReport* report) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError("not valid JSON (corrupt or truncated)");
  }
  try {
    if (j.value("format", "") != kFormat) {
      return absl::FailedPreconditionError(absl::StrCat("format is not ", kFormat));
    }
    TuneCacheHeader file;
    const nlohmann::json& device = j.at("device");
    file.device_name = device.at("name").get<std::string>();
    file.cc_major = IntField(device, "cc_major");
    file.cc_minor = IntField(device, "cc_minor");
    file.sm_count = device.contains("sm_count") ? IntField(device, "sm_count") : 0;
    file.driver_version = IntField(device, "driver_version");
    file.runtime_version = IntField(device, "runtime_version");
    file.build_id = j.at("build_id").get<std::string>();
    if (std::string why = header_.Mismatch(file); !why.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("cache is for another setup: ", why));
    }
    const nlohmann::json& entries = j.at("entries");
    if (!entries.is_object()) {
      throw nlohmann::json::type_error::create(302, "entries is not an object", &entries);
    }
    std::map<std::string, TuneRecord> loaded;
    LoadReport skipped;
    for (const auto& [key, e] : entries.items()) {
      try {
        loaded[key] = RecordFromJson(e);
      } catch (const nlohmann::json::exception& why) {
        if (skipped.skipped++ == 0)
          skipped.first_skipped = absl::StrCat("\"", key, "\": ", why.what());
      }
    }
    if (report != nullptr) *report = skipped;
    absl::MutexLock lock(&mu_);
    entries_ = std::move(loaded);
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat("malformed cache: ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status TuneCache::Load(const std::string& path, LoadReport* report) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  // Read whole and parsed into a tree: a huge file, a device or a FIFO would exhaust memory or
  // hang the start.
  if (!S_ISREG(st.st_mode) || st.st_size > kMaxFileBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": not a regular file of at most ", kMaxFileBytes, " bytes; ignored"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::UnavailableError(absl::StrCat(path, ": cannot open for reading"));
  std::stringstream text;
  text << in.rdbuf();
  absl::Status s = FromJson(text.str(), report);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  return absl::OkStatus();
}

absl::Status TuneCache::Save(const std::string& path, absl::Duration lock_wait) const {
  // Writers of one file (a server tuning in the background, flashserve-tune, replicas on a shared
  // volume, each possibly pid 1 in its container) take turns on its lock file, and each keeps the
  // entries the others wrote (its own win). Without the lock (a file system that refuses it) the
  // write still goes through a temp file no other writer can share.
  const std::string lock_path = path + ".lock";
  // Anyone may take it (0666 less the umask); another user's lock file is locked read-only (flock
  // needs no write access): the server's user could not open one flashserve-tune made as root,
  // and wrote unlocked, losing other writers' entries.
  int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (lock_fd < 0) lock_fd = ::open(lock_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (lock_fd >= 0 && !LockWithin(lock_fd, lock_wait)) {
    ::close(lock_fd);
    return absl::UnavailableError(absl::StrCat(
        lock_path, ": another writer has held it for ", absl::FormatDuration(lock_wait),
        "; not saved now (the entries go with the next save)"));
  }
  absl::Status saved = SaveMergedLocked(path);
  if (lock_fd >= 0) ::close(lock_fd);  // releases the lock
  return saved;
}

absl::Status TuneCache::SaveMergedLocked(const std::string& path) const {
  TuneCache merged(header_);
  merged.Load(path).IgnoreError();  // another setup's, or a corrupt, file is replaced
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [key, record] : entries_) merged.Put(key, record);
  }
  const std::string text = merged.ToJson();
  absl::StatusOr<std::string> nonce = RandomHexId128("tune cache temp file");
  if (!nonce.ok()) return nonce.status();
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", *nonce);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(tmp, ": ", std::strerror(errno)));
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::UnavailableError(absl::StrCat(tmp, ": ", std::strerror(err)));
    }
    written += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat(tmp, ": ", std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("rename to ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace flashserve
