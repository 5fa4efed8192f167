// The local transport's wire format (--local_socket): for clients on the server's host, the
// messages of attention.proto / sequences.proto in length-prefixed frames over a Unix stream
// socket instead of gRPC (no HTTP/2, no completion-queue hops). Tensors normally live in shared
// memory regions registered through the shared-memory extension; inline bytes are allowed up to
// the server's --local_max_frame_bytes.
//
// A connection carries one call at a time: the client writes a request frame, the server answers
// with one response frame, in order. Every integer is little-endian. Header-only: the server
// (server/edge/local) and the clients (bench/service, client/python/flashserve/local.py) share it.
#pragma once

#include <cstdint>
#include <cstring>

namespace flashserve::v1::local {

inline constexpr uint32_t kMagic = 0x314C5346;  // "FSL1" in memory order
inline constexpr uint32_t kHeaderBytes = 16;

/// What a request frame asks for; its payload is the named message, serialized.
enum class Method : uint16_t {
  kHello = 1,       // payload: a bearer token (raw bytes, no "Bearer "); answers OK or
                    // UNAUTHENTICATED. Needed once per connection when the server has tokens.
  kEcho = 2,        // payload: any bytes up to the frame limit; answered with the same bytes
                    // (the transport's floor, as flashserve-echo is gRPC's)
  kAttention = 3,   // v1::AttentionRequest -> v1::AttentionResponse
  kDecodeStep = 4,  // v1::DecodeStepRequest -> v1::DecodeStepResponse
  kAttend = 5,      // v1::AttendRequest -> v1::AttendResponse
};

/// Request: magic, method, flags (0), payload bytes, reserved (0).
/// Response: magic, status (a google.rpc / absl code: 0 = OK), reserved (0), payload bytes,
/// reserved (0). OK: the payload is the response message; otherwise a UTF-8 error message.
struct FrameHeader {
  uint32_t magic = kMagic;
  uint16_t method_or_status = 0;
  uint16_t flags = 0;
  uint32_t payload_bytes = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(FrameHeader) == kHeaderBytes, "the header is 16 packed bytes");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "frames are copied as little-endian bytes");

inline void EncodeHeader(const FrameHeader& header, unsigned char out[kHeaderBytes]) {
  std::memcpy(out, &header, kHeaderBytes);
}
inline FrameHeader DecodeHeader(const unsigned char in[kHeaderBytes]) {
  FrameHeader header;
  std::memcpy(&header, in, kHeaderBytes);
  return header;
}

}  // namespace flashserve::v1::local
