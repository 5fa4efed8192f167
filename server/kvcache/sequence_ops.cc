// SequenceCache: append, release, info, eviction and the published statistics.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvcache/sequence_cache_internal.h"

namespace flashserve::kvcache {

absl::StatusOr<std::vector<int64_t>> SequenceCache::Append(std::string_view id,
                                                           const std::vector<LayerRows>& rows) {
  std::lock_guard<std::mutex> lock(mu_);
  MaybeEvictLocked();
  Sequence* seq = FindLocked(id);
  if (seq == nullptr) {
    if (metrics_ != nullptr) metrics_->RecordRefused("not_found");
    return absl::NotFoundError(absl::StrCat("unknown or evicted sequence ", std::string(id)));
  }
  std::vector<bool> seen(size_t(seq->shape.num_layers), false);
  int64_t count = 0;
  for (const LayerRows& r : rows) {
    if (r.layer < 0 || r.layer >= seq->shape.num_layers || seen[size_t(r.layer)]) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", r.layer,
                                                     " is out of range or given twice (num_layers ",
                                                     seq->shape.num_layers, ")"));
    }
    seen[size_t(r.layer)] = true;
    if (absl::Status s = CheckKvRows(seq->shape, r.k, r.v); !s.ok()) return s;
    const int64_t after = seq->lengths[size_t(r.layer)] + r.k.rows;
    if (after > seq->max_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("appending ", r.k.rows, " rows to layer ", r.layer, " would make it ", after,
                       " tokens, past the sequence's limit of ", seq->max_tokens));
    }
    count += PagesToGrow(*seq, r.layer, after);
  }
  std::vector<int64_t> fresh;
  if (absl::Status s = TakePages(seq->format.page_bytes, count, &fresh); !s.ok()) return s;
  for (const LayerRows& r : rows) {
    if (absl::Status s = WriteRows(seq, r.layer, r.k, r.v, &fresh); !s.ok()) {
      pages_.Free(seq->format.page_bytes, fresh);  // a device fault: the pages not reached
      return s;
    }
  }
  seq->last_used = Now();
  PublishLocked();
  return seq->lengths;
}

std::vector<std::string> SequenceCache::Release(const std::vector<std::string>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> not_found;
  int64_t released = 0;
  for (const std::string& id : ids) {
    Sequence* seq = FindLocked(id);
    if (seq == nullptr) {
      not_found.push_back(id);
      continue;
    }
    Remove(seq);
    ++released;
  }
  if (metrics_ != nullptr) metrics_->RecordReleased(released);
  PublishLocked();
  return not_found;
}

absl::StatusOr<SequenceStatus> SequenceCache::Info(std::string_view id) {
  std::lock_guard<std::mutex> lock(mu_);
  MaybeEvictLocked();
  Sequence* seq = FindLocked(id);
  if (seq == nullptr)
    return absl::NotFoundError(absl::StrCat("unknown or evicted sequence ", std::string(id)));
  SequenceStatus status = StatusOf(*seq);
  seq->last_used = Now();
  return status;
}

CacheStats SequenceCache::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats stats;
  stats.sequences = int64_t(table_.size());
  stats.used_bytes = pages_.used_bytes();
  stats.capacity_bytes = pages_.capacity_bytes();
  stats.pages_used = pages_.pages_used();
  stats.evictions = evictions_;
  return stats;
}

int64_t SequenceCache::EvictIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  return EvictIdleLocked();
}

void SequenceCache::MaybeEvictLocked() {
  if (options_.ttl == absl::ZeroDuration()) return;
  if (Now() - last_sweep_ >= std::max(options_.ttl / 8, absl::Milliseconds(10))) EvictIdleLocked();
}

int64_t SequenceCache::EvictIdleLocked() {
  const absl::Time now = Now();
  last_sweep_ = now;
  if (options_.ttl == absl::ZeroDuration()) return 0;
  std::vector<Sequence*> idle;
  for (auto& [id, seq] : table_) {
    if (seq->ready && seq->pins == 0 && now - seq->last_used >= options_.ttl)
      idle.push_back(seq.get());
  }
  for (Sequence* seq : idle) Remove(seq);
  evictions_ += int64_t(idle.size());
  if (metrics_ != nullptr && !idle.empty()) metrics_->RecordEvicted(int64_t(idle.size()));
  PublishLocked();
  return int64_t(idle.size());
}

void SequenceCache::PublishLocked() {
  if (metrics_ == nullptr) return;
  metrics_->SetPool(int64_t(table_.size()), pages_.used_bytes(), pages_.capacity_bytes(),
                    pages_.pages_used());
}

SequenceStatus SequenceCache::StatusOf(const Sequence& seq) const {
  SequenceStatus status;
  status.id = seq.id;
  status.label = seq.label;
  status.shape = seq.shape;
  status.lengths = seq.lengths;
  status.max_tokens = seq.max_tokens;
  status.idle = Now() - seq.last_used;
  status.bytes = seq.page_count() * seq.format.page_bytes;
  return status;
}

}  // namespace flashserve::kvcache
