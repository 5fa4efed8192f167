// config/: flag strings -> ServerConfig -> Check(). Every bad value is refused with a message
// naming its flag, the defaults are the README's, and the exit decision of config/serve_loop.h.
#include <pthread.h>

#include <csignal>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "config/flags.h"
#include "config/serve_loop.h"
#include "config/server_config.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

// Sets one flag from its command-line text, as `--name=value` would.
void SetFlag(const std::string& name, const std::string& value) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  ASSERT_NE(flag, nullptr) << "no flag --" << name;
  std::string error;
  ASSERT_TRUE(flag->ParseFrom(value, &error)) << "--" << name << "=" << value << ": " << error;
}

absl::StatusOr<ServerConfig> ConfigWith(
    const std::vector<std::pair<std::string, std::string>>& flags) {
  for (const auto& [name, value] : flags) SetFlag(name, value);
  return ServerConfigFromFlags();
}

TEST(ServerConfigTest, DefaultFlagsGiveTheStructDefaults) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config = ServerConfigFromFlags();
  ASSERT_TRUE(config.ok()) << config.status();
  const ServerConfig defaults;
  EXPECT_EQ(config->network.host, defaults.network.host);
  EXPECT_EQ(config->network.grpc_port, 8001);
  EXPECT_EQ(config->network.grpc_memory_quota_bytes, -1);  // auto: sized by the gRPC edge
  EXPECT_EQ(config->memory.receive_arena_bytes, MemoryOptions::kAuto);
  EXPECT_EQ(config->memory.pinned_pool_bytes, kDefaultRequestPoolBytes);
  EXPECT_EQ(config->backend.kind, "auto");
  EXPECT_EQ(config->backend.cuda.streams_per_device, defaults.backend.cuda.streams_per_device);
  EXPECT_EQ(config->backend.cuda.device_pool_release_threshold_bytes, int64_t{4} << 30);
  EXPECT_EQ(config->scheduler.queue_capacity, defaults.scheduler.queue_capacity);
  EXPECT_EQ(config->limits.validation.max_tensor_elements, ValidationLimits{}.max_tensor_elements);
  EXPECT_EQ(config->limits.max_request_bytes, int64_t{1} << 30);
  EXPECT_EQ(config->stream.max_sessions, 16);
  EXPECT_EQ(config->http.max_connections, HttpOptions{}.max_connections);
  EXPECT_EQ(config->shutdown.grace_seconds, 10);
  EXPECT_FALSE(config->test_hooks.enable_fault_injection);
  EXPECT_EQ(config->local.socket_path, "");  // the local socket is off unless asked for
  EXPECT_EQ(config->local.socket_mode, 0600);
  EXPECT_EQ(config->local.max_connections, defaults.local.max_connections);
  EXPECT_EQ(config->local.max_frame_bytes, int64_t{8} << 20);
  EXPECT_EQ(config->local.read_timeout_ms, defaults.local.read_timeout_ms);
  EXPECT_EQ(config->local.spin_us, LocalOptions::kAuto);
}

TEST(ServerConfigTest, FlagsReachTheirFields) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config = ConfigWith({{"pinned_pool_bytes", "12345"},
                                                    {"devices", "1, 3"},
                                                    {"worker_threads", "3"},
                                                    {"receive_arena_bytes", "0"},
                                                    {"grpc_memory_quota_bytes", "0"},
                                                    {"max_tensor_elements", "1099511627776"},
                                                    {"http_body_timeout_s", "7"},
                                                    {"autotune", "startup"},
                                                    {"tune_head_dims", "128"},
                                                    {"local_socket", "/run/fs.sock"},
                                                    {"local_socket_mode", "0660"},
                                                    {"local_max_frame_bytes", "4096"}});
  ASSERT_TRUE(config.ok()) << config.status();
  // One flag sizes both backends' request-buffer pools.
  const BackendOptions backend = config->ResolvedBackend();
  EXPECT_EQ(backend.cuda.pinned_pool_bytes, 12345);
  EXPECT_EQ(backend.cpu.buffer_pool_bytes, 12345);
  EXPECT_EQ(backend.cuda.devices, (std::vector<int>{1, 3}));
  EXPECT_EQ(backend.cpu.num_threads, 3);
  EXPECT_EQ(config->memory.ReceiveArenaBytesFor("cuda"), 0);
  EXPECT_EQ(config->network.grpc_memory_quota_bytes, 0);
  EXPECT_EQ(config->limits.validation.max_tensor_elements, int64_t{1} << 40);
  EXPECT_EQ(config->http.body_timeout_s, 7);
  EXPECT_EQ(config->local.socket_path, "/run/fs.sock");
  EXPECT_EQ(config->local.socket_mode, 0660);  // octal, as chmod reads it
  EXPECT_EQ(config->local.max_frame_bytes, 4096);
  // bf16,fp16 x head dim 128 x causal both x 4 seqlens x gqa 1 (two head dims would be 32).
  EXPECT_EQ(backend.cuda.startup_grid.points.size(), 16u);
}

TEST(ServerConfigTest, AutoValuesResolvePerBackend) {
  MemoryOptions memory;
  EXPECT_EQ(memory.ReceiveArenaBytesFor("cuda"), int64_t{1} << 30);
  EXPECT_EQ(memory.ReceiveArenaBytesFor("cpu"), 0);
  memory.receive_arena_bytes = 1 << 20;
  EXPECT_EQ(memory.ReceiveArenaBytesFor("cpu"), 1 << 20);
  RequestThreadOptions threads;
  EXPECT_EQ(threads.HotLaneSpinUsFor("cuda", 16), 1000);
  EXPECT_EQ(threads.HotLaneSpinUsFor("cuda", 2), 0);
  EXPECT_EQ(threads.HotLaneSpinUsFor("cpu", 16), 0);
  threads.hot_lane_spin_us = 5;
  EXPECT_EQ(threads.HotLaneSpinUsFor("cpu", 2), 5);
  LocalOptions local;
  EXPECT_EQ(local.SpinUsFor(16), 200);
  EXPECT_EQ(local.SpinUsFor(2), 0);
  local.spin_us = 7;
  EXPECT_EQ(local.SpinUsFor(2), 7);
}

struct BadValue {
  std::string flag, value;
};

class BadFlagTest : public testing::TestWithParam<BadValue> {};

TEST_P(BadFlagTest, IsRefusedNamingTheFlag) {
  absl::FlagSaver saver;
  const BadValue& bad = GetParam();
  absl::StatusOr<ServerConfig> config = ConfigWith({{bad.flag, bad.value}});
  ASSERT_FALSE(config.ok()) << "--" << bad.flag << "=" << bad.value << " was accepted";
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  // --tls_key alone is refused as "--tls_cert and --tls_key"; the tune grid as "--tune_*".
  const std::string named =
      bad.flag.rfind("tune_", 0) == 0 && bad.flag != "tune_cache" ? "--tune_*" : "--" + bad.flag;
  EXPECT_NE(config.status().message().find(named), std::string::npos) << config.status();
}

std::vector<BadValue> BadValues() {
  return {
      {"grpc_port", "-1"},
      {"http_port", "65536"},
      {"metrics_port", "70000"},
      {"http_port", "8001"},     // the default --grpc_port
      {"metrics_port", "8000"},  // the default --http_port
      {"tls_cert", "cert.pem"},
      {"grpc_memory_quota_bytes", "-2"},
      // Ready, then every call failed ("Buffers full"); the second is --max_request_bytes alone.
      {"grpc_memory_quota_bytes", "1"},
      {"grpc_memory_quota_bytes", "1073741824"},
      {"http_max_connections", "0"},
      {"http_max_connections_per_ip", "-1"},
      {"http_max_header_bytes", "0"},
      {"http_max_header_bytes", "1023"},     // the listener needs 1 KiB
      {"http_max_header_bytes", "1048577"},  // + 16 KiB overflowed int near INT_MAX
      {"http_max_header_bytes", "2147467264"},
      {"http_idle_timeout_s", "0"},
      {"http_idle_timeout_s", "86401"},
      {"http_idle_timeout_s", "4294968"},  // libmicrohttpd's 32-bit milliseconds: ~0.7 s
      {"http_header_timeout_s", "-5"},
      {"http_header_timeout_s", "86401"},
      {"http_body_timeout_s", "0"},
      {"http_body_timeout_s", "2147483647"},
      {"http_max_json_bytes", "0"},
      {"http_max_json_bytes", "1023"},  // the HTTP edge needs 1 KiB (it failed later, otherwise)
      {"http_max_receive_bytes", "0"},
      {"receive_arena_bytes", "-2"},
      {"pinned_pool_bytes", "-1"},
      {"malloc_mmap_threshold_bytes", "33554433"},
      {"malloc_mmap_threshold_bytes", "-1"},
      {"malloc_trim_threshold_bytes", "1073741825"},
      {"malloc_arena_max", "1025"},
      {"backend", "tpu"},
      {"devices", "0,x"},
      {"devices", "-1"},
      {"streams_per_device", "0"},
      {"streams_per_device", "65"},
      {"completion_spin_us", "-1"},
      {"completion_spin_us", "1000001"},
      {"copy_pipeline_chunks", "0"},
      {"copy_pipeline_chunks", "9"},
      {"device_pool_release_threshold_bytes", "-1"},
      {"max_device_bytes_per_request", "-1"},
      {"autotune", "sometimes"},
      {"worker_threads", "-1"},
      {"worker_threads", "1025"},
      {"worker_threads", "100000"},  // std::system_error from std::thread ended the process
      {"queue_capacity", "0"},
      {"max_tensor_elements", "0"},
      {"max_tensor_elements", "1099511627777"},
      {"max_tensor_elements", "4611686018427387904"},  // 2^62: its byte sizes overflow int64
      {"max_request_bytes", "0"},
      {"max_request_bytes", "2147483648"},
      {"max_inflight_bytes", "-1"},
      {"copy_threads", "65"},
      {"copy_threads", "-1"},
      {"hot_lane_spin_us", "-2"},
      {"hot_lane_spin_us", "1000001"},
      {"stream_max_sessions", "0"},
      {"stream_session_timeout_ms", "0"},
      {"stream_session_timeout_ms", "86400001"},  // longer overflowed the reaper's arithmetic
      {"model_name", ""},
      {"model_name", "a/b"},
      {"log_level", "loud"},
      {"log_format", "xml"},
      {"shutdown_grace_seconds", "-1"},
      {"shutdown_grace_seconds", "2147483647"},  // grace + 20 s overflowed: exit 3 at once
      {"local_socket", std::string(108, 'a')},   // longer than sun_path holds
      {"local_socket_mode", "0800"},
      {"local_socket_mode", "rw"},
      {"local_socket_mode", "01000"},
      {"local_max_connections", "0"},
      {"local_max_frame_bytes", "15"},
      {"local_max_frame_bytes", "2147483648"},
      {"local_read_timeout_ms", "0"},
      {"local_spin_us", "-2"},
      {"local_spin_us", "1000001"},
      {"decode_launches_in_flight", "0"},
      {"decode_launches_in_flight", "5"},
      {"max_batch_sequences", "0"},
      {"max_batch_sequences", "65536"},
      {"http_min_body_bytes_per_s", "-1"},
      {"batch_window_us", "-1"},
  };
}

INSTANTIATE_TEST_SUITE_P(AllChecks, BadFlagTest, testing::ValuesIn(BadValues()));

// The ends of the ranges the checks above refuse just past.
TEST(ServerConfigTest, LargestValuesAreAccepted) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config = ConfigWith({{"http_max_header_bytes", "1048576"},
                                                    {"http_idle_timeout_s", "86400"},
                                                    {"http_header_timeout_s", "86400"},
                                                    {"http_body_timeout_s", "86400"},
                                                    {"worker_threads", "1024"},
                                                    {"sequence_ttl_s", "9223372036854775807"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->http.max_header_bytes, 1 << 20);
  EXPECT_EQ(config->http.idle_timeout_s, 86400);
  EXPECT_EQ(config->backend.cpu.num_threads, 1024);
  ASSERT_TRUE(ConfigWith({{"http_max_header_bytes", "1024"}}).ok());
}

// An explicit gRPC quota holds a request of --max_request_bytes plus 4 MiB; -1 (auto) and 0
// (gRPC's default) stay valid whatever --max_request_bytes is.
TEST(ServerConfigTest, GrpcMemoryQuotaHoldsTheLargestRequest) {
  absl::FlagSaver saver;
  SetFlag("max_request_bytes", "1048576");
  for (const char* quota : {"-1", "0", "5242880", "16777216"}) {
    absl::StatusOr<ServerConfig> config = ConfigWith({{"grpc_memory_quota_bytes", quota}});
    EXPECT_TRUE(config.ok()) << "--grpc_memory_quota_bytes=" << quota << ": " << config.status();
  }
  absl::StatusOr<ServerConfig> config = ConfigWith({{"grpc_memory_quota_bytes", "5242879"}});
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* flag : {"--grpc_memory_quota_bytes", "--max_request_bytes", "5242880"}) {
    EXPECT_NE(config.status().message().find(flag), std::string::npos) << config.status();
  }
}

TEST(BadFlagTest, TuneGridIsCheckedForStartupTuning) {
  absl::FlagSaver saver;
  absl::StatusOr<ServerConfig> config =
      ConfigWith({{"autotune", "startup"}, {"tune_causal", "maybe"}});
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find("--tune_*"), std::string::npos) << config.status();
}

// README's "Server flags" table: `--flag` | `default` | meaning; a row may name several flags
// with as many defaults ("`a`, `b`").
std::vector<std::pair<std::string, std::string>> ReadmeDefaults() {
  std::ifstream file(FLASHSERVE_README);
  std::stringstream text;
  text << file.rdbuf();
  const std::string all = text.str();
  const size_t begin = all.find("## Server flags");
  const size_t end = all.find("\n## ", begin + 1);
  std::vector<std::pair<std::string, std::string>> defaults;
  for (absl::string_view line : absl::StrSplit(all.substr(begin, end - begin), '\n')) {
    if (!absl::ConsumePrefix(&line, "| `--")) continue;
    std::vector<std::string> cells = absl::StrSplit(line, " | ");
    std::vector<std::string> names =
        absl::StrSplit(cells[0], absl::ByAnyChar("`, -"), absl::SkipEmpty());
    std::vector<std::string> values = absl::StrSplit(cells[1], ", ");
    if (values.size() != names.size()) values.assign(names.size(), cells[1]);
    for (size_t i = 0; i < names.size(); ++i) {
      std::string value(absl::StripSuffix(absl::StripPrefix(values[i], "`"), "`"));
      if (value == "empty" || value == "all") value = "";
      defaults.emplace_back(names[i], value);
    }
  }
  return defaults;
}

TEST(ServerConfigTest, DefaultsAreTheReadmeTable) {
  const auto defaults = ReadmeDefaults();
  ASSERT_GT(defaults.size(), 40u) << "could not read README's Server flags table";
  for (const auto& [name, value] : defaults) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    ASSERT_NE(flag, nullptr) << "README documents --" << name << ", which is not a flag";
    EXPECT_EQ(flag->DefaultValue(), value) << "--" << name << ": README's default differs";
  }
}

TEST(ServeLoopTest, UnhealthyBackendStopsWithExitCode3) {
  int asked = 0;
  const absl::Time start = absl::Now();
  const StopEvent stop = WaitForStop([&] { return ++asked < 3; }, absl::Milliseconds(10));
  EXPECT_EQ(stop.reason, StopReason::kBackendUnhealthy);
  EXPECT_EQ(asked, 3);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(ExitCodeFor(stop.reason), 3);
  EXPECT_EQ(ExitCodeFor(stop.reason), ShutdownOptions::kExitBackendUnhealthy);
}

TEST(ServeLoopTest, SignalStopsWithExitCode0) {
  BlockShutdownSignals();  // so the signal below stays pending for the wait to take
  ASSERT_EQ(pthread_kill(pthread_self(), SIGTERM), 0);
  const StopEvent stop = WaitForStop([] { return true; }, absl::Milliseconds(10));
  EXPECT_EQ(stop.reason, StopReason::kSignal);
  EXPECT_EQ(stop.signal_number, SIGTERM);
  EXPECT_EQ(ExitCodeFor(stop.reason), 0);
}

TEST(ServeLoopTest, LingerEndsAtTheDeadlineOrAtASignal) {
  BlockShutdownSignals();
  absl::Time start = absl::Now();
  EXPECT_FALSE(WaitForSignalUntil(start + absl::Milliseconds(50)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  ASSERT_EQ(pthread_kill(pthread_self(), SIGINT), 0);
  start = absl::Now();
  EXPECT_TRUE(WaitForSignalUntil(start + absl::Seconds(30)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A shutdown stuck behind a launch the device never completes: the process ends with the given
// code once the limit passes, running no destructors (the stuck one would never return).
TEST(ServeLoopDeathTest, ShutdownPastItsLimitEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto stuck_teardown = [] {
    ExitIfShutdownOutlasts(absl::Milliseconds(100), ShutdownOptions::kExitBackendUnhealthy);
    absl::SleepFor(absl::Seconds(60));  // a destructor waiting for the device
    std::exit(0);
  };
  const absl::Time start = absl::Now();
  EXPECT_EXIT(stuck_teardown(), ::testing::ExitedWithCode(ShutdownOptions::kExitBackendUnhealthy),
              "");
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST(ServeLoopDeathTest, ShutdownWithinItsLimitExitsAsItWould) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto quick_teardown = [] {
    ExitIfShutdownOutlasts(absl::Seconds(30), ShutdownOptions::kExitBackendUnhealthy);
    std::exit(0);
  };
  EXPECT_EXIT(quick_teardown(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flashserve
