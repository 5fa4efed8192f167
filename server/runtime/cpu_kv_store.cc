#include "runtime/cpu_kv_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace flashserve {

namespace {

// 16-byte aligned scratch for one item (the CPU kernels load through typed pointers), grown as
// items need and never zero-filled: a 128k-token item's K and V are hundreds of MB, and every
// byte is written before it is read.
struct Scratch {
  struct Buffer {
    std::unique_ptr<char[]> bytes;
    int64_t size = 0;
  };
  Buffer q, k, v, o;
  static char* Aligned(Buffer* buf, int64_t bytes) {
    if (buf->size < bytes + 16) {
      buf->bytes.reset(new char[size_t(bytes) + 16]);
      buf->size = bytes + 16;
    }
    const uintptr_t p = reinterpret_cast<uintptr_t>(buf->bytes.get());
    return buf->bytes.get() + ((16 - p % 16) % 16);
  }
};

absl::Status DeviceRefused(const char* what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, " is in GPU memory, but this server's KV cache is in host memory (CPU "
                         "backend): use a system shared-memory region or inline bytes"));
}

}  // namespace

bool GatherPages(const char* base, const kvcache::PageFormat& format,
                 const kvcache::PagedItem& item, int64_t add, char* dst,
                 kernels::cpu::StopSignal* stop) {
  for (int64_t pos = 0; pos < item.length; pos += format.page_tokens) {
    if (stop->stop_requested()) return false;
    const int64_t n = std::min<int64_t>(format.page_tokens, item.length - pos);
    const int64_t page = item.pages[size_t(pos / format.page_tokens)];
    std::memcpy(dst + pos * format.row_bytes, base + page * format.page_bytes + add,
                size_t(n * format.row_bytes));
  }
  return true;
}

absl::StatusOr<std::unique_ptr<CpuKvStore>> CpuKvStore::Create(int64_t bytes,
                                                               kernels::cpu::ThreadPool* pool) {
  void* base = mmap(nullptr, size_t(bytes), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    // The flag's value is more than this machine can map (SequenceRuntime names the flag): exit 2.
    return absl::InvalidArgumentError(
        absl::StrCat("cannot map ", bytes, " bytes for the KV cache: ", std::strerror(errno)));
  }
  return std::unique_ptr<CpuKvStore>(new CpuKvStore(static_cast<char*>(base), bytes, pool));
}

CpuKvStore::~CpuKvStore() { munmap(base_, size_t(bytes_)); }

absl::Status CpuKvStore::Write(int64_t offset, const void* src, int64_t bytes,
                               kvcache::BytesAt at) {
  if (offset < 0 || bytes < 0 || offset + bytes > bytes_) {
    return absl::InternalError("KV store write outside the pool");
  }
  if (at == kvcache::BytesAt::kDevice) return DeviceRefused("a K/V row");
  std::memcpy(base_ + offset, src, size_t(bytes));
  return absl::OkStatus();
}

absl::Status CpuKvStore::Attend(const kvcache::PagedBatch& batch, kvcache::AttendInfo* info) {
  const kvcache::SequenceShape& s = batch.shape;
  const int64_t elem = int64_t(kernels::dtype_size(s.dtype));
  for (const kvcache::PagedItem& item : batch.items) {
    if (item.q_at == kvcache::BytesAt::kDevice) return DeviceRefused("q");
    if (item.out_at == kvcache::BytesAt::kDevice) return DeviceRefused("out");
    if (item.lse != nullptr && item.lse_at == kvcache::BytesAt::kDevice) {
      return DeviceRefused("lse");
    }
  }
  Scratch scratch;
  // A launch over a long cache with many query heads computes for seconds: stop between items
  // and key tiles once no call waits for it.
  kernels::cpu::StopSignal stop(batch.stop);
  const absl::Time start = absl::Now();
  const auto stopped = [&start] {
    return absl::CancelledError(
        absl::StrCat("stopped after ", absl::ToInt64Microseconds(absl::Now() - start), " us"));
  };
  for (const kvcache::PagedItem& item : batch.items) {
    if (stop.stop_requested()) return stopped();
    const int64_t q_bytes = int64_t(item.rows_q) * s.heads_q * s.head_dim * elem;
    if (item.length == 0) {  // no key: O = 0, LSE = -inf (as the kernels define it)
      std::memset(item.out, 0, size_t(q_bytes));
      if (item.lse != nullptr) {
        std::fill(item.lse, item.lse + int64_t(s.heads_q) * item.rows_q,
                  -std::numeric_limits<float>::infinity());
      }
      continue;
    }
    kernels::AttentionParams p =
        kernels::make_contiguous_params(s.dtype, 1, item.rows_q, int(item.length), s.heads_q,
                                        s.heads_kv, s.head_dim, batch.causal, batch.softmax_scale);
    char* q = Scratch::Aligned(&scratch.q, q_bytes);
    std::memcpy(q, item.q, size_t(q_bytes));
    char* k = Scratch::Aligned(&scratch.k, item.length * batch.format.row_bytes);
    char* v = Scratch::Aligned(&scratch.v, item.length * batch.format.row_bytes);
    if (!GatherPages(base_, batch.format, item, 0, k, &stop) ||
        !GatherPages(base_, batch.format, item, batch.format.v_offset, v, &stop)) {
      return stopped();
    }
    char* o = Scratch::Aligned(&scratch.o, q_bytes);
    p.q = q;
    p.k = k;
    p.v = v;
    p.o = o;
    p.lse = item.lse;
    if (std::string why = kernels::cpu::supported(p); !why.empty()) {
      return absl::InvalidArgumentError(why);
    }
    if (!kernels::cpu::attention_forward(p, pool_, &stop)) return stopped();
    std::memcpy(item.out, o, size_t(q_bytes));
  }
  info->kernel = "cpu_paged_gather";
  return absl::OkStatus();
}

}  // namespace flashserve
