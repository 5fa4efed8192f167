// SequenceCache::Truncate: layers cut back to their first tokens (speculative decoding drops the
// draft tokens the model rejected), the pages wholly past the cut returned to the pool.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvcache/sequence_cache_internal.h"

namespace flashserve::kvcache {

SequenceCache::Sequence* SequenceCache::FindUnpinnedLocked(std::string_view id,
                                                           std::unique_lock<std::mutex>* lock,
                                                           absl::Time deadline) {
  Sequence* seq = FindLocked(id);
  // A prepared step reads the pages past the cut (its rows were appended when it was prepared),
  // and an append writes there: cutting under either would let the next append overwrite rows a
  // launch still reads, or leave an append's rows beyond the length it then sets.
  while (seq != nullptr && seq->pins > 0 && WaitLocked(&unpinned_, lock, deadline)) {
    seq = FindLocked(id);  // it may have been released meanwhile
  }
  return seq;
}

absl::Status SequenceCache::ValidateTruncate(const Sequence& seq, int64_t length,
                                             const std::vector<int>& layers,
                                             std::vector<int>* cut) const {
  if (length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a Truncate keeps a length of 0 or more tokens, got ", length));
  }
  std::vector<bool> seen(size_t(seq.shape.num_layers), false);
  for (int layer : layers) {
    if (layer < 0 || layer >= seq.shape.num_layers || seen[size_t(layer)]) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer,
                                                     " is out of range or given twice (num_layers ",
                                                     seq.shape.num_layers, ")"));
    }
    seen[size_t(layer)] = true;
    cut->push_back(layer);
  }
  if (layers.empty()) {
    for (int layer = 0; layer < seq.shape.num_layers; ++layer) cut->push_back(layer);
  }
  for (int layer : *cut) {
    const int64_t held = seq.lengths[size_t(layer)];
    if (held < length) {
      return absl::AbortedError(absl::StrCat(
          "layer ", layer, " holds ", held, " tokens, fewer than the ", length,
          " a Truncate keeps: the client's count is off; nothing was cut (GetSequenceInfo has the "
          "lengths)"));
    }
  }
  return absl::OkStatus();
}

int64_t SequenceCache::CutLayer(Sequence* seq, int layer, int64_t length,
                                std::vector<int64_t>* freed) {
  const int64_t dropped = seq->lengths[size_t(layer)] - length;
  seq->lengths[size_t(layer)] = length;
  // Pages past the last one a token of `length` uses: also the surplus an append that failed on
  // the device left behind (its pages were taken, its length not moved).
  std::vector<int32_t>& ids = seq->page_ids[size_t(layer)];
  const int64_t tokens = seq->format.page_tokens;
  const size_t keep = size_t((length + tokens - 1) / tokens);
  for (size_t i = keep; i < ids.size(); ++i)
    freed->push_back(int64_t(ids[i]) * seq->format.page_bytes);
  if (ids.size() > keep) ids.resize(keep);
  return dropped;
}

absl::StatusOr<TruncateResult> SequenceCache::Truncate(std::string_view id, int64_t length,
                                                       const std::vector<int>& layers,
                                                       absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  MaybeEvictLocked();
  Sequence* seq = FindUnpinnedLocked(id, &lock, deadline);
  if (seq == nullptr) {
    if (metrics_ != nullptr) metrics_->RecordRefused("not_found");
    return UnknownSequences({std::string(id)});
  }
  if (seq->pins > 0) {
    return absl::DeadlineExceededError(
        "the call's deadline passed while it waited for the steps and appends holding its sequence "
        "to end; nothing was cut");
  }
  std::vector<int> cut;
  if (absl::Status s = ValidateTruncate(*seq, length, layers, &cut); !s.ok()) {
    if (metrics_ != nullptr && s.code() == absl::StatusCode::kAborted)
      metrics_->RecordRefused("length_mismatch");
    return s;
  }
  TruncateResult result;
  std::vector<int64_t> freed;
  for (int layer : cut) result.dropped += CutLayer(seq, layer, length, &freed);
  if (!freed.empty()) {
    store_->Fence();  // rows still deferred by the store must not land on the pages' next owner
    pages_.Free(seq->format.page_bytes, freed);
  }
  seq->last_used = Now();
  result.lengths = seq->lengths;
  if (metrics_ != nullptr) metrics_->RecordTruncated(result.dropped);
  PublishLocked();
  return result;
}

}  // namespace flashserve::kvcache
