// The server's metrics, all named flashserve_* (README "API summary" lists the families),
// behind typed methods the edges, scheduler and backends call. One object per server; the
// metrics HTTP endpoint renders it.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "metrics/metrics.h"

namespace flashserve {

/// Server-side phases of one request, as in the response's Timing.
enum class Phase { kQueue = 0, kH2D = 1, kCompute = 2, kD2H = 3 };
inline constexpr int kNumPhases = 4;
/// "queue", "h2d", "compute", "d2h": the `phase` label values.
std::string_view PhaseName(Phase phase);

/// The `result` label values of autotune_total, as the background tuner reports them: exported at 0
/// from startup so a dashboard shows 0, not "No data", before the first event.
inline constexpr std::string_view kAutotuneResults[] = {"hit", "miss", "tuned", "failed",
                                                        "skipped"};

/// The gRPC status code name for a code number ("OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for
/// numbers outside 0..16). absl::StatusCode uses the same numbers: GrpcCodeName(int(s.code())).
std::string_view GrpcCodeName(int code);

struct ServerMetricsOptions {
  // build_info{version,cuda,arch} labels, e.g. "0.1.0", "12.4" (or "none"), "80;90" (or "none").
  std::string version = "unknown";
  std::string cuda = "none";
  std::string arch = "none";
  // `method` label values served through a lock-free table (others work too, via the family's
  // child list). Each gets requests_total{method,status="OK"} and request_duration_seconds
  // series from the start, so rate() has a zero to begin from.
  std::vector<std::string> methods = {"Attention", "GetServerInfo"};
};

/// Bytes held by a memory pool: `used` by requests now, `reserved` from the device/driver in all.
struct PoolBytes {
  int64_t used = 0;
  int64_t reserved = 0;
};

/// Thread-safe. Every Record/Observe/Inc/Dec/Set is lock-free (atomics only); the first use of
/// a new label value (kernel name, autotune result, unknown method or status) takes a family
/// mutex once. Callbacks run on the scraping thread and must stay valid until they are replaced
/// or the object is destroyed: clear them (pass nullptr) before destroying what they read.
class ServerMetrics {
 public:
  explicit ServerMetrics(const ServerMetricsOptions& options = {});
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  /// One finished RPC: requests_total{method,status} += 1,
  /// request_duration_seconds{method} observes `seconds` (end to end in the server),
  /// request_bytes_total{direction="in"} += bytes_in, {direction="out"} += bytes_out for an OK
  /// call only (negative values are ignored).
  /// `status_code_name` is the gRPC code name, e.g. "OK", "INVALID_ARGUMENT".
  void RecordRequest(std::string_view method, std::string_view status_code_name, double seconds,
                     int64_t bytes_in, int64_t bytes_out);
  /// Same, with the gRPC (or absl::StatusCode) number.
  void RecordRequest(std::string_view method, int status_code, double seconds, int64_t bytes_in,
                     int64_t bytes_out);
  /// phase_duration_seconds{phase} observes `seconds`.
  void RecordPhase(Phase phase, double seconds);
  /// kernel_tflops{kernel} observes the throughput of one launch (NaN/negative/inf ignored).
  void ObserveKernel(std::string_view kernel, double tflops);
  /// autotune_total{result} += 1; kAutotuneResults exist from the start, any other result string
  /// gets its series on first use.
  void RecordAutotune(std::string_view result);
  /// hot_lane_requests_total{result}: "lane" (processed on the hot lane) or "busy" (the lane was
  /// busy; processed on the gRPC thread). Only requests small enough for the lane are counted.
  void RecordHotLane(bool on_lane) { (on_lane ? hot_lane_run_ : hot_lane_busy_)->Increment(); }
  /// How a request's tensors reached the backend, once it runs: path "in_place" (read from the
  /// receive arena), "copied" (into request buffers), "shm_system" / "shm_cuda" (a client's
  /// shared memory).
  void RecordInputPath(std::string_view path) {
    (path == "shm_cuda"     ? inputs_shm_cuda_
     : path == "shm_system" ? inputs_shm_system_
     : path == "in_place"   ? inputs_in_place_
                            : inputs_copied_)
        ->Increment();
  }
  /// Clients' shared-memory regions now: shm_regions{type} and shm_region_bytes{type}.
  void SetShmRegions(std::string_view type, int64_t count, int64_t bytes);
  /// receive_arena_bytes{state="used"|"peak"|"capacity"}, read at scrape time.
  struct ArenaBytes {
    int64_t used = 0, peak = 0, capacity = 0;
  };
  void SetReceiveArenaCallback(std::function<ArenaBytes()> callback);

  /// inflight_requests: requests accepted by an edge and not yet answered.
  void InflightInc() { inflight_->Increment(); }
  void InflightDec() { inflight_->Decrement(); }
  /// Increments inflight_requests for its lifetime; `metrics` may be null (then does nothing).
  class InflightGuard {
   public:
    explicit InflightGuard(ServerMetrics* metrics) : metrics_(metrics) {
      if (metrics_ != nullptr) metrics_->InflightInc();
    }
    ~InflightGuard() {
      if (metrics_ != nullptr) metrics_->InflightDec();
    }
    InflightGuard(const InflightGuard&) = delete;
    InflightGuard& operator=(const InflightGuard&) = delete;

   private:
    ServerMetrics* metrics_;
  };

  /// queue_depth: jobs waiting in the scheduler. Either set it, or give a callback read at scrape.
  void SetQueueDepth(double depth) { queue_depth_->Set(depth); }
  void SetQueueDepthCallback(std::function<double()> callback);
  /// queue_capacity: the bound on waiting jobs (--queue_capacity), for alerts on depth / capacity.
  void SetQueueCapacity(int capacity) { queue_capacity_->Set(double(capacity)); }
  /// backend_healthy: 1 until `healthy` (read at scrape) says a device fault made the backend
  /// unusable.
  void SetBackendHealthyCallback(std::function<bool()> healthy);

  /// device_memory_pool_bytes{device,state="used"|"reserved"}.
  void SetDevicePool(int device, int64_t used_bytes, int64_t reserved_bytes);
  void SetDevicePoolCallback(int device, std::function<PoolBytes()> callback);
  /// pinned_memory_pool_bytes{state="used"|"reserved"} (0 until set: the CPU backend has none).
  void SetPinnedPool(int64_t used_bytes, int64_t reserved_bytes);
  void SetPinnedPoolCallback(std::function<PoolBytes()> callback);

  /// Hot-path handles for callers that want to skip even the lock-free child lookup.
  metrics::Histogram* KernelTflops(std::string_view kernel) {
    return kernel_tflops_->Labels({kernel});
  }

  /// The exposition text (serve with metrics::kContentType).
  std::string Render() const { return registry_.Render(); }
  /// For modules that add their own flashserve_* families.
  metrics::Registry& registry() { return registry_; }

 private:
  static constexpr int kNumCodes = 17;
  // Resolved children for one configured method; counters per status code are created lazily.
  struct MethodSlot {
    std::string name;
    metrics::Histogram* duration = nullptr;
    std::array<std::atomic<metrics::Counter*>, kNumCodes> by_code{};
  };
  MethodSlot* FindMethod(std::string_view method);
  void Record(std::string_view method, int code, std::string_view code_name, double seconds,
              int64_t bytes_in, int64_t bytes_out);
  std::array<metrics::Gauge*, 2> PoolGauges(metrics::Family<metrics::Gauge>* family,
                                            const std::string* device);

  metrics::Registry registry_;
  metrics::Family<metrics::Counter>* requests_;
  metrics::Family<metrics::Histogram>* request_duration_;
  metrics::Family<metrics::Histogram>* phase_duration_;
  metrics::Family<metrics::Counter>* request_bytes_;
  metrics::Family<metrics::Histogram>* kernel_tflops_;
  metrics::Family<metrics::Gauge>* device_pool_;
  metrics::Family<metrics::Gauge>* pinned_pool_;
  metrics::Family<metrics::Counter>* autotune_;
  metrics::Counter* hot_lane_run_;
  metrics::Counter* hot_lane_busy_;
  metrics::Counter* inputs_in_place_;
  metrics::Counter* inputs_copied_;
  metrics::Counter* inputs_shm_system_;
  metrics::Counter* inputs_shm_cuda_;
  metrics::Family<metrics::Gauge>* shm_regions_;
  metrics::Family<metrics::Gauge>* shm_region_bytes_;
  metrics::Family<metrics::Gauge>* receive_arena_;
  metrics::Gauge* inflight_;
  metrics::Gauge* queue_depth_;
  metrics::Gauge* queue_capacity_;
  metrics::Gauge* backend_healthy_;
  metrics::Counter* bytes_in_;
  metrics::Counter* bytes_out_;
  std::array<metrics::Histogram*, kNumPhases> phases_{};
  std::unique_ptr<MethodSlot[]> methods_;  // immutable layout after construction
  size_t num_methods_ = 0;
};

}  // namespace flashserve
