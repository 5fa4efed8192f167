// Every server flag (ABSL_FLAG), its default taken from the options struct that owns it, and the
// one conversion of the flags into a ServerConfig. `flashserve --help` lists the flags of this
// file; README's "Server flags" table lists the same (tests/python/test_flag_docs.py).
#include "config/flags.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "autotune/tune_grid.h"
#include "common/flag_file.h"
#include "common/logging.h"
#include "common/version.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, host, flashserve::NetworkOptions{}.host,
          "Address the gRPC, HTTP and metrics servers bind to (0.0.0.0 for all interfaces)");
ABSL_FLAG(int, grpc_port, flashserve::NetworkOptions{}.grpc_port,
          "gRPC port (AttentionService, AttentionStreamService, Sequences, KServe v2 "
          "GRPCInferenceService, health, reflection); 0 picks a free port; the gRPC, HTTP and "
          "metrics ports must differ");
ABSL_FLAG(int, http_port, flashserve::NetworkOptions{}.http_port,
          "HTTP port (KServe v2 REST, /v2/health/live, /v2/health/ready); 0 picks a free port");
ABSL_FLAG(int, metrics_port, flashserve::NetworkOptions{}.metrics_port,
          "Prometheus metrics port (GET /metrics, text format 0.0.4); 0 picks a free port");
ABSL_FLAG(std::string, backend, flashserve::BackendOptions{}.kind,
          "Compute backend: auto (CUDA when a usable GPU exists, else CPU), cuda or cpu");
ABSL_FLAG(std::string, devices, "", "CUDA devices to use, e.g. \"0,1\"; empty: all visible");
ABSL_FLAG(int, streams_per_device, flashserve::CudaBackendOptions{}.streams_per_device,
          "CUDA backend: streams (jobs in flight) per device, in [1, 64]; with 2+ one job's copies "
          "overlap another's kernel; 4 rather than 2 gave 16-64 concurrent small requests 10-30% "
          "more calls/s");
ABSL_FLAG(int, completion_spin_us, flashserve::CudaBackendOptions{}.completion_spin_us,
          "CUDA backend: how long a stream's completion thread polls for its job to finish before "
          "it polls every ~20 us with short sleeps (up to 20 ms) and then sleeps (a sleeping wait "
          "wakes tens of us late, which dominates small requests; polling uses a core only while "
          "such a job runs); 0: always sleep, max 1000000");
ABSL_FLAG(int, copy_pipeline_chunks, flashserve::CudaBackendOptions{}.copy_pipeline_chunks,
          "CUDA backend: cut a request with >= 8 MiB of inputs in one page-locked piece each "
          "(staged, or a system shared-memory region) that is alone on its GPU into this many "
          "head chunks, so that one chunk's copies overlap another's kernel (H2D, kernel and "
          "D2H at once); in [1, 8], "
          "1: off (one copy in, the kernel, one copy out)");
ABSL_FLAG(
    int, copy_threads, flashserve::RequestThreadOptions{}.copy_threads,
    "Helper threads that copy a large request (>= 4 MiB) from gRPC's receive buffers into the "
    "backend's (pinned) buffers beside the gRPC thread, in [0, 64]; one thread copies ~6 GB/s "
    "into pinned memory. 0: the gRPC thread copies alone");
ABSL_FLAG(int64_t, hot_lane_spin_us, flashserve::RequestThreadOptions{}.hot_lane_spin_us,
          "Attention requests under 4 MiB are processed on one thread that polls for the next "
          "request this long (microseconds) after each one, keeping its core warm (one core busy "
          "while requests keep coming; it sleeps after this long without one). gRPC otherwise runs "
          "each request on whichever of its threads is free, on a cold core: ~2x the CPU time of a "
          "small GPU request. -1: 1000 with the CUDA backend on a machine with >= 4 cores, else 0 "
          "(CPU-backend requests take milliseconds; on 2-3 cores a polling thread costs too "
          "much); 0: no such thread; at most 1000000");
ABSL_FLAG(bool, enable_fault_injection, false,
          "TEST ONLY: an Attention request whose request_id is "
          "\"flashserve-test:inject-device-fault\" faults its GPU (sticky CUDA error) instead of "
          "computing, to exercise the unhealthy-device path; one whose request_id is "
          "\"flashserve-test:inject-device-hang\" never completes (CUDA: a kernel spins for "
          "10 minutes), to exercise the bounded shutdown; one whose request_id is "
          "\"flashserve-test:inject-launch-error\" has a CUDA call refused (not sticky; CUDA "
          "only), to exercise the failed-launch path. Never enable in production");
ABSL_FLAG(int64_t, malloc_mmap_threshold_bytes, flashserve::MallocOptions{}.mmap_threshold_bytes,
          "glibc malloc: allocations of at least this many bytes get their own mmap and go back "
          "to the system when freed. A fixed threshold stops glibc from raising it after large "
          "frees and then keeping tensor-sized buffers in per-thread arenas (RSS growth under "
          "mixed traffic; tests/soak/RESULTS.md); 0 keeps glibc's dynamic default");
ABSL_FLAG(int64_t, malloc_trim_threshold_bytes, flashserve::MallocOptions{}.trim_threshold_bytes,
          "glibc malloc: while Attention, CreateSequence or Append requests of >= 16 MiB or "
          "DecodeSteps keep arriving (one in the last 10 s), gRPC's receive buffers (256 KiB-4 MiB "
          "chunks) and message strings below 32 MiB come from malloc's heap instead of their own "
          "mmaps, and free memory at the top of a heap goes back to the system only above this "
          "many bytes: the next big request or step reuses the pages instead of page-faulting "
          "them in again (50 MB requests ~10 ms faster, a 64-sequence decode step 0.08-0.6 ms, an "
          "8k-token prefix 4,000-8,000 fewer faults). Costs up to this much per malloc arena while it "
          "lasts. 0 (or --malloc_mmap_threshold_bytes=0): never");
ABSL_FLAG(int, malloc_arena_max, flashserve::MallocOptions{}.arena_max,
          "glibc malloc: at most this many arenas (glibc's default, 0, is 8 per core). While "
          "--malloc_trim_threshold_bytes keeps big requests' receive buffers, each arena that "
          "received one keeps its own; fewer arenas bound that memory (and add lock contention)");
ABSL_FLAG(int64_t, device_pool_release_threshold_bytes,
          flashserve::CudaBackendOptions{}.device_pool_release_threshold_bytes,
          "CUDA backend: freed device memory the stream-ordered pool (cudaMallocAsync) keeps "
          "mapped for reuse instead of returning it to the driver, per device");
ABSL_FLAG(int64_t, pinned_pool_bytes, flashserve::MemoryOptions{}.pinned_pool_bytes,
          "Cap of the pool of request buffers (power-of-two size classes from 64 KiB, reused "
          "between requests; also a DecodeStep's O/LSE, sent from there): page-locked on the "
          "CUDA backend (a request that does not fit is served with slower pageable copies, a "
          "DecodeStep answer is copied into its message), heap memory on the CPU backend (no page "
          "faults of fresh buffers); 0 disables the pool");
ABSL_FLAG(bool, allow_client_shm, flashserve::ShmLimits{}.allow,
          "Serve Triton's shared-memory extension (system and CUDA regions of co-located "
          "clients; memory/shm_regions.h). Off: every shared-memory call is refused");
ABSL_FLAG(int, shm_max_regions, flashserve::ShmLimits{}.max_regions,
          "Shared-memory regions registered at once (system and CUDA together)");
ABSL_FLAG(int64_t, shm_max_bytes, flashserve::ShmLimits{}.max_bytes,
          "Bytes of shared-memory regions registered at once (system and CUDA together)");
ABSL_FLAG(std::string, shm_key_prefix, flashserve::ShmLimits{}.key_prefix,
          "System shared memory: only shm_open keys starting with '/' and this (letters, digits, "
          "'_', '.', '-'; empty: any key), so that clients cannot name other programs' objects");
ABSL_FLAG(bool, shm_any_uid, flashserve::ShmLimits{}.any_uid,
          "System shared memory: map objects owned by any user (default: only those owned by the "
          "server's own uid)");
ABSL_FLAG(int64_t, receive_arena_bytes, flashserve::MemoryOptions{}.receive_arena_bytes,
          "Memory for gRPC's socket read buffers (blocks of 64 KiB-4 MiB), so the native API's "
          "tensors can be copied to the GPU straight from where they arrived instead of being "
          "copied into pinned memory first: page-locked and allocated at startup on the CUDA "
          "backend; when it is full, buffers come from the heap and requests are copied as "
          "before. -1: 1 GiB on the CUDA backend, none on the CPU backend (where it only serves "
          "tests of the mechanism); 0: none");
ABSL_FLAG(int64_t, max_device_bytes_per_request,
          flashserve::CudaBackendOptions{}.max_device_bytes_per_request,
          "CUDA backend: a request needing more device memory (Q, K, V, O, LSE) gets "
          "RESOURCE_EXHAUSTED before any allocation; 0: no limit (the GPU's free memory is)");
ABSL_FLAG(std::string, autotune, flashserve::CudaBackendOptions{}.autotune,
          "Kernel autotuning (CUDA backend): off (use --tune_cache read-only, else heuristic "
          "defaults), background (unseen problem classes are served with the default while they "
          "are tuned off the request path), startup (tune the --tune_* grid before reporting "
          "ready, then background)");
ABSL_FLAG(std::string, tune_cache, "",
          "Autotuning cache file (JSON; written by the server and flashserve-tune); a cache from "
          "another GPU model or kernel build is ignored with a warning");
ABSL_FLAG(int, tune_max_classes, flashserve::CudaBackendOptions{}.tune_max_classes,
          "Autotuning: problem classes the server holds (cached, queued or failed); a miss past "
          "it keeps the heuristic default and counts autotune_total{result=\"skipped\"}. Decode "
          "classes follow the clients' head counts and shapes, so this bounds what they can make "
          "the server tune and store");
ABSL_FLAG(std::string, tune_dtypes, "bf16,fp16", "--autotune=startup grid: dtypes");
ABSL_FLAG(std::string, tune_head_dims, "64,128", "--autotune=startup grid: head dims");
ABSL_FLAG(std::string, tune_causal, "both", "--autotune=startup grid: yes, no or both");
ABSL_FLAG(std::string, tune_seqlens, "512,1024,2048,4096",
          "--autotune=startup grid: sequence lengths, q or q:k");
ABSL_FLAG(std::string, tune_gqa, "1", "--autotune=startup grid: GQA ratios heads_q/heads_kv");
ABSL_FLAG(int64_t, max_request_bytes, flashserve::LimitsOptions{}.max_request_bytes,
          "Largest serialized request accepted (bytes, at most 2147483647); larger ones get "
          "RESOURCE_EXHAUSTED before they are parsed (gRPC still receives them: bound that memory "
          "with --grpc_memory_quota_bytes)");
ABSL_FLAG(
    int64_t, max_inflight_bytes, flashserve::LimitsOptions{}.max_inflight_bytes,
    "Tensor bytes (inputs + outputs) of all accepted, unfinished requests; a request that would "
    "pass it gets RESOURCE_EXHAUSTED (one request alone is always admitted); 0: no limit");
// The help text below spells the headroom out (a flag's help must be a literal).
static_assert(flashserve::ServerConfig::kMinGrpcMemoryQuotaHeadroom == 4194304);
ABSL_FLAG(
    int64_t, grpc_memory_quota_bytes, flashserve::NetworkOptions{}.grpc_memory_quota_bytes,
    "gRPC resource quota for its buffers (received messages included): over it, new calls get "
    "RESOURCE_EXHAUSTED instead of growing the process. -1: auto, a quarter of the host's memory "
    "(the smaller of physical memory and the container's cgroup memory limit), at most 4 GiB and "
    "at least --max_request_bytes + 64 MiB; 0: gRPC's default (no bound); else at least "
    "--max_request_bytes + 4194304");
ABSL_FLAG(int, answer_timeout_s, flashserve::NetworkOptions{}.answer_timeout_s,
          "A tensor answer the client has not taken this long after it was ready is dropped: "
          "gRPC (Attention, ModelInfer, Attend, DecodeStep, inline Compute) cancels the call, its "
          "bytes counting against --max_inflight_bytes until then; HTTP closes the connection. "
          "0: no limit");
ABSL_FLAG(
    std::string, tls_cert, "",
    "PEM certificate (chain) file: with --tls_key, gRPC, HTTP and metrics are served over TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key file for --tls_cert");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token (>= 16 printable characters); when set, gRPC calls need "
          "metadata 'authorization: Bearer <token>' and HTTP/metrics requests the same header. "
          "Also read from $FLASHSERVE_AUTH_TOKEN when this flag is empty");
ABSL_FLAG(
    bool, auth_open_health, flashserve::NetworkOptions{}.auth_open_health,
    "With a token: leave /v2/health/* open (probes need no token); gRPC health is always open");
ABSL_FLAG(int64_t, max_tensor_elements, flashserve::ValidationLimits{}.max_tensor_elements,
          "Largest element count of one tensor (Q, K or V), in [1, 2^40]; larger ones get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(
    int, queue_capacity, flashserve::SchedulerOptions{}.queue_capacity,
    "Requests that may wait for a worker; when full, new ones get RESOURCE_EXHAUSTED at once");
ABSL_FLAG(int, worker_threads, flashserve::CpuBackendOptions{}.num_threads,
          "CPU backend compute threads, at most 1024; 0 uses every core");
ABSL_FLAG(
    int, shutdown_grace_seconds, flashserve::ShutdownOptions{}.grace_seconds,
    "On SIGINT/SIGTERM/SIGHUP: how long in-flight requests may take to finish before they are "
    "cancelled (exit 0; a second signal cancels them at once). After a sticky device fault the "
    "process stays up this long, not ready and not live, then exits 3 so that its supervisor "
    "restarts it (a signal cuts it short). In [0, 86400]");
ABSL_FLAG(
    std::string, log_level, flashserve::LogOptions{}.level,
    "Log level: trace, debug, info, warn, error, critical, off (debug: one line per request)");
static_assert(flashserve::ModelOptions::kMaxNameBytes == 256);  // spelled out below
ABSL_FLAG(std::string, model_name, flashserve::ModelOptions{}.model_name,
          "Model name of the KServe v2 / Open Inference Protocol API (REST /v2/models/<name>, "
          "gRPC inference.GRPCInferenceService): 1 to 256 letters, digits, '_', '-' and '.' "
          "(not \".\" or \"..\"), so that it needs no percent-encoding in a URL");
ABSL_FLAG(int, stream_max_sessions, flashserve::StreamOptions{}.max_sessions,
          "Striped streaming API (flashserve.v1.AttentionStreamService): open sessions at a time; "
          "each holds up to --max_request_bytes of tensors, all together up to "
          "--max_inflight_bytes");
ABSL_FLAG(int64_t, stream_session_timeout_ms, flashserve::StreamOptions{}.session_timeout_ms,
          "Striped streaming API: a session idle for this long is dropped; in [1, 86400000]");
// The Sequences API (flashserve.v1.Sequences): README.md, "Sequences".
ABSL_FLAG(int64_t, kv_cache_bytes, flashserve::SequenceRuntimeOptions{}.cache.capacity_bytes,
          "Sequences API: bytes of the KV cache pool (device memory on the CUDA backend, "
          "reserved at startup; host memory on the CPU backend), rounded down to 2 MiB slabs; "
          "0 or at least 2097152 (one slab); on the CPU backend at most the host's memory "
          "(physical memory, or the cgroup's memory.max when smaller). 0: the Sequences API is "
          "off (its calls get FAILED_PRECONDITION; GetKvPoolInfo answers enabled: false)");
ABSL_FLAG(int, kv_page_tokens, flashserve::SequenceRuntimeOptions{}.cache.page_tokens,
          "Sequences API: tokens per KV page (a page holds K and V of one layer), in [1, 1024]");
ABSL_FLAG(int64_t, sequence_ttl_s,
          absl::ToInt64Seconds(flashserve::SequenceRuntimeOptions{}.cache.ttl),
          "Sequences API: a sequence no call has used for this long (counted from the end of its "
          "last call) is evicted (its id then answers NOT_FOUND); 0: never");
ABSL_FLAG(int, max_sequences, flashserve::SequenceRuntimeOptions{}.cache.max_sequences,
          "Sequences API: live sequences at most (CreateSequence beyond: RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_sequence_tokens,
          flashserve::SequenceRuntimeOptions{}.cache.max_sequence_tokens,
          "Sequences API: tokens per layer of one sequence at most (appends beyond: "
          "INVALID_ARGUMENT)");
ABSL_FLAG(int64_t, batch_window_us, flashserve::SequenceRuntimeOptions{}.batch_window_us,
          "Sequences API: DecodeStep/Attend calls arriving within this many microseconds of the "
          "first waiting one run as one paged launch; 0: each call runs alone");
ABSL_FLAG(bool, batch_when_busy, flashserve::SequenceRuntimeOptions{}.batch_when_busy,
          "Sequences API: DecodeStep/Attend calls that arrive while a decode launch runs wait "
          "for it and then run together as the next launch (no wait when idle); combines with "
          "--batch_window_us");
ABSL_FLAG(int, max_batch_sequences, flashserve::SequenceRuntimeOptions{}.max_batch_sequences,
          "Sequences API: sequences in one paged launch (and items in one DecodeStep) at most; in "
          "[1, 65535]");
ABSL_FLAG(int, decode_launches_in_flight, flashserve::SequenceRuntimeOptions{}.launches_in_flight,
          "Sequences API: decode launches queued on the GPU at once, in [1, 4]: the next one is "
          "prepared and queued while one runs (each holds its own scratch); with "
          "--batch_when_busy also the batches that run at once (at most the scheduler's "
          "workers: --streams_per_device per GPU). "
          "1: one launch at a time");
ABSL_FLAG(std::string, log_format, flashserve::LogOptions{}.format,
          "Log format: text, or json (one JSON object per line)");
// The HTTP ports (8000 and 8002) against hostile clients: server/edge/http/README.md.
ABSL_FLAG(int, http_max_connections, flashserve::HttpLimitsOptions{}.max_connections,
          "HTTP and metrics ports: open connections each; near the cap the longest idle ones are "
          "closed, at it new ones wait unaccepted (the open-file soft limit is raised to fit "
          "them, else the cap lowered, with a warning)");
ABSL_FLAG(int, http_max_connections_per_ip, flashserve::HttpLimitsOptions{}.max_connections_per_ip,
          "HTTP and metrics ports: open connections per client address; 0: no per-address cap");
ABSL_FLAG(int, http_max_header_bytes, flashserve::HttpLimitsOptions{}.max_header_bytes,
          "HTTP: request line plus headers, bytes (431 or 414 beyond), in [1024, 1048576]; at "
          "most 100 header fields");
ABSL_FLAG(int, http_idle_timeout_s, flashserve::HttpLimitsOptions{}.idle_timeout_s,
          "HTTP: a connection that sends nothing for this long is closed (idle keep-alive too); "
          "in [1, 86400]");
ABSL_FLAG(int, http_header_timeout_s, flashserve::HttpLimitsOptions{}.header_timeout_s,
          "HTTP: the headers must arrive within this long of the request line, else closed; in "
          "[1, 86400]");
ABSL_FLAG(int, http_body_timeout_s, flashserve::HttpLimitsOptions{}.body_timeout_s,
          "HTTP: a request body must arrive within this long of its headers, else the "
          "connection is cut off; in [1, 86400]");
ABSL_FLAG(int64_t, http_min_body_bytes_per_s, flashserve::HttpLimitsOptions{}.min_body_bytes_per_s,
          "HTTP: from 5 s after its headers, a request body arriving slower than this on "
          "average is cut off (a claimed body holds --http_max_receive_bytes while it comes); "
          "0: no floor");
ABSL_FLAG(int64_t, http_max_json_bytes, flashserve::HttpLimitsOptions{}.max_json_bytes,
          "HTTP: the JSON part of a KServe infer body (413 beyond)");
ABSL_FLAG(int64_t, http_max_receive_bytes, flashserve::HttpLimitsOptions{}.max_receive_bytes,
          "HTTP: request-body bytes held at once over all requests, and their answers' bytes "
          "until read (503 beyond: retry later)");

// The local transport (server/edge/local): frames over a Unix socket for clients on this host.
ABSL_FLAG(std::string, local_socket, "",
          "Path of a Unix socket serving Attention, DecodeStep and Attend in length-prefixed "
          "frames (proto/flashserve/v1/local_frame.h) for clients on this host; empty: off");
ABSL_FLAG(std::string, local_socket_mode, "0600",
          "Permission bits of the --local_socket file (octal): who on this host may connect");
ABSL_FLAG(int, local_max_connections, flashserve::LocalOptions{}.max_connections,
          "Local socket: open connections at most (one thread each); more get "
          "RESOURCE_EXHAUSTED and are closed");
ABSL_FLAG(int64_t, local_max_frame_bytes, flashserve::LocalOptions{}.max_frame_bytes,
          "Local socket: payload bytes of one request frame at most (inline tensors included); "
          "a larger header is refused before anything is allocated");
ABSL_FLAG(int64_t, local_read_timeout_ms, flashserve::LocalOptions{}.read_timeout_ms,
          "Local socket: a frame once started must arrive whole within this long (else the "
          "connection is closed), and an answer must be taken within it; idle connections "
          "between calls may wait");
ABSL_FLAG(int64_t, local_spin_us, flashserve::LocalOptions{}.spin_us,
          "Local socket: a connection's thread polls for its call's answer, and after answering "
          "for the next request, this long (us) before it sleeps; 0: sleep at once; -1: 200 on a "
          "machine with >= 4 cores, else 0");

namespace flashserve {
namespace {

constexpr char kThisFile[] = "server/config/flags.cc";

absl::StatusOr<std::vector<int>> ParseDevices(const std::string& text) {
  std::vector<int> devices;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int device = 0;
    if (!absl::SimpleAtoi(part, &device) || device < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: bad device index \"", part, "\""));
    }
    devices.push_back(device);
  }
  return devices;
}

SequenceRuntimeOptions SequencesFromFlags() {
  SequenceRuntimeOptions sequences;
  sequences.cache.capacity_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  sequences.cache.page_tokens = absl::GetFlag(FLAGS_kv_page_tokens);
  sequences.cache.ttl = absl::Seconds(absl::GetFlag(FLAGS_sequence_ttl_s));
  sequences.cache.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  sequences.cache.max_sequence_tokens = absl::GetFlag(FLAGS_max_sequence_tokens);
  sequences.batch_window_us = absl::GetFlag(FLAGS_batch_window_us);
  sequences.batch_when_busy = absl::GetFlag(FLAGS_batch_when_busy);
  sequences.max_batch_sequences = absl::GetFlag(FLAGS_max_batch_sequences);
  sequences.launches_in_flight = absl::GetFlag(FLAGS_decode_launches_in_flight);
  return sequences;
}

NetworkOptions NetworkFromFlags() {
  NetworkOptions network;
  network.host = absl::GetFlag(FLAGS_host);
  network.grpc_port = absl::GetFlag(FLAGS_grpc_port);
  network.http_port = absl::GetFlag(FLAGS_http_port);
  network.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  network.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  network.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  network.grpc_memory_quota_bytes = absl::GetFlag(FLAGS_grpc_memory_quota_bytes);
  network.answer_timeout_s = absl::GetFlag(FLAGS_answer_timeout_s);
  network.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  if (const char* token = std::getenv("FLASHSERVE_AUTH_TOKEN");
      network.auth_token_file.empty() && token != nullptr) {
    network.auth_token = token;
    network.auth_token_from_env = true;  // even empty: a secret that resolved to "" is no "off"
  }
  network.auth_open_health = absl::GetFlag(FLAGS_auth_open_health);
  return network;
}

HttpLimitsOptions HttpLimitsFromFlags() {
  HttpLimitsOptions http;
  http.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  http.max_connections_per_ip = absl::GetFlag(FLAGS_http_max_connections_per_ip);
  http.max_header_bytes = absl::GetFlag(FLAGS_http_max_header_bytes);
  http.idle_timeout_s = absl::GetFlag(FLAGS_http_idle_timeout_s);
  http.header_timeout_s = absl::GetFlag(FLAGS_http_header_timeout_s);
  http.body_timeout_s = absl::GetFlag(FLAGS_http_body_timeout_s);
  http.min_body_bytes_per_s = absl::GetFlag(FLAGS_http_min_body_bytes_per_s);
  http.max_json_bytes = absl::GetFlag(FLAGS_http_max_json_bytes);
  http.max_receive_bytes = absl::GetFlag(FLAGS_http_max_receive_bytes);
  return http;
}

LocalOptions LocalFromFlags() {
  LocalOptions local;
  local.socket_path = absl::GetFlag(FLAGS_local_socket);
  const std::string mode = absl::GetFlag(FLAGS_local_socket_mode);
  char* end = nullptr;
  const long bits = std::strtol(mode.c_str(), &end, 8);
  local.socket_mode = mode.empty() || *end != '\0' ? -1 : int(std::min(bits, 07777L));
  local.max_connections = absl::GetFlag(FLAGS_local_max_connections);
  local.max_frame_bytes = absl::GetFlag(FLAGS_local_max_frame_bytes);
  local.read_timeout_ms = absl::GetFlag(FLAGS_local_read_timeout_ms);
  local.spin_us = absl::GetFlag(FLAGS_local_spin_us);
  return local;
}

MemoryOptions MemoryFromFlags() {
  MemoryOptions memory;
  memory.receive_arena_bytes = absl::GetFlag(FLAGS_receive_arena_bytes);
  memory.pinned_pool_bytes = absl::GetFlag(FLAGS_pinned_pool_bytes);
  memory.malloc.mmap_threshold_bytes = absl::GetFlag(FLAGS_malloc_mmap_threshold_bytes);
  memory.malloc.trim_threshold_bytes = absl::GetFlag(FLAGS_malloc_trim_threshold_bytes);
  memory.malloc.arena_max = absl::GetFlag(FLAGS_malloc_arena_max);
  memory.shm.allow = absl::GetFlag(FLAGS_allow_client_shm);
  memory.shm.max_regions = absl::GetFlag(FLAGS_shm_max_regions);
  memory.shm.max_bytes = absl::GetFlag(FLAGS_shm_max_bytes);
  memory.shm.key_prefix = absl::GetFlag(FLAGS_shm_key_prefix);
  memory.shm.any_uid = absl::GetFlag(FLAGS_shm_any_uid);
  return memory;
}

absl::StatusOr<BackendOptions> BackendFromFlags() {
  BackendOptions backend;
  backend.kind = absl::GetFlag(FLAGS_backend);
  backend.cpu.num_threads = absl::GetFlag(FLAGS_worker_threads);
  CudaBackendOptions& cuda = backend.cuda;
  absl::StatusOr<std::vector<int>> devices = ParseDevices(absl::GetFlag(FLAGS_devices));
  if (!devices.ok()) return devices.status();
  cuda.devices = *devices;
  cuda.streams_per_device = absl::GetFlag(FLAGS_streams_per_device);
  cuda.completion_spin_us = absl::GetFlag(FLAGS_completion_spin_us);
  cuda.copy_pipeline_chunks = absl::GetFlag(FLAGS_copy_pipeline_chunks);
  cuda.device_pool_release_threshold_bytes =
      absl::GetFlag(FLAGS_device_pool_release_threshold_bytes);
  cuda.max_device_bytes_per_request = absl::GetFlag(FLAGS_max_device_bytes_per_request);
  cuda.autotune = absl::GetFlag(FLAGS_autotune);
  cuda.tune_cache_path = absl::GetFlag(FLAGS_tune_cache);
  cuda.tune_max_classes = absl::GetFlag(FLAGS_tune_max_classes);
  if (cuda.autotune == "startup") {
    absl::StatusOr<TuneGrid> grid =
        ParseTuneGrid(absl::GetFlag(FLAGS_tune_dtypes), absl::GetFlag(FLAGS_tune_head_dims),
                      absl::GetFlag(FLAGS_tune_causal), absl::GetFlag(FLAGS_tune_seqlens),
                      absl::GetFlag(FLAGS_tune_gqa));
    if (!grid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tune_*: ", grid.status().message()));
    }
    cuda.startup_grid = *grid;
  }
  return backend;
}

LimitsOptions LimitsFromFlags() {
  LimitsOptions limits;
  limits.validation.max_tensor_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  limits.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  limits.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  return limits;
}

}  // namespace

namespace {

// Abseil reads a --flagfile whole, treats a read error as its end and goes on: a directory, or a
// file it could not finish, left the server on its defaults (auth off, default ports) without a
// word, and a FIFO or /dev/zero held the start forever. Each one (comma-separated lists too) must
// be a regular file of at most kMaxFlagFileBytes. Flag files named inside a flag file are Abseil's.
absl::Status CheckFlagFiles(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--flagfile") && !absl::ConsumePrefix(&arg, "-flagfile")) {
      continue;
    }
    absl::string_view value;
    if (absl::ConsumePrefix(&arg, "=")) {
      value = arg;
    } else if (arg.empty() && i + 1 < argc) {  // --flagfile PATH
      value = argv[++i];
    } else {
      continue;  // --flagfilex: another flag
    }
    for (absl::string_view path : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      absl::StatusOr<std::string> read =
          ReadFlagFile(std::string(path), "--flagfile", kMaxFlagFileBytes);
      if (!read.ok()) return read.status();
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::optional<int> ParseServerFlags(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, kThisFile);
  };
  usage_config.version_string = [] { return absl::StrCat("flashserve ", kVersion, "\n"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "exact attention over gRPC (port 8001) and HTTP (port 8000).\n"
      "Usage: flashserve [--flag=value ...]");
  // --help prints the flags and exits 0 (Abseil's own handling exits 1).
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "-h") {
      absl::flags_internal::SetProgramInvocationName("flashserve");
      absl::flags_internal::FlagsHelp(std::cout, kThisFile,
                                      absl::flags_internal::HelpFormat::kHumanReadable,
                                      absl::ProgramUsageMessage());
      return 0;
    }
  }
  if (absl::Status s = CheckFlagFiles(argc, argv); !s.ok()) {
    std::cerr << "flashserve: " << s.message() << "\n";
    return ShutdownOptions::kExitBadConfig;
  }
  absl::ParseCommandLine(argc, argv);
  return std::nullopt;
}

void ReportConfigError(const absl::Status& status) {
  LogOptions log;
  log.level = absl::GetFlag(FLAGS_log_level);
  log.format = absl::GetFlag(FLAGS_log_format);
  if (!log.Check().ok()) log = LogOptions{};
  if (!ConfigureLogging(log.level, log.format).ok()) return;  // checked: cannot fail
  spdlog::error("{}", std::string(status.message()));
}

absl::StatusOr<ServerConfig> ServerConfigFromFlags() {
  ServerConfig config;
  config.network = NetworkFromFlags();
  config.http = HttpLimitsFromFlags();
  config.local = LocalFromFlags();
  config.memory = MemoryFromFlags();
  absl::StatusOr<BackendOptions> backend = BackendFromFlags();
  if (!backend.ok()) return backend.status();
  config.backend = *std::move(backend);
  config.scheduler.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
  config.limits = LimitsFromFlags();
  config.request_threads.copy_threads = absl::GetFlag(FLAGS_copy_threads);
  config.request_threads.hot_lane_spin_us = absl::GetFlag(FLAGS_hot_lane_spin_us);
  config.stream.max_sessions = absl::GetFlag(FLAGS_stream_max_sessions);
  config.stream.session_timeout_ms = absl::GetFlag(FLAGS_stream_session_timeout_ms);
  config.sequences = SequencesFromFlags();
  config.model.model_name = absl::GetFlag(FLAGS_model_name);
  config.log.level = absl::GetFlag(FLAGS_log_level);
  config.log.format = absl::GetFlag(FLAGS_log_format);
  config.shutdown.grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  config.test_hooks.enable_fault_injection = absl::GetFlag(FLAGS_enable_fault_injection);
  if (absl::Status s = config.Check(); !s.ok()) return s;
  return config;
}

}  // namespace flashserve
