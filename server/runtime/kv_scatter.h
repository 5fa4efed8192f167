// One kernel that copies many small byte ranges (the K/V rows a decode step appends, staged in one
// buffer) into the KV pool, so a step's rows cost one copy and one launch instead of a
// cudaMemcpyAsync per row (runtime/cuda_kv_store.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flashserve {

/// One range: `bytes` from staging + src to pool + dst.
struct KvScatterRange {
  int64_t dst = 0;
  int64_t src = 0;
  int64_t bytes = 0;
};

/// Queues the copy of `count` ranges (device array `ranges`) from `staging` to `pool` on `stream`:
/// one block per range, 16-byte moves where dst, src and bytes allow, else bytes.
cudaError_t LaunchKvScatter(const KvScatterRange* ranges, int count, const char* staging,
                            char* pool, cudaStream_t stream);

}  // namespace flashserve
