#include "edge/grpc/stream_session.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/random_id.h"
#include "spdlog/spdlog.h"

namespace flashserve {

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
  const bool touches = (prev != ranges_.end() && prev->second == begin) ||
                       (next != ranges_.end() && next->first == end);
  if (!touches && ranges_.size() >= kMaxRanges) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "byte range [", begin, ", ", end, ") would be separate range number ", kMaxRanges + 1,
        " (at most ", kMaxRanges, "): send each stripe's chunks in order"));
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

// --- StreamSession ------------------------------------------------------------------------------

StreamSession::StreamSession(std::string id, int64_t accounted_bytes)
    : id_(std::move(id)),
      accounted_bytes_(accounted_bytes),
      last_activity_(std::chrono::steady_clock::now()) {}

StreamSession::~StreamSession() {
  io_.reset();  // the memory first, then its room
  if (room_) room_->Give(accounted_bytes_);
}

absl::Status SessionRoom::Take(int64_t bytes, const StreamLimits& limits) {
  absl::MutexLock lock(&mu_);
  if (sessions_ >= limits.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("too many open stream sessions (", limits.max_sessions,
                     ", closed ones included while their uploads or downloads still run)"));
  }
  if (limits.max_total_bytes > 0 && bytes_ > 0 && bytes_ + bytes > limits.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("stream sessions hold ", bytes_, " bytes; ",
                                                     bytes, " more would exceed the limit of ",
                                                     limits.max_total_bytes));
  }
  ++sessions_;
  bytes_ += bytes;
  return absl::OkStatus();
}

void SessionRoom::Give(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  --sessions_;
  bytes_ -= bytes;
}

int64_t SessionRoom::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

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
    return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
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

void StreamSession::AbortCompute(std::shared_ptr<IoBuffers> inputs) {
  absl::MutexLock lock(&mu_);
  if (state_ != State::kComputing) return;  // closed meanwhile (reaped, CloseSession)
  io_ = std::move(inputs);
  state_ = State::kUploading;
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
    return absl::Status(s.code(), absl::StrCat("DownloadRequest: ", s.message()));
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

// The data size a tensor header's shape and dtype imply; -1 when they are not valid (the
// validation then refuses the header before it looks at sizes).
int64_t ImpliedBytes(const v1::Tensor& t) {
  const int64_t element_size = t.dtype() == v1::FLOAT32                                ? 4
                               : t.dtype() == v1::FLOAT16 || t.dtype() == v1::BFLOAT16 ? 2
                                                                                       : 0;
  int64_t bytes = element_size;
  for (int64_t dim : t.shape()) {
    if (dim <= 0 || __builtin_mul_overflow(bytes, dim, &bytes)) return -1;
  }
  return element_size > 0 ? bytes : -1;
}

// A session header is a request without data: validated as the native API validates one
// (api/validation.h, same messages), each tensor's data taken to be the size its header implies.
absl::StatusOr<AttentionProblem> ValidateSessionHeader(const v1::AttentionRequest& header,
                                                       const ValidationLimits& limits) {
  const v1::Tensor* tensors[3] = {&header.q(), &header.k(), &header.v()};
  const char* names[3] = {"q", "k", "v"};
  int64_t data_bytes[3];
  for (int i = 0; i < 3; ++i) {
    if (!tensors[i]->data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(names[i], ".data: must be empty in OpenSession (send it with Upload)"));
    }
    // A session's tensors travel in Upload chunks and O in the answer or Download: a reference
    // here would be ignored, the region never read or written.
    if (tensors[i]->has_shm()) {
      return absl::InvalidArgumentError(absl::StrCat(
          names[i], ".shm: shared memory is not supported by the stream service (use Attention)"));
    }
    data_bytes[i] = ImpliedBytes(*tensors[i]);
  }
  if (header.has_out_shm() || header.has_lse_shm()) {
    return absl::InvalidArgumentError(absl::StrCat(
        header.has_out_shm() ? "out_shm" : "lse_shm",
        ": shared memory is not supported by the stream service (use Attention)"));
  }
  return ValidateAttentionRequest(header, limits, data_bytes);
}

}  // namespace

absl::StatusOr<std::string> NewSessionId() { return RandomHexId128("session id"); }

absl::StatusOr<std::shared_ptr<StreamSession>> SessionTable::Open(
    const v1::AttentionRequest& header) {
  // Everything is checked before anything is allocated.
  absl::StatusOr<AttentionProblem> problem = ValidateSessionHeader(header, validation_);
  if (!problem.ok()) return problem.status();
  const int64_t input = problem->q_bytes() + 2 * problem->kv_bytes();
  if (input > limits_.max_session_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session of ", input,
                     " tensor bytes exceeds --max_request_bytes=", limits_.max_session_bytes));
  }
  // Output: like q, plus the LSE (fp32, one per query row and head).
  const int64_t accounted = input + problem->out_bytes() + problem->lse_elements() * 4;
  absl::StatusOr<std::string> id = NewSessionId();
  if (!id.ok()) return id.status();
  if (absl::Status room = room_->Take(accounted, limits_); !room.ok()) return room;

  auto session = std::make_shared<StreamSession>(*id, accounted);
  session->room_ = room_;  // its room from now on, given back when it is destroyed
  session->request = header;
  session->input_bytes_ = input;
  // Outside the table lock. Pooled pinned memory when the backend has a pool: reused between
  // sessions, never zero-filled, and the GPU copies straight from it.
  session->io_ = IoBuffers::Allocate(*problem, pool_);
  if (session->io_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", accounted, " bytes of host memory for the session"));
  }
  absl::MutexLock lock(&mu_);
  sessions_.emplace(*id, session);
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

int64_t SessionTable::total_bytes() const { return room_->bytes(); }

}  // namespace flashserve
