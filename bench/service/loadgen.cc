// flashserve-loadgen: the service benchmark (issue 9).
//
// Closed-loop load over gRPC's callback API: `concurrency` requests in flight, each worker on its own
// channel (one HTTP/2 connection per worker unless --channels says otherwise), the request serialized
// once and re-sent as the same ByteBuffer (reference counted slices: the load generator copies
// nothing per call). Each response is checked (status, size) and its server timing is read by
// skipping over the tensor bytes, so the client stays cheap. For each request shape and concurrency:
//   * flashserve (AttentionService/Attention): p50/p99 latency, throughput, goodput, the server's
//     timing breakdown and server overhead = total - h2d - compute - d2h;
//   * the raw ceiling: the same request bytes to flashserve-echo, which answers with as many bytes as
//     flashserve's response had, same client, same channel settings;
//   * the load generator's own ceiling: tiny echo calls (calls/s) and its CPU use per cell;
//   * the striped streaming path (AttentionStreamService) at concurrency 1 with K channels.
// Writes a CSV (one row per cell) and markdown tables.
//
//   flashserve-loadgen --target=127.0.0.1:8001 --echo=127.0.0.1:9000 [--shapes=small,medium,large]
//     [--concurrency=1,4,16,64] [--duration_s=2] [--min_requests=3] [--large_max_concurrency=16]
//     [--stripes=1,2,4,8] [--stripe_reps=5] [--striped_shapes=medium,large] [--chunk_mib=4] [--channels=0]
//     [--csv=FILE] [--md=FILE]
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdarg>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flashserve/v1/attention.grpc.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace {

using Clock = std::chrono::steady_clock;
using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;
namespace v1 = flashserve::v1;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// --- flags --------------------------------------------------------------------------------------

std::map<std::string, std::string> g_flags;
std::string Flag(const std::string& name, const std::string& def) {
  auto it = g_flags.find(name);
  return it == g_flags.end() ? def : it->second;
}
double FlagD(const std::string& name, double def) {
  auto it = g_flags.find(name);
  return it == g_flags.end() ? def : std::atof(it->second.c_str());
}
std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    if (!part.empty()) out.push_back(part);
  }
  return out;
}

// --- shapes and requests ------------------------------------------------------------------------

struct Shape {
  std::string name;
  int64_t batch, seqlen, heads, head_dim;
  int64_t tensor_bytes() const { return batch * seqlen * heads * head_dim * 2; }  // bf16
};

const std::vector<Shape> kShapes = {
    {"small", 1, 128, 8, 64},
    {"medium", 1, 2048, 32, 128},
    {"large", 4, 4096, 32, 128},
};

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return uint16_t(bits >> 16);
}

// Random N(0,1) bf16 values (never zeros, never NaN patterns).
std::string RandomBf16(int64_t bytes, uint64_t seed) {
  std::string out(size_t(bytes), '\0');
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  // A 64 Ki-value table repeated with a per-block rotation keeps this fast for 128 MiB tensors.
  std::vector<uint16_t> table(65536);
  for (auto& v : table) v = ToBf16(normal(rng));
  auto* p = reinterpret_cast<uint16_t*>(out.data());
  const int64_t n = bytes / 2;
  for (int64_t i = 0; i < n; ++i) p[i] = table[(i + (i >> 16) * 7919) & 65535];
  return out;
}

struct Workload {
  Shape shape;
  v1::AttentionRequest request;  // with data
  v1::AttentionRequest header;   // without tensor data (the striped path's OpenSession)
  std::string serialized;        // the request on the wire
  double serialize_us = 0;       // client: AttentionRequest -> bytes, once
  double parse_us = 0;           // the same bytes parsed back (what the server edge does)
};

std::unique_ptr<Workload> MakeWorkload(const Shape& shape) {
  auto w = std::make_unique<Workload>();
  w->shape = shape;
  v1::Tensor* tensors[3] = {w->request.mutable_q(), w->request.mutable_k(), w->request.mutable_v()};
  for (int i = 0; i < 3; ++i) {
    tensors[i]->set_dtype(v1::BFLOAT16);
    for (int64_t d : {shape.batch, shape.seqlen, shape.heads, shape.head_dim}) tensors[i]->add_shape(d);
    *tensors[i]->mutable_data() = RandomBf16(shape.tensor_bytes(), 1234 + uint64_t(i));
  }
  w->request.set_request_id("loadgen-" + shape.name);
  for (int i = 0; i < 3; ++i) {
    const v1::Tensor& t = i == 0 ? w->request.q() : i == 1 ? w->request.k() : w->request.v();
    v1::Tensor* h = i == 0 ? w->header.mutable_q() : i == 1 ? w->header.mutable_k() : w->header.mutable_v();
    h->set_dtype(t.dtype());
    *h->mutable_shape() = t.shape();
  }
  w->header.set_request_id(w->request.request_id());
  auto t0 = Clock::now();
  w->request.SerializeToString(&w->serialized);
  w->serialize_us = Micros(Clock::now() - t0);
  v1::AttentionRequest parsed;
  t0 = Clock::now();
  parsed.ParseFromString(w->serialized);
  w->parse_us = Micros(Clock::now() - t0);
  return w;
}

grpc::ByteBuffer StaticBuffer(const std::string& bytes) {
  grpc::Slice slice(const_cast<char*>(bytes.data()), bytes.size(), grpc::Slice::STATIC_SLICE);
  return grpc::ByteBuffer(&slice, 1);
}

// Reads AttentionResponse.timing (field 3) out of a response without copying the tensor bytes.
bool ParseTiming(grpc::ByteBuffer* buffer, int64_t timing[6]) {
  grpc::ProtoBufferReader reader(buffer);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  bool found = false;
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == 3 &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length;
      if (!in.ReadVarint32(&length)) return false;
      auto limit = in.PushLimit(int(length));
      for (uint32_t t = in.ReadTag(); t != 0; t = in.ReadTag()) {
        const int field = int(WireFormatLite::GetTagFieldNumber(t));
        uint64_t value;
        if (WireFormatLite::GetTagWireType(t) != WireFormatLite::WIRETYPE_VARINT || !in.ReadVarint64(&value)) {
          return false;
        }
        if (field >= 1 && field <= 6) timing[field - 1] = int64_t(value);
      }
      in.PopLimit(limit);
      found = true;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  return found;
}

// --- channels -----------------------------------------------------------------------------------

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT_MAX);
  args.SetMaxSendMessageSize(INT_MAX);
  args.SetInt("flashserve.loadgen.channel", index);  // distinct args: a connection of its own
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return channel;
}

struct Pool {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  Pool(const std::string& target, int n) {
    for (int i = 0; i < n; ++i) {
      channels.push_back(MakeChannel(target, i));
      stubs.push_back(std::make_unique<grpc::GenericStub>(channels.back()));
    }
  }
};

// --- closed-loop cell ---------------------------------------------------------------------------

struct CellResult {
  std::string target, shape;
  int concurrency = 0, channels = 0;
  int64_t ok = 0, errors = 0;
  std::string first_error;
  double wall_s = 0, cpu_s = 0;
  int64_t request_bytes = 0, response_bytes = 0;
  std::vector<double> latency_us;
  std::vector<std::array<int64_t, 6>> timings;  // queue, h2d, compute, d2h, total, stage
};

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct CellSpec {
  std::string target_name, method;
  const std::string* request = nullptr;
  int64_t echo_response_bytes = -1;  // >= 0: ask the echo server for this many bytes
  int concurrency = 1;
  double duration_s = 2;
  int min_requests = 3, max_requests = 1 << 30;
  bool read_timing = false;
};

class Cell {
 public:
  Cell(Pool* pool, const CellSpec& spec) : pool_(pool), spec_(spec), master_(StaticBuffer(*spec.request)) {}

  CellResult Run() {
    const int n = spec_.concurrency;
    workers_.resize(size_t(n));
    cpu0_ = CpuSeconds();
    start_ = Clock::now();
    end_ = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spec_.duration_s));
    for (int i = 0; i < n; ++i) {
      workers_[size_t(i)].stub = pool_->stubs[size_t(i) % pool_->stubs.size()].get();
      Start(&workers_[size_t(i)]);
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return finished_ == n; });
    }
    CellResult r;
    r.wall_s = Seconds(Clock::now() - start_);
    r.cpu_s = CpuSeconds() - cpu0_;
    r.target = spec_.target_name;
    r.concurrency = n;
    r.channels = int(std::min<size_t>(size_t(n), pool_->stubs.size()));
    r.request_bytes = int64_t(spec_.request->size());
    for (Worker& w : workers_) {
      r.ok += w.ok;
      r.errors += w.errors;
      if (r.first_error.empty()) r.first_error = w.first_error;
      r.latency_us.insert(r.latency_us.end(), w.latency_us.begin(), w.latency_us.end());
      r.timings.insert(r.timings.end(), w.timings.begin(), w.timings.end());
      r.response_bytes = std::max(r.response_bytes, w.response_bytes);
    }
    return r;
  }

 private:
  struct Worker {
    grpc::GenericStub* stub = nullptr;
    std::unique_ptr<grpc::ClientContext> context;
    grpc::ByteBuffer request, response;
    Clock::time_point t0;
    int64_t ok = 0, errors = 0, response_bytes = 0;
    std::string first_error;
    std::vector<double> latency_us;
    std::vector<std::array<int64_t, 6>> timings;
  };

  void Start(Worker* w) {
    w->context = std::make_unique<grpc::ClientContext>();
    if (spec_.echo_response_bytes >= 0) {
      w->context->AddMetadata("x-response-bytes", std::to_string(spec_.echo_response_bytes));
    }
    w->request = master_;
    w->response.Clear();
    w->t0 = Clock::now();
    w->stub->UnaryCall(w->context.get(), spec_.method, grpc::StubOptions(), &w->request, &w->response,
                       [this, w](grpc::Status status) { Done(w, status); });
  }

  void Done(Worker* w, const grpc::Status& status) {
    const Clock::time_point t1 = Clock::now();
    if (status.ok()) {
      ++w->ok;
      w->latency_us.push_back(Micros(t1 - w->t0));
      w->response_bytes = int64_t(w->response.Length());
      if (spec_.read_timing) {
        std::array<int64_t, 6> t{};
        if (ParseTiming(&w->response, t.data())) w->timings.push_back(t);
      }
    } else {
      ++w->errors;
      if (w->first_error.empty()) {
        w->first_error = std::to_string(int(status.error_code())) + ": " + status.error_message();
      }
    }
    w->response.Clear();
    const int64_t done = ++completed_;
    const bool more = done < spec_.max_requests &&
                      (t1 < end_ || done + int64_t(spec_.concurrency) <= int64_t(spec_.min_requests)) &&
                      w->errors < 100;
    if (more) {
      Start(w);
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      if (++finished_ == spec_.concurrency) cv_.notify_all();
    }
  }

  Pool* pool_;
  const CellSpec spec_;
  grpc::ByteBuffer master_;
  std::vector<Worker> workers_;
  std::atomic<int64_t> completed_{0};
  Clock::time_point start_, end_;
  double cpu0_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  int finished_ = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = p * double(v.size() - 1);
  const size_t lo = size_t(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

std::vector<double> Column(const CellResult& r, int index) {
  std::vector<double> out;
  for (const auto& t : r.timings) out.push_back(double(t[size_t(index)]));
  return out;
}

std::vector<double> Overhead(const CellResult& r, bool minus_stage = false) {
  std::vector<double> out;
  for (const auto& t : r.timings) out.push_back(double(t[4] - t[1] - t[2] - t[3] - (minus_stage ? t[5] : 0)));
  return out;
}

// --- striped streaming path ---------------------------------------------------------------------

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

  void Start(grpc::GenericStub* stub) {
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

  void Start(grpc::GenericStub* stub) {
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

struct StripedSample {
  double total_us, open_us, upload_us, compute_us, download_us;
  std::array<int64_t, 6> timing;
};

// One striped request: Open, K uploads in parallel, Compute, K downloads in parallel.
bool RunStriped(const Workload& w, std::vector<std::shared_ptr<grpc::Channel>>& channels,
                std::vector<std::unique_ptr<grpc::GenericStub>>& stubs, int64_t chunk_bytes,
                std::string* output, StripedSample* sample, std::string* error) {
  const int k = int(channels.size());
  const auto t0 = Clock::now();
  auto stub = v1::AttentionStreamService::NewStub(channels[0]);
  v1::SessionInfo info;
  {
    grpc::ClientContext context;
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
  for (int i = 0; i < k; ++i) uploads[size_t(i)]->Start(stubs[size_t(i)].get());
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
      downloads.back()->Start(stubs[size_t(i)].get());
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

std::string Fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string Fmt(const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  return buffer;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0 || arg.find('=') == std::string::npos) {
      std::fprintf(stderr, "usage: see the header of bench/service/loadgen.cc (bad argument %s)\n", argv[i]);
      return 2;
    }
    g_flags[arg.substr(2, arg.find('=') - 2)] = arg.substr(arg.find('=') + 1);
  }
  const std::string target = Flag("target", "127.0.0.1:8001");
  const std::string echo = Flag("echo", "");
  const double duration = FlagD("duration_s", 2);
  const int min_requests = int(FlagD("min_requests", 3));
  const int large_max_conc = int(FlagD("large_max_concurrency", 16));
  const int stripe_reps = int(FlagD("stripe_reps", 5));
  const int64_t chunk_bytes = int64_t(FlagD("chunk_mib", 4) * (1 << 20));
  std::vector<int> concurrency;
  for (const std::string& c : Split(Flag("concurrency", "1,4,16,64"))) concurrency.push_back(std::atoi(c.c_str()));
  std::vector<int> stripes;
  for (const std::string& s : Split(Flag("stripes", "1,2,4,8"))) stripes.push_back(std::atoi(s.c_str()));
  const int max_conc = *std::max_element(concurrency.begin(), concurrency.end());
  const int channels_flag = int(FlagD("channels", 0));
  const int pool_size = channels_flag > 0 ? channels_flag : max_conc;

  std::fprintf(stderr, "loadgen: %d channels to %s%s%s\n", pool_size, target.c_str(),
               echo.empty() ? "" : " and to echo ", echo.c_str());
  Pool server(target, pool_size);
  std::unique_ptr<Pool> echo_pool;
  if (!echo.empty()) echo_pool = std::make_unique<Pool>(echo, pool_size);

  std::ofstream csv(Flag("csv", "service.csv"));
  csv << "target,shape,concurrency,channels,ok,errors,wall_s,req_per_s,p50_us,p99_us,request_bytes,response_bytes,"
         "goodput_p50_GBps,goodput_agg_GBps,queue_p50_us,h2d_p50_us,compute_p50_us,d2h_p50_us,total_p50_us,"
         "overhead_p50_us,overhead_p99_us,client_cpu_cores,first_error,stage_p50_us,overhead_excl_stage_p50_us\n";
  std::ostringstream md;
  std::ostringstream breakdown;

  // The load generator's own ceiling: tiny calls to the echo server.
  if (echo_pool) {
    md << "### Load generator ceiling (tiny echo calls, 64 B each way)\n\n"
          "| concurrency | calls/s | p50 us | p99 us | client CPU cores |\n|---|---|---|---|---|\n";
    const std::string tiny(64, 'x');
    for (int c : concurrency) {
      CellSpec spec{"echo-tiny", "/flashserve.bench.Echo/Echo", &tiny, 64, c, duration, min_requests, 1 << 30, false};
      Cell cell(echo_pool.get(), spec);
      CellResult r = cell.Run();
      md << Fmt("| %d | %.0f | %.0f | %.0f | %.2f |\n", c, double(r.ok) / r.wall_s, Percentile(r.latency_us, 0.5),
                Percentile(r.latency_us, 0.99), r.cpu_s / r.wall_s);
    }
    md << "\n";
  }

  md << "### Unary AttentionService/Attention vs raw gRPC echo of the same bytes\n\n"
        "Goodput = (request + response bytes) / latency (p50; `agg` = bytes x calls/s over all workers). "
        "Overhead = server total - h2d - compute - d2h (queue and the host staging copy included); stage = the "
        "server's one host copy of the request tensors (receive slices -> pinned buffers), part of the overhead. "
        "Kernel = server-reported compute_us p50. Ratio (p50) = echo p50 / flashserve p50 (goodput ratio of the same "
        "bytes at the median); ratio (agg) = aggregate throughput ratio.\n\n"
        "| shape | conc | calls/s | p50 ms | p99 ms | goodput GB/s (p50) | agg GB/s | echo p50 ms | echo agg GB/s | "
        "ratio (p50) | ratio (agg) | overhead p50 us | stage p50 us | overhead - stage p50 us | h2d p50 us | "
        "kernel p50 us | d2h p50 us | client CPU cores | errors |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

  std::vector<std::unique_ptr<Workload>> workloads;
  for (const std::string& name : Split(Flag("shapes", "small,medium,large"))) {
    const Shape* shape = nullptr;
    for (const Shape& s : kShapes) {
      if (s.name == name) shape = &s;
    }
    if (shape == nullptr) {
      std::fprintf(stderr, "unknown shape %s\n", name.c_str());
      return 2;
    }
    workloads.push_back(MakeWorkload(*shape));
    const Workload& w = *workloads.back();
    std::fprintf(stderr, "shape %s: request %zu bytes (serialize %.0f us, parse %.0f us)\n", name.c_str(),
                 w.serialized.size(), w.serialize_us, w.parse_us);

    // Warm-up (first CUDA use of this shape, connection windows), and the response size.
    int64_t response_bytes = 0;
    {
      CellSpec warm{"flashserve", "/flashserve.v1.AttentionService/Attention", &w.serialized, -1, 1, 0, 2, 2, true};
      Cell cell(&server, warm);
      CellResult r = cell.Run();
      if (r.ok == 0) {
        std::fprintf(stderr, "warm-up failed: %s\n", r.first_error.c_str());
        return 1;
      }
      response_bytes = r.response_bytes;
    }
    // Both targets then get the same unmeasured second of this shape on the first channel (the one c=1 cells use):
    // HTTP/2 flow-control windows grow with the bytes a connection has carried (BDP probing), and a channel that
    // has only seen small requests starts a medium one cold -- which used to favour whichever target went second.
    {
      CellSpec warm{"flashserve", "/flashserve.v1.AttentionService/Attention", &w.serialized, -1, 1, 1.0, 2,
                    1 << 30, false};
      Cell(&server, warm).Run();
      if (echo_pool) {
        CellSpec ewarm{"echo", "/flashserve.bench.Echo/Echo", &w.serialized, response_bytes, 1, 1.0, 2, 1 << 30,
                       false};
        Cell(echo_pool.get(), ewarm).Run();
      }
    }
    // Response parse cost on the client (one AttentionResponse of that size), for the breakdown.
    double response_parse_us = 0;
    {
      v1::AttentionResponse resp;
      resp.mutable_out()->set_dtype(v1::BFLOAT16);
      *resp.mutable_out()->mutable_data() = w.request.q().data();
      const std::string bytes = resp.SerializeAsString();
      v1::AttentionResponse back;
      const auto t0 = Clock::now();
      back.ParseFromString(bytes);
      response_parse_us = Micros(Clock::now() - t0);
    }

    for (int c : concurrency) {
      if (shape->name == "large" && c > large_max_conc) continue;
      if (c > 1) {
        // One request per worker, all in flight at once, unmeasured: each holds its own pinned buffer, and
        // pinning a new one (cudaHostAlloc, ~0.3 s per GiB) belongs to the server's warm-up, not to the cell.
        CellSpec warm_c{"flashserve", "/flashserve.v1.AttentionService/Attention", &w.serialized, -1, c, 0, c, c,
                        false};
        Cell(&server, warm_c).Run();
      }
      CellSpec spec{"flashserve", "/flashserve.v1.AttentionService/Attention", &w.serialized, -1, c, duration,
                    min_requests, 1 << 30, true};
      Cell cell(&server, spec);
      CellResult r = cell.Run();
      r.shape = name;
      CellResult e;
      if (echo_pool) {
        CellSpec espec{"echo", "/flashserve.bench.Echo/Echo", &w.serialized, response_bytes, c, duration,
                       min_requests, 1 << 30, false};
        Cell ecell(echo_pool.get(), espec);
        e = ecell.Run();
        e.shape = name;
      }
      const double bytes = double(r.request_bytes + r.response_bytes);
      auto write_csv = [&](const CellResult& x) {
        const double b = double(x.request_bytes + x.response_bytes);
        csv << x.target << ',' << x.shape << ',' << x.concurrency << ',' << x.channels << ',' << x.ok << ','
            << x.errors << ',' << x.wall_s << ',' << double(x.ok) / x.wall_s << ',' << Percentile(x.latency_us, 0.5)
            << ',' << Percentile(x.latency_us, 0.99) << ',' << x.request_bytes << ',' << x.response_bytes << ','
            << b / (Percentile(x.latency_us, 0.5) * 1e3) << ',' << b * double(x.ok) / x.wall_s / 1e9 << ','
            << Percentile(Column(x, 0), 0.5) << ',' << Percentile(Column(x, 1), 0.5) << ','
            << Percentile(Column(x, 2), 0.5) << ',' << Percentile(Column(x, 3), 0.5) << ','
            << Percentile(Column(x, 4), 0.5) << ',' << Percentile(Overhead(x), 0.5) << ','
            << Percentile(Overhead(x), 0.99) << ',' << x.cpu_s / x.wall_s << ",\"" << x.first_error << "\","
            << Percentile(Column(x, 5), 0.5) << ',' << Percentile(Overhead(x, true), 0.5) << "\n";
      };
      write_csv(r);
      if (echo_pool) write_csv(e);
      csv.flush();
      const double p50 = Percentile(r.latency_us, 0.5);
      const double agg = bytes * double(r.ok) / r.wall_s / 1e9;
      const double eagg = echo_pool ? bytes * double(e.ok) / e.wall_s / 1e9 : 0;
      const double ep50 = echo_pool ? Percentile(e.latency_us, 0.5) : 0.0;
      md << Fmt("| %s | %d | %.1f | %.3f | %.3f | %.2f | %.2f | %.3f | %.2f | %.2f | %.2f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %lld |\n",
                name.c_str(), c, double(r.ok) / r.wall_s, p50 / 1e3, Percentile(r.latency_us, 0.99) / 1e3,
                bytes / (p50 * 1e3), agg, ep50 / 1e3, eagg, ep50 > 0 ? ep50 / p50 : 0.0,
                eagg > 0 ? agg / eagg : 0.0, Percentile(Overhead(r), 0.5), Percentile(Column(r, 5), 0.5),
                Percentile(Overhead(r, true), 0.5), Percentile(Column(r, 1), 0.5),
                Percentile(Column(r, 2), 0.5), Percentile(Column(r, 3), 0.5), r.cpu_s / r.wall_s,
                (long long)(r.errors));
      std::fprintf(stderr, "%s c=%d: %lld ok %lld err, p50 %.3f ms, agg %.2f GB/s (echo %.2f) %s\n", name.c_str(), c,
                   (long long)r.ok, (long long)r.errors, p50 / 1e3, agg, eagg, r.first_error.c_str());
      if (c == 1) {
        const double total_ms = Percentile(Column(r, 4), 0.5) / 1e3;
        const double echo_ms = echo_pool ? Percentile(e.latency_us, 0.5) / 1e3 : 0.0;
        breakdown << Fmt(
            "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f | %.1f |\n",
            name.c_str(), p50 / 1e3, echo_ms, total_ms, Percentile(Column(r, 5), 0.5) / 1e3,
            Percentile(Column(r, 0), 0.5) / 1e3, Percentile(Column(r, 1), 0.5) / 1e3,
            Percentile(Column(r, 2), 0.5) / 1e3, Percentile(Column(r, 3), 0.5) / 1e3,
            (Percentile(Overhead(r, true), 0.5) - Percentile(Column(r, 0), 0.5)) / 1e3,
            p50 / 1e3 - total_ms - echo_ms, w.serialize_us / 1e3,
            response_parse_us / 1e3);
      }
    }
  }
  md << "\n### Where the time goes at concurrency 1 (ms, p50)\n\n"
        "Echo = the raw gRPC round trip of the same bytes (the transport's share). Server total (handler entry -> "
        "answer ready) = stage (one host copy of Q/K/V from the receive slices into pinned buffers) + queue + h2d + "
        "kernel + d2h + rest; the server sends O from those buffers without a copy. Unexplained = latency - server "
        "total - echo (transport variation between the two cells). Not in the loop: what a real client adds to "
        "build its message (client serialize, here done once) and read O (client parse; this load generator skips "
        "the tensor bytes).\n\n"
        "| shape | latency | echo | server total | stage | queue | h2d | kernel | d2h | rest | unexplained | "
        "(client serialize) | (client parse) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
     << breakdown.str();

  // Striped streaming path vs unary at concurrency 1.
  if (!stripes.empty() && stripe_reps > 0) {
    md << "\n### Striped streaming (AttentionStreamService) vs unary, concurrency 1\n\n"
          "K channels (one connection each); request chunks of "
       << Fmt("%.2f", double(chunk_bytes) / (1 << 20))
       << " MiB round-robin over the K Upload streams; O downloaded as K ranges (K=1: O inline in the Compute "
          "response). p50 over the reps.\n\n"
          "| shape | K | p50 ms | goodput GB/s | open ms | upload ms | compute RPC ms | download ms | server total ms "
          "| h2d ms | kernel ms | d2h ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& wp : workloads) {
      const Workload& w = *wp;
      const std::vector<std::string> striped_shapes = Split(Flag("striped_shapes", "medium,large"));
      if (std::find(striped_shapes.begin(), striped_shapes.end(), w.shape.name) == striped_shapes.end()) continue;
      for (int k : stripes) {
        std::vector<std::shared_ptr<grpc::Channel>> chans;
        std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
        for (int i = 0; i < k; ++i) {
          chans.push_back(MakeChannel(target, 1000 + i));
          stubs.push_back(std::make_unique<grpc::GenericStub>(chans.back()));
        }
        std::vector<StripedSample> samples;
        std::string output, error;
        for (int rep = 0; rep < stripe_reps + 1; ++rep) {  // first one warms the connections
          StripedSample s{};
          if (!RunStriped(w, chans, stubs, chunk_bytes, &output, &s, &error)) break;
          if (rep > 0) samples.push_back(s);
        }
        if (!error.empty()) {
          std::fprintf(stderr, "striped %s K=%d failed: %s\n", w.shape.name.c_str(), k, error.c_str());
          md << "| " << w.shape.name << " | " << k << " | failed: " << error << " |\n";
          continue;
        }
        auto p50 = [&](auto get) {
          std::vector<double> v;
          for (const auto& s : samples) v.push_back(get(s));
          return Percentile(v, 0.5);
        };
        const double total = p50([](const StripedSample& s) { return s.total_us; });
        const double bytes = double(3 * w.shape.tensor_bytes() + w.shape.tensor_bytes());
        md << Fmt("| %s | %d | %.1f | %.2f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                  w.shape.name.c_str(), k, total / 1e3, bytes / (total * 1e3),
                  p50([](const StripedSample& s) { return s.open_us; }) / 1e3,
                  p50([](const StripedSample& s) { return s.upload_us; }) / 1e3,
                  p50([](const StripedSample& s) { return s.compute_us; }) / 1e3,
                  p50([](const StripedSample& s) { return s.download_us; }) / 1e3,
                  p50([](const StripedSample& s) { return double(s.timing[4]); }) / 1e3,
                  p50([](const StripedSample& s) { return double(s.timing[1]); }) / 1e3,
                  p50([](const StripedSample& s) { return double(s.timing[2]); }) / 1e3,
                  p50([](const StripedSample& s) { return double(s.timing[3]); }) / 1e3);
        std::fprintf(stderr, "striped %s K=%d: p50 %.1f ms, %.2f GB/s\n", w.shape.name.c_str(), k, total / 1e3,
                     bytes / (total * 1e3));
      }
    }
  }
  const std::string md_text = md.str();
  std::ofstream(Flag("md", "service.md")) << md_text;
  std::printf("%s", md_text.c_str());
  return 0;
}
