// The autotuning cache: winners per problem class, persisted as JSON for one device and build.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flashserve {

/// Identifies where and with what a cache was measured; a file whose header differs is ignored.
struct TuneCacheHeader {
  std::string device_name;
  int cc_major = 0;
  int cc_minor = 0;
  int driver_version = 0;   // cudaDriverGetVersion
  int runtime_version = 0;  // cudaRuntimeGetVersion
  std::string build_id;     // hash of the compiled kernel set
  int sm_count = 0;  // multiProcessorCount (0 in files written before it was recorded: no match)

  /// Empty when `other` may be used with this header; else why not.
  std::string Mismatch(const TuneCacheHeader& other) const;
};

struct TuneRecord {
  std::string config;  // KernelConfig::name() of the winner; decode classes: "splits=N"
  double tflops = 0;   // throughput: TFLOPS; decode classes (key "decode|..."): K/V TB/s
  std::string runner_up;  // second fastest ("" if only one candidate ran)
  double runner_up_tflops = 0;
  std::string default_config;  // the heuristic default, for the speed-up
  double default_tflops = 0;
  int candidates_timed = 0;
};

/// Thread-safe (reads take a shared lock; the request path only reads).
class TuneCache {
 public:
  explicit TuneCache(TuneCacheHeader header) : header_(std::move(header)) {}

  const TuneCacheHeader& header() const { return header_; }
  std::optional<TuneRecord> Find(const std::string& key) const;
  void Put(const std::string& key, const TuneRecord& record);
  size_t size() const;

  /// What a load dropped: entries that are not well-formed (a hand edit, another version's field
  /// types) are skipped one by one, so one bad entry does not cost the file's other classes.
  struct LoadReport {
    int skipped = 0;
    std::string first_skipped;  // its key and why
    /// "" when nothing was skipped, else a warning for the log naming `path`.
    std::string Warning(const std::string& path) const;
  };
  /// Loads entries from `path` if its header matches. A missing file is OK (nothing loaded).
  /// A foreign (other device/build) or corrupt file (not JSON, a bad header) loads nothing and
  /// returns a status that says why (callers log it as a warning and carry on with an empty
  /// cache); malformed entries of a good file are skipped and counted in `report` if given.
  absl::Status Load(const std::string& path, LoadReport* report = nullptr);
  /// Writes the cache atomically (a temp file in the same directory, fsync, rename), merged with
  /// the entries the file holds (another writer's; this cache's win), under `path`.lock.
  /// UNAVAILABLE, nothing written, when another writer holds the lock longer than `lock_wait`
  /// (a stopped process, a hung network file system held the tuner, and a server's shutdown
  /// joining it, forever); the entries stay for the next save.
  absl::Status Save(const std::string& path, absl::Duration lock_wait = kLockWait) const;
  static constexpr absl::Duration kLockWait = absl::Seconds(5);
  /// A cache file larger than this (or not a regular file) is not read: it is parsed into a tree
  /// of ~37x its size (a 64 MiB file took 2.4 GB); entries are ~250 bytes each.
  static constexpr int64_t kMaxFileBytes = int64_t{8} << 20;

  std::string ToJson() const;
  /// Parses `text`; on success replaces the entries with its well-formed ones. Errors name what
  /// is wrong.
  absl::Status FromJson(const std::string& text, LoadReport* report = nullptr);

 private:
  absl::Status SaveMergedLocked(const std::string& path) const;

  const TuneCacheHeader header_;
  mutable absl::Mutex mu_;
  std::map<std::string, TuneRecord> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flashserve
