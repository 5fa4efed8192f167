#include "edge/grpc/stream_edge.h"

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "edge/grpc/grpc_auth.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "flashserve/v1/attention.grpc.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "spdlog/spdlog.h"

namespace flashserve {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

// --- RangeSet -----------------------------------------------------------------------------------

absl::Status RangeSet::Insert(int64_t begin, int64_t end) {
  if (end <= begin) return absl::OkStatus();
  auto next = ranges_.upper_bound(begin);  // first range starting after begin
  if (next != ranges_.end() && next->first < end) {
    return absl::InvalidArgumentError(absl::StrCat("byte range [", begin, ", ", end,
                                                   ") overlaps bytes already sent [", next->first,
                                                   ", ", next->second, ")"));
  }
  auto prev = next == ranges_.begin() ? ranges_.end() : std::prev(next);
  if (prev != ranges_.end() && prev->second > begin) {
    return absl::InvalidArgumentError(absl::StrCat("byte range [", begin, ", ", end,
                                                   ") overlaps bytes already sent [", prev->first,
                                                   ", ", prev->second, ")"));
  }
  covered_ += end - begin;
  // Merge with adjacent neighbours so the map stays small for sequential chunks.
  if (prev != ranges_.end() && prev->second == begin) {
    begin = prev->first;
    ranges_.erase(prev);
  }
  if (next != ranges_.end() && next->first == end) {
    end = next->second;
    ranges_.erase(next);
  }
  ranges_[begin] = end;
  return absl::OkStatus();
}

absl::Status CheckRange(int64_t offset, int64_t length, int64_t size, const char* what) {
  if (offset < 0 || length < 0 || offset > size || length > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": byte range [", offset, ", +", length,
                                                   ") is outside the tensor's ", size, " bytes"));
  }
  return absl::OkStatus();
}

// --- chunk wire format --------------------------------------------------------------------------

absl::Status ParseChunk(google::protobuf::io::ZeroCopyInputStream* in,
                        const std::function<absl::StatusOr<char*>(const ChunkHeader&)>& place,
                        ChunkHeader* header) {
  *header = ChunkHeader{};  // proto3 leaves zero fields out: nothing may carry over
  CodedInputStream stream(in);
  stream.SetTotalBytesLimit(INT_MAX);
  bool have_data = false;
  auto bad = [](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("AttentionChunk: ", what));
  };
  for (;;) {
    const uint32_t tag = stream.ReadTag();
    if (tag == 0) break;
    const int field = int(WireFormatLite::GetTagFieldNumber(tag));
    const auto wire = WireFormatLite::GetTagWireType(tag);
    if (field >= 1 && field <= 4 && have_data) {
      return bad("fields after data (serialize in field order)");
    }
    switch (field) {
      case 1: {  // session_id
        uint32_t length = 0;
        if (wire != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || !stream.ReadVarint32(&length) ||
            length > 256 || !stream.ReadString(&header->session_id, int(length))) {
          return bad("malformed session_id");
        }
        break;
      }
      case 2:
      case 3: {  // tensor, offset
        uint64_t value = 0;
        if (wire != WireFormatLite::WIRETYPE_VARINT || !stream.ReadVarint64(&value)) {
          return bad(field == 2 ? "malformed tensor" : "malformed offset");
        }
        if (field == 2) {
          header->tensor = value > 1000 ? -1 : int(value);
        } else {
          header->offset = int64_t(value);  // a negative int64 arrives as a huge varint
        }
        break;
      }
      case 4: {  // data
        uint32_t length = 0;
        if (wire != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || !stream.ReadVarint32(&length) ||
            length > uint32_t(INT_MAX)) {
          return bad("malformed data");
        }
        header->length = int64_t(length);
        absl::StatusOr<char*> dest = place(*header);
        if (!dest.ok()) return dest.status();
        if (length > 0 && !stream.ReadRaw(*dest, int(length))) return bad("truncated data");
        have_data = true;
        break;
      }
      default:
        if (!WireFormatLite::SkipField(&stream, tag)) return bad("malformed unknown field");
    }
  }
  if (!stream.ConsumedEntireMessage()) return bad("malformed message");
  if (!have_data) return bad("no data field");
  return absl::OkStatus();
}

void AppendChunkHeader(int tensor, int64_t offset, int64_t data_length, std::string* out) {
  auto varint = [out](uint64_t v) {
    while (v >= 0x80) {
      out->push_back(char(v | 0x80));
      v >>= 7;
    }
    out->push_back(char(v));
  };
  out->push_back(char((2 << 3) | 0));
  varint(uint64_t(tensor));
  out->push_back(char((3 << 3) | 0));
  varint(uint64_t(offset));
  out->push_back(char((4 << 3) | 2));
  varint(uint64_t(data_length));
}

// --- StreamSession ------------------------------------------------------------------------------

StreamSession::StreamSession(std::string id, int64_t accounted_bytes)
    : id_(std::move(id)),
      accounted_bytes_(accounted_bytes),
      last_activity_(std::chrono::steady_clock::now()) {}

std::pair<char*, int64_t> StreamSession::TensorData(int tensor) {
  const IoLayout& layout = io_->layout();
  switch (tensor) {
    case v1::TENSOR_Q:
      return {io_->q(), int64_t(layout.q_bytes)};
    case v1::TENSOR_K:
      return {io_->k(), int64_t(layout.kv_bytes)};
    case v1::TENSOR_V:
      return {io_->v(), int64_t(layout.kv_bytes)};
    case v1::TENSOR_OUT:
      return {io_->o(), int64_t(layout.q_bytes)};
    case v1::TENSOR_LSE:
      return {reinterpret_cast<char*>(io_->lse()), int64_t(layout.lse_bytes)};
    default:
      return {nullptr, 0};
  }
}

absl::StatusOr<char*> StreamSession::Reserve(int tensor, int64_t offset, int64_t length) {
  absl::MutexLock lock(&mu_);
  if (state_ != State::kUploading) {
    return absl::FailedPreconditionError(
        state_ == State::kClosed ? "session was closed or expired"
                                 : "session no longer accepts uploads (Compute was called)");
  }
  if (tensor != v1::TENSOR_Q && tensor != v1::TENSOR_K && tensor != v1::TENSOR_V) {
    return absl::InvalidArgumentError(
        absl::StrCat("AttentionChunk.tensor: ", tensor, " is not TENSOR_Q, TENSOR_K or TENSOR_V"));
  }
  const auto [data, size] = TensorData(tensor);
  const char* name = tensor == v1::TENSOR_Q ? "q" : tensor == v1::TENSOR_K ? "k" : "v";
  if (absl::Status s = CheckRange(offset, length, size, name); !s.ok()) return s;
  if (absl::Status s = received_[tensor - 1].Insert(offset, offset + length); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", s.message()));
  }
  ++pending_;
  last_activity_ = std::chrono::steady_clock::now();
  return data + offset;
}

void StreamSession::Commit(int64_t length) {
  absl::MutexLock lock(&mu_);
  --pending_;
  committed_ += length;
  last_activity_ = std::chrono::steady_clock::now();
  // Hook: with pinned staging, the range just committed can be copied to the device here.
}

int64_t StreamSession::bytes_received() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

absl::Status StreamSession::BeginCompute() {
  absl::MutexLock lock(&mu_);
  if (state_ != State::kUploading) {
    return absl::FailedPreconditionError(state_ == State::kClosed
                                             ? "session was closed or expired"
                                             : "Compute was already called for this session");
  }
  if (pending_ > 0 || committed_ != input_bytes_) {
    return absl::FailedPreconditionError(
        absl::StrCat("session incomplete: ", committed_, " of ", input_bytes_,
                     " input bytes received", pending_ > 0 ? " (uploads still copying)" : ""));
  }
  state_ = State::kComputing;
  last_activity_ = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

void StreamSession::EndCompute(bool ok) {
  absl::MutexLock lock(&mu_);
  state_ = ok ? State::kOutputReady : State::kClosed;
  last_activity_ = std::chrono::steady_clock::now();
}

absl::StatusOr<std::pair<const char*, int64_t>> StreamSession::ReserveDownload(int tensor,
                                                                               int64_t offset,
                                                                               int64_t length) {
  absl::MutexLock lock(&mu_);
  if (state_ != State::kOutputReady) {
    return absl::FailedPreconditionError(state_ == State::kClosed
                                             ? "session was closed or expired"
                                             : "no output to download yet (call Compute without "
                                               "inline_output first)");
  }
  if (tensor != v1::TENSOR_OUT && !(tensor == v1::TENSOR_LSE && request.return_lse())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DownloadRequest.tensor: ", tensor, " is not TENSOR_OUT (or TENSOR_LSE with return_lse)"));
  }
  const auto [data, size] = TensorData(tensor);
  if (length == 0 && offset >= 0 && offset <= size) length = size - offset;
  if (absl::Status s = CheckRange(offset, length, size, "DownloadRequest"); !s.ok()) return s;
  if (absl::Status s = downloaded_[tensor - v1::TENSOR_OUT].Insert(offset, offset + length);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("DownloadRequest: ", s.message()));
  }
  last_activity_ = std::chrono::steady_clock::now();
  return std::make_pair(static_cast<const char*>(data) + offset, length);
}

bool StreamSession::FullyDownloaded() const {
  absl::MutexLock lock(&mu_);
  if (state_ != State::kOutputReady) return false;
  return downloaded_[0].covered() == int64_t(io_->layout().q_bytes) &&
         downloaded_[1].covered() == int64_t(io_->layout().lse_bytes);
}

StreamSession::State StreamSession::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

void StreamSession::Close() {
  absl::MutexLock lock(&mu_);
  state_ = State::kClosed;
}

std::chrono::steady_clock::time_point StreamSession::last_activity() const {
  absl::MutexLock lock(&mu_);
  return last_activity_;
}

void StreamSession::Touch() {
  absl::MutexLock lock(&mu_);
  last_activity_ = std::chrono::steady_clock::now();
}

// --- SessionTable -------------------------------------------------------------------------------

namespace {

int ElementSize(int dtype) {
  switch (dtype) {
    case v1::FLOAT16:
    case v1::BFLOAT16:
      return 2;
    case v1::FLOAT32:
      return 4;
    default:
      return 0;
  }
}

// Element count of a rank-4 tensor header, or an error naming the field.
absl::StatusOr<int64_t> CheckHeaderTensor(const v1::Tensor& t, const char* name,
                                          int64_t max_elements) {
  if (!t.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".data: must be empty in OpenSession (send it with Upload)"));
  }
  if (ElementSize(t.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".dtype: unsupported (", t.dtype(), ")"));
  }
  if (t.shape_size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shape: must have 4 dimensions, got ", t.shape_size()));
  }
  int64_t elements = 1;
  for (int i = 0; i < 4; ++i) {
    const int64_t d = t.shape(i);
    if (d <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape[", i, "]: must be > 0"));
    }
    if (elements > max_elements / d) {
      return absl::ResourceExhaustedError(
          absl::StrCat(name, ": more than --max_tensor_elements=", max_elements, " elements"));
    }
    elements *= d;
  }
  return elements;
}

}  // namespace

absl::StatusOr<std::shared_ptr<StreamSession>> SessionTable::Open(
    const v1::AttentionRequest& header) {
  int64_t bytes[3] = {0, 0, 0};
  const v1::Tensor* tensors[3] = {&header.q(), &header.k(), &header.v()};
  const char* names[3] = {"q", "k", "v"};
  int64_t input = 0;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int64_t> elements =
        CheckHeaderTensor(*tensors[i], names[i], limits_.max_tensor_elements);
    if (!elements.ok()) return elements.status();
    bytes[i] = *elements * ElementSize(tensors[i]->dtype());
    input += bytes[i];
  }
  // The session's buffers follow the runtime's layout (IoLayout), which assumes K and V agree with
  // Q on dtype, batch and head_dim and with each other on shape. Full validation follows in
  // OpenSession; this only keeps the layout honest.
  const v1::Tensor& q = header.q();
  const v1::Tensor& k = header.k();
  const v1::Tensor& v = header.v();
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype() || k.shape(0) != q.shape(0) ||
      k.shape(3) != q.shape(3) || v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) ||
      v.shape(2) != k.shape(2) || v.shape(3) != k.shape(3)) {
    return absl::InvalidArgumentError(
        "k and v must have q's dtype, batch and head_dim, and v the shape of k");
  }
  AttentionProblem problem;
  problem.dtype = static_cast<kernels::DType>(q.dtype());
  problem.batch = int(q.shape(0));
  problem.seqlen_q = int(q.shape(1));
  problem.heads_q = int(q.shape(2));
  problem.head_dim = int(q.shape(3));
  problem.seqlen_k = int(k.shape(1));
  problem.heads_kv = int(k.shape(2));
  problem.return_lse = header.return_lse();
  if (input > limits_.max_session_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session of ", input,
                     " tensor bytes exceeds --max_request_bytes=", limits_.max_session_bytes));
  }
  // Output: like q, plus the LSE (fp32, one per query row and head).
  const int64_t lse =
      header.return_lse() ? header.q().shape(0) * header.q().shape(1) * header.q().shape(2) * 4 : 0;
  const int64_t accounted = input + bytes[0] + lse;

  std::string id;
  {
    absl::MutexLock lock(&mu_);
    if (int(sessions_.size()) >= limits_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("too many open stream sessions (", limits_.max_sessions, ")"));
    }
    if (limits_.max_total_bytes > 0 && total_bytes_ > 0 &&
        total_bytes_ + accounted > limits_.max_total_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("stream sessions hold ", total_bytes_, " bytes; ", accounted,
                       " more would exceed the limit of ", limits_.max_total_bytes));
    }
    static std::mt19937_64 rng{std::random_device{}()};
    id = absl::StrFormat("%016x%08x", rng(), ++counter_ & 0xffffffffu);
    total_bytes_ += accounted;
  }
  auto session = std::make_shared<StreamSession>(id, accounted);
  session->request = header;
  session->input_bytes_ = input;
  // Outside the table lock. Pooled pinned memory when the backend has a pool: reused between
  // sessions, never zero-filled, and the GPU copies straight from it.
  session->io_ = IoBuffers::Allocate(problem, pool_);
  if (session->io_ == nullptr) {
    absl::MutexLock lock(&mu_);
    total_bytes_ -= accounted;
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", accounted, " bytes of host memory for the session"));
  }
  absl::MutexLock lock(&mu_);
  sessions_.emplace(id, session);
  return session;
}

absl::StatusOr<std::shared_ptr<StreamSession>> SessionTable::Find(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown or expired session \"", id.substr(0, 64), "\""));
  }
  return it->second;
}

void SessionTable::Erase(const std::string& id) {
  std::shared_ptr<StreamSession> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    session = std::move(it->second);
    sessions_.erase(it);
    total_bytes_ -= session->accounted_bytes();
  }
  session->Close();
}

int SessionTable::Reap(std::chrono::steady_clock::time_point now) {
  std::vector<std::shared_ptr<StreamSession>> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      const std::shared_ptr<StreamSession>& s = it->second;
      if (s->state() != StreamSession::State::kComputing &&
          now - s->last_activity() > limits_.idle_timeout) {
        total_bytes_ -= s->accounted_bytes();
        dropped.push_back(std::move(it->second));
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& s : dropped) {
    s->Close();
    spdlog::info("stream session {} dropped after {} ms idle", s->id(),
                 limits_.idle_timeout.count());
  }
  return int(dropped.size());
}

size_t SessionTable::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

int64_t SessionTable::total_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

// --- the gRPC service ---------------------------------------------------------------------------

namespace {

grpc::Status Unauthenticated() {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kUnauthenticatedMessage);
}

void SerializeTo(const google::protobuf::MessageLite& message, grpc::ByteBuffer* out) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  *out = grpc::ByteBuffer(&slice, 1);
}

class UploadReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  UploadReactor(SessionTable* table, grpc::ByteBuffer* response, bool authorized)
      : table_(table), response_(response) {
    if (!authorized) {
      Finish(Unauthenticated());
      return;
    }
    StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending (or the call broke; then Finish is moot)
      v1::UploadAck ack;
      ack.set_bytes_received(received_);
      SerializeTo(ack, response_);
      Finish(grpc::Status::OK);
      return;
    }
    ChunkHeader header;
    bool reserved = false;
    absl::Status status;
    {
      grpc::ProtoBufferReader reader(&buffer_);
      status = ParseChunk(
          &reader,
          [&](const ChunkHeader& h) -> absl::StatusOr<char*> {
            if (!session_) {
              if (h.session_id.empty()) {
                return absl::InvalidArgumentError(
                    "AttentionChunk.session_id: required in the first chunk of an Upload");
              }
              absl::StatusOr<std::shared_ptr<StreamSession>> found = table_->Find(h.session_id);
              if (!found.ok()) return found.status();
              session_ = std::move(*found);
            } else if (!h.session_id.empty() && h.session_id != session_->id()) {
              return absl::InvalidArgumentError(
                  "AttentionChunk.session_id: one Upload call carries one session");
            }
            absl::StatusOr<char*> dest = session_->Reserve(h.tensor, h.offset, h.length);
            reserved = dest.ok();
            return dest;
          },
          &header);
    }
    buffer_.Clear();
    if (reserved) {
      session_->Commit(status.ok() ? header.length : 0);
      // A reserved range that was not filled cannot be sent again: the session is unusable.
      if (!status.ok()) table_->Erase(session_->id());
    }
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    received_ += header.length;
    StartRead(&buffer_);
  }

  void OnDone() override { delete this; }

 private:
  SessionTable* const table_;
  grpc::ByteBuffer* const response_;
  grpc::ByteBuffer buffer_;
  std::shared_ptr<StreamSession> session_;
  int64_t received_ = 0;
  LiveCall live_;  // until gRPC has finished the call (OnDone)
};

class DownloadReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  static constexpr int64_t kDefaultChunk = int64_t{4} << 20;

  DownloadReactor(SessionTable* table, const grpc::ByteBuffer* request, bool authorized)
      : table_(table) {
    if (!authorized) {
      Finish(Unauthenticated());
      return;
    }
    v1::DownloadRequest parsed;
    grpc::ByteBuffer copy(*request);
    grpc::ProtoBufferReader reader(&copy);
    if (!parsed.ParseFromZeroCopyStream(&reader)) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "malformed DownloadRequest"));
      return;
    }
    absl::StatusOr<std::shared_ptr<StreamSession>> found = table_->Find(parsed.session_id());
    if (!found.ok()) {
      Finish(ToGrpcStatus(found.status()));
      return;
    }
    session_ = std::move(*found);
    absl::StatusOr<std::pair<const char*, int64_t>> span =
        session_->ReserveDownload(parsed.tensor(), parsed.offset(), parsed.length());
    if (!span.ok()) {
      Finish(ToGrpcStatus(span.status()));
      return;
    }
    tensor_ = parsed.tensor();
    base_offset_ = parsed.offset();
    data_ = span->first;
    length_ = span->second;
    chunk_ = parsed.chunk_bytes() <= 0
                 ? kDefaultChunk
                 : std::clamp<int64_t>(parsed.chunk_bytes(), 4096, int64_t{64} << 20);
    NextWrite();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "download interrupted"));
      return;
    }
    session_->Touch();
    NextWrite();
  }

  void OnDone() override {
    if (session_ && session_->FullyDownloaded()) table_->Erase(session_->id());
    delete this;
  }

 private:
  void NextWrite() {
    if (pos_ >= length_) {
      Finish(grpc::Status::OK);
      return;
    }
    const int64_t n = std::min(chunk_, length_ - pos_);
    std::string header;
    AppendChunkHeader(tensor_, base_offset_ + pos_, n, &header);
    // The data slice points into the session's output; the slice keeps the session alive.
    auto* keep = new std::shared_ptr<StreamSession>(session_);
    grpc::Slice slices[2] = {
        grpc::Slice(header),
        grpc::Slice(
            const_cast<char*>(data_ + pos_), size_t(n),
            [](void* p) { delete static_cast<std::shared_ptr<StreamSession>*>(p); }, keep)};
    buffer_ = grpc::ByteBuffer(slices, 2);
    pos_ += n;
    StartWrite(&buffer_);
  }

  SessionTable* const table_;
  std::shared_ptr<StreamSession> session_;
  int tensor_ = 0;
  int64_t base_offset_ = 0;
  const char* data_ = nullptr;
  int64_t length_ = 0, pos_ = 0, chunk_ = kDefaultChunk;
  grpc::ByteBuffer buffer_;
  LiveCall live_;  // until gRPC has finished the call (OnDone)
};

using StreamServiceBase = v1::AttentionStreamService::WithCallbackMethod_OpenSession<
    v1::AttentionStreamService::WithRawCallbackMethod_Upload<
        v1::AttentionStreamService::WithCallbackMethod_Compute<
            v1::AttentionStreamService::WithRawCallbackMethod_Download<
                v1::AttentionStreamService::WithCallbackMethod_CloseSession<
                    v1::AttentionStreamService::Service>>>>>;

class StreamService final : public StreamServiceBase {
 public:
  StreamService(AttentionRuntime* runtime, StreamLimits limits, const BearerAuth* auth)
      : runtime_(runtime),
        table_(limits, runtime->backend().staging_pool()),
        auth_(auth),
        reaper_([this] { ReapLoop(); }) {}

  ~StreamService() override {
    {
      std::lock_guard<std::mutex> lock(reaper_mu_);
      stop_ = true;
    }
    reaper_cv_.notify_all();
    reaper_.join();
  }

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::AttentionRequest* header,
                                        v1::SessionInfo* info) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!GrpcCallAuthorized(auth_, context)) {
      reactor->Finish(Unauthenticated());
      return reactor;
    }
    absl::StatusOr<std::shared_ptr<StreamSession>> session = table_.Open(*header);
    if (!session.ok()) {
      reactor->Finish(ToGrpcStatus(session.status()));
      return reactor;
    }
    // Everything but the data is checkable now (head_dim, GQA, dtype agreement, ...).
    const IoLayout& layout = (*session)->io()->layout();
    const int64_t data_bytes[3] = {int64_t(layout.q_bytes), int64_t(layout.kv_bytes),
                                   int64_t(layout.kv_bytes)};
    if (absl::StatusOr<AttentionProblem> problem =
            ValidateAttentionRequest((*session)->request, runtime_->limits(), data_bytes);
        !problem.ok()) {
      table_.Erase((*session)->id());
      reactor->Finish(ToGrpcStatus(problem.status()));
      return reactor;
    }
    info->set_session_id((*session)->id());
    info->set_idle_timeout_ms(int64_t(table_.limits().idle_timeout.count()));
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerReadReactor<grpc::ByteBuffer>* Upload(grpc::CallbackServerContext* context,
                                                    grpc::ByteBuffer* response) override {
    return new UploadReactor(&table_, response, GrpcCallAuthorized(auth_, context));
  }

  grpc::ServerUnaryReactor* Compute(grpc::CallbackServerContext* context,
                                    const v1::ComputeRequest* request,
                                    v1::AttentionResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!GrpcCallAuthorized(auth_, context)) {
      reactor->Finish(Unauthenticated());
      return reactor;
    }
    absl::StatusOr<std::shared_ptr<StreamSession>> found = table_.Find(request->session_id());
    if (!found.ok()) {
      reactor->Finish(ToGrpcStatus(found.status()));
      return reactor;
    }
    std::shared_ptr<StreamSession> session = std::move(*found);
    if (absl::Status s = session->BeginCompute(); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    const bool inline_output = request->inline_output();
    AttentionRuntime::Call call;
    call.request = &session->request;
    call.response = inline_output ? response : &session->response;
    call.io = session->io();
    const IoLayout& layout = session->io()->layout();
    call.data_bytes[0] = int64_t(layout.q_bytes);
    call.data_bytes[1] = call.data_bytes[2] = int64_t(layout.kv_bytes);
    call.received = absl::Now();
    call.deadline = ToAbslTime(context->deadline());
    call.cancelled = [context] { return context->IsCancelled(); };
    call.done = [this, reactor, session, response, inline_output](const absl::Status& status) {
      if (status.ok() && inline_output) {
        // K = 1: the output goes back in this response (one copy out of the session's buffers).
        const IoBuffers& io = *session->io();
        response->mutable_out()->set_data(io.o(), io.layout().q_bytes);
        if (io.layout().lse_bytes > 0) {
          response->mutable_lse()->set_data(reinterpret_cast<const char*>(io.lse()),
                                            io.layout().lse_bytes);
        }
      }
      if (!status.ok() || inline_output) {
        session->EndCompute(false);
        table_.Erase(session->id());
        reactor->Finish(ToGrpcStatus(status));
        return;
      }
      // The output stays in the session for Download; the response says what it is.
      const v1::AttentionResponse& full = session->response;
      response->mutable_out()->set_dtype(full.out().dtype());
      *response->mutable_out()->mutable_shape() = full.out().shape();
      if (full.has_lse()) {
        response->mutable_lse()->set_dtype(full.lse().dtype());
        *response->mutable_lse()->mutable_shape() = full.lse().shape();
      }
      *response->mutable_timing() = full.timing();
      response->set_kernel(full.kernel());
      response->set_request_id(full.request_id());
      session->EndCompute(true);
      reactor->Finish(grpc::Status::OK);
    };
    runtime_->Submit(std::move(call));
    return reactor;
  }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Download(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override {
    return new DownloadReactor(&table_, request, GrpcCallAuthorized(auth_, context));
  }

  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* /*response*/) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (!GrpcCallAuthorized(auth_, context)) {
      reactor->Finish(Unauthenticated());
      return reactor;
    }
    absl::StatusOr<std::shared_ptr<StreamSession>> found = table_.Find(request->session_id());
    if (found.ok() && (*found)->state() == StreamSession::State::kComputing) {
      // The runtime holds it; it is dropped when Compute answers (or by the idle reaper after).
      (*found)->Touch();
    } else {
      table_.Erase(request->session_id());
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  void ReapLoop() {
    const auto period = std::clamp<std::chrono::milliseconds>(table_.limits().idle_timeout / 4,
                                                              std::chrono::milliseconds(10),
                                                              std::chrono::milliseconds(1000));
    std::unique_lock<std::mutex> lock(reaper_mu_);
    while (!stop_) {
      reaper_cv_.wait_for(lock, period, [this] { return stop_; });
      if (stop_) break;
      lock.unlock();
      table_.Reap(std::chrono::steady_clock::now());
      lock.lock();
    }
  }

  AttentionRuntime* const runtime_;
  SessionTable table_;
  const BearerAuth* const auth_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  bool stop_ = false;
  std::thread reaper_;  // last: starts after everything it uses
};

}  // namespace

std::unique_ptr<grpc::Service> CreateStreamService(AttentionRuntime* runtime, StreamLimits limits,
                                                   const BearerAuth* auth) {
  return std::make_unique<StreamService>(runtime, limits, auth);
}

}  // namespace flashserve
