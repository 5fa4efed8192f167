#include "loadgen_workload.h"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace flashserve::loadgen {

using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

// --- shapes and requests ------------------------------------------------------------------------

const std::vector<Shape> kShapes = {
    {"small", 1, 128, 8, 64},
    {"medium", 1, 2048, 32, 128},
    {"large", 4, 4096, 32, 128},
};

namespace {

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

}  // namespace

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

namespace {

// Reads AttentionResponse.timing (field 3) from `in`, skipping every other field.
bool ParseTimingFrom(CodedInputStream* in, int64_t timing[6]) {
  bool found = false;
  for (uint32_t tag = in->ReadTag(); tag != 0; tag = in->ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == 3 &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length;
      if (!in->ReadVarint32(&length)) return false;
      auto limit = in->PushLimit(int(length));
      for (uint32_t t = in->ReadTag(); t != 0; t = in->ReadTag()) {
        const int field = int(WireFormatLite::GetTagFieldNumber(t));
        uint64_t value;
        if (WireFormatLite::GetTagWireType(t) != WireFormatLite::WIRETYPE_VARINT || !in->ReadVarint64(&value)) {
          return false;
        }
        if (field >= 1 && field <= 6) timing[field - 1] = int64_t(value);
      }
      in->PopLimit(limit);
      found = true;
    } else if (!WireFormatLite::SkipField(in, tag)) {
      return false;
    }
  }
  return found;
}

}  // namespace

bool ParseTiming(grpc::ByteBuffer* buffer, int64_t timing[6]) {
  grpc::ProtoBufferReader reader(buffer);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  return ParseTimingFrom(&in, timing);
}

bool ParseTimingBytes(const std::string& bytes, int64_t timing[6]) {
  if (bytes.size() > size_t(INT_MAX)) return false;
  CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()), int(bytes.size()));
  return ParseTimingFrom(&in, timing);
}

// --- channels -----------------------------------------------------------------------------------

// FLASHSERVE_LOADGEN_CHANNEL_ARGS="name=value,...": integer channel arguments for every channel
// (e.g. grpc.http2.max_frame_size=16777215), to measure what a client's settings change.
void AddChannelArgsFromEnvironment(grpc::ChannelArguments* args) {
  const char* spec = std::getenv("FLASHSERVE_LOADGEN_CHANNEL_ARGS");
  std::string rest = spec != nullptr ? spec : "";
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string item = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) continue;
    args->SetInt(item.substr(0, eq), std::atoi(item.c_str() + eq + 1));
  }
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT_MAX);
  args.SetMaxSendMessageSize(INT_MAX);
  args.SetInt("flashserve.loadgen.channel", index);  // distinct args: a connection of its own
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  AddChannelArgsFromEnvironment(&args);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return channel;
}

}  // namespace flashserve::loadgen
