// flashserve-echo: the raw gRPC ceiling for the service benchmark. A callback generic service that
// answers any unary call with a response of the size the client asks for in the metadata
// "x-response-bytes" (the flashserve response size for the same request), after receiving the
// whole request. Same server settings as flashserve's gRPC edge (message limits, no SO_REUSEPORT).
//
//   flashserve-echo --port=0 [--host=127.0.0.1]     prints "listening on <port>" and serves until killed
#include <climits>
#include <csignal>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "bench_flags.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"

namespace {

// One zero-filled slice per response size, shared by every call (slices are reference counted).
class ResponseCache {
 public:
  grpc::ByteBuffer Get(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slices_.find(bytes);
    if (it == slices_.end()) {
      std::string zeros(bytes, '\0');
      it = slices_.emplace(bytes, grpc::Slice(zeros)).first;
    }
    grpc::Slice slice = it->second;
    return grpc::ByteBuffer(&slice, 1);
  }

 private:
  std::mutex mu_;
  std::map<size_t, grpc::Slice> slices_;
};

class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor(grpc::GenericCallbackServerContext* context, ResponseCache* cache) : cache_(cache) {
    const auto& md = context->client_metadata();
    auto it = md.find("x-response-bytes");
    if (it != md.end()) response_bytes_ = std::strtoull(std::string(it->second.data(), it->second.size()).c_str(), nullptr, 10);
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    request_bytes_ = request_.Length();
    request_.Clear();
    response_ = cache_->Get(response_bytes_ == SIZE_MAX ? request_bytes_ : response_bytes_);
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  ResponseCache* cache_;
  size_t response_bytes_ = SIZE_MAX;  // absent: echo the request's size
  size_t request_bytes_ = 0;
  grpc::ByteBuffer request_, response_;
};

class EchoService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new EchoReactor(context, &cache_);
  }

 private:
  ResponseCache cache_;
};

}  // namespace

int main(int argc, char** argv) {
  const flashserve::bench::Flags flags(
      argc, argv, "usage: flashserve-echo [--host=127.0.0.1] [--port=0]   (0: any free port)\n",
      {"host", "port"});
  const std::string host = flags.Str("host", "127.0.0.1");
  const int64_t port = flags.Int("port", 0);
  if (port < 0 || port > 65535) flags.Fail("--port: 0..65535");
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  EchoService service;
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(host + ":" + std::to_string(port), grpc::InsecureServerCredentials(), &bound);
  builder.RegisterCallbackGenericService(&service);
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || bound == 0) {
    std::fprintf(stderr, "flashserve-echo: cannot listen on %s:%d\n", host.c_str(), int(port));
    return 1;
  }
  std::printf("listening on %d\n", bound);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  server->Shutdown(std::chrono::system_clock::now());
  return 0;
}
