// The striped streaming edge: flashserve.v1.AttentionStreamService (see attention.proto).
//
// One request's bytes travel over several HTTP/2 connections: the client opens a session
// (shapes only), uploads disjoint byte ranges of Q, K and V on K client-streaming calls in
// parallel, calls Compute, and downloads O (and LSE) as byte ranges on K server-streaming calls.
//
// Reassembly: a session owns one IoBuffers (q | k | v | o | lse), taken at OpenSession from the
// backend's pinned staging pool when it has one (reused, never zero-filled), else the heap. Every
// received chunk is copied exactly once, from gRPC's receive slices into place (Upload is
// registered raw and parsed by ParseChunk, never into a temporary message); Compute hands the
// buffers to the runtime as they are, so the GPU copies straight from them; Download sends O out
// of them (no copy).
//
// Not done yet: StreamSession::Commit knows each completed range -- the place to start an H2D copy
// of it while later chunks still arrive.
//
// The pieces below StreamService are pure logic (no gRPC) so tests can drive them directly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/auth.h"
#include "flashserve/v1/attention.pb.h"
#include "runtime/attention_runtime.h"
#include "memory/io_buffers.h"

namespace google::protobuf::io {
class ZeroCopyInputStream;
}  // namespace google::protobuf::io
namespace grpc {
class Service;
}  // namespace grpc

namespace flashserve {

/// Disjoint half-open byte ranges [begin, end); rejects overlaps.
class RangeSet {
 public:
  /// INVALID_ARGUMENT when [begin, end) overlaps a range already in the set. Empty ranges are
  /// accepted and change nothing.
  absl::Status Insert(int64_t begin, int64_t end);
  int64_t covered() const { return covered_; }
  size_t size() const { return ranges_.size(); }

 private:
  std::map<int64_t, int64_t> ranges_;  // begin -> end, merged when adjacent
  int64_t covered_ = 0;
};

/// Checks [offset, offset + length) against a buffer of `size` bytes without overflowing.
absl::Status CheckRange(int64_t offset, int64_t length, int64_t size, const char* what);

/// The fields of one AttentionChunk before its data.
struct ChunkHeader {
  std::string session_id;
  int tensor = 0;  // v1::TensorName
  int64_t offset = 0;
  int64_t length = 0;  // of data
};

/// Parses one serialized AttentionChunk from `in`. When the data field starts, calls
/// place(header) for the destination of header.length bytes and copies them there directly (the
/// only copy). Unknown fields are skipped. INVALID_ARGUMENT on malformed input, on data before
/// tensor/offset, on a second data field, or when there is no data field; place's error otherwise.
/// On success `header` holds what was parsed and the copy is complete.
absl::Status ParseChunk(google::protobuf::io::ZeroCopyInputStream* in,
                        const std::function<absl::StatusOr<char*>(const ChunkHeader&)>& place,
                        ChunkHeader* header);

/// Serializes the AttentionChunk header fields (tensor, offset, data tag + length) that precede
/// `data_length` bytes of data; appended to `out`. The session id is left out (Download).
void AppendChunkHeader(int tensor, int64_t offset, int64_t data_length, std::string* out);

struct StreamLimits {
  int max_sessions = 16;                    // open sessions at a time
  int64_t max_session_bytes = int64_t{1} << 30;  // Q + K + V bytes of one session
  int64_t max_total_bytes = int64_t{8} << 30;    // inputs + outputs of all open sessions; 0: none
  int64_t max_tensor_elements = int64_t{1} << 28;
  std::chrono::milliseconds idle_timeout{60000};
};

/// One session: the request being reassembled and, after Compute, its response.
class StreamSession {
 public:
  enum class State { kUploading, kComputing, kOutputReady, kClosed };

  StreamSession(std::string id, int64_t accounted_bytes);

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
  /// The byte span [offset, offset+length) of OUT/LSE to send, when the output is ready and the
  /// range was not downloaded before (length 0: to the end). Marks it downloaded.
  absl::StatusOr<std::pair<const char*, int64_t>> ReserveDownload(int tensor, int64_t offset,
                                                                  int64_t length);
  /// True once every output byte was handed to a Download.
  bool FullyDownloaded() const;

  State state() const;
  void Close();
  std::chrono::steady_clock::time_point last_activity() const;
  void Touch();

  // The request's header (tensor data empty) and, after Compute (unless inline), the response's
  // header. Owned by the session; mutated only while the state machine allows it (see above).
  v1::AttentionRequest request;
  v1::AttentionResponse response;
  /// The tensors: inputs as uploaded, outputs after Compute. Set by SessionTable::Open.
  const std::shared_ptr<IoBuffers>& io() const { return io_; }

 private:
  friend class SessionTable;
  // Where tensor Q/K/V/OUT/LSE lives and its size; {nullptr, 0} for other values.
  std::pair<char*, int64_t> TensorData(int tensor);

  const std::string id_;
  const int64_t accounted_bytes_;
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
  /// `pool` (may be null: heap memory) provides the sessions' buffers; it must outlive the table.
  explicit SessionTable(StreamLimits limits, PinnedPool* pool = nullptr)
      : limits_(limits), pool_(pool) {}

  /// Validates the header (dtype, rank-4 shapes, element and byte limits), allocates the tensor
  /// buffers and registers a new session. The header's tensor data must be empty.
  absl::StatusOr<std::shared_ptr<StreamSession>> Open(const v1::AttentionRequest& header);
  /// NOT_FOUND for unknown or expired ids.
  absl::StatusOr<std::shared_ptr<StreamSession>> Find(const std::string& id);
  void Erase(const std::string& id);
  /// Drops sessions idle for longer than the timeout (not those computing); returns how many.
  int Reap(std::chrono::steady_clock::time_point now);

  size_t size() const;
  int64_t total_bytes() const;
  const StreamLimits& limits() const { return limits_; }

 private:
  const StreamLimits limits_;
  PinnedPool* const pool_;
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<StreamSession>> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t counter_ ABSL_GUARDED_BY(mu_) = 0;
};

/// The gRPC service (raw Upload/Download, typed others). Reaps idle sessions on a background
/// thread. Register it through GrpcEdge::Create(..., extra_services); it must outlive the edge.
std::unique_ptr<grpc::Service> CreateStreamService(AttentionRuntime* runtime, StreamLimits limits,
                                                   const BearerAuth* auth);

}  // namespace flashserve
