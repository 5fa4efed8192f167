// A DecodeStep whose tensors are packed (DecodeStepRequest.packed, PackedDecodeRows): each item's
// q/k/v rows are its slice of three packed tensors (inline or in shared memory) and its O / LSE a
// slice of one packed span, so a step of n sequences names three or five places, not 5 n.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "flashserve/v1/sequences.pb.h"
#include "kvcache/kv_types.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {

struct SequenceShm;

/// The items of a packed step, in request order. INVALID_ARGUMENT when an item carries tensors of
/// its own, when rows_q / rows_kv do not have one entry per item (or none), when a count is out
/// of range, or when the counts do not add up to the packed tensors' rows.
absl::StatusOr<std::vector<kvcache::StepItem>> PackedItems(const v1::DecodeStepRequest& request,
                                                           SequenceShm* shm);

/// Where each item's O (and LSE) go: its slice of packed.out_shm / lse_shm; else, with
/// packed.answer_packed, its slice of response.packed's one tensor; else its own tensor in
/// `response`'s result -- the data of those two in `answer` (may be null) while it has room, else
/// in the message (sized here, written by the runtime).
class AnswerBuffer;
absl::Status AddPackedOutputs(const v1::DecodeStepRequest& request, SequenceShm* shm,
                              DecodeCall* call, v1::DecodeStepResponse* response,
                              AnswerBuffer* answer);

}  // namespace flashserve
