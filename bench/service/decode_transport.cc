#include "decode_transport.h"

#include <unistd.h>
#include <utility>

#include "grpcpp/impl/client_unary_call.h"

#include "loadgen_workload.h"

namespace flashserve::loadgen {
namespace {

void SetRef(v1::SharedMemoryRef* ref, const std::string& region, uint64_t offset, uint64_t bytes) {
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(bytes);
}

// Keeps dtype and shape, drops the bytes, names (region, offset, size) instead.
void ToShm(v1::Tensor* t, const std::string& region, uint64_t offset) {
  const uint64_t bytes = t->data().size();
  t->clear_data();
  SetRef(t->mutable_shm(), region, offset, bytes);
}

}  // namespace

std::unique_ptr<DecodeClient> DecodeClient::Create(const DecodeTransportOptions& options, int index,
                                                   std::string* error) {
  std::unique_ptr<DecodeClient> client(new DecodeClient());
  client->options_ = options;
  if (options.local_socket.empty()) {
    client->stub_ = v1::Sequences::NewStub(MakeChannel(options.target, index));
    return client;
  }
  local::LocalClientOptions local_options;
  local_options.socket_path = options.local_socket;
  local_options.token = options.token;
  local_options.timeout_ms = options.timeout_ms;
  local_options.spin_us = options.spin_us;
  local::CallStatus status;
  client->local_ = local::LocalClient::Connect(local_options, &status);
  if (client->local_ == nullptr) {
    *error = "local transport: " + status.ToString();
    return nullptr;
  }
  return client;
}

void DecodeClient::Prepare(const v1::DecodeStepRequest& request) {
  request_ = &request;
  if (local_ != nullptr) request.SerializeToString(&bytes_);
}

bool DecodeClient::Step(v1::DecodeStepResponse* response, std::string* error) {
  if (local_ != nullptr) {
    local::CallStatus status = local_->CallBytes(local::Method::kDecodeStep, bytes_, &reply_);
    if (status.ok() && !response->ParseFromString(reply_)) {
      status = {13, "DecodeStepResponse did not parse"};
    }
    if (!status.ok()) *error = status.ToString();
    return status.ok();
  }
  grpc::ClientContext ctx;
  Authorize(&ctx, options_.token);
  const grpc::Status s = stub_->DecodeStep(&ctx, *request_, response);
  if (!s.ok()) *error = std::to_string(int(s.error_code())) + ": " + s.error_message();
  return s.ok();
}

EchoClient::EchoClient(const std::string& target, int index, const std::string& token,
                       std::string request_bytes, int64_t response_bytes)
    : channel_(MakeChannel(target, index)),
      method_("/flashserve.bench.Echo/Echo", grpc::internal::RpcMethod::NORMAL_RPC, channel_),
      token_(token),
      request_bytes_(std::move(request_bytes)),
      response_bytes_(response_bytes),
      request_(StaticBuffer(request_bytes_)) {}

bool EchoClient::Step(std::string* error) {
  grpc::ClientContext ctx;
  Authorize(&ctx, token_);
  ctx.AddMetadata("x-response-bytes", std::to_string(response_bytes_));
  response_.Clear();
  const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), method_, &ctx, request_, &response_);
  if (!s.ok()) {
    const std::string message = s.error_message().empty()
                                    ? "(no message: is the --echo target a flashserve-echo?)"
                                    : s.error_message();
    *error = "echo: " + std::to_string(int(s.error_code())) + ": " + message;
    return false;
  }
  if (int64_t(response_.Length()) != response_bytes_) {  // not an echo server, or not this one
    *error = "echo: answered " + std::to_string(response_.Length()) + " bytes, asked for " +
             std::to_string(response_bytes_);
    return false;
  }
  return true;
}

std::unique_ptr<DecodeRegions> DecodeRegions::Create(const DecodeTransportOptions& options,
                                                     int64_t sequences, const v1::Tensor& q,
                                                     const v1::Tensor& kv, std::string* error) {
  std::unique_ptr<DecodeRegions> r(new DecodeRegions());
  r->q_bytes_ = q.data().size();
  r->kv_bytes_ = kv.data().size();
  r->sequences_ = uint64_t(sequences);
  r->kserve_ = inference::GRPCInferenceService::NewStub(MakeChannel(options.target, 2000));
  const uint64_t per_sequence = r->q_bytes_ + 2 * r->kv_bytes_;
  // The pid in the names: a run killed before it unregistered does not block the next one.
  const std::string suffix = options.shm + "_" + std::to_string(getpid());
  r->in_ = MakeRegion(options.shm, "dl_in_" + suffix, size_t(per_sequence * uint64_t(sequences)),
                      options.device, r->kserve_.get(), options.token, error);
  if (r->in_ == nullptr) return nullptr;
  r->out_ = MakeRegion(options.shm, "dl_out_" + suffix, size_t(r->q_bytes_ * uint64_t(sequences)),
                       options.device, r->kserve_.get(), options.token, error);
  if (r->out_ == nullptr) return nullptr;
  const uint64_t n = r->sequences_;
  for (uint64_t i = 0; i < n; ++i) {
    // Where sequence i's q, k, v go: interleaved per sequence, or (packed) each kind together.
    const uint64_t q_at = options.packed ? r->q_bytes_ * i : per_sequence * i;
    const uint64_t k_at = options.packed ? r->q_bytes_ * n + r->kv_bytes_ * i : q_at + r->q_bytes_;
    const uint64_t v_at =
        options.packed ? (r->q_bytes_ + r->kv_bytes_) * n + r->kv_bytes_ * i : k_at + r->kv_bytes_;
    if (!WriteRegion(r->in_.get(), size_t(q_at), q.data().data(), r->q_bytes_, error) ||
        !WriteRegion(r->in_.get(), size_t(k_at), kv.data().data(), r->kv_bytes_, error) ||
        !WriteRegion(r->in_.get(), size_t(v_at), kv.data().data(), r->kv_bytes_, error)) {
      return nullptr;
    }
  }
  return r;
}

bool DecodeRegions::PoisonOutputs(std::string* error) {
  return Poison(out_.get(), 0, out_->bytes, error);
}

bool DecodeRegions::CheckOutputs(std::string* error) const {
  return CheckWritten(*out_, 0, out_->bytes, error);
}

void DecodeRegions::Name(int64_t index, v1::DecodeItem* item) const {
  const uint64_t at = (q_bytes_ + 2 * kv_bytes_) * uint64_t(index);
  ToShm(item->mutable_q(), in_->name, at);
  ToShm(item->mutable_k(), in_->name, at + q_bytes_);
  ToShm(item->mutable_v(), in_->name, at + q_bytes_ + kv_bytes_);
  SetRef(item->mutable_out_shm(), out_->name, q_bytes_ * uint64_t(index), q_bytes_);
}

void DecodeRegions::NamePacked(int64_t first, v1::DecodeStepRequest* request) const {
  v1::PackedDecodeRows* p = request->mutable_packed();
  const uint64_t f = uint64_t(first), n = sequences_;
  ToShm(p->mutable_q(), in_->name, q_bytes_ * f);
  ToShm(p->mutable_k(), in_->name, q_bytes_ * n + kv_bytes_ * f);
  ToShm(p->mutable_v(), in_->name, (q_bytes_ + kv_bytes_) * n + kv_bytes_ * f);
  SetRef(p->mutable_out_shm(), out_->name, q_bytes_ * f,
         q_bytes_ * uint64_t(request->items_size()));
}

}  // namespace flashserve::loadgen
