// One kernel that copies many small byte ranges, so a decode step's K/V rows (staged, or where a
// client's region holds them), its queries and its outputs cost one launch each instead of a
// cudaMemcpyAsync per row (runtime/cuda_kv_store.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flashserve {

/// One range: `bytes` from `src` to `dst`, both addresses the device can use (device memory,
/// or page-locked host memory mapped into its address space).
struct KvScatterRange {
  char* dst = nullptr;
  const char* src = nullptr;
  int64_t bytes = 0;
};

/// Queues the copy of `count` ranges (device array `ranges`) on `stream`: one block per range,
/// 16-byte moves where dst, src and bytes allow, else bytes. Ranges must not overlap.
cudaError_t LaunchKvScatter(const KvScatterRange* ranges, int count, cudaStream_t stream);

}  // namespace flashserve
