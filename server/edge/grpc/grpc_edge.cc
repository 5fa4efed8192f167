#include "edge/grpc/grpc_edge.h"

#include <climits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/process_health.h"
#include "edge/grpc/attention_call.h"
#include "edge/grpc/grpc_auth.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/grpc_memory_quota.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "flashserve/v1/attention.grpc.pb.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

constexpr const char kServiceName[] = "flashserve.v1.AttentionService";

// Attention is served by AttentionRouter (edge/grpc/attention_call.h) through the generic callback
// API, so it is marked generic here; GetServerInfo is raw (grpc_call.h says why).
using AttentionServiceBase = v1::AttentionService::WithGenericMethod_Attention<
    v1::AttentionService::WithRawCallbackMethod_GetServerInfo<v1::AttentionService::Service>>;

class AttentionServiceImpl final : public AttentionServiceBase {
 public:
  AttentionServiceImpl(AttentionRuntime* runtime, const ServerIdentity& identity)
      : runtime_(runtime), identity_(identity) {}

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override {
    return ServeUnary<v1::GetServerInfoRequest, v1::ServerInfo>(
        context, runtime_->metrics(), grpc_methods::kGetServerInfo, *request, response,
        [this](const v1::GetServerInfoRequest&, v1::ServerInfo* info, GrpcCall*) {
          FillServerInfo(info);
          return absl::OkStatus();
        });
  }

 private:
  void FillServerInfo(v1::ServerInfo* info) {
    const BackendCapabilities& caps = runtime_->backend().capabilities();
    info->set_version(identity_.version);
    info->set_build(identity_.build);
    info->set_backend(caps.name);
    for (const DeviceDescription& device : caps.devices) {
      v1::DeviceInfo* d = info->add_devices();
      d->set_index(device.index);
      d->set_name(device.name);
      d->set_compute_capability_major(device.cc_major);
      d->set_compute_capability_minor(device.cc_minor);
      d->set_total_memory_bytes(device.total_memory_bytes);
    }
    for (kernels::DType dtype : caps.dtypes) info->add_dtypes(static_cast<v1::DType>(dtype));
    for (int head_dim : caps.head_dims) info->add_head_dims(head_dim);
    info->set_max_head_dim(caps.max_head_dim);
    info->set_worker_threads(identity_.worker_threads);
    v1::Limits* limits = info->mutable_limits();
    limits->set_max_request_bytes(identity_.max_request_bytes);
    limits->set_max_tensor_elements(runtime_->limits().max_tensor_elements);
    limits->set_queue_capacity(identity_.queue_capacity);
  }

  AttentionRuntime* runtime_;
  const ServerIdentity identity_;
};

// gRPC core's own log lines (a failed TLS handshake, a port that cannot be bound) through the
// server's logger: with --log_format=json they were gRPC's "E1129 ..." lines among JSON objects.
void LogFromGrpc(gpr_log_func_args* args) {
  // gRPC 1.51's listener stops for good after an accept error other than EAGAIN/ECONNABORTED
  // (EMFILE: descriptors ran out): the port takes no connection again while HTTP health said
  // ready. Not live, so that the process drains and is restarted.
  if (args->message != nullptr && absl::StartsWith(args->message, "Failed accept4")) {
    MarkProcessBroken(absl::StrCat("gRPC stopped accepting connections (", args->message,
                                   "; it does not retry)"));
  }
  const spdlog::level::level_enum level =
      args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
      : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                : spdlog::level::debug;
  spdlog::log(level, "gRPC: {} ({}:{})", LogSafe(args->message ? args->message : "", 1024),
              args->file ? args->file : "?", args->line);
}

// Message limits, the memory quota and the HTTP/2 settings of the listening port.
void ConfigureTransport(const GrpcOptions& options, int64_t memory_quota_bytes,
                        grpc::ServerBuilder* builder) {
  // A request is bounded by --max_request_bytes (gRPC answers RESOURCE_EXHAUSTED above it,
  // before we see it); an answer over kMaxInlineAnswerBytes is refused before it is computed.
  builder->SetMaxReceiveMessageSize(int(options.max_request_bytes));
  builder->SetMaxSendMessageSize(INT_MAX);
  // Reflection is a sync service: its pollers wake every CQ_TIMEOUT_MSEC (default 10 s) and
  // Server::Wait() at shutdown waits for them. 200 ms keeps SIGTERM exits prompt.
  builder->SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::CQ_TIMEOUT_MSEC, 200);
  if (memory_quota_bytes > 0) {
    // Bounds the memory gRPC may use for buffers (received messages included); see
    // edge/grpc/grpc_memory_quota.h for the default and what gRPC does when it is reached.
    grpc::ResourceQuota quota("flashserve");
    quota.Resize(size_t(memory_quota_bytes));
    builder->SetResourceQuota(quota);
    spdlog::info("gRPC memory quota: {} MiB{}", memory_quota_bytes >> 20,
                 options.memory_quota_bytes == kGrpcMemoryQuotaAuto ? " (auto)" : "");
  } else {
    spdlog::warn(
        "gRPC memory quota: none (--grpc_memory_quota_bytes=0): gRPC may buffer "
        "without bound");
  }
  // No compressed requests: gRPC inflates a whole message before it checks --max_request_bytes,
  // outside the memory quota, so 1 MB of gzip held 1 GiB per call (and tensors do not compress).
  // A call that names gzip or deflate is refused before its message is read (UNIMPLEMENTED).
  builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder->SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  // A second process must not be able to bind the same port and take half the calls.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Large messages (README "Large messages"): tensors are MiB..GiB, so let one HTTP/2 frame carry
  // up to 16 MiB - 1 (the protocol maximum; default 16 KiB means a thousand frame headers per
  // 16 MiB), read the socket in chunks of up to 4 MiB, and let one stream's flow-control window
  // grow to 64 MiB ahead of the application (BDP probing, on by default, sizes it dynamically up
  // to that). With them one connection carries 1.9-2.1 GB/s of unary Attention (C++ load
  // generator, bench/results/service-h100-2026-11-22-hot-lane.md); several connections scale.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (16 << 20) - 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  // Asks for socket reads of 256 KiB to 4 MiB; gRPC 1.51's TCP reader ignores these and reads into
  // 64 KiB buffers (measured with a malloc histogram), which memory/receive_arena.h serves.
  builder->AddChannelArgument(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  builder->AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
}

}  // namespace

struct GrpcEdge::Impl {
  std::unique_ptr<AttentionServiceImpl> service;
  std::unique_ptr<AttentionRouter> router;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

GrpcEdge::GrpcEdge(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GrpcEdge::~GrpcEdge() { Shutdown(absl::Now()); }

absl::StatusOr<std::unique_ptr<GrpcEdge>> GrpcEdge::Create(
    const GrpcOptions& options, AttentionRuntime* runtime, const ServerIdentity& identity,
    const std::vector<grpc::Service*>& extra_services) {
  if (options.max_request_bytes < 1 || options.max_request_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("max_request_bytes must be in [1, ", INT_MAX,
                                                   "] (gRPC's limit), got ",
                                                   options.max_request_bytes));
  }
  auto impl = std::make_unique<Impl>();
  GrpcCredentialsOptions credentials_options;
  credentials_options.tls_cert_file = options.tls_cert_file;
  credentials_options.tls_key_file = options.tls_key_file;
  credentials_options.auth = options.auth;
  credentials_options.metrics = runtime->metrics();
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeGrpcServerCredentials(credentials_options);
  if (!credentials.ok()) return credentials.status();
  absl::StatusOr<int64_t> quota = ResolveGrpcMemoryQuota(
      options.memory_quota_bytes, options.max_request_bytes, HostMemoryBytes());
  if (!quota.ok()) return quota.status();
  impl->service = std::make_unique<AttentionServiceImpl>(runtime, identity);
  AttentionCallOptions call_options;
  call_options.fault_injection = options.enable_fault_injection;
  call_options.hot_lane_spin_us = options.hot_lane_spin_us;
  call_options.heap_retention = options.heap_retention;
  if (options.hot_lane_spin_us > 0) {
    spdlog::info("hot lane: Attention requests under 4 MiB run on one warm thread (it polls {} us "
                 "for the next)", options.hot_lane_spin_us);
  }
  impl->router = std::make_unique<AttentionRouter>(runtime, call_options);
  if (options.enable_fault_injection) {
    spdlog::warn(
        "--enable_fault_injection: a request with request_id \"{}\" faults its device, "
        "one with \"{}\" hangs it (test use only)",
        kInjectDeviceFaultRequestId, kInjectDeviceHangRequestId);
  }

  gpr_set_log_function(&LogFromGrpc);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(options.host.find(':') != std::string::npos
                                               ? absl::StrCat("[", options.host, "]")
                                               : options.host,
                                           ":", options.port);
  builder.AddListeningPort(address, *credentials, &impl->port);
  builder.RegisterService(impl->service.get());
  builder.RegisterCallbackGenericService(impl->router.get());
  for (grpc::Service* service : extra_services) builder.RegisterService(service);
  ConfigureTransport(options, *quota, &builder);
  AnswerWatch::Start(absl::Seconds(options.answer_timeout_s));
  impl->server = builder.BuildAndStart();
  if (!impl->server || impl->port == 0) {
    AnswerWatch::Stop();
    return absl::UnavailableError(absl::StrCat("gRPC: cannot listen on ", address));
  }
  auto edge = std::unique_ptr<GrpcEdge>(new GrpcEdge(std::move(impl)));
  edge->SetServing(true);
  return edge;
}

int GrpcEdge::port() const { return impl_->port; }

void GrpcEdge::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = impl_->server->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
}

bool GrpcEdge::WaitForDataCalls(absl::Time deadline) {
  while (LiveCall::count() > 0) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

void GrpcEdge::Shutdown(absl::Time deadline) {
  if (!impl_->server) return;
  impl_->server->Shutdown(absl::ToChronoTime(deadline));
  impl_->server->Wait();
  AnswerWatch::Stop();
  if (const int64_t live = LiveCall::count(); live != 0) {
    spdlog::warn("{} data calls were never finished by gRPC", live);
  }
  // Every call has finished here. grpc::Server's destructor (grpc_server_destroy) was seen to
  // block ~10 s while a client still holds its connection open (gRPC 1.51), which would hold up
  // a SIGTERM exit; this only runs on the way out of the process, so skip the destructor.
  static_cast<void>(impl_->server.release());
}

}  // namespace flashserve
