// The striped streaming edge: flashserve.v1.AttentionStreamService (see attention.proto).
//
// One request's bytes travel over several HTTP/2 connections: the client opens a session
// (shapes only), uploads disjoint byte ranges of Q, K and V on K client-streaming calls in
// parallel, calls Compute, and downloads O (and LSE) as byte ranges on K server-streaming calls.
//
// The pieces, one job per file:
//   stream_session.h   sessions: reassembly ranges, state machine, the table, its limits, ids
//   stream_chunk.h     the AttentionChunk wire format (parsed in place, header for downloads)
//   stream_transfer.h  the Upload and Download reactors (raw, no temporary messages)
//   stream_edge.h      this service: OpenSession, Compute, CloseSession, the idle reaper
// Every chunk is copied exactly once, from gRPC's receive slices into its session's buffers;
// Compute hands the buffers to the runtime as they are, so the GPU copies straight from them;
// Download sends O out of them (no copy). Each call's metrics, failure log and status go through
// its GrpcCall (edge/grpc/grpc_call.h), like every other gRPC call; the bearer token is checked
// before any of them runs (edge/grpc/grpc_auth.h).
//
// Not done yet: StreamSession::Commit knows each completed range -- the place to start an H2D copy
// of it while later chunks still arrive.
#pragma once

#include <memory>

#include "edge/grpc/stream_session.h"
#include "runtime/attention_runtime.h"

namespace grpc {
class Service;
}  // namespace grpc

namespace flashserve {

/// The gRPC service (raw Upload/Download, typed others). Reaps idle sessions on a background
/// thread. Register it through GrpcEdge::Create(..., extra_services); it must outlive the edge.
/// Headers are validated against runtime->limits(). The token is the edge's (GrpcOptions::auth).
std::unique_ptr<grpc::Service> CreateStreamService(AttentionRuntime* runtime, StreamLimits limits);

}  // namespace flashserve
