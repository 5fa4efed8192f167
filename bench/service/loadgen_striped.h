// The striped streaming path (AttentionStreamService): one request as OpenSession, its Q/K/V
// chunks uploaded round-robin over K streams on K channels, Compute, and O downloaded as K ranges
// (K=1: inline in the Compute response).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "loadgen_workload.h"

namespace flashserve::loadgen {

struct StripedSample {
  double total_us, open_us, upload_us, compute_us, download_us;
  std::array<int64_t, 6> timing;
};

// One striped request: Open, K uploads in parallel, Compute, K downloads in parallel; every call
// carries the bearer `token` when it is non-empty.
bool RunStriped(const Workload& w, std::vector<std::shared_ptr<grpc::Channel>>& channels,
                std::vector<std::unique_ptr<grpc::GenericStub>>& stubs, const std::string& token, int64_t chunk_bytes,
                std::string* output, StripedSample* sample, std::string* error);

}  // namespace flashserve::loadgen
