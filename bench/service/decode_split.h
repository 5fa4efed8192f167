// One client's decode step split into parts sent at once, each on a gRPC connection of its own,
// and done when every part has answered (flashserve-decode-loadgen --split). One loopback gRPC
// connection moves a 64-sequence step's ~1.3 MB at ~2-3 GB/s, in the order: request bytes, the
// server's parse, the launch, the answer's bytes; split over N connections, the parts' transfers
// and parses overlap one another (the server runs the parts' launches in turn, or as one with
// --batch_when_busy). The parts go out through gRPC's callback API from the client's one thread, as
// a client fanning out its step would; SplitEchoClient sends the same parts' bytes to
// flashserve-echo the same way (the raw gRPC floor of the split step).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "flashserve/v1/sequences.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"

namespace flashserve::loadgen {

/// Counts a step's calls in flight; Wait() returns once each has called Done().
class CallLatch {
 public:
  explicit CallLatch(size_t calls) : pending_(calls) {}
  void Done();
  void Wait();

 private:
  std::mutex mu_;
  std::condition_variable all_done_;
  size_t pending_;
};

/// Not thread-safe: one per client thread.
class SplitDecodeClient {
 public:
  /// Part j goes on connection `index * parts.size() + j` (distinct across clients); the parts
  /// must outlive the client.
  SplitDecodeClient(const std::string& target, const std::string& token, int index,
                    std::vector<const v1::DecodeStepRequest*> parts);
  /// Sends every part, waits for all; (*responses)[j] is part j's answer. false with *error
  /// ("part j: <code>: <message>", the first part that failed) when any failed.
  bool Step(std::vector<v1::DecodeStepResponse>* responses, std::string* error);

 private:
  std::string token_;
  std::vector<std::unique_ptr<v1::Sequences::Stub>> stubs_;
  std::vector<const v1::DecodeStepRequest*> parts_;
};

/// The same split for the raw gRPC echo: part j's request bytes to flashserve-echo, answered with
/// response_bytes[j] bytes. Not thread-safe: one per client thread.
class SplitEchoClient {
 public:
  SplitEchoClient(const std::string& target, const std::string& token, int index,
                  std::vector<std::string> request_bytes, std::vector<int64_t> response_bytes);
  /// false with *error when a part failed or was answered with the wrong number of bytes.
  bool Step(std::string* error);

 private:
  std::string token_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::vector<std::string> request_bytes_;
  std::vector<int64_t> response_bytes_;
  std::vector<grpc::ByteBuffer> requests_, responses_;
};

}  // namespace flashserve::loadgen
