// SequenceCache::Truncate: layers cut back to their first tokens (speculative decoding drops the
// draft tokens the model rejected), the pages wholly past the cut returned to the pool.
#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "kvcache/sequence_cache_internal.h"

namespace flashserve::kvcache {

absl::Status SequenceCache::FindUnpinnedLocked(const std::vector<TruncateItem>& items,
                                               std::unique_lock<std::mutex>* lock,
                                               absl::Time deadline,
                                               const std::function<bool()>& cancelled,
                                               std::vector<Sequence*>* found) {
  std::vector<std::string_view> ids;
  ids.reserve(items.size());
  for (const TruncateItem& item : items) ids.push_back(item.id);
  // A prepared step reads the pages past the cut (its rows were appended when it was prepared),
  // and an append writes there: cutting under either would let the next append overwrite rows a
  // launch still reads, or leave an append's rows beyond the length it then sets.
  while (true) {
    found->clear();
    if (absl::Status s = FindIds(ids, found); !s.ok()) return s;
    if (std::none_of(found->begin(), found->end(), [](const Sequence* q) { return q->pins > 0; }))
      return absl::OkStatus();
    if (!WaitLocked(&unpinned_, lock, deadline, cancelled)) {
      return GaveUpWaiting(cancelled,
                           "while it waited for the steps and appends holding its sequences to "
                           "end; nothing was cut");
    }
  }
}

absl::Status SequenceCache::CheckTruncateLocked(const std::vector<TruncateItem>& items) {
  std::vector<std::string_view> ids;
  ids.reserve(items.size());
  for (const TruncateItem& item : items) ids.push_back(item.id);
  std::vector<Sequence*> found;
  if (absl::Status s = FindIds(ids, &found); !s.ok()) return s;
  std::unordered_set<const Sequence*> seen;
  std::vector<int> cut;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!seen.insert(found[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("item ", i, ": its sequence is named twice in one Truncate"));
    }
    cut.clear();
    if (absl::Status s = TruncateLayers(*found[i], items[i], i, &cut); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SequenceCache::ValidateTruncate(const Sequence& seq, const TruncateItem& item,
                                             size_t index, std::vector<int>* cut) const {
  if (absl::Status s = TruncateLayers(seq, item, index, cut); !s.ok()) return s;
  for (int layer : *cut) {
    const int64_t held = seq.lengths[size_t(layer)];
    if (held < item.length) {
      return absl::AbortedError(absl::StrCat(
          "item ", index, ": layer ", layer, " holds ", held, " tokens, fewer than the ",
          item.length,
          " a Truncate keeps: the client's count is off; nothing was cut (GetSequenceInfo has the "
          "lengths)"));
    }
  }
  return absl::OkStatus();
}

absl::Status SequenceCache::TruncateLayers(const Sequence& seq, const TruncateItem& item,
                                           size_t index, std::vector<int>* cut) {
  if (item.length < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "item ", index, ": a Truncate keeps a length of 0 or more tokens, got ", item.length));
  }
  std::vector<bool> seen(size_t(seq.shape.num_layers), false);
  for (int layer : item.layers) {
    if (layer < 0 || layer >= seq.shape.num_layers || seen[size_t(layer)]) {
      return absl::InvalidArgumentError(absl::StrCat("item ", index, ": layer ", layer,
                                                     " is out of range or given twice (num_layers ",
                                                     seq.shape.num_layers, ")"));
    }
    seen[size_t(layer)] = true;
    cut->push_back(layer);
  }
  if (item.layers.empty()) {
    for (int layer = 0; layer < seq.shape.num_layers; ++layer) cut->push_back(layer);
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

absl::StatusOr<std::vector<TruncateResult>> SequenceCache::Truncate(
    const std::vector<TruncateItem>& items, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> lock(mu_);
  MaybeEvictLocked();
  if (absl::Status s = CheckTruncateLocked(items); !s.ok()) return s;
  std::vector<Sequence*> found;
  if (absl::Status s = FindUnpinnedLocked(items, &lock, deadline, cancelled, &found); !s.ok())
    return s;
  std::vector<std::vector<int>> cuts(items.size());  // (names checked once: CheckTruncateLocked)
  for (size_t i = 0; i < items.size(); ++i) {
    if (absl::Status s = ValidateTruncate(*found[i], items[i], i, &cuts[i]); !s.ok()) {
      if (metrics_ != nullptr && s.code() == absl::StatusCode::kAborted)
        metrics_->RecordRefused("length_mismatch");
      return s;
    }
  }
  std::vector<TruncateResult> results(items.size());
  std::vector<std::vector<int64_t>> freed(items.size());
  int64_t dropped = 0;
  bool any_freed = false;
  for (size_t i = 0; i < items.size(); ++i) {
    for (int layer : cuts[i])
      results[i].dropped += CutLayer(found[i], layer, items[i].length, &freed[i]);
    found[i]->last_used = Now();
    results[i].lengths = found[i]->lengths;
    dropped += results[i].dropped;
    any_freed |= !freed[i].empty();
  }
  // Rows still deferred must not land on the pages' next owner, nor over the rows written next at
  // the places this cut gave up inside a kept page (one deferred flush applies its writes in no
  // particular order). Pages may be freed with no token dropped: the surplus of an append that
  // failed on the device holds the rows it wrote before the fault.
  if (dropped > 0 || any_freed) store_->Fence();
  for (size_t i = 0; i < items.size(); ++i) {
    if (!freed[i].empty()) pages_.Free(found[i]->format.page_bytes, freed[i]);
  }
  if (metrics_ != nullptr) metrics_->RecordTruncated(dropped);
  PublishLocked();
  return results;
}

}  // namespace flashserve::kvcache
