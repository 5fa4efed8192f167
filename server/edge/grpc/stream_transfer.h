// The striped stream's byte-moving calls, registered raw so chunks never become a temporary
// message: Upload (client-streaming AttentionChunks, each copied once from gRPC's receive slices
// into its session's buffers) and Download (server-streaming chunks whose data are slices of the
// session's output, no copy). Each call's metrics, failure log and status go through its GrpcCall
// (edge/grpc/grpc_call.h).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "edge/grpc/stream_session.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "metrics/server_metrics.h"

namespace grpc {
class CallbackServerContext;
}  // namespace grpc

namespace flashserve {

/// DownloadRequest.chunk_bytes: bytes of data per streamed chunk.
inline constexpr int64_t kDefaultDownloadChunkBytes = int64_t{4} << 20;  // when 0
inline constexpr int64_t kMinDownloadChunkBytes = 4096;
inline constexpr int64_t kMaxDownloadChunkBytes = int64_t{64} << 20;
/// The chunk size a Download uses: the default for 0, the value itself within [min, max];
/// anything else INVALID_ARGUMENT naming the field and the range (not clamped: a client asking
/// for 1 byte or -5 would silently get something else).
absl::StatusOr<int64_t> DownloadChunkBytes(int64_t requested);

/// The reactor of one Upload call: reads chunks into their sessions' buffers until the client
/// ends the stream, then answers an UploadAck (serialized into `response`). Deletes itself when
/// gRPC is done. `table` must outlive it; `metrics` may be null.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewUploadReactor(grpc::CallbackServerContext* context,
                                                            SessionTable* table,
                                                            grpc::ByteBuffer* response,
                                                            ServerMetrics* metrics);

/// The reactor of one Download call (`request`: a serialized DownloadRequest): writes the range
/// asked for in chunks; the session is dropped once every output byte was downloaded. Deletes
/// itself when gRPC is done. A write the client has not taken within --answer_timeout_s cancels
/// the call (AnswerWatch). `table` must outlive it; `metrics` may be null.
grpc::ServerWriteReactor<grpc::ByteBuffer>* NewDownloadReactor(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request, SessionTable* table,
    ServerMetrics* metrics);

}  // namespace flashserve
