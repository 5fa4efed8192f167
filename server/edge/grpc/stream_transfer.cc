#include "edge/grpc/stream_transfer.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/live_calls.h"
#include "edge/grpc/read_end.h"
#include "edge/grpc/stream_chunk.h"
#include "flashserve/v1/attention.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace flashserve {
namespace {

void SerializeTo(const google::protobuf::MessageLite& message, grpc::ByteBuffer* out) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  *out = grpc::ByteBuffer(&slice, 1);
}

class UploadReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  UploadReactor(grpc::CallbackServerContext* context, SessionTable* table,
                grpc::ByteBuffer* response, ServerMetrics* metrics)
      : context_(context),
        table_(table),
        response_(response),
        call_(metrics, grpc_methods::kUpload) {
    call_.Start();
    StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      EndOfChunks();
      return;
    }
    call_.AddBytesIn(int64_t(buffer_.Length()));
    Chunk();
  }

  void OnDone() override {
    if (count_when_done_) {
      call_.Finish(AnsweredCallWasOverSizeLimit(context_) ? OverSizeLimit() : absl::OkStatus());
    }
    delete this;
  }

 private:
  static absl::Status OverSizeLimit() {
    return OverSizeLimitStatus("flashserve.v1.AttentionChunk");
  }

  // The client's stream ended (edge/grpc/read_end.h). After a half-close the ack goes out, counted
  // OK once gRPC is done with the call -- unless gRPC cancelled it meanwhile: a chunk over
  // --max_request_bytes ends the read the same way (it was counted OK).
  void EndOfChunks() {
    switch (ClassifyReadEnd(context_)) {
      case ReadEnd::kDeadlinePassed:
        Finish(call_.Finish(absl::DeadlineExceededError("upload: the deadline passed")));
        return;
      case ReadEnd::kStreamBroke:
        Finish(call_.Finish(absl::CancelledError("upload cancelled")));
        return;
      case ReadEnd::kOverSizeLimit:
        Finish(call_.Finish(OverSizeLimit()));
        return;
      case ReadEnd::kHalfClosed:
        break;
    }
    v1::UploadAck ack;
    ack.set_bytes_received(received_);
    SerializeTo(ack, response_);
    call_.AddBytesOut(int64_t(response_->Length()));
    count_when_done_ = true;
    Finish(grpc::Status::OK);
  }

  // Copies the chunk just read into its session; reads the next one or ends the call. Between
  // chunks the call holds its session weakly: one closed or reaped meanwhile is gone (an Upload
  // left open must not keep its memory past the session table's limits).
  void Chunk() {
    ChunkHeader header;
    bool reserved = false;
    absl::Status status;
    std::shared_ptr<StreamSession> session = session_.lock();
    {
      grpc::ProtoBufferReader reader(&buffer_);
      status = ParseChunk(
          &reader,
          [&](const ChunkHeader& h) -> absl::StatusOr<char*> {
            if (session_id_.empty()) {
              if (h.session_id.empty()) {
                return absl::InvalidArgumentError(
                    "AttentionChunk.session_id: required in the first chunk of an Upload");
              }
              absl::StatusOr<std::shared_ptr<StreamSession>> found = table_->Find(h.session_id);
              if (!found.ok()) return found.status();
              session = std::move(*found);
              session_ = session;
              session_id_ = session->id();
              call_.set_session_id(session_id_);
            } else if (!h.session_id.empty() && h.session_id != session_id_) {
              return absl::InvalidArgumentError(
                  "AttentionChunk.session_id: one Upload call carries one session");
            } else if (session == nullptr) {
              return absl::NotFoundError(absl::StrCat(
                  "session \"", session_id_, "\" was closed or expired during this Upload"));
            }
            absl::StatusOr<char*> dest = session->Reserve(h.tensor, h.offset, h.length);
            reserved = dest.ok();
            return dest;
          },
          &header);
    }
    buffer_.Clear();
    if (reserved) {
      session->Commit(status.ok() ? header.length : 0);
      // A reserved range that was not filled cannot be sent again: the session is unusable.
      if (!status.ok()) table_->Erase(session->id());
    }
    if (!status.ok()) {
      Finish(call_.Finish(status));
      return;
    }
    received_ += header.length;
    StartRead(&buffer_);
  }

  grpc::CallbackServerContext* const context_;
  SessionTable* const table_;
  grpc::ByteBuffer* const response_;
  grpc::ByteBuffer buffer_;
  std::weak_ptr<StreamSession> session_;
  std::string session_id_;  // set by the first chunk
  int64_t received_ = 0;
  bool count_when_done_ = false;  // EndOfChunks answered OK; OnDone counts the call
  GrpcCall call_;  // metrics, failure log, status conversion
  LiveCall live_;  // until gRPC has finished the call (OnDone)
};

class DownloadReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  DownloadReactor(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                  SessionTable* table, ServerMetrics* metrics)
      : context_(context), table_(table), call_(metrics, grpc_methods::kDownload) {
    call_.Start(int64_t(request->Length()));
    if (absl::Status s = Begin(request); !s.ok()) {
      Finish(call_.Finish(s));
      return;
    }
    NextWrite();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(call_.Finish(absl::CancelledError("download interrupted")));
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
  // Parses the request and reserves the range it asks for.
  absl::Status Begin(const grpc::ByteBuffer* request) {
    v1::DownloadRequest parsed;
    if (absl::Status s = ParseRequest(*request, &parsed); !s.ok()) return s;
    call_.set_session_id(parsed.session_id());
    // Before the range is reserved: a reserved byte cannot be downloaded again.
    absl::StatusOr<int64_t> chunk = DownloadChunkBytes(parsed.chunk_bytes());
    if (!chunk.ok()) return chunk.status();
    absl::StatusOr<std::shared_ptr<StreamSession>> found = table_->Find(parsed.session_id());
    if (!found.ok()) return found.status();
    session_ = std::move(*found);
    absl::StatusOr<std::pair<const char*, int64_t>> span =
        session_->ReserveDownload(parsed.tensor(), parsed.offset(), parsed.length());
    if (!span.ok()) return span.status();
    tensor_ = parsed.tensor();
    base_offset_ = parsed.offset();
    data_ = span->first;
    length_ = span->second;
    chunk_ = *chunk;
    return absl::OkStatus();
  }

  void NextWrite() {
    if (pos_ >= length_) {
      // Before the status goes out (OnDone runs after the client may have it): a client that has
      // the whole output must find the session gone.
      if (session_->FullyDownloaded()) table_->Erase(session_->id());
      Finish(call_.Finish(absl::OkStatus()));
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
    call_.AddBytesOut(int64_t(buffer_.Length()));
    pos_ += n;
    // A write the client never takes held its slice -- the session's slot and bytes -- forever:
    // the reaper drops a session from the table, not from its room (audit, session 47).
    live_.WriteHandedOver(context_);
    StartWrite(&buffer_);
  }

  grpc::CallbackServerContext* const context_;
  SessionTable* const table_;
  std::shared_ptr<StreamSession> session_;
  int tensor_ = 0;
  int64_t base_offset_ = 0;
  const char* data_ = nullptr;
  int64_t length_ = 0, pos_ = 0, chunk_ = kDefaultDownloadChunkBytes;
  grpc::ByteBuffer buffer_;
  GrpcCall call_;  // metrics, failure log, status conversion
  LiveCall live_;  // until gRPC has finished the call (OnDone)
};

}  // namespace

absl::StatusOr<int64_t> DownloadChunkBytes(int64_t requested) {
  if (requested == 0) return kDefaultDownloadChunkBytes;
  if (requested < kMinDownloadChunkBytes || requested > kMaxDownloadChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DownloadRequest.chunk_bytes: ", requested, " is outside [", kMinDownloadChunkBytes, ", ",
        kMaxDownloadChunkBytes, "] (0: the default, ", kDefaultDownloadChunkBytes, ")"));
  }
  return requested;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* NewUploadReactor(grpc::CallbackServerContext* context,
                                                            SessionTable* table,
                                                            grpc::ByteBuffer* response,
                                                            ServerMetrics* metrics) {
  return new UploadReactor(context, table, response, metrics);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* NewDownloadReactor(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request, SessionTable* table,
    ServerMetrics* metrics) {
  return new DownloadReactor(context, request, table, metrics);
}

}  // namespace flashserve
