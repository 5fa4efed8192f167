// The closed-loop cell: `concurrency` workers, each with one unary call in flight on its channel
// of the pool and the next one sent as the last returns, for a duration or a number of requests;
// and the statistics over a cell's latencies and server timings (percentiles, overhead).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "loadgen_workload.h"

namespace flashserve::loadgen {

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

/// Adds one worker's counts, latencies and timings to `r` (the gRPC and local-socket cells'
/// workers have the same fields).
template <typename Worker>
void AddWorker(const Worker& w, CellResult* r) {
  r->ok += w.ok;
  r->errors += w.errors;
  if (r->first_error.empty()) r->first_error = w.first_error;
  r->latency_us.insert(r->latency_us.end(), w.latency_us.begin(), w.latency_us.end());
  r->timings.insert(r->timings.end(), w.timings.begin(), w.timings.end());
  r->response_bytes = std::max(r->response_bytes, w.response_bytes);
}

struct CellSpec {
  std::string target_name, method;
  const std::string* request = nullptr;
  int64_t echo_response_bytes = -1;  // >= 0: ask the echo server for this many bytes
  int concurrency = 1;
  double duration_s = 2;
  int min_requests = 3, max_requests = 1 << 30;
  bool read_timing = false;
  bool kserve_timing = false;  // read_timing from a KServe ModelInferResponse's parameters
};

class Cell {
 public:
  Cell(Pool* pool, const CellSpec& spec);

  CellResult Run();

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

  void Start(Worker* w);
  void Done(Worker* w, const grpc::Status& status);

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

double Percentile(std::vector<double> v, double p);
std::vector<double> Column(const CellResult& r, int index);
std::vector<double> Overhead(const CellResult& r, bool minus_stage = false);

}  // namespace flashserve::loadgen
