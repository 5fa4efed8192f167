// libFuzzer target: the local transport's request frames (server/edge/local/frame_check.h) and
// the parsing of their payloads as the server does it: a whole frame -> header checks (magic,
// method, flags, reserved, length against a limit) -> the payload parsed for its method
// (Attention: the zero-copy wire parser and validation; DecodeStep / Attend: protobuf).
//
// Oracles:
//  1. Only INVALID_ARGUMENT or RESOURCE_EXHAUSTED are refusals; RESOURCE_EXHAUSTED exactly when
//     the header is otherwise good and claims more than the limit.
//  2. An accepted frame's payload is the bytes after the header, as long as the header says.
//  3. The Attention payload parses with the wire parser iff protobuf parses it (known deviations
//     aside: then only compare when both succeed), and their headers agree on dtype and shape.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "api/request_wire.h"
#include "edge/local/frame_check.h"
#include "flashserve/v1/sequences.pb.h"
#include "fuzz_check.h"

namespace {

constexpr int64_t kLimit = 1 << 20;
namespace local = flashserve::v1::local;

void ParseAttention(std::string_view payload) {
  using namespace flashserve;
  WireRequest wire;
  const absl::Status parsed = ParseAttentionRequestWire({payload}, &wire);
  v1::AttentionRequest reference;
  const bool protobuf_ok = reference.ParseFromArray(payload.data(), int(payload.size()));
  if (!parsed.ok() || !protobuf_ok) return;
  FUZZ_CHECK(wire.header.q().shape_size() == reference.q().shape_size(), "q shape");
  FUZZ_CHECK(wire.data[0].bytes == int64_t(reference.q().data().size()), "q data size");
  for (const std::string_view piece : wire.data[0].pieces) {
    FUZZ_CHECK(piece.data() >= payload.data() &&
                   piece.data() + piece.size() <= payload.data() + payload.size(),
               "a span outside the payload");
  }
  (void)ValidateAttentionRequest(wire.header, fuzz::CpuLimits());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  flashserve::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashserve;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  local::FrameHeader header;
  std::string_view payload;
  const absl::Status s = SplitRequestFrame(bytes, kLimit, &header, &payload);
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument ||
                   s.code() == absl::StatusCode::kResourceExhausted,
               s.ToString());
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      FUZZ_CHECK(header.payload_bytes > kLimit, "RESOURCE_EXHAUSTED under the limit");
    }
    return 0;
  }
  FUZZ_CHECK(CheckRequestHeader(header, kLimit).ok(), "accepted frame with a bad header");
  FUZZ_CHECK(payload.size() == header.payload_bytes && payload.data() == bytes.data() + 16,
             "payload is not the bytes after the header");
  switch (static_cast<local::Method>(header.method_or_status)) {
    case local::Method::kAttention: ParseAttention(payload); break;
    case local::Method::kDecodeStep: {
      v1::DecodeStepRequest request;
      (void)request.ParseFromArray(payload.data(), int(payload.size()));
      break;
    }
    case local::Method::kAttend: {
      v1::AttendRequest request;
      (void)request.ParseFromArray(payload.data(), int(payload.size()));
      break;
    }
    case local::Method::kHello:
    case local::Method::kEcho: break;
  }
  return 0;
}
