// How flashserve-decode-loadgen's clients send DecodeStep: over gRPC (the Sequences stub) or the
// local transport (frames on a Unix socket, local_client.h), with each item's q/k/v inline or in
// a shared-memory region of the load generator's (system or CUDA; O written into one too).
// Sequences are created and released over gRPC either way (the local transport carries only
// DecodeStep / Attend / Attention), and regions are registered over KServe gRPC. EchoClient: the
// raw gRPC floor of a client's step (the same bytes to flashserve-echo).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "flashserve/v1/sequences.grpc.pb.h"
#include "grpcpp/impl/rpc_method.h"
#include "loadgen_regions.h"
#include "local_client.h"

namespace flashserve::loadgen {

struct DecodeTransportOptions {
  std::string target, token;  // gRPC: target host:port, bearer token
  std::string local_socket;   // non-empty: DecodeStep over the local transport
  std::string shm = "none";   // "none", "system" or "cuda": where q/k/v and O live
  int device = 0;             // cuda regions
  int timeout_ms = 60000;     // local transport: per send / receive
  int64_t spin_us = 0;        // local transport: LocalClientOptions::spin_us
  bool packed = false;        // DecodeStepRequest.packed: one q/k/v/O place per client's step
};

/// One client's connection. Not thread-safe: one per client thread.
class DecodeClient {
 public:
  /// `index` gives a gRPC client a connection of its own.
  static std::unique_ptr<DecodeClient> Create(const DecodeTransportOptions& options, int index,
                                              std::string* error);

  /// The request the next Step()s send (serialized here, once, for the local transport).
  void Prepare(const v1::DecodeStepRequest& request);
  /// One DecodeStep; false with *error ("<code>: <message>") when the call fails.
  bool Step(v1::DecodeStepResponse* response, std::string* error);

 private:
  DecodeClient() = default;
  DecodeTransportOptions options_;
  std::unique_ptr<v1::Sequences::Stub> stub_;
  std::unique_ptr<local::LocalClient> local_;
  const v1::DecodeStepRequest* request_ = nullptr;
  std::string bytes_, reply_;
};

/// One client's raw gRPC echo of its DecodeStep: the request's serialized bytes sent as they are to
/// flashserve-echo (echo_server.cc, method /flashserve.bench.Echo/Echo), which answers with
/// `response_bytes` bytes (the size of the DecodeStepResponse the client got). The call goes
/// through the same blocking path as the generated Sequences stub
/// (grpc::internal::BlockingUnaryCall), so the difference to the real step is the proto work on
/// both sides and the server, not the call machinery. Not thread-safe: one per client thread.
class EchoClient {
 public:
  /// `index` gives the client a connection of its own; `token` is sent as on the real call.
  EchoClient(const std::string& target, int index, const std::string& token,
             std::string request_bytes, int64_t response_bytes);
  /// One echo call; false with *error when it fails or the answer is not the size asked for.
  bool Step(std::string* error);

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::internal::RpcMethod method_;
  std::string token_, request_bytes_;  // request_ is a static slice of request_bytes_
  int64_t response_bytes_ = 0;
  grpc::ByteBuffer request_, response_;
};

/// The regions of a shared-memory run: per sequence i, its q, k, v back to back at
/// i * (q + 2 kv bytes) of the input region, its O at i * q bytes of the output region. Packed
/// (options.packed): every sequence's q, then every k, then every v, so that consecutive
/// sequences' rows are one span each.
class DecodeRegions {
 public:
  /// Creates and registers both regions and writes q, k, v (the same rows for every sequence).
  static std::unique_ptr<DecodeRegions> Create(const DecodeTransportOptions& options,
                                               int64_t sequences, const v1::Tensor& q,
                                               const v1::Tensor& kv, std::string* error);
  /// Fills the output region with a poison; CheckOutputs then fails if any sequence's O still
  /// holds some (the server did not write it: loadgen_regions.h).
  bool PoisonOutputs(std::string* error);
  bool CheckOutputs(std::string* error) const;
  /// Replaces `item`'s q/k/v bytes by references to sequence `index`'s place and sets out_shm.
  void Name(int64_t index, v1::DecodeItem* item) const;
  /// Packed layout: names the spans of sequences [first, first + items) as `request`'s packed
  /// q/k/v and O.
  void NamePacked(int64_t first, v1::DecodeStepRequest* request) const;

 private:
  DecodeRegions() = default;
  std::unique_ptr<inference::GRPCInferenceService::Stub> kserve_;  // outlives the regions
  std::unique_ptr<Region> in_, out_;
  uint64_t q_bytes_ = 0, kv_bytes_ = 0, sequences_ = 0;
};

}  // namespace flashserve::loadgen
