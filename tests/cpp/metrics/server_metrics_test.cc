// ServerMetrics: the DESIGN.md §6 families and what each typed method records.
#include "metrics/server_metrics.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

// The value of the sample whose line starts with `series ` ("" when absent).
std::string Sample(const std::string& text, const std::string& series) {
  const std::string key = series + " ";
  size_t pos = 0;
  while ((pos = text.find(key, pos)) != std::string::npos) {
    if (pos == 0 || text[pos - 1] == '\n') {
      const size_t start = pos + key.size();
      return text.substr(start, text.find('\n', start) - start);
    }
    pos += key.size();
  }
  return "";
}

ServerMetricsOptions TestOptions() {
  ServerMetricsOptions options;
  options.version = "1.2.3";
  options.cuda = "12.4";
  options.arch = "80;90";
  return options;
}

TEST(ServerMetricsTest, EveryDesignFamilyIsDeclared) {
  ServerMetrics m(TestOptions());
  const std::string text = m.Render();
  const std::vector<std::pair<std::string, std::string>> families = {
      {"flashserve_requests_total", "counter"},
      {"flashserve_request_duration_seconds", "histogram"},
      {"flashserve_phase_duration_seconds", "histogram"},
      {"flashserve_request_bytes_total", "counter"},
      {"flashserve_inflight_requests", "gauge"},
      {"flashserve_queue_depth", "gauge"},
      {"flashserve_kernel_tflops", "histogram"},
      {"flashserve_device_memory_pool_bytes", "gauge"},
      {"flashserve_pinned_memory_pool_bytes", "gauge"},
      {"flashserve_autotune_total", "counter"},
      {"flashserve_build_info", "gauge"},
  };
  for (const auto& [name, type] : families) {
    EXPECT_NE(text.find("\n# TYPE " + name + " " + type + "\n"), std::string::npos) << name;
    EXPECT_NE(text.find("# HELP " + name + " "), std::string::npos) << name;
  }
}

TEST(ServerMetricsTest, ProcessStartTimeIsWhenTheMetricsWereMade) {
  const double before = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  ServerMetrics m(TestOptions());
  const double after = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  const std::string text = m.Render();
  EXPECT_NE(text.find("\n# TYPE flashserve_start_time_seconds gauge\n"), std::string::npos);
  const double started = std::stod(Sample(text, "flashserve_start_time_seconds"));
  EXPECT_GE(started, std::floor(before));
  EXPECT_LE(started, after + 1.0);
}

// A duration from a wall clock stepped back is negative: counted as 0, so _sum never goes down
// (rate() would read that as a counter reset).
TEST(ServerMetricsTest, NegativeDurationsCountAsZero) {
  ServerMetrics m(TestOptions());
  m.RecordRequest("Attention", 0, 0.5, 0, 0);
  m.RecordRequest("Attention", 0, -3.0, 0, 0);
  m.RecordPhase(Phase::kQueue, -1.0);
  const std::string text = m.Render();
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_sum{method="Attention"})"), "0.5");
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_count{method="Attention"})"), "2");
  EXPECT_EQ(Sample(text, R"(flashserve_phase_duration_seconds_sum{phase="queue"})"), "0");
}

TEST(ServerMetricsTest, SeriesThatExistFromTheStart) {
  ServerMetrics m(TestOptions());
  const std::string text = m.Render();
  EXPECT_EQ(Sample(text, R"(flashserve_build_info{version="1.2.3",cuda="12.4",arch="80;90"})"),
            "1");
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="Attention",status="OK"})"), "0");
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_count{method="Attention"})"), "0");
  for (const char* phase : {"queue", "h2d", "compute", "d2h"}) {
    EXPECT_EQ(Sample(text, std::string("flashserve_phase_duration_seconds_count{phase=\"") + phase +
                               "\"}"),
              "0")
        << phase;
  }
  EXPECT_EQ(Sample(text, R"(flashserve_request_bytes_total{direction="in"})"), "0");
  EXPECT_EQ(Sample(text, R"(flashserve_request_bytes_total{direction="out"})"), "0");
  EXPECT_EQ(Sample(text, "flashserve_inflight_requests"), "0");
  EXPECT_EQ(Sample(text, "flashserve_queue_depth"), "0");
  EXPECT_EQ(Sample(text, R"(flashserve_pinned_memory_pool_bytes{state="used"})"), "0");
  EXPECT_EQ(Sample(text, R"(flashserve_pinned_memory_pool_bytes{state="reserved"})"), "0");
  // Latency buckets: 10 µs .. 10 s.
  EXPECT_EQ(
      Sample(text, R"(flashserve_request_duration_seconds_bucket{method="Attention",le="1e-05"})"),
      "0");
  EXPECT_EQ(
      Sample(text, R"(flashserve_request_duration_seconds_bucket{method="Attention",le="10"})"),
      "0");
}

// Every labelled family whose label values are known before any traffic has a zero series for
// each of them from startup, so dashboards show 0 instead of "No data" (issue 17, item 7).
TEST(ServerMetricsTest, KnownLabelValuesAreExportedAtZeroFromTheStart) {
  ServerMetrics m(TestOptions());
  const std::string text = m.Render();
  for (std::string_view result : kAutotuneResults) {
    EXPECT_EQ(Sample(text, "flashserve_autotune_total{result=\"" + std::string(result) + "\"}"), "0")
        << result;
  }
  for (const char* result : {"lane", "busy"}) {
    EXPECT_EQ(Sample(text, std::string("flashserve_hot_lane_requests_total{result=\"") + result + "\"}"),
              "0")
        << result;
  }
  for (const char* path : {"in_place", "copied", "shm_system", "shm_cuda"}) {
    EXPECT_EQ(Sample(text, std::string("flashserve_request_inputs_total{path=\"") + path + "\"}"), "0")
        << path;
  }
  for (const char* type : {"system", "cuda"}) {
    EXPECT_EQ(Sample(text, std::string("flashserve_shm_regions{type=\"") + type + "\"}"), "0") << type;
    EXPECT_EQ(Sample(text, std::string("flashserve_shm_region_bytes{type=\"") + type + "\"}"), "0")
        << type;
  }
  for (const char* state : {"used", "peak", "capacity"}) {
    EXPECT_EQ(Sample(text, std::string("flashserve_receive_arena_bytes{state=\"") + state + "\"}"), "0")
        << state;
  }
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_count{method="GetServerInfo"})"), "0");
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="GetServerInfo",status="OK"})"), "0");
}

// Any family with a label has at least one series at startup, except those whose label values
// exist only at run time (kernel names; CUDA device numbers, set when a GPU backend reports).
// A new family added without its zero series fails here.
TEST(ServerMetricsTest, NoLabelledFamilyStartsEmpty) {
  ServerMetrics m(TestOptions());
  const std::string text = m.Render();
  const std::vector<std::string> runtime_only = {"flashserve_kernel_tflops",
                                                 "flashserve_device_memory_pool_bytes"};
  size_t pos = 0, checked = 0;
  while ((pos = text.find("# TYPE ", pos)) != std::string::npos) {
    const size_t name_start = pos + 7;
    const std::string name = text.substr(name_start, text.find(' ', name_start) - name_start);
    pos = name_start;
    if (std::find(runtime_only.begin(), runtime_only.end(), name) != runtime_only.end()) continue;
    ++checked;
    EXPECT_NE(text.find("\n" + name), std::string::npos) << name << " has no series at startup";
  }
  EXPECT_GE(checked, 12u);
}

TEST(ServerMetricsTest, RecordRequestCountsByMethodAndStatus) {
  ServerMetrics m(TestOptions());
  m.RecordRequest("Attention", "OK", 0.002, 1000, 500);
  m.RecordRequest("Attention", "OK", 0.004, 1000, 500);
  m.RecordRequest("Attention", "INVALID_ARGUMENT", 1e-5, 10, 0);
  m.RecordRequest("Attention", 8, 3e-5, 20, 0);  // RESOURCE_EXHAUSTED by number
  m.RecordRequest("GetServerInfo", 0, 1e-4, 0, 64);
  m.RecordRequest("Custom", "NOT_A_CODE", 20.0, -5, -5);  // unknown method and name still count
  m.RecordRequest("Attention", 99, 1.0, 0, 0);            // out of range -> UNKNOWN
  m.RecordRequest("KServeInfer", "INVALID_ARGUMENT", 1e-5, 7, 58);  // its error body: not out
  const std::string text = m.Render();
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="Attention",status="OK"})"), "2");
  EXPECT_EQ(
      Sample(text, R"(flashserve_requests_total{method="Attention",status="INVALID_ARGUMENT"})"),
      "1");
  EXPECT_EQ(
      Sample(text, R"(flashserve_requests_total{method="Attention",status="RESOURCE_EXHAUSTED"})"),
      "1");
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="Attention",status="UNKNOWN"})"), "1");
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="GetServerInfo",status="OK"})"), "1");
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="Custom",status="NOT_A_CODE"})"), "1");
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_count{method="Attention"})"), "5");
  EXPECT_EQ(
      Sample(text, R"(flashserve_request_duration_seconds_bucket{method="Attention",le="1e-05"})"),
      "1");
  EXPECT_EQ(
      Sample(text, R"(flashserve_request_duration_seconds_bucket{method="Attention",le="0.0025"})"),
      "3");
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_bucket{method="Custom",le="10"})"),
            "0");
  EXPECT_EQ(
      Sample(text, R"(flashserve_request_duration_seconds_bucket{method="Custom",le="+Inf"})"),
      "1");
  EXPECT_EQ(Sample(text, R"(flashserve_request_bytes_total{direction="in"})"), "2037");
  EXPECT_EQ(Sample(text, R"(flashserve_request_bytes_total{direction="out"})"), "1064");
}

TEST(ServerMetricsTest, ConcurrentRecordRequestIsExact) {
  ServerMetrics m(TestOptions());
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < kPerThread; ++i) {
        m.RecordRequest("Attention", (i + t) % 2 == 0 ? "OK" : "CANCELLED", 0.5, 2, 1);
        m.RecordPhase(Phase::kCompute, 0.25);
        ServerMetrics::InflightGuard guard(&m);
      }
    });
  }
  for (auto& th : threads) th.join();
  const std::string text = m.Render();
  constexpr int kTotal = kThreads * kPerThread;
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="Attention",status="OK"})"),
            std::to_string(kTotal / 2));
  EXPECT_EQ(Sample(text, R"(flashserve_requests_total{method="Attention",status="CANCELLED"})"),
            std::to_string(kTotal / 2));
  EXPECT_EQ(Sample(text, R"(flashserve_request_duration_seconds_sum{method="Attention"})"),
            std::to_string(kTotal / 2));
  EXPECT_EQ(Sample(text, R"(flashserve_phase_duration_seconds_count{phase="compute"})"),
            std::to_string(kTotal));
  EXPECT_EQ(Sample(text, R"(flashserve_request_bytes_total{direction="in"})"),
            std::to_string(2 * kTotal));
  EXPECT_EQ(Sample(text, "flashserve_inflight_requests"), "0");
}

TEST(ServerMetricsTest, PhasesKernelsAutotune) {
  ServerMetrics m(TestOptions());
  m.RecordPhase(Phase::kQueue, 1e-5);
  m.RecordPhase(Phase::kH2D, 0.001);
  m.RecordPhase(Phase::kD2H, 0.002);
  m.ObserveKernel("sm80_fp16_hd128", 350.0);
  m.ObserveKernel("sm80_fp16_hd128", 351.0);
  m.ObserveKernel("cpu", 0.05);
  m.ObserveKernel("cpu", std::nan(""));  // ignored
  m.ObserveKernel("cpu", -1.0);          // ignored
  m.KernelTflops("cpu")->Observe(0.02);
  m.RecordAutotune("hit");
  m.RecordAutotune("hit");
  m.RecordAutotune("tuned");
  const std::string text = m.Render();
  EXPECT_EQ(Sample(text, R"(flashserve_phase_duration_seconds_bucket{phase="queue",le="1e-05"})"),
            "1");
  EXPECT_EQ(Sample(text, R"(flashserve_phase_duration_seconds_bucket{phase="h2d",le="0.001"})"),
            "1");
  EXPECT_EQ(Sample(text, R"(flashserve_phase_duration_seconds_bucket{phase="d2h",le="0.001"})"),
            "0");
  EXPECT_EQ(Sample(text, R"(flashserve_kernel_tflops_bucket{kernel="sm80_fp16_hd128",le="350"})"),
            "1");
  EXPECT_EQ(Sample(text, R"(flashserve_kernel_tflops_bucket{kernel="sm80_fp16_hd128",le="400"})"),
            "2");
  EXPECT_EQ(Sample(text, R"(flashserve_kernel_tflops_bucket{kernel="sm80_fp16_hd128",le="1000"})"),
            "2");
  EXPECT_EQ(Sample(text, R"(flashserve_kernel_tflops_count{kernel="cpu"})"), "2");
  EXPECT_EQ(Sample(text, R"(flashserve_kernel_tflops_bucket{kernel="cpu",le="0.025"})"), "1");
  EXPECT_EQ(Sample(text, R"(flashserve_autotune_total{result="hit"})"), "2");
  EXPECT_EQ(Sample(text, R"(flashserve_autotune_total{result="tuned"})"), "1");
}

TEST(ServerMetricsTest, GaugesAndCallbacks) {
  ServerMetrics m(TestOptions());
  m.InflightInc();
  m.InflightInc();
  m.InflightDec();
  int depth = 5;
  m.SetQueueDepthCallback([&depth] { return double(depth); });
  m.SetDevicePool(0, 1 << 20, 1 << 30);
  PoolBytes pool{123, 4096};
  m.SetDevicePoolCallback(1, [&pool] { return pool; });
  m.SetPinnedPool(7, 8);
  std::string text = m.Render();
  EXPECT_EQ(Sample(text, "flashserve_inflight_requests"), "1");
  EXPECT_EQ(Sample(text, "flashserve_queue_depth"), "5");
  EXPECT_EQ(Sample(text, R"(flashserve_device_memory_pool_bytes{device="0",state="used"})"),
            "1048576");
  EXPECT_EQ(Sample(text, R"(flashserve_device_memory_pool_bytes{device="0",state="reserved"})"),
            "1073741824");
  EXPECT_EQ(Sample(text, R"(flashserve_device_memory_pool_bytes{device="1",state="used"})"), "123");
  EXPECT_EQ(Sample(text, R"(flashserve_pinned_memory_pool_bytes{state="reserved"})"), "8");
  depth = 2;
  pool.used = 4000;
  m.SetPinnedPoolCallback([] { return PoolBytes{1, 2}; });
  text = m.Render();
  EXPECT_EQ(Sample(text, "flashserve_queue_depth"), "2");
  EXPECT_EQ(Sample(text, R"(flashserve_device_memory_pool_bytes{device="1",state="used"})"),
            "4000");
  EXPECT_EQ(Sample(text, R"(flashserve_pinned_memory_pool_bytes{state="used"})"), "1");
  m.SetQueueDepthCallback(nullptr);
  m.SetQueueDepth(11);
  EXPECT_EQ(Sample(m.Render(), "flashserve_queue_depth"), "11");
}

TEST(ServerMetricsTest, QueueCapacityAndBackendHealth) {
  ServerMetrics m(TestOptions());
  std::string text = m.Render();
  EXPECT_NE(text.find("\n# TYPE flashserve_backend_healthy gauge\n"), std::string::npos);
  EXPECT_EQ(Sample(text, "flashserve_backend_healthy"), "1");  // before a backend reports
  EXPECT_EQ(Sample(text, "flashserve_queue_capacity"), "0");
  m.SetQueueCapacity(64);
  bool healthy = true;
  m.SetBackendHealthyCallback([&healthy] { return healthy; });
  EXPECT_EQ(Sample(m.Render(), "flashserve_queue_capacity"), "64");
  EXPECT_EQ(Sample(m.Render(), "flashserve_backend_healthy"), "1");
  healthy = false;  // a sticky device fault: read at the next scrape
  EXPECT_EQ(Sample(m.Render(), "flashserve_backend_healthy"), "0");
}

TEST(ServerMetricsTest, NamesOfCodesAndPhases) {
  EXPECT_EQ(GrpcCodeName(0), "OK");
  EXPECT_EQ(GrpcCodeName(3), "INVALID_ARGUMENT");
  EXPECT_EQ(GrpcCodeName(16), "UNAUTHENTICATED");
  EXPECT_EQ(GrpcCodeName(17), "UNKNOWN");
  EXPECT_EQ(GrpcCodeName(-1), "UNKNOWN");
  EXPECT_EQ(PhaseName(Phase::kH2D), "h2d");
}

}  // namespace
}  // namespace flashserve
