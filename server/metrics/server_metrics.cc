#include "metrics/server_metrics.h"

#include <cmath>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flashserve {
namespace {

constexpr std::string_view kCodeNames[] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};
constexpr int kUnknownCode = 2;

int CodeOfName(std::string_view name) {
  for (int i = 0; i < int(std::size(kCodeNames)); ++i) {
    if (kCodeNames[i] == name) return i;
  }
  return -1;
}

// Throughput of one kernel launch, TFLOPS. A histogram rather than a gauge: a gauge would show
// whichever launch happened last before a scrape, while buckets keep every launch, so PromQL
// gives quantiles and the mean (rate(_sum)/rate(_count)) over any window, per kernel and summed
// across replicas. Low buckets cover the CPU backend (~0.01-1), 25-1000 the GPUs (H100 dense
// fp16 peak ~990), with 50-100 TFLOPS steps where FlashAttention-2-class kernels land.
std::vector<double> TflopsBuckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,   10,  25,  50,  75,
          100,  150,   200,  250, 300,  350, 400, 450, 500, 600, 700, 800, 1000};
}

// Durations are wall-clock differences: a clock stepped back (NTP) makes them negative, and a
// negative observation makes the histogram's _sum go down, which rate() reads as a counter reset.
double NonNegative(double seconds) { return seconds >= 0.0 ? seconds : 0.0; }

}  // namespace

std::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kQueue:
      return "queue";
    case Phase::kH2D:
      return "h2d";
    case Phase::kCompute:
      return "compute";
    case Phase::kD2H:
      return "d2h";
  }
  return "unknown";
}

std::string_view GrpcCodeName(int code) {
  return code >= 0 && code < int(std::size(kCodeNames)) ? kCodeNames[code]
                                                        : kCodeNames[kUnknownCode];
}

ServerMetrics::ServerMetrics(const ServerMetricsOptions& options) {
  requests_ = &registry_.AddCounter("flashserve_requests_total",
                                    "RPCs finished, by method and gRPC status code name.",
                                    {"method", "status"});
  request_duration_ = &registry_.AddHistogram(
      "flashserve_request_duration_seconds",
      "Time of an RPC inside the server, from the request read to the answer handed to the "
      "transport (its sending, which a slow reader prolongs, is not included).",
      {"method"}, metrics::LatencyBuckets());
  phase_duration_ = &registry_.AddHistogram(
      "flashserve_phase_duration_seconds",
      "Time a request spent in one server phase: queue, h2d (host to device copy), compute, "
      "d2h (device to host copy).",
      {"phase"}, metrics::LatencyBuckets());
  request_bytes_ =
      &registry_.AddCounter("flashserve_request_bytes_total",
                            "Request bytes received (in) and answer bytes sent for successful "
                            "calls (out): serialized messages, HTTP bodies, local-socket frames.",
                            {"direction"});
  auto& inflight = registry_.AddGauge("flashserve_inflight_requests",
                                      "Requests accepted by an edge and not yet answered.");
  auto& queue_depth =
      registry_.AddGauge("flashserve_queue_depth", "Jobs waiting in the scheduler's queue.");
  auto& queue_capacity = registry_.AddGauge(
      "flashserve_queue_capacity",
      "Jobs the scheduler's queue holds before it refuses more (--queue_capacity).");
  auto& backend_healthy = registry_.AddGauge(
      "flashserve_backend_healthy",
      "1 while the backend can run work; 0 after a sticky device fault (the process then reports "
      "not live and not ready, and answers UNAVAILABLE).");
  kernel_tflops_ = &registry_.AddHistogram(
      "flashserve_kernel_tflops",
      "Attention throughput of one kernel launch, TFLOPS (10^12 floating-point operations per "
      "second).",
      {"kernel"}, TflopsBuckets());
  device_pool_ = &registry_.AddGauge(
      "flashserve_device_memory_pool_bytes",
      "Device memory of the CUDA buffer pool: used by requests now, reserved from the driver.",
      {"device", "state"});
  pinned_pool_ = &registry_.AddGauge(
      "flashserve_pinned_memory_pool_bytes",
      "Pinned host staging memory: used by requests now, reserved from the driver.", {"state"});
  autotune_ = &registry_.AddCounter("flashserve_autotune_total", "Autotune cache events by result.",
                                    {"result"});
  auto& hot_lane = registry_.AddCounter(
      "flashserve_hot_lane_requests_total",
      "Attention requests small enough for the hot lane (--hot_lane_spin_us): processed on it "
      "(lane) or on the gRPC thread because it was busy (busy).",
      {"result"});
  hot_lane_run_ = hot_lane.Labels({"lane"});
  hot_lane_busy_ = hot_lane.Labels({"busy"});
  auto& inputs = registry_.AddCounter(
      "flashserve_request_inputs_total",
      "Requests by how their tensors reached the backend: native-API requests read in place "
      "from the receive arena (in_place) or copied once into request buffers (copied); any "
      "request whose inputs were in a client's shared-memory region (shm_system, shm_cuda).",
      {"path"});
  inputs_in_place_ = inputs.Labels({"in_place"});
  inputs_copied_ = inputs.Labels({"copied"});
  inputs_shm_system_ = inputs.Labels({"shm_system"});
  inputs_shm_cuda_ = inputs.Labels({"shm_cuda"});
  shm_regions_ = &registry_.AddGauge(
      "flashserve_shm_regions",
      "Clients' shared-memory regions registered now (--allow_client_shm), by type.", {"type"});
  shm_region_bytes_ = &registry_.AddGauge(
      "flashserve_shm_region_bytes",
      "Bytes of the clients' shared-memory regions registered now, by type.", {"type"});
  for (const char* type : {"system", "cuda"}) {
    shm_regions_->Labels({type})->Set(0);
    shm_region_bytes_->Labels({type})->Set(0);
  }
  receive_arena_ = &registry_.AddGauge(
      "flashserve_receive_arena_bytes",
      "Receive arena (--receive_arena_bytes) for gRPC's read buffers: bytes in blocks in use now, "
      "the most ever in use, and its capacity (0: none).",
      {"state"});
  // process_start_time_seconds of client libraries, with DESIGN's prefix: an alert sees restarts
  // as changes of it (a restart loses every sequence of the KV cache).
  registry_
      .AddGauge("flashserve_start_time_seconds",
                "Start time of the process since the Unix epoch, in seconds.")
      .Get()
      ->Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));  // built at startup
  auto& build_info = registry_.AddGauge("flashserve_build_info",
                                        "Build of the running server; the value is always 1.",
                                        {"version", "cuda", "arch"});

  inflight_ = inflight.Get();
  queue_depth_ = queue_depth.Get();
  queue_capacity_ = queue_capacity.Get();
  backend_healthy_ = backend_healthy.Get();
  backend_healthy_->Set(1.0);
  bytes_in_ = request_bytes_->Labels({"in"});
  bytes_out_ = request_bytes_->Labels({"out"});
  for (int p = 0; p < kNumPhases; ++p) {
    phases_[size_t(p)] = phase_duration_->Labels({PhaseName(Phase(p))});
  }
  PoolGauges(pinned_pool_, nullptr);  // zero until a backend reports a pinned pool
  for (std::string_view result : kAutotuneResults) autotune_->Labels({result});
  for (const char* state : {"used", "peak", "capacity"}) receive_arena_->Labels({state})->Set(0);
  build_info.Labels({options.version, options.cuda, options.arch})->Set(1.0);

  num_methods_ = options.methods.size();
  methods_ = std::make_unique<MethodSlot[]>(num_methods_);
  for (size_t i = 0; i < num_methods_; ++i) {
    MethodSlot& slot = methods_[i];
    slot.name = options.methods[i];
    slot.duration = request_duration_->Labels({slot.name});
    slot.by_code[0].store(requests_->Labels({slot.name, kCodeNames[0]}), std::memory_order_release);
  }
}

ServerMetrics::MethodSlot* ServerMetrics::FindMethod(std::string_view method) {
  for (size_t i = 0; i < num_methods_; ++i) {
    if (methods_[i].name == method) return &methods_[i];
  }
  return nullptr;
}

void ServerMetrics::Record(std::string_view method, int code, std::string_view code_name,
                           double seconds, int64_t bytes_in, int64_t bytes_out) {
  seconds = NonNegative(seconds);
  MethodSlot* slot = FindMethod(method);
  if (slot != nullptr && code >= 0) {
    std::atomic<metrics::Counter*>& cached = slot->by_code[size_t(code)];
    metrics::Counter* counter = cached.load(std::memory_order_acquire);
    if (counter == nullptr) {
      counter = requests_->Labels({method, code_name});  // the family returns one child per tuple
      cached.store(counter, std::memory_order_release);
    }
    counter->Increment();
    slot->duration->Observe(seconds);
  } else {
    requests_->Labels({method, code_name})->Increment();
    request_duration_->Labels({method})->Observe(seconds);
  }
  if (bytes_in > 0) bytes_in_->Increment(uint64_t(bytes_in));
  // An error's body (an HTTP error JSON, a gRPC status) is not an answer: out counts OK calls only.
  if (bytes_out > 0 && code == 0) bytes_out_->Increment(uint64_t(bytes_out));
}

void ServerMetrics::RecordRequest(std::string_view method, std::string_view status_code_name,
                                  double seconds, int64_t bytes_in, int64_t bytes_out) {
  Record(method, CodeOfName(status_code_name), status_code_name, seconds, bytes_in, bytes_out);
}

void ServerMetrics::RecordRequest(std::string_view method, int status_code, double seconds,
                                  int64_t bytes_in, int64_t bytes_out) {
  const std::string_view name = GrpcCodeName(status_code);
  Record(method, CodeOfName(name), name, seconds, bytes_in, bytes_out);
}

void ServerMetrics::RecordPhase(Phase phase, double seconds) {
  const int p = int(phase);
  if (p >= 0 && p < kNumPhases) phases_[size_t(p)]->Observe(NonNegative(seconds));
}

void ServerMetrics::ObserveKernel(std::string_view kernel, double tflops) {
  if (!std::isfinite(tflops) || tflops < 0.0) return;
  kernel_tflops_->Labels({kernel})->Observe(tflops);
}

void ServerMetrics::RecordAutotune(std::string_view result) {
  autotune_->Labels({result})->Increment();
}

void ServerMetrics::SetQueueDepthCallback(std::function<double()> callback) {
  queue_depth_->SetCallback(std::move(callback));
}

void ServerMetrics::SetBackendHealthyCallback(std::function<bool()> healthy) {
  if (!healthy) return;
  backend_healthy_->SetCallback([healthy = std::move(healthy)] { return healthy() ? 1.0 : 0.0; });
}

std::array<metrics::Gauge*, 2> ServerMetrics::PoolGauges(metrics::Family<metrics::Gauge>* family,
                                                         const std::string* device) {
  if (device == nullptr) return {family->Labels({"used"}), family->Labels({"reserved"})};
  return {family->Labels({*device, "used"}), family->Labels({*device, "reserved"})};
}

void ServerMetrics::SetDevicePool(int device, int64_t used_bytes, int64_t reserved_bytes) {
  const std::string name = std::to_string(device);
  const auto gauges = PoolGauges(device_pool_, &name);
  gauges[0]->Set(double(used_bytes));
  gauges[1]->Set(double(reserved_bytes));
}

namespace {
// Points the used/reserved gauges at one shared callback (called once per gauge per scrape).
void SetPoolCallbacks(const std::array<metrics::Gauge*, 2>& gauges,
                      std::function<PoolBytes()> callback) {
  if (!callback) {
    gauges[0]->SetCallback(nullptr);
    gauges[1]->SetCallback(nullptr);
    return;
  }
  auto shared = std::make_shared<std::function<PoolBytes()>>(std::move(callback));
  gauges[0]->SetCallback([shared] { return double((*shared)().used); });
  gauges[1]->SetCallback([shared] { return double((*shared)().reserved); });
}
}  // namespace

void ServerMetrics::SetDevicePoolCallback(int device, std::function<PoolBytes()> callback) {
  const std::string name = std::to_string(device);
  SetPoolCallbacks(PoolGauges(device_pool_, &name), std::move(callback));
}

void ServerMetrics::SetPinnedPool(int64_t used_bytes, int64_t reserved_bytes) {
  const auto gauges = PoolGauges(pinned_pool_, nullptr);
  gauges[0]->Set(double(used_bytes));
  gauges[1]->Set(double(reserved_bytes));
}

void ServerMetrics::SetReceiveArenaCallback(std::function<ArenaBytes()> callback) {
  if (!callback) return;
  auto shared = std::make_shared<std::function<ArenaBytes()>>(std::move(callback));
  receive_arena_->Labels({"used"})->SetCallback([shared] { return double((*shared)().used); });
  receive_arena_->Labels({"peak"})->SetCallback([shared] { return double((*shared)().peak); });
  receive_arena_->Labels({"capacity"})->SetCallback(
      [shared] { return double((*shared)().capacity); });
}

void ServerMetrics::SetPinnedPoolCallback(std::function<PoolBytes()> callback) {
  SetPoolCallbacks(PoolGauges(pinned_pool_, nullptr), std::move(callback));
}

void ServerMetrics::SetShmRegions(std::string_view type, int64_t count, int64_t bytes) {
  shm_regions_->Labels({type})->Set(double(count));
  shm_region_bytes_->Labels({type})->Set(double(bytes));
}

}  // namespace flashserve
