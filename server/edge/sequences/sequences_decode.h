// Attend and DecodeStep between their messages and the SequenceRuntime's DecodeCall: checks,
// output tensors sized in the response (the runtime writes into them), and the response's rest.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "edge/sequences/answer_buffer.h"
#include "flashserve/v1/sequences.pb.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {

/// A DecodeCall for one Attend (no rows appended); out/lse in `response`. Everything the message
/// alone shows is checked before the outputs are allocated.
absl::StatusOr<std::shared_ptr<DecodeCall>> BuildAttend(const v1::AttendRequest& request,
                                                        v1::AttendResponse* response);
/// Where a DecodeStep's outputs that travel in the answer (not into a client's region) go: with
/// a `pool`, into one AnswerBuffer from it (`buffer`, set by BuildDecodeStep when the pool had
/// room; the transport then sends the answer with EncodeDecodeStepAnswer), else into the
/// response's tensors.
struct AnswerPlace {
  PinnedPool* pool = nullptr;
  std::shared_ptr<AnswerBuffer> buffer;
};
/// The same for a DecodeStep of at most `max_items` items (INVALID_ARGUMENT beyond). Tensors
/// and outputs that name a shared-memory region are resolved through `shm` (its leases must be
/// held until the call is answered); `answer` may be null (outputs into `response`).
struct SequenceShm;
absl::StatusOr<std::shared_ptr<DecodeCall>> BuildDecodeStep(const v1::DecodeStepRequest& request,
                                                            int max_items, SequenceShm* shm,
                                                            v1::DecodeStepResponse* response,
                                                            AnswerPlace* answer = nullptr);
/// Shared with the packed form (sequences_packed.h): a tensor's rows from the region it names
/// (through `shm`) or from its data; `optional`: an unset tensor is 0 rows.
absl::StatusOr<kvcache::HostRows> DecodeTensorRows(const v1::Tensor& tensor, const char* name,
                                                   bool optional, SequenceShm* shm);
/// Bytes of an item's O (q's shape and 2-byte dtype) and of its LSE (FLOAT32 [heads, rows]).
inline int64_t OutBytes(const kvcache::HostRows& q) { return q.rows * q.heads * q.head_dim * 2; }
inline int64_t LseBytes(const kvcache::HostRows& q) { return q.rows * q.heads * 4; }
/// Where an item's O / LSE are written: a place in shared memory, or (null) its own response
/// tensor, which AddItemOutputsAt sizes.
struct ItemOutputPlaces {
  char* out = nullptr;
  kvcache::BytesAt out_at = kvcache::BytesAt::kHost;
  char* lse = nullptr;
  kvcache::BytesAt lse_at = kvcache::BytesAt::kHost;
};
/// Appends the item's O (and, with return_lse, LSE) places to `call`; `out` / `lse` (the
/// response's tensors) get dtype and shape, and data when the place is neither in shared memory
/// nor in `answer` (may be null; used while it has room).
/// `lse` may be null without return_lse (the answer then carries no LSE field at all); either may
/// be null where its place is given (a packed answer's slice: the result carries no tensor).
void AddItemOutputsAt(const kvcache::StepItem& item, bool return_lse, ItemOutputPlaces places,
                      v1::Tensor* out, v1::Tensor* lse, DecodeCall* call, AnswerBuffer* answer);
void FillAttend(const DecodeReport& report, absl::Time received, v1::AttendResponse* response);
void FillDecodeStep(const DecodeReport& report, absl::Time received,
                    v1::DecodeStepResponse* response);
void FillSequenceInfo(const kvcache::SequenceStatus& status, v1::SequenceInfo* info);
void FillPoolInfo(SequenceRuntime* sequences, v1::KvPoolInfo* info);

}  // namespace flashserve
