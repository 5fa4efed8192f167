// The Sequences edge: flashserve.v1.Sequences (proto/flashserve/v1/sequences.proto), a KV cache
// that stays on the server. Release and the info calls run on gRPC's thread; Create/Append/
// Truncate are tried without waiting first and wait, if they must, on threads of the edge's own
// (sequences_service.cc says which); Attend and DecodeStep go through the SequenceRuntime (queue,
// batching, the paged launch).
// Every call is admitted like other requests (AttentionRuntime::Admit: refused while draining,
// waited for by the drain), counted by its GrpcCall, and behind the edge's bearer-token gate.
#pragma once

#include <memory>

#include "memory/heap_retention.h"
#include "runtime/attention_runtime.h"
#include "runtime/sequence_runtime.h"

namespace grpc {
class Service;
}  // namespace grpc

namespace flashserve {

/// Trailing metadata of a NOT_FOUND DecodeStep/Attend: the missing ids, comma-separated.
inline constexpr char kMissingSequenceIdsKey[] = "flashserve-missing-sequence-ids";

/// `sequences` null: the server runs without a KV cache and every call is FAILED_PRECONDITION.
/// `heap_retention` (may be null) is told of every DecodeStep (HeapRetention::Retain). All must
/// outlive the service; register it through GrpcEdge::Create(..., extra_services).
std::unique_ptr<grpc::Service> CreateSequencesService(AttentionRuntime* runtime,
                                                      SequenceRuntime* sequences,
                                                      HeapRetention* heap_retention);

}  // namespace flashserve
