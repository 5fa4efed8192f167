// The load generator's workload: the request shapes, the requests built for them (serialized once,
// re-sent as static slices), reading the server timing out of a response, and the channels (one
// connection each) the requests go out on.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flashserve/v1/attention.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace flashserve::loadgen {

using Clock = std::chrono::steady_clock;

inline double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

struct Shape {
  std::string name;
  int64_t batch, seqlen, heads, head_dim;
  int64_t tensor_bytes() const { return batch * seqlen * heads * head_dim * 2; }  // bf16
};

extern const std::vector<Shape> kShapes;

struct Workload {
  Shape shape;
  v1::AttentionRequest request;  // with data
  v1::AttentionRequest header;   // without tensor data (the striped path's OpenSession)
  std::string serialized;        // the request on the wire
  double serialize_us = 0;       // client: AttentionRequest -> bytes, once
  double parse_us = 0;           // the same bytes parsed back (what the server edge does)
};

std::unique_ptr<Workload> MakeWorkload(const Shape& shape);

grpc::ByteBuffer StaticBuffer(const std::string& bytes);

// Reads AttentionResponse.timing (field 3) out of a response without copying the tensor bytes.
bool ParseTiming(grpc::ByteBuffer* buffer, int64_t timing[6]);
// The same from a response's bytes (the local transport's reply payload).
bool ParseTimingBytes(const std::string& bytes, int64_t timing[6]);

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, int index);

/// Adds `authorization: Bearer <token>` to a call when `token` is non-empty (the server's
/// --auth_token_file).
inline void Authorize(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
}

/// `n` channels to one target, and the bearer token every call on them carries (empty: none).
struct Pool {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::string token;
  Pool(const std::string& target, int n, std::string bearer_token = "") : token(std::move(bearer_token)) {
    for (int i = 0; i < n; ++i) {
      channels.push_back(MakeChannel(target, i));
      stubs.push_back(std::make_unique<grpc::GenericStub>(channels.back()));
    }
  }
};

}  // namespace flashserve::loadgen
