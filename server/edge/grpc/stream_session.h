// The striped stream's sessions: a request reassembled from byte ranges uploaded on several calls,
// then its output downloaded the same way. Pure logic (no gRPC) so tests drive it directly.
//
// A session owns one IoBuffers (q | k | v | o | lse), taken at Open from the backend's pinned
// staging pool when it has one (reused, never zero-filled), else the heap -- and only after its
// header passed the native API's validation (api/validation.h) and the table's limits, so a bad
// or oversized header costs no allocation. A session id is the only credential of its later
// calls: 128 bits from the OS CSPRNG (getrandom(2)), hex.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "api/validation.h"
#include "flashserve/v1/attention.pb.h"
#include "memory/io_buffers.h"

namespace flashserve {

/// Disjoint half-open byte ranges [begin, end); rejects overlaps.
class RangeSet {
 public:
  /// Separate ranges a set holds at most (adjacent ones merge): a map node each (~64 bytes), and
  /// no session budget counts them -- one-byte chunks at every other offset grew a server by
  /// 316 MiB for a 64 MiB session. Striped transfers keep about one range per stream.
  static constexpr size_t kMaxRanges = 4096;

  /// INVALID_ARGUMENT when [begin, end) overlaps a range already in the set; RESOURCE_EXHAUSTED
  /// when it would be the set's kMaxRanges + 1st separate range. Empty ranges are accepted and
  /// change nothing.
  absl::Status Insert(int64_t begin, int64_t end);
  int64_t covered() const { return covered_; }
  size_t size() const { return ranges_.size(); }

 private:
  std::map<int64_t, int64_t> ranges_;  // begin -> end, merged when adjacent
  int64_t covered_ = 0;
};

/// Checks [offset, offset + length) against a buffer of `size` bytes without overflowing.
absl::Status CheckRange(int64_t offset, int64_t length, int64_t size, const char* what);

struct StreamLimits {
  int max_sessions = 16;                         // open sessions at a time
  int64_t max_session_bytes = int64_t{1} << 30;  // Q + K + V bytes of one session
  int64_t max_total_bytes = int64_t{8} << 30;    // inputs + outputs of all open sessions; 0: none
  // Headers are checked against the runtime's ValidationLimits, as a native request is.
  std::chrono::milliseconds idle_timeout{60000};
};

/// The room a table's sessions take -- a slot each and their bytes -- shared with every session,
/// which gives its part back when it is destroyed: a session closed while an Upload copies into it
/// or gRPC still sends Download slices of it keeps its memory, so it keeps counting. Thread-safe.
class SessionRoom {
 public:
  /// RESOURCE_EXHAUSTED when one more session of `bytes` would pass the limits.
  absl::Status Take(int64_t bytes, const StreamLimits& limits);
  void Give(int64_t bytes);
  int64_t bytes() const;

 private:
  mutable absl::Mutex mu_;
  int sessions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

/// One session: the request being reassembled and, after Compute, its response.
class StreamSession {
 public:
  enum class State { kUploading, kComputing, kOutputReady, kClosed };

  StreamSession(std::string id, int64_t accounted_bytes);
  ~StreamSession();
  StreamSession(const StreamSession&) = delete;
  StreamSession& operator=(const StreamSession&) = delete;

  const std::string& id() const { return id_; }
  int64_t accounted_bytes() const { return accounted_bytes_; }

  /// Where `length` bytes at `offset` of tensor Q/K/V go: checks state, bounds and overlap and
  /// reserves the range. Call Commit(length) after copying.
  absl::StatusOr<char*> Reserve(int tensor, int64_t offset, int64_t length);
  void Commit(int64_t length);
  int64_t bytes_received() const;
  int64_t input_bytes() const { return input_bytes_; }

  /// Uploading -> computing, when every input byte is in and no copy is under way.
  absl::Status BeginCompute();
  /// Computing -> output ready (ok) or closed.
  void EndCompute(bool ok);
  /// Computing -> uploading again, for a Compute that never ran (busy, queue full, expired):
  /// `inputs` (the buffers as uploaded) become the session's again, so Compute can be retried.
  void AbortCompute(std::shared_ptr<IoBuffers> inputs);
  /// The byte span [offset, offset+length) of OUT/LSE to send, when the output is ready and the
  /// range was not downloaded before (length 0: to the end). Marks it downloaded.
  absl::StatusOr<std::pair<const char*, int64_t>> ReserveDownload(int tensor, int64_t offset,
                                                                  int64_t length);
  /// True once every output byte was handed to a Download.
  bool FullyDownloaded() const;

  State state() const;
  void Close();
  /// CloseSession while computing: Compute erases the session when it answers.
  void RequestClose() { close_requested_.store(true); }
  bool close_requested() const { return close_requested_.load(); }
  std::chrono::steady_clock::time_point last_activity() const;
  void Touch();

  // The request's header (tensor data empty) and, after Compute (unless inline), the response's
  // header. Owned by the session; mutated only while the state machine allows it (see above).
  v1::AttentionRequest request;
  v1::AttentionResponse response;
  /// The tensors: inputs as uploaded, outputs after Compute. Set by SessionTable::Open.
  const std::shared_ptr<IoBuffers>& io() const { return io_; }
  /// While computing only (no upload or download touches io_ then): where the runtime puts the
  /// buffers holding the outputs, which are new ones if it had to stage the inputs.
  std::shared_ptr<IoBuffers>* io_for_compute() { return &io_; }

 private:
  friend class SessionTable;
  // Where tensor Q/K/V/OUT/LSE lives and its size; {nullptr, 0} for other values.
  std::pair<char*, int64_t> TensorData(int tensor);

  const std::string id_;
  const int64_t accounted_bytes_;
  std::shared_ptr<SessionRoom> room_;  // set by SessionTable::Open: given back at destruction
  std::atomic<bool> close_requested_{false};
  int64_t input_bytes_ = 0;
  std::shared_ptr<IoBuffers> io_;
  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kUploading;
  RangeSet received_[3] ABSL_GUARDED_BY(mu_);
  int64_t committed_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  RangeSet downloaded_[2] ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point last_activity_ ABSL_GUARDED_BY(mu_);
};

/// The open sessions, bounded by StreamLimits. Thread-safe.
class SessionTable {
 public:
  /// Headers are validated against `validation` (the runtime's limits: dtypes, head dims, element
  /// counts). `pool` (may be null: heap memory) provides the sessions' buffers; it must outlive
  /// the table.
  SessionTable(StreamLimits limits, ValidationLimits validation, PinnedPool* pool = nullptr)
      : limits_(limits), validation_(std::move(validation)), pool_(pool) {}

  /// Validates the header as the native API validates a request (ValidateAttentionRequest, same
  /// messages; the tensors' data must be empty: it comes by Upload), checks the session limits,
  /// and only then allocates the tensor buffers and registers a new session.
  absl::StatusOr<std::shared_ptr<StreamSession>> Open(const v1::AttentionRequest& header);
  /// NOT_FOUND for unknown or expired ids.
  absl::StatusOr<std::shared_ptr<StreamSession>> Find(const std::string& id);
  void Erase(const std::string& id);
  /// Drops sessions idle for longer than the timeout (not those computing); returns how many.
  int Reap(std::chrono::steady_clock::time_point now);

  /// Sessions open (in the table).
  size_t size() const;
  /// Bytes of the sessions not yet destroyed (closed ones included while something holds them).
  int64_t total_bytes() const;
  const StreamLimits& limits() const { return limits_; }

 private:
  const StreamLimits limits_;
  const ValidationLimits validation_;
  PinnedPool* const pool_;
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<StreamSession>> sessions_ ABSL_GUARDED_BY(mu_);
  const std::shared_ptr<SessionRoom> room_ = std::make_shared<SessionRoom>();
};

/// A new session id: 128 bits from getrandom(2), as 32 lowercase hex digits. UNAVAILABLE when
/// the OS has no randomness to give (never a weaker id).
absl::StatusOr<std::string> NewSessionId();

}  // namespace flashserve
