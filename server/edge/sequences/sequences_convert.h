// flashserve.v1.Sequences messages <-> the KV cache's types (server/kvcache/kv_types.h). Checks
// what a message alone can show (dtypes, ranks, byte counts, scale); the cache checks the rest
// against the sequence.
#pragma once

#include "absl/status/statusor.h"
#include "flashserve/v1/sequences.pb.h"
#include "kvcache/sequence_cache.h"

namespace flashserve {

/// Rows [rows, heads, head_dim] of FLOAT16/BFLOAT16 whose data holds exactly their bytes.
/// `optional`: an unset tensor (no shape, no data) is 0 rows. A shared-memory reference is refused
/// (DecodeTensorRows resolves those where a call takes them).
absl::StatusOr<kvcache::HostRows> RowsFromTensor(const v1::Tensor& tensor, const char* name,
                                                 bool optional);
/// The same for a tensor whose `bytes` bytes are at `data` (a shared-memory span), not in it.
absl::StatusOr<kvcache::HostRows> RowsFromBytes(const v1::Tensor& tensor, const char* name,
                                                const char* data, int64_t bytes);
/// A LayerKV's rows and expected_length (>= 0 when set; -1 unset).
absl::StatusOr<kvcache::LayerRows> LayerRowsFrom(const v1::LayerKV& layer);
/// An optional expected_length as the cache takes it: -1 when unset, INVALID_ARGUMENT below 0.
absl::StatusOr<int64_t> ExpectedLengthFrom(bool has, int64_t value);
absl::StatusOr<kvcache::CreateRequest> CreateRequestFrom(const v1::CreateSequenceRequest& request);
/// The scale to use: the request's (finite, > 0, <= 1e4) or 1/sqrt(head_dim).
absl::StatusOr<float> ScaleFrom(bool has_scale, float scale, int64_t head_dim);
/// Fills a response tensor's dtype and shape and sizes its data; returns where to write.
char* PrepareOutput(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape,
                    int64_t element_bytes);

}  // namespace flashserve
