#include "loadgen_striped.h"

#include <algorithm>
#include <climits>
#include <future>
#include <utility>

#include "flashserve/v1/attention.grpc.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace flashserve::loadgen {

using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

namespace {

constexpr char kUpload[] = "/flashserve.v1.AttentionStreamService/Upload";
constexpr char kDownload[] = "/flashserve.v1.AttentionStreamService/Download";

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(char(v | 0x80));
    v >>= 7;
  }
  out->push_back(char(v));
}

// Client-streaming Upload over the generic API: chunk = small header slice + data slice that points
// into the request tensors (no copy on the client).
class UploadCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  std::vector<grpc::ByteBuffer> messages;
  std::promise<grpc::Status> done;

  void Start(grpc::GenericStub* stub, const std::string& token) {
    Authorize(&context_, token);
    stub->PrepareBidiStreamingCall(&context_, kUpload, grpc::StubOptions(), this);
    StartRead(&ack_);
    if (messages.empty()) {
      StartWritesDone();
    } else {
      StartWrite(&messages[0]);
    }
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return;
    if (++next_ < messages.size()) {
      StartWrite(&messages[next_]);
    } else {
      StartWritesDone();
    }
  }
  void OnReadDone(bool /*ok*/) override {}
  void OnDone(const grpc::Status& status) override { done.set_value(status); }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer ack_;
  size_t next_ = 0;
};

// Server-streaming Download: each chunk's data is copied once, into the output buffer.
class DownloadCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  DownloadCall(std::string request, char* out, int64_t out_size)
      : request_bytes_(std::move(request)), out_(out), out_size_(out_size) {}
  std::promise<grpc::Status> done;
  int64_t received = 0;
  bool bad = false;

  void Start(grpc::GenericStub* stub, const std::string& token) {
    Authorize(&context_, token);
    stub->PrepareBidiStreamingCall(&context_, kDownload, grpc::StubOptions(), this);
    request_ = StaticBuffer(request_bytes_);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&chunk_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (!Place()) bad = true;
    chunk_.Clear();
    StartRead(&chunk_);
  }
  void OnDone(const grpc::Status& status) override { done.set_value(status); }

 private:
  bool Place() {
    grpc::ProtoBufferReader reader(&chunk_);
    CodedInputStream in(&reader);
    in.SetTotalBytesLimit(INT_MAX);
    uint64_t offset = 0;
    for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
      const int field = int(WireFormatLite::GetTagFieldNumber(tag));
      if (field == 3) {
        if (!in.ReadVarint64(&offset)) return false;
      } else if (field == 4) {
        uint32_t length;
        if (!in.ReadVarint32(&length) || int64_t(offset) + int64_t(length) > out_size_) return false;
        if (!in.ReadRaw(out_ + offset, int(length))) return false;
        received += length;
      } else if (!WireFormatLite::SkipField(&in, tag)) {
        return false;
      }
    }
    return true;
  }

  grpc::ClientContext context_;
  std::string request_bytes_;
  grpc::ByteBuffer request_, chunk_;
  char* out_;
  int64_t out_size_;
};

}  // namespace

bool RunStriped(const Workload& w, std::vector<std::shared_ptr<grpc::Channel>>& channels,
                std::vector<std::unique_ptr<grpc::GenericStub>>& stubs, const std::string& token, int64_t chunk_bytes,
                std::string* output, StripedSample* sample, std::string* error) {
  const int k = int(channels.size());
  const auto t0 = Clock::now();
  auto stub = v1::AttentionStreamService::NewStub(channels[0]);
  v1::SessionInfo info;
  {
    grpc::ClientContext context;
    Authorize(&context, token);
    grpc::Status s = stub->OpenSession(&context, w.header, &info);
    if (!s.ok()) {
      *error = "OpenSession: " + s.error_message();
      return false;
    }
  }
  const auto t1 = Clock::now();
  // Chunks round-robin over the stripes; each stripe names the session in its first chunk.
  std::vector<std::unique_ptr<UploadCall>> uploads;
  for (int i = 0; i < k; ++i) uploads.push_back(std::make_unique<UploadCall>());
  const std::string* data[3] = {&w.request.q().data(), &w.request.k().data(), &w.request.v().data()};
  int next = 0;
  for (int t = 0; t < 3; ++t) {
    for (int64_t off = 0; off < int64_t(data[t]->size()); off += chunk_bytes) {
      const int64_t n = std::min<int64_t>(chunk_bytes, int64_t(data[t]->size()) - off);
      UploadCall* call = uploads[size_t(next++ % k)].get();
      std::string head;
      if (call->messages.empty()) {
        head.push_back(char((1 << 3) | 2));
        AppendVarint(info.session_id().size(), &head);
        head += info.session_id();
      }
      head.push_back(char((2 << 3) | 0));
      AppendVarint(uint64_t(t + 1), &head);
      head.push_back(char((3 << 3) | 0));
      AppendVarint(uint64_t(off), &head);
      head.push_back(char((4 << 3) | 2));
      AppendVarint(uint64_t(n), &head);
      grpc::Slice slices[2] = {
          grpc::Slice(head),
          grpc::Slice(const_cast<char*>(data[t]->data() + off), size_t(n), grpc::Slice::STATIC_SLICE)};
      call->messages.emplace_back(slices, 2);
    }
  }
  for (int i = 0; i < k; ++i) uploads[size_t(i)]->Start(stubs[size_t(i)].get(), token);
  for (auto& u : uploads) {
    grpc::Status s = u->done.get_future().get();
    if (!s.ok()) *error = "Upload: " + s.error_message();
  }
  if (!error->empty()) return false;
  const auto t2 = Clock::now();
  v1::AttentionResponse response;
  {
    v1::ComputeRequest compute;
    compute.set_session_id(info.session_id());
    compute.set_inline_output(k == 1);
    grpc::ClientContext context;
    Authorize(&context, token);
    grpc::Status s = stub->Compute(&context, compute, &response);
    if (!s.ok()) {
      *error = "Compute: " + s.error_message();
      return false;
    }
  }
  const auto t3 = Clock::now();
  const int64_t out_bytes = w.shape.tensor_bytes();
  if (k == 1) {
    *output = response.out().data();
  } else {
    output->resize(size_t(out_bytes));
    std::vector<std::unique_ptr<DownloadCall>> downloads;
    const int64_t per = (out_bytes + k - 1) / k;
    for (int i = 0; i < k; ++i) {
      const int64_t off = std::min<int64_t>(out_bytes, per * i);
      const int64_t len = std::min<int64_t>(per, out_bytes - off);
      if (len <= 0) continue;
      v1::DownloadRequest req;
      req.set_session_id(info.session_id());
      req.set_tensor(v1::TENSOR_OUT);
      req.set_offset(off);
      req.set_length(len);
      req.set_chunk_bytes(chunk_bytes);
      downloads.push_back(std::make_unique<DownloadCall>(req.SerializeAsString(), output->data(), out_bytes));
      downloads.back()->Start(stubs[size_t(i)].get(), token);
    }
    int64_t got = 0;
    for (auto& d : downloads) {
      grpc::Status s = d->done.get_future().get();
      if (!s.ok()) *error = "Download: " + s.error_message();
      if (d->bad) *error = "Download: malformed chunk";
      got += d->received;
    }
    if (error->empty() && got != out_bytes) *error = "Download: short output";
    if (!error->empty()) return false;
  }
  const auto t4 = Clock::now();
  sample->total_us = Micros(t4 - t0);
  sample->open_us = Micros(t1 - t0);
  sample->upload_us = Micros(t2 - t1);
  sample->compute_us = Micros(t3 - t2);
  sample->download_us = Micros(t4 - t3);
  const v1::Timing& t = response.timing();
  sample->timing = {t.queue_us(), t.h2d_us(), t.compute_us(), t.d2h_us(), t.total_us(), t.stage_us()};
  return true;
}

}  // namespace flashserve::loadgen
