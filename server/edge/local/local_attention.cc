// The local socket's Attention: edge/grpc/attention_call.cc's Process and Answer, with the
// request in one contiguous payload instead of gRPC's slices.
#include <utility>

#include "api/request_wire.h"
#include "edge/local/call_waiter.h"
#include "edge/local/local_calls.h"
#include "runtime/shm_requests.h"

namespace flashserve {
namespace {

// The response's bytes: O and LSE from the request buffers (no copy), or, when an output went
// into a shared-memory region (or nothing was computed into buffers), the plain message.
void AttentionResponseBytes(const v1::AttentionResponse& response, bool plain, LocalReply* reply) {
  if (plain || reply->io == nullptr) {
    reply->bytes = response.SerializeAsString();
    reply->AddPiece(reply->bytes);
    return;
  }
  const IoBuffers& io = *reply->io;
  const std::string_view out(io.o(), io.layout().q_bytes);
  const std::string_view lse(reinterpret_cast<const char*>(io.lse()), io.layout().lse_bytes);
  reply->wire = EncodeAttentionResponse(response, out, lse);
  reply->AddPiece(reply->wire.out_prefix);
  reply->AddPiece(out);
  if (!lse.empty()) {
    reply->AddPiece(reply->wire.lse_prefix);
    reply->AddPiece(lse);
  }
  reply->AddPiece(reply->wire.rest);
}

}  // namespace

void ServeLocalAttention(const LocalServices& services, LocalCall local, LocalReply* reply) {
  WireRequest wire;
  reply->status = ParseAttentionRequestWire({local.payload}, &wire);
  if (!reply->status.ok()) return;
  v1::AttentionResponse response;
  AttentionRuntime::Call call;
  call.request = &wire.header;
  call.response = &response;
  call.received = local.received;
  call.cancelled = std::move(local.peer_gone);  // AttentionRequest has no deadline of its own
  // The tensors stay in the payload: the runtime copies them only if the backend cannot read
  // them there. The payload outlives the call (this thread waits for done()), so no owner.
  for (int i = 0; i < 3; ++i) {
    call.inputs[i] = TensorBytes::FromReceiveBuffers(std::move(wire.data[i].pieces));
  }
  call.outputs_in_buffers = true;
  call.buffers_out = &reply->io;
  call.caller_waits = true;  // this thread waits for done(): run the job here, no worker hop
  ShmLeases leases;
  const ShmReferences shm = NativeShmReferences(wire.header);
  bool shm_outputs = false;
  if (shm.any()) {
    shm_outputs = shm.any_output();
    call.outputs_in_buffers = !shm_outputs;
    // Owner "": with the server's one bearer token every authorized caller is the same owner,
    // as on gRPC (edge/grpc/kserve_shm_grpc.cc), so regions registered there are usable here.
    if (absl::Status s = AttachShm(*services.runtime, shm, "", &call, &leases); !s.ok()) {
      reply->status = s;
      return;
    }
  }
  auto waiter = std::make_shared<CallWaiter>();
  absl::Status done_status;
  call.done = [waiter, &done_status, &leases](const absl::Status& status) {
    // The output is in its region: the client may unregister now.
    done_status = ReleaseShmLeases(status, &leases);
    waiter->Notify();
  };
  services.runtime->Submit(std::move(call), std::move(local.admission));
  waiter->Wait(services.spin);
  reply->status = done_status;
  if (reply->status.ok()) AttentionResponseBytes(response, shm_outputs, reply);
}

}  // namespace flashserve
